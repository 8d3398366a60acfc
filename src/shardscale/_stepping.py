"""Taking the step: the decision after the agreement, for each kind of optimizer.

* plain (non-fused): one host read of the agreed flag; ``optimizer.step()`` only if it is 0;
* fused (``_step_supports_amp_scaling``): ``optimizer.step()`` always, with ``grad_scale`` and
  ``found_inf`` tensors set on it (the kernel unscales in fp32 and skips): no host read;
* ``grad_scaler=``: torch's older protocol, the optimizer unscales itself through the scaler's
  internals.

A fused ``SGD`` with momentum whose first step is skipped: torch's kernel allocates the momentum
buffers (``empty_like``) and returns before writing them, and the next step reads that memory
(NaN or garbage weights; torch's scaler has the same bug). :func:`prime_momentum` gives such an
optimizer zero buffers first: with ``dampening=0`` (the default, and nesterov) a zero buffer
steps exactly as a missing one (``buf = 0 * momentum + grad``), skipped or not, with no host
read. With ``dampening != 0`` it cannot (the first step sets ``buf = grad``, later ones
``(1 - dampening) * grad``), so while buffers are missing the agreed flag is read (one host read
per step until a step is taken) and a skipped step does not call the optimizer, as for a plain
one: the state stays empty.

The optimizer's own ``step`` is kept out of ``torch.compile`` graphs (it breaks them anyway).

:class:`Stepping` is a mixin of :class:`shardscale.ShardedGradScaler`: each kind's step after
the record of the check (``_checking.Checking``), recorded by
:meth:`~shardscale._iteration.Iteration.stepped`. It reads the scaler's ``_it``, ``_calls``,
``_schedule``, ``_bounds``, ``_config`` and ``_loss_scale``, and calls its ``_check``,
``_unscale`` and ``_poll``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from ._grads import to_device, unscaled_or_tied

#: fused SGDs whose momentum buffers all exist -> ``id`` of the state they exist in (a loaded
#: state is a new one)
_PRIMED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def prime_momentum(optimizer: torch.optim.SGD) -> bool:
    """Give the momentum buffers a fused step of ``optimizer`` would create zeros (groups with
    ``dampening=0``; see the module docstring); returns whether the step must read the flag
    first (a group with ``dampening != 0`` still lacks buffers). Once every parameter of the
    fused momentum groups has a buffer, the optimizer is not looked at again."""
    read, complete, state = False, True, optimizer.state
    for group in optimizer.param_groups:
        if not group.get("fused") or not group.get("momentum"):
            continue
        params = group["params"]
        # a zero buffer steps as a missing one only with dampening 0 and each parameter once
        # (torch's first fused step starts every listing's buffer from its gradient)
        zero_ok = group.get("dampening", 0) == 0 and len(set(map(id, params))) == len(params)
        for p in params:
            if "momentum_buffer" in state.get(p, ()):
                continue
            if p.grad is not None and zero_ok:
                state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
                continue
            complete = False
            read = read or p.grad is not None
    if complete:
        _PRIMED[optimizer] = id(state)
    return read


@torch.compiler.disable
def plain(optimizer: Any, flags: list[torch.Tensor], shadowing: bool, args: Any, kwargs: Any):
    """``(overflow, retval)``: the agreed ``flags`` read (one host read), and what
    ``optimizer.step(*args, **kwargs)`` returned (None when skipped or ``shadowing``)."""
    overflow = bool(sum(f.item() for f in flags))
    retval = None if overflow or shadowing else optimizer.step(*args, **kwargs)
    return overflow, retval


def fused_inputs(
    state: dict[str, Any], user: torch.Tensor | None, home: torch.device
) -> tuple[Any, torch.Tensor]:
    """``(grad_scale, found_inf)`` for a fused kernel: the record's ``grad_scale`` (the scale,
    or a clip's scale / clip_coef; None when the gradients are unscaled already) times the
    user's own ``grad_scale``, and the record's flags summed on ``home``."""
    folded = state.get("grad_scale")
    grad_scale = user if folded is None else folded if user is None else folded * user
    flags = list(state["found_inf_per_device"].values())
    found_inf = flags[0] if len(flags) == 1 else sum(to_device(f, home) for f in flags)
    return grad_scale, found_inf


@torch.compiler.disable
def fused(
    optimizer: Any,
    grad_scale: Any,
    found_inf: Any,
    user: Any,
    shadowing: bool,
    catch_up: tuple[Any, Callable[[], float], Callable[[], None]],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``optimizer.step`` with ``grad_scale``/``found_inf`` set (the user's ``grad_scale`` put
    back after); nothing when ``shadowing`` (a joined rank). ``catch_up``: the alarm's
    ``Schedule``, the updates it may leave unseen and its read, for a compiled loop (counted
    here, out of the graph)."""
    schedule, safe, poll = catch_up
    if schedule.step(True, safe):
        poll()
    if shadowing:
        return None
    if isinstance(optimizer, torch.optim.SGD) and _PRIMED.get(optimizer) != id(optimizer.state):
        if prime_momentum(optimizer) and bool(found_inf):
            return None  # skipped while buffers are missing (dampening != 0): the state stays empty
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.found_inf
        if user is None:
            del optimizer.grad_scale
        else:
            optimizer.grad_scale = user


