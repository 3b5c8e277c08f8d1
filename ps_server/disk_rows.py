"""A table's rows on local disk: id -> one fixed-size record, in a RocksDB database (rocksdict, raw bytes). What an
SSD-backed embedding table keeps beyond its RAM cache. No lock: its owner's lock covers every call.

Keys are the ids as 8 big-endian bytes with the sign bit flipped, so the
store's byte order is the ids' numeric order (items() runs by ascending id).
Records are opaque to the store: `record_bytes` bytes each, read and written
as rows of a uint8 array, a batch per call (one multi-get, one write batch).

Durability comes from elsewhere: writes skip RocksDB's write-ahead log, so
after a crash the store holds some recent writes and not others, and is
thrown away; a restart rebuilds it from a checkpoint's copy (snapshot_to: a
RocksDB checkpoint, hard links where the file system allows) and the
journal. The store's own memory is bounded: a block cache of `cache_bytes`,
write buffers of `buffer_bytes` (two at most), filters and indexes inside
the cache; reads go through the file system, not a mapping, so the page
cache is the kernel's and not this process's resident set.

bench/row_stores.py compares this store with LMDB on an embedding table's
access pattern (docs/guide/embeddings.md says why RocksDB was chosen).
"""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Iterator

import numpy as np
import rocksdict

__all__ = ["DiskRows", "DiskMemory", "encode_keys", "decode_keys", "link_tree"]

_FLIP = np.uint64(1 << 63)
CACHE_BYTES = 8 << 20     # the block cache (reads of hot blocks)
BUFFER_BYTES = 16 << 20   # one write buffer (memtable)
_SCAN_ROWS = 1 << 14      # rows per chunk of items()


class DiskMemory:
    """What every store of a shard shares: one block cache of `cache_bytes` and one memtable budget of
    `buffer_bytes` (RocksDB's write buffer manager: a store that passes its share is flushed)."""

    def __init__(self, cache_bytes: int = CACHE_BYTES, buffer_bytes: int = 2 * BUFFER_BYTES):
        self.cache = rocksdict.Cache(cache_bytes)
        self.buffers = rocksdict.WriteBufferManager(buffer_bytes, False)


