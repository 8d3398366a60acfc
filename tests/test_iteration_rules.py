"""The rules of an iteration (issue 21), each checked against the right result (parameters,
gradients, the scale on every rank), not only against nothing raising:

1. a wrapper sharing an optimizer's param groups and that optimizer are one optimizer;
3. a parameter listed twice (tied) is unscaled once, fused optimizers included;
4. a ``scale()`` after ``unscale_`` begins a new backward pass (sharpness-aware optimizers, a
   guard that drops a pass); gradients added to unscaled ones are refused;
5. a ``backward()`` without ``scale()`` is an error, except zero gradients and idle ranks;
   ``load_state_dict`` after ``scale()`` is refused.

The references are torch's optimizers stepped on the unscaled gradients in fp32, no scaler.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from shardscale import ShardedGradScaler

S = 1024.0
INF = float("inf")


def _grad(i: int, n: int = 4) -> torch.Tensor:
    return torch.arange(1.0, n + 1.0) * (i + 1) / 8.0


def _make(kind: str, params, lr: float = 0.1) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "sgd_fused":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=True)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    return torch.optim.AdamW(params, lr=lr, fused=True)


class _Property(torch.optim.Optimizer):
    """A wrapper whose param_groups is the inner optimizer's (accelerate's AcceleratedOptimizer,
    LARS-style wrappers): a property."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer, self.defaults = inner, inner.defaults

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        return self.optimizer.step(closure)


class _Shared(torch.optim.Optimizer):
    """A wrapper holding the inner optimizer's param-group list itself (Lookahead)."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.base, self.defaults = inner, inner.defaults
        self.param_groups, self.state = inner.param_groups, inner.state

    def step(self, closure=None):
        return self.base.step(closure)


# ------------------------------------------------------- 1. a wrapper and its inner optimizer
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
@pytest.mark.parametrize("wrapper", [_Property, _Shared])
@pytest.mark.parametrize("first", ["wrapper", "inner"])
@pytest.mark.parametrize("call", ["unscale_", "clip_grad_norm_"])
def test_a_wrapper_and_its_inner_optimizer_are_one_optimizer(kind, wrapper, first, call):
    """accelerate#113: unscale_(wrapper) then step(inner), or the reverse, unscales once: the
    parameters are the fp32 reference's and the gradients end unscaled, once."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    ref = w.detach().clone().requires_grad_()
    inner = _make(kind, [w])
    outer = wrapper(inner)
    ref_opt = _make(kind, [ref])
    s = ShardedGradScaler("cpu", init_scale=S, growth_interval=1)
    for i in range(3):
        s.scale(torch.ones(()))
        w.grad, ref.grad = _grad(i) * s.get_scale(), _grad(i)
        a, b = (outer, inner) if first == "wrapper" else (inner, outer)
        if call == "unscale_":
            s.unscale_(a)
        else:
            s.clip_grad_norm_(a, 1e9)
        with pytest.raises(RuntimeError, match="already been called"):
            s.unscale_(b)  # the same record: its gradients are unscaled already
        s.step(b)
        s.update()
        ref_opt.step()
        torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
        if kind == "sgd":
            assert torch.equal(w.grad, _grad(i))  # divided once
        assert not s.last_step_skipped(a) and not s.last_step_skipped(b)
    assert s.metrics()["steps"] == 3 and s.get_scale() == S * 8  # every step counted, once


def test_a_wrapper_stepped_twice_with_its_inner_optimizer_is_refused():
    w = torch.nn.Parameter(torch.ones(4))
    inner = torch.optim.SGD([w], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=S)
    s.scale(torch.ones(()))
    w.grad = _grad(0) * S
    s.step(_Property(inner))
    before = w.detach().clone()
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        s.step(inner)
    assert torch.equal(w.detach(), before)


