"""Scale-policy configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
import warnings
from typing import Literal

import torch

#: Smallest scale allowed by default: the smallest normal float32 (2**-126). Reaching it means
#: ~142 consecutive overflows from the default initial scale, i.e. a collapsed run.
DEFAULT_MIN_SCALE = 2.0**-126
#: Largest scale allowed by default: the largest power of two below float32's max (2**127).
DEFAULT_MAX_SCALE = 2.0**127
_FLOAT32_MAX = 3.4028234663852886e38

OnCollapse = Literal["raise", "warn"]
Policy = Literal["torch", "headroom"]
#: ``policy="headroom"``'s defaults (evidence: ``docs/headroom.md``): bits kept between the
#: measured gradient amax times the scale and fp16's largest value (plus log2 of the ranks), and
#: the clean measurements remembered.
HEADROOM_MARGIN = 3.0
HEADROOM_HISTORY = 50


def check_real(name: str, value: object) -> float:
    """``value`` as a finite float (Python/NumPy scalars, a 1-element float tensor read once).
    Raises TypeError/ValueError naming ``name``."""
    # numbers.Real covers Python and NumPy scalars; a 1-element tensor is read once (as torch does)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r}).")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")
    return value


def check_flag(name: str, value: object, expected: str = "a bool") -> bool:
    """``value`` as a bool: ``True``/``False``, a NumPy bool, or the ints 0 and 1 (torch's
    ``GradScaler`` takes ``enabled=0``); one rule for every flag. Raises TypeError naming
    ``name``."""
    numpy_bool = type(value).__module__ == "numpy" and "bool" in type(value).__name__
    if isinstance(value, (bool, numbers.Integral)) and value in (0, 1) or numpy_bool:
        return bool(value)
    raise TypeError(f"{name} must be {expected} (True/False, or 0/1), got {value!r}.")


#: Largest value of an int32 tracker (torch's growth tracker, our hysteresis tracker).
INT32_MAX = 2**31 - 1
#: Largest value of an int64 counter / setting compared with one.
INT64_MAX = 2**63 - 1


def check_int(name: str, value: object, minimum: int, maximum: int = INT64_MAX) -> int:
    """``value`` as an int in ``[minimum, maximum]``. Raises TypeError/ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r}).")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    if value > maximum:
        raise ValueError(
            f"{name} must be <= {maximum} (it is held in a "
            f"{'32' if maximum == INT32_MAX else '64'}-bit integer tensor), got {value}."
        )
    return value


def check_growth_factor(value: object) -> float:
    """Validate ``growth_factor`` (> 1). Raises TypeError/ValueError naming the argument."""
    v = check_real("growth_factor", value)
    if v <= 1.0:
        raise ValueError(f"growth_factor must be > 1.0, got {v}.")
    return v


def check_backoff_factor(value: object) -> float:
    """Validate ``backoff_factor`` (in the open interval (0, 1))."""
    v = check_real("backoff_factor", value)
    if not 0.0 < v < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {v}.")
    return v


def _swapped(fields: dict[str, object]) -> str:
    """The constructor's hint for a growth and a backoff factor that look swapped (torch's FSDP
    ``ShardedGradScaler`` takes them in the other order), or ``""``."""
    growth, backoff = fields.get("growth_factor"), fields.get("backoff_factor")
    if (isinstance(growth, (int, float)) and 0.0 < growth < 1.0) or (
        isinstance(backoff, (int, float)) and backoff > 1.0
    ):
        return (
            " (The factors look swapped: torch's FSDP ShardedGradScaler takes backoff_factor "
            "before growth_factor positionally; pass both by keyword.)"
        )
    return ""


def check_growth_interval(value: object) -> int:
    """Validate ``growth_interval`` (an int >= 1)."""
    return check_int("growth_interval", value, 1)


def round_f32(x: float) -> float:
    """``x`` rounded to float32 (the scale tensor's dtype); ``x`` within float32's range."""
    return struct.unpack("f", struct.pack("f", x))[0]


def check_scale(name: str, value: object, min_scale: float, max_scale: float) -> float:
    """Validate a scale value: finite, > 0 and inside ``[min_scale, max_scale]``, the bounds
    widened to their float32 roundings (a float32 scale clamped at a bound that float32 cannot
    hold, e.g. 1e-4, sits just outside it and must load back from a state_dict)."""
    v = check_real(name, value)
    if v <= 0.0:
        raise ValueError(f"{name} must be > 0, got {v}.")
    lo, hi = min(min_scale, round_f32(min_scale)), max(max_scale, round_f32(max_scale))
    if not lo <= v <= hi:
        raise ValueError(
            f"{name}={v} lies outside [min_scale, max_scale] = [{min_scale}, {max_scale}]; "
            "change the value or the bounds."
        )
    return v


