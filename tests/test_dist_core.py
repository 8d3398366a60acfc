"""2-rank gloo tests of the core scaler: cross-rank skip agreement, one all-reduce per step,
FSDP2/FSDP1/DDP gradients, ranks without gradients, several and fused optimizers.

Two launches (``run_ranks``) run every scenario; each scenario returns plain values (scales,
skip decisions, parameter tensors) that the tests below compare across ranks and against
hand-computed sequences. A scenario that raises returns its traceback, so one failure does not
hide the others.
"""

from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from shardscale import ShardedGradScaler

pytestmark = pytest.mark.dist

INF, NAN = math.inf, math.nan


# ----------------------------------------------------------------------------- helpers


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(rank: int, steps: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(steps, 6, 4, generator=g), torch.randn(steps, 6, 2, generator=g)


def _poison(params, value: float) -> None:
    """Write ``value`` into the first element of this rank's first non-empty gradient (shard)."""
    with torch.no_grad():
        for p in params:
            g = p.grad
            if g is None:
                continue
            local = g.to_local() if hasattr(g, "to_local") else g
            if local.numel() > 0:
                local.view(-1)[0] = value
                return
    raise AssertionError("no gradient to poison on this rank")


def _snapshot(params) -> list[torch.Tensor]:
    out = []
    for p in params:
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        out.append(t.clone())
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _comm_count(fn) -> tuple[int, dict[str, int]]:
    mode = CommDebugMode()
    with mode:
        fn()
    counts = {str(k): v for k, v in mode.get_comm_counts().items()}
    return mode.get_total_counts(), counts


def _step_count(opt: torch.optim.Optimizer) -> list[float]:
    return [float(opt.state[p]["step"]) for g in opt.param_groups for p in g["params"]]


def _run_scenarios(scenarios, rank, world_size) -> dict:
    out = {}
    for fn in scenarios:
        try:
            out[fn.__name__] = fn(rank, world_size)
        except Exception:  # reported by the test that reads this scenario
            out[fn.__name__] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def _get(results, name):
    vals = [r[name] for r in results]
    for rank, v in enumerate(vals):
        if isinstance(v, dict) and "error" in v:
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{v['error']}")
    return vals


# ================================================================ launch 1: plain and DDP

# step -> (rank that gets the bad value, value); growth_interval=3, init 1024
SCHEDULE = {2: (0, INF), 5: (1, NAN), 6: (0, INF)}
HAND_SCALES = [1024, 1024, 512, 512, 512, 256, 128, 128, 128, 256, 256, 256, 512]
HAND_SKIPS = [i in SCHEDULE for i in range(len(HAND_SCALES))]


def one_rank_overflow(rank, world_size):
    """Replicated model, own data per rank, gradients averaged by hand (outside the scaler),
    then inf/NaN written into ONE rank's gradient. A torch.amp.GradScaler twin sees the same
    averaged gradients and the bad value whatever rank it was injected on."""
    steps = len(HAND_SCALES)
    x, y = _data(rank, steps)
    model, twin = _mlp(), _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    scales, skips, twin_equal = [], [], []
    for i in range(steps):
        opt.zero_grad()
        twin_opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x[i]), y[i])).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
        ref.scale(torch.ones(()))  # lazy init of torch's scale
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            q.grad = p.grad.clone()
        if i in SCHEDULE:
            bad_rank, value = SCHEDULE[i]
            if rank == bad_rank:
                _poison(model.parameters(), value)
            _poison(twin.parameters(), value)
        scaler.step(opt)
        scaler.update()
        ref.step(twin_opt)
        ref.update()
        scales.append(scaler.get_scale())
        skips.append(bool(scaler.last_step_skipped(opt)))
        twin_equal.append(
            _same(list(model.parameters()), list(twin.parameters()))
            and ref.get_scale() == scaler.get_scale()
        )
    return {
        "scales": scales,
        "skips": skips,
        "twin_equal": twin_equal,
        "params": _snapshot(model.parameters()),
        "metrics": scaler.metrics(),
    }


class _TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2).to(torch.bfloat16)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).bfloat16()).float()


