"""Sparse embedding tables: one shard's rows of a table and their lazy optimizer state (row_optimizers.py).

A table's rows are spread over its shards by id: "modulo" puts id on shard
id mod n (floor modulo: non-negative for negative ids), "hash" on shard
splitmix64(id) mod n, where splitmix64 is SplitMix64's output function of the
id read as uint64 (z = id + 0x9E3779B97F4A7C15; z = (z ^ z>>30) *
0xBF58476D1CE4E5B9; z = (z ^ z>>27) * 0x94D049BB133111EB; z ^ z>>31).
torchps/rows.py defines both (shard_of, re-exported here), for shards and clients alike.

* Fixed tables (num_embeddings=N) hold every owned id of [0, N) in one
  preallocated tensor, from construction on.
* Dynamic tables (num_embeddings=None) take any int64 id. A row is created at
  its id's min_count-th admitting lookup (min_count=1: the first); before
  that the lookup returns zeros and stores nothing but a counter.
  evict(step) drops rows not updated in more than max_age steps, then the
  least recently updated (ties: lowest id) above capacity; counters age and
  are capped alike. Rows live in slabs (each new one max(1024 rows, an
  eighth of those allocated; row_storage.py); eviction moves the last rows into the holes and
  frees emptied slabs), ids in an open-addressing index of int32 slots
  (docs/guide/embeddings.md says what a row costs).

Every row of either kind carries its RowMarks (row_changes.py): the seq of
its last change and its update count, what changes() answers a serving
replica from (a cursor older than the change log: the rows marked since;
min_updates: rows updated fewer times are sent as not held).

Every row, wherever and whenever created, starts as initial_rows(seed, id):
a counter-based SplitMix64 stream, N(0, init_scale^2) (nn.Embedding's N(0, 1)
by default) or U(-init_scale, init_scale), so all shards and restarts agree.
apply() is one optimizer step of the shard's part of the table: Adagrad's
lr_decay and SparseAdam's bias corrections count steps per table as torch
does, so a client matching torch.optim on a whole table calls apply() on every
shard at every training step, with no ids where a shard has none.
state_dict() / load_state_dict() checkpoint a shard; relayout() builds shard
i of n from all shards' states of another layout.

Thread safety: each table has one lock, held for the whole of every public
method, so lookups, applies, evictions and checkpoints of a table run one at
a time and each sees the others whole; returned tensors are copies. A call
that raises has changed nothing. No gRPC here.
"""

from __future__ import annotations

import math
import threading
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from ..errors import InvalidArgumentError, LayoutChangedError, NonFiniteGradientError, TensorMismatchError
from ..rows import GOLDEN as _GOLDEN, PARTITIONS, owner as _owner, shard_of, splitmix64 as _splitmix64
from .row_changes import MAX_UPDATES, RowChanges, RowMarks
from .row_optimizers import RowOptimizer, coalesce
from .row_storage import MIN_SLAB as _MIN_SLAB, Keyed as _Keyed, Slabs as _Slabs, ids_array as _ids_array

__all__ = ["EmbeddingTable", "shard_of", "initial_rows", "relayout", "relayout_head", "rows_for", "check_read", "PARTITIONS", "INITS"]

INITS = ("normal", "uniform")
STATE_FORMAT = 1
_INIT_CHUNK = 1 << 14  # rows initialized at once (bounds the generator's temporaries)
_STRUCTURAL = ("dim", "num_embeddings", "shard_index", "num_shards", "partition", "optimizer", "init", "init_scale",
               "seed", "dtype")


