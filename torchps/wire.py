"""Hand-coded protobuf wire format for the two hot messages: PullResponse and PushRequest.

Bulk tensor bytes dominate the cost of Pull and Push. The generated classes
copy a chunk's `data` several times (into the message, into the serialized
string, out of the parsed message). These functions produce and read exactly
the bytes ps.proto defines, with one copy when encoding and none when
decoding (`data` is a memoryview into the received message). `pack` puts
many small tensors into one message, so a small model moves in one message
per shard each way. Every other
message, and every client that uses the generated stubs, interoperates
unchanged: tests check byte equality with the generated classes.
"""

from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple

import torch

from . import codec
from .errors import MalformedStreamError
from .lanes import LaneBytes
from .codec import WireChunk
from .proto import ps_pb2

__all__ = ["Piece", "PullMessage", "tensor_pieces", "delta_pieces", "byte_pieces", "pack", "encode_pull_response",
           "encode_push_request", "decode_pull_response", "decode_push_request"]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _chunk_parts(name: bytes, meta: bytes | None, offset: int, data, version: int) -> tuple[bytes, bytes]:
    """(bytes before data, bytes after data) of a serialized TensorChunk, fields in number order."""
    head = [_key(1, _LEN), _varint(len(name)), name]
    if meta is not None:
        head += [_key(2, _LEN), _varint(len(meta)), meta]
    if offset:
        head += [_key(3, _VARINT), _varint(offset)]
    if len(data):
        head += [_key(4, _LEN), _varint(len(data))]
    tail = _key(5, _VARINT) + _varint(version) if version else b""
    return b"".join(head), tail


Piece = tuple  # (name, meta or None, offset, bytes-like data, version): one TensorChunk to encode


def tensor_pieces(name: str, tensor: torch.Tensor, chunk_bytes: int, version: int = 0) -> list[Piece]:
    """The pieces of one CPU tensor: meta and version on the first only. Views alias the tensor."""
    meta = codec.meta_of(tensor)
    return [(name, meta if offset == 0 else None, offset, view, version if offset == 0 else 0)
            for offset, view in codec.split(tensor, chunk_bytes)]


def delta_pieces(name: str, shape, version: int, index: torch.Tensor, values: torch.Tensor,
                 chunk_bytes: int) -> list[Piece]:
    """The pieces of a DELTA tensor of `shape` (ps.proto): flat `index` (compression.index_dtype) then `values`,
    copied once into one payload that the pieces view; meta and version on the first."""
    payload = codec.tensor_bytes(torch.cat([index.view(torch.uint8), values.view(torch.uint8)]))
    meta = ps_pb2.TensorMeta(dtype=codec.wire_dtype(values.dtype), shape=shape, encoding=ps_pb2.DELTA,
                             nnz=index.numel())
    return byte_pieces(name, meta, payload, chunk_bytes, version)


def byte_pieces(name: str, meta: ps_pb2.TensorMeta, raw: memoryview, chunk_bytes: int, version: int = 0
                ) -> list[Piece]:
    """The pieces of one tensor's bytes `raw` (`meta` describes them), chunk_bytes each (at least one piece):
    meta and version on the first. Views alias `raw`."""
    return [(name, meta if offset == 0 else None, offset, raw[offset:offset + chunk_bytes],
             version if offset == 0 else 0) for offset in range(0, max(len(raw), 1), chunk_bytes)]


def pack(pieces: Iterable[Piece], chunk_bytes: int) -> Iterator[list[Piece]]:
    """Groups pieces into messages of at most chunk_bytes of data (a larger piece goes alone)."""
    batch, size = [], 0
    for piece in pieces:
        if batch and size + len(piece[3]) > chunk_bytes:
            yield batch
            batch, size = [], 0
        batch.append(piece)
        size += len(piece[3])
    if batch:
        yield batch


def _encode_chunks(field: int, pieces: Iterable[Piece], out: list, lane: bool = False) -> None:
    for name, meta, offset, data, version in pieces:
        head, tail = _chunk_parts(name.encode(), None if meta is None else meta.SerializeToString(),
                                  offset, b"" if lane else data, version)
        if lane:  # the data follows on the call's bulk lane (torchps/lanes.py): only its length goes here
            tail += _key(6, _VARINT) + _varint(len(data)) if len(data) else b""
            out += [_key(field, _LEN), _varint(len(head) + len(tail)), head, tail]
        else:
            out += [_key(field, _LEN), _varint(len(head) + len(data) + len(tail)), head, data, tail]


def encode_pull_response(pieces: Iterable[Piece], step: int, result: ps_pb2.PushResponse | None = None,
                         generation: int = 0, lane: bool = False) -> bytes:
    """Serialized PullResponse{chunks, step, result, generation}, copying each piece's data once; with
    `lane`, each chunk's lane_bytes in place of its data (which the caller sends on the lane)."""
    out: list = []
    _encode_chunks(1, pieces, out, lane)
    if step:
        out += [_key(2, _VARINT), _varint(step & (1 << 64) - 1)]
    if result is not None:
        raw = result.SerializeToString()
        out += [_key(3, _LEN), _varint(len(raw)), raw]
    if generation:
        out += [_key(4, _VARINT), _varint(generation)]
    return b"".join(out)