def test_accelerates_optimizer_unscaled_by_hand_then_stepped():
    """The real AcceleratedOptimizer (accelerate#113): scaler.unscale_(the prepared optimizer),
    then optimizer.step(), which calls scaler.step(the inner optimizer) and update()."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        Accelerator(cpu=True)  # accelerate's process-wide state, which its optimizer reads
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4))
        ref = w.detach().clone().requires_grad_()
        s = ShardedGradScaler("cpu", init_scale=S)
        opt = AcceleratedOptimizer(torch.optim.SGD([w], lr=0.1), device_placement=False, scaler=s)
        ref_opt = torch.optim.SGD([ref], lr=0.1)
        for i in range(2):
            s.scale(torch.ones(()))
            w.grad, ref.grad = _grad(i) * S, _grad(i)
            s.unscale_(opt)
            opt.step()
            ref_opt.step()
            torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
            assert not opt.step_was_skipped
        assert s.metrics()["steps"] == 2
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _wrapper_two_ranks(rank: int, world_size: int, kind: str) -> dict:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    ref = w.detach().clone().requires_grad_()
    inner, ref_opt = _make(kind, [w]), _make(kind, [ref])
    outer = _Property(inner)
    s = ShardedGradScaler("cpu", init_scale=S, growth_interval=2)
    scales = []
    for i in range(4):
        s.scale(torch.ones(()))
        bad = rank == 1 and i == 2
        g = _grad(10 * rank + i) * s.get_scale() * (INF if bad else 1.0)
        dist.all_reduce(g)
        w.grad = g / world_size
        s.unscale_(outer)
        s.step(inner)
        s.update()
        scales.append(s.get_scale())
        if i != 2:  # the reference steps the clean iterations on the averaged gradients
            mean = sum(_grad(10 * r + i) for r in range(world_size)) / world_size
            ref.grad = mean
            ref_opt.step()
    return {"scales": scales, "w": w.detach().clone(), "ref": ref.detach().clone()}


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_a_wrapper_and_its_inner_optimizer_on_two_ranks(tmp_path, kind):
    r0, r1 = run_ranks(_wrapper_two_ranks, tmp_path, kind)
    assert r0["scales"] == r1["scales"] == [S, S * 2, S, S]  # grew after 2, backed off at 2
    for r in (r0, r1):
        torch.testing.assert_close(r["w"], r["ref"], rtol=1e-6, atol=1e-7)
    assert torch.equal(r0["w"], r1["w"])


# ------------------------------------------------------------------------ 3. tied parameters
@pytest.mark.parametrize("kind", ["sgd", "sgd_fused", "adamw", "adamw_fused"])
@pytest.mark.parametrize("path", ["step", "unscale_", "clip_grad_norm_"])
def test_a_parameter_listed_twice_is_unscaled_once(kind, path):
    """pytorch#40967: tied weights listed twice in one group. torch's fused kernels divide each
    listing's gradient by grad_scale and write it back: the second listing was divided twice.
    Every path now gives the fp32 reference's parameters (the same optimizer, the same list,
    no scaler) and leaves the gradient unscaled once."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    ref = w.detach().clone().requires_grad_()
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt, ref_opt = _make(kind, [w, w]), _make(kind, [ref, ref])
    s = ShardedGradScaler("cpu", init_scale=S)
    for i in range(3):
        s.scale(torch.ones(()))
        w.grad, ref.grad = _grad(i) * S, _grad(i)
        if path == "unscale_":
            s.unscale_(opt)
        elif path == "clip_grad_norm_":
            s.clip_grad_norm_(opt, 1e9)
        s.step(opt)
        s.update()
        ref_opt.step()
        torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(w.grad, ref.grad, rtol=1e-6, atol=0)
    assert s.metrics()["steps"] == 3


def test_torchs_scaler_divides_a_fused_tied_gradient_twice():
    w = torch.nn.Parameter(torch.ones(4))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = torch.optim.SGD([w, w], lr=0.1, fused=True)
    s = torch.amp.GradScaler("cpu", init_scale=S)
    s.scale(torch.ones(()))
    w.grad = _grad(0) * S
    s.step(opt)
    torch.testing.assert_close(w.grad, _grad(0) / S)


@pytest.mark.parametrize("kind", ["sgd_fused", "adamw_fused"])
def test_a_tied_overflow_is_still_skipped(kind):
    w = torch.nn.Parameter(torch.ones(4))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = _make(kind, [w, w])
    s = ShardedGradScaler("cpu", init_scale=S)
    s.scale(torch.ones(()))
    w.grad = torch.tensor([1.0, INF, 1.0, 1.0])
    s.step(opt)
    s.update()
    assert bool(s.last_step_skipped(opt)) and s.get_scale() == S / 2
    assert torch.equal(w.detach(), torch.ones(4))


# -------------------------------------------------------------- 4. two backward passes a step
def _sam_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (w * x).sin().sum() + (w**2).sum()


