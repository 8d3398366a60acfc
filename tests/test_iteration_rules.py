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
