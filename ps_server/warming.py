"""Cache warming: the rows a client announced for its next lookup (LookupRowsRequest.upcoming), read into the
caches of a shard's SSD tables by one background thread while the client computes its step. No gRPC.

A Warmer keeps the announcements not yet read (a LookupRows's tables and
ids: one announcement), oldest first, at most MAX_PENDING (an older one is
dropped for a newer: its client has moved on past it), and reads them in
one thread, started at the first and ended by close(). Reading one is SsdTable.warm(): under the table's lock, as a lookup,
so a push or a lookup of the table waits for it, never the other way round
unordered. Warming changes no row, counter or journal: a failure (a store
that fails) is logged and the rows are read by the lookup that needs them.

Thread safety: offer() and close() from any thread; one lock.
"""

from __future__ import annotations

import collections
import logging
import threading

import numpy as np

__all__ = ["Warmer", "MAX_PENDING"]

_LOGGER = logging.getLogger(__name__)

MAX_PENDING = 16          # announcements waiting to be read: a newer drops the oldest
CLOSE_SECONDS = 10.0      # close() waits this long for the read in progress


class Warmer:
    """Reads announced rows into SSD tables' caches in the background (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.offered = self.dropped = self.failed = 0

    def offer(self, announced: list[tuple[object, np.ndarray]]) -> None:
        """Queues one announcement: each (table, ids checked: distinct, of this shard) to be read into the
        table's cache (its warm()). Never blocks on a table; does nothing once closed."""
        with self._cond:
            if self._closed or not announced:
                return
            if len(self._pending) >= MAX_PENDING:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(announced)
            self.offered += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cache-warmer", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        """Drops what is queued and ends the thread (waiting up to CLOSE_SECONDS for the read in progress)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(CLOSE_SECONDS)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._pending)
                if self._closed:
                    return
                announced = self._pending.popleft()
            for table, ids in announced:
                try:
                    table.warm(ids)
                except Exception:  # noqa: BLE001 - a warming that fails is a lookup that reads its rows itself
                    with self._cond:
                        self.failed += 1
                    _LOGGER.warning("warming a table's cache failed; its next lookup reads the rows itself",
                                    exc_info=True)