#: The policy's fields (``ScalerConfig`` attribute names), in order: what a state dict may carry
#: and what the ranks' agreement compares.
POLICY_FIELDS = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_scale",
    "max_scale",
    "hysteresis",
    "consecutive_hysteresis",
    "dynamic",
    "max_consecutive_skips",
    "on_collapse",
    "policy",
    "headroom_margin",
    "headroom_history",
    "measure_every",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalerConfig:
    """The dynamic loss-scale policy: how the scale moves after each step.

    All values are plain Python numbers; the scale itself lives in :class:`ScaleState`.

    Attributes:
        growth_factor: factor (> 1) applied after ``growth_interval`` clean steps in a row.
        backoff_factor: factor in (0, 1) applied when an overflow (inf/NaN) backs the scale off.
        growth_interval: clean steps (>= 1) in a row before the scale grows.
        min_scale: floor of the scale (>= 2**-126, so 1/scale stays finite in float32). The
            scale never goes below it, so it can never reach 0 (torch's GradScaler reaches
            exactly 0.0 after 166 overflows).
        max_scale: ceiling of the scale (<= float32 max, >= min_scale); the scale never
            becomes inf.
        hysteresis: overflowing steps tolerated before the scale backs off (>= 1; 1 = back off on
            every overflow, torch's behaviour). As Megatron-LM's ``DynamicGradScaler``
            (``hysteresis``) and DeepSpeed's ``DynamicLossScaler`` (``delayed_shift``).
        consecutive_hysteresis: if False (Megatron-LM), the hysteresis budget is refilled only
            when the scale grows; if True (DeepSpeed's ``consecutive_hysteresis=True``), it is
            refilled on every clean step, so only *consecutive* overflows count.
        dynamic: if False the scale stays at its initial value (e.g. 1.0 in bf16 guard mode);
            non-finite gradients are still detected and the step still skipped on every rank.
        max_consecutive_skips: if set (>= 1), this many skipped steps in a row count as a
            collapse (see ``on_collapse``).
        on_collapse: ``"raise"`` raises :class:`~shardscale.ScaleCollapseError`, ``"warn"``
            emits a ``RuntimeWarning`` and goes on. A collapse is an overflow while the scale
            already sits at ``min_scale`` (as DeepSpeed's ``raise_error_at_min_scale``), or
            ``max_consecutive_skips`` skipped steps in a row.
        policy: ``"torch"`` (default): torch's rule (growth after ``growth_interval`` clean
            steps). ``"headroom"``: the next scale keeps the largest |scaled gradient| measured
            over the last ``headroom_history`` clean steps ``headroom_margin + log2(ranks)``
            bits below fp16's largest value (``docs/headroom.md``; ``growth_factor`` and
            ``growth_interval`` are then unused, an overflow still backs off).
        headroom_margin: bits (>= 0, <= 64) kept below 65504 by ``"headroom"``, before the
            log2 of the agreement groups' size is added. Default 3.0.
        headroom_history: clean measurements (>= 1, <= 65536) whose maximum sets the scale.
            Default 50.
        measure_every: measure every k-th update (>= 1) on non-fused steps (one read pass of the
            gradients each); fused steps measure in their check pass, always. Default 1.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range; the message names the field and the range.
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = DEFAULT_MIN_SCALE
    max_scale: float = DEFAULT_MAX_SCALE
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    dynamic: bool = True
    max_consecutive_skips: int | None = None
    on_collapse: OnCollapse = "raise"
    policy: Policy = "torch"
    headroom_margin: float = HEADROOM_MARGIN
    headroom_history: int = HEADROOM_HISTORY
    measure_every: int = 1

    @property
    def headroom(self) -> bool:
        """Whether the scale follows the measured gradient amax (``policy="headroom"``)."""
        return self.policy == "headroom" and self.dynamic

    @property
    def lowest(self) -> float:
        """The smallest scale the rule sets: ``min_scale``; ``max(min_scale, 1)`` with
        ``policy="headroom"`` (the scale stays >= 1, so the host knows 1/scale <= 1 without a
        read: no second check, a fused step keeps its fold; ``docs/headroom.md``)."""
        return max(self.min_scale, 1.0) if self.headroom else self.min_scale

    @property
    def floor(self) -> float:
        """The scale the backoffs stop at (a backoff due there is a collapse): ``min_scale``;
        with ``policy="headroom"``, whose scales are powers of two, the smallest power of two
        >= :attr:`lowest` (within ``max_scale``: checked in ``__post_init__``)."""
        if not self.headroom:
            return self.min_scale
        return 2.0 ** math.ceil(math.log2(self.lowest))

    @property
    def plain(self) -> bool:
        """torch's rule with bounds: dynamic, every overflow backs off (hysteresis 1), no skip
        guard. Its update is torch's kernel and the counters (``_policy``'s plain path)."""
        return (
            not self.headroom
            and self.dynamic
            and self.hysteresis == 1
            and not self.consecutive_hysteresis
            and self.max_consecutive_skips is None
        )

    def with_growth_factor(self, value: object) -> ScalerConfig:
        """This policy with ``growth_factor`` replaced (validated first)."""
        return dataclasses.replace(self, growth_factor=check_growth_factor(value))

    def with_backoff_factor(self, value: object) -> ScalerConfig:
        """This policy with ``backoff_factor`` replaced (validated first)."""
        return dataclasses.replace(self, backoff_factor=check_backoff_factor(value))

    def with_growth_interval(self, value: object) -> ScalerConfig:
        """This policy with ``growth_interval`` replaced (validated first)."""
        return dataclasses.replace(self, growth_interval=check_growth_interval(value))

    def __post_init__(self) -> None:
        check_growth_factor(self.growth_factor)
        check_backoff_factor(self.backoff_factor)
        check_growth_interval(self.growth_interval)
        lo = check_real("min_scale", self.min_scale)
        hi = check_real("max_scale", self.max_scale)
        if lo < DEFAULT_MIN_SCALE:
            raise ValueError(
                f"min_scale must be >= 2**-126 (the smallest normal float32), got {lo}: below it "
                "1/scale overflows float32 to inf and zero gradients are unscaled to NaN."
            )
        if hi > _FLOAT32_MAX:
            raise ValueError(
                f"max_scale must be <= {_FLOAT32_MAX} (the largest float32), got {hi}: a larger "
                "bound lets the float32 scale become inf."
            )
        if hi < lo:
            raise ValueError(f"max_scale ({hi}) must be >= min_scale ({lo}).")
        check_int("hysteresis", self.hysteresis, 1, INT32_MAX)  # the tracker is int32
        for name in ("consecutive_hysteresis", "dynamic"):
            object.__setattr__(self, name, check_flag(name, getattr(self, name)))
        if self.max_consecutive_skips is not None:
            check_int("max_consecutive_skips", self.max_consecutive_skips, 1)
        if self.on_collapse not in ("raise", "warn"):
            raise ValueError(f"on_collapse must be 'raise' or 'warn', got {self.on_collapse!r}.")
        if self.policy not in ("torch", "headroom"):
            raise ValueError(f"policy must be 'torch' or 'headroom', got {self.policy!r}.")
        margin = check_real("headroom_margin", self.headroom_margin)
        if not 0.0 <= margin <= 64.0:
            raise ValueError(f"headroom_margin must be in [0, 64] bits, got {margin}.")
        check_int("headroom_history", self.headroom_history, 1, 65536)
        check_int("measure_every", self.measure_every, 1, INT32_MAX)
        if self.headroom and 2.0 ** math.ceil(math.log2(max(lo, 1.0))) > hi:
            raise ValueError(
                f"min_scale and max_scale [{lo:g}, {hi:g}] hold no power of two >= "
                f"max(min_scale, 1) = {max(lo, 1.0):g}, and policy='headroom' sets its scales "
                "to powers of two (its backoffs would stop short of the collapse guard): widen "
                f"max_scale to {2.0 ** math.ceil(math.log2(max(lo, 1.0))):g} or more."
            )
        # Store normalised floats (ints are accepted for the float fields).
        # Store plain Python numbers (NumPy scalars and 1-element tensors are accepted).
        for name in (
            "growth_factor",
            "backoff_factor",
            "min_scale",
            "max_scale",
            "headroom_margin",
        ):
            object.__setattr__(self, name, check_real(name, getattr(self, name)))
        for name in (
            "growth_interval",
            "hysteresis",
            "max_consecutive_skips",
            "headroom_history",
            "measure_every",
        ):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))


@dataclasses.dataclass(frozen=True)
class Settings:
    """The constructor's arguments, validated (:func:`settings`).

    Attributes:
        device_type: torch's ``GradScaler._device`` (e.g. ``"cuda"``, ``"cpu"``).
        enabled: whether scaling is on.
        config: the policy.
        init_scale: the initial loss scale, inside the policy's bounds.
        report_overflows, rank_local_params: as the constructor's.
    """

    device_type: str
    enabled: bool
    config: ScalerConfig
    init_scale: float
    report_overflows: bool
    rank_local_params: bool


#: The initial scale when none is given (torch's), clamped into the bounds.
DEFAULT_INIT_SCALE = 2.0**16


def device_type(device: object) -> str:
    """The device type a constructor's ``device`` names: a str (``"cuda"``, ``"cuda:1"``), a
    ``torch.device``, or any object whose ``.type`` is one (as torch's ``GradScaler`` takes
    it); None: ``"cuda"`` if available, else ``"cpu"``. Another object is taken as None with
    a warning: torch's scaler stores it unused (Lightning's own tests pass a ``Mock``), the
    scale goes where the first scaled loss is.

    Raises:
        TypeError: a number, bytes or a container. ValueError: a string torch does not know
            as a device.
    """
    default = "cuda" if torch.cuda.is_available() else "cpu"
    if device is None:
        return default
    if isinstance(device, (numbers.Number, bytes, list, tuple, dict, set)):
        raise TypeError(
            "device must be a str, a torch.device or an object whose .type is a device type "
            f"string, got {type(device).__name__}."
        )
    kind = device if isinstance(device, str) else getattr(device, "type", None)
    if not isinstance(kind, str):
        warnings.warn(
            f"device={type(device).__name__} names no device (a str, a torch.device or an "
            f"object whose .type is a device type string): taken as {default!r}, and the scale "
            "is placed where the first scaled loss is. Pass a device such as 'cuda'.",
            stacklevel=4,
        )
        return default
    try:
        kind = torch.device(kind).type
    except RuntimeError as e:
        raise ValueError(f"device={kind!r} is not a device torch knows: {e}") from None
    if kind == "meta":
        raise ValueError(
            "device='meta' holds no data, and the loss scale is a tensor: pass the device the "
            "loss will be on ('cuda', 'cpu', ...)."
        )
    return kind


def settings(
    device: object,
    init_scale: object,
    enabled: object,
    report_overflows: object,
    rank_local_params: object,
    **policy: object,
) -> Settings:
    """Validate ``ShardedGradScaler``'s arguments (``policy``: :class:`ScalerConfig`'s fields,
    ``min_scale``/``max_scale`` None for their defaults; ``init_scale`` None for
    :data:`DEFAULT_INIT_SCALE` clamped into the bounds) before anything is built.

    Raises:
        TypeError, ValueError: the first bad argument, named, with the range it must be in.
    """
    kind = device_type(device)
    enabled = check_flag("enabled", enabled)
    fields = {k: v for k, v in policy.items() if v is not None or k == "max_consecutive_skips"}
    try:
        config = ScalerConfig(**fields)  # type: ignore[arg-type]
    except ValueError as e:
        if str(e).startswith(("growth_factor ", "backoff_factor ")):
            raise ValueError(f"{e}{_swapped(fields)}") from None
        raise
    if config.policy == "headroom":
        _check_headroom_args(config)
    else:
        _check_torch_args(config)
    if init_scale is None:  # not given: torch's default, inside the bounds asked for
        init = min(max(DEFAULT_INIT_SCALE, config.floor), config.max_scale)
    else:
        init = check_policy_scale("init_scale", init_scale, config)
    flags = [
        check_flag(name, flag)
        for name, flag in (
            ("report_overflows", report_overflows),
            ("rank_local_params", rank_local_params),
        )
    ]
    return Settings(kind, enabled, config, init, *flags)


#: torch's rule's arguments, by their defaults: ``policy="headroom"`` does not use them
_TORCH_RULE = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


#: ``policy="headroom"``'s arguments, by their defaults: torch's rule does not use them
_HEADROOM_RULE = {
    "headroom_margin": HEADROOM_MARGIN,
    "headroom_history": HEADROOM_HISTORY,
    "measure_every": 1,
}


def _warn_unused(config: ScalerConfig, defaults: dict[str, object], why: str) -> None:
    """A constructor's arguments of the other policy, set away from ``defaults``: a warning."""
    unused = [k for k, default in defaults.items() if getattr(config, k) != default]
    if unused:
        warnings.warn(
            f"policy={config.policy!r} does not use {', '.join(unused)} ({why}): ignored.",
            UserWarning,
            stacklevel=5,
        )


