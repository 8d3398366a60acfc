"""torchtitan: fp16 training with a :class:`~shardscale.ShardedGradScaler`.

torchtitan trains in bf16 or fp32 and has no loss scaling. This module turns any torchtitan
training config into an fp16 one (``training.mixed_precision_param="float16"``) whose trainer
scales the loss, unscales and checks the gradients (one all-reduce), skips the optimizer and LR
scheduler steps on every rank after an overflow, logs the loss scale and checkpoints the scaler.
Nothing in torchtitan is edited or patched: the trainer is a ``Trainer`` subclass, the loss,
optimizer, LR scheduler, metrics and checkpoint components are torchtitan component subclasses
built from the config.

From torchtitan's command line, name a torchtitan config as ``MODULE:CONFIG`` (``MODULE`` as
``--module`` takes it, a shorthand such as ``llama3`` or a dotted path) after
``--module shardscale.integrations.torchtitan``; the scaler's arguments are the
``--loss_scaling.*`` options::

    torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module shardscale.integrations.torchtitan --config llama3:llama3_debugmodel \\
        --loss_scaling.init_scale 1024 --loss_scaling.hysteresis 2

In Python (a config registry of your own): ``to_fp16(llama3_debugmodel(), init_scale=1024)``.

Importing this module imports torchtitan (``pip install 'shardscale[torchtitan]'``);
``import shardscale`` and ``import shardscale.integrations`` do not.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

try:
    from torch.distributed.checkpoint import FileSystemReader
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.tools.logging import logger
    from torchtitan.trainer import Trainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        raise ImportError(
            "shardscale.integrations.torchtitan needs torchtitan: pip install "
            f"'shardscale[torchtitan]' (importing it failed: {exc})"
        ) from exc
    raise ImportError(
        f"torchtitan is installed but importing its trainer failed: {exc}. torchtitan.trainer "
        "imports triton kernels (a CUDA machine has triton); on a CPU-only machine see "
        "shardscale's docs/torchtitan.md (tests/titan_cpu stands in for them)."
    ) from exc

from shardscale import ShardedGradScaler

__all__ = [
    "LossScalingConfig",
    "Fp16TrainingConfig",
    "ScaledLoss",
    "ShardscaleTrainer",
    "METRIC_SOURCES",
    "SCALER_STATE_KEY",
    "to_fp16",
]

#: The scaler's entry in torchtitan's DCP checkpoints (``--checkpoint.exclude_from_loading
#: loss_scaler`` leaves it out of a load).
SCALER_STATE_KEY = "loss_scaler"


# --------------------------------------------------------------------------------- config
@dataclass(kw_only=True, slots=True)
class LossScalingConfig:
    """The :class:`~shardscale.ShardedGradScaler` of an fp16 run: the ``--loss_scaling.*``
    options of torchtitan's command line (every field is a ``ShardedGradScaler`` argument of
    the same name). Validated on construction: a bad value raises ``TypeError``/``ValueError``
    naming the option."""

    init_scale: float = 2.0**16
    """Initial loss scale (finite, > 0)."""

    growth_factor: float = 2.0
    """Factor the scale grows by after growth_interval clean steps (> 1)."""

    backoff_factor: float = 0.5
    """Factor the scale backs off by after an overflow (in (0, 1))."""

    growth_interval: int = 2000
    """Clean steps before the scale grows (>= 1)."""

    min_scale: float | None = None
    """Smallest scale (None: 2**-126)."""

    max_scale: float | None = None
    """Largest scale (None: 2**127)."""

    hysteresis: int = 1
    """Overflows tolerated before the scale backs off (Megatron-LM's hysteresis)."""

    consecutive_hysteresis: bool = False
    """Count only consecutive overflows against the hysteresis (DeepSpeed)."""

    max_consecutive_skips: int | None = None
    """Raise ScaleCollapseError (or warn, see on_collapse) after this many skipped steps in a
    row (None: never)."""

    on_collapse: Literal["raise", "warn"] = "raise"
    """What a collapse does: raise ScaleCollapseError, or warn."""

    dynamic: bool = True
    """False: the scale stays at init_scale (guard mode: non-finite steps are still skipped)."""

    policy: Literal["torch", "headroom"] = "torch"
    """How the scale moves: torch's rule, or set from the gradients' measured headroom (see
    shardscale's docs/headroom.md)."""

    report_overflows: bool = False
    """Log which parameters overflowed, on which rank, after each overflow (one host read per
    step, one all-gather on overflow)."""

    def __post_init__(self) -> None:
        ShardedGradScaler(device="cpu", **self.scaler_kwargs())  # raises on a bad value

    def scaler_kwargs(self) -> dict[str, Any]:
        """The fields as ``ShardedGradScaler`` keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def build(self, device: torch.device, param_names: Any = None) -> ShardedGradScaler:
        """The scaler, its state placed on ``device`` (before any CUDA graph capture), its
        flag agreed over the default process group (every rank of every mesh dimension)."""
        kwargs = self.scaler_kwargs()
        scaler = ShardedGradScaler(device=device.type, param_names=param_names, **kwargs)
        scaler.place(device)
        return scaler


@dataclass(kw_only=True, slots=True)
class Fp16TrainingConfig(TrainingConfig):
    """torchtitan's ``TrainingConfig`` with ``"float16"`` among the mixed-precision parameter
    dtypes (FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``), and as the default."""

    mixed_precision_param: Literal["float16", "bfloat16", "float32"] = "float16"


# ----------------------------------------------------------------------------------- loss
class _ScaleGradient(torch.autograd.Function):
    """Identity forward (the true loss value), gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale  # read at backward time (no version check: the buffer is refreshed)
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale.to(dtype=grad.dtype), None


class ScaledLoss(BaseLoss):
    """A torchtitan loss whose gradient is multiplied by the loss scale, its value unchanged.

    :func:`to_fp16` puts it where the backward runs: inside ``ChunkedLossWrapper`` (which calls
    ``backward()`` on each chunk's loss itself and ignores the gradient of the loss it returns,
    so scaling the returned loss would scale nothing) around the per-chunk loss, otherwise
    around the whole loss. The logged loss stays the true one.

    ``scale`` is a 0-d float32 tensor on the training device that :class:`ShardscaleTrainer`
    refreshes from the scaler before each forward-backward (outside any CUDA graph, so a
    captured backward reads the current scale). Under ``no_grad`` (validation) it is the inner
    loss unchanged.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        loss_fn: BaseLoss.Config = field(default_factory=CrossEntropyLoss.Config)
        """The loss whose gradient is scaled."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None) -> None:
        self.loss_fn: BaseLoss = config.loss_fn.build(compile_config=compile_config)
        self.scale: torch.Tensor | None = None

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = self.loss_fn(pred, labels, global_valid_tokens, **kwargs)
        if loss.requires_grad:
            if self.scale is None:
                raise RuntimeError(
                    "ScaledLoss has no loss scale: it is set by ShardscaleTrainer (build the "
                    "trainer from a config made by shardscale.integrations.torchtitan.to_fp16)."
                )
            loss = _ScaleGradient.apply(loss, self.scale)
        return loss, metrics


def _losses(loss: Any) -> list[Any]:
    """``loss`` and the losses it wraps (``loss_fn`` attributes), outermost first."""
    out = []
    while loss is not None and len(out) < 16:
        out.append(loss)
        loss = getattr(loss, "loss_fn", None)
    return out


def _scaled_loss_config(loss: BaseLoss.Config) -> BaseLoss.Config:
    """``loss`` with a :class:`ScaledLoss` where its backward runs (unchanged if it has one)."""
    if any(isinstance(c, ScaledLoss.Config) for c in _losses(loss)):
        return loss
    if isinstance(loss, ChunkedLossWrapper.Config):  # backward() per chunk, on its inner loss
        return dataclasses.replace(loss, loss_fn=ScaledLoss.Config(loss_fn=loss.loss_fn))
    return ScaledLoss.Config(loss_fn=loss)


# ---------------------------------------------------------------------------- components
def _scale_and_skips(scaler: ShardedGradScaler) -> dict[str, float]:
    m = scaler.metrics()  # one host read
    return {"loss_scale": m["scale"], "skipped_steps": m["skipped_steps"]}


def _headroom_figures(scaler: ShardedGradScaler) -> dict[str, float]:
    """With ``policy="headroom"``: the last step's headroom bits and underflow fraction
    (:meth:`ShardedGradScaler.numerics`, one pass over the gradients when logged)."""
    if scaler.config.policy != "headroom":
        return {}
    numerics = scaler.numerics()
    return {} if numerics is None else numerics.as_dict()


#: Where the scaler's figures in torchtitan's metrics come from: each entry takes the scaler
#: and returns ``{name: number}``, merged into every metrics log, in order. Add a source in
#: one line, e.g. ``METRIC_SOURCES.append(lambda scaler: scaler.numerics())``.
METRIC_SOURCES: list[Callable[[ShardedGradScaler], Mapping[str, float]]] = [
    _scale_and_skips,
    _headroom_figures,
]


def scaler_metrics(scaler: ShardedGradScaler) -> dict[str, float]:
    """Every :data:`METRIC_SOURCES` entry's figures for ``scaler``, merged."""
    out: dict[str, float] = {}
    for source in METRIC_SOURCES:
        out.update(source(scaler))
    return out


class _ScaledStep:
    """Optimizer container: ``step()`` steps each optimizer through the scaler (skipped on every
    rank after an overflow), then ``update()``s the scale once."""

    scaler: ShardedGradScaler | None = None

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        scaler = self.scaler
        if scaler is None:  # not attached (built outside ShardscaleTrainer)
            return super().step(closure)  # type: ignore[misc]
        if closure is not None:
            raise ValueError("the loss-scaled optimizer container does not take a closure.")
        for optimizer in self.optimizers:  # type: ignore[attr-defined]
            scaler.step(optimizer)
        scaler.update()
        return None


class _ScalerMetrics:
    """Metrics processor: every training log gains :func:`scaler_metrics` (``loss_scale``,
    ``skipped_steps``), in the loggers (TensorBoard, W&B) and on the console."""

    scaler: ShardedGradScaler | None = None

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        figures = scaler_metrics(self.scaler) if self.scaler is not None else {}
        super().log(  # type: ignore[misc]
            step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **figures}
        )
        if figures:
            shown = "  ".join(f"{k}: {v:g}" for k, v in figures.items())
            logger.info(f"step: {step:2}  {shown}")


