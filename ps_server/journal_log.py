"""The journal's files: how a record is laid out, checked and read back, and where a log may be cut. No gRPC.

    magic "TPJ2" | meta length (u32) | data length (u64) | JSON meta | tensor bytes |
    check of the head, meta and file number (u32) | sum of the data's words (u64) | file number (u32) | "TPJE"

A log's records carry its number (log-000007.bin: 7), and so does a base's
one record (its whole state, `state_record`): the journal reuses retired
files instead of allocating and freeing pages for every new one, and bytes
left over from a file's earlier use never pass for its records.

The data's check is the sum of its little-endian 64-bit words (each tensor's
last bytes padded with zeros), modulo 2**64: one pass at memory speed where
Adler-32 takes several, and it catches what a torn or damaged write leaves (a
page lost, zeroed or stale). Adler-32 covers the head, the meta and the number.
`write` writes a record from the tensors' own memory, PIECE bytes at a time,
each piece summed just before it is written: the write copies it from the
cache, so the data is read from memory once for both.

A log is scanned from its start (`scan`): its whole records in order, up to
the first bad one. A bad record with no whole record of its log after it, in
its file or a later log, is the log's end: cut off. It is a torn record (a
process killed in the middle of a write: `torn`) or bytes left from the
file's earlier use. One with a whole record after it is corruption: the
journal is refused, naming the file and the byte (`check_tail`).
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pathlib
import struct
import zlib
from typing import Callable, Iterator, Mapping

import numpy as np
import torch

from .. import codec
from ..errors import CheckpointError, MalformedStreamError

__all__ = ["Record", "Abandoned", "TAIL_BYTES", "PIECE", "encode", "kind_of", "meta_of", "split", "tail", "write", "scan", "first", "check_tail", "torn", "mapped",
           "state_record", "state_of_record"]

MAGIC, END = b"TPJ2", b"TPJE"
_HEAD = struct.Struct("<4sIQ")     # magic, meta length, data length
_TAIL = struct.Struct("<IQI4s")    # Adler-32 of head + meta + number, sum of the data's words, number, end marker
_NUMBER = struct.Struct("<I")
_MASK = (1 << 64) - 1
_TENSOR = "\0tensor"                # a tensor's place in a state record's skeleton
TAIL_BYTES = _TAIL.size
PIECE = 2 << 20                     # bytes summed, then written, at a time: a multiple of 8 that stays in the cache


class Abandoned(Exception):
    """A record whose bytes stopped coming while it was written (write's `ready` raised it): the file ends in
    part of it, as a log cut short by a crash does."""


class Record:
    """One decoded journal record: its kind, its JSON meta and its tensors by name."""

    def __init__(self, kind: str, meta: dict, tensors: dict[str, torch.Tensor]):
        self.kind, self.meta, self.tensors = kind, meta, tensors


def encode(kind: str, meta: dict, tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[memoryview]]:
    """A record's head and meta as bytes, and views of its tensors' bytes (not copied: the tensors must not
    change until the record is written); its tail comes from tail()."""
    views = [codec.tensor_bytes(t.detach().cpu()) for t in tensors.values()]
    body = json.dumps({"kind": kind, **meta, "tensors": [
        [name, str(t.dtype).removeprefix("torch."), list(t.shape), len(v)]
        for (name, t), v in zip(tensors.items(), views)]}
    ).encode()
    return _HEAD.pack(MAGIC, len(body), sum(len(v) for v in views)) + body, views


def meta_of(head: bytes) -> dict:
    """The meta (its "kind" included) of the record an encoded head begins ({} if it cannot be read)."""
    try:
        _, meta_len, _ = _HEAD.unpack_from(head)
        meta = json.loads(bytes(head[_HEAD.size:_HEAD.size + meta_len]))
    except (struct.error, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def kind_of(head: bytes) -> str:
    """The kind of the record an encoded head begins ("" if it cannot be read)."""
    return str(meta_of(head).get("kind", ""))


def split(head: bytes, data) -> list[memoryview]:
    """The views, one per tensor (no copy), of an encoded record's tensor bytes `data` (its tensors' bytes in
    one buffer), as encode() gave them: written so, a record sums each tensor's words as its encoder did.
    MalformedStreamError for a head that is not a record's, or whose tensors are not `data`'s length."""
    data = memoryview(data).cast("B")
    try:
        magic, meta_len, data_len = _HEAD.unpack_from(head)
        entries = json.loads(bytes(head[_HEAD.size:_HEAD.size + meta_len]))["tensors"]
        lengths = [int(entry[3]) for entry in entries]
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise MalformedStreamError(f"a journal record's head cannot be read ({exc})") from None
    if magic != MAGIC or data_len != len(data) or sum(lengths) != len(data):
        raise MalformedStreamError(f"a journal record's head says {data_len} bytes of tensors, {sum(lengths)} in "
                                   f"its list, and {len(data)} came")
    views, at = [], 0
    for length in lengths:
        views.append(data[at:at + length])
        at += length
    return views


def tail(head: bytes, views: list[memoryview], number: int) -> bytes:
    """The tail of a record written into file `number`: its checks and the end marker."""
    return _tail(head, sum(map(_sum64, views)), number)


def write(fd: int, offset: int, head: bytes, views: list[memoryview], number: int,
          ready: Callable[[int], None] | None = None) -> int:
    """Writes the record of file `number` made of encode()'s `head` and `views` at `offset` of the open file
    `fd`, its tail last; returns where it ends. `ready(n)`, if given, blocks until the first n bytes of the
    views (in order) are there to be written, or raises Abandoned. Raises OSError as os.pwrite does (a record
    cut short)."""
    at, total, came = _write_all(fd, head, offset), 0, 0
    for view in views:
        view = memoryview(view).cast("B")
        for start in range(0, len(view), PIECE):
            piece = view[start:start + PIECE]
            came += len(piece)
            if ready is not None:
                ready(came)
            total += _sum64(piece)
            at = _write_all(fd, piece, at)
    return _write_all(fd, _tail(head, total, number), at)


def _tail(head: bytes, data_sum: int, number: int) -> bytes:
    return _TAIL.pack(zlib.adler32(_NUMBER.pack(number), zlib.adler32(head)), data_sum & _MASK, number, END)


def _write_all(fd: int, data, offset: int) -> int:
    """Writes all of `data` at `offset`; returns where it ends."""
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    return offset


def _sum64(view) -> int:
    whole = len(view) // 8 * 8
    total = int(np.frombuffer(view, dtype="<u8", count=whole // 8).sum(dtype=np.uint64)) if whole else 0
    return total + int.from_bytes(view[whole:], "little") if whole < len(view) else total


def scan(view: memoryview, number: int) -> Iterator[tuple[Record, int]]:
    """(record, where the next begins) for each whole record of file `number` from its start, up to the first
    bad one."""
    at = 0
    while True:
        record, end = _decode(view, at, number)
        if record is None:
            return
        yield record, end
        at = end


def first(view: memoryview, number: int) -> Record | None:
    """The whole record of file `number` at its start, or None."""
    return _decode(view, 0, number)[0]


def check_tail(path: pathlib.Path, view: memoryview, number: int, bad: int,
               later: list[tuple[pathlib.Path, int]]) -> None:
    """CheckpointError if a whole record of log `number` follows the bad one at byte `bad` of `path`, or a
    `later` log ((path, number) each) holds one: corruption, not a torn end."""
    rest = bytes(view[bad + 1:])
    at = rest.find(MAGIC)
    while at >= 0:
        if _decode(view, bad + 1 + at, number, check_only=True)[1] > bad + 1 + at:
            raise CheckpointError(
                f"journal {path}: the record at byte {bad} is damaged and a whole one follows at byte "
                f"{bad + 1 + at}: the log is corrupt, not cut short by a crash")
        at = rest.find(MAGIC, at + 1)
    for log, log_number in later:
        log_view, mapping = mapped(log)
        try:
            whole = _decode(log_view, 0, log_number, check_only=True)[1] > 0
        finally:
            log_view.release()
            if mapping is not None:
                mapping.close()
        if whole:
            raise CheckpointError(
                f"journal {path}: the record at byte {bad} is damaged and a later log ({log.name}) holds records: "
                f"the journal is corrupt, not cut short by a crash")


def torn(view: memoryview, number: int, at: int) -> bool:
    """True if a record of file `number` begins at byte `at` and is not whole: its head was written, not its
    end (a write cut short). False for bytes left from the file's earlier use: no record's head there (zeros,
    the middle of an older record), or a whole record of the file it was before."""
    if bytes(view[at:at + len(MAGIC)]) != MAGIC:
        return False
    if at + _HEAD.size <= len(view):
        _, meta_len, data_len = _HEAD.unpack_from(view, at)
        tail_at = at + _HEAD.size + meta_len + data_len
        if tail_at + _TAIL.size <= len(view):
            earlier = _TAIL.unpack_from(view, tail_at)[2]
            if earlier != number and _decode(view, at, earlier, check_only=True)[1] > at:
                return False
    return True


def mapped(path: pathlib.Path) -> tuple[memoryview, mmap.mmap | None]:
    """A read-only view of a file's bytes and its mapping to close() when done (mapped, not read)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return memoryview(b""), None
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    return memoryview(mapping), mapping


