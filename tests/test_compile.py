"""torch.compile: scale() and update() compile with fullgraph=True, a whole train step compiles
on one process and on 2-rank FSDP2 with eager's results, and its graph breaks are torch's own
(backward, the optimizer's step) plus the one part kept eager on purpose (the host read that
decides a non-fused step), never more than with torch.amp.GradScaler.

Whole steps use the ``aot_eager`` backend: the same graphs as inductor without its fused
kernels, so parameters compare bit for bit with eager.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch._dynamo
from _dist import run_ranks

from shardscale import ShardedGradScaler

INF = float("inf")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _state(s: ShardedGradScaler) -> dict:
    return {k: v for k, v in s.metrics().items()}


def test_scale_and_update_compile_fullgraph_with_eager_results():
    """12 iterations across growths and two overflows: scale() and update() compiled with
    fullgraph=True (no graph break allowed) give the eager twin's scale, trackers, counters."""
    runs = []
    for compiled in (False, True):
        s = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=3, hysteresis=2)
        scale = torch.compile(s.scale, fullgraph=True) if compiled else s.scale
        update = torch.compile(s.update, fullgraph=True) if compiled else s.update
        w = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([w], lr=0.01)
        seen = []
        for i in range(12):
            opt.zero_grad()
            out = scale(w.sum() * (INF if i in (4, 5, 9) else 1.0))
            out.backward()
            seen.append(out.detach())
            s.step(opt)
            update()
            seen.append(_state(s))
        runs.append((seen, w.detach().clone()))
    (eager, w_e), (comp, w_c) = runs
    assert eager == comp or all(
        (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
        for a, b in zip(eager, comp, strict=True)
    )
    assert torch.equal(w_e, w_c)
    assert comp[-1]["skipped_steps"] == 3 and comp[-1]["backoffs"] == 1


class _Breaks(logging.Handler):
    """Collects dynamo's graph-break records: (file:line, reason)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        where = re.search(r"Graph break.* in user code at (\S+)", msg)
        if where:
            reason = msg.split("Graph Break Reason:", 1)[-1].strip()
            self.seen.append((where.group(1), reason))


def _graph_breaks(fn) -> list[tuple[str, str]]:
    handler = _Breaks()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(graph_breaks=True)
    logger.addHandler(handler)
    try:
        fn()
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    return handler.seen


def _train(scaler, fused: bool, compiled: bool, steps: int = 8, rank: int = 0, fsdp=None):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if fsdp is not None:
        fsdp(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.01, fused=fused)

    def step(x, factor):
        opt.zero_grad()
        loss = m(x).pow(2).mean() * factor
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    run = torch.compile(step, backend="aot_eager") if compiled else step
    for i in range(steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2 * i + rank))
        run(x, torch.tensor(INF if i == 3 and rank == 0 else 1.0))  # rank 0 alone overflows
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in m.parameters()]
    skipped = scaler.metrics()["skipped_steps"] if hasattr(scaler, "metrics") else None
    return [p.detach().clone() for p in params], scaler.get_scale(), skipped


@pytest.mark.parametrize("fused", [False, True])
def test_a_compiled_train_step_ends_as_eager_across_an_overflow(fused):
    eager = _train(ShardedGradScaler("cpu", growth_interval=2), fused, compiled=False)
    comp = _train(ShardedGradScaler("cpu", growth_interval=2), fused, compiled=True)
    torch_eager = _train(torch.amp.GradScaler("cpu", growth_interval=2), fused, compiled=False)
    for a, b, c in zip(eager[0], comp[0], torch_eager[0], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert eager[1] == comp[1] == torch_eager[1] == 2.0**18  # 8 steps, 1 skipped: 3 growths
    assert comp[2] == 1


def _shardscale_file(path: str) -> bool:
    return "/shardscale/" in path and "/tests/" not in path


@pytest.mark.parametrize("fused", [False, True])
def test_graph_breaks_are_torchs_own_and_no_more_than_with_torchs_scaler(fused):
    ours = _graph_breaks(
        lambda: _train(ShardedGradScaler("cpu", growth_interval=2), fused, True, steps=3)
    )
    torch._dynamo.reset()
    theirs = _graph_breaks(
        lambda: _train(torch.amp.GradScaler("cpu", growth_interval=2), fused, True, steps=3)
    )
    assert len(ours) <= len(theirs), (ours, theirs)
    mine = [(where, why) for where, why in ours if _shardscale_file(where)]
    # the parts kept eager on purpose: the host read that decides a non-fused step, the call
    # of a fused optimizer's step (which breaks the graph by itself)
    assert all("torch.compiler.disable" in why for _, why in mine), mine
    assert len(mine) <= 2, mine


def _fsdp2_compiled(rank: int, world_size: int, fused: bool) -> list:
    from torch.distributed.fsdp import fully_shard

    def shard(m):
        fully_shard(m[0])
        fully_shard(m[2])
        fully_shard(m)

    out = []
    for compiled in (False, True):
        torch._dynamo.reset()
        s = ShardedGradScaler("cpu", growth_interval=2)
        params, scale, skipped = _train(s, fused, compiled, rank=rank, fsdp=shard)
        out.append(([p.tolist() for p in params], scale, skipped))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("fused", [False, True])
def test_a_compiled_fsdp2_step_on_two_ranks_ends_as_eager(tmp_path, fused):
    """Rank 0 injects an inf at step 3: both ranks skip it, eager and compiled agree bit for
    bit, and the ranks hold the same parameters."""
    results = run_ranks(_fsdp2_compiled, tmp_path, fused, timeout=120)
    for eager, comp in results:
        assert eager == comp
        assert comp[2] == 1 and comp[1] == 2.0**18
    assert results[0] == results[1]


@pytest.mark.parametrize("fused", [False, True])
def test_a_compiled_loop_still_raises_the_collapse(fused):
    """A fully compiled step has no eager update(): the eager parts of step() read the alarm
    every POLL_EVERY steps, so a collapsing scale raises there, naming the step it collapsed."""
    from shardscale import ScaleCollapseError
    from shardscale.scaler import POLL_EVERY

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.01, fused=fused)
    scaler = ShardedGradScaler("cpu", max_consecutive_skips=5)

    def step(x):
        opt.zero_grad()
        scaler.scale(m(x).sum() * INF).backward()
        scaler.step(opt)
        scaler.update()

    run = torch.compile(step, backend="aot_eager")
    with pytest.raises(ScaleCollapseError) as info:
        for _ in range(3 * POLL_EVERY):
            run(torch.randn(3, 4))
    assert info.value.step == 4  # the fifth skip in a row
    assert scaler.metrics()["steps"] <= POLL_EVERY + 1


def _clipped(fused: bool, compiled: bool, policy: str = "torch") -> tuple:
    """A clipped step (``scaler.clip_grad_norm_``) with an inf loss at step 2 and a NaN at 4,
    compiled with inductor (the default backend: its own simplifications, not aot_eager's).
    Inputs > 0 and a linear loss: the inf loss gives +inf gradients (an inf norm, not NaN)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, fused=fused or None)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, policy=policy)

    def step(x, factor):
        opt.zero_grad()
        scaler.scale(m(x).sum() * factor).backward()
        scaler.clip_grad_norm_(opt, 0.5)
        scaler.step(opt)
        scaler.update()

    run = torch.compile(step) if compiled else step
    scales, skipped = [], []
    for i in range(6):
        x = torch.rand(5, 4, generator=torch.Generator().manual_seed(i)) + 0.5
        run(x, torch.tensor({2: INF, 4: float("nan")}.get(i, 1.0)))
        scales.append(scaler.get_scale())
        skipped.append(bool(scaler.last_step_skipped(opt)))
    return scales, skipped, torch.cat([p.detach().reshape(-1) for p in m.parameters()])


