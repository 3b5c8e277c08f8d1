"""The apply gate: many updates at once, or one snapshot alone. No gRPC.

Every change to a shard's state (an async push, a sync step, a pending sum,
an optimizer change) runs under the gate shared; a snapshot (checkpoint,
journal compaction) takes it exclusively, so it sees each change whole or not
at all. A waiting snapshot stops new changes from entering, so it is never
starved. Neither side ever waits for a status, membership or heartbeat call.
"""

from __future__ import annotations

import contextlib
import threading

from . import locks

__all__ = ["ApplyGate"]


class ApplyGate:
    """A writer-preferring readers-writer lock (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._changes = 0
        self._snapshot = False
        self._snapshots_waiting = 0

    @locks.ranked("gate", "the apply gate")
    @contextlib.contextmanager
    def change(self):
        """Held while state changes; waits only while a snapshot is taken or waiting."""
        with self._cond:
            self._cond.wait_for(lambda: not self._snapshot and not self._snapshots_waiting)
            self._changes += 1
        try:
            yield
        finally:
            with self._cond:
                self._changes -= 1
                if not self._changes:
                    self._cond.notify_all()

    @locks.ranked("gate", "the apply gate")
    @contextlib.contextmanager
    def snapshot(self):
        """Held while state is copied: no change runs meanwhile."""
        with self._cond:
            self._snapshots_waiting += 1
            self._cond.wait_for(lambda: not self._snapshot and not self._changes)
            self._snapshots_waiting -= 1
            self._snapshot = True
        try:
            yield
        finally:
            with self._cond:
                self._snapshot = False
                self._cond.notify_all()
