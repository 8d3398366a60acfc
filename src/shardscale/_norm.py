"""The global gradient norm behind ``clip_grad_norm_``: per-tensor norms of the *scaled* local
gradients, unscaled before any power, summed over shards and ranks in one all-reduce.

Two implementations of the same float32 arithmetic: :func:`_global_norm_device` in tensor
operations (no host synchronisation; accelerators), and :func:`_global_norm_cpu` on Python floats
when everything lives on the CPU, where reading a tensor costs nothing (fewer tiny operations; a
test checks both agree bit for bit). On the CPU, per-tensor norms whose *scaled* value overflowed
or may have underflowed are recomputed from unscaled chunks.
"""

from __future__ import annotations

import ctypes
import math

import torch
import torch.distributed as dist

from . import _cpukernel, _sync

#: Elements per chunk when a CPU gradient is reduced in fp32 (fp16 gradients; overflowed scaled
#: norms): torch's CPU norm with an fp32 ``dtype`` converts its whole input first, so chunks
#: copied into one reused scratch buffer bound that temporary to 1 MiB (and stay in L2).
_CPU_CHUNK = 1 << 18

#: (device, dtype, sharded) -> local dense gradient tensors
Buckets = dict[tuple[torch.device, torch.dtype, bool], list[torch.Tensor]]
_Buckets = Buckets


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _local_piece(
    grads: list[torch.Tensor], p: float, inv: torch.Tensor | None, acc: torch.dtype
) -> torch.Tensor:
    """sum(|g / scale|^p) over ``grads`` (max(|g / scale|) for p=inf), a 0-d ``acc`` tensor.

    One read of every gradient: per-tensor norms of the *scaled* gradients, each multiplied by
    ``inv`` (so only unscaled norms are raised to the power p; no underflow of ``inv**p``).
    On accelerators ``torch._foreach_norm`` (fp32 output; low-precision gradients read in place).
    On CPU see :func:`_cpu_norms`, which also recomputes, from unscaled chunks, any per-tensor
    norm whose scaled value overflowed (a large scale times finite gradients), so a finite
    gradient is never taken for an overflow there (nor, for scales < 1, an underflowed norm for
    0). On accelerators that fallback would need a host sync: a per-tensor norm of scaled
    gradients above ~1.8e19 (p=2) reads as an overflow, and one below ~1e-19 may read as 0.
    """
    device = grads[0].device
    inv_acc = None if inv is None else inv.to(device=device, dtype=acc)
    if device.type == "cpu":
        norms = _cpu_norms(grads, p, inv_acc, acc)
    else:
        raw = (
            torch._foreach_norm(grads, p)
            if grads[0].dtype == acc
            else (torch._foreach_norm(grads, p, dtype=acc))
        )
        norms = torch.stack(raw).to(acc)
        if inv_acc is not None:
            norms = norms * inv_acc
    if math.isinf(p):
        return norms.max()
    if p == 2.0:
        return (norms * norms).sum()
    return norms.pow(p).sum()


def _chunk_norm(
    g: torch.Tensor, p: float, inv: torch.Tensor | None, acc: torch.dtype, buf: torch.Tensor
) -> torch.Tensor:
    """||g * inv||_p of one CPU tensor, converted to ``acc`` chunk by chunk into ``buf`` (a 1-d
    ``acc`` scratch tensor of ``_CPU_CHUNK`` elements, reused: no allocation per chunk): BLAS dot
    products for p=2, max for inf, pow-sums otherwise."""
    parts = []
    for c in g.reshape(-1).split(buf.numel()):
        f = buf[: c.numel()]
        f.copy_(c)
        if inv is not None:
            f.mul_(inv)
        if p == 2.0:
            parts.append(torch.dot(f, f))
        elif math.isinf(p):
            parts.append(f.abs_().amax())
        else:
            parts.append(f.abs_().pow_(p).sum())
    joined = torch.stack(parts)
    if math.isinf(p):
        return joined.amax()
    return joined.sum().sqrt() if p == 2.0 else joined.sum().pow(1.0 / p)