def state_record(state: dict) -> dict[str, torch.Tensor]:
    """The tensors of a base record holding `state`: each of its tensors (not copied), and its skeleton (the
    rest, by torch.save) as "skeleton"."""
    tensors: dict[str, torch.Tensor] = {}

    def strip(value):
        if isinstance(value, torch.Tensor):
            tensors[str(len(tensors))] = value
            return (_TENSOR, len(tensors) - 1)
        if isinstance(value, dict):
            return {key: strip(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(item) for item in value)
        return value

    skeleton, buffer = strip(state), io.BytesIO()
    torch.save(skeleton, buffer)
    tensors["skeleton"] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    return tensors


def state_of_record(record: Record) -> dict:
    """The state a base record (state_record) holds."""
    tensors = dict(record.tensors)
    skeleton = torch.load(io.BytesIO(tensors.pop("skeleton").numpy().tobytes()), weights_only=True)

    def fill(value):
        if isinstance(value, tuple) and len(value) == 2 and value[0] == _TENSOR:
            return tensors[str(value[1])]
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(item) for item in value)
        return value

    return fill(skeleton)


def _decode(view: memoryview, offset: int, number: int, *, check_only: bool = False) -> tuple[Record | None, int]:
    """The record of file `number` at `offset` and where the next begins, or (None, offset) if there is none
    whole (torn, damaged, or left from the file's earlier use). `check_only`: (None, end) for a whole one."""
    if offset + _HEAD.size > len(view):
        return None, offset
    magic, meta_len, data_len = _HEAD.unpack_from(view, offset)
    data_at = offset + _HEAD.size + meta_len
    tail_at = data_at + data_len
    if magic != MAGIC or tail_at + _TAIL.size > len(view):
        return None, offset
    head_check, data_check, tail_number, end = _TAIL.unpack_from(view, tail_at)
    if (end != END or tail_number != number
            or zlib.adler32(_NUMBER.pack(number), zlib.adler32(view[offset:data_at])) != head_check):
        return None, offset
    try:
        meta = json.loads(bytes(view[offset + _HEAD.size:data_at]))
        entries = meta.pop("tensors")
    except (ValueError, KeyError):
        return None, offset
    pieces, at = [], data_at
    for name, dtype, shape, nbytes in entries:
        pieces.append((name, dtype, shape, view[at:at + nbytes]))
        at += nbytes
    if at != tail_at or sum(_sum64(piece[3]) for piece in pieces) & _MASK != data_check:
        return None, offset
    if check_only:
        return None, tail_at + _TAIL.size
    tensors = {}
    for name, dtype, shape, raw in pieces:
        torch_type = getattr(torch, dtype, None)
        if not isinstance(torch_type, torch.dtype):
            raise CheckpointError(f"a journal record holds a tensor of dtype {dtype!r}, which this torch lacks")
        tensors[name] = (torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).view(torch_type).reshape(shape)
                         if len(raw) else torch.empty(shape, dtype=torch_type))
    return Record(meta.pop("kind"), meta, tensors), tail_at + _TAIL.size
