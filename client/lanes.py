"""A client's bulk lanes (torchps/lanes.py) to its shards: opened on first need, lent to one call at a time.

ClientLanes learns a shard's lane port from GetStatus (0: the shard offers
none, and the client sends inline), opens lanes to it as calls need them and
keeps those given back in step for the next calls. A lane that broke is
closed and the port asked again before the next one is opened; a shard whose
lanes cannot be opened is sent to inline for NO_LANE_SECONDS. All of that
holds for the address the shard is served at: once it is served elsewhere
(its backup was promoted), its kept lanes are closed, and its port, and
whether it goes inline, learnt anew there.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
import weakref
from typing import Callable

from ..errors import LaneBrokenError
from ..lanes import Lane, connect

__all__ = ["ClientLanes", "LANE_MIN_BYTES"]

_LOGGER = logging.getLogger(__name__)
LANE_MIN_BYTES = 1 << 20  # by default a call moving fewer bytes goes inline: one message, no frame to read
NO_LANE_SECONDS = 30.0    # after a lane could not be opened, the shard's calls go inline this long
_KEPT_PER_SHARD = 4       # idle lanes kept per shard (more calls at once open more, closed when given back)


class ClientLanes:
    """Lanes by shard. `address(shard)` is the shard's gRPC host:port, `lane_port(shard)` asks it for its lane
    port (GetStatus; 0: none); `context` (lanes.tls_context) makes them TLS; calls of fewer than `min_bytes`
    go inline. Thread-safe; borrow() blocks only to open a lane (up to `timeout`)."""

    def __init__(self, address: Callable[[int], str], lane_port: Callable[[int], int], enabled: bool = True,
                 context: ssl.SSLContext | None = None, min_bytes: int = LANE_MIN_BYTES):
        self._address, self._lane_port, self.enabled, self._context = address, lane_port, enabled, context
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._ports: dict[int, int] = {}
        self._idle: dict[int, list[Lane]] = {}
        self._inline_until: dict[int, float] = {}
        self._at: dict[int, str] = {}  # the address the shard's port, kept lanes and inline time belong to
        self._opened_at: weakref.WeakKeyDictionary[Lane, str] = weakref.WeakKeyDictionary()  # lane -> address
        self.opened = 0  # lanes opened so far (tests read it)

    def borrow(self, shard: int, nbytes: int, timeout: float) -> Lane | None:
        """A lane to `shard` for one call moving `nbytes`, or None: send inline (few bytes, lanes off, none
        offered, or none could be opened)."""
        if not self.enabled or nbytes < self.min_bytes:
            return None
        with self._lock:  # (read under it: a later borrow never sees an older address than an earlier one)
            address = self._address(shard)
            stale = self._follow(shard, address)
            inline = time.monotonic() < self._inline_until.get(shard, 0.0)
            idle = self._idle.get(shard)
            lane = idle.pop() if idle and not inline else None
            port = self._ports.get(shard)
        for old in stale:
            old.close()
        if inline or lane is not None:
            return lane
        try:
            if port is None:
                # Asked where the shard is served now: kept only if that is still `address`.
                port = self._lane_port(shard)
                with self._lock:
                    if self._address(shard) != address:
                        return None
                    self._ports[shard] = port
            if not port:
                return None
            lane = connect(address.rpartition(":")[0].strip("[]"), port, timeout, self._context)
        except Exception as exc:  # noqa: BLE001 - no lane: the call goes inline, as it would without lanes
            self._go_inline(shard, address, exc)
            return None
        with self._lock:
            self.opened += 1
            self._opened_at[lane] = address
        return lane

    def _follow(self, shard: int, address: str) -> list[Lane]:
        """(Holding the lock.) The shard is served at `address`: if that is news, what was learnt of it at the
        old one is forgotten; returns the old one's kept lanes, to close."""
        if self._at.get(shard) == address:
            return []
        self._at[shard] = address
        self._ports.pop(shard, None)
        self._inline_until.pop(shard, None)
        return self._idle.pop(shard, [])

    def give_back(self, shard: int, lane: Lane | None, ok: bool) -> None:
        """Ends a borrow: the lane kept for the next call if `ok` and in step, else closed (and the shard's
        port asked again before another is opened)."""
        if lane is None:
            return
        keep = ok and not lane.closed and lane.finished()
        with self._lock:
            if self._opened_at.get(lane) != self._at.get(shard):  # opened where the shard was served before
                keep = False
            elif not keep:
                self._ports.pop(shard, None)
            elif len(self._idle.setdefault(shard, [])) < _KEPT_PER_SHARD:
                self._idle[shard].append(lane)
                return
        lane.close()

    def close(self) -> None:
        with self._lock:
            lanes = [lane for idle in self._idle.values() for lane in idle]
            self._idle.clear()
        for lane in lanes:
            lane.close()

    def _go_inline(self, shard: int, address: str, exc: Exception) -> None:
        with self._lock:
            if self._at.get(shard) != address:  # served elsewhere by now: nothing is known of it there yet
                return
            self._inline_until[shard] = time.monotonic() + NO_LANE_SECONDS
            self._ports.pop(shard, None)
        _LOGGER.info("no bulk lane to shard %d (%s): its calls go inline for %g s", shard,
                     exc if isinstance(exc, LaneBrokenError) else repr(exc), NO_LANE_SECONDS)
