"""ShardedGradScaler.clip_grad_norm_: parity with torch's unscale_ + clip_grad_norm_ recipe,
overflow handling, call order, and the global norm across DDP / FSDP1 / FSDP2 shards."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _dist import run_ranks

from shardscale import OptState, ShardedGradScaler

NORMS = [2.0, 1.0, math.inf]


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    )
    return m.to(dtype)


def _batch(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g).to(dtype)


def _pair(dtype=torch.float32, opt="sgd", fused=False, init_scale=1024.0):
    """Two identical models/optimizers: one for shardscale, one for torch's recipe."""
    a = _model(dtype)
    b = copy.deepcopy(a)

    def make(m):
        if opt == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(m.parameters(), lr=0.01, fused=fused)

    sa = ShardedGradScaler("cpu", init_scale=init_scale)
    sb = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return a, b, make(a), make(b), sa, sb


def _found(scaler: ShardedGradScaler, optimizer) -> float:
    """The agreed found-inf flag recorded for ``optimizer`` (torch's per-optimizer record)."""
    return float(sum(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()))


def _step_both(sa, sb, oa, ob):
    """Step, update and zero both sides of a :func:`_pair`."""
    for scaler, opt in ((sa, oa), (sb, ob)):
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _backward(model, scaler, x, poison=False):
    loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    if poison:
        next(model.parameters()).grad.view(-1)[3] = float("inf")


@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_matches_torch_recipe_fp32(norm_type, max_norm):
    a, b, oa, ob, sa, sb = _pair()
    x = _batch()
    for _ in range(2):  # two iterations: the second starts from the stepped parameters
        _backward(a, sa, x)
        _backward(b, sb, x)
        na = sa.clip_grad_norm_(oa, max_norm, norm_type)
        sb.unscale_(ob)
        nb = torch.nn.utils.clip_grad_norm_(b.parameters(), max_norm, norm_type)
        assert na.shape == () and na.dtype == torch.float32
        torch.testing.assert_close(na, nb, rtol=1e-6, atol=0)
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            if max_norm > 1e5:  # not clipped: the single multiply is exactly torch's unscale
                assert torch.equal(pa.grad, pb.grad)
            else:
                torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=1e-9)
        assert sa._per_optimizer_states[id(oa)]["stage"] is OptState.UNSCALED
        _step_both(sa, sb, oa, ob)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
    assert sa.get_scale() == sb.get_scale() == 1024.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_torch_recipe_low_precision(dtype):
    a, b, oa, ob, sa, sb = _pair(dtype)
    x = _batch(dtype)
    _backward(a, sa, x)
    _backward(b, sb, x)
    na = sa.clip_grad_norm_(oa, 0.05)
    # torch.amp.GradScaler refuses fp16 grads: the reference unscales in fp32 by hand
    unscaled = [p.grad.float() / 1024.0 for p in b.parameters()]
    ref = torch.linalg.vector_norm(torch.cat([g.view(-1) for g in unscaled]).double()).float()
    if dtype == torch.float16:  # fp32 chunks: the norm to fp32 precision
        torch.testing.assert_close(na, ref, rtol=1e-5, atol=0)
        coef = min(1.0, 0.05 / (ref.item() + 1e-6))
        expected = [(g * coef).to(dtype) for g in unscaled]
    else:
        # bf16 on CPU: torch's norm kernel (fp32 accumulation, each per-tensor norm rounded to
        # bf16, as torch.nn.utils.clip_grad_norm_): within 2**-8 of the exact norm, and at
        # least as close as torch's own bf16 clip_grad_norm_ (which also rounds the total).
        err = abs(na.double() - ref.double()) / ref.double()
        assert err <= 2**-8
        tg = [p.grad.detach().clone() / 1024.0 for p in b.parameters()]
        torch_norm = torch.nn.utils.clip_grad_norm_(tg, 0.05)
        assert err <= abs(torch_norm.double() - ref.double()) / ref.double() + 2**-12
        # the single write pass: scaled grad * (coef / scale) in fp32, rounded once to bf16
        factor = (0.05 / (na + 1e-6)).clamp(max=1.0) * (1.0 / 1024.0)
        expected = [(p.grad.float() * factor).to(dtype) for p in b.parameters()]
        coef = factor.item() * 1024.0
    assert coef < 1.0
    for pa, e in zip(a.parameters(), expected, strict=True):
        assert pa.grad.dtype == dtype
        torch.testing.assert_close(pa.grad, e, rtol=0, atol=0)


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf, 3.0])
def test_large_fp16_gradients_norm_in_fp32_pieces(p):
    """fp16 gradients of every layout the norm cuts or converts (a large contiguous one in
    pieces, a large transposed one, small ones): the fp32-precise norm of the scaled values."""
    torch.manual_seed(0)
    shapes = [(2**19 + 3,), (300, 200), (5,), (40, 7)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float16)) for s in shapes]
    params[1] = torch.nn.Parameter(torch.zeros(200, 300, dtype=torch.float16).t())
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.zeros((), dtype=torch.float16))  # creates the scale
    for q in params:
        q.grad = (torch.randn(q.shape) * 2.0**12).to(torch.float16)  # scaled; norm past 65504
    params[1].grad = params[1].grad.t().contiguous().t()  # a transposed layout
    ref = torch.linalg.vector_norm(
        torch.cat([q.grad.double().reshape(-1) for q in params]) / 2.0**10, p
    )
    norm = scaler.clip_grad_norm_(opt, 1e9, norm_type=p)
    # fp32 precision (p = 3: a sum of cubes in fp32, as torch's kernels take it)
    torch.testing.assert_close(norm.double(), ref, rtol=1e-5 if p != 3.0 else 1e-4, atol=0)
    assert _found(scaler, opt) == 0.0