def initial_rows(ids: np.ndarray, dim: int, *, seed: int = 0, init: str = "normal", init_scale: float = 1.0,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(len(ids), dim) rows, each a function of (seed, id) only: element j of id's row comes from SplitMix64
    seeded with splitmix64(id ^ splitmix64(seed)); Box-Muller over two draws for "normal"."""
    ids = np.asarray(ids, dtype=np.int64).view(np.uint64)
    out = torch.empty(len(ids), dim, dtype=dtype)
    draws = 2 * dim if init == "normal" else dim
    with np.errstate(over="ignore"):
        counters = np.arange(draws, dtype=np.uint64) * _GOLDEN
        key = _splitmix64(np.array([seed % (1 << 64)], dtype=np.uint64))
        for start in range(0, len(ids), _INIT_CHUNK):
            base = _splitmix64(ids[start:start + _INIT_CHUNK] ^ key)
            bits = (_splitmix64(base[:, None] + counters[None, :]) >> np.uint64(11)).astype(np.float64)
            if init == "normal":
                u1, u2 = (bits[:, 0::2] + 1.0) * 2.0 ** -53, bits[:, 1::2] * 2.0 ** -53
                rows = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2) * init_scale
            else:
                rows = (bits * 2.0 ** -52 - 1.0) * init_scale
            out[start:start + len(base)] = torch.from_numpy(rows)
    return out


def _check_config(c: Mapping) -> None:
    def whole(value, least):
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    problems = [name for name, ok in [
        ("dim", whole(c["dim"], 1)),
        ("num_embeddings", c["num_embeddings"] is None or whole(c["num_embeddings"], 1)),
        ("num_shards", whole(c["num_shards"], 1)),
        ("shard_index", whole(c["shard_index"], 0) and c["shard_index"] < c["num_shards"]),
        ("partition", c["partition"] in PARTITIONS),
        ("init", c["init"] in INITS),
        ("init_scale", isinstance(c["init_scale"], (int, float)) and math.isfinite(c["init_scale"])
         and c["init_scale"] >= 0),
        ("seed", whole(c["seed"], 0)),
        ("dtype", isinstance(getattr(torch, c["dtype"], None), torch.dtype) and getattr(torch, c["dtype"])
         .is_floating_point),
        ("min_count", whole(c["min_count"], 1)),
        ("max_age", c["max_age"] is None or whole(c["max_age"], 0)),
        ("capacity", c["capacity"] is None or whole(c["capacity"], 1)),
        ("fixed-size tables take no min_count, max_age or capacity", c["num_embeddings"] is None
         or (c["min_count"], c["max_age"], c["capacity"]) == (1, None, None)),
    ] if not ok]
    if problems:
        raise InvalidArgumentError(f"bad embedding table settings {problems}: {dict(c)}")


class EmbeddingTable:
    """One shard's part of an embedding table (see the module docstring). Raises InvalidArgumentError for bad
    settings and OptimizerSpecError for a bad optimizer."""

    storage = "ram"  # where its rows live (ssd_tables.SsdTable: "ssd")

    def __init__(self, dim: int, *, num_embeddings: int | None = None, shard_index: int = 0, num_shards: int = 1,
                 partition: str = "modulo", optimizer: str = "sgd", hyperparams: Mapping[str, float] | None = None,
                 init: str = "normal", init_scale: float = 1.0, seed: int = 0, dtype: torch.dtype = torch.float32,
                 min_count: int = 1, max_age: int | None = None, capacity: int | None = None):
        dtype_name = str(dtype).removeprefix("torch.")
        self._config = dict(dim=dim, num_embeddings=num_embeddings, shard_index=shard_index, num_shards=num_shards,
                            partition=partition, init=init, init_scale=init_scale, seed=seed, dtype=dtype_name,
                            min_count=min_count, max_age=max_age, capacity=capacity)
        _check_config(self._config)
        self.optimizer = RowOptimizer(optimizer, hyperparams)
        self.dim, self.dtype, self.fixed = dim, getattr(torch, dtype_name), num_embeddings is not None
        self._spec = self.optimizer.state_spec(dim)
        self._lock = threading.Lock()
        self._changes = RowChanges()  # rows created, updated or dropped: what a serving replica reads
        self._replaced = False  # closed: a read in parts stops
        self._step = 0
        self._events = {"admitted": 0, "evicted_by_age": 0, "evicted_by_capacity": 0}
        self._owned = None  # fixed "hash" tables: the owned ids, sorted (slot = position)
        if self.fixed:
            owned = np.arange(shard_index, num_embeddings, num_shards, dtype=np.int64)
            if partition == "hash":
                owned = self._owned = _hash_owned(num_embeddings, shard_index, num_shards)
            self._slabs = self._new_slabs(len(owned))
            self._write_new(np.arange(len(owned)), owned)
            self._marks = np.zeros(len(owned), dtype=np.int64)  # RowMarks by slot
        else:
            self._slabs = self._new_slabs(0)
            self._rows = _Keyed(updated=np.int64, marks=np.int64)
            self._pending = _Keyed(counts=np.int32, seen=np.int64)
            self._pending_dead = 0  # pending records of ids admitted since (count -1), dropped in bulk

    # -- settings -------------------------------------------------------------------------------

    @property
    def admits(self) -> bool:
        """Whether an admitting lookup may count ids and create rows (a dynamic table)."""
        return not self.fixed

    def config(self) -> dict:
        """The constructor's arguments (dtype by name, the optimizer's current hyperparameters): JSON-able."""
        return {**self._config, "optimizer": self.optimizer.name, "hyperparams": dict(self.optimizer.hyperparams)}

    @property
    def row_bytes(self) -> int:
        """Bytes of one row and its optimizer state."""
        return (self.dim + sum(w for w, _ in self._spec.values())) * self.dtype.itemsize

    _least = _MIN_SLAB  # rows of the smallest slab and spare room of the id arrays (a cache's: fewer)
    _whole = False      # rows in one slab grown by a copy (a bounded cache's)

    def _new_slabs(self, rows: int) -> _Slabs:
        slabs = _Slabs({"values": self.dim, **{k: w for k, (w, _) in self._spec.items()}}, self.dtype,
                       least=self._least, whole=self._whole)
        slabs.reserve(rows, exact=self.fixed)
        return slabs

    def _write_new(self, slots: np.ndarray, ids: np.ndarray) -> None:
        for start in range(0, len(ids), _INIT_CHUNK):
            part = slots[start:start + _INIT_CHUNK]
            c = self._config
            self._slabs.scatter("values", part, initial_rows(ids[start:start + _INIT_CHUNK], self.dim, seed=c["seed"],
                                                              init=c["init"], init_scale=c["init_scale"],
                                                              dtype=self.dtype))
            for key, (width, value) in self._spec.items():
                self._slabs.scatter(key, part, torch.full((len(part), width), value, dtype=self.dtype))

    # -- ids ------------------------------------------------------------------------------------

    def check_ids(self, ids: torch.Tensor, *, unique: bool) -> None:
        """Raises InvalidArgumentError unless `ids` is a 1-D int64 tensor of ids of this shard (in range for a
        fixed-size table; distinct with `unique`), as lookup() and apply() require. Changes nothing."""
        with self._lock:
            self._checked_ids(ids, unique)

    def _checked_ids(self, ids, unique: bool) -> np.ndarray:
        out = _ids_array(ids)
        if unique and len(np.unique(out)) != len(out):
            raise InvalidArgumentError("lookup ids must be unique")
        self._check_owned(out)
        return out

    def _check_owned(self, ids: np.ndarray) -> None:
        c = self._config
        if self.fixed:
            bad = ids[(ids < 0) | (ids >= c["num_embeddings"])]
            if bad.size:
                raise InvalidArgumentError(f"ids must be in [0, {c['num_embeddings']}); got {bad[:5].tolist()}")
        bad = ids[_owner(ids, c["num_shards"], c["partition"]) != c["shard_index"]]
        if bad.size:
            raise InvalidArgumentError(f"ids {bad[:5].tolist()} are not on shard {c['shard_index']} of "
                                       f"{c['num_shards']} ({c['partition']} partitioning)")

    def _find(self, ids: np.ndarray) -> np.ndarray:
        if not self.fixed:
            return self._rows.find(ids)
        if self._owned is not None:
            return np.searchsorted(self._owned, ids)
        return ids // self._config["num_shards"]

    # -- lookups and updates --------------------------------------------------------------------

    def lookup(self, ids: torch.Tensor, *, admit: bool = True) -> torch.Tensor:
        """(len(ids), dim) copies of the rows of `ids` (unique, owned by this shard). In a dynamic table, with
        admit, an absent id counts one occurrence and its row is created at the min_count-th; absent ids get
        zeros. Raises InvalidArgumentError for ids that are not 1-D int64, unique and this shard's."""
        with self._lock:
            return self._lookup(self._checked_ids(ids, unique=True), admit)

    def _lookup(self, ids: np.ndarray, admit: bool) -> torch.Tensor:
        """lookup() of checked ids, under the table's lock."""
        slots = self._find(ids)
        missing = np.flatnonzero(slots < 0)
        if admit and missing.size:
            new = missing[self._count(ids[missing])]
            slots[new] = self._create(ids[new])
        present = np.flatnonzero(slots >= 0)
        if present.size == len(ids):
            return self._slabs.gather("values", slots)
        out = torch.zeros(len(ids), self.dim, dtype=self.dtype)
        out[torch.from_numpy(present)] = self._slabs.gather("values", slots[present])
        return out

    def changes(self, seq: int, incarnation: str, min_updates: int = 0
                ) -> tuple[str, int, bool, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What changed since `seq` of `incarnation` (row_changes.py), read at one moment: (incarnation, seq now,
        whole, ids, rows, held). `whole`: the log could not say, so `ids` is every row the table holds now
        (ascending); else the distinct ids changed since. `rows`: their values (copies; zeros where not held);
        `held`: a bool per id, False for a row dropped since (evicted) or, with `min_updates`, one updated
        fewer times than that (its update that reaches it is a change: it comes then). Raises
        InvalidArgumentError for a `min_updates` outside [0, MAX_UPDATES]."""
        check_read(min_updates)
        with self._lock:
            ids = self._changes.since(seq, incarnation, self._changed_after)
            whole = ids is None
            if whole:
                ids = self._stored()[0]
            return (self._changes.incarnation, self._changes.seq, whole, torch.from_numpy(ids),
                    *self._rows_of(ids, min_updates))

    def read_changes(self, seq: int, incarnation: str, min_updates: int = 0, max_rows: int = 1 << 16
                     ) -> Iterator[tuple[str, int, bool, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """changes()' answer in parts of at most `max_rows` rows, at least one, each (incarnation, seq, whole,
        ids, rows, held) with the first part's incarnation and seq: the ids are taken at once, each part's rows
        under the table's lock as it is read (a row may be newer than that seq, never older; one dropped
        meanwhile comes as not held), so only a part's rows are ever copied. LayoutChangedError if the table
        was replaced (a restore or a re-layout) between two parts: read again. Raises as changes() does."""
        check_read(min_updates, max_rows)
        with self._lock:
            ids = self._changes.since(seq, incarnation, self._changed_after)
            at, whole = (self._changes.incarnation, self._changes.seq), ids is None
            if whole:
                ids = self._stored()[0].copy()
        for start in range(0, max(1, len(ids)), max_rows):
            part = ids[start:start + max_rows]
            with self._lock:
                if self._replaced or self._changes.incarnation != at[0]:
                    raise LayoutChangedError("an embedding table was replaced (a restore or a re-layout) while it "
                                             "was read; read it again")
                rows = self._rows_of(part, min_updates)
            yield (*at, whole, torch.from_numpy(part), *rows)

    def _rows_of(self, ids: np.ndarray, min_updates: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values (copies; zeros where not held), held) of `ids`, as changes() answers them. Under the lock."""
        slots = self._find(ids)
        if min_updates:
            found = slots >= 0
            slots = slots.copy()
            slots[found] = np.where(RowMarks.updates(self._marked()[slots[found]]) >= min_updates, slots[found], -1)
        values = torch.zeros(len(ids), self.dim, dtype=self.dtype)
        present = np.flatnonzero(slots >= 0)
        if present.size:
            values[torch.from_numpy(present)] = self._slabs.gather("values", slots[present])
        return values, torch.from_numpy(slots >= 0)

    def _marked(self) -> np.ndarray:
        """Every slot's RowMarks (the array itself)."""
        return self._marks if self.fixed else self._rows.cols["marks"]

    def _changed_after(self, seq: int) -> np.ndarray:
        """The ids of the rows whose last change came after `seq` (row_changes.RowChanges.since)."""
        ids, slots = self._stored()
        return ids[RowMarks.seqs(self._marked()[slots]) > seq]

    def _count(self, ids: np.ndarray) -> np.ndarray:
        """Counts one occurrence of each (absent) id; True where it reaches min_count (its record is retired)."""
        if self._config["min_count"] <= 1:
            return np.ones(len(ids), dtype=bool)
        pending = self._pending
        slots = pending.find(ids)
        known = slots[slots >= 0]
        old = pending.cols["counts"][known]
        self._pending_dead -= int(np.count_nonzero(old < 0))
        pending.cols["counts"][known] = np.maximum(old, 0) + 1
        pending.cols["seen"][known] = self._step
        fresh = np.flatnonzero(slots < 0)
        slots[fresh] = pending.append(ids[fresh], counts=1, seen=self._step)
        counts = pending.cols["counts"]  # after append: it may have moved
        reached = counts[slots] >= self._config["min_count"]
        counts[slots[reached]] = -1
        self._pending_dead += int(np.count_nonzero(reached))
        if self._pending_dead > max(_MIN_SLAB, pending.n // 2):
            pending.remove(np.flatnonzero(counts[:pending.n] < 0))
            self._pending_dead = 0
        return reached

    def _create(self, ids: np.ndarray) -> np.ndarray:
        self._slabs.reserve(self._rows.n + len(ids))
        seq = self._changes.record(ids)
        slots = self._rows.append(ids, updated=self._step, marks=RowMarks.new(seq))
        self._write_new(slots, ids)
        self._events["admitted"] += len(ids)
        return slots

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, step: int, *, count_step: bool = True) -> int:
        """One optimizer step at training step `step` with grads[i] the gradient of row ids[i] (repeated ids are
        summed first); returns the number of rows updated. Absent ids of a dynamic table are skipped (the step
        still counts). `count_step` False: the rows are updated as by the step counted last, counting none
        (rows sent again after a live re-layout). Raises InvalidArgumentError (bad ids or step), TensorMismatchError (grads not
        (len(ids), dim) of the table's dtype) or NonFiniteGradientError."""
        with self._lock:
            step = self._checked_step(step)
            if not isinstance(grads, torch.Tensor) or grads.dtype != self.dtype or grads.dim() != 2 \
                    or grads.shape[1] != self.dim:
                raise TensorMismatchError(f"gradients must be (len(ids), {self.dim}) {self.dtype}; got "
                                          f"{getattr(grads, 'dtype', type(grads))} "
                                          f"{tuple(getattr(grads, 'shape', ()))}")
            ids, summed = coalesce(torch.from_numpy(self._checked_ids(ids, unique=False)), grads.detach().cpu())
            if not torch.isfinite(summed).all():
                raise NonFiniteGradientError("embedding gradients hold NaN or Inf")
            return self._apply(ids.numpy(), summed, step, count_step)

    def _apply(self, ids: np.ndarray, summed: torch.Tensor, step: int, count_step: bool) -> int:
        """apply() of checked, distinct ids and their summed gradients, under the table's lock."""
        slots = self._find(ids)
        present = np.flatnonzero(slots >= 0)
        seq = self._changes.record(ids[present])
        if present.size < len(slots):
            slots, summed = slots[present], summed[torch.from_numpy(present)]
        marks = self._marked()
        marks[slots] = RowMarks.updated(marks[slots], seq)
        self.optimizer.step([(slab["values"], {k: slab[k] for k in self._spec}, rows, summed[positions])
                             for slab, rows, positions in self._slabs.groups(slots)], count=count_step)
        if not self.fixed:
            self._rows.cols["updated"][slots] = step
        self._step = max(self._step, step)
        return len(slots)

    @staticmethod
    def _checked_step(step) -> int:
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative integer, got {step!r}")
        return int(step)

    # -- eviction and accounting ----------------------------------------------------------------

    def evict(self, step: int) -> dict[str, int]:
        """Drops rows (and occurrence counters) older than max_age steps at `step`, then the least recently
        updated above capacity; returns {"by_age": n, "by_capacity": n} rows dropped (fixed tables: none)."""
        with self._lock:
            step = self._checked_step(step)
            if self.fixed:
                self._step = max(self._step, step)
                return {"by_age": 0, "by_capacity": 0}
            by_age, by_capacity = self._evict_rows(step)  # first: on SSD it may raise (a store that fails)
            self._step = max(self._step, step)
            retired = np.flatnonzero(self._pending.cols["counts"][:self._pending.n] < 0)
            self._pending_dead -= len(retired)
            self._pending.remove(np.concatenate([retired, *self._stale(self._pending, "seen", step, retired)]))
            self._events["evicted_by_age"] += by_age
            self._events["evicted_by_capacity"] += by_capacity
            return {"by_age": by_age, "by_capacity": by_capacity}

    def _evict_rows(self, step: int) -> tuple[int, int]:
        """evict()'s rows (a dynamic table's, under its lock): drops them, returns (by age, by capacity)."""
        by_age, by_capacity = self._stale(self._rows, "updated", step)
        gone = np.concatenate([by_age, by_capacity])
        if gone.size:
            self._changes.record(self._rows.cols["ids"][gone], dropped=True)
            self._drop_cached(gone)
        return len(by_age), len(by_capacity)

    def _drop_cached(self, slots: np.ndarray, keep: int | None = None) -> None:
        """Removes the rows at `slots` of _rows, moving the last rows' values into their places; the slabs
        keep room for `keep` rows (default: those left)."""
        src, dst = self._rows.remove(slots)
        for key in self._slabs.columns:
            self._slabs.scatter(key, dst, self._slabs.gather(key, src))
        self._slabs.release(self._rows.n if keep is None else keep)

    def _stale(self, records: _Keyed, key: str, step: int, skip: np.ndarray = np.empty(0, dtype=np.int64)):
        """(slots older than max_age, then the oldest beyond capacity), neither in `skip`."""
        c = self._config
        when, ids = records.cols[key][:records.n], records.cols["ids"][:records.n]
        alive = np.ones(records.n, dtype=bool)
        alive[skip] = False
        old = np.flatnonzero(alive & (step - when > c["max_age"])) if c["max_age"] is not None else skip[:0]
        alive[old] = False
        rest = np.flatnonzero(alive)
        if c["capacity"] is None or len(rest) <= c["capacity"]:
            return old, skip[:0]
        return old, rest[np.lexsort((ids[rest], when[rest]))[:len(rest) - c["capacity"]]]

    def nbytes(self) -> int:
        """Bytes this shard's part of the table holds: rows, optimizer state, ids, index, counters."""
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        total = self._slabs.nbytes + (self._owned.nbytes if self._owned is not None else 0)
        return total + self._marks.nbytes if self.fixed else total + self._rows.nbytes + self._pending.nbytes

    def counters(self) -> dict[str, int]:
        """rows, pending (ids counted, not admitted), admitted, evicted_by_age, evicted_by_capacity, evicted,
        bytes, row_bytes (one row and its state), optimizer_steps."""
        with self._lock:
            rows = self._slabs.capacity if self.fixed else self._rows.n
            pending = 0 if self.fixed else self._pending.n - self._pending_dead
            return {"rows": rows, "pending": pending, **self._events,
                    "evicted": self._events["evicted_by_age"] + self._events["evicted_by_capacity"],
                    "bytes": self._nbytes(), "row_bytes": self.row_bytes, "optimizer_steps": self.optimizer.steps}

    # -- checkpoints ----------------------------------------------------------------------------

    def _stored(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids in ascending order, their slots)."""
        if self.fixed:
            c = self._config
            ids = self._owned if self._owned is not None else np.arange(c["shard_index"], c["num_embeddings"],
                                                                         c["num_shards"], dtype=np.int64)
            return ids.copy(), np.arange(len(ids))
        order = np.argsort(self._rows.cols["ids"][:self._rows.n], kind="stable")
        return self._rows.cols["ids"][order], order

    def state_dict(self) -> dict:
        """A copy of the shard's table: config, optimizer steps, the table's step, event counters, rows by
        ascending id ("ids", "values", "state" {name: (rows, width)}), each row's "update_counts", for
        dynamic tables "last_update" and the occurrence counters ("pending": ids, counts, last_seen), and the
        change log's cursor at this copy ("changes": incarnation, seq: a reader holding these rows reads what
        changed since from there)."""
        with self._lock:
            ids, slots = self._stored()
            out = {"format": STATE_FORMAT, "config": self.config(), "optimizer_steps": self.optimizer.steps,
                   "step": self._step, "events": dict(self._events), "ids": torch.from_numpy(ids),
                   "values": self._slabs.gather("values", slots),
                   "state": {key: self._slabs.gather(key, slots) for key in self._spec},
                   "update_counts": torch.from_numpy(RowMarks.updates(self._marked()[slots])),
                   "changes": {"incarnation": self._changes.incarnation, "seq": self._changes.seq}}
            if not self.fixed:
                out["last_update"] = torch.from_numpy(self._rows.cols["updated"][slots])
                out["pending"] = self._pending_state()
            return out

    def _pending_state(self) -> dict[str, torch.Tensor]:
        """A dynamic table's occurrence counters by ascending id (state_dict's "pending")."""
        p = self._pending
        live = np.flatnonzero(p.cols["counts"][:p.n] > 0)
        live = live[np.argsort(p.cols["ids"][live], kind="stable")]
        return {"ids": torch.from_numpy(p.cols["ids"][live]),
                "counts": torch.from_numpy(p.cols["counts"][live].astype(np.int64)),
                "last_seen": torch.from_numpy(p.cols["seen"][live])}

    def close(self) -> None:
        """Lets go of what the table holds outside memory (a RAM table: nothing but a read in parts, which
        fails at its next part). Call once it is replaced."""
        with self._lock:
            self._replaced = True

    @classmethod
    def from_state_dict(cls, state: Mapping) -> EmbeddingTable:
        """A table built from the config in `state`, holding its rows."""
        config = {**state["config"], "dtype": getattr(torch, state["config"]["dtype"])}
        table = cls(config.pop("dim"), **config)
        table.load_state_dict(state)
        return table

    def load_state_dict(self, state: Mapping) -> None:
        """Replaces the table's rows, optimizer state and counters with `state`'s (from state_dict() or
        relayout()). The config's layout keys must equal this table's; hyperparameters come from `state`,
        min_count, max_age and capacity stay this table's. Raises InvalidArgumentError for a state that does
        not fit (rows not this shard's, missing or misshapen tensors), OptimizerSpecError for bad hyperparameters.
        A state without update counts (an older torchps's) counts every row's updates as MAX_UPDATES."""
        with self._lock:
            optimizer, ids, tensors, counters, step, events = self._parsed(state)
            slabs = self._new_slabs(len(ids))
            if self.fixed:
                slots = self._find(ids)
                marks = np.zeros(len(ids), dtype=np.int64)
            else:
                rows, pending = _Keyed(updated=np.int64, marks=np.int64), _Keyed(counts=np.int32, seen=np.int64)
                slots = rows.append(ids, updated=counters["last_update"])
                marks = rows.cols["marks"]
                pending.append(counters["pending ids"], counts=counters["pending counts"],
                               seen=counters["pending last_seen"])
            for key, tensor in tensors.items():
                slabs.scatter(key, slots, tensor.detach().cpu())
            self._changes.reset()
            marks[slots] = RowMarks.new(self._changes.seq, counters.get("update_counts", MAX_UPDATES))
            self._slabs, self.optimizer, self._step, self._events = slabs, optimizer, step, events
            if self.fixed:
                self._marks = marks
            else:
                self._rows, self._pending, self._pending_dead = rows, pending, 0

    def _parsed_head(self, state: Mapping) -> tuple[RowOptimizer, int, dict[str, int]]:
        """(optimizer, step, events) of a state of this table's format and layout; InvalidArgumentError if not."""
        try:
            config = state["config"]
            different = [k for k in _STRUCTURAL if config[k] != self.config()[k]]
            if state["format"] != STATE_FORMAT or different:
                raise InvalidArgumentError(f"table state of format {state['format']} differs in {different}")
            optimizer = RowOptimizer(config["optimizer"], config["hyperparams"], int(state["optimizer_steps"]))
            return optimizer, int(state["step"]), {k: int(state["events"][k]) for k in self._events}
        except InvalidArgumentError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"not an embedding table state: missing or bad {exc}") from None

    def _parsed(self, state: Mapping):
        """load_state_dict's checks: (optimizer, ids, row tensors, counter arrays, step, events)."""
        optimizer, step, events = self._parsed_head(state)
        try:
            ids = _ids_array(state["ids"])
            tensors = {"values": state["values"], **{k: state["state"][k] for k in self._spec}}
            counters = {} if self.fixed else {"last_update": state["last_update"],
                                              **{f"pending {k}": state["pending"][k]
                                                 for k in ("ids", "counts", "last_seen")}}
            if state.get("update_counts") is not None:
                counters["update_counts"] = state["update_counts"]
        except InvalidArgumentError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"not an embedding table state: missing or bad {exc}") from None
        pending = counters.get("pending ids")
        lengths = {"last_update": len(ids), "update_counts": len(ids)}
        if isinstance(pending, torch.Tensor) and pending.dim() == 1:
            lengths.update({f"pending {k}": len(pending) for k in ("ids", "counts", "last_seen")})
        bad = [k for k, t in tensors.items() if not isinstance(t, torch.Tensor) or t.dtype != self.dtype
               or tuple(t.shape) != (len(ids), self._slabs.columns[k])]
        bad += [k for k, t in counters.items() if not isinstance(t, torch.Tensor) or t.dtype != torch.int64
                or tuple(t.shape) != (lengths.get(k, -1),)]
        if bad:
            raise InvalidArgumentError(f"table state tensors {bad} do not fit {len(ids)} rows of {self.dim} "
                                       f"{self.dtype} (counters: int64, one per row or pending id)")
        counters = {k: t.numpy() for k, t in counters.items()}
        every = np.concatenate([ids, counters.get("pending ids", ids[:0])])
        self._check_owned(every)
        if len(np.unique(every)) != len(every) or (self.fixed and len(ids) != self._slabs.capacity) \
                or np.any(counters.get("pending counts", 1) < 1) or np.any(counters.get("update_counts", 0) < 0):
            raise InvalidArgumentError("a table state needs distinct ids (rows and pending), positive pending "
                                       "counts, update counts of at least 0 and, for a fixed-size table, every "
                                       "id of the shard")
        return optimizer, ids, tensors, counters, step, events


