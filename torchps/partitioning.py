"""Variables split along axis 0 into pieces on different shards: policies and the name -> pieces map.

A partitioned variable `w` travels and is stored as variables named
`w/part_0`, `w/part_1`, ... (TensorFlow's names), each a run of whole rows:
the first `rows % n` pieces hold one row more than the others. Pieces are
placed like any variable, in order, so with round-robin placement the pieces
of one variable land on different shards. Everything a user sees (modules,
pull, push, exchange, export_state_dict) speaks of whole variables; the
pieces of a contiguous tensor are views of it, so splitting copies nothing.

The policies are TensorFlow's (tf.distribute.experimental.partitioners):
* MinSizePartitioner(min_shard_bytes=256 KiB, max_shards=None): as many
  pieces as keep each at least min_shard_bytes, at most max_shards (None:
  the number of shards) - the default;
* MaxSizePartitioner(max_shard_bytes, max_shards=None): as few pieces as
  keep each at most max_shard_bytes;
* FixedShardsPartitioner(num_shards): that many pieces.
A variable is never cut into more pieces than it has rows. No gRPC here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

import torch

from .errors import ClusterConfigError, TensorMismatchError

__all__ = ["Partitioner", "MinSizePartitioner", "MaxSizePartitioner", "FixedShardsPartitioner", "NoPartitioner",
           "Partitions", "check_manifest", "row_ranges", "piece_names", "partitioner_from_dict", "partitioner_from_spec", "DEFAULT_MIN_SHARD_BYTES"]

DEFAULT_MIN_SHARD_BYTES = 256 << 10  # TensorFlow's tutorial default


class Partitioner:
    """How many pieces a variable of `shape` and `itemsize` bytes per element is cut into over `num_ps` shards."""

    kind = ""

    def num_pieces(self, shape: tuple[int, ...], itemsize: int, num_ps: int) -> int:
        raise NotImplementedError

    def to_dict(self) -> dict:
        """JSON-able form, kept in checkpoint manifests so a restore onto another shard count re-cuts alike."""
        return {"kind": self.kind, **dataclasses.asdict(self)}

    def pieces(self, shape: tuple[int, ...], itemsize: int, num_ps: int) -> int:
        """num_pieces, bounded to [1, rows]; scalars are never cut."""
        if not shape or shape[0] < 2:
            return 1
        return max(1, min(shape[0], self.num_pieces(tuple(shape), itemsize, num_ps)))


def _check_positive(owner: str, **values) -> None:
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ClusterConfigError(f"{owner}: {name} must be a positive integer or None. Received: {value!r}")


@dataclasses.dataclass(frozen=True)
class NoPartitioner(Partitioner):
    """Every variable stays whole (PSClient(partitioner=None))."""

    kind = "none"

    def num_pieces(self, shape, itemsize, num_ps) -> int:
        return 1


@dataclasses.dataclass(frozen=True)
class MinSizePartitioner(Partitioner):
    """As many pieces as keep each at least min_shard_bytes, at most max_shards (None: the shard count)."""

    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES
    max_shards: int | None = None
    kind = "min_size"

    def __post_init__(self):
        _check_positive("MinSizePartitioner", min_shard_bytes=self.min_shard_bytes, max_shards=self.max_shards)

    def num_pieces(self, shape, itemsize, num_ps) -> int:
        nbytes = math.prod(shape) * itemsize
        return min(self.max_shards or num_ps, nbytes // self.min_shard_bytes)


@dataclasses.dataclass(frozen=True)
class MaxSizePartitioner(Partitioner):
    """As few pieces as keep each at most max_shard_bytes (at most max_shards of them, if given)."""

    max_shard_bytes: int
    max_shards: int | None = None
    kind = "max_size"

    def __post_init__(self):
        _check_positive("MaxSizePartitioner", max_shard_bytes=self.max_shard_bytes, max_shards=self.max_shards)

    def num_pieces(self, shape, itemsize, num_ps) -> int:
        wanted = -(-math.prod(shape) * itemsize // self.max_shard_bytes)
        return min(wanted, self.max_shards) if self.max_shards else wanted


@dataclasses.dataclass(frozen=True)
class FixedShardsPartitioner(Partitioner):
    """num_shards pieces (fewer only for a variable with fewer rows)."""

    num_shards: int
    kind = "fixed"

    def __post_init__(self):
        _check_positive("FixedShardsPartitioner", num_shards=self.num_shards)

    def num_pieces(self, shape, itemsize, num_ps) -> int:
        return self.num_shards


_KINDS = {cls.kind: cls for cls in (NoPartitioner, MinSizePartitioner, MaxSizePartitioner, FixedShardsPartitioner)}


def partitioner_from_dict(entry: Mapping) -> Partitioner:
    """The policy Partitioner.to_dict() described; ClusterConfigError if it is not one."""
    try:
        fields = {k: v for k, v in entry.items() if k != "kind"}
        return _KINDS[entry["kind"]](**fields)
    except (KeyError, TypeError) as exc:
        raise ClusterConfigError(f"not a partitioner: {dict(entry)!r} ({exc})") from None


def check_manifest(partitions: Mapping) -> None:
    """Raises ValueError (or KeyError, TypeError) unless `partitions` (Partitions.manifest()) can be cut again."""
    if partitions["splits"]:
        partitioner_from_dict(partitions["partitioner"])
    for name, split in partitions["splits"].items():
        shape = split["shape"]
        if not shape or not all(isinstance(d, int) and d >= 0 for d in shape) or not isinstance(
                getattr(torch, split["dtype"], None), torch.dtype):
            raise ValueError(f"partitioned variable {name!r} has shape {shape!r} and dtype {split['dtype']!r}")
        expected = 0
        for _, start, stop in split["pieces"]:
            if start != expected or stop <= start:
                raise ValueError(f"the pieces of {name!r} do not cover its rows in order")
            expected = stop
        if expected != shape[0]:
            raise ValueError(f"the pieces of {name!r} cover {expected} of its {shape[0]} rows")


def partitioner_from_spec(spec: str) -> Partitioner:
    """The policy a command-line SPEC names: `min_size[:BYTES[:MAX_SHARDS]]`, `max_size:BYTES[:MAX_SHARDS]`,
    `fixed:N` or `none`; ClusterConfigError if it is not one."""
    kind, *numbers = spec.strip().split(":")
    values = [int(n) for n in numbers if n.strip().lstrip("-").isdigit()]
    if len(values) == len(numbers):
        if kind == "none" and not values:
            return NoPartitioner()
        if kind == "min_size" and len(values) <= 2:
            return MinSizePartitioner(*values)
        if kind == "max_size" and 1 <= len(values) <= 2:
            return MaxSizePartitioner(*values)
        if kind == "fixed" and len(values) == 1:
            return FixedShardsPartitioner(*values)
    raise ClusterConfigError(f"not a partitioner: {spec!r}; use min_size[:BYTES[:MAX_SHARDS]], "
                             f"max_size:BYTES[:MAX_SHARDS], fixed:N or none")


def row_ranges(rows: int, pieces: int) -> list[tuple[int, int]]:
    """[start, stop) rows of each piece: the first rows % pieces get one row more."""
    base, extra = divmod(rows, pieces)
    bounds, start = [], 0
    for i in range(pieces):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def piece_names(name: str, pieces: int) -> list[str]:
    return [f"{name}/part_{i}" for i in range(pieces)]


@dataclasses.dataclass(frozen=True)
class Split:
    """One partitioned variable: its shape, dtype and pieces (name, first row, row after the last)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[tuple[str, int, int], ...]

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."),
                "pieces": [list(p) for p in self.pieces]}


