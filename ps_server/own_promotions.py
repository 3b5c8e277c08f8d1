"""An arbiter's promotions of its own arbiter's backup (ps 0 promoting ps 1's, ps 1 ps 0's), each decided only
once the tie-breaker (ps 2: deposals.py) granted the deposal of the primary it replaces. No gRPC.

One such promotion at a time. Before it asks ps 2, the arbiter notes the
ask (the replaced primary's record and the ask's fresh name) as pending; a
promotion made clears it. Any other outcome but ps 2's refusal (its own
record refused the promotion, or ps 2's answer did not come) leaves a grant
ps 2 may hold while that primary still serves, unable to promote this
arbiter's backup: the arbiter takes it back (REINSTATE, one attempt) at
once, and while it cannot, again every TAKE_BACK_SECONDS from a thread of
its own, as long as its record still names that primary. A new promotion
of that shard takes back the pending ask first (ServerUnavailableError
while it cannot: the backup asks again), so ps 2 never keeps one behind a
later grant. Pending asks are held in memory: an arbiter that stops before
it took one back leaves it at ps 2 (docs/roadmap.md).

The deposal gets at least DEPOSE_SECONDS whatever the backup's own deadline
(its PROMOTE waits a fraction of a second): a promotion decided after the
backup stopped waiting is answered to its next ask, a repeat.

Thread-safe: one lock ("promotion" in locks.LOCK_ORDER, taken before the
shard's others), held across a call to ps 2 (each ends within its timeout).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Callable

from ..errors import PSError, ReplicaFencedError, ServerUnavailableError
from .deposals import TIE_BREAKER, Tiebreaker
from .locks import checked
from .replicas import ReplicaRegistry

__all__ = ["OwnPromotions", "TAKE_BACK_SECONDS", "DEPOSE_SECONDS"]

TAKE_BACK_SECONDS = 1.0  # between attempts to take back a grant whose promotion was not made
DEPOSE_SECONDS = 5.0     # the least a DEPOSE is given, whatever is left of its PROMOTE's deadline
REINSTATE_SECONDS = 2.0  # one REINSTATE attempt
_LOGGER = logging.getLogger(__name__)
Change = Callable[[], tuple]  # makes the promotion in the arbiter's record: (event, journal ticket)


class OwnPromotions:
    """Shard `index`'s promotions of its own arbiter's backup, recorded in `replicas` (see the module docstring).
    `tiebreaker`: how it asks ps 2 (set once the shard's links are made; None: it never asks)."""

    def __init__(self, index: int, replicas: ReplicaRegistry):
        self.index, self._replicas = index, replicas
        self.tiebreaker: Tiebreaker | None = None
        self._lock = checked(threading.Lock(), "promotion", "OwnPromotions._lock")
        self._pending: dict[int, tuple[dict, str]] = {}  # shard -> (the replaced primary's record, the ask's name)
        self._warned: set[str] = set()  # the asks whose take-back failed (logged once each)
        self._closed = threading.Event()

    def promote(self, shard: int, primary: str, backup: str, copy: str, change: Change,
                left: Callable[[], float | None]) -> tuple:
        """Promotes `backup` over shard `shard`'s `primary` (its copy `copy`) with `change`, once ps 2 deposed the
        primary replaced; returns change()'s (event, ticket), (None, None) if the record says so already (a
        retry). Blocks for ps 2's answer, DEPOSE_SECONDS at least. Raises what the record's decide raises
        (nothing changed), what change() raises, and PSError when ps 2 refuses (ReplicaFencedError: it put
        another process of this arbiter's shard in place) or does not answer; a grant ps 2 may hold for a
        promotion not made is being taken back then. ServerUnavailableError when another promotion of this
        arbiter's holds the lock past `left()`, or an earlier ask of this shard's cannot be taken back yet."""
        wait = left()
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            raise ServerUnavailableError(f"ps {self.index} decides another promotion of ps:{shard}'s backup: ask "
                                         f"again")
        try:
            if shard in self._pending and not self._take_back(shard):
                raise ServerUnavailableError(f"ps {self.index} cannot take back at ps:{TIE_BREAKER} its earlier "
                                             f"ask to depose ps:{shard}'s primary yet: ask again")
            replaced = self._replicas.entry(shard)
            if self._replicas.decide("promote", shard, primary, backup, copy=copy) is None:
                return None, None  # granted already: a retry
            grant = uuid.uuid4().hex[:16]
            self._pending[shard] = (replaced, grant)
            try:
                self.tiebreaker("depose", shard, replaced["primary"], replaced["failovers"], backup, grant,
                                max(left() or 0.0, DEPOSE_SECONDS))
            except ReplicaFencedError:
                del self._pending[shard]  # refused: nothing granted
                raise
            except PSError:
                self._take_back(shard)
                raise
            try:
                made = change()
            except PSError:
                self._take_back(shard)  # (none if the record moved on: made, then not journaled)
                raise
            del self._pending[shard]
            return made
        finally:
            self._lock.release()

    def run_take_backs(self) -> None:
        """Takes back the grants left pending every TAKE_BACK_SECONDS (thread body; returns at close())."""
        while not self._closed.wait(TAKE_BACK_SECONDS):
            if self._pending and self._lock.acquire(blocking=False):
                try:
                    for shard in list(self._pending):
                        self._take_back(shard)
                finally:
                    self._lock.release()

    def pending(self) -> dict[int, str]:
        """{shard: the name of the ask not yet taken back}."""
        with self._lock:
            return {shard: grant for shard, (_, grant) in self._pending.items()}

    def close(self) -> None:
        """Ends run_take_backs."""
        self._closed.set()

    def _take_back(self, shard: int) -> bool:
        """(Holding the lock.) One REINSTATE of shard `shard`'s pending ask, unless the record moved past the
        primary it replaced (a promotion made: the grant holds); True once it is pending no more."""
        replaced, grant = self._pending[shard]
        now = self._replicas.entry(shard)
        if (now["primary"], now["failovers"]) == (replaced["primary"], replaced["failovers"]):
            try:
                self.tiebreaker("reinstate", shard, "", 0, "", grant, REINSTATE_SECONDS)
            except PSError as exc:
                if grant not in self._warned:
                    self._warned.add(grant)
                    _LOGGER.warning("ps %d could not take back at ps:%d its deposal of ps:%d's primary %s, whose "
                                    "promotion it did not make: %s; trying again", self.index, TIE_BREAKER, shard,
                                    replaced["primary"], exc)
                return False
            _LOGGER.info("ps %d took back at ps:%d its deposal of ps:%d's primary %s", self.index, TIE_BREAKER,
                         shard, replaced["primary"])
        del self._pending[shard]
        self._warned.discard(grant)
        return True
