"""The record of one iteration: what each optimizer did between two ``update()`` calls, and
what the last ``update()`` closed.

Each optimizer's record is torch's (``GradScaler._per_optimizer_states[id(opt)]``: ``"stage"``,
an ``OptState``, and ``"found_inf_per_device"``, ``{device: 0-d float32 flag}``), so frameworks
and ``grad_scaler=`` optimizers that read or write it see the truth; shardscale adds
``"optimizer"`` (a weak reference) and ``"grad_scale"`` (what a fused kernel divides by).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ._grads import iter_params, to_device


def fresh_state() -> dict[str, Any]:
    """One optimizer's record, as torch's ``_refresh_per_optimizer_state`` (defined here:
    ``torch.compile`` does not trace a torch function that returns a dict)."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


@dataclasses.dataclass
class LastStep:
    """What ``update()`` remembers of the iteration it closed (reports, ``last_step_skipped``).

    Attributes:
        counters: the scaler's counters tensor; the iteration's 0-based index is
            ``counters[0] + offset`` (read only when reported).
        offset: -1 for an iteration ``update()`` closed (counted already), 0 for the current one.
        scale: 0-d float32, the scale its gradients were computed with.
        found_inf: 0-d float32, the number of optimizers that overflowed (agreed).
        optimizers: weak references to the optimizers stepped or unscaled.
    """

    counters: torch.Tensor
    offset: int
    scale: torch.Tensor
    found_inf: torch.Tensor
    optimizers: list[weakref.ref]

    @property
    def index(self) -> int:
        """The iteration's 0-based index (one host read)."""
        return int(self.counters[0]) + self.offset

    def live_optimizers(self) -> list[Any]:
        return [o for o in (r() for r in self.optimizers) if o is not None]