def _sam(w, opt, x, scale, unscale, zero):
    """One sharpness-aware step (SAM/GSAM): backward, (unscale_), perturb the weights along the
    gradient, zero_grad, backward again at the perturbed point, restore, step."""
    loss = _sam_loss(w, x)
    scale(loss).backward()
    unscale(opt)
    with torch.no_grad():
        e = 0.05 * w.grad / (w.grad.norm() + 1e-12)
        w.add_(e)
    zero(opt)
    scale(_sam_loss(w, x)).backward()
    with torch.no_grad():
        w.sub_(e)


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_sharpness_aware_steps_apply_the_second_pass_unscaled(kind, set_to_none):
    """GSAM#2: unscale_, perturb, zero_grad, scale(loss2).backward(), step. torch's scaler
    applies the second pass's gradients still scaled (1024x); here the parameters are the fp32
    SAM's, every step."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    ref = w.detach().clone().requires_grad_()
    opt, ref_opt = _make(kind, [w], lr=0.01), _make(kind, [ref], lr=0.01)
    s = ShardedGradScaler("cpu", init_scale=S, growth_interval=2)
    for i in range(4):
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad()
        _sam(w, opt, x, s.scale, s.unscale_, lambda o: o.zero_grad(set_to_none=set_to_none))
        s.step(opt)
        s.update()
        _sam(ref, ref_opt, x, lambda v: v, lambda o: None, lambda o: o.zero_grad())
        ref_opt.step()
        torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert s.metrics()["steps"] == 4 and s.get_scale() == S * 4  # one iteration each


def test_torchs_scaler_applies_the_second_pass_still_scaled():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    ref = w.detach().clone().requires_grad_()
    opt, ref_opt = torch.optim.SGD([w], lr=0.01), torch.optim.SGD([ref], lr=0.01)
    s = torch.amp.GradScaler("cpu", init_scale=S)
    x = torch.randn(4, generator=torch.Generator().manual_seed(0))
    start = w.detach().clone()
    _sam(w, opt, x, s.scale, s.unscale_, lambda o: o.zero_grad())
    s.step(opt)
    _sam(ref, ref_opt, x, lambda v: v, lambda o: None, lambda o: o.zero_grad())
    ref_opt.step()
    torch.testing.assert_close(w.detach() - start, (ref.detach() - start) * S)


@pytest.mark.parametrize("overflow", [False, True])
def test_a_guard_that_drops_a_pass_after_unscale_needs_no_abandon(overflow):
    """A guard of the user's skips the iteration after unscale_ (no step, no update): the loop
    just goes on. The dropped pass and the next are one iteration: its step applies the next
    pass's gradients unscaled once; an overflow in the dropped pass skips that step too and
    backs the scale off once (as if update() had been called for it)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    ref = w.detach().clone().requires_grad_()
    opt, ref_opt = torch.optim.SGD([w], lr=0.1), torch.optim.SGD([ref], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=S, growth_interval=1)
    s.scale(torch.ones(()))
    w.grad = _grad(0) * S * (INF if overflow else 1e6)
    norm = s.clip_grad_norm_(opt, 1e9)
    assert norm.item() > 1e3  # the guard: drop this pass
    opt.zero_grad()
    s.scale(torch.ones(()))
    w.grad, ref.grad = _grad(1) * S, _grad(1)
    s.unscale_(opt)  # torch's scaler: "unscale_() has already been called"
    s.step(opt)
    s.update()
    if overflow:
        assert bool(s.last_step_skipped(opt)) and s.get_scale() == S / 2
        assert torch.equal(w.detach(), ref.detach())
    else:
        ref_opt.step()
        assert not s.last_step_skipped(opt) and s.get_scale() == S * 2
        torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert s.metrics()["steps"] == 1


@pytest.mark.parametrize("call", ["step", "unscale_", "clip_grad_norm_"])
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_gradients_added_to_unscaled_ones_are_refused(call, kind):
    """No zero_grad between the passes: the second backward adds scaled gradients to unscaled
    ones. Refused before anything is written, naming the fix; after the fix the loop goes on."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = _make(kind, [w])
    s = ShardedGradScaler("cpu", init_scale=S)
    (s.scale(w.sum())).backward()
    s.unscale_(opt)
    s.scale((2 * w).sum()).backward()  # accumulates onto the unscaled gradient
    grad, before = w.grad.clone(), w.detach().clone()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) before the next scaler\.scale"):
        if call == "clip_grad_norm_":
            s.clip_grad_norm_(opt, 1.0)
        else:
            getattr(s, call)(opt)
    assert torch.equal(w.grad, grad) and torch.equal(w.detach(), before)
    opt.zero_grad()
    s.scale((2 * w).sum()).backward()
    s.step(opt)
    s.update()
    assert not s.last_step_skipped(opt) and s.metrics()["steps"] == 1
    assert torch.equal(w.grad, torch.full((4,), 2.0))  # the second pass's, unscaled once


def test_gradients_a_new_pass_leaves_alone_are_not_unscaled_again():
    """unscale_(a), then a backward that reaches only b's parameters: a's gradients stay
    unscaled once, b's are unscaled once."""
    wa, wb = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    oa, ob = torch.optim.SGD([wa], lr=0.1), torch.optim.SGD([wb], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=S)
    s.scale((3 * wa).sum()).backward()
    s.unscale_(oa)
    s.scale((5 * wb).sum()).backward()
    s.step(oa)
    s.step(ob)
    s.update()
    assert torch.equal(wa.grad, torch.full((4,), 3.0))
    assert torch.equal(wb.grad, torch.full((4,), 5.0))
    assert torch.equal(wa.detach(), torch.full((4,), 0.7)) and s.metrics()["steps"] == 1


