"""What an iteration costs, counted: host reads (``item``, ``tolist``, ``__bool__``,
``__float__``, ``__int__``, ``__index__`` on any tensor) and collectives.

A steady-state iteration (``scale``, ``step``, ``update``) reads the host 0 times with a fused
optimizer and once with a non-fused one (the read that decides whether to call
``optimizer.step()``); with fused steps the alarm (collapse guard, rank agreement) is read once
every ``POLL_EVERY`` updates. One all-reduce per iteration on 2 ranks. The same code runs on
every device, so these counts are those of a CUDA run.
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch
import torch.utils._python_dispatch
from _dist import run_ranks

from shardscale import ShardedGradScaler
from shardscale.scaler import POLL_EVERY

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class HostReads:
    """Counts host reads of tensors while active (patches torch.Tensor's methods), except
    those of the optimizers given to :meth:`not_in` (Adam's own step reads its step count)."""

    def __init__(self) -> None:
        self.count = 0
        self.paused = 0
        self._saved: dict[str, object] = {}

    def not_in(self, optimizer: torch.optim.Optimizer) -> None:
        step = optimizer.step

        def uncounted(*args, **kwargs):
            self.paused += 1
            try:
                return step(*args, **kwargs)
            finally:
                self.paused -= 1

        optimizer.step = uncounted

    def __enter__(self) -> HostReads:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = torch.Tensor.__dict__.get(name)

            def counting(t, *a, _original=original, **k):
                self.count += not self.paused
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, counting)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, saved in self._saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.01, fused=True),
}