@dataclasses.dataclass
class Iteration:
    """The scaler's bookkeeping between updates. Plain attributes; no tensor is read here.

    Attributes:
        states: torch's per-optimizer records, by ``id(optimizer)``.
        pre_unscaled: ``id(param) -> agreed flag`` for gradients ``clip_grad_norm_(params)``
            unscaled this iteration (their optimizer leaves them alone).
        skipped: ``id(optimizer) -> 0-d bool``: whether its last step was skipped.
        last: the iteration the last ``update()`` closed.
        host_overflow: a step of this iteration read an overflow on the host.
        unread_steps: fused steps ran whose flags the host never read (since the last poll).
        updates_since_poll: ``update()`` calls since the alarm was last read.
        scaled: ``scale()`` was called in this iteration (on this rank).
        ever_scaled: ``scale()`` was called in an iteration closed since the scaler was made
            or loaded.
        stale: gradients were checked in this iteration without ``scale()`` in it, after one
            since the scaler was made or loaded: scaled gradients stepped after an
            ``update()`` (an ``update()`` after each optimizer), which count, unlike checkpoint
            plumbing's zero gradients right after a load or an iteration without gradients.
        last_scaled: whether it was in the iteration the last ``update()`` closed (None: no
            update since the scaler was made or loaded).
        checks: the agreements made in this iteration (the next one's ordinal).
        last_checks: the agreements made in the iteration the last ``update()`` closed.
        blind: a step of this iteration whose flag the host did not read (a fused one).
        floor: a lower bound of the scale known to the host without reading it (it can only
            back off by ``backoff_factor`` per update the host did not see clean).
        steps_since_update: steps since the last eager ``update()`` (a compiled loop's count).
        calls: the scaler calls of the last iteration, in order, with their arguments
            (``(name, args)``: from the first unscale/clip/step after an ``update()`` to the
            calls after the next one): what a rank that joined (``Join``) repeats.
        calls_closed: ``update()`` (or ``abandon()``) is in ``calls``: the next unscale/clip/
            step starts a new list.
    """

    states: dict[int, dict[str, Any]] = dataclasses.field(
        default_factory=lambda: defaultdict(fresh_state)
    )
    pre_unscaled: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    skipped: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    last: LastStep | None = None
    host_overflow: bool = False
    unread_steps: bool = False
    updates_since_poll: int = 0
    scaled: bool = False
    last_scaled: bool | None = None
    ever_scaled: bool = False
    stale: bool = False
    checks: int = 0
    last_checks: int = 0
    blind: bool = False
    floor: float = 1.0
    steps_since_update: int = 0
    calls: list[tuple[str, tuple[Any, ...]]] = dataclasses.field(default_factory=list)
    calls_closed: bool = False

    def counts(self) -> bool:
        """This rank's vote that the iteration counts: its gradients were scaled (``scale()``
        in this iteration, or :attr:`stale` ones)."""
        return self.scaled or self.stale

    def saw_gradients(self) -> None:
        """Gradients were checked: stale ones if ``scale()`` was not called since the update."""
        if not self.scaled and self.ever_scaled:
            self.stale = True

    def note_call(self, name: str, args: tuple[Any, ...]) -> None:
        """Append a scaler call to :attr:`calls` (a new list at the first unscale/clip/step
        after an ``update()``)."""
        if self.calls_closed and name in ("unscale_", "clip_grad_norm_", "step"):
            self.calls, self.calls_closed = [], False
        self.calls.append((name, args))
        if name in ("update", "abandon"):
            self.calls_closed = True

    def record(self, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s record, created READY if new (inserted explicitly: ``torch.compile``
        loses a defaultdict's own insert)."""
        state = self.states.get(id(optimizer))
        if state is None:
            state = self.states[id(optimizer)] = fresh_state()
        return state

    def checked(self, optimizer: Any, flag: torch.Tensor) -> dict[str, Any]:
        """Record ``optimizer``'s agreed ``flag`` (0-d float32 on the scale's device)."""
        state = self.record(optimizer)
        state["found_inf_per_device"] = {flag.device: flag}
        state["optimizer"] = weakref.ref(optimizer)
        return state

    def forget_if_untouched(self, optimizer: Any) -> None:
        """A failed call does not start an iteration for ``optimizer``."""
        state = self.states.get(id(optimizer))
        if state is not None and state["stage"] is OptState.READY:
            if not state["found_inf_per_device"]:
                del self.states[id(optimizer)]

    def seen_clean(self) -> bool:
        """Whether the host read every flag of this iteration (non-fused steps) and none was
        set: the scale cannot have backed off."""
        return not (self.blind or self.host_overflow or self.pre_unscaled) and all(
            s["stage"] is OptState.STEPPED
            for s in self.states.values()
            if s["found_inf_per_device"]
        )

    def started(self) -> bool:
        """Whether anything was unscaled, checked or stepped since the last update."""
        return bool(self.pre_unscaled) or any(
            s["stage"] is not OptState.READY or s["found_inf_per_device"]
            for s in self.states.values()
        )

    def pre_unscaled_in(self, optimizer: Any) -> list[torch.Tensor]:
        """The agreed flags of ``optimizer``'s gradients ``clip_grad_norm_(params)`` unscaled."""
        pre = self.pre_unscaled
        return [pre[id(p)] for p in iter_params(optimizer) if id(p) in pre] if pre else []

    def inf_checks(self) -> tuple[list[torch.Tensor], list[weakref.ref]]:
        """The iteration's inf checks: every recorded flag, and the optimizers they belong to.
        When only ``clip_grad_norm_(params)`` ran, its flags (as torch's update after
        ``unscale_`` alone: the checks made are what counts)."""
        live = [s for s in self.states.values() if s["found_inf_per_device"]]
        flags = [f for s in live for f in s["found_inf_per_device"].values()]
        if not flags:
            flags = list({id(f): f for f in self.pre_unscaled.values()}.values())
        return flags, [s["optimizer"] for s in live if "optimizer" in s]

    def others_scaled(self) -> list[torch.Tensor]:
        """0-d bools from this iteration's collectives (multi-rank only): whether any rank
        called ``scale()``."""
        return [s["scaled"] for s in self.states.values() if "scaled" in s]

    def close(self, home: torch.device) -> tuple[torch.Tensor | None, list[weakref.ref]]:
        """End the iteration: the sum of its flags on ``home`` (None if nothing was checked)
        and its optimizers; the records are cleared for the next one. No host read."""
        flags, refs = self.inf_checks()
        found_inf = None
        if flags:
            found_inf = to_device(flags[0], home)
            for flag in flags[1:]:
                found_inf = found_inf + to_device(flag, home)
        self.abandon()
        return found_inf, refs

    def abandon(self) -> None:
        """Clear this iteration's records (``close`` without the sum)."""
        self.states = defaultdict(fresh_state)
        self.pre_unscaled = {}
        self.ever_scaled, self.stale = self.ever_scaled or self.scaled, False
        self.last_scaled, self.scaled, self.blind = self.scaled, False, False
        self.last_checks, self.checks = self.checks, 0