def _check_torch_args(config: ScalerConfig) -> None:
    """A constructor's torch rule with ``policy="headroom"``'s arguments: a warning."""
    _warn_unused(
        config,
        _HEADROOM_RULE,
        "they set policy='headroom'; a checkpoint loaded later may switch the policy",
    )


def warn_unused_setter(config: ScalerConfig, name: str) -> None:
    """A setter of torch's rule (``set_growth_factor`` ...) under ``policy="headroom"``."""
    if config.headroom:
        warnings.warn(
            f"set_{name}(): policy='headroom' does not use {name} (the scale follows the "
            "measured gradient amax): stored, ignored.",
            UserWarning,
            stacklevel=3,
        )


def _check_headroom_args(config: ScalerConfig) -> None:
    """A constructor's ``policy="headroom"`` with arguments it contradicts or does not use.

    Raises:
        ValueError: ``dynamic=False`` (``guard()``): the scale is fixed, there is no policy.
    """
    if not config.dynamic:
        raise ValueError(
            "policy='headroom' sets the scale from the measured gradients, and dynamic=False "
            "(guard()) keeps it fixed: drop one of them."
        )
    _warn_unused(
        config,
        _TORCH_RULE,
        "the scale follows the measured gradient amax; an overflow backs off by powers of two",
    )


