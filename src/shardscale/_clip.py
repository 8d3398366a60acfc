"""Gradient clipping fused with unscaling: the pure functions behind
``ShardedGradScaler.clip_grad_norm_``.

torch's recipe for clipping with a loss scaler is ``scaler.unscale_(opt)`` followed by
``torch.nn.utils.clip_grad_norm_(params, max_norm)``: one read+write pass to unscale, one read
pass for the norm, one read+write pass to clip, and, under FSDP, a norm that is only right if the
caller knows which gradients are sharded. Here the same job is

* **one read pass** over the *scaled* local gradients: per-tensor norms (``torch._foreach_norm``,
  fp32 results), multiplied by ``1/scale`` before any power is taken, and the norm of those
  norms (as torch's ``clip_grad_norm_``) for a *sharded* and a *replicated* part;
* **one collective**: an all-reduce of this rank's sum of the parts' p-th powers (the
  replicated part from rank 0 only; elsewhere inf if it is not finite) and whether it scaled
  (SUM; MAX for ``norm_type=inf``, with an inf for a non-finite local norm: a MAX may drop a
  NaN) giving the global norm, which is not finite exactly when some gradient anywhere was
  not: the agreed found-inf flag is read from the norm;
* **one write pass** multiplying every gradient by ``min(1, max_norm / (norm + 1e-6)) / scale``,
  or, for fused optimizers, **none**: the factor is folded into the ``grad_scale`` handed to the
  fused kernel (``grad_scale = scale / clip_coef``). Until that kernel runs ``p.grad`` holds the
  scaled, unclipped values, so the fold applies only where nothing registered can read them
  (:func:`may_fold`: no step hook on the optimizer, none global) and ``fold`` is not False.

Every function here is tensor code on the scale's device: no host synchronisation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.optim.optimizer as _optim

from . import _sync
from ._config import check_flag
from ._grads import SharedMemoryGradError, check_bucket, local_grads, peak, to_device

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_

#: ``(device, dtype, sharded) -> local dense gradient tensors``
Buckets = dict[tuple[torch.device, torch.dtype, bool], list[torch.Tensor]]

#: From here on ``scale / clip_coef`` makes ``coef / scale`` subnormal in fp32 (or 0, or the
#: folded grad_scale inf): a single multiply would lose the gradients' precision, or all of it.
_FOLD_LIMIT = 2.0**126


def check_max_norm(max_norm: object) -> float:
    """``max_norm`` as a float >= 0 (inf: no clipping). Raises TypeError/ValueError."""
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1:
        max_norm = float(max_norm.item())
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}.")
    value = float(max_norm)
    if math.isnan(value) or value < 0:
        raise ValueError(f"max_norm must be >= 0 (inf disables clipping), got {max_norm!r}.")
    return value


def check_norm_type(norm_type: object) -> float:
    """``norm_type`` as a float > 0 (``inf`` / ``"inf"`` accepted). Raises TypeError/ValueError."""
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


@dataclasses.dataclass(frozen=True)
class ClipArgs:
    """``clip_grad_norm_``'s arguments, validated (:meth:`check`).

    Attributes:
        max_norm: >= 0 (inf: no clipping).
        p: the norm's order, > 0 (inf for the max norm).
        error_if_nonfinite: raise on a non-finite total norm (one host read).
        foreach: use the ``torch._foreach_*`` kernels.
        fold: a fused optimizer's clip may be folded into its ``grad_scale`` (:func:`may_fold`).
    """

    max_norm: float
    p: float
    error_if_nonfinite: bool
    foreach: bool
    fold: bool = True

    @classmethod
    def check(
        cls,
        max_norm: object,
        norm_type: object,
        error_if_nonfinite: object,
        foreach: object,
        fold: object = True,
    ) -> ClipArgs:
        """Raises TypeError/ValueError naming the bad argument."""
        max_norm_f, p = check_max_norm(max_norm), check_norm_type(norm_type)
        error_if_nonfinite = check_flag("error_if_nonfinite", error_if_nonfinite)
        if foreach is not None:
            foreach = check_flag("foreach", foreach, "None or a bool")
        fold = check_flag("fold", fold)
        return cls(max_norm_f, p, error_if_nonfinite, foreach is not False, fold)

    @property
    def opts(self) -> dict[str, bool]:
        return {"error_if_nonfinite": self.error_if_nonfinite, "foreach": self.foreach}


def may_fold(optimizer: Any, args: ClipArgs, bounds: Any) -> bool:
    """Whether a fused ``optimizer``'s clip may be folded into its ``grad_scale`` (no write
    pass): ``args.fold``, the scale is known to be at least 1 (``bounds``:
    :class:`~shardscale._policy.HostBounds`; below 1 the kernel's division could overflow
    unseen) and nothing registered can read ``p.grad`` around the kernel: no step hook on the
    optimizer (``register_step_pre_hook`` / ``register_step_post_hook``) and no global one
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``). Otherwise
    the gradients are written unscaled and clipped, as for a non-fused optimizer."""
    return (
        args.fold
        and not bounds.below_one
        and not getattr(optimizer, "_optimizer_step_pre_hooks", None)
        and not getattr(optimizer, "_optimizer_step_post_hooks", None)
        and not _optim._global_optimizer_pre_hooks
        and not _optim._global_optimizer_post_hooks
    )


def single_group(groups: list[Any]) -> Any:
    """The one process group a clip reduces over (None for none).

    Raises:
        NotImplementedError: several groups (HSDP, a multi-dimensional mesh).
    """
    if len(groups) > 1:
        raise NotImplementedError(
            "clip_grad_norm_() supports one process group (or a 1-D DeviceMesh); this scaler "
            f"reduces over {len(groups)} groups. For HSDP / multi-dimensional meshes, call "
            "scaler.unscale_(optimizer) and compute the norm with your framework's helper."
        )
    return groups[0] if groups else None


def param_list(params: object) -> list[torch.Tensor]:
    """A tensor or an iterable of tensors as a list (as ``torch.nn.utils.clip_grad_norm_``)."""
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


def _is_sharded(param: Any, group: Any, rank_local: bool) -> bool:
    """Whether ``param``'s local gradient is a shard (summed over ranks) or a replica (counted
    once). ``rank_local``: the ranks own different parameters (pipeline stages), so every
    gradient is summed.

    Raises:
        NotImplementedError: a DTensor gradient on a multi-dimensional mesh, or on a mesh whose
            ranks are not the scaler's group.
        ValueError: a DTensor gradient with a ``Partial`` placement (not reduced yet).
    """
    grad = param.grad
    if DTensor is not None and isinstance(grad, DTensor):
        placements, mesh = grad.placements, grad.device_mesh
        if mesh.ndim != 1:
            raise NotImplementedError(
                "clip_grad_norm_() supports DTensor gradients on a 1-D mesh (FSDP2 fully_shard); "
                f"got a {mesh.ndim}-D mesh with placements {placements}."
            )
        if not rank_local and group is not None:
            mesh_ranks = sorted(dist.get_process_group_ranks(mesh.get_group()))
            if mesh_ranks != sorted(dist.get_process_group_ranks(group)):
                raise NotImplementedError(
                    "clip_grad_norm_(): a DTensor gradient lives on a mesh of other ranks than "
                    "the scaler's process group (e.g. tensor parallelism on a sub-mesh of a dp x "
                    "tp mesh): its shards would be counted once per replica. Pass that mesh's "
                    "group as process_group when it covers the whole model, or call "
                    "scaler.unscale_(opt) and compute the norm over the right groups yourself."
                )
        if any(pl.is_partial() for pl in placements):
            raise ValueError(
                f"a DTensor gradient has a Partial placement ({placements}): it is not reduced "
                "yet, so its norm is undefined; reduce it (redistribute to Shard/Replicate) first."
            )
        return rank_local or any(pl.is_shard() for pl in placements)
    if rank_local:
        return True
    if getattr(param, "_is_flat_param", False):  # FSDP1 FlatParameter
        # NO_SHARD keeps the whole flat parameter on every rank: a replica
        sharded, full = (
            getattr(param, a, None) for a in ("_sharded_size", "_unpadded_unsharded_size")
        )
        return not (sharded is not None and sharded == full)
    return bool(getattr(param, "_fsdp_flattened", False))  # FSDP1 use_orig_params views


def bucket(params: list[Any], group: Any, rank_local: bool, names: Any = None) -> Buckets:
    """Local gradient values grouped by ``(device, dtype, sharded)``, validated (sparse
    gradients coalesced: their values count) before anything is written.

    Raises:
        SharedMemoryGradError: a gradient whose elements share memory, named from ``names``
            (:class:`~shardscale._report.ParamNames`) or by its position.
    """
    buckets: Buckets = {}
    try:
        grads = local_grads(params, coalesce_all=True)
    except SharedMemoryGradError as e:
        raise e.naming(names.current() if names is not None else {}, params) from None
    for param, values in grads:
        key = (values.device, values.dtype, _is_sharded(param, group, rank_local))
        buckets.setdefault(key, []).append(values)
    for device, dtype, _ in buckets:
        check_bucket(device, dtype)
    return buckets


_REFUSED = {
    "optimizer after params": (
        "clip_grad_norm_(optimizer) was called after clip_grad_norm_(params) on some of its "
        "parameters in this iteration; clip either the optimizer or parameter lists, once per "
        "parameter per iteration."
    ),
    "after step": (
        "clip_grad_norm_() was called after step() on this optimizer in this iteration; clip "
        "before step(): scaler.scale(loss).backward() -> scaler.clip_grad_norm_(opt, max_norm) "
        "-> scaler.step(opt) -> scaler.update()."
    ),
    "params after step": (
        "clip_grad_norm_(params) was called after step() of an optimizer that owns these "
        "parameters; clip before: scaler.scale(loss).backward() -> "
        "scaler.clip_grad_norm_(params, max_norm) -> scaler.step(opt)."
    ),
    "mixed": (
        "clip_grad_norm_(params) mixes parameters whose gradients are unscaled already (by "
        "unscale_() or an earlier clip) with others still scaled; clip each set on its own."
    ),
}


def refused(case: str) -> RuntimeError:
    """The error for a clip in the wrong place of the iteration (``case`` in ``_REFUSED``)."""
    return RuntimeError(_REFUSED[case])


def unscaled_already(stages: dict[int, Any], params: list[Any]) -> bool:
    """Whether ``params`` (``stages``: ``id -> OptState`` of those not READY) all have unscaled
    gradients already (clip them as they are) rather than none.

    Raises:
        RuntimeError: some are stepped, or unscaled ones are mixed with scaled ones.
    """
    if any(stage.name == "STEPPED" for stage in stages.values()):
        raise refused("params after step")
    if stages and len(stages) == len({id(q) for q in params}):
        return True
    if stages:
        raise refused("mixed")
    return False


#: Elements per piece when fp16 gradients are normed in fp32: torch's kernels may convert each
#: input to fp32 first (the CPU's do), so pieces bound that temporary (1 MiB) and keep it cached.
_FP16_PIECE = 1 << 18


def _pieces(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous gradients cut into flat views of at most ``_FP16_PIECE`` elements (the sums
    of their norms' p-th powers are the gradients'); others as they are."""
    out: list[torch.Tensor] = []
    for g in grads:
        if g.numel() > _FP16_PIECE and g.is_contiguous():
            out.extend(g.view(-1).split(_FP16_PIECE))
        else:
            out.append(g)
    return out


