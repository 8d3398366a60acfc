"""``scaler.numerics()``: headroom to fp16's overflow, underflow in fp16, the unscaled norm and
amax of each parameter group's gradients at the last step, hand-computed."""

from __future__ import annotations

import copy
import math
import warnings

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
    assert w.zeros == 0.25 and b.zeros == 0.0 and n.zeros == pytest.approx(1 / 6)  # the 0
    assert w.grad_norm == pytest.approx(math.sqrt(sum(v * v for v in VALUES)))
    assert b.grad_norm == pytest.approx(math.sqrt(0.25 + 4.0))
    assert n.headroom_bits == b.headroom_bits and n.underflow == pytest.approx(2 / 6)
    assert n.as_dict() == {"headroom_bits": n.headroom_bits, "underflow": n.underflow}


@pytest.mark.parametrize("scale", [2.0**10, 2.0**16])
def test_fp16_gradients_count_their_underflow_at_any_scale(scale):
    """fp16 parameters, unscaled fp16 gradients: 2**-14 / scale lies below fp16's smallest
    subnormal from scale 2**11 on, so the comparison is made in fp32."""
    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = ShardedGradScaler("cpu", init_scale=scale)
    scaler.scale(torch.zeros((), requires_grad=True) * 0)
    w.grad = (torch.tensor([0.0, 1e-9, 1e-3, 0.5]) * scale).half()  # 0, subnormal, 2 normal
    scaler.step(opt)
    scaler.update()
    group = scaler.numerics().groups[0]
    assert group.underflow == 0.5
    assert group.zeros == 0.5  # unscaled in place in fp16, 1e-9 became 0


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_an_overflowing_step_has_negative_headroom(kind):
    n = _step(kind, values=[1.0, math.inf, 0.0, 0.0]).numerics()
    assert n.groups[0].headroom_bits == -math.inf and n.groups[0].amax == math.inf
    assert n.groups[1].amax == pytest.approx(2.0)  # the other group is measured as it is


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_a_nan_gradient_reads_as_an_overflow_too(kind):
    """A NaN gives -inf headroom, as an inf does (not NaN: the smallest over groups holds)."""
    n = _step(kind, values=[1.0, math.nan, 0.0, 0.0]).numerics()
    assert n.groups[0].headroom_bits == -math.inf and n.headroom_bits == -math.inf


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


def test_none_once_the_gradients_are_zeroed():
    """After zero_grad() nothing is left to measure: None, not an infinite headroom."""
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.numerics().as_dict()["headroom_bits"] == pytest.approx(16 - 10, abs=0.01)
    opt.zero_grad()
    assert scaler.numerics() is None


def test_a_module_without_fsdp_units_keeps_the_group_names():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    scaler = ShardedGradScaler("cpu", init_scale=8.0, param_names=model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    (group,) = scaler.numerics().groups
    assert group.name == "optimizer 0, group 0" and group.numel == 13
    amax = max(float(p.grad.abs().max()) for p in model.parameters())
    assert group.amax == pytest.approx(amax)
    # a deep copy of (model, scaler) measures the copied model's tree
    model2, scaler2 = copy.deepcopy((model, scaler))
    assert scaler2._names.root() is model2


def _fsdp_units(rank: int, world_size: int):
    """FSDP2 on 2 gloo ranks: a group spanning the units "0" and "2" gives one entry per unit
    (hand-computed from this rank's gradient shards); a model sharded as one unit does not."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for wrap in ("layers", "root"):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        if wrap == "layers":
            fully_shard(m[0])
            fully_shard(m[2])
        fully_shard(m)
        scaler = ShardedGradScaler("cpu", init_scale=2.0**12, param_names=m)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        scaler.scale(m(x).pow(2).sum() * 1e-5).backward()
        scaler.step(opt)
        scaler.update()
        hand = {}
        for i in (0, 2):  # this rank's gradient shards, unscaled in place by step()
            g = torch.cat([p.grad.to_local().reshape(-1) for p in m[i].parameters()]).double()
            under = float((g.abs() * 2.0**12 < 2.0**-14).double().mean())
            hand[f"unit {i}"] = (float(g.abs().max()), float(g.norm()), under, g.numel())
        n = scaler.numerics()
        every = scaler.numerics(all_ranks=True)
        out[wrap] = {
            "local": [(g.name, g.amax, g.grad_norm, g.underflow, g.numel) for g in n.groups],
            "every": [(g.rank, g.name) for g in every.groups],
            "hand": hand,
        }
    out["fsdp1"] = _fsdp1_units()
    return out


def _fsdp1_units() -> list[tuple[str, int]]:
    """FSDP1 (flat parameters): one entry per wrapped Linear, named by its module path."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation
        policy = ModuleWrapPolicy({torch.nn.Linear})
        m = FSDP1(m, device_id=torch.device("cpu"), auto_wrap_policy=policy)
    scaler = ShardedGradScaler("cpu", param_names=m)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    scaler.scale(m(torch.randn(3, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    return [(g.name, g.numel) for g in scaler.numerics().groups]


@pytest.mark.dist
def test_a_group_spanning_fsdp_units_is_measured_per_unit(tmp_path):
    results = run_ranks(_fsdp_units, tmp_path)
    for res in results:
        local, hand = res["layers"]["local"], res["layers"]["hand"]
        names = ["optimizer 0, group 0, unit 0", "optimizer 0, group 0, unit 2"]
        assert [g[0] for g in local] == names
        for name, amax, norm, under, numel in local:
            h_amax, h_norm, h_under, h_numel = hand[name.split(", ")[-1]]
            assert amax == pytest.approx(h_amax) and norm == pytest.approx(h_norm)
            assert under == pytest.approx(h_under) and numel == h_numel
        assert res["layers"]["every"] == [(r, n) for r in range(2) for n in names]
        # one unit (only the root sharded): the group keeps its name
        assert [g[0] for g in res["root"]["local"]] == ["optimizer 0, group 0"]
        assert res["root"]["local"][0][4] == sum(h[3] for h in res["root"]["hand"].values())
        prefix = "optimizer 0, group 0, unit _fsdp_wrapped_module."
        assert res["fsdp1"] == [(prefix + "0", 20), (prefix + "2", 9)]  # 40 and 18 elements
    # the shards differ: each rank measured its own
    assert results[0]["layers"]["local"] != results[1]["layers"]["local"]
