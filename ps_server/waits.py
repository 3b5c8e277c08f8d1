"""Calls that wait: what they wait for, and a cap on them. No gRPC.

The waits of the push and pull paths (a sync push held for its release, a
push held by the ssp bound, a retry waiting for its original, a pull waiting
for min_step) are written as generators that yield a `Wait` at the point
where they would block, holding no lock. A caller either blocks on it
(`run_blocking`: a thread waits, as tests and in-process callers do) or
hands it to an event loop (`Wait.watch`: the bookkeeping condition calls
back when its predicate turns true), so the shard's asyncio edge holds no
thread while such a call waits. Every wait has a deadline; the generator
decides, holding the lock again, what its end means (released, timed out,
cancelled, closed).

The other waits (a save waiting for its step, a wait for variables, tables
or a data queue) block one of the server's RPC threads.

WaitLimit caps them: past `limit` waiting calls of any kind (ps-server
--max-waiting-calls) a shard answers the next one RESOURCE_EXHAUSTED
(ShardBusyError: clients retry it) at once; the thread-holding kinds
(THREADED) are also capped at `threaded` (three quarters of --threads),
so the threads left always serve status, membership, heartbeats and
plain pushes and pulls.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import threading
import time
from typing import Callable, Container, Generator, TypeVar

from ..errors import ServerUnavailableError, ShardBusyError, WaitTimeoutError

__all__ = ["WaitLimit", "NamesAwaited", "WatchedCondition", "Wait", "Waiting", "run_blocking", "THREADED"]

THREADED = frozenset({"save", "list", "take"})  # the kinds of wait that block an RPC thread
T = TypeVar("T")


class WatchedCondition(threading.Condition):
    """A threading.Condition that also calls back watchers (watch()) whose predicate is true when it is
    notified. A watcher's predicate runs holding the lock, in the notifier's thread; its callback must not
    block (an event loop's call_soon_threadsafe).

    A watcher that gives a `level` (its predicate cannot turn true before `level()` of the condition, the
    shard's step, reaches it, but at notify_all(every=True)) is checked only once it does: a notify costs
    O(log n) for such watchers, not O(n), so a step that releases n held pushes costs O(n log n) in all.
    """

    def __init__(self, lock, level: Callable[[], int]) -> None:
        super().__init__(lock)
        self._level = level
        self._watchers: dict[int, tuple[Callable[[], bool], Callable[[], None]]] = {}  # checked at every notify
        self._leveled: dict[int, tuple[Callable[[], bool], Callable[[], None]]] = {}  # once the level is reached
        self._levels: list[tuple[int, int]] = []  # heap of (level, key) over _leveled (and keys since gone)
        self._next = 0

    def notify_all(self, *, every: bool = False) -> None:
        """Wakes the threads waiting and calls back the watchers now ready (`every`: each watcher is checked,
        whatever its level: the shard is closing)."""
        super().notify_all()
        if self._leveled:
            level = None if every else self._level()
            while self._levels and (level is None or self._levels[0][0] <= level):
                key = heapq.heappop(self._levels)[1]
                if key in self._leveled:
                    self._watchers[key] = self._leveled.pop(key)  # from now on checked at every notify
        if self._watchers:
            ready = [key for key, (predicate, _) in self._watchers.items() if predicate()]
            for key in ready:
                self._watchers.pop(key)[1]()

    def watch(self, predicate: Callable[[], bool], wake: Callable[[], None], level: int | None = None) -> int | None:
        """Calls wake() once, at the first notify_all after which predicate() holds (at once, and None is
        returned, if it holds now); else returns a key for unwatch(). Takes the lock."""
        with self:
            if predicate():
                wake()
                return None
            self._next += 1
            if level is None or level <= self._level():
                self._watchers[self._next] = (predicate, wake)
            else:
                self._leveled[self._next] = (predicate, wake)
                heapq.heappush(self._levels, (level, self._next))
            return self._next

    def unwatch(self, key: int | None) -> None:
        """Forgets a watcher (a no-op once it was called back). Takes the lock."""
        if key is not None:
            with self:
                self._watchers.pop(key, None)
                self._leveled.pop(key, None)
                if not self._leveled:
                    self._levels.clear()


@dataclasses.dataclass(frozen=True)
class Wait:
    """A point where a call waits, holding no lock: until `ready()` (read holding `cond`) or `left()` is 0.
    Whoever drives the call resumes it then; the call itself decides what the end of the wait means. `level`:
    ready() cannot turn true before the shard's step reaches it, but at close (WatchedCondition)."""

    cond: WatchedCondition
    ready: Callable[[], bool]
    left: Callable[[], float | None]  # seconds to the deadline (None: none)
    level: int | None = None

    def block(self) -> None:
        """Waits in this thread."""
        with self.cond:
            self.cond.wait_for(self.ready, self.left())


Waiting = Generator[Wait, None, T]  # a call that yields its waits and returns its result


def run_blocking(call: Waiting[T]) -> T:
    """Runs a call that yields Waits to its end, blocking this thread at each; returns its result."""
    try:
        wait = next(call)
        while True:
            wait.block()
            wait = next(call)
    except StopIteration as stop:
        return stop.value


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
    """Counts waiting calls by kind and refuses those past the limit (the THREADED kinds also past
    `threaded`; None: no separate bound). Thread-safe."""

    def __init__(self, limit: int, threaded: int | None = None):
        self.limit = limit
        self.threaded = threaded
        self._lock = threading.Lock()
        self._waiting: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def slot(self, kind: str):
        """Held while a call of `kind` waits; ShardBusyError (naming the limit) if none is free."""
        self.acquire(kind)
        try:
            yield
        finally:
            self.release(kind)

    def acquire(self, kind: str) -> None:
        """Takes a slot for a call of `kind` (release() gives it back); ShardBusyError if none is free."""
        with self._lock:
            total = sum(self._waiting.values())
            if total >= self.limit:
                raise ShardBusyError(
                    f"this shard already holds {total} waiting calls, its limit (ps-server --max-waiting-calls "
                    f"{self.limit}); the {kind} call was refused and changed nothing: retry later, or raise "
                    f"--max-waiting-calls")
            if kind in THREADED and self.threaded is not None:
                held = sum(self._waiting[k] for k in THREADED)
                if held >= self.threaded:
                    raise ShardBusyError(
                        f"this shard already holds {held} calls waiting on an RPC thread (saves, waits for "
                        f"names or data), its limit (three quarters of ps-server --threads); the {kind} call "
                        f"was refused and changed nothing: retry later, or raise --threads")
            self._waiting[kind] += 1

    def release(self, kind: str) -> None:
        with self._lock:
            self._waiting[kind] -= 1

    def waiting(self, kind: str | None = None) -> int:
        """Calls waiting now, of `kind` or of every kind."""
        with self._lock:
            return self._waiting[kind] if kind else sum(self._waiting.values())
