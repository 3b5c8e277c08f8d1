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
import time
from typing import Callable, Container

from ..errors import ResourceExhaustedError, ServerUnavailableError, WaitTimeoutError

__all__ = ["WaitLimit", "NamesAwaited"]


class NamesAwaited:
    """A mixin for a store whose names others wait for (store.py's variables, tables.py's tables).

    The store keeps `_changed` (a threading.Condition that guards its names
    and is notified when names are created) and `_closed`, and says in
    `_waited_names()` (called under `_changed`) what exists; `_what` names
    its kind in messages ("variable", "embedding table").
    """

    _what = "name"
    _changed: threading.Condition
    _closed: bool

    def _waited_names(self) -> Container[str]:
        raise NotImplementedError

    def wait_for(self, names: list[str], timeout: float, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Blocks until every name exists; WaitTimeoutError naming the missing ones after `timeout` s,
        ServerUnavailableError once close()d. Returns early once `cancelled()` is true after a wake()."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                held = self._waited_names()
                missing = [n for n in names if n not in held]
                if self._closed:
                    raise ServerUnavailableError("this shard is stopping; retry against its replacement")
                if not missing or cancelled():
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    shown = ", ".join(repr(n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
                    raise WaitTimeoutError(f"waited {timeout:g} s for {len(missing)} {self._what}(s) to be created: "
                                           f"{shown}. Is the chief running and creating them?")
                self._changed.wait(remaining)

    def wake(self) -> None:
        """Wakes waiters so they re-check their condition (a call was cancelled)."""
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        """Ends every wait_for at once with ServerUnavailableError (the shard is stopping)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()


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
