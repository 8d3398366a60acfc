"""ShardedGradScaler is a torch.amp.GradScaler by type and by protocol: the private state and
methods that frameworks and ``grad_scaler=`` optimizers use exist and tell the truth, and every
process group torch's scalers accept is accepted."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from _optim import SelfUnscaling
from torch.amp.grad_scaler import OptState

from shardscale import ShardedGradScaler


def test_it_is_a_grad_scaler_and_overrides_every_public_method():
    s = ShardedGradScaler("cpu")
    assert isinstance(s, torch.amp.GradScaler)
    public = [n for n in vars(torch.amp.GradScaler) if not n.startswith("_")]
    inherited = [
        n for n in public if getattr(ShardedGradScaler, n) is getattr(torch.amp.GradScaler, n)
    ]
    assert public and not inherited, inherited


@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_an_optimizer_taking_grad_scaler_gets_the_scaler_and_steps_as_with_torch(explicit_unscale):
    runs = []
    for make in (ShardedGradScaler, torch.amp.GradScaler):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4))
        opt = SelfUnscaling([w])
        scaler = make("cpu", init_scale=8.0, growth_interval=2)
        out = []
        for i in range(5):
            opt.zero_grad()
            scaler.scale((w * (float("inf") if i == 2 else 1.0)).sum() * w.sum()).backward()
            if explicit_unscale:
                scaler.unscale_(opt)
            with pytest.warns(FutureWarning, match="stop passing itself"):
                out.append(scaler.step(opt))
            assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
            scaler.update()
            out.append(scaler.get_scale())
        runs.append((out, w.detach().clone()))
    (ours, w_ours), (theirs, w_theirs) = runs
    assert ours == theirs and "skipped" in ours
    assert torch.equal(w_ours, w_theirs)


def test_the_per_optimizer_record_is_torchs_and_true():
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=4.0)
    s.scale(w.sum()).backward()
    s.unscale_(opt)
    state = s._per_optimizer_states[id(opt)]
    assert state["stage"] is OptState.UNSCALED
    ((device, flag),) = state["found_inf_per_device"].items()
    assert device == torch.device("cpu") and flag.shape == () and flag.item() == 0.0
    assert s._found_inf_per_device(opt) is state["found_inf_per_device"]
    s.step(opt)
    assert state["stage"] is OptState.STEPPED
    s.update()
    assert not s._per_optimizer_states  # cleared for the next iteration, as torch


def test_unscale_grads_and_check_inf_per_device_as_torch():
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    for make in (ShardedGradScaler, torch.amp.GradScaler):
        s = make("cpu", init_scale=4.0)
        s.scale(torch.ones(()))
        w.grad = torch.tensor([4.0, float("inf"), 8.0])
        found = s._check_inf_per_device(opt)  # a check: nothing unscaled
        assert [v.item() for v in found.values()] == [1.0]
        assert w.grad[0].item() == 4.0
        w.grad = torch.tensor([4.0, 2.0, 8.0])
        per_device = s._unscale_grads_(opt, torch.tensor(0.25), torch.zeros(()), True)
        assert [v.item() for v in per_device.values()] == [0.0]
        assert w.grad.tolist() == [1.0, 0.5, 2.0]
        h = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
        h.grad = torch.ones(3, dtype=torch.float16)
        with pytest.raises(ValueError, match="FP16"):
            s._unscale_grads_(
                torch.optim.SGD([h], lr=0.1), torch.tensor(0.25), torch.zeros(()), False
            )


def test_lazy_init_places_the_scale_before_the_first_scale_and_is_idempotent():
    """accelerate's checkpoint loading and CUDA-graph captures call it before scale()."""
    s = ShardedGradScaler("cpu", init_scale=16.0)
    s.load_state_dict({**ShardedGradScaler("cpu").state_dict(), "scale": 32.0})
    s._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert s._scale.item() == 32.0 and s._growth_tracker.item() == 0
    scale = s._scale
    s._lazy_init_scale_growth_tracker("cpu")  # again: the same tensors
    assert s._scale is scale
    assert s.scale(torch.ones(())).item() == 32.0


def test_init_growth_tracker_is_writable_as_torchs_and_a_load_resets_it():
    """torch's test_grad_scaling_state_dict writes it, then loads a checkpoint over it."""
    s = ShardedGradScaler("cpu")
    s._init_growth_tracker = 7
    s._lazy_init_scale_growth_tracker("cpu")
    assert s._growth_tracker.item() == 7  # the tracker the state is created with
    with pytest.raises(ValueError, match="_init_growth_tracker"):
        s._init_growth_tracker = -1
    s = ShardedGradScaler("cpu")
    s._init_growth_tracker = 7
    s.load_state_dict(ShardedGradScaler("cpu", growth_interval=3).state_dict())
    assert s._init_growth_tracker == 0 and s.get_growth_interval() == 3


def test_torch_attribute_names_read_and_write_the_policy():
    s = ShardedGradScaler("cpu", growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    assert (s._growth_factor, s._backoff_factor, s._growth_interval) == (3.0, 0.25, 7)
    assert (s._init_scale, s._enabled, s._device) == (2.0**16, True, "cpu")
    s._growth_factor = 4.0
    assert s.get_growth_factor() == 4.0 and s.config.growth_factor == 4.0
    with pytest.raises(ValueError, match="growth_factor"):
        s._growth_factor = 0.5


class _DummyGroup:
    """torch's test utilities' DummyProcessGroup: a duck-typed group of one rank."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def allreduce(self, *args, **kwargs):
        raise AssertionError("a group of one rank needs no collective")


def test_a_duck_typed_group_of_one_is_accepted_without_a_collective():
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    s = ShardedGradScaler("cpu", init_scale=4.0, process_group=_DummyGroup())
    s.scale(w.sum()).backward()
    s.step(opt)
    s.update()
    assert s.metrics()["steps"] == 1


def test_a_fake_process_group_of_two_is_accepted():
    """torch's FakeProcessGroup (testing at world size 2 in one process): collectives return
    their input; the scaler runs its one all-reduce through it."""
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.tensor.debug import CommDebugMode
        from shardscale import ShardedGradScaler
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        w = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([w], lr=0.1)
        s = ShardedGradScaler("cpu", init_scale=4.0)
        with CommDebugMode() as comm:
            s.scale(w.sum()).backward()
            s.step(opt)
            s.update()
        assert comm.get_total_counts() == 1, comm.get_total_counts()
        assert s.metrics()["steps"] == 1 and torch.equal(w.detach(), torch.full((3,), 0.9))
        print("ok")
        """
    )
    with warnings.catch_warnings():
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
