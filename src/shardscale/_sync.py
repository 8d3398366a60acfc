"""The one cross-rank reduction: agree on found_inf with a MAX all-reduce.

Process groups are given explicitly (a ``ProcessGroup``, a ``DeviceMesh`` or a sequence of
them); ``None`` means the default group when ``torch.distributed`` is initialized at the time of
the call, and no communication otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch
import torch.distributed as dist

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover
    DeviceMesh = None  # type: ignore[assignment,misc]

ProcessGroupLike = Union["dist.ProcessGroup", "DeviceMesh", Sequence[Any], None]

# Backends whose collectives take tensors of these device types (the first is preferred).
_BACKEND_DEVICES = {
    "gloo": ("cpu",),
    "mpi": ("cpu",),
    "ucc": ("cpu", "cuda"),
    "nccl": ("cuda",),
    "xccl": ("xpu",),
    "hccl": ("hpu",),
}


_DISTRIBUTED = dist.is_available()


def _is_group(obj: object) -> bool:
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)


def _is_mesh(obj: object) -> bool:
    return DeviceMesh is not None and isinstance(obj, DeviceMesh)


def validate_process_group(process_group: object) -> None:
    """Check the type of a ``process_group`` argument without resolving it.

    Raises:
        TypeError: not None, a ProcessGroup, a DeviceMesh, or a non-empty list/tuple of those.
    """
    if process_group is None or _is_group(process_group) or _is_mesh(process_group):
        return
    if isinstance(process_group, (list, tuple)) and process_group:
        for item in process_group:
            if not (_is_group(item) or _is_mesh(item)):
                raise TypeError(
                    "process_group sequence items must be ProcessGroup or DeviceMesh, got "
                    f"{type(item).__name__}."
                )
        return
    raise TypeError(
        "process_group must be None, a torch.distributed.ProcessGroup, a DeviceMesh, or a "
        f"non-empty list/tuple of them; got {type(process_group).__name__}."
    )


def default_group() -> dist.ProcessGroup | None:
    """The default process group (``dist.group.WORLD``), or None when ``torch.distributed`` is
    not initialized."""
    return dist.group.WORLD if _DISTRIBUTED else None  # None until init_process_group


def resolve_groups(process_group: ProcessGroupLike) -> list[dist.ProcessGroup]:
    """The process groups to all-reduce over, with groups of size 1 left out.

    A DeviceMesh contributes one group per mesh dimension (MAX over each dimension in turn is
    the MAX over the whole mesh).
    """
    if process_group is None:
        world = default_group()
        if world is None:
            return []
        items: list[Any] = [world]
    elif isinstance(process_group, (list, tuple)):
        items = list(process_group)
    else:
        items = [process_group]
    groups: list[dist.ProcessGroup] = []
    for item in items:
        if _is_mesh(item):
            groups.extend(item.get_all_groups())
        else:
            groups.append(item)
    return [g for g in groups if dist.get_world_size(g) > 1]


def comm_device(group: dist.ProcessGroup, preferred: torch.device) -> torch.device:
    """The device a flag must be on for ``group``'s backend (CPU for gloo, CUDA for NCCL).

    ``preferred`` (the scale's device) wins when the backend supports it.
    """
    types: list[str] = []
    try:
        types = [d.type for d in group._device_types]  # one entry per backend of the group
    except (AttributeError, RuntimeError):
        backend = str(dist.get_backend(group))
        for part in backend.split(","):
            name = part.split(":")[-1].strip()
            types.extend(_BACKEND_DEVICES.get(name, ("cpu",)))
    if not types or preferred.type in types:
        return preferred
    if "cpu" in types:
        return torch.device("cpu")
    kind = types[0]
    module = getattr(torch, kind, None)
    index = (
        module.current_device() if module is not None and hasattr(module, "current_device") else 0
    )
    return torch.device(kind, index)


def all_reduce(
    tensor: torch.Tensor, groups: list[dist.ProcessGroup], op: dist.ReduceOp = dist.ReduceOp.MAX
) -> torch.Tensor:
    """All-reduce ``tensor`` with ``op`` over each group, waiting for completion.

    Args:
        tensor: float32 tensor (any shape) on the scale's device.
        groups: from :func:`resolve_groups`; empty means no communication.
        op: the reduction (MAX for found-inf flags; SUM for the norm parts of clipping).

    Returns:
        The reduced tensor on ``tensor``'s device (``tensor`` itself when no copy was needed),
        moved to the device the backend needs and back (:func:`comm_device`). One all-reduce
        per group; each is complete (``wait()`` returned) before this function returns, so the
        result may be read at once.
    """
    for group in groups:
        device = comm_device(group, tensor.device)
        buf = tensor if device == tensor.device else tensor.to(device)
        dist.all_reduce(buf, op=op, group=group)
        if buf is not tensor:
            tensor = to_device(buf, tensor.device)  # blocking back to the CPU: read at once
    return tensor


def to_device(
    tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``tensor`` on ``device`` (and ``dtype``): asynchronous where that is safe, blocking when
    copying to the CPU, since a ``non_blocking`` device-to-host copy lands in pinned memory
    later and the CPU code that follows would read it at once (CPU-offloaded gradients with
    the scale on an accelerator)."""
    device = torch.device(device)
    return tensor.to(device=device, dtype=dtype, non_blocking=device.type != "cpu")


def rank() -> int:
    """This process's global rank (0 without an initialized torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def num_params(optimizer: torch.optim.Optimizer) -> int:
    """The number of parameters of ``optimizer`` (the same on every rank, sharded or not)."""
    return sum(len(group["params"]) for group in optimizer.param_groups)


def check_agreement(
    agreed: torch.Tensor, counters: torch.Tensor, optimizer: torch.optim.Optimizer
) -> None:
    """Raise if the MAX-reduced ``[found_inf, step, -step, n, -n]`` shows ranks at different
    steps or reducing different optimizers' flags."""
    _, high, neg_low, n_high, neg_n_low = agreed.tolist()  # CPU tensor: no device sync
    if n_high != -neg_n_low:
        raise RuntimeError(
            f"ShardedGradScaler: the ranks reduce the found-inf flags of different optimizers: "
            f"this rank (rank {rank()}) checks an optimizer with {num_params(optimizer)} "
            f"parameters, other ranks one with {int(-neg_n_low)}..{int(n_high)}. Every rank must "
            "call unscale_/step/clip_grad_norm_ for the optimizers in the same order (safe "
            "pattern: unscale_(opt_k); step(opt_k) for each k in a fixed order). If the ranks "
            "own different parameters by design (pipeline-parallel stages), construct the "
            "scaler with rank_local_params=True."
        )
    if high != -neg_low:
        own_step = int(counters[0])  # error path only
        raise RuntimeError(
            f"ShardedGradScaler: the ranks are out of step: this rank (rank {rank()}) is at "
            f"step {own_step} (update() calls) but the ranks of the process group range over "
            f"steps {int(-neg_low)}..{int(high)} (mod 2**24), so this found-inf all-reduce met "
            "another iteration's. Every rank must call scale/step/update in the same order for "
            "the same optimizers and load the same checkpoint (e.g. a rank stepped fewer "
            "optimizers, skipped update(), or restored another step's scaler state)."
        )