def _reads_per_iteration(kind: str, iterations: int, **scaler_kw) -> list[int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = OPTIMIZERS[kind](model.parameters())
    scaler = ShardedGradScaler("cpu", **scaler_kw)
    x = torch.randn(4, 8)
    out = []
    reads = HostReads()
    reads.not_in(opt)
    for _ in range(iterations):
        opt.zero_grad()
        loss = model(x).pow(2).mean()  # the forward and backward read nothing either
        reads.count = 0
        with reads:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        out.append(reads.count)
    return out


@pytest.mark.parametrize("kind", ["adam_fused", "adamw_fused", "sgd_fused"])
def test_a_fused_iteration_reads_the_host_only_to_poll_the_alarm(kind):
    got = _reads_per_iteration(kind, 2 * POLL_EVERY + 3)
    assert got == [int((i + 1) % POLL_EVERY == 0) for i in range(2 * POLL_EVERY + 3)]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_non_fused_iteration_reads_the_host_once(kind):
    assert _reads_per_iteration(kind, 2 * POLL_EVERY + 3) == [1] * (2 * POLL_EVERY + 3)


def test_the_policy_extras_cost_no_read():
    kw = {"hysteresis": 3, "max_consecutive_skips": 5, "min_scale": 1.0, "growth_interval": 2}
    assert _reads_per_iteration("adam_fused", POLL_EVERY - 1, **kw) == [0] * (POLL_EVERY - 1)
    assert _reads_per_iteration("sgd", POLL_EVERY + 1, **kw) == [1] * (POLL_EVERY + 1)


def _costs_two_ranks(rank: int, world_size: int) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    for kind in ("sgd", "adam_fused"):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = OPTIMIZERS[kind](model.parameters())
        scaler = ShardedGradScaler("cpu")
        x = torch.randn(4, 8)
        reads, comms = [], []
        r = HostReads()
        r.not_in(opt)
        for _ in range(5):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            r.count = 0
            with r, CommDebugMode() as c:
                scaler.scale(loss).backward()
                with AtenOps() as a:
                    scaler.step(opt)
                scaler.update()
            reads.append(r.count)
            comms.append(c.get_total_counts())
        out[kind] = (reads, comms)
        out[kind + " ops"] = len(a.names)
    return out


@pytest.mark.dist
def test_two_ranks_one_all_reduce_and_the_same_reads(tmp_path):
    """The first agreement since the scaler was made (or loaded) reads its mismatch bit once
    (ranks built or restored differently raise there); then the steady state."""
    for result in run_ranks(_costs_two_ranks, tmp_path):
        assert result["sgd"] == ([2] + [1] * 4, [1] * 5)
        assert result["adam_fused"] == ([1] + [0] * 4, [1] * 5)
        # step(): the 1-process ops (6 / 3) and the agreement's 21: 9 to build its vector
        # (views included), the all-reduce, 4 to find a mismatch, 4 for the flag and whether
        # any rank scaled, 3 into the alarm
        assert (result["sgd ops"], result["adam_fused ops"]) == (27, 24), result


def _largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation made by ``fn`` (torch's profiler, per op)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max([0] + [int(e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_unscale_and_clip_allocate_nothing_gradient_sized(dtype, fused):
    """A 2M-element gradient (8 MB in fp32): unscale_ allocates a few bytes, clip_grad_norm_ at
    most a 1 MiB scratch (fp16 norms are taken in fp32, piece by piece)."""
    w = torch.nn.Parameter(torch.zeros(2_000_000, dtype=dtype))
    opt = torch.optim.AdamW([w], lr=1e-3, fused=fused)
    scaler = ShardedGradScaler("cpu")
    for call in (lambda: scaler.unscale_(opt), lambda: scaler.clip_grad_norm_(opt, 1.0)):
        scaler.scale(torch.ones(()))
        w.grad = torch.randn(2_000_000).to(dtype)
        largest = _largest_allocation(call)
        scaler.step(opt)
        scaler.update()
        assert largest <= (1 << 20) + 1024, largest


class AtenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten ops (on an accelerator each is a kernel launch) outside ``torch.optim``."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and "/torch/optim/" not in frame.f_code.co_filename:
            frame = frame.f_back
        if frame is None:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _steady_iteration(kind: str, **scaler_kw):
    """(ops of scale, of step, of update) in the 4th iteration of a small model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = OPTIMIZERS[kind](model.parameters())
    scaler = ShardedGradScaler("cpu", **scaler_kw)
    x = torch.randn(4, 8)
    for _ in range(4):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        with AtenOps() as a:
            scaled = scaler.scale(loss)
        scaled.backward()
        with AtenOps() as b:
            scaler.step(opt)
        with AtenOps() as c:
            scaler.update()
    return a.names, b.names, c.names


@pytest.mark.parametrize("kind,expected", [("sgd", (1, 6, 6)), ("adamw_fused", (1, 3, 6))])
def test_an_iteration_dispatches_few_aten_ops(kind, expected):
    """Default arguments, one process: 13 aten ops per iteration with SGD, 10 with fused AdamW
    (torch's GradScaler: 10 and 9); update() is torch's kernel and one update of the counters."""
    scale, step, update = _steady_iteration(kind)
    assert (len(scale), len(step), len(update)) == expected, (scale, step, update)
    assert "_amp_update_scale_" in update and "_amp_foreach_non_finite_check_and_unscale_" in step


def _steady_clip_iteration(kind: str):
    """(ops of scale, of clip_grad_norm_, of step, of update) in the 4th iteration."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = OPTIMIZERS[kind](model.parameters())
    scaler = ShardedGradScaler("cpu")
    x = torch.randn(4, 8)
    for _ in range(4):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        phases = []
        with AtenOps() as a:
            scaled = scaler.scale(loss)
        phases.append(a.names)
        scaled.backward()
        for call in (lambda: scaler.clip_grad_norm_(opt, 1.0), lambda: scaler.step(opt)):
            with AtenOps() as a:
                call()
            phases.append(a.names)
        with AtenOps() as a:
            scaler.update()
        phases.append(a.names)
    return phases


@pytest.mark.parametrize("kind,expected", [("sgd", (1, 24, 1, 6)), ("adamw_fused", (1, 22, 1, 6))])
def test_a_clip_iteration_dispatches_few_aten_ops(kind, expected):
    """scale, clip_grad_norm_(opt, 1.0), step, update on one process: 32 aten ops with SGD, 30
    with fused AdamW (torch's unscale_ + clip_grad_norm_ recipe: 18). The clip: 1/scale as
    torch's unscale_ (3), the per-tensor norms in one kernel, stacked, unscaled and normed (4),
    torch's clip coefficient (4), the overflow and fold check (9: a non-finite norm found by a
    comparison, which torch.compile keeps), found_inf (1), and the write
    pass (factor 2, one _foreach_mul_) or, fused, the folded grad_scale (1)."""
    phases = _steady_clip_iteration(kind)
    assert tuple(len(p) for p in phases) == expected, phases
    clip = phases[1]
    assert clip.count("_foreach_norm") == 1 and "stack" in clip
    assert clip.count("_foreach_mul_") == (kind == "sgd")  # fused: folded, no write pass


def test_options_off_cost_nothing_and_options_on_run_the_whole_rule():
    """Bounds at their defaults, hysteresis 1, no skip guard: the 6-op update. Bounds that may
    bind, hysteresis or a skip guard: the whole rule (more ops, same results elsewhere)."""
    assert len(_steady_iteration("sgd", min_scale=2.0**-10)[2]) == 6  # far from the bound
    for kw in ({"hysteresis": 2}, {"max_consecutive_skips": 5}, {"max_scale": 2.0**17}):
        assert len(_steady_iteration("sgd", **kw)[2]) > 6, kw


@pytest.mark.parametrize("kind,expected", [("sgd", (1, 13, 23)), ("adamw_fused", (1, 11, 41))])
def test_a_headroom_iteration_dispatches_its_counted_ops(kind, expected):
    """policy="headroom", 4 gradients: the check measures with one aminmax per gradient and 3
    ops (stack, abs, max; fused: the check itself, 4 more). update(): SGD's step read its flag
    clean on the host, so the rule leaves the overflow's branches out (23 ops, no collapse
    alarm); fused, the whole rule (35) and the collapse alarm (6)."""
    scale, step, update = _steady_iteration(kind, policy="headroom")
    assert (len(scale), len(step), len(update)) == expected, (scale, step, update)
    assert step.count("aminmax") == 4
    assert ("gather" in update) == (kind == "adamw_fused")  # the k-th backoff's factor


def _package_calls(fn) -> int:
    """Calls of shardscale's own functions while ``fn`` runs (a generator once, comprehensions
    not)."""
    import shardscale

    root = os.path.dirname(shardscale.__file__)
    seen: set[int] = set()
    calls = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(root):
            return
        if code.co_name in ("<listcomp>", "<dictcomp>", "<setcomp>"):
            return
        if code.co_flags & inspect.CO_GENERATOR:
            if id(frame) in seen:
                return
            seen.add(id(frame))
        calls.append(code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return len(calls)


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_step_is_a_short_path(kind):
    """step() on one process: at most 25 calls of the package's own functions (local check ->
    agreement -> record -> decide)."""
    model = torch.nn.Linear(8, 4)
    opt = OPTIMIZERS[kind](model.parameters())
    scaler = ShardedGradScaler("cpu")
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(2, 8)).sum()).backward()
        calls = _package_calls(lambda: scaler.step(opt))
        scaler.update()
    assert calls <= 25, calls