def encode_push_request(header: ps_pb2.PushHeader | None, pieces: Iterable[Piece],
                        end: ps_pb2.PushEnd | None = None, lane: bool = False) -> bytes:
    """Serialized PushRequest{header, chunks, end}, copying each piece's data once; with `lane`, each
    chunk's lane_bytes in place of its data (which the caller sends on the lane).

    `end` closes a streamed push (PushHeader.streamed): the stream's last message carries it.
    """
    out: list = []
    if header is not None:
        raw = header.SerializeToString()
        out += [_key(1, _LEN), _varint(len(raw)), raw]
    _encode_chunks(2, pieces, out, lane)
    if end is not None:
        raw = end.SerializeToString()
        out += [_key(3, _LEN), _varint(len(raw)), raw]
    return b"".join(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise MalformedStreamError("malformed protobuf message: bad varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview):
    """Yields (field number, wire type, value): int for varints/fixed, memoryview for LEN."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire_type == _LEN:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise MalformedStreamError("malformed protobuf message: field runs past the end")
            value, pos = buf[pos:pos + size], pos + size
        elif wire_type in (_I64, _I32):
            width = 8 if wire_type == _I64 else 4
            if pos + width > len(buf):
                raise MalformedStreamError("malformed protobuf message: truncated fixed field")
            value, pos = int.from_bytes(buf[pos:pos + width], "little"), pos + width
        else:
            raise MalformedStreamError(f"malformed protobuf message: wire type {wire_type}")
        if field == 0:
            raise MalformedStreamError("malformed protobuf message: field number 0")
        yield field, wire_type, value


def _decode_chunk(buf: memoryview) -> WireChunk:
    """A TensorChunk; with lane_bytes, its data a lanes.LaneBytes to be read from the call's lane."""
    chunk = WireChunk("", None, 0, memoryview(b""))
    lane_bytes = 0
    for field, wire_type, value in _fields(buf):
        if field == 1 and wire_type == _LEN:
            try:
                chunk.name = bytes(value).decode()
            except UnicodeDecodeError:
                raise MalformedStreamError("variable name is not valid UTF-8") from None
        elif field == 2 and wire_type == _LEN:
            meta = chunk.meta or ps_pb2.TensorMeta()
            meta.MergeFromString(bytes(value))  # repeated fields of a message merge, as protobuf does
            chunk.meta = meta
        elif field == 3 and wire_type == _VARINT:
            chunk.offset = value
        elif field == 4 and wire_type == _LEN:
            chunk.data = value
        elif field == 5 and wire_type == _VARINT:
            chunk.version = value
        elif field == 6 and wire_type == _VARINT and value:
            lane_bytes = value
    if lane_bytes:
        if len(chunk.data):
            raise MalformedStreamError(f"a chunk of {chunk.name!r} carries both data and lane_bytes")
        chunk.data = LaneBytes(lane_bytes)
    return chunk


class PullMessage(NamedTuple):
    """A decoded PullResponse: chunks (data viewing the message), step, PushPull result or None, generation."""

    chunks: list[WireChunk]
    step: int
    result: ps_pb2.PushResponse | None
    generation: int


def decode_pull_response(raw: bytes) -> PullMessage:
    """A serialized PullResponse as a PullMessage; chunk data views `raw`."""
    chunks, step, result, generation = [], 0, None, 0
    for field, wire_type, value in _fields(memoryview(raw)):
        if field == 1 and wire_type == _LEN:
            chunks.append(_decode_chunk(value))
        elif field == 2 and wire_type == _VARINT:
            step = value - (1 << 64) if value >= 1 << 63 else value
        elif field == 3 and wire_type == _LEN:
            result = ps_pb2.PushResponse.FromString(bytes(value))
        elif field == 4 and wire_type == _VARINT:
            generation = value
    return PullMessage(chunks, step, result, generation)


def decode_push_request(raw: bytes) -> tuple[ps_pb2.PushHeader | None, list[WireChunk], ps_pb2.PushEnd | None]:
    """(header or None, chunks, end or None) from a serialized PushRequest; chunk data views `raw`.

    A message field given twice merges, as protobuf parsers do.
    """
    header, chunks, end = None, [], None
    for field, wire_type, value in _fields(memoryview(raw)):
        if field == 1 and wire_type == _LEN:
            header = header or ps_pb2.PushHeader()
            header.MergeFromString(bytes(value))
        elif field == 2 and wire_type == _LEN:
            chunks.append(_decode_chunk(value))
        elif field == 3 and wire_type == _LEN:
            end = end or ps_pb2.PushEnd()
            end.MergeFromString(bytes(value))
    return header, chunks, end
