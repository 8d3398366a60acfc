"""``torch.distributed.algorithms.Join`` for the scaler: what a rank out of data repeats.

A rank that ran out of data (uneven inputs) repeats, once per iteration of the others, the
scaler calls of its own last iteration (``unscale_``, ``clip_grad_norm_``, ``step``,
``update``, ``overflow_report(all_ranks=True)``, ``abandon``, in their order) with no gradients
of its own: it takes part in every collective of the others and applies the agreed update. A
rank that never trained makes one agreement and applies the agreed update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.join import JoinHook

from . import _headroom, _sync
from ._alarm import Alarm
from ._config import ScalerConfig
from ._headroom import Headroom
from ._policy import ScaleState, step_

#: The calls that start an iteration's list.
_STARTS = ("unscale_", "clip_grad_norm_", "step")


class CallLog:
    """The scaler calls of the last iteration, in order, with their arguments.

    Attributes:
        calls: ``(name, args)`` from the first unscale/clip/step after an ``update()`` to the
            calls after the next one.
        closed: ``update()`` (or ``abandon()``) is in :attr:`calls`: the next unscale/clip/
            step starts a new list.
        shadowing: this rank has joined and is repeating :attr:`calls` (no gradients of its
            own: the scaler skips its local work and never steps an optimizer).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.closed = False
        self.shadowing = False

    def note(self, name: str, *args: Any) -> None:
        """A call completed. Nothing is noted while repeating or under ``torch.compile``."""
        if self.shadowing or torch.compiler.is_compiling():
            return
        if self.closed and name in _STARTS:
            self.calls, self.closed = [], False
        self.calls.append((name, args))
        if name in ("update", "abandon"):
            self.closed = True

    def replay(self, call: Callable[[str, tuple[Any, ...]], Any]) -> None:
        """Repeat :attr:`calls` through ``call(name, args)``, shadowing."""
        self.shadowing = True
        try:
            for name, args in list(self.calls):
                call(name, args)
        finally:
            self.shadowing = False


class ScalerJoinHook(JoinHook):
    """The scaler's ``JoinHook``: each iteration of the others runs ``shadow``."""

    def __init__(self, shadow: Callable[[], None]) -> None:
        self.shadow = shadow

    def main_hook(self) -> None:
        self.shadow()


def check_order(join_config: Any) -> None:
    """Inside ``Join``, the model (DDP) must come first: its hook shadows the forward and
    backward collectives, which come before the scaler's.

    Raises:
        RuntimeError: the scaler is the first Joinable of an enabled Join.
    """
    if join_config.enable and join_config.is_first_joinable:
        raise RuntimeError(
            "ShardedGradScaler is the first Joinable of a Join: list the model before it, "
            "Join([ddp_model, scaler]) (a joined rank shadows the model's collectives first, "
            "then the scaler's)."
        )


def idle_iteration(
    state: ScaleState,
    config: ScalerConfig,
    alarm: Alarm,
    groups: list[Any],
    headroom: Headroom | None = None,
) -> None:
    """A joined rank that never trained: one agreement (no gradients, not scaled) and, when
    another rank scaled, the agreed update (``policy="headroom"``: with the agreed amax and
    ``headroom``'s history)."""
    zero = torch.zeros((), dtype=torch.float32, device=state.scale.device)
    policy = _sync.policy_values(config)
    agreed = _sync.agree(zero, state.counters[0], 0, False, groups, state.scale, policy)
    if bool(agreed[_sync.SCALED] > 0):
        if config.headroom and headroom is not None:
            rule = headroom.place(state.scale.device, config)
            world = math.prod(g.size() for g in groups)
            collapsed, old = _headroom.step_(
                state, rule, agreed[_sync.FOUND], agreed[_sync.AMAX], config, world
            )
        else:
            collapsed, old = step_(state, agreed[_sync.FOUND], config)
        alarm.note_collapse(collapsed, state.counters[0], old)


class JoinableScaler:
    """The scaler's ``Joinable`` side (a mixin of :class:`shardscale.ShardedGradScaler`): its
    hook, device and process group, and one shadowed iteration. Reads the scaler's
    ``process_group``, ``_loss_scale``, ``_device``, ``_calls``, ``_config`` and ``_alarm``."""

    process_group: Any
    _loss_scale: Any
    _device: str
    _calls: CallLog
    _config: ScalerConfig
    _alarm: Any
    _headroom: Headroom

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For ``torch.distributed.algorithms.Join([ddp_model, scaler])`` (uneven inputs).

        A rank that ran out of data repeats, once per iteration of the others, the scaler calls
        of its own last iteration with no gradients of its own (see :mod:`shardscale._join`):
        it takes part in every collective of the others, never steps an optimizer, and
        applies the agreed update, so every rank keeps the same scale and raises a collapse
        together. The ranks must run the same scaler calls in every iteration (one optimizer
        step per forward: no gradient accumulation inside a Join). List the model first (its
        hook shadows the forward and backward collectives, which come first); the scaler listed
        first raises a ``RuntimeError`` at its first collective."""
        return ScalerJoinHook(self._shadow_iteration)

    @property
    def join_device(self) -> torch.device:
        groups = _sync.resolve_groups(self.process_group)
        tensors = self._loss_scale.tensors
        home = tensors.scale.device if tensors is not None else torch.device(self._device)
        return _sync.comm_device(groups[0], home) if groups else home

    @property
    def join_process_group(self) -> Any:
        groups = _sync.resolve_groups(self.process_group)
        return groups[0] if groups else None

    def _shadow_iteration(self) -> None:
        self._lazy_init_scale_growth_tracker(self._device)
        if self._calls.calls:
            self._calls.replay(lambda name, args: getattr(self, name)(*args))
        else:
            groups = _sync.resolve_groups(self.process_group)
            state, headroom = self._loss_scale.tensors, self._headroom
            idle_iteration(state, self._config, self._alarm, groups, headroom)
