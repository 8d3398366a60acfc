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
import math

import torch

from ._config import ScalerConfig

#: Order of the entries of :attr:`ScaleState.counters`.
COUNTER_NAMES = ("steps", "skipped_steps", "consecutive_skips", "overflows", "backoffs", "growths")


#: ``str(device) -> whether float64 tensors work there``, found by :func:`has_float64`.
_FLOAT64: dict[str, bool] = {}


def _try_float64(device: torch.device) -> bool:
    try:
        torch.zeros(1, dtype=torch.float64, device=device)
    except (RuntimeError, TypeError, NotImplementedError):  # MPS: TypeError; XPU: RuntimeError
        return False
    return True


def has_float64(device: torch.device) -> bool:
    """Whether ``device`` runs float64 tensors (Apple MPS and Intel Arc GPUs do not), found by
    trying one, once per device. A probe made under a ``TorchDispatchMode`` answers for that
    mode (which may refuse float64, as a test of such a device does) and is not remembered;
    while ``torch.compile`` traces, the eager answer is used (float64 if none was found yet)."""
    key = str(device)
    known = _FLOAT64.get(key)
    if torch.compiler.is_compiling():
        return True if known is None else known
    if torch._C._len_torch_dispatch_stack():
        return _try_float64(device)
    if known is None:
        known = _FLOAT64[key] = _try_float64(device)
    return known


def math_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (:func:`has_float64`; torch's scaler computes 1/scale in
    double), else float32."""
    return torch.float64 if has_float64(device) else torch.float32


@dataclasses.dataclass
class ScaleState:
    """The scaler's numeric state, all tensors on the device of the scale.

    Attributes:
        scale: 0-d float32, the current loss scale.
        growth_tracker: 0-d int32, clean steps since the last growth or overflow.
        hysteresis_tracker: 0-d int32, overflows still tolerated before a backoff (with
            ``hysteresis=1`` every overflow backs off and it stays 1).
        counters: 1-d float64 (float32 where the device has no float64: exact up to 2**24) of
            length 6, in :data:`COUNTER_NAMES` order: updates done, skipped steps, consecutive
            skipped steps, overflows (optimizer steps that saw inf/NaN), backoffs (the scale
            went down), growths (the scale went up).
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
        dtype: torch.dtype | None = None,
    ) -> ScaleState:
        """Build a state on ``device`` from plain numbers (``dtype``: the counters', None for
        :func:`math_dtype`)."""
        return cls(
            scale=torch.full((), scale, dtype=torch.float32, device=device),
            growth_tracker=torch.full((), growth_tracker, dtype=torch.int32, device=device),
            hysteresis_tracker=torch.full((), hysteresis_tracker, dtype=torch.int32, device=device),
            counters=torch.tensor(list(counters), dtype=dtype or math_dtype(device), device=device),
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


@dataclasses.dataclass(frozen=True)
class Numbers:
    """The scale state as plain Python numbers (before it is placed on a device, or as read).

    Attributes:
        scale: the loss scale.
        growth_tracker, hysteresis_tracker: as :class:`ScaleState`'s.
        counters: in :data:`COUNTER_NAMES` order.
    """

    scale: float
    growth_tracker: int = 0
    hysteresis_tracker: int = 1
    counters: tuple[int, ...] = (0,) * len(COUNTER_NAMES)

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"scale": self.scale}
        out.update(growth_tracker=self.growth_tracker, hysteresis_tracker=self.hysteresis_tracker)
        out.update(zip(COUNTER_NAMES, self.counters, strict=True))
        return out


