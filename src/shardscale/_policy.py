"""The loss-scale state and its transition rule.

:func:`next_state` is the whole dynamic loss-scale algorithm as one pure function of
``(state, found_inf, config)``, written once in tensor operations: it runs the same on every
device (no ``.item()``, no host synchronisation, traceable by ``torch.compile``).

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

Products are computed in float64 and rounded to float32, as torch's ``_amp_update_scale_``
kernel does, so with ``hysteresis=1`` and the default bounds the scale sequence is bit-identical
to ``torch.amp.GradScaler``'s.
"""

from __future__ import annotations

import dataclasses

import torch

from ._config import ScalerConfig

#: Order of the entries of :attr:`ScaleState.counters`.
COUNTER_NAMES = ("steps", "skipped_steps", "consecutive_skips", "overflows", "backoffs", "growths")


def math_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (torch's update kernel multiplies in double); MPS has none."""
    return torch.float32 if device.type == "mps" else torch.float64


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
        """Write ``other``'s values into this state's tensors (in place: whoever holds them, a
        fused optimizer or a CUDA graph, sees the new values)."""
        self.scale.copy_(other.scale)
        self.growth_tracker.copy_(other.growth_tracker)
        self.hysteresis_tracker.copy_(other.hysteresis_tracker)
        self.counters.copy_(other.counters)


def next_state(
    state: ScaleState, found_inf: torch.Tensor, config: ScalerConfig
) -> tuple[ScaleState, torch.Tensor]:
    """Apply one step of the policy. Pure: ``state`` is not modified.

    Args:
        state: the current state (tensors on one device).
        found_inf: 0-d float32 on ``state.scale.device``: the number of optimizers whose step
            overflowed this iteration (> 0 means the step was skipped), agreed across ranks.
        config: the policy.

    Returns:
        ``(new_state, collapsed)``; ``collapsed`` is a 0-d bool tensor (see the module
        docstring). No host synchronisation.
    """
    scale, gt, ht = state.scale, state.growth_tracker, state.hysteresis_tracker
    overflow = found_inf > 0
    if config.dynamic:
        ht_after = torch.where(overflow, (ht - 1).clamp_min(0), ht)
        do_backoff = overflow & (ht_after == 0)
        gt_next = torch.where(overflow, 0, gt + 1)
        # int64: an interval beyond int32 (e.g. 2**40, "never grow") must not wrap around
        do_grow = ~overflow & (gt_next.to(torch.int64) >= config.growth_interval)
        s = scale.to(math_dtype(scale.device))  # Python-float factors keep s's precision
        backed = (s * config.backoff_factor).clamp_min(config.min_scale)
        grown = (s * config.growth_factor).clamp_max(config.max_scale)
        new_scale = torch.where(do_backoff, backed, torch.where(do_grow, grown, s)).float()
        new_gt = torch.where(do_grow, 0, gt_next).to(torch.int32)
        refill = (do_grow | ~overflow) if config.consecutive_hysteresis else do_grow
        new_ht = torch.where(refill, config.hysteresis, ht_after).to(torch.int32)
        backoff_due = do_backoff
    else:
        new_scale, new_gt, new_ht = scale.clone(), torch.zeros_like(gt), ht.clone()
        backoff_due = overflow
    new_counters = next_counters(state.counters, found_inf, scale, new_scale)
    # float32 comparison: min_scale is rounded to the scale's dtype, as the clamp above rounds it
    collapsed = backoff_due & (scale <= config.min_scale)
    if config.max_consecutive_skips is not None:
        collapsed = collapsed | (new_counters[2] >= config.max_consecutive_skips)
    return ScaleState(new_scale, new_gt, new_ht, new_counters), collapsed


def next_counters(
    counters: torch.Tensor, found_inf: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor
) -> torch.Tensor:
    """The counters after one update (device ops): steps, skips, consecutive skips (reset by a
    clean step), overflows, and a backoff/growth when ``new_scale`` is below/above ``scale``."""
    overflow = found_inf > 0
    increments = torch.stack(
        [overflow, overflow, overflow, overflow, scale > new_scale, scale < new_scale]
    ).to(torch.int64)
    increments[0] = 1
    increments[3] = found_inf.to(torch.int64)
    new = counters + increments
    new[2] = new[2] * overflow  # consecutive skips: reset by a clean step
    return new
