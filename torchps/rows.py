"""Embedding-table rows on the wire, shared by shards and clients: which shard owns an id, and ROWS tensors.

Partitions (ps.proto's TablePartition): "modulo" puts id on shard id mod n
(floor modulo: non-negative for negative ids), "hash" on splitmix64(id) mod n,
where splitmix64 is SplitMix64's output function of the id read as uint64.

A ROWS tensor (Encoding ROWS) carries a table's row gradients in a push:
meta [n, dim] of the table's dtype, bytes = n int64 ids, then the n x dim
values. No gRPC here.
"""

from __future__ import annotations

import numpy as np
import torch

from . import codec
from .compression import Encoded
from .errors import InvalidArgumentError
from .proto import ps_pb2

__all__ = ["PARTITIONS", "GOLDEN", "splitmix64", "owner", "shard_of", "partition_name", "partition_enum",
           "encode_rows", "decode_rows", "ids_bytes", "ids_from_bytes"]

PARTITIONS = ("modulo", "hash")
_WIRE_PARTITIONS = {"modulo": ps_pb2.PARTITION_MODULO, "hash": ps_pb2.PARTITION_HASH}
GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of each uint64 (arithmetic mod 2^64)."""
    with np.errstate(over="ignore"):
        z = z + GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def owner(ids: np.ndarray, num_shards: int, partition: str) -> np.ndarray:
    """The shard of each int64 id (numpy, unchecked)."""
    if partition == "hash":
        return (splitmix64(ids.view(np.uint64)) % np.uint64(num_shards)).astype(np.int64)
    return np.mod(ids, num_shards)


def shard_of(ids: torch.Tensor, num_shards: int, partition: str = "modulo") -> torch.Tensor:
    """The shard (0 .. num_shards-1) of each id of a 1-D int64 tensor under `partition`; InvalidArgumentError
    for other ids, an unknown partition or fewer than one shard."""
    if partition not in PARTITIONS or num_shards < 1:
        raise InvalidArgumentError(f"partition must be one of {PARTITIONS} over >= 1 shards; "
                                   f"got {partition!r} over {num_shards}")
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        raise InvalidArgumentError(f"ids must be a 1-D int64 tensor, got {getattr(ids, 'dtype', type(ids))} of "
                                   f"shape {tuple(getattr(ids, 'shape', ()))}")
    return torch.from_numpy(owner(ids.detach().cpu().contiguous().numpy(), num_shards, partition))


def partition_name(wire: int) -> str:
    """"modulo" or "hash" for a TablePartition value; InvalidArgumentError for another."""
    for name, value in _WIRE_PARTITIONS.items():
        if value == wire:
            return name
    raise InvalidArgumentError(f"unknown table partition {wire} (TablePartition enum)")


def partition_enum(name: str) -> int:
    """The TablePartition value of "modulo" or "hash"; InvalidArgumentError for another name."""
    try:
        return _WIRE_PARTITIONS[name]
    except KeyError:
        raise InvalidArgumentError(f"partition must be one of {PARTITIONS}. Received: {name!r}") from None


def ids_bytes(ids: torch.Tensor) -> bytes:
    """A 1-D int64 tensor as raw little-endian bytes (TableIds.ids)."""
    return codec.tensor_bytes(ids.detach().cpu().to(torch.int64)).tobytes()


def ids_from_bytes(raw: bytes) -> torch.Tensor:
    """TableIds.ids as a 1-D int64 tensor (a copy); InvalidArgumentError unless it is whole int64s."""
    if len(raw) % 8:
        raise InvalidArgumentError(f"ids must be raw int64s (8 bytes each); got {len(raw)} bytes")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i8").copy())


def encode_rows(ids: torch.Tensor, values: torch.Tensor) -> Encoded:
    """A ROWS tensor of row gradients: values[i] for ids[i] (1-D int64, (n, dim) floats), for a push."""
    values = values.detach().cpu().contiguous()
    ids = ids.detach().cpu().to(torch.int64).contiguous()
    if values.dim() != 2 or values.shape[0] != ids.numel():
        raise InvalidArgumentError(f"row gradients must be (len(ids), dim) = ({ids.numel()}, dim); "
                                   f"got {tuple(values.shape)}")
    payload = torch.cat([ids.view(torch.uint8), values.reshape(-1).view(torch.uint8)])
    meta = ps_pb2.TensorMeta(dtype=codec.wire_dtype(values.dtype), shape=list(values.shape), encoding=ps_pb2.ROWS)
    return Encoded(meta, payload)


def decode_rows(meta: ps_pb2.TensorMeta, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, values) of a complete ROWS tensor's bytes (codec.meta_nbytes(meta) of them), sharing their memory."""
    n, dim = meta.shape
    split = 8 * n
    ids = codec.dense_tensor(ps_pb2.TensorMeta(dtype=ps_pb2.INT64, shape=[n]), raw[:split])
    values = codec.dense_tensor(ps_pb2.TensorMeta(dtype=meta.dtype, shape=[n, dim]), raw[split:])
    return ids, values
