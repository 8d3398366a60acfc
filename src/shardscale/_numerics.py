"""Gradient numerics users can see: how close the scaled gradients came to fp16's overflow
(headroom), how many would vanish in fp16 (underflow), their unscaled norm and amax.

Measured on request (:meth:`shardscale.ShardedGradScaler.numerics`) from the gradients as they
are after ``step()`` and before ``zero_grad()``: one pass over them and one host read per
parameter group, split by FSDP unit where a group spans several (the units found from the
module the scaler names parameters from). Nothing here runs in the training step.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable
from typing import Any

import torch

from . import _sync
from ._grads import local_grads
from ._report import ParamNames

#: fp16's largest finite value and its smallest normal one (below it: subnormal, then zero).
FP16_MAX = 65504.0
FP16_TINY = 2.0**-14
#: Elements per piece of a gradient: bounds the temporaries of the underflow count (4 MiB).
_PIECE = 1 << 20


@dataclasses.dataclass(frozen=True)
class GroupNumerics:
    """One parameter group's local gradients (this rank's shards) at the last step.

    Attributes:
        name: ``"optimizer i, group j"``; ``"optimizer i, group j, unit <path>"`` when the
            group's parameters belong to several FSDP units and the scaler names parameters
            from the model (``param_names=model``): one entry per unit, ``<path>`` the unit's
            module path (a parameter belongs to its innermost unit; ``(root)``: the root module
            is the unit; ``(none)``: parameters of no unit).
        rank: the global rank measured.
        headroom_bits: ``log2(65504 / (amax * scale))``: how many doublings of the scale the
            largest scaled gradient had left before fp16 overflows (inf when every gradient is
            0; negative, -inf for an inf or NaN: it overflowed).
        underflow: fraction of elements whose scaled value is zero or subnormal in fp16
            (``|g * scale| < 2**-14``), in [0, 1].
        zeros: fraction of elements exactly zero, in [0, underflow]: gradients the step left
            at 0 (an embedding's rows no token used, a masked input) count as underflow too,
            and ``underflow - zeros`` is the fraction that is subnormal.
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
    zeros: float = 0.0


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The gradient numerics of one step (:meth:`ShardedGradScaler.numerics`).

    Attributes:
        step: the step's 0-based index (``update()`` calls before it).
        scale: the loss scale its gradients were computed with.
        groups: one :class:`GroupNumerics` per (rank, optimizer, parameter group) with
            gradients (per FSDP unit where a group spans several), sorted by rank.
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

    @property
    def zeros(self) -> float:
        """The fraction of all measured elements exactly zero (part of :attr:`underflow`)."""
        total = sum(g.numel for g in self.groups)
        return sum(g.zeros * g.numel for g in self.groups) / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        """The headline figures for loggers: ``headroom_bits``, ``underflow``."""
        return {"headroom_bits": self.headroom_bits, "underflow": self.underflow}


def _part_values(grads: list[torch.Tensor], factor: float) -> torch.Tensor:
    """``[amax, sum of squares, underflowing elements, zero elements]`` of ``grads`` as they
    are stored (a
    float64 tensor on their device, not read), ``factor`` times the stored values being the
    scaled ones."""
    device = grads[0].device
    amax = torch.zeros((), dtype=torch.float32, device=device)
    squares = torch.zeros((), dtype=torch.float64, device=device)
    under = torch.zeros((), dtype=torch.int64, device=device)
    zeros = torch.zeros((), dtype=torch.int64, device=device)
    threshold = FP16_TINY / factor
    with torch.no_grad():
        for g in grads:
            for piece in g.reshape(-1).split(_PIECE):
                a = piece.abs()
                if a.dtype not in (torch.float32, torch.float64):
                    a = a.float()  # fp16: 2**-14 / scale may lie below its smallest subnormal
                amax = torch.maximum(amax, a.max().float())
                squares = squares + a.double().square().sum()
                under = under + (a < threshold).sum()
                zeros = zeros + (a == 0).sum()
    return torch.stack([amax.double(), squares, under.double(), zeros.double()])


def _unit_types() -> tuple[type, ...]:
    """The classes of FSDP units: FSDP2's ``FSDPModule`` (``fully_shard``) and FSDP1's
    ``FullyShardedDataParallel``; none while ``torch.distributed.fsdp`` was never imported (no
    module can be one then, and importing it here would cost the first call)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    found = (getattr(fsdp, n, None) for n in ("FSDPModule", "FullyShardedDataParallel"))
    return tuple(t for t in found if isinstance(t, type))


def fsdp_units(names: ParamNames | None) -> dict[int, str]:
    """``{id(parameter): path of its FSDP unit}`` for the parameters ``names`` names from a
    module (``param_names=model``): the unit is the innermost FSDP module (``fully_shard``ed,
    or FSDP1-wrapped) holding the parameter, its path as ``named_modules()`` gives it (``""``
    for the root). Empty without a module, or without FSDP units in it. Host work only."""
    root = names.root() if names is not None and names.root is not None else None
    types = _unit_types() if root is not None else ()
    if not types:
        return {}
    units = {path for path, m in root.named_modules() if isinstance(m, types)}
    if not units:
        return {}
    out: dict[int, str] = {}
    for pid, name in names.current().items():
        parts = name.split(".")[:-1]  # the owning module's path, then its outer ones
        for k in range(len(parts), -1, -1):
            path = ".".join(parts[:k])
            if path in units:
                out[pid] = path
                break
    return out


def _split(
    params: list[Any], pairs: list[tuple[Any, torch.Tensor]], units: dict[int, str]
) -> list[tuple[str, list[torch.Tensor]]]:
    """``pairs`` (``(parameter, local gradient)`` of a group's ``params``) by FSDP unit, in
    order of first appearance: ``[("", all)]`` when ``params`` are in one unit (or none), else
    ``[(", unit <path>", ...)]`` (``(root)``: the root module's unit, ``(none)``: no unit).
    Decided from ``params``, not ``pairs``: every rank names the same way, one holding no
    shard of a unit leaves it out."""
    if len({units.get(id(q)) for q in params}) <= 1:
        return [("", [v for _, v in pairs])]
    by_unit: dict[str | None, list[torch.Tensor]] = {}
    for param, values in pairs:
        by_unit.setdefault(units.get(id(param)), []).append(values)
    labels = {None: "(none)", "": "(root)"}
    return [(f", unit {labels.get(u, u)}", grads) for u, grads in by_unit.items()]


def measure(
    optimizers: Iterable[tuple[Any, bool]],
    scale: float,
    rank: int,
    names: ParamNames | None = None,
) -> list[GroupNumerics]:
    """The numerics of each parameter group of ``optimizers``: ``(optimizer, still_scaled)``
    pairs, ``still_scaled`` when its gradients hold ``scale`` times their values (a fused
    step's), else unscaled in place. A group whose parameters belong to several FSDP units
    (:func:`fsdp_units` of ``names``) gives one entry per unit. One pass and one host read per
    group with gradients."""
    units = fsdp_units(names)
    out = []
    for i, (optimizer, still_scaled) in enumerate(optimizers):
        for j, group in enumerate(optimizer.param_groups):
            pairs = [(p, v) for p, v in local_grads(group["params"]) if v.is_floating_point()]
            if not pairs:
                continue
            factor = 1.0 if still_scaled else scale  # stored value * factor = scaled value
            parts = _split(group["params"], pairs, units)
            values = torch.stack([_part_values(grads, factor) for _, grads in parts]).tolist()
            for (label, grads), (amax, squares, under, zeros) in zip(parts, values, strict=True):
                name, numel = f"optimizer {i}, group {j}{label}", sum(g.numel() for g in grads)
                figures = _figures(name, rank, scale, factor, amax, squares, under, numel)
                out.append(dataclasses.replace(figures, zeros=zeros / numel))
    return out


def of_step(
    index: int,
    scale: float,
    optimizers: Iterable[tuple[Any, bool]],
    names: ParamNames | None,
    groups: list[Any] | None,
) -> Numerics | None:
    """``ShardedGradScaler.numerics()`` of the step ``index`` at ``scale``: :func:`measure`
    of this rank's ``optimizers``, gathered over the process ``groups`` when given (one
    ``all_gather_object`` each, collective); None when no gradient is left to measure."""
    found = measure(optimizers, scale, _sync.rank(), names)
    if groups is not None:
        found = _sync.gather_objects(found, groups)
    if not found:  # nothing left to measure: no figures rather than an infinite headroom
        return None
    return Numerics(index, scale, tuple(sorted(found, key=lambda g: (g.rank, g.name))))


def _figures(
    name: str,
    rank: int,
    scale: float,
    factor: float,
    amax: float,
    squares: float,
    under: float,
    numel: int,
) -> GroupNumerics:
    """The figures of one group (or unit) from its stored ``amax``, sum of ``squares`` and
    ``under``flowing count, ``factor`` times the stored values being the scaled ones."""
    top = amax * factor
    if math.isnan(top) or math.isinf(top):
        headroom = -math.inf  # it overflowed (an inf or a NaN)
    else:
        headroom = math.log2(FP16_MAX / top) if top > 0 else math.inf
    unscale = factor / scale
    return GroupNumerics(
        name, rank, headroom, under / numel, math.sqrt(squares) * unscale, amax * unscale, numel
    )
