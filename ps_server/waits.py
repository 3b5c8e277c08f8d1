"""A cap on calls that wait. No gRPC.

A call that waits (a sync push held for its release, a push held by the ssp
bound, a pull waiting for min_step, a retry waiting for its original, a save
waiting for its step, a wait for variables) holds one of the server's RPC
threads. Past `limit` such calls a shard answers the next one
RESOURCE_EXHAUSTED at once, so the threads left always serve status,
membership, heartbeats and plain pushes and pulls.
"""

from __future__ import annotations

import collections
import contextlib
import threading

from ..errors import ResourceExhaustedError

__all__ = ["WaitLimit"]


class WaitLimit:
    """Counts waiting calls by kind and refuses those past the limit. Thread-safe."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._waiting: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def slot(self, kind: str):
        """Held while a call of `kind` waits; ResourceExhaustedError (naming the limit) if none is free."""
        self.acquire(kind)
        try:
            yield
        finally:
            self.release(kind)

    def acquire(self, kind: str) -> None:
        """Takes a slot for a call of `kind` (release() gives it back); ResourceExhaustedError if none is free."""
        with self._lock:
            total = sum(self._waiting.values())
            if total >= self.limit:
                raise ResourceExhaustedError(
                    f"this shard already holds {total} waiting calls, its limit (ps-server --max-waiting-calls "
                    f"{self.limit}); the {kind} call was refused and changed nothing: retry later, or raise "
                    f"--max-waiting-calls (with --threads)")
            self._waiting[kind] += 1

    def release(self, kind: str) -> None:
        with self._lock:
            self._waiting[kind] -= 1

    def waiting(self, kind: str | None = None) -> int:
        """Calls waiting now, of `kind` or of every kind."""
        with self._lock:
            return self._waiting[kind] if kind else sum(self._waiting.values())