def _norms(tensors: list[torch.Tensor], p: float, dtype: torch.dtype | None, foreach: bool) -> list:
    """Per-tensor p-norms: one ``torch._foreach_norm``, or (``foreach=False``, as torch's
    ``clip_grad_norm_`` takes it) one ``torch.linalg.vector_norm`` per tensor."""
    if foreach:
        return (
            torch._foreach_norm(tensors, p, dtype=dtype)
            if dtype
            else torch._foreach_norm(tensors, p)
        )
    return [torch.linalg.vector_norm(t, p, dtype=dtype) for t in tensors]


def _local_norms(
    grads: list[torch.Tensor],
    p: float,
    inv: torch.Tensor | None,
    guard: bool = False,
    foreach: bool = True,
) -> torch.Tensor:
    """The per-tensor norms of ``grads / scale``, a 1-D float32 (float64 for float64
    gradients): the norms of the *scaled* gradients (fp16 ones accumulated in fp32, piece by
    piece: an fp16 norm would overflow at 65504), each multiplied by ``inv`` before any power.
    ``guard`` (a scale that may be below 1): a norm past an fp16/bf16 gradient's range is inf."""
    acc = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
    if grads[0].dtype == torch.float16:
        norms = _norms(_pieces(grads), p, acc, foreach)
    else:
        norms = _norms(grads, p, None, foreach)
    x = torch.stack(norms).to(acc)
    if inv is not None:
        x = x * inv.to(device=x.device, dtype=acc)
    if guard and grads[0].dtype != acc:
        # an unscaled value may leave fp16/bf16 while the fp32 norm is finite; no element
        # exceeds its tensor's norm, so a norm past the dtype's range counts as one
        x = x.masked_fill(x > torch.finfo(grads[0].dtype).max, math.inf)
    return x


