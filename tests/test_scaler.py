"""Single-process tests of ``ShardedGradScaler``: differential against ``torch.amp.GradScaler``,
state dicts, call-order and argument errors, gradient kinds, fp16 precision, fused optimizers
and the scale floor."""

from __future__ import annotations

import contextlib
import copy
import io
import math
import struct
import warnings

import pytest
import torch
from torch import nn

from shardscale import ShardedGradScaler

TORCH_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}

# ----------------------------------------------------------------------------- helpers


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


_gen = torch.Generator().manual_seed(1234)
X = torch.randn(24, 8, 4, generator=_gen)
Y = torch.randn(24, 8, 2, generator=_gen)


def loss_at(model: nn.Module, i: int, bad: dict[int, float]) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(X[i]), Y[i])
    if i in bad:
        loss = loss * bad[i]  # every gradient becomes inf or NaN
    return loss


def train_step(model, opt, scaler, i, bad, clip=False):
    opt.zero_grad()
    scaler.scale(loss_at(model, i, bad)).backward()
    if clip:
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def assert_same_opt_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for key, va in sa[k].items():
            vb = sb[k][key]
            assert torch.equal(torch.as_tensor(va), torch.as_tensor(vb)), (k, key)


def torch_scaler(**kw) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kw)


def is_plain(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    if isinstance(value, list):  # _headroom_history: floats
        return all(isinstance(v, float) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


OPTIMIZERS = {
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "sgd_forloop": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
}

# inf and NaN steps, with clean runs of >= growth_interval in between (growth AND backoff).
BAD = {3: math.inf, 4: math.nan, 9: math.inf, 15: math.nan}


# ----------------------------------------------------------- 1. differential vs torch


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "unscale_clip"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_bit_identical_to_torch_gradscaler(opt_name, clip):
    """Same model, data and inf/NaN steps: params, scale and optimizer state bit-identical
    after every step."""
    make_opt = OPTIMIZERS[opt_name]
    ref_model, our_model = make_mlp(), make_mlp()
    ref_opt, our_opt = make_opt(ref_model.parameters()), make_opt(our_model.parameters())
    ref = torch_scaler(init_scale=2.0**10, growth_interval=2)
    ours = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for i in range(20):
        before = [p.detach().clone() for p in our_model.parameters()]
        train_step(ref_model, ref_opt, ref, i, BAD, clip)
        train_step(our_model, our_opt, ours, i, BAD, clip)
        assert_same_params(ref_model, our_model)
        assert ours.get_scale() == ref.get_scale(), i
        assert torch.equal(ours._get_scale_async(), ref._get_scale_async())
        skipped = bool(ours.last_step_skipped(our_opt))
        assert skipped == (i in BAD)
        moved = any(
            not torch.equal(b, p) for b, p in zip(before, our_model.parameters(), strict=True)
        )
        assert moved != skipped, i
        scales.append(ours.get_scale())
    assert_same_opt_state(ref_opt, our_opt)
    assert ours.state_dict()["_growth_tracker"] == ref.state_dict()["_growth_tracker"]
    # Both growth and backoff happened: 2**10 -> 2**11 -> back to 2**10 and 2**9, ...
    assert scales[:6] == [1024.0, 2048.0, 2048.0, 1024.0, 512.0, 512.0]
    assert max(scales) > 2048.0


# --------------------------------------------------------------------- 2. state_dict


def _trained_pair(steps, bad, growth_interval=3):
    """A torch-scaled model after ``steps`` steps, and a deep copy of model and optimizer."""
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch_scaler(init_scale=2.0**8, growth_interval=growth_interval)
    for i in range(steps):
        train_step(model, opt, scaler, i, bad)
    return model, opt, scaler


def _clone(model, opt):
    m2 = copy.deepcopy(model)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    o2.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict shares tensors
    return m2, o2


def _continue_identically(m_a, o_a, s_a, m_b, o_b, s_b, start, bad):
    for i in range(start, start + 8):
        train_step(m_a, o_a, s_a, i, bad)
        train_step(m_b, o_b, s_b, i, bad)
        assert_same_params(m_a, m_b)
        assert s_a.get_scale() == s_b.get_scale(), i


def test_state_dict_keys_plain_values_and_weights_only_roundtrip():
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(5):
        train_step(model, opt, scaler, i, {1: math.inf})
    sd = scaler.state_dict()
    assert TORCH_KEYS <= sd.keys()
    assert is_plain(sd)
    assert isinstance(sd["scale"], float) and isinstance(sd["_growth_tracker"], int)
    assert isinstance(sd["growth_interval"], int)
    assert sd["scale"] == 256.0  # 256 -> 128 (step 1) -> 256 (3 clean steps)
    assert sd["_growth_tracker"] == 0
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded == sd
    fresh = ShardedGradScaler("cpu")
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == sd


@pytest.mark.parametrize("after_scale", [False, True], ids=["before_scale", "after_scale"])
def test_torch_state_dict_into_shardscale_continues_identically(after_scale):
    bad = {2: math.inf, 9: math.nan}
    m_t, o_t, s_t = _trained_pair(5, bad)  # tracker mid-interval
    assert s_t.state_dict()["_growth_tracker"] == 2
    m_s, o_s = _clone(m_t, o_t)
    ours = ShardedGradScaler("cpu")
    if after_scale:  # a scaler that already holds a (different) state on the device
        model = make_mlp(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step(model, opt, ours, 0, {0: math.inf})
        assert ours.get_scale() == 2.0**15
    ours.load_state_dict(s_t.state_dict())
    assert ours.get_scale() == s_t.get_scale()
    assert ours.get_growth_interval() == 3
    _continue_identically(m_t, o_t, s_t, m_s, o_s, ours, 5, bad)


@pytest.mark.parametrize("after_scale", [False, True], ids=["before_scale", "after_scale"])
def test_shardscale_state_dict_into_torch_continues_identically(after_scale):
    bad = {2: math.inf, 9: math.nan}
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ours = ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    for i in range(5):
        train_step(model, opt, ours, i, bad)
    m_t, o_t = _clone(model, opt)
    ref = torch_scaler()
    if after_scale:
        m0 = make_mlp(1)
        o0 = torch.optim.SGD(m0.parameters(), lr=0.1)
        train_step(m0, o0, ref, 0, {})
    ref.load_state_dict(ours.state_dict())
    assert ref.get_scale() == ours.get_scale()
    _continue_identically(model, opt, ours, m_t, o_t, ref, 5, bad)


def test_every_state_field_survives_a_round_trip():
    kwargs = dict(
        init_scale=2.0**6,
        growth_factor=4.0,
        backoff_factor=0.25,
        growth_interval=5,
        min_scale=0.5,
        max_scale=2.0**20,
        hysteresis=3,
        consecutive_hysteresis=True,
        max_consecutive_skips=50,
        on_collapse="warn",
    )
    scaler = ShardedGradScaler("cpu", **kwargs)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # 7 clean (one growth at 5), then 2 overflows (hysteresis 3 -> 1 left, no backoff), 1 clean
    bad = {7: math.inf, 8: math.nan}
    for i in range(10):
        train_step(model, opt, scaler, i, bad)
    sd = scaler.state_dict()
    assert sd["scale"] == 2.0**8
    assert sd["_growth_tracker"] == 1
    assert sd["_hysteresis_tracker"] == 3  # refilled by the clean step (consecutive)
    assert sd["_counters"] == {
        "steps": 10,
        "skipped_steps": 2,
        "consecutive_skips": 0,
        "overflows": 2,
        "backoffs": 0,
        "growths": 1,
    }
    for key in ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale"):
        assert sd[key] == kwargs[key], key
    assert (sd["hysteresis"], sd["consecutive_hysteresis"], sd["dynamic"]) == (3, True, True)
    assert (sd["max_consecutive_skips"], sd["on_collapse"]) == (50, "warn")

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    for target in (ShardedGradScaler("cpu"), scaler):
        target.load_state_dict(torch.load(buf, weights_only=True))
        buf.seek(0)
        assert target.state_dict() == sd
        assert target.config == scaler.config
    # the loaded trackers behave: two more overflows spend the hysteresis budget only at the 3rd
    fresh = ShardedGradScaler("cpu")
    fresh.load_state_dict(sd)
    m2 = copy.deepcopy(model)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.05)
    for i in (0, 1, 2):
        train_step(m2, o2, fresh, i, {0: math.inf, 1: math.inf, 2: math.inf})
    assert fresh.get_scale() == 2.0**8 * 0.25
    assert fresh.metrics()["backoffs"] == 1


def _bad_state_dicts(good):
    out = {}
    for key in sorted(TORCH_KEYS):
        d = dict(good)
        del d[key]
        out[f"missing_{key}"] = d
    for name, key, value in [
        ("scale_str", "scale", "1024"),
        ("scale_tensor_list", "scale", [1024.0]),
        ("scale_zero", "scale", 0.0),
        ("scale_neg", "scale", -4.0),
        ("scale_inf", "scale", math.inf),
        ("scale_nan", "scale", math.nan),
        ("tracker_neg", "_growth_tracker", -1),
        ("tracker_float", "_growth_tracker", 1.5),
        ("hyst_tracker_neg", "_hysteresis_tracker", -2),
        ("growth_factor_lt1", "growth_factor", 0.5),
        ("growth_factor_str", "growth_factor", "2"),
        ("backoff_one", "backoff_factor", 1.0),
        ("interval_zero", "growth_interval", 0),
        ("interval_float", "growth_interval", 2.0),
        ("counters_bad_key", "_counters", {"nope": 1}),
        ("counters_neg", "_counters", {"steps": -1}),
        ("on_collapse_bad", "on_collapse", "ignore"),
    ]:
        d = dict(good)
        d[key] = value
        out[name] = d
    return out


@pytest.mark.parametrize("after_scale", [False, True], ids=["before_scale", "after_scale"])
def test_malformed_state_dict_raises_and_leaves_scaler_unchanged(after_scale):
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    if after_scale:
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(4):
            train_step(model, opt, scaler, i, {1: math.nan})
    good = scaler.state_dict()
    cases = _bad_state_dicts(good)
    assert len(cases) == 22
    for name, bad in cases.items():
        with pytest.raises((TypeError, ValueError)):
            scaler.load_state_dict(bad)
        assert scaler.state_dict() == good, name
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        scaler.load_state_dict([("scale", 1.0)])
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})
    assert scaler.state_dict() == good


