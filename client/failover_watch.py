"""Calls stuck at a replicated shard's lost primary, moved to its promoted backup without waiting for their deadline.

A primary cut off from the network, or paused (SIGSTOP), neither answers nor
closes its connections: a call in flight there would wait for its deadline
(seconds; a held sync push's is long) before the client looked for the
shard elsewhere. While a client follows failovers (client/layout.py), every
call to a shard is registered here. A watcher thread looks every
WATCH_SECONDS for shards with a call in flight for WATCH_SECONDS or more and
starts a poller for each (one per shard, so one shard's wait never delays
another's): it asks the shard's arbiter where the shard is served
(ShardChannels.relocate) as a long poll (GetLayout's watch: answered when the
arbiter promotes the shard's backup, or after POLL_SECONDS), again and again
while the shard has such a call, at most once per WATCH_SECONDS when answers
come sooner. Once the arbiter names another address, the client calls it
there and closes the old channel, which ends the stuck calls at once
(CANCELLED); ShardChannels.call sends each again to the new address, where
the replicated push ledger answers a push the old primary acknowledged as a
duplicate.

A call legitimately long (a sync push held for its step's release, a large
transfer) keeps one long poll open at its shard's arbiter while it runs. A
shard whose arbiter has no record of a backup in sync for it is answered at
once and not asked about again for QUIET_SECONDS (an unreplicated job asks
once per QUIET_SECONDS at most).

Thread-safe: its own lock guards the calls in flight, the quiet shards and
the pollers; relocate runs on the pollers' threads, outside it.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable

__all__ = ["FailoverWatch", "WATCH_SECONDS", "POLL_SECONDS", "QUIET_SECONDS"]

WATCH_SECONDS = 0.25  # a call in flight this long has its shard's arbiter asked where it is served
POLL_SECONDS = 2.0    # one ask's long poll at the arbiter lasts at most this
QUIET_SECONDS = 5.0   # a shard its arbiter records no backup for is not asked about again for this long


class FailoverWatch:
    """Calls in flight by shard, and the threads that ask about the slow ones. `relocate(shard, wait)` asks the
    shard's arbiter, waiting up to `wait` s for a promotion, and moves the client's calls if it is served
    elsewhere (True); `replicated(shard)` says whether its arbiter's last answer recorded a backup or a
    failover for it."""

    def __init__(self, relocate: Callable[[int, float], bool], replicated: Callable[[int], bool],
                 closed: threading.Event, clock: Callable[[], float] = time.monotonic):
        self._relocate, self._replicated, self._closed, self._clock = relocate, replicated, closed, clock
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[int, float]] = {}  # call number -> (shard, when it began)
        self._quiet: dict[int, float] = {}  # shard -> until when it is not asked about
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None
        self._polling: set[int] = set()  # shards a poller asks about now
        self.asked = 0  # arbiters asked about a slow call's shard

    def enter(self, shard: int) -> int:
        """Registers a call to `shard` beginning now; its number for leave(). Starts the watcher at the first."""
        with self._lock:
            number = next(self._numbers)
            self._calls[number] = (shard, self._clock())
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="failover-watch", daemon=True)
                self._thread.start()
        return number

    def leave(self, number: int) -> None:
        """The call `number` ended (answered, failed or cancelled)."""
        with self._lock:
            self._calls.pop(number, None)

    def slow(self) -> list[int]:
        """The shards with a call in flight for WATCH_SECONDS or more, not quiet now."""
        now = self._clock()
        with self._lock:
            return sorted({shard for shard, began in self._calls.values()
                           if now - began >= WATCH_SECONDS and self._quiet.get(shard, 0.0) <= now})

    def check(self) -> None:
        """One round in this thread: the arbiter of each slow shard asked once, in turn (blocks for those
        calls)."""
        for shard in self.slow():
            self._ask(shard)

    def _ask(self, shard: int) -> bool:
        """The arbiter of `shard` asked once (a long poll); True if the shard moved or went quiet (a shard
        its arbiter records no backup for goes quiet for QUIET_SECONDS)."""
        with self._lock:
            self.asked += 1
        if self._relocate(shard, POLL_SECONDS):
            return True
        if self._replicated(shard):
            return False
        with self._lock:
            self._quiet[shard] = self._clock() + QUIET_SECONDS
        return True

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_SECONDS):
            for shard in self.slow():
                with self._lock:
                    if shard in self._polling:
                        continue
                    self._polling.add(shard)
                threading.Thread(target=self._poll, args=(shard,), name=f"failover-watch-{shard}",
                                 daemon=True).start()

    def _poll(self, shard: int) -> None:
        """Asks about `shard` while it has a slow call, at most once per WATCH_SECONDS (an arbiter that answers
        at once: no backup in sync, or a shard of an older version that knows no long poll)."""
        try:
            while not self._closed.is_set() and shard in self.slow():
                began = self._clock()
                if self._ask(shard):
                    return
                self._closed.wait(max(0.0, began + WATCH_SECONDS - self._clock()))
        finally:
            with self._lock:
                self._polling.discard(shard)
