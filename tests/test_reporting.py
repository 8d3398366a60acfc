"""Skipped-step reporting, counters, overflow reports and bf16 guard mode (one process).

Parameter trajectories are compared bit for bit with ``torch.amp.GradScaler("cpu")`` driving the
same optimizer; counters are compared with counts made by hand.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from shardscale import COUNTER_NAMES, OverflowReport, ScaleCollapseError, ShardedGradScaler

INF = float("inf")
NAN = float("nan")
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 4, dtype=dtype), torch.nn.Tanh())
        self.head = torch.nn.Linear(4, 2, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Calls(TorchFunctionMode):
    """Records the names of the torch functions/methods called inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))

    def host_reads(self) -> list[str]:
        return [n for n in self.names if n in HOST_READS]


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
}


def make(kind: str = "sgd", seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = Net(dtype)
    return model, OPTIMIZERS[kind](model.parameters())


def batch(i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(8, 3, generator=torch.Generator().manual_seed(i)).to(dtype)


def backward(scaler, model, i, bad=None, dtype=torch.float32):
    """Scaled backward on batch ``i``; ``bad = {param name: value}`` is written into grads."""
    loss = model(batch(i, dtype)).float().pow(2).mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    params = dict(model.named_parameters())
    for name, value in (bad or {}).items():
        params[name].grad.view(-1)[0] = value


# --------------------------------------------------------------------- step / last_step_skipped
FLAGS = [0, 1, 0, 1, 1, 0, 0]


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_last_step_skipped_and_params_match_torch(kind):
    """Fused and non-fused: the skip flag is right, skipped steps leave parameters (and the
    optimizer state) untouched, and the trajectory equals torch.amp.GradScaler's bit for bit."""
    ours_model, ours_opt = make(kind)
    ref_model, ref_opt = make(kind)
    ours = ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    skipped = []
    for i, flag in enumerate(FLAGS):
        bad = {"head.weight": INF} if flag else None
        for scaler, model, opt in ((ours, ours_model, ours_opt), (ref, ref_model, ref_opt)):
            opt.zero_grad()
            backward(scaler, model, i, bad)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            changed = any(
                not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
            )
            assert changed != bool(flag)
        flag_t = ours.last_step_skipped(ours_opt)
        assert isinstance(flag_t, torch.Tensor) and flag_t.dtype == torch.bool
        skipped.append(bool(flag_t))
        assert bool(ours.last_step_skipped()) == bool(flag)
        assert ours.get_scale() == ref.get_scale()
    assert skipped == [bool(f) for f in FLAGS]
    for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
    if "adam" in kind:  # the step count of Adam only advanced on the 4 clean steps
        steps = {float(s["step"]) for s in ours_opt.state.values()}
        assert steps == {float(FLAGS.count(0))}


class ReturningSGD(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        return "stepped"


@pytest.mark.parametrize("fused", [False, True])
def test_step_returns_the_optimizer_return_value(fused):
    model, _ = make()
    opt = ReturningSGD(model.parameters(), lr=0.1, fused=fused)
    scaler = ShardedGradScaler("cpu")
    got = []
    for i, flag in enumerate([0, 1, 0]):
        opt.zero_grad()
        backward(scaler, model, i, {"body.0.bias": NAN} if flag else None)
        got.append(scaler.step(opt))
        scaler.update()
    # non-fused: a skipped step does not call optimizer.step(); fused: the kernel skips
    assert got == (["stepped"] * 3 if fused else ["stepped", None, "stepped"])


def test_last_step_skipped_before_any_step_raises():
    model, opt = make()
    scaler = ShardedGradScaler("cpu")
    with pytest.raises(RuntimeError, match="not been stepped"):
        scaler.last_step_skipped(opt)
    with pytest.raises(RuntimeError, match="update\\(\\) has not been called"):
        scaler.last_step_skipped()


def test_last_step_skipped_with_two_optimizers():
    model, _ = make()
    opt_a = torch.optim.SGD(model.body.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model.head.parameters(), lr=0.1, fused=True)
    scaler = ShardedGradScaler("cpu")
    backward(scaler, model, 0, {"head.bias": INF})
    scaler.step(opt_a)
    scaler.step(opt_b)
    assert not scaler.last_step_skipped(opt_a) and scaler.last_step_skipped(opt_b)
    scaler.update()
    assert scaler.last_step_skipped()  # any optimizer


# ----------------------------------------------------------------------------------- metrics
def test_metrics_counters_match_hand_counts_with_two_optimizers():
    model, _ = make()
    opt_a = torch.optim.SGD(model.body.parameters(), lr=0.1)
    opt_b = torch.optim.Adam(model.head.parameters(), lr=0.01, fused=True)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    m0 = scaler.metrics()
    assert m0 == {
        "scale": 1024.0,
        "growth_tracker": 0,
        "hysteresis_tracker": 1,
        **dict.fromkeys(COUNTER_NAMES, 0),
        "last_step_skipped": 0,
    }
    # (body overflows, head overflows) per iteration
    plan = [(0, 0), (1, 0), (1, 1), (0, 0), (0, 0), (0, 1), (0, 0), (0, 0)]
    # scale after each update, by hand: grow after 2 clean steps, halve on any overflow
    want_scales = [1024.0, 512.0, 256.0, 256.0, 512.0, 256.0, 256.0, 512.0]
    history = []
    for i, (a, b) in enumerate(plan):
        opt_a.zero_grad()
        opt_b.zero_grad()
        bad = {}
        if a:
            bad["body.0.weight"] = INF
        if b:
            bad["head.weight"] = NAN
        backward(scaler, model, i, bad)
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        history.append(scaler.metrics())
    assert [m["scale"] for m in history] == want_scales
    assert [m["consecutive_skips"] for m in history] == [0, 1, 2, 0, 0, 1, 0, 0]
    assert [m["last_step_skipped"] for m in history] == [0, 1, 1, 0, 0, 1, 0, 0]
    assert [m["growth_tracker"] for m in history] == [1, 0, 0, 1, 0, 0, 1, 0]
    final = history[-1]
    assert {k: final[k] for k in COUNTER_NAMES} == {
        "steps": 8,
        "skipped_steps": 3,
        "consecutive_skips": 0,
        "overflows": 4,  # optimizer steps that saw inf/NaN: 1 + 2 + 1
        "backoffs": 3,
        "growths": 2,
    }
    assert type(final["scale"]) is float
    assert all(type(v) is int for k, v in final.items() if k != "scale")


def test_metrics_reads_the_host_once():
    model, opt = make()
    scaler = ShardedGradScaler("cpu")
    backward(scaler, model, 0, {"head.bias": INF})
    scaler.step(opt)
    scaler.update()
    with Calls() as calls:
        m = scaler.metrics()
    assert calls.host_reads() == ["tolist"]
    assert m["skipped_steps"] == 1 and m["scale"] == 2.0**15


def test_disabled_scaler_metrics_and_step():
    model, opt = make()
    scaler = ShardedGradScaler("cpu", enabled=False)
    backward(scaler, model, 0)
    assert scaler.step(opt) is None
    assert scaler.metrics() == {
        **dict.fromkeys(ShardedGradScaler("cpu").metrics(), 0),
        "scale": 1.0,
    }


# ------------------------------------------------------------------------ LR scheduler skip
@pytest.mark.parametrize("fused", [False, True])
def test_lr_scheduler_skipped_on_skipped_steps(fused):
    """The documented pattern: step the scheduler only if the optimizer step was not skipped.
    The first step overflows (typical with init_scale=2**16 in fp16)."""
    flags = [1, 1, 0, 1, 0, 0]
    model, _ = make()
    opt = torch.optim.SGD(model.parameters(), lr=1.0, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    scaler = ShardedGradScaler("cpu")
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()"
        for i, flag in enumerate(flags):
            opt.zero_grad()
            backward(scaler, model, i, {"head.weight": INF} if flag else None)
            scaler.step(opt)
            scaler.update()
            if not scaler.last_step_skipped(opt):
                sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    assert sched.last_epoch == flags.count(0) == 3
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.25, 0.125]


def test_lr_scheduler_naive_loop_warns_when_first_step_is_skipped():
    """The contrast: stepping the scheduler unconditionally triggers torch's warning."""
    model, _ = make()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    scaler = ShardedGradScaler("cpu")
    backward(scaler, model, 0, {"head.weight": INF})
    scaler.step(opt)
    scaler.update()
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        sched.step()


# --------------------------------------------------------------------------- overflow report
def test_overflow_report_none_on_clean_steps_without_scanning():
    model, opt = make()
    scaler = ShardedGradScaler("cpu", param_names=model)
    assert scaler.overflow_report() is None  # nothing stepped yet
    for i in range(3):
        opt.zero_grad()
        backward(scaler, model, i)
        scaler.step(opt)
        assert scaler.overflow_report() is None  # mid-iteration
        scaler.update()
        with Calls() as calls:
            assert scaler.overflow_report() is None
        assert not {"isnan", "isinf", "isfinite"} & set(calls.names)
    # positive control: an overflow scans once (then the report is reused)
    opt.zero_grad()
    backward(scaler, model, 3, {"head.bias": INF})
    scaler.step(opt)
    scaler.update()
    with Calls() as calls:
        first = scaler.overflow_report()
    assert calls.names.count("isnan") == len(list(model.parameters()))  # one scan
    with Calls() as calls:
        assert scaler.overflow_report() is first
    assert "isnan" not in calls.names


def test_overflow_report_names_parameters_and_counts_inf_and_nan():
    model, opt = make()
    scaler = ShardedGradScaler("cpu", param_names=model)
    backward(scaler, model, 0)
    with torch.no_grad():
        g = model.body[0].weight.grad.view(-1)
        g[:2] = INF
        g[2] = -INF
        g[5:8] = NAN
        model.head.bias.grad[1] = NAN
    scale_used = scaler.get_scale()
    scaler.step(opt)
    mid = scaler.overflow_report()
    scaler.update()
    report = scaler.overflow_report()
    assert isinstance(report, OverflowReport)
    assert [
        (e.name, e.rank, e.n_inf, e.n_nan, e.numel, e.dtype, e.device) for e in report.entries
    ] == [
        ("body.0.weight", 0, 3, 3, 12, "torch.float32", "cpu"),
        ("head.bias", 0, 0, 1, 2, "torch.float32", "cpu"),
    ]
    assert (report.step, report.scale) == (0, scale_used)
    assert report.names == ["body.0.weight", "head.bias"] and report.ranks == [0]
    assert mid is not None and mid.entries == report.entries
    text = str(report)
    assert text.splitlines()[0] == "overflow at step 0 (loss scale 65536):"
    assert "rank 0: body.0.weight (torch.float32, 12 elements on cpu): 3 inf, 3 NaN" in text


def test_overflow_report_name_sources():
    model, opt = make()
    scaler = ShardedGradScaler("cpu")
    backward(scaler, model, 0, {"head.weight": INF})
    scaler.step(opt)
    scaler.update()
    # unnamed: index in the optimizer (body.0.weight, body.0.bias, head.weight, head.bias)
    assert scaler.overflow_report().names == ["<param 2 of optimizer 0>"]
    scaler.set_param_names({"decoder.proj.weight": model.head.weight})
    opt.zero_grad()
    backward(scaler, model, 1, {"head.weight": INF})
    scaler.step(opt)
    scaler.update()
    assert scaler.overflow_report().names == ["decoder.proj.weight"]
    scaler.set_param_names(torch.nn.ModuleDict({"net": model}))  # fully-qualified names
    opt.zero_grad()
    backward(scaler, model, 2, {"head.weight": INF})
    scaler.step(opt)
    scaler.update()
    assert scaler.overflow_report().names == ["net.head.weight"]
    with pytest.raises(TypeError, match="nn.Module or a"):
        scaler.set_param_names([model.head.weight])


def test_overflow_report_covers_every_optimizer_and_low_precision_grads():
    torch.manual_seed(0)
    emb = torch.nn.Parameter(torch.randn(5, dtype=torch.float16))
    lin = torch.nn.Linear(5, 1)
    opt_a = torch.optim.SGD([emb], lr=0.1)
    opt_b = torch.optim.SGD(lin.parameters(), lr=0.1, fused=True)
    scaler = ShardedGradScaler("cpu", param_names={"emb": emb, "lin.weight": lin.weight})
    loss = lin(emb.float()).sum()
    scaler.scale(loss).backward()
    emb.grad[3] = INF
    lin.weight.grad[0, 0] = NAN
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    report = scaler.overflow_report()
    assert [(e.name, e.dtype, e.n_inf, e.n_nan) for e in report.entries] == [
        ("emb", "torch.float16", 1, 0),
        ("lin.weight", "torch.float32", 0, 1),
    ]


def test_report_overflows_logs_one_record_per_overflowing_iteration(caplog):
    model, _ = make()
    opt_a = torch.optim.SGD(model.body.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model.head.parameters(), lr=0.1, fused=True)
    scaler = ShardedGradScaler("cpu", param_names=model, report_overflows=True)
    plan = [{}, {"body.0.bias": INF, "head.weight": NAN}, {}, {"head.bias": INF}]
    with caplog.at_level(logging.WARNING, logger="shardscale"):
        for i, bad in enumerate(plan):
            opt_a.zero_grad()
            opt_b.zero_grad()
            backward(scaler, model, i, bad)
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            if i == 1:
                assert scaler.overflow_report().names == ["body.0.bias", "head.weight"]
    records = [r for r in caplog.records if r.name == "shardscale"]
    assert len(records) == 2
    assert all(r.levelno == logging.WARNING for r in records)
    first, second = (r.getMessage() for r in records)
    assert first.startswith("overflow at step 1 (loss scale 65536):")
    assert "body.0.bias" in first and "1 inf, 0 NaN" in first
    assert "head.weight" in first and "0 inf, 1 NaN" in first
    assert second.startswith("overflow at step 3 (loss scale 32768):") and "head.bias" in second


def test_no_log_without_report_overflows(caplog):
    model, opt = make()
    scaler = ShardedGradScaler("cpu")
    with caplog.at_level(logging.DEBUG, logger="shardscale"):
        backward(scaler, model, 0, {"head.bias": INF})
        scaler.step(opt)
        scaler.update()
    assert not [r for r in caplog.records if r.name == "shardscale"]


# ------------------------------------------------------------------------------ bf16 guard
@pytest.mark.parametrize("fused", [False, True])
def test_guard_mode_bf16_skips_nonfinite_steps_and_equals_plain_training_otherwise(fused):
    flags = [0, 0, 1, 0, 1, 1, 0]
    guarded, g_opt = make(dtype=torch.bfloat16)
    plain, p_opt = make(dtype=torch.bfloat16)
    g_opt = torch.optim.SGD(guarded.parameters(), lr=0.1, fused=fused)
    p_opt = torch.optim.SGD(plain.parameters(), lr=0.1, fused=fused)
    scaler = ShardedGradScaler.guard(param_names=guarded, growth_interval=1)
    for i, flag in enumerate(flags):
        g_opt.zero_grad()
        backward(scaler, guarded, i, {"head.weight": NAN} if flag else None, torch.bfloat16)
        assert scaler.get_scale() == 1.0
        scaler.step(g_opt)
        scaler.update()
        assert bool(scaler.last_step_skipped(g_opt)) == bool(flag)
        if flag:
            report = scaler.overflow_report()
            assert [(e.name, e.dtype, e.n_nan) for e in report.entries] == [
                ("head.weight", "torch.bfloat16", 1)
            ]
        else:  # the same step without a scaler: bit-identical (scale 1.0 changes nothing)
            p_opt.zero_grad()
            backward(None, plain, i, None, torch.bfloat16)
            p_opt.step()
    for a, b in zip(guarded.parameters(), plain.parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    m = scaler.metrics()
    assert m["scale"] == 1.0 and m["growths"] == 0 and m["backoffs"] == 0
    assert (m["skipped_steps"], m["overflows"], m["steps"]) == (3, 3, 7)
    assert scaler.state_dict()["dynamic"] is False


def test_plain_bf16_training_writes_nan_into_params():
    """What guard mode prevents: without a scaler a single NaN gradient poisons the weights."""
    model, opt = make(dtype=torch.bfloat16)
    opt.zero_grad()
    backward(None, model, 0, {"head.weight": NAN}, torch.bfloat16)
    opt.step()
    assert torch.isnan(model.head.weight).any()


# ------------------------------------------------ collapse check without host reads (fused)
@pytest.mark.parametrize("kind", ["adam_fused", "sgd_fused"])
def test_fused_collapse_is_raised_at_the_next_alarm_read(kind):
    """A fused step reads nothing on the host: the collapse flag is recorded on the device and
    read every POLL_EVERY updates; the error names the step at which the scale collapsed."""
    from shardscale.scaler import POLL_EVERY

    model, opt = make(kind)
    scaler = ShardedGradScaler("cpu", max_consecutive_skips=3, param_names=model)
    raised_at = None
    for i in range(2 * POLL_EVERY):
        opt.zero_grad()
        backward(scaler, model, i, {"head.bias": INF})
        scaler.step(opt)
        try:
            scaler.update()
        except ScaleCollapseError as e:
            raised_at, error = i, e
            break
    assert raised_at == POLL_EVERY - 1  # the first read of the alarm
    assert error.step == 2  # the third skip in a row
    assert error.scale == 2.0**14 and "head.bias on rank 0" in str(error)
    assert scaler.metrics()["steps"] == POLL_EVERY  # the update itself was applied


def test_a_collapse_read_after_clean_steps_says_where_its_gradients_went():
    """A fused loop reads the alarm every POLL_EVERY updates: a collapse whose steps were
    followed by clean ones is read with finite gradients, and the message says why none are
    named (it names the step and scale all the same)."""
    from shardscale.scaler import POLL_EVERY

    model, opt = make("adam_fused")
    scaler = ShardedGradScaler("cpu", max_consecutive_skips=3, param_names=model)
    with pytest.raises(ScaleCollapseError) as info:
        for i in range(POLL_EVERY):
            opt.zero_grad()
            backward(scaler, model, i, {"head.bias": INF} if i < 3 else None)
            scaler.step(opt)
            scaler.update()
    assert info.value.step == 2 and info.value.scale == 2.0**14
    assert "none in the last step's gradients" in str(info.value)
    assert "up to 16 updates after the collapse" in str(info.value)


def test_non_fused_collapse_is_raised_by_the_update_that_collapsed():
    model, opt = make("sgd")
    scaler = ShardedGradScaler("cpu", max_consecutive_skips=2)
    for i in range(2):
        opt.zero_grad()
        backward(scaler, model, i, {"head.bias": INF})
        scaler.step(opt)
        if i == 0:
            scaler.update()
    with pytest.raises(ScaleCollapseError) as info:
        scaler.update()
    assert info.value.step == 1


def test_update_with_new_scale_still_counts_the_iteration():
    """update(new_scale): scale set and trackers kept as torch does, and the iteration is
    counted (metrics, last_step_skipped(), overflow_report()) like any other."""
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 2)
    ref = torch.nn.Linear(2, 2)
    ref.load_state_dict(m.state_dict())
    opt, opt_ref = (
        torch.optim.SGD(m.parameters(), lr=0.1),
        torch.optim.SGD(ref.parameters(), lr=0.1),
    )
    ours = ShardedGradScaler("cpu", init_scale=1024.0, param_names=m)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for it, (poison, new_scale) in enumerate([(False, None), (True, 256.0), (False, 4096.0)]):
        for model, o, s in ((m, opt, ours), (ref, opt_ref, theirs)):
            o.zero_grad()
            s.scale(model(torch.ones(2)).sum()).backward()
            if poison:
                model.weight.grad[0, 0] = float("inf")
            s.step(o)
            s.update(new_scale)
        sd_ours, sd_theirs = ours.state_dict(), theirs.state_dict()
        for key in ("scale", "_growth_tracker"):
            assert sd_ours[key] == sd_theirs[key], (it, key)
        assert bool(ours.last_step_skipped()) is poison
        if it == 1:
            report = ours.overflow_report()
            assert report is not None and report.entries[0].name == "weight"
    metrics = ours.metrics()
    assert (metrics["steps"], metrics["skipped_steps"], metrics["overflows"]) == (3, 1, 1)
    assert (metrics["backoffs"], metrics["growths"], metrics["consecutive_skips"]) == (1, 1, 0)
    assert ours.get_scale() == theirs.get_scale() == 4096.0
    for a, b in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_report_names_follow_deepcopy_and_are_dropped_by_pickle():
    import copy
    import pickle

    def report_names(model, opt, scaler):
        scaler.scale((model(torch.ones(1, 3)) * INF).sum()).backward()
        scaler.step(opt)
        scaler.update()
        names = scaler.overflow_report().names
        opt.zero_grad()
        return names

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", param_names=model)
    # copied together: the copy names the copied model's parameters
    model2, opt2, scaler2 = copy.deepcopy((model, opt, scaler))
    assert report_names(model2, opt2, scaler2) == ["bias", "weight"]
    # copied alone: it still names the original model's parameters
    assert report_names(model, opt, copy.deepcopy(scaler)) == ["bias", "weight"]
    # pickled: ids mean nothing in another process; names dropped until set_param_names
    clone = pickle.loads(pickle.dumps(scaler))
    assert report_names(model, opt, clone) == [
        "<param 0 of optimizer 0>",
        "<param 1 of optimizer 0>",
    ]
    clone.set_param_names(model)
    assert report_names(model, opt, clone) == ["bias", "weight"]


def test_shallow_copy_keeps_names_and_old_pickles_load():
    import copy

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", param_names=model)
    shallow = copy.copy(scaler)
    shallow.scale((model(torch.ones(1, 3)) * INF).sum()).backward()
    shallow.step(opt)
    shallow.update()
    assert shallow.overflow_report().names == ["bias", "weight"]
    # a scaler pickled by shardscale 0.1: other private attributes, names as {id: name}
    state = {"_device": "cpu", "_enabled": True, "_state": None, "_per_optimizer": {}}
    state.update(_pending_collapse=[], _inv_cache=None, _pre_unscaled={}, _skipped={}, _last=None)
    state["_names"] = {id(model.weight): "weight"}
    old = ShardedGradScaler.__new__(ShardedGradScaler)
    old.__setstate__(state)
    assert old.rank_local_params is False
    opt.zero_grad()
    old.scale(model(torch.ones(1, 3)).sum()).backward()
    old.clip_grad_norm_(opt, 1.0)
    old.step(opt)
    old.update()
    assert old.metrics()["steps"] == 1


def test_param_names_hold_no_reference_to_the_parameters():
    """Names are kept by id, with no (weak) reference: torch refuses to swap tensors that
    have weak references (FSDP2's module.to(), swap-on-conversion), so naming must not."""
    from shardscale._report import ParamNames

    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    names = ParamNames([("p", p)]).current()
    assert names.get(id(p), "?") == "p" and names.get(id(q), "?") == "?"
    copy_of = torch.nn.Parameter(torch.ones(2))
    remapped = ParamNames([("p", p)]).remapped({id(p): copy_of}).current()
    assert remapped.get(id(copy_of), "?") == "p" and remapped.get(id(p), "?") == "?"
    model = torch.nn.Linear(4, 2)
    ShardedGradScaler("cpu", param_names=model)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.double()  # swaps the parameters: refused if anything held a weakref to them
        model.float().load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _inf_step_report_names(model, scaler):
    """One iteration of a 3->2 model with every gradient inf; the report's names."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale((model(torch.ones(1, 3)) * INF).sum()).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.overflow_report().names


def test_module_names_follow_replaced_parameters_and_die_with_the_model():
    """Names from a module are read when the report is built: parameters replaced since
    (load_state_dict(assign=True), FSDP2 module.to()) are named right, and a freed model names
    nothing (a new model's parameter reusing a dead one's id is never given its name)."""
    import gc

    model = torch.nn.Linear(3, 2)
    scaler = ShardedGradScaler("cpu", param_names=model)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(fresh, assign=True)  # new Parameter objects
    assert _inf_step_report_names(model, scaler) == ["bias", "weight"]
    del model
    gc.collect()
    other = torch.nn.Linear(3, 2)  # may reuse the dead parameters' ids
    assert _inf_step_report_names(other, scaler) == [
        "<param 0 of optimizer 0>",
        "<param 1 of optimizer 0>",
    ]


def test_module_names_for_scripted_and_parametrized_modules():
    """TorchScript modules (their _parameters is no dict) and parametrizations registered after
    naming (the parameter moves to a new submodule) keep their names."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, x):
            return 2 * x

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated
        scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    assert _inf_step_report_names(scripted, ShardedGradScaler("cpu", param_names=scripted)) == [
        "0.bias",
        "0.weight",
    ]
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    scaler = ShardedGradScaler("cpu", param_names=model)
    parametrize.register_parametrization(model[0], "weight", Double())
    assert _inf_step_report_names(model, scaler) == ["0.bias", "0.weight"]