def test_load_state_dict_mid_iteration_raises():
    scaler = ShardedGradScaler("cpu")
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(loss_at(model, 0, {})).backward()
    scaler.unscale_(opt)
    sd = scaler.state_dict()
    with pytest.raises(RuntimeError, match="iteration boundary"):
        scaler.load_state_dict(sd)
    scaler.step(opt)
    scaler.update()
    scaler.load_state_dict(sd)  # fine at the boundary


def test_copies_after_scale_carry_the_iteration_and_are_refused_once_stepped():
    """As torch's: a copy (pickle, copy, deepcopy) may be made after scale() (the copy steps
    the scaled gradients as the original would), not after unscale_/step."""
    import copy
    import pickle

    for fn in (copy.deepcopy, copy.copy, lambda s: pickle.loads(pickle.dumps(s))):
        results = []
        for copied in (False, True):
            torch.manual_seed(0)
            model = make_mlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = ShardedGradScaler("cpu", growth_interval=1)
            scaler.scale(loss_at(model, 0, {})).backward()
            if copied:
                scaler = fn(scaler)
            scaler.step(opt)
            scaler.update()
            results.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
        assert results[0][0] == results[1][0] == 2.0**17
        assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
        scaler.scale(loss_at(model, 1, {})).backward()
        scaler.step(opt)
        with pytest.raises(RuntimeError, match=r"beginning of an iteration.*after update\(\)"):
            fn(scaler)