@pytest.mark.parametrize("fused", [False, True])
def test_a_compiled_clipped_step_skips_inf_and_nan_as_eager(fused):
    """Inductor folds ``x * 0`` to 0: a clip that found an inf norm that way took the step and
    wrote NaN into the parameters. Compiled, the clipped step skips the inf and NaN steps and
    backs off as eager does; a fused optimizer's compiled clip traces (its step kind is a
    constant of the graph)."""
    eager = _clipped(fused, compiled=False)
    comp = _clipped(fused, compiled=True)
    assert comp[1] == eager[1] == [False, False, True, False, True, False]
    assert comp[0] == eager[0] == [1024.0, 1024.0, 512.0, 512.0, 256.0, 256.0]
    assert torch.isfinite(comp[2]).all()
    torch.testing.assert_close(comp[2], eager[2])


_SCRIPT_STEP = """
def step(x):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (m(x) - x.sum(1, keepdim=True)).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


@pytest.mark.parametrize("every", [1, 4])
def test_a_compiled_headroom_step_does_not_recompile_every_update(every):
    """policy="headroom" reads no host counter in a compiled step with measure_every=1, and
    only its phase with measure_every=k: no new graph once the step has been compiled for each
    phase (a guard on a count would recompile at every update until dynamo's recompile limit,
    then run eagerly). The step as a script writes it, with the model, optimizer and scaler
    module globals (dynamo guards on globals' attributes)."""
    compiled = []

    def backend(gm, example_inputs):  # counts the graphs compiled
        compiled.append(gm)
        return gm.forward

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, policy="headroom", measure_every=every)
    script = {"torch": torch, "m": m, "opt": opt, "scaler": scaler}
    exec(_SCRIPT_STEP, script)
    step = torch.compile(script["step"], backend=backend)
    seen = []
    for i in range(16):
        step(torch.randn(32, 16, generator=torch.Generator().manual_seed(i)))
        seen.append(len(compiled))
    assert seen[-1] == seen[3 + every], seen


