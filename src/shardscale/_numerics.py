"""Gradient numerics users can see: how close the scaled gradients came to fp16's overflow
(headroom), how many would vanish in fp16 (underflow), their unscaled norm and amax.

Measured on request (:meth:`shardscale.ShardedGradScaler.numerics`) from the gradients as they
are after ``step()`` and before ``zero_grad()``: one pass over them and one host read per
parameter group. Nothing here runs in the training step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch

from ._grads import local_grads

#: fp16's largest finite value and its smallest normal one (below it: subnormal, then zero).
FP16_MAX = 65504.0
FP16_TINY = 2.0**-14
#: Elements per piece of a gradient: bounds the temporaries of the underflow count (4 MiB).
_PIECE = 1 << 20


@dataclasses.dataclass(frozen=True)
class GroupNumerics:
    """One parameter group's local gradients (this rank's shards) at the last step.

    Attributes:
        name: ``"optimizer i, group j"``.
        rank: the global rank measured.
        headroom_bits: ``log2(65504 / (amax * scale))``: how many doublings of the scale the
            largest scaled gradient had left before fp16 overflows (inf when every gradient is
            0; negative: it overflowed).
        underflow: fraction of elements whose scaled value is zero or subnormal in fp16
            (``|g * scale| < 2**-14``), in [0, 1].
        grad_norm: the unscaled L2 norm of these local gradients.
        amax: the unscaled largest absolute value (inf/NaN after an overflow).
        numel: elements measured.
    """

    name: str
    rank: int
    headroom_bits: float
    underflow: float
    grad_norm: float
    amax: float
    numel: int


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The gradient numerics of one step (:meth:`ShardedGradScaler.numerics`).

    Attributes:
        step: the step's 0-based index (``update()`` calls before it).
        scale: the loss scale its gradients were computed with.
        groups: one :class:`GroupNumerics` per (rank, optimizer, parameter group) with
            gradients, sorted by rank.
    """

    step: int
    scale: float
    groups: tuple[GroupNumerics, ...]

    @property
    def headroom_bits(self) -> float:
        """The smallest headroom over the groups (inf if none)."""
        return min((g.headroom_bits for g in self.groups), default=math.inf)

    @property
    def underflow(self) -> float:
        """The fraction of all measured elements that underflow in fp16."""
        total = sum(g.numel for g in self.groups)
        return sum(g.underflow * g.numel for g in self.groups) / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        """The headline figures for loggers: ``headroom_bits``, ``underflow``."""
        return {"headroom_bits": self.headroom_bits, "underflow": self.underflow}


def _group_values(grads: list[torch.Tensor], factor: float) -> list[float]:
    """``[amax, sum of squares, underflowing elements, elements]`` of ``grads`` as they are
    stored, ``factor`` times the stored values being the scaled ones (one host read)."""
    device = grads[0].device
    amax = torch.zeros((), dtype=torch.float32, device=device)
    squares = torch.zeros((), dtype=torch.float64, device=device)
    under = torch.zeros((), dtype=torch.int64, device=device)
    numel = 0
    threshold = FP16_TINY / factor
    with torch.no_grad():
        for g in grads:
            flat = g.reshape(-1)
            numel += flat.numel()
            for piece in flat.split(_PIECE):
                a = piece.abs()
                amax = torch.maximum(amax, a.max().float())
                squares = squares + a.double().square().sum()
                under = under + (a < threshold).sum()
    values = torch.stack([amax.double(), squares, under.double()]).tolist()
    return [*values, float(numel)]


def measure(
    optimizers: Iterable[tuple[Any, bool]], scale: float, rank: int
) -> list[GroupNumerics]:
    """The numerics of each parameter group of ``optimizers``: ``(optimizer, still_scaled)``
    pairs, ``still_scaled`` when its gradients hold ``scale`` times their values (a fused
    step's), else unscaled in place. One pass and one host read per group with gradients."""
    out = []
    for i, (optimizer, still_scaled) in enumerate(optimizers):
        for j, group in enumerate(optimizer.param_groups):
            grads = [v for _, v in local_grads(group["params"]) if v.is_floating_point()]
            if not grads:
                continue
            factor = 1.0 if still_scaled else scale  # stored value * factor = scaled value
            amax, squares, under, numel = _group_values(grads, factor)
            true_amax = amax * (factor / scale)
            top = amax * factor
            if math.isnan(top) or math.isinf(top):
                headroom = -top  # NaN, or -inf: it overflowed
            else:
                headroom = math.log2(FP16_MAX / top) if top > 0 else math.inf
            norm = math.sqrt(squares) * (factor / scale)
            out.append(
                GroupNumerics(
                    f"optimizer {i}, group {j}", rank, headroom, under / numel, norm,
                    true_amax, int(numel),
                )  # fmt: skip
            )
    return out