def test_scaled_fp16_norm_does_not_overflow():
    """Scaled fp16 grads whose norm exceeds fp16's max (65504) are not an overflow."""
    p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**16)
    scaler.scale(torch.zeros((), dtype=torch.float16))  # creates the scale
    p.grad = torch.full_like(p, 2.0**14)  # unscaled 0.25 each; scaled norm 2**20 > 65504
    norm = scaler.clip_grad_norm_(opt, 1e9)
    assert norm.item() == pytest.approx(0.25 * 64)
    assert _found(scaler, opt) == 0.0
    assert torch.equal(p.grad, torch.full_like(p, 0.25))


@pytest.mark.parametrize("norm_type", NORMS)
def test_fused_adamw_folds_unscale_and_clip_into_grad_scale(norm_type):
    a, b, oa, ob, sa, sb = _pair(opt="adamw", fused=True)
    x = _batch()
    _backward(a, sa, x)
    _backward(b, sb, x)
    scaled = [p.grad.clone() for p in a.parameters()]
    na = sa.clip_grad_norm_(oa, 0.05, norm_type)
    sb.unscale_(ob)
    nb = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05, norm_type)
    torch.testing.assert_close(na, nb, rtol=1e-6, atol=0)
    # no write pass: the gradients are still the scaled ones
    assert all(torch.equal(p.grad, s) for p, s in zip(a.parameters(), scaled, strict=True))
    coef = min(1.0, 0.05 / (nb.item() + 1e-6))
    grad_scale = sa._per_optimizer_states[id(oa)]["grad_scale"]
    assert grad_scale.item() == pytest.approx(1024.0 / coef, rel=1e-6)
    sa.step(oa)
    sb.step(ob)
    sa.update()
    sb.update()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert not bool(sa.last_step_skipped(oa))


@pytest.mark.parametrize("fused", [False, True])
def test_overflow_skips_step_and_backs_off(fused):
    a, b, oa, ob, sa, sb = _pair(opt="adamw", fused=fused)
    x = _batch()
    before = [p.detach().clone() for p in a.parameters()]
    _backward(a, sa, x, poison=True)
    _backward(b, sb, x, poison=True)
    norm = sa.clip_grad_norm_(oa, 1.0)
    assert not torch.isfinite(norm)
    assert _found(sa, oa) == 1.0
    if not fused:  # only unscaled: the inf stays where it was, other grads equal torch's unscale_
        sb.unscale_(ob)
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(pa.grad, pb.grad)
    sa.step(oa)
    sb.step(ob)
    sa.update()
    sb.update()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before, strict=True))
    assert bool(sa.last_step_skipped(oa))
    assert sa.get_scale() == sb.get_scale() == 512.0
    assert sa.metrics()["skipped_steps"] == 1
    # the next clean iteration steps again
    oa.zero_grad()
    _backward(a, sa, x)
    assert torch.isfinite(sa.clip_grad_norm_(oa, 1.0))
    sa.step(oa)
    sa.update()
    assert not bool(sa.last_step_skipped(oa))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), before, strict=True))


def test_nan_gradient_is_an_overflow_for_every_norm_type():
    for norm_type in NORMS:
        a, _, oa, _, sa, _ = _pair()
        _backward(a, sa, _batch())
        list(a.parameters())[2].grad.view(-1)[0] = float("nan")
        norm = sa.clip_grad_norm_(oa, 1.0, norm_type)
        assert math.isnan(norm.item()), norm_type
        assert _found(sa, oa) == 1.0


