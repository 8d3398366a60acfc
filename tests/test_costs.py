"""What an iteration costs, counted: host reads (``item``, ``tolist``, ``__bool__``,
``__float__``, ``__int__``, ``__index__`` on any tensor) and collectives.

A steady-state iteration (``scale``, ``step``, ``update``) reads the host 0 times with a fused
optimizer and once with a non-fused one (the read that decides whether to call
``optimizer.step()``); with fused steps the alarm (collapse guard, rank agreement) is read once
every ``POLL_EVERY`` updates. One all-reduce per iteration on 2 ranks. The same code runs on
every device, so these counts are those of a CUDA run.
"""

from __future__ import annotations

import pytest
import torch
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
                scaler.step(opt)
                scaler.update()
            reads.append(r.count)
            comms.append(c.get_total_counts())
        out[kind] = (reads, comms)
    return out


@pytest.mark.dist
def test_two_ranks_one_all_reduce_and_the_same_reads(tmp_path):
    for result in run_ranks(_costs_two_ranks, tmp_path):
        assert result["sgd"] == ([1] * 5, [1] * 5)
        assert result["adam_fused"] == ([0] * 5, [1] * 5)


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
