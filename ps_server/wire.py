"""Hand-coded protobuf wire format for the two hot messages: PullResponse and PushRequest.

Bulk tensor bytes dominate the cost of Pull and Push. The generated classes
copy a chunk's `data` several times (into the message, into the serialized
string, out of the parsed message). These functions produce and read exactly
the bytes ps.proto defines, with one copy when encoding and none when
decoding (`data` is a memoryview into the received message). Every other
message, and every client that uses the generated stubs, interoperates
unchanged: tests check byte equality with the generated classes.
"""

from __future__ import annotations

import dataclasses

from .errors import MalformedStreamError
from .proto import ps_pb2

__all__ = ["WireChunk", "encode_pull_response", "encode_push_chunk", "decode_pull_response", "decode_push_request"]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


@dataclasses.dataclass
class WireChunk:
    """A TensorChunk with `data` as a zero-copy memoryview and `meta` None when absent."""

    name: str
    meta: ps_pb2.TensorMeta | None
    offset: int
    data: memoryview
    version: int = 0

    @classmethod
    def from_proto(cls, chunk: ps_pb2.TensorChunk) -> "WireChunk":
        meta = chunk.meta if chunk.HasField("meta") else None
        return cls(chunk.name, meta, chunk.offset, memoryview(chunk.data), chunk.version)


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


def _encode(field: int, name: str, meta: ps_pb2.TensorMeta | None, offset: int, data, version: int,
            trailer: bytes) -> bytes:
    head, tail = _chunk_parts(name.encode(), None if meta is None else meta.SerializeToString(), offset, data, version)
    inner = len(head) + len(data) + len(tail)
    return b"".join((_key(field, _LEN), _varint(inner), head, data, tail, trailer))


def encode_pull_response(name: str, meta: ps_pb2.TensorMeta | None, offset: int, data, version: int,
                         step: int) -> bytes:
    """Serialized PullResponse{chunk: TensorChunk{...}, step}; `data` is any bytes-like object."""
    trailer = _key(2, _VARINT) + _varint(step & (1 << 64) - 1) if step else b""
    return _encode(1, name, meta, offset, data, version, trailer)


def encode_push_chunk(name: str, meta: ps_pb2.TensorMeta | None, offset: int, data) -> bytes:
    """Serialized PushRequest{chunk: TensorChunk{...}}; `data` is any bytes-like object."""
    return _encode(2, name, meta, offset, data, 0, b"")


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
    chunk = WireChunk("", None, 0, memoryview(b""))
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
    return chunk


def decode_pull_response(raw: bytes) -> tuple[WireChunk, int]:
    """(chunk, step) from a serialized PullResponse; `chunk.data` views `raw`."""
    chunk, step = None, 0
    for field, wire_type, value in _fields(memoryview(raw)):
        if field == 1 and wire_type == _LEN:
            chunk = _decode_chunk(value)
        elif field == 2 and wire_type == _VARINT:
            step = value - (1 << 64) if value >= 1 << 63 else value
    if chunk is None:
        raise MalformedStreamError("PullResponse without a chunk")
    return chunk, step


def decode_push_request(raw: bytes) -> tuple[ps_pb2.PushHeader | None, WireChunk | None]:
    """(header or None, chunk or None) from a serialized PushRequest; `chunk.data` views `raw`."""
    header = chunk = None
    for field, wire_type, value in _fields(memoryview(raw)):
        if field == 1 and wire_type == _LEN:
            header = ps_pb2.PushHeader.FromString(bytes(value))
        elif field == 2 and wire_type == _LEN:
            chunk = _decode_chunk(value)
    return header, chunk
