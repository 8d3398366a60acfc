"""A rank that calls the scaler differently from the others fails fast with a clear error.

One 2-rank launch runs five scenarios, each on its own process group created with
``dist.new_group(timeout=TIMEOUT)`` (so one scenario's timed-out collective does not poison the
next; the default group keeps ``tests/_dist.py``'s 30 s):

1. rank 1 never calls ``step``: its ``update()`` raises at once ("no optimizer was stepped")
   after telling the others through the all-reduce they wait in: rank 0 raises at once too,
   naming rank 1 and its error (no collective timeout).
2. rank 1 steps one optimizer of two: the scaler's step-agreement check (``[found_inf, step,
   -step]`` in its one MAX all-reduce) sees rank 0 at step 0 and rank 1 at step 1 and both ranks
   raise "out of step" at once (without the check the flags would pair silently).
3. rank 1 restored another checkpoint (its scaler is 5 steps ahead): both ranks raise
   "out of step" on the first step.
4. rank 1 never calls ``unscale_`` while rank 0 does (an inf injected on rank 1): not an error,
   both issue one all-reduce per optimizer; the ranks agree on the skip and the parameters.
5. the ranks pass different process groups to the scaler: both all-reduces time out and raise.
6. the ranks step two optimizers in opposite orders: not detected (as with torch's scalers): the
   flags pair by the order of the checks; documented in RELIABILITY.md.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from shardscale import ShardedGradScaler

TIMEOUT_S = 3.0


def _setup(group, n_opts: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    models = [torch.nn.Linear(3, 2) for _ in range(n_opts)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scaler = ShardedGradScaler("cpu", init_scale=256.0, process_group=group)
    return models, opts, scaler


def _backward(models, scaler, bad: bool = False) -> None:
    loss = sum(m(torch.ones(2, 3)).sum() for m in models)
    if bad:
        loss = loss * float("inf")
    scaler.scale(loss).backward()


def _attempt(fn) -> dict:
    t0 = time.perf_counter()
    try:
        value = fn()
        return {"error": None, "value": value, "elapsed": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {
            "error": type(e).__name__,
            "runtime_error": isinstance(e, RuntimeError),
            "message": str(e),
            "elapsed": time.perf_counter() - t0,
        }


def _group():
    return dist.new_group([0, 1], timeout=timedelta(seconds=TIMEOUT_S))


def _scenarios(rank: int, world_size: int) -> dict:
    out = {}

    # 1. rank 1 never calls step() (in its second iteration)
    g = _group()
    models, opts, scaler = _setup(g)
    _backward(models, scaler)

    def never_steps():
        scaler.step(opts[0])  # one clean iteration first: the first agreement is read anyway
        scaler.update()
        opts[0].zero_grad()
        _backward(models, scaler)
        if rank == 0:
            scaler.step(opts[0])
        scaler.update()

    out["never_steps"] = {**_attempt(never_steps), "metrics": scaler.metrics()}

    # 2. rank 1 steps only the first of two optimizers
    g = _group()
    models, opts, scaler = _setup(g, n_opts=2)

    def fewer_optimizers():
        for _ in range(3):
            for o in opts:
                o.zero_grad()
            _backward(models, scaler)
            for o in opts if rank == 0 else opts[:1]:
                scaler.step(o)
            scaler.update()

    out["fewer_optimizers"] = _attempt(fewer_optimizers)

    # 3. rank 1 restored a checkpoint 5 steps ahead
    g = _group()
    models, opts, scaler = _setup(g)
    if rank == 1:
        sd = scaler.state_dict()
        sd["_counters"] = {**sd["_counters"], "steps": 5}
        scaler.load_state_dict(sd)

    def other_checkpoint():
        _backward(models, scaler)
        scaler.step(opts[0])
        scaler.update()

    out["other_checkpoint"] = _attempt(other_checkpoint)

    # 4. rank 1 never calls unscale_ (allowed): agreement holds
    g = _group()
    models, opts, scaler = _setup(g)

    def skips_unscale():
        skipped = []
        for it in range(3):
            opts[0].zero_grad()
            _backward(models, scaler, bad=(rank == 1 and it == 1))
            if rank == 0:
                scaler.unscale_(opts[0])
            scaler.step(opts[0])
            scaler.update()
            skipped.append(bool(scaler.last_step_skipped(opts[0])))
        params = [p.detach().clone() for p in models[0].parameters()]
        return {"skipped": skipped, "scale": scaler.get_scale(), "params": params}

    out["skips_unscale"] = _attempt(skips_unscale)

    # 5. the ranks give the scaler different process groups
    groups = [_group(), _group()]
    models, opts, scaler = _setup(groups[rank])

    def different_groups():
        _backward(models, scaler)
        scaler.step(opts[0])
        scaler.update()

    out["different_groups"] = _attempt(different_groups)

    # 6. the ranks step two optimizers (2 and 4 parameters) in different orders
    g = _group()
    torch.manual_seed(0)
    a_mod, b_mod = (
        torch.nn.Linear(3, 2),
        torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)),
    )
    opt_a = torch.optim.SGD(a_mod.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b_mod.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=256.0, process_group=g)

    def swapped_order():
        loss = a_mod(torch.ones(2, 3)).sum() + b_mod(torch.ones(2, 3)).sum()
        scaler.scale(loss).backward()
        for o in (opt_a, opt_b) if rank == 0 else (opt_b, opt_a):
            scaler.step(o)
        scaler.update()

    out["swapped_order"] = _attempt(swapped_order)

    # 7. rank 1 calls update() twice while rank 0 is in no scaler call (under DDP/FSDP: in a
    # gradient collective): rank 1 logs its error first, and raises it when its all-reduce fails
    g = _group()
    models, opts, scaler = _setup(g)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardscale").addHandler(handler)

    def update_twice_alone():
        _backward(models, scaler)
        scaler.step(opts[0])
        scaler.update()
        if rank == 1:
            scaler.update()

    out["update_twice_alone"] = {**_attempt(update_twice_alone), "logged": records}
    logging.getLogger("shardscale").removeHandler(handler)
    return out


@pytest.mark.dist
def test_mismatched_ranks_fail_fast_with_clear_errors(tmp_path):
    r0, r1 = run_ranks(_scenarios, tmp_path)
    limit = TIMEOUT_S + 10.0  # generous: CI machines are slow, a hang would be 30 s+

    # 1. never steps: rank 1 fails at once and tells rank 0, which fails at once naming it
    a, b = r0["never_steps"], r1["never_steps"]
    assert b["error"] == "RuntimeError" and "no optimizer was stepped" in b["message"]
    assert a["error"] == "RuntimeError", a
    assert "rank 1 called update() with no optimizer stepped" in a["message"], a
    assert a["elapsed"] < TIMEOUT_S and b["elapsed"] < TIMEOUT_S, (a, b)
    # rank 0's skipped step read the poisoned flag and raised there, before its update() could
    # back the scale off for an overflow that never happened: both scalers stay as they were
    assert a["metrics"] == b["metrics"], (a["metrics"], b["metrics"])
    assert a["metrics"]["steps"] == 1 and a["metrics"]["overflows"] == 0, a["metrics"]

    # 2./3. out of step: detected by the scaler on both ranks, naming each rank's step
    for name, steps in (("fewer_optimizers", (0, 1)), ("other_checkpoint", (0, 5))):
        for rank, res in enumerate((r0[name], r1[name])):
            assert res["error"] == "RuntimeError", (name, res)
            assert "out of step" in res["message"], (name, res)
            assert f"(rank {rank}) is at step {steps[rank]}" in res["message"], (name, res)
            assert f"range over steps {steps[0]}..{steps[1]}" in res["message"], (name, res)
            assert res["elapsed"] < TIMEOUT_S, (name, res)  # detected, not timed out

    # 4. skipping unscale_ on one rank is fine: same decisions, same parameters
    a, b = r0["skips_unscale"], r1["skips_unscale"]
    assert a["error"] is None and b["error"] is None, (a, b)
    assert a["value"]["skipped"] == b["value"]["skipped"] == [False, True, False]
    assert a["value"]["scale"] == b["value"]["scale"] == 128.0
    for p, q in zip(a["value"]["params"], b["value"]["params"], strict=True):
        assert torch.equal(p, q)

    # 6. optimizers stepped in different orders: not detected (a documented limit, as torch)
    assert r0["swapped_order"]["error"] is None and r1["swapped_order"]["error"] is None

    # 5. different process groups: both collectives time out with an error
    for res in (r0["different_groups"], r1["different_groups"]):
        assert res["runtime_error"], res
        assert TIMEOUT_S - 0.5 <= res["elapsed"] < limit, res

    # 7. the call-order error alone: logged at once, then raised from the all-reduce's failure
    a, b = r0["update_twice_alone"], r1["update_twice_alone"]
    assert a["error"] is None and not a["logged"], a
    assert b["error"] == "RuntimeError" and "no optimizer was stepped" in b["message"], b
    assert len(b["logged"]) == 1 and b["logged"][0].startswith("rank 1: update() was called"), b
