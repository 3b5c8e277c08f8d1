"""The journal: every change to a shard's state, on disk before it is acknowledged. No gRPC.

A shard started with a journal folder (by default `<checkpoint-dir>/journal/ps-N`)
writes each change there as one record before it replies: a push applied,
gradients added to a sync step, a step applied, variables created, optimizer
changes, the mode, a retired worker incarnation. After a crash the shard
loads the newest base (a whole state) and replays the records written after
it, so it comes back with exactly the state it had acknowledged: no push
acknowledged is lost, none is applied twice (the push ledger is part of it).

    base-000003.pt    the state when log 3 began (written under a temporary name, then renamed)
    log-000003.bin    records since: magic, lengths, JSON meta, tensor bytes, Adler-32, end marker

Records are written with one system call each on an unbuffered file, so a
killed process leaves whole records and at most one torn one at the end,
which recovery detects (length, checksum, end marker) and cuts off. The log
is fsynced every `sync_seconds` by a background thread: a lost host loses at
most that much. When the log outgrows `compact_bytes` the shard writes a new
base and starts a new log (Journal.compact), so the folder stays near two
states' size.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import struct
import threading
import zlib
from typing import Iterator, Mapping

import numpy as np
import torch

from .. import codec
from ..errors import CheckpointError
from .checkpoint import fsync_dir, write_atomic

__all__ = ["Journal", "Record", "DEFAULT_COMPACT_BYTES"]

_LOGGER = logging.getLogger(__name__)
MAGIC, END = b"TPJ1", b"TPJE"
_HEAD = struct.Struct("<4sIQ")   # magic, meta length, data length
_TAIL = struct.Struct("<I4s")    # Adler-32 of meta + data, end marker
DEFAULT_COMPACT_BYTES = 256 << 20
_BASE = re.compile(r"^base-(\d{6})\.pt$")
_LOG = re.compile(r"^log-(\d{6})\.bin$")


class Record:
    """One decoded journal record: its kind, its JSON meta and its tensors by name."""

    def __init__(self, kind: str, meta: dict, tensors: dict[str, torch.Tensor]):
        self.kind, self.meta, self.tensors = kind, meta, tensors


class Journal:
    """A shard's journal folder (see the module docstring). append() is thread-safe."""

    def __init__(self, directory: str | os.PathLike, *, sync_seconds: float = 1.0,
                 compact_bytes: int = DEFAULT_COMPACT_BYTES):
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sync_seconds = sync_seconds
        self.compact_bytes = compact_bytes
        self._lock = threading.Lock()
        self._file = None
        self._number = -1
        self.log_bytes = 0
        self._dirty = threading.Event()
        self._closed = threading.Event()
        self._syncer: threading.Thread | None = None

    # -- recovery ---------------------------------------------------------------------------------

    def _numbers(self, pattern: re.Pattern) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := pattern.match(p.name)))

    def holds_state(self) -> bool:
        """True if the folder holds a journal to recover from."""
        return bool(self._numbers(_BASE) or self._numbers(_LOG))

    def recover(self) -> tuple[dict | None, Iterator[Record]] | None:
        """(base state or None, the records after it) to replay, or None if the folder holds no journal.

        Cuts a torn record off the end of the last log, so appends go on after the last whole one.
        """
        if not self.holds_state():
            return None
        bases, logs = self._numbers(_BASE), self._numbers(_LOG)
        base, state = -1, None
        for number in reversed(bases):
            try:
                state = torch.load(self._base_path(number), map_location="cpu", weights_only=True)
                base = number
                break
            except Exception as exc:  # noqa: BLE001 - a damaged base: the older one and more log are used
                _LOGGER.warning("journal base %d cannot be read (%s); trying an older one", number, exc)
        replay = [n for n in logs if n >= base]
        if base < 0 and logs and logs[0] != 0:
            raise CheckpointError(f"journal {self.directory}: no readable base before log {logs[0]}")
        self._number = max([base, *replay])
        return state, self._replay(replay)

    def _replay(self, numbers: list[int]) -> Iterator[Record]:
        for number in numbers:
            path = self._log_path(number)
            good = 0
            with open(path, "rb") as f:
                data = f.read()
            view = memoryview(data)
            while good < len(data):
                record, end = _decode(view, good)
                if record is None:
                    _LOGGER.warning("journal %s: a torn record at byte %d (a crash mid-write): %d bytes cut off",
                                    path.name, good, len(data) - good)
                    os.truncate(path, good)
                    break
                good = end
                yield record
            if number == self._number:
                self.log_bytes = good

    # -- writing ----------------------------------------------------------------------------------

    def start(self, state: dict | None) -> None:
        """Opens the log for appends: the current one after recover(), else a new base with `state` first."""
        if self._number < 0:
            self._number = 0
            if state is not None:
                self._write_base(0, state)
        self._file = open(self._log_path(self._number), "ab", buffering=0)
        self.log_bytes = self._file.tell()
        self._syncer = threading.Thread(target=self._sync_loop, name="journal-sync", daemon=True)
        self._syncer.start()

    def append(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor]) -> None:
        """Writes one record (call before acknowledging the change it describes)."""
        views = {name: codec.tensor_bytes(t.detach().cpu()) for name, t in tensors.items()}
        body = json.dumps({"kind": kind, **meta, "tensors": [
            [name, codec.wire_dtype(t.dtype), list(t.shape), len(views[name])] for name, t in tensors.items()]}
        ).encode()
        size = sum(len(v) for v in views.values())
        checksum = zlib.adler32(body)
        for view in views.values():
            checksum = zlib.adler32(view, checksum)
        with self._lock:
            f = self._file
            _write_all(f, memoryview(_HEAD.pack(MAGIC, len(body), size) + body))
            for view in views.values():
                _write_all(f, view)
            _write_all(f, memoryview(_TAIL.pack(checksum, END)))
            self.log_bytes += _HEAD.size + len(body) + size + _TAIL.size
        self._dirty.set()

    def wants_compaction(self) -> bool:
        return self.log_bytes > self.compact_bytes

    def rotate(self) -> int:
        """Starts a new log; returns its number. Call under the apply gate, with the state copied at the same
        moment, then write that state with finish_compaction()."""
        with self._lock:
            self._file.close()
            self._number += 1
            self._file = open(self._log_path(self._number), "ab", buffering=0)
            self.log_bytes = 0
            return self._number

    def finish_compaction(self, number: int, state: dict) -> None:
        """Writes base `number` (the state at the start of log `number`), then deletes everything older."""
        self._write_base(number, state)
        for older in self._numbers(_BASE) + self._numbers(_LOG):
            if older < number:
                for path in (self._base_path(older), self._log_path(older)):
                    path.unlink(missing_ok=True)
        fsync_dir(self.directory)

    def close(self) -> None:
        self._closed.set()
        self._dirty.set()
        if self._syncer is not None:
            self._syncer.join()
        with self._lock:
            if self._file is not None:
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None

    # -- files ------------------------------------------------------------------------------------

    def _base_path(self, number: int) -> pathlib.Path:
        return self.directory / f"base-{number:06d}.pt"

    def _log_path(self, number: int) -> pathlib.Path:
        return self.directory / f"log-{number:06d}.bin"

    def _write_base(self, number: int, state: dict) -> None:
        write_atomic(self._base_path(number), lambda f: torch.save(state, f))

    def _sync_loop(self) -> None:
        while not self._closed.is_set():
            self._dirty.wait()
            self._closed.wait(self.sync_seconds)
            self._dirty.clear()
            with self._lock:
                if self._file is not None:
                    os.fsync(self._file.fileno())


