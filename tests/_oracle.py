"""The scale policy in plain Python: the tests' oracle for ``shardscale.next_state``.

An independent statement of the rule in ``shardscale/_policy.py`` (float32 rounding emulated),
used to predict scale sequences by hand and in property tests. Not part of the library.
"""

from __future__ import annotations

import dataclasses
import struct

from shardscale import ScalerConfig


def round_f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


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
    # hysteresis=1 (not consecutive): every overflow backs off; the tracker is left alone
    h1 = config.hysteresis == 1 and not config.consecutive_hysteresis
    if config.dynamic:
        if overflow and h1:
            gt = 0
            new_s = round_f32(max(s * config.backoff_factor, config.min_scale))
        elif overflow:
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
                ht = ht if h1 else config.hysteresis
                grown = s * config.growth_factor
                if grown < 3.4028235677973366e38:  # past float32 max: not applied (torch's kernel)
                    new_s = round_f32(min(grown, config.max_scale))
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
    backoff_due = overflow and (ht <= 0 or h1 if config.dynamic else True)
    collapsed = backoff_due and s <= round_f32(config.min_scale)
    if config.max_consecutive_skips is not None:
        collapsed = collapsed or consecutive >= config.max_consecutive_skips
    return PyScaleState(new_s, gt, ht, counters), collapsed
