"""Embedding tables kept on local disk: a bounded RAM cache of rows over a DiskRows store (ps-server
--table-storage ssd). No gRPC.

With --table-storage ssd a shard keeps each dynamic table (num_embeddings
None) as an SsdTable; fixed-size tables stay in memory (their size is known
at creation and counted against --max-memory) unless their spec asks for
"ssd": such a table runs as a dynamic one whose every owned id has a row,
written into the store at its creation. An SsdTable is an
EmbeddingTable whose rows live in a DiskRows store (disk_rows.py: RocksDB),
one per table under --table-dir, and in a RAM cache of the rows used last:

* lookup() and apply() first make room for their ids that are not cached
  (spill: the rows used longest ago, LRU by call, leave the cache, those
  changed since they were read written back in one batch, until the call's
  ids fit in the table's share of --table-cache), then read the rows they
  name that are not cached from the store (a miss; a row in neither is
  created by admission as in RAM), then run as in RAM on the cache.
  RocksDB writes into its memtable and flushes and compacts in its own
  threads, so write-back costs a call a memory copy, not a disk write.
* warm() reads rows a client announced for its next lookup into the cache
  ahead of it (warming.py), changing nothing else.
* The shard's SSD tables share --table-cache: a table may grow into what
  none holds, and is always allowed an equal share (CacheBudget; one over
  its share gives the rest back at its next call).
* state_dict() writes every changed row back and takes a RocksDB checkpoint
  of the store (hard links: the table is not read) into a StoreCopy, a
  folder removed once the state is dropped; a checkpoint or a journal base
  places it in its own folder (place_stores) and names it relative to
  itself, and whoever reads the state back resolves it (resolve_stores).
  Where the checkpoint's file system is not the store's (no hard link), a
  table file the newest committed checkpoint holds already is linked from
  there: a checkpoint copies the table files made since that one.
  load_state_dict() of such a state opens a copy of it as the table's store
  (table files linked, not read), so a restart reads no row until asked;
  a state of a RAM table's rows is written into a new store.
* changes() and read_changes() (serving replicas, PSClient.export_rows)
  write changed rows back and read the store; a whole read streams it a
  part at a time (DiskRows.scan), so the table is never whole in memory.

The store's writes skip RocksDB's write-ahead log: a store left by a killed
shard is never reopened (TableStorage empties --table-dir/ps-INDEX at
start); the shard starts from its journal's base or checkpoint and replays
the journal onto it, as a RAM shard does.

A table with max_age or capacity keeps every row's last update in memory
(_ages: its id, the step and an index entry), chooses what to evict from
it as a RAM table does from its rows, and deletes those rows from the store
and the cache; loading a state reads the store once to build it.

A checkpoint restored onto another number of shards (relayout_stores)
streams each old shard's store copy a chunk at a time into the new shard's
store, keeping the rows the table's partition now gives it: no table is
read whole into memory. A serving replica started from a checkpoint reads
a store copy whole (stored_rows). A live resize streams the rows the same
way from a frozen copy of the old store (table_moves.py). A replicated shard's backup copies the
store copies of each journal base (feed.py), and once promoted opens
them as a restarted shard does.

Thread safety: as EmbeddingTable (one lock per table, held for every public
call); CacheBudget has its own lock, taken inside a table's.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import secrets
import shutil
import threading
import weakref
from typing import Iterator, Mapping

import numpy as np
import torch

from ..errors import InvalidArgumentError, LayoutChangedError, ModeConflictError
from .disk_rows import DiskMemory, DiskRows, link_tree
from ..rows import owner
from .embeddings import STATE_FORMAT, EmbeddingTable, _check_config, check_read, initial_rows, relayout_head
from .row_changes import MAX_UPDATES, RowChanges, RowMarks
from .row_storage import Keyed as _Keyed

__all__ = ["SsdTable", "TableStorage", "CacheBudget", "StoreCopy", "place_stores", "resolve_stores", "stored_rows",
           "decoded", "relayout_stores", "STORAGES"]

STORAGES = ("ram", "ssd")
LOG_IDS = 1 << 16        # change-log ids an SSD table keeps (512 KiB): older cursors are answered from the store
CACHE_LEAST = 64         # rows of a cache's smallest slab: a shard's many small caches stay small
_TAIL = 16               # a record's bytes after the row: last update step and RowMarks, int64 each
_KEEP = 7 / 8            # a spill leaves the cache this full, so that it is not spilled again at once
_CHUNK = 1 << 16         # rows written at a time when a RAM table's state is loaded


def decoded(records: np.ndarray, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(rows (n, row width) of `dtype`: values, then optimizer state; last update steps; RowMarks) of an SSD
    table's store records."""
    row_bytes = records.shape[1] - _TAIL
    if not len(records):
        return (torch.empty(0, row_bytes // dtype.itemsize, dtype=dtype), np.empty(0, dtype=np.int64),
                np.empty(0, dtype=np.int64))
    rows = torch.from_numpy(np.ascontiguousarray(records[:, :row_bytes])).view(dtype)
    tail = np.ascontiguousarray(records[:, row_bytes:]).view(np.int64)
    return rows, tail[:, 0], tail[:, 1]


def stored_rows(store: Mapping, dtype: torch.dtype, dim: int) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
    """(ids ascending, values (n, dim), RowMarks) of a placed store copy (a state's "store", resolved), read
    whole without changing it."""
    disk = DiskRows(store["path"], int(store["record_bytes"]), read_only=True)
    try:
        chunks = list(disk.items())
    finally:
        disk.close()
    ids = np.concatenate([i for i, _ in chunks]) if chunks else np.empty(0, dtype=np.int64)
    records = np.concatenate([r for _, r in chunks]) if chunks else np.empty((0, disk.record_bytes), dtype=np.uint8)
    rows, _, marks = decoded(records, dtype)
    return ids, rows[:, :dim].clone(), marks


def relayout_stores(states: list[Mapping], shard_index: int, num_shards: int) -> dict:
    """The state of shard `shard_index` of `num_shards` of an SSD table whose old shards' states (placed and
    resolved, or StoreCopy) are `states`, all of them: relayout_head()'s, and "sources", the old stores with
    the shard each was, from which load_state_dict() streams the rows the new shard owns. Raises
    InvalidArgumentError as embeddings.relayout() does; reads no row."""
    out = relayout_head(states, shard_index, num_shards)
    try:
        out["sources"] = [{**_store_of(s["store"]), "shard_index": int(s["config"]["shard_index"]),
                           "num_shards": int(s["config"]["num_shards"])} for s in states]
        seqs = [int((s.get("changes") or {}).get("seq", 0)) for s in states]
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"not the states of an SSD table: missing or bad {exc}") from None
    out["changes"] = {"seq": max(seqs)}  # the rows' change marks stay older than the new table's
    return out