def test_call_order_and_argument_errors():
    a, _, oa, _, sa, _ = _pair()
    _backward(a, sa, _batch())
    with pytest.raises(TypeError, match="pass tensors"):
        sa.clip_grad_norm_([1.0, 2.0], 1.0)
    with pytest.raises(TypeError, match="an iterable of parameters"):
        sa.clip_grad_norm_("weights", 1.0)
    with pytest.raises(ValueError, match="max_norm"):
        sa.clip_grad_norm_(oa, -1.0)
    with pytest.raises(TypeError, match="max_norm"):
        sa.clip_grad_norm_(oa, "1")
    with pytest.raises(ValueError, match="norm_type"):
        sa.clip_grad_norm_(oa, 1.0, 0)
    with pytest.raises(ValueError, match="norm_type"):
        sa.clip_grad_norm_(oa, 1.0, "fro")
    grads = [p.grad.clone() for p in a.parameters()]
    assert all(
        torch.equal(p.grad, g) for p, g in zip(a.parameters(), grads, strict=True)
    )  # untouched
    assert not sa._per_optimizer_states.get(id(oa), {}).get("found_inf_per_device")
    sa.clip_grad_norm_(oa, 1.0, "inf")
    sa.step(oa)
    with pytest.raises(RuntimeError, match="after step"):
        sa.clip_grad_norm_(oa, 1.0)


def test_disabled_scaler_clips_like_torch():
    a, b, oa, _, _, _ = _pair()
    s = ShardedGradScaler("cpu", enabled=False)
    x = _batch()
    s.scale(a(x).pow(2).mean()).backward()
    b(x).pow(2).mean().backward()
    na = s.clip_grad_norm_(oa, 0.05)
    nb = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
    torch.testing.assert_close(na, nb, rtol=1e-6, atol=0)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=1e-9)


def test_sparse_and_missing_gradients():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    lin = torch.nn.Linear(4, 1)
    unused = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([*emb.parameters(), *lin.parameters(), unused], lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=8.0)
    idx = torch.tensor([1, 1, 3])  # duplicate index: the sparse grad is uncoalesced
    scaler.scale(lin(emb(idx)).sum()).backward()
    dense = [emb.weight.grad.to_dense() / 8.0, lin.weight.grad / 8.0, lin.bias.grad / 8.0]
    ref = torch.linalg.vector_norm(torch.cat([d.view(-1) for d in dense]))
    norm = scaler.clip_grad_norm_(opt, 1e9)
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(emb.weight.grad.to_dense(), dense[0])
    assert unused.grad is None


