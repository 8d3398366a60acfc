"""``ShardedGradScaler``: a ``torch.amp.GradScaler`` that is correct across shards and ranks.

The facade: each public method names its steps and delegates to the room of each concern:
``_config`` arguments, ``_policy`` the rule and the scale state (``_headroom``: the measured
rule), ``_grads`` the local check, ``_sync`` the collectives, ``_checking`` one optimizer's
check (local check -> agreement -> record), ``_stepping`` the step of each kind of optimizer,
``_clip`` / ``_clipping`` the clip and its place in the iteration, ``_iteration`` the record,
``_alarm`` what the device noticed, ``_report`` reports, ``_numerics`` numerics,
``_checkpoint`` state dicts and pickling, ``_join`` Join, ``_protocol`` torch's internals."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, overload

import torch
from torch.amp.grad_scaler import OptState
from torch.distributed.algorithms.join import Joinable

from . import _checkpoint, _clip, _grads, _headroom, _join, _numerics, _sync
from ._alarm import POLL_EVERY, Alarm, Schedule
from ._checking import Checking
from ._clipping import Clipping
from ._config import ScalerConfig, check_device, check_flag, check_new_scale, guard_kwargs, settings
from ._iteration import ORDER, Iteration, LastStep
from ._numerics import Numerics
from ._policy import HostBounds, LossScale, Numbers, step_
from ._protocol import TorchInternals, is_optimizer, step_kind
from ._report import OverflowReport, Reporter, name_params
from ._stepping import Stepping

__all__ = ["ShardedGradScaler", "OptState", "POLL_EVERY"]


class ShardedGradScaler(
    Checking,
    Stepping,
    Clipping,
    TorchInternals,
    _checkpoint.Picklable,
    _join.JoinableScaler,
    torch.amp.GradScaler,
    Joinable,
):
    """Dynamic loss scaling for fp16/bf16 training, correct across shards and ranks.

    A ``torch.amp.GradScaler`` by type and by protocol (public API, ``state_dict`` keys, the
    private state frameworks and ``grad_scaler=`` optimizers read): swapping the import is
    enough. What differs from torch's scalers:

    * **Agreement.** Each optimizer's found-inf flag is all-reduced (MAX) in exactly one
      collective per ``unscale_`` (one per mesh dimension for a DeviceMesh), so every rank skips
      the same steps; fused optimizers receive the agreed flag. The same all-reduce carries the
      step count, the check's ordinal, the loss scale and the policy: ranks that call the
      scaler differently, or were built or restored differently, get an error naming what
      differs instead of diverging; a rank that stops calling it, one naming the call.
    * **Any gradient.** Plain, FSDP2 DTensor shards (the local shard is unscaled), FSDP1 flat
      parameters, CPU-offloaded next to device ones, fp32/fp16/bf16, sparse, ranks holding no
      shard. The kernel is torch's on every device.
    * **Bounded scale** in ``[min_scale, max_scale]``, hysteresis (Megatron-LM, DeepSpeed), a
      collapse guard raising :class:`ScaleCollapseError`, :meth:`metrics`,
      :meth:`last_step_skipped`, :meth:`overflow_report`, :meth:`clip_grad_norm_` (one read
      pass, one all-reduce).

    Host reads: one per non-fused ``step`` (does it step?), none with fused optimizers, and a
    read of the alarm (collapse guard, rank agreement) after a step read an overflow and every
    ``POLL_EVERY`` (16) updates of fused steps. Costs per call: ``docs/compile.md``.

    .. note:: fp16 gradients unscaled in place lose values below fp16's range; a fused
       optimizer without ``unscale_`` unscales in its fp32 math and keeps them. Otherwise reduce
       gradients in fp32 (FSDP2 ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``).

    Args:
        device: as ``torch.amp.GradScaler``'s; the scale lives on the device of the first tensor
            given to :meth:`scale`. Default ``"cuda"`` if available, else ``"cpu"``.
        init_scale: initial loss scale (finite, > 0). Default 2**16, clamped into the bounds.
        growth_factor: > 1. Default 2.0.
        backoff_factor: in (0, 1). Default 0.5.
        growth_interval: clean steps before growth, >= 1. Default 2000.
        enabled: if False every method is a pass-through (``step`` calls ``optimizer.step()``).
        process_group: a ``ProcessGroup``, a ``DeviceMesh`` or a list/tuple of them; the flag is
            reduced over all of them. ``None``: the default group if ``torch.distributed`` is
            initialized when ``unscale_`` runs, else no communication.
        min_scale, max_scale, hysteresis, consecutive_hysteresis, max_consecutive_skips,
        on_collapse, dynamic: the policy beyond torch's, see :class:`ScalerConfig`.
        policy, headroom_margin, headroom_history, measure_every: ``policy="headroom"`` sets the
            scale from the measured gradient amax, agreed in the same all-reduce
            (:class:`ScalerConfig`, ``docs/headroom.md``); ``"torch"`` is torch's rule, bit
            for bit. ``None`` (default): ``"torch"``, or the policy of a checkpoint loaded
            later; a policy named here is kept over a checkpoint's.
        report_overflows: if True, ``update()`` reads the agreed flag (one host read per
            iteration) and logs every rank's :class:`OverflowReport` once (on rank 0) as a
            warning on the ``"shardscale"`` logger after each overflowing iteration (one scan
            and one all-gather then).
        param_names: an ``nn.Module`` or ``{name: parameter}`` map naming parameters in reports.
        rank_local_params: True when the ranks hold *different* parameters (pipeline stages):
            :meth:`clip_grad_norm_` sums every gradient over ranks. False (default) for
            replicated (DDP) or sharded (FSDP) models.

    Raises:
        TypeError, ValueError: a bad argument; the message names it. Nothing is half-built.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float | None = None,
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
        policy: str | None = None,
        headroom_margin: float = 3.0,
        headroom_history: int = 50,
        measure_every: int = 1,
        report_overflows: bool = False,
        param_names: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
        rank_local_params: bool = False,
    ) -> None:
        args = settings(
            device, init_scale, enabled, report_overflows, rank_local_params,
            growth_factor=growth_factor, backoff_factor=backoff_factor,
            growth_interval=growth_interval, hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis, on_collapse=on_collapse,
            max_consecutive_skips=max_consecutive_skips, dynamic=dynamic,
            min_scale=min_scale, max_scale=max_scale, policy=policy,
            headroom_margin=headroom_margin, headroom_history=headroom_history,
            measure_every=measure_every,
        )  # fmt: skip
        _sync.validate_process_group(process_group)
        names = name_params(param_names)
        # Validated. torch's GradScaler.__init__ is not called (with device="cuda" on a machine
        # without CUDA it disables the scaler): every attribute it sets is here or in _protocol.
        self._device, self._enabled, self._config = args.device_type, args.enabled, args.config
        self._loss_scale = LossScale(Numbers(args.init_scale, 0, args.config.hysteresis))
        self._bounds = HostBounds.at(args.init_scale)  # what the host knows of the scale
        self._headroom = _headroom.Headroom()  # policy="headroom": history, the iteration's amax
        self._alarm: Alarm | None = None  # what the device noticed, for the host to read
        self._schedule = Schedule()  # when the host reads the alarm
        self._it = Iteration()  # the record of this iteration and of the last one
        self._calls = _join.CallLog()  # the last iteration's calls (Join)
        self._reporter = Reporter(names)
        self._call = "the scaler"  # the call in progress, named by a collective that fails
        #: the next agreement is the first since the scaler was made or loaded: its mismatch
        #: bit is read at once (ranks built or restored differently raise on every rank there)
        self._verify = True
        self.process_group = process_group
        self.rank_local_params = args.rank_local_params
        self._report_overflows = args.report_overflows
        #: policy fields set away from their defaults, kept over a checkpoint's (dynamic: always)
        named = ("dynamic", "policy") if policy else ("dynamic",)
        self._asked = _checkpoint.asked(args.config, named=named)
        Joinable.__init__(self)

    @classmethod
    def guard(
        cls, process_group: _sync.ProcessGroupLike = None, **kwargs: Any
    ) -> ShardedGradScaler:
        """A scaler for bf16/fp32 training: the scale fixed (at 1.0, or ``init_scale`` if
        given), non-finite steps still skipped on every rank, reports as in fp16 mode. ``kwargs``
        go to the constructor (e.g. ``max_consecutive_skips``, ``report_overflows``)."""
        return cls(process_group=process_group, **guard_kwargs(kwargs))

    @property
    def _names(self) -> Any:
        return self._reporter.names

    def _placed(self, state: Any) -> None:
        self._alarm = Alarm(state.scale.device)

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
        first = _grads.first_tensor(outputs)  # validates the whole structure first
        self._lazy_init_scale_growth_tracker(first.device)
        self._it.scaled()
        return _grads.times(outputs, self._loss_scale.tensors.scale)

    # ---------------------------------------------------------------- unscale
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ("unscale") ``optimizer``'s gradients by the scale and agree on found_inf.

        Optional: :meth:`step` unscales by itself. One ``_amp_foreach_non_finite_check_and_
        unscale_`` per (device, dtype) of local gradients (DTensor grads: their local shard),
        then exactly one all-reduce (MAX) of the flag per process group. No host read.

        Raises:
            RuntimeError: called twice for this optimizer in one backward pass, or after
                :meth:`step`; gradients no rank scaled, or added to unscaled ones (both named).
            TypeError: ``optimizer`` is not an optimizer.
            ValueError: a gradient's elements share memory (an expanded view), named, before
                anything is written.
        """
        if not self._enabled:
            return
        self._unscale(optimizer, self._begin("unscale_", optimizer))
        self._calls.note("unscale_", optimizer)

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
        whose class's ``step`` takes ``grad_scaler=`` (even wrapped) gets ``grad_scaler=self``
        (with torch's ``FutureWarning``) and unscales itself. :meth:`last_step_skipped` tells
        whether the step was skipped.

        Returns:
            What ``optimizer.step(*args, **kwargs)`` returned; None if a non-fused step was
            skipped.

        Raises:
            RuntimeError: twice for this optimizer in one iteration, with a ``closure`` (as
                torch), when the ranks disagree (another step, another check), or as
                :meth:`unscale_`; ValueError: as :meth:`unscale_` (nothing written or stepped).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported if ShardedGradScaler is enabled.")
        state = self._begin("step", optimizer)
        if state["stage"] is OptState.STEPPED:
            self._fail(
                1,
                "step() has already been called on this optimizer since the last update(); "
                f"the order is {ORDER}, with update() once per iteration.",
            )
        kind = step_kind(optimizer)
        if kind == "plain":
            if state["stage"] is OptState.READY:
                self._unscale(optimizer, state)
            elif state.get("grad_scale") is not None:  # a clip folded for a fused inner optimizer
                self._unscale_grads_(
                    optimizer,
                    _grads.inv_scale(state.pop("grad_scale"), self._loss_scale.math),
                    None,
                )
            retval = self._plain_step(optimizer, state, args, kwargs)
        elif kind == "grad_scaler":
            retval = self._grad_scaler_step(optimizer, state, args, kwargs)
        else:
            retval = self._fused_step(optimizer, state, args, kwargs)
        self._calls.note("step", optimizer)
        return retval

    # ----------------------------------------------------------------- update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the loss scale after every optimizer of the iteration has stepped.

        Without ``new_scale`` the policy of :class:`ScalerConfig` runs on the device
        (:func:`next_state`, no host read): back off after an overflow on any rank (after
        ``hysteresis`` of them), grow after ``growth_interval`` clean steps, stay inside
        ``[min_scale, max_scale]``. All optimizers' agreed flags are summed once. With
        ``new_scale`` (a float, or a 1-element tensor, read once) the scale is set to it and the
        trackers kept, as torch; the iteration is still counted, the collapse guard not run.

        The alarm (collapse guard, rank agreement) is read after a step read an overflow and
        every ``POLL_EVERY`` updates of fused steps: a collapse raises from that call. Compiled
        (``fullgraph=True`` works), nothing is read: the next eager call does it.

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
        self._calls.note("update", new_scale)

    def _update(self, new_scale: float | torch.Tensor | None) -> None:
        # validate first
        value = None if new_scale is None else check_new_scale(new_scale, self._config)
        it = self._it
        if not it.inf_checks()[0] and value is None:
            self._fail(
                2,
                "update() was called but no optimizer was stepped or unscaled since the last "
                f"update(); the order is {ORDER}.",
            )
        if self._loss_scale.tensors is None:  # update(new_scale) first: the constructor's device
            self.place(check_device(self._device, "update(new_scale) before any scale()"))
        state = self._loss_scale.tensors
        counts, seen_clean, still_scaled = it.counts(), it.seen_clean(), it.still_scaled()
        read_overflow = it.read_overflow
        found_inf, refs, binary = it.close(state.scale.device)
        if not counts and value is None:
            self._headroom.forget()
            return  # no rank scaled since the scaler was made or loaded: checkpoint plumbing
        config, bounds = self._config, self._bounds
        if value is not None:
            old = self._loss_scale.set_(value, found_inf)  # the iteration is still counted
            self._headroom.set_scale(found_inf is not None, config)
        else:
            if config.headroom:
                unit = self._loss_scale.unit
                collapsed, old = self._headroom.update_(
                    state, found_inf, config, unit, binary, seen_clean
                )
            else:
                unit = self._loss_scale.unit if bounds.free(config) else None
                collapsed, old = step_(state, found_inf, config, unit, binary)
            if collapsed is not None:
                self._alarm.note_collapse(collapsed, state.counters[0], old)
        last = None
        if found_inf is not None:
            last = it.last = LastStep(state.counters, -1, old, found_inf, refs, still_scaled)
        self._reporter.forget()  # a mid-iteration report may miss optimizers stepped later
        if torch.compiler.is_compiling():
            self._schedule.compiled_update()  # the host's bounds miss this update
            return
        bounds.after_update(config, seen_clean, value)
        if last is not None and self._report_overflows and bool(last.found_inf > 0):
            groups = _sync.resolve_groups(self.process_group)
            self._reporter.log(last, groups, self._calls.shadowing)  # once, all ranks' entries
        refresh = config.plain and not bounds.free(config)
        if self._schedule.update_due(read_overflow, bounds.below_one, refresh):
            self._poll()

    def abandon(self) -> None:
        """Abandon the current iteration, after ``unscale_``/``clip_grad_norm_`` and before
        ``step``/``update`` (e.g. a gradient-norm guard of your own decided to skip it): the
        iteration's records are dropped; the scale, its trackers and the counters stay as they
        are; the next iteration starts with ``scale(loss)`` as usual. Call it on every rank of
        the process group (decide from a value every rank agrees on, such as the norm
        :meth:`clip_grad_norm_` returns): a rank that steps instead is out of step and the next
        agreement raises naming it. No collective, no host read."""
        self._it.abandon()
        self._headroom.forget()
        self._calls.note("abandon")

    def place(self, device: torch.device | str) -> None:
        """Create the scale state on ``device`` before the first :meth:`scale` (e.g. before a
        CUDA graph capture or after ``load_state_dict``), or move it there. Idempotent; call it
        at an iteration boundary.

        Raises:
            TypeError: ``device`` is not a str or ``torch.device``.
            ValueError: the meta device (no data).
            RuntimeError: a device torch cannot create tensors on here (e.g. ``"cuda"`` on a
                CPU-only build).
        """
        device = check_device(device)
        if self._loss_scale.tensors is None:
            self._lazy_init_scale_growth_tracker(device)
        elif self._loss_scale.tensors.scale.device != device:
            self._loss_scale.move(device)
            self._placed(self._loss_scale.tensors)

    # ---------------------------------------------------------------- helpers
    def _begin(self, method: str, optimizer: Any) -> dict[str, Any]:
        """``optimizer``'s record of this iteration (created READY), after checking the call;
        the scale state created on an idle rank (no loss to scale since the start or a
        resume)."""
        if not is_optimizer(optimizer):
            raise TypeError(
                f"{method}() takes a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        self._call = f"{method}()"  # named by a collective that fails
        if self._loss_scale.tensors is None:
            params = list(_grads.iter_params(optimizer))
            self._lazy_init_scale_growth_tracker(params[0].device if params else self._device)
        return self._it.record(optimizer)

    def _poll(self, collapses: bool = True) -> None:
        """Read the alarm (one host read): raise on a rank mismatch, raise or warn on a collapse
        (not ``collapses``: left for the update's; all ranks poll at once: reports gathered)."""
        self._schedule.read()
        collapse, now = self._alarm.read(_sync.rank(), self._loss_scale.tensors.scale, collapses)
        self._bounds.set_exact(now)
        if collapse is not None:
            groups, shadowing = _sync.resolve_groups(self.process_group), self._calls.shadowing
            self._reporter.collapsed(collapse, self._config, self._it.last, groups, shadowing)

    # ------------------------------------------------------------- clipping
    def clip_grad_norm_(
        self,
        optimizer_or_params: torch.optim.Optimizer | Iterable[torch.Tensor] | torch.Tensor,
        max_norm: float,
        norm_type: float | str = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        fold: bool = True,
    ) -> torch.Tensor:
        """Unscale, compute the global gradient norm across shards and ranks, and clip.

        ``scaler.unscale_(opt)`` then ``torch.nn.utils.clip_grad_norm_`` on the *unsharded*
        model, with :meth:`unscale_`'s agreement, in one read pass, ONE all-reduce (none without
        a group) and one write pass (none for a fused optimizer: see ``fold``). Replicas
        (plain, DDP, DTensor ``Replicate``, FSDP1 ``NO_SHARD``) count once, shards are summed.
        The optimizer is then UNSCALED with its agreed flag. After ``unscale_`` (torch's recipe)
        or a first clip, and when disabled, it clips the gradients as they are (one all-reduce
        of the norm). See :mod:`shardscale._clip`.

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
            fold: False: write the unscaled, clipped gradients always. True: a fused optimizer
                gets them folded into its ``grad_scale`` instead where :func:`_clip.may_fold`.

        Returns:
            The total norm of the unscaled gradients over all ranks and shards, a 0-d float32
            tensor on the scale's device (inf/NaN after an overflow), as torch's function.

        Raises:
            TypeError, ValueError: a bad argument or gradient (a Partial DTensor, shared memory),
                before anything is written.
            RuntimeError: after :meth:`step` in the iteration, parameters mixing unscaled and
                scaled gradients, ``error_if_nonfinite`` and a non-finite norm (nothing written
                then), or as :meth:`unscale_`.
            NotImplementedError: several process groups / a multi-dimensional mesh, or DTensor
                gradients on a mesh other than the scaler's group.
        """
        target: Any = optimizer_or_params
        if not is_optimizer(target):
            target = _clip.param_list(target)  # a generator is read once
        args = _clip.ClipArgs.check(max_norm, norm_type, error_if_nonfinite, foreach, fold)
        total = self._clip_grad_norm(target, args)
        self._calls.note(
            "clip_grad_norm_", target, max_norm, norm_type, error_if_nonfinite, foreach
        )
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
        return self._it.last_skipped(optimizer)

    def metrics(self) -> dict[str, float | int]:
        """Plain numbers for loggers: ``scale``, ``growth_tracker``, ``hysteresis_tracker``,
        ``steps``, ``skipped_steps``, ``consecutive_skips``, ``overflows``, ``backoffs``,
        ``growths`` (see :class:`ScaleState`) and ``last_step_skipped`` (0/1). One host read; no
        collective. A disabled scaler gives the same keys: scale 1.0 and zeros."""
        if not self._enabled:
            return {**Numbers(1.0, 0, 0).as_dict(), "last_step_skipped": 0}
        last = self._it.last.found_inf if self._it.last is not None else None
        numbers, last_found = self._loss_scale.read(last)
        return {**numbers.as_dict(), "last_step_skipped": int(last_found > 0)}

    def set_param_names(self, source: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Name parameters in overflow reports, from a module (its submodules are asked for
        their parameters when a report is built) or a ``{name: parameter}`` map. ``copy.
        deepcopy`` of the scaler after its model in the same call follows the copied model;
        pickling drops the names (call this again after loading)."""
        self._reporter.names = name_params(source)

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
        all_ranks = check_flag("all_ranks", all_ranks)
        groups = _sync.resolve_groups(self.process_group)
        shadowing = self._calls.shadowing
        tensors = self._loss_scale.tensors
        report = self._reporter.report(self._it, tensors, all_ranks, groups, shadowing)
        if all_ranks:
            self._calls.note("overflow_report", True)
        return report

    def numerics(self, all_ranks: bool = False) -> Numerics | None:
        """The gradient numerics of the last stepped iteration, per parameter group (per FSDP
        unit where a group spans several): headroom in bits to fp16's overflow, the fraction
        of elements that underflow in fp16, the unscaled norm and amax
        (:class:`~shardscale.Numerics`; headline figures in ``as_dict()``). Call it after
        ``update()`` and before ``zero_grad()``; None before the first ``update()``, after the
        next ``scale()``, with no gradient left (after ``zero_grad()``; a rank holding none,
        locally) or when disabled. One pass and one host read per group, nothing in the
        training step. ``all_ranks=False``: this rank's gradients (shards), no collective;
        True: every rank's (one ``all_gather_object``: every rank must call it)."""
        if not isinstance(all_ranks, bool):
            raise TypeError(f"all_ranks must be a bool, got {all_ranks!r}.")
        last = self._it.last
        if not self._enabled or last is None or self._it.scaled_here:
            return None
        groups = _sync.resolve_groups(self.process_group) if all_ranks else None
        pairs = [] if self._calls.shadowing else self._it.left_scaled()
        return _numerics.of_step(last.index, float(last.scale), pairs, self._names, groups)

    # torch's getters and setters: in _protocol.TorchInternals
    @property
    def config(self) -> ScalerConfig:
        """The (frozen) policy in force."""
        return self._config

    # ----------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python values (safe for ``torch.load(weights_only=True)``).

        Keys: torch's five (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``), then the other policy fields, the hysteresis
        tracker, ``_counters`` and the headroom rule's ``_headroom_history`` (oldest first) and
        ``_headroom_backoffs`` (all listed in ``docs/checkpoints.md``). Empty if disabled. One
        host read (two with ``policy="headroom"``). Call it after :meth:`update`.
        """
        if not self._enabled:
            return {}
        return _checkpoint.to_state_dict(self._config, self.metrics(), self._headroom.read())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or from ``torch.amp.GradScaler.state_dict()``.

        The scale, trackers, counters and torch's policy keys come from the checkpoint, as
        torch; so do shardscale's policy fields, except those the constructor set (kept, with
        a warning); the mode (fp16 or :meth:`guard`) is always the constructor's. Validated
        before anything changes. After :meth:`scale` (torch allows it) the iteration is
        abandoned with a warning. Rules and warnings: ``docs/checkpoints.md``.

        Raises:
            RuntimeError: empty dict (saved from a disabled scaler), or called mid-iteration
                (after ``unscale_``, ``clip_grad_norm_`` or ``step``).
            TypeError, ValueError: a missing key or a bad value, named in the message.
        """
        if not self._enabled:
            return
        _checkpoint.check_load_boundary(self._it.started())
        own = self._loss_scale.read()[0]  # kept if the checkpoint is of the other mode
        loaded = _checkpoint.parse_state_dict(state_dict, self._config, self._asked, own)
        if self._it.scaled_here:  # its gradients hold the old scale
            _checkpoint.warn_load_after_scale()
            self.abandon()
        self._loss_scale.load(loaded.numbers)
        self._headroom.load(loaded.headroom, loaded.counters[0], loaded.config)  # steps
        self._config = loaded.config
        self._it.loaded()  # a step before the next scale() is checkpoint plumbing
        self._verify = True
        self._bounds = HostBounds.at(loaded.numbers.scale)