def rows_for(state: Mapping, shard_index: int, num_shards: int) -> dict:
    """`state` (a state_dict()) with only the rows and occurrence counters shard `shard_index` of `num_shards`
    owns under its partition: what one old shard sends a new one in a live re-layout (relayout() takes every
    old shard's such part)."""
    partition = state["config"]["partition"]

    def kept(ids: torch.Tensor) -> torch.Tensor:
        return shard_of(ids, num_shards, partition) == shard_index

    mine = kept(state["ids"])
    out = {**state, "ids": state["ids"][mine], "values": state["values"][mine],
           "state": {k: v[mine] for k, v in state["state"].items()}}
    for key in ("last_update", "update_counts"):
        if state.get(key) is not None:
            out[key] = state[key][mine]
    if state.get("pending") is not None:
        waiting = kept(state["pending"]["ids"])
        out["pending"] = {k: v[waiting] for k, v in state["pending"].items()}
    return out


def check_read(min_updates: int, max_rows: int = 1) -> None:
    """InvalidArgumentError unless a read of changes may ask for `min_updates` and parts of `max_rows` rows."""
    if not 0 <= min_updates <= MAX_UPDATES:
        raise InvalidArgumentError(f"min_updates must be in [0, {MAX_UPDATES}], got {min_updates}")
    if max_rows < 1:
        raise InvalidArgumentError(f"max_rows must be positive, got {max_rows}")


