"""Failures that used to pass silently (issue 21, items 6-9 and 11), checked against the right
values: a fused optimizer's clip seen from hooks, ``grad_scaler=`` optimizers behind a wrapper,
fused SGD's skipped first step, devices without float64, and the small things a new user hit
(flags, ``guard``, bounds, one log per overflow, Lightning's ``device``).

The 2-rank scenarios run in one launch of 2 gloo processes (module fixture ``results``); both
ranks train replicas on the same batches, non-finite values are injected on rank 1 only.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from _dist import run_ranks
from _optim import SelfUnscaling
from test_costs import HostReads
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardscale import ShardedGradScaler
from shardscale._policy import has_float64
from shardscale._protocol import step_kind

INF = float("inf")


def _model(n_in: int = 6, n_out: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(n_in, 8), torch.nn.Tanh(), torch.nn.Linear(8, n_out))


def _loss(model: torch.nn.Module, i: int, bad: bool = False) -> torch.Tensor:
    x = torch.randn(5, model[0].in_features, generator=torch.Generator().manual_seed(i))
    loss = model(x).pow(2).mean() * 40.0
    return loss * INF if bad else loss


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], **kw) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, **kw)


# --------------------------------------------------------------------------- 6: fused clip
def _clipped_reference(model, i, max_norm):
    """The gradients torch's recipe gives: unscaled, clipped by the global 2-norm."""
    ref = copy.deepcopy(model)
    _loss(ref, i).backward()
    unclipped = [p.grad.clone() for p in ref.parameters()]
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    return [p.grad.clone() for p in ref.parameters()], unclipped


def _fused_clip_run(register, fold=True, iterations=3, max_norm=0.5):
    """Fused AdamW, clip_grad_norm_(opt) then step; ``register(opt, seen)`` installs an
    observer that appends what it reads (or nothing). Returns (seen, params, the clipped
    reference gradients of the last iteration, the scale)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    seen: list = []
    remove = register(opt, seen)
    scaler = ShardedGradScaler("cpu")
    try:
        for i in range(iterations):
            expected, _ = _clipped_reference(model, i, max_norm)
            opt.zero_grad()
            scaler.scale(_loss(model, i)).backward()
            scaler.clip_grad_norm_(opt, max_norm, fold=fold)
            seen.append(("expected", expected))
            scaler.step(opt)
            scaler.update()
    finally:
        if remove is not None:
            remove.remove()
    return seen, _params(model), scaler.get_scale()


def _reference_fused_adamw(iterations=3, max_norm=0.5):
    """The same training without a scaler: fp32 gradients clipped by torch, fused AdamW."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for i in range(iterations):
        opt.zero_grad()
        _loss(model, i).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
    return _params(model)


def _pre_hook(opt, seen):
    def hook(optimizer, args, kwargs):
        seen.append(("hook", [p.grad.clone() for p in optimizer.param_groups[0]["params"]]))

    return opt.register_step_pre_hook(hook)


def _global_pre_hook(opt, seen):
    def hook(optimizer, args, kwargs):
        if optimizer is opt:
            seen.append(("hook", [p.grad.clone() for p in optimizer.param_groups[0]["params"]]))

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return register_optimizer_step_pre_hook(hook)


@pytest.mark.parametrize("register", [_pre_hook, _global_pre_hook], ids=["optimizer", "global"])
def test_a_step_pre_hook_sees_the_clipped_unscaled_gradients_of_a_fused_optimizer(register):
    seen, params, scale = _fused_clip_run(register)
    hooks = [g for kind, g in seen if kind == "hook"]
    expected = [g for kind, g in seen if kind == "expected"]
    assert len(hooks) == len(expected) == 3
    for got, want in zip(hooks, expected, strict=True):
        _close(got, want, rtol=1e-5, atol=1e-7)
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in got]))
        assert abs(norm.item() - 0.5) < 1e-4  # a gradient-norm logger reads 0.5, not ~2**16 * x
    _close(params, _reference_fused_adamw(), rtol=1e-5, atol=1e-6)
    assert scale == 2.0**16


