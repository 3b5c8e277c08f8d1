"""Which rows of one shard's embedding table changed since an earlier moment: what a serving replica asks for
(ReadChanges). No gRPC, no lock of its own: its table holds it under the table's lock.

Every change of a row (created at admission, updated by a push, dropped by
eviction) is recorded as its id under the next sequence number `seq`. A
reader that saw the table up to `seq` asks for the ids changed since; the
log answers with the distinct ids of every record after it, or None when it
no longer holds them all (it keeps at most `limit` ids over all its records,
dropping the oldest first; a reset, a new state loaded, forgets everything
before it) and the reader must read the whole table again. `incarnation`, a
random name given when the log is made and at every reset, tells a reader
whose `seq` belongs to another table object (a shard restarted and replayed
its journal, a live re-layout) to read it whole too.
"""

from __future__ import annotations

import collections
import secrets

import numpy as np

__all__ = ["RowChanges", "DEFAULT_LIMIT"]

DEFAULT_LIMIT = 1 << 22  # ids kept over all records: 32 MiB of int64


class RowChanges:
    """The change log of one table (see the module docstring). Not thread-safe: its table's lock guards it."""

    def __init__(self, limit: int = DEFAULT_LIMIT):
        self.limit = limit
        self.seq = 0
        self.incarnation = secrets.token_hex(8)
        self._records: collections.deque[tuple[int, np.ndarray]] = collections.deque()  # (seq, ids) oldest first
        self._held = 0       # ids over all records
        self._floor = 0      # the seq the oldest record kept follows: since >= floor can be answered

    def record(self, ids: np.ndarray) -> None:
        """The rows of `ids` (int64) changed now. Records nothing for no ids."""
        if not len(ids):
            return
        self.seq += 1
        self._records.append((self.seq, np.array(ids, dtype=np.int64, copy=True)))
        self._held += len(ids)
        while self._held > self.limit and self._records:
            seq, dropped = self._records.popleft()
            self._held -= len(dropped)
            self._floor = seq

    def reset(self) -> None:
        """Forgets every record (the table's rows were replaced): every reader reads the table whole."""
        self._records.clear()
        self._held = 0
        self.seq += 1
        self._floor = self.seq
        self.incarnation = secrets.token_hex(8)

    def since(self, seq: int, incarnation: str) -> np.ndarray | None:
        """The distinct ids (ascending) changed after `seq` of `incarnation`; None if the log cannot say (another
        incarnation, a seq older than it keeps, or one it never reached)."""
        if incarnation != self.incarnation or not self._floor <= seq <= self.seq:
            return None
        parts = []
        for number, ids in reversed(self._records):
            if number <= seq:
                break
            parts.append(ids)
        return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)
