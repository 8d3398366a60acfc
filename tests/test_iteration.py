"""Iteration control: idle ranks, abandoning an iteration, update() once per iteration, the
zero-gradient step of checkpoint plumbing, placing the scale before the first scale()."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from shardscale import ShardedGradScaler

INF = float("inf")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _loss(model: torch.nn.Module, i: int, bad: bool = False) -> torch.Tensor:
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(i))
    return model(x).pow(2).mean() * (INF if bad else 1.0)


# ------------------------------------------------------------------------------ idle ranks
def _idle_rank(rank: int, world_size: int, fused: bool, resumed: bool) -> dict:
    """Rank 1 has no data at iterations 1 and 3 (no scale(), no backward: its gradients are
    None), and with ``resumed`` none since its process started after a resume (no scale() yet:
    iterations 0 and 1); rank 0 overflows at iteration 3."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    s = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    if resumed:
        s.load_state_dict({**s.state_dict(), "scale": 2.0**8, "_growth_tracker": 1})
    scales = []
    for i in range(6):
        opt.zero_grad(set_to_none=True)
        idle = rank == 1 and (i in (1, 3) or (resumed and i == 0))
        if not idle:
            s.scale(_loss(model, 10 * rank + i, bad=rank == 0 and i == 3)).backward()
        # data parallelism by hand: average the gradients of the ranks that have some
        for p in model.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            p.grad = g
        s.step(opt)
        s.update()
        scales.append(s.get_scale())
    m = s.metrics()
    params = [p.detach().clone() for p in model.parameters()]
    return {"scales": scales, "skipped": m["skipped_steps"], "steps": m["steps"], "params": params}


@pytest.mark.dist
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("resumed", [False, True])
def test_an_idle_rank_agrees_and_every_rank_ends_with_the_same_scale(tmp_path, fused, resumed):
    r0, r1 = run_ranks(_idle_rank, tmp_path, fused, resumed)
    assert r0["scales"] == r1["scales"]
    start = 2.0**8 if resumed else 2.0**10
    # growth every 2 clean iterations, the overflow at iteration 3 backs off on both ranks
    tracker = 1 if resumed else 0
    expected, scale = [], start
    for i in range(6):
        if i == 3:
            scale, tracker = scale / 2, 0
        else:
            tracker += 1
            if tracker == 2:
                scale, tracker = scale * 2, 0
        expected.append(scale)
    assert r0["scales"] == expected, (r0["scales"], expected)
    assert r0["skipped"] == r1["skipped"] == 1 and r0["steps"] == r1["steps"] == 6
    for p, q in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(p, q) and torch.isfinite(p).all()


def test_a_single_process_step_without_scale_counts_nothing():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=8.0, growth_interval=1)
    s.step(opt)  # no gradients, no scale(): the state is placed, nothing happens
    s.update()
    assert s.metrics()["steps"] == 0 and s.get_scale() == 8.0


# -------------------------------------------------------------------------- abandon
def _abandon(rank: int, world_size: int) -> dict:
    """A gradient-norm guard of the user's own abandons iteration 1 on every rank (the decision
    comes from the global norm, the same everywhere): nothing is stepped or counted, and the
    next iteration works."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    norms, scales = [], []
    for i in range(3):
        opt.zero_grad()
        s.scale(_loss(model, i) * (1e4 if i == 1 else 1.0)).backward()
        norm = s.clip_grad_norm_(opt, 1e9)  # the global norm: agreed
        norms.append(norm.item())
        before = [p.detach().clone() for p in model.parameters()]
        if norm.item() > 100.0:
            s.abandon()
            unchanged = all(
                torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
            )
            assert unchanged
        else:
            s.step(opt)
            s.update()
        scales.append(s.get_scale())
    params = [p.detach().clone() for p in model.parameters()]
    return {"norms": norms, "scales": scales, "steps": s.metrics()["steps"], "params": params}


@pytest.mark.dist
def test_abandoning_an_iteration_on_every_rank_keeps_them_together(tmp_path):
    r0, r1 = run_ranks(_abandon, tmp_path)
    assert r0["norms"] == r1["norms"] and r0["norms"][1] > 100.0
    assert r0["scales"] == r1["scales"] == [2.0**11, 2.0**11, 2.0**12]  # abandoned: not counted
    assert r0["steps"] == r1["steps"] == 2
    for p, q in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(p, q)


def test_abandon_after_unscale_lets_the_next_unscale_run():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=8.0)
    s.scale(_loss(model, 0)).backward()
    s.unscale_(opt)
    s.abandon()
    opt.zero_grad()
    s.scale(_loss(model, 1)).backward()
    s.unscale_(opt)  # torch's scaler: "unscale_() has already been called"
    s.step(opt)
    s.update()
    assert s.metrics()["steps"] == 1


# -------------------------------------------------------------- update() once per iteration
def test_update_after_each_of_two_optimizers_is_caught():
    """accelerate#439: each optimizer's wrapper calls step() and update(): the second
    optimizer's gradients were scaled before the first update(); a warning names the order."""
    a, b = _model(0), _model(1)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=8.0)
    s.scale(_loss(a, 0) + _loss(b, 0)).backward()
    s.step(opt_a)
    s.update()
    with pytest.warns(RuntimeWarning, match=r"update\(\) once per iteration"):
        s.step(opt_b)
    s.update()
    with warnings.catch_warnings():  # the right order warns nothing
        warnings.simplefilter("error")
        for opt in (opt_a, opt_b):
            opt.zero_grad()
        s.scale(_loss(a, 1) + _loss(b, 1)).backward()
        s.step(opt_a)
        s.step(opt_b)
        s.update()


