"""A serving replica's model: the rows of every embedding table and the dense variables, one consistent version
at a time, and the last versions kept for a rollback. No gRPC.

The follower (follower.py) publishes a version per round of reads: every
table's changed rows (or a table read whole) and, when it read them, the
dense variables. `publish` makes the whole round visible at once: a lookup
sees all of it or none of it. Each version keeps what it overwrote (an undo
log: the rows before, and which ids had none), so `rollback(step)` can go
back to any of the last `keep` versions bit for bit; dense variables are kept
by reference (a round that did not read them shares the previous ones).
A rollback, or `hold`, freezes the replica: publish() is refused until
`resume`, and a round read before it is refused after it too (`freezes`: it
may hold part of a push made meanwhile). A rollback also counts in
`rewinds`: the follower then reads every table whole again (what the
rollback undid is read back from the shards).

Thread-safe: one change at a time (publish, rollback, hold, resume: `_writing`), and one lock for what
lookups see, which a publish takes only to write rows it has found and copied before.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Mapping, Sequence

import numpy as np
import torch

from ..errors import ServingVersionError, UnknownVariableError
from ..ps_server.row_storage import Keyed
from ..rows import owner
from .settings import KEEP_VERSIONS

__all__ = ["ModelView", "Replica", "TableBatch", "Version"]


@dataclasses.dataclass
class TableBatch:
    """One shard's changes of one table in a round: rows of `ids` (held[i]: the table holds it; False: dropped),
    or, with `whole`, every row the shard holds (rows of ids the shard owns that the replica has and these lack
    are dropped). `owner`: (shard, num_shards, partition) of the table's layout (torchps.rows.owner)."""

    dim: int
    dtype: torch.dtype
    ids: np.ndarray        # int64
    rows: torch.Tensor     # (len(ids), dim)
    held: np.ndarray       # bool
    whole: bool = False
    owner: tuple[int, int, str] = (0, 1, "modulo")
    num_embeddings: int = 0  # a fixed-size table's ids 0 .. n-1 (0: a dynamic table)


@dataclasses.dataclass(frozen=True)
class Version:
    version: int
    step: int
    published: float  # Unix time it became visible