def _cpu_norms(
    grads: list[torch.Tensor], p: float, inv: torch.Tensor | None, acc: torch.dtype
) -> torch.Tensor:
    """Per-tensor unscaled norms of CPU gradients, a 1-d ``acc`` tensor.

    p = 1, 2 or inf with shardscale's compiled CPU kernel (:func:`_cpukernel.foreach_norm`):
    float32/bfloat16/float16 gradients read once, on all threads, summed in float64 (no
    overflow, underflow or bf16 rounding: the norm of the scaled values times ``inv``, rounded
    once to ``acc``). Otherwise (no C compiler, other p, float64) torch's operations, with these
    fast paths, each a single read of the gradients with no gradient-sized temporary:

    * fp32/fp64: 2-norms by BLAS dot on the scaled tensor, other norms by ``_foreach_norm``;
    * bf16: ``_foreach_norm`` (torch's CPU kernel accumulates in fp32 and rounds each per-tensor
      norm to bf16: relative error <= 2**-8, as ``torch.nn.utils.clip_grad_norm_``, whose total
      is rounded to bf16 as well; an fp32 result would need a conversion pass, 1.4x slower);
    * fp16: fp32 chunks in a reused 1 MiB buffer (torch's CPU fp16 norm is 3x slower, and an
      fp16 result would overflow above 65504).

    Then, where a scaled norm is not finite, or (scale < 1) so small that the p-th powers of
    the scaled values may have underflowed, the norm is recomputed from unscaled fp32 chunks:
    reading the values costs nothing on the CPU, and neither a large scale (a spurious
    overflow) nor a tiny one (a norm of 0: no clipping) may change the result.
    """
    fast = _cpukernel.foreach_norm(grads, p)
    if fast is not None:  # float64: no overflow or underflow to recompute
        return (fast if inv is None else fast * inv.double()).to(acc)
    dtype = grads[0].dtype
    buf: torch.Tensor | None = None

    def scratch() -> torch.Tensor:
        nonlocal buf
        if buf is None:
            buf = torch.empty(
                min(_CPU_CHUNK, max(g.numel() for g in grads)), dtype=acc, device="cpu"
            )
        return buf

    if dtype == torch.float16:
        raw = [_chunk_norm(g, p, None, acc, scratch()) for g in grads]
    elif p == 2.0 and dtype != torch.bfloat16:
        raw = [torch.dot(f, f).sqrt() for f in (g.reshape(-1) for g in grads)]
    else:  # bf16 (any p), fp32/fp64 other p
        raw = list(torch._foreach_norm(grads, p))
    norms = torch.stack(raw).to(acc)
    if inv is None:
        return norms
    unscaled = norms * inv
    redo = ~torch.isfinite(unscaled)
    if not math.isinf(p) and float(inv) > 1.0:
        # scale < 1: the powers of the (smaller) scaled values may underflow where the unscaled
        # ones would not; below this scaled norm, recompute (underflowed terms are then < 2**-62
        # of the norm's p-th power for any tensor under 2**40 elements)
        redo |= norms < 2.0 ** (-64.0 / max(p, 1.0))
    if bool(redo.any()):  # a CPU tensor: no device sync
        for i in torch.nonzero(redo).flatten().tolist():
            unscaled[i] = _chunk_norm(grads[i], p, inv, acc, scratch())
    return unscaled


