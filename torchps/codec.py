"""Tensors to and from chunk streams (TensorChunk messages). No gRPC here.

Wire form: dtype + shape + raw little-endian bytes (or a compressed encoding,
see torchps/compression.py), cut into chunks of at most `chunk_bytes`.
`split` cuts; `ChunkAssembler` glues back and enforces the stream rules of
ps.proto (contiguous offsets, one tensor at a time, no overrun, nothing
missing), raising MalformedStreamError otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Callable, Iterator

import numpy as np
import torch

from .errors import InvalidArgumentError, MalformedStreamError, TensorMismatchError
from .lanes import LaneBytes
from .proto import ps_pb2
from .sizes import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_CHUNK_BYTES, ENVELOPE_BYTES, MIN_CHUNK_BYTES


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_CHUNK_BYTES",
    "ENVELOPE_BYTES",
    "MIN_CHUNK_BYTES",
    "check_chunk_bytes",
    "torch_dtype",
    "wire_dtype",
    "meta_of",
    "meta_nbytes",
    "dense_tensor",
    "describe_meta",
    "byte_array",
    "tensor_bytes",
    "split",
    "encode_chunks",
    "WireChunk",
    "ChunkAssembler",
]


if sys.byteorder != "little":  # the wire is little-endian and we send memory as is
    raise ImportError("torchps supports little-endian hosts only")

_TO_TORCH = {
    ps_pb2.FLOAT32: torch.float32,
    ps_pb2.FLOAT64: torch.float64,
    ps_pb2.FLOAT16: torch.float16,
    ps_pb2.BFLOAT16: torch.bfloat16,
    ps_pb2.INT32: torch.int32,
    ps_pb2.INT64: torch.int64,
}
_TO_WIRE = {v: k for k, v in _TO_TORCH.items()}


def check_chunk_bytes(chunk_bytes: int, maximum: int = DEFAULT_MAX_CHUNK_BYTES) -> None:
    """InvalidArgumentError unless MIN_CHUNK_BYTES <= chunk_bytes <= maximum."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= maximum:
        raise InvalidArgumentError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {maximum}]. Received: {chunk_bytes}")


def torch_dtype(wire: int) -> torch.dtype:
    """The torch dtype of a DType enum value; InvalidArgumentError if unsupported."""
    try:
        return _TO_TORCH[wire]
    except KeyError:
        raise InvalidArgumentError(f"unsupported or missing dtype {wire!r} (DType enum)") from None


def wire_dtype(dtype: torch.dtype) -> int:
    """The DType enum value of a torch dtype; InvalidArgumentError if unsupported."""
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in _TO_WIRE)
        raise InvalidArgumentError(f"dtype {dtype} is not supported on the wire; use one of {supported}") from None


def meta_of(tensor: torch.Tensor) -> ps_pb2.TensorMeta:
    """The TensorMeta describing `tensor`."""
    return ps_pb2.TensorMeta(dtype=wire_dtype(tensor.dtype), shape=list(tensor.shape))


def meta_nbytes(meta: ps_pb2.TensorMeta) -> int:
    """Byte size a meta declares (DENSE, SPARSE or ROWS); InvalidArgumentError for bad dtype, shape, encoding or nnz."""
    dtype = torch_dtype(meta.dtype)
    if any(d < 0 for d in meta.shape):
        raise InvalidArgumentError(f"negative dimension in shape {list(meta.shape)}")
    numel = math.prod(meta.shape)
    if meta.encoding == ps_pb2.DENSE:
        if meta.nnz:
            raise InvalidArgumentError(f"nnz is for SPARSE tensors only; this one is DENSE with nnz {meta.nnz}")
        return numel * dtype.itemsize
    if meta.encoding in (ps_pb2.SPARSE, ps_pb2.DELTA):
        least = 1 if meta.encoding == ps_pb2.SPARSE else 0
        if not least <= meta.nnz <= numel:
            raise InvalidArgumentError(f"{ps_pb2.Encoding.Name(meta.encoding)} nnz must be in [{least}, {numel}] "
                                       f"for shape {list(meta.shape)}. Received: {meta.nnz}")
        return meta.nnz * ((4 if numel < 2 ** 31 else 8) + dtype.itemsize)
    if meta.encoding == ps_pb2.ROWS:
        if len(meta.shape) != 2 or meta.nnz:
            raise InvalidArgumentError(f"ROWS tensors are [rows, dim] with no nnz; got shape {list(meta.shape)}, "
                                       f"nnz {meta.nnz}")
        return meta.shape[0] * (8 + meta.shape[1] * dtype.itemsize)
    raise InvalidArgumentError(f"unknown encoding {meta.encoding} (Encoding enum)")