class Partitions:
    """The client's map of partitioned variables. Names not in it are whole. Not thread-safe (the client
    serializes `add`)."""

    def __init__(self, partitioner: Partitioner, num_ps: int):
        self.partitioner = partitioner
        self.num_ps = num_ps
        self.splits: dict[str, Split] = {}
        self._whole_of: dict[str, str] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, int]]:
        """Cuts `name` per the policy (idempotent); returns its wire variables as (name, bytes) pairs."""
        split = self.splits.get(name)
        if split is None:
            n = self.partitioner.pieces(tuple(shape), dtype.itemsize, self.num_ps)
            if n == 1:
                return [(name, math.prod(shape) * dtype.itemsize)]
            split = Split(tuple(shape), dtype, tuple(
                (piece, start, stop) for piece, (start, stop) in zip(piece_names(name, n), row_ranges(shape[0], n))))
            self.splits[name] = split
            self._whole_of.update({piece: name for piece, _, _ in split.pieces})
        row_bytes = math.prod(split.shape[1:]) * split.dtype.itemsize
        return [(piece, (stop - start) * row_bytes) for piece, start, stop in split.pieces]

    def wire_names(self, names: Iterable[str]) -> list[str]:
        """The wire variables of `names` in order: a partitioned name's pieces, others as they are."""
        out = []
        for name in names:
            split = self.splits.get(name)
            out += [piece for piece, _, _ in split.pieces] if split else [name]
        return out

    def whole_of(self, wire_name: str) -> str:
        """The variable a wire name is a piece of (itself if whole)."""
        return self._whole_of.get(wire_name, wire_name)

    def split(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{wire name: tensor}: partitioned tensors replaced by their row slices (views, no copy)."""
        if not self.splits:
            return dict(tensors)
        out = {}
        for name, tensor in tensors.items():
            split = self.splits.get(name)
            if split is None:
                out[name] = tensor
                continue
            if tuple(tensor.shape) != split.shape:
                raise TensorMismatchError(f"{name!r} is partitioned as shape {list(split.shape)} but the tensor "
                                          f"given is {list(tensor.shape)}")
            out.update({piece: tensor[start:stop] for piece, start, stop in split.pieces})
        return out

    def join(self, pieces: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
        """{name: tensor} for `names` from their wire tensors (partitioned ones concatenated)."""
        out = {}
        for name in names:
            split = self.splits.get(name)
            out[name] = torch.cat([pieces[p] for p, _, _ in split.pieces]) if split else pieces[name]
        return out

    def manifest(self) -> dict:
        """The partitions for a checkpoint manifest: the policy and every split."""
        return {"partitioner": self.partitioner.to_dict(),
                "splits": {name: split.to_dict() for name, split in self.splits.items()}}

    def report(self) -> list[str]:
        """One line per partitioned variable: its pieces and their rows."""
        return [f"  {name} {list(split.shape)} in {len(split.pieces)} pieces: " + ", ".join(
            f"{piece.rsplit('/', 1)[1]} rows {start}-{stop - 1}" for piece, start, stop in split.pieces)
            for name, split in self.splits.items()]
