"""Exactly-once pushes: each worker incarnation's latest push number, and what that push did. No gRPC.

Clients number their pushes 1, 2, ... per incarnation and send one at a time,
so a shard needs only the latest number of each (worker, incarnation): a push
numbered at or below it is a retry (or a straggler of one) and is never
applied again. The record of a push being handled has no result yet; a retry
that arrives meanwhile waits for it. Records survive lease expiry and rejoins,
travel in checkpoints and the journal, and are dropped only when the
incarnation is retired (membership.py fences it off for good).

Thread-safe: its own lock (an "owner" in locks.LOCK_ORDER) guards the records
and every change to one (mark_*, answer); a PushRecord is read as it is.
"""

from __future__ import annotations

import dataclasses
import threading

from .locks import guarded
from .modes import PushResult

__all__ = ["PushRecord", "PushLedger"]


@dataclasses.dataclass
class PushRecord:
    """The latest push of one worker incarnation (changed only through its PushLedger)."""

    seq: int
    step: int                         # the step it was computed at; -1: restored, nothing more known
    stale: bool = False
    applied: bool = False             # its effect is in the shard's state (set under the apply gate)
    pending: bool = False             # sync: that effect is in step `step`'s pending sums, not yet applied
    result: PushResult | None = None  # the reply; None while the push is being handled


class PushLedger:
    """(worker, incarnation) -> its latest PushRecord, and how many repeated pushes were answered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple[str, int], PushRecord] = {}
        self._duplicates = 0

    @guarded
    def seen(self, worker: str, incarnation: int, seq: int) -> PushRecord | None:
        """The record that makes push `seq` a repeat (a push numbered `seq` or later was received), or None."""
        record = self._records.get((worker, incarnation))
        return record if record is not None and seq and record.seq >= seq else None

    @guarded
    def begin(self, worker: str, incarnation: int, seq: int, step: int) -> PushRecord | None:
        """Records push `seq` as being handled (None for seq 0: no dedup asked)."""
        if not seq:
            return None
        record = self._records[(worker, incarnation)] = PushRecord(seq, step)
        return record

    @guarded
    def mark_applied(self, record: PushRecord | None, *, pending: bool = False) -> None:
        """The push of `record` changed the shard's state (`pending`: a sync step's sums). None: no record."""
        if record is not None:
            record.applied = True
            record.pending = record.pending or pending

    @guarded
    def mark_stale(self, record: PushRecord | None) -> None:
        """The push of `record` was dropped as stale. None: no record."""
        if record is not None:
            record.stale = True

    @guarded
    def answer(self, record: PushRecord | None, result: PushResult | None) -> None:
        """Keeps the reply to the push of `record`, for its retries. None: no record."""
        if record is not None:
            record.result = result

    @staticmethod
    def settled(record: PushRecord) -> bool:
        """Whether the push of `record` applied its effect or has its reply (a retry need not wait)."""
        return record.applied or record.result is not None

    @guarded
    def abort(self, worker: str, incarnation: int, record: PushRecord | None) -> None:
        """Forgets a push that failed before it changed anything, so its retry is applied."""
        if record is not None and self._records.get((worker, incarnation)) is record:
            del self._records[(worker, incarnation)]

    @guarded
    def forget(self, worker: str, incarnation: int) -> None:
        """Drops a retired incarnation's record (membership refuses its calls from now on)."""
        self._records.pop((worker, incarnation), None)

    @guarded
    def count_duplicate(self) -> None:
        """Counts a repeated push that was answered without being applied again."""
        self._duplicates += 1

    @property
    @guarded
    def duplicates(self) -> int:
        return self._duplicates

    @guarded
    def reset(self) -> None:
        """Forgets every record (a new job); the count of duplicates stays."""
        self._records = {}

    @guarded
    def __len__(self) -> int:
        return len(self._records)

    @guarded
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

    @guarded
    def restore(self, entries: list[dict]) -> None:
        for entry in entries:
            result = entry["result"]
            self._records[(entry["worker"], entry["incarnation"])] = PushRecord(
                entry["seq"], entry["step"], entry["stale"], applied=True, pending=entry.get("pending", False),
                result=None if result is None else PushResult(**result))
