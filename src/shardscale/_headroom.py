"""``policy="headroom"``: the loss scale set from the measured largest |scaled gradient|.

After each clean step every rank knows the largest absolute value of the scaled gradients of
the whole group (``amax``: each rank's from its check pass, agreed by MAX in the one agreement
all-reduce, :func:`shardscale._sync.agree`). The rule (evidence and sources:
``docs/headroom.md``)::

    u    = amax / scale                        # unscaled (exact for a power-of-two scale)
    hist = the last H entries                   # H = headroom_history (50)
    m    = headroom_margin + log2(world)        # 3 bits + log2 of the agreement groups' size
    measured:         push u                    # 0 (all-zero gradients): an empty slot
    absorbed overflow (hysteresis): push an empty slot; the scale stays
    clean:            s' = 2**floor(log2(65504 / max(hist)) - m)  # no growth limit; may go down
                      (empty history: the scale stays)
    k-th backoff in a row (an overflow the hysteresis does not absorb):
                      push 65504 * 2**-m * 1.0001 / scale   # a pseudo entry: the target of
                                                # max(hist) is below the scale for H updates
                      s' = min(target of max(hist), scale * 2**-(2**(k-1)))  (k >= 2)
                      # x0.5 (the pseudo entry's target), x0.25, x1/16, ... for a power of two
    scale = s', clamped to the powers of two in [max(min_scale, 1), max_scale]

Everything here is small tensor code on the scale's device, no host read, the same on every
rank given the same agreed inputs (so every rank computes the same scale): :func:`step_` in
place, :func:`next_state` pure. :class:`Headroom` is the scaler's holder of the rule's state
(numbers until placed, then :class:`HeadroomState` tensors) and of the iteration's agreed amax.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._config import ScalerConfig
from ._policy import ScaleState, count_

#: fp16's largest finite value.
FP16_MAX = 65504.0
#: Backoffs in a row are counted up to this many: the k-th goes 2**(k-1) bits down, and
#: after 7 in a row the scale has dropped 127 bits (to the floor).
MAX_RUN = 7
#: An overflow's pseudo entry is this much above the amax whose target is one exponent below
#: the overflowing one, so that ``floor`` lands on ``e - 1`` despite rounding (1e-4 relative
#: >> float32's 6e-8).
PSEUDO_SLACK = 1.0001


def margin_bits(config: ScalerConfig, world: int) -> float:
    """Bits kept between ``max(hist) * scale`` and 65504: ``headroom_margin + log2(world)``
    (``world``: the number of ranks whose gradients the agreed amax covers; a rank's own
    gradients sit ~log2(world) bits above the averaged ones, ``docs/headroom.md``)."""
    return config.headroom_margin + math.log2(max(int(world), 1))


def exponent_range(config: ScalerConfig) -> tuple[int, int]:
    """``(lo, hi)``: the exponents of the smallest and largest powers of two inside
    ``[config.lowest, config.max_scale]`` (``hi >= lo``: :class:`ScalerConfig` refuses a
    headroom range holding none)."""
    return math.ceil(math.log2(config.lowest)), math.floor(math.log2(config.max_scale))


@dataclasses.dataclass
class HeadroomState:
    """The rule's state, tensors on the scale's device.

    Attributes:
        history: 1-d float32 of length ``headroom_history``: the last entries (unscaled amaxes
            and overflows' pseudo entries), oldest first, the newest last; 0.0 marks an empty
            slot (before the oldest entry).
        backoffs: 0-d int64, backoffs in a row (reset by a clean step; at most
            :data:`MAX_RUN`).
        limits: 1-d float32 of length ``MAX_RUN + 1``, a constant: the factor bounding the
            scale after the k-th backoff in a row, ``limits[k]``: inf for none (a clean step),
            1 for the first (the pseudo entry's target already lies below the scale), then
            ``2**-(2**(k-1))``.
    """

    history: torch.Tensor
    backoffs: torch.Tensor
    limits: torch.Tensor

    @classmethod
    def create(
        cls, device: torch.device, length: int, entries: tuple[float, ...], backoffs: int
    ) -> HeadroomState:
        """A state on ``device`` holding the last ``length`` of ``entries`` (oldest first)."""
        kept = list(entries)[-length:] if length else []
        values = [0.0] * (length - len(kept)) + kept
        limits = [math.inf, 1.0] + [2.0 ** -(2 ** (k - 1)) for k in range(2, MAX_RUN + 1)]
        return cls(
            history=torch.tensor(values, dtype=torch.float32).to(device),
            backoffs=torch.full((), min(backoffs, MAX_RUN), dtype=torch.int64, device=device),
            limits=torch.tensor(limits, dtype=torch.float32).to(device),
        )

    def clone(self) -> HeadroomState:
        return HeadroomState(*(t.clone() for t in dataclasses.astuple(self)))


@dataclasses.dataclass(frozen=True)
class HeadroomNumbers:
    """The rule's state as plain numbers (before it is placed, as read, in a state dict).

    Attributes:
        history: the entries, oldest first (unscaled amaxes and pseudo entries, all > 0).
        backoffs: backoffs in a row.
    """

    history: tuple[float, ...] = ()
    backoffs: int = 0


def read(state: HeadroomState) -> HeadroomNumbers:
    """``state`` as numbers: one host read."""
    values = torch.cat([state.history.double(), state.backoffs.double().reshape(1)]).tolist()
    return HeadroomNumbers(tuple(v for v in values[:-1] if v > 0.0), int(values[-1]))


def step_(
    state: ScaleState,
    rule: HeadroomState,
    found_inf: torch.Tensor,
    amax: torch.Tensor,
    config: ScalerConfig,
    world: int = 1,
    measured: bool = False,
    unit: torch.Tensor | None = None,
    binary: bool = False,
    clean: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One update of ``policy="headroom"`` (module docstring), in place: ``state``'s scale,
    trackers and counters and ``rule``'s history. Tensor ops only, no host read: 35 small
    ones with the defaults (the margin's constants folded on the host, the history a shift
    register, the k-th backoff's factor looked up in :attr:`HeadroomState.limits`); 23 when
    the host read the iteration's flags clean (``clean``: no backoff, no collapse possible).

    The hysteresis is :func:`shardscale._policy.step_`'s: an overflow it absorbs keeps the
    scale (an empty slot pushed); the growth tracker counts clean steps since the scale last rose or
    an overflow (below ``growth_interval``, which is otherwise unused).

    Args:
        state: the scale state; updated in place.
        rule: the history; updated in place.
        found_inf: 0-d float32 on the state's device: optimizers that overflowed, agreed.
        amax: 0-d float32 there: the largest |scaled gradient| of the iteration over the
            ranks (any value < 0: not measured; ignored after an overflow).
        config: the policy (``config.headroom``).
        world: the ranks the amax covers (:func:`margin_bits`), a host constant.
        measured: the host knows that ``amax >= 0`` (or NaN/inf with an overflow): the
            entry is pushed without testing it (an amax of 0 pushes an empty slot).
        unit: a 0-d float32 1.0 on the state's device (the counters' constant), or None.
        binary: ``found_inf`` is 0 or 1 (one optimizer's agreed flag), not a count.
        clean: the host read every flag of the iteration and none was set (non-fused steps:
            :meth:`shardscale._iteration.Iteration.seen_clean`), so ``found_inf`` is 0: with
            ``hysteresis=1`` the overflow's branches are left out.

    Returns:
        ``(collapsed, old_scale)``: 0-d bool (a backoff due at or below ``config.floor``, or
        ``max_consecutive_skips`` reached; None when ``clean``: none is possible) and a 0-d
        copy of the scale before the update.
    """
    simple = config.hysteresis == 1 and not config.consecutive_hysteresis
    clean = clean and simple  # with hysteresis the tracker's refill still follows the rule
    scale, gt, ht, k = state.scale, state.growth_tracker, state.hysteresis_tracker, rule.backoffs
    old = scale.clone()
    # backoffs in a row (saturating at MAX_RUN: the table's last factor) and the entry: an
    # overflow's pseudo entry PSEUDO / scale puts the history's target below the scale
    pseudo = FP16_MAX * PSEUDO_SLACK * 2.0 ** -margin_bits(config, world)
    if clean:  # found_inf is 0: no backoff, nothing absorbed, the measured entry
        overflow = backoff_due = absorbed = None
        k.zero_()
        entry = amax / old
    elif simple:
        overflow = found_inf > 0
        backoff_due, absorbed = overflow, None
        k.add_(1).clamp_max_(MAX_RUN).mul_(overflow)
        entry = amax.masked_fill(overflow, pseudo) / old
    else:
        overflow = found_inf > 0
        ht_after = torch.where(overflow, (ht - 1).clamp_min(0), ht)
        backoff_due = overflow & (ht_after == 0)
        absorbed = overflow & ~backoff_due
        k.copy_(torch.where(backoff_due, (k + 1).clamp_max(MAX_RUN), k * overflow))
        entry = amax.masked_fill(overflow, 0.0).masked_fill_(backoff_due, pseudo) / old
    history = rule.history
    shifted = torch.cat([history[1:], entry.reshape(1)])
    # not measured (amax < 0) and clean: nothing pushed; a measured 0 pushes an empty slot, as
    # with `measured` (a joined rank, told the agreed amax only, pushes what the others push)
    history.copy_(shifted if measured else torch.where(entry >= 0, shifted, history))
    peak = history.max()
    new = _target(peak, config, world)
    if not clean:  # the k-th backoff in a row's bound (none after a clean step: inf)
        new = torch.minimum(new, old * rule.limits.gather(0, k.view(1)).view(()))
    _clamp_(new, config)
    known = peak > 0  # an empty history keeps the scale
    torch.where(known if absorbed is None else known & ~absorbed, new, old, out=scale)
    grew, shrank = scale > old, scale < old
    reset = grew if clean else overflow | grew
    gt.add_(1).clamp_max_(config.growth_interval - 1).masked_fill_(reset, 0)
    if not simple:
        refill = (grew | ~overflow) if config.consecutive_hysteresis else grew
        ht.copy_(torch.where(refill, config.hysteresis, ht_after))
    count_(state.counters, found_inf, shrank, grew, unit, binary or clean)
    if clean:
        return None, old  # no backoff: no collapse; consecutive skips reset
    collapsed = backoff_due & (old <= config.floor)
    if config.max_consecutive_skips is not None:
        collapsed = collapsed | (state.counters[2] >= config.max_consecutive_skips)
    return collapsed, old


def _target(peak: torch.Tensor, config: ScalerConfig, world: int) -> torch.Tensor:
    """The history's target: the largest power of two keeping ``peak`` (0-d float32, the
    history's largest entry) ``margin_bits`` below fp16's largest value (4 ops; inf for an
    empty history). float32: an integer boundary within its rounding (~4e-6 bits) is a coin
    toss either way."""
    top = math.log2(FP16_MAX) - margin_bits(config, world)
    return torch.exp2(torch.floor(top - torch.log2(peak)))


def _clamp_(new: torch.Tensor, config: ScalerConfig) -> None:
    """Clamp ``new`` (0-d) to the powers of two in ``[config.lowest, config.max_scale]``, in
    place."""
    lo_e, hi_e = exponent_range(config)
    new.clamp_(2.0**lo_e, 2.0**hi_e)


def next_state(
    state: ScaleState,
    rule: HeadroomState,
    found_inf: torch.Tensor,
    amax: torch.Tensor,
    config: ScalerConfig,
    world: int = 1,
    measured: bool = False,
) -> tuple[ScaleState, HeadroomState, torch.Tensor]:
    """:func:`step_` on copies: pure. Returns ``(new_state, new_rule, collapsed)``."""
    new, new_rule = state.clone(), rule.clone()
    collapsed, _ = step_(new, new_rule, found_inf, amax, config, world, measured)
    return new, new_rule, collapsed


def local_amax(amaxes: dict[torch.device, torch.Tensor], home: torch.device) -> torch.Tensor:
    """The MAX of per-device 0-d amaxes (:func:`shardscale._grads.measure_and_check`) as one
    0-d float32 on ``home``; 0.0 when there is none (a rank holding no gradient)."""
    own = amaxes.get(home)
    if own is not None and len(amaxes) == 1:
        return own
    out = torch.zeros((), dtype=torch.float32, device=home)
    for value in amaxes.values():
        out = torch.maximum(out, value.to(home))
    return out


class Headroom:
    """The scaler's ``policy="headroom"`` state: the rule's history (:class:`HeadroomNumbers`
    until placed, then :class:`HeadroomState` on the scale's device) and this iteration's
    agreed amax.

    Attributes:
        numbers: the state to create when placed (initial or loaded).
        tensors: the state on its device, or None.
        pending: 0-d float32, the MAX of this iteration's agreed amaxes (< 0: not measured),
            or None before the first check.
        world: the ranks the amax covers (product of the agreement groups' sizes).
        phase: updates counted modulo ``measure_every`` (kept on the host with
            ``measure_every`` > 1; restored from a checkpoint's steps counter): a step compiled
            from globals guards on it, so it takes ``measure_every`` values, not one per update.
    """

    def __init__(self, numbers: HeadroomNumbers | None = None) -> None:
        self.numbers = numbers or HeadroomNumbers()
        self.tensors: HeadroomState | None = None
        self.pending: torch.Tensor | None = None
        self.world = 1
        self.phase = 0

    def due(self, config: ScalerConfig) -> bool:
        """Whether a non-fused step of this iteration measures (every ``measure_every``-th).
        With ``measure_every=1`` the count is not read (a compiled step would guard on it and
        recompile at every update)."""
        return config.measure_every == 1 or self.phase % config.measure_every == 0

    def note(self, amax: torch.Tensor, world: int) -> None:
        """An agreed amax of this iteration (0-d float32; < 0: not measured)."""
        self.pending = amax if self.pending is None else torch.maximum(self.pending, amax)
        self.world = world

    def take(self, home: torch.device, config: ScalerConfig) -> torch.Tensor:
        """The iteration's amax (-1.0: not measured), and a fresh iteration (counted for
        ``measure_every`` > 1 only: see :meth:`due`)."""
        amax = self.pending
        self.pending = None
        if config.measure_every != 1:
            self.phase = (self.phase + 1) % config.measure_every
        if amax is None:
            return torch.full((), -1.0, dtype=torch.float32, device=home)
        return amax.to(home)

    def request(self, config: ScalerConfig, check_only: bool) -> dict | None:
        """A dict for a check to fill with per-device amaxes, or None: not measuring (another
        policy, or a non-fused step between two ``measure_every`` ones)."""
        if config.headroom and (check_only or self.due(config)):
            return {}
        return None

    def update_(
        self,
        state: ScaleState,
        found_inf: torch.Tensor,
        config: ScalerConfig,
        unit: torch.Tensor | None = None,
        binary: bool = False,
        clean: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``update()`` under ``policy="headroom"``: :func:`step_` with this iteration's amax
        (``unit``, ``binary``, ``clean``: as there); returns its ``(collapsed, old_scale)``."""
        home = state.scale.device
        measured = self.pending is not None
        rule, amax = self.place(home, config), self.take(home, config)
        return step_(
            state, rule, found_inf, amax, config, self.world, measured, unit, binary, clean
        )

    def forget(self) -> None:
        """The iteration was abandoned: its amax is dropped."""
        self.pending = None

    def place(self, device: torch.device, config: ScalerConfig) -> HeadroomState:
        """The tensors on ``device`` (created, moved, or resized to ``headroom_history``)."""
        t = self.tensors
        if t is None or t.history.numel() != config.headroom_history:
            numbers = self.numbers if t is None else read(t)
            self.tensors = HeadroomState.create(
                device, config.headroom_history, numbers.history, numbers.backoffs
            )
        elif t.history.device != device:
            self.tensors = HeadroomState(*(x.to(device) for x in dataclasses.astuple(t)))
        return self.tensors

    def read(self) -> HeadroomNumbers:
        """The state as numbers (one host read once placed)."""
        return self.numbers if self.tensors is None else read(self.tensors)

    def load(self, numbers: HeadroomNumbers, updates: int, config: ScalerConfig) -> None:
        """Install validated ``numbers`` (the tensors are re-created at the next update) and
        ``updates`` (the checkpoint's count of updates: ``measure_every``'s phase)."""
        self.numbers, self.tensors, self.pending = numbers, None, None
        self.phase = updates % config.measure_every

    def set_scale(self, counted: bool, config: ScalerConfig) -> None:
        """``update(new_scale)``: the amax is dropped; an iteration that counted (checked,
        as for the steps counter) counts for ``measure_every``'s phase."""
        self.pending = None
        self.phase = (self.phase + counted) % config.measure_every
