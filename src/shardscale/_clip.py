"""Gradient clipping fused with unscaling: ``ShardedGradScaler.clip_grad_norm_``.

torch's recipe for clipping with a loss scaler is ``scaler.unscale_(opt)`` followed by
``torch.nn.utils.clip_grad_norm_(params, max_norm)``: one read+write pass to unscale, one read
pass for the norm, one read+write pass to clip, and, under FSDP, a norm that is only correct if
the caller knows which gradients are sharded. :func:`clip_grad_norm_` does the same job in

* **one read pass** over the *scaled* gradients computing per-tensor norms (fp32 accumulation,
  local shards only), split into a *sharded* and a *replicated* part;
* **one collective**: a 3-element all-reduce ``[sharded_part, replicated_part_on_rank_0,
  nonfinite_count]`` (SUM, or MAX for ``norm_type=inf``) that yields the global norm *and* the
  agreed found-inf flag (a non-finite norm means an inf/NaN gradient somewhere);
* **one write pass** multiplying every gradient by ``min(1, max_norm / (norm + 1e-6)) / scale``,
  or, for fused optimizers (``Adam/AdamW/SGD(fused=True)``), **no write pass at all**: the
  coefficient is folded into the ``grad_scale`` that :meth:`ShardedGradScaler.step` hands to the
  fused kernel (``grad_scale = scale / clip_coef``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import _cpukernel, _sync
from ._grads import grad_values, iter_params, plain_grad, require_writable
from ._norm import Buckets as _Buckets
from ._norm import _cpu_f32, _f32, global_norm_host, on_host
from ._norm import global_norm as _global_norm

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

try:
    from torch.distributed.fsdp._flat_param import FlatParameter
except ImportError:  # pragma: no cover
    FlatParameter = None  # type: ignore[assignment,misc]

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def clip_grad_norm_(
    scaler: object,
    optimizer_or_params: torch.optim.Optimizer | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
) -> torch.Tensor:
    """Unscale ``optimizer``'s gradients, compute their global norm across shards/ranks, and clip.

    Equivalent to ``scaler.unscale_(optimizer)`` followed by
    ``torch.nn.utils.clip_grad_norm_(all_params, max_norm, norm_type)`` on the *unsharded*
    model, with the found-inf agreement of ``unscale_``: afterwards the optimizer is in the
    UNSCALED stage with its agreed ``found_inf`` set, so ``scaler.step(optimizer)`` skips (on
    every rank) or steps, and ``scaler.update()`` backs off after an overflow. Overflow is
    detected from the norm itself (a non-finite global norm means an inf/NaN gradient).

    Gradients: plain tensors and DDP gradients (replicated: counted once, from the group's rank
    0), FSDP2 DTensor gradients (``Shard`` placements: local shards summed over ranks;
    ``Replicate``: counted once), FSDP1 ``FlatParameter`` gradients and ``use_orig_params``
    views (sharded), CPU-offloaded gradients next to device ones, fp32/fp16/bf16/fp64, sparse
    gradients (coalesced, their values count). Norms accumulate in fp32 (fp64 for fp64
    gradients) from per-tensor norms multiplied by ``1/scale`` before any power is taken. On the
    CPU, per-tensor norms for p = 1, 2, inf come from shardscale's compiled kernel, summed in
    float64 (no overflow, underflow or bf16 rounding whatever the scale); without it (no C
    compiler, other p) a per-tensor norm whose *scaled* value overflowed is recomputed from
    unscaled chunks, so a large scale never turns finite gradients into a spurious overflow
    there, and bf16 per-tensor norms come from torch's own kernel (each rounded to bf16,
    relative error <= 2**-8, as ``torch.nn.utils.clip_grad_norm_``, which also rounds the total
    to bf16). Everything else (any dtype on accelerators) is exact to fp32. Norm types whose p-th power
    sum overflows fp32 (a large ``p`` with gradients above 1) read as an overflow: the step is
    skipped (torch's recipe returns an inf norm and zeroes the gradients).

    Cost: one read pass computing per-tensor norms, **one** all-reduce of 3 floats (none
    without a process group), then one in-place multiply pass by
    ``min(1, max_norm / (norm + 1e-6)) / scale``. For a fused optimizer
    (``_step_supports_amp_scaling``, e.g. ``AdamW(fused=True)``) there is no write pass: the
    gradients stay *scaled* in memory and ``step`` passes ``grad_scale = scale / clip_coef`` to
    the fused kernel, which unscales and clips them in its fp32 math. No host synchronisation.
    After an overflow (non-fused) the gradients are only unscaled (inf/NaN stay where they
    were, for :meth:`ShardedGradScaler.overflow_report`); the step is skipped anyway.

    A disabled scaler (``enabled=False``) still clips with the global norm (scale 1, no
    found-inf bookkeeping), so the same training loop runs with or without fp16.

    Args:
        scaler: the :class:`~shardscale.ShardedGradScaler` (this is its method's body).
        optimizer_or_params: the optimizer whose gradients to clip (one collective in the
            iteration, fused optimizers folded), or a tensor / an iterable of parameters (a
            subset or all of a model's, as ``torch.nn.utils.clip_grad_norm_`` takes): those
            gradients are unscaled and clipped in place and remembered as unscaled, so the
            owning optimizer's ``step`` does not unscale them again and still skips on every
            rank after an overflow (it issues its own all-reduce: two in the iteration).
        max_norm: the largest allowed total norm (a finite or infinite number >= 0).
        norm_type: ``p`` of the p-norm, any number > 0, or ``inf`` / ``"inf"``.

    Returns:
        The total norm of the unscaled gradients over all ranks and shards, a 0-d float32 tensor
        on the scale's device (inf/NaN after an overflow), as ``torch.nn.utils.clip_grad_norm_``
        returns.

    Raises:
        TypeError: neither an optimizer nor tensors, a non-floating-point gradient, or a bad
            ``max_norm`` / ``norm_type`` type.
        ValueError: ``max_norm`` < 0 or NaN, ``norm_type`` <= 0, a DTensor gradient with a
            ``Partial`` placement (not yet reduced), or a gradient whose elements share memory
            (an expanded view; named, before anything is written).
        RuntimeError: called before ``scale()``, after ``unscale_``/``clip_grad_norm_`` or
            ``step`` for this optimizer in the same iteration (the order is
            ``scale -> backward -> clip_grad_norm_ -> step -> update``).
        NotImplementedError: the scaler reduces over several process groups / a multi-dimensional
            mesh, or a DTensor gradient lives on a multi-dimensional mesh (FSDP2 HSDP) or on a
            mesh of other ranks than the scaler's group (tensor parallelism on a sub-mesh):
            which gradients are replicated along which dimension is ambiguous there. Use
            ``unscale_`` + a norm of your own in that case.

    .. warning:: Two FSDP1 set-ups cannot be told apart from the tensors and give a wrong norm:
       ``HYBRID_SHARD`` with the scaler on the default (world) group sums shards over the
       replica dimension too (pass ``process_group=`` the FSDP shard group); and ``NO_SHARD``
       with ``use_orig_params=True`` counts the replicated gradients once per rank (use DDP, or
       ``use_orig_params=False``, where ``NO_SHARD`` is detected).
    """
    from .scaler import OptState, ShardedGradScaler

    if not isinstance(scaler, ShardedGradScaler):
        raise TypeError(f"scaler must be a ShardedGradScaler, got {type(scaler).__name__}.")
    optimizer = optimizer_or_params
    is_optimizer = hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))
    params = None if is_optimizer else _param_list(optimizer_or_params)
    max_norm_f = _check_max_norm(max_norm)
    p = _check_norm_type(norm_type)
    groups = scaler._groups()
    if len(groups) > 1:
        raise NotImplementedError(
            "clip_grad_norm_() supports one process group (or a 1-D DeviceMesh); this scaler "
            f"reduces over {len(groups)} groups. For HSDP / multi-dimensional meshes, call "
            "scaler.unscale_(optimizer) and compute the norm with your framework's helper."
        )
    group = groups[0] if groups else None

    if params is not None:
        return _clip_params(scaler, params, max_norm_f, p, group)
    if not scaler.is_enabled():
        buckets = _bucket(iter_params(optimizer), scaler.rank_local_params, group)
        return _clip_unscaled(buckets, p, max_norm_f, group)

    # validates the gradients before any change
    buckets = _bucket(iter_params(optimizer), scaler.rank_local_params, group)
    if scaler._pre_unscaled and any(id(q) in scaler._pre_unscaled for q in iter_params(optimizer)):
        raise RuntimeError(
            "clip_grad_norm_(optimizer) was called after clip_grad_norm_(params) on some of its "
            "parameters in this iteration; clip either the optimizer or parameter lists, once "
            "per parameter per iteration."
        )
    st = scaler._require_stage("clip_grad_norm_", optimizer)
    if st.stage is OptState.UNSCALED:
        raise RuntimeError(
            "clip_grad_norm_() was called after unscale_() or clip_grad_norm_() on this optimizer "
            "in this iteration; clip_grad_norm_() unscales by itself, so call it instead of "
            "unscale_(): scaler.scale(loss).backward() -> scaler.clip_grad_norm_(opt, max_norm) "
            "-> scaler.step(opt) -> scaler.update()."
        )
    if st.stage is OptState.STEPPED:
        raise RuntimeError(
            "clip_grad_norm_() was called after step() for this optimizer; the order is "
            "scaler.scale(loss).backward() -> scaler.clip_grad_norm_(opt, max_norm) -> "
            "scaler.step(opt) -> scaler.update()."
        )
    assert scaler._state is not None
    fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
    try:
        total, st.grad_scale, found_inf = _norm_and_clip(
            buckets, scaler._state.scale, scaler._inv_scale(), p, max_norm_f, group, fused
        )
    except BaseException:
        if st.stage is OptState.READY and st.found_inf is None:  # no half-started iteration
            scaler._per_optimizer.pop(id(optimizer), None)
        raise
    st.found_inf = found_inf
    st.stage = OptState.UNSCALED
    return total


# ----------------------------------------------------------------------------- validation
def _check_max_norm(max_norm: object) -> float:
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1:
        max_norm = float(max_norm.item())
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):  # NumPy scalars too
        raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}.")
    value = float(max_norm)
    if math.isnan(value) or value < 0:
        raise ValueError(f"max_norm must be >= 0 (inf disables clipping), got {max_norm!r}.")
    return value


def _check_norm_type(norm_type: object) -> float:
    if isinstance(norm_type, str):
        if norm_type.strip().lower() != "inf":
            raise ValueError(f"norm_type must be a number > 0 or 'inf', got {norm_type!r}.")
        return math.inf
    if isinstance(norm_type, torch.Tensor) and norm_type.numel() == 1:
        norm_type = float(norm_type.item())
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise TypeError(f"norm_type must be a number or 'inf', got {type(norm_type).__name__}.")
    value = float(norm_type)
    if math.isnan(value) or value <= 0:
        raise ValueError(
            f"norm_type must be > 0 (1, 2, ... or inf), got {norm_type!r}; 0 and -inf are not "
            "norms."
        )
    return value


# ------------------------------------------------------------------------------ gradients
def _same_ranks(mesh: Any, group: dist.ProcessGroup | None, seen: dict[int, bool]) -> bool:
    """Whether the 1-D ``mesh`` spans exactly the ranks of the scaler's ``group`` (memoised)."""
    if group is None:
        return True
    key = id(mesh)
    if key not in seen:
        mesh_ranks = sorted(dist.get_process_group_ranks(mesh.get_group()))
        seen[key] = mesh_ranks == sorted(dist.get_process_group_ranks(group))
    return seen[key]


def _is_sharded(
    param: torch.Tensor,
    grad: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    seen: dict[int, bool] | None = None,
) -> bool:
    """Whether ``grad``'s local values are a shard (summed over ranks) or a replica (counted once).

    Raises:
        NotImplementedError: a DTensor gradient on a multi-dimensional mesh, or on a mesh whose
            ranks are not the scaler's group (tensor parallelism on a sub-mesh: summing its
            shards over the scaler's group would count them once per replica).
    """
    if DTensor is not None and isinstance(grad, DTensor):
        placements = grad.placements
        if grad.device_mesh.ndim != 1:
            raise NotImplementedError(
                "clip_grad_norm_() supports DTensor gradients on a 1-D mesh (FSDP2 fully_shard); "
                f"got a {grad.device_mesh.ndim}-D mesh with placements {placements}."
            )
        if not _same_ranks(grad.device_mesh, group, {} if seen is None else seen):
            raise NotImplementedError(
                "clip_grad_norm_(): a DTensor gradient lives on a mesh of other ranks than the "
                "scaler's process group (e.g. tensor parallelism on a sub-mesh of a dp x tp "
                "mesh): its shards would be counted once per replica. Pass that mesh's group as "
                "process_group when it covers the whole model, or call scaler.unscale_(opt) and "
                "compute the norm over the right groups yourself."
            )
        if any(pl.is_partial() for pl in placements):
            raise ValueError(
                f"a DTensor gradient has a Partial placement ({placements}): it is not reduced "
                "yet, so its norm is undefined; reduce it (redistribute to Shard/Replicate) first."
            )
        return any(pl.is_shard() or "Shard" in type(pl).__name__ for pl in placements)
    if FlatParameter is not None and isinstance(param, FlatParameter):
        # NO_SHARD keeps the whole flat parameter on every rank: a replica.
        sharded = getattr(param, "_sharded_size", None)
        full = getattr(param, "_unpadded_unsharded_size", None)
        return not (sharded is not None and full is not None and sharded == full)
    return bool(getattr(param, "_fsdp_flattened", False))


def _param_list(params: object) -> list[torch.Tensor]:
    """A tensor or an iterable of tensors as a list (as torch.nn.utils.clip_grad_norm_ takes;
    repeats, e.g. a tied weight gathered from two modules, are dropped by :func:`_bucket`)."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise TypeError(
            "clip_grad_norm_() takes an optimizer, a tensor or an iterable of parameters, got "
            f"{type(params).__name__}."
        )
    out = list(params)
    for q in out:
        if not isinstance(q, torch.Tensor):
            raise TypeError(
                f"clip_grad_norm_() got a {type(q).__name__} among the parameters; pass tensors "
                "(e.g. model.parameters())."
            )
    return out


def _clip_params(
    scaler: Any, params: list[torch.Tensor], max_norm: float, p: float, group: Any
) -> torch.Tensor:
    """``clip_grad_norm_`` over a list of parameters instead of an optimizer.

    The gradients are unscaled and clipped in place (one read pass, one all-reduce, one write
    pass) and remembered as unscaled, with the agreed found-inf flag: the owning optimizer's
    ``step`` then leaves them alone (a fused optimizer gets its other gradients unscaled in place
    and ``grad_scale=None``) and skips on every rank if any gradient overflowed. That ``step``
    issues its own all-reduce for the remaining gradients: two collectives in the iteration
    (one when clipping through the optimizer).
    """
    from .scaler import OptState

    # validates the gradients before any state changes
    buckets = _bucket(params, scaler.rank_local_params, group)
    if not scaler.is_enabled():
        return _clip_unscaled(buckets, p, max_norm, group)
    if scaler._state is None:
        raise RuntimeError(
            "clip_grad_norm_() was called before scale(); the order is scaler.scale(loss)"
            ".backward() -> scaler.clip_grad_norm_(params, max_norm) -> scaler.step(opt) -> "
            "scaler.update()."
        )
    ids = {id(q) for q in params}
    if ids & scaler._pre_unscaled.keys():
        raise RuntimeError(
            "clip_grad_norm_() was already called on some of these parameters in this iteration "
            "(their gradients are unscaled); clip each parameter once per iteration."
        )
    for st in scaler._per_optimizer.values():
        opt = st.optimizer() if st.optimizer is not None else None
        if st.stage is not OptState.READY and opt is not None:
            if any(id(q) in ids for q in iter_params(opt)):
                raise RuntimeError(
                    "clip_grad_norm_(params) was called after unscale_()/step() of an optimizer "
                    "that owns these parameters; clip before: scaler.scale(loss).backward() -> "
                    "scaler.clip_grad_norm_(params, max_norm) -> scaler.step(opt)."
                )
    total, _, found_inf = _norm_and_clip(
        buckets, scaler._state.scale, scaler._inv_scale(), p, max_norm, group, fused=False
    )
    for q in params:
        scaler._pre_unscaled[id(q)] = found_inf
    return total


def _bucket(
    params: Iterable[torch.Tensor],
    rank_local: bool = False,
    group: dist.ProcessGroup | None = None,
) -> _Buckets:
    """Local dense gradient tensors grouped by (device, dtype, sharded). ``rank_local`` (the
    ranks own different parameters: pipeline stages): every gradient counts as sharded, i.e.
    summed over ranks, none as a replica counted once."""
    buckets: _Buckets = {}
    seen: dict[int, bool] = {}  # mesh id -> spans the group's ranks
    taken: set[int] = set()  # a parameter listed twice is one gradient: counted, clipped once
    for param in params:
        if id(param) in taken:
            continue
        taken.add(id(param))
        # FSDP1's FlatParameter is an nn.Parameter by type, marked by an instance attribute
        # _is_flat_param (and use_orig_params views by _fsdp_flattened): read them from
        # __dict__, which is cheaper than a failing getattr on every plain parameter.
        marks = getattr(param, "__dict__", None) or {}
        values = None if marks.get("_is_flat_param") else plain_grad(param)
        if values is not None:  # a plain Parameter with a dense grad
            sharded = bool(marks.get("_fsdp_flattened", False))
        else:
            values = grad_values(param, coalesce_all=True)  # validates (TypeError/ValueError)
            if values is None:
                continue
            # rank_local: every gradient is summed over the group by design (pipeline stages,
            # each maybe FSDP-sharded on a sub-mesh), so a sub-mesh is no ambiguity there
            sharded = _is_sharded(param, param.grad, None if rank_local else group, seen)
        require_writable(values, param)  # clipping multiplies it in place
        key = (values.device, values.dtype, sharded or rank_local)
        buckets.setdefault(key, []).append(values)
    return buckets


def _clip_unscaled(
    buckets: _Buckets, p: float, max_norm: float, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Clip gradients that are not scaled (a disabled scaler), as torch's clip_grad_norm_."""
    device = next(iter(buckets))[0] if buckets else torch.device("cpu")
    total, _ = _global_norm(buckets, p, None, device, group)
    with torch.no_grad():
        _mul_all(buckets, _clip_coef(total, max_norm))
    return total


def _norm_and_clip(
    buckets: _Buckets,
    scale: torch.Tensor,
    inv_scale: torch.Tensor,
    p: float,
    max_norm: float,
    group: dist.ProcessGroup | None,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The global norm, then the unscale and clip (or their fold into a fused optimizer's
    ``grad_scale``): ``(total norm, grad_scale or None, agreed found_inf)``.

    When the scale and every gradient are on the CPU, the scalar arithmetic between the read
    pass and the write pass (the norm's total, the clip coefficient, the folded factor) runs
    on Python floats (:func:`_clip_coef_host`, :func:`_unscale_and_clip_host`: the same float32
    results as the tensor operations, without their ~20 cold dispatches); else tensor operations
    on the scale's device, with no host synchronisation."""
    if on_host(buckets, scale.device):
        total, found = global_norm_host(buckets, p, inv_scale, group)
        coef = _clip_coef_host(total, max_norm)
        grad_scale, found_inf = _unscale_and_clip_host(
            buckets, scale, inv_scale, coef, found, fused
        )
        return _cpu_f32(total), grad_scale, found_inf
    total, found_inf = _global_norm(buckets, p, inv_scale, scale.device, group)
    coef = _clip_coef(total, max_norm)
    grad_scale, found_inf = _unscale_and_clip(buckets, scale, inv_scale, coef, found_inf, fused)
    return total, grad_scale, found_inf


def _clip_coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total + 1e-6))`` as torch.nn.utils.clip_grad_norm_ (0-d float32);
    exactly 1 for ``max_norm=inf`` (no clipping), where torch's ``reciprocal() * inf`` gives
    NaN for a total above ~8.5e37 under ``torch.set_flush_denormal(True)``."""
    if math.isinf(max_norm):
        return torch.ones_like(total)
    return (max_norm / (total + _EPS)).clamp(max=1.0)


def _div(a: float, b: float) -> float:
    """``a / b`` rounded to float32 for float32 ``a`` and ``b``, with IEEE division by zero
    (inf, or NaN for 0/0), as a float32 tensor division gives. (A float64 quotient rounded to
    float32 is the float32 quotient: for + - * / double rounding through float64 is innocuous.)"""
    try:
        return _f32(a / b)
    except ZeroDivisionError:
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _clip_coef_host(total: float, max_norm: float) -> float:
    """:func:`_clip_coef` on Python floats, the same float32 result: ``total + 1e-6`` in float32,
    then ``max_norm / x`` as torch computes a number divided by a tensor (``x.reciprocal() *
    max_norm``), then ``min(1, .)`` keeping NaN (``clamp``)."""
    if math.isinf(max_norm):
        return 1.0  # as _clip_coef
    x = _f32(total + _f32(_EPS))
    coef = _f32(_div(1.0, x) * _f32(max_norm))
    return coef if math.isnan(coef) else min(coef, 1.0)


#: ``scale / clip_coef`` from here on makes ``coef / scale`` subnormal in fp32 (or 0, or the
#: folded grad_scale inf): a single multiply would lose the gradients' precision, or all of it.
_FOLD_LIMIT = 2.0**126


def _unscale_and_clip(
    buckets: _Buckets,
    scale: torch.Tensor,
    inv_scale: torch.Tensor,
    coef: torch.Tensor,
    found_inf: torch.Tensor,
    fused: bool,
    host_reads: bool | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Unscale and clip: ``(grad_scale for a fused kernel or None, found_inf)``.

    ``host_reads``: whether values may be read on the host (default: the scale is on the CPU);
    False is the accelerator branch, which tests also run on CPU tensors.

    Fused: no write pass, the kernel divides by ``grad_scale = scale / coef`` in its fp32 math.
    Otherwise one write pass by ``coef / scale``. After an overflow the gradients are only
    unscaled (``grad_scale = scale``). Past ``_FOLD_LIMIT`` (a huge scale and a large norm) the
    folded factor would leave fp32's normal range and silently zero or blur the update: on the
    CPU (a free read) the gradients then get two write passes (``1/scale``, then ``coef``, as
    torch's recipe); on a device, where reading would be a host sync, the step is taken as an
    overflow (skipped, the scale backs off).
    """
    if host_reads is None:
        host_reads = scale.device.type == "cpu"
    if host_reads:
        return _unscale_and_clip_host(
            buckets, scale, inv_scale, float(coef), float(found_inf), fused
        )
    overflow = found_inf > 0
    folded = torch.where(overflow, scale, scale / coef).float()
    # also inf; but coef == 0 (max_norm=0) is fine: the gradients are zeroed exactly (a factor
    # of 0, or a fused grad_scale of inf, which divides finite gradients to 0)
    too_big = ~(folded < _FOLD_LIMIT) & (coef != 0)
    with torch.no_grad():
        # no host sync: an unfoldable clip is taken as an overflow
        found_inf = torch.maximum(found_inf, too_big.float())
        overflow = found_inf > 0
        folded = torch.where(overflow, scale, folded)
        if fused:
            return folded, found_inf
        _mul_all(buckets, torch.where(overflow, inv_scale, coef * inv_scale))
        return None, found_inf


def _unscale_and_clip_host(
    buckets: _Buckets,
    scale: torch.Tensor,
    inv_scale: torch.Tensor,
    coef: float,
    found: float,
    fused: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """:func:`_unscale_and_clip`'s host branch (a CPU scale: its value is read for free) with
    the other scalars as Python floats holding float32 values (``coef``; ``found``: 1.0 or
    0.0): the same float32 factors as the tensor operations, the same writes. Past
    ``_FOLD_LIMIT`` the gradients get two exact write passes (``1/scale``, then ``coef``)."""
    overflow = found > 0
    folded = float(scale) if overflow else _div(float(scale), coef)
    # (after an overflow the step is skipped: only unscale, as the device branch does)
    too_big = not overflow and not folded < _FOLD_LIMIT and coef != 0
    found_inf = _cpu_f32(found)
    with torch.no_grad():
        if too_big:  # unscale, then clip: two exact passes
            _mul_all(buckets, inv_scale)
            _mul_all(buckets, _cpu_f32(coef))
            return None, found_inf
        if fused:
            return _cpu_f32(folded), found_inf
        factor = inv_scale if overflow else _cpu_f32(_f32(coef * float(inv_scale)))
        _mul_all(buckets, factor)
        return None, found_inf


def _mul_all(buckets: _Buckets, factor: torch.Tensor) -> None:
    """Multiply every gradient in place by the 0-d ``factor``: one ``_foreach_mul_`` per bucket
    (CPU: shardscale's compiled kernel, the same bits)."""
    per_device: dict[torch.device, torch.Tensor] = {}
    for (device, _, _), grads in buckets.items():
        f = per_device.get(device)
        if f is None:
            f = per_device[device] = _sync.to_device(factor, device)
        if device.type == "cpu":
            _cpukernel.foreach_mul_(grads, f)
        else:
            torch._foreach_mul_(grads, f)


__all__ = ["clip_grad_norm_"]
