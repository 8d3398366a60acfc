"""Optimizers the tests share."""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState


class SelfUnscaling(torch.optim.SGD):
    """torch's ``step(closure=None, *, grad_scaler=None)`` protocol, as apex's
    DistributedFusedAdam takes it: it reads the per-optimizer record, checks the gradients with
    ``_check_inf_per_device`` (or reads ``_found_inf_per_device`` after ``unscale_``), divides
    by the scale itself and skips by itself; returns ``"skipped"`` or ``"stepped"``."""

    def __init__(self, params):
        super().__init__(params, lr=0.5)
        self._step_supports_amp_scaling = True

    def step(self, closure=None, *, grad_scaler=None):
        if grad_scaler is None:
            raise AssertionError("the scaler did not pass itself: scaled gradients and inf applied")
        state = grad_scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:
            found = grad_scaler._check_inf_per_device(self)
        else:
            found = grad_scaler._found_inf_per_device(self)
        if sum(v.item() for v in found.values()):
            return "skipped"
        scale = grad_scaler._get_scale_async() if state["stage"] is OptState.READY else 1.0
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p.grad.div_(scale)
        super().step()
        return "stepped"