def _power(norm: torch.Tensor, p: float) -> torch.Tensor:
    """``norm ** p`` (``norm`` itself for p = 1 and p = inf: maxima combine as they are)."""
    if math.isinf(p) or p == 1.0:
        return norm
    return norm * norm if p == 2.0 else norm.pow(p)


def _root(total: torch.Tensor, p: float) -> torch.Tensor:
    """``total ** (1 / p)`` (``total`` itself for p = 1 and p = inf)."""
    if math.isinf(p) or p == 1.0:
        return total
    return total.sqrt() if p == 2.0 else total.pow(1.0 / p)


def _zero(home: torch.device) -> torch.Tensor:
    """The norm of no gradient (a rank that holds none): 0-d float32 on ``home``."""
    return torch.zeros((), dtype=torch.float32, device=home)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """Whether ``x`` is finite (bool; False for inf and NaN), in a form ``torch.compile`` keeps:
    inductor folds ``x * 0`` to 0, which would hide an inf or NaN."""
    return x.abs() < math.inf


def _inf_if_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """0 where ``x`` is finite, inf where it is inf or NaN (no host read)."""
    return torch.where(_finite(x), 0.0, math.inf)


#: ``policy="headroom"``'s amax in the clip's SUM all-reduce (which cannot carry a MAX): a
#: thermometer code of its binary exponent ``E`` (``amax < 2**E``, :func:`torch.frexp`), slot
#: ``k`` set when ``E >= k + _EXP_LO``, over float32's whole range (``E`` in -148..128). After
#: the SUM the slots set on any rank are the first ``max(E)`` ones: ``2**max(E)`` bounds the
#: group's amax from above within a factor of 2.
_EXP_LO, _EXP_SLOTS = -148, 277
_SLOTS: dict[torch.device, torch.Tensor] = {}


