"""The job's live resize as ps 0 owns it: what it is for, who drives it, its lease and its moves. No gRPC.

One resize runs at a time. Its driver (ps-admin resize, PSClient.resize:
client/resize.py) begins it here, then reports its plan and each move's
status; every report renews the driver's lease. A driver that stops
renewing (killed, paused, cut off) leaves the resize *cut off* once the
lease runs out: another driver may then take it over (ps-admin resize
--resume finishes it, --abort rolls it back, or finishes it past its point
of no return, below; a chief that starts does as --abort), and from then on
the old driver's reports are refused, so it can never act on the record
again. The shards are the truth of where each
variable is (what they hold, and what their outboxes keep: layout.py); this
record is the truth of what the resize was for and who may drive it.

    NONE --begin--> RUNNING --end(DONE | ABORTED)--> DONE / ABORTED --begin--> RUNNING ...
                    RUNNING --take_over (lease out)--> RUNNING, another driver

A move's status goes PLANNED -> EXPORTED -> IMPORTED -> CONFIRMED, or from
PLANNED or EXPORTED to RETURNED (rolled back), never back.

The embedding tables' re-layout (`tables`: onto how many shards, from how
many, built) is recorded before the first epoch that freezes them: from
then on the resize can only go forward (a shard may have built its part of
the new layout from the others' rows), so a driver that takes it over
finishes it, one that aborts too. `built` (every new shard built its
tables) goes from False to True, never back.

Every change is an event (a small JSON-able dict) made by `apply`, live and
when the journal is replayed (recorded by the caller: moves.py); `export` and
`restore` carry the whole record in journal bases and checkpoints. The lease
is not journaled: a ps 0 that restarts gives a running resize's driver a
whole lease from its start.

Thread-safe: its own lock (an "owner" in locks.LOCK_ORDER).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..errors import InvalidArgumentError, ResizeConflictError
from .layout import LEASE_SECONDS, MAX_SHARDS, lease_of
from .locks import guarded

__all__ = ["ResizeOwner", "PHASES", "STATUSES"]

_LOGGER = logging.getLogger(__name__)
PHASES = ("none", "running", "done", "aborted")                           # ps.proto's ResizeState.Phase, in order
STATUSES = ("planned", "exported", "imported", "confirmed", "returned")  # ResizeMove.Status, in order
MAX_DRIVER_CHARS = 256
MAX_WHY_CHARS = 1000
MAX_NAME_CHARS = 1024
_NEXT = {"planned": {"exported", "imported", "confirmed", "returned"}, "exported": {"imported", "confirmed", "returned"},
         "imported": {"confirmed"}, "confirmed": set(), "returned": set()}

Event = dict


def _check_addresses(addresses: list[str], what: str) -> None:
    if not 1 <= len(addresses) <= MAX_SHARDS or not all(addresses) or len(set(addresses)) != len(addresses):
        raise InvalidArgumentError(f"a resize's {what} shards are 1 to {MAX_SHARDS} distinct, non-empty addresses. "
                                   f"Received: {len(addresses)}")


class ResizeOwner:
    """The resize record on ps 0 (see the module docstring). `now`: monotonic seconds (injectable)."""

    def __init__(self, now: Callable[[], float] = time.monotonic):
        self._now = now
        self._lock = threading.Lock()
        self._id = 0
        self._phase = "none"
        self._driver = ""
        self._before: list[str] = []
        self._after: list[str] = []
        self._hold = 0
        self._moves: dict[str, dict] = {}  # name -> {"from", "to", "bytes", "status"}, in plan order
        self._lease = LEASE_SECONDS
        self._deadline = 0.0               # when the driver's lease runs out (monotonic)
        self._why = ""
        self._tables: dict | None = None   # {"count", "from", "built"}: the tables' re-layout, once begun
        self._cut_off_logged = False

    # -- reading --------------------------------------------------------------------------------

    @guarded
    def state(self) -> dict:
        """The record: id, phase, driver, before, after, hold, moves [(name, from, to, bytes, status)], lease,
        lease_left (0 once it ran out or the resize is not running), why, tables ({"count", "from", "built"}
        or None). Logs, once, a resize found cut off."""
        left = max(0.0, self._deadline - self._now()) if self._phase == "running" else 0.0
        if self._phase == "running" and left == 0 and not self._cut_off_logged:
            self._cut_off_logged = True
            _LOGGER.warning("resize %d (%d -> %d shards) is cut off: its driver %s renewed nothing for %g s; "
                            "ps-admin resize --resume finishes it, --abort rolls it back where it can", self._id,
                            len(self._before), len(self._after), self._driver, self._lease)
        return {"id": self._id, "phase": self._phase, "driver": self._driver, "before": list(self._before),
                "after": list(self._after), "hold": self._hold, "lease": self._lease, "lease_left": left,
                "moves": [(name, m["from"], m["to"], m["bytes"], m["status"]) for name, m in self._moves.items()],
                "why": self._why, "tables": dict(self._tables) if self._tables else None}

    @property
    def running(self) -> bool:
        return self._phase == "running"

    # -- the driver's calls: each returns the event to journal (None: nothing to record) --------------

    @guarded
    def begin(self, driver: str, before: list[str], after: list[str], lease: float) -> Event:
        """A new resize from `before` to `after` shards, driven by `driver`. ResizeConflictError while one runs
        (saying whether its driver holds the lease or it was cut off); InvalidArgumentError for a malformed
        request. Nothing changes when it raises."""
        self._check_driver(driver)
        _check_addresses(before, "current")
        _check_addresses(after, "new")
        lease = lease_of(lease, "a resize")
        if self._phase == "running":
            raise ResizeConflictError(self._busy())
        event = {"op": "begin", "id": self._id + 1, "driver": driver, "before": list(before), "after": list(after),
                 "lease": lease}
        self._apply(event)
        return event

    @guarded
    def take_over(self, resize_id: int, driver: str, lease: float) -> Event:
        """`driver` drives the running resize `resize_id` from now on; ResizeConflictError while its driver's
        lease runs (a driver may take its own back at any time), or if it is not the one running."""
        self._check_driver(driver)
        lease = lease_of(lease, "a resize")
        self._check_id(resize_id)
        if driver != self._driver and self._now() < self._deadline:
            raise ResizeConflictError(self._busy())
        event = {"op": "take_over", "id": resize_id, "driver": driver, "lease": lease}
        self._apply(event)
        _LOGGER.warning("resize %d taken over by %s", resize_id, driver)
        return event

    @guarded
    def renew(self, resize_id: int, driver: str) -> None:
        """Renews the lease (not journaled); ResizeConflictError unless `driver` drives resize `resize_id`."""
        self._check_driver_of(resize_id, driver)
        self._renew()

    @guarded
    def plan(self, resize_id: int, driver: str, moves: list[tuple[str, int, int, int]], hold: int) -> Event:
        """The moves [(name, from, to, bytes)] still to make (replacing those of an earlier plan not ended yet),
        and the sync hold's step (0: none)."""
        self._check_driver_of(resize_id, driver)
        shards = max(len(self._before), len(self._after))
        if not 0 <= hold < 2 ** 62:
            raise InvalidArgumentError(f"a hold's step must be in [0, 2**62). Received: {hold}")
        names = [name for name, _, _, _ in moves]
        if len(set(names)) != len(names):
            raise InvalidArgumentError("a resize's plan names each variable once")
        for name, source, target, nbytes in moves:
            if (not name or len(name) > MAX_NAME_CHARS or not (0 <= source < shards and 0 <= target < shards)
                    or source == target or not 0 <= nbytes < 2 ** 62):
                raise InvalidArgumentError(f"a planned move names a variable (1 to {MAX_NAME_CHARS} characters), "
                                           f"two different shards of the resize's {shards} and its bytes. "
                                           f"Received: {name[:80]!r} from ps {source} to ps {target}, {nbytes}")
        event = {"op": "plan", "id": resize_id, "hold": hold, "moves": [list(move) for move in moves]}
        self._renew()
        self._apply(event)
        return event

    @guarded
    def moved(self, resize_id: int, driver: str, moves: list[tuple[str, str]]) -> Event | None:
        """Moves [(name, status)] reached their status (a status they had already: no change). InvalidArgumentError
        for a name not planned or a status that goes back."""
        self._check_driver_of(resize_id, driver)
        changes = []
        for name, status in moves:
            move = self._moves.get(name)
            if move is None or status not in STATUSES:
                raise InvalidArgumentError(f"resize {resize_id} planned no move of {name[:80]!r} (or {status!r} is "
                                           f"no status); nothing was recorded")
            if status == move["status"]:
                continue
            if status not in _NEXT[move["status"]]:
                raise InvalidArgumentError(f"the move of {name!r} is {move['status']}; it cannot become {status}")
            changes.append([name, status])
        self._renew()
        if not changes:
            return None
        event = {"op": "moved", "id": resize_id, "moves": changes}
        self._apply(event)
        return event

    @guarded
    def tables(self, resize_id: int, driver: str, count: int, source: int, built: bool) -> Event | None:
        """The tables' re-layout onto `count` shards from `source`, begun (the resize's point of no return), or
        `built` by every shard of `count`; the same again: no change. InvalidArgumentError for counts out of
        range, another re-layout than the one recorded, or `built` going back."""
        self._check_driver_of(resize_id, driver)
        if not (1 <= count <= MAX_SHARDS and 1 <= source <= MAX_SHARDS) or count == source:
            raise InvalidArgumentError(f"a re-layout of the tables is onto 1 to {MAX_SHARDS} shards from another "
                                       f"such count. Received: onto {count} from {source}")
        now = self._tables
        if now is not None and ((now["count"], now["from"]) != (count, source) or (now["built"] and not built)):
            raise InvalidArgumentError(f"resize {resize_id} re-lays its tables out onto {now['count']} shards from "
                                       f"{now['from']}{' (built)' if now['built'] else ''}; it cannot become onto "
                                       f"{count} from {source}{' (built)' if built else ''}; nothing was recorded")
        self._renew()
        if now is not None and now["built"] == built:
            return None
        event = {"op": "tables", "id": resize_id, "count": count, "from": source, "built": built}
        self._apply(event)
        return event

    @guarded
    def end(self, resize_id: int, driver: str, phase: str, why: str) -> Event:
        """The resize ended: `phase` "done" or "aborted", `why` a line."""
        self._check_driver_of(resize_id, driver)
        if phase not in ("done", "aborted") or len(why) > MAX_WHY_CHARS:
            raise InvalidArgumentError(f"a resize ends DONE or ABORTED with a line of at most {MAX_WHY_CHARS} "
                                       f"characters. Received: {phase!r}")
        event = {"op": "end", "id": resize_id, "phase": phase, "why": why}
        self._apply(event)
        return event

    # -- events, the journal, checkpoints -------------------------------------------------------------

    @guarded
    def apply(self, event: Event) -> None:
        """Makes the change of one event again (journal replay)."""
        self._apply(event)

    def _apply(self, event: Event) -> None:
        op = event["op"]
        if op == "begin":
            self._id, self._phase, self._driver = event["id"], "running", event["driver"]
            self._before, self._after, self._hold, self._moves = list(event["before"]), list(event["after"]), 0, {}
            self._lease, self._why, self._cut_off_logged, self._tables = event["lease"], "", False, None
            self._renew()
        elif op == "take_over":
            self._driver, self._lease, self._cut_off_logged = event["driver"], event["lease"], False
            self._renew()
        elif op == "plan":
            self._hold = event["hold"]
            kept = {name: m for name, m in self._moves.items() if m["status"] in ("confirmed", "returned")}
            fresh = {name: {"from": source, "to": target, "bytes": nbytes, "status": "planned"}
                     for name, source, target, nbytes in event["moves"] if name not in kept}
            self._moves = {**kept, **fresh}
        elif op == "moved":
            for name, status in event["moves"]:
                self._moves[name]["status"] = status
        elif op == "tables":
            self._tables = {"count": event["count"], "from": event["from"], "built": event["built"]}
        elif op == "end":
            self._phase, self._why = event["phase"], event["why"]
        else:
            raise ValueError(f"not a resize event: {op!r}")

    @guarded
    def export(self) -> dict:
        """The record for a journal base or a checkpoint."""
        return {"id": self._id, "phase": self._phase, "driver": self._driver, "before": list(self._before),
                "after": list(self._after), "hold": self._hold, "lease": self._lease, "why": self._why,
                "tables": dict(self._tables) if self._tables else None,
                "moves": [[name, m["from"], m["to"], m["bytes"], m["status"]] for name, m in self._moves.items()]}

    @guarded
    def restore(self, state: dict | None) -> None:
        """Takes export()'s record (None: no resize yet); a running one's driver gets a whole lease from now."""
        state = state or {}
        self._id, self._phase, self._driver = state.get("id", 0), state.get("phase", "none"), state.get("driver", "")
        self._before, self._after = list(state.get("before", [])), list(state.get("after", []))
        self._hold, self._lease, self._why = state.get("hold", 0), state.get("lease", LEASE_SECONDS), \
            state.get("why", "")
        self._moves = {name: {"from": source, "to": target, "bytes": nbytes, "status": status}
                       for name, source, target, nbytes, status in state.get("moves", [])}
        self._tables = dict(state["tables"]) if state.get("tables") else None
        self._cut_off_logged = False
        self._renew()

    # -- helpers (under the lock) ---------------------------------------------------------------------

    def _renew(self) -> None:
        self._deadline = self._now() + self._lease

    def _busy(self) -> str:
        left = self._deadline - self._now()
        what = (f"its driver {self._driver} holds the lease for {left:.1f} s more: wait for it to end" if left > 0
                else f"it was cut off: its driver {self._driver} renewed nothing for {self._lease:g} s; run "
                     f"ps-admin resize --resume to finish it or --abort to roll it back where it can")
        return f"resize {self._id} ({len(self._before)} -> {len(self._after)} shards) is running: {what}"

    @staticmethod
    def _check_driver(driver: str) -> None:
        if not driver or len(driver) > MAX_DRIVER_CHARS:
            raise InvalidArgumentError(f"a resize's driver is named in 1 to {MAX_DRIVER_CHARS} characters. "
                                       f"Received: {len(driver)}")

    def _check_id(self, resize_id: int) -> None:
        if self._phase != "running" or resize_id != self._id:
            now = f"resize {self._id} is {self._phase}" if self._id else "no resize was begun"
            raise ResizeConflictError(f"resize {resize_id} is not running ({now}); nothing was recorded")

    def _check_driver_of(self, resize_id: int, driver: str) -> None:
        self._check_id(resize_id)
        if driver != self._driver:
            raise ResizeConflictError(f"resize {resize_id} is driven by {self._driver} now (it was taken over: "
                                      f"{driver} renewed nothing in time); {driver} must stop")