def _store_of(store) -> dict:
    """{"path": str, "record_bytes": int} of a state's store (a StoreCopy or a placed one)."""
    if isinstance(store, StoreCopy):
        return {"path": str(store.path), "record_bytes": store.record_bytes}
    return {"path": str(store["path"]), "record_bytes": int(store["record_bytes"])}


class CacheBudget:
    """The bytes the caches of a shard's SSD tables share: a table may grow into what none holds, and is
    always allowed an equal share (those over theirs give it back at their next call)."""

    def __init__(self, total: int):
        self.total = total
        self._lock = threading.Lock()
        self._used: dict[int, int] = {}
        self._sum = 0

    def allowance(self, key: int, used: int) -> int:
        """Table `key`'s bytes now `used`; returns what it may hold."""
        with self._lock:
            self._sum += used - self._used.get(key, 0)
            self._used[key] = used
            return max(self.total // len(self._used), used + self.total - self._sum)

    def leave(self, key: int) -> None:
        with self._lock:
            self._sum -= self._used.pop(key, 0)


class StoreCopy:
    """A table's store as of a state_dict(): folder `path`, removed when this object is dropped, unless
    place_stores linked it into a checkpoint or journal first."""

    def __init__(self, path: pathlib.Path, record_bytes: int):
        self.path, self.record_bytes = path, record_bytes
        weakref.finalize(self, shutil.rmtree, path, True)


_PLACING = threading.Lock()  # two saves of one step place one state: the second finds it placed


def place_stores(state: dict, folder: pathlib.Path, base: pathlib.Path, earlier: pathlib.Path | None = None, *,
                 full: bool = False) -> int:
    """Links every SSD table's StoreCopy in `state` ("tables": a shard's section) into a new folder of its own
    under `folder` (under `base`), fsynced, and names it there relative to `base`, in `state` itself; a folder
    placed earlier is never written over (a file that names it may be committed). `earlier`: a folder placed
    before (an older checkpoint's, on `folder`'s file system), whose table files a store on another file system
    links instead of copying them again (disk_rows.link_tree); `full`: every file copied, none linked. Returns
    the placed stores' bytes (what a
    journal's base weighs: its log is replayed onto them). A state placed before (two saves of one step) is
    left as it is."""
    placed = 0
    with _PLACING:
        for entry in state.get("tables") or []:
            copy = entry["state"].get("store")
            if not isinstance(copy, StoreCopy):
                continue
            name = _safe(entry["name"])
            target = folder / f"{name}-{secrets.token_hex(4)}"
            before = sorted(earlier.glob(f"{name}-*")) if earlier is not None and earlier.is_dir() else []
            link_tree(copy.path, target, sync=True, reuse=before[0] if len(before) == 1 else None, copy=full)
            placed += sum(f.stat().st_size for f in target.iterdir())
            entry["state"]["store"] = {"path": str(target.relative_to(base)), "record_bytes": copy.record_bytes}
    return placed


def resolve_stores(state: Mapping, base: pathlib.Path) -> None:
    """Makes the store folders named in `state`'s tables (place_stores) absolute under `base`, in place."""
    for entry in state.get("tables") or []:
        store = entry.get("state", {}).get("store") if isinstance(entry, Mapping) else None
        if isinstance(store, dict) and isinstance(store.get("path"), str):
            store["path"] = str(base / store["path"])


def _safe(name: str) -> str:
    """A folder name for table `name`: its first safe characters and a digest of the whole name, so two names
    never share one."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:48]}-{digest}"


class TableStorage:
    """Where a shard keeps its dynamic tables: by default `kind` ("ram" or "ssd"); on SSD only with a
    `directory`, under `directory`/`name` (ps-INDEX; emptied here: a store is never reopened after its shard
    stopped), the SSD tables' caches sharing `cache_bytes`. With a directory and kind "ram", tables whose spec
    asks for "ssd" go to disk and the others stay in memory."""

    def __init__(self, kind: str = "ram", directory: str | os.PathLike | None = None, *, name: str = "ps-0",
                 cache_bytes: int = 256 << 20):
        if kind not in STORAGES or (kind == "ssd" and directory is None) or cache_bytes <= 0:
            raise InvalidArgumentError(f"table storage {kind!r} needs a folder where it is 'ssd' and a positive "
                                       f"cache; got {directory!r}, {cache_bytes} bytes")
        self.kind, self.cache_bytes = kind, cache_bytes
        self.root = None
        if directory is not None:
            self.root = pathlib.Path(directory) / name
            if self.root.exists():
                shutil.rmtree(self.root)
            self.root.mkdir(parents=True)
            self.memory = DiskMemory()
            self.budget = CacheBudget(cache_bytes)

    @property
    def on_disk(self) -> bool:
        """Whether tables may be kept on SSD here (a directory was given)."""
        return self.root is not None

    def where(self, name: str, storage: str, fixed: bool) -> str:
        """Where table `name` is kept ("ram" or "ssd") when its spec asks for `storage` ("": this storage's
        kind, which puts fixed-size tables in memory: their size is known at creation and counted against
        --max-memory; "ssd" asked for by a table puts either kind on disk). InvalidArgumentError for an unknown
        storage; ModeConflictError for "ssd" without a directory."""
        if storage not in ("", *STORAGES):
            raise InvalidArgumentError(f"table {name!r}: storage must be '', 'ram' or 'ssd'; got {storage!r}")
        kept = storage or ("ram" if fixed else self.kind)
        if kept == "ssd" and not self.on_disk:
            raise ModeConflictError(f"table {name!r} asks to be kept on SSD, and this shard keeps no tables on disk: "
                                    f"start it with --table-dir DIR")
        return kept

    def table(self, name: str, dim: int, storage: str = "", *, initial: bool = True, **args) -> EmbeddingTable:
        """A new table `name` (EmbeddingTable's arguments) kept where where() says: an SsdTable on "ssd" (a
        fixed-size one with its initial rows written, unless `initial` is False: a state is loaded next).
        Raises as where() does."""
        if self.where(name, storage, args.get("num_embeddings") is not None) == "ram":
            return EmbeddingTable(dim, **args)
        folder = self.root / f"{_safe(name)}-{secrets.token_hex(4)}"
        return SsdTable(dim, folder=folder, memory=self.memory, budget=self.budget, initial=initial, **args)


class SsdTable(EmbeddingTable):
    """A table's rows on disk under `folder` with a RAM cache (see the module docstring); the other arguments
    are EmbeddingTable's. A fixed-size one (num_embeddings N) runs as a dynamic one whose every owned id of
    [0, N) has a row from the start: `initial` writes them into the store (its initial rows, a chunk at a
    time); a table about to load a state is made without (initial=False)."""

    storage = "ssd"

    def __init__(self, dim: int, *, folder: pathlib.Path, memory: DiskMemory, budget: CacheBudget,
                 initial: bool = True, **args):
        size = args.get("num_embeddings")
        super().__init__(dim, **{**args, "num_embeddings": None})
        self._config["num_embeddings"] = size
        _check_config(self._config)
        self._rows = self._new_cache()
        self._changes = RowChanges(limit=LOG_IDS)
        self._folder, self._memory, self._budget = folder, memory, budget
        self._record_bytes = self.row_bytes + _TAIL
        self._row_cost = (self.row_bytes + 41) * 9 // 8  # row, ids, columns, index: grown by an eighth
        self._disk = DiskRows(folder / "live", self._record_bytes, fresh=True, memory=memory)
        self._tick = 0                          # calls so far: a cached row's "touched" is its last
        self._held = 0                          # rows in the table, cached or not
        self._hits = self._misses = 0           # rows asked for that were cached / read from the store
        self._warmed = 0                        # rows read in by warm() (announced for a next lookup)
        self._found: tuple[np.ndarray, np.ndarray] | None = None  # the call's ids and their slots (_fault_in)
        self._ages = self._new_ages()           # with max_age or capacity: every row's last update (evict)
        self._closed = False
        if size is not None and initial:
            try:
                self._held = self._write_initial(self._disk)
            except BaseException:  # a full disk: no half-made store is left behind
                self._disk.close()
                self._budget.leave(id(self))
                shutil.rmtree(folder, ignore_errors=True)
                raise

    @property
    def admits(self) -> bool:
        return self._config["num_embeddings"] is None

    def _owned_ids(self) -> Iterator[np.ndarray]:
        """A fixed-size table's owned ids of [0, N), ascending, a chunk at a time."""
        c = self._config
        for start in range(0, c["num_embeddings"], _CHUNK * c["num_shards"]):
            ids = np.arange(start, min(start + _CHUNK * c["num_shards"], c["num_embeddings"]), dtype=np.int64)
            mine = ids[owner(ids, c["num_shards"], c["partition"]) == c["shard_index"]]
            if len(mine):
                yield mine

    def _write_initial(self, disk: DiskRows) -> int:
        """Writes a fixed-size table's initial rows (values, optimizer state as new, no update) into `disk`;
        returns their number."""
        c, held = self._config, 0
        for ids in self._owned_ids():
            tensors = {"values": initial_rows(ids, self.dim, seed=c["seed"], init=c["init"],
                                              init_scale=c["init_scale"], dtype=self.dtype)}
            for key, (width, value) in self._spec.items():
                tensors[key] = torch.full((len(ids), width), value, dtype=self.dtype)
            self._write_rows(disk, ids, tensors, {"last_update": np.zeros(len(ids), dtype=np.int64),
                                                  "update_counts": np.zeros(len(ids), dtype=np.int64)})
            held += len(ids)
        return held

    def _check_owned(self, ids: np.ndarray) -> None:
        size = self._config["num_embeddings"]
        if size is not None:
            bad = ids[(ids < 0) | (ids >= size)]
            if bad.size:
                raise InvalidArgumentError(f"ids must be in [0, {size}); got {bad[:5].tolist()}")
        super()._check_owned(ids)

    # -- the cache --------------------------------------------------------------------------------

    _least, _whole = CACHE_LEAST, True

    def _new_cache(self) -> _Keyed:
        return _Keyed(least=CACHE_LEAST, updated=np.int64, marks=np.int64, touched=np.int64, dirty=bool)

    def _lookup(self, ids: np.ndarray, admit: bool) -> torch.Tensor:
        self._fault_in(ids)
        try:
            return super()._lookup(ids, admit and self.admits)
        finally:
            self._found = None

    def _apply(self, ids: np.ndarray, summed: torch.Tensor, step: int, count_step: bool) -> int:
        slots = self._fault_in(ids)
        try:
            updated = super()._apply(ids, summed, step, count_step)
        finally:
            self._found = None
        present = slots >= 0
        self._rows.cols["dirty"][slots[present]] = True  # the rows the push updated (it creates none)
        if self._ages is not None:
            self._ages.cols["updated"][self._ages.find(ids[present])] = step
        return updated

    def _create(self, ids: np.ndarray) -> np.ndarray:
        slots = super()._create(ids)
        self._rows.cols["touched"][slots] = self._tick
        self._rows.cols["dirty"][slots] = True
        self._held += len(ids)
        if self._ages is not None:
            self._ages.append(ids, updated=self._step)
        return slots

    def _fault_in(self, ids: np.ndarray) -> np.ndarray:
        """Makes a call on `ids` ready to run on the cache: its cached rows touched now, room made for the
        others (_spill), those the store holds read in. Returns their slots (-1: in neither), which _find
        answers for `ids` until the call ends (_found)."""
        slots = self._touched(ids)
        missing = np.flatnonzero(slots < 0)
        self._hits += len(ids) - len(missing)
        self._misses += len(missing)
        if missing.size:
            slots[missing] = self._read_in(ids[missing])
        self._found = (ids, slots)
        return slots

    def _touched(self, ids: np.ndarray) -> np.ndarray:
        """Starts a call on `ids`: a new tick, their cached rows touched at it (so a spill keeps them), room
        made for the rest; returns the slots of `ids` after the spill (-1: not cached)."""
        self._tick += 1
        slots = self._rows.find(ids)
        cached = slots >= 0
        self._rows.cols["touched"][slots[cached]] = self._tick
        if self._spill(len(ids) - int(cached.sum())):
            slots = self._rows.find(ids)
        return slots

    def _read_in(self, ids: np.ndarray) -> np.ndarray:
        """Reads the rows of `ids` (none cached) that the store holds into the cache, touched now; returns their
        slots (-1: not in the store)."""
        slots = np.full(len(ids), -1, dtype=np.int64)
        found, records = self._disk.get(ids)
        if found.any():
            rows, updated, marks = self._decoded(records[found])
            self._slabs.reserve(self._rows.n + len(rows))
            slots[found] = self._rows.append(ids[found], updated=updated, marks=marks, touched=self._tick,
                                             dirty=False)
            self._scatter(slots[found], rows)
        return slots

    def warm(self, ids: np.ndarray) -> int:
        """Reads the rows of `ids` (checked) that the store holds and the cache does not into the cache, as
        the lookup that asks for them next would (warming.py); creates, counts and changes nothing else.
        Returns the rows read. Blocks the table's other calls meanwhile, as a lookup does."""
        with self._lock:
            if self._closed:
                return 0
            slots = self._touched(ids)
            missing = slots < 0
            read = int((self._read_in(ids[missing]) >= 0).sum()) if missing.any() else 0
            self._warmed += read
            return read

    def _find(self, ids: np.ndarray) -> np.ndarray:
        if self._found is not None and self._found[0] is ids:
            return self._found[1].copy()
        return self._rows.find(ids)

    def _spill(self, incoming: int) -> bool:
        """Makes room in the cache for `incoming` rows: the least recently used rows leave it, those changed
        written back, until the cache holds at most its allowance less `incoming` (and 7/8 of it, so that the
        next calls need not spill again); returns whether any left. Runs first in a call, so a store that
        fails (a full disk) fails the call before it changed anything. The budget counts a cached row as
        _row_cost bytes."""
        n = self._rows.n
        limit = max(1, self._budget.allowance(id(self), n * self._row_cost) // self._row_cost)
        if n + incoming <= limit:
            return False
        going = n - max(0, min(int(limit * _KEEP), limit - incoming))
        victims = np.argpartition(self._rows.cols["touched"][:n], going - 1)[:going]
        self._write_back(victims)
        self._drop_cached(victims, keep=limit)  # room for `limit` rows: the cache grows back at once
        self._budget.allowance(id(self), self._rows.n * self._row_cost)
        return True

    # -- eviction (max_age, capacity): every row's last update kept in memory ----------------------------

    def _new_ages(self) -> _Keyed | None:
        c = self._config
        return _Keyed(least=CACHE_LEAST, updated=np.int64) if c["max_age"] is not None or c["capacity"] else None

    def _evict_rows(self, step: int) -> tuple[int, int]:
        """As in RAM, chosen from every row's last update (_ages): the rows go from the store first (a store
        that fails fails the call before anything else changed), then from the index and the cache."""
        if self._ages is None:
            return 0, 0
        by_age, by_capacity = self._stale(self._ages, "updated", step)
        gone = np.concatenate([by_age, by_capacity])
        if gone.size:
            ids = self._ages.cols["ids"][gone]
            self._disk.delete(ids)
            self._changes.record(ids, dropped=True)
            self._ages.remove(gone)
            cached = self._rows.find(ids)
            self._drop_cached(cached[cached >= 0], keep=max(self._slabs.capacity, self._rows.n))
            self._held -= len(gone)
            self._budget.allowance(id(self), self._rows.n * self._row_cost)  # what it freed, the others may take
        return len(by_age), len(by_capacity)

    def _indexed_ages(self, disk: DiskRows) -> _Keyed | None:
        """A new _ages of every row `disk` holds (read a chunk at a time), or None for a table that never
        evicts."""
        ages = self._new_ages()
        if ages is not None:
            for ids, records in disk.items():
                ages.append(ids, updated=self._decoded(records)[1])
        return ages

    def _nbytes(self) -> int:
        return super()._nbytes() + (self._ages.nbytes if self._ages is not None else 0)

    def _write_back(self, slots: np.ndarray | None = None) -> None:
        """Writes the changed rows among `slots` (default: every cached row) to the store; they are clean then."""
        dirty = self._rows.cols["dirty"]
        slots = np.flatnonzero(dirty[:self._rows.n]) if slots is None else slots[dirty[slots]]
        if slots.size:
            self._disk.put(self._rows.cols["ids"][slots], self._encoded(slots))
            dirty[slots] = False

    # -- records: the row (values, then optimizer state, in the table's dtype), last update, RowMarks --------

    def _encoded(self, slots: np.ndarray) -> np.ndarray:
        out = np.empty((len(slots), self._record_bytes), dtype=np.uint8)
        rows = torch.cat([self._slabs.gather(key, slots) for key in self._slabs.columns], dim=1)
        out[:, :self.row_bytes] = rows.contiguous().view(torch.uint8).numpy()
        tail = np.stack([self._rows.cols["updated"][slots], self._rows.cols["marks"][slots]], axis=1)
        out[:, self.row_bytes:] = tail.view(np.uint8)
        return out

    def _decoded(self, records: np.ndarray) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        return decoded(records, self.dtype)

    def _scatter(self, slots: np.ndarray, rows: torch.Tensor) -> None:
        start = 0
        for key, width in self._slabs.columns.items():
            self._slabs.scatter(key, slots, rows[:, start:start + width])
            start += width

    # -- serving replicas -------------------------------------------------------------------------

    def changes(self, seq: int, incarnation: str, min_updates: int = 0
                ) -> tuple[str, int, bool, torch.Tensor, torch.Tensor, torch.Tensor]:
        """EmbeddingTable.changes(): read_changes()' parts put together."""
        parts = list(self.read_changes(seq, incarnation, min_updates))
        return (*parts[0][:3], *(torch.cat([part[i] for part in parts]) for i in (3, 4, 5)))

    def read_changes(self, seq: int, incarnation: str, min_updates: int = 0, max_rows: int = 1 << 16
                     ) -> Iterator[tuple[str, int, bool, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """EmbeddingTable.read_changes(). A whole read streams the store a part at a time, each part read under
        the table's lock once changed rows were written back: it holds its rows as they are when read, so a row
        may be newer than the first part's seq, never older (a reader's next read from that seq sends it
        again). The rows of the ids changed since a seq are read a part at a time too: never more than a
        part's rows in memory. LayoutChangedError if the table was replaced (a restore, a
        re-layout) or closed between two parts: read again."""
        check_read(min_updates, max_rows)
        with self._lock:
            self._write_back()
            ids = self._changes.since(seq, incarnation, self._changed_after)
            at = (self._changes.incarnation, self._changes.seq)
        if ids is not None:  # the ids changed since: their rows read a part at a time
            for start in range(0, max(1, len(ids)), max_rows):
                part = ids[start:start + max_rows]
                with self._lock:
                    self._check_same(at)
                    self._write_back()
                    held, records = self._disk.get(part)
                yield self._part(at, False, part, held, records, min_updates)
            return
        after = None
        while True:
            with self._lock:
                self._check_same(at)
                self._write_back()
                ids, records = self._disk.scan(after, max_rows)
            if len(ids) or after is None:
                yield self._part(at, True, ids, np.ones(len(ids), dtype=bool), records, min_updates)
            if len(ids) < max_rows:
                return
            after = int(ids[-1])

    def _check_same(self, at: tuple[str, int]) -> None:
        """LayoutChangedError unless the table read from `at` (its incarnation then) is still this one."""
        if self._closed or self._changes.incarnation != at[0]:
            raise LayoutChangedError("an embedding table kept on SSD was replaced (a restore or a re-layout) "
                                     "while it was read; read it again")

    def _part(self, at: tuple[str, int], whole: bool, ids: np.ndarray, held: np.ndarray, records: np.ndarray,
              min_updates: int) -> tuple[str, int, bool, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A part of read_changes() from store records: values zeroed where not held (or updated fewer than
        `min_updates` times)."""
        rows, _, marks = self._decoded(records)
        if min_updates:
            held = held & (RowMarks.updates(marks) >= min_updates)
        values = rows[:, :self.dim].clone()
        values[torch.from_numpy(~held)] = 0
        return (*at, whole, torch.from_numpy(ids.copy()), values, torch.from_numpy(held))

    def _changed_after(self, seq: int) -> np.ndarray:
        parts = [ids[RowMarks.seqs(self._decoded(records)[2]) > seq] for ids, records in self._disk.items()]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    # -- accounting -------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """EmbeddingTable.counters(), "rows" counting every row (cached or not), and cache_rows, cache_hits,
        cache_misses (rows asked for by lookups and pushes, found cached / not), cache_warmed (rows read in by
        warm()), disk_bytes_read,
        disk_bytes_written (store records), disk_bytes (its files)."""
        with self._lock:
            return {"rows": self._held, "pending": self._pending.n - self._pending_dead, **self._events,
                    "evicted": self._events["evicted_by_age"] + self._events["evicted_by_capacity"],
                    "bytes": self._nbytes(), "row_bytes": self.row_bytes, "optimizer_steps": self.optimizer.steps,
                    "cache_rows": self._rows.n, "cache_hits": self._hits, "cache_misses": self._misses,
                    "cache_warmed": self._warmed,
                    "disk_bytes_read": self._disk.bytes_read, "disk_bytes_written": self._disk.bytes_written,
                    "disk_bytes": self._disk.disk_bytes()}

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """As EmbeddingTable.state_dict(), with the rows, their state, last updates and update counts in
        "store" (a StoreCopy of the table's store, taken after every changed row was written back) and their
        number in "rows". Blocks while changed rows are written and the store is copied (hard links)."""
        with self._lock:
            self._write_back()
            copies = self._folder / "copies"
            copies.mkdir(exist_ok=True)
            path = copies / secrets.token_hex(8)
            self._disk.snapshot_to(path)
            return {"format": STATE_FORMAT, "config": self.config(), "optimizer_steps": self.optimizer.steps,
                    "step": self._step, "events": dict(self._events), "rows": self._held,
                    "store": StoreCopy(path, self._record_bytes), "pending": self._pending_state(),
                    "changes": {"incarnation": self._changes.incarnation, "seq": self._changes.seq}}

    def load_state_dict(self, state: Mapping) -> None:
        """Replaces the table with `state`'s: a state_dict() of an SsdTable (its store copy opened as the
        table's store, no row read), relayout_stores()'s (the rows this shard owns streamed from the old stores
        into a new one, a chunk at a time) or a RAM table's (its rows written into a new store). Raises
        InvalidArgumentError for a state that does not fit, and changes nothing then."""
        with self._lock:
            path, disk = self._folder / f"live-{secrets.token_hex(4)}", None
            try:
                if state.get("sources") is not None:  # a re-layout: the rows streamed from the old stores
                    optimizer, step, events = self._parsed_head(state)
                    pending = self._parsed_pending(state)
                    disk = DiskRows(path, self._record_bytes, fresh=True, memory=self._memory)
                    held = self._stream_in(disk, state["sources"])
                elif state.get("store") is None:
                    optimizer, ids, tensors, counters, step, events = self._parsed(self._as_dynamic(state))
                    pending = {k: counters[f"pending {k}"] for k in ("ids", "counts", "last_seen")}
                    disk = DiskRows(path, self._record_bytes, fresh=True, memory=self._memory)
                    self._write_rows(disk, ids, tensors, counters)
                    held = len(ids)
                else:
                    optimizer, step, events = self._parsed_head(state)
                    held, pending, source = self._parsed_store(state)
                    link_tree(source, path)
                    disk = DiskRows(path, self._record_bytes, memory=self._memory)
                ages = self._indexed_ages(disk)
                if not self.admits and held != sum(len(ids) for ids in self._owned_ids()):
                    raise InvalidArgumentError(f"a fixed-size table's state of {held} rows: it needs every id of "
                                               f"the shard")
            except BaseException:  # the new store goes; the table is as it was
                if disk is not None:
                    disk.close()
                shutil.rmtree(path, ignore_errors=True)
                raise
            self._disk.close()
            shutil.rmtree(self._disk.path, ignore_errors=True)
            self._disk, self.optimizer, self._step, self._events, self._held = disk, optimizer, step, events, held
            self._ages = ages
            self._rows = self._new_cache()
            self._slabs = self._new_slabs(0)
            self._pending, self._pending_dead = _Keyed(counts=np.int32, seen=np.int64), 0
            self._pending.append(pending["ids"], counts=pending["counts"], seen=pending["last_seen"])
            saved = (state.get("changes") or {}).get("seq", 0)
            self._changes.seq = max(self._changes.seq, int(saved))  # marks in the store stay older than new ones
            self._changes.reset()

    def _as_dynamic(self, state: Mapping) -> Mapping:
        """A RAM state of a fixed-size table as a dynamic table's (every row last updated at 0, no occurrence
        counter), which this one runs as; any other state as it is."""
        if self.admits or state.get("last_update") is not None or not isinstance(state.get("ids"), torch.Tensor):
            return state
        none = torch.empty(0, dtype=torch.int64)
        return {**state, "last_update": torch.zeros(len(state["ids"]), dtype=torch.int64),
                "pending": {"ids": none, "counts": none, "last_seen": none}}

    def _parsed_store(self, state: Mapping) -> tuple[int, dict[str, np.ndarray], pathlib.Path]:
        """(rows, occurrence counters, store folder) of an SsdTable's state; InvalidArgumentError if unfit."""
        try:
            store = _store_of(state["store"])
            held = int(state["rows"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"not an SSD table state: missing or bad {exc}") from None
        if held < 0:
            raise InvalidArgumentError(f"an SSD table state of {held} rows")
        return held, self._parsed_pending(state), self._checked_store(store)

    def _checked_store(self, store: Mapping) -> pathlib.Path:
        """The folder of a store of this table's records; InvalidArgumentError if it is missing or unfit."""
        path = pathlib.Path(store["path"])
        if store["record_bytes"] != self._record_bytes or not (path / "CURRENT").is_file():
            raise InvalidArgumentError(f"an SSD table state whose store {path} is missing or holds records of "
                                       f"{store['record_bytes']} bytes (this table's: {self._record_bytes})")
        return path

    def _parsed_pending(self, state: Mapping) -> dict[str, np.ndarray]:
        """A state's occurrence counters; InvalidArgumentError unless they are this shard's, one per id. A
        fixed-size table's state may have none (it admits nothing)."""
        if not self.admits and state.get("pending") is None:
            return {"ids": np.empty(0, dtype=np.int64), "counts": np.empty(0, dtype=np.int64),
                    "last_seen": np.empty(0, dtype=np.int64)}
        try:
            pending = {k: state["pending"][k] for k in ("ids", "counts", "last_seen")}
        except (KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"not an SSD table state: missing or bad {exc}") from None
        if any(not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1
               or len(t) != len(pending["ids"]) for t in pending.values()):
            raise InvalidArgumentError("an SSD table state's occurrence counters must be int64 vectors of one length")
        pending = {k: t.numpy() for k, t in pending.items()}
        self._check_owned(pending["ids"])
        if len(np.unique(pending["ids"])) != len(pending["ids"]) or np.any(pending["counts"] < 1):
            raise InvalidArgumentError("an SSD table state's occurrence counters need distinct ids and counts of "
                                       "at least 1")
        return pending

    def _stream_in(self, disk: DiskRows, sources) -> int:
        """Writes the rows this shard owns from every old store of `sources` (relayout_stores) into `disk`, a
        chunk at a time; returns their number. InvalidArgumentError for a store that is missing, unfit or holds
        rows its old shard did not own."""
        config, held = self.config(), 0
        for source in sources:
            try:
                path = self._checked_store(_store_of(source))
                index, count = int(source["shard_index"]), int(source["num_shards"])
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidArgumentError(f"not an SSD table's old store: missing or bad {exc}") from None
            old = DiskRows(path, self._record_bytes, read_only=True)
            try:
                for ids, records in old.items():
                    if not np.all(owner(ids, count, config["partition"]) == index):
                        raise InvalidArgumentError(f"the store {path} holds rows of ids that are not shard {index}'s "
                                                   f"of {count}: it is damaged")
                    mine = owner(ids, config["num_shards"], config["partition"]) == config["shard_index"]
                    if mine.any():
                        disk.put(ids[mine], records[mine])
                        held += int(mine.sum())
            finally:
                old.close()
        return held

    def _write_rows(self, disk: DiskRows, ids: np.ndarray, tensors: Mapping[str, torch.Tensor],
                    counters: Mapping[str, np.ndarray]) -> None:
        """Writes a RAM table state's rows into `disk`, a chunk at a time."""
        counts = counters.get("update_counts", MAX_UPDATES)
        for start in range(0, len(ids), _CHUNK):
            part = slice(start, start + _CHUNK)
            rows = torch.cat([tensors[key][part].detach().cpu() for key in self._slabs.columns], dim=1)
            out = np.empty((len(rows), self._record_bytes), dtype=np.uint8)
            out[:, :self.row_bytes] = rows.contiguous().view(torch.uint8).numpy()
            marks = RowMarks.new(self._changes.seq, counts[part] if isinstance(counts, np.ndarray) else counts)
            tail = np.stack([counters["last_update"][part], np.broadcast_to(marks, (len(rows),))], axis=1)
            out[:, self.row_bytes:] = np.ascontiguousarray(tail, dtype=np.int64).view(np.uint8)
            disk.put(ids[part], out)

    def close(self) -> None:
        """Closes the store and removes the table's folder; the table is not used afterwards."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._budget.leave(id(self))
                self._disk.close()
                shutil.rmtree(self._folder, ignore_errors=True)
