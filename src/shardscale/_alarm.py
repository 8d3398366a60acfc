"""The alarm: what the device notices during a step, for the host to read later.

A collapse of the scale (decided by :func:`shardscale._policy.next_state`) and ranks that
disagree (seen in the agreement all-reduce, :func:`shardscale._sync.agree`) are written into one
small tensor on the scale's device by tensor operations only, so the step path needs no host
read; the scaler reads it (one read of 10 floats) when a read costs nothing: after a step already
read an overflow, or every few updates while fused steps run.
"""

from __future__ import annotations

import torch

from ._policy import math_dtype
from ._sync import mismatch_message

# slots of the vector
_COLLAPSE_STEP, _COLLAPSE_SCALE, _MISMATCH, _AGREED, _OWN_STEP, _OWN_COUNT = 0, 1, 2, 3, 8, 9


class Alarm:
    """Device-side record of the first collapse and the first rank mismatch since the last read.

    Attributes:
        values: 1-d float64 (float32 on MPS) of length 10 on the scale's device: the step of a
            collapse (-1: none) and the scale then, 1 if the ranks disagreed, that agreement
            vector (5), this rank's step count and optimizer parameter count then.
    """

    def __init__(self, device: torch.device) -> None:
        self.values = torch.zeros(10, dtype=math_dtype(device), device=device)
        self.values[_COLLAPSE_STEP] = -1

    def note_collapse(
        self, collapsed: torch.Tensor, step: torch.Tensor, scale: torch.Tensor
    ) -> None:
        """Record ``(step, scale)`` if ``collapsed`` (0-d bool) and nothing is recorded yet."""
        v = self.values
        first = collapsed & (v[_COLLAPSE_STEP] < 0)
        v[:2] = torch.where(first, torch.stack([step.to(v.dtype), scale.to(v.dtype)]), v[:2])

    def note_mismatch(
        self, bad: torch.Tensor, agreed: torch.Tensor, step: torch.Tensor, count: int
    ) -> None:
        """Record the agreement vector ``agreed`` if ``bad`` (0-d bool) and it is the first."""
        v = self.values
        first = bad & (v[_MISMATCH] == 0)
        record = torch.cat(
            [
                v.new_ones(1),
                agreed.to(v.dtype),
                step.to(v.dtype).reshape(1),
                v.new_full((1,), count),
            ]
        )
        v[2:] = torch.where(first, record, v[2:])

    def read(self, rank: int) -> tuple[int, float] | None:
        """Read the alarm (one host read): ``(step, scale)`` of a recorded collapse (then
        forgotten, so the next one is recorded), else None.

        Raises:
            RuntimeError: the ranks disagreed (another step or another optimizer), named.
        """
        values = self.values.tolist()
        if values[_MISMATCH]:
            own_step, own_count = int(values[_OWN_STEP]), int(values[_OWN_COUNT])
            raise RuntimeError(
                mismatch_message(values[_AGREED:_OWN_STEP], own_step, own_count, rank)
            )
        if values[_COLLAPSE_STEP] < 0:
            return None
        self.values[_COLLAPSE_STEP] = -1
        return int(values[_COLLAPSE_STEP]), values[_COLLAPSE_SCALE]
