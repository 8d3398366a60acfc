"""The loss-scale state and its transition rule.

:func:`next_state` is the whole dynamic loss-scale algorithm as one pure function of
``(state, found_inf, config)``. It runs on the device that holds the scale, with tensor
operations only (no ``.item()``, no host synchronisation). :func:`reference_step` is the same rule
on plain Python numbers, used by the property tests and by anyone who wants to predict a scale
sequence by hand.

Algorithm (per :meth:`ShardedGradScaler.update`)::

    overflow = found_inf > 0                      # any optimizer saw inf/NaN on any rank
    if overflow:
        growth_tracker = 0
        hysteresis_tracker = max(hysteresis_tracker - 1, 0)
        if hysteresis_tracker == 0:               # budget spent: back off
            scale = max(scale * backoff_factor, min_scale)
    else:
        growth_tracker += 1
        if consecutive_hysteresis:                # DeepSpeed: refill on every clean step
            hysteresis_tracker = hysteresis
        if growth_tracker >= growth_interval:
            growth_tracker = 0
            hysteresis_tracker = hysteresis       # Megatron-LM: refill when the scale grows
            scale = min(scale * growth_factor, max_scale)
    collapsed = (overflow and a backoff is due (hysteresis spent, or dynamic=False)
                 and old_scale <= min_scale)
                or consecutive_skips >= max_consecutive_skips
    # as DeepSpeed's raise_error_at_min_scale: an overflow the hysteresis absorbs is no collapse

Products are computed in float64 and rounded to float32, exactly as torch's
``_amp_update_scale_`` kernel does, so with ``hysteresis=1`` and the default bounds the scale
sequence is bit-identical to ``torch.amp.GradScaler``'s.
"""

from __future__ import annotations

import dataclasses
import struct

import torch

from ._config import ScalerConfig

#: Order of the entries of :attr:`ScaleState.counters`.
COUNTER_NAMES = ("steps", "skipped_steps", "consecutive_skips", "overflows", "backoffs", "growths")


