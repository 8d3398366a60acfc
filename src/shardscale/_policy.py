"""The loss-scale state and its transition rule.

:func:`next_state` is the whole dynamic loss-scale algorithm as one pure function of
``(state, found_inf, config)``, written once in tensor operations (:func:`step_` in place): it
runs the same on every device (no ``.item()``, no host synchronisation, traceable by
``torch.compile``). The state's growth tracker stays below ``growth_interval``.

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

The growth and backoff themselves are torch's ``_amp_update_scale_`` kernel (float64 products
rounded to float32; a growth past float32's range is not applied), so with ``hysteresis=1`` and
the default bounds the scale sequence is ``torch.amp.GradScaler``'s bit for bit; the bounds, the
hysteresis and the counters are a few tensor operations around it (:func:`step_`).
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
        hysteresis_tracker: 0-d int32, overflows still tolerated before a backoff (with
            ``hysteresis=1`` every overflow backs off and it stays 1).
        counters: 1-d float64 (float32 on MPS: exact up to 2**24) of length 6, in
            :data:`COUNTER_NAMES` order: updates done, skipped steps, consecutive skipped steps,
            overflows (optimizer steps that saw inf/NaN), backoffs (the scale went down),
            growths (the scale went up).
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
            counters=torch.tensor(list(counters), dtype=math_dtype(device), device=device),
        )

    def copy_from(self, other: ScaleState) -> None:
        """Write ``other``'s values into this state's tensors (in place: whoever holds them, a
        fused optimizer or a CUDA graph, sees the new values)."""
        self.scale.copy_(other.scale)
        self.growth_tracker.copy_(other.growth_tracker)
        self.hysteresis_tracker.copy_(other.hysteresis_tracker)
        self.counters.copy_(other.counters)

    def clone(self) -> ScaleState:
        return ScaleState(*(t.clone() for t in dataclasses.astuple(self)))


def step_(
    state: ScaleState, found_inf: torch.Tensor, config: ScalerConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply one step of the policy to ``state``, in place (tensor ops, no host read).

    The growth and backoff are torch's own kernel, ``torch._amp_update_scale_`` (float64
    products rounded to float32; a growth that would overflow float32 is not applied), so with
    ``hysteresis=1`` and the default bounds the sequence is ``torch.amp.GradScaler``'s bit for
    bit; then the bounds, the hysteresis (an absorbed overflow keeps the scale) and the
    counters: about 15 small tensor operations.

    Args:
        state: the current state (tensors on one device); updated in place.
        found_inf: 0-d float32 on ``state.scale.device``: the number of optimizers whose step
            overflowed this iteration (> 0: the step was skipped), agreed across ranks.
        config: the policy.

    Returns:
        ``(collapsed, old_scale)``: 0-d bool (see the module docstring) and a 0-d copy of the
        scale before the step.
    """
    scale, gt, ht = state.scale, state.growth_tracker, state.hysteresis_tracker
    overflow = found_inf > 0
    old = scale.clone()
    if not config.dynamic:
        gt.zero_()
        backoff_due = overflow
    else:
        torch._amp_update_scale_(
            scale,
            gt,
            found_inf,
            config.growth_factor,
            config.backoff_factor,
            config.growth_interval,
        )
        scale.clamp_(config.min_scale, config.max_scale)
        if config.hysteresis == 1 and not config.consecutive_hysteresis:
            backoff_due = overflow  # every overflow backs off; the tracker stays 1
        else:
            ht_after = torch.where(overflow, (ht - 1).clamp_min(0), ht)
            backoff_due = overflow & (ht_after == 0)
            grew = ~overflow & (gt == 0)  # the growth tracker restarts only on a growth
            refill = (grew | ~overflow) if config.consecutive_hysteresis else grew
            ht.copy_(torch.where(refill, config.hysteresis, ht_after))
            scale.copy_(torch.where(overflow & ~backoff_due, old, scale))  # absorbed: kept
    count_(state.counters, found_inf, old, scale)
    # float32 comparison: min_scale is rounded to the scale's dtype, as the clamp rounds it
    collapsed = backoff_due & (old <= config.min_scale)
    if config.max_consecutive_skips is not None:
        collapsed = collapsed | (state.counters[2] >= config.max_consecutive_skips)
    return collapsed, old


def next_state(
    state: ScaleState, found_inf: torch.Tensor, config: ScalerConfig
) -> tuple[ScaleState, torch.Tensor]:
    """Apply one step of the policy (:func:`step_`) to a copy of ``state``. Pure: ``state`` is
    not modified. Returns ``(new_state, collapsed)``."""
    new = state.clone()
    collapsed, _ = step_(new, found_inf, config)
    return new, collapsed


def count_(
    counters: torch.Tensor, found_inf: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor
) -> None:
    """Advance the counters by one update, in place (device ops): steps, skips, consecutive
    skips (reset by a clean step), overflows, and a backoff/growth when ``new_scale`` is below
    or above ``scale``."""
    overflow = found_inf > 0
    inc = torch.stack(
        [
            torch.ones_like(found_inf),
            overflow,
            overflow,
            found_inf,
            new_scale < scale,
            new_scale > scale,
        ]
    )
    counters.add_(inc)
    counters[2].mul_(inc[1])  # consecutive skips: reset by a clean step
