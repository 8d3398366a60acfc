"""The scaler's checkpoints: its ``state_dict`` (torch's five keys plus shardscale's, built and
validated here) and its pickling, copies and deep copies (:class:`Picklable`)."""

from __future__ import annotations

import copy
import dataclasses
import numbers
import warnings
from collections.abc import Mapping
from typing import Any

from ._alarm import Schedule
from ._config import (
    INT32_MAX,
    INT64_MAX,
    POLICY_FIELDS,
    ScalerConfig,
    check_policy_scale,
    check_real,
)
from ._headroom import Headroom, HeadroomNumbers
from ._iteration import Iteration
from ._join import CallLog
from ._policy import COUNTER_NAMES, HostBounds, LossScale, Numbers
from ._report import ParamNames, Reporter

#: The keys of ``torch.amp.GradScaler.state_dict()``, required in every loaded state.
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
#: The config fields a state dict may carry (each optional when loading).
CONFIG_KEYS = POLICY_FIELDS


@dataclasses.dataclass(frozen=True)
class LoadedState:
    """A validated state dict: the config and the numeric state to install."""

    config: ScalerConfig
    scale: float
    growth_tracker: int
    hysteresis_tracker: int
    counters: tuple[int, ...]
    headroom: HeadroomNumbers = HeadroomNumbers()

    @property
    def numbers(self) -> Numbers:
        return Numbers(self.scale, self.growth_tracker, self.hysteresis_tracker, self.counters)


def to_state_dict(
    config: ScalerConfig,
    metrics: Mapping[str, float | int],
    headroom: HeadroomNumbers | None = None,
) -> dict[str, Any]:
    """The state dict of a scaler with ``config`` whose :meth:`metrics` are ``metrics`` and
    whose ``policy="headroom"`` state is ``headroom`` (None: empty)."""
    headroom = headroom or HeadroomNumbers()
    return {
        "scale": float(metrics["scale"]),
        "growth_factor": config.growth_factor,
        "backoff_factor": config.backoff_factor,
        "growth_interval": config.growth_interval,
        "_growth_tracker": int(metrics["growth_tracker"]),
        "min_scale": config.min_scale,
        "max_scale": config.max_scale,
        "hysteresis": config.hysteresis,
        "consecutive_hysteresis": config.consecutive_hysteresis,
        "dynamic": config.dynamic,
        "max_consecutive_skips": config.max_consecutive_skips,
        "on_collapse": config.on_collapse,
        "_hysteresis_tracker": int(metrics["hysteresis_tracker"]),
        "_counters": {name: int(metrics[name]) for name in COUNTER_NAMES},
        "policy": config.policy,
        "headroom_margin": config.headroom_margin,
        "headroom_history": config.headroom_history,
        "measure_every": config.measure_every,
        "_headroom_history": [float(v) for v in headroom.history],
        "_headroom_backoffs": int(headroom.backoffs),
    }


#: shardscale's own policy fields: a value the constructor asked for wins over a checkpoint's.
GUARD_KEYS = CONFIG_KEYS[3:]


def asked(config: ScalerConfig, named: tuple[str, ...] = ()) -> frozenset[str]:
    """The guard fields ``config`` sets away from their defaults, and those ``named`` (given
    explicitly to the constructor): they win over a checkpoint's in ``load_state_dict`` (a
    guard asked for is never switched off by a resume)."""
    defaults = ScalerConfig()
    changed = {k for k in GUARD_KEYS if getattr(config, k) != getattr(defaults, k)}
    return frozenset(changed | set(named))


#: The top-level keys shardscale's state dict has beyond torch's (``_counters`` is a dict).
EXTRA_KEYS = (*GUARD_KEYS, "_hysteresis_tracker", "_counters", "_headroom_history",
              "_headroom_backoffs")  # fmt: skip