@dataclasses.dataclass
class ScaleState:
    """The scaler's numeric state, all tensors on the device of the scale.

    Attributes:
        scale: 0-d float32, the current loss scale.
        growth_tracker: 0-d int32, clean steps since the last growth or overflow.
        hysteresis_tracker: 0-d int32, overflows still tolerated before a backoff.
        counters: 1-d int64 of length 6, in :data:`COUNTER_NAMES` order: updates done, skipped
            steps, consecutive skipped steps, overflows (optimizer steps that saw inf/NaN),
            backoffs (the scale went down), growths (the scale went up).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_tracker: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def create(
        cls,
        device: torch.device,
        scale: float,
        growth_tracker: int,
        hysteresis_tracker: int,
        counters: tuple[int, ...] | list[int],
    ) -> ScaleState:
        """Build a state on ``device`` from plain numbers."""
        return cls(
            scale=torch.full((), scale, dtype=torch.float32, device=device),
            growth_tracker=torch.full((), growth_tracker, dtype=torch.int32, device=device),
            hysteresis_tracker=torch.full((), hysteresis_tracker, dtype=torch.int32, device=device),
            counters=torch.tensor(list(counters), dtype=torch.int64, device=device),
        )

    def copy_from(self, other: ScaleState) -> None:
        """Write ``other``'s values into this state's tensors (in place, no reallocation)."""
        self.scale.copy_(other.scale)
        self.growth_tracker.copy_(other.growth_tracker)
        self.hysteresis_tracker.copy_(other.hysteresis_tracker)
        self.counters.copy_(other.counters)


def round_f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _math_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; everywhere else follow torch's kernel (double products).
    return torch.float32 if device.type == "mps" else torch.float64


def next_state(
    state: ScaleState, found_inf: torch.Tensor, config: ScalerConfig
) -> tuple[ScaleState, torch.Tensor]:
    """Apply one step of the policy. Pure: ``state`` is not modified.

    Args:
        state: the current state (tensors on one device).
        found_inf: 0-d float32 on ``state.scale.device``: the number of optimizers whose step
            overflowed this iteration (> 0 means the step was skipped), already agreed across ranks.
        config: the policy.

    Returns:
        ``(new_state, collapsed)``; ``collapsed`` is a 0-d bool tensor (see module docstring).
        No host synchronisation.
    """
    scale, gt, ht, counters = (
        state.scale,
        state.growth_tracker,
        state.hysteresis_tracker,
        state.counters,
    )
    overflow = found_inf > 0
    clean = ~overflow
    md = _math_dtype(scale.device)
    s = scale.to(md)
    zero_i = torch.zeros_like(gt)
    if config.dynamic:
        ht_after = torch.where(overflow, (ht - 1).clamp_min(0), ht)
        do_backoff = overflow & (ht_after <= 0)
        gt_next = torch.where(overflow, zero_i, gt + 1)
        # int64: an interval beyond int32 (e.g. 2**40, "never grow") must not wrap around
        do_grow = clean & (gt_next.to(torch.int64) >= config.growth_interval)
        backed = (s * config.backoff_factor).clamp_min(config.min_scale)
        grown = (s * config.growth_factor).clamp_max(config.max_scale)
        new_scale = torch.where(do_backoff, backed, torch.where(do_grow, grown, s)).to(
            torch.float32
        )
        new_gt = torch.where(do_grow, zero_i, gt_next)
        refill = do_grow | clean if config.consecutive_hysteresis else do_grow
        new_ht = torch.where(refill, torch.full_like(ht, config.hysteresis), ht_after)
    else:
        new_scale, new_gt, new_ht = scale.clone(), zero_i, ht.clone()
    new_counters = _next_counters(counters, found_inf, scale, new_scale)
    consecutive = new_counters[2]
    backoff_due = do_backoff if config.dynamic else overflow
    collapsed = backoff_due & (scale <= round_f32(config.min_scale))
    if config.max_consecutive_skips is not None:
        collapsed = collapsed | (consecutive >= config.max_consecutive_skips)
    return ScaleState(
        new_scale, new_gt.to(torch.int32), new_ht.to(torch.int32), new_counters
    ), collapsed


@dataclasses.dataclass(frozen=True)
class PyScaleState:
    """:class:`ScaleState` as plain Python numbers, for :func:`reference_step`."""

    scale: float
    growth_tracker: int = 0
    hysteresis_tracker: int = 1
    counters: tuple[int, ...] = (0, 0, 0, 0, 0, 0)


def reference_step(
    state: PyScaleState, found_inf: int, config: ScalerConfig
) -> tuple[PyScaleState, bool]:
    """The rule of :func:`next_state` on Python numbers (float32 rounding emulated).

    Args:
        state: current state; ``scale`` must be a float32-representable value.
        found_inf: number of optimizers that overflowed this iteration (0 = clean step).
        config: the policy.

    Returns:
        ``(new_state, collapsed)``.
    """
    s, gt, ht = state.scale, state.growth_tracker, state.hysteresis_tracker
    steps, skipped, consecutive, overflows, backoffs, growths = state.counters
    overflow = found_inf > 0
    new_s = s
    if config.dynamic:
        if overflow:
            gt = 0
            ht = max(ht - 1, 0)
            if ht <= 0:
                new_s = round_f32(max(s * config.backoff_factor, config.min_scale))
        else:
            gt += 1
            if config.consecutive_hysteresis:
                ht = config.hysteresis
            if gt >= config.growth_interval:
                gt = 0
                ht = config.hysteresis
                new_s = round_f32(min(s * config.growth_factor, config.max_scale))
    else:
        gt = 0
    consecutive = consecutive + 1 if overflow else 0
    counters = (
        steps + 1,
        skipped + int(overflow),
        consecutive,
        overflows + found_inf,
        backoffs + int(new_s < s),
        growths + int(new_s > s),
    )
    backoff_due = overflow and (ht <= 0 if config.dynamic else True)
    collapsed = backoff_due and s <= round_f32(config.min_scale)
    if config.max_consecutive_skips is not None:
        collapsed = collapsed or consecutive >= config.max_consecutive_skips
    return PyScaleState(new_s, gt, ht, counters), collapsed


def _next_counters(
    counters: torch.Tensor,
    found_inf: torch.Tensor,
    scale: torch.Tensor,
    new_scale: torch.Tensor | float,
) -> torch.Tensor:
    """The counters after one update (device ops): steps, skips, consecutive skips (reset by a
    clean step), overflows, and a backoff/growth when ``new_scale`` is below/above ``scale``."""
    overflow = found_inf > 0
    increments = torch.stack(
        [
            torch.ones_like(counters[0]),
            overflow.to(torch.int64),
            torch.zeros_like(counters[2]),
            found_inf.to(torch.int64),
            (scale > new_scale).to(torch.int64),
            (scale < new_scale).to(torch.int64),
        ]
    )
    new = counters + increments
    new[2] = torch.where(overflow, counters[2] + 1, torch.zeros_like(counters[2]))
    return new


def count_step(state: ScaleState, found_inf: torch.Tensor, new_scale: float) -> None:
    """Advance only ``state.counters`` for an iteration whose scale the caller sets to
    ``new_scale`` (``update(new_scale)``), in place, device ops only (no host sync); the scale
    and the trackers are left to the caller (torch keeps them)."""
    state.counters.copy_(_next_counters(state.counters, found_inf, state.scale, new_scale))


def step_in_place(state: ScaleState, found_inf: torch.Tensor, config: ScalerConfig) -> torch.Tensor:
    """Advance ``state`` by one step, in place; return the 0-d bool ``collapsed`` flag.

    On accelerators this is :func:`next_state` (device kernels, no host sync). On the CPU, where
    reading a tensor costs no synchronisation, the same rule runs as :func:`reference_step` on
    Python numbers (a few microseconds instead of ~30 tiny kernels); the property tests check
    that both give bit-identical states.
    """
    if state.scale.device.type != "cpu":
        new, collapsed = next_state(state, found_inf, config)
        state.copy_from(new)
        return collapsed
    py = PyScaleState(
        scale=float(state.scale),
        growth_tracker=int(state.growth_tracker),
        hysteresis_tracker=int(state.hysteresis_tracker),
        counters=tuple(state.counters.tolist()),
    )
    new_py, collapsed_py = reference_step(py, int(found_inf), config)
    if new_py.scale != py.scale:  # unchanged: not written (its version, and 1/scale, stand)
        state.scale.fill_(new_py.scale)
    state.growth_tracker.fill_(new_py.growth_tracker)
    state.hysteresis_tracker.fill_(new_py.hysteresis_tracker)
    state.counters.copy_(torch.tensor(new_py.counters, dtype=torch.int64, device="cpu"))
    return torch.tensor(collapsed_py, device="cpu")