def with_grad_scaler(
    optimizer: Any, scaler: Any, state: dict[str, Any], shadowing: bool, args: Any, kwargs: Any
) -> tuple[Any, Any]:
    """``(retval, skipped)`` of ``optimizer.step(..., grad_scaler=scaler)`` (torch's
    ``FutureWarning`` first); ``skipped`` from the flags it recorded (0-d bool)."""
    warnings.warn(
        "GradScaler is going to stop passing itself as a keyword argument to the passed "
        "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
        "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
        FutureWarning,
        stacklevel=4,
    )
    retval = None if shadowing else optimizer.step(*args, **{**kwargs, "grad_scaler": scaler})
    flags = list(state["found_inf_per_device"].values())
    skipped = sum(flags) > 0 if flags else torch.tensor(False, device="cpu")
    return retval, skipped


class Stepping:
    """The scaler's step of each kind of optimizer (see the module docstring)."""

    _it: Any
    _calls: Any
    _schedule: Any
    _bounds: Any
    _loss_scale: Any
    _check: Any
    _unscale: Any
    _poll: Any
    _config: Any

    def _safe_updates(self) -> float:
        """Updates the host need not see for the scale to stay >= 1 (a compiled loop's)."""
        return self._bounds.safe_updates(self._config)

    @torch.compiler.disable  # the host read; the schedule's count would recompile a graph
    def _plain_step(self, optimizer: Any, state: dict[str, Any], args: Any, kwargs: Any) -> Any:
        """A checked non-fused ``optimizer`` (``state``: its record): one host read of the
        agreed flag, ``optimizer.step`` only if it is 0."""
        if self._schedule.step(False, self._safe_updates):  # a compiled loop's catch-up read
            self._poll()
        flags = list(state["found_inf_per_device"].values())
        overflow, retval = plain(optimizer, flags, self._calls.shadowing, args, kwargs)
        if overflow and "scaled" in state:  # agreed: a rank's error or mismatch raises here,
            self._poll(collapses=False)  # before update() could back any rank's scale off for it
        self._it.stepped(optimizer, state, overflow)
        return retval

    def _fused_step(self, optimizer: Any, state: dict[str, Any], args: Any, kwargs: Any) -> Any:
        """A fused ``optimizer``: checked (not unscaled) unless unscaled already, then stepped
        with ``grad_scale``/``found_inf`` tensors: no host read."""
        scale = self._loss_scale.tensors.scale
        if state["stage"] is OptState.READY:
            if self._bounds.below_one or unscaled_or_tied(optimizer, self._it.pre_unscaled):
                # part is unscaled already, a tied parameter, or the scale may be below 1 (the
                # kernel's 1/scale could overflow unseen): unscale in place, checked
                self._unscale(optimizer, state)
            else:
                self._check(optimizer, state, unscale=False)["grad_scale"] = scale
        user = getattr(optimizer, "grad_scale", None)
        grad_scale, found_inf = fused_inputs(state, user, scale.device)
        self._it.stepped(optimizer, state, found_inf > 0)
        catch_up = (self._schedule, self._safe_updates, self._poll)
        shadowing = self._calls.shadowing
        return fused(optimizer, grad_scale, found_inf, user, shadowing, catch_up, *args, **kwargs)

    def _grad_scaler_step(self, optimizer: Any, state: dict[str, Any], args: Any, kwargs: Any):
        """An optimizer on torch's ``grad_scaler=`` protocol: it unscales itself through the
        scaler's internals (``_protocol``)."""
        state["optimizer"] = weakref.ref(optimizer)
        shadowing = self._calls.shadowing
        retval, skipped = with_grad_scaler(optimizer, self, state, shadowing, args, kwargs)
        self._it.stepped(optimizer, state, skipped)
        self._schedule.unread = True
        return retval