def _write_all(f, view: memoryview) -> None:
    while len(view):
        written = f.write(view)
        view = view[written:]


def _decode(view: memoryview, offset: int) -> tuple[Record | None, int]:
    """The record at `offset` and where the next begins, or (None, offset) if it is torn or damaged."""
    if offset + _HEAD.size > len(view):
        return None, offset
    magic, meta_len, data_len = _HEAD.unpack_from(view, offset)
    body_at = offset + _HEAD.size
    data_at = body_at + meta_len
    tail_at = data_at + data_len
    if magic != MAGIC or tail_at + _TAIL.size > len(view):
        return None, offset
    checksum, end = _TAIL.unpack_from(view, tail_at)
    if end != END or zlib.adler32(view[data_at:tail_at], zlib.adler32(view[body_at:data_at])) != checksum:
        return None, offset
    meta = json.loads(bytes(view[body_at:data_at]))
    tensors, at = {}, data_at
    for name, dtype, shape, nbytes in meta.pop("tensors"):
        raw = np.frombuffer(view[at:at + nbytes], dtype=np.uint8).copy()
        torch_type = codec.torch_dtype(dtype)
        tensors[name] = (torch.from_numpy(raw).view(torch_type).reshape(shape) if nbytes
                         else torch.empty(shape, dtype=torch_type))
        at += nbytes
    return Record(meta.pop("kind"), meta, tensors), tail_at + _TAIL.size