def _thermometer(amax: torch.Tensor) -> torch.Tensor:
    """The thermometer code of 0-d ``amax`` (all zeros for ``amax <= 0``): 1-D float32."""
    slots = _SLOTS.get(amax.device)
    if slots is None:  # made once per device
        slots = _SLOTS[amax.device] = torch.arange(_EXP_SLOTS, device=amax.device) + _EXP_LO
    return ((slots <= torch.frexp(amax)[1]) & (amax > 0)).float()


def _from_thermometer(counts: torch.Tensor) -> torch.Tensor:
    """``2**max(E)`` from the summed slots (0.0 when none is set): 0-d float32."""
    n = (counts > 0).sum()
    return torch.exp2((n + (_EXP_LO - 1)).float()) * (n > 0)


def local_amax(buckets: Buckets, home: torch.device) -> torch.Tensor:
    """The largest |gradient| of ``buckets`` (one read pass, :func:`peak`), 0-d float32 on
    ``home``; 0.0 for none."""
    out = _zero(home)
    for grads in buckets.values():
        out = torch.maximum(out, to_device(peak(grads), home))
    return out


def global_norm(
    buckets: Buckets,
    p: float,
    inv_scale: torch.Tensor | None,
    home: torch.device,
    group: Any,
    scaled: bool | None = True,
    guard: bool = False,
    foreach: bool = True,
    amax: dict[torch.device, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The total norm over shards and ranks (0-d float32 on ``home``: inf or NaN if any
    gradient anywhere was) and whether any rank ``scaled`` (0-d bool: this rank called
    ``scale()`` in the iteration; None without a group, or for ``scaled=None``).

    Each part (sharded, replicated) has the norm of its tensors' norms, as
    ``torch.nn.utils.clip_grad_norm_`` takes it; without a group the parts' norms combine the
    same way. With one, the parts' p-th powers are summed over ranks in ONE all-reduce over
    ``group`` of ``[local, scaled]`` (SUM): the replicated part counted from the group's rank 0
    only, other ranks sending 0 for it, or inf where theirs is not finite (then the norm is
    inf, as ``torch.nn.utils.clip_grad_norm_`` gives on that rank); for p = inf the maxima,
    ``[local, inf if local is not finite, scaled]`` (MAX: a reduction may drop a NaN, never the
    inf). ``guard``: see :func:`_local_norms`. A per-tensor norm of scaled gradients past fp32's
    range (with the default scale, fp32 gradients of norm above ~1e34) reads as an overflow:
    the step is skipped and the scale backs off.

    ``amax`` (``policy="headroom"``): filled with ``{home: the largest |gradient| over the
    ranks}`` (one more read pass, :func:`local_amax`): exact without a group and for p = inf
    (a MAX slot); for a SUM its power-of-two upper bound (:data:`_EXP_SLOTS` more slots in the
    same all-reduce: at most one bit above).
    """
    is_inf = math.isinf(p)
    mine = None if amax is None else local_amax(buckets, home)
    per_part: dict[bool, list[torch.Tensor]] = {}
    for (_, _, sharded), grads in buckets.items():
        x = _local_norms(grads, p, inv_scale, guard, foreach)
        per_part.setdefault(sharded, []).append(to_device(x, home))
    parts = {
        sharded: torch.linalg.vector_norm(xs[0] if len(xs) == 1 else torch.cat(xs), p).float()
        for sharded, xs in per_part.items()
    }
    if group is None:
        if mine is not None:
            amax[home] = mine
        norms = list(parts.values()) or [_zero(home)]
        if len(norms) == 1:
            return norms[0], None
        return torch.linalg.vector_norm(torch.stack(norms), p), None
    powers = {sharded: _power(norm, p) for sharded, norm in parts.items()}
    if not is_inf and group.rank() != 0 and False in powers:
        powers[False] = _inf_if_nonfinite(powers[False])  # the replicas count from rank 0 only
    combine = torch.maximum if is_inf else torch.add
    local = functools.reduce(combine, list(powers.values()) or [_zero(home)])
    sent = [local, _inf_if_nonfinite(local)] if is_inf else [local]
    if scaled is not None:
        sent.append(torch.full_like(local, scaled))
    if mine is not None and is_inf:
        sent.append(mine)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    packed = torch.stack(sent)
    if mine is not None and not is_inf:
        packed = torch.cat([packed, _thermometer(mine)])
    packed = _sync.all_reduce(packed, [group], op, call=("clip_grad_norm_()", None))
    n = len(sent)
    if mine is not None:
        amax[home] = packed[n - 1] if is_inf else _from_thermometer(packed[n:])
        n -= is_inf
    got = packed[:n].unbind()
    total = torch.maximum(got[0], got[1]) if is_inf else got[0]
    return _root(total, p), None if scaled is None else got[-1] > 0


def clip_coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_`` (0-d float32);
    exactly 1 for ``max_norm=inf`` (no clipping: torch's ``reciprocal() * inf`` gives NaN for a
    total above ~8.5e37 under ``torch.set_flush_denormal(True)``)."""
    if math.isinf(max_norm):
        return torch.ones_like(total)
    return (max_norm / (total + _EPS)).clamp(max=1.0)


def mul_all(buckets: Buckets, factor: torch.Tensor, foreach: bool = True) -> None:
    """Multiply every gradient in place by the 0-d ``factor``: one ``_foreach_mul_`` per bucket
    (``foreach=False``: one ``mul_`` per gradient)."""
    per_device: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _, _), grads in buckets.items():
            f = per_device.get(device)
            if f is None:
                f = per_device[device] = to_device(factor, device)
            if foreach:
                torch._foreach_mul_(grads, f)
            else:
                for g in grads:
                    g.mul_(f)


def unscale_and_clip(
    buckets: Buckets,
    scale: torch.Tensor,
    inv_scale: torch.Tensor,
    total: torch.Tensor,
    coef: torch.Tensor,
    fused: bool,
    foreach: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Unscale and clip: ``(grad_scale for a fused kernel or None, found_inf)``, ``found_inf``
    0-d float32: 1.0 for an overflow (a non-finite ``total``, or a fold past ``_FOLD_LIMIT``).

    Fused: no write pass, the kernel divides by ``grad_scale = scale / coef`` in its fp32 math.
    Otherwise one write pass by ``coef / scale``. After an overflow the gradients are only
    unscaled (the step is skipped anyway; the inf/NaN stay where they were, for the overflow
    report). Past ``_FOLD_LIMIT`` (a huge scale and a large norm) the folded factor would leave
    fp32's normal range and silently zero or blur the update: the step is taken as an overflow
    (skipped, the scale backs off), which needs no host read.
    """
    # NaN where the total is not finite, so that the test below flags it too; otherwise coef.
    # (coef == 0, max_norm=0, is fine: a factor of 0, or a fused grad_scale of inf, zeroes the
    # gradients exactly)
    checked = torch.where(_finite(total), coef, math.nan)
    folded = scale / checked
    overflow = ~(folded < _FOLD_LIMIT) & (checked != 0)
    if fused:
        return torch.where(overflow, scale, folded), overflow.float()
    mul_all(buckets, torch.where(overflow, inv_scale, coef * inv_scale), foreach)
    return None, overflow.float()


def clip_unscaled(
    buckets: Buckets,
    p: float,
    max_norm: float,
    group: Any,
    error_if_nonfinite: bool = False,
    foreach: bool = True,
) -> torch.Tensor:
    """Clip gradients that are not scaled (a disabled scaler, or after ``unscale_``), as torch's
    ``clip_grad_norm_``."""
    home = next(iter(buckets))[0] if buckets else torch.device("cpu")
    total, _ = global_norm(buckets, p, None, home, group, None, foreach=foreach)
    check_finite(total, p, error_if_nonfinite)
    mul_all(buckets, clip_coef(total, max_norm), foreach)
    return total


def check_finite(total: torch.Tensor, p: float, error_if_nonfinite: bool) -> None:
    """torch's ``error_if_nonfinite``: raise if the total norm is inf/NaN (one host read, only
    when asked for).

    Raises:
        RuntimeError: the norm is not finite (before anything is written).
    """
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite "
            "norm anyway, set `error_if_nonfinite=False`"
        )


def norm_and_clip(
    buckets: Buckets,
    scale: torch.Tensor,
    inv_scale: torch.Tensor,
    p: float,
    max_norm: float,
    group: Any,
    fused: bool,
    scaled: bool = True,
    guard: bool = False,
    error_if_nonfinite: bool = False,
    foreach: bool = True,
    amax: dict[torch.device, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The whole clip of scaled gradients: ``(total norm, grad_scale for a fused kernel or
    None, agreed found_inf, whether any rank scaled or None without a group)``
    (:func:`global_norm`, :func:`clip_coef`, :func:`unscale_and_clip`); ``amax``: see
    :func:`global_norm`."""
    total, anyone = global_norm(
        buckets, p, inv_scale, scale.device, group, scaled, guard, foreach, amax
    )
    check_finite(total, p, error_if_nonfinite)
    coef = clip_coef(total, max_norm)
    grad_scale, found_inf = unscale_and_clip(buckets, scale, inv_scale, total, coef, fused, foreach)
    return total, grad_scale, found_inf, anyone