# ---------------------------------------------------------------- 2 ranks (gloo)
def _ranks_scenarios(rank: int, world_size: int) -> dict:
    """All multi-rank scenarios in one launch. The reference is the unsharded model on the full
    batch computed locally by each rank (same seeds): its torch clip_grad_norm_ result."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = _batch()
    half = x.shape[0] // world_size
    mine = x[rank * half : (rank + 1) * half]
    out: dict = {}

    def reference(max_norm, norm_type):
        m = _model()
        m(x).pow(2).mean().backward()
        n = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm, norm_type)
        torch.optim.SGD(m.parameters(), lr=0.1).step()
        return n.item(), [p.detach().clone() for p in m.parameters()]

    def run(name, model, max_norm, norm_type, gather, poison=None):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", init_scale=256.0)
        scaler.scale(model(mine).pow(2).mean()).backward()
        if poison is not None and rank == 1:
            p = next(q for q in model.parameters() if q.grad is not None)
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            g.view(-1)[0] = poison
        with CommDebugMode() as comm:
            norm = scaler.clip_grad_norm_(opt, max_norm, norm_type)
            scaler.step(opt)
        scaler.update()
        ref_norm, ref_params = reference(max_norm, norm_type)
        params = gather(model)
        out[name] = {
            "norm": norm.item(),
            "ref_norm": ref_norm,
            "max_param_diff": max(
                (a - b).abs().max().item() for a, b in zip(params, ref_params, strict=True)
            ),
            "collectives": comm.get_total_counts(),
            "skipped": bool(scaler.last_step_skipped(opt)),
            "scale": scaler.get_scale(),
        }

    for norm_type in NORMS:
        tag = {2.0: "2", 1.0: "1", math.inf: "inf"}[norm_type]
        # DDP: replicated gradients (averaged over the two half batches = full-batch gradient)
        ddp = DDP(_model())
        run(f"ddp_{tag}", ddp, 0.05, norm_type, lambda m: [p.detach() for p in m.parameters()])
        # FSDP2: DTensor Shard(0) gradients
        mesh = init_device_mesh("cpu", (world_size,))
        f2 = _model()
        for layer in (f2[0], f2[2], f2[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(f2, mesh=mesh)
        run(
            f"fsdp2_{tag}", f2, 0.05, norm_type, lambda m: [p.full_tensor() for p in m.parameters()]
        )

        # FSDP1: one flat parameter per wrapped module (rank-local shards), and use_orig_params
        def gather1(m):
            with FSDP.summon_full_params(m):
                return [p.detach().clone() for p in m.parameters()]

        for orig in (False, True):
            f1 = FSDP(_model(), device_id=torch.device("cpu"), use_orig_params=orig)
            run(f"fsdp1{'_orig' if orig else ''}_{tag}", f1, 0.05, norm_type, gather1)
    # overflow on one rank only: every rank skips and backs off; the norm is inf on every rank
    # (NaN for a NaN in a shard: summed), as torch's clip_grad_norm_ gives on the rank with it
    for bad, tag in ((math.inf, "inf"), (math.nan, "nan")):
        run(
            f"fsdp2_overflow_{tag}",
            fully_shard(_model(), mesh=init_device_mesh("cpu", (world_size,))),
            1.0,
            2.0,
            lambda m: [p.full_tensor() for p in m.parameters()],
            poison=bad,
        )
        for norm_type in (2.0, math.inf):  # a replica's: counted from rank 0, flagged from 1
            run(
                f"ddp_overflow_{tag}_{norm_type}",
                DDP(_model()),
                1.0,
                norm_type,
                lambda m: [p.detach() for p in m.parameters()],
                poison=bad,
            )
    out["world"] = dist.get_world_size()
    return out


@pytest.mark.dist
def test_two_ranks_ddp_fsdp1_fsdp2_match_unsharded(tmp_path):
    results = run_ranks(_ranks_scenarios, tmp_path)
    r0, r1 = results
    names = [k for k in r0 if k != "world" and "overflow" not in k]
    assert len(names) == 12
    for name in names:
        for r in results:
            res = r[name]
            assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5), name
            assert res["max_param_diff"] < 1e-6, name
            assert res["collectives"] == 1, name  # ONE all-reduce for clip + step
            assert not res["skipped"] and res["scale"] == 256.0
        assert r0[name]["norm"] == r1[name]["norm"], name  # bitwise agreement
    overflows = [k for k in r0 if "overflow" in k]
    assert len(overflows) == 6
    for name in overflows:
        for r in results:
            if name == "fsdp2_overflow_nan":
                assert math.isnan(r[name]["norm"]), name
            elif name == "ddp_overflow_nan_inf":  # a MAX all-reduce may keep or drop a NaN
                assert not math.isfinite(r[name]["norm"]), name
            else:  # NaN or inf in a replica on rank 1, or inf in a shard: inf
                assert r[name]["norm"] == math.inf, name
            assert r[name]["skipped"] and r[name]["scale"] == 128.0, name
            assert r[name]["max_param_diff"] > 0  # the step was skipped: params != reference
            assert r[name]["collectives"] == 1


@pytest.mark.dist
def test_multiple_groups_not_supported(tmp_path):
    """Several process groups: a clear NotImplementedError (HSDP norms are ambiguous)."""
    results = run_ranks(_two_groups, tmp_path)
    assert results == ["NotImplementedError", "NotImplementedError"]


def _two_groups(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    g = dist.new_group([0, 1])
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = ShardedGradScaler("cpu", process_group=[dist.group.WORLD, g])
    s.scale(m(_batch()).sum()).backward()
    try:
        s.clip_grad_norm_(opt, 1.0)
    except NotImplementedError as e:
        assert "one process group" in str(e)
        return type(e).__name__
    return "no error"


@pytest.mark.parametrize("subset", [False, True])
@pytest.mark.parametrize("opt,fused", [("sgd", False), ("adamw", False), ("adamw", True)])
def test_clip_parameter_list_matches_torch_recipe(opt, fused, subset):
    """clip_grad_norm_(params): all or a subset of the parameters, then step (non-fused and
    fused): norms, gradients and parameters as torch's unscale_ + clip_grad_norm_(params); an
    overflow in the clipped set skips the step and backs the scale off."""
    a, b, oa, ob, sa, sb = _pair(opt=opt, fused=fused)
    x = _batch()
    for it in range(3):
        poison = it == 1
        _backward(a, sa, x, poison=poison)
        _backward(b, sb, x, poison=poison)
        pa = list(a.parameters())[:2] if subset else list(a.parameters())
        pb = list(b.parameters())[:2] if subset else list(b.parameters())
        na = sa.clip_grad_norm_(pa, 0.05)
        sb.unscale_(ob)
        nb = torch.nn.utils.clip_grad_norm_(pb, 0.05)
        if poison:
            assert not math.isfinite(float(na)) and not math.isfinite(float(nb))
        else:
            torch.testing.assert_close(na, nb, rtol=1e-6, atol=0)
        sa.step(oa)
        sb.step(ob)
        if not poison:  # after an overflow torch multiplies by 0 (NaN); the step is skipped
            for qa, qb in zip(a.parameters(), b.parameters(), strict=True):
                torch.testing.assert_close(qa.grad, qb.grad, rtol=1e-6, atol=1e-9, equal_nan=True)
        sa.update()
        sb.update()
        assert bool(sa.last_step_skipped(oa)) is poison
        assert sa.get_scale() == sb.get_scale() == (512.0 if it >= 1 else 1024.0)
        oa.zero_grad()
        ob.zero_grad()
        for qa, qb in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(qa, qb, rtol=1e-6, atol=1e-7)


def test_clip_parameter_list_order_errors():
    a, _, oa, _, sa, _ = _pair()
    x = _batch()
    _backward(a, sa, x)
    params = list(a.parameters())
    sa.clip_grad_norm_(params[:2], 1.0)
    with pytest.raises(RuntimeError, match="mixes parameters"):
        sa.clip_grad_norm_(params[1:3], 1.0)
    with pytest.raises(RuntimeError, match="iteration boundary"):
        sa.load_state_dict(sa.state_dict())
    g = [p.grad.clone() for p in params[:2]]
    sa.clip_grad_norm_(params[:2], 1e9)  # clipped already: as they are (no second unscale)
    assert all(torch.equal(p.grad, q) for p, q in zip(params[:2], g, strict=True))
    sa.step(oa)
    with pytest.raises(RuntimeError, match="after step"):
        sa.clip_grad_norm_(params, 1.0)
    sa.update()


def _params_clip_ranks(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=1024.0)
    out = {"skipped": [], "scale": []}
    for it in range(3):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * it + rank))
        loss = m(x).pow(2).mean()
        s.scale(loss).backward()
        for p in m.parameters():  # replicated gradients, as DDP would leave them
            torch.distributed.all_reduce(p.grad)
            p.grad /= world_size
        if it == 1 and rank == 1:
            list(m.parameters())[0].grad.view(-1)[0] = float("nan")
        s.clip_grad_norm_(list(m.parameters())[:2], 0.1)
        s.step(opt)
        s.update()
        opt.zero_grad()
        out["skipped"].append(bool(s.last_step_skipped(opt)))
        out["scale"].append(s.get_scale())
    out["params"] = [p.detach().clone() for p in m.parameters()]
    return out


@pytest.mark.dist
def test_clip_parameter_list_two_ranks_agree(tmp_path):
    r0, r1 = run_ranks(_params_clip_ranks, tmp_path)
    assert r0["skipped"] == r1["skipped"] == [False, True, False]
    assert r0["scale"] == r1["scale"] == [1024.0, 512.0, 512.0]
    for p, q in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "dtype,scale,p,value,numel",
    [
        (torch.float16, 2.0**16, 10.0, 0.5, 64),  # |S g|^10 overflows fp32 in a pow-sum
        (torch.float32, 2.0**60, 2.0, 1.0, 10**6),  # sum of squares of S g overflows fp32
        (torch.float32, 2.0**66, 2.0, 1.0, 10),
        (torch.bfloat16, 2.0**70, 2.0, 1.0, 1000),
    ],
)
def test_a_scaled_norm_past_float32_is_an_overflow(dtype, scale, p, value, numel):
    """The per-tensor norms are taken of the *scaled* gradients in fp32 (one read pass, the same
    code on every device): past fp32's range the step is an overflow, as documented: skipped
    on every rank, the scale backs off, the parameters stay as they were."""
    w = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
    opt = torch.optim.SGD([w], lr=1.0)
    s = ShardedGradScaler("cpu", init_scale=scale)
    s.scale(torch.ones(()))  # creates the scale; then write the scaled gradient by hand
    w.grad = torch.full((numel,), value * scale, dtype=dtype)
    assert math.isinf(s.clip_grad_norm_(opt, 1e30, p).item())
    s.step(opt)
    s.update()
    assert bool(s.last_step_skipped(opt)) and s.get_scale() == scale / 2
    assert torch.equal(w.detach(), torch.zeros(numel, dtype=dtype))


def test_clip_optimizer_after_clip_params_raises():
    a, _, oa, _, sa, _ = _pair()
    _backward(a, sa, _batch())
    sa.clip_grad_norm_(list(a.parameters())[:1], 1.0)
    with pytest.raises(RuntimeError, match="after clip_grad_norm_\\(params\\)"):
        sa.clip_grad_norm_(oa, 1.0)
    sa.step(oa)  # still a consistent iteration
    sa.update()


@pytest.mark.parametrize("poison", [False, True])
def test_update_without_step_after_params_clip_uses_the_clip_checks(poison):
    """As torch's update() after unscale_() without step(): the inf checks made this iteration
    (the clipped parameters' agreed flags) drive the update, and the iteration ends cleanly."""
    a, _, oa, _, sa, _ = _pair()
    _backward(a, sa, _batch())
    if poison:
        next(a.parameters()).grad[0] = math.inf
    sa.clip_grad_norm_(list(a.parameters()), 1.0)
    sa.update()
    assert sa.get_scale() == (512.0 if poison else 1024.0)
    assert sa.state_dict()["_growth_tracker"] == (0 if poison else 1)
    assert not sa._per_optimizer_states  # a clean iteration boundary (the clip below works)
    oa.zero_grad()
    _backward(a, sa, _batch())
    sa.clip_grad_norm_(list(a.parameters()), 1.0)
    sa.step(oa)
    sa.update()


def test_update_without_any_check_raises_and_changes_nothing():
    a, _, oa, _, sa, _ = _pair()
    _backward(a, sa, _batch())
    before = sa.state_dict()
    with pytest.raises(RuntimeError, match="no optimizer was stepped"):
        sa.update()
    assert sa.state_dict() == before
    sa.step(oa)  # the iteration goes on in the right order
    sa.update()
    assert sa.state_dict()["_growth_tracker"] == 1


# ----------------------------------------------- extreme scales and repeated parameters
def test_tied_parameter_listed_twice_is_unscaled_and_counted_once():
    """A tied weight gathered from two modules: one gradient, unscaled once, counted once."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    dec = torch.nn.Linear(4, 10)
    dec.weight = emb.weight
    params = list(emb.parameters()) + list(dec.parameters())  # emb.weight twice
    unique = list({id(q): q for q in params}.values())
    assert len(params) == 3 and len(unique) == 2
    s = ShardedGradScaler("cpu", init_scale=1024.0)
    s.scale(dec(emb(torch.tensor([1, 2, 3]))).pow(2).sum()).backward()
    scaled = [q.grad.clone() for q in unique]
    norm = s.clip_grad_norm_(params, 0.5)
    true = [g / 1024.0 for g in scaled]
    ref = torch.linalg.vector_norm(torch.cat([g.view(-1) for g in true]))
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
    coef = 0.5 / (ref.item() + 1e-6)
    for q, g in zip(unique, true, strict=True):
        torch.testing.assert_close(q.grad, g * coef, rtol=1e-6, atol=0)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("log2_scale", [-8, -20])
def test_a_scale_below_one_clips_as_torch_recipe(p, dtype, log2_scale):
    """Scale < 1 (a run backing off): the norms of the scaled gradients, multiplied by 1/scale,
    give torch's recipe's norm and clip (below ~2**-50 the squares of 1e-3 gradients would
    underflow fp32: the documented range of the one-pass norm)."""
    scale = 2.0**log2_scale
    true = torch.full((1000,), 1e-3, dtype=torch.float64)
    w = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
    opt = torch.optim.SGD([w], lr=0.0)
    s = ShardedGradScaler("cpu", init_scale=scale)
    s.scale(torch.ones(()))
    w.grad = (true * scale).to(dtype)  # what backward() would produce: exact (a power of 2)
    norm = s.clip_grad_norm_(opt, 0.01, p)
    unscaled = w.grad.double() / 1.0  # clipped in place
    expected = torch.linalg.vector_norm(true.to(dtype).double(), p)
    # bf16: per-tensor norms rounded to bf16 (relative error <= 2**-8), as torch's recipe
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(norm.double(), expected, rtol=rtol, atol=0)
    # clipped in place by max_norm / (norm + 1e-6), as torch.nn.utils.clip_grad_norm_
    clipped = expected * min(1.0, 0.01 / (expected.item() + 1e-6))
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(torch.linalg.vector_norm(unscaled, p), clipped, rtol=tol, atol=0)


def _tp_submesh(rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    m = parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    out = []
    for group in (None, mesh["tp"].get_group()):
        s = ShardedGradScaler("cpu", init_scale=16.0, process_group=group)
        opt.zero_grad()
        s.scale(m(torch.ones(5, 4)).pow(2).sum()).backward()
        try:
            norm = s.clip_grad_norm_(opt, 1e9).item()
        except NotImplementedError as e:
            out.append(str(e))
            continue
        full = [p.grad.full_tensor() for p in m.parameters()]
        out.append((norm, torch.linalg.vector_norm(torch.cat([g.view(-1) for g in full])).item()))
    return out


@pytest.mark.dist
def test_dtensor_on_a_sub_mesh_of_other_ranks_is_refused(tmp_path):
    """Tensor parallelism on the 'tp' sub-mesh while the scaler reduces over the world: the
    shards would be counted once per data-parallel replica; refused instead of a wrong norm.
    With the sub-mesh's own group the norm is the full gradients' norm."""
    for refused, (norm, full) in run_ranks(_tp_submesh, tmp_path):
        assert "mesh of other ranks" in refused
        assert norm == pytest.approx(full, rel=1e-6)


def test_refused_clip_leaves_no_iteration_behind():
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p, q], lr=0.1)
    s = ShardedGradScaler("cpu")
    s.scale((p + q).sum()).backward()
    s.clip_grad_norm_([p], 1.0)
    with pytest.raises(RuntimeError, match="after clip_grad_norm_\\(params\\)"):
        s.clip_grad_norm_(opt, 1.0)
    assert not s._per_optimizer_states  # no half-started iteration for opt (torch's record)
    assert s.overflow_report() is None
    s.step(opt)
    s.update()
    assert s.metrics()["steps"] == 1


@pytest.mark.parametrize("how", ["unscale_", "clip_optimizer"])
def test_parameter_listed_twice_in_an_optimizer_is_unscaled_once(how):
    """torch only warns about a tied weight listed twice in an optimizer, and its unscale_
    divides it by scale**2; here it is one gradient: unscaled once, counted once in the norm."""
    emb = torch.nn.Embedding(4, 3)
    head = torch.nn.Linear(3, 4, bias=False)
    head.weight = emb.weight
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=8.0)
    s.scale(head(emb(torch.tensor([0, 1]))).pow(2).sum()).backward()
    true = emb.weight.grad.clone() / 8.0
    if how == "unscale_":
        s.unscale_(opt)
    else:
        norm = s.clip_grad_norm_(opt, 1e9)
        torch.testing.assert_close(norm, true.norm(), rtol=1e-6, atol=0)
    assert torch.equal(emb.weight.grad, true)


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_max_norm_zero_with_a_fused_optimizer_matches_torch_recipe(opt_name):
    params = []
    for ours in (True, False):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        if opt_name == "adamw":
            opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
        else:
            opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True)
        s = (ShardedGradScaler if ours else torch.amp.GradScaler)("cpu", init_scale=1024.0)
        for _ in range(3):
            opt.zero_grad()
            s.scale(m(torch.ones(3, 4)).pow(2).sum()).backward()
            if ours:
                s.clip_grad_norm_(opt, 0.0)
            else:
                s.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.0)
            s.step(opt)
            s.update()
        assert s.get_scale() == 1024.0
        params.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*params, strict=True):
        assert torch.equal(a, b)


def test_params_clip_flags_count_once_through_the_stepped_optimizer():
    """clip_grad_norm_(params) flags count through the optimizer that owns the parameters:
    once (a frozen backbone in the clip list adds nothing), and a parameter of no optimizer
    that overflows does not mark the stepped optimizer's iteration as skipped."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for p in model[0].parameters():
        p.requires_grad_(False)  # frozen backbone, still in the clip list
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=1024.0)
    s.scale(model(torch.ones(3, 4)).sum() * math.inf).backward()
    s.clip_grad_norm_(model.parameters(), 1.0)
    s.step(opt)
    s.update()
    m = s.metrics()
    assert (m["overflows"], m["skipped_steps"], s.get_scale()) == (1, 1, 512.0)

    a, aux = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt_a = torch.optim.SGD([a], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=1024.0, max_consecutive_skips=2)
    for _ in range(3):
        opt_a.zero_grad()
        aux.grad = None
        s.scale(a.sum() + aux.sum()).backward()
        aux.grad.fill_(math.inf)  # a parameter no optimizer holds
        s.clip_grad_norm_([a], 1.0)
        s.clip_grad_norm_([aux], 1.0)
        before = a.detach().clone()
        s.step(opt_a)
        s.update()
        assert not torch.equal(before, a) and not bool(s.last_step_skipped())
    assert s.metrics()["skipped_steps"] == 0 and s.get_scale() == 1024.0


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(
    "log2_scale,p,skipped",
    [
        (10, 2.0, False),
        (10, math.inf, False),
        (100, math.inf, False),
        (124, math.inf, True),
        (100, 2.0, True),
    ],
)
def test_a_clip_past_float32_is_an_overflow_never_a_zero_update(fused, log2_scale, p, skipped):
    """Within fp32 (scale / clip_coef < 2**126, scaled norms finite) the clip matches torch's
    recipe; past it a folded factor (or grad_scale) would zero or blur the update, and the sum
    of squares overflows: the step is skipped and the scale backs off, on every device (no host
    read decides it)."""
    scale = 2.0**log2_scale
    out = []
    for ours in (True, False):
        w = torch.nn.Parameter(torch.zeros(10_000))
        opt = torch.optim.SGD([w], lr=1.0, fused=fused)
        make = ShardedGradScaler if ours else torch.amp.GradScaler
        s = make("cpu", init_scale=scale)
        s.scale(torch.ones(()))
        w.grad = torch.full((10_000,), 10.0) * scale  # finite; unscaled 2-norm 1000
        if ours:
            norm = s.clip_grad_norm_(opt, 1.0, p)
        else:
            s.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_([w], 1.0, p)
        s.step(opt)
        s.update()
        out.append((norm.item(), w.detach().clone(), s.get_scale()))
    (n_a, w_a, s_a), (n_b, w_b, s_b) = out
    assert s_b == scale
    if not skipped:
        assert n_a == n_b and s_a == scale
        torch.testing.assert_close(w_a, w_b, rtol=1e-6, atol=0)
        assert torch.linalg.vector_norm(w_a, p).item() == pytest.approx(1.0, rel=1e-4)  # clipped
    else:
        assert s_a == scale / 2 and torch.equal(w_a, torch.zeros(10_000))