def test_fold_false_writes_the_gradients_and_the_default_still_folds_where_nothing_observes():
    model = _model()
    for fold in (False, True):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = ShardedGradScaler("cpu")
        expected, unscaled = _clipped_reference(model, 0, 0.5)
        opt.zero_grad()
        scaler.scale(_loss(model, 0)).backward()
        scaler.clip_grad_norm_(opt, 0.5, fold=fold)
        grads = [p.grad.clone() for p in model.parameters()]
        if fold:  # the fold: no write pass, p.grad still holds the scaled, unclipped values
            _close(grads, [g * 2.0**16 for g in unscaled], rtol=1e-5, atol=1e-3)
            assert scaler._per_optimizer_states[id(opt)]["grad_scale"] is not None
        else:
            _close(grads, expected, rtol=1e-5, atol=1e-7)
            assert scaler._per_optimizer_states[id(opt)]["grad_scale"] is None
        scaler.step(opt)
        scaler.update()
        # the kernel writes the unscaled, clipped gradients back either way
        _close([p.grad for p in model.parameters()], expected, rtol=1e-5, atol=1e-7)
    with pytest.raises(TypeError, match="fold must be a bool"):
        scaler.clip_grad_norm_(opt, 0.5, fold="no")


def test_the_fold_still_costs_no_write_pass_where_nothing_observes():
    class Writes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = ShardedGradScaler("cpu")
    counts = {}
    for fold in (True, False):
        opt.zero_grad()
        scaler.scale(_loss(model, 0)).backward()
        with Writes() as w:
            scaler.clip_grad_norm_(opt, 0.5, fold=fold)
        counts[fold] = w.names.count("_foreach_mul_")
        scaler.step(opt)
        scaler.update()
    assert counts == {True: 0, False: 1}


# ------------------------------------------------------------- 7: grad_scaler= behind a wrapper
def _no_wraps(fn):
    def wrapper(*args, **kwargs):  # a decorator without functools.wraps (pytorch#129922)
        return fn(*args, **kwargs)

    return wrapper


class _Decorated(SelfUnscaling):
    step = _no_wraps(SelfUnscaling.step)


def _profiled(opt):
    """A profiling hook that wraps the bound method on the instance."""
    inner = opt.step
    opt.step = lambda *a, **k: inner(*a, **k)
    return opt


_WRAPPED = {
    "plain": lambda ps: SelfUnscaling(ps),
    "class_decorated": lambda ps: _Decorated(ps),
    "instance_wrapped": lambda ps: _profiled(SelfUnscaling(ps)),
    "both": lambda ps: _profiled(_Decorated(ps)),
}


def _grad_scaler_run(make_opt, make_scaler=ShardedGradScaler, bad_at=(2,), rank=1):
    model = _model()
    opt = make_opt(model.parameters())
    scaler = make_scaler("cpu", init_scale=8.0, growth_interval=2)
    out = []
    for i in range(5):
        opt.zero_grad()
        scaler.scale(_loss(model, i, bad=i in bad_at and rank == 1)).backward()
        with pytest.warns(FutureWarning, match="stop passing itself"):
            out.append(scaler.step(opt))
        scaler.update()
        out.append(scaler.get_scale())
    return out, _params(model)


@pytest.mark.parametrize("how", list(_WRAPPED))
def test_a_wrapped_grad_scaler_optimizer_still_gets_the_scaler(how):
    opt = _WRAPPED[how](_model().parameters())
    assert step_kind(opt) == "grad_scaler"
    ours, w_ours = _grad_scaler_run(_WRAPPED[how])
    theirs, w_theirs = _grad_scaler_run(SelfUnscaling, torch.amp.GradScaler)
    assert ours == theirs and ours[4] == "skipped" and ours.count("stepped") == 4
    _close(w_ours, w_theirs, rtol=0, atol=0)
    assert all(torch.isfinite(w).all() for w in w_ours)


def test_fused_optimizers_stay_fused_and_plain_ones_plain():
    ps = list(_model().parameters())
    assert step_kind(_profiled(torch.optim.AdamW(ps, fused=True))) == "fused"
    assert step_kind(torch.optim.SGD(ps, lr=0.1, fused=True)) == "fused"
    assert step_kind(_profiled(torch.optim.SGD(ps, lr=0.1))) == "plain"


# ------------------------------------------------------------- 8: fused SGD's skipped first step
def _poison_allocator(model):
    """Freed NaN blocks of the parameters' sizes: a buffer allocated next and never written
    reads NaN (what the unfixed fused kernel's empty momentum buffers then hold)."""
    junk = [torch.full_like(p, math.nan) for p in model.parameters() for _ in range(3)]
    del junk


def _sgd_run(fused, dampening, nesterov, bad_at=(0, 1), rank=1, reads=None):
    model = _model()
    opt = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9, dampening=dampening, nesterov=nesterov,
        fused=fused,
    )  # fmt: skip
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    skipped = []
    for i in range(5):
        opt.zero_grad()
        loss = _loss(model, i, bad=i in bad_at and rank == 1)
        _poison_allocator(model)
        if reads is not None:
            reads.count = 0
        with reads or _nothing():
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if reads is not None:
            skipped.append(reads.count)
        skipped.append(bool(scaler.last_step_skipped(opt)))
    return _params(model), skipped, scaler.get_scale()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