def test_a_clip_of_parameters_then_a_new_pass():
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=S)
    s.scale((3 * w).sum()).backward()
    s.clip_grad_norm_([w], 1e9)
    opt.zero_grad()
    s.scale((2 * w).sum()).backward()
    s.clip_grad_norm_([w], 1e9)  # the new gradients: unscaled, once
    s.step(opt)
    s.update()
    assert torch.equal(w.grad, torch.full((4,), 2.0))
    assert torch.equal(w.detach(), torch.full((4,), 0.8))


def _sam_two_ranks(rank: int, world_size: int, kind: str) -> dict:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    ref = w.detach().clone().requires_grad_()
    opt, ref_opt = _make(kind, [w], lr=0.01), _make(kind, [ref], lr=0.01)
    s = ShardedGradScaler("cpu", init_scale=S, growth_interval=2)

    def averaged(scale, param):
        """``scale``, whose result's backward() averages ``param``'s gradient over the ranks
        (data parallelism by hand)."""

        class _Averaged:
            def __init__(self, loss):
                self.loss = scale(loss)

            def backward(self):
                self.loss.backward()
                dist.all_reduce(param.grad)
                param.grad /= world_size

        return _Averaged

    scales = []
    for i in range(3):
        x = torch.randn(4, generator=torch.Generator().manual_seed(10 * rank + i))
        opt.zero_grad()
        ref_opt.zero_grad()
        _sam(w, opt, x, averaged(s.scale, w), s.unscale_, lambda o: o.zero_grad())
        s.step(opt)
        s.update()
        scales.append(s.get_scale())
        _sam(ref, ref_opt, x, averaged(lambda v: v, ref), lambda o: None, lambda o: o.zero_grad())
        ref_opt.step()
    return {"scales": scales, "w": w.detach().clone(), "ref": ref.detach().clone()}


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_sharpness_aware_steps_on_two_ranks(tmp_path, kind):
    r0, r1 = run_ranks(_sam_two_ranks, tmp_path, kind)
    assert r0["scales"] == r1["scales"] == [S, S * 2, S * 2]
    for r in (r0, r1):
        torch.testing.assert_close(r["w"], r["ref"], rtol=1e-5, atol=1e-6)
    assert torch.equal(r0["w"], r1["w"])


# --------------------------------------------------------------------- 5. a forgotten scale()
@pytest.mark.parametrize("call", ["step", "unscale_", "clip_grad_norm_", "clip_params"])
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_a_backward_without_scale_is_an_error(call, kind):
    """loss.backward() without scaler.scale(loss): torch's AssertionError ("did not use
    scaler.scale(loss or outputs)"), a RuntimeError here too, naming the fix; nothing is
    unscaled, stepped or counted. After the fix the loop goes on."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = _make(kind, [w])
    s = ShardedGradScaler("cpu", init_scale=S)
    (3 * w).sum().backward()
    with pytest.raises(RuntimeError, match=r"did not use scaler\.scale\(loss or outputs\)") as e:
        if call == "clip_grad_norm_":
            s.clip_grad_norm_(opt, 1.0)
        elif call == "clip_params":
            s.clip_grad_norm_([w], 1.0)
        else:
            getattr(s, call)(opt)
    assert isinstance(e.value, AssertionError) and "scaler.scale(loss).backward()" in str(e.value)
    assert torch.equal(w.grad, torch.full((4,), 3.0)) and torch.equal(w.detach(), torch.ones(4))
    assert not s._per_optimizer_states and s.metrics()["steps"] == 0
    opt.zero_grad()
    s.scale((3 * w).sum()).backward()
    s.step(opt)
    s.update()
    assert s.metrics()["steps"] == 1 and torch.equal(w.grad, torch.full((4,), 3.0))


@pytest.mark.parametrize("loaded", [False, True])
def test_zero_gradients_without_scale_stay_quiet(loaded):
    """Checkpoint plumbing (torch.distributed.checkpoint's set_optimizer_state_dict: a step on
    zero gradients, through a wrapper that drives the scaler), on a fresh or a loaded scaler:
    no error, nothing counted."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([w], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=S)
    if loaded:
        s.load_state_dict({**s.state_dict(), "scale": 64.0})
    w.grad = torch.zeros(4)
    s.step(opt)
    s.update()
    assert opt.state[w]["step"] == 1 and s.metrics()["steps"] == 0
    assert s.get_scale() == (64.0 if loaded else S)


