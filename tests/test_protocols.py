"""torch's protocols around a scaler: Join (uneven inputs), torch.distributed.checkpoint
(checkpoints moving between torch's scalers and shardscale), reports that stay local."""

from __future__ import annotations

import math

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


def _uneven_calls(rank: int, world_size: int, mode: str, fused: bool) -> dict:
    """As :func:`_uneven`, with the scaler calls of ``mode`` in every iteration: the rank that
    joined repeats them (the clip's norm all-reduce, the report gathers) without gradients."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from shardscale import ScaleCollapseError

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    kwargs = {"report_overflows": True, "param_names": model} if mode == "report" else {}
    if mode == "collapse":
        kwargs = {"max_consecutive_skips": 2}
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=2, **kwargs)
    batches = (24 if mode == "collapse" else 6) if rank == 0 else 3
    poisoned = range(3, 24) if mode == "collapse" else (4,)
    out: dict = {"scales": [], "norms": [], "reports": []}
    joinables = [scaler, model] if mode == "scaler_first" else [model, scaler]
    try:
        with Join(joinables):
            for i in range(batches):
                opt.zero_grad()
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i))
                inf = rank == 0 and i in poisoned
                loss = model(x).pow(2).mean() * (INF if inf else 1.0)
                scaler.scale(loss).backward()
                if mode in ("clip", "unscale_clip", "clip_params"):
                    if mode == "unscale_clip":
                        scaler.unscale_(opt)
                    target = model.parameters() if mode == "clip_params" else opt
                    out["norms"].append(scaler.clip_grad_norm_(target, 0.1).item())
                scaler.step(opt)
                scaler.update()
                if mode == "report":
                    report = scaler.overflow_report(all_ranks=True)
                    out["reports"].append(report and (report.names, report.ranks))
                out["scales"].append(scaler.get_scale())
    except (ScaleCollapseError, RuntimeError) as err:
        out["error"] = (type(err).__name__, getattr(err, "step", None), str(err)[:200])
    out["final"] = scaler.get_scale()
    out["metrics"] = scaler.metrics()
    out["weight"] = model.module.weight.detach().clone()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", ["clip", "unscale_clip", "clip_params", "report"])
def test_join_repeats_clips_and_reports_of_the_others(tmp_path, mode, fused):
    r0, r1 = run_ranks(_uneven_calls, tmp_path, mode, fused, timeout=20)
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["scales"] == [2.0**8, 2.0**9, 2.0**9, 2.0**10, 2.0**9, 2.0**9]
    assert r0["final"] == r1["final"] == 2.0**9
    assert r0["metrics"] == r1["metrics"]
    assert r0["metrics"]["skipped_steps"] == 1
    assert torch.equal(r0["weight"], r1["weight"])  # DDP's join hook syncs the model
    if mode != "report":
        norms = r0["norms"]
        assert len(norms) == 6 and not math.isfinite(norms[4])
        assert all(math.isfinite(n) and n > 0 for k, n in enumerate(norms) if k != 4)
    else:
        weight = "module.weight"
        assert r0["reports"][4] is not None and weight in r0["reports"][4][0]
        assert r0["reports"][4][1] == [0]
        assert [r for k, r in enumerate(r0["reports"]) if k != 4] == [None] * 5


@pytest.mark.dist
@pytest.mark.parametrize("fused", [False, True])
def test_join_a_collapse_raises_on_the_joined_rank_too(tmp_path, fused):
    """Rank 0 overflows at every batch from its 4th on, after rank 1 joined: both ranks raise
    ScaleCollapseError from the same update (the fused one after 16 updates: the poll)."""
    r0, r1 = run_ranks(_uneven_calls, tmp_path, "collapse", fused, timeout=20)
    assert r0["error"][0] == r1["error"][0] == "ScaleCollapseError"
    assert r0["error"][1] == r1["error"][1]
    assert r0["metrics"] == r1["metrics"]


@pytest.mark.dist
def test_join_with_the_scaler_first_raises_on_every_rank(tmp_path):
    r0, r1 = run_ranks(_uneven_calls, tmp_path, "scaler_first", False, timeout=20)
    for r in (r0, r1):
        assert r["error"][0] == "RuntimeError" and "list the model before it" in r["error"][2]
        assert r["scales"] == []


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


def _run(scaler, steps: int, poison_at: tuple[int, ...] = (2,)) -> tuple[list, list]:
    """A few fp32 SGD steps (gradients overflowing at ``poison_at``) from a fixed start: the
    scales seen after each update and the final weights."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for i in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(3, 4)).pow(2).mean() * (INF if i in poison_at else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


def _same(a: tuple[list, list], b: tuple[list, list]) -> None:
    assert a[0] == b[0]
    for p, q in zip(a[1], b[1], strict=True):
        assert torch.equal(p, q)


def _trained(cls) -> torch.amp.GradScaler:
    scaler = cls("cpu", init_scale=2.0**10, growth_interval=2)
    _run(scaler, 5)  # scale 1024 -> 2048 -> 1024 (overflow) -> 1024 -> 2048, tracker 0
    return scaler


