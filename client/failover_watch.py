"""Calls stuck at a replicated shard's lost primary, moved to its promoted backup without waiting for their deadline.

A primary cut off from the network, or paused (SIGSTOP), neither answers nor
closes its connections: a call in flight there would wait for its deadline
(seconds; a held sync push's is long) before the client looked for the
shard elsewhere. While a client follows failovers (client/layout.py), every
call to a shard is registered here; a watcher thread asks the arbiter of
each shard with a call in flight for WATCH_SECONDS or more where the shard is
served (ShardChannels.relocate), every WATCH_SECONDS. Once the arbiter names
another address, the client calls it there and closes the old channel, which
ends the stuck calls at once (CANCELLED); ShardChannels.call sends each
again to the new address, where the replicated push ledger answers a push
the old primary acknowledged as a duplicate.

A call legitimately long (a sync push held for its step's release, a large
transfer) costs one GetLayout to its shard's arbiter per WATCH_SECONDS while
it runs. A shard whose arbiter has no record of a backup for it is not asked
about again for QUIET_SECONDS (an unreplicated job asks once per
QUIET_SECONDS at most).

Thread-safe: its own lock guards the calls in flight and the quiet shards;
relocate runs on the watcher thread, outside it.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable

__all__ = ["FailoverWatch", "WATCH_SECONDS", "QUIET_SECONDS"]

WATCH_SECONDS = 0.25  # a call in flight this long has its shard's arbiter asked where it is served, this often
QUIET_SECONDS = 5.0   # a shard its arbiter records no backup for is not asked about again for this long


class FailoverWatch:
    """Calls in flight by shard, and the thread that asks about the slow ones. `relocate(shard)` asks the
    shard's arbiter and moves the client's calls if it is served elsewhere (True); `replicated(shard)` says
    whether its arbiter's last answer recorded a backup or a failover for it."""

    def __init__(self, relocate: Callable[[int], bool], replicated: Callable[[int], bool],
                 closed: threading.Event, clock: Callable[[], float] = time.monotonic):
        self._relocate, self._replicated, self._closed, self._clock = relocate, replicated, closed, clock
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[int, float]] = {}  # call number -> (shard, when it began)
        self._quiet: dict[int, float] = {}  # shard -> until when it is not asked about
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None
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
        """One round: the arbiter of each slow shard asked (blocks for those calls); a shard it records no
        backup for goes quiet for QUIET_SECONDS."""
        for shard in self.slow():
            self.asked += 1
            if not self._relocate(shard) and not self._replicated(shard):
                with self._lock:
                    self._quiet[shard] = self._clock() + QUIET_SECONDS

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_SECONDS):
            self.check()
