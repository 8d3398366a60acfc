"""``ShardedGradScaler``: a drop-in, shard-aware replacement for ``torch.amp.GradScaler``."""

from __future__ import annotations

import copy
import dataclasses
import logging
import numbers
import warnings
import weakref
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any, overload

import torch

from . import _sync
from ._checkpoint import parse_state_dict, to_state_dict
from ._config import (
    ScalerConfig,
    check_backoff_factor,
    check_growth_factor,
    check_growth_interval,
    check_scale,
)
from ._grads import SharedMemoryGradError, iter_params, unscale_grads_
from ._policy import COUNTER_NAMES, ScaleState, count_step, step_in_place
from ._report import (
    OverflowReport,
    ParamNames,
    collapse_error,
    gather_entries,
    param_names,
    scan_local,
)

logger = logging.getLogger("shardscale")

_ORDER = (
    "scaler.scale(loss).backward() -> [scaler.unscale_(opt)] -> scaler.step(opt) -> scaler.update()"
)


class OptState(Enum):
    """Where one optimizer is in the current iteration (as ``torch.amp.grad_scaler.OptState``)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class _PerOptimizer:
    stage: OptState = OptState.READY
    #: 0-d float32 on the scale's device, agreed across ranks: 1.0 if this step overflowed.
    found_inf: torch.Tensor | None = None
    optimizer: weakref.ref | None = None
    #: set by clip_grad_norm_ for fused optimizers: the grad_scale step() hands to the kernel.
    grad_scale: torch.Tensor | None = None


@dataclasses.dataclass
class _LastStep:
    """What update() remembers of the iteration it closed (for reports and last_step_skipped)."""

    step: torch.Tensor  # 0-d copy of the step counter: read (a host sync) only when reported
    scale: torch.Tensor
    found_inf: torch.Tensor
    optimizers: list[weakref.ref]

    @property
    def index(self) -> int:
        return int(self.step)


class ShardedGradScaler:
    """Dynamic loss scaling for fp16/bf16 training that is correct across shards and ranks.

    The public API and ``state_dict`` keys are those of ``torch.amp.GradScaler`` (and of
    ``torch.distributed.fsdp.ShardedGradScaler``), so swapping the import is enough::

        scaler = ShardedGradScaler()
        for input, target in data:
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            scaler.scale(loss).backward()   # gradients are scaled by S
            scaler.step(optimizer)          # unscale + inf/NaN check + ONE all-reduce; skip or step
            scaler.update()                 # S *= backoff_factor after an overflow, S *= growth_factor
                                            # after growth_interval clean steps (see _policy.py)

    What differs from torch's scalers:

    * **Agreement.** Each optimizer's found_inf flag is all-reduced (MAX) across the process
      group(s) in exactly one collective per ``unscale_`` (torch's ``ShardedGradScaler`` issues
      one per device, and two under FSDP2), so every rank skips the same steps. Fused optimizers
      receive the agreed flag. Works on CPU with gloo (torch's ``.cuda()`` calls do not).
    * **Any gradient.** Plain tensors, FSDP2 DTensor shards (the local shard is unscaled; DTensor's
      own per-bucket all-reduce is not triggered), FSDP1 flat parameters, CPU-offloaded gradients
      next to device ones, fp32/fp16/bf16 and sparse gradients, ranks holding no shard.
    * **Bounded scale** in ``[min_scale, max_scale]``, optional hysteresis (Megatron-LM,
      DeepSpeed), a collapse guard raising :class:`ScaleCollapseError`, skip counters,
      :meth:`metrics`, :meth:`last_step_skipped` and :meth:`overflow_report`.

    Host synchronisation: ``scale``, ``unscale_`` and ``update`` never synchronise with a device
    (except ``update`` with a tensor ``new_scale``). ``step`` synchronises once per optimizer to
    decide whether to call ``optimizer.step()``, except for fused optimizers
    (``Adam/AdamW/SGD(fused=True)``), which receive ``grad_scale``/``found_inf`` tensors and skip
    inside the kernel: zero synchronisations.

    .. note:: Low-precision gradients unscaled in place lose values below the dtype's range (an
       fp16 gradient of 1e-8 becomes 0). With a fused optimizer and no explicit ``unscale_``,
       the unscale is folded into the kernel's fp32 math and such values survive. Otherwise,
       reduce gradients in fp32 (FSDP2 ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``,
       FSDP1 ``MixedPrecision(reduce_dtype=torch.float32)``).

    Args:
        device: kept for compatibility with ``torch.amp.GradScaler``; the scale lives on the
            device of the first tensor given to :meth:`scale`. Default ``"cuda"`` if available,
            else ``"cpu"`` (so a CPU-only machine works with default arguments).
        init_scale: initial loss scale (finite, > 0). Default 2**16.
        growth_factor: > 1. Default 2.0.
        backoff_factor: in (0, 1). Default 0.5.
        growth_interval: clean steps before growth, >= 1. Default 2000.
        enabled: if False every method is a pass-through (``step`` calls ``optimizer.step()``).
        process_group: a ``ProcessGroup``, a ``DeviceMesh`` or a list/tuple of them; the found-inf
            flag is reduced over all of them (one all-reduce per group or mesh dimension). ``None``:
            the default group if ``torch.distributed`` is initialized when ``unscale_`` runs,
            else no communication. Ranks that train *independent* models in one job must pass a
            group of their own (every rank of a group skips together, and ``clip_grad_norm_``
            counts unsharded gradients once, as replicas, from the group's first rank).
        min_scale, max_scale, hysteresis, consecutive_hysteresis, max_consecutive_skips,
        on_collapse, dynamic: the policy beyond torch's, see :class:`ScalerConfig`.
        report_overflows: if True, ``update()`` reads the agreed overflow flag (one host sync
            per iteration) and, on overflowing iterations, builds one :class:`OverflowReport`
            covering every optimizer stepped (one per-parameter scan and one all-gather) and logs
            it as a warning on the ``"shardscale"`` logger.
        param_names: an ``nn.Module`` or ``{name: parameter}`` map used to name parameters in
            reports (see :meth:`set_param_names`).
        rank_local_params: False (default) when the ranks of the process group hold the same
            model, replicated (DDP) or sharded (FSDP): the all-reduce then also checks that
            every rank reduces the flag of an optimizer with the same parameter count, and
            :meth:`clip_grad_norm_` counts plain (unsharded) gradients once, as replicas. True
            when the ranks own *different* parameters, as pipeline-parallel stages do (one
            scale for the whole pipeline, as Megatron-LM reduces found_inf over its
            model-parallel group): the parameter-count check is off (the step counter is still
            checked) and every gradient is summed over ranks in the norm. Pipeline x data
            parallelism: keep the default (world) group so that every rank agrees (with FSDP
            the data-parallel ranks hold different shards and must agree too); its
            ``clip_grad_norm_`` is then right when the data-parallel dimension is FSDP (shards)
            and over-counts with DDP (replicas): there, clip with a norm of your own.

    Raises:
        TypeError, ValueError: a bad argument; the message names it.
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
        self._device = torch.device(device).type
        is_numpy_bool = type(enabled).__module__ == "numpy" and type(enabled).__name__ in (
            "bool_",
            "bool",
        )
        if not (isinstance(enabled, numbers.Integral) or is_numpy_bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}.")
        enabled = bool(enabled)  # as torch.amp.GradScaler: 1, numpy.True_ ... are accepted
        _sync.validate_process_group(process_group)
        bounds = {}
        if min_scale is not None:
            bounds["min_scale"] = min_scale
        if max_scale is not None:
            bounds["max_scale"] = max_scale
        self._config = ScalerConfig(
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
        self._init_scale = check_scale(
            "init_scale", init_scale, self._config.min_scale, self._config.max_scale
        )
        if not isinstance(rank_local_params, bool):
            raise TypeError(f"rank_local_params must be a bool, got {rank_local_params!r}.")
        if not isinstance(report_overflows, bool):
            raise TypeError(f"report_overflows must be a bool, got {report_overflows!r}.")
        self._names = _report_names(param_names)
        self.rank_local_params = rank_local_params
        self._enabled = enabled
        self.process_group = process_group
        self._report_overflows = report_overflows
        self._init_growth_tracker = 0
        self._init_hysteresis_tracker = hysteresis
        self._init_counters: tuple[int, ...] = (0,) * len(COUNTER_NAMES)
        self._state: ScaleState | None = None
        self._per_optimizer: dict[int, _PerOptimizer] = {}
        #: id(param) -> agreed found_inf, for gradients unscaled by clip_grad_norm_(params)
        self._pre_unscaled: dict[int, torch.Tensor] = {}
        # (scale tensor, its version, 1/scale): reused while the scale is not written
        self._inv_cache: tuple[torch.Tensor, int, torch.Tensor] | None = None
        # (process_group, the default group, their resolved groups): see _groups()
        self._groups_cache: tuple[Any, Any, list[Any]] | None = None
        self._skipped: dict[int, torch.Tensor] = {}
        self._last: _LastStep | None = None
        self._last_report: OverflowReport | None = None
        self._pending_collapse: list[tuple[Any, torch.Tensor, _LastStep]] = []

    @classmethod
    def guard(
        cls, process_group: _sync.ProcessGroupLike = None, **kwargs: Any
    ) -> ShardedGradScaler:
        """A scaler for bf16/fp32 training: scale fixed (at 1.0, or ``init_scale`` if given),
        non-finite steps still skipped.

        Every rank skips the same steps (one all-reduce per ``unscale_``) and the reporting
        (:meth:`metrics`, :meth:`overflow_report`) works as in fp16 mode. ``kwargs`` are passed to
        the constructor (e.g. ``max_consecutive_skips``, ``report_overflows``).
        """
        kwargs.setdefault("init_scale", 1.0)
        return cls(process_group=process_group, dynamic=False, **kwargs)

    # ------------------------------------------------------------------ scale
    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[Any]) -> list[Any]: ...

    @overload
    def scale(self, outputs: tuple[Any, ...]) -> tuple[Any, ...]: ...

    def scale(self, outputs: torch.Tensor | list[Any] | tuple[Any, ...]) -> Any:
        """Multiply a loss (or nested lists/tuples of losses) by the current loss scale.

        The scale is created on the device of the first tensor ever scaled (a 0-d float32
        tensor); outputs on other devices get a copy. The result dtype follows torch's type
        promotion, exactly as ``torch.amp.GradScaler``: an fp16 tensor with dimensions stays
        fp16, a 0-d fp16 loss becomes fp32. A NaN/inf loss is not an error: its step is skipped.

        Args:
            outputs: a floating-point tensor, or a list/tuple (possibly nested) of them.

        Returns:
            The same structure with every tensor multiplied by the scale (unchanged if disabled).

        Raises:
            TypeError: anything else (the scaler is left unchanged).
        """
        if not self._enabled:
            return outputs
        first = _first_tensor(outputs)  # validates the whole structure first
        if self._state is None:
            self._lazy_init(first.device)
        assert self._state is not None
        scale = self._state.scale
        if isinstance(outputs, torch.Tensor):
            return outputs * _sync.to_device(scale, outputs.device)
        per_device: dict[torch.device, torch.Tensor] = {}

        def apply(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                s = per_device.get(val.device)
                if s is None:
                    s = per_device[val.device] = _sync.to_device(scale, val.device)
                return val * s
            items = [apply(v) for v in val]
            return type(val)(*items) if hasattr(val, "_fields") else type(val)(items)

        return apply(outputs)

    def _lazy_init(self, device: torch.device) -> None:
        self._state = ScaleState.create(
            device,
            self._init_scale,
            self._init_growth_tracker,
            self._init_hysteresis_tracker,
            self._init_counters,
        )

    # ---------------------------------------------------------------- unscale
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ("unscale") ``optimizer``'s gradients by the scale and agree on found_inf.

        Optional: :meth:`step` unscales by itself. Call it to inspect or clip unscaled gradients.
        One fused unscale+check kernel per (device, dtype) of local gradients (DTensor grads:
        their local shard), then exactly one all-reduce (MAX) of a 0-d flag per process group,
        waited on before returning. No host synchronisation with NCCL.

        Raises:
            RuntimeError: called before :meth:`scale`, twice for this optimizer in one iteration,
                or after :meth:`step`.
            TypeError: ``optimizer`` is not an optimizer.
            ValueError: a gradient's elements share memory (an expanded view: give the parameter
                a gradient of its own); raised, naming the parameter, before anything is written.
        """
        if not self._enabled:
            return
        st = self._require_stage("unscale_", optimizer)
        if st.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(); "
                f"call it at most once per optimizer per iteration: {_ORDER}."
            )
        if st.stage is OptState.STEPPED:
            raise RuntimeError(
                f"unscale_() is being called after step() for this optimizer; the order is {_ORDER}."
            )
        st.found_inf = self._check(optimizer, self._inv_scale())
        st.stage = OptState.UNSCALED

    def _inv_scale(self) -> torch.Tensor:
        """``1/scale`` (0-d float32, on the scale's device), recomputed only after the scale
        tensor was written (its version counter moved): the scale changes only on a growth or a
        backoff. Callers only read it."""
        assert self._state is not None
        scale = self._state.scale
        cached = self._inv_cache
        if cached is not None and cached[0] is scale and cached[1] == scale._version:
            return cached[2]
        if scale.device.type == "mps":
            inv = scale.reciprocal()
        else:  # float64 reciprocal, as torch.amp.GradScaler: fp32 division can be imprecise.
            inv = scale.double().reciprocal().float()
        self._inv_cache = (scale, scale._version, inv)
        return inv

    def _groups(self) -> list[Any]:
        """:func:`_sync.resolve_groups` of ``self.process_group``: cached while it and the default
        group are the same objects (``dist.get_world_size`` per group costs ~20 us per call right
        after a backward pass). A list or tuple is resolved every time: a list may change."""
        pg = self.process_group
        world = _sync.default_group() if pg is None else None
        cached = self._groups_cache
        if cached is not None and cached[0] is pg and cached[1] is world:
            return cached[2]
        groups = _sync.resolve_groups(pg)
        self._groups_cache = None if isinstance(pg, (list, tuple)) else (pg, world, groups)
        return groups

    def _check(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """Local unscale/check, then the single all-reduce. Returns the agreed 0-d flag.

        The all-reduce carries ``[found_inf, step, -step, n, -n]`` (``step``: update() calls so
        far; ``n``: the optimizer's parameter count): after MAX, ``step_max != -(-step)_max``
        means the ranks' scalers are out of step, and ``n_max != -(-n)_max`` that the ranks
        reduce the flags of different optimizers (e.g. ``unscale_`` called in another order);
        either raises a RuntimeError when the result is on the CPU (no host sync). On error the
        optimizer's iteration stage is left as it was.
        """
        assert self._state is not None
        try:
            home = self._state.scale.device
            pre = self._pre_unscaled
            try:
                flags = unscale_grads_(optimizer, inv_scale, skip=pre)
            except SharedMemoryGradError as e:
                raise e.naming(self._names.current(), optimizer) from None
            local = _combine_flags(flags, home)
            if pre:  # gradients a clip_grad_norm_(params) already unscaled: their agreed flags
                for flag in (pre[id(p)] for p in iter_params(optimizer) if id(p) in pre):
                    local = torch.maximum(local, flag)
            groups = self._groups()
            if not groups:
                return local
            step = (self._state.counters[0] % 2**24).to(torch.float32)
            # which optimizer this is, in a form every rank agrees on: its parameter count
            # (not comparable when the ranks own different parameters: pipeline stages)
            count = 0 if self.rank_local_params else _sync.num_params(optimizer) % 2**24
            n = torch.full((), float(count), device=home)
            agreed = _sync.all_reduce(torch.stack([local, step, -step, n, -n]), groups)
            if agreed.device.type == "cpu":
                _sync.check_agreement(agreed, self._state.counters, optimizer)
            return agreed[0]
        except BaseException:
            st = self._per_optimizer.get(id(optimizer))
            if st is not None and st.stage is OptState.READY and st.found_inf is None:
                del self._per_optimizer[id(optimizer)]  # a failed call does not start an iteration
            raise

    # ------------------------------------------------------------------- step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` was called), then step ``optimizer`` unless any rank
        found inf/NaN in its gradients.

        Non-fused optimizers: one host synchronisation reads the agreed flag; ``optimizer.step``
        is called only when it is 0. Fused optimizers (``_step_supports_amp_scaling``, e.g.
        ``AdamW(fused=True)``): ``optimizer.step`` is always called with ``optimizer.grad_scale``
        (the scale, so the kernel unscales in fp32; None if :meth:`unscale_` already did) and
        ``optimizer.found_inf`` (the agreed 0-d flag; the kernel skips when it is 1): no sync.
        Use :meth:`last_step_skipped` to know whether the step was skipped.

        Returns:
            What ``optimizer.step(*args, **kwargs)`` returned; None if a non-fused step was
            skipped (a fused optimizer is always called and skips inside its kernel).

        Raises:
            RuntimeError: called before :meth:`scale`, twice for this optimizer in one
                iteration, or with a ``closure`` (not supported, as in torch).
            ValueError: as :meth:`unscale_` (a gradient sharing memory), before anything is
                written or stepped.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported if ShardedGradScaler is enabled.")
        st = self._require_stage("step", optimizer)
        if st.stage is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called on this optimizer since the last update(); "
                f"the order is {_ORDER}, with update() once per iteration."
            )
        assert self._state is not None
        retval = None
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if fused and st.stage is OptState.READY and self._pre_unscaled:
            if any(id(p) in self._pre_unscaled for p in iter_params(optimizer)):
                self.unscale_(optimizer)  # part is unscaled already: unscale the rest in place
        if fused:
            if st.stage is OptState.READY:
                st.found_inf = self._check(optimizer, None)  # check only: the kernel unscales
                user_scale = getattr(optimizer, "grad_scale", None)
                grad_scale = (
                    self._state.scale if user_scale is None else self._state.scale * user_scale
                )
            elif st.grad_scale is not None:
                grad_scale = st.grad_scale  # decided by clip_grad_norm_ (unscale and clip folded)
            else:
                grad_scale = getattr(optimizer, "grad_scale", None)
            assert st.found_inf is not None
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = st.found_inf  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            skipped = st.found_inf > 0
        else:
            if st.stage is OptState.READY:
                self.unscale_(optimizer)
            assert st.found_inf is not None
            overflow = bool(st.found_inf.item())  # the one host sync of a non-fused step
            if not overflow:
                retval = optimizer.step(*args, **kwargs)
            skipped = torch.tensor(overflow, device="cpu")
        st.stage = OptState.STEPPED
        self._skipped[id(optimizer)] = skipped
        return retval

    # ----------------------------------------------------------------- update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the loss scale after every optimizer of the iteration has stepped.

        Without ``new_scale`` the policy of :class:`ScalerConfig` runs on the device (no host
        sync): back off after an overflow on any rank (after ``hysteresis`` of them), grow after
        ``growth_interval`` clean steps, stay inside ``[min_scale, max_scale]``. All optimizers'
        agreed flags are combined once. With ``new_scale`` (a float, or a 1-element tensor on any
        device, read with one host sync) the scale is set to it; trackers are kept, as in torch;
        the iteration is still counted (``metrics()``, ``last_step_skipped()``,
        ``overflow_report()``), and the collapse guard does not run (the caller chose the scale).

        Raises:
            RuntimeError: no :meth:`step`/:meth:`unscale_`/``clip_grad_norm_`` since the last
                update (nothing to update from), or called before :meth:`scale`. (When only
                ``clip_grad_norm_(params)`` ran, its flags are the iteration's inf checks, as
                torch counts ``unscale_`` without ``step``; otherwise they count through the
                optimizers that own those parameters when these step or unscale in the same
                iteration: an overflow in parameters whose optimizer is not stepped then, or
                that no optimizer holds, does not back off the scale.)
            TypeError, ValueError: a bad ``new_scale`` (not a finite value in the bounds).
            ScaleCollapseError: the scale collapsed and ``on_collapse="raise"`` (the update has
                been applied and the scaler is ready for the next iteration).
        """
        if not self._enabled:
            return
        if self._state is None:
            raise RuntimeError(f"update() was called before scale(); the order is {_ORDER}.")
        value = None if new_scale is None else self._check_new_scale(new_scale)  # validate first
        stepped = [st for st in self._per_optimizer.values() if st.found_inf is not None]
        # the inf checks recorded this iteration: each stepped/unscaled optimizer's agreed flag
        # (which includes the flags of its parameters clipped by clip_grad_norm_(params)), or,
        # when only clip_grad_norm_(params) ran, those flags (as torch's update() after
        # unscale_() without step(): the checks made are what counts)
        flags: list[torch.Tensor] = [st.found_inf for st in stepped]  # type: ignore[misc]
        if not flags:
            flags = list({id(f): f for f in self._pre_unscaled.values()}.values())
        if not flags and value is None:
            raise RuntimeError(
                "update() was called but no optimizer was stepped or unscaled since the last "
                f"update(); the order is {_ORDER}."
            )
        last = None
        if flags:
            found_inf = flags[0]
            for flag in flags[1:]:
                found_inf = found_inf + flag
            last = _LastStep(
                step=self._state.counters[0].clone(),  # no host sync in update()
                scale=self._state.scale.clone(),
                found_inf=found_inf,
                optimizers=[st.optimizer for st in stepped if st.optimizer is not None],
            )
        collapsed = None
        if value is not None:
            # the user sets the scale (trackers kept, as torch); the iteration is still counted
            # (steps, skips, overflows, last_step_skipped, reports), the collapse guard not run
            if last is not None:
                count_step(self._state, last.found_inf, value)
            self._state.scale.fill_(value)
        else:
            assert last is not None
            collapsed = step_in_place(self._state, last.found_inf, self._config)
        if last is not None:
            self._last = last
        self._per_optimizer = {}
        self._pre_unscaled = {}
        self._last_report = None  # a mid-iteration report may miss optimizers stepped later
        if last is not None and self._report_overflows and bool(last.found_inf > 0):
            live = [o for o in (ref() for ref in last.optimizers) if o is not None]
            logger.warning("%s", self._build_report(live, last.scale, last.index))
        if collapsed is not None:
            assert last is not None
            self._handle_collapse(collapsed, last)

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

    # --------------------------------------------------------- collapse guard
    def _handle_collapse(self, collapsed: torch.Tensor, last: _LastStep) -> None:
        """Raise/warn on collapse without a host sync on accelerators (checked one step late)."""
        if collapsed.device.type == "cpu":
            if bool(collapsed):  # every rank sees it at this same update: gather the report
                self._collapse(last, gather=True)
            return
        ready, waiting = [], []
        for pending in self._pending_collapse:  # no tuple equality: it would compare tensors
            (ready if pending[0] is None or pending[0].query() else waiting).append(pending)
        self._pending_collapse = waiting
        host = collapsed.to("cpu", non_blocking=True)
        event = None
        try:
            event = torch.Event(device=collapsed.device)  # type: ignore[attr-defined,call-arg]
            event.record()
        except (AttributeError, RuntimeError, TypeError):
            host = collapsed.cpu()  # no event support: read now
        if event is None:
            ready.append((None, host, last))
        else:
            self._pending_collapse.append((event, host, last))
        for _, flag, step in ready:
            if bool(flag):
                self._collapse(step)

    def _collapse(self, last: _LastStep, gather: bool = False) -> None:
        optimizers = [o for o in (ref() for ref in last.optimizers) if o is not None]
        entries = scan_local(optimizers, self._names, _sync.rank())
        if gather:  # collective: only where every rank detects the collapse at the same update
            entries = gather_entries(entries, self._groups())
        error = collapse_error(self._config, last.index, float(last.scale), entries, _sync.rank())
        if self._config.on_collapse == "raise":
            raise error
        warnings.warn(str(error), RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------- clipping
    def clip_grad_norm_(
        self,
        optimizer_or_params: torch.optim.Optimizer | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Unscale, compute the global gradient norm across shards and ranks, and clip.

        See :func:`shardscale._clip.clip_grad_norm_` for the algorithm, the collectives and the
        errors raised.
        """
        from ._clip import clip_grad_norm_

        try:
            return clip_grad_norm_(self, optimizer_or_params, max_norm, norm_type)
        except SharedMemoryGradError as e:  # raised before any write, with its parameter
            optimizer = (
                optimizer_or_params if hasattr(optimizer_or_params, "param_groups") else None
            )
            raise e.naming(self._names.current(), optimizer) from None

    # ------------------------------------------------------------- reporting
    def last_step_skipped(self, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """Whether the last step of ``optimizer`` (or of any optimizer, for None) was skipped.

        Returns:
            A 0-d bool tensor. Reading it as a Python bool synchronises the host when it lives on
            an accelerator (fused optimizers); for non-fused optimizers it is a CPU tensor already
            known to the host. To skip an LR scheduler on skipped steps::

                scaler.step(optimizer); scaler.update()
                if not scaler.last_step_skipped(optimizer):
                    scheduler.step()

        Raises:
            RuntimeError: no step has been taken yet (for this optimizer).
        """
        if not self._enabled:
            # a disabled scaler never skips: the loop stays the same
            return torch.tensor(False, device="cpu")
        if optimizer is not None:
            flag = self._skipped.get(id(optimizer))
            if flag is None:
                raise RuntimeError("last_step_skipped(): this optimizer has not been stepped yet.")
            return flag
        if self._last is None:
            raise RuntimeError("last_step_skipped(): update() has not been called yet.")
        return self._last.found_inf > 0

    def metrics(self) -> dict[str, float | int]:
        """Plain numbers for loggers: ``scale``, ``growth_tracker``, ``hysteresis_tracker``,
        ``steps``, ``skipped_steps``, ``consecutive_skips``, ``overflows``, ``backoffs``,
        ``growths`` (see :class:`ScaleState`) and ``last_step_skipped`` (0/1). One host sync.
        A disabled scaler returns the same keys: scale 1.0 and zeros (nothing is counted)."""
        if not self._enabled:  # the same keys (a logging loop must not depend on enabled)
            return {
                "scale": 1.0,
                "growth_tracker": 0,
                "hysteresis_tracker": 0,
                **dict.fromkeys(COUNTER_NAMES, 0),
                "last_step_skipped": 0,
            }
        if self._state is None:
            values = [
                self._init_scale,
                self._init_growth_tracker,
                self._init_hysteresis_tracker,
                *self._init_counters,
            ]
        else:
            s = self._state
            last = (
                self._last.found_inf
                if self._last is not None
                else torch.zeros((), device=s.scale.device)
            )
            packed = torch.cat(
                [
                    s.scale.double().reshape(1),
                    s.growth_tracker.double().reshape(1),
                    s.hysteresis_tracker.double().reshape(1),
                    s.counters.double(),
                    last.to(s.scale.device).double().reshape(1),
                ]
            )
            values = packed.tolist()  # the one host sync
        out: dict[str, float | int] = {"scale": float(values[0])}
        out["growth_tracker"] = int(values[1])
        out["hysteresis_tracker"] = int(values[2])
        for i, name in enumerate(COUNTER_NAMES):
            out[name] = int(values[3 + i])
        out["last_step_skipped"] = int(len(values) > 3 + len(COUNTER_NAMES) and values[-1] > 0)
        return out

    def set_param_names(self, source: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Name parameters in overflow reports, from a module or a ``{name: parameter}`` map.

        With FSDP1 (``use_orig_params=False``) the optimizer sees flat parameters, named after
        the ``_flat_param`` attributes. From a module, the submodules are recorded now and
        asked for their parameters when a report is built (parameters replaced since are
        named; a freed model names nothing; parameters registered later are not: call this
        again); from a map, names are kept by parameter identity.
        ``copy.deepcopy`` of the scaler after its model in the same call follows the copied
        model; pickling (e.g. ``torch.save(scaler)``) drops them: call this again after loading.
        """
        self._names = _report_names(source)

    def overflow_report(self) -> OverflowReport | None:
        """Where the non-finite gradients of the last stepped iteration were, on every rank.

        Collective: every rank of the process group(s) must call it (all-gather of the entries).
        Call it after :meth:`step`/:meth:`update` and before ``zero_grad()`` (it scans the
        gradients). Costs nothing extra on clean steps: returns None without scanning when the
        last iteration did not overflow (one host sync to know).

        Returns:
            An :class:`OverflowReport`, or None if the last iteration was clean.
        """
        if any(st.found_inf is not None for st in self._per_optimizer.values()):
            optimizers = [
                o
                for o in (
                    st.optimizer()
                    for st in self._per_optimizer.values()
                    if st.optimizer and st.found_inf is not None
                )
                if o is not None
            ]
            flags = [
                st.found_inf for st in self._per_optimizer.values() if st.found_inf is not None
            ]
            index = self._step_index()
            assert self._state is not None
            scale = self._state.scale
        elif self._last is not None:
            optimizers = [o for o in (r() for r in self._last.optimizers) if o is not None]
            flags = [self._last.found_inf]
            index, scale = self._last.index, self._last.scale
        else:
            return None
        if not bool(torch.stack([f.reshape(()) for f in flags]).amax() > 0):  # one host sync
            return None
        if self._last_report is not None and self._last_report.step == index:
            return self._last_report
        return self._build_report(optimizers, scale, index)

    def _build_report(
        self, optimizers: list[torch.optim.Optimizer], scale: torch.Tensor, index: int
    ) -> OverflowReport:
        entries = scan_local(optimizers, self._names, _sync.rank())
        entries = gather_entries(entries, self._groups())
        self._last_report = OverflowReport(index, float(scale), tuple(entries))
        return self._last_report

    def _step_index(self) -> int:
        if self._state is None:
            return self._init_counters[0]
        return int(self._state.counters[0])

    # ------------------------------------------------------- getters/setters
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 if disabled). Synchronises the host."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._state is None else float(self._state.scale.item())

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor without a sync (None before the first :meth:`scale`), as torch."""
        return None if self._state is None else self._state.scale

    @property
    def _scale(self) -> torch.Tensor | None:
        """The 0-d float32 scale tensor (None before the first :meth:`scale`), under the private
        name some libraries read from ``torch.amp.GradScaler``. Read-only."""
        return self._get_scale_async()

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        """The 0-d int32 growth tracker tensor (None before the first :meth:`scale`), as torch's
        private attribute. Read-only."""
        return None if self._state is None else self._state.growth_tracker

    def _get_growth_tracker(self) -> int:
        """The growth tracker as a Python int (0 if disabled), as torch's private method.
        Synchronises the host."""
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._state is None else int(self._state.growth_tracker)

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
        ``on_collapse``, ``_hysteresis_tracker`` and ``_counters`` (a dict of the counters of
        :meth:`metrics`). Empty if disabled. One host sync. Call it after :meth:`update` to
        checkpoint a whole iteration (mid-iteration it holds the state before the update).
        """
        if not self._enabled:
            return {}
        return to_state_dict(self._config, self.metrics())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or from ``torch.amp.GradScaler.state_dict()``.

        Keys missing from a torch state dict keep this scaler's settings (the hysteresis
        tracker is refilled, counters start at 0). Everything is validated before anything
        changes: on error the scaler is left exactly as it was.

        Raises:
            RuntimeError: empty dict (saved from a disabled scaler), or called between
                ``unscale_``/``step`` and ``update`` (load at an iteration boundary).
            TypeError, ValueError: a missing key or a bad value, named in the message.
        """
        if not self._enabled:
            return
        if self._per_optimizer or self._pre_unscaled:
            raise RuntimeError(
                "load_state_dict() was called in the middle of an iteration (after unscale_/step, "
                "before update()); load the state at an iteration boundary."
            )
        loaded = parse_state_dict(state_dict, self._config)
        # build the new tensors (the last step that could fail) before changing anything
        fresh = ScaleState.create(
            self._state.scale.device if self._state is not None else torch.device("cpu"),
            loaded.scale,
            loaded.growth_tracker,
            loaded.hysteresis_tracker,
            loaded.counters,
        )
        # validated: now mutate
        self._config = loaded.config
        self._init_scale, self._init_growth_tracker = loaded.scale, loaded.growth_tracker
        self._init_hysteresis_tracker = loaded.hysteresis_tracker
        self._init_counters = loaded.counters
        if self._state is not None:
            self._state.copy_from(fresh)

    def __getstate__(self) -> dict[str, Any]:
        if self._per_optimizer or self._pre_unscaled:
            raise RuntimeError(
                "A ShardedGradScaler may only be pickled at an iteration boundary (before scale() "
                "or after update())."
            )
        state = self.__dict__.copy()
        if self._enabled and self._state is not None:
            sd = self.state_dict()
            state["_init_scale"] = sd["scale"]
            state["_init_growth_tracker"] = sd["_growth_tracker"]
            state["_init_hysteresis_tracker"] = sd["_hysteresis_tracker"]
            state["_init_counters"] = tuple(sd["_counters"][n] for n in COUNTER_NAMES)
        for key in ("_state", "_last", "_last_report"):
            state[key] = None
        state["_per_optimizer"], state["_skipped"], state["_pending_collapse"] = {}, {}, []
        state["_pre_unscaled"] = {}
        state["_inv_cache"] = state["_groups_cache"] = None
        state["process_group"] = None  # process groups cannot be pickled (copies share it)
        # report names are ids of this process's parameters: pickling drops them (call
        # set_param_names after loading); __copy__/__deepcopy__ keep or remap them
        state["_names"] = ParamNames()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # attributes added after a scaler may have been pickled get their defaults
        self.__dict__.update(
            {
                "rank_local_params": False,
                "_names": ParamNames(),
                "_report_overflows": False,
                "_state": None,
                "_per_optimizer": {},
                "_pre_unscaled": {},
                "_inv_cache": None,
                "_groups_cache": None,
                "_skipped": {},
                "_last": None,
                "_last_report": None,
                "_pending_collapse": [],
            }
        )
        self.__dict__.update(state)
        if not isinstance(self._names, ParamNames):  # an older pickle: {id: name}, meaningless
            self._names = ParamNames()

    def __copy__(self) -> ShardedGradScaler:
        """A copy (at an iteration boundary, as pickling) naming the same parameters."""
        new = type(self).__new__(type(self))
        new.__setstate__(self.__getstate__())
        new._names = self._names
        new.process_group = self.process_group  # a process resource: shared, not copied
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedGradScaler:
        """A deep copy (at an iteration boundary, as pickling). Report names follow the
        parameters copied *before* the scaler in the same ``deepcopy`` call (e.g.
        ``copy.deepcopy((model, opt, scaler))``); others keep naming the originals (copied
        alone, the copy serves the same model). Otherwise call :meth:`set_param_names`."""
        state = self.__getstate__()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(state, memo))
        new._names = self._names.remapped(memo)
        new.process_group = self.process_group  # a process resource: shared, not copied
        return new

    # ---------------------------------------------------------------- helpers
    def _require_stage(self, method: str, optimizer: torch.optim.Optimizer) -> _PerOptimizer:
        if not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
            raise TypeError(
                f"{method}() takes a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        if self._state is None:
            raise RuntimeError(f"{method}() was called before scale(): the order is {_ORDER}.")
        st = self._per_optimizer.get(id(optimizer))
        if st is None:
            st = self._per_optimizer[id(optimizer)] = _PerOptimizer(
                optimizer=weakref.ref(optimizer)
            )
        return st


def _report_names(source: torch.nn.Module | Mapping[str, torch.Tensor] | None) -> ParamNames:
    return param_names(source)


def _combine_flags(flags: dict[torch.device, torch.Tensor], home: torch.device) -> torch.Tensor:
    """MAX of per-device 0-d flags as one 0-d float32 tensor on ``home`` (no host sync)."""
    if len(flags) == 1 and home in flags:
        return flags[home]  # the common case: one device, the scale's
    local = torch.zeros((), dtype=torch.float32, device=home)
    for flag in flags.values():
        local = torch.maximum(local, _sync.to_device(flag, home))
    return local


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
                "scale() takes a tensor or a (nested) list/tuple of tensors; got "
                f"{type(val).__name__}."
            )

    visit(outputs, 0)
    if not first:
        raise TypeError("scale() got a list/tuple with no tensor in it.")
    return first[0]


__all__ = ["ShardedGradScaler", "OptState"]
