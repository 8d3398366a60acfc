"""Hugging Face accelerate: make a :class:`~shardscale.ShardedGradScaler` the grad scaler of an
``accelerate.Accelerator``.

``use_shardscale(accelerator)`` before or after ``accelerator.prepare(...)``; the training loop
stays accelerate's (``accelerator.backward``, ``optimizer.step()``, ``scheduler.step()``,
``accelerator.clip_grad_norm_``, ``save_state``/``load_state``). ``accelerator.log(
scaler_logs(accelerator), step=step)`` between ``optimizer.step()`` and ``optimizer.zero_grad()``
logs the loss scale, the skipped steps and, with ``policy="headroom"``, the headroom and
underflow of the step's gradients. accelerate itself is imported only when
:func:`use_shardscale` is called (``pip install shardscale[accelerate]``).
"""

from __future__ import annotations

import warnings
from types import MethodType
from typing import Any

import torch

from .. import ShardedGradScaler

__all__ = ["use_shardscale", "scaler_logs"]

#: accelerate's set-ups with a loss scaling of their own (or none to replace).
_REFUSED = ("DEEPSPEED", "MEGATRON_LM", "XLA")

_SKIP_AWARE: dict[type, type] = {}  # AcceleratedOptimizer (sub)class -> its skip-aware subclass


def use_shardscale(accelerator: Any, **scaler_kwargs: Any) -> ShardedGradScaler:
    """Install a :class:`~shardscale.ShardedGradScaler` as ``accelerator``'s grad scaler.

    Call it before or after ``accelerator.prepare(...)``, before the first step; call it before
    ``accelerator.load_state()`` so that the checkpoint's scaler state lands in this scaler. It
    sets ``accelerator.scaler`` and the scaler of every optimizer prepared (now or later), so
    ``accelerator.backward`` scales the loss, ``optimizer.step()`` unscales, agrees the inf/NaN
    flag across ranks (one all-reduce) and steps or skips on every rank together, and
    ``save_state``/``load_state`` checkpoint the scaler (``scaler.pt``).

    * ``mixed_precision="fp16"``: a dynamic scaler. Defaults: ``device=accelerator.device.type``,
      then ``GradScalerKwargs`` given to the accelerator, then ``scaler_kwargs``. The scale and
      growth tracker of the scaler accelerate made (if any: it may have loaded a checkpoint)
      carry over unless ``init_scale`` is given.
    * ``"bf16"`` or ``"no"``: :meth:`ShardedGradScaler.guard` (scale fixed at 1.0: an
      ``init_scale`` is ignored with a warning, since accelerate unscales only fp16 gradients;
      a step with an inf/NaN gradient on any rank is skipped on every rank).
    * fp16 on the CPU, which accelerate turns off silently (no autocast, no scaler): fp16
      autocast is turned on (``accelerator.native_amp``; models prepared already get accelerate's
      autocast wrapper; FSDP2 models use the plugin's ``MixedPrecisionPolicy``) and a
      ``UserWarning`` says so. fp16 on the CPU is slow: for testing.

    ``optimizer.step_was_skipped`` (and ``accelerator.optimizer_step_was_skipped``, which a
    prepared ``AcceleratedScheduler`` reads to stay still) then reports
    :meth:`ShardedGradScaler.last_step_skipped`: right for fused optimizers too, whose ``step``
    accelerate sees called even when the kernel skipped the update (accelerate issue #4242).
    Reading it waits for a fused step on an accelerator device (one host read).

    Args:
        accelerator: an ``accelerate.Accelerator``.
        **scaler_kwargs: :class:`~shardscale.ShardedGradScaler` arguments (``init_scale``,
            ``growth_interval``, ``max_consecutive_skips``, ``process_group``, ...).

    Returns:
        The installed scaler (``accelerator.scaler``): log :func:`scaler_logs` (or
        ``scaler.metrics()``) with ``accelerator.log``.

    Raises:
        ValueError: DeepSpeed, Megatron-LM, XLA or fp8, which scale (or not) on their own.
        TypeError, ValueError: a bad scaler argument (from :class:`ShardedGradScaler`).
    """
    from accelerate.utils import DistributedType

    refused = [getattr(DistributedType, name) for name in _REFUSED]
    precision = accelerator.mixed_precision
    if accelerator.distributed_type in refused or precision == "fp8":
        raise ValueError(
            f"use_shardscale() does not support distributed_type="
            f"{accelerator.distributed_type.value!r} with mixed_precision={precision!r}: that "
            "set-up does its own loss scaling (or needs none from a GradScaler)."
        )
    kwargs: dict[str, Any] = {"device": accelerator.device.type}
    old = accelerator.scaler
    if precision == "fp16":
        if accelerator.scaler_handler is not None:
            kwargs.update(accelerator.scaler_handler.to_kwargs())
        kwargs.update(scaler_kwargs)
        scaler = ShardedGradScaler(**kwargs)
        if _is_live_grad_scaler(old) and "init_scale" not in scaler_kwargs:
            _carry_over(old, scaler)
        if not accelerator.native_amp:  # the CPU: accelerate turned fp16 off
            _enable_cpu_fp16(accelerator)
    else:
        kwargs.update(scaler_kwargs)
        if kwargs.pop("init_scale", 1.0) != 1.0:
            warnings.warn(
                f"use_shardscale(): init_scale is ignored with mixed_precision={precision!r}: "
                "accelerate unscales gradients (for clip_grad_norm_) only in fp16, so the "
                "bf16/fp32 guard keeps its scale at 1.0.",
                UserWarning,
                stacklevel=2,
            )
        scaler = ShardedGradScaler.guard(**kwargs)
    accelerator.scaler = scaler
    for optimizer in accelerator._optimizers:
        _adopt(optimizer, scaler)
    _hook_prepare_optimizer(accelerator)
    return scaler