def guard_kwargs(kwargs: dict[str, object]) -> dict[str, object]:
    """``ShardedGradScaler.guard``'s constructor keywords: ``init_scale`` 1.0 unless given,
    ``dynamic=False``.

    Raises:
        TypeError: ``dynamic`` is given (a guard's scale is fixed).
    """
    if "dynamic" in kwargs:
        raise TypeError(
            "guard() fixes the scale (dynamic=False) and takes no dynamic argument; for a "
            "dynamic loss scale construct ShardedGradScaler(...) (dynamic=True is its default)."
        )
    return {"init_scale": 1.0, **kwargs, "dynamic": False}


def check_policy_scale(name: str, value: object, config: ScalerConfig) -> float:
    """:func:`check_scale` inside ``config``'s bounds, and at or above ``policy="headroom"``'s
    floor (:attr:`ScalerConfig.floor`: the smallest power of two >= ``max(min_scale, 1)``;
    below it the rule's first backoff would raise the scale)."""
    v = check_scale(name, value, config.min_scale, config.max_scale)
    if config.headroom and v < config.floor:
        raise ValueError(
            f"{name}={v} lies below policy='headroom''s floor {config.floor:g} (the smallest "
            f"power of two >= max(min_scale, 1), here {config.lowest:g}): the rule's scales are "
            "powers of two, and >= 1 so that unscaling never enlarges a gradient (no second "
            f"check of the unscaled values); pass a value >= {config.floor:g}."
        )
    return v


