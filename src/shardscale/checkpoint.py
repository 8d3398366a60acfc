"""Loading a torch scaler's checkpoint into a ShardedGradScaler through
``torch.distributed.checkpoint`` (DCP).

DCP asks the checkpoint for every key of the loading object's ``state_dict()``, and a strict load
(torch's ``DefaultLoadPlanner``) stops at the first key the checkpoint lacks. A checkpoint written
with torch's scaler (``torch.amp.GradScaler`` or torch's FSDP ``ShardedGradScaler``) holds torch's
five keys, so a strict load into shardscale stops at ``scaler.min_scale``. No ``Stateful`` can
avoid that (DCP reads the checkpoint's keys only after asking the object for its own), so the
fix is a planner: :class:`ScalerLoadPlanner` is torch's, strict for every other key, letting
exactly shardscale's keys be absent from a scaler entry that has torch's.

Imported on demand: ``from shardscale.checkpoint import ScalerLoadPlanner``.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan

from ._checkpoint import EXTRA_KEYS, TORCH_KEYS

__all__ = ["ScalerLoadPlanner"]


class ScalerLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads a torch scaler's checkpoint into a ShardedGradScaler.

    Use it in ``dcp.load`` when the checkpoint may have been written with
    ``torch.amp.GradScaler`` (or torch's FSDP ``ShardedGradScaler``)::

        dcp.load({"model": msd, "optim": osd, "scaler": scaler}, checkpoint_id=path,
                 planner=ScalerLoadPlanner())

    For a scaler entry whose torch keys (``scale``, ``_growth_tracker``, ...) are in the
    checkpoint, shardscale's keys that are not (``min_scale``, ``hysteresis``, ``_counters``,
    ...) are left out of the load and out of the dict ``load_state_dict`` receives, so they take
    what a plain ``scaler.load_state_dict(torch_scaler.state_dict())`` gives them: the policy of
    the scaler's constructor, a full hysteresis tracker, counters at 0. Every other missing key
    still raises, as with ``DefaultLoadPlanner()`` (unlike ``allow_partial_load=True``, which
    lets any missing key through). Takes ``DefaultLoadPlanner``'s arguments; a shardscale
    checkpoint loads with it exactly as without.
    """

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata  # type: ignore[union-attr]
        for fqn in [f for f in self.state_dict if f not in saved and _torch_extra(f, saved)]:
            del self.state_dict[fqn]
            if self.flatten_state_dict:
                _remove(self.original_state_dict, self.mappings.pop(fqn))
        return super().create_local_plan()


def _torch_extra(fqn: str, saved: Any) -> bool:
    """Whether ``fqn`` is one of shardscale's keys (``<prefix>.min_scale``,
    ``<prefix>._counters.steps``, ...) under a scaler entry whose torch keys ``saved`` holds."""
    parts = fqn.split(".")
    if len(parts) >= 2 and parts[-2] == "_counters":
        parts = parts[:-1]
    if parts[-1] not in EXTRA_KEYS:
        return False
    return all(".".join([*parts[:-1], key]) in saved for key in TORCH_KEYS)


def _remove(state: dict, path: tuple) -> None:
    """Delete ``state[path[0]]...[path[-1]]``, and a dict left empty by it (``_counters``)."""
    parents = [state]
    for key in path[:-1]:
        parents.append(parents[-1][key])
    del parents[-1][path[-1]]
    if len(parents) > 2 and not parents[-1] and path[-2] == "_counters":
        del parents[-2][path[-2]]
