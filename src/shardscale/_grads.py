"""An optimizer's local gradients: found, validated, bucketed, unscaled and checked.

Everything here is local to one rank: no collective, and no host synchronisation except in
:func:`any_nonzero` and :func:`since` (off the steady path: a rank that scaled nothing, a new
backward pass). The kernel is torch's own (``torch._amp_foreach_non_finite_check_and_unscale_``,
behind ``torch.amp.GradScaler``) on every device.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Container, Iterable, Iterator, Mapping
from typing import Any

import torch

try:  # DTensor is public from torch 2.5 on; keep the import soft for other builds.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

#: ``{device: {dtype: [dense local gradient tensors]}}``
Buckets = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]


def to_device(tensor: torch.Tensor, device: torch.device, copy: bool = False) -> torch.Tensor:
    """``tensor`` on ``device``: asynchronous, except a copy to the CPU, which blocks since a
    ``non_blocking`` device-to-host copy lands later and the CPU code that follows reads it at
    once (CPU-offloaded gradients with the scale on an accelerator)."""
    return tensor.to(device, non_blocking=device.type != "cpu", copy=copy)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank: a DTensor's local shard (sharing its storage, so an
    in-place unscale of it unscales the DTensor without DTensor's collectives), else ``t``."""
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def iter_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of every param group of ``optimizer``, in order."""
    for group in optimizer.param_groups:
        yield from group["params"]


def unique_params(params: Iterable[Any], skip: Container[int] = ()) -> list[Any]:
    """``params`` in order, each once (a tied weight listed twice is one gradient: torch only
    warns about it), without those whose ``id`` is in ``skip``. The duplicate test is one set
    built in C: no Python per parameter when there is none."""
    params = params if isinstance(params, list) else list(params)
    if len(set(map(id, params))) != len(params):
        params = list({id(p): p for p in params}.values())  # the first of each, in order
    if skip:
        params = [p for p in params if id(p) not in skip]
    return params


def unscaled_or_tied(optimizer: Any, unscaled: Container[int]) -> bool:
    """Whether a fused kernel must be given ``optimizer``'s gradients unscaled: some are unscaled
    already (their parameters' ids are in ``unscaled``), or a parameter is listed twice (tied
    weights: the kernel divides each listing's gradient by ``grad_scale`` and writes it back, so
    the second listing would be divided again). The scan is C: ``set``, ``map``, ``chain``."""
    params = list(itertools.chain.from_iterable([g["params"] for g in optimizer.param_groups]))
    ids = set(map(id, params))
    return len(ids) != len(params) or (bool(unscaled) and not ids.isdisjoint(unscaled))


class SharedMemoryGradError(ValueError):
    """A gradient whose elements share memory (an expanded or stride-0 view such as
    ``torch.ones(1).expand(4, 4)``, or an ``as_strided`` view over itself) cannot be unscaled or
    clipped in place: a shared location would be multiplied several times (torch's kernels refuse
    stride-0 views only when they reach them, after the gradients before were written). Raised
    before anything is written.

    Attributes:
        grad: the gradient tensor (a local shard or sparse values where the gradient is one).
        param: the parameter it belongs to, where known (else None).
        name: how the message names the parameter (None: unknown).
    """

    def __init__(self, grad: torch.Tensor, param: object = None, name: str | None = None):
        self.grad, self.param, self.name = grad, param, name
        who = f"the gradient of {name}" if name else "a gradient"
        super().__init__(
            f"{who} (shape {tuple(grad.shape)}, strides {tuple(grad.stride())}) has elements "
            "that share memory (an expanded or overlapping view) and cannot be unscaled or "
            "clipped in place; nothing was unscaled. Give the parameter a gradient of its own "
            "first, e.g. p.grad = p.grad.clone()."
        )

    def __reduce__(self) -> tuple[Any, ...]:  # copy/pickle: rebuilt from its fields
        return (type(self), (self.grad, self.param, self.name))

    def naming(self, names: Mapping[int, str], params: Iterable[Any] = ()) -> SharedMemoryGradError:
        """This error again, naming the parameter: by its name in ``names`` (``{id(param):
        name}``), else by its position in ``params``."""
        param, position = self.param, None
        for i, candidate in enumerate(params):
            if candidate is param:
                position = i
                break
        if param is None:
            return self
        name = names.get(id(param))
        if name is None:
            name = "a parameter" if position is None else f"parameter {position} of the optimizer"
        return SharedMemoryGradError(self.grad, param, name)


def _may_overlap(t: torch.Tensor) -> bool:
    """False when no two elements of ``t`` can share memory: its dimensions, sorted by stride,
    each step over everything the smaller ones span (slices, transposes, permutations do)."""
    span = 0
    for stride, size in sorted(
        (st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1
    ):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def require_writable(grad: torch.Tensor, param: object = None) -> None:
    """Raise :class:`SharedMemoryGradError` if elements of ``grad`` share memory. Contiguous
    tensors never do and cost one ``is_contiguous()``; tensor subclasses are left to their own
    kernels."""
    if type(grad) is not torch.Tensor or grad.is_contiguous():
        return
    overlap = torch._debug_has_internal_overlap(grad)  # 0: none, 1: yes, 2: too hard to tell
    if overlap == 1 or (overlap == 2 and _may_overlap(grad)):
        raise SharedMemoryGradError(grad, param)


def grad_values(param: object, coalesce_all: bool = False) -> torch.Tensor | None:
    """The dense local tensor holding ``param.grad``'s values (None if there is nothing).

    A DTensor gradient gives its local shard; a sparse gradient its values, coalesced first
    (``param.grad`` is replaced) when it is fp16/bf16 or ``coalesce_all``: summing duplicate
    entries may itself overflow, so a check or a norm must see the sums. Empty shards give None.

    Raises:
        TypeError: ``param`` is not a tensor, or its gradient is not floating point.
        ValueError: the gradient is on the meta device.
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(
            f"optimizer params must be tensors, got {type(param).__name__}; "
            "build the optimizer from module.parameters()."
        )
    grad = param.grad
    if grad is None:
        return None
    values = local_tensor(grad)
    if not values.is_floating_point():
        raise TypeError(f"gradients must be floating point, got dtype {values.dtype}.")
    if values.is_meta:
        raise ValueError(
            "a gradient is on the meta device (no data); materialize the model "
            "(module.to_empty(device=...)) before training."
        )
    if values.is_sparse:
        low = values.dtype in (torch.float16, torch.bfloat16)
        if (coalesce_all or low) and not values.is_coalesced():
            param.grad = values = values.coalesce()
        values = values._values()
    return None if values.numel() == 0 else values