@pytest.mark.parametrize("fused", [False, True])
def test_max_norm_zero_zeroes_gradients_without_an_overflow(fused):
    """max_norm=0: the clip coefficient is 0, so scale/coef is inf; that is no overflow: a
    factor of 0, or a fused grad_scale of inf (finite gradients / inf = 0)."""
    w = torch.nn.Parameter(torch.ones(10))
    opt = torch.optim.SGD([w], lr=1.0, fused=fused)
    s = ShardedGradScaler("cpu", init_scale=2.0**16)
    s.scale((w * 3.0).sum()).backward()
    s.clip_grad_norm_(opt, 0.0)
    if not fused:
        assert torch.equal(w.grad, torch.zeros(10))
    s.step(opt)
    s.update()
    assert not bool(s.last_step_skipped(opt)) and torch.equal(w.detach(), torch.ones(10))


@pytest.mark.parametrize("p", [1.0, math.inf])
def test_max_norm_inf_never_clips_even_with_flush_denormal(p):
    """max_norm=inf: the coefficient is exactly 1. Under torch.set_flush_denormal(True) torch's
    ``reciprocal() * inf`` turns a finite total above ~8.5e37 into NaN; here the gradients are
    only unscaled and the step is taken."""
    torch.set_flush_denormal(True)  # (it returns whether it is supported, not the old mode)
    try:
        w = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([w], lr=0.0)
        s = ShardedGradScaler("cpu", init_scale=1.0)
        s.scale(torch.ones(()))
        w.grad = torch.full((2,), 1e38)
        total = s.clip_grad_norm_(opt, math.inf, p)
        assert math.isfinite(total.item()) and total.item() > 8.5e37
        assert torch.equal(w.grad, torch.full((2,), 1e38))  # unscaled by 1, not clipped
        s.step(opt)
        s.update()
        assert not bool(s.last_step_skipped(opt))
    finally:
        torch.set_flush_denormal(False)  # torch's default, which every other test runs under


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_foreach_takes_torchs_meaning_with_the_same_results(foreach, norm_type):
    """foreach=False: one kernel per tensor (as torch's); the same norm and gradients."""
    out = []
    for fe in (foreach, None):
        a, _, oa, _, sa, _ = _pair(dtype=torch.float16)
        _backward(a, sa, _batch(torch.float16))
        norm = sa.clip_grad_norm_(oa, 0.05, norm_type, foreach=fe)
        out.append((norm, [p.grad.clone() for p in a.parameters()]))
    (n1, g1), (n2, g2) = out
    torch.testing.assert_close(n1, n2, rtol=1e-6, atol=0)
    for x, y in zip(g1, g2, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("scaled", [True, False])
def test_error_if_nonfinite_raises_as_torch_before_writing(scaled):
    a, b, oa, ob, sa, sb = _pair()
    if not scaled:
        sa = ShardedGradScaler("cpu", enabled=False)
    x = _batch()
    _backward(a, sa, x, poison=True)
    before = [p.grad.clone() for p in a.parameters()]
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
        sa.clip_grad_norm_(oa, 1.0, error_if_nonfinite=True)
    for p, g in zip(a.parameters(), before, strict=True):
        assert torch.equal(p.grad.nan_to_num(), g.nan_to_num())  # nothing written
    _backward(b, sb, x, poison=True)  # torch's recipe raises the same
    sb.unscale_(ob)
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
        torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0, error_if_nonfinite=True)
    if scaled:  # the iteration can still end: the step skips, the scale backs off
        sa.step(oa)
        sa.update()
        assert sa.get_scale() == 512.0