class _ScalerCheckpoint:
    """DCP checkpoint manager: a checkpoint without the scaler's state (saved before fp16 loss
    scaling was switched on) still loads, the scaler starting afresh, with a warning."""

    def dcp_load(
        self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        if SCALER_STATE_KEY in state_dict and not from_hf and not _has_scaler(checkpoint_id):
            scaler = state_dict[SCALER_STATE_KEY]
            logger.warning(
                f"Checkpoint {checkpoint_id} has no '{SCALER_STATE_KEY}' state (saved before "
                "shardscale's fp16 loss scaling was switched on): loading everything else; the "
                f"loss scale starts at {scaler.get_scale():g}."
            )
            state_dict = {k: v for k, v in state_dict.items() if k != SCALER_STATE_KEY}
        return super().dcp_load(  # type: ignore[misc]
            state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized
        )


def _has_scaler(checkpoint_id: str) -> bool:
    """Whether the DCP checkpoint ``checkpoint_id`` holds the scaler's state (True for a
    checkpoint that is not a local folder: the strict load then decides)."""
    if not os.path.isdir(checkpoint_id):
        return True
    saved = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    return any(k.startswith(f"{SCALER_STATE_KEY}.") for k in saved)


class SkipAwareLRSchedulers(LRSchedulersContainer):
    """torchtitan's LR schedulers, held still on a step the scaler skipped (one host read per
    step; the skip is agreed, so every rank holds). Wraps the container the config built:
    state dicts and metrics are its own."""

    scaler: ShardedGradScaler | None = None

    def __init__(self, inner: LRSchedulersContainer) -> None:
        self.inner = inner
        self.schedulers = inner.schedulers

    def step(self) -> None:
        if self.scaler is not None and bool(self.scaler.last_step_skipped()):
            return
        self.inner.step()

    def get_metrics(self) -> dict[str, float]:
        return self.inner.get_metrics()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


class _SkipAwareLRBuild:
    """LR scheduler config: ``build()`` wraps what the config builds in
    :class:`SkipAwareLRSchedulers` (torchtitan's LR config builds its container class
    directly, so a container subclass cannot be named by the config)."""

    __slots__ = ()

    def build(self, **kwargs: Any) -> SkipAwareLRSchedulers:
        inner = super().build(**kwargs)  # type: ignore[misc]
        return SkipAwareLRSchedulers(inner)


_DERIVED: dict[tuple[type, ...], type] = {}


def _derived_config(config: Any, mixin: type, prefix: str) -> Any:
    """``config`` (a torchtitan component's Config instance) as an instance of a subclass whose
    component (the class ``build()`` constructs) has ``mixin``'s methods first; the classes are
    made once per (config class, mixin)."""
    base = type(config)
    owner = base._owner
    doc = f"torchtitan's {owner.__name__} with {mixin.__doc__}"
    return _copy_into(_config_class(base, mixin, f"{prefix}{owner.__name__}", [], doc), config)


def _config_class(base: type, mixin: type, name: str, fields: list, doc: str) -> type:
    """The Config class (a subclass of ``base`` with ``fields``) of a component class ``name``
    deriving from ``mixin`` and ``base``'s component: made once per (``base``, ``mixin``)."""
    key = (base, mixin)
    if key not in _DERIVED:
        derived_config = dataclasses.make_dataclass(
            "Config",
            fields,
            bases=(base,),
            kw_only=True,
            slots=True,
            namespace={"__module__": __name__, "__qualname__": f"{name}.Config"},
        )
        _DERIVED[key] = types.new_class(
            name,
            (mixin, base._owner),
            exec_body=lambda ns: ns.update(
                Config=derived_config, __module__=__name__, __qualname__=name, __doc__=doc
            ),
        ).Config
    return _DERIVED[key]


def _derived_lr_config(config: Any) -> Any:
    base = type(config)
    key = (base, _SkipAwareLRBuild)
    if key not in _DERIVED:
        _DERIVED[key] = dataclasses.make_dataclass(
            f"SkipAware{base.__name__}",
            [],
            bases=(_SkipAwareLRBuild, base),
            kw_only=True,
            slots=True,
            namespace={"__module__": __name__},
        )
    return _copy_into(_DERIVED[key], config)


def _copy_into(cls: type, config: Any) -> Any:
    if type(config) is cls:
        return config
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})


