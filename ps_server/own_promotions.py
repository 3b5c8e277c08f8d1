"""An arbiter's promotions of its own arbiter's backup (ps 0 promoting ps 1's, ps 1 ps 0's), each decided only
once the tie-breaker (ps 2: deposals.py) granted the deposal of the primary it replaces. No gRPC.

One such promotion at a time. Before it asks ps 2, the arbiter notes the
ask (the replaced primary and its failover count, and the ask's fresh name)
as pending, in a journal record (kind "ask") that it waits for, written by
its own backup too unless that backup is lost (as the promotion itself is
answered past a lost backup: coordinator.py); a promotion made clears it. Any other outcome but ps 2's
refusal (its own record refused the promotion, or ps 2's answer did not
come) leaves a grant ps 2 may hold while that primary still serves, unable
to promote this arbiter's backup: the arbiter takes it back (REINSTATE, one
attempt) at once, and while it cannot, again every TAKE_BACK_SECONDS from a
thread of its own, as long as its record still names that primary. A new
promotion of that shard takes back the pending ask first
(ServerUnavailableError while it cannot: the backup asks again), so ps 2
never keeps one behind a later grant. An arbiter that stops with an ask
pending finds it again in its journal (restarted on its folder, or its
backup promoted) and takes it back the same way once it serves. Clearing
an ask is journaled too, unwaited: one whose record was lost is cleared
again by the thread, which finds the arbiter's record moved past it.

The deposal gets at least DEPOSE_SECONDS whatever the backup's own deadline
(its PROMOTE waits a fraction of a second): a promotion decided after the
backup stopped waiting is answered to its next ask, a repeat.

Thread-safe: one lock ("promotion" in locks.LOCK_ORDER, taken before the
shard's others), held across an ask's record and a call to ps 2 (each ends
within its timeout). apply() changes the pending asks: holding that lock
(through `log`), or before the shard starts (replay).
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
# Journals an "ask" event and applies it (apply): waits up to its timeout for the record (None: does not wait).
Log = Callable[[dict, float | None], None]


class OwnPromotions:
    """Shard `index`'s promotions of its own arbiter's backup, recorded in `replicas` (see the module docstring).
    `log` journals and applies its asks' events. `tiebreaker`: how it asks ps 2 (set once the shard's links
    are made; None: it never asks, nor takes back)."""

    def __init__(self, index: int, replicas: ReplicaRegistry, log: Log):
        self.index, self._replicas, self._log = index, replicas, log
        self.tiebreaker: Tiebreaker | None = None
        self._lock = checked(threading.Lock(), "promotion", "OwnPromotions._lock")
        self._pending: dict[int, tuple[dict, str]] = {}  # shard -> ({primary, failovers} replaced, the ask's name)
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
            try:
                self._log({"shard": shard, "grant": grant, "replaced": {"primary": replaced["primary"],
                                                                        "failovers": replaced["failovers"]}},
                          max(left() or 0.0, DEPOSE_SECONDS))
            except PSError:
                if shard in self._pending:  # never sent: nothing to take back
                    self._clear(shard)
                raise
            try:
                self.tiebreaker("depose", shard, replaced["primary"], replaced["failovers"], backup, grant,
                                max(left() or 0.0, DEPOSE_SECONDS))
            except ReplicaFencedError:
                self._clear(shard)  # refused: nothing granted
                raise
            except PSError:
                self._take_back(shard)
                raise
            try:
                made = change()
            except PSError:
                self._take_back(shard)  # (none if the record moved on: made, then not journaled)
                raise
            self._clear(shard)
            return made
        finally:
            self._lock.release()

    def apply(self, event: dict) -> None:
        """Makes one ask's event (live through `log`, or replayed): pending with its "replaced", else cleared (if
        it is still the shard's pending ask)."""
        shard = int(event["shard"])
        if "replaced" in event:
            self._pending[shard] = (dict(event["replaced"]), str(event["grant"]))
        elif shard in self._pending and self._pending[shard][1] == event["grant"]:
            del self._pending[shard]

    def export(self) -> dict:
        """The pending asks, for a journal's base ({} when none; call it where apply() cannot run)."""
        return {str(shard): {"replaced": dict(replaced), "grant": grant}
                for shard, (replaced, grant) in self._pending.items()}

    def restore(self, state: dict | None) -> None:
        """Before the shard starts: the pending asks of export()."""
        self._pending = {int(shard): (dict(ask["replaced"]), str(ask["grant"])) for shard, ask in (state or {}).items()}

    def run_take_backs(self) -> None:
        """Takes back the grants left pending every TAKE_BACK_SECONDS (thread body; returns at close())."""
        while not self._closed.wait(TAKE_BACK_SECONDS):
            if self._pending and self.tiebreaker is not None and self._lock.acquire(blocking=False):
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
                    _LOGGER.warning("ps %d could not take back at ps:%d its deposal of ps:%d's primary %s (ask %s), "
                                    "whose promotion it did not make: %s; trying again", self.index, TIE_BREAKER,
                                    shard, replaced["primary"], grant, exc)
                return False
            _LOGGER.info("ps %d took back at ps:%d its deposal of ps:%d's primary %s (ask %s)", self.index,
                         TIE_BREAKER, shard, replaced["primary"], grant)
        self._clear(shard)
        self._warned.discard(grant)
        return True

    def _clear(self, shard: int) -> None:
        """(Holding the lock.) Clears shard `shard`'s pending ask, journaled unwaited: a record lost leaves it
        pending in the journal, where the next take-back finds the arbiter's record moved past it or takes the
        grant back again (REINSTATE of one taken back already is a repeat)."""
        try:
            self._log({"shard": shard, "grant": self._pending[shard][1]}, None)
        except PSError as exc:  # cleared in memory (apply() runs first), or left for the next take-back to clear
            _LOGGER.warning("ps %d could not journal the end of its ask for ps:%d's promotion: %s", self.index,
                            shard, exc)