class LossScale:
    """The scaler's scale state, one object: :class:`Numbers` until it is placed on a device
    (lazily, on the first loss scaled), then :class:`ScaleState` tensors there, updated in place
    (whoever holds them, a fused optimizer or a CUDA graph, sees the new values).

    Attributes:
        numbers: the state to create when placed (the initial or loaded one).
        tensors: the state on its device, or None before it is placed.
        unit: a 0-d float32 1.0 on that device (the plain update's constant).
        math: the counters' dtype, in which ``1/scale`` is divided too (:func:`math_dtype`:
            float64, float32 where the device has none), found when placed.
    """

    def __init__(self, numbers: Numbers) -> None:
        self.numbers = numbers
        self.tensors: ScaleState | None = None
        self.unit: torch.Tensor | None = None
        self.math: torch.dtype = torch.float64

    def place(self, device: torch.device) -> ScaleState:
        """The tensors, created on ``device`` if they do not exist (else where they are)."""
        if self.tensors is None:
            n, self.math = self.numbers, math_dtype(device)
            self.tensors = ScaleState.create(
                device, n.scale, n.growth_tracker, n.hysteresis_tracker, n.counters, self.math
            )
            self.unit = torch.ones((), dtype=torch.float32, device=device)
        return self.tensors

    def move(self, device: torch.device) -> None:
        """Move the tensors to ``device`` (new tensors there)."""
        if self.tensors is not None and self.tensors.scale.device != device:
            s, self.math = self.tensors, math_dtype(device)
            self.tensors = ScaleState(
                s.scale.to(device),
                s.growth_tracker.to(device),
                s.hysteresis_tracker.to(device),
                s.counters.to(device, self.math),  # float32 where the device has no float64
            )
            self.unit = torch.ones((), dtype=torch.float32, device=device)

    def load(self, numbers: Numbers) -> None:
        """Install ``numbers`` (validated): into the tensors in place when placed. The tensors
        are built first, so a failure changes nothing."""
        if self.tensors is not None:
            n = numbers
            fresh = ScaleState.create(
                self.tensors.scale.device,
                n.scale,
                n.growth_tracker,
                n.hysteresis_tracker,
                n.counters,
                self.math,
            )
            self.tensors.copy_from(fresh)
        self.numbers = numbers

    def cap_growth_tracker(self, last: int) -> None:
        """Keep the growth tracker at most ``last`` (a shorter growth interval)."""
        n = self.numbers
        self.numbers = dataclasses.replace(n, growth_tracker=min(n.growth_tracker, last))
        if self.tensors is not None:
            self.tensors.growth_tracker.clamp_(max=min(last, 2**31 - 1))

    def set_(self, value: float, found_inf: torch.Tensor | None) -> torch.Tensor:
        """``update(new_scale)``: the scale set to ``value`` (validated), the trackers kept (as
        torch); the iteration counted when it was checked (``found_inf``, 0-d on the state's
        device). Returns a 0-d copy of the scale before."""
        state = self.tensors
        old = state.scale.clone()
        state.scale.fill_(value)
        if found_inf is not None:
            count_(state.counters, found_inf, state.scale < old, state.scale > old)
        return old

    def read(self, extra: torch.Tensor | None = None) -> tuple[Numbers, float]:
        """The state as numbers, and ``extra`` (a 0-d tensor on the state's device, e.g. the
        last found-inf flag; 0.0 if None): one host read (of :attr:`math` values), none before
        the state is placed."""
        if self.tensors is None:
            return self.numbers, 0.0
        s = self.tensors
        last = extra if extra is not None else torch.zeros_like(s.scale)
        parts = [*dataclasses.astuple(s), last.to(s.scale.device)]
        values = torch.cat([t.to(self.math).reshape(-1) for t in parts]).tolist()  # one read
        counters = tuple(int(v) for v in values[3:-1])
        return Numbers(float(values[0]), int(values[1]), int(values[2]), counters), values[-1]


