"""Every collective of the scaler: the found-inf agreement, the norm's sum, the report's gather.

Process groups are given explicitly (a ``ProcessGroup``, a ``DeviceMesh``, or a sequence of
them); ``None`` means the default group when ``torch.distributed`` is initialized at the time of
the call, and no communication otherwise. Groups of one rank are left out: a single process
issues no collective at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch
import torch.distributed as dist

from ._config import POLICY_FIELDS
from ._grads import to_device

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch built without distributed
    DeviceMesh = None  # type: ignore[assignment,misc]

ProcessGroupLike = Union["dist.ProcessGroup", "DeviceMesh", Sequence[Any], None]

#: Device types each backend's collectives take (the first is preferred).
_BACKEND_DEVICES = {
    "gloo": ("cpu",),
    "mpi": ("cpu",),
    "ucc": ("cpu", "cuda"),
    "nccl": ("cuda",),
    "xccl": ("xpu",),
    "hccl": ("hpu",),
}


def _is_mesh(obj: object) -> bool:
    return DeviceMesh is not None and isinstance(obj, DeviceMesh)


def _is_group(obj: object) -> bool:
    """A ``ProcessGroup``, or an object that behaves as one (``rank()``, ``size()``,
    ``allreduce()``: the dummy groups of torch's test utilities), as torch's scalers accept."""
    if dist.is_available() and isinstance(obj, dist.ProcessGroup):
        return True
    return all(callable(getattr(obj, name, None)) for name in ("rank", "size", "allreduce"))


def validate_process_group(process_group: object) -> None:
    """Check the type of a ``process_group`` argument without resolving it.

    Raises:
        TypeError: not None, a ProcessGroup, a DeviceMesh, or a non-empty list/tuple of those.
    """
    if process_group is None or _is_mesh(process_group) or _is_group(process_group):
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


def resolve_groups(process_group: ProcessGroupLike) -> list[Any]:
    """The process groups to reduce over, groups of one rank left out. A DeviceMesh gives one
    group per mesh dimension (MAX or SUM over each dimension in turn covers the whole mesh)."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return []
        items: list[Any] = [dist.group.WORLD]
    elif isinstance(process_group, (list, tuple)):
        items = list(process_group)
    else:
        items = [process_group]
    groups: list[Any] = []
    for item in items:
        groups.extend(_mesh_dims(item) if _is_mesh(item) else [item])
    return [g for g in groups if g.size() > 1]


@torch.compiler.disable  # DeviceMesh's methods are opaque to torch.compile: kept eager
def _mesh_dims(mesh: Any) -> list[Any]:
    return list(mesh.get_all_groups())


def _contains(outer: Any, inner: Any) -> bool:
    """Whether every rank of group ``inner`` is in group ``outer``."""
    if dist.is_initialized() and outer is dist.group.WORLD:
        return True
    return set(dist.get_process_group_ranks(inner)) <= set(dist.get_process_group_ranks(outer))


def cover(process_group: ProcessGroupLike, optimizer: Any) -> list[Any]:
    """The groups to agree over: :func:`resolve_groups` of ``process_group`` plus the
    dimensions of the DeviceMeshes of ``optimizer``'s DTensor parameters whose ranks no group
    contains, since the ranks holding pieces of one parameter (tensor parallelism on a dp x tp
    mesh, with the scaler given the dp group) must take the same skip decision. When that takes
    several groups and a mesh spans every rank, the default group replaces them: one
    all-reduce."""
    groups = resolve_groups(process_group)
    meshes: dict[int, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            mesh = getattr(p, "device_mesh", None) if type(p) is not torch.nn.Parameter else None
            if mesh is not None:
                meshes.setdefault(id(mesh), mesh)
    return _with_mesh_dims(process_group, groups, list(meshes.values())) if meshes else groups


@torch.compiler.disable  # DeviceMesh's methods are opaque to torch.compile: kept eager
def _with_mesh_dims(
    process_group: ProcessGroupLike, groups: list[Any], meshes: Sequence[Any]
) -> list[Any]:
    extra: list[Any] = []
    for mesh in meshes:
        for group in _mesh_dims(mesh):
            if group.size() > 1 and not any(_contains(h, group) for h in groups + extra):
                extra.append(group)
    groups = groups + extra
    if len(groups) > 1:
        spanning = [*meshes, *(m for m in _items(process_group) if _is_mesh(m))]
        if any(m.size() == dist.get_world_size() for m in spanning):
            return [dist.group.WORLD]
    return groups


def _items(process_group: ProcessGroupLike) -> list[Any]:
    if process_group is None:
        return []
    return list(process_group) if isinstance(process_group, (list, tuple)) else [process_group]


@torch.compiler.assume_constant_result  # torch.compile: read once when tracing, a constant
def comm_device(group: Any, preferred: torch.device) -> torch.device:
    """The device a tensor must be on for ``group``'s backend (CPU for gloo, CUDA for NCCL);
    ``preferred`` (the scale's device) when the backend takes it."""
    try:
        types = [d.type for d in group._device_types]  # one entry per backend of the group
    except (AttributeError, RuntimeError):
        try:
            backend = str(dist.get_backend(group))
        except (RuntimeError, ValueError, AttributeError):
            return preferred
        types = [
            t
            for part in backend.split(",")
            for t in _BACKEND_DEVICES.get(part.split(":")[-1].strip(), ("cpu",))
        ]
    if not types or preferred.type in types:
        return preferred
    if "cpu" in types:
        return torch.device("cpu")
    module = getattr(torch, types[0], None)
    index = module.current_device() if hasattr(module, "current_device") else 0
    return torch.device(types[0], index)


_UNMATCHED = (
    "ShardedGradScaler: the all-reduce of {call}{step} failed on rank {rank}: "
    "another rank of the process group did not make the same call in time, or made another "
    "collective instead. Likely causes: a rank ran out of data (uneven inputs: run the loop "
    "inside torch.distributed.algorithms.Join([model, scaler]); inside Join, a rank with no "
    "batch at all repeats one agreement per iteration: with several optimizers or "
    "clip_grad_norm_, give every rank at least one batch), a rank skipped or added a "
    "step()/unscale_()/clip_grad_norm_() call, crashed, or was given another process group. "
    "Every rank must make the same scaler calls in the same order. ({error})"
)


def all_reduce(
    tensor: torch.Tensor,
    groups: list[Any],
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.MAX,
    call: tuple[str, Any] | None = None,
) -> torch.Tensor:
    """``tensor`` all-reduced with ``op`` over each of ``groups`` in turn.

    Args:
        tensor: a float tensor (any shape) on the scale's device.
        groups: from :func:`resolve_groups`; empty means no communication.
        op: MAX for found-inf flags, SUM for the parts of a norm.
        call: ``(the scaler call, its update count as a 0-d tensor)``: a failed collective (a
            timeout, a peer gone or in another collective) raises a ``RuntimeError`` naming
            it, the likely causes and the fix.

    Returns:
        The reduced tensor on ``tensor``'s device (moved to the device the backend needs and
        back where they differ). One all-reduce per group, each complete (on an accelerator:
        ordered before later work on the current stream) when this returns.
    """
    for group in groups:
        device = comm_device(group, tensor.device)
        buf = tensor if device == tensor.device else to_device(tensor, device)
        try:
            dist.all_reduce(buf, op=op, group=group)
        except RuntimeError as e:
            if call is None:
                raise
            name, step = call
            raise RuntimeError(
                _UNMATCHED.format(
                    call=name,
                    step="" if step is None else f" (at update {int(step)})",
                    rank=rank(),
                    error=e,
                )
            ) from e
        tensor = buf if buf is tensor else to_device(buf, tensor.device)
    return tensor


#: The policy fields compared across ranks (``ScalerConfig`` attribute names), in order.
POLICY = POLICY_FIELDS
#: Slots of the agreement vector (see :func:`agree`): three taken as they come, then the
#: compared fields twice, as themselves from ``POS`` and negated from ``NEG`` (in the same
#: order: step, scale, check, error, the policy's; error's negated slot holds 0). After a MAX,
#: the ranks agree on a field iff ``max(x) + max(-x) == 0``: one add over the two blocks.
FOUND, AMAX, SCALED = 0, 1, 2
POS = 3
STEP, SCALE, CHECK, ERROR = range(POS, POS + 4)
NEG = POS + 4 + len(POLICY)
NEG_STEP, NEG_SCALE, NEG_CHECK = range(NEG, NEG + 3)
#: Length of the agreement vector.
LENGTH = NEG + (NEG - POS)
#: What a rank that fails a call-order check tells the others (:func:`poison`), by code.
ERRORS = {
    1: "called unscale_()/step() again for an optimizer before update()",
    2: "called update() with no optimizer stepped or unscaled",
    3: "called unscale_() after step() for an optimizer",
}
_CONSTANTS: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = {}


#: The policy fields that are names, as the agreement vector codes them (their index).
_CODES = {"on_collapse": ("raise", "warn"), "policy": ("torch", "headroom")}


def policy_values(config: Any) -> tuple[float, ...]:
    """``config``'s :data:`POLICY` fields as floats (None -> -1, a name -> its index in
    ``_CODES``, a bool -> 0/1)."""
    out = []
    for name in POLICY:
        value = getattr(config, name)
        if name in _CODES:
            value = _CODES[name].index(value)
        out.append(-1.0 if value is None else float(value))
    return tuple(out)


def _shown(name: str, value: float) -> str:
    """A policy field's value as the user wrote it (``policy_values`` reversed)."""
    if name in _CODES and value in (0.0, 1.0):
        return repr(_CODES[name][int(value)])
    if name in ("consecutive_hysteresis", "dynamic") and value in (0.0, 1.0):
        return str(bool(value))
    if name == "max_consecutive_skips" and value == -1.0:
        return "None"
    return f"{value:g}"


def _constants(
    check: int, scaled: bool, policy: tuple[float, ...], device: torch.device, amax: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The agreement vector's constant pieces on ``device``: ``[(-1: no amax,) scaled]``,
    ``[check, 0 (error), *policy]`` and ``[-check, 0, *-policy]``; made once per key (a
    host-to-device copy the first time only), then reused as they are (read-only)."""
    key = (check, scaled, policy, device, amax)
    pieces = _CONSTANTS.get(key)
    if pieces is None:
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        first = [float(scaled)] if amax else [-1.0, float(scaled)]
        pos = [float(check), 0.0, *policy]
        neg = [-float(check), 0.0, *(-v for v in policy)]
        pieces = _CONSTANTS[key] = tuple(
            torch.tensor(v, dtype=torch.float32, device=device) for v in (first, pos, neg)
        )
    return pieces  # type: ignore[return-value]


def agree(
    found_inf: torch.Tensor,
    step: torch.Tensor,
    check: int,
    scaled: bool,
    groups: list[Any],
    scale: torch.Tensor,
    policy: tuple[float, ...],
    error: float = 0.0,
    call: str = "the scaler",
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """The found-inf agreement: ONE MAX all-reduce (per group) of :data:`LENGTH` float32 values
    on ``found_inf``'s device: ``[found_inf, amax, scaled, step, scale, check, error,
    *policy, -step, -scale, -check, 0, *-policy]``. ``amax`` (0-d float32, this rank's largest
    |scaled gradient|; None: not measured, -1) comes out as the group's largest:
    ``policy="headroom"``'s measurement at no extra collective.

    ``step`` (0-d: the scaler's update count), ``check`` (the ordinal of this check within the
    iteration), ``scale`` (0-d, the loss scale the gradients were computed with) and ``policy``
    (:func:`policy_values`) ride along, so that ranks which call the scaler differently, hold
    different scales (one restored a checkpoint) or were built with different arguments are
    told apart from an overflow: after MAX, ``x_max + (-x)_max != 0`` means the ranks disagree
    on ``x`` (:func:`mismatch`); ``scaled`` (whether this rank called ``scale()`` in the
    iteration) tells an idle rank that others did; ``error`` is 0 but from :func:`poison`.
    ``call`` names the scaler call in the error of a collective that fails
    (:func:`all_reduce`). 9 tensor operations (views included) besides the all-reduce.
    """
    step32 = (step % 2**24).to(torch.float32).reshape(())
    scale32 = scale.to(device=found_inf.device, dtype=torch.float32).reshape(())
    first, pos, neg = _constants(check, scaled, policy, found_inf.device, amax is not None)
    if error:
        pos = pos.clone()
        pos[ERROR - CHECK] = error
    moving = torch.stack([step32, scale32])
    head = [found_inf.reshape(1)] + ([] if amax is None else [amax.reshape(1).float()])
    vector = torch.cat([*head, first, moving, pos, -moving, neg])
    return all_reduce(vector, groups, call=(call, step))


def agreement(
    found_inf: torch.Tensor,
    step: torch.Tensor,
    check: int,
    scaled: bool,
    groups: list[Any],
    scale: torch.Tensor,
    policy: tuple[float, ...],
    call: str = "the scaler",
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`agree`, read back: ``(flag, anyone_scaled, bad, vector)``: the agreed flag (0-d
    float32, also set when the ranks disagree), whether any rank called ``scale()`` (0-d bool),
    whether they disagree (0-d bool, :func:`mismatch`) and the agreement vector."""
    vector = agree(found_inf, step, check, scaled, groups, scale, policy, call=call, amax=amax)
    bad = mismatch(vector)
    return torch.maximum(vector[FOUND], bad), vector[SCALED] > 0, bad, vector


def poison(
    code: int,
    step: torch.Tensor,
    check: int,
    rank: int,
    groups: list[Any],
    scale: torch.Tensor,
    policy: tuple[float, ...],
) -> None:
    """The agreement all-reduce of a rank that is about to raise a call-order error (``code`` in
    :data:`ERRORS`): it pairs with the all-reduce the other ranks wait in, which then fails with
    a message naming this rank and its error instead of a collective timeout."""
    flag = torch.ones((), dtype=torch.float32, device=scale.device)
    agree(flag, step, check, False, groups, scale, policy, code * 4096 + rank % 4096 + 1)


def mismatch(agreed: torch.Tensor) -> torch.Tensor:
    """0-d bool: the agreement vector shows ranks at different steps or checks, with different
    scales or policies, or an error (4 tensor operations)."""
    return (agreed[POS:NEG] + agreed[NEG:]).any()


def mismatched(values: Sequence[float]) -> bool:
    """:func:`mismatch` of an agreement vector read on the host."""
    return any(a + b != 0 for a, b in zip(values[POS:NEG], values[NEG:LENGTH], strict=True))


def _differences(values: Sequence[float]) -> list[str]:
    """The scale and policy fields on which the ranks differ, with their ranges."""
    out = []
    if values[SCALE] != -values[NEG_SCALE]:
        out.append(f"loss scale {-values[NEG_SCALE]:g}..{values[SCALE]:g}")
    for i, name in enumerate(POLICY):
        hi, lo = values[ERROR + 1 + i], -values[NEG_CHECK + 2 + i]
        if hi != lo:
            out.append(f"{name} {_shown(name, lo)}..{_shown(name, hi)}")
    return out


def mismatch_message(values: Sequence[float], own_step: int, own_check: int, rank: int) -> str:
    """The error for an agreement vector ``values`` (read on the host) that shows a mismatch."""
    if values[ERROR] > 0:
        code, other = divmod(int(values[ERROR]) - 1, 4096)
        return (
            f"ShardedGradScaler: rank {other} {ERRORS.get(code, 'failed')} and raised; this rank "
            f"(rank {rank}) stops here instead of waiting for it. Every rank must call "
            "scale/unscale_/step/update in the same order for the same optimizers."
        )
    if values[STEP] != -values[NEG_STEP]:
        return (
            f"ShardedGradScaler: the ranks are out of step: this rank (rank {rank}) is at step "
            f"{own_step} (update() calls) but the ranks of the process group range over steps "
            f"{int(-values[NEG_STEP])}..{int(values[STEP])} (mod 2**24), so this found-inf all-reduce met "
            "another iteration's. Every rank must call scale/step/update in the same order for the "
            "same optimizers and load the same checkpoint (e.g. a rank stepped fewer optimizers, "
            "skipped update(), or restored another step's scaler state)."
        )
    if values[CHECK] != -values[NEG_CHECK]:
        return (
            "ShardedGradScaler: the ranks reduce the found-inf flags of different checks: this "
            f"rank (rank {rank}) makes its check number {own_check} of the iteration, other ranks "
            f"numbers {int(-values[NEG_CHECK])}..{int(values[CHECK])}. Every rank must call "
            "unscale_/step/clip_grad_norm_ for the same number of optimizers, in the same order."
        )
    return (
        f"ShardedGradScaler: the ranks' scalers differ at step {own_step} (seen on rank {rank}): "
        + ", ".join(_differences(values))
        + ". Their gradients were scaled differently (or the scales would move differently), so "
        "the replicas would drift apart; the step was skipped on every rank. Build every rank's "
        "scaler with the same arguments and load the same checkpoint on every rank (a rank that "
        "restored a scaler state the others did not, or a per-rank config)."
    )


def gather_objects(items: list[Any], groups: list[Any]) -> list[Any]:
    """Every rank's ``items`` (picklable, hashable), gathered over each group in turn (an
    ``all_gather_object`` per group: collective on every member), each item once."""
    merged = list(items)
    for group in groups:
        out: list[list[Any] | None] = [None] * group.size()
        dist.all_gather_object(out, merged, group=group)
        merged = list(dict.fromkeys(item for part in out for item in part or []))
    return merged


def rank() -> int:
    """This process's global rank (0 without an initialized torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
