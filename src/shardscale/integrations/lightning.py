"""PyTorch Lightning: ``ShardscalePrecision`` (a precision plugin) and ``LossScaleMonitor``.

Importing this module imports ``lightning`` (``pip install shardscale[lightning]``, the
``lightning`` package, not the standalone ``pytorch_lightning``); ``import shardscale`` does not.

Trainer::

    trainer = L.Trainer(
        plugins=[ShardscalePrecision("16-mixed", init_scale=2**10)],
        callbacks=[LossScaleMonitor()],
        gradient_clip_val=1.0,
    )

Fabric::

    fabric = L.Fabric(plugins=[ShardscalePrecision("16-mixed")])

The plugin works with the single-device, DDP, ``FSDPStrategy`` (FSDP1) and
``ModelParallelStrategy`` (FSDP2, ``fully_shard`` in ``configure_model``) strategies, on CUDA and
on the CPU, where it really runs fp16 (Lightning's own ``"16-mixed"`` turns into bf16 there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision as _FabricFSDPPrecision
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.wrappers import _FabricOptimizer
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import FSDPPrecision as _TrainerFSDPPrecision
from lightning.pytorch.plugins.precision import Precision as _TrainerPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection

from ..scaler import ShardedGradScaler

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecision as _FSDPMixedPrecision

__all__ = ["ShardscalePrecision", "LossScaleMonitor"]

_PRECISIONS = ("16-mixed", "bf16-mixed")
#: keys under which Lightning's own plugins store a torch GradScaler's state in a checkpoint
_TORCH_SCALER_KEYS = ("MixedPrecision", "FSDPPrecision", "native_amp_scaling_state")
_cpu_fp16_warned = False


def _warn_cpu_fp16() -> None:
    global _cpu_fp16_warned
    if not _cpu_fp16_warned:
        _cpu_fp16_warned = True
        rank_zero_warn(
            "ShardscalePrecision('16-mixed') on the CPU runs real fp16 autocast and loss scaling "
            "(Lightning's own precision='16-mixed' switches to bf16 on the CPU). CPU fp16 kernels "
            "are slow: use this to test fp16 code paths; train on the CPU with 'bf16-mixed'."
        )


class ShardscalePrecision(_TrainerFSDPPrecision, _FabricFSDPPrecision):
    """Mixed precision with a :class:`~shardscale.ShardedGradScaler`, for the Trainer and Fabric.

    ``"16-mixed"``: fp16 autocast and a dynamic loss scale; ``"bf16-mixed"``: bf16 autocast and
    ``ShardedGradScaler.guard()`` (scale fixed at 1.0, non-finite steps still skipped). On every
    strategy each rank skips the same steps: the scaler agrees the found-inf flag in one
    all-reduce over the default process group.

    Strategies: single device, DDP, ``FSDPStrategy`` (FSDP1; the plugin is an ``FSDPPrecision``,
    which that strategy requires: FSDP computes in fp16/bf16 and reduces fp16 gradients in fp32,
    see :attr:`mixed_precision_config`; pass ``FSDPStrategy(mixed_precision=...)`` to choose
    otherwise) and ``ModelParallelStrategy`` (FSDP2: choose the ``MixedPrecisionPolicy`` in
    ``configure_model``, e.g. ``param_dtype=torch.float16, reduce_dtype=torch.float32``). Lightning
    refuses ``precision="16-mixed"`` there and ``FSDPPrecision("16-mixed", scaler=...)`` raises
    (Lightning issue #19803); this plugin is accepted by both. The same instance type works in
    ``Trainer(plugins=[...])`` and ``Fabric(plugins=[...])``: the Trainer announces itself by
    calling :meth:`connect`, and the backward/step methods follow its protocol after that.

    Gradients (Trainer): ``on_before_optimizer_step`` and ``configure_gradient_clipping`` see
    unscaled gradients, as with Lightning's ``MixedPrecision`` (fused optimizers too, where
    Lightning leaves them scaled). When neither the LightningModule nor a callback overrides those
    hooks, nobody can look at the gradients between backward and step, so the unscale is left to the
    clip or the step: ``gradient_clip_val`` with ``gradient_clip_algorithm="norm"`` then runs
    ``scaler.clip_grad_norm_`` (unscale, global norm over shards and ranks, clip: one read pass, one
    all-reduce; with a fused optimizer no write pass, the clip folded into its step, unless a step
    hook is registered on it). Manual optimization's ``self.clip_gradients`` writes the clipped
    gradients (user code may read them before ``opt.step()``). Otherwise the clip runs on the
    unscaled gradients: the FSDP1 root's ``clip_grad_norm_`` when Lightning wrapped the model, else
    ``scaler.clip_grad_norm_`` after ``unscale_`` (the norm over shards and ranks: plain, DDP, FSDP1
    flat or original parameters, FSDP2), or ``torch.nn.utils.clip_grad_norm_`` for DTensors on a 2-D
    mesh (HSDP, tensor parallelism), which the scaler's norm refuses. Norm clipping works with fused
    optimizers (Lightning's ``MixedPrecision`` refuses them). Fabric: ``fabric.clip_gradients``
    unscales first through :meth:`unscale_gradients`; pass ``error_if_nonfinite=False`` there, or an
    overflow step (which the scaler skips) raises in torch's clip.

    The scaler's state is saved in Lightning checkpoints (``trainer.save_checkpoint``,
    ``ModelCheckpoint``) and restored by ``trainer.fit(ckpt_path=...)``; a checkpoint written with
    Lightning's ``MixedPrecision``/``FSDPPrecision`` (a torch ``GradScaler`` state) loads too. With
    Fabric, put the plugin (or its ``scaler``) in the state given to ``fabric.save``/``load``.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: the autocast device: a device type (``"cuda"``, ``"cpu"``, ...), a string or
            ``torch.device`` naming one (``"cuda:0"``), or any object whose ``.type`` is one.
            None: the device of the model's parameters in the Trainer; in Fabric (and until the
            Trainer connects) ``"cuda"`` if available, else ``"cpu"``. :attr:`device` is always
            the device type in use, as Lightning's ``MixedPrecision.device``.
        scaler: a ready :class:`~shardscale.ShardedGradScaler` (e.g. with a ``process_group``);
            None: built from ``scaler_kwargs``.
        **scaler_kwargs: keyword arguments of :class:`~shardscale.ShardedGradScaler`
            (``init_scale``, ``growth_interval``, ``hysteresis``, ``max_consecutive_skips``, ...),
            or of ``ShardedGradScaler.guard`` for ``"bf16-mixed"``.

    Raises:
        ValueError: another precision, or both ``scaler`` and ``scaler_kwargs``.
        TypeError: ``scaler`` is not a ``ShardedGradScaler``; an ``LBFGS`` optimizer (at its step:
            it needs a closure, which loss scaling cannot run).
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: str | None = None,
        scaler: ShardedGradScaler | None = None,
        **scaler_kwargs: Any,
    ) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(
                f"ShardscalePrecision(precision={precision!r}): precision must be one of "
                f"{_PRECISIONS}; for '32-true', '16-true' or 'bf16-true' use Lightning's plugins."
            )
        kind = _device_type(device)
        if scaler is not None:
            if not isinstance(scaler, ShardedGradScaler):
                raise TypeError(
                    f"scaler must be a shardscale.ShardedGradScaler, got {type(scaler).__name__}."
                )
            if scaler_kwargs:
                raise ValueError(
                    "pass either scaler or the scaler's keyword arguments "
                    f"({', '.join(sorted(scaler_kwargs))}), not both."
                )
        else:  # two explicit calls: LightningCLI (jsonargparse) reads scaler_kwargs' names here
            if kind is not None:
                scaler_kwargs.setdefault("device", kind)
            if precision == "16-mixed":
                scaler = ShardedGradScaler(**scaler_kwargs)
            else:
                scaler = ShardedGradScaler.guard(**scaler_kwargs)
        # Lightning's FSDPPrecision.__init__ is not called: it reads self.precision before setting
        # it (issue #19803) and builds torch's ShardedGradScaler.
        self.precision = precision  # type: ignore[assignment]
        #: the autocast device type (``"cuda"``, ``"cpu"``, ...)
        self.device: str = kind or ("cuda" if torch.cuda.is_available() else "cpu")
        self.scaler = scaler
        self._dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
        self._device_given = kind is not None
        self._fold = False  # set while Lightning's loop clips right before the step
        self._in_trainer = False  # set by connect(): the Trainer's protocol, else Fabric's
        self._model: torch.nn.Module | None = None
        self._unscaled: set[int] = set()  # optimizers unscaled (or clipped) in this iteration
        self._eager_unscale: bool | None = None

    # ------------------------------------------------------------------ model and forward
    @property
    def mixed_precision_config(self) -> _FSDPMixedPrecision:
        """FSDP1's ``MixedPrecision`` (read by ``FSDPStrategy`` unless it was given one):
        parameters and buffers in fp16/bf16; gradients reduced in fp32 for ``"16-mixed"`` (an
        fp16 reduce may overflow where fp32 does not, and keeps no value below fp16's range),
        in bf16 for ``"bf16-mixed"`` (as Lightning)."""
        from torch.distributed.fsdp import MixedPrecision

        reduce = torch.float32 if self._dtype == torch.float16 else self._dtype
        return MixedPrecision(
            param_dtype=self._dtype, reduce_dtype=reduce, buffer_dtype=self._dtype
        )

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self._dtype == torch.float16 and self.device == "cpu":
            _warn_cpu_fp16()
        return torch.autocast(self.device, dtype=self._dtype, cache_enabled=False)

    def convert_input(self, data: Any) -> Any:
        return data  # autocast casts; FSDP1 casts its root's inputs to param_dtype

    def convert_output(self, data: Any) -> Any:
        dtype = torch.get_default_dtype()
        return apply_to_collection(
            data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t
        )

    def connect(
        self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        """Called by the Trainer's strategy once the model is set up (Fabric never calls it)."""
        self._in_trainer, self._model, self._eager_unscale = True, model, None
        self._unscaled.clear()
        if not self._device_given:
            first = next(iter(model.parameters()), None)
            if first is not None and first.device.type != "meta":
                self.device = first.device.type
        return model, optimizers, lr_schedulers

    def teardown(self) -> None:
        self._in_trainer, self._model, self._eager_unscale = False, None, None
        self._unscaled.clear()

    # ------------------------------------------------------------------ backward
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if not self._in_trainer:
            return None  # Fabric scales in backward()
        return _TrainerPrecision.pre_backward(self, self.scaler.scale(tensor), module)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if self._in_trainer:  # (tensor, model, optimizer, *args); scaled in pre_backward
            _TrainerPrecision.backward(self, tensor, model, *args, **kwargs)
        else:
            self.scaler.scale(tensor).backward(*args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if not self._in_trainer:
            return None
        return _TrainerPrecision.post_backward(self, tensor, module)

    # ------------------------------------------------------------------ step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Trainer: ``(optimizer, model=, closure=, **kwargs)``: run the closure (forward and
        backward), unscale if a hook reads the gradients, run the hooks and the clip, then
        ``scaler.step`` and ``scaler.update``. Fabric: ``(optimizer, **kwargs)``: step, update."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "LBFGS needs a closure for its step, which loss scaling cannot run "
                "(ShardedGradScaler.step refuses closures, as torch's GradScaler)."
            )
        if not self._in_trainer:
            return self._step(optimizer, **kwargs)
        model: LightningModule = kwargs.pop("model")
        closure: Callable[[], Any] = kwargs.pop("closure")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward, nothing to step (Lightning)
        if self._eager_unscale is None:
            self._eager_unscale = _hooks_read_gradients(model)
        if self._eager_unscale:
            self.unscale_gradients(optimizer)
        # on_before_optimizer_step, then the clip, then the step: nothing of Lightning's reads
        # the gradients between the clip and the step, so a fused optimizer's clip may fold
        # (manual optimization clips in user code, which may read them: no fold there)
        self._fold = model.automatic_optimization
        try:
            self._after_closure(model, optimizer)
        finally:
            self._fold = False
        return self._step(optimizer, **kwargs)

    def _step(self, optimizer: Any, **kwargs: Any) -> Any:
        try:
            out = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
        finally:
            self._unscaled.clear()
        return out

    def unscale_gradients(self, optimizer: Any) -> None:
        """Unscale ``optimizer``'s gradients once per iteration (fused optimizers included)."""
        optimizer = _unwrap(optimizer)
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    # ------------------------------------------------------------------ clipping
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if not clip_val or clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.clip_grad_by_value(optimizer, clip_val)
        elif gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self.clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        optimizer = _unwrap(optimizer)
        self.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(list(self.main_params(optimizer)), clip_val)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> torch.Tensor:
        """Clip by the global norm; returns it (inf/NaN on an overflow step, which is skipped)."""
        optimizer = _unwrap(optimizer)
        if id(optimizer) not in self._unscaled:
            try:
                norm = self.scaler.clip_grad_norm_(optimizer, clip_val, fold=self._fold)
            except NotImplementedError:
                pass  # several groups or a 2-D mesh (HSDP, TP): refused before any write
            else:
                self._unscaled.add(id(optimizer))
                return norm
        self.unscale_gradients(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(self._model, FullyShardedDataParallel):
            return self._model.clip_grad_norm_(clip_val)  # FSDP1 root: any sharding strategy
        try:  # after unscale_: the norm over shards and ranks of the unscaled gradients
            return self.scaler.clip_grad_norm_(optimizer, clip_val)
        except NotImplementedError:  # 2-D meshes: torch reduces DTensor norms itself
            return torch.nn.utils.clip_grad_norm_(list(self.main_params(optimizer)), clip_val)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint written with Lightning's ``MixedPrecision``/``FSDPPrecision`` holds a
        torch ``GradScaler`` state under their name: load it (shardscale reads torch's keys)."""
        if type(self).__qualname__ in checkpoint or self._dtype != torch.float16:
            return
        for key in _TORCH_SCALER_KEYS:
            if checkpoint.get(key):
                self.scaler.load_state_dict(checkpoint[key])
                return


def _device_type(device: Any) -> str | None:
    """The device type ``device`` names (None for None).

    Raises:
        TypeError: not a str, a ``torch.device`` or an object whose ``.type`` is a str.
    """
    if device is None:
        return None
    kind = device if isinstance(device, str) else getattr(device, "type", None)
    if not isinstance(kind, str):
        raise TypeError(
            "device must be a device type such as 'cuda' or 'cpu', a torch.device or an object "
            f"whose .type is one, got {device!r}."
        )
    return torch.device(kind).type


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer the scaler steps: ``self.optimizers()`` in a LightningModule and
    Fabric's ``setup_optimizers`` hand out wrappers (``LightningModule.clip_gradients`` passes
    them on)."""
    if isinstance(optimizer, (LightningOptimizer, _FabricOptimizer)):
        return optimizer.optimizer
    return optimizer


def _hooks_read_gradients(model: LightningModule) -> bool:
    """Whether user code may look at the gradients between backward and the optimizer step."""
    if any(
        is_overridden(name, model, LightningModule)
        for name in ("on_before_optimizer_step", "configure_gradient_clipping")
    ):
        return True
    return any(
        is_overridden("on_before_optimizer_step", cb, Callback) for cb in model.trainer.callbacks
    )


def _scaler_of(trainer: Trainer) -> ShardedGradScaler | None:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if isinstance(scaler, ShardedGradScaler) else None


class LossScaleMonitor(Callback):
    """Log the loss scale and skipped steps; keep LR schedulers still on skipped steps.

    Works with any precision plugin whose ``scaler`` is a :class:`~shardscale.ShardedGradScaler`
    (:class:`ShardscalePrecision`, or Lightning's ``MixedPrecision(..., scaler=...)``); without one
    it warns at the start of training and does nothing.

    **Logging.** After each optimizer step on which the Trainer logs (every
    ``log_every_n_steps``, as ``LearningRateMonitor``), ``loss_scale``, ``skipped_steps`` and
    ``overflows`` from ``scaler.metrics()`` (one host read, no collective; the values are the
    same on every rank) go to every logger of the Trainer, at the step of the training metrics.
    With ``log_numerics`` (by default: when the scaler's ``policy`` is ``"headroom"``), so do
    the headline figures of :meth:`~shardscale.ShardedGradScaler.numerics` on those steps:
    ``headroom_bits`` (bits to fp16's overflow left by the largest scaled gradient; negative
    or -inf on an overflow) and ``underflow`` (the fraction of gradient elements zero or
    subnormal in fp16, in [0, 1]). They cost one pass over the gradients and one host read per
    parameter group on a logged step, no collective; they are this rank's (its shards under
    FSDP; loggers usually record rank 0's). They are measured in ``on_train_batch_end``, after
    the scaler's ``update()``: in automatic optimization Lightning zeroes the gradients at the
    next window's first backward, so they are the step's (accumulated) gradients, after any
    clipping (a clip scales them down: headroom reads higher, underflow too). In manual
    optimization they are what ``training_step`` leaves: call ``opt.zero_grad()`` before
    ``manual_backward`` (as Lightning's examples do), not after ``opt.step()``; gradients set
    to None there log no figures (zeroed in place, they would read as inf and 1.0).

    **Schedulers.** The Trainer steps ``interval="step"`` schedulers right after the optimizer
    step even when the scaler skipped it (Lightning issues #16228, #5558): the learning rate runs
    ahead of the parameters, and torch warns that ``lr_scheduler.step()`` came before
    ``optimizer.step()`` when the very first step is skipped. No callback hook runs between the
    two: the training loop calls the optimizer step, then the LightningModule hook
    ``lr_scheduler_step(scheduler, metric)`` for each due scheduler. So, from ``on_train_start``
    to the end of training, this callback wraps that hook on the module instance (the module's
    own override, if any, still does the stepping) and calls it only when
    ``scaler.last_step_skipped(scheduler.optimizer)`` is false. Every rank takes the same
    decision (the flag is agreed), fused optimizers included (their flag lives on the device:
    one host read per scheduler step). Schedulers with ``interval="epoch"`` are never held back.
    Nothing is replaced in the schedulers or optimizers, so checkpoints are unchanged; with
    ``frequency=N`` the scheduler is held back when the step just before its turn was skipped.
    Manual optimization: Lightning does not step schedulers; do ``if not
    scaler.last_step_skipped(opt.optimizer): sch.step()`` (``opt = self.optimizers()`` is
    Lightning's wrapper; the scaler knows the torch optimizer).

    Args:
        skip_lr_schedulers: hold ``interval="step"`` schedulers back on skipped steps.
        prefix: prepended to the logged names.
        log_numerics: log ``headroom_bits`` and ``underflow`` too; None: when the scaler's
            ``policy`` is ``"headroom"``.

    Raises:
        TypeError: ``log_numerics`` is not a bool or None.
    """

    def __init__(
        self, skip_lr_schedulers: bool = True, prefix: str = "", log_numerics: bool | None = None
    ) -> None:
        if log_numerics is not None and not isinstance(log_numerics, bool):
            raise TypeError(f"log_numerics must be a bool or None, got {log_numerics!r}.")
        self.skip_lr_schedulers = skip_lr_schedulers
        self.prefix = prefix
        self.log_numerics = log_numerics
        #: scheduler steps held back since the start of this fit
        self.held_back_scheduler_steps = 0
        self._module: LightningModule | None = None
        self._wrapper: Callable[..., Any] | None = None
        self._seen_step = -1

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seen_step = trainer.global_step
        self.held_back_scheduler_steps = 0
        if _scaler_of(trainer) is None:
            rank_zero_warn(
                "LossScaleMonitor: the Trainer's precision plugin has no shardscale "
                "ShardedGradScaler (use ShardscalePrecision); nothing is logged and LR schedulers "
                "step as usual."
            )
            return
        if self.skip_lr_schedulers and "lr_scheduler_step" not in vars(pl_module):
            original = pl_module.lr_scheduler_step

            def lr_scheduler_step(scheduler: Any, metric: Any = None) -> Any:
                if _held_back(trainer, scheduler):
                    self.held_back_scheduler_steps += 1
                    return None
                return original(scheduler, metric)

            pl_module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]
            self._module, self._wrapper = pl_module, lr_scheduler_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._seen_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._seen_step = trainer.global_step
        scaler = _scaler_of(trainer)
        if scaler is None or not trainer.loggers:
            return
        if not trainer._logger_connector.should_update_logs:
            return
        m = scaler.metrics()
        values = {
            f"{self.prefix}loss_scale": float(m["scale"]),
            f"{self.prefix}skipped_steps": float(m["skipped_steps"]),
            f"{self.prefix}overflows": float(m["overflows"]),
        }
        wanted = self.log_numerics
        if wanted if wanted is not None else scaler.config.policy == "headroom":
            numerics = scaler.numerics()  # the step's gradients: Lightning has not zeroed them
            if numerics is not None and numerics.groups:
                values.update((self.prefix + k, v) for k, v in numerics.as_dict().items())
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._unwrap()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._unwrap()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._unwrap()

    def _unwrap(self) -> None:
        module, self._module = self._module, None
        if module is not None and vars(module).get("lr_scheduler_step") is self._wrapper:
            del module.lr_scheduler_step
        self._wrapper = None


def _held_back(trainer: Trainer, scheduler: Any) -> bool:
    """Whether the step just taken by ``scheduler``'s optimizer was skipped (interval "step")."""
    config = next((c for c in trainer.lr_scheduler_configs if c.scheduler is scheduler), None)
    scaler = _scaler_of(trainer)
    if config is None or config.interval != "step" or scaler is None:
        return False
    for optimizer in (getattr(scheduler, "optimizer", None), None):
        try:
            return bool(scaler.last_step_skipped(optimizer))
        except RuntimeError:  # not stepped through this scaler (yet)
            continue
    return False