def local_grads(
    params: Iterable[Any], skip: Container[int] = (), coalesce_all: bool = False
) -> list[tuple[Any, torch.Tensor]]:
    """``(param, values)`` for each parameter of ``params`` that has a gradient here.

    Each parameter is taken once, without those whose ``id`` is in ``skip``. ``values`` is the
    dense local tensor holding the gradient: the gradient itself when it is plain and dense, a
    DTensor's local shard, a sparse gradient's values (:func:`grad_values`). Parameters without
    ``.grad`` and empty shards are left out, so a rank that holds no shard gets ``[]``. Dtypes
    and devices are checked per bucket (:func:`check_bucket`).

    Raises:
        TypeError: a parameter is not a tensor.
        SharedMemoryGradError: a gradient whose elements share memory (checked here, before
            any caller writes).
    """
    out = []
    tensor, strided = torch.Tensor, torch.strided
    for param in unique_params(params, skip):
        grad = getattr(param, "grad", None)
        if type(grad) is tensor and grad.layout is strided:
            values = grad  # the common case: a plain dense gradient, taken as it is
        else:
            values = grad_values(param, coalesce_all)
            if values is None:
                continue
        if not values.is_contiguous():
            require_writable(values, param)
        out.append((param, values))
    return out


def _l1_norms(values: list[tuple[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """``key -> 0-d L1 norm`` of each tensor (one ``_foreach_norm`` per device and dtype; not
    read: 0 for zeros, non-zero for any other value, inf or NaN)."""
    per: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
    for key, v in values:
        per.setdefault((v.device, v.dtype), []).append((key, v))
    out = {}
    for items in per.values():
        norms = torch._foreach_norm([v for _, v in items], 1)
        out.update((key, n) for (key, _), n in zip(items, norms, strict=True))
    return out


def any_nonzero(params: Iterable[Any], skip: Container[int] = ()) -> bool:
    """Whether a local gradient of ``params`` (without those whose ``id`` is in ``skip``) holds
    anything but zeros (inf and NaN count). One host read; none without gradients."""
    norms = list(_l1_norms([(i, v) for i, (_, v) in enumerate(local_grads(params, skip))]).values())
    if not norms:
        return False
    home = norms[0].device
    return bool(torch.stack([to_device(n.float(), home) for n in norms]).ne(0).any())


#: ``id(param) -> (param, weak reference to its gradient, the gradient's version, its L1 norm
#: (0-d, not read; None for an empty shard))``; ``(param, None, -1, None)`` without a gradient
Snapshot = dict[int, tuple[Any, Any, int, "torch.Tensor | None"]]


def snapshot(params: Iterable[Any]) -> Snapshot:
    """The gradients of ``params`` as they are (unscaled) when a new backward pass begins, to
    tell afterwards which the pass replaced, left alone or added to (:func:`since`). No host
    read; one ``_foreach_norm`` per device and dtype."""
    out: dict[int, list[Any]] = {}
    values = []
    for param in unique_params(params):
        if getattr(param, "grad", None) is None:
            out[id(param)] = [param, None, -1, None]  # whatever it gets is new
            continue
        v = grad_values(param)  # may coalesce a sparse gradient: take param.grad after it
        grad = param.grad
        out[id(param)] = [param, weakref.ref(grad), grad._version, None]
        if v is not None:
            values.append((id(param), v))
    for key, norm in _l1_norms(values).items():
        out[key][3] = norm
    return {key: tuple(item) for key, item in out.items()}  # type: ignore[misc]


def since(carried: Snapshot) -> tuple[list[int], list[int], bool]:
    """What became of the gradients of :func:`snapshot`: ``(untouched, replaced, added_to)``:
    the ids of parameters whose gradient is the same tensor, unchanged (still unscaled), those
    whose gradient is another tensor, none, or one that was zero when snapshotted (zeroed in
    place, ``zero_grad(set_to_none=False)``), and whether a non-zero one was written in place
    since (a backward accumulated onto it). One host read, only when some were written."""
    untouched, replaced, written = [], [], []
    for key, (param, ref, version, norm) in carried.items():
        grad = param.grad
        if grad is None or ref is None or grad is not ref():
            replaced.append(key)
        elif grad._version == version:
            untouched.append(key)
        elif norm is None:
            replaced.append(key)
        else:
            written.append((key, norm))
    added_to = False
    if written:
        home = written[0][1].device
        nonzero = torch.stack([to_device(n.float(), home) for _, n in written]).ne(0).tolist()
        added_to = any(nonzero)
        replaced += [key for (key, _), bad in zip(written, nonzero, strict=True) if not bad]
    return untouched, replaced, added_to


def check_bucket(device: torch.device, dtype: torch.dtype) -> None:
    """Raise if gradients of this device and dtype cannot be unscaled.

    Raises:
        TypeError: not a floating-point dtype.
        ValueError: the meta device (no data).
    """
    if not dtype.is_floating_point:
        raise TypeError(f"gradients must be floating point, got dtype {dtype}.")
    if device.type == "meta":
        raise ValueError(
            "a gradient is on the meta device (no data); materialize the model "
            "(module.to_empty(device=...)) before training."
        )


def bucket_grads(params: Iterable[Any], skip: Container[int] = ()) -> Buckets:
    """:func:`local_grads`' values grouped by device and dtype, in parameter order."""
    buckets: Buckets = {}
    for _, values in local_grads(params, skip):
        buckets.setdefault(values.device, {}).setdefault(values.dtype, []).append(values)
    for device, per_dtype in buckets.items():
        for dtype in per_dtype:
            check_bucket(device, dtype)
    return buckets


def unscale_and_check(
    buckets: Buckets, inv_scale: torch.Tensor, found_inf: torch.Tensor | None = None
) -> dict[torch.device, torch.Tensor]:
    """Multiply every gradient by ``inv_scale`` in place and flag non-finite values.

    One ``torch._amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) bucket: one
    read and one write of each gradient (torch's kernels skip the write for a factor of 1).

    Args:
        buckets: from :func:`bucket_grads`.
        inv_scale: 0-d float32 tensor (any device; copied once per device).
        found_inf: 0-d float32 (any device): each device gets a copy of it; None: a zero made
            on each device.

    Returns:
        ``{device: found_inf}``, each a 0-d float32 tensor on that device, 1.0 if any gradient on
        the device held inf or NaN, else 0.0 (as ``torch.amp.GradScaler._unscale_grads_``). No
        host synchronisation.
    """
    flags: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, per_dtype in buckets.items():
            if found_inf is None:
                flag = torch.zeros((), dtype=torch.float32, device=device)
            else:
                flag = to_device(found_inf, device, copy=True)
            inv = inv_scale if inv_scale.device == device else to_device(inv_scale, device)
            for grads in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
            flags[device] = flag
    return flags


def peak(grads: list[torch.Tensor]) -> torch.Tensor:
    """max |g| over ``grads`` (one device and dtype) as a 0-d float32, in one read pass; an inf
    or NaN propagates. ``torch._foreach_norm(grads, inf)`` (one multi-tensor kernel on CUDA);
    on the CPU, where that norm is ~10x slower than torch's check kernel, one ``aminmax`` per
    tensor (~1.5x)."""
    if grads[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(grads, math.inf)).max().float()
    # max(|max g|, |min g|) over the tensors is max |g|: one stack of both, abs, max
    ends = [end for g in grads for end in torch.aminmax(g)]
    return torch.stack(ends).abs().max().float()


def measure_and_check(
    buckets: Buckets,
    inv_scale: torch.Tensor,
    amax: dict[torch.device, torch.Tensor],
    check_only: bool = False,
) -> dict[torch.device, torch.Tensor]:
    """:func:`unscale_and_check`, measuring the largest |gradient| before unscaling
    (``policy="headroom"``).

    Per (device, dtype) bucket one pass reads every gradient once (:func:`peak`: max |g|; an
    inf or NaN propagates). ``check_only`` (a fused step's check,
    factor 1): that pass is the check, replacing torch's check kernel (no extra read);
    otherwise torch's kernel then unscales (one more read and write, as without measuring).

    Args:
        buckets: from :func:`bucket_grads`.
        inv_scale: 0-d float32 (any device); unused when ``check_only``.
        amax: filled with ``{device: 0-d float32}``, the largest |scaled gradient| there
            (inf when any is inf; NaN, or inf when ``check_only``, when any is NaN).
        check_only: only check (the gradients are left as they are).

    Returns:
        ``{device: found_inf}`` as :func:`unscale_and_check` (1.0 where a gradient is not
        finite). No host synchronisation.
    """
    flags: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, per_dtype in buckets.items():
            peaks = [peak(grads) for grads in per_dtype.values()]
            top = peaks[0] if len(peaks) == 1 else torch.stack(peaks).max()
            if check_only:  # NaN read as inf: the flag, and the agreement's MAX, see it
                top = torch.nan_to_num(top, nan=math.inf, posinf=math.inf)
                flag = (top == math.inf).float()
            else:  # a NaN amax comes with torch's flag: an overflow, which ignores the amax
                flag = torch.zeros((), dtype=torch.float32, device=device)
                inv = inv_scale if inv_scale.device == device else to_device(inv_scale, device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
            flags[device], amax[device] = flag, top
    return flags


def combine_flags(flags: Mapping[torch.device, torch.Tensor], home: torch.device) -> torch.Tensor:
    """MAX of per-device 0-d flags as one 0-d float32 tensor on ``home`` (no host sync)."""
    own = flags.get(home)
    if own is not None and len(flags) == 1:
        return own  # the common case: one device, the scale's
    local = torch.zeros((), dtype=torch.float32, device=home)
    for flag in flags.values():
        local = torch.maximum(local, to_device(flag, home))
    return local


def inv_scale(scale: torch.Tensor, math: torch.dtype = torch.float64) -> torch.Tensor:
    """``1 / scale`` as torch's ``GradScaler`` computes it (in float64, then float32: a float32
    division can be imprecise); ``math=torch.float32`` where the device has no float64
    (:func:`shardscale._policy.has_float64`)."""
    if math != torch.float64:
        return scale.reciprocal()
    return scale.double().reciprocal().float()


def first_tensor(outputs: object) -> torch.Tensor:
    """Validate a scale() argument and return its first tensor."""
    first: list[torch.Tensor] = []

    def visit(val: object, depth: int) -> None:
        if isinstance(val, torch.Tensor):
            if not (val.is_floating_point() or val.is_complex()):
                raise TypeError(
                    f"scale() takes floating-point tensors (a loss); got dtype {val.dtype}."
                )
            if val.device.type == "meta":
                raise ValueError(
                    "scale() got a tensor on the meta device (no data); compute the loss with a "
                    "materialized model (module.to_empty(device=...) and initialize it first)."
                )
            first.append(val)
        elif isinstance(val, (list, tuple)) and depth < 64:
            for v in val:
                visit(v, depth + 1)
        else:
            raise TypeError(
                f"scale() takes a tensor or a (nested) list/tuple of tensors; got {type(val).__name__}."
            )

    visit(outputs, 0)
    if not first:
        raise TypeError("scale() got a list/tuple with no tensor in it.")
    return first[0]


def times(outputs: Any, scale: torch.Tensor) -> Any:
    """``outputs`` (a tensor, or nested lists/tuples of them, validated by
    :func:`first_tensor`) multiplied by the 0-d ``scale``, each on its own device."""
    if isinstance(outputs, torch.Tensor):
        return outputs * to_device(scale, outputs.device)
    items = [times(v, scale) for v in outputs]
    return type(outputs)(*items) if hasattr(outputs, "_fields") else type(outputs)(items)
