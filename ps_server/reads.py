"""Reading a variable chunk by chunk as one version, without a whole copy. No gRPC here.

A pull used to copy each variable whole under its lock, so a shard holding V
bytes could hold another V per concurrent pull. A VersionedRead instead copies
one chunk at a time under the variable's lock, straight into the outgoing
message, and stays registered on the variable until it ends: an update that
arrives first (store.apply, under the same lock) calls `preserve`, which
copies only the bytes not yet read. The read goes on from that copy, so every
chunk it sends belongs to the version it started with; memory beyond the
variable is at most its unread remainder, and only when an update races it.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np

from .. import codec

__all__ = ["VersionedRead"]

T = TypeVar("T")


class VersionedRead:
    """One consistent read of `variable` (a store.Variable), opened with `open` and ended with `close`."""

    def __init__(self, variable):
        self.variable = variable
        self.version = 0
        self.offset = 0                    # bytes taken so far
        self.nbytes = variable.nbytes
        self._frozen: np.ndarray | None = None  # bytes [frozen_at:] of the version being read, once preserved
        self._frozen_at = 0

    def open(self) -> "VersionedRead":
        with self.variable.lock:
            self.version = self.variable.version
            self.variable.readers.append(self)
        return self

    def take(self, nbytes: int, use: Callable[[memoryview, int], T]) -> T:
        """use(view of the next `nbytes` bytes, their offset), under the variable's lock: `use` must copy
        what it keeps (encode it) before returning. The last take may ask for fewer than remain."""
        with self.variable.lock:
            start, end = self.offset, min(self.offset + nbytes, self.nbytes)
            if self._frozen is not None:
                view = memoryview(self._frozen)[start - self._frozen_at:end - self._frozen_at]
            else:
                view = memoryview(codec.byte_array(self.variable.value))[start:end]
            self.offset = end
            result = use(view, start)
            if self._frozen is not None and end >= self.nbytes:
                self._frozen = None
            return result

    def preserve(self) -> None:
        """Called with the variable's lock held, before its value changes: keeps the unread bytes."""
        if self._frozen is None and self.offset < self.nbytes:
            self._frozen_at = self.offset
            self._frozen = codec.byte_array(self.variable.value)[self.offset:].copy()

    def close(self) -> None:
        """Unregisters the read (idempotent); its preserved bytes go."""
        with self.variable.lock:
            if self in self.variable.readers:
                self.variable.readers.remove(self)
            self._frozen = None

    def __enter__(self) -> "VersionedRead":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