def relayout(states: Sequence[Mapping], shard_index: int, num_shards: int, *,
             partition: str | None = None) -> dict:
    """The state of shard `shard_index` of `num_shards` (partitioned by `partition`, default: as before) of the
    table whose old shards' state_dict()s are `states`, all of them, in any order: every row the new shard owns,
    with its optimizer state and age, and its occurrence counters. Event counters restart at zero; per-shard
    capacity stays (the next evict() applies it). The optimizer's step count is the highest of the old shards'
    (those of an async job differ by the pushes that reached some shards and failed on others, a live
    re-layout's by the pushes between their freezes). Raises InvalidArgumentError unless the states are one
    table's complete old layout (the states are only read)."""
    try:
        return _relayout(states, shard_index, num_shards, partition)
    except (KeyError, TypeError, IndexError, RuntimeError) as exc:
        raise InvalidArgumentError(f"not the states of an embedding table: missing or bad {exc}") from None


_OWNER_CHUNK = 1 << 20  # ids hashed at a time: a fixed table's id range is never made whole on a shard


def _hash_owned(num_embeddings: int, shard_index: int, num_shards: int) -> np.ndarray:
    """The ids of [0, num_embeddings) that "hash" partitioning gives shard `shard_index`, sorted; the range
    is hashed a chunk at a time, so the temporaries are a chunk's, not the table's."""
    parts = []
    for start in range(0, num_embeddings, _OWNER_CHUNK):
        ids = np.arange(start, min(start + _OWNER_CHUNK, num_embeddings), dtype=np.int64)
        parts.append(ids[_owner(ids, num_shards, "hash") == shard_index])
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def relayout_head(states: Sequence[Mapping], shard_index: int, num_shards: int) -> dict:
    """relayout()'s state without the rows ("ids", "values", "state" and their counters): config, optimizer
    step count, step, events at zero, and a dynamic table's occurrence counters. What an SSD table's re-layout
    starts from (it streams the rows from the old stores). Raises InvalidArgumentError as relayout() does."""
    try:
        return _head(states, shard_index, num_shards, None)
    except (KeyError, TypeError, IndexError, RuntimeError) as exc:
        raise InvalidArgumentError(f"not the states of an embedding table: missing or bad {exc}") from None


