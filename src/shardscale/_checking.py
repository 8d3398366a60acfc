"""One check of an optimizer's gradients: local check (and unscale) -> agreement -> record.

:class:`Checking` is a mixin of :class:`shardscale.ShardedGradScaler`; ``unscale_``, ``step``
and torch's ``_check_inf_per_device`` run :meth:`Checking._check`:

1. **local check**: the optimizer's local gradients (shards), bucketed by (device, dtype),
   unscaled and checked by torch's kernel (``_protocol.TorchInternals._unscale_grads_``); a
   fused step's only checked (factor 1: its kernel unscales); again unscaled when the host
   cannot rule out a scale below 1; the flags of parameters a clip unscaled joined in;
   ``policy="headroom"``: the amax measured in the same pass;
2. **agreement**: ONE all-reduce (MAX, :func:`shardscale._sync.agreement`) of the flag, the
   step, the check's ordinal, the scale, the policy and the amax; ranks that differ set the
   flag (the step is skipped on every rank) and the alarm, read at the first agreement after
   the scaler is made or loaded and by ``update()``;
3. **record**: :meth:`shardscale._iteration.Iteration.checked`.

A rank with no ``scale()`` since the scaler was made or loaded (an idle rank) checks with
factor 1 and unscales once the agreement says another rank scaled; on one process its
gradients must be zero (checkpoint plumbing) or :class:`~shardscale.NotScaledError` is raised.
A call-order error tells the other ranks first, through the all-reduce they wait in
(:meth:`Checking._fail`).

Reads the scaler's ``_it``, ``_loss_scale``, ``_config``, ``_headroom``, ``_bounds``,
``_alarm``, ``_verify``, ``_call``, ``process_group`` and ``_join_config`` (``Joinable``'s).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, NoReturn

import torch
from torch.amp.grad_scaler import OptState

from . import _grads, _headroom, _join, _sync
from ._iteration import ORDER, STALE


class Checking:
    """The scaler's check of one optimizer (see the module docstring)."""

    _it: Any
    _loss_scale: Any
    _config: Any
    _headroom: Any
    _bounds: Any
    _alarm: Any
    _verify: bool
    _call: str
    _join_config: Any
    process_group: Any

    def _unscale(self, optimizer: Any, state: dict[str, Any]) -> None:
        """``unscale_`` of a READY optimizer (``state``: its record), after the call-order
        checks."""
        if state["stage"] is OptState.UNSCALED:
            self._fail(
                1,
                "unscale_() has already been called on this optimizer since the last update(); "
                f"call it at most once per optimizer per iteration: {ORDER}.",
            )
        if state["stage"] is OptState.STEPPED:
            self._fail(3, f"unscale_() is being called after step(); the order is {ORDER}.")
        self._check(optimizer, state, unscale=True)

    def _check(self, optimizer: Any, state: dict[str, Any], unscale: bool) -> dict[str, Any]:
        """Local check (and unscale, ``unscale``) -> agreement -> record: ``optimizer``'s record
        with its agreed flag. On error the iteration is not started for ``optimizer``."""
        it, tensors, unit = self._it, self._loss_scale.tensors, self._loss_scale.unit
        home = tensors.scale.device
        idle = not (it.scaled_here or it.ever_scaled)
        probe = None  # policy="headroom": the amax is measured in the check pass
        if self._config.policy != "torch":
            probe = self._headroom.request(self._config, check_only=not unscale)
        try:
            inv = _grads.inv_scale(tensors.scale, self._loss_scale.math) if unscale else unit
            if probe is None:
                flags = self._unscale_grads_(optimizer, unit if idle else inv, None)
            else:
                flags = self._unscale_grads_(
                    optimizer, unit if idle else inv, None, amax=probe, check_only=not unscale
                )
            if flags and it.saw_gradients():
                warnings.warn(STALE, RuntimeWarning, stacklevel=4)
            local = _grads.combine_flags(flags, home)
            if unscale and self._bounds.below_one:  # 1/scale > 1: finite values may overflow
                again = self._unscale_grads_(optimizer, unit, None)
                local = torch.maximum(local, _grads.combine_flags(again, home))
            for flag in it.pre_unscaled_in(optimizer) if it.pre_unscaled else ():
                local = torch.maximum(local, flag)  # unscaled by clip_grad_norm_(params)
            amax = None if probe is None else _headroom.local_amax(probe, home)
            anyone, groups = None, _sync.cover(self.process_group, optimizer)
            if groups:
                local, anyone, amax = self._agree(local, groups, amax)
            if idle and flags:  # another rank's scaled gradients, or zeros
                params = list(_grads.iter_params(optimizer))
                if it.scaled_elsewhere(anyone, params, "step or unscale_") and unscale:
                    self._unscale_grads_(optimizer, inv, None)
            if amax is not None:
                self._headroom.note(amax, math.prod(g.size() for g in groups))
        except BaseException:
            it.failed(optimizer)
            raise
        return it.checked(optimizer, state, local, anyone, unscale)

    def _agree(
        self, local: torch.Tensor, groups: list[Any], amax: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The agreement (ONE all-reduce over ``groups``): ``(agreed flag, whether any rank
        scaled, the group's amax or None)``. A mismatch sets the flag and the alarm; at the
        first agreement since the scaler was made or loaded it is read at once (raises)."""
        _join.check_order(self._join_config)
        it, tensors = self._it, self._loss_scale.tensors
        step, policy = tensors.counters[0], _sync.policy_values(self._config)
        flag, anyone, bad, vector = _sync.agreement(
            local, step, it.checks, it.vote(), groups, tensors.scale, policy, self._call, amax
        )
        self._alarm.note_mismatch(bad, vector, step, it.checks)
        if self._verify:  # the first agreement since made or loaded: read at once
            self._verify = False
            if bool(bad):
                self._poll()
        return flag, anyone, None if amax is None else vector[_sync.AMAX]

    def _fail(self, code: int, message: str) -> NoReturn:
        """Raise the call-order error ``message``; on several ranks, first tell the others
        through the all-reduce they wait in (:func:`_sync.poison`, ``code`` in
        :data:`_sync.ERRORS`), so that they fail naming this rank instead of timing out."""
        groups = _sync.resolve_groups(self.process_group)
        tensors = self._loss_scale.tensors
        if groups and tensors is not None:
            policy = _sync.policy_values(self._config)
            step, check = tensors.counters[0], self._it.checks
            # logged first: under DDP/FSDP the others may wait in another collective, which
            # this all-reduce then breaks (an error, or gloo's abort of the process)
            logging.getLogger("shardscale").error(
                "rank %d: %s (telling the other ranks through the scaler's all-reduce)",
                _sync.rank(),
                message,
            )
            try:
                _sync.poison(code, step, check, _sync.rank(), groups, tensors.scale, policy)
            except Exception as exc:  # the others were not in the scaler's all-reduce
                raise RuntimeError(message) from exc
        raise RuntimeError(message)

    # the scaler's (declared for readers and type checkers)
    _unscale_grads_: Any
    _poll: Any
