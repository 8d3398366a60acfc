"""Finding an optimizer's gradients and unscaling/checking them locally, per (device, dtype).

Everything here is local to one rank: no collective, no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from typing import Any

import torch

from . import _gather
from ._cpukernel import CPU as _CPU
from ._cpukernel import Batch, unscale_batch_
from ._gather import gather
from ._sync import to_device

try:  # DTensor is public from torch 2.5 on; keep the import soft for other builds.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

#: ``{device: {dtype: tensors}}``; CPU buckets are :class:`~shardscale._cpukernel.Batch` objects
#: (the tensors split for the compiled kernel as they were gathered), the others lists.
Buckets = dict[torch.device, dict[torch.dtype, "list[torch.Tensor] | Batch"]]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` stored on this rank: a DTensor's local shard, else ``t`` itself.

    For a DTensor this is its ``to_local()`` shard, which shares storage with the DTensor, so an
    in-place unscale of it unscales the DTensor without DTensor's own collectives.
    """
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def iter_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of every param group of ``optimizer``, in order."""
    for group in optimizer.param_groups:
        yield from group["params"]


_Parameter = torch.nn.Parameter

#: Floating-point dtypes a gradient may have (a set lookup is cheaper than is_floating_point()).
_FLOAT_DTYPES = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point
)


class SharedMemoryGradError(ValueError):
    """A gradient whose elements share memory (an expanded or stride-0 view such as
    ``torch.ones(1).expand(4, 4)``, or an ``as_strided`` view over itself) cannot be unscaled or
    clipped in place: a shared location would be multiplied several times (torch's in-place
    kernels refuse stride-0 views only when they reach them, after the gradients before were
    written, and multiply other self-overlapping views silently). Raised before anything is
    written.

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

    def naming(
        self, names: Mapping[int, str], optimizer: torch.optim.Optimizer | None = None
    ) -> SharedMemoryGradError:
        """This error again, naming the parameter: by its name in ``names`` (``{id(param):
        name}``), else by its position in ``optimizer`` (found by its gradient's memory when
        ``param`` is not known: sparse values and DTensor shards are new objects per call)."""
        param, position = self.param, None
        if optimizer is not None:
            for i, candidate in enumerate(iter_params(optimizer)):
                if candidate is param or (param is None and _holds(candidate, self.grad)):
                    param, position = candidate, i
                    break
        if param is None:
            return self
        name = names.get(id(param))
        if name is None:
            name = "a parameter" if position is None else f"parameter {position} of the optimizer"
        return SharedMemoryGradError(self.grad, param, name)


def _holds(param: object, values: torch.Tensor) -> bool:
    """Whether ``values`` is ``param``'s gradient, its local shard or its sparse values (the
    same memory, shape and strides). Error path only."""
    grad = getattr(param, "grad", None)
    if not isinstance(grad, torch.Tensor):
        return False
    local = local_tensor(grad)
    local = local._values() if local.is_sparse else local
    return (local.data_ptr(), local.shape, local.stride()) == (
        values.data_ptr(),
        values.shape,
        values.stride(),
    )