def _head(states: Sequence[Mapping], shard_index: int, num_shards: int, partition: str | None) -> dict:
    configs = [dict(s["config"]) for s in states]
    if not configs:
        raise InvalidArgumentError("relayout needs the states of every old shard")
    old = configs[0]
    layout = sorted(c["shard_index"] for c in configs)
    same = all({**c, "shard_index": 0} == {**old, "shard_index": 0} for c in configs)
    if not same or layout != list(range(old["num_shards"])):
        raise InvalidArgumentError(f"relayout needs one table's states from all of its {old['num_shards']} shards; "
                                   f"got shards {layout}")
    config = {**old, "shard_index": shard_index, "num_shards": num_shards, "partition": partition or old["partition"]}
    _check_config(config)
    out = {"format": STATE_FORMAT, "config": config,
           "optimizer_steps": max(int(s["optimizer_steps"]) for s in states),
           "step": max(int(s["step"]) for s in states), "events": {k: 0 for k in states[0]["events"]}}
    if old["num_embeddings"] is None:
        pending = _gathered(states, config, lambda s: (s["pending"]["ids"], s["pending"]["counts"],
                                                       s["pending"]["last_seen"]))
        order = torch.argsort(pending[0])
        out["pending"] = dict(zip(("ids", "counts", "last_seen"), (t[order] for t in pending)))
    return out


def _gathered(states: Sequence[Mapping], config: Mapping, get) -> tuple[torch.Tensor, ...]:
    """The tensors get(state) of every state, each cut to the ids (the first tensor) `config`'s shard owns."""
    parts = [get(s) for s in states]
    keeps = [shard_of(p[0], config["num_shards"], config["partition"]) == config["shard_index"] for p in parts]
    return tuple(torch.cat([p[i][k] for p, k in zip(parts, keeps)]) for i in range(len(parts[0])))


def _relayout(states: Sequence[Mapping], shard_index: int, num_shards: int, partition: str | None) -> dict:
    out = _head(states, shard_index, num_shards, partition)
    keys = sorted(states[0]["state"])
    extra = [k for k in ("last_update", "update_counts") if all(s.get(k) is not None for s in states)]
    rows = _gathered(states, out["config"],
                     lambda s: (s["ids"], s["values"], *(s["state"][k] for k in keys), *(s[k] for k in extra)))
    order = torch.argsort(rows[0])
    rows = [t[order] for t in rows]
    return {**out, "ids": rows[0], "values": rows[1], "state": dict(zip(keys, rows[2:2 + len(keys)])),
            **dict(zip(extra, rows[2 + len(keys):]))}