def comm_counts_plain_ddp(rank, world_size):
    """All-reduces issued inside scaler.step/unscale_: plain, two dtypes, DDP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _data(rank, 4)
    out = {}
    for name, make in [
        ("plain", _mlp),
        ("two_dtypes", _TwoDtypes),
        ("ddp", lambda: DDP(_mlp())),
    ]:
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", init_scale=256.0)
        per_step = []
        for i in range(3):
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x[i]), y[i])).backward()
            if i == 1 and rank == 1:
                _poison(model.parameters(), INF)
            if i == 2:  # explicit unscale_: its one all-reduce, then none in step
                n_unscale, _ = _comm_count(lambda: scaler.unscale_(opt))  # noqa: B023
                n_step, counts = _comm_count(lambda: scaler.step(opt))  # noqa: B023
                per_step.append((n_unscale, n_step))
            else:
                n_step, counts = _comm_count(lambda: scaler.step(opt))  # noqa: B023
                per_step.append((n_step, counts))
            scaler.update()
        out[name] = {
            "per_step": per_step,
            "scale": scaler.get_scale(),
            "dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        }
    return out


def _two_opt_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def two_optimizers(rank, world_size):
    """Part A (fused AdamW) overflows on rank 0 only; part B (SGD) is clean."""
    x, y = _data(0, 3)  # same data on both ranks: replicated training
    model = _two_opt_model()
    part_a, part_b = list(model[0].parameters()), list(model[2].parameters())
    opt_a = torch.optim.AdamW(part_a, lr=1e-2, fused=True)
    opt_b = torch.optim.SGD(part_b, lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=4096.0)
    out = {"a_moved": [], "b_moved": [], "skip_a": [], "skip_b": [], "scales": []}
    for i in range(3):
        opt_a.zero_grad()
        opt_b.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x[i]), y[i])).backward()
        if i == 1 and rank == 0:
            _poison(part_a, INF)
        a0, b0 = _snapshot(part_a), _snapshot(part_b)
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        out["a_moved"].append(not _same(a0, _snapshot(part_a)))
        out["b_moved"].append(not _same(b0, _snapshot(part_b)))
        out["skip_a"].append(bool(scaler.last_step_skipped(opt_a)))
        out["skip_b"].append(bool(scaler.last_step_skipped(opt_b)))
        out["scales"].append(scaler.get_scale())
    out["a_steps"] = _step_count(opt_a)
    out["metrics"] = scaler.metrics()
    out["params"] = _snapshot(model.parameters())
    return out


def fused_rank1_overflow(rank, world_size):
    """Fused AdamW, rank 1 alone overflows: both ranks skip. torch's FSDP ShardedGradScaler,
    which does not reduce the flag it hands to fused optimizers, lets rank 0 step."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    x, y = _data(0, 2)
    out = {}
    for name, make_scaler in [
        ("ours", lambda: ShardedGradScaler("cpu", init_scale=1024.0)),
        ("torch_sharded", lambda: TorchSharded("cpu", init_scale=1024.0)),
    ]:
        try:
            model = _mlp()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            scaler = make_scaler()
            moved, steps = [], []
            for i in range(2):
                opt.zero_grad()
                scaler.scale(nn.functional.mse_loss(model(x[i]), y[i])).backward()
                if i == 1 and rank == 1:
                    _poison(model.parameters(), INF)
                before = _snapshot(model.parameters())
                scaler.step(opt)
                scaler.update()
                moved.append(not _same(before, _snapshot(model.parameters())))
                steps.append(_step_count(opt))
            out[name] = {"moved": moved, "steps": steps, "scale": scaler.get_scale()}
        except Exception:
            if name == "ours":
                raise
            out[name] = {"error": traceback.format_exc(limit=2)}
    return out


def unscale_then_fused_step(rank, world_size):
    """unscale_ before a fused step on 2 ranks: 0-dim agreed flag, no grad_scale, no error."""
    x, y = _data(0, 3)
    out = {}
    for name, make in [
        ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)),
        ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True)),
    ]:
        model = _mlp()
        opt = make(model.parameters())
        seen: list[tuple] = []

        def hook(o, args, kwargs, seen=seen):
            seen.append((o.grad_scale, tuple(o.found_inf.shape), float(o.found_inf)))

        opt.register_step_pre_hook(hook)
        scaler = ShardedGradScaler("cpu", init_scale=512.0)
        for i in range(3):
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x[i]), y[i])).backward()
            if i == 1 and rank == 1:
                _poison(model.parameters(), NAN)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # NaN stays NaN
            scaler.step(opt)
            scaler.update()
        out[name] = {
            "seen": seen,
            "params": _snapshot(model.parameters()),
            "scale": scaler.get_scale(),
            "attrs_left": hasattr(opt, "grad_scale") or hasattr(opt, "found_inf"),
        }
    return out


