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
from ._sync import ERROR, mismatch_message

# slots of the mismatch record: seen, the agreement vector, own step and check
_SEEN, _AGREED, _OWN_STEP, _OWN_CHECK = 0, 1, ERROR + 2, ERROR + 3


class Alarm:
    """Device-side record of the first collapse and the first rank mismatch since the last read.

    Attributes:
        collapse: 1-d float64 (float32 on MPS): ``update()`` calls after the first collapse (-1
            if none) and the scale the collapsing step used. (Not two 0-d tensors:
            ``torch.compile``'s AOT backends drop writes into 0-d float64 inputs.)
        mismatch: 1-d, same dtype: 1 if the ranks disagreed, that agreement vector
            (:func:`shardscale._sync.agree`), this rank's step count and check ordinal then.
    """

    def __init__(self, device: torch.device) -> None:
        dtype = math_dtype(device)
        self.collapse = torch.full((2,), -1.0, dtype=dtype, device=device)
        self.mismatch = torch.zeros(_OWN_CHECK + 1, dtype=dtype, device=device)

    def note_collapse(
        self, collapsed: torch.Tensor, steps: torch.Tensor, scale: torch.Tensor
    ) -> None:
        """Record ``steps`` (0-d: ``update()`` calls so far, this one included) and ``scale``
        if ``collapsed`` (0-d bool) and no collapse is recorded yet: 6 tensor operations."""
        first = collapsed & (self.collapse[0] < 0)
        record = torch.stack([steps.to(self.collapse.dtype), scale.to(self.collapse.dtype)])
        self.collapse.copy_(torch.where(first, record, self.collapse))

    def note_mismatch(
        self, bad: torch.Tensor, agreed: torch.Tensor, step: torch.Tensor, check: int
    ) -> None:
        """Record the agreement vector ``agreed`` if ``bad`` (0-d bool) and it is the first."""
        m = self.mismatch
        first = bad & (m[_SEEN] == 0)
        record = torch.cat(
            [
                m.new_ones(1),
                agreed.to(m.dtype),
                step.to(m.dtype).reshape(1),
                m.new_full((1,), check),
            ]
        )
        m.copy_(torch.where(first, record, m))

    def read(self, rank: int, scale_now: torch.Tensor) -> tuple[tuple[int, float] | None, float]:
        """Read the alarm and ``scale_now`` (one host read): ``(step, scale)`` of a recorded
        collapse (``step``: its 0-based index; then forgotten, so the next one is recorded) or
        None, and the current scale.

        Raises:
            RuntimeError: the ranks disagreed (another step or another optimizer), named.
        """
        values = torch.cat(
            [
                self.collapse,
                scale_now.to(self.mismatch.dtype).reshape(1),
                self.mismatch,
            ]
        ).tolist()
        step, scale, now, mismatch = values[0], values[1], values[2], values[3:]
        if mismatch[_SEEN]:
            own_step, own_check = int(mismatch[_OWN_STEP]), int(mismatch[_OWN_CHECK])
            raise RuntimeError(
                mismatch_message(mismatch[_AGREED:_OWN_STEP], own_step, own_check, rank)
            )
        if step < 0:
            return None, now
        self.collapse[0] = -1
        return (int(step) - 1, scale), now