class _Table:
    """One table's rows: an id index (row_storage.Keyed, as a shard's) over one contiguous tensor of values, so
    that a lookup is one find and one index_select (a shard's slabs cost a copy per slab touched)."""

    def __init__(self, dim: int, dtype: torch.dtype):
        self.dim, self.dtype = dim, dtype
        self.keys = Keyed()
        self.values = torch.empty(0, dim, dtype=dtype)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Each id's slot, -1 where the table holds none."""
        return self.keys.find(ids)

    def count(self) -> int:
        return self.keys.n

    def read(self, ids: np.ndarray, slots: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray]:
        """(rows, held) of `ids` (at `slots` if found already): zeros where the table holds none."""
        slots = self.find(ids) if slots is None else slots
        held = slots >= 0
        if held.all():
            return self.values.index_select(0, torch.from_numpy(slots)), held
        rows = torch.zeros(len(ids), self.dim, dtype=self.dtype)
        where = np.flatnonzero(held)
        if where.size:
            rows[torch.from_numpy(where)] = self.values.index_select(0, torch.from_numpy(slots[where]))
        return rows, held

    def write(self, ids: np.ndarray, rows: torch.Tensor, held: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Rows of `ids` set where `held`, removed where not (`slots`: found since the last write, if given)."""
        slots = self.keys.find(ids) if slots is None else slots.copy()
        keep = np.flatnonzero(held)
        new = keep[slots[keep] < 0]
        if new.size:
            slots[new] = self.keys.append(ids[new])
            self._reserve(self.keys.n)
        if keep.size:
            self.values.index_copy_(0, torch.from_numpy(slots[keep]), rows[torch.from_numpy(keep)])
        gone = slots[np.flatnonzero(~held & (slots >= 0))]
        if gone.size:
            src, dst = self.keys.remove(gone)
            if src.size:
                self.values[torch.from_numpy(dst)] = self.values.index_select(0, torch.from_numpy(src))

    def _reserve(self, n: int) -> None:
        if n > len(self.values):
            grown = torch.empty(max(n, len(self.values) * 3 // 2), self.dim, dtype=self.dtype)
            grown[:len(self.values)] = self.values
            self.values = grown

    def ids(self) -> np.ndarray:
        return self.keys.cols["ids"][:self.keys.n].copy()


class _FixedTable(_Table):
    """A fixed-size table's rows (ids 0 .. num_embeddings - 1): row i at slot i, so finding an id is reading
    one array (a dynamic table's hash probing costs a few numpy passes per probe)."""

    def __init__(self, dim: int, dtype: torch.dtype, num_embeddings: int):
        super().__init__(dim, dtype)
        self.slot_of = np.full(num_embeddings, -1, dtype=np.int64)  # i where row i is held, else -1
        self.values = torch.zeros(num_embeddings, dim, dtype=dtype)

    def find(self, ids: np.ndarray) -> np.ndarray:
        inside = (ids >= 0) & (ids < len(self.slot_of))
        if inside.all():
            return self.slot_of[ids]
        slots = np.full(len(ids), -1, dtype=np.int64)
        slots[inside] = self.slot_of[ids[inside]]
        return slots

    def count(self) -> int:
        return int(np.count_nonzero(self.slot_of >= 0))

    def write(self, ids: np.ndarray, rows: torch.Tensor, held: np.ndarray, slots: np.ndarray | None = None) -> None:
        keep = np.flatnonzero(held)
        if keep.size:
            self.values.index_copy_(0, torch.from_numpy(ids[keep]), rows[torch.from_numpy(keep)])
            self.slot_of[ids[keep]] = ids[keep]
        gone = ids[~held]
        if gone.size:
            self.values[torch.from_numpy(gone)] = 0
            self.slot_of[gone] = -1

    def ids(self) -> np.ndarray:
        return np.flatnonzero(self.slot_of >= 0).astype(np.int64)


def _table(batch: TableBatch) -> _Table:
    """A new table for a batch's rows: fixed-size (ids 0 .. n-1) if the batch says so, else dynamic."""
    if batch.num_embeddings:
        return _FixedTable(batch.dim, batch.dtype, batch.num_embeddings)
    return _Table(batch.dim, batch.dtype)


class ModelView:
    """A model as a guard (guard.py) reads it: the replica's current version, or that version with a round's
    changes laid over it (Replica.candidate), which no lookup sees. Reads copy; nothing here writes."""

    def __init__(self, replica: Replica, round_rows: Mapping[str, tuple[Keyed, torch.Tensor, np.ndarray]],
                 dense: Mapping[str, torch.Tensor] | None):
        self._replica, self._round, self._dense = replica, round_rows, dense

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), dim) rows of `ids` (a 1-D int64 tensor), zeros where the model holds none;
        UnknownVariableError for a table it does not hold."""
        keys = ids.numpy().astype(np.int64, copy=False)
        laid = self._round.get(table)
        if laid is None:
            return self._replica.lookup(table, keys)[1]
        index, rows, held = laid
        if table in self._replica.tables():
            out = self._replica.lookup(table, keys)[1]
        else:
            out = torch.zeros(len(keys), rows.shape[1], dtype=rows.dtype)
        at = index.find(keys)
        mine = np.flatnonzero(at >= 0)
        if mine.size:
            out[torch.from_numpy(mine)] = rows[torch.from_numpy(at[mine])]
            out[torch.from_numpy(mine[~held[at[mine]]])] = 0  # dropped in the round
        return out

    def dense(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """{name: tensor} of the dense variables (every one when `names` is None); UnknownVariableError naming
        those it does not hold."""
        if self._dense is None:
            return self._replica.dense(names)[1]
        missing = [n for n in names or () if n not in self._dense]
        if missing:
            raise UnknownVariableError(f"this model holds no dense variable {missing}")
        return {n: self._dense[n] for n in (names or sorted(self._dense))}


class Replica:
    """Versions of a model (see the module docstring); `keep`: the versions kept for rollback (>= 1)."""

    def __init__(self, keep: int = KEEP_VERSIONS):
        self.keep = max(1, keep)
        self._writing = threading.Lock()  # one change at a time (publish, rollback); taken before _lock
        self._lock = threading.Lock()     # what lookups see: held only to read, or to make a change visible
        self._tables: dict[str, _Table] = {}
        self._dense: dict[str, torch.Tensor] = {}
        self._versions: collections.deque[tuple[Version, list, dict]] = collections.deque()  # (v, undo, dense)
        self._current = Version(0, 0, 0.0)
        self.held = False
        self.rewinds = 0  # rollbacks so far: the follower reads every table whole after one
        self.freezes = 0  # holds and rollbacks so far: a round read before one must not be published after it

    # -- reads --------------------------------------------------------------------------------

    def lookup(self, table: str, ids: np.ndarray) -> tuple[Version, torch.Tensor, np.ndarray, int, torch.dtype]:
        """(version, rows, held, dim, dtype) of `ids` of `table` in the current version; UnknownVariableError
        for a table it does not hold."""
        with self._lock:
            found = self._tables.get(table)
            if found is None:
                raise UnknownVariableError(f"this replica holds no table {table!r} (it holds "
                                           f"{sorted(self._tables)})")
            rows, held = found.read(ids)
            return self._current, rows, held, found.dim, found.dtype

    def dense(self, names: list[str] | None = None) -> tuple[Version, dict[str, torch.Tensor]]:
        """(version, {name: tensor}) of the current version (the tensors are never written: share them);
        UnknownVariableError naming those it does not hold."""
        with self._lock:
            missing = [n for n in names or () if n not in self._dense]
            if missing:
                raise UnknownVariableError(f"this replica holds no dense variable {missing}")
            return self._current, {n: self._dense[n] for n in (names or sorted(self._dense))}

    def status(self) -> tuple[Version, list[Version], bool, int]:
        """(current, kept versions oldest first, held, rows over all tables)."""
        with self._lock:
            return (self._current, [v for v, _, _ in self._versions], self.held,
                    sum(t.count() for t in self._tables.values()))

    def tables(self) -> dict[str, np.ndarray]:
        """{table: its ids} now (copies)."""
        with self._lock:
            return {name: table.ids() for name, table in self._tables.items()}

    def current(self) -> Version:
        with self._lock:
            return self._current

    def view(self) -> ModelView:
        """The current version as a guard reads it (each read sees the version current at that read)."""
        return ModelView(self, {}, None)

    def candidate(self, batches: Sequence[tuple[str, TableBatch]], dense: Mapping[str, torch.Tensor] | None
                  ) -> ModelView:
        """The current version with a round's changes (publish()'s arguments) laid over it, visible only to the
        view's reader: what publish would make visible."""
        laid = {}
        for name, parts in self._by_table(batches).items():
            with self._lock:
                table = self._tables.get(name) or _table(parts[0])
                ids, rows, held = self._merged(table, parts)
            index = Keyed()
            index.append(ids)
            laid[name] = (index, rows, held)
        return ModelView(self, laid, dense)

    # -- writes -------------------------------------------------------------------------------

    def publish(self, step: int, batches: Sequence[tuple[str, TableBatch]],
                dense: Mapping[str, torch.Tensor] | None, freezes: int, now: float | None = None) -> Version:
        """Makes one round (its (table, batch) pairs) visible as the next version, reflecting training step
        `step`; `dense`: every dense variable after this round (None: unchanged); `freezes`: the replica's count
        of holds and rollbacks when the round began. ServingVersionError while held, or after a hold or a
        rollback since the round began (its reads may hold part of a push made while held, or follow what the
        rollback undid). Returns the new version. What lookups wait for is only
        the writing of the rows: the ids are found and the rows a rollback needs copied before."""
        with self._writing:
            self._check(freezes)
            planned = []
            for name, parts in self._by_table(batches).items():
                table = self._tables.get(name) or _table(parts[0])
                ids, rows, held = self._merged(table, parts)
                slots = table.find(ids)
                before, had = table.read(ids, slots)
                planned.append((name, table, ids, rows, held, slots, had, before[torch.from_numpy(had)]))
            with self._lock:
                self._check(freezes)
                for name, table, ids, rows, held, slots, _, _ in planned:
                    self._tables.setdefault(name, table).write(ids, rows, held, slots)
                if dense is not None:
                    self._dense = dict(dense)
                self._current = Version(self._current.version + 1, step, time.time() if now is None else now)
                undo = [(name, ids, had, before) for name, _, ids, _, _, _, had, before in planned]
                self._versions.append((self._current, undo, self._dense))
                while len(self._versions) > self.keep:
                    self._versions.popleft()
                return self._current

    def _check(self, freezes: int) -> None:
        if self.held:
            raise ServingVersionError("this replica is held on its version (hold or rollback): resume it first")
        if freezes != self.freezes:
            raise ServingVersionError("this replica was held or rolled back while the round was read: read again")

    @staticmethod
    def _by_table(batches: Sequence[tuple[str, TableBatch]]) -> dict[str, list[TableBatch]]:
        grouped: dict[str, list[TableBatch]] = {}
        for name, batch in batches:
            grouped.setdefault(name, []).append(batch)
        return grouped

    @staticmethod
    def _merged(table: _Table, parts: list[TableBatch]) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
        """One table's (ids, rows, held) of a round: every shard's batch, and for a shard's whole read the rows
        of its ids the replica holds and it no longer does (dropped)."""
        ids, rows, held = [], [], []
        mine = table.ids() if any(part.whole for part in parts) else None
        for part in parts:
            ids.append(part.ids), rows.append(part.rows), held.append(part.held)
            if part.whole:
                shard, num_shards, partition = part.owner
                stale = np.setdiff1d(mine[owner(mine, num_shards, partition) == shard], part.ids)
                ids.append(stale), held.append(np.zeros(len(stale), dtype=bool))
                rows.append(torch.zeros(len(stale), table.dim, dtype=table.dtype))
        return np.concatenate(ids), torch.cat(rows), np.concatenate(held)

    def hold(self) -> None:
        with self._writing, self._lock:
            self.held = True
            self.freezes += 1

    def resume(self) -> None:
        """Follows the stream again."""
        with self._writing, self._lock:
            self.held = False

    def rollback(self, step: int) -> Version:
        """Goes back to the newest kept version whose step is at most `step`, and holds there; returns it.
        ServingVersionError if every kept version is newer (nothing changes)."""
        with self._writing, self._lock:
            kept = [v for v, _, _ in self._versions]
            target = next((v for v in reversed(kept) if v.step <= step), None)
            if target is None:
                raise ServingVersionError(
                    f"no kept version is at step {step} or before: this replica keeps steps "
                    f"{[v.step for v in kept]} (ps-serve --keep-versions)")
            while self._versions[-1][0].version > target.version:
                _, undo, _ = self._versions.pop()
                for name, ids, had, before in reversed(undo):
                    table = self._tables[name]
                    rows = torch.zeros(len(ids), table.dim, dtype=table.dtype)
                    rows[torch.from_numpy(had)] = before
                    table.write(ids, rows, had)
            self._current, _, self._dense = self._versions[-1]
            self.held = True
            self.rewinds += 1
            self.freezes += 1
            return self._current