def scaler_logs(source: Any, numerics: bool | None = None) -> dict[str, float]:
    """The scaler's headline figures, for ``accelerator.log``::

        optimizer.step()  # the scaler's step and update
        accelerator.log(scaler_logs(accelerator), step=step)
        optimizer.zero_grad()

    Keys: ``loss_scale`` (the scale now) and ``skipped_steps`` (steps skipped since the scaler
    was made or loaded; :meth:`ShardedGradScaler.metrics`); with ``numerics``, the last step's
    ``headroom_bits`` (bits to fp16's overflow left by the largest scaled gradient; negative
    or -inf on an overflow) and ``underflow`` (the fraction of gradient elements zero or
    subnormal in fp16, in [0, 1]) from :meth:`ShardedGradScaler.numerics`. Those two are
    measured from the gradients: call it after ``optimizer.step()`` and before
    ``optimizer.zero_grad()``, and after any clip (``accelerator.clip_grad_norm_``) they are
    the clipped gradients' (a clip by ``c`` adds ``log2(1/c)`` to the headroom, and counts more
    elements as underflowing). They are left out where there is nothing to measure: on a
    micro-step of gradient accumulation (no step was taken, ``backward`` scaled new gradients),
    with the gradients set to None by ``zero_grad()`` (zeroed in place, they would read inf and
    1.0), before the first step, with a disabled scaler.

    Cost: one host read (``metrics()``); with ``numerics``, one pass over the gradients and one
    host read per parameter group. No collective: the gradients are this rank's (its shards
    under FSDP; ``accelerator.log`` records the main process's).

    Args:
        source: an ``Accelerator`` set up by :func:`use_shardscale`, or a
            :class:`~shardscale.ShardedGradScaler`.
        numerics: include ``headroom_bits`` and ``underflow``; None (default): when the
            scaler's ``policy`` is ``"headroom"``.

    Raises:
        TypeError: ``source`` is neither a ``ShardedGradScaler`` nor an object whose
            ``scaler`` is one (:func:`use_shardscale` not called); ``numerics`` not a bool or
            None.
    """
    scaler = source if isinstance(source, ShardedGradScaler) else getattr(source, "scaler", None)
    if not isinstance(scaler, ShardedGradScaler):
        raise TypeError(
            "scaler_logs() needs a ShardedGradScaler or an Accelerator set up by "
            f"use_shardscale(accelerator), got {type(source).__name__} (scaler: "
            f"{type(scaler).__name__})."
        )
    if numerics is not None and not isinstance(numerics, bool):
        raise TypeError(f"numerics must be a bool or None, got {numerics!r}.")
    metrics = scaler.metrics()
    out: dict[str, float] = {
        "loss_scale": metrics["scale"],
        "skipped_steps": metrics["skipped_steps"],
    }
    if numerics if numerics is not None else scaler.config.policy == "headroom":
        measured = scaler.numerics()
        if measured is not None and measured.groups:
            out.update(measured.as_dict())
    return out


def _is_live_grad_scaler(scaler: object) -> bool:
    return isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()


def _carry_over(old: Any, new: ShardedGradScaler) -> None:
    """Give ``new`` the scale and growth tracker of ``old`` (a torch GradScaler or ours), with
    ``new``'s own policy."""
    state = old.state_dict()
    new.load_state_dict(
        {
            "scale": state["scale"],
            "_growth_tracker": state["_growth_tracker"],
            "growth_factor": new.get_growth_factor(),
            "backoff_factor": new.get_backoff_factor(),
            "growth_interval": new.get_growth_interval(),
        }
    )