def _torch_fsdp_scaler(*args, **kwargs):
    """torch's FSDP scaler with the state :func:`_trained` leaves (it cannot step without a
    process group): scale 2048, growth tracker 0."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    scaler = TorchSharded("cpu", init_scale=2.0**10, growth_interval=2)
    scaler.load_state_dict(_trained(torch.amp.GradScaler).state_dict())
    return scaler


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("source", ["amp", "fsdp"])
@pytest.mark.parametrize("how", ["planner", "through_torch_scaler", "state_dict"])
def test_a_torch_scaler_checkpoint_resumes_in_shardscale(how, source, tmp_path):
    """A run checkpointed with torch.amp.GradScaler (or torch's FSDP scaler) goes on with
    ShardedGradScaler exactly as it would have with torch's: same scale sequence, same weights;
    shardscale's keys take the constructor's policy, a full hysteresis tracker, counters 0."""
    import torch.distributed.checkpoint as dcp

    from shardscale.checkpoint import ScalerLoadPlanner

    src = _trained(torch.amp.GradScaler) if source == "amp" else _torch_fsdp_scaler()
    cid = str(tmp_path / "torch")
    model = torch.nn.Linear(2, 2)
    dcp.save({"model": model.state_dict(), "scaler": src}, checkpoint_id=cid, no_dist=True)
    new = ShardedGradScaler("cpu", hysteresis=2, max_consecutive_skips=7)
    target = {"model": torch.nn.Linear(2, 2).state_dict(), "scaler": new}
    if how == "planner":
        dcp.load(target, checkpoint_id=cid, no_dist=True, planner=ScalerLoadPlanner())
        assert torch.equal(target["model"]["weight"], model.weight)
    elif how == "through_torch_scaler":
        holder = torch.amp.GradScaler("cpu")
        dcp.load({"scaler": holder}, checkpoint_id=cid, no_dist=True)  # strict
        new.load_state_dict(holder.state_dict())
    else:
        new.load_state_dict(src.state_dict())
    sd = new.state_dict()
    assert sd["scale"] == src.state_dict()["scale"] == 2048.0
    assert (sd["growth_interval"], sd["hysteresis"], sd["max_consecutive_skips"]) == (2, 2, 7)
    assert sd["_hysteresis_tracker"] == 2 and sd["_counters"]["steps"] == 0
    plain = ShardedGradScaler("cpu", hysteresis=2, max_consecutive_skips=7)
    plain.load_state_dict(src.state_dict())
    assert sd == plain.state_dict()
    # the same state with torch's policy (hysteresis 1) goes on exactly as torch's scaler
    new_h1 = ShardedGradScaler("cpu")
    new_h1.load_state_dict(sd | {"hysteresis": 1, "_hysteresis_tracker": 1})
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(src.state_dict())
    _same(_run(new_h1, 6, poison_at=(1, 4)), _run(torch_scaler, 6, poison_at=(1, 4)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_planner_is_strict_for_every_other_key(tmp_path):
    """A strict load stops at shardscale's first key (DCP's message names it); with the planner
    a key missing elsewhere (here the model's bias) still raises; nothing changes either way."""
    import torch.distributed.checkpoint as dcp

    from shardscale.checkpoint import ScalerLoadPlanner

    cid = str(tmp_path / "torch")
    model = torch.nn.Linear(2, 2)
    weight_only = {"weight": model.weight.detach()}
    dcp.save(
        {"model": weight_only, "scaler": _trained(torch.amp.GradScaler)},
        checkpoint_id=cid,
        no_dist=True,
    )
    new = ShardedGradScaler("cpu")
    before = new.state_dict()
    with pytest.raises(BaseException, match="scaler.min_scale"):  # DCP's CheckpointException
        dcp.load({"scaler": new}, checkpoint_id=cid, no_dist=True)
    target = {"model": torch.nn.Linear(2, 2).state_dict(), "scaler": new}
    with pytest.raises(BaseException, match="model.bias"):
        dcp.load(target, checkpoint_id=cid, no_dist=True, planner=ScalerLoadPlanner())
    assert new.state_dict() == before


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_planner_loads_a_shardscale_checkpoint_in_full(tmp_path):
    import torch.distributed.checkpoint as dcp

    from shardscale.checkpoint import ScalerLoadPlanner

    src = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2, hysteresis=3)
    _run(src, 5)
    cid = str(tmp_path / "shardscale")
    dcp.save({"scaler": src}, checkpoint_id=cid, no_dist=True)
    new = ShardedGradScaler("cpu")
    dcp.load({"scaler": new}, checkpoint_id=cid, no_dist=True, planner=ScalerLoadPlanner())
    assert new.state_dict() == src.state_dict()
    assert new.state_dict()["_counters"]["steps"] == 5


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("how", ["dcp", "state_dict"])
def test_a_shardscale_checkpoint_resumes_in_torch_grad_scaler(how, tmp_path):
    """The way back: torch's scaler reads its own keys of shardscale's checkpoint (strict DCP
    load too) and goes on exactly as shardscale would with torch's defaults."""
    import torch.distributed.checkpoint as dcp

    src = _trained(ShardedGradScaler)
    new = torch.amp.GradScaler("cpu")
    if how == "dcp":
        cid = str(tmp_path / "shardscale")
        dcp.save({"scaler": src}, checkpoint_id=cid, no_dist=True)
        dcp.load({"scaler": new}, checkpoint_id=cid, no_dist=True)
    else:
        new.load_state_dict(src.state_dict())
    assert new.state_dict() == {k: src.state_dict()[k] for k in new.state_dict()}
    _same(_run(new, 6, poison_at=(1, 4)), _run(src, 6, poison_at=(1, 4)))
