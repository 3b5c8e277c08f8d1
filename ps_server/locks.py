"""The order in which a shard's threads take its locks, written once: LOCK_ORDER. No gRPC.

A thread holding a lock of one rank takes locks of later ranks only. An
owner's lock is a leaf: held inside that owner's own methods, which call no
other owner, so no thread holds two owners' locks at once, and none takes the
bookkeeping condition or the gate while holding one.

    gate         gate.ApplyGate: shared while variables, tables or the step change; alone
                 while a whole state is copied (a checkpoint, a journal compaction)
    ordering     recording.Recorder.ordering (with a journal): a change to variables or tables and
                 the queueing of its record, so the journal replays them in the order they happened
    bookkeeping  bookkeeping.Bookkeeping.cond: a decision that reads or changes several owners (a
                 push's admission, a lease and the quorum, catching up), and every wait; it also
                 guards the saves waiting for their step (snapshots.Saves)
    owner        one owner's lock, inside its methods: membership.Membership, ledger.PushLedger,
                 aggregation.PendingSteps, step_clock.StepClock, waits.WaitLimit,
                 layout.ShardLayout, store.VariableStore and tables.TableStore (with their variables' and
                 tables' locks), tokens.TokenFile (the token table, taken by the gRPC edge only)
    sums         aggregation.StepBuffer.lock: a push's gradients added to a sync step's sums
    journal      recording.Recorder's compaction lock, then journal.Journal's queue: a record is
                 queued (never written: the journal's thread writes)

No lock is held while a record is written to disk: a caller waits for its
record (Recorder.durable) holding none. The bookkeeping condition is held
for bookkeeping only: never while a gradient is applied or summed, a value
copied or a file written, so status, joins, heartbeats and leaves never wait
behind an apply or a save.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

__all__ = ["LOCK_ORDER", "guarded"]

LOCK_ORDER = ("gate", "ordering", "bookkeeping", "owner", "sums", "journal")
F = TypeVar("F", bound=Callable)


def guarded(method: F) -> F:
    """An owner's method that runs holding the owner's own lock (its `_lock`: an "owner" in LOCK_ORDER)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return call  # type: ignore[return-value]