# -------------------------------------------------------------------------------- trainer
class _LossScaling:
    """What :class:`ShardscaleTrainer` adds to a torchtitan trainer (a mixin, so that any
    ``Trainer`` subclass gets it: :func:`to_fp16` derives one per trainer class)."""

    scaler: ShardedGradScaler

    def __init__(self, config: Any) -> None:
        if config.parallelism.pipeline_parallel_degree > 1:
            raise NotImplementedError(
                "shardscale's torchtitan integration does not support pipeline parallelism yet: "
                "set --parallelism.pipeline_parallel_degree 1 (FSDP2, TP and gradient accumulation "
                "are supported)."
            )
        config = _with_scaled_components(config)
        super().__init__(config)  # type: ignore[call-arg]
        self._setup_loss_scaling()

    def _setup_loss_scaling(self) -> None:
        t: Any = self
        parts = t.model_parts
        names = parts[0] if len(parts) == 1 else None  # overflow reports name parameters
        scaler = t.config.loss_scaling.build(t.device, param_names=names)
        self.scaler = scaler
        self._one = torch.ones((), dtype=torch.float32, device=t.device)
        self._loss_scale = torch.ones((), dtype=torch.float32, device=t.device)
        scaled = [loss for loss in _losses(t.loss_fn) if isinstance(loss, ScaledLoss)]
        if len(scaled) != 1:
            raise RuntimeError(
                f"expected one ScaledLoss in the trainer's loss, found {len(scaled)} "
                f"({type(t.loss_fn).__name__}): the loss was replaced after the config was made."
            )
        scaled[0].scale = self._loss_scale
        for component in (t.optimizers, t.lr_schedulers, t.metrics_processor):
            if not hasattr(type(component), "scaler"):
                raise RuntimeError(
                    f"{type(component).__name__} was not built from shardscale's config (the "
                    "trainer's components were replaced after its config was made)."
                )
            component.scaler = scaler
        checkpointer = t.checkpointer
        if getattr(checkpointer, "enable", False):
            checkpointer.states[SCALER_STATE_KEY] = scaler
        self._backwards = 0

    def train_step(self, data_iterator: Any) -> Any:
        self._backwards = 0
        return super().train_step(data_iterator)  # type: ignore[misc]

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        """torchtitan's forward-backward with the loss scaled; after the last one of the step
        (``gradient_accumulation_steps`` of them), :meth:`unscale_gradients`."""
        t: Any = self
        # outside any CUDA graph: a captured backward reads the buffer, not the scaler
        self._loss_scale.copy_(self.scaler.scale(self._one))
        loss = super().forward_backward_step(**kwargs)  # type: ignore[misc]
        self._backwards += 1
        if self._backwards == t.gradient_accumulation_steps:
            self.unscale_gradients()
        return loss

    def unscale_gradients(self) -> None:
        """Divide every optimizer's gradients by the scale and agree on inf/NaN across ranks (one
        all-reduce per optimizer). Runs after the step's last backward, before torchtitan clips
        the gradients (so its ``grad_norm`` is the true norm, inf on an overflow step, which
        the optimizer step then skips on every rank)."""
        for optimizer in self.optimizers:  # type: ignore[attr-defined]
            self.scaler.unscale_(optimizer)