def link_tree(source: str | os.PathLike, target: str | os.PathLike, *, sync: bool = False,
              reuse: str | os.PathLike | None = None, copy: bool = False) -> int:
    """Copies folder `source` (a snapshot_to copy) to `target` (which must not exist): the store's table
    files (*.sst, never written after they are made) as hard links where the file system allows, else as links
    to the same file in folder `reuse` (an earlier copy on target's file system: same name, size and
    modification time), every other file (the manifest, which a store opened there appends to) as a copy.
    `copy`: every file copied, none linked. `sync`: every file and the folder are fsynced (the copy outlives a
    crash of the host). Returns the bytes copied."""
    source, target = pathlib.Path(source), pathlib.Path(target)
    target.mkdir(parents=True)
    earlier = {}
    if reuse is not None and pathlib.Path(reuse).is_dir():
        for path in pathlib.Path(reuse).glob("*.sst"):
            stat = path.stat()
            earlier[path.name, stat.st_size, stat.st_mtime_ns] = path
    copied = 0
    for path in source.iterdir():
        linked = False
        if path.suffix == ".sst" and not copy:
            stat = path.stat()
            for origin in (path, earlier.get((path.name, stat.st_size, stat.st_mtime_ns))):
                try:
                    if origin is not None:
                        os.link(origin, target / path.name)
                        linked = True
                        break
                except OSError:
                    pass
        if not linked:
            shutil.copy2(path, target / path.name)
            copied += path.stat().st_size
        if sync:
            fd = os.open(target / path.name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    if sync:
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return copied


def encode_keys(ids: np.ndarray) -> list[bytes]:
    """One 8-byte key per id (int64), ordered as the ids are."""
    raw = (np.asarray(ids, dtype=np.int64).view(np.uint64) ^ _FLIP).astype(">u8").tobytes()
    return [raw[i:i + 8] for i in range(0, len(raw), 8)]


def decode_keys(keys: list[bytes]) -> np.ndarray:
    """The ids of encode_keys' keys."""
    return (np.frombuffer(b"".join(keys), dtype=">u8").astype(np.uint64) ^ _FLIP).view(np.int64)


class DiskRows:
    """id -> record store at `path` (a folder, made if missing; see the module docstring). `fresh`: start
    empty, deleting what the folder held. `memory`: the block cache and memtable budget it shares with other
    stores (default: its own, of CACHE_BYTES and two write buffers). `read_only`: the folder is read and never
    written (a copy in a checkpoint). Raises OSError (rocksdict's exception)
    if the folder cannot be opened."""

    def __init__(self, path: str | os.PathLike, record_bytes: int, *, fresh: bool = False,
                 cache_bytes: int = CACHE_BYTES, buffer_bytes: int = BUFFER_BYTES, memory: DiskMemory | None = None,
                 read_only: bool = False):
        self.path, self.record_bytes = pathlib.Path(path), record_bytes
        if fresh and self.path.exists():
            shutil.rmtree(self.path)
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_write_buffer_size(buffer_bytes)
        options.set_max_write_buffer_number(2)
        options.set_compression_type(rocksdict.DBCompressionType.none())  # rows of floats do not compress
        if memory is not None:
            options.set_write_buffer_manager(memory.buffers)
        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(memory.cache if memory is not None else rocksdict.Cache(cache_bytes))
        table.set_cache_index_and_filter_blocks(True)
        table.set_bloom_filter(10, False)  # a miss (an id never stored) rarely reads a block
        options.set_block_based_table_factory(table)
        access = rocksdict.AccessType.read_only() if read_only else rocksdict.AccessType.read_write()
        self._db = rocksdict.Rdict(str(self.path), options=options, access_type=access)
        unlogged = rocksdict.WriteOptions()
        unlogged.disable_wal = True
        self._db.set_write_options(unlogged)
        reads = rocksdict.ReadOptions()
        reads.set_verify_checksums(False)  # a point read a third cheaper; compactions still check
        self._db.set_read_options(reads)
        self.bytes_read = self.bytes_written = self.reads = self.writes = 0

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found: bool per id, records: (len(ids), record_bytes) uint8, zeros where not found)."""
        out = np.zeros((len(ids), self.record_bytes), dtype=np.uint8)
        if not len(ids):
            return np.zeros(0, dtype=bool), out
        got = self._db[encode_keys(ids)]
        found = np.fromiter((value is not None for value in got), dtype=bool, count=len(got))
        if found.any():
            raw = b"".join(value for value in got if value is not None)
            out[found] = np.frombuffer(raw, dtype=np.uint8).reshape(-1, self.record_bytes)
            self.bytes_read += len(raw)
        self.reads += len(ids)
        return found, out

    def put(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Stores records[i] under ids[i] (replacing what was there), in one write batch."""
        if not len(ids):
            return
        records = np.ascontiguousarray(records, dtype=np.uint8)
        if records.shape != (len(ids), self.record_bytes):
            raise ValueError(f"records must be ({len(ids)}, {self.record_bytes}) uint8, got {records.shape}")
        batch = rocksdict.WriteBatch(raw_mode=True)
        raw = records.tobytes()
        step = self.record_bytes
        for i, key in enumerate(encode_keys(ids)):
            batch.put(key, raw[i * step:(i + 1) * step])
        self._db.write(batch)
        self.bytes_written += len(raw)
        self.writes += len(ids)

    def delete(self, ids: np.ndarray) -> None:
        """Removes the records of `ids` (absent ones: nothing)."""
        if not len(ids):
            return
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key in encode_keys(ids):
            batch.delete(key)
        self._db.write(batch)

    def scan(self, after: int | None, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, records) of at most `limit` rows with ids above `after` (None: from the lowest), by ascending
        id, as the store holds them now: one step of a read that goes on at the id it ended at."""
        if after is not None and after == np.iinfo(np.int64).max:
            return np.empty(0, dtype=np.int64), np.empty((0, self.record_bytes), dtype=np.uint8)
        start = None if after is None else encode_keys(np.array([after + 1], dtype=np.int64))[0]
        keys, values = [], []
        for key, value in self._db.items(from_key=start):
            keys.append(key)
            values.append(value)
            if len(keys) == limit:
                break
        if not keys:
            return np.empty(0, dtype=np.int64), np.empty((0, self.record_bytes), dtype=np.uint8)
        return self._chunk(keys, values)

    def items(self, chunk: int = _SCAN_ROWS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) chunks of at most `chunk` rows, by ascending id, as the store holds them when asked
        (a snapshot: writes made meanwhile are not seen)."""
        snapshot = self._db.snapshot()
        keys, values = [], []
        for key, value in snapshot.items():
            keys.append(key)
            values.append(value)
            if len(keys) == chunk:
                yield self._chunk(keys, values)
                keys, values = [], []
        if keys:
            yield self._chunk(keys, values)

    def _chunk(self, keys: list[bytes], values: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        raw = b"".join(values)
        self.bytes_read += len(raw)
        return decode_keys(keys), np.frombuffer(raw, dtype=np.uint8).reshape(len(keys), self.record_bytes)

    def flush(self) -> None:
        """Writes what the memtable holds into table files (the store keeps no write-ahead log)."""
        self._db.flush()

    def snapshot_to(self, path: str | os.PathLike) -> None:
        """A consistent copy of the store at `path` (which must not exist): a RocksDB checkpoint, its files hard
        links where the file system allows. What was written before the call is in it."""
        self._db.flush()
        rocksdict.Checkpoint(self._db).create_checkpoint(str(path))

    def disk_bytes(self) -> int:
        """Bytes of the store's files (one that RocksDB removes meanwhile counts as gone)."""
        total = 0
        for f in self.path.iterdir():
            try:
                total += f.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def close(self) -> None:
        self._db.close()
