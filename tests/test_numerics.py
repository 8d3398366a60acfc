"""``scaler.numerics()``: headroom to fp16's overflow, underflow in fp16, the unscaled norm and
amax of each parameter group's gradients at the last step, hand-computed."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_ranks

from shardscale import Numerics, ShardedGradScaler

VALUES = [1e-9, 1e-3, 1.0, 0.0]  # scaled by 1024: 1e-6 (subnormal), 1.024, 1024, 0


def _step(opt_kind: str, values=VALUES, scale: float = 1024.0, **kw):
    w = torch.nn.Parameter(torch.zeros(len(values)))
    b = torch.nn.Parameter(torch.zeros(2))
    opts = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.0),
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.0, fused=True),
    }
    opt = opts[opt_kind]([{"params": [w]}, {"params": [b]}])
    scaler = ShardedGradScaler("cpu", init_scale=scale, **kw)
    scaler.scale(torch.zeros((), requires_grad=True) * 0)  # places the scale; scale() called
    w.grad = torch.tensor(values) * scale  # the backward of a scaled loss
    b.grad = torch.tensor([0.5, -2.0]) * scale
    scaler.step(opt)
    scaler.update()
    return scaler


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_numerics_per_group_are_the_hand_computed_figures(kind):
    n = _step(kind).numerics()
    assert isinstance(n, Numerics) and n.step == 0 and n.scale == 1024.0
    w, b = n.groups
    assert (w.name, b.name) == ("optimizer 0, group 0", "optimizer 0, group 1")
    assert w.amax == pytest.approx(1.0) and b.amax == pytest.approx(2.0)
    assert w.headroom_bits == pytest.approx(math.log2(65504 / 1024))
    assert b.headroom_bits == pytest.approx(math.log2(65504 / 2048))
    assert w.underflow == 0.5 and b.underflow == 0.0  # 1e-9 * 1024 and 0 vanish in fp16
    assert w.grad_norm == pytest.approx(math.sqrt(sum(v * v for v in VALUES)))
    assert b.grad_norm == pytest.approx(math.sqrt(0.25 + 4.0))
    assert n.headroom_bits == b.headroom_bits and n.underflow == pytest.approx(2 / 6)
    assert n.as_dict() == {"headroom_bits": n.headroom_bits, "underflow": n.underflow}


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_an_overflowing_step_has_negative_headroom(kind):
    n = _step(kind, values=[1.0, math.inf, 0.0, 0.0]).numerics()
    assert n.groups[0].headroom_bits == -math.inf and n.groups[0].amax == math.inf
    assert n.groups[1].amax == pytest.approx(2.0)  # the other group is measured as it is


def test_none_before_a_step_or_when_disabled():
    assert ShardedGradScaler("cpu").numerics() is None
    assert ShardedGradScaler("cpu", enabled=False).numerics() is None
    with pytest.raises(TypeError, match="all_ranks must be a bool"):
        ShardedGradScaler("cpu").numerics(all_ranks=1)


def _two_ranks(rank: int, world_size: int):
    values = [1.0, 2.0] if rank == 0 else [4.0, 0.0]
    scaler = _step("sgd", values=values + [0.0, 0.0], scale=256.0)
    local = scaler.numerics()
    every = scaler.numerics(all_ranks=True)
    return [(g.rank, g.name, g.amax) for g in local.groups], [
        (g.rank, g.name, g.amax) for g in every.groups
    ]


@pytest.mark.dist
def test_numerics_local_by_default_every_rank_when_asked(tmp_path):
    (local0, every0), (local1, every1) = run_ranks(_two_ranks, tmp_path)
    assert [r for r, _, _ in local0] == [0, 0] and [r for r, _, _ in local1] == [1, 1]
    assert every0 == every1 == local0 + local1
    assert every0[0][2] == pytest.approx(2.0) and every0[2][2] == pytest.approx(4.0)


def test_none_once_the_next_iteration_scaled():
    """After the next scale(), the gradients are no longer the last step's: None."""
    scaler = _step("sgd")
    assert scaler.numerics() is not None
    scaler.scale(torch.ones((), requires_grad=True))
    assert scaler.numerics() is None