# ------------------------------------------------------------------ 3. call order


def _scaled(scaler):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(loss_at(model, 0, {})).backward()
    return model, opt


def test_call_order_errors():
    order = r"scaler\.scale\(loss\)\.backward\(\) -> \[scaler\.unscale_\(opt\)\] -> scaler\.step"
    s = ShardedGradScaler("cpu")
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=rf"no optimizer was stepped or unscaled.*{order}"):
        s.update()
    # before any scale(): an idle rank's calls (no loss this iteration): they run, count nothing
    s.step(opt)
    s.update()
    assert s.state_dict()["scale"] == 2.0**16 and s.metrics()["steps"] == 0

    s = ShardedGradScaler("cpu")
    _, opt = _scaled(s)
    with pytest.raises(RuntimeError, match=rf"no optimizer was stepped or unscaled.*{order}"):
        s.update()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match=rf"unscale_\(\) has already been called.*{order}"):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(
        RuntimeError, match=rf"unscale_\(\) is being called after step\(\).*{order}"
    ):
        s.unscale_(opt)
    with pytest.raises(RuntimeError, match=rf"step\(\) has already been called.*{order}"):
        s.step(opt)
    s.update()
    with pytest.raises(RuntimeError, match="Closure use is not supported"):
        s.step(opt, closure=lambda: 0.0)
    with pytest.raises(TypeError, match="takes a torch.optim.Optimizer"):
        s.unscale_(list(model.parameters()))
    assert s.metrics()["steps"] == 1


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        ({"growth_factor": 1.0}, ValueError, "growth_factor"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor"),
        ({"growth_factor": "2"}, TypeError, "growth_factor"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 1.5}, ValueError, "backoff_factor"),
        ({"backoff_factor": -1.0}, ValueError, "backoff_factor"),
        ({"growth_interval": 0}, ValueError, "growth_interval"),
        ({"growth_interval": -3}, ValueError, "growth_interval"),
        ({"growth_interval": 2.0}, TypeError, "growth_interval"),
        ({"init_scale": 0.0}, ValueError, "init_scale"),
        ({"init_scale": -1.0}, ValueError, "init_scale"),
        ({"init_scale": math.inf}, ValueError, "init_scale"),
        ({"init_scale": math.nan}, ValueError, "init_scale"),
        ({"process_group": "world"}, TypeError, "process_group"),
        ({"process_group": 3}, TypeError, "process_group"),
        ({"process_group": []}, TypeError, "process_group"),
        ({"process_group": [None]}, TypeError, "process_group"),
        ({"enabled": "yes"}, TypeError, "enabled"),
    ],
)
def test_bad_constructor_arguments(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        ShardedGradScaler("cpu", **kwargs)


def test_disabled_scaler_is_a_pass_through():
    s = ShardedGradScaler("cpu", enabled=False)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = loss_at(model, 0, {})
    assert s.scale(loss) is loss
    pair = [loss, loss]
    assert s.scale(pair) is pair
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    s.unscale_(opt)  # no-op: gradients untouched
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    before = [p.detach().clone() for p in model.parameters()]
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))
    assert s.step(opt) is None
    assert calls == [1]
    for b, p, g in zip(before, model.parameters(), grads, strict=True):
        assert torch.allclose(p, b - 0.1 * g)
    s.update()
    s.update(1234.0)
    assert s.state_dict() == {}
    assert s.get_scale() == 1.0
    assert not s.is_enabled()
    s.load_state_dict({"scale": 3.0})  # ignored
    assert s.get_scale() == 1.0


