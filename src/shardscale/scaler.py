"""``ShardedGradScaler``: a ``torch.amp.GradScaler`` that is correct across shards and ranks."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import numbers
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, overload

import torch
from torch.amp.grad_scaler import OptState
from torch.distributed.algorithms.join import Joinable, JoinHook

from . import _clip, _sync
from ._alarm import Alarm
from ._checkpoint import GUARD_KEYS, parse_state_dict, to_state_dict
from ._config import (
    ScalerConfig,
    check_backoff_factor,
    check_growth_factor,
    check_growth_interval,
    check_scale,
)
from ._grads import (
    SharedMemoryGradError,
    bucket_grads,
    combine_flags,
    iter_params,
    to_device,
    unscale_and_check,
)
from ._iteration import Iteration, LastStep
from ._policy import COUNTER_NAMES, ScaleState, count_, step_
from ._report import OverflowReport, ParamNames, collapse_error, name_params, scan_local

logger = logging.getLogger("shardscale")

_STALE = (
    "ShardedGradScaler: an optimizer is stepped (or unscaled) after update() with no scale() "
    "since: its gradients were scaled before that update(), by a scale update() may have "
    "changed. Call update() once per iteration, after every optimizer's step(): "
    "scale(loss).backward() -> step(opt_1) ... step(opt_n) -> update()."
)
_ORDER = (
    "scaler.scale(loss).backward() -> [scaler.unscale_(opt)] -> scaler.step(opt) -> scaler.update()"
)
#: update() calls between two reads of the alarm (a completed device-to-host copy) when steps
#: ran whose found-inf flag the host never read (fused optimizers).
POLL_EVERY = 16
_DEFAULTS = ScalerConfig()


def _is_optimizer(obj: object) -> bool:
    return hasattr(obj, "param_groups") and callable(getattr(obj, "step", None))


class ShardedGradScaler(torch.amp.GradScaler, Joinable):
    """Dynamic loss scaling for fp16/bf16 training, correct across shards and ranks.

    A ``torch.amp.GradScaler`` by type and by protocol (public API, ``state_dict`` keys, the
    private state frameworks and ``grad_scaler=`` optimizers read): swapping the import is
    enough. What differs from torch's scalers:

    * **Agreement.** Each optimizer's found-inf flag is all-reduced (MAX) in exactly one
      collective per ``unscale_`` (one per mesh dimension for a DeviceMesh), so every rank skips
      the same steps; fused optimizers receive the agreed flag. The same all-reduce carries the
      step count and the optimizer's parameter count: ranks that call the scaler differently
      get an error naming the mismatch instead of diverging.
    * **Any gradient.** Plain, FSDP2 DTensor shards (the local shard is unscaled), FSDP1 flat
      parameters, CPU-offloaded next to device ones, fp32/fp16/bf16, sparse, ranks holding no
      shard. The kernel is torch's on every device.
    * **Bounded scale** in ``[min_scale, max_scale]``, hysteresis (Megatron-LM, DeepSpeed), a
      collapse guard raising :class:`ScaleCollapseError`, :meth:`metrics`,
      :meth:`last_step_skipped`, :meth:`overflow_report`, :meth:`clip_grad_norm_` (one read
      pass, one all-reduce).

    Host reads: ``scale``, ``unscale_`` and ``clip_grad_norm_`` make none; ``step`` one per
    non-fused optimizer (to decide whether to call ``optimizer.step()``), none for fused
    optimizers (``Adam/AdamW/SGD(fused=True)``), which receive ``grad_scale``/``found_inf``
    tensors; ``update`` none, except one read of the alarm (the collapse guard and the
    rank-agreement check, a few floats written on the device) after a step read an overflow,
    and every ``POLL_EVERY`` (16) updates while fused steps run (their flags are never read).
    ``scale``, ``update`` and a whole train step compile with ``torch.compile``.

    .. note:: fp16 gradients unscaled in place lose values below fp16's range; a fused
       optimizer without ``unscale_`` unscales in its fp32 math and keeps them. Otherwise reduce
       gradients in fp32 (FSDP2 ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``).

    Args:
        device: as ``torch.amp.GradScaler``'s; the scale lives on the device of the first tensor
            given to :meth:`scale`. Default ``"cuda"`` if available, else ``"cpu"``.
        init_scale: initial loss scale (finite, > 0). Default 2**16.
        growth_factor: > 1. Default 2.0.
        backoff_factor: in (0, 1). Default 0.5.
        growth_interval: clean steps before growth, >= 1. Default 2000.
        enabled: if False every method is a pass-through (``step`` calls ``optimizer.step()``).
        process_group: a ``ProcessGroup``, a ``DeviceMesh`` or a list/tuple of them; the flag is
            reduced over all of them. ``None``: the default group if ``torch.distributed`` is
            initialized when ``unscale_`` runs, else no communication.
        min_scale, max_scale, hysteresis, consecutive_hysteresis, max_consecutive_skips,
        on_collapse, dynamic: the policy beyond torch's, see :class:`ScalerConfig`.
        report_overflows: if True, ``update()`` reads the agreed flag (one host read per
            iteration) and logs an :class:`OverflowReport` as a warning on the ``"shardscale"``
            logger after each overflowing iteration (one scan and one all-gather then).
        param_names: an ``nn.Module`` or ``{name: parameter}`` map naming parameters in reports.
        rank_local_params: True when the ranks hold *different* parameters (pipeline stages):
            the optimizer-identity check is off and :meth:`clip_grad_norm_` sums every gradient
            over ranks. False (default) for replicated (DDP) or sharded (FSDP) models.

    Raises:
        TypeError, ValueError: a bad argument; the message names it. Nothing is half-built.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: _sync.ProcessGroupLike = None,
        *,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        max_consecutive_skips: int | None = None,
        on_collapse: str = "raise",
        dynamic: bool = True,
        report_overflows: bool = False,
        param_names: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
        rank_local_params: bool = False,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}.")
        device_type = torch.device(device).type
        numpy_bool = type(enabled).__module__ == "numpy" and "bool" in type(enabled).__name__
        if not (isinstance(enabled, numbers.Integral) or numpy_bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}.")
        _sync.validate_process_group(process_group)
        bounds = {
            k: v for k, v in (("min_scale", min_scale), ("max_scale", max_scale)) if v is not None
        }
        config = ScalerConfig(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            max_consecutive_skips=max_consecutive_skips,
            on_collapse=on_collapse,  # type: ignore[arg-type]
            dynamic=dynamic,
            **bounds,
        )
        init = check_scale("init_scale", init_scale, config.min_scale, config.max_scale)
        for name, flag in (
            ("rank_local_params", rank_local_params),
            ("report_overflows", report_overflows),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}.")
        names = name_params(param_names)
        # Validated. torch's GradScaler.__init__ is not called (with device="cuda" on a machine
        # without CUDA it disables the scaler): every attribute it sets is set here.
        self._device = device_type
        self._enabled = bool(enabled)
        self._config = config
        self._init_scale = init
        self._init_growth_tracker = 0
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        # shardscale's state: the rest of ScaleState, created with _scale
        self._init_hysteresis_tracker = config.hysteresis
        self._init_counters: tuple[int, ...] = (0,) * len(COUNTER_NAMES)
        self._hysteresis_tracker: torch.Tensor | None = None
        self._counters: torch.Tensor | None = None
        self._alarm: Alarm | None = None  # what the device noticed, for the host to read
        self.process_group = process_group
        self.rank_local_params = rank_local_params
        self._report_overflows = report_overflows
        self._names = names
        self._it = Iteration(floor=init)  # the record of this iteration and of the last one
        #: the policy fields the constructor set away from their defaults: they win over a
        #: checkpoint's in load_state_dict (a guard asked for is never switched off by a resume)
        self._asked = frozenset(
            k for k in GUARD_KEYS if getattr(config, k) != getattr(_DEFAULTS, k)
        )
        Joinable.__init__(self)  # torch.distributed.algorithms.Join: see join_hook()
        self._shadowing = False  # a joined rank repeating the others' calls (Join)
        self._last_report: tuple[bool, OverflowReport] | None = None  # (all_ranks, report)

    @classmethod
    def guard(
        cls, process_group: _sync.ProcessGroupLike = None, **kwargs: Any
    ) -> ShardedGradScaler:
        """A scaler for bf16/fp32 training: the scale fixed (at 1.0, or ``init_scale`` if
        given), non-finite steps still skipped on every rank, reports as in fp16 mode. ``kwargs``
        go to the constructor (e.g. ``max_consecutive_skips``, ``report_overflows``)."""
        kwargs.setdefault("init_scale", 1.0)
        return cls(process_group=process_group, dynamic=False, **kwargs)

    # torch's attributes for the policy, read and written through the config
    _growth_factor = property(
        lambda self: self._config.growth_factor, lambda self, v: self.set_growth_factor(v)
    )
    _backoff_factor = property(
        lambda self: self._config.backoff_factor, lambda self, v: self.set_backoff_factor(v)
    )
    _growth_interval = property(
        lambda self: self._config.growth_interval, lambda self, v: self.set_growth_interval(v)
    )

    @property
    def _per_optimizer_states(self) -> dict[int, dict[str, Any]]:  # type: ignore[override]
        """torch's per-optimizer records of this iteration (see :mod:`shardscale._iteration`)."""
        return self._it.states

    @_per_optimizer_states.setter
    def _per_optimizer_states(self, value: dict[int, dict[str, Any]]) -> None:
        self._it.states = value

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Create the scale state on ``dev`` (as torch's method; also public in effect: call it
        to place the scale before the first :meth:`scale`, e.g. before a CUDA graph capture).
        Idempotent: a state that exists already stays where it is."""
        if self._scale is not None:
            return
        state = ScaleState.create(
            torch.device(dev),
            self._init_scale,
            self._init_growth_tracker,
            self._init_hysteresis_tracker,
            self._init_counters,
        )
        self._scale, self._growth_tracker = state.scale, state.growth_tracker
        self._hysteresis_tracker, self._counters = state.hysteresis_tracker, state.counters
        self._alarm = Alarm(state.scale.device)

    def _state(self) -> ScaleState:
        return ScaleState(
            self._scale, self._growth_tracker, self._hysteresis_tracker, self._counters
        )  # type: ignore[arg-type]

    # ------------------------------------------------------------------ scale
    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    def scale(self, outputs: Any) -> Any:
        """Multiply a loss (or nested lists/tuples of losses) by the current loss scale.

        The scale is created on the device of the first tensor ever scaled (a 0-d float32
        tensor). The result dtype follows torch's type promotion, as ``torch.amp.GradScaler``. A
        NaN/inf loss is not an error: its step is skipped. No host read; compiles with
        ``torch.compile(fullgraph=True)``.

        Args:
            outputs: a floating-point tensor, or a list/tuple (possibly nested) of them.

        Returns:
            The same structure with every tensor multiplied by the scale (unchanged if disabled).

        Raises:
            TypeError, ValueError: anything else (the scaler is left unchanged).
        """
        if not self._enabled:
            return outputs
        first = _first_tensor(outputs)  # validates the whole structure first
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(first.device)
        self._it.scaled = True
        scale: torch.Tensor = self._scale  # type: ignore[assignment]
        if isinstance(outputs, torch.Tensor):
            return outputs * to_device(scale, outputs.device)

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                return val * to_device(scale, val.device)
            items = [apply(v) for v in val]
            return type(val)(*items) if hasattr(val, "_fields") else type(val)(items)

        return apply(outputs)

    # ---------------------------------------------------------------- unscale
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ("unscale") ``optimizer``'s gradients by the scale and agree on found_inf.

        Optional: :meth:`step` unscales by itself. One ``_amp_foreach_non_finite_check_and_
        unscale_`` per (device, dtype) of local gradients (DTensor grads: their local shard),
        then exactly one all-reduce (MAX) of the flag per process group. No host read.

        Raises:
            RuntimeError: called before :meth:`scale`, twice for this optimizer in one iteration,
                or after :meth:`step`.
            TypeError: ``optimizer`` is not an optimizer.
            ValueError: a gradient's elements share memory (an expanded view), named, before
                anything is written.
        """
        if not self._enabled:
            return
        self._unscale(optimizer)
        self._record("unscale_", optimizer)

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        state = self._opt_state("unscale_", optimizer)
        if state["stage"] is OptState.UNSCALED:
            self._fail(
                1,
                "unscale_() has already been called on this optimizer since the last update(); "
                f"call it at most once per optimizer per iteration: {_ORDER}.",
            )
        if state["stage"] is OptState.STEPPED:
            self._fail(3, f"unscale_() is being called after step(); the order is {_ORDER}.")
        self._agree(optimizer, self._inv_scale(), unscaling=True)
        state["stage"] = OptState.UNSCALED

    def _inv_scale(self) -> torch.Tensor:
        scale: torch.Tensor = self._scale  # type: ignore[assignment]
        if scale.device.type == "mps":  # no float64 there
            return scale.reciprocal()
        return scale.double().reciprocal().float()  # as torch: fp32 division can be imprecise

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's local unscale: ``optimizer``'s local gradients times ``inv_scale``, in place;
        ``{device: found_inf}`` (0-d float32 copies of ``found_inf``, 1.0 where a gradient held
        inf/NaN). No collective. Gradients ``clip_grad_norm_(params)`` unscaled already are left
        out. ``allow_fp16=False`` refuses fp16 gradients, as torch."""
        if self._shadowing:  # a joined rank: no gradients of this iteration
            return {}
        params = list(iter_params(optimizer))
        try:
            buckets = bucket_grads(params, skip=self._it.pre_unscaled)
        except SharedMemoryGradError as e:
            raise e.naming(self._names.current(), params) from None
        if not allow_fp16 and any(torch.float16 in b for b in buckets.values()):
            raise ValueError("Attempting to unscale FP16 gradients.")
        return unscale_and_check(buckets, inv_scale, found_inf)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """torch's check without unscaling: records and returns ``optimizer``'s agreed
        ``{scale device: found_inf}`` (one all-reduce, as :meth:`unscale_`)."""
        self._opt_state("_check_inf_per_device", optimizer)
        return self._agree(optimizer, torch.ones_like(self._scale))  # type: ignore[arg-type]

    def _agree(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, unscaling: bool = False
    ) -> dict[Any, torch.Tensor]:
        """Local unscale/check, then the single all-reduce; stores and returns the agreed flag
        as ``state["found_inf_per_device"]``. On error the optimizer's iteration is not started.

        The all-reduce carries ``[found_inf, step, -step, k, -k, scaled, error]``
        (:func:`_sync.agree`; ``k``: the ordinal of this check in the iteration): ranks at
        different steps or checks set the flag (the step is skipped) and the alarm, read by
        :meth:`update`, raises naming the mismatch."""
        scale: torch.Tensor = self._scale  # type: ignore[assignment]
        home, it = scale.device, self._it
        try:
            zero = torch.zeros((), dtype=torch.float32, device=home)
            flags = self._unscale_grads_(optimizer, inv_scale, zero, True)
            if flags:
                if not it.scaled and it.last_scaled:
                    warnings.warn(_STALE, RuntimeWarning, stacklevel=3)
                it.saw_gradients()
            local = combine_flags(flags, home)
            if unscaling and it.floor < 1.0:  # 1/scale > 1: finite gradients may overflow now
                again = self._unscale_grads_(optimizer, torch.ones_like(inv_scale), zero, True)
                local = torch.maximum(local, combine_flags(again, home))
            for flag in it.pre_unscaled_in(optimizer):  # unscaled by clip_grad_norm_
                local = torch.maximum(local, flag)
            groups = _sync.cover(self.process_group, _meshes(optimizer))
            agreed = None
            if groups:
                self._check_join_order()
                step = self._counters[0]  # type: ignore[index]
                agreed = _sync.agree(local, step, it.checks, it.counts(), groups)
                bad = _sync.mismatch(agreed)
                self._alarm.note_mismatch(bad, agreed, step, it.checks)  # type: ignore[union-attr]
                local = torch.maximum(agreed[0], bad.float())
        except BaseException:
            it.forget_if_untouched(optimizer)
            raise
        it.checks += 1
        state = it.checked(optimizer, local)
        if agreed is not None:
            state["scaled"] = agreed[_sync.SCALED] > 0  # did any rank call scale()?
        return state["found_inf_per_device"]

    # ------------------------------------------------------------------- step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` was called), then step ``optimizer`` unless any rank
        found inf/NaN in its gradients.

        Non-fused optimizers: one host read of the agreed flag; ``optimizer.step`` is called
        only when it is 0. Fused optimizers (``_step_supports_amp_scaling``, e.g.
        ``AdamW(fused=True)``): ``optimizer.step`` is always called with ``optimizer.grad_scale``
        (the scale times any ``grad_scale`` the user set, so the kernel unscales in fp32; the
        user's alone if :meth:`unscale_` already did; restored afterwards) and
        ``optimizer.found_inf`` (the agreed flag; the kernel skips): no host read. An optimizer
        whose ``step`` takes ``grad_scaler=`` gets ``grad_scaler=self`` (with torch's
        ``FutureWarning``) and does its own unscaling. :meth:`last_step_skipped` tells whether
        the step was skipped.

        Returns:
            What ``optimizer.step(*args, **kwargs)`` returned; None if a non-fused step was
            skipped.

        Raises:
            RuntimeError: called before :meth:`scale`, twice for this optimizer in one
                iteration, with a ``closure`` (as torch), or when the ranks disagree (another
                step, another optimizer).
            ValueError: as :meth:`unscale_`, before anything is written or stepped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported if ShardedGradScaler is enabled.")
        state = self._opt_state("step", optimizer)
        if state["stage"] is OptState.STEPPED:
            self._fail(
                1,
                "step() has already been called on this optimizer since the last update(); "
                f"the order is {_ORDER}, with update() once per iteration.",
            )
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            if state["stage"] is OptState.READY:
                self._unscale(optimizer)
            retval = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        elif "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                FutureWarning,
                stacklevel=2,
            )
            state["optimizer"] = weakref.ref(optimizer)
            retval = (
                None
                if self._shadowing
                else optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            )
            self._it.unread_steps = self._it.blind = True
            flags = list(state["found_inf_per_device"].values())
            skipped = sum(flags) > 0 if flags else torch.tensor(False, device="cpu")
            self._it.skipped[id(optimizer)] = skipped  # type: ignore[assignment]
        else:
            retval = self._fused_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        self._record("step", optimizer)
        return retval

    def _fused_step(self, optimizer: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Hand ``grad_scale`` and the agreed ``found_inf`` to a fused optimizer's kernel."""
        scale: torch.Tensor = self._scale  # type: ignore[assignment]
        if state["stage"] is OptState.READY:
            if self._it.pre_unscaled_in(optimizer) or self._it.floor < 1.0:
                # part is unscaled already, or the scale may be below 1 (the kernel's 1/scale
                # could overflow unseen): unscale in place, checked
                self._unscale(optimizer)
            else:
                self._check_inf_per_device(optimizer)  # check only: the kernel unscales
                state["grad_scale"] = scale
        user = getattr(optimizer, "grad_scale", None)
        folded = state.get("grad_scale")  # the scale, or clip_grad_norm_'s scale / clip_coef
        grad_scale = user if folded is None else folded if user is None else folded * user
        found_inf = sum(to_device(f, scale.device) for f in state["found_inf_per_device"].values())
        self._it.skipped[id(optimizer)] = found_inf > 0  # type: ignore[operator]
        self._it.unread_steps = self._it.blind = True
        return self._call_fused(optimizer, grad_scale, found_inf, user, *args, **kwargs)

    @torch.compiler.disable
    def _call_fused(
        self, optimizer: Any, grad_scale: Any, found_inf: Any, user: Any, *args: Any, **kwargs: Any
    ) -> Any:
        """``optimizer.step`` with ``grad_scale``/``found_inf`` set (the user's ``grad_scale``
        put back after), kept out of ``torch.compile`` graphs with the optimizer's step (which
        breaks them by itself) and :meth:`_catch_up`."""
        self._catch_up()
        if self._shadowing:
            return None
        optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.found_inf
            if user is None:
                del optimizer.grad_scale
            else:
                optimizer.grad_scale = user

    def _catch_up(self) -> None:
        """In a ``torch.compile``-d loop ``update()`` reads nothing on the host; the steps (kept
        eager) read the alarm every ``POLL_EVERY`` of them instead: a collapse then raises from
        ``step()``. Eager ``update()`` calls reset the count, so this never reads in eager code."""
        it = self._it
        it.steps_since_update += 1
        if it.steps_since_update > POLL_EVERY:
            it.steps_since_update = 0
            self._poll()

    @torch.compiler.disable
    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """The one host read of a non-fused step (kept out of ``torch.compile`` graphs):
        ``optimizer.step`` only if no rank overflowed. An overflow (or a rank mismatch, which
        sets the flag too) has ``update`` read the alarm in this iteration."""
        self._catch_up()
        flags = list(optimizer_state["found_inf_per_device"].values())
        overflow = bool(sum(f.item() for f in flags))
        self._it.skipped[id(optimizer)] = torch.tensor(overflow, device="cpu")
        self._it.host_overflow = self._it.host_overflow or overflow
        return None if overflow or self._shadowing else optimizer.step(*args, **kwargs)

    # ----------------------------------------------------------------- update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the loss scale after every optimizer of the iteration has stepped.

        Without ``new_scale`` the policy of :class:`ScalerConfig` runs on the device
        (:func:`next_state`, no host read): back off after an overflow on any rank (after
        ``hysteresis`` of them), grow after ``growth_interval`` clean steps, stay inside
        ``[min_scale, max_scale]``. All optimizers' agreed flags are summed once. With
        ``new_scale`` (a float, or a 1-element tensor, read once) the scale is set to it and the
        trackers kept, as torch; the iteration is still counted, the collapse guard not run.

        The collapse guard and the rank-agreement check read the alarm on the host when a step
        of this iteration read an overflow, and every ``POLL_EVERY`` updates while fused steps
        run (by then long computed: no wait): a collapse raises from that call. Under
        ``torch.compile`` (``fullgraph=True`` works) nothing is read: the next eager ``update``
        does it.

        Raises:
            RuntimeError: no :meth:`step`/:meth:`unscale_`/``clip_grad_norm_`` since the last
                update, called before :meth:`scale`, or the ranks disagreed.
            TypeError, ValueError: a bad ``new_scale`` (not a finite value in the bounds).
            ScaleCollapseError: the scale collapsed and ``on_collapse="raise"`` (the update has
                been applied and the scaler is ready for the next iteration).
        """
        if not self._enabled:
            return
        self._update(new_scale)
        self._record("update", new_scale)

    def _update(self, new_scale: float | torch.Tensor | None) -> None:
        value = None if new_scale is None else self._check_new_scale(new_scale)  # validate first
        if not self._it.inf_checks()[0] and value is None:
            self._fail(
                2,
                "update() was called but no optimizer was stepped or unscaled since the last "
                f"update(); the order is {_ORDER}.",
            )
        if self._scale is None:  # only update(new_scale) gets here
            self._lazy_init_scale_growth_tracker(self._device)
        state = self._state()
        anyone_scaled = self._anyone_scaled()
        seen_clean = self._it.seen_clean()
        found_inf, refs = self._it.close(state.scale.device)
        if not anyone_scaled and value is None:
            # no rank has called scale() since the scaler was made or loaded: a step of
            # checkpoint plumbing on zero gradients (torch.distributed.checkpoint's
            # optimizer-state init): nothing to count
            return
        if value is not None:
            old = state.scale.clone()
            state.scale.fill_(value)
            if found_inf is not None:  # the iteration is still counted
                count_(state.counters, found_inf, old, state.scale)
        else:
            assert found_inf is not None
            collapsed, old = step_(state, found_inf, self._config)
            self._alarm.note_collapse(collapsed, state.counters[0], old)  # type: ignore[union-attr]
        last = None
        if found_inf is not None:
            last = self._it.last = LastStep(state.counters, -1, old, found_inf, refs)
        self._last_report = None  # a mid-iteration report may miss optimizers stepped later
        if not torch.compiler.is_compiling():
            it, config = self._it, self._config
            if value is not None:
                it.floor = value
            elif config.dynamic and not seen_clean:
                it.floor = max(it.floor * config.backoff_factor, config.min_scale)
            if last is not None and self._report_overflows and bool(last.found_inf > 0):
                logger.warning("%s", self._build_report(last))
            it.updates_since_poll += 1
            it.steps_since_update = 0
            due = it.unread_steps and it.updates_since_poll >= POLL_EVERY
            if it.host_overflow or due or it.floor < 1.0:
                self._poll()
            it.host_overflow = False

    def _anyone_scaled(self) -> bool:
        """Whether the iteration counts: this rank's gradients were scaled (``scale()`` now, or
        in an earlier iteration since the scaler was made or loaded: no host read), or another
        rank's were, as the iteration's agreements say (one host read, on idle ranks only)."""
        if self._it.counts():
            return True
        seen = self._it.others_scaled()
        return bool(torch.stack(seen).any()) if seen else False

    def abandon(self) -> None:
        """Abandon the current iteration, after ``unscale_``/``clip_grad_norm_`` and before
        ``step``/``update`` (e.g. a gradient-norm guard of your own decided to skip it): the
        iteration's records are dropped; the scale, its trackers and the counters stay as they
        are; the next iteration starts with ``scale(loss)`` as usual. Call it on every rank of
        the process group (decide from a value every rank agrees on, such as the norm
        :meth:`clip_grad_norm_` returns): a rank that steps instead is out of step and the next
        agreement raises naming it. No collective, no host read."""
        self._it.abandon()
        self._record("abandon")

    def place(self, device: torch.device | str) -> None:
        """Create the scale state on ``device`` before the first :meth:`scale` (e.g. before a
        CUDA graph capture or after ``load_state_dict``), or move it there. Idempotent; call it
        at an iteration boundary.

        Raises:
            TypeError: ``device`` is not a str or ``torch.device``.
            ValueError: the meta device (no data).
        """
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}.")
        device = torch.device(device)
        if device.type == "meta":
            raise ValueError("place() needs a device with data, got the meta device.")
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(device)
        elif self._scale.device != device:
            moved = ScaleState(*(t.to(device) for t in dataclasses.astuple(self._state())))
            self._scale, self._growth_tracker = moved.scale, moved.growth_tracker
            self._hysteresis_tracker, self._counters = moved.hysteresis_tracker, moved.counters
            self._alarm = Alarm(device)

    def _fail(self, code: int, message: str) -> None:
        """Raise the call-order error ``message``; on several ranks, first tell the others
        through the all-reduce they wait in (:func:`_sync.poison`), so that they fail naming
        this rank instead of timing out."""
        groups = _sync.resolve_groups(self.process_group)
        if groups and self._scale is not None:
            steps = float(self._counters[0])  # type: ignore[index]  (error path: a read is fine)
            _sync.poison(code, steps, self._it.checks, _sync.rank(), groups, self._scale.device)
        raise RuntimeError(message)

    def _check_new_scale(self, new_scale: object) -> float:
        if isinstance(new_scale, torch.Tensor):
            if (
                new_scale.numel() != 1
                or new_scale.device.type == "meta"
                or new_scale.requires_grad
                or not new_scale.is_floating_point()
            ):
                raise ValueError(
                    "new_scale must be a float or a 1-element floating-point tensor with "
                    f"requires_grad=False, not on the meta device; got shape "
                    f"{tuple(new_scale.shape)}, dtype {new_scale.dtype}, device "
                    f"{new_scale.device}, requires_grad={new_scale.requires_grad}."
                )
            new_scale = float(new_scale.item())
        return check_scale("new_scale", new_scale, self._config.min_scale, self._config.max_scale)

    def _poll(self) -> None:
        """Read the alarm (one host read): raise on a rank mismatch, raise or warn on a collapse
        (every rank polls at the same update, so the report is gathered over the ranks)."""
        self._it.updates_since_poll, self._it.unread_steps = 0, False
        collapse, self._it.floor = self._alarm.read(_sync.rank(), self._scale)  # type: ignore[union-attr,arg-type]
        if collapse is None:
            return
        entries = self._scan(self._it.last.live_optimizers() if self._it.last else [])
        error = collapse_error(self._config, *collapse, entries, _sync.rank())
        if self._config.on_collapse == "raise":
            raise error
        warnings.warn(str(error), RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ Join
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For ``torch.distributed.algorithms.Join([ddp_model, scaler])`` (uneven inputs).

        A rank that ran out of data repeats, once per iteration of the others, the scaler calls
        of its own last iteration (``unscale_``, ``clip_grad_norm_``, ``step``, ``update``,
        ``overflow_report(all_ranks=True)``, ``abandon``, in their order) with no gradients of
        its own: it takes part in every collective of the others (the agreements, the clip's
        norm, the overflow report's and a collapse's gathers), never steps an optimizer, and
        applies the agreed update, so every rank keeps the same scale and raises a collapse
        together. The ranks must run the same scaler calls in every iteration (one optimizer
        step per forward: no gradient accumulation inside a Join). List the model first (its
        hook shadows the forward and backward collectives, which come first); the scaler listed
        first raises a ``RuntimeError`` at its first collective."""
        return _ScalerJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        groups = _sync.resolve_groups(self.process_group)
        home = self._scale.device if self._scale is not None else torch.device(self._device)
        return _sync.comm_device(groups[0], home) if groups else home

    @property
    def join_process_group(self) -> Any:
        groups = _sync.resolve_groups(self.process_group)
        return groups[0] if groups else None

    def _shadow_iteration(self) -> None:
        """A joined rank's part of one iteration of the others: the scaler calls of its last
        iteration, repeated without gradients (see :meth:`join_hook`); with none (it never
        trained), one agreement and the agreed update."""
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(self._device)
        calls = list(self._it.calls)
        if not calls:
            groups = _sync.resolve_groups(self.process_group)
            state = self._state()
            zero = torch.zeros((), dtype=torch.float32, device=state.scale.device)
            agreed = _sync.agree(zero, state.counters[0], 0, False, groups)
            if bool(agreed[_sync.SCALED] > 0):
                collapsed, old = step_(state, agreed[_sync.FOUND], self._config)
                self._alarm.note_collapse(collapsed, state.counters[0], old)  # type: ignore[union-attr]
            return
        self._shadowing = True
        try:
            for name, args in calls:
                getattr(self, name)(*args)
        finally:
            self._shadowing = False

    # ------------------------------------------------------------- clipping
    def clip_grad_norm_(
        self,
        optimizer_or_params: torch.optim.Optimizer | Iterable[torch.Tensor] | torch.Tensor,
        max_norm: float,
        norm_type: float | str = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Unscale, compute the global gradient norm across shards and ranks, and clip.

        The same as ``scaler.unscale_(opt)`` then ``torch.nn.utils.clip_grad_norm_(params,
        max_norm, norm_type)`` on the *unsharded* model, with the found-inf agreement of
        :meth:`unscale_`, in one read pass, ONE all-reduce of 3 floats (none without a process
        group) and one write pass (none for a fused optimizer: the factor is folded into its
        ``grad_scale``). Replicated gradients (plain, DDP, DTensor ``Replicate``, FSDP1
        ``NO_SHARD`` flat parameters) count once; shards (FSDP2 ``Shard``, FSDP1) are summed.
        Afterwards the optimizer is UNSCALED with its agreed flag, so :meth:`step` skips (on
        every rank) or steps. See :mod:`shardscale._clip`.

        After ``scaler.unscale_(optimizer)`` (torch's recipe: unscale, then clip) or a first
        clip in the same iteration, it clips the gradients as they are, as
        ``torch.nn.utils.clip_grad_norm_`` would on the unsharded model: one more all-reduce, of
        the norm only. A disabled scaler (``enabled=False``) does the same: the global norm of
        unscaled gradients over shards and ranks.

        Args:
            optimizer_or_params: the optimizer whose gradients to clip, or a tensor / iterable
                of parameters (those are unscaled and clipped in place and remembered, so their
                optimizer's ``step`` leaves them alone and still skips after an overflow; it
                issues its own all-reduce: two in the iteration).
            max_norm: the largest allowed total norm (>= 0; inf: no clipping).
            norm_type: ``p`` of the p-norm, any number > 0, or ``inf`` / ``"inf"``.
            error_if_nonfinite: as torch's: raise if the total norm is inf/NaN (one host read;
                with a scaler such a norm means an overflow, which is otherwise skipped).
            foreach: as torch's: None or True use the ``torch._foreach_*`` kernels, False one
                kernel per tensor.

        Returns:
            The total norm of the unscaled gradients over all ranks and shards, a 0-d float32
            tensor on the scale's device (inf/NaN after an overflow), as torch's function.

        Raises:
            TypeError, ValueError: a bad argument or gradient (a Partial DTensor, shared memory),
                before anything is written.
            RuntimeError: after :meth:`step` in the iteration, parameters mixing unscaled and
                scaled gradients, or ``error_if_nonfinite`` and a non-finite norm (nothing
                written then).
            NotImplementedError: several process groups / a multi-dimensional mesh, or DTensor
                gradients on a mesh other than the scaler's group.
        """
        target: Any = optimizer_or_params
        if not _is_optimizer(target):
            target = _clip.param_list(target)  # a generator is read once
        total = self._clip_grad_norm(target, max_norm, norm_type, error_if_nonfinite, foreach)
        self._record("clip_grad_norm_", target, max_norm, norm_type, error_if_nonfinite, foreach)
        return total

    def _clip_grad_norm(
        self,
        optimizer_or_params: Any,
        max_norm: float,
        norm_type: float | str,
        error_if_nonfinite: bool,
        foreach: bool | None,
    ) -> torch.Tensor:
        is_opt = _is_optimizer(optimizer_or_params)
        params = list(iter_params(optimizer_or_params)) if is_opt else optimizer_or_params
        max_norm_f = _clip.check_max_norm(max_norm)
        p = _clip.check_norm_type(norm_type)
        if not isinstance(error_if_nonfinite, bool):
            raise TypeError(f"error_if_nonfinite must be a bool, got {error_if_nonfinite!r}.")
        if foreach is not None and not isinstance(foreach, bool):
            raise TypeError(f"foreach must be None or a bool, got {foreach!r}.")
        opts = {"error_if_nonfinite": error_if_nonfinite, "foreach": foreach is not False}
        groups = _sync.resolve_groups(self.process_group)
        if len(groups) > 1:
            raise NotImplementedError(
                "clip_grad_norm_() supports one process group (or a 1-D DeviceMesh); this scaler "
                f"reduces over {len(groups)} groups. For HSDP / multi-dimensional meshes, call "
                "scaler.unscale_(optimizer) and compute the norm with your framework's helper."
            )
        group = groups[0] if groups else None
        try:
            buckets = _clip.bucket(params, group, self.rank_local_params)
        except SharedMemoryGradError as e:
            raise e.naming(self._names.current(), params) from None
        if self._shadowing:
            buckets = {}  # a joined rank: no gradients of this iteration
        elif buckets:
            self._it.saw_gradients()
        if group is not None:
            self._check_join_order()
        if not self._enabled:
            return _clip.clip_unscaled(buckets, p, max_norm_f, group, **opts)
        if self._scale is None:  # an idle rank: no loss to scale since the start (or a resume)
            self._lazy_init_scale_growth_tracker(params[0].device if params else self._device)
        if not is_opt:
            return self._clip_params(buckets, params, p, max_norm_f, group, opts)
        optimizer: Any = optimizer_or_params
        if any(id(q) in self._it.pre_unscaled for q in params):
            raise RuntimeError(
                "clip_grad_norm_(optimizer) was called after clip_grad_norm_(params) on some of "
                "its parameters in this iteration; clip either the optimizer or parameter lists, "
                "once per parameter per iteration."
            )
        state = self._opt_state("clip_grad_norm_", optimizer)
        if state["stage"] is OptState.UNSCALED:  # after unscale_(): clip them as they are
            return _clip.clip_unscaled(buckets, p, max_norm_f, group, **opts)
        if state["stage"] is not OptState.READY:
            self._it.forget_if_untouched(optimizer)
            raise RuntimeError(
                "clip_grad_norm_() was called after step() on this optimizer in this iteration; "
                "clip before step(): scaler.scale(loss).backward() -> "
                "scaler.clip_grad_norm_(opt, max_norm) -> scaler.step(opt) -> scaler.update()."
            )
        # a scale below 1 is not folded (the kernel's division could overflow unseen)
        fused = (
            bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and self._it.floor >= 1
        )
        try:
            total, state["grad_scale"], found_inf, anyone = self._norm_and_clip(
                buckets, p, max_norm_f, group, fused, opts
            )
        except BaseException:
            self._it.forget_if_untouched(optimizer)
            raise
        state = self._it.checked(optimizer, found_inf)
        state["stage"], state["scaled"] = OptState.UNSCALED, anyone
        return total

    def _norm_and_clip(
        self,
        buckets: _clip.Buckets,
        p: float,
        max_norm: float,
        group: Any,
        fused: bool,
        opts: dict[str, bool],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        scale: torch.Tensor = self._scale  # type: ignore[assignment]
        inv, scaled, low = self._inv_scale(), self._it.counts(), self._it.floor < 1.0
        return _clip.norm_and_clip(
            buckets, scale, inv, p, max_norm, group, fused, scaled, low, **opts
        )

    def _clip_params(
        self,
        buckets: _clip.Buckets,
        params: list[torch.Tensor],
        p: float,
        max_norm: float,
        group: Any,
        opts: dict[str, bool],
    ) -> torch.Tensor:
        ids = {id(q) for q in params}
        stages: dict[int, OptState] = {}  # parameter -> its optimizer's stage, if not READY
        stages.update((i, OptState.UNSCALED) for i in ids & self._it.pre_unscaled.keys())
        for state in self._per_optimizer_states.values():
            opt = state["optimizer"]() if "optimizer" in state else None
            if state["stage"] is not OptState.READY and opt is not None:
                stages.update((id(q), state["stage"]) for q in iter_params(opt) if id(q) in ids)
        if OptState.STEPPED in stages.values():
            raise RuntimeError(
                "clip_grad_norm_(params) was called after step() of an optimizer that owns these "
                "parameters; clip before: scaler.scale(loss).backward() -> "
                "scaler.clip_grad_norm_(params, max_norm) -> scaler.step(opt)."
            )
        if stages and len(stages) == len(ids):  # unscaled already: clip them as they are
            return _clip.clip_unscaled(buckets, p, max_norm, group, **opts)
        if stages:
            raise RuntimeError(
                "clip_grad_norm_(params) mixes parameters whose gradients are unscaled already "
                "(by unscale_() or an earlier clip) with others still scaled; clip each set on "
                "its own."
            )
        total, _, found_inf, _ = self._norm_and_clip(buckets, p, max_norm, group, False, opts)
        for q in params:
            self._it.pre_unscaled[id(q)] = found_inf
        return total

    # ------------------------------------------------------------- reporting
    def last_step_skipped(self, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """Whether the last step of ``optimizer`` (or of the last iteration, for None) was
        skipped, as a 0-d bool tensor: a CPU tensor already known to the host for non-fused
        optimizers; on the scale's device for fused ones (reading it then waits for the step).
        A disabled scaler never skips. To keep an LR scheduler still on skipped steps::

            scaler.step(optimizer); scaler.update()
            if not scaler.last_step_skipped(optimizer):
                scheduler.step()

        Raises:
            RuntimeError: no step has been taken yet (for this optimizer).
        """
        if not self._enabled:
            return torch.tensor(False, device="cpu")
        if optimizer is not None:
            flag = self._it.skipped.get(id(optimizer))
            if flag is None:
                raise RuntimeError("last_step_skipped(): this optimizer has not been stepped yet.")
            return flag
        if self._it.last is None:
            raise RuntimeError("last_step_skipped(): update() has not been called yet.")
        return self._it.last.found_inf > 0

    def metrics(self) -> dict[str, float | int]:
        """Plain numbers for loggers: ``scale``, ``growth_tracker``, ``hysteresis_tracker``,
        ``steps``, ``skipped_steps``, ``consecutive_skips``, ``overflows``, ``backoffs``,
        ``growths`` (see :class:`ScaleState`) and ``last_step_skipped`` (0/1). One host read; no
        collective. A disabled scaler gives the same keys: scale 1.0 and zeros."""
        if not self._enabled:
            values = [1.0, 0, 0, *(0,) * len(COUNTER_NAMES), 0]
        elif self._scale is None:
            init = (self._init_scale, self._init_growth_tracker, self._init_hysteresis_tracker)
            values = [*init, *self._init_counters, 0]
        else:
            s = self._state()
            last = self._it.last.found_inf if self._it.last else torch.zeros_like(s.scale)
            parts = [*dataclasses.astuple(s), to_device(last, s.scale.device)]
            values = torch.cat([t.double().reshape(-1) for t in parts]).tolist()  # one read
        out: dict[str, float | int] = {"scale": float(values[0])}
        names = ("growth_tracker", "hysteresis_tracker", *COUNTER_NAMES)
        out.update({name: int(v) for name, v in zip(names, values[1:], strict=False)})
        out["last_step_skipped"] = int(values[-1] > 0)
        return out

    def set_param_names(self, source: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Name parameters in overflow reports, from a module (its submodules are asked for
        their parameters when a report is built) or a ``{name: parameter}`` map. ``copy.
        deepcopy`` of the scaler after its model in the same call follows the copied model;
        pickling drops the names (call this again after loading)."""
        self._names = name_params(source)

    def overflow_report(self, all_ranks: bool = False) -> OverflowReport | None:
        """Where the non-finite gradients of the last stepped iteration were.

        Call it after :meth:`step` / :meth:`update` and before ``zero_grad()``. Returns None
        without scanning when the iteration was clean (one host read to know; the flag is agreed,
        so every rank gets the same answer).

        Args:
            all_ranks: False (default): this rank's gradients only; no collective, so any rank
                may call it alone. True: every rank's, gathered: a collective (one
                ``all_gather_object`` when the iteration overflowed), which every rank of the
                process group must call.
        """
        if not isinstance(all_ranks, bool):
            raise TypeError(f"all_ranks must be a bool, got {all_ranks!r}.")
        report = self._overflow_report(all_ranks)
        if all_ranks:
            self._record("overflow_report", True)
        return report

    def _overflow_report(self, all_ranks: bool) -> OverflowReport | None:
        flags, refs = self._it.inf_checks()
        if flags:  # mid-iteration: what was checked so far
            scale: torch.Tensor = self._scale  # type: ignore[assignment]
            found = sum(to_device(f, scale.device) for f in flags)
            last = LastStep(self._counters, 0, scale.clone(), found, refs)  # type: ignore[arg-type]
        elif self._it.last is not None:
            last = self._it.last
        else:
            return None
        if not bool(last.found_inf > 0):  # the one host read
            return None
        cached = self._last_report
        if cached is not None and cached[0] == all_ranks and cached[1].step == last.index:
            return cached[1]
        return self._build_report(last, all_ranks)

    def _build_report(self, last: LastStep, all_ranks: bool = True) -> OverflowReport:
        entries = self._scan(last.live_optimizers(), all_ranks)
        report = OverflowReport(last.index, float(last.scale), tuple(entries))
        self._last_report = (all_ranks, report)
        return report

    def _scan(self, optimizers: list[Any], all_ranks: bool = True) -> list[Any]:
        """The non-finite gradients of ``optimizers``, on every rank (a gather: collective)
        or this one's."""
        entries = [] if self._shadowing else scan_local(optimizers, self._names, _sync.rank())
        if all_ranks:
            entries = _sync.gather_objects(entries, _sync.resolve_groups(self.process_group))
        return sorted(entries, key=lambda e: (e.rank, e.name))

    # ------------------------------------------------------- getters/setters
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 if disabled). One host read."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return (
            self._init_growth_tracker
            if self._growth_tracker is None
            else int(self._growth_tracker.item())
        )

    def get_growth_factor(self) -> float:
        """The growth factor (a Python float)."""
        return self._config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1). Raises TypeError/ValueError, leaving it unchanged."""
        check_growth_factor(new_factor)
        self._config = dataclasses.replace(self._config, growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor (a Python float)."""
        return self._config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)). Raises TypeError/ValueError, leaving it unchanged."""
        check_backoff_factor(new_factor)
        self._config = dataclasses.replace(self._config, backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval (a Python int)."""
        return self._config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (int >= 1). Raises TypeError/ValueError, leaving it unchanged."""
        check_growth_interval(new_interval)
        self._config = dataclasses.replace(self._config, growth_interval=new_interval)
        # clean steps beyond the new interval: the next clean step grows (the rule's >=)
        last = self._config.growth_interval - 1
        self._init_growth_tracker = min(self._init_growth_tracker, last)
        if self._growth_tracker is not None:
            self._growth_tracker.clamp_(max=min(last, 2**31 - 1))

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    @property
    def config(self) -> ScalerConfig:
        """The (frozen) policy in force."""
        return self._config

    # ----------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python values (safe for ``torch.load(weights_only=True)``).

        Keys: torch's five (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``), then ``min_scale``, ``max_scale``,
        ``hysteresis``, ``consecutive_hysteresis``, ``dynamic``, ``max_consecutive_skips``,
        ``on_collapse``, ``_hysteresis_tracker`` and ``_counters``. Empty if disabled. One host
        read. Call it after :meth:`update` to checkpoint a whole iteration.
        """
        if not self._enabled:
            return {}
        return to_state_dict(self._config, self.metrics())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or from ``torch.amp.GradScaler.state_dict()``.

        The scale, trackers and counters come from the checkpoint; so do torch's policy keys
        (``growth_factor``, ``backoff_factor``, ``growth_interval``, as torch). shardscale's own
        policy fields (bounds, hysteresis, ``dynamic``, the collapse guard) come from the
        checkpoint too, except those the constructor set away from their defaults: those are
        kept (with a warning when the checkpoint differs), so resuming an older checkpoint never
        switches off a guard asked for (a scale outside kept bounds is clamped, with a warning).
        Keys missing from a torch state dict keep this scaler's settings (the hysteresis
        tracker is refilled, counters start at 0). Everything is validated before anything
        changes: on error the scaler is left exactly as it was.

        Raises:
            RuntimeError: empty dict (saved from a disabled scaler), or called mid-iteration.
            TypeError, ValueError: a missing key or a bad value, named in the message.
        """
        if not self._enabled:
            return
        if self._it.started():
            raise RuntimeError(
                "load_state_dict() was called in the middle of an iteration (after unscale_/step, "
                "before update()); load the state at an iteration boundary."
            )
        loaded = parse_state_dict(state_dict, self._config, self._asked)
        fresh = None
        if self._scale is not None:  # the last step that can fail, before anything changes
            fresh = ScaleState.create(
                self._scale.device,
                loaded.scale,
                loaded.growth_tracker,
                loaded.hysteresis_tracker,
                loaded.counters,
            )
        self._config = loaded.config
        self._init_scale, self._init_growth_tracker = loaded.scale, loaded.growth_tracker
        self._init_hysteresis_tracker, self._init_counters = (
            loaded.hysteresis_tracker,
            loaded.counters,
        )
        if fresh is not None:
            self._state().copy_from(fresh)
        self._it.last_scaled = None  # a step before the next scale() is checkpoint plumbing
        self._it.ever_scaled = False
        self._it.floor = loaded.scale

    def __getstate__(self) -> dict[str, Any]:
        if self._it.started():
            raise RuntimeError(
                "A ShardedGradScaler may only be pickled at an iteration boundary (before scale() "
                "or after update())."
            )
        state = self.__dict__.copy()
        if self._enabled and self._scale is not None:
            m = self.metrics()
            state["_init_scale"], state["_init_growth_tracker"] = m["scale"], m["growth_tracker"]
            state["_init_hysteresis_tracker"] = m["hysteresis_tracker"]
            state["_init_counters"] = tuple(m[n] for n in COUNTER_NAMES)
        for key in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_counters", "_alarm"):
            state[key] = None
        state.update(_it=Iteration(), _last_report=None)
        state["process_group"] = None  # process groups cannot be pickled (copies share it)
        state["_names"] = ParamNames()  # ids of this process's parameters: meaningless elsewhere
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = type(self)(state.get("_device", "cpu"), enabled=False).__dict__
        fresh.update({k: v for k, v in state.items() if k in fresh})  # an older pickle: its keys
        if not isinstance(fresh["_names"], ParamNames):  # an older pickle: {id: name}
            fresh["_names"] = ParamNames()
        self.__dict__.update(fresh)

    def __copy__(self) -> ShardedGradScaler:
        """A copy (at an iteration boundary, as pickling) naming the same parameters."""
        new = type(self).__new__(type(self))
        new.__setstate__(self.__getstate__())
        new._names, new.process_group = self._names, self.process_group
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedGradScaler:
        """A deep copy (at an iteration boundary, as pickling). Report names follow the
        parameters copied *before* the scaler in the same ``deepcopy`` call; others keep naming
        the originals."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        new._names = self._names.remapped(memo)
        new.process_group = self.process_group  # a process resource: shared, not copied
        return new

    # ---------------------------------------------------------------- helpers
    def _record(self, name: str, *args: Any) -> None:
        """Note a call that completed, for a rank that joins later (Join): it repeats the calls
        of its last iteration. Nothing is noted while repeating or under ``torch.compile``."""
        if not self._shadowing and not torch.compiler.is_compiling():
            self._it.note_call(name, args)

    def _check_join_order(self) -> None:
        """Inside ``Join``, the model (DDP) must come first: its hook shadows the forward and
        backward collectives, which come before the scaler's."""
        config = self._join_config
        if config.enable and config.is_first_joinable:
            raise RuntimeError(
                "ShardedGradScaler is the first Joinable of a Join: list the model before it, "
                "Join([ddp_model, scaler]) (a joined rank shadows the model's collectives first, "
                "then the scaler's)."
            )

    def _opt_state(self, method: str, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s record of this iteration (created READY), after checking the call."""
        if not _is_optimizer(optimizer):
            raise TypeError(
                f"{method}() takes a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        if self._scale is None:  # an idle rank: no loss to scale since the start (or a resume)
            params = list(iter_params(optimizer))
            self._lazy_init_scale_growth_tracker(params[0].device if params else self._device)
        return self._it.record(optimizer)


class _ScalerJoinHook(JoinHook):
    def __init__(self, scaler: ShardedGradScaler) -> None:
        self.scaler = scaler

    def main_hook(self) -> None:
        self.scaler._shadow_iteration()


def _meshes(optimizer: Any) -> list[Any]:
    """The DeviceMeshes of ``optimizer``'s DTensor parameters (each once)."""
    meshes: dict[int, Any] = {}
    for p in iter_params(optimizer):
        mesh = getattr(p, "device_mesh", None) if type(p) is not torch.nn.Parameter else None
        if mesh is not None:
            meshes.setdefault(id(mesh), mesh)
    return list(meshes.values())


def _first_tensor(outputs: object) -> torch.Tensor:
    """Validate a scale() argument and return its first tensor."""
    first: list[torch.Tensor] = []

    def visit(val: object, depth: int) -> None:
        if isinstance(val, torch.Tensor):
            if not (val.is_floating_point() or val.is_complex()):
                raise TypeError(
                    f"scale() takes floating-point tensors (a loss); got dtype {val.dtype}."
                )
            if val.device.type == "meta":
                raise ValueError(
                    "scale() got a tensor on the meta device (no data); compute the loss with a "
                    "materialized model (module.to_empty(device=...) and initialize it first)."
                )
            first.append(val)
        elif isinstance(val, (list, tuple)) and depth < 64:
            for v in val:
                visit(v, depth + 1)
        else:
            raise TypeError(
                f"scale() takes a tensor or a (nested) list/tuple of tensors; got {type(val).__name__}."
            )

    visit(outputs, 0)
    if not first:
        raise TypeError("scale() got a list/tuple with no tensor in it.")
    return first[0]


__all__ = ["ShardedGradScaler", "OptState"]