def _new_buffer(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def dense_tensor(meta: ps_pb2.TensorMeta, raw: np.ndarray) -> torch.Tensor:
    """A DENSE tensor's bytes (uint8, meta_nbytes(meta) of them) as the tensor, sharing their memory."""
    dtype, shape = torch_dtype(meta.dtype), tuple(meta.shape)
    # numpy gives empty arrays a zero stride, which torch cannot reinterpret as another dtype.
    return torch.from_numpy(raw).view(dtype).reshape(shape) if raw.size else torch.empty(shape, dtype=dtype)


def describe_meta(meta: ps_pb2.TensorMeta) -> str:
    """'float32[3, 4]' for error messages."""
    name = str(_TO_TORCH.get(meta.dtype, f"dtype#{meta.dtype}")).removeprefix("torch.")
    return f"{name}{list(meta.shape)}"


def byte_array(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory; writes go to the tensor."""
    if not tensor.numel():  # an empty tensor from numpy has a zero stride, which view() refuses
        return np.empty(0, dtype=np.uint8)
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's memory (of a contiguous copy if it is not contiguous)."""
    return memoryview(byte_array(tensor.detach().contiguous()))


def split(tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[int, memoryview]]:
    """(offset, bytes view) pieces of a CPU tensor's memory: at least one, even if empty.

    The views alias the tensor (or a contiguous copy of it): encode them
    before the tensor changes.
    """
    if chunk_bytes <= 0:
        raise InvalidArgumentError(f"chunk_bytes must be positive, got {chunk_bytes}")
    raw = tensor_bytes(tensor)
    return [(offset, raw[offset:offset + chunk_bytes]) for offset in range(0, max(len(raw), 1), chunk_bytes)]


def encode_chunks(name: str, tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[ps_pb2.TensorChunk]:
    """TensorChunk messages for a CPU tensor (the generated-class path; see wire.py for the fast one)."""
    meta = meta_of(tensor)
    for offset, piece in split(tensor, chunk_bytes):
        yield ps_pb2.TensorChunk(name=name, meta=meta if offset == 0 else None, offset=offset, data=piece.tobytes())


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


class ChunkAssembler:
    """Rebuilds whole tensors from a validated stream of chunks (wire.WireChunk); shards and clients alike.

    `begin(name, meta)` is called with each new tensor's name and meta before
    any memory is allocated; it may raise (unknown variable, wrong shape) to
    reject the stream early. Bytes go into `sink(name, meta)`'s uint8 buffer
    (of exactly the tensor's size) if given, else into `allocate(nbytes)`
    (a shard's kept receive buffers) or fresh memory, which goes back to the
    allocator with the last tensor using it (a big block back to the kernel:
    see torchps.memory). Every chunk but a tensor's last must carry at least
    `min_chunk` bytes. A complete tensor is `decode(name, meta, buffer)` if
    given (a shard decoding compressed gradients), else the buffer viewed as
    the meta's DENSE tensor; without `decode`, a SPARSE meta is refused. A
    DELTA tensor (a delta pull's reply) goes into fresh memory and, complete,
    to `delta(name, meta, buffer)`; without `delta` it is refused. `versions`
    holds each tensor's TensorChunk.version (its first chunk's). Not
    thread-safe: one assembler per stream.
    """

    def __init__(self, begin: Callable[[str, ps_pb2.TensorMeta], None] | None = None,
                 *, sink: Callable[[str, ps_pb2.TensorMeta], np.ndarray] | None = None,
                 decode: Callable[[str, ps_pb2.TensorMeta, np.ndarray], torch.Tensor] | None = None,
                 delta: Callable[[str, ps_pb2.TensorMeta, np.ndarray], None] | None = None,
                 allocate: Callable[[int], np.ndarray] | None = None, min_chunk: int = MIN_CHUNK_BYTES):
        self._begin = begin
        self._allocate = allocate or _new_buffer
        self._sink = sink
        self._decode = decode
        self._delta = delta
        self.min_chunk = min_chunk
        self._name: str | None = None
        self._meta: ps_pb2.TensorMeta | None = None
        self._buffer: np.ndarray | None = None
        self._filled = 0
        self._seen: set[str] = set()
        self.versions: dict[str, int] = {}

    def add(self, chunk: WireChunk | ps_pb2.TensorChunk, meta: ps_pb2.TensorMeta | None = None
            ) -> tuple[str, torch.Tensor | None] | None:
        """Feeds one chunk; returns (name, tensor) when that tensor is complete (tensor None with a sink).

        `meta` stands in for a first chunk that carries none (CreateVariables
        sends it in the spec).
        """
        if isinstance(chunk, ps_pb2.TensorChunk):
            chunk = WireChunk.from_proto(chunk)
        if self._name is None:
            self._start(chunk, meta)
        elif chunk.name != self._name:
            raise MalformedStreamError(
                f"chunk for {chunk.name!r} arrived while {self._name!r} had {self._filled} of "
                f"{len(self._buffer)} bytes: chunks are missing")
        elif chunk.meta is not None or chunk.offset != self._filled:
            raise MalformedStreamError(
                f"chunk of {self._name!r} at offset {chunk.offset} (meta set: {chunk.meta is not None}) "
                f"where offset {self._filled} was expected: chunks are missing, duplicated or out of order")
        data = chunk.data
        end = self._filled + len(data)
        if end > len(self._buffer):
            raise MalformedStreamError(
                f"chunks of {self._name!r} run to byte {end}, past the {len(self._buffer)} bytes "
                f"its meta {describe_meta(self._meta)} declares")
        if end < len(self._buffer) and len(data) < self.min_chunk:
            raise MalformedStreamError(
                f"a chunk of {self._name!r} carries {len(data)} bytes and is not its last: chunks must carry at "
                f"least {self.min_chunk} bytes")
        if isinstance(data, LaneBytes):  # read from the call's bulk lane straight into place
            data.read_into(memoryview(self._buffer)[self._filled:end])
        else:
            self._buffer[self._filled:end] = np.frombuffer(data, dtype=np.uint8)
        self._filled = end
        if end < len(self._buffer):
            return None
        return self._complete()

    @property
    def seen(self) -> set[str]:
        """Names of the tensors started so far."""
        return self._seen

    def finish(self) -> None:
        """Raises MalformedStreamError if the stream ended inside a tensor."""
        if self._name is not None:
            raise MalformedStreamError(
                f"stream ended with {self._name!r} incomplete: {self._filled} of {len(self._buffer)} bytes arrived")

    def _start(self, chunk: WireChunk, meta: ps_pb2.TensorMeta | None) -> None:
        if not chunk.name:
            raise MalformedStreamError("chunk without a variable name")
        if chunk.offset != 0:
            raise MalformedStreamError(
                f"first chunk of {chunk.name!r} has offset {chunk.offset}, expected 0: chunks are missing or out of order")
        if chunk.name in self._seen:
            raise MalformedStreamError(f"{chunk.name!r} appears twice in one stream")
        if chunk.meta is not None:
            if meta is not None and chunk.meta != meta:
                raise TensorMismatchError(
                    f"{chunk.name!r}: chunk declares {describe_meta(chunk.meta)} but the spec says {describe_meta(meta)}")
            meta = chunk.meta
        if meta is None:
            raise MalformedStreamError(f"first chunk of {chunk.name!r} carries no meta (dtype and shape)")
        try:
            nbytes = meta_nbytes(meta)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{chunk.name!r}: {exc}") from None
        if meta.encoding == ps_pb2.DELTA:
            if self._delta is None:
                raise InvalidArgumentError(f"{chunk.name!r}: DELTA tensors are for delta pulls' replies only")
        elif meta.encoding != ps_pb2.DENSE and self._decode is None:
            raise InvalidArgumentError(f"{chunk.name!r}: {ps_pb2.Encoding.Name(meta.encoding)} tensors are for pushes only")
        if self._begin is not None:
            self._begin(chunk.name, meta)
        if self._sink is not None and meta.encoding != ps_pb2.DELTA:
            self._buffer = self._sink(chunk.name, meta)
            if self._buffer.size != nbytes:
                raise MalformedStreamError(f"{chunk.name!r}: the stream declares {nbytes} bytes where "
                                           f"{self._buffer.size} are expected")
        else:
            try:
                self._buffer = self._allocate(nbytes)
            except (MemoryError, ValueError):
                raise InvalidArgumentError(f"cannot allocate {nbytes} bytes for {chunk.name!r}") from None
        self._name, self._meta, self._filled = chunk.name, meta, 0
        self._seen.add(chunk.name)
        self.versions[chunk.name] = chunk.version

    def _complete(self) -> tuple[str, torch.Tensor | None]:
        if self._meta.encoding == ps_pb2.DELTA:
            self._delta(self._name, self._meta, self._buffer)
            name, self._name, self._meta, self._buffer, self._filled = self._name, None, None, None, 0
            return name, None
        if self._sink is not None:  # the bytes are in the caller's own tensor already
            name, self._name, self._meta, self._buffer, self._filled = self._name, None, None, None, 0
            return name, None
        if self._decode is not None:
            tensor = self._decode(self._name, self._meta, self._buffer)
        else:
            tensor = dense_tensor(self._meta, self._buffer)
        result = (self._name, tensor)
        self._name = self._meta = self._buffer = None
        self._filled = 0
        return result

