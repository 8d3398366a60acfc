"""FSDP2 x tensor parallelism on a 2 x 2 (dp x tp) mesh, 4 gloo ranks (torchtitan's 2-D
layout): whatever process group the scaler is given (the dp mesh, the tp mesh, the whole mesh,
or None), the ranks holding pieces of one weight take the same skip decision, in one all-reduce
per step (fairseq2 PR #1374, apex PR #1220: with the dp group alone, rank 0 skipped while its tp
partner stepped)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

from shardscale import ShardedGradScaler

CHOICES = ("dp", "tp", "mesh", "none")


def _tp_run(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    out = {}
    for choice in CHOICES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        model = parallelize_module(model, mesh["tp"], plan)
        model = fully_shard(model, mesh=mesh["dp"])  # parameters: DTensors on the 2-D mesh
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        group = {"dp": mesh["dp"], "tp": mesh["tp"], "mesh": mesh, "none": None}[choice]
        scaler = ShardedGradScaler("cpu", init_scale=16.0, process_group=group)
        skipped, scales, comms = [], [], []
        for i in range(3):
            opt.zero_grad()
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * i + dp_rank))
            scaler.scale(model(x).pow(2).sum()).backward()
            if i == 1 and rank == 0:  # one tp shard of one replica overflows
                next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
            with CommDebugMode() as comm:
                scaler.step(opt)
            comms.append(comm.get_total_counts())
            scaler.update()
            skipped.append(bool(scaler.last_step_skipped(opt)))
            scales.append(scaler.get_scale())
        full = [p.full_tensor().tolist() for p in model.parameters()]
        out[choice] = {"skipped": skipped, "scales": scales, "comms": comms, "params": full}
    return out


@pytest.mark.dist
def test_every_group_choice_agrees_over_the_tensor_parallel_pieces(tmp_path):
    results = run_ranks(_tp_run, tmp_path, world_size=4, timeout=60)
    for choice in CHOICES:
        runs = [r[choice] for r in results]
        for run in runs:
            assert run["skipped"] == [False, True, False], (choice, run["skipped"])
            assert run["scales"] == [16.0, 8.0, 8.0], (choice, run["scales"])
            assert run["comms"] == [1, 1, 1], (choice, run["comms"])  # one all-reduce a step
        assert all(run["params"] == runs[0]["params"] for run in runs), choice
