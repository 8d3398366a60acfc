"""The record of one iteration: what each optimizer did between two ``update()`` calls, and
what the last ``update()`` closed.

Each optimizer's record is torch's (``GradScaler._per_optimizer_states[id(opt)]``: ``"stage"``,
an ``OptState``, and ``"found_inf_per_device"``, ``{device: 0-d float32 flag}``), so frameworks
and ``grad_scaler=`` optimizers that read or write it see the truth; shardscale adds
``"optimizer"`` (a weak reference), ``"grad_scale"`` (what a fused kernel divides by),
``"scaled"`` (0-d bool from the agreement: whether any rank called ``scale()``) and ``"groups"``
(the id of its first param group: a wrapper sharing an optimizer's param groups is listed under
both ids with the one record).

The record changes only through its methods, each named for what happened: :meth:`scaled`
(:meth:`new_pass` when it follows an unscale), :meth:`settle`, :meth:`checked`,
:meth:`clipped_params`, :meth:`stepped`, :meth:`abandon`, :meth:`close`. Whether an iteration
counts is :meth:`counts`; whether an idle rank's gradients are another rank's scaled ones is
:meth:`scaled_elsewhere`. The rules of several backward passes: ``docs/setups.md``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from . import _grads
from ._grads import iter_params, to_device

#: the order of one iteration's calls, as the call-order errors name it
ORDER = (
    "scaler.scale(loss).backward() -> [scaler.unscale_(opt)] -> scaler.step(opt) -> scaler.update()"
)
#: the warning for gradients checked after an update() with no scale() since
STALE = (
    "ShardedGradScaler: an optimizer is stepped (or unscaled) after update() with no scale() "
    "since: its gradients were scaled before that update(), by a scale update() may have "
    "changed, or this iteration's backward() ran on a loss not passed to scale() (its "
    "gradients are unscaled by the scale all the same). Call update() once per iteration, "
    "after every optimizer's step(): scale(loss).backward() -> step(opt_1) ... step(opt_n) "
    "-> update()."
)
_ADDED_TO = (
    "ShardedGradScaler: a backward pass added its scaled gradients to gradients unscale_() (or "
    "clip_grad_norm_) had unscaled already in this iteration: their sum mixes unscaled and "
    "scaled values; nothing was unscaled or stepped. Call optimizer.zero_grad() before the next "
    "scaler.scale(loss).backward(), or unscale_ once, after every backward pass of the step."
)
_NOT_SCALED = (
    "ShardedGradScaler: gradients are being unscaled ({what}) but no rank of the scaler's "
    "process group called scale() since the scaler was made or loaded, and they are not zero. "
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the "
    "iteration: call scaler.scale(loss).backward() instead of loss.backward() (with pipeline "
    "stages, give the scaler a process group that includes the stage that scales the loss); "
    "{then}."
)


class NotScaledError(RuntimeError, AssertionError):
    """Gradients are being unscaled but no rank called ``scale()``: a ``loss.backward()``
    without ``scaler.scale(loss)``. A ``RuntimeError`` as shardscale's call-order errors, and an
    ``AssertionError`` as torch's ``GradScaler`` raises in that case."""


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
        still_scaled: ids of those whose gradients the scaler left scaled (a fused step's: its
            kernel unscales them in place unless it skips the step).
    """

    counters: torch.Tensor
    offset: int
    scale: torch.Tensor
    found_inf: torch.Tensor
    optimizers: list[weakref.ref]
    still_scaled: frozenset[int] = frozenset()

    @property
    def index(self) -> int:
        """The iteration's 0-based index (one host read)."""
        return int(self.counters[0]) + self.offset

    def live_optimizers(self) -> list[Any]:
        return [o for o in (r() for r in self.optimizers) if o is not None]