def global_norm(
    buckets: _Buckets,
    p: float,
    inv_scale: torch.Tensor | None,
    home: torch.device,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The total norm over ranks (0-d float32 on ``home``) and the agreed found-inf flag.

    One all-reduce of ``[sharded, replicated (rank 0 only), nonfinite]`` over ``group``.
    """
    if on_host(buckets, home):
        return _global_norm_cpu(buckets, p, inv_scale, group)
    return _global_norm_device(buckets, p, inv_scale, home, group)


def on_host(buckets: _Buckets, home: torch.device) -> bool:
    """Whether the scale (on ``home``) and every gradient are on the CPU: then the norm's
    float32 arithmetic runs on Python floats (:func:`global_norm_host`)."""
    return home.type == "cpu" and all(device.type == "cpu" for device, _, _ in buckets)


def _global_norm_device(
    buckets: _Buckets,
    p: float,
    inv_scale: torch.Tensor | None,
    home: torch.device,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`global_norm` in tensor operations on ``home``: no host synchronisation."""
    is_inf = math.isinf(p)
    parts = {
        sharded: torch.zeros((), dtype=torch.float32, device=home) for sharded in (True, False)
    }
    for (_, dtype, sharded), grads in buckets.items():
        piece = _local_piece(grads, p, inv_scale, _acc_dtype(dtype))
        piece = _sync.to_device(piece, home, torch.float32)
        parts[sharded] = torch.maximum(parts[sharded], piece) if is_inf else parts[sharded] + piece
    sharded_part, replicated_part = parts[True], parts[False]
    local = (
        torch.maximum(sharded_part, replicated_part) if is_inf else sharded_part + replicated_part
    )
    nonfinite = (~torch.isfinite(local)).float()
    if group is not None and not is_inf and group.rank() != 0:
        replicated_part = torch.zeros_like(replicated_part)  # counted once, from rank 0
    packed = torch.stack([sharded_part, replicated_part, nonfinite])
    if group is not None:
        op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
        packed = _sync.all_reduce(packed, [group], op)
    if is_inf:
        total = torch.maximum(packed[0], packed[1])
    else:
        total = packed[0] + packed[1]
        total = total.sqrt() if p == 2.0 else total.pow(1.0 / p)
    # a non-finite replicated gradient on a rank other than 0 is only counted in the flag:
    # report the norm as inf then, as torch.nn.utils.clip_grad_norm_ would on that rank.
    flagged = packed[2] > 0
    total = torch.where(flagged & torch.isfinite(total), torch.full_like(total, math.inf), total)
    found_inf = (flagged | ~torch.isfinite(total)).float()
    return total, found_inf


def _f32(x: float) -> float:
    """``x`` rounded to float32 (IEEE round-to-nearest, inf beyond the range), as a Python float."""
    return ctypes.c_float(x).value


def _cpu_f32(x: float | list[float]) -> torch.Tensor:
    """``x`` as a float32 CPU tensor (explicitly on the CPU: not on ``torch.set_default_device``'s
    device)."""
    return torch.tensor(x, dtype=torch.float32, device="cpu")


def _max(a: float, b: float) -> float:
    """max() that propagates NaN, as ``torch.maximum``."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _global_norm_cpu(
    buckets: _Buckets,
    p: float,
    inv_scale: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`global_norm` when the gradients and the scale are on the CPU:
    :func:`global_norm_host`'s two floats as 0-d float32 CPU tensors."""
    total, found = global_norm_host(buckets, p, inv_scale, group)
    return _cpu_f32(total), _cpu_f32(found)


def global_norm_host(
    buckets: _Buckets,
    p: float,
    inv_scale: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> tuple[float, float]:
    """The total norm and the agreed found-inf flag (1.0 or 0.0) of CPU gradients, as Python
    floats holding float32 values: :func:`global_norm`'s float32 arithmetic, step for step, on
    Python floats (reading a CPU tensor costs no device sync), so the ~20 tiny tensor
    operations of the device path become 3 (the pieces, the all-reduce and the root)."""
    is_inf = math.isinf(p)
    parts = {True: 0.0, False: 0.0}
    for (_, dtype, sharded), grads in buckets.items():
        piece = _f32(float(_local_piece(grads, p, inv_scale, _acc_dtype(dtype))))
        parts[sharded] = _max(parts[sharded], piece) if is_inf else _f32(parts[sharded] + piece)
    sharded_part, replicated_part = parts[True], parts[False]
    local = _max(sharded_part, replicated_part) if is_inf else _f32(sharded_part + replicated_part)
    nonfinite = 0.0 if math.isfinite(local) else 1.0
    if group is not None and not is_inf and group.rank() != 0:
        replicated_part = 0.0  # counted once, from rank 0
    packed = [sharded_part, replicated_part, nonfinite]
    if group is not None:
        op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
        reduced = _sync.all_reduce(_cpu_f32(packed), [group], op)
        packed = reduced.tolist()
    if is_inf:
        total = _max(packed[0], packed[1])
    else:
        # the root as a float32 tensor op, as the device path: torch's CPU float32 sqrt is not
        # always correctly rounded, so math.sqrt could differ by an ulp
        root = _cpu_f32(_f32(packed[0] + packed[1]))
        total = (root.sqrt() if p == 2.0 else root.pow(1.0 / p)).item()
    flagged = packed[2] > 0
    if flagged and math.isfinite(total):
        total = math.inf  # see _global_norm_device
    found = 1.0 if flagged or not math.isfinite(total) else 0.0
    return total, found