def parse_state_dict(
    state_dict: object,
    current: ScalerConfig,
    keep: frozenset[str] = frozenset(),
    own: Numbers | None = None,
) -> LoadedState:
    """Validate ``state_dict`` (ours or torch's) against ``current``'s defaults; mutate nothing.

    Keys missing from a torch state dict keep ``current``'s settings; the hysteresis tracker is
    then full and the counters 0. A checkpoint of the other mode (``dynamic``: fp16 loss
    scaling against the bf16/fp32 guard; torch's scalers are dynamic) with ``dynamic`` kept:
    the scale and trackers stay ``own`` (this scaler's), the counters come from the
    checkpoint, and a warning says so.

    Raises:
        TypeError, ValueError: not a dict, a missing key, or a bad value (named).
        RuntimeError: an empty dict (saved from a disabled scaler).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}.")
    if len(state_dict) == 0:
        raise RuntimeError(
            "The state dict is empty, possibly because it was saved from a disabled scaler."
        )
    missing = [k for k in TORCH_KEYS if k not in state_dict]
    if missing:
        raise ValueError(f"state_dict is missing the keys {missing}; pass a scaler state_dict().")
    fields = {k: state_dict[k] for k in CONFIG_KEYS if k in state_dict}
    try:
        dataclasses.replace(current, **fields)  # validates every field, kept ones too
    except (TypeError, ValueError) as e:  # named as the state dict's key
        key = next((k for k in fields if str(e).startswith(f"{k} ")), None)
        if key is None:
            raise
        raise type(e)(f"state_dict[{key!r}]{str(e)[len(key) :]}") from None
    config = dataclasses.replace(current, **{k: v for k, v in fields.items() if k not in keep})
    switched = own is not None and "dynamic" in keep and _dynamic(state_dict) != current.dynamic
    overridden = [
        f"{k}={getattr(current, k)!r} (the checkpoint's: {state_dict[k]!r})"
        for k in keep
        if k in state_dict and state_dict[k] != getattr(current, k) and k != "dynamic"
    ]
    if switched:
        assert own is not None
        modes = {True: "dynamic fp16 loss scaling", False: "the bf16/fp32 guard (dynamic=False)"}
        warnings.warn(
            f"load_state_dict(): the checkpoint was saved by {modes[not current.dynamic]}; this "
            f"scaler keeps {modes[current.dynamic]} and its own loss scale {own.scale:g} (the "
            "checkpoint's belongs to the other mode); its counters are loaded.",
            stacklevel=3,
        )
    if config.policy != current.policy:  # the whole rule changes: say so
        warnings.warn(
            f"load_state_dict(): the checkpoint's policy={config.policy!r} replaces this "
            f"scaler's {current.policy!r} (the scale rule changes); pass policy="
            f"{current.policy!r} to the constructor to keep it.",
            stacklevel=3,
        )
    if overridden:
        warnings.warn(
            "load_state_dict() keeps the policy the constructor asked for: "
            + ", ".join(sorted(overridden))
            + "; the scale, trackers and counters come from the checkpoint.",
            stacklevel=3,
        )
    raw_scale = state_dict["scale"]
    if overridden or ("max_scale" not in state_dict and "min_scale" not in state_dict):
        # torch's GradScaler has no bounds: with a growth factor that is not a power of 2 its
        # scale can pass 2**127, and it can back off below 2**-126. Such a state is valid for
        # torch: load it with the scale clamped into this scaler's bounds, and say so.
        value = check_real("state_dict['scale']", raw_scale)
        lo = config.floor  # policy="headroom": the power of two >= max(min_scale, 1)
        if value >= 0 and not lo <= value <= config.max_scale:  # 0: backed off to 0
            clamped = min(max(value, lo), config.max_scale)
            what = "the bounds kept" if overridden else "a torch.amp.GradScaler state"
            warnings.warn(
                f"state_dict['scale']={value} ({what}) lies outside the policy's bounds "
                f"[{lo}, {config.max_scale}]; loaded as {clamped}.",
                stacklevel=3,
            )
            raw_scale = clamped
    scale = check_policy_scale("state_dict['scale']", raw_scale, config)
    tracker = _nonneg_int("_growth_tracker", state_dict["_growth_tracker"], INT32_MAX)
    tracker = min(tracker, config.growth_interval - 1)  # past the interval: grow at the next step
    hyst = _nonneg_int(
        "_hysteresis_tracker", state_dict.get("_hysteresis_tracker", config.hysteresis), INT32_MAX
    )
    if overridden:
        hyst = min(hyst, config.hysteresis)
    if hyst > config.hysteresis:
        raise ValueError(
            f"state_dict['_hysteresis_tracker']={hyst} exceeds hysteresis="
            f"{config.hysteresis}; the checkpoint is inconsistent (pass a state_dict())."
        )
    raw = state_dict.get("_counters", {})
    if not isinstance(raw, Mapping) or not set(raw) <= set(COUNTER_NAMES):
        raise ValueError(f"state_dict['_counters'] must be a dict with keys from {COUNTER_NAMES}.")
    counters = tuple(_nonneg_int("_counters", raw.get(n, 0), sub=n) for n in COUNTER_NAMES)
    if switched:
        assert own is not None
        scale, tracker, hyst = own.scale, own.growth_tracker, own.hysteresis_tracker
    return LoadedState(config, scale, tracker, hyst, counters, _headroom(state_dict, config))


def _dynamic(state_dict: Mapping[str, Any]) -> bool:
    """The mode a checkpoint was saved in: its ``dynamic`` (torch's scalers: True)."""
    return bool(state_dict.get("dynamic", True))


def _headroom(state_dict: Mapping[str, Any], config: ScalerConfig) -> HeadroomNumbers:
    """``policy="headroom"``'s state from ``state_dict`` (none saved: an empty history), the
    last ``headroom_history`` entries kept."""
    raw = state_dict.get("_headroom_history", [])
    if not isinstance(raw, (list, tuple)):
        raise ValueError("state_dict['_headroom_history'] must be a list of floats > 0.")
    history = []
    for v in raw:
        value = check_real("state_dict['_headroom_history'] entries", v)
        if value <= 0.0:
            raise ValueError(f"state_dict['_headroom_history'] entries must be > 0, got {v!r}.")
        history.append(value)
    backoffs = _nonneg_int("_headroom_backoffs", state_dict.get("_headroom_backoffs", 0), 64)
    return HeadroomNumbers(tuple(history[-config.headroom_history :]), backoffs)


def _nonneg_int(name: str, value: object, maximum: int = INT64_MAX, sub: str = "") -> int:
    """``value`` (``state_dict[name]``, or ``state_dict[name][sub]``) as an int in
    [0, maximum] (the range of the integer tensor that holds it).

    Raises:
        TypeError: not an int; ValueError: out of that range.
    """
    where = f"state_dict[{name!r}]" + (f"[{sub!r}]" if sub else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where} must be an int >= 0, got {value!r}.")
    if value < 0:
        raise ValueError(f"{where} must be an int >= 0, got {value!r}.")
    if value > maximum:
        raise ValueError(
            f"{where} must be <= {maximum} (it is held in a "
            f"{'32' if maximum == INT32_MAX else '64'}-bit integer tensor), got {value!r}."
        )
    return int(value)


def check_load_boundary(started: bool) -> None:
    """Refuse a load in the middle of an iteration (``started``: after ``unscale_``,
    ``clip_grad_norm_`` or ``step``, the gradients unscaled or stepped by the old scale)."""
    if started:
        raise RuntimeError(
            "load_state_dict() was called in the middle of an iteration (after unscale_, "
            "clip_grad_norm_ or step): load at an iteration boundary (after update() or "
            "abandon())."
        )


def warn_load_after_scale() -> None:
    """The warning of a ``load_state_dict()`` after ``scale()`` (the iteration is abandoned)."""
    warnings.warn(
        "load_state_dict() after scale(): this iteration's gradients hold the scale before "
        "the load, which the loaded one would wrongly unscale, so the iteration is abandoned "
        "(as abandon()): zero the gradients and scale the loss again before step(). Load "
        "before scale() to keep the iteration.",
        RuntimeWarning,
        stacklevel=3,
    )


class Picklable:
    """Pickling, ``copy.copy`` and ``copy.deepcopy`` of a scaler, at an iteration boundary: the
    scale state as numbers (re-created on its device at the next ``scale()``), a fresh record;
    process groups are shared by copies and dropped by pickles, as are parameter names (ids of
    this process's parameters). A mixin of :class:`shardscale.ShardedGradScaler`, reading its
    ``_it``, ``_loss_scale``, ``_enabled``, ``_device``, ``_reporter`` and ``process_group``."""

    _it: Iteration
    _loss_scale: LossScale
    _headroom: Headroom
    _enabled: bool
    _device: str
    _reporter: Reporter
    process_group: Any

    def __getstate__(self) -> dict[str, Any]:
        if self._it.started():  # as torch's: refused once an optimizer was unscaled or stepped
            raise RuntimeError(
                "A ShardedGradScaler may only be pickled or copied at the beginning of an "
                "iteration (before unscale_(), clip_grad_norm_() or step()) or after update()."
            )
        it = Iteration()
        it.scaled_here = self._it.scaled_here  # after scale(): the copy steps those gradients
        state = self.__dict__.copy()
        numbers = self._loss_scale.read()[0] if self._enabled else self._loss_scale.numbers
        state.update(
            _loss_scale=LossScale(numbers),
            _headroom=Headroom(self._headroom.read()),
            _bounds=HostBounds.at(numbers.scale),
            _alarm=None,
            _it=it,
            _calls=CallLog(),
            _schedule=Schedule(),
            _reporter=Reporter(ParamNames()),
            process_group=None,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = type(self)(state.get("_device", "cpu"), enabled=False).__dict__  # type: ignore[call-arg]
        fresh.update({k: v for k, v in state.items() if k in fresh})  # an older pickle: its keys
        for key, kind in (("_loss_scale", LossScale), ("_reporter", Reporter)):
            if not isinstance(fresh[key], kind):  # pragma: no cover - defensive
                fresh[key] = type(self)("cpu").__dict__[key]  # type: ignore[call-arg]
        self.__dict__.update(fresh)

    def __copy__(self) -> Any:
        """A copy (at an iteration boundary, as pickling) naming the same parameters."""
        new = type(self).__new__(type(self))
        new.__setstate__(self.__getstate__())
        new._reporter.names, new.process_group = self._reporter.names, self.process_group
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A deep copy (at an iteration boundary, as pickling). Report names follow the
        parameters copied *before* the scaler in the same ``deepcopy`` call; others keep naming
        the originals."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        new._reporter.names = self._reporter.names.remapped(memo)
        new.process_group = self.process_group  # a process resource: shared, not copied
        return new
