"""Which rows of one shard's embedding table changed since an earlier moment: what a serving replica asks for
(ReadChanges). No gRPC, no lock of its own: its table holds it under the table's lock.

Every change of a row (created at admission, updated by a push, dropped by
eviction) is recorded as its id under the next sequence number `seq`. A
reader that saw the table up to `seq` asks for the ids changed since; the
log answers with the distinct ids of every record after it. It keeps at most
`limit` ids over all its records, dropping the oldest first; for an older
`seq` it asks its table which rows it holds changed since (the table marks
each row with the seq of its last change, see RowMarks) and adds the rows
dropped since, which it keeps apart (again at most `limit` ids). When it
cannot say (drops older than it keeps, a seq of before a reset, another
incarnation) it answers None and the reader reads the whole table again.
`incarnation`, a random name given when the log is made and at every reset
(a new state loaded: a shard restarted and replayed its journal, a live
re-layout), tells a reader whose `seq` belongs to another table object.
"""

from __future__ import annotations

import collections
import secrets
from typing import Callable

import numpy as np

__all__ = ["RowChanges", "RowMarks", "DEFAULT_LIMIT", "MAX_UPDATES"]

DEFAULT_LIMIT = 1 << 22  # ids kept over all records: 32 MiB of int64
_COUNT_BITS = 20
MAX_UPDATES = (1 << _COUNT_BITS) - 1  # a row's update count stops here


class _Log:
    """(seq, ids) records, oldest first, at most `limit` ids over all; `floor`: the seq the oldest kept follows."""

    def __init__(self, limit: int, floor: int):
        self.limit, self.floor = limit, floor
        self.records: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self.held = 0

    def add(self, seq: int, ids: np.ndarray) -> None:
        self.records.append((seq, np.array(ids, dtype=np.int64, copy=True)))
        self.held += len(ids)
        while self.held > self.limit and self.records:
            self.floor, dropped = self.records.popleft()
            self.held -= len(dropped)

    def after(self, seq: int) -> list[np.ndarray]:
        parts = []
        for number, ids in reversed(self.records):
            if number <= seq:
                break
            parts.append(ids)
        return parts


class RowChanges:
    """The change log of one table (see the module docstring). Not thread-safe: its table's lock guards it."""

    def __init__(self, limit: int = DEFAULT_LIMIT):
        self.limit = limit
        self.seq = 0
        self.incarnation = secrets.token_hex(8)
        self._log, self._drops = _Log(limit, 0), _Log(limit, 0)

    def record(self, ids: np.ndarray, *, dropped: bool = False) -> int:
        """The rows of `ids` (int64) changed now (`dropped`: the table no longer holds them); returns the seq
        they changed at (no ids: none is taken, the current seq)."""
        if not len(ids):
            return self.seq
        self.seq += 1
        self._log.add(self.seq, ids)
        if dropped:
            self._drops.add(self.seq, ids)
        return self.seq

    def reset(self) -> None:
        """Forgets every record (the table's rows were replaced): every reader reads the table whole."""
        self.seq += 1
        self._log, self._drops = _Log(self.limit, self.seq), _Log(self.limit, self.seq)
        self.incarnation = secrets.token_hex(8)

    def since(self, seq: int, incarnation: str, changed_after: Callable[[int], np.ndarray]) -> np.ndarray | None:
        """The distinct ids (ascending) changed after `seq` of `incarnation`; None if it cannot say (see the
        module docstring). `changed_after(seq)`: the ids of the rows the table holds whose last change came
        after `seq`, asked only when the log no longer reaches back to it."""
        if incarnation != self.incarnation or not self._drops.floor <= seq <= self.seq:
            return None
        if seq >= self._log.floor:
            parts = self._log.after(seq)
        else:
            parts = [changed_after(seq), *self._drops.after(seq)]
        return np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)


class RowMarks:
    """Per-row marks packed in one int64 each: the seq of the row's last change (high bits) and how many
    updates it had (low _COUNT_BITS bits, stopping at MAX_UPDATES). Pure functions over numpy arrays."""

    @staticmethod
    def new(seq: int, updates: np.ndarray | int = 0) -> np.ndarray | np.int64:
        return (np.int64(seq) << _COUNT_BITS) | np.minimum(updates, MAX_UPDATES).astype(np.int64)

    @staticmethod
    def updated(marks: np.ndarray, seq: int) -> np.ndarray:
        """`marks` after one more update at `seq`."""
        return RowMarks.new(seq, (marks & MAX_UPDATES) + 1)

    @staticmethod
    def seqs(marks: np.ndarray) -> np.ndarray:
        return marks >> _COUNT_BITS

    @staticmethod
    def updates(marks: np.ndarray) -> np.ndarray:
        return marks & MAX_UPDATES