# -------------------------------------------------------------------- 4. gradients


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradients_unscaled(dtype):
    w = torch.tensor([1.0, -2.0, 0.5, 3.0])  # exact in fp16/bf16 times powers of two
    p = nn.Parameter(torch.zeros(4, dtype=dtype))
    opt = torch.optim.SGD([p], lr=1.0)
    if dtype is torch.float16:  # torch refuses fp16 gradients
        ref = torch_scaler(init_scale=2.0**10)
        ref.scale((p.float() * w).sum()).backward()
        with pytest.raises(ValueError, match="FP16 gradients"):
            ref.unscale_(opt)
        p.grad = None
    s = ShardedGradScaler("cpu", init_scale=2.0**10)
    s.scale((p.float() * w).sum()).backward()
    assert torch.equal(p.grad, (w * 2.0**10).to(dtype))
    s.unscale_(opt)
    assert p.grad.dtype == dtype
    assert torch.equal(p.grad, w.to(dtype))
    s.step(opt)
    s.update()
    assert torch.equal(p.detach(), (-w).to(dtype))
    assert s.get_scale() == 2.0**10
    # an overflow of the low-precision gradient itself (fp16: 65504 max) is caught
    opt.zero_grad()
    big = 1e5 if dtype is torch.float16 else 1e38
    s.scale((p.float() * big).sum()).backward()
    before = p.detach().clone()
    s.step(opt)
    s.update()
    assert bool(s.last_step_skipped(opt))
    assert torch.equal(p.detach(), before)
    assert s.get_scale() == 2.0**9