def _with_scaled_components(config: Any) -> Any:
    """A copy of the trainer ``config`` whose loss, optimizer, LR scheduler, metrics and (DCP)
    checkpoint components are shardscale's subclasses of the configured ones."""
    changes = {
        "loss": _scaled_loss_config(config.loss),
        "optimizer": _derived_config(config.optimizer, _ScaledStep, "LossScaled"),
        "lr_scheduler": _derived_lr_config(config.lr_scheduler),
        "metrics": _derived_config(config.metrics, _ScalerMetrics, "LossScale"),
    }
    if isinstance(config.checkpoint, CheckpointManager.Config):
        changes["checkpoint"] = _derived_config(config.checkpoint, _ScalerCheckpoint, "LossScaler")
    return dataclasses.replace(config, **changes)


class ShardscaleTrainer(_LossScaling, Trainer):
    """torchtitan's ``Trainer`` with fp16 loss scaling by a :class:`~shardscale.ShardedGradScaler`.

    Built from a config made by :func:`to_fp16` (its ``Config`` adds ``loss_scaling``). Per
    step: the loss gradient is scaled where the backward runs (:class:`ScaledLoss`); after the
    step's last microbatch the gradients are unscaled and checked, one all-reduce agreeing on
    inf/NaN over every rank; torchtitan then clips them (its DTensor norm: ``grad_norm`` is the
    true norm); the optimizer step and the LR scheduler step are skipped on every rank after an
    overflow, and the scale backs off (or grows after ``growth_interval`` clean steps).
    ``loss_scale`` and ``skipped_steps`` join torchtitan's metrics; the scaler's state is the
    ``loss_scaler`` entry of its DCP checkpoints (resumed exactly).

    Attributes:
        scaler: the :class:`~shardscale.ShardedGradScaler` (on the training device).

    Raises:
        NotImplementedError: pipeline parallelism (not supported yet).
        RuntimeError: the trainer's loss or components were replaced after the config was made.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        loss_scaling: LossScalingConfig = field(default_factory=LossScalingConfig)
        """The loss scaler (shardscale.ShardedGradScaler's arguments)."""


# ------------------------------------------------------------------------------ to_fp16
def _trainer_config_class(base: type) -> type:
    """The Config class of the loss-scaling trainer for the trainer Config class ``base``."""
    if issubclass(base, ShardscaleTrainer.Config) or "loss_scaling" in {
        f.name for f in dataclasses.fields(base)
    }:
        return base
    if base is Trainer.Config:
        return ShardscaleTrainer.Config
    owner = base._owner
    if not (isinstance(owner, type) and issubclass(owner, Trainer)):
        raise TypeError(
            f"to_fp16() takes a torchtitan trainer config (a Trainer.Config), got {base.__name__}."
        )
    loss_scaling = ("loss_scaling", LossScalingConfig, field(default_factory=LossScalingConfig))
    doc = f"torchtitan's {owner.__name__} with fp16 loss scaling by shardscale."
    return _config_class(base, _LossScaling, f"Shardscale{owner.__name__}", [loss_scaling], doc)


def _fp16_training(training: TrainingConfig) -> TrainingConfig:
    if isinstance(training, Fp16TrainingConfig):
        return training
    if type(training) is TrainingConfig:
        cls: type = Fp16TrainingConfig
    else:  # a TrainingConfig subclass: widen its mixed_precision_param the same way
        key = (type(training), Fp16TrainingConfig)
        if key not in _DERIVED:
            _DERIVED[key] = dataclasses.make_dataclass(
                f"Fp16{type(training).__name__}",
                [
                    (
                        "mixed_precision_param",
                        Literal["float16", "bfloat16", "float32"],
                        field(default="float16"),
                    )
                ],
                bases=(type(training),),
                kw_only=True,
                slots=True,
                namespace={"__module__": __name__},
            )
        cls = _DERIVED[key]
    values = {f.name: getattr(training, f.name) for f in dataclasses.fields(training) if f.init}
    values["mixed_precision_param"] = "float16"
    return cls(**values)


def to_fp16(config: Trainer.Config, **loss_scaling: Any) -> Trainer.Config:
    """Turn a torchtitan training config into an fp16 one trained by :class:`ShardscaleTrainer`.

    The result has every field of ``config`` (shared, not copied), plus ``loss_scaling`` (a
    :class:`LossScalingConfig`); parameters compute in fp16
    (``training.mixed_precision_param="float16"``, FSDP2's ``MixedPrecisionPolicy``; gradients
    are still reduced in ``training.mixed_precision_reduce``, float32), and ``config.build()``
    builds the loss-scaling trainer. A config of a ``Trainer`` subclass (e.g. an experiment's)
    gets a loss-scaling subclass of that trainer. Calling it on its own result changes only the
    scaler arguments given.

    Args:
        config: a ``torchtitan.trainer.Trainer.Config`` (or a subclass's), e.g. from a
            ``config_registry`` function.
        **loss_scaling: :class:`LossScalingConfig` fields (``init_scale``, ``growth_interval``,
            ``hysteresis``, ...).

    Returns:
        The fp16 config (host-side only; nothing is built or placed on a device).

    Raises:
        TypeError: ``config`` is not a trainer config, or a bad scaler argument.
        ValueError: a bad scaler value (named in the message).
    """
    if not isinstance(config, Trainer.Config):
        raise TypeError(
            "to_fp16() takes a torchtitan trainer config (Trainer.Config), got "
            f"{type(config).__name__}."
        )
    cls = _trainer_config_class(type(config))
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values["training"] = _fp16_training(config.training)
    base = values.get("loss_scaling")
    base_kwargs = base.scaler_kwargs() if isinstance(base, LossScalingConfig) else {}
    values["loss_scaling"] = LossScalingConfig(**{**base_kwargs, **loss_scaling})
    return cls(**values)


# ------------------------------------------------------- torchtitan's --module/--config
def _registry(module_name: str) -> Any:
    """The module ``--module MODULE`` names, resolved as torchtitan's ConfigManager does (a
    shorthand of torchtitan's models and experiments, or a dotted path, with or without
    ``.config_registry``); an import error inside it is raised as it is."""
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    if module_name in _supported_models | _supported_experiments:
        prefixes = (
            "torchtitan.models",
            "torchtitan.experiments",
            "torchtitan.experiments.rl.examples",
        )
        candidates = [f"{p}.{module_name}.config_registry" for p in prefixes]
    else:
        candidates = [f"{module_name}.config_registry", module_name]
    for candidate in candidates:
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as exc:
            if exc.name is None or not candidate.startswith(exc.name):
                raise  # the module exists but an import inside it failed
    raise ValueError(
        f"--config {module_name}:...: no module {module_name!r} (tried {candidates}); use a "
        "torchtitan shorthand (llama3, qwen3, deepseek_v3, ...) or a dotted module path."
    )


def _fp16_config_function(name: str) -> Callable[[], Trainer.Config]:
    module_name, _, config_name = name.partition(":")
    if not module_name or not config_name or ":" in config_name:
        raise ValueError(
            f"--config {name!r}: with --module {__name__}, name a torchtitan config as "
            "MODULE:CONFIG, e.g. --config llama3:llama3_debugmodel."
        )
    registry = _registry(module_name)
    function = getattr(registry, config_name, None)
    if not callable(function):
        available = sorted(
            n for n in dir(registry) if n[:1].islower() and callable(getattr(registry, n))
        )
        raise ValueError(
            f"--config {name!r}: {registry.__name__} has no config function {config_name!r}. "
            f"Available: {available}"
        )

    def fp16_config() -> Trainer.Config:
        return to_fp16(function())

    fp16_config.__name__ = fp16_config.__qualname__ = name
    fp16_config.__doc__ = f"{registry.__name__}.{config_name}() in fp16 with shardscale's scaler."
    return fp16_config


def __getattr__(name: str) -> Any:
    """``MODULE:CONFIG`` (torchtitan's ``--config`` with ``--module
    shardscale.integrations.torchtitan``): a config function returning
    ``to_fp16(MODULE.CONFIG())``. Raises ``ValueError`` naming the fix for a name with a colon
    that names no config."""
    if ":" in name:
        return _fp16_config_function(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
