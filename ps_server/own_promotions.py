"""An arbiter's promotions of its own arbiter's backup (ps 0 promoting ps 1's, ps 1 ps 0's), each decided only
once the tie-breaker (ps 2: deposals.py) granted the deposal of the primary it replaces. No gRPC.

One such promotion at a time. Before it asks ps 2, the arbiter notes the
ask (the replaced primary's record and the ask's fresh name) as pending; a
promotion made clears it. Any other outcome (its own record refused the
promotion, ps 2 did not answer, the record could not be journaled before
anything changed) leaves a grant ps 2 may hold while that primary still
serves, unable to promote this arbiter's backup: the arbiter takes it back
(REINSTATE) at once, and, while it cannot, every TAKE_BACK_SECONDS from a
thread of its own, as long as its record still names that primary (a later
ask replaces the pending one: ps 2 keeps the later grant). Pending asks are
held in memory: an arbiter that stops before it took one back leaves it at
ps 2 (docs/roadmap.md).

Thread-safe: one lock, held across an ask of ps 2 (each ask ends within its
timeout), never while this shard's other locks are.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Callable

from ..errors import PSError, ServerUnavailableError
from .deposals import TIE_BREAKER, Tiebreaker
from .replicas import ReplicaRegistry

__all__ = ["OwnPromotions", "TAKE_BACK_SECONDS"]

TAKE_BACK_SECONDS = 1.0  # between attempts to take back a grant whose promotion was not made
ASK_SECONDS = 5.0        # one REINSTATE call, when no caller's deadline bounds it
_LOGGER = logging.getLogger(__name__)
Change = Callable[[], tuple]  # makes the promotion in the arbiter's record: (event, journal ticket)


class OwnPromotions:
    """Shard `index`'s promotions of its own arbiter's backup, recorded in `replicas` (see the module docstring).
    `tiebreaker`: how it asks ps 2 (set once the shard's links are made; None: it never asks)."""

    def __init__(self, index: int, replicas: ReplicaRegistry):
        self.index, self._replicas = index, replicas
        self.tiebreaker: Tiebreaker | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[dict, str]] = {}  # shard -> (the replaced primary's record, the ask's name)
        self._warned: set[str] = set()  # the asks whose take-back failed once (logged once each)
        self._closed = threading.Event()

    def promote(self, shard: int, primary: str, backup: str, copy: str, change: Change,
                left: Callable[[], float | None]) -> tuple:
        """Promotes `backup` over shard `shard`'s `primary` (its copy `copy`) with `change`, once ps 2 deposed the
        primary replaced; returns change()'s (event, ticket), (None, None) if the record says so already (a
        retry). Blocks for ps 2's answer within `left()` s. Raises what the record's decide raises, and PSError
        when ps 2 refuses (ReplicaFencedError: ps 2 records this arbiter deposed) or does not answer; then the
        record is as it was, and the grant is being taken back. ServerUnavailableError when another promotion
        of this arbiter's holds the lock past `left()`."""
        wait = left()
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            raise ServerUnavailableError(f"ps {self.index} decides another promotion of ps:{shard}'s backup: ask "
                                         f"again")
        try:
            replaced = self._replicas.entry(shard)
            if self._replicas.decide("promote", shard, primary, backup, copy=copy) is None:
                return None, None  # granted already: a retry
            grant = uuid.uuid4().hex[:16]
            self._pending[shard] = (replaced, grant)
            try:
                self.tiebreaker("depose", shard, replaced["primary"], replaced["failovers"], backup, grant, left())
                made = change()
            except PSError:
                if self._promoted(shard, replaced):  # made, then its record not journaled: the grant holds
                    self._pending.pop(shard, None)
                else:
                    remaining = left()
                    self._take_back(shard, ASK_SECONDS if remaining is None else max(remaining, 1.0))
                raise
            self._pending.pop(shard, None)
            return made
        finally:
            self._lock.release()

    def run_take_backs(self) -> None:
        """Takes back the grants left pending every TAKE_BACK_SECONDS (thread body; returns at close())."""
        while not self._closed.wait(TAKE_BACK_SECONDS):
            if self._pending and self._lock.acquire(blocking=False):
                try:
                    for shard in list(self._pending):
                        self._take_back(shard, ASK_SECONDS)
                finally:
                    self._lock.release()

    def pending(self) -> dict[int, str]:
        """{shard: the name of the ask not yet taken back}."""
        with self._lock:
            return {shard: grant for shard, (_, grant) in self._pending.items()}

    def close(self) -> None:
        """Ends run_take_backs."""
        self._closed.set()

    def _promoted(self, shard: int, replaced: dict) -> bool:
        """Whether the record moved past the primary `replaced` (holding the lock: only a promotion does)."""
        now = self._replicas.entry(shard)
        return (now["primary"], now["failovers"]) != (replaced["primary"], replaced["failovers"])

    def _take_back(self, shard: int, timeout: float) -> None:
        """(Holding the lock.) One REINSTATE of shard `shard`'s pending ask; it stays pending if ps 2 does not
        answer."""
        replaced, grant = self._pending[shard]
        if self._promoted(shard, replaced):
            self._pending.pop(shard)
            return
        try:
            self.tiebreaker("reinstate", shard, "", 0, "", grant, timeout)
        except PSError as exc:
            if grant not in self._warned:
                self._warned.add(grant)
                _LOGGER.warning("ps %d could not take back at ps:%d its deposal of ps:%d's primary %s, whose "
                                "promotion it did not make: %s; trying again", self.index, TIE_BREAKER, shard,
                                replaced["primary"], exc)
            return
        self._pending.pop(shard)
        self._warned.discard(grant)
        _LOGGER.info("ps %d took back at ps:%d its deposal of ps:%d's primary %s", self.index, TIE_BREAKER, shard,
                     replaced["primary"])