def test_bf16_gradients_match_torch():
    def run(scaler):
        torch.manual_seed(0)
        m = nn.Linear(4, 3).to(torch.bfloat16)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for i in range(8):
            opt.zero_grad()
            loss = m(X[i].bfloat16()).float().pow(2).mean() * (math.inf if i == 3 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return [p.detach() for p in m.parameters()], scaler.get_scale()

    ref_p, ref_s = run(torch_scaler(init_scale=2.0**10, growth_interval=2))
    our_p, our_s = run(ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    assert ref_s == our_s == 2.0**12  # grown 3 times, backed off once
    assert all(torch.equal(a, b) for a, b in zip(ref_p, our_p, strict=True))


def test_sparse_fp32_gradients_match_torch():
    def run(scaler):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        idx = torch.tensor([[1, 2, 2, 7], [3, 3, 3, 0], [9, 1, 5, 5], [4, 4, 8, 6]])
        for i in range(8):
            opt.zero_grad()
            loss = emb(idx[i % 4]).pow(2).sum() * (math.nan if i == 2 else 1.0)
            scaler.scale(loss).backward()
            assert emb.weight.grad.is_sparse
            scaler.step(opt)
            scaler.update()
        return emb.weight.detach(), scaler.get_scale()

    ref_w, ref_s = run(torch_scaler(init_scale=2.0**10, growth_interval=2))
    our_w, our_s = run(ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    assert ref_s == our_s
    assert torch.equal(ref_w, our_w)


def test_sparse_fp16_duplicate_indices_overflow_after_coalescing():
    emb = nn.Embedding(10, 3, sparse=True).half()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=2.0**15)
    # each occurrence contributes 1.4 * 32768 = 45875 (finite in fp16), two of them sum to inf
    s.scale(emb(torch.tensor([1, 1, 2])).float().sum() * 1.4).backward()
    assert not emb.weight.grad.is_coalesced()
    assert torch.isfinite(emb.weight.grad._values()).all()
    before = emb.weight.detach().clone()
    s.step(opt)
    s.update()
    assert bool(s.last_step_skipped(opt))
    assert torch.equal(emb.weight.detach(), before)
    assert s.get_scale() == 2.0**14
    # a clean fp16 sparse step with duplicates: coalesced and unscaled exactly
    opt.zero_grad()
    s.scale(emb(torch.tensor([1, 1, 2])).float().sum() * 0.5).backward()
    s.unscale_(opt)
    g = emb.weight.grad
    assert g.is_coalesced()
    assert torch.equal(g._indices(), torch.tensor([[1, 2]]))
    assert torch.equal(g._values(), torch.tensor([[1.0] * 3, [0.5] * 3], dtype=torch.float16))
    s.step(opt)
    s.update()
    assert torch.equal(emb.weight.detach()[1], before[1] - torch.tensor(0.1, dtype=torch.float16))


class _Odd(nn.Module):
    """Two param groups, a 0-dim parameter and a parameter that never gets a gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        self.gain = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.lin(x) * self.gain


def test_param_groups_zero_dim_and_missing_grads_match_torch():
    def run(scaler):
        m = _Odd()
        opt = torch.optim.Adam(
            [
                {"params": [m.lin.weight, m.unused], "lr": 1e-2},
                {"params": [m.lin.bias, m.gain], "lr": 3e-2},
            ]
        )
        for i in range(10):
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(X[i]), Y[i]) * (math.inf if i in (2, 7) else 1.0)
            scaler.scale(loss).backward()
            assert m.unused.grad is None and m.gain.grad.dim() == 0
            scaler.step(opt)
            scaler.update()
        return m, scaler.get_scale()

    ref_m, ref_s = run(torch_scaler(init_scale=2.0**10, growth_interval=2))
    our_m, our_s = run(ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2))
    assert ref_s == our_s
    assert_same_params(ref_m, our_m)
    assert torch.equal(our_m.unused.detach(), torch.ones(3))


def test_optimizer_without_any_gradient_steps_without_error():
    m = _Odd()
    opt_a = torch.optim.SGD(m.lin.parameters(), lr=0.1)
    opt_b = torch.optim.SGD([m.unused], lr=0.1)
    calls = []
    opt_b.register_step_post_hook(lambda *a: calls.append(1))
    # torch refuses this: "No inf checks were recorded for this optimizer."
    ref = torch_scaler()
    ref.scale(m(X[0]).sum()).backward()
    ref.step(opt_a)
    with pytest.raises(AssertionError, match="No inf checks"):
        ref.step(opt_b)
    opt_a.zero_grad()
    s = ShardedGradScaler("cpu", init_scale=2.0**10)
    s.scale(m(X[0]).sum()).backward()
    s.step(opt_a)
    s.step(opt_b)
    s.update()
    assert calls == [1]
    assert not bool(s.last_step_skipped(opt_b))
    assert s.get_scale() == 2.0**10
    assert s.metrics()["steps"] == 1


# --------------------------------------------------------------- 5. fp16 precision


def _fp16_tiny_grad(explicit_unscale, opt_cls, **opt_kw):
    p = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt = opt_cls([p], fused=True, **opt_kw)
    s = ShardedGradScaler("cpu", init_scale=65536.0)
    s.scale((p.float() * 1e-8).sum()).backward()  # d loss / d p = 1e-8
    assert torch.allclose(p.grad.float(), torch.full((3,), 65536e-8), rtol=1e-3)
    if explicit_unscale:
        s.unscale_(opt)
        assert torch.equal(p.grad, torch.zeros(3, dtype=torch.float16))  # 1e-8 underflows fp16
    s.step(opt)
    s.update()
    assert not bool(s.last_step_skipped(opt))
    assert s.get_scale() == 65536.0
    return p.detach().float()


def test_fused_fp16_keeps_tiny_gradients_without_explicit_unscale():
    # fused SGD, lr=1e4: p = 0 - 1e4 * 1e-8 = -1e-4 (the kernel unscales in fp32)
    p = _fp16_tiny_grad(False, torch.optim.SGD, lr=1e4)
    assert torch.allclose(p, torch.full((3,), -1e-4), rtol=2e-3)
    # fused Adam: m_hat = g, v_hat = g^2, step = lr * g / (|g| + eps) = lr / 2 with g = eps
    p = _fp16_tiny_grad(False, torch.optim.Adam, lr=1e-3, eps=1e-8)
    assert torch.allclose(p, torch.full((3,), -5e-4), rtol=5e-3)


def test_fp16_explicit_unscale_loses_tiny_gradients():
    assert torch.equal(_fp16_tiny_grad(True, torch.optim.SGD, lr=1e4), torch.zeros(3))
    assert torch.equal(_fp16_tiny_grad(True, torch.optim.Adam, lr=1e-3), torch.zeros(3))


# -------------------------------------------------------------- 6. fused optimizers


@pytest.mark.parametrize("explicit_unscale", [False, True], ids=["step_only", "unscale_first"])
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    ],
    ids=["adamw", "sgd"],
)
def test_fused_optimizer_contract(make_opt, explicit_unscale):
    model = make_mlp()
    opt = make_opt(model.parameters())
    s = ShardedGradScaler("cpu", init_scale=2.0**10)
    seen = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: seen.append((o.grad_scale, o.found_inf.clone()))
    )

    def one(i, bad):
        opt.zero_grad()
        s.scale(loss_at(model, i, bad)).backward()
        if explicit_unscale:
            s.unscale_(opt)
        s.step(opt)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        s.update()

    one(0, {})
    grad_scale, found_inf = seen[-1]
    assert found_inf.dim() == 0 and found_inf.dtype == torch.float32 and float(found_inf) == 0.0
    if explicit_unscale:
        assert grad_scale is None
    else:
        assert grad_scale.dim() == 0 and float(grad_scale) == 2.0**10
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    one(1, {1: math.inf})
    assert float(seen[-1][1]) == 1.0
    assert bool(s.last_step_skipped(opt))
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    after = opt.state_dict()["state"]
    for k in state:
        for key in state[k]:
            assert torch.equal(torch.as_tensor(state[k][key]), torch.as_tensor(after[k][key]))
    if "step" in state[0]:
        assert float(after[0]["step"]) == 1.0
    one(2, {})
    assert not bool(s.last_step_skipped(opt))
    if "step" in state[0]:
        assert float(opt.state_dict()["state"][0]["step"]) == 2.0
    assert s.get_scale() == 2.0**9


# ---------------------------------------------------------------- 7. scale floor


def test_scale_never_reaches_zero_under_forced_overflows():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    ours = ShardedGradScaler("cpu", on_collapse="warn")
    ref = torch_scaler()
    min_scale = ours.config.min_scale
    collapses = 0
    for _ in range(200):
        for s in (ours, ref):
            opt.zero_grad()
            s.scale(p.sum() * math.inf).backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                s.step(opt)
                s.update()
            collapses += sum(issubclass(w.category, RuntimeWarning) for w in caught)
        assert ours.get_scale() >= min_scale > 0.0
    assert ours.get_scale() == min_scale == 2.0**-126
    assert ref.get_scale() == 0.0  # torch's scale collapses to exactly 0
    # 2**16 * 0.5**142 == 2**-126: the warnings start once the floor is reached
    assert collapses == 200 - 142
    assert torch.equal(p.detach(), torch.zeros(2))
    assert ours.metrics()["consecutive_skips"] == 200


def test_numpy_and_tensor_hyperparameters_are_accepted_like_torch():
    """torch.amp.GradScaler takes NumPy scalars and 1-element tensors; so does shardscale, and
    its state_dict then holds plain Python numbers."""
    np = pytest.importorskip("numpy")
    s = ShardedGradScaler(
        "cpu",
        init_scale=np.float32(1024),
        growth_interval=np.int64(10),
        growth_factor=torch.tensor(4.0),
    )
    sd = s.state_dict()
    assert (sd["scale"], sd["growth_interval"], sd["growth_factor"]) == (1024.0, 10, 4.0)
    assert type(sd["growth_interval"]) is int and type(sd["growth_factor"]) is float


def test_torch_private_accessors_some_libraries_read():
    s = ShardedGradScaler("cpu", init_scale=8.0)
    assert s._scale is None and s._growth_tracker is None and s._get_growth_tracker() == 0
    s.scale(torch.ones(()))
    assert s._scale.item() == 8.0 and s._scale.dtype == torch.float32
    assert s._growth_tracker.item() == 0 and s._get_growth_tracker() == 0


def test_disabled_scaler_keeps_the_scheduler_pattern_working():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s = ShardedGradScaler("cpu", enabled=False)
    s.scale(p.sum()).backward()
    s.step(opt)
    s.update()
    assert not bool(s.last_step_skipped(opt)) and not bool(s.last_step_skipped())


def test_numpy_and_int_arguments_accepted_as_torch_does():
    import numpy as np

    for enabled in (1, np.True_, 0, np.False_):
        s = ShardedGradScaler("cpu", enabled=enabled)
        assert s.is_enabled() is bool(enabled)
        assert torch.amp.GradScaler("cpu", enabled=enabled).is_enabled() == bool(enabled)
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    norms = []
    for max_norm, norm_type in [
        (1.0, 2.0),
        (np.float32(1.0), 2.0),
        (np.int64(1), 2),
        (1.0, np.float32(2.0)),
        (1.0, torch.tensor(2.0)),
    ]:
        s = ShardedGradScaler("cpu", init_scale=8.0)
        m.zero_grad()
        s.scale(m(torch.ones(2)).sum()).backward()
        norms.append(s.clip_grad_norm_(opt, max_norm, norm_type).item())
        s.update(8.0)  # no step: the gradients are recomputed each round
    assert len(set(norms)) == 1


def test_disabled_metrics_have_the_same_keys():
    on, off = ShardedGradScaler("cpu"), ShardedGradScaler("cpu", enabled=False)
    assert off.metrics().keys() == on.metrics().keys()
    assert off.metrics()["scale"] == 1.0 and off.metrics()["skipped_steps"] == 0


@pytest.mark.parametrize(
    "kw, poison",
    [
        ({"init_scale": 2.0**-12, "min_scale": 1e-4, "on_collapse": "warn"}, True),
        ({"init_scale": 0.25, "max_scale": 0.3, "growth_interval": 1}, False),
        ({"init_scale": 0.3, "max_scale": 0.3}, False),
    ],
)
def test_state_dict_at_a_bound_float32_cannot_hold_loads_back(kw, poison):
    """The float32 scale clamped at min_scale=1e-4 (or max_scale=0.3) sits just outside the
    Python-float bound; its state_dict must load back, into the same and a fresh scaler."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    s = ShardedGradScaler("cpu", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the collapse warning at min_scale
        for _ in range(3):
            s.scale((p * (math.inf if poison else 1.0)).sum()).backward()
            s.step(opt)
            s.update()
            opt.zero_grad()
    sd = s.state_dict()
    bound = kw.get("min_scale", kw.get("max_scale"))
    assert sd["scale"] == struct.unpack("f", struct.pack("f", bound))[0] != bound
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    for target in (s, ShardedGradScaler("cpu", **kw)):
        target.load_state_dict(loaded)
        assert target.state_dict()["scale"] == sd["scale"]


def test_copies_share_the_process_group():
    import copy

    group = object()  # a stand-in for a process group handle (never used here)
    s = ShardedGradScaler("cpu")
    s.process_group = group
    assert copy.copy(s).process_group is group
    assert copy.deepcopy(s).process_group is group


def test_inverse_scale_follows_every_write_of_the_scale():
    """Growth, backoff, load_state_dict and a user's in-place write of the scale are all seen
    by the next unscale_."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = ShardedGradScaler(init_scale=8.0, growth_interval=1)

    def unscaled(grad_value: float) -> float:
        scaler.scale(torch.ones(()))
        p.grad = torch.full((4,), grad_value)
        scaler.unscale_(opt)
        got = p.grad[0].item()
        scaler.step(opt)
        scaler.update()
        return got

    assert unscaled(8.0) == 1.0  # scale 8, then grows to 16
    assert unscaled(16.0) == 1.0  # 16 -> 32
    assert unscaled(float("inf")) != 1.0  # overflow: 32 -> 16
    assert scaler.get_scale() == 16.0 and unscaled(16.0) == 1.0  # -> 32
    scaler.load_state_dict({**scaler.state_dict(), "scale": 4.0})
    assert unscaled(4.0) == 1.0  # -> 8
    scaler._scale.fill_(2.0)  # torch's private attribute, written in place
    assert unscaled(2.0) == 1.0


# ------------------------------------------------------------------ gradient layouts
def _layout_params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [
        (300, 100),
        (50,),
        (7,),
        (100, 300),
        (8, 16, 5, 5),
        (3000,),
        (64,),
        (20_000,),
        (100, 90),
    ]
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _layout_grads(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    """Scaled gradients of every layout: contiguous, small, transposed, channels-last, a slice
    with gaps between its rows; an inf at step 2."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = []
    for i, p in enumerate(params):
        if i == 3:  # transposed: not contiguous
            g = torch.randn(p.shape[::-1], generator=gen).t()
        elif i == 8:  # rows of 90 elements 120 apart
            g = torch.randn(100, 120, generator=gen)[:, :90]
        else:
            g = torch.randn(p.shape, generator=gen)
        if i == 4:
            g = g.contiguous(memory_format=torch.channels_last)
        g.mul_(1024.0)  # in place: keeps the layout
        if step == 2 and i == 5:
            g[17] = float("inf")
        grads.append(g)
    return grads


def test_every_gradient_layout_unscales_as_torch_bit_for_bit() -> None:
    """Contiguous, small, transposed, channels-last and gapped gradients: unscaled gradients
    (layouts kept), steps and scales equal torch's."""
    runs = []
    for make in (ShardedGradScaler, torch.amp.GradScaler):
        params = _layout_params()
        opt = torch.optim.SGD(params, lr=0.01)
        scaler = make("cpu", init_scale=1024.0, growth_interval=2)
        seen = []
        for step in range(5):
            scaler.scale(torch.ones(()))
            for p, g in zip(params, _layout_grads(params, step), strict=True):
                p.grad = g
            scaler.unscale_(opt)
            seen += [p.grad.clone() for p in params]
            scaler.step(opt)
            scaler.update()
            seen.append(torch.tensor(scaler.get_scale()))
        runs.append(seen + [p.detach() for p in params])
        assert not params[8].grad.is_contiguous() and params[4].grad.is_contiguous(
            memory_format=torch.channels_last
        )
    for ours, theirs in zip(*runs, strict=True):
        assert ours.stride() == theirs.stride()
        assert torch.equal(ours, theirs)


def test_a_parameter_in_two_param_groups_is_unscaled_once() -> None:
    """torch refuses it at construction, but param_groups can be edited after: still once."""
    w, b = nn.Parameter(torch.ones(10)), nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([{"params": [w, b]}, {"params": []}], lr=0.1)
    opt.param_groups[1]["params"].append(w)
    scaler = ShardedGradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    w.grad, b.grad = torch.full((10,), 8.0), torch.full((3,), 16.0)
    scaler.unscale_(opt)
    assert torch.equal(w.grad, torch.ones(10)) and torch.equal(b.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("clip", [False, True])
def test_a_default_device_does_not_move_the_scalers_cpu_tensors(clip) -> None:
    """Tensors the scaler makes for a CPU step (found-inf flags, skipped flags, norms, counters)
    are made on the CPU explicitly: under ``torch.device("meta")`` (or
    ``torch.set_default_device``) the iteration gives the same results as without it."""

    def run(context: bool) -> list[torch.Tensor]:
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        out = []
        for i in range(5):
            scaler.scale(loss_at(model, i, {2: float("inf")})).backward()
            with torch.device("meta") if context else contextlib.nullcontext():
                if clip:
                    out.append(scaler.clip_grad_norm_(opt, 0.5))
                else:
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
                out.append(scaler.last_step_skipped())
            opt.zero_grad()
        return (
            out
            + [p.detach().clone() for p in model.parameters()]
            + [torch.tensor(scaler.get_scale())]
        )

    for ours, plain in zip(run(True), run(False), strict=True):
        assert ours.device.type == "cpu"
        torch.testing.assert_close(ours, plain, rtol=0, atol=0, equal_nan=True)  # the inf step: NaN