@dataclasses.dataclass
class Iteration:
    """The scaler's bookkeeping between updates. Plain attributes, written by the methods
    only; no tensor is read here except by :meth:`counts` and :meth:`scaled_elsewhere` on an
    idle rank, and by :meth:`settle` after a new backward pass wrote unscaled gradients.

    Attributes:
        states: torch's per-optimizer records, by ``id(optimizer)`` (a wrapper and its inner
            optimizer: one record under both ids).
        pre_unscaled: ``id(param) -> agreed flag`` for gradients ``clip_grad_norm_(params)``
            unscaled this iteration (their optimizer leaves them alone).
        skipped: ``id(optimizer)`` (and the id of its first param group) ``-> bool`` (read on
            the host) or 0-d bool tensor (a fused step's, on the device): whether its last step
            was skipped.
        last: the iteration the last ``update()`` closed.
        read_overflow: a step of this iteration read an overflow on the host.
        blind: a step of this iteration whose flag the host did not read (a fused one).
        scaled_here: ``scale()`` was called in this iteration (on this rank).
        ever_scaled: ``scale()`` was called in an iteration closed since the scaler was made
            or loaded.
        stale: gradients were checked in this iteration without ``scale()`` in it, after one
            since the scaler was made or loaded: scaled gradients stepped after an
            ``update()`` (an ``update()`` after each optimizer), which count, unlike checkpoint
            plumbing's zero gradients right after a load or an iteration without gradients.
        last_scaled: whether ``scale()`` was in the iteration the last ``update()`` closed
            (None: no update since the scaler was made or loaded).
        checks: the agreements made in this iteration (the next one's ordinal).
        unscaled_open: gradients were unscaled since this backward pass began: a ``scale()``
            now begins another pass (:meth:`new_pass`).
        earlier: the agreed flag of this iteration's earlier passes (0-d float32, or None): it
            joins every flag recorded after them.
        carried: the unscaled gradients a new pass began with (:func:`_grads.snapshot`),
            until the next call sees what the pass did to them (:meth:`settle`).
        clipped: ``id(param) -> param`` of :attr:`pre_unscaled`.
    """

    states: dict[int, dict[str, Any]] = dataclasses.field(
        default_factory=lambda: defaultdict(fresh_state)
    )
    pre_unscaled: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    skipped: dict[int, Any] = dataclasses.field(default_factory=dict)
    last: LastStep | None = None
    read_overflow: bool = False
    blind: bool = False
    scaled_here: bool = False
    ever_scaled: bool = False
    stale: bool = False
    last_scaled: bool | None = None
    checks: int = 0
    unscaled_open: bool = False
    earlier: torch.Tensor | None = None
    carried: dict[int, Any] = dataclasses.field(default_factory=dict)
    clipped: dict[int, Any] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------- what happened
    def scaled(self) -> None:
        """``scale()`` was called: after gradients were unscaled, a new backward pass begins."""
        self.scaled_here = True
        if self.unscaled_open:
            self.new_pass()

    @torch.compiler.disable  # weak references and versions: the rare path, left to eager
    def new_pass(self) -> None:
        """A backward pass begins after gradients were unscaled in this iteration (sharpness-
        aware optimizers: ``unscale_``, perturb, ``zero_grad``, a second ``scale(loss)
        .backward()``, ``step``; or a guard of the user's that dropped a pass): the optimizers
        unscaled and not stepped are READY again (their next step unscales the new gradients
        once), the flags so far join the later ones (:attr:`earlier`: an overflow in a pass
        skips the steps after it and backs the scale off once), and the unscaled gradients
        are snapshotted: those the pass leaves alone are not unscaled again, those it adds to
        are refused (:meth:`settle`)."""
        self.unscaled_open = False
        flags = [] if self.earlier is None else [self.earlier]
        carry, stepped = {}, set()
        for state in {id(s): s for s in self.states.values()}.values():
            opt = state["optimizer"]() if "optimizer" in state else None
            if state["stage"] is OptState.STEPPED and opt is not None:
                stepped.update(map(id, iter_params(opt)))
            elif state["stage"] is OptState.UNSCALED:
                state["stage"] = OptState.READY
                flags.extend(state["found_inf_per_device"].values())
                # a clip folded into a fused kernel's grad_scale left them scaled: nothing to keep
                if state.pop("grad_scale", None) is None and opt is not None:
                    carry.update((id(q), q) for q in iter_params(opt))
        for key, q in self.clipped.items():
            if key not in stepped:
                carry[key] = q
                flags.append(self.pre_unscaled[key])
        if flags:
            home = flags[0].device
            self.earlier = torch.stack([to_device(f, home) for f in flags]).amax()
        self.carried = _grads.snapshot(carry.values())

    def settle(self) -> None:
        """The first call after a new pass's backward: the gradients it left alone are unscaled
        already (left out, as a clip of parameters'), those it replaced are scaled ones.

        Raises:
            RuntimeError: it added scaled gradients to unscaled ones (nothing changes here).
        """
        untouched, replaced, added_to = _grads.since(self.carried)
        if added_to:
            raise RuntimeError(_ADDED_TO)
        self.carried = {}
        for key in replaced:
            self.pre_unscaled.pop(key, None)
            self.clipped.pop(key, None)
        for key in untouched:
            if key not in self.pre_unscaled:
                self.pre_unscaled[key] = self.earlier

    def record(self, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s record, created READY if new (inserted explicitly: ``torch.compile``
        loses a defaultdict's own insert). An optimizer sharing the param groups of one recorded
        already (a wrapper and its inner optimizer: accelerate's ``AcceleratedOptimizer``,
        Lookahead) shares its record: one optimizer, whichever object names it."""
        if self.carried:
            self.settle()
        state = self.states.get(id(optimizer))
        if state is None:
            groups = optimizer.param_groups
            key = id(groups[0]) if groups else id(optimizer)
            for other in self.states.values():
                if other.get("groups") == key:
                    self.states[id(optimizer)] = other
                    return other
            state = {"stage": OptState.READY, "found_inf_per_device": {}, "groups": key}
            self.states[id(optimizer)] = state
        return state

    def saw_gradients(self) -> bool:
        """Gradients were checked. Returns whether they are stale ones: no ``scale()`` since the
        last ``update()`` though there was one in the iteration it closed (warn the user)."""
        if not self.scaled_here and self.ever_scaled:
            self.stale = True
        return bool(not self.scaled_here and self.last_scaled)

    def checked(
        self,
        optimizer: Any,
        state: dict[str, Any],
        flag: torch.Tensor,
        anyone_scaled: torch.Tensor | None,
        unscaled: bool,
    ) -> dict[str, Any]:
        """``optimizer``'s gradients (``state``: its record) were checked, and ``unscaled``
        (``unscale_``, a clip) or not (a fused step's check): its agreed ``flag`` (0-d float32
        on the scale's device) and, from the agreement, whether any rank scaled (0-d bool)."""
        self.checks += 1
        if self.earlier is not None:  # an earlier pass of this iteration
            flag = torch.maximum(flag, to_device(self.earlier, flag.device))
        state["found_inf_per_device"] = {flag.device: flag}
        state["optimizer"] = weakref.ref(optimizer)
        if anyone_scaled is not None:
            state["scaled"] = anyone_scaled
        if unscaled:
            state["stage"] = OptState.UNSCALED
            self.unscaled_open = True
        return state

    def clipped_params(self, params: list[Any], flag: torch.Tensor) -> None:
        """``clip_grad_norm_(params)`` unscaled ``params``' gradients, with the agreed ``flag``."""
        if self.earlier is not None:
            flag = torch.maximum(flag, to_device(self.earlier, flag.device))
        for q in params:
            self.pre_unscaled[id(q)] = flag
            self.clipped[id(q)] = q
        self.unscaled_open = True

    def stepped(self, optimizer: Any, state: dict[str, Any], skipped: Any) -> None:
        """``optimizer`` was stepped (or its step skipped): ``skipped`` is a bool the host read,
        or a 0-d bool tensor it did not (a fused step)."""
        state["stage"] = OptState.STEPPED
        self.skipped[id(optimizer)] = skipped
        if "groups" in state:  # its param groups: what a wrapper or inner optimizer asks by
            self.skipped[state["groups"]] = skipped
        if isinstance(skipped, bool):
            self.read_overflow = self.read_overflow or skipped
        else:
            self.blind = True

    def failed(self, optimizer: Any) -> None:
        """A call failed: it does not start an iteration for ``optimizer``."""
        state = self.states.get(id(optimizer))
        if state is not None and state["stage"] is OptState.READY:
            if not state["found_inf_per_device"]:
                for key in [k for k, s in self.states.items() if s is state]:
                    del self.states[key]

    def abandon(self) -> None:
        """The iteration ends without an update: its records are cleared."""
        self.states = defaultdict(fresh_state)
        self.pre_unscaled, self.clipped, self.carried = {}, {}, {}
        self.unscaled_open, self.earlier = False, None
        self.ever_scaled, self.stale = self.ever_scaled or self.scaled_here, False
        self.last_scaled, self.scaled_here, self.blind = self.scaled_here, False, False
        self.read_overflow = False
        self.checks = 0

    def close(self, home: torch.device) -> tuple[torch.Tensor | None, list[weakref.ref], bool]:
        """``update()``: the sum of the iteration's flags on ``home`` (None if nothing was
        checked), its optimizers, and whether the sum is one flag (0 or 1); the records are
        cleared for the next one. No host read."""
        flags, refs = self.inf_checks()
        found_inf = None
        if flags:
            found_inf = to_device(flags[0], home)
            for flag in flags[1:]:
                found_inf = found_inf + to_device(flag, home)
        self.abandon()
        return found_inf, refs, len(flags) == 1

    def loaded(self) -> None:
        """A checkpoint was loaded: a step before the next ``scale()`` is checkpoint plumbing."""
        self.last_scaled = None
        self.ever_scaled = False

    def scaled_elsewhere(
        self, anyone: torch.Tensor | None, params: list[Any], what: str, written: bool = False
    ) -> bool:
        """This rank checked gradients (``params``') with no ``scale()`` since the scaler was
        made or loaded: whether another rank scaled (``anyone``, from the agreement; None: no
        other rank), so that these are its scaled gradients (an idle rank's, from the data
        parallel reduction). One host read (idle ranks only).

        Raises:
            NotScaledError: no rank scaled and a gradient is not zero (a ``backward()`` of an
                unscaled loss). Zero gradients (checkpoint plumbing's step) are no error.
        """
        if anyone is not None and bool(anyone):
            return True
        if _grads.any_nonzero(params, self.pre_unscaled):
            then = "they were divided by the scale" if written else "nothing was unscaled"
            raise NotScaledError(_NOT_SCALED.format(what=what, then=then))
        return False

    # -------------------------------------------------------------------- queries
    def vote(self) -> bool:
        """This rank's vote that the iteration counts: its gradients were scaled (``scale()``
        in this iteration, or :attr:`stale` ones)."""
        return self.scaled_here or self.stale

    def counts(self) -> bool:
        """Whether the iteration counts: this rank's :meth:`vote`, or another rank's, as the
        iteration's agreements say (one host read, on idle ranks only). An iteration no rank
        scaled (checkpoint plumbing's zero-gradient step right after a load) changes nothing."""
        if self.vote():
            return True
        seen = [s["scaled"] for s in self.states.values() if "scaled" in s]
        return bool(torch.stack(seen).any()) if seen else False

    def seen_clean(self) -> bool:
        """Whether the host read every flag of this iteration (non-fused steps) and none was
        set: the scale cannot have backed off."""
        return not (self.blind or self.read_overflow or self.pre_unscaled) and all(
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

    def stages_of(self, params: list[Any]) -> dict[int, OptState]:
        """``id(param) -> stage`` for those of ``params`` whose gradients are not READY: unscaled
        by a clip of parameters, or owned by an optimizer unscaled or stepped."""
        ids = {id(q) for q in params}
        stages = {i: OptState.UNSCALED for i in ids & self.pre_unscaled.keys()}
        for state in self.states.values():
            opt = state["optimizer"]() if "optimizer" in state else None
            if state["stage"] is not OptState.READY and opt is not None:
                stages.update((id(q), state["stage"]) for q in iter_params(opt) if id(q) in ids)
        return stages

    def inf_checks(self) -> tuple[list[torch.Tensor], list[weakref.ref]]:
        """The iteration's inf checks: every recorded flag, and the optimizers they belong to.
        When only ``clip_grad_norm_(params)`` ran, its flags (as torch's update after
        ``unscale_`` alone: the checks made are what counts)."""
        live: list[dict[str, Any]] = []
        for s in self.states.values():  # a wrapper's record is its inner optimizer's: once
            if s["found_inf_per_device"] and not any(s is t for t in live):
                live.append(s)
        flags = [f for s in live for f in s["found_inf_per_device"].values()]
        if not flags:
            flags = list({id(f): f for f in self.pre_unscaled.values()}.values())
        return flags, [s["optimizer"] for s in live if "optimizer" in s]

    def still_scaled(self) -> frozenset[int]:
        """Ids of the optimizers whose gradients still hold the scale (a fused step's check
        or a folded clip: the kernel unscales in its own math)."""
        return frozenset(k for k, s in self.states.items() if s.get("grad_scale") is not None)

    def last_skipped(self, optimizer: Any = None) -> torch.Tensor:
        """Whether the last step of ``optimizer`` (or of the last iteration, for None) was
        skipped, as a 0-d bool tensor (``ShardedGradScaler.last_step_skipped``).

        Raises:
            RuntimeError: no step has been taken yet (for this optimizer).
        """
        if optimizer is not None:
            flag = self.skipped_flag(optimizer)
            if flag is None:
                raise RuntimeError("last_step_skipped(): this optimizer has not been stepped yet.")
            return flag
        if self.last is None:
            raise RuntimeError("last_step_skipped(): update() has not been called yet.")
        return self.last.found_inf > 0

    def left_scaled(self) -> list[tuple[Any, bool]]:
        """The optimizers of the iteration :attr:`last` closed, each with whether its gradients
        still hold the scale: a fused step's (or a folded clip's) whose kernel skipped the step
        (a kernel that steps unscales them in place). One host read per such optimizer."""
        last = self.last
        if last is None:
            return []
        return [
            (o, id(o) in last.still_scaled and bool(self.skipped_flag(o)))
            for o in last.live_optimizers()
        ]

    def skipped_flag(self, optimizer: Any) -> torch.Tensor | None:
        """Whether ``optimizer``'s last step was skipped, as a 0-d bool tensor (None: never
        stepped)."""
        flag = self.skipped.get(id(optimizer))
        groups = getattr(optimizer, "param_groups", None)
        if flag is None and groups:  # a wrapper of the optimizer stepped, or the reverse
            flag = self.skipped.get(id(groups[0]))
        if isinstance(flag, bool):
            return torch.tensor(flag, device="cpu")
        return flag