def rank_without_grads(rank, world_size):
    """Rank 1 never uses ``a`` (a.grad is None there) and holds no gradient at all for the
    optimizer over ``c``; the bad value is on rank 0 in ``a``/``c``. No hang, same decisions."""
    a = nn.Parameter(torch.ones(3))
    b = nn.Parameter(torch.ones(3))
    c = nn.Parameter(torch.ones(2))
    opt_ab = torch.optim.SGD([a, b], lr=0.1)
    opt_c = torch.optim.SGD([c], lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=64.0)
    out = {"skip_ab": [], "skip_c": [], "scales": [], "has_a_grad": [], "has_c_grad": []}
    for i in range(4):
        opt_ab.zero_grad()
        opt_c.zero_grad()
        loss = (b * 2.0).sum()
        if rank == 0:
            loss = loss + (a * 3.0).sum() + c.sum()
        scaler.scale(loss).backward()
        if rank == 0 and i == 1:
            _poison([a], INF)
        if rank == 0 and i == 2:
            _poison([c], NAN)
        out["has_a_grad"].append(a.grad is not None)
        out["has_c_grad"].append(c.grad is not None)
        scaler.step(opt_ab)
        scaler.step(opt_c)
        scaler.update()
        out["skip_ab"].append(bool(scaler.last_step_skipped(opt_ab)))
        out["skip_c"].append(bool(scaler.last_step_skipped(opt_c)))
        out["scales"].append(scaler.get_scale())
    out["b"] = b.detach().clone()
    return out


LAUNCH_1 = [
    one_rank_overflow,
    comm_counts_plain_ddp,
    two_optimizers,
    fused_rank1_overflow,
    unscale_then_fused_step,
    rank_without_grads,
]


def _launch_1(rank, world_size):
    return _run_scenarios(LAUNCH_1, rank, world_size)


# ======================================================================= launch 2: FSDP


def _fsdp2(model, **kw):
    from torch.distributed.fsdp import fully_shard

    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _full(params) -> list[torch.Tensor]:
    return [p.detach().full_tensor().clone() for p in params]


