"""``transformers.Trainer`` integration: :class:`ShardscaleCallback`.

``Trainer(..., callbacks=[ShardscaleCallback()])`` trains with a :class:`ShardedGradScaler` as the
Trainer's grad scaler. The Trainer trains through accelerate; when the Trainer is built, the
callback hands its accelerator to :func:`shardscale.integrations.accelerate.use_shardscale`,
before ``train()`` prepares the model and the optimizer. What it changes:

* ``fp16=True``: the scaler replaces accelerate's (torch's ``GradScaler``, or FSDP's); every rank
  skips the same steps. On the CPU, where transformers and accelerate silently train fp16 runs in
  fp32 (no autocast, no scaler), fp16 autocast and loss scaling are turned on, with a warning:
  fp16 on the CPU is slow, for testing.
* ``bf16=True`` or full precision: a guard scaler (:meth:`ShardedGradScaler.guard`: scale fixed
  at 1.0, steps with inf/NaN gradients skipped on every rank).
* Skipped steps leave the LR scheduler where it was, with fused optimizers
  (``optim="adamw_torch_fused"``) too: they are always called (the kernel skips), so accelerate
  took their steps as taken; ``accelerator.optimizer_step_was_skipped``, which the Trainer reads,
  now comes from :meth:`ShardedGradScaler.last_step_skipped` (one host read per step).
* Every log gains ``loss_scale`` and ``skipped_steps`` (``trainer.state.log_history`` and the
  ``report_to`` integrations: the callback moves itself first in the Trainer's callback list);
  with ``policy="headroom"`` (or ``log_numerics=True``) the logs of training steps gain
  ``headroom_bits`` and ``underflow`` (:meth:`ShardedGradScaler.numerics`).
* Checkpoints: the Trainer saves ``accelerator.scaler`` (``scaler.pt``, rank 0) and loads it on
  ``train(resume_from_checkpoint=...)``: scale, growth tracker and counters come back exactly.

Not supported: DeepSpeed, Megatron-LM, XLA and fp8 (refused when the Trainer is built), and
``hyperparameter_search`` (it replaces the accelerator after the callback set it up; ``train()``
then raises).

Imported on demand only (``import shardscale`` never imports transformers).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

try:
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shardscale.integrations.transformers needs transformers and accelerate: "
        "pip install 'shardscale[transformers]'"
    ) from exc

from .. import ShardedGradScaler
from .accelerate import use_shardscale

__all__ = ["ShardscaleCallback"]


class ShardscaleCallback(transformers.TrainerCallback):
    """Install a :class:`ShardedGradScaler` as a ``transformers.Trainer``'s grad scaler.

    Pass it to the Trainer's constructor, one callback per Trainer::

        trainer = Trainer(model=model, args=TrainingArguments("out", fp16=True),
                          train_dataset=ds, callbacks=[ShardscaleCallback()])

    Every log gains ``loss_scale`` and ``skipped_steps`` (``scaler.metrics()``: one host read
    per log). With ``log_numerics`` (by default: when the scaler's ``policy`` is
    ``"headroom"``), the log of a training step also gains the headline figures of
    :meth:`ShardedGradScaler.numerics`: ``headroom_bits`` (bits to fp16's overflow left by
    the largest scaled gradient; negative or -inf on an overflow) and ``underflow`` (the
    fraction of gradient elements zero or subnormal in fp16, in [0, 1]). The Trainer zeroes the
    gradients right after the optimizer step, before ``on_step_end`` and ``on_log``, so they are
    measured in ``on_optimizer_step`` (after ``optimizer.step()``, which under accelerate runs
    the scaler's ``step`` and ``update``; after the Trainer's clip, so a clipped step's
    gradients: a clip by ``c`` adds ``log2(1/c)`` to the headroom and counts more elements as
    underflowing), only on the steps the Trainer will log: every ``logging_steps`` (and the
    first with ``logging_first_step``); with ``logging_strategy="epoch"``, whose last step is
    not known beforehand, on every step. Each measurement costs one pass over the gradients and
    one host read per parameter group, no collective: this rank's gradients (its shards under
    FSDP; the ``report_to`` integrations record rank 0's). A log another callback asks for on
    another step gets no figures.

    Args:
        log_numerics: add ``headroom_bits`` and ``underflow`` to the logs; None (default): when
            the scaler's ``policy`` is ``"headroom"``.
        **scaler_kwargs: arguments of :class:`ShardedGradScaler` (``init_scale``,
            ``growth_interval``, ``max_consecutive_skips``, ``process_group``, ``policy``, ...),
            validated here. With bf16 or full precision they go to
            :meth:`ShardedGradScaler.guard`.

    Attributes:
        scaler: the installed scaler (None until the Trainer is built): ``metrics()``,
            ``overflow_report()``, ``state_dict()``.

    Raises:
        TypeError, ValueError: a bad scaler argument, or ``log_numerics`` not a bool or None
            (on construction); DeepSpeed, Megatron-LM, XLA, fp8, or one callback given to two
            Trainers (when the Trainer is built).
        RuntimeError: ``train()`` without the scaler installed (the callback was added after the
            Trainer was built, or the accelerator was replaced).
    """

    def __init__(self, *, log_numerics: bool | None = None, **scaler_kwargs: Any) -> None:
        if log_numerics is not None and not isinstance(log_numerics, bool):
            raise TypeError(f"log_numerics must be a bool or None, got {log_numerics!r}.")
        ShardedGradScaler(**scaler_kwargs)  # raises now on a bad argument
        self._kwargs = scaler_kwargs
        self.log_numerics = log_numerics
        self.scaler: ShardedGradScaler | None = None
        self._trainer: weakref.ref[transformers.Trainer] | None = None
        #: (global step, headline figures) measured for the log of that step
        self._numerics: tuple[int, dict[str, float]] | None = None

    # ----------------------------------------------------------------- install
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        found = _calling_trainer(self)
        if found is None:
            raise RuntimeError(
                "ShardscaleCallback.on_init_end was not called by a transformers.Trainer; pass "
                "the callback to Trainer(callbacks=[ShardscaleCallback()])."
            )
        trainer, depth = found
        self._install(trainer, stacklevel=depth + 3)  # warnings point at `Trainer(...)`

    def _install(self, trainer: transformers.Trainer, stacklevel: int = 2) -> None:
        """Put a fresh scaler on ``trainer.accelerator`` (before ``train()`` prepares the model
        and optimizer, so the model's forward gets autocast and the optimizer the scaler)."""
        if self._trainer is not None and self._trainer() not in (None, trainer):
            raise ValueError(
                "this ShardscaleCallback is installed on another Trainer already; create one "
                "ShardscaleCallback per Trainer."
            )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler = use_shardscale(trainer.accelerator, **self._kwargs)
        for w in caught:  # fp16 on the CPU: said where the Trainer is built
            warnings.warn(w.message, w.category, stacklevel=stacklevel)
        self.scaler = scaler
        self._trainer = weakref.ref(trainer)
        callbacks = trainer.callback_handler.callbacks
        callbacks.remove(self)
        callbacks.insert(0, self)  # on_log first: the report_to integrations see loss_scale

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._numerics = None
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None or self.scaler is None:
            raise RuntimeError(
                "ShardscaleCallback has not installed its scaler: pass it to the Trainer's "
                "constructor, Trainer(callbacks=[ShardscaleCallback()]) (trainer.add_callback() "
                "comes too late)."
            )
        optimizer = kwargs.get("optimizer")
        if trainer.accelerator.scaler is not self.scaler or (
            getattr(optimizer, "scaler", self.scaler) is not self.scaler
        ):
            raise RuntimeError(
                "the Trainer's accelerator no longer uses ShardscaleCallback's scaler (it was "
                "replaced, e.g. by hyperparameter_search, which ShardscaleCallback does not "
                "support)."
            )

    # -------------------------------------------------------------------- logs
    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After ``optimizer.step()`` (the scaler's step and update), before the Trainer zeroes
        the gradients: measure the numerics of a step the Trainer will log."""
        scaler, wanted = self.scaler, self.log_numerics
        if scaler is None:
            return
        if not (wanted if wanted is not None else scaler.config.policy == "headroom"):
            return
        step = state.global_step + 1  # the Trainer counts the step after this hook
        self._numerics = None
        if args.logging_strategy == "epoch" or (
            args.logging_strategy == "steps"
            and (step % state.logging_steps == 0 or (step == 1 and args.logging_first_step))
        ):
            numerics = scaler.numerics()
            if numerics is not None and numerics.groups:
                self._numerics = (step, numerics.as_dict())

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Add ``loss_scale`` and ``skipped_steps`` (one host read), and the step's
        ``headroom_bits`` and ``underflow`` if measured, to ``logs`` and to the entry the Trainer
        has just appended to ``state.log_history``."""
        if self.scaler is None or logs is None:
            return
        metrics = self.scaler.metrics()
        extra = {"loss_scale": metrics["scale"], "skipped_steps": metrics["skipped_steps"]}
        if self._numerics is not None and self._numerics[0] == state.global_step:
            extra.update(self._numerics[1])
            self._numerics = None  # the step's own log only, not the end-of-training summary
        history = state.log_history
        if history and history[-1].get("step") == state.global_step:
            if history[-1].keys() >= logs.keys():
                history[-1].update(extra)
        logs.update(extra)


def _calling_trainer(callback: ShardscaleCallback) -> tuple[transformers.Trainer, int] | None:
    """The Trainer whose ``__init__`` is calling ``callback`` (a callback is given no Trainer,
    but the accelerator must be set up before ``train()`` prepares the model), and how many
    frames above the caller of this function its frame is."""
    frame = sys._getframe(1)
    for depth in range(32):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, transformers.Trainer):
            handler = getattr(owner, "callback_handler", None)
            if any(cb is callback for cb in getattr(handler, "callbacks", ())):
                return owner, depth
        frame = frame.f_back
    return None
