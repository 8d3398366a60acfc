"""The alarm: what the device notices during a step, for the host to read later.

A collapse of the scale (decided by :func:`shardscale._policy.next_state`) and ranks that
disagree (seen in the agreement all-reduce, :func:`shardscale._sync.agree`) are written into one
small tensor on the scale's device by tensor operations only, so the step path needs no host
read; the scaler reads it (one read of 10 floats) when a read costs nothing: after a step already
read an overflow, or every few updates while fused steps run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._policy import math_dtype
from ._sync import LENGTH, mismatch_message, mismatched

# slots of the mismatch record: the agreement vector, own step and check
_AGREED, _OWN_STEP, _OWN_CHECK = 0, LENGTH, LENGTH + 1


class Alarm:
    """Device-side record of the first collapse since the last read and of the last rank mismatch.

    Attributes:
        collapse: 1-d float64 (float32 where the device has no float64, as the counters):
            ``update()`` calls after the first collapse (-1 if none) and the scale the
            collapsing step used. (Not two 0-d tensors: ``torch.compile``'s AOT backends drop
            writes into 0-d float64 inputs.)
        mismatch: 1-d, same dtype: the last agreement vector that showed the ranks
            disagreeing (:func:`shardscale._sync.agree`; zeros, which agree, until then), this
            rank's step count and check ordinal then.
    """

    def __init__(self, device: torch.device) -> None:
        dtype = math_dtype(device)
        self.collapse = torch.full((2,), -1.0, dtype=dtype, device=device)
        self.mismatch = torch.zeros(_OWN_CHECK + 1, dtype=dtype, device=device)
        self._checks: dict[int, torch.Tensor] = {}  # each check ordinal as a 1-element tensor

    def note_collapse(
        self, collapsed: torch.Tensor | None, steps: torch.Tensor, scale: torch.Tensor
    ) -> None:
        """Record ``steps`` (0-d: ``update()`` calls so far, this one included) and ``scale``
        if ``collapsed`` (0-d bool; None: no collapse was possible) and no collapse is recorded
        yet: 5 tensor operations (both slots are < 0 until one is recorded)."""
        if collapsed is None:
            return
        c = self.collapse
        record = torch.stack([steps.to(c.dtype), scale.to(c.dtype)])
        torch.where(collapsed & (c < 0), record, c, out=c)

    def note_mismatch(
        self, bad: torch.Tensor, agreed: torch.Tensor, step: torch.Tensor, check: int
    ) -> None:
        """Record the agreement vector ``agreed`` with this rank's ``step`` (0-d, the counters'
        dtype) and ``check`` if ``bad`` (0-d bool): the last mismatch is kept (3 tensor
        operations)."""
        m = self._checks.get(check)
        if m is None:
            m = self._checks[check] = torch.full(
                (1,), check, dtype=self.mismatch.dtype, device=self.mismatch.device
            )
        record = torch.cat([agreed, step.reshape(1), m])
        torch.where(bad, record, self.mismatch, out=self.mismatch)

    def read(
        self, rank: int, scale_now: torch.Tensor, collapse: bool = True
    ) -> tuple[tuple[int, float] | None, float]:
        """Read the alarm and ``scale_now`` (one host read): ``(step, scale)`` of a recorded
        collapse (``step``: its 0-based index; then forgotten, so the next one is recorded) or
        None (always, and nothing forgotten, when not ``collapse``: a read for the mismatch
        only), and the current scale.

        Raises:
            RuntimeError: the ranks disagreed (another step, or another check ordinal), named.
        """
        values = torch.cat(
            [
                self.collapse,
                scale_now.to(self.mismatch.dtype).reshape(1),
                self.mismatch,
            ]
        ).tolist()
        step, scale, now, mismatch = values[0], values[1], values[2], values[3:]
        if mismatched(mismatch[_AGREED:_OWN_STEP]):
            own_step, own_check = int(mismatch[_OWN_STEP]), int(mismatch[_OWN_CHECK])
            raise RuntimeError(
                mismatch_message(mismatch[_AGREED:_OWN_STEP], own_step, own_check, rank)
            )
        if step < 0 or not collapse:
            return None, now
        self.collapse[0] = -1
        return (int(step) - 1, scale), now


#: update() calls between two reads of the alarm (a completed device-to-host copy) when steps
#: ran whose found-inf flag the host never read (fused optimizers).
POLL_EVERY = 16


class Schedule:
    """When the host reads the alarm: after a step read an overflow (the read is paid for
    already), when the scale may be below 1, every :data:`POLL_EVERY` updates while fused steps
    run (their flags are never read) or while the host's bounds of the scale keep the update
    off its plain path; in a compiled loop (``update()`` traced, reading nothing), every
    :data:`POLL_EVERY` steps from the steps' eager part, or sooner where the updates it did
    not see could have taken the scale below 1.

    Attributes:
        updates: ``update()`` calls since the last read.
        unread: fused steps ran since the last read.
        steps: steps since the last eager ``update()`` (a compiled loop's count).
        unseen: a compiled ``update()`` ran since the last eager one (set by a constant store
            in the graph: no guard, no recompile): the host's bounds of the scale miss updates.
    """

    def __init__(self) -> None:
        self.updates, self.unread, self.steps = 0, False, 0
        self.unseen = False

    def step(self, blind: bool = False, safe: Callable[[], float] | None = None) -> bool:
        """A step ran (``blind``: one whose flag the host does not read); returns whether a
        compiled loop's catch-up read is due (eager ``update()`` calls reset the count): after
        :data:`POLL_EVERY` steps, or, once a compiled ``update()`` ran, sooner where the next
        step's check could otherwise meet a scale below 1 unknown to the host: it follows an
        update per step counted since the last read, and one more; ``safe()`` updates cannot
        take the scale there (:meth:`shardscale._policy.HostBounds.safe_updates`)."""
        self.unread = self.unread or blind
        self.steps += 1
        close = self.unseen and safe is not None and self.steps + 1 > safe()
        if self.steps > POLL_EVERY or close:
            self.steps = 0
            return True
        return False

    def compiled_update(self) -> None:
        """A compiled ``update()`` ran (a constant store in its graph: no guard, no recompile)."""
        self.unseen = True

    def update_due(self, read_overflow: bool, below_one: bool, refresh: bool) -> bool:
        """An eager ``update()`` ran: whether to read the alarm now (``refresh``: the host's
        bounds of the scale would gain from an exact value)."""
        self.updates += 1
        self.steps, self.unseen = 0, False
        periodic = (self.unread or refresh) and self.updates >= POLL_EVERY
        return read_overflow or below_one or periodic

    def read(self) -> None:
        """The alarm was read."""
        self.updates, self.unread = 0, False