def step_(
    state: ScaleState,
    found_inf: torch.Tensor,
    config: ScalerConfig,
    unit: torch.Tensor | None = None,
    binary: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
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
        unit: a 0-d float32 1.0 on the state's device, given when the host knows that neither
            bound can bind and no collapse can happen in this step (:class:`HostBounds`) and
            :attr:`ScalerConfig.plain`: then the step is torch's kernel and one update of the
            counters, 6 tensor operations in all (:func:`_plain_step_`).
        binary: ``found_inf`` is 0 or 1 (one optimizer's agreed flag), not a count.

    Returns:
        ``(collapsed, old_scale)``: 0-d bool (see the module docstring; None when ``unit`` is
        given: no collapse is possible) and a 0-d copy of the scale before the step.
    """
    if unit is not None:
        return None, _plain_step_(state, found_inf, config, unit, binary)
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
    count_(state.counters, found_inf, scale < old, scale > old)
    # float32 comparison: min_scale is rounded to the scale's dtype, as the clamp rounds it
    collapsed = backoff_due & (old <= config.min_scale)
    if config.max_consecutive_skips is not None:
        collapsed = collapsed | (state.counters[2] >= config.max_consecutive_skips)
    return collapsed, old


def _plain_step_(
    state: ScaleState,
    found_inf: torch.Tensor,
    config: ScalerConfig,
    unit: torch.Tensor,
    binary: bool,
) -> torch.Tensor:
    """:func:`step_` for a plain policy whose bounds cannot bind: torch's kernel, then the six
    counters in one ``addcmul`` (``counters * keep + increments``; ``keep`` is 0 only for the
    consecutive skips after a clean step). A backoff is exactly an overflow here."""
    scale = state.scale
    old = scale.clone()
    torch._amp_update_scale_(
        scale,
        state.growth_tracker,
        found_inf,
        config.growth_factor,
        config.backoff_factor,
        config.growth_interval,
    )
    over = found_inf if binary else found_inf.clamp(max=1.0)
    grew = scale > old
    inc = torch.stack([unit, over, over, found_inf, over, grew])
    keep = torch.stack([unit, unit, over, unit, unit, unit])
    torch.addcmul(inc, state.counters, keep, out=state.counters)
    return old


def next_state(
    state: ScaleState, found_inf: torch.Tensor, config: ScalerConfig
) -> tuple[ScaleState, torch.Tensor]:
    """Apply one step of the policy (:func:`step_`) to a copy of ``state``. Pure: ``state`` is
    not modified. Returns ``(new_state, collapsed)``."""
    new = state.clone()
    collapsed, _ = step_(new, found_inf, config)
    return new, collapsed


def count_(
    counters: torch.Tensor,
    found_inf: torch.Tensor,
    shrank: torch.Tensor,
    grew: torch.Tensor,
    unit: torch.Tensor | None = None,
    binary: bool = False,
) -> None:
    """Advance the counters by one update, in place (3-5 device ops, one ``addcmul``:
    ``counters * keep + increments``): steps, skips, consecutive skips (``keep`` 0 after a
    clean step: reset), overflows, and a backoff/growth when ``shrank``/``grew`` (0-d bool:
    the scale went down/up). ``unit``: a 0-d float32 1.0 there (None: made); ``binary``:
    ``found_inf`` is 0 or 1."""
    one = torch.ones_like(found_inf) if unit is None else unit
    over = found_inf if binary else found_inf.clamp(max=1.0)
    inc = torch.stack([one, over, over, found_inf, shrank, grew])
    keep = torch.stack([one, one, over, one, one, one])
    torch.addcmul(inc, counters, keep, out=counters)


@dataclasses.dataclass
class HostBounds:
    """What the host knows of the loss scale without reading it: ``lo <= scale <= hi``.

    From an exact value (a read, a load, ``update(new_scale)``), each update the host did not
    see clean may back the scale off by ``backoff_factor`` (``lo`` falls, down to
    ``min_scale``), and the scale can grow by ``growth_factor`` at most once every
    ``growth_interval`` updates (``hi`` rises). A scale below 1 has the unscaled gradients
    checked again (:meth:`below_one`); bounds that cannot bind let the update take the plain
    path (:meth:`free`).

    Attributes:
        lo: a lower bound of the scale.
        exact: the last exactly known scale.
        since: updates since then.
        below_one: ``lo < 1``: the scale may be below 1 (1/scale > 1: finite gradients may
            overflow once unscaled).
    """

    lo: float
    exact: float
    since: int = 0
    below_one: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.below_one = self.lo < 1.0

    @classmethod
    def at(cls, value: float) -> HostBounds:
        """Bounds at an exactly known scale."""
        return cls(value, value)

    def set_exact(self, value: float) -> None:
        """The scale is known exactly (read, loaded or set)."""
        self.lo, self.exact, self.since = value, value, 0
        self.below_one = value < 1.0

    def hi(self, config: ScalerConfig) -> float:
        """An upper bound of the scale (growths possible since :attr:`exact`)."""
        growths = -(-self.since // config.growth_interval)
        try:
            return self.exact * config.growth_factor**growths
        except OverflowError:
            return math.inf

    def after_update(
        self, config: ScalerConfig, seen_clean: bool, value: float | None = None
    ) -> None:
        """One update happened; ``seen_clean``: the host read every flag of it and none was set;
        ``value``: the scale it set (``update(new_scale)``), known exactly."""
        if value is not None:
            self.set_exact(value)
            return
        self.since += 1
        if config.headroom:  # any update lands in [config.lowest, max_scale] (>= 1)
            self.lo = config.lowest
            self.below_one = self.lo < 1.0
        elif config.dynamic and not seen_clean:
            self.lo = max(self.lo * config.backoff_factor, config.min_scale)
            self.below_one = self.lo < 1.0

    def safe_updates(self, config: ScalerConfig) -> float:
        """How many updates the host may leave unseen (a compiled loop's ``update()`` calls,
        until a step reads the scale again) with the scale still known to be at least 1:
        backoffs by ``backoff_factor`` from :attr:`lo` (inf where no update goes below 1;
        0 once :attr:`below_one`)."""
        if config.lowest >= 1.0 or not config.dynamic:
            return math.inf
        if self.below_one:
            return 0
        return math.floor(math.log(self.lo) / -math.log(config.backoff_factor))

    def free(self, config: ScalerConfig) -> bool:
        """Whether the next update can neither reach a bound nor collapse, and the policy is
        :attr:`ScalerConfig.plain`: the update may take the plain path (margins of 2x for the
        float32 rounding of the products). Never while ``torch.compile`` traces: a compiled
        ``update()`` runs again with the host's bounds left as they were at tracing (its
        updates go unseen), so it keeps the bounds and the collapse guard."""
        if not config.plain or torch.compiler.is_compiling():
            return False
        low = self.lo * config.backoff_factor >= 2.0 * config.min_scale
        return low and self.hi(config) * config.growth_factor * 2.0 <= config.max_scale
