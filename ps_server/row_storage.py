"""Where a shard's embedding rows live (embeddings.py's EmbeddingTable uses them): an index of int64 ids,
id-keyed record columns, and row slabs. No locks here: the table's lock covers every call.

* IdIndex: id -> slot by linear probing over a power-of-two int32 bucket
  array at most half full, from SplitMix64(id ^ salt) (salted so that
  buckets do not follow hash partitioning); rebuilt to remove ids.
* Keyed: numpy columns (ids and the named dtypes) of records found by id,
  grown by an eighth at a time, removed by moving the last records into the
  holes.
* Slabs: tensor columns of whole rows (values and per-row optimizer state),
  reserved in slabs of max(MIN_SLAB, an eighth of the capacity) rows, freed
  from the end; or (a bounded cache) one slab, grown and shrunk by a copy.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..rows import splitmix64 as _splitmix64

__all__ = ["IdIndex", "Keyed", "Slabs", "ids_array", "MIN_SLAB"]

_INDEX_SALT = np.uint64(0x5851F42D4C957F2D)  # decorrelates index buckets from hash partitioning
MIN_SLAB = 1024  # rows in a dynamic table's first slab; also the least spare room of its id arrays
_GROWTH = 8  # a new slab holds at least 1/_GROWTH of the rows already allocated


def ids_array(ids) -> np.ndarray:
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        raise InvalidArgumentError(f"ids must be a 1-D int64 tensor, got {getattr(ids, 'dtype', type(ids))} of "
                                   f"shape {tuple(getattr(ids, 'shape', ()))}")
    return ids.detach().cpu().contiguous().numpy()


def _resized(array: np.ndarray, size: int, used: int) -> np.ndarray:
    out = np.empty(size, dtype=array.dtype)
    out[:used] = array[:used]
    return out


class IdIndex:
    """id -> slot for the ids in keys[:n] (an array its owner keeps): linear probing over a power-of-two
    int32 bucket array at most half full. Buckets hold slots (-1: empty) and ids are read from keys, so an
    entry costs 8 to 16 bytes. Removing ids means rebuild()."""

    def __init__(self):
        self.buckets = np.full(64, -1, dtype=np.int32)

    def _home(self, ids: np.ndarray) -> np.ndarray:
        shift = np.uint64(65 - len(self.buckets).bit_length())  # the hash's top log2(buckets) bits
        return (_splitmix64(ids.view(np.uint64) ^ _INDEX_SALT) >> shift).astype(np.int64)

    def find(self, keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Each id's slot, -1 where absent."""
        slots = np.full(len(ids), -1, dtype=np.int64)
        active, pos, mask = np.arange(len(ids)), self._home(ids), len(self.buckets) - 1
        while active.size:
            slot = self.buckets[pos]
            used = slot >= 0
            hit = np.zeros(len(active), dtype=bool)
            hit[used] = keys[slot[used]] == ids[active[used]]
            slots[active[hit]] = slot[hit]
            going = used & ~hit
            active, pos = active[going], (pos[going] + 1) & mask
        return slots

    def insert(self, keys: np.ndarray, slots: np.ndarray, n: int) -> None:
        """Indexes keys[slots] (absent ids), keys[:n] being all ids afterwards."""
        if 2 * n > len(self.buckets):
            self.rebuild(keys, n)
        else:
            self._place(keys[slots], slots)

    def rebuild(self, keys: np.ndarray, n: int) -> None:
        self.buckets = np.full(max(64, 1 << (2 * n - 1).bit_length()), -1, dtype=np.int32)
        self._place(keys[:n], np.arange(n))

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        pending, pos, mask = np.arange(len(ids)), self._home(ids), len(self.buckets) - 1
        while pending.size:
            free = np.flatnonzero(self.buckets[pos] < 0)
            cells, first = np.unique(pos[free], return_index=True)  # one winner per free bucket
            self.buckets[cells] = slots[pending[free[first]]]
            left = np.ones(len(pending), dtype=bool)
            left[free[first]] = False
            pending, pos = pending[left], (pos[left] + 1) & mask

    @property
    def nbytes(self) -> int:
        return self.buckets.nbytes