@pytest.mark.parametrize("n_opts", [2, 3])
def test_update_after_each_optimizer_still_counts_their_overflows(n_opts):
    """The same pattern, with an inf in the last optimizer's gradients from iteration 2 on:
    its steps are skipped and every update counts as torch's does (the scales, the skips and
    the parameters equal torch.amp.GradScaler's), never taken for checkpoint plumbing."""
    results = []
    for make in (torch.amp.GradScaler, ShardedGradScaler):
        torch.manual_seed(0)
        models = [torch.nn.Linear(8, 1) for _ in range(n_opts)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        s = make("cpu", init_scale=256.0, growth_interval=3)
        scales = []
        for it in range(6):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it))
            losses = [m(x).mean() for m in models]
            losses[-1] = losses[-1] * (INF if it >= 2 else 1.0)
            s.scale(sum(losses)).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the order warning
                for opt in opts:
                    s.step(opt)
                    s.update()
                    scales.append(s.get_scale())
            for opt in opts:
                opt.zero_grad()
        results.append((scales, [p.detach().clone() for m in models for p in m.parameters()]))
    (torch_scales, torch_params), (ours, params) = results
    assert ours == torch_scales
    assert min(ours) < 256.0  # the overflows backed off
    for p, q in zip(params, torch_params, strict=True):
        assert torch.equal(p, q)
    assert s.metrics()["skipped_steps"] == 4  # the last optimizer's, iterations 2-5


# -------------------------------------------------- checkpoint plumbing's zero-gradient step
class _WrappedOptimizer(torch.optim.Optimizer):
    """An optimizer wrapper whose step() drives the scaler, as accelerate's AcceleratedOptimizer
    does: torch.distributed.checkpoint's set_optimizer_state_dict calls it with zero
    gradients to create the optimizer state before loading it (accelerate#4289)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: ShardedGradScaler):
        self.optimizer, self.scaler = optimizer, scaler
        self.defaults = optimizer.defaults

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure=None):
        self.steps = getattr(self, "steps", 0) + 1
        self.scaler.step(self.optimizer)
        self.scaler.update()


def test_the_zero_gradient_step_of_set_optimizer_state_dict_changes_nothing():
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict

    model = _model()
    s = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    opt = _WrappedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), s)
    for i in range(4):
        opt.zero_grad()
        s.scale(_loss(model, i)).backward()
        opt.step()
    _, optim_sd = get_state_dict(model, opt.optimizer)
    saved = s.state_dict()

    fresh_model = _model(1)
    fresh = ShardedGradScaler("cpu")
    fresh.load_state_dict(saved)
    wrapped = _WrappedOptimizer(torch.optim.Adam(fresh_model.parameters(), lr=1e-3), fresh)
    set_optimizer_state_dict(fresh_model, wrapped, optim_sd)  # runs wrapped.step() on zeros
    assert wrapped.steps == 1  # the dummy step did run through the scaler
    assert fresh.state_dict() == saved
    assert (
        wrapped.optimizer.state_dict()["state"][0]["step"]
        == optim_sd["state"][next(iter(optim_sd["state"]))]["step"]
    )


# ------------------------------------------------------------------------------ place()
def test_place_creates_the_state_before_the_first_scale_and_is_idempotent():
    s = ShardedGradScaler("cpu", init_scale=16.0)
    s.load_state_dict({**s.state_dict(), "scale": 64.0, "_growth_tracker": 3})
    s.place("cpu")
    scale = s._get_scale_async()
    assert scale is not None and scale.item() == 64.0 and s.metrics()["growth_tracker"] == 3
    s.place(torch.device("cpu"))
    assert s._get_scale_async() is scale  # the same tensor: a CUDA graph may hold it
    assert s.scale(torch.ones(())).item() == 64.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch or machine without CUDA")
def test_place_on_a_device_torch_cannot_use_says_so_and_changes_nothing():
    s = ShardedGradScaler("cpu")
    with pytest.raises(RuntimeError, match=r"place\(\) on 'cuda': torch cannot create tensors"):
        s.place("cuda")
    assert s._get_scale_async() is None and s.scale(torch.ones(())).item() == 2.0**16


# ------------------------------------------------------------- a user-set grad_scale
@pytest.mark.parametrize("path", ["step", "unscale_", "clip_grad_norm_"])
def test_a_user_set_grad_scale_of_a_fused_optimizer_is_honoured_on_every_path(path):
    """pytorch#123428: optimizer.grad_scale set by the user (e.g. gradients accumulated over 2
    micro-batches: divide by 2) must divide the update on every path, every step: the result
    equals halving the gradients by hand, and the user's value is there again afterwards."""
    out = []
    for user_scale in (2.0, None):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(6))
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, fused=True)  # the update ~ the gradient
        s = ShardedGradScaler("cpu", init_scale=2.0**10)
        for i in range(3):
            opt.zero_grad()
            factor = 1.0 if user_scale else 0.5
            s.scale((w * torch.arange(6.0) * (i + 1) * factor).sum()).backward()
            if user_scale:
                opt.grad_scale = torch.tensor(user_scale)
            if path == "unscale_":
                s.unscale_(opt)
            elif path == "clip_grad_norm_":
                s.clip_grad_norm_(opt, 1e9)
            s.step(opt)
            s.update()
            if user_scale:
                assert opt.grad_scale.item() == user_scale  # not dropped
        out.append(w.detach().clone())
    torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------ an overflow made by the unscale