def _bounded_run(mode: str, fused: bool, case: str) -> list:
    """24 iterations under user bounds, eager or compiled (``update`` alone with
    fullgraph=True, or the whole step): ``min``: NaN losses from iteration 3 on, the scale
    backs off to ``min_scale`` and collapses (warned); ``max``: growth every step, capped at
    ``max_scale``. Returns the scale after each iteration and the collapse warnings' steps."""
    import warnings

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused or None)
    if case == "min":
        s = ShardedGradScaler("cpu", init_scale=2.0**12, min_scale=2.0**10, on_collapse="warn")
    else:
        s = ShardedGradScaler("cpu", init_scale=2.0**4, max_scale=2.0**8, growth_interval=1)
    update = torch.compile(s.update, fullgraph=True) if mode == "update" else s.update

    def step(x, factor):
        opt.zero_grad()
        s.scale(m(x).sum() * factor).backward()
        s.step(opt)
        update()

    run = torch.compile(step, backend="aot_eager") if mode == "step" else step
    scales = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(24):
            nan = case == "min" and i >= 3
            run(torch.ones(3, 4), torch.tensor(float("nan") if nan else 1.0))
            scales.append(s.get_scale())
    said = [re.search(r"collapsed at step (\d+)", str(w.message)) for w in caught]
    return scales, [int(m.group(1)) for m in said if m][:1]


@pytest.mark.parametrize("case", ["min", "max"])
@pytest.mark.parametrize("fused", [False, True])
def test_a_compiled_update_keeps_the_bounds_and_the_collapse_step(fused, case):
    """A compiled update() runs again with the host's bounds as they were when it was traced
    (its updates go unseen): it must not take the unbounded plain path then. The scale stays
    in [min_scale, max_scale] as in eager, and the collapse names eager's step."""
    eager = _bounded_run("eager", fused, case)
    assert min(eager[0]) >= 2.0**10 if case == "min" else max(eager[0]) == 2.0**8
    if case == "min":
        assert eager[1] == [5]
    assert _bounded_run("update", fused, case)[0] == eager[0]
    step = _bounded_run("step", fused, case)
    assert step[0] == eager[0] and step[1] == eager[1]


@pytest.mark.parametrize("fused", [False, True])
def test_a_compiled_loop_checks_again_below_a_scale_of_1(fused):
    """fp16 parameters, the scale backed off from 8 to below 1 inside a compiled loop (the
    host sees none of those updates): a gradient finite when scaled and inf once unscaled
    (1e5 > fp16's 65504) is still caught and the step skipped, as eager, never stepped."""

    def run(compiled: bool) -> list:
        torch._dynamo.reset()
        w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
        opt = torch.optim.AdamW([w], lr=0.01, fused=True) if fused else torch.optim.SGD([w], 1e-6)
        s = ShardedGradScaler("cpu", init_scale=8.0, min_scale=2.0**-10)

        def step(factor):
            opt.zero_grad()
            s.scale((w.float() * factor).sum()).backward()
            s.step(opt)
            s.update()

        run_ = torch.compile(step, backend="aot_eager") if compiled else step
        seen = []
        for i in range(9):
            run_(torch.tensor(INF if i < 6 else 1e5))
            seen.append((s.get_scale(), bool(s.last_step_skipped(opt))))
        assert torch.isfinite(w).all()
        return seen

    eager = run(False)
    assert eager[-1] == (2.0**-6, True)
    assert run(True) == eager