def fsdp2_counts_and_skip(rank, world_size):
    """FSDP2 (DTensor grads), fp32 and fp32+bf16 params: one all-reduce inside step, DTensor's
    own found_inf reduction not triggered; inf in rank 1's shard -> both skip."""
    x, y = _data(0, 3)
    out = {}
    for name, make in [("fp32", _mlp), ("two_dtypes", _TwoDtypes)]:
        model = _fsdp2(make())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", init_scale=2048.0)
        res = {"counts": [], "moved": [], "skips": [], "scales": []}
        for i in range(3):
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x[i]), y[i])).backward()
            if i == 1 and rank == 1:
                _poison(model.parameters(), INF)
            before = _snapshot(model.parameters())
            res["counts"].append(_comm_count(lambda: scaler.step(opt)))  # noqa: B023
            scaler.update()
            res["moved"].append(not _same(before, _snapshot(model.parameters())))
            res["skips"].append(bool(scaler.last_step_skipped(opt)))
            res["scales"].append(scaler.get_scale())
        res["grad_types"] = sorted({type(p.grad).__name__ for p in model.parameters()})
        res["grad_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
        res["full"] = _full(model.parameters())
        out[name] = res
    return out


def fsdp2_fp16_mixed_precision(rank, world_size):
    """FSDP2 MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp32) on CPU, AdamW; an inf on
    rank 0's shard at step 2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    model = _fsdp2(_mlp(), mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    x, y = _data(rank, 5)
    out = {"scales": [], "skips": [], "losses": [], "out_dtype": None}
    for i in range(5):
        opt.zero_grad()
        pred = model(x[i])
        out["out_dtype"] = str(pred.dtype)
        loss = nn.functional.mse_loss(pred.float(), y[i])
        scaler.scale(loss).backward()
        if i == 2 and rank == 0:
            _poison(model.parameters(), INF)
        scaler.step(opt)
        scaler.update()
        out["scales"].append(scaler.get_scale())
        out["skips"].append(bool(scaler.last_step_skipped(opt)))
        out["losses"].append(float(loss))
    out["full"] = _full(model.parameters())
    out["grad_dtype"] = str(next(iter(model.parameters())).grad.dtype)
    return out


def fsdp2_tiny_param(rank, world_size):
    """A 1-element parameter sharded over 2 ranks: rank 1 holds an empty shard of it."""
    torch.manual_seed(0)
    model = _fsdp2(nn.Sequential(nn.Linear(4, 1)))
    bias = model[0].bias
    opt_bias = torch.optim.SGD([bias], lr=0.1)
    opt_w = torch.optim.SGD([model[0].weight], lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=8.0)
    x, y = _data(0, 3)
    out = {"local_numel": bias.to_local().numel(), "skips": [], "scales": []}
    for i in range(3):
        opt_bias.zero_grad()
        opt_w.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x[i]), y[i][:, :1])).backward()
        if i == 1 and rank == 0:
            _poison([bias], INF)
        scaler.step(opt_bias)
        scaler.step(opt_w)
        scaler.update()
        out["skips"].append(
            (bool(scaler.last_step_skipped(opt_bias)), bool(scaler.last_step_skipped(opt_w)))
        )
        out["scales"].append(scaler.get_scale())
    out["full"] = _full(model.parameters())
    return out


def _fsdp1_run(rank, **kw):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_mlp(), device_id=torch.device("cpu"), **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = ShardedGradScaler("cpu", init_scale=512.0)
    x, y = _data(rank, 3)
    out = {"moved": [], "skips": [], "scales": []}
    for i in range(3):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x[i]), y[i])).backward()
        if i == 1 and rank == 0:
            _poison(model.parameters(), INF)
        before = _snapshot(model.parameters())
        scaler.step(opt)
        scaler.update()
        out["moved"].append(not _same(before, _snapshot(model.parameters())))
        out["skips"].append(bool(scaler.last_step_skipped(opt)))
        out["scales"].append(scaler.get_scale())
    with FSDP.summon_full_params(model):
        out["full"] = [p.detach().clone() for p in model.parameters()]
    return out


def fsdp1(rank, world_size):
    return {
        "flat": _fsdp1_run(rank, use_orig_params=False),
        "orig": _fsdp1_run(rank, use_orig_params=True),
    }


def fsdp1_cpu_offload(rank, world_size):
    """FSDP1 CPUOffload(offload_params=True). torch 2.13 pins the offloaded shards and
    synchronises device streams, which needs an accelerator: on a CPU-only machine the scenario
    reports why it could not run."""
    from torch.distributed.fsdp import CPUOffload

    try:
        return _fsdp1_run(rank, cpu_offload=CPUOffload(offload_params=True))
    except (RuntimeError, AttributeError) as e:
        if torch.accelerator.is_available():
            raise
        return {"unsupported": f"{type(e).__name__}: {e}"}


LAUNCH_2 = [
    fsdp2_counts_and_skip,
    fsdp2_fp16_mixed_precision,
    fsdp2_tiny_param,
    fsdp1,
    fsdp1_cpu_offload,
]


def _launch_2(rank, world_size):
    return _run_scenarios(LAUNCH_2, rank, world_size)


# ============================================================================== the tests


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run_ranks(_launch_1, tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return run_ranks(_launch_2, tmp_path_factory.mktemp("fsdp"))


def test_one_rank_overflow_all_ranks_skip(plain):
    r0, r1 = _get(plain, "one_rank_overflow")
    for r in (r0, r1):
        assert r["scales"] == HAND_SCALES
        assert r["skips"] == HAND_SKIPS
        # bit-identical to a single torch.amp.GradScaler that saw the bad value itself
        assert all(r["twin_equal"]), r["twin_equal"]
        assert r["metrics"]["skipped_steps"] == 3 and r["metrics"]["growths"] == 2
    assert _same(r0["params"], r1["params"])


def test_one_all_reduce_per_step_plain_and_ddp(plain):
    r0, r1 = _get(plain, "comm_counts_plain_ddp")
    for r in (r0, r1):
        for name in ("plain", "two_dtypes", "ddp"):
            res = r[name]
            (n0, c0), (n1, c1), (n_unscale, n_step) = res["per_step"]
            assert (n0, n1) == (1, 1), (name, c0, c1)
            assert c0 == {"c10d.allreduce_": 1}, (name, c0)
            assert (n_unscale, n_step) == (1, 0), name
            assert res["scale"] == 128.0, name  # 256, backoff at step 1 (inf on rank 1 only)
        assert r["two_dtypes"]["dtypes"] == ["torch.bfloat16", "torch.float32"]


def test_two_optimizers_skip_only_the_overflowing_one(plain):
    r0, r1 = _get(plain, "two_optimizers")
    for r in (r0, r1):
        assert r["skip_a"] == [False, True, False]
        assert r["skip_b"] == [False, False, False]
        assert r["a_moved"] == [True, False, True]
        assert r["b_moved"] == [True, True, True]
        assert r["scales"] == [4096.0, 2048.0, 2048.0]  # backed off once
        assert r["a_steps"] == [2.0, 2.0]  # the fused kernel undid the skipped step's count
        assert r["metrics"]["backoffs"] == 1 and r["metrics"]["overflows"] == 1
    assert _same(r0["params"], r1["params"])


def test_fused_optimizer_rank1_overflow_both_skip(plain):
    r0, r1 = _get(plain, "fused_rank1_overflow")
    for r in (r0, r1):
        assert r["ours"]["moved"] == [True, False]
        assert r["ours"]["steps"][1] == r["ours"]["steps"][0] == [1.0] * 4
        assert r["ours"]["scale"] == 512.0
    ts0, ts1 = r0["torch_sharded"], r1["torch_sharded"]
    if "error" in ts0 or "error" in ts1:
        pytest.skip(f"torch's ShardedGradScaler did not run on CPU: {ts0.get('error', '')}")
    # torch's scaler: rank 0 stepped on the step rank 1 skipped (the ranks diverged)
    assert ts0["moved"] == [True, True] and ts1["moved"] == [True, False]


def test_unscale_then_fused_step_two_ranks(plain):
    r0, r1 = _get(plain, "unscale_then_fused_step")
    for name in ("adamw", "sgd"):
        for r in (r0, r1):
            res = r[name]
            assert [s[0] for s in res["seen"]] == [None, None, None]
            assert [s[1] for s in res["seen"]] == [(), (), ()]
            assert [s[2] for s in res["seen"]] == [0.0, 1.0, 0.0]  # rank 1's NaN, agreed
            assert res["scale"] == 256.0
            assert not res["attrs_left"]
        assert _same(r0[name]["params"], r1[name]["params"])


def test_rank_without_grads_agrees(plain):
    r0, r1 = _get(plain, "rank_without_grads")
    assert r0["has_a_grad"] == r0["has_c_grad"] == [True] * 4
    assert r1["has_a_grad"] == r1["has_c_grad"] == [False] * 4
    for r in (r0, r1):
        assert r["skip_ab"] == [False, True, False, False]
        assert r["skip_c"] == [False, False, True, False]
        assert r["scales"] == [64.0, 32.0, 16.0, 16.0]
    # b (grad 2, lr 0.1) stepped on steps 0, 2 and 3 on both ranks: 1 - 3 * 0.2
    assert torch.equal(r0["b"], r1["b"])
    assert torch.allclose(r0["b"], torch.full((3,), 0.4))


def test_fsdp2_one_all_reduce_and_skip_agreement(fsdp):
    r0, r1 = _get(fsdp, "fsdp2_counts_and_skip")
    for name in ("fp32", "two_dtypes"):
        for r in (r0, r1):
            res = r[name]
            assert res["grad_types"] == ["DTensor"]
            # exactly one collective in step: ours; DTensor's own reduction never runs
            assert [c for c in res["counts"]] == [(1, {"c10d.allreduce_": 1})] * 3, res["counts"]
            assert res["skips"] == [False, True, False]
            assert res["moved"] == [True, False, True]
            assert res["scales"] == [2048.0, 1024.0, 1024.0]
        assert _same(r0[name]["full"], r1[name]["full"])
    assert r0["two_dtypes"]["grad_dtypes"] == ["torch.bfloat16", "torch.float32"]


def test_fsdp2_fp16_mixed_precision_trains(fsdp):
    r0, r1 = _get(fsdp, "fsdp2_fp16_mixed_precision")
    for r in (r0, r1):
        assert r["out_dtype"] == "torch.float16"  # fp16 matmuls on CPU
        assert r["grad_dtype"] == "torch.float32"  # reduce_dtype / sharded fp32 params
        assert r["skips"] == [False, False, True, False, False]
        # init 4096, growth_interval 2: grow at step 1, back off at 2, grow at 4
        assert r["scales"] == [4096.0, 8192.0, 4096.0, 4096.0, 8192.0]
        assert all(math.isfinite(v) for v in r["losses"])
        assert all(torch.isfinite(p).all() for p in r["full"])
    assert _same(r0["full"], r1["full"])


def test_fsdp2_empty_shard_rank_agrees(fsdp):
    r0, r1 = _get(fsdp, "fsdp2_tiny_param")
    assert (r0["local_numel"], r1["local_numel"]) == (1, 0)
    for r in (r0, r1):
        assert r["skips"] == [(False, False), (True, False), (False, False)]
        assert r["scales"] == [8.0, 4.0, 4.0]
    assert _same(r0["full"], r1["full"])


@pytest.mark.parametrize("variant", ["flat", "orig"])
def test_fsdp1_skip_agreement(fsdp, variant):
    r0, r1 = (r[variant] for r in _get(fsdp, "fsdp1"))
    for r in (r0, r1):
        assert r["skips"] == [False, True, False]
        assert r["moved"] == [True, False, True]
        assert r["scales"] == [512.0, 256.0, 256.0]
    assert _same(r0["full"], r1["full"])


def test_fsdp1_cpu_offload_skip_agreement(fsdp):
    r0, r1 = _get(fsdp, "fsdp1_cpu_offload")
    if "unsupported" in r0:
        pytest.skip(f"FSDP1 CPUOffload needs an accelerator in torch 2.13: {r0['unsupported']}")
    for r in (r0, r1):
        assert r["skips"] == [False, True, False]
        assert r["moved"] == [True, False, True]
        assert r["scales"] == [512.0, 256.0, 256.0]
    assert _same(r0["full"], r1["full"])


# ------------------------------------------------------------ pipeline-parallel stages
def _pipeline_stages(rank: int, world_size: int) -> dict:
    """Each rank owns a different stage (rank r: r+1 Linear layers): one scale for the pipeline.
    Rank 1 overflows at step 1. With default arguments the stages step and skip together; with
    rank_local_params=True clip_grad_norm_ sums every stage's gradients."""
    out: dict = {}
    for clip in (False, True):
        torch.manual_seed(rank)
        stage = nn.Sequential(*[nn.Linear(3, 3) for _ in range(rank + 1)])
        opt = torch.optim.SGD(stage.parameters(), lr=0.1)
        s = ShardedGradScaler("cpu", init_scale=1024.0, rank_local_params=clip)
        runs = out[clip] = {"skipped": [], "scales": [], "norms": [], "local_sq": []}
        for step in range(3):
            opt.zero_grad()
            s.scale(stage(torch.ones(3)).sum()).backward()
            if step == 1 and rank == 1:
                stage[0].weight.grad[0, 0] = float("inf")
            scale = s.get_scale()
            local_sq = sum(
                float((p.grad.double() / scale).pow(2).sum()) for p in stage.parameters()
            )
            before = [p.detach().clone() for p in stage.parameters()]
            if clip:
                runs["norms"].append(s.clip_grad_norm_(opt, 1e9).item())
            s.step(opt)
            s.update()
            params = zip(before, stage.parameters(), strict=True)
            moved = any(not torch.equal(a, p) for a, p in params)
            runs["skipped"].append((bool(s.last_step_skipped(opt)), not moved))
            runs["scales"].append(s.get_scale())
            runs["local_sq"].append(local_sq)
    return out


@pytest.mark.dist
def test_pipeline_stages_with_default_arguments_and_clipping(tmp_path):
    r0, r1 = run_ranks(_pipeline_stages, tmp_path)
    for r in (r0, r1):
        for clip in (False, True):
            # step 1 overflows on rank 1 only: both ranks skip (parameters untouched), back off
            assert r[clip]["skipped"] == [(False, False), (True, True), (False, False)]
            assert r[clip]["scales"] == [1024.0, 512.0, 512.0]
    n0, n1 = r0[True], r1[True]
    for step in (0, 2):  # the norm of the whole pipeline: every stage's gradients, summed
        expected = math.sqrt(n0["local_sq"][step] + n1["local_sq"][step])
        assert n0["norms"][step] == n1["norms"][step] == pytest.approx(expected, rel=1e-6)
    assert math.isinf(n0["norms"][1]) and math.isinf(n1["norms"][1])