def check_new_scale(new_scale: object, config: ScalerConfig) -> float:
    """``update(new_scale)``'s value: a float, or a 1-element float tensor (read once), finite
    and inside ``config``'s bounds (:func:`check_policy_scale`). Raises TypeError/ValueError
    naming the fix, and that nothing changed."""
    try:
        return _new_scale(new_scale, config)
    except (TypeError, ValueError) as e:
        raise type(e)(
            f"{e} update() changed nothing: the iteration is still open (call update() again)."
        ) from None


def _new_scale(new_scale: object, config: ScalerConfig) -> float:
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
    return check_policy_scale("new_scale", new_scale, config)


def check_device(device: object, call: str = "place()") -> torch.device:
    """A ``str`` or ``torch.device`` naming a device with data (``call``: named in errors).

    Raises:
        TypeError: not a str or ``torch.device``.
        ValueError: the meta device.
        RuntimeError: a device torch cannot create tensors on here (e.g. CUDA without it).
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}.")
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError(f"{call} needs a device with data, got the meta device.")
    try:
        torch.empty(0, device=device)
    except (AssertionError, RuntimeError) as e:  # e.g. torch built without CUDA
        raise RuntimeError(
            f"{call} on {str(device)!r}: torch cannot create tensors there ({e}); pass a "
            "device this machine and torch build have."
        ) from e
    return device
