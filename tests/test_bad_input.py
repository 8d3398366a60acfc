"""Bad input: every public method of ShardedGradScaler with wrong types, wrong structures,
non-finite or out-of-range values, wrong call orders and wrong devices.

``test_bad_input`` is ONE parametrized table. Each case builds a scaler at an iteration stage
(``fresh``: never scaled; ``scaled``: after ``scale().backward()``; ``unscaled``: after
``unscale_``; ``stepped``: after ``step``; ``updated``: after a full iteration), snapshots its
state (``state_dict()``, whether the scale exists, every optimizer's stage and flag, the config,
the gradients), makes the bad call, and checks that it raises the expected exception type with a
message naming the problem or the fix, and that the snapshot is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardscale import ShardedGradScaler

try:
    from shardscale import _clip  # noqa: F401

    HAVE_CLIP = True
except ImportError:  # clip_grad_norm_ not implemented in this checkout
    HAVE_CLIP = False

STAGES = ("fresh", "scaled", "unscaled", "stepped", "updated")


class _Duck:
    """Looks like an optimizer but holds a non-tensor parameter."""

    def __init__(self) -> None:
        self.param_groups = [{"params": [1.0]}]

    def step(self) -> None:  # pragma: no cover - never reached
        pass


def _build(stage: str, fused: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    scaler = ShardedGradScaler(
        "cpu", init_scale=1024.0, growth_interval=3, hysteresis=2, min_scale=1.0, max_scale=2.0**20
    )
    if stage == "fresh":
        return scaler, model, opt
    if stage == "updated":  # one full iteration first: non-trivial tracker and counters
        scaler.scale(model(torch.ones(4, 3)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        return scaler, model, opt
    scaler.scale(model(torch.ones(4, 3)).sum()).backward()
    if stage in ("unscaled", "stepped"):
        scaler.unscale_(opt)
    if stage == "stepped":
        scaler.step(opt)
    return scaler, model, opt


def _skipped(scaler: ShardedGradScaler, opt: torch.optim.Optimizer) -> bool | None:
    try:
        return bool(scaler.last_step_skipped(opt))
    except RuntimeError:  # never stepped
        return None


def _snapshot(
    scaler: ShardedGradScaler, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> dict[str, Any]:
    return {
        "state_dict": scaler.state_dict(),
        "has_scale": scaler._scale is not None,
        "stages": {
            k: (v["stage"], [float(f) for f in v["found_inf_per_device"].values()])
            for k, v in scaler._per_optimizer_states.items()
        },
        "config": scaler.config,
        "skipped": _skipped(scaler, opt),
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, list):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y, strict=True))
        return x == y

    return all(eq(a[k], b[k]) for k in a)


def _gen():
    yield torch.tensor(1.0)


def _sd(**changes: Any) -> Callable[[ShardedGradScaler], dict[str, Any]]:
    """A state dict of the scaler itself with some entries changed (None value: removed)."""

    def make(s: ShardedGradScaler) -> dict[str, Any]:
        sd = s.state_dict()
        for k, v in changes.items():
            if v is None:
                sd.pop(k)
            else:
                sd[k] = v
        return sd

    return make


NAN, INF = math.nan, math.inf
T = torch.tensor
# (id, stage, call(scaler, model, opt), exception, regex the message must match)
C = Callable[[ShardedGradScaler, torch.nn.Module, torch.optim.Optimizer], Any]
CASES: list[tuple[str, str, C, type[BaseException], str]] = []


def case(cid: str, stage: str, call: C, exc: type[BaseException], match: str) -> None:
    CASES.append((cid, stage, call, exc, match))


# ---------------------------------------------------------------- constructor
def ctor(**kw: Any) -> C:
    return lambda s, m, o: ShardedGradScaler(**kw)


for cid, kw, exc, match in [
    ("device_int", {"device": 3}, TypeError, "device must be"),
    ("device_meta", {"device": "meta"}, ValueError, "device='meta' holds no data"),
    ("device_meta_obj", {"device": torch.device("meta")}, ValueError, "holds no data"),
    ("enabled_str", {"enabled": "yes"}, TypeError, "enabled must be a bool"),
    ("init_scale_nan", {"init_scale": NAN}, ValueError, "init_scale must be finite"),
    ("init_scale_inf", {"init_scale": INF}, ValueError, "init_scale must be finite"),
    ("init_scale_zero", {"init_scale": 0.0}, ValueError, "init_scale must be > 0"),
    ("init_scale_negative", {"init_scale": -1.0}, ValueError, "init_scale must be > 0"),
    ("init_scale_str", {"init_scale": "1024"}, TypeError, "init_scale must be a real number"),
    (
        "init_scale_2elem_tensor",
        {"init_scale": torch.tensor([2.0, 3.0])},
        TypeError,
        "init_scale must be a real number",
    ),
    ("init_scale_bool", {"init_scale": True}, TypeError, "init_scale"),
    ("init_scale_above_max", {"init_scale": 8.0, "max_scale": 4.0}, ValueError, "outside"),
    ("init_scale_below_min", {"init_scale": 0.5, "min_scale": 1.0}, ValueError, "outside"),
    ("growth_factor_1", {"growth_factor": 1.0}, ValueError, "growth_factor must be > 1"),
    ("growth_factor_nan", {"growth_factor": NAN}, ValueError, "growth_factor must be finite"),
    ("growth_factor_inf", {"growth_factor": INF}, ValueError, "growth_factor must be finite"),
    ("growth_factor_str", {"growth_factor": "2"}, TypeError, "growth_factor"),
    (
        "backoff_factor_0",
        {"backoff_factor": 0.0},
        ValueError,
        r"backoff_factor must be in \(0, 1\)",
    ),
    (
        "backoff_factor_1",
        {"backoff_factor": 1.0},
        ValueError,
        r"backoff_factor must be in \(0, 1\)",
    ),
    ("backoff_factor_2", {"backoff_factor": 2.0}, ValueError, "backoff_factor"),
    ("backoff_factor_nan", {"backoff_factor": NAN}, ValueError, "backoff_factor must be finite"),
    ("growth_interval_0", {"growth_interval": 0}, ValueError, "growth_interval must be >= 1"),
    ("growth_interval_neg", {"growth_interval": -3}, ValueError, "growth_interval must be >= 1"),
    ("growth_interval_float", {"growth_interval": 1.5}, TypeError, "growth_interval must be"),
    ("growth_interval_bool", {"growth_interval": True}, TypeError, "growth_interval must be"),
    ("min_scale_0", {"min_scale": 0.0}, ValueError, "min_scale must be"),
    ("min_scale_neg", {"min_scale": -1.0}, ValueError, "min_scale must be"),
    ("min_scale_nan", {"min_scale": NAN}, ValueError, "min_scale must be finite"),
    ("max_scale_inf", {"max_scale": INF}, ValueError, "max_scale must be finite"),
    ("max_below_min", {"min_scale": 4.0, "max_scale": 2.0}, ValueError, "max_scale"),
    ("hysteresis_0", {"hysteresis": 0}, ValueError, "hysteresis must be >= 1"),
    ("hysteresis_float", {"hysteresis": 1.5}, TypeError, "hysteresis must be"),
    ("hysteresis_2pow31", {"hysteresis": 2**31}, ValueError, "hysteresis must be <= 2147483647"),
    (
        "growth_interval_2pow63",
        {"growth_interval": 2**63},
        ValueError,
        "growth_interval must be <=",
    ),
    ("consecutive_hysteresis_str", {"consecutive_hysteresis": "y"}, TypeError, "must be a bool"),
    ("dynamic_str", {"dynamic": "no"}, TypeError, "dynamic must be a bool"),
    ("max_consecutive_skips_0", {"max_consecutive_skips": 0}, ValueError, "max_consecutive"),
    ("on_collapse_bad", {"on_collapse": "ignore"}, ValueError, "on_collapse must be"),
    ("process_group_str", {"process_group": "gloo"}, TypeError, "process_group must be"),
    ("process_group_empty_list", {"process_group": []}, TypeError, "process_group must be"),
    ("process_group_list_of_int", {"process_group": [1]}, TypeError, "process_group sequence"),
    ("param_names_list", {"param_names": [T(1.0)]}, TypeError, "param names must come"),
    ("rank_local_params_int", {"rank_local_params": 2}, TypeError, "rank_local_params must be"),
    ("report_overflows_str", {"report_overflows": "no"}, TypeError, "report_overflows must be"),
    ("param_names_bad_values", {"param_names": {"w": 5}}, TypeError, "param names must map"),
]:
    case(f"ctor-{cid}", "fresh", ctor(**kw), exc, match)

# ---------------------------------------------------------------------- scale
SCALE_BAD = [
    ("dict", lambda: {"loss": T(1.0)}, TypeError, "got dict"),
    ("str", lambda: "loss", TypeError, "got str"),
    ("int", lambda: 3, TypeError, "got int"),
    ("float", lambda: 3.0, TypeError, "got float"),
    ("none", lambda: None, TypeError, "got NoneType"),
    ("set", lambda: {1.0}, TypeError, "got set"),
    ("generator", _gen, TypeError, "got generator"),
    ("empty_list", lambda: [], TypeError, "no tensor in it"),
    ("empty_nested", lambda: [(), []], TypeError, "no tensor in it"),
    ("int_tensor", lambda: T(3), TypeError, "floating-point tensors"),
    ("bool_tensor", lambda: T(True), TypeError, "floating-point tensors"),
    ("list_with_str", lambda: [T(1.0), "x"], TypeError, "got str"),
    ("nested_int_tensor", lambda: [(T(1.0), [T([1, 2])])], TypeError, "floating-point"),
    ("meta_tensor", lambda: torch.ones((), device="meta"), ValueError, "meta device"),
]
for stage in ("fresh", "updated"):
    for cid, make, exc, match in SCALE_BAD:
        case(f"scale-{cid}-{stage}", stage, lambda s, m, o, f=make: s.scale(f()), exc, match)

# ---------------------------------------------------------------- unscale_/step
for meth in ("unscale_", "step"):
    call = (lambda name: lambda s, m, o, x=None: getattr(s, name))(meth)
    case(
        f"{meth}-module", "scaled", lambda s, m, o, n=meth: getattr(s, n)(m), TypeError, "Optimizer"
    )
    case(
        f"{meth}-none",
        "scaled",
        lambda s, m, o, n=meth: getattr(s, n)(None),
        TypeError,
        "Optimizer",
    )
    case(
        f"{meth}-non_tensor_param",
        "scaled",
        lambda s, m, o, n=meth: getattr(s, n)(_Duck()),
        TypeError,
        "must be tensors",
    )
    case(
        f"{meth}-after_step",
        "stepped",
        lambda s, m, o, n=meth: getattr(s, n)(o),
        RuntimeError,
        "after step|already",
    )
case(
    "unscale_-twice", "unscaled", lambda s, m, o: s.unscale_(o), RuntimeError, "already been called"
)
case(
    "step-closure",
    "scaled",
    lambda s, m, o: s.step(o, closure=lambda: 0.0),
    RuntimeError,
    "Closure",
)


def _meta_opt(s, m, o, meth):
    p = torch.nn.Parameter(torch.ones(2, device="meta"))
    p.grad = torch.ones(2, device="meta")
    getattr(s, meth)(torch.optim.SGD([p], lr=0.1))


case(
    "unscale_-meta_grads",
    "scaled",
    lambda s, m, o: _meta_opt(s, m, o, "unscale_"),
    ValueError,
    "meta device",
)
case(
    "step-meta_grads",
    "scaled",
    lambda s, m, o: _meta_opt(s, m, o, "step"),
    ValueError,
    "meta device",
)

# ------------------------------------------------------------ abandon and place
case("abandon-argument", "unscaled", lambda s, m, o: s.abandon(o), TypeError, "argument")
case("place-none", "fresh", lambda s, m, o: s.place(None), TypeError, "device must be")
case("place-meta", "scaled", lambda s, m, o: s.place("meta"), ValueError, "meta device")

# --------------------------------------------------------------------- update
case(
    "update-before_scale",
    "fresh",
    lambda s, m, o: s.update(),
    RuntimeError,
    "no optimizer was stepped",
)
case(
    "update-without_step",
    "scaled",
    lambda s, m, o: s.update(),
    RuntimeError,
    "no optimizer was stepped",
)
case(
    "update-twice", "updated", lambda s, m, o: s.update(), RuntimeError, "no optimizer was stepped"
)
for cid, value, exc, match in [
    ("nan", NAN, ValueError, "new_scale must be finite"),
    ("inf", INF, ValueError, "new_scale must be finite"),
    ("zero", 0.0, ValueError, "new_scale must be > 0"),
    ("negative", -1.0, ValueError, "new_scale must be > 0"),
    ("above_max", 2.0**21, ValueError, "outside"),
    ("below_min", 0.5, ValueError, "outside"),
    ("str", "2", TypeError, "new_scale must be a real number"),
    ("list", [2.0], TypeError, "new_scale"),
    ("tensor_nan", T(NAN), ValueError, "new_scale must be finite"),
    ("tensor_2_elements", T([2.0, 4.0]), ValueError, "1-element"),
    ("tensor_int", T(2), ValueError, "floating-point"),
    ("tensor_requires_grad", T(2.0, requires_grad=True), ValueError, "requires_grad"),
    ("tensor_meta", torch.ones((), device="meta"), ValueError, "meta device"),
]:
    match += ".*update\\(\\) changed nothing"  # and the fix: the iteration is still open
    case(f"update-new_scale_{cid}", "stepped", lambda s, m, o, v=value: s.update(v), exc, match)

# ------------------------------------------------------------ getters/setters
for name, values in {
    "growth_factor": [
        (1.0, ValueError),
        (0.5, ValueError),
        (NAN, ValueError),
        (INF, ValueError),
        ("2", TypeError),
        (None, TypeError),
        (True, TypeError),
    ],
    "backoff_factor": [
        (0.0, ValueError),
        (1.0, ValueError),
        (1.5, ValueError),
        (NAN, ValueError),
        (None, TypeError),
    ],
    "growth_interval": [
        (0, ValueError),
        (-1, ValueError),
        (2.5, TypeError),
        ("10", TypeError),
        (None, TypeError),
        (True, TypeError),
    ],
}.items():
    for value, exc in values:
        for stage in ("fresh", "stepped"):
            case(
                f"set_{name}-{value!r}-{stage}",
                stage,
                lambda s, m, o, n=name, v=value: getattr(s, f"set_{n}")(v),
                exc,
                name,
            )
    case(
        f"get_{name}-extra_arg",
        "updated",
        lambda s, m, o, n=name: getattr(s, f"get_{n}")(1),
        TypeError,
        "argument",
    )
case("get_scale-extra_arg", "updated", lambda s, m, o: s.get_scale(1), TypeError, "argument")
case("metrics-extra_arg", "updated", lambda s, m, o: s.metrics(1), TypeError, "argument")
case("state_dict-extra_arg", "updated", lambda s, m, o: s.state_dict({}), TypeError, "argument")
case(
    "overflow_report-all_ranks_int",
    "updated",
    lambda s, m, o: s.overflow_report(2),
    TypeError,
    "all_ranks must be a bool",
)
case(
    "overflow_report-extra_arg",
    "updated",
    lambda s, m, o: s.overflow_report(True, 1),
    TypeError,
    "argument",
)
case(
    "numerics-all_ranks_int",
    "updated",
    lambda s, m, o: s.numerics(1),
    TypeError,
    "all_ranks must be a bool",
)
case("numerics-extra_arg", "updated", lambda s, m, o: s.numerics(True, 1), TypeError, "argument")
case("join_hook-positional", "updated", lambda s, m, o: s.join_hook(1), TypeError, "argument")

# ------------------------------------------------------------ load_state_dict
for cid, make, exc, match in [
    ("str", lambda s: "ckpt.pt", TypeError, "state_dict must be a dict"),
    ("none", lambda s: None, TypeError, "state_dict must be a dict"),
    ("list", lambda s: [("scale", 2.0)], TypeError, "state_dict must be a dict"),
    ("empty", lambda s: {}, RuntimeError, "empty"),
    ("missing_scale", _sd(scale=None), ValueError, "missing the keys"),
    ("missing_tracker", _sd(_growth_tracker=None), ValueError, "missing the keys"),
    ("scale_nan", _sd(scale=NAN), ValueError, "finite"),
    ("scale_inf", _sd(scale=INF), ValueError, "finite"),
    ("scale_zero", _sd(scale=0.0), ValueError, "> 0"),
    ("scale_negative", _sd(scale=-1024.0), ValueError, "> 0"),
    ("scale_str", _sd(scale="1024"), TypeError, "scale"),
    ("scale_above_max", _sd(scale=2.0**30), ValueError, "outside"),
    ("tracker_negative", _sd(_growth_tracker=-1), ValueError, "_growth_tracker"),
    ("tracker_float", _sd(_growth_tracker=1.5), TypeError, "_growth_tracker"),
    ("tracker_str", _sd(_growth_tracker="1"), TypeError, "_growth_tracker"),
    ("growth_factor_half", _sd(growth_factor=0.5), ValueError, "growth_factor"),
    ("backoff_factor_2", _sd(backoff_factor=2.0), ValueError, "backoff_factor"),
    ("growth_interval_0", _sd(growth_interval=0), ValueError, "growth_interval"),
    ("hysteresis_0", _sd(hysteresis=0), ValueError, "hysteresis"),
    ("min_above_max", _sd(min_scale=2.0**21), ValueError, "max_scale|outside"),
    ("on_collapse_bad", _sd(on_collapse="ignore"), ValueError, "on_collapse"),
    ("hysteresis_tracker_negative", _sd(_hysteresis_tracker=-1), ValueError, "_hysteresis_tracker"),
    ("hysteresis_tracker_above", _sd(_hysteresis_tracker=5), ValueError, "exceeds hysteresis"),
    ("counters_list", _sd(_counters=[1, 2]), ValueError, "_counters"),
    ("counters_unknown_key", _sd(_counters={"epochs": 1}), ValueError, "_counters"),
    ("counters_negative", _sd(_counters={"steps": -1}), ValueError, "steps"),
    ("counters_2pow63", _sd(_counters={"steps": 2**63}), ValueError, "64-bit"),
    ("tracker_2pow40", _sd(_growth_tracker=2**40), ValueError, "32-bit"),
    ("hysteresis_2pow40", _sd(hysteresis=2**40, _hysteresis_tracker=2**40), ValueError, "32-bit"),
]:
    for stage in ("fresh", "updated"):
        case(
            f"load_state_dict-{cid}-{stage}",
            stage,
            lambda s, m, o, f=make: s.load_state_dict(f(s)),
            exc,
            match,
        )
case(
    "load_state_dict-mid_iteration",
    "unscaled",
    lambda s, m, o: s.load_state_dict(s.state_dict()),
    RuntimeError,
    "iteration boundary",
)
case(
    "load_state_dict-mid_iteration_stepped",
    "stepped",
    lambda s, m, o: s.load_state_dict(s.state_dict()),
    RuntimeError,
    "iteration boundary",
)

# ----------------------------------------------------------------- reporting
case(
    "last_step_skipped-never_updated",
    "fresh",
    lambda s, m, o: s.last_step_skipped(),
    RuntimeError,
    "update\\(\\) has not been called",
)
case(
    "last_step_skipped-opt_never_stepped",
    "unscaled",
    lambda s, m, o: s.last_step_skipped(o),
    RuntimeError,
    "not been stepped",
)
case(
    "last_step_skipped-not_an_optimizer",
    "updated",
    lambda s, m, o: s.last_step_skipped("opt"),
    RuntimeError,
    "not been stepped",
)
for cid, value, match in [
    ("int", 5, "param names must come"),
    ("str", "model", "param names must come"),
    ("list", [T(1.0)], "param names must come"),
    ("values_not_tensors", {"w": 5}, "param names must map"),
    ("keys_not_str", {1: T(1.0)}, "param names must map"),
]:
    case(
        f"set_param_names-{cid}",
        "scaled",
        lambda s, m, o, v=value: s.set_param_names(v),
        TypeError,
        match,
    )

# ----------------------------------------------------------------- clip_grad_norm_
if HAVE_CLIP:
    for cid, stage, args, exc, match in [
        ("max_norm_negative", "scaled", (-1.0,), ValueError, "max_norm"),
        ("max_norm_nan", "scaled", (NAN,), ValueError, "max_norm"),
        ("max_norm_str", "scaled", ("1",), TypeError, "max_norm"),
        ("max_norm_none", "scaled", (None,), TypeError, "max_norm"),
        ("norm_type_0", "scaled", (1.0, 0.0), ValueError, "norm_type"),
        ("norm_type_negative", "scaled", (1.0, -2.0), ValueError, "norm_type"),
        ("norm_type_str", "scaled", (1.0, "two"), ValueError, "norm_type"),
        ("after_step", "stepped", (1.0,), RuntimeError, "after step"),
    ]:
        case(
            f"clip_grad_norm_-{cid}",
            stage,
            lambda s, m, o, a=args: s.clip_grad_norm_(o, *a),
            exc,
            match,
        )
    case(
        "clip_grad_norm_-non_tensor_list",
        "scaled",
        lambda s, m, o: s.clip_grad_norm_([1.0, 2.0], 1.0),
        TypeError,
        "pass tensors",
    )
    case(
        "clip_grad_norm_-non_tensor_param",
        "scaled",
        lambda s, m, o: s.clip_grad_norm_(_Duck(), 1.0),
        TypeError,
        "tensors",
    )
    case(
        "clip_grad_norm_-meta_grads",
        "scaled",
        lambda s, m, o: _meta_opt_clip(s),
        ValueError,
        "meta",
    )


def _meta_opt_clip(s):
    p = torch.nn.Parameter(torch.ones(2, device="meta"))
    p.grad = torch.ones(2, device="meta")
    s.clip_grad_norm_(torch.optim.SGD([p], lr=0.1), 1.0)


@pytest.mark.parametrize("stage,call,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(stage, call, exc, match):
    scaler, model, opt = _build(stage)
    before = _snapshot(scaler, model, opt)
    with pytest.raises(exc, match=match):
        call(scaler, model, opt)
    assert _same(before, _snapshot(scaler, model, opt)), "a failed call changed the scaler's state"
    # and the scaler still works: finish the iteration like a user would after fixing the call
    if stage in ("fresh", "updated"):
        opt.zero_grad()
        scaler.scale(model(torch.ones(4, 3)).sum()).backward()
    if stage != "stepped":
        scaler.step(opt)
    scaler.update()
    assert scaler.metrics()["steps"] == (2 if stage == "updated" else 1)


def test_every_public_method_is_covered():
    public = {
        n
        for n in dir(ShardedGradScaler)
        if not n.startswith("_") and callable(getattr(ShardedGradScaler, n))
    } - {"guard", "is_enabled"}  # guard: constructor cases; is_enabled: takes nothing
    covered = {c[0].split("-")[0] for c in CASES} | {"get_scale"}
    covered |= {"__init__"} if any(c[0].startswith("ctor-") for c in CASES) else set()
    missing = public - covered - ({"clip_grad_norm_"} if not HAVE_CLIP else set())
    assert not missing, f"no bad-input case for {sorted(missing)}"
    assert len(CASES) >= 200


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adamw"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_nonfinite_loss_is_an_overflow_not_an_error(bad, fused):
    """A NaN/inf loss given to scale() is the ordinary overflow path: the step is skipped."""
    scaler, model, opt = _build("fresh", fused=fused)
    params = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(4, 3)).sum() * bad
    scaled = scaler.scale(loss)  # no error
    assert not math.isfinite(float(scaled.detach()))
    scaled.backward()
    scaler.step(opt)
    scaler.update()
    assert bool(scaler.last_step_skipped(opt)) and bool(scaler.last_step_skipped())
    for p, q in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, q)
    m = scaler.metrics()
    # hysteresis=2: the first overflow is absorbed (scale kept, tracker 2 -> 1), the second backs off
    assert (m["scale"], m["hysteresis_tracker"], m["skipped_steps"]) == (1024.0, 1, 1)
    opt.zero_grad()
    scaler.scale(model(torch.ones(4, 3)).sum() * bad).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0 and scaler.metrics()["skipped_steps"] == 2
    # a finite loss afterwards steps normally
    opt.zero_grad()
    scaler.scale(model(torch.ones(4, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert not bool(scaler.last_step_skipped(opt))
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))


@pytest.mark.parametrize("bad_first", [False, True], ids=["bad_last", "bad_first"])
@pytest.mark.parametrize("call", ["unscale_", "step", "clip_optimizer", "clip_params"])
def test_a_gradient_sharing_memory_is_refused_before_anything_is_written(bad_first, call) -> None:
    """An expanded (stride-0) gradient cannot be multiplied in place. torch's kernels refuse it
    when they reach it, after writing the gradients before it; a retry then divided those twice
    (found by the session-5 trial). shardscale refuses it before writing anything, naming the
    parameter; after the fix the message names, the iteration completes as if nothing happened."""
    good = torch.nn.Parameter(torch.zeros(3))
    bad = torch.nn.Parameter(torch.zeros(4, 4))
    opt = torch.optim.SGD([bad, good] if bad_first else [good, bad], lr=1.0)
    named = call != "step"  # step: no names given, the position names it
    scaler = ShardedGradScaler(
        "cpu", init_scale=4.0, param_names={"good": good, "bad": bad} if named else None
    )
    scaler.scale(torch.tensor(1.0))
    good.grad = torch.full((3,), 4.0)
    bad.grad = torch.tensor([4.0]).expand(4, 4)

    def run() -> None:
        if call == "unscale_":
            scaler.unscale_(opt)
        elif call == "step":
            scaler.step(opt)
        elif call == "clip_optimizer":
            scaler.clip_grad_norm_(opt, 1e9)
        else:
            scaler.clip_grad_norm_([good, bad], 1e9)

    before = scaler.state_dict()
    who = "bad" if named else f"parameter {0 if bad_first else 1} of the optimizer"
    with pytest.raises(ValueError, match=rf"the gradient of {who}.*share memory.*clone\(\)"):
        run()
    assert torch.equal(good.grad, torch.full((3,), 4.0))  # nothing was unscaled
    assert scaler.state_dict() == before and not scaler._per_optimizer_states

    bad.grad = torch.full((4, 4), 4.0)  # the fix the message names
    run()
    if call != "step":
        scaler.step(opt)
    scaler.update()
    assert torch.equal(good.detach(), torch.full((3,), -1.0))
    assert torch.equal(bad.detach(), torch.full((4, 4), -1.0))


def test_overlapping_views_are_refused_and_strided_views_are_not() -> None:
    """An ``as_strided`` view over itself (no stride 0: torch's check says "too hard to tell"
    and torch's kernels multiply it silently, shared elements several times) is refused, named
    also for sparse values; slices, transposes and permutations are unscaled as torch does. The
    error survives copy and pickle (DataLoader workers, process pools)."""
    import copy
    import pickle

    from shardscale import SharedMemoryGradError

    good = torch.nn.Parameter(torch.zeros(3))
    bad = torch.nn.Parameter(torch.zeros(3, 3))
    opt = torch.optim.SGD([good, bad], lr=1.0)
    scaler = ShardedGradScaler("cpu", init_scale=4.0, param_names={"good": good, "bad": bad})
    scaler.scale(torch.tensor(1.0))
    good.grad = torch.full((3,), 4.0)
    bad.grad = torch.full((6,), 4.0).as_strided((3, 3), (1, 1))
    with pytest.raises(SharedMemoryGradError, match="the gradient of bad .*overlapping") as info:
        scaler.unscale_(opt)
    assert torch.equal(good.grad, torch.full((3,), 4.0)) and not scaler._per_optimizer_states
    err = info.value
    for again in (copy.copy(err), pickle.loads(pickle.dumps(err))):
        assert str(again) == str(err) and again.name == "bad"

    sparse = torch.nn.Parameter(torch.zeros(5))
    sparse.grad = torch.sparse_coo_tensor(
        torch.tensor([[0, 1, 2]]),
        torch.tensor([4.0]).expand(3),
        (5,),
        is_coalesced=True,
        check_invariants=False,
    )
    opt2 = torch.optim.SGD([good, sparse], lr=1.0)
    scaler.set_param_names({"good": good, "sparse": sparse})
    with pytest.raises(SharedMemoryGradError, match="the gradient of sparse "):
        scaler.unscale_(opt2)  # its values are a new object per call: found by their memory

    # strided, non-overlapping layouts go through, bit for bit as torch.amp.GradScaler
    base = torch.randn(8, 8) * 1024
    views = [
        lambda b: b[::2],
        lambda b: b.t(),
        lambda b: b[:, 1::3],
        lambda b: b.reshape(4, 4, 4).permute(2, 0, 1),
    ]
    results = []
    for scaler_ in (ShardedGradScaler("cpu", 1024.0), torch.amp.GradScaler("cpu", 1024.0)):
        grads = [view(base.clone()) for view in views]  # each a view into its own copy
        assert not any(g.is_contiguous() for g in grads)
        params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        opt3 = torch.optim.SGD(params, lr=1.0)
        scaler_.scale(torch.tensor(1.0))
        scaler_.step(opt3)
        scaler_.update()
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_the_swapped_factors_hint_comes_only_when_they_look_swapped():
    # torch's FSDP ShardedGradScaler(device, init_scale, backoff_factor, growth_factor, ...)
    with pytest.raises(ValueError, match="look swapped"):
        ShardedGradScaler("cpu", 2.0**16, 0.5, 2.0)
    for kw in ({"backoff_factor": 0.0}, {"growth_factor": 1.0}):
        with pytest.raises(ValueError) as err:
            ShardedGradScaler("cpu", **kw)
        assert "swapped" not in str(err.value), kw


def test_a_bad_policy_field_in_a_state_dict_is_named_by_its_key_and_changes_nothing():
    scaler = ShardedGradScaler("cpu")
    before = scaler.state_dict()
    for key, value, message in (
        ("growth_factor", 0.5, "state_dict['growth_factor'] must be > 1.0, got 0.5."),
        ("growth_interval", 0, "state_dict['growth_interval'] must be >= 1, got 0."),
        ("policy", "bogus", "state_dict['policy'] must be 'torch' or 'headroom', got 'bogus'."),
    ):
        with pytest.raises(ValueError) as err:
            scaler.load_state_dict({**before, key: value})
        assert str(err.value) == message  # no hint about positional constructor arguments
        assert scaler.state_dict() == before
    with pytest.raises(ValueError) as err:
        scaler.set_growth_factor(0.5)
    assert "swapped" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_update_new_scale_first_on_a_device_torch_lacks_is_refused_and_recoverable():
    """``device="cuda"`` on a CPU-only build stays enabled (the scale goes where the first
    scaled loss is); update(new_scale) before any scale() would create the scale on CUDA: it
    is refused naming the call, nothing is created, and the next iteration runs on the CPU."""
    s = ShardedGradScaler("cuda", init_scale=8.0)
    with pytest.raises(RuntimeError, match=r"update\(new_scale\) before any scale\(\) on 'cuda'"):
        s.update(new_scale=4.0)
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    s.scale(w.sum()).backward()
    s.step(opt)
    s.update()
    assert s.get_scale() == 8.0 and w.grad.device.type == "cpu"
