"""Ranks whose scalers differ, or that stop calling them, end with the scaler's error.

* The loss scale and the policy ride in the one agreement all-reduce: a rank that restored a
  torch-format checkpoint the others did not (pytorch#136009: the step counts agree, the scales
  do not) or was built with other arguments (``init_scale``, ``growth_interval``,
  ``hysteresis``, ``guard()``) makes every rank skip the step and raise, naming what differs,
  before any parameter changes.
* A rank that stops calling the scaler (out of data, without ``Join``) or makes one more call:
  its peers' all-reduce fails within the process group's timeout with an error naming the call,
  the likely causes and the fix, instead of a bare gloo timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from shardscale import ShardedGradScaler

TIMEOUT_S = 3.0


def _group():
    return dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))


def _attempt(fn) -> dict:
    t0 = time.perf_counter()
    try:
        return {"error": None, "value": fn(), "elapsed": time.perf_counter() - t0}
    except RuntimeError as e:
        return {"error": str(e), "elapsed": time.perf_counter() - t0}


def _train(scaler, fused: bool, steps: int, group) -> dict:
    """``steps`` iterations of a DDP model; the parameters before and after."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    before = [p.detach().clone() for p in model.parameters()]

    def run():
        for _ in range(steps):
            opt.zero_grad()
            scaler.scale(model(torch.ones(3, 4)).sum()).backward()
            scaler.step(opt)
            scaler.update()

    out = _attempt(run)
    out["unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )
    out["scale"] = scaler.get_scale()
    return out


def _differ(rank: int, world_size: int) -> dict:
    out = {}
    # pytorch#136009: rank 0 restores a torch.amp.GradScaler checkpoint, rank 1 does not
    g = _group()
    scaler = ShardedGradScaler("cpu", process_group=g)
    if rank == 0:
        torch_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.load_state_dict(torch_scaler.state_dict())
    out["checkpoint"] = _train(scaler, False, 2, g)
    # per-rank configuration typos, non-fused and fused
    cases = {
        "init_scale": ({"init_scale": 2.0**16}, {"init_scale": 2.0**8}),
        "growth_interval": ({"growth_interval": 2000}, {"growth_interval": 100}),
        "hysteresis": ({}, {"hysteresis": 2}),
        "policy": ({}, {"policy": "headroom"}),
    }
    for name, kwargs in cases.items():
        for fused in (False, True):
            g = _group()
            scaler = ShardedGradScaler("cpu", process_group=g, **kwargs[rank])
            out[f"{name}-{fused}"] = _train(scaler, fused, 20, g)
    g = _group()
    if rank == 1:
        scaler = ShardedGradScaler.guard(g)
    else:
        scaler = ShardedGradScaler("cpu", process_group=g)
    out["guard"] = _train(scaler, False, 2, g)
    # the same arguments on both ranks: no error, the same parameters
    g = _group()
    out["same"] = _train(ShardedGradScaler("cpu", process_group=g), True, 3, g)
    return out


@pytest.mark.dist
def test_ranks_with_different_scales_or_policies_raise_before_any_parameter_changes(tmp_path):
    r0, r1 = run_ranks(_differ, tmp_path)
    expected = {
        "checkpoint": "loss scale 1024..65536",
        "init_scale-False": "loss scale 256..65536",
        "init_scale-True": "loss scale 256..65536",
        "growth_interval-False": "growth_interval 100..2000",
        "growth_interval-True": "growth_interval 100..2000",
        "hysteresis-False": "hysteresis 1..2",
        "hysteresis-True": "hysteresis 1..2",
        "policy-False": "policy 'torch'..'headroom'",
        "policy-True": "policy 'torch'..'headroom'",
        "guard": "dynamic False..True",
    }
    for name, what in expected.items():
        for res in (r0[name], r1[name]):
            assert res["error"] is not None, (name, res)
            assert "scalers differ" in res["error"] and what in res["error"], (name, res)
            assert "same arguments" in res["error"], (name, res)
            assert res["unchanged"], (name, res)  # every step skipped until the error
            assert res["elapsed"] < TIMEOUT_S, (name, res)  # detected, not timed out
    assert "loss scale 1..65536" in r0["guard"]["error"]
    assert r0["same"]["error"] is None and r1["same"]["error"] is None
    assert not r0["same"]["unchanged"] and r0["same"]["scale"] == r1["same"]["scale"]


def _stops(rank: int, world_size: int) -> dict:
    out = {}
    # rank 1 runs out of data after one iteration, without Join
    g = _group()
    scaler = ShardedGradScaler("cpu", process_group=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def uneven():
        for _ in range(2 if rank == 0 else 1):
            opt.zero_grad()
            scaler.scale(model(torch.ones(3, 4)).sum()).backward()
            scaler.step(opt)
            scaler.update()

    out["uneven"] = _attempt(uneven)
    dist.barrier()  # both ranks past the timeout
    # rank 1 calls clip_grad_norm_ once more than rank 0
    g = _group()
    scaler = ShardedGradScaler("cpu", process_group=g)

    def extra_clip():
        opt.zero_grad()
        scaler.scale(model(torch.ones(3, 4)).sum()).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        if rank == 1:  # a second clip: one more all-reduce, of the norm
            scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    out["extra_clip"] = _attempt(extra_clip)
    dist.barrier()
    # under DDP, rank 1 steps one optimizer more: its agreement meets DDP's next bucket
    g = _group()
    scaler = ShardedGradScaler("cpu", process_group=g)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), process_group=g)
    extra = torch.nn.Linear(4, 2)
    opts = [torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(extra.parameters(), lr=0.1)]

    def one_more_step():
        for _ in range(2):
            loss = ddp(torch.ones(3, 4)).sum() + extra(torch.ones(3, 4)).sum()
            scaler.scale(loss).backward()
            for o in opts if rank == 1 else opts[:1]:
                scaler.step(o)
            scaler.update()

    out["one_more_step"] = _attempt(one_more_step)
    return out


@pytest.mark.dist
def test_a_rank_that_stops_calling_the_scaler_gets_the_scalers_error(tmp_path):
    r0, r1 = run_ranks(_stops, tmp_path)
    a = r0["uneven"]
    assert r1["uneven"]["error"] is None
    assert a["error"] is not None and "the all-reduce of step() (at update 1)" in a["error"], a
    assert "Join([model, scaler])" in a["error"] and "ran out of data" in a["error"], a
    assert a["elapsed"] < TIMEOUT_S + 10.0, a
    # one clip more: the rank that waits for the missing call names its own call
    waiting = [r["extra_clip"]["error"] or "" for r in (r0, r1)]
    assert any("the all-reduce of clip_grad_norm_()" in w for w in waiting), waiting
    # one step more under DDP: both ranks raise within the timeout (no abort, no hang), the
    # scaler's error on the rank whose agreement met DDP's collective or waited for it
    a, b = r0["one_more_step"], r1["one_more_step"]
    assert a["error"] is not None and b["error"] is not None, (a, b)
    assert any("the all-reduce of step()" in r["error"] for r in (a, b)), (a, b)
    assert max(a["elapsed"], b["elapsed"]) < TIMEOUT_S + 10.0, (a, b)