def _enable_cpu_fp16(accelerator: Any) -> None:
    """Turn on what accelerate turns off for fp16 on the CPU: the autocast of prepared models
    (as ``Accelerator.prepare_model`` does it) and of ``accelerator.autocast()``."""
    warnings.warn(
        "mixed_precision='fp16' on the CPU: accelerate turns fp16 off there (no autocast, no "
        "grad scaler); shardscale turns on fp16 autocast on the CPU and loss scaling. fp16 "
        "on the CPU is slow: use it for testing (bf16 for CPU training).",
        UserWarning,
        stacklevel=3,
    )
    accelerator.native_amp = True  # prepare_model() wraps models prepared from now on
    if not accelerator.is_fsdp2:  # FSDP2 casts by its MixedPrecisionPolicy, not by autocast
        for model in accelerator._models:
            _autocast_forward(accelerator, model)


def _autocast_forward(accelerator: Any, model: Any) -> None:
    """Wrap ``model``'s forward in fp16 autocast and fp32 outputs, as ``prepare_model`` does
    (``accelerator.unwrap_model(model, keep_fp32_wrapper=False)`` removes it)."""
    from accelerate.utils import (
        convert_outputs_to_fp32,
        extract_model_from_parallel,
        get_mixed_precision_context_manager,
    )

    module = extract_model_from_parallel(model, keep_torch_compile=False)
    if "_original_forward" in module.__dict__:  # wrapped already
        return
    autocast = get_mixed_precision_context_manager(True, accelerator.autocast_handler)
    module._original_forward = module.forward
    if hasattr(module.forward, "__func__"):
        module.forward = MethodType(autocast(module.forward.__func__), module)
        module.forward = MethodType(convert_outputs_to_fp32(module.forward.__func__), module)
    else:
        module.forward = convert_outputs_to_fp32(autocast(module.forward))


def _adopt(optimizer: Any, scaler: ShardedGradScaler) -> None:
    """Make a prepared ``AcceleratedOptimizer`` step through ``scaler`` and report its skips."""
    from accelerate.optimizer import AcceleratedOptimizer, patch_optimizer_step

    if not isinstance(optimizer, AcceleratedOptimizer):
        return
    optimizer.scaler = scaler
    # what AcceleratedOptimizer.__init__ sets up when it is given a scaler
    optimizer._accelerate_step_called = False
    optimizer._optimizer_original_step_method = optimizer.optimizer.step
    optimizer._optimizer_patched_step_method = patch_optimizer_step(
        optimizer, optimizer.optimizer.step
    )
    if type(optimizer) not in _SKIP_AWARE.values():
        optimizer.__class__ = _skip_aware(type(optimizer))


def _hook_prepare_optimizer(accelerator: Any) -> None:
    """Adopt optimizers prepared after :func:`use_shardscale` too (once per accelerator)."""
    if "prepare_optimizer" in accelerator.__dict__:
        return
    prepare_optimizer = accelerator.prepare_optimizer

    def prepare_and_adopt(optimizer: Any, device_placement: bool | None = None) -> Any:
        prepared = prepare_optimizer(optimizer, device_placement=device_placement)
        if isinstance(accelerator.scaler, ShardedGradScaler):
            _adopt(prepared, accelerator.scaler)
        return prepared

    prepare_and_adopt.__doc__ = prepare_optimizer.__doc__
    accelerator.prepare_optimizer = prepare_and_adopt


def _step_was_skipped(self: Any) -> bool:
    """Whether the last optimizer step was skipped (an inf/NaN gradient on any rank). With a
    ShardedGradScaler: its :meth:`~shardscale.ShardedGradScaler.last_step_skipped`, which
    knows fused optimizers' skips too; otherwise accelerate's answer."""
    scaler = self.scaler
    if not isinstance(scaler, ShardedGradScaler):
        return self._is_overflow
    try:
        return bool(scaler.last_step_skipped(self.optimizer))
    except RuntimeError:  # not stepped yet
        return False


def _skip_aware(cls: type) -> type:
    """The subclass of ``cls`` (an ``AcceleratedOptimizer``) whose ``step_was_skipped`` asks
    the scaler; made once per class."""
    new = _SKIP_AWARE.get(cls)
    if new is None:
        name = f"Shardscale{cls.__name__}"
        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{cls.__name__} whose ``step_was_skipped`` asks its ShardedGradScaler.",
            "step_was_skipped": property(_step_was_skipped),
        }
        new = _SKIP_AWARE[cls] = type(name, (cls,), namespace)
    return new


def __getattr__(name: str) -> type:
    """``ShardscaleAcceleratedOptimizer`` on demand (pickle finds an adopted optimizer's class
    by this name); accelerate is imported only then."""
    if name == "ShardscaleAcceleratedOptimizer":
        from accelerate.optimizer import AcceleratedOptimizer

        return _skip_aware(AcceleratedOptimizer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