class Keyed:
    """Records keyed by unique int64 ids in numpy columns ("ids" first) with an IdIndex; appended at the
    end, removed by moving the last records into the holes."""

    def __init__(self, *, least: int = MIN_SLAB, **dtypes):
        self.cols = {"ids": np.empty(0, dtype=np.int64), **{k: np.empty(0, dtype=d) for k, d in dtypes.items()}}
        self.n = 0
        self.index = IdIndex()
        self.least = least  # the least spare room kept: records appended before the columns grow again

    def find(self, ids: np.ndarray) -> np.ndarray:
        return self.index.find(self.cols["ids"], ids)

    def append(self, ids: np.ndarray, **values) -> np.ndarray:
        """Slots of the new records (ids absent from the table)."""
        n = self.n + len(ids)
        if n > len(self.cols["ids"]):
            size = max(n, len(self.cols["ids"]) * (_GROWTH + 1) // _GROWTH, self.least)
            self.cols = {k: _resized(col, size, self.n) for k, col in self.cols.items()}
        slots = np.arange(self.n, n)
        for key, value in {"ids": ids, **values}.items():
            self.cols[key][slots] = value
        self.n = n
        self.index.insert(self.cols["ids"], slots, n)
        return slots

    def remove(self, gone: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drops the records at slots `gone` (distinct); returns (src, dst): the slots moved into holes."""
        if not len(gone):
            return gone, gone
        n = self.n - len(gone)
        dead = np.zeros(self.n, dtype=bool)
        dead[gone] = True
        dst, src = np.flatnonzero(dead[:n]), n + np.flatnonzero(~dead[n:])
        for col in self.cols.values():
            col[dst] = col[src]
        if len(self.cols["ids"]) > n + n // 4 + self.least:
            self.cols = {k: _resized(col, n + n // _GROWTH + self.least, n) for k, col in self.cols.items()}
        self.n = n
        self.index.rebuild(self.cols["ids"], n)
        return src, dst

    @property
    def nbytes(self) -> int:
        return sum(col.nbytes for col in self.cols.values()) + self.index.nbytes


class Slabs:
    """Rows [0, capacity) of values and per-row optimizer state, in slabs of whole rows (a dict of
    (rows, columns) tensors per slab), every tensor in the same slot order."""

    def __init__(self, columns: Mapping[str, int], dtype: torch.dtype, *, least: int = MIN_SLAB,
                 whole: bool = False):
        self.columns, self.dtype = dict(columns), dtype
        self.least = least  # rows of the smallest slab
        self.whole = whole  # one slab, grown and shrunk by a copy (a bounded cache: every gather one index_select)
        self.slabs: list[dict[str, torch.Tensor]] = []
        self.starts = np.empty(0, dtype=np.int64)
        self.capacity = 0

    def reserve(self, n: int, exact: bool = False) -> None:
        """Room for rows [0, n): slabs of max(least, an eighth of the capacity) rows each (exact: one slab of
        the rows missing), so that release() can give back all but an eighth; `whole`: one slab of an eighth
        more than n, the rows held copied into it."""
        if self.whole:
            if n > self.capacity:
                self._resize(max(self.least, n + n // _GROWTH))
            return
        while n > self.capacity:
            size = n - self.capacity if exact else max(self.least, self.capacity // _GROWTH)
            self.slabs.append({k: torch.empty(size, w, dtype=self.dtype) for k, w in self.columns.items()})
            self.starts = np.append(self.starts, self.capacity)
            self.capacity += size

    def _resize(self, size: int) -> None:
        """`whole`: one slab of `size` rows holding the first rows of the old one."""
        kept = min(size, self.capacity)
        slab = {k: torch.empty(size, w, dtype=self.dtype) for k, w in self.columns.items()}
        if kept:
            for key in self.columns:
                slab[key][:kept] = self.slabs[0][key][:kept]
        self.slabs, self.starts, self.capacity = [slab], np.zeros(1, dtype=np.int64), size

    def release(self, n: int) -> None:
        """Frees the slabs wholly beyond row n (`whole`: shrinks the slab to an eighth more than n once it is a
        quarter larger)."""
        if self.whole:
            if self.capacity > n + n // 4 + self.least:
                self._resize(max(self.least, n + n // _GROWTH))
            return
        keep = int(np.searchsorted(self.starts, n, side="left"))
        if keep < len(self.slabs):
            self.capacity = int(self.starts[keep])
            del self.slabs[keep:]
            self.starts = self.starts[:keep].copy()

    def groups(self, slots: np.ndarray) -> list[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]]:
        """(slab, rows within it, positions in `slots`) for each slab that `slots` touch."""
        if len(self.slabs) == 1:
            return [(self.slabs[0], torch.from_numpy(slots), torch.arange(len(slots)))] if len(slots) else []
        which = np.searchsorted(self.starts, slots, side="right") - 1
        order = np.argsort(which, kind="stable")
        out = []
        for part in np.split(order, np.flatnonzero(np.diff(which[order])) + 1):
            if part.size:
                k = which[part[0]]
                out.append((self.slabs[k], torch.from_numpy(slots[part] - self.starts[k]), torch.from_numpy(part)))
        return out

    def gather(self, key: str, slots: np.ndarray) -> torch.Tensor:
        out = torch.empty(len(slots), self.columns[key], dtype=self.dtype)
        for slab, rows, positions in self.groups(slots):
            out[positions] = slab[key].index_select(0, rows)
        return out

    def scatter(self, key: str, slots: np.ndarray, data: torch.Tensor) -> None:
        for slab, rows, positions in self.groups(slots):
            slab[key].index_copy_(0, rows, data[positions])

    @property
    def nbytes(self) -> int:
        return self.starts.nbytes + sum(t.untyped_storage().nbytes() for slab in self.slabs for t in slab.values())
