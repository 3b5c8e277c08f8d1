"""Exactly-once pushes: each worker incarnation's latest push number, and what that push did. No gRPC.

Clients number their pushes 1, 2, ... per incarnation and send one at a time,
so a shard needs only the latest number of each (worker, incarnation): a push
numbered at or below it is a retry (or a straggler of one) and is never
applied again. The record of a push being handled has no result yet; a retry
that arrives meanwhile waits for it. Records survive lease expiry and rejoins,
travel in checkpoints and the journal, and are dropped only when the
incarnation is retired (membership.py fences it off for good).

The coordinator's lock guards every call here.
"""

from __future__ import annotations

import dataclasses

from .modes import PushResult

__all__ = ["PushRecord", "PushLedger"]


@dataclasses.dataclass
class PushRecord:
    """The latest push of one worker incarnation."""

    seq: int
    step: int                         # the step it was computed at; -1: restored, nothing more known
    stale: bool = False
    applied: bool = False             # its effect is in the shard's state (set under the apply gate)
    pending: bool = False             # sync: that effect is in step `step`'s pending sums, not yet applied
    result: PushResult | None = None  # the reply; None while the push is being handled


class PushLedger:
    """(worker, incarnation) -> its latest PushRecord."""

    def __init__(self) -> None:
        self._records: dict[tuple[str, int], PushRecord] = {}

    def seen(self, worker: str, incarnation: int, seq: int) -> PushRecord | None:
        """The record that makes push `seq` a repeat (a push numbered `seq` or later was received), or None."""
        record = self._records.get((worker, incarnation))
        return record if record is not None and seq and record.seq >= seq else None

    def begin(self, worker: str, incarnation: int, seq: int, step: int) -> PushRecord | None:
        """Records push `seq` as being handled (None for seq 0: no dedup asked)."""
        if not seq:
            return None
        record = self._records[(worker, incarnation)] = PushRecord(seq, step)
        return record

    def abort(self, worker: str, incarnation: int, record: PushRecord | None) -> None:
        """Forgets a push that failed before it changed anything, so its retry is applied."""
        if record is not None and self._records.get((worker, incarnation)) is record:
            del self._records[(worker, incarnation)]

    def forget(self, worker: str, incarnation: int) -> None:
        """Drops a retired incarnation's record (membership refuses its calls from now on)."""
        self._records.pop((worker, incarnation), None)

    def __len__(self) -> int:
        return len(self._records)

    def export(self, store_step: int, *, with_pending: bool) -> list[dict]:
        """Every record as a saved state at `store_step` knows it (see the module docstring); `with_pending`:
        that state includes the sync steps' pending sums. Take it under the apply gate."""
        out = []
        for (worker, incarnation), r in self._records.items():
            if r.stale or (r.applied and (not r.pending or with_pending or r.step < store_step)):
                entry = {"seq": r.seq, "step": r.step, "stale": r.stale, "pending": r.pending and with_pending,
                         "result": None if r.result is None else r.result.to_dict()}
            elif r.seq > 1:
                entry = {"seq": r.seq - 1, "step": -1, "stale": False, "result": None}
            else:
                continue
            out.append({"worker": worker, "incarnation": incarnation, **entry})
        return out

    def restore(self, entries: list[dict]) -> None:
        for entry in entries:
            result = entry["result"]
            self._records[(entry["worker"], entry["incarnation"])] = PushRecord(
                entry["seq"], entry["step"], entry["stale"], applied=True, pending=entry.get("pending", False),
                result=None if result is None else PushResult(**result))
