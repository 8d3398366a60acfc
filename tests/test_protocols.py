"""torch's protocols around a scaler: Join (uneven inputs), torch.distributed.checkpoint
(checkpoints moving between torch's scalers and shardscale), reports that stay local."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

from shardscale import ShardedGradScaler

INF = float("inf")


def _uneven(rank: int, world_size: int, fused: bool) -> dict:
    """Rank 0 has 6 batches, rank 1 has 3; rank 0's gradient overflows at its batch 4, after
    rank 1 joined: rank 1 still takes part in that skip decision and applies the backoff."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    batches = 6 if rank == 0 else 3
    scales = []
    with Join([model, scaler]):
        for i in range(batches):
            opt.zero_grad()
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i))
            loss = model(x).pow(2).mean() * (INF if (rank == 0 and i == 4) else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    return {"scales": scales, "final": scaler.get_scale(), "metrics": scaler.metrics()}


@pytest.mark.dist
@pytest.mark.parametrize("fused", [False, True])
def test_join_with_uneven_inputs_trains_to_the_end_and_agrees(tmp_path, fused):
    r0, r1 = run_ranks(_uneven, tmp_path, fused, timeout=30)
    # growth every 2 clean iterations from 2**8; iteration 4 (rank 0's inf) backs off on both
    assert r0["scales"] == [2.0**8, 2.0**9, 2.0**9, 2.0**10, 2.0**9, 2.0**9]
    assert r1["scales"] == r0["scales"][:3]
    assert r0["final"] == r1["final"] == 2.0**9  # rank 1 followed after joining
    assert r0["metrics"]["skipped_steps"] == r1["metrics"]["skipped_steps"] == 1


def _one_rank_reports(rank: int, world_size: int) -> dict:
    """Rank 1 alone asks for the report (as rank-0-only logging code does): it returns this
    rank's entries at once, no collective; with all_ranks=True every rank must call it."""
    import time

    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = ShardedGradScaler("cpu", param_names={"w": w})
    scaler.scale(w.sum()).backward()
    if rank == 1:
        w.grad[0] = INF
    scaler.step(opt)
    scaler.update()
    out = {}
    if rank == 1:
        t0 = time.perf_counter()
        local = scaler.overflow_report()
        out["local"] = (local.names, local.ranks, time.perf_counter() - t0)
    everyone = scaler.overflow_report(all_ranks=True)
    out["all"] = (everyone.names, everyone.ranks)
    return out


@pytest.mark.dist
def test_a_report_asked_on_one_rank_is_local_and_returns_at_once(tmp_path):
    r0, r1 = run_ranks(_one_rank_reports, tmp_path, timeout=10)
    names, ranks, elapsed = r1["local"]
    assert names == ["w"] and ranks == [1] and elapsed < 5.0
    assert r0["all"] == r1["all"] == (["w"], [1])