def _may_overlap(t: torch.Tensor) -> bool:
    """False when no two elements of ``t`` can share memory: its dimensions, sorted by stride,
    each step over everything the smaller ones span (slices, transposes, permutations do).
    True otherwise, which includes every stride-0 view and every ``as_strided`` view over
    itself (and a few exotic interleaved layouts that do not overlap)."""
    span = 0
    for stride, size in sorted(
        (st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1
    ):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def require_writable(grad: torch.Tensor, param: object = None) -> None:
    """Raise :class:`SharedMemoryGradError` (naming ``param``'s gradient) if elements of
    ``grad`` share memory. Contiguous (and channels-last) tensors never do and cost one
    ``is_contiguous()``; tensor subclasses are left to their own kernels."""
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
    # This runs once per parameter per step: plain dense tensors (the common case) skip the
    # DTensor and device-object checks, which cost more than the rest together.
    values = grad if type(grad) is torch.Tensor else local_tensor(grad)
    if values.dtype not in _FLOAT_DTYPES:
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


def plain_grad(param: object) -> torch.Tensor | None:
    """``param.grad`` when ``param`` is a plain ``nn.Parameter`` whose gradient is a non-empty,
    dense (strided), floating-point, non-meta ``torch.Tensor`` (the common case), else None:
    then call :func:`grad_values`, which handles and validates every other case.

    A fast path: it runs once per parameter per step and skips the DTensor and device checks,
    which cost more than the rest of a step's per-parameter work together.
    """
    if type(param) is not torch.nn.Parameter:
        return None
    grad = param.grad
    if (
        type(grad) is torch.Tensor
        and grad.layout is torch.strided
        and grad.dtype in _FLOAT_DTYPES
        and not grad.is_meta
        and grad.numel()
    ):
        return grad
    return None


def unique_params(optimizer: torch.optim.Optimizer, skip: Container[int] = ()) -> list[Any]:
    """``optimizer``'s parameters in order, each once, without those whose ``id`` is in ``skip``.

    torch only warns about a parameter listed twice in one param group (e.g. a tied weight), and
    param groups can be edited after construction. The duplicate test is one ``set`` of ids built
    in C: no Python per parameter in the common case (no duplicates, nothing skipped), where the
    optimizer's own list is returned: read it, do not change it.
    """
    groups = optimizer.param_groups
    if len(groups) == 1:
        params = groups[0]["params"]
    else:
        params = [p for group in groups for p in group["params"]]
    if len(set(map(id, params))) != len(params):
        params = list({id(p): p for p in params}.values())  # the first of each, in order
    if skip:
        params = [p for p in params if id(p) not in skip]
    return params


def bucket_grads(optimizer: torch.optim.Optimizer, skip: Container[int] = ()) -> Buckets:
    """Group the local gradient tensors of ``optimizer`` by device and dtype.

    Parameters whose ``id`` is in ``skip`` (already unscaled this iteration by
    ``clip_grad_norm_(params)``) are left out, and a parameter listed twice (a tied weight
    listed twice in a param group, which torch only warns about) is taken once, so it is
    unscaled once (:func:`unique_params`).

    Returns:
        ``{device: {dtype: tensors}}`` of dense tensors (local DTensor shards, values of sparse
        gradients): a list per accelerator bucket, in the optimizer's parameter order; a
        :class:`~shardscale._cpukernel.Batch` per CPU bucket, filled in this same pass (the
        compiled kernel's pointer arrays cost no second loop over the gradients), or again at
        the end when a parameter took the general path (a ``.grad`` getter of a parameter or
        gradient subclass could have run user code after earlier addresses were read).
        Parameters without ``.grad`` and empty shards are left out, so a rank that holds no
        shard gets ``{}``. The common case on the CPU (nothing skipped, every parameter a plain
        ``nn.Parameter`` listed once, every gradient a plain dense CPU tensor of a dtype the
        kernel has a path for) is gathered in C++ (:mod:`shardscale._gather`), with the same
        result.

    Raises:
        TypeError: a parameter is not a tensor, or a gradient is not floating point.
    """
    if not skip:  # the common case on the CPU, gathered in C++ (None: not the common case)
        gathered = gather(optimizer)
        if gathered is not None:
            return gathered  # type: ignore[return-value]
    buckets: Buckets = {}
    cpu: dict[torch.dtype, Batch] | None = None
    general = False  # a parameter took grad_values()
    parameter, tensor, strided, floats = _Parameter, torch.Tensor, torch.strided, _FLOAT_DTYPES
    last_dtype, last_batch = None, None  # most gradients have the dtype of the one before
    for param in unique_params(optimizer, skip):
        # This runs once per parameter per step, right after the backward pass has streamed
        # through the caches: the common case, a plain parameter with a dense CPU gradient,
        # reads as few tensor attributes as it can (each costs ~0.5 us cold).
        grad = param.grad if type(param) is parameter else None
        if type(grad) is tensor and grad.is_cpu and grad.layout is strided:
            dtype, numel = grad.dtype, grad.numel()
            if dtype is last_dtype and numel:
                last_batch.add_dense(grad, numel)  # type: ignore[union-attr]
                continue
            if numel and dtype in floats:
                if cpu is None:
                    cpu = buckets[_CPU] = {}  # type: ignore[assignment]
                batch = cpu.get(dtype)
                if batch is None:
                    batch = cpu[dtype] = Batch(dtype)
                batch.add_dense(grad, numel)
                last_dtype, last_batch = dtype, batch
                continue
        general = True
        values = grad_values(param)  # the general case; validates (TypeError/ValueError)
        if values is None:
            continue
        device = values.device
        if device.type == "cpu":
            if cpu is None:
                cpu = buckets[_CPU] = {}  # type: ignore[assignment]
            batch = cpu.get(values.dtype)
            if batch is None:
                batch = cpu[values.dtype] = Batch(values.dtype)
            batch.add(values, values.numel())
            continue
        per_dtype = buckets.get(device)
        if per_dtype is None:
            per_dtype = buckets[device] = {}
        same = per_dtype.get(values.dtype)
        if same is None:
            per_dtype[values.dtype] = [values]
        else:
            same.append(values)  # type: ignore[union-attr]
    if general and cpu:  # read the addresses after every getter ran
        for dtype, batch in cpu.items():
            cpu[dtype] = batch.regathered()
    if cpu and _gather._fn is None:  # CPU gradients: build/load the C++ gathering for next time
        _gather.status()
    return buckets


#: CPU found-inf flags handed out by :func:`zero_flag`: 0-d views of one zeroed buffer.
_CPU_FLAGS: list[torch.Tensor] = []
_FLAGS_PER_BUFFER = 64


def zero_flag(device: torch.device) -> torch.Tensor:
    """A new 0-d float32 zero on ``device``, for a found-inf flag.

    On the CPU it is a 0-d view of a zeroed buffer allocated for 64 flags at a time, each view
    handed out once (never reused, so a flag a caller keeps never changes): right after a
    backward pass a first ``torch.zeros`` costs ~40 us of cold dispatch. Elsewhere
    ``torch.zeros`` (an accelerator's buffer would be zeroed on whichever stream was current).
    """
    if device is not _CPU and device.type != "cpu":
        return torch.zeros((), dtype=torch.float32, device=device)
    while True:  # another thread may take the new ones first
        try:
            return _CPU_FLAGS.pop()
        except IndexError:  # views share the buffer's version counter; nothing writes them in place
            _CPU_FLAGS.extend(
                torch.zeros(_FLAGS_PER_BUFFER, dtype=torch.float32, device=_CPU).unbind()
            )


def unscale_and_check(
    buckets: Buckets, inv_scale: torch.Tensor | None
) -> dict[torch.device, torch.Tensor]:
    """Multiply every gradient by ``inv_scale`` in place and flag non-finite values.

    One fused kernel per (device, dtype) bucket: one read and one write of each gradient (no
    write when the factor is 1). Accelerators use ``torch._amp_foreach_non_finite_check_and_unscale_``,
    the kernel behind ``torch.amp.GradScaler``; the CPU uses shardscale's compiled kernel
    (:mod:`shardscale._cpukernel`, same results bit for bit), or torch's where it cannot be built.

    Args:
        buckets: from :func:`bucket_grads`.
        inv_scale: 0-d float32 tensor (any device; copied once per device), or None to only check
            (multiplies by 1.0: the gradients keep their values).

    Returns:
        ``{device: found_inf}``, each a 0-d float32 tensor on that device, 1.0 if any gradient on
        the device held inf or NaN, else 0.0. No host synchronisation.

    Raises:
        SharedMemoryGradError: a gradient's elements share memory; nothing was written.
    """
    tensor = torch.Tensor
    for per_dtype in buckets.values():  # first, so that a refused gradient leaves all unwritten
        for bucket in per_dtype.values():
            # a CPU batch's taken tensors are dense (no shared memory): only its rest can share;
            # contiguous ones are passed over here (a call per gradient costs ~40 % more)
            for grad in bucket.rest if isinstance(bucket, Batch) else bucket:
                if type(grad) is tensor and not grad.is_contiguous():
                    require_writable(grad)
    flags: dict[torch.device, torch.Tensor] = {}
    for device, per_dtype in buckets.items():
        flag = zero_flag(device)
        if inv_scale is None:
            inv = torch.ones((), dtype=torch.float32, device=device)
        elif inv_scale.is_cpu if device is _CPU else inv_scale.device == device:
            inv = inv_scale  # (is_cpu: no device object to build and compare)
        else:
            inv = to_device(inv_scale, device)
        if device.type == "cpu":  # the compiled kernel; torch's (under no_grad) for the rest
            for batch in per_dtype.values():
                unscale_batch_(batch, flag, inv)  # type: ignore[arg-type]
        else:
            with torch.no_grad():
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)  # type: ignore[arg-type]
        flags[device] = flag
    return flags


#: The factor of a check-only pass (the compiled kernel reads it; nothing writes it)
_ONE = torch.ones((), dtype=torch.float32)


def unscale_grads_(
    optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor | None, skip: Container[int] = ()
) -> dict[torch.device, torch.Tensor]:
    """``unscale_and_check(bucket_grads(optimizer, skip), inv_scale)``: the commonest CPU case
    (nothing skipped; every gradient a plain, dense, aligned CPU tensor of one dtype the
    compiled kernel has a path for) in one C++ call (:func:`shardscale._gather.unscale_`), the
    same result; any other case as that expression. Arguments, result and errors as
    :func:`bucket_grads` and :func:`unscale_and_check`."""
    if not skip and _gather._unscale_fn:
        flag = zero_flag(_CPU)
        done = _gather.unscale_(optimizer, flag, _ONE if inv_scale is None else inv_scale)
        if done is not None:
            return {_CPU: flag} if done else {}
        _CPU_FLAGS.append(flag)  # unwritten and never handed out: back to the pool
    return unscale_and_check(bucket_grads(optimizer, skip), inv_scale)