def _no_rank_scaled(rank: int, world_size: int, call: str, idle: bool) -> dict:
    """No rank calls scale() (``idle``: rank 1 has no gradients; else both backward)."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=S)
    if not (idle and rank == 1):
        (3 * w).sum().backward()
    try:
        if call == "clip_grad_norm_":
            s.clip_grad_norm_(opt, 1e9)
        else:
            getattr(s, call)(opt)
    except RuntimeError as e:
        return {"error": str(e), "w": w.detach().clone()}
    return {"error": None, "w": w.detach().clone()}


@pytest.mark.dist
@pytest.mark.parametrize("call", ["step", "unscale_", "clip_grad_norm_"])
def test_no_rank_scaled_on_two_ranks(tmp_path, call):
    """Both ranks decide from the agreement (no collective added): every rank with gradients
    raises; a rank without any stays quiet."""
    for idle in (False, True):
        r0, r1 = run_ranks(_no_rank_scaled, tmp_path, call, idle)
        assert "did not use scaler.scale" in r0["error"]
        assert (r1["error"] is None) if idle else ("did not use scaler.scale" in r1["error"])
        assert torch.equal(r0["w"], torch.ones(4)) and torch.equal(r1["w"], torch.ones(4))


def _idle_rank_unscales_its_peers_gradients(rank: int, world_size: int, kind: str) -> dict:
    """Rank 1 has no data (no scale()) in iteration 0 of a fresh scaler and in iteration 1 of
    a loaded one: its gradients are rank 0's (the data-parallel average), unscaled once."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = _make(kind, [w])
    s = ShardedGradScaler("cpu", init_scale=S)
    for i in range(3):
        if i == 2:
            s.load_state_dict(copy.deepcopy(s.state_dict()))
        opt.zero_grad()
        idle = rank == 1 and i != 1
        if idle:
            w.grad = torch.zeros(4)
        else:
            s.scale((w * _grad(i)).sum()).backward()
        dist.all_reduce(w.grad)
        s.step(opt)
        s.update()
    return {"w": w.detach().clone(), "steps": s.metrics()["steps"], "scale": s.get_scale()}


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_an_idle_ranks_gradients_are_its_peers_unscaled_once(tmp_path, kind):
    r0, r1 = run_ranks(_idle_rank_unscales_its_peers_gradients, tmp_path, kind)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    ref = _make(kind, [w])
    for i in range(3):
        w.grad = _grad(i) * (2 if i == 1 else 1)  # the sum over the ranks that had data
        ref.step()
    for r in (r0, r1):
        torch.testing.assert_close(r["w"], w.detach(), rtol=1e-6, atol=1e-7)
        assert r["steps"] == 3 and r["scale"] == S


def test_load_state_dict_after_scale_abandons_the_iteration():
    """torch loads after scale() (its own test does); the gradients then hold the old scale,
    which the loaded one would wrongly unscale: the iteration is abandoned, with a warning, and
    a step of those gradients raises until the loss is scaled again."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=S)
    saved = {**s.state_dict(), "scale": 8.0}
    s.scale((3 * w).sum()).backward()
    with pytest.warns(RuntimeWarning, match=r"after scale\(\).*abandoned"):
        s.load_state_dict(saved)
    assert s.get_scale() == 8.0
    with pytest.raises(
        RuntimeError, match=r"no rank of the scaler's process group called scale\(\)"
    ):
        s.step(opt)
    assert torch.equal(w.detach(), torch.ones(4))  # nothing unscaled or stepped
    opt.zero_grad()
    s.scale((3 * w).sum()).backward()  # 8 * 3 per element, unscaled by 1/8
    s.step(opt)
    s.update()
    assert torch.equal(w.detach(), torch.full((4,), 0.7)) and s.get_scale() == 8.0
    s.scale((3 * w).sum()).backward()
    s.step(opt)
    with pytest.raises(RuntimeError, match="iteration boundary"):  # after step(): refused
        s.load_state_dict(saved)