@pytest.mark.parametrize("form", ["optimizer", "params"])
@pytest.mark.parametrize("fused", [False, True])
def test_clip_after_unscale_is_torchs_recipe(form, fused):
    """scaler.unscale_(opt) then scaler.clip_grad_norm_(...) clips the unscaled gradients as
    torch.nn.utils.clip_grad_norm_ does after torch's unscale_ (the same kernels: bit for bit);
    a second clip clips them as they are again, as torch's would."""
    a, b, oa, ob, sa, sb = _pair(opt="adamw", fused=fused)
    x = _batch()
    for _ in range(2):
        _backward(a, sa, x)
        _backward(b, sb, x)
        sa.unscale_(oa)
        sb.unscale_(ob)
        target = oa if form == "optimizer" else list(a.parameters())
        for max_norm in (0.5, 0.1):
            na = sa.clip_grad_norm_(target, max_norm)
            nb = torch.nn.utils.clip_grad_norm_(b.parameters(), max_norm)
            torch.testing.assert_close(na, nb, rtol=1e-6, atol=0)
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=1e-9)
        _step_both(sa, sb, oa, ob)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_clip_params_mixing_unscaled_and_scaled_gradients_is_refused():
    a, _, oa, _, sa, _ = _pair()
    other = torch.nn.Linear(8, 4)
    oo = torch.optim.SGD(other.parameters(), lr=0.1)
    x = _batch()
    sa.scale(a(x).pow(2).mean() + other(x).pow(2).mean()).backward()
    sa.unscale_(oa)
    grads = [p.grad.clone() for p in other.parameters()]
    with pytest.raises(RuntimeError, match="mixes parameters"):
        sa.clip_grad_norm_([*a.parameters(), *other.parameters()], 1.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(other.parameters(), grads, strict=True))
    sa.step(oa)
    sa.step(oo)
    sa.update()
