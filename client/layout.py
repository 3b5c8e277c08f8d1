"""Following the job's layout across live resizes (ps-admin resize), on the client's side.

A client starts at layout epoch 0, the placement it computes itself. When
variables move (a shard answers LayoutChangedError, or a reply carries a
later `layout_epoch` than the client's), it asks shard 0 for the layout
(GetLayout), opens channels to shards that joined, stops calling those that
left, and places every variable where the layout says.

`each` runs one call per shard as ShardFanout.each does, and sends the names
of a shard that refused them (moved away: nothing was changed there) again,
to their new owners, until every name was served or MAX_ROUNDS layouts were
followed. A part refused that way changed nothing, so sending it again
applies it once. A shard a variable is on its way to answers
VariableMovingError, which the channels retry with backoff as any
UNAVAILABLE.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping, TypeVar

from ..errors import LayoutChangedError, PSError
from ..placement import Placement
from ..proto import ps_pb2
from .fanout import ShardFanout

__all__ = ["LayoutFollower", "MAX_ROUNDS"]

T = TypeVar("T")
_LOGGER = logging.getLogger(__name__)
MAX_ROUNDS = 8  # layouts followed within one call before its LayoutChangedError is raised
COUNTED = ("push", "push_pull")  # calls a shard counts a step for, even with no variable of it
NOT_YET_SECONDS = 0.1  # pause before sending again when shard 0 did not have a later layout yet


class _Moved:
    """What a shard's part came back as when the shard refused its names (LayoutChangedError)."""

    def __init__(self, error: LayoutChangedError):
        self.error = error


class LayoutFollower:
    """The layout epoch this client follows, and calls that follow it (see the module docstring).
    Thread-safe: refreshes are serialized; calls read the placement as it stands."""

    def __init__(self, fanout: ShardFanout, placement: Placement):
        self._fanout = fanout
        self._placement = placement
        self._lock = threading.Lock()
        self.epoch = 0
        self.table_shards = 0  # the shards the embedding tables are spread over since a live resize (0: as created)
        self.refused = 0  # parts a shard refused because their variables or table rows had moved, sent again
        fanout.channels.follows_failovers = True  # a replicated shard's failover: calls go to its new address

    @property
    def shards(self) -> int:
        """The number of shards in the job now."""
        return self._fanout.channels.live

    def count_refused(self) -> None:
        """A part with table rows was refused as placed by an older layout (sent again by its caller)."""
        with self._lock:
            self.refused += 1

    def refresh(self, seen: int | None = None) -> bool:
        """Asks shard 0 for the layout and follows it if it is later than this client's (True). With `seen`
        (an epoch a reply carried), asks only if that is later. Blocks for one call (the control deadline)."""
        with self._lock:
            if seen is not None and seen <= self.epoch:
                return False
            layout = self._fanout.call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t),
                                       self._fanout.control_timeout)
            if layout.epoch <= self.epoch:
                return False
            self._follow(layout)
            return True

    def _follow(self, layout: ps_pb2.Layout) -> None:
        """Takes `layout` (a later epoch; holding the lock)."""
        self._fanout.channels.follow(list(layout.addresses))
        self._placement.follow(len(layout.addresses), dict(layout.placement))
        self.table_shards = layout.table_shards
        _LOGGER.info("following layout epoch %d: %d shards (was epoch %d)", layout.epoch, len(layout.addresses),
                     self.epoch)
        self.epoch = layout.epoch

    def _refresh_from(self, replies: Mapping[int, object]) -> bool:
        """Follows the layout of a shard that refused a part, if later than this client's (ps 0 may lag behind
        the others: a resize's driver that died between setting an epoch on them and on ps 0). Every shard
        of an epoch got the same layout, so any shard's is the job's. Blocks for one call a refusing shard."""
        for shard, reply in replies.items():
            if not isinstance(reply, _Moved):
                continue
            with self._lock:
                try:
                    layout = self._fanout.call(shard, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(),
                                                                                     timeout=t),
                                               self._fanout.control_timeout)
                except PSError:
                    continue  # stopped meanwhile (a removed shard): another refusal may tell
                if layout.epoch > self.epoch and layout.addresses:
                    self._follow(layout)
                    return True
        return False

    def each(self, groups: Mapping[int, list[str]], fn: Callable[[int, list[str], bool, bool], T],
             phase: str | None = None) -> dict[int, T]:
        """fn(shard, names, first, again) for every shard concurrently, as ShardFanout.each (the first error
        raised after all finish); a shard's names refused as moved are sent again (`again`) to their owners in
        the layout then followed. `first` is False for a part sent to a shard that already served one of this
        call (a push then counts no step there again). {shard: its first reply}."""
        results: dict[int, T] = {}
        pending = {shard: (names, True) for shard, names in groups.items()}
        for round_ in range(MAX_ROUNDS):
            def part(shard: int, names: list[str], again: bool = round_ > 0) -> T | _Moved:
                try:
                    return fn(shard, names, pending[shard][1], again)
                except LayoutChangedError as exc:
                    return _Moved(exc)

            replies = self._fanout.each({shard: names for shard, (names, _) in pending.items()}, part, phase)
            moved: list[str] = []
            error: LayoutChangedError | None = None
            for shard, reply in replies.items():
                if isinstance(reply, _Moved):
                    moved += pending[shard][0]
                    error = reply.error
                    self.refused += 1
                else:
                    results.setdefault(shard, reply)
            if error is None:
                return results
            if not self.refresh() and not self._refresh_from(replies):
                time.sleep(NOT_YET_SECONDS)  # a shard knew the new layout before shard 0 did: a moment
            regrouped = self._placement.group(moved)
            pending = {shard: (names, shard not in results) for shard, names in regrouped.items()}
            if phase in COUNTED:  # a push goes to every shard of the layout followed, once: one that refused its
                for shard in range(self.shards):  # part, or one the layout added, gets an empty part (it counts
                    if shard not in results:      # the step) where it has none (a pull's or an update's would
                        pending.setdefault(shard, ([], True))  # mean "every variable": not sent)
            if not pending:
                return results
        raise error