SGD_CASES = [(0.0, False), (0.0, True), (0.1, False)]


@pytest.mark.parametrize("dampening,nesterov", SGD_CASES)
def test_fused_sgd_after_skipped_first_steps_equals_the_non_fused_optimizer(dampening, nesterov):
    ref, ref_skips, ref_scale = _sgd_run(False, dampening, nesterov)
    got, skips, scale = _sgd_run(True, dampening, nesterov)
    assert skips == ref_skips == [True, True, False, False, False]
    assert scale == ref_scale == 2.0**6
    assert all(torch.isfinite(p).all() for p in got)
    _close(got, ref, rtol=1e-6, atol=1e-7)


def test_fused_sgd_with_momentum_still_reads_nothing_on_the_host():
    reads = HostReads()
    _, counts, _ = _sgd_run(True, 0.0, False, reads=reads)
    assert counts[0::2] == [0, 0, 0, 0, 0]


# ------------------------------------------------------------------- 9: no float64 on a device
class NoFloat64(TorchDispatchMode):
    """A device without float64 (Apple MPS, Intel Arc): every op whose result is float64
    fails, as there."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                raise RuntimeError(f"{func}: float64 is not supported on this device")
        return out


def _no_f64_run(kind, clip, no_float64, rank=1, **kw):
    model = _model()
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    mode = NoFloat64() if no_float64 else _nothing()
    with mode:
        scaler = ShardedGradScaler("cpu", init_scale=2.0**4, growth_interval=2, **kw)
        for i in range(6):
            opt.zero_grad()
            scaler.scale(_loss(model, i, bad=i == 2 and rank == 1)).backward()
            if clip:
                scaler.clip_grad_norm_(opt, 0.5)
            scaler.step(opt)
            scaler.update()
        metrics, state = scaler.metrics(), scaler.state_dict()
        again = ShardedGradScaler("cpu")
        again.load_state_dict(state)
        again.place("cpu")
        loaded = again.metrics()
        dtype = scaler._loss_scale.tensors.counters.dtype
    return _params(model), metrics, loaded, dtype


@pytest.mark.parametrize(
    "kw", [{}, {"hysteresis": 2, "max_consecutive_skips": 3}], ids=["plain", "rule"]
)
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_the_scaler_runs_where_the_device_has_no_float64(kind, clip, kw):
    ref, ref_metrics, _, ref_dtype = _no_f64_run(kind, clip, False, **kw)
    got, metrics, loaded, dtype = _no_f64_run(kind, clip, True, **kw)
    assert (ref_dtype, dtype) == (torch.float64, torch.float32)  # torch's float64 where it exists
    assert metrics == ref_metrics == loaded
    assert metrics["skipped_steps"] == 1 and metrics["steps"] == 6
    _close(got, ref, rtol=0, atol=0)


def test_float64_is_found_by_trying_and_a_mode_answers_for_itself():
    cpu = torch.device("cpu")
    assert has_float64(cpu)
    with NoFloat64():
        assert not has_float64(cpu)
    assert has_float64(cpu)  # the mode's answer was not remembered for the device


# -------------------------------------------------------------------- 11: small things
@pytest.mark.parametrize("value,expected", [(0, False), (1, True), (True, True), (False, False)])
def test_every_flag_takes_the_same_values(value, expected):
    s = ShardedGradScaler(
        "cpu", enabled=value, report_overflows=value, rank_local_params=value,
        dynamic=value, consecutive_hysteresis=value,
    )  # fmt: skip
    assert (s.is_enabled(), s._report_overflows, s.rank_local_params) == (expected,) * 3
    assert s.config.consecutive_hysteresis is expected and s.config.dynamic is expected
    assert type(s.is_enabled()) is bool and type(s.rank_local_params) is bool


@pytest.mark.parametrize(
    "name",
    ["enabled", "report_overflows", "rank_local_params", "dynamic", "consecutive_hysteresis"],
)
def test_every_flag_refuses_the_same_values(name):
    for bad in (2, "yes", 1.0):
        with pytest.raises(TypeError, match=f"{name} must be a bool"):
            ShardedGradScaler("cpu", **{name: bad})
    s = ShardedGradScaler("cpu")
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s.scale(w.sum()).backward()
    with pytest.raises(TypeError, match="error_if_nonfinite must be a bool"):
        s.clip_grad_norm_(opt, 1.0, error_if_nonfinite=2)
    assert s.clip_grad_norm_(opt, 1.0, error_if_nonfinite=0, foreach=1).item() > 0
    s.step(opt)
    s.update()
    assert s.overflow_report(0) is None
    with pytest.raises(TypeError, match="all_ranks must be a bool"):
        s.overflow_report(2)


def test_guard_says_why_it_takes_no_dynamic():
    with pytest.raises(
        TypeError, match=r"guard\(\) fixes the scale .* ShardedGradScaler\(\.\.\.\)"
    ):
        ShardedGradScaler.guard(dynamic=True)
    g = ShardedGradScaler.guard(max_consecutive_skips=2)
    assert g.get_scale() == 1.0 and not g.config.dynamic and g.config.max_consecutive_skips == 2


def test_the_default_init_scale_is_clamped_into_the_bounds_and_a_given_one_is_checked():
    assert ShardedGradScaler("cpu", max_scale=2.0**10).get_scale() == 2.0**10
    assert ShardedGradScaler("cpu", min_scale=2.0**20).get_scale() == 2.0**20
    assert ShardedGradScaler("cpu").get_scale() == 2.0**16
    with pytest.raises(ValueError, match=r"init_scale=65536.0 lies outside"):
        ShardedGradScaler("cpu", init_scale=2.0**16, max_scale=2.0**10)


class _DeviceLike:
    type = "cpu"


def test_device_objects_with_a_type_are_taken_as_torch_takes_them():
    for device in (torch.device("cpu"), _DeviceLike(), "cpu", "cpu:0"):
        s = ShardedGradScaler(device)
        assert s._device == "cpu"
        w = torch.nn.Parameter(torch.ones(2))
        s.scale(w.sum())  # works
    with pytest.warns(UserWarning, match="device=object names no device"):
        s = ShardedGradScaler(object())  # torch stores it unused (Lightning's tests: a Mock)
    s.scale(torch.nn.Parameter(torch.ones(2)).sum())
    assert s._scale.device.type == "cpu"
    with pytest.raises(ValueError, match="is not a device torch knows"):
        ShardedGradScaler("nonsense")


def test_report_overflows_logs_once_on_one_process(caplog):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = ShardedGradScaler("cpu", report_overflows=True, param_names=model)
    with caplog.at_level(logging.WARNING, logger="shardscale"):
        for i in range(3):
            opt.zero_grad()
            s.scale(_loss(model, i, bad=i == 1)).backward()
            s.step(opt)
            s.update()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "overflow at step 1 (loss scale 65536)"
    ]


# ------------------------------------------------------------------- Lightning (item 6 and 11)
lightning = pytest.importorskip("lightning")


def test_shardscale_precision_has_its_device_as_lightnings_mixed_precision():
    from shardscale.integrations.lightning import ShardscalePrecision

    default = "cuda" if torch.cuda.is_available() else "cpu"
    assert ShardscalePrecision("16-mixed").device == default
    assert ShardscalePrecision("bf16-mixed", device="cpu").device == "cpu"
    assert ShardscalePrecision("16-mixed", device=torch.device("cpu")).device == "cpu"
    assert ShardscalePrecision("16-mixed", device="cuda:0").device == "cuda"
    assert ShardscalePrecision("16-mixed", device=_DeviceLike()).device == "cpu"
    with pytest.raises(TypeError, match="device must be a device type"):
        ShardscalePrecision("16-mixed", device=3)
    p = ShardscalePrecision("16-mixed")
    model = torch.nn.Linear(2, 2)  # the Trainer connects the model: its parameters' device
    p.connect(model, [], [])
    assert p.device == "cpu"
    with p.forward_context():
        assert torch.is_autocast_enabled("cpu")


def test_shardscale_precision_clips_without_folding_outside_lightnings_own_loop():
    """Manual optimization: ``self.clip_gradients`` then user code, then ``opt.step()``: the
    gradients read in between are the unscaled, clipped ones, with a fused optimizer too."""
    from shardscale.integrations.lightning import ShardscalePrecision

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    plugin = ShardscalePrecision("16-mixed", device="cpu")
    expected, _ = _clipped_reference(model, 0, 0.5)
    plugin.scaler.scale(_loss(model, 0)).backward()
    plugin.clip_grad_by_norm(opt, 0.5)
    _close([p.grad for p in model.parameters()], expected, rtol=1e-5, atol=1e-7)
    plugin._step(opt)
    _close(_params(model), _reference_fused_adamw(iterations=1), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ 2 ranks
def _two_ranks(rank: int, world_size: int) -> dict:
    out: dict = {}

    # 6: a pre-hook on a fused optimizer, identical (replicated) gradients, an overflow on rank 1
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    seen = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append([p.grad.clone() for p in o.param_groups[0]["params"]])
    )
    scaler = ShardedGradScaler("cpu")
    expected = []
    for i in range(4):
        expected.append(_clipped_reference(model, i, 0.5)[0])
        opt.zero_grad()
        scaler.scale(_loss(model, i, bad=i == 2 and rank == 1)).backward()
        scaler.clip_grad_norm_(opt, 0.5)
        scaler.step(opt)
        scaler.update()
    out["clip"] = (
        [seen[i] for i in (0, 1, 3)],
        [expected[i] for i in (0, 1, 3)],
        _params(model),
        scaler.get_scale(),
    )

    # 7: a wrapped grad_scaler= optimizer, inf on rank 1 only
    out["grad_scaler"] = _grad_scaler_run(_WRAPPED["both"], rank=rank)

    # 8: fused SGD whose first two steps rank 1 overflows
    out["sgd"] = {
        (d, n): (_sgd_run(True, d, n, rank=rank), _sgd_run(False, d, n, rank=rank))
        for d, n in SGD_CASES
    }

    # 9: no float64, agreement over gloo
    out["no_f64"] = (_no_f64_run("adamw_fused", True, True, rank=rank)[:2],
                     _no_f64_run("adamw_fused", True, False, rank=rank)[:2])  # fmt: skip

    # 11: report_overflows logs once, with every rank's entries
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    log = logging.getLogger("shardscale")
    log.addHandler(handler)
    try:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", report_overflows=True, param_names=model)
        for i in range(3):
            opt.zero_grad()
            scaler.scale(_loss(model, i)).backward()
            if i == 1 and rank == 1:
                model[2].bias.grad[0] = math.nan
            scaler.step(opt)
            scaler.update()
    finally:
        log.removeHandler(handler)
    out["logged"] = records
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_two_ranks, tmp_path_factory.mktemp("silent"))


@pytest.mark.dist
def test_two_ranks_a_hook_sees_the_clipped_gradients_and_both_skip_the_overflow(results):
    for r in results:
        seen, expected, _, scale = r["clip"]
        for got, want in zip(seen, expected, strict=True):
            _close(got, want, rtol=1e-5, atol=1e-7)
        assert scale == 2.0**15  # one overflow, on rank 1, backed off on both
    (_, _, p0, _), (_, _, p1, _) = (r["clip"] for r in results)
    _close(p0, p1, rtol=0, atol=0)


@pytest.mark.dist
def test_two_ranks_a_wrapped_grad_scaler_optimizer_skips_with_the_other_rank(results):
    (out0, w0), (out1, w1) = (r["grad_scaler"] for r in results)
    assert out0 == out1 and out0[4] == "skipped" and out0[5] == 8.0
    _close(w0, w1, rtol=0, atol=0)
    assert all(torch.isfinite(w).all() for w in w0)


@pytest.mark.dist
def test_two_ranks_fused_sgd_after_skipped_first_steps_equals_non_fused(results):
    for case in SGD_CASES:
        (f0, n0), (f1, n1) = (r["sgd"][case] for r in results)
        for fused, plain in ((f0, n0), (f1, n1)):
            assert fused[1] == plain[1] == [True, True, False, False, False]
            assert fused[2] == plain[2] == 2.0**6
            _close(fused[0], plain[0], rtol=1e-6, atol=1e-7)
        _close(f0[0], f1[0], rtol=0, atol=0)


@pytest.mark.dist
def test_two_ranks_without_float64_agree_and_match_the_float64_run(results):
    for r in results:
        (got, metrics), (ref, ref_metrics) = r["no_f64"]
        assert metrics == ref_metrics and metrics["skipped_steps"] == 1
        _close(got, ref, rtol=0, atol=0)
    _close(results[0]["no_f64"][0][0], results[1]["no_f64"][0][0], rtol=0, atol=0)


@pytest.mark.dist
def test_two_ranks_report_overflows_logs_each_overflow_once(results):
    l0, l1 = (r["logged"] for r in results)
    assert len(l0) == 1 and l1 == []
    assert l0[0].startswith("overflow at step 1 (loss scale 65536):")
    assert "rank 1: 2.bias" in l0[0] and "rank 0" not in l0[0]