class _KernelCalls(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.unscales = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.unscales += func is torch._amp_foreach_non_finite_check_and_unscale_
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("path", ["step", "fused", "unscale_", "clip_grad_norm_", "fused_clip"])
def test_gradients_that_overflow_only_once_unscaled_are_skipped(dtype, path):
    """pytorch#96755: a scale below 1 multiplies the gradients by 1/scale > 1: finite values
    near the dtype's top become inf. torch writes them into the parameters; here the step is
    skipped and the scale backs off, as for any overflow."""
    big = 40000.0 if dtype == torch.float16 else 3e38  # finite; times 1/0.5 is not
    w = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
    opt = torch.optim.SGD([w], lr=1e-9, fused=path.startswith("fused"))
    s = ShardedGradScaler("cpu", init_scale=0.5, min_scale=2.0**-10)
    s.scale(torch.ones(()))
    w.grad = torch.tensor([1.0, big, 2.0, 3.0], dtype=dtype)
    if path == "unscale_":
        s.unscale_(opt)
    elif path in ("clip_grad_norm_", "fused_clip"):
        s.clip_grad_norm_(opt, 1e30)
    s.step(opt)
    s.update()
    assert bool(s.last_step_skipped(opt)) and s.get_scale() == 0.25
    assert torch.equal(w.detach(), torch.zeros(4, dtype=dtype))


def test_torch_writes_such_an_overflow_into_the_parameters():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    s = torch.amp.GradScaler("cpu", init_scale=0.5)
    s.scale(torch.ones(()))
    w.grad = torch.tensor([1.0, 3e38])
    s.step(opt)
    s.update()
    assert torch.isinf(w.detach()[1]) and s.get_scale() == 0.5 * 2**0  # no backoff either


def _low_scale_two_ranks(rank: int, world_size: int) -> list:
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=1e-3)
    s = ShardedGradScaler("cpu", init_scale=0.5, min_scale=2.0**-10, growth_interval=10**6)
    out = []
    for i in range(3):
        s.scale(torch.ones(()))
        # rank 1's gradient overflows only once unscaled, at iteration 1
        big = 40000.0 if (rank == 1 and i == 1) else 1.0
        w.grad = torch.tensor([1.0, big, 1.0], dtype=torch.float16)
        s.step(opt)
        s.update()
        out.append((bool(s.last_step_skipped(opt)), s.get_scale(), w.detach().tolist()))
    return out


@pytest.mark.dist
def test_every_rank_skips_an_overflow_made_by_one_ranks_unscale(tmp_path):
    r0, r1 = run_ranks(_low_scale_two_ranks, tmp_path)
    assert r0 == r1
    assert [skipped for skipped, _, _ in r0] == [False, True, False]
    assert [scale for _, scale, _ in r0] == [0.5, 0.25, 0.25]
    assert all(all(v == v and abs(v) < 1 for v in params) for _, _, params in r0)


@pytest.mark.parametrize("init_scale", [1.0, 2.0**16])
def test_no_extra_pass_when_the_scale_is_at_least_one(init_scale):
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=init_scale, min_scale=2.0**-10)
    for _ in range(3):
        s.scale(torch.ones(()))
        w.grad = torch.ones(4)
        with _KernelCalls() as calls:
            s.step(opt)
        s.update()
        assert calls.unscales == 1
    s.load_state_dict({**s.state_dict(), "scale": 0.5})
    s.scale(torch.ones(()))
    w.grad = torch.ones(4)
    with _KernelCalls() as calls:
        s.step(opt)
    assert calls.unscales == 2  # below 1: the unscaled gradients are checked again
