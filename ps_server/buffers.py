"""Receive buffers a shard keeps between pushes, so that a push's gradient lands in memory already faulted in.

A push's complete tensors must be held until the whole stream is checked,
so each is received into a buffer of its own. A fresh buffer of a large
gradient is a fresh mapping whose every page the kernel zeroes on first
touch; a shard that takes the same sizes push after push spends that again
each time. ReceiveBuffers keeps the buffers of finished pushes, by size, for
the next push of the same size.

A buffer of MIN_KEPT_BYTES or more is kept only if nothing else holds it
any more (its reference count: a tensor, a view or a memoryview of it
counts), and only up to a
bound on the bytes kept free: `limit()` (by default the bytes of the
shard's variables, one push's worth). With --max-memory the bytes kept free
count against it as a standing reservation (Quotas), given up when a push
takes the buffer or when a reservation needs the room (drop()).
"""

from __future__ import annotations

import sys
import threading
from typing import Callable

import numpy as np

from .quotas import Quotas

__all__ = ["MIN_KEPT_BYTES", "ReceiveBuffers"]

MIN_KEPT_BYTES = 4 << 20  # smaller buffers come from malloc's heaps, whose pages stay (torchps.memory's shard role)
# sys.getrefcount of a buffer that only give_back's caller passed in: the argument and getrefcount's own.
_ONLY_HERE = 2


class ReceiveBuffers:
    """Free receive buffers by size. Thread-safe; take() never blocks on anything but its own short lock."""

    def __init__(self, quotas: Quotas, held: Callable[[], int], limit: Callable[[], int]):
        self._quotas, self._held, self._limit = quotas, held, limit
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0
        self.reused = 0  # buffers taken from those kept (tests and GetStatus read it)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of `nbytes`: one kept, else a new one (MemoryError/ValueError as np.empty raises)."""
        with self._lock:
            kept = self._free.get(nbytes)
            buffer = kept.pop() if kept else None
            if buffer is not None:
                self._free_bytes -= nbytes
                self.reused += 1
        if buffer is None:
            return np.empty(nbytes, dtype=np.uint8)
        self._quotas.release_kept(nbytes)
        return buffer

    def give_back(self, buffer: np.ndarray) -> None:
        """Keeps `buffer` for a later take() if nothing else refers to it and the bounds allow; else lets it go.
        The caller passes its last reference (e.g. `give_back(list.pop())`)."""
        if sys.getrefcount(buffer) > _ONLY_HERE or not buffer.flags.owndata:
            return
        nbytes = buffer.nbytes
        if nbytes < MIN_KEPT_BYTES:
            return
        limit = self._limit()
        if nbytes > limit or not self._quotas.keep(self._held, nbytes):
            return
        with self._lock:
            fits = self._free_bytes + nbytes <= limit
            if fits:
                self._free.setdefault(nbytes, []).append(buffer)
                self._free_bytes += nbytes
        if not fits:
            self._quotas.release_kept(nbytes)

    def drop(self) -> int:
        """Lets every kept buffer go (their reservation too); the bytes freed."""
        with self._lock:
            freed, self._free, self._free_bytes = self._free_bytes, {}, 0
        if freed:
            self._quotas.release_kept(freed)
        return freed
