"""Who takes part in the job, as one shard sees it: leases, progress, incarnations. No gRPC.

A worker is *live* while both hold:
* its lease: it sent something (push, join, heartbeat) within lease_seconds;
* its progress: it pushed within the progress timeout, or a shard is holding
  one of its pushes (waiting for a sync release or the ssp bound is not a stall).
    progress timeout = max(progress_seconds, PROGRESS_MULTIPLE x median push interval)

Each worker's pace (a moving average of its push intervals) gives it a
straggler score: its interval over the median of the other live workers'.

Each member counts its pushes (count_push: applied, summed into a sync step
or dropped as stale, live and at the journal's replay), over every
incarnation of its name; the count and the step of its last push go into
checkpoints and "member" records, and GetStatus reports them (the chief's
account of the data trained, a restarted worker's batches to skip).

Each client process draws a random incarnation (never 0; 0 means none was
given, and fences nothing). A known worker arriving with a new incarnation is a restart: the old incarnation is retired, and every later
call from it (a push, a heartbeat, a leave) is refused with
WorkerReplacedError, so a dying old process can neither evict its successor
nor have a retried push applied. A worker that left, or whose lease or
progress ran out, and that comes back with the same incarnation rejoins
(in sync mode, on a shard but shard 0, once a call names a step the shard
has not passed: Bookkeeping.touch): nothing about its pushes is forgotten.

Members are bounded: the names of the cluster spec's workers (`known`) may
always join, and at most `elastic` other names (None: no bound); a new name
past that is refused with PermissionDeniedError, so invented names cannot
grow a shard's membership and ledger without end.

Thread-safe: its own lock (an "owner" in locks.LOCK_ORDER) guards every call
here; `members` and the counters `expired` and `stalls` may be read without it
(status, tests).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import threading
from typing import Mapping

import numpy as np

from ..errors import PermissionDeniedError, WorkerReplacedError
from .locks import guarded

__all__ = ["Member", "Membership", "paces_of", "PROGRESS_MULTIPLE", "PACE_WEIGHT"]

_LOGGER = logging.getLogger(__name__)
PROGRESS_MULTIPLE = 20.0   # median push intervals without a push before a heartbeating worker is stalled
PACE_WEIGHT = 0.2          # weight of a new interval in a worker's moving average of them
RETIRED_PER_WORKER = 64    # replaced incarnations remembered per task (restarts of one task, job-long)
_INTERVALS_KEPT = 256      # push intervals the median is taken over
_MEDIAN_EVERY = 16         # new intervals between two computations of the median


@dataclasses.dataclass
class Member:
    """One worker as this shard knows it."""

    incarnation: int
    last_seen: float          # any call: renews the lease
    last_progress: float      # a push arrived, or one of its held pushes was released
    counts_from: int = 0      # first step whose quorum counts it (a late or returning worker
                              # counts from the step it starts at, not for one being finished)
    clock: int = 0            # pushes applied (ssp)
    gone: bool = False        # left, or its lease ran out
    left: bool = False        # gone by leave() (not by its lease running out)
    stalled: bool = False     # heartbeats, but pushed nothing for the progress timeout
    held: int = 0             # its pushes this shard is holding right now
    last_push: float | None = None
    interval: float | None = None  # moving average of its push intervals (its step time, as seen here)
    pushes: int = 0           # pushes counted (count_push), every incarnation of the name
    last_push_step: int = -1  # the step its last counted push was computed at

    @property
    def state(self) -> str:
        """"live", "left" (it called Leave) or "lost" (its lease or progress ran out)."""
        return "live" if self.live else "left" if self.left else "lost"

    @property
    def live(self) -> bool:
        return not self.gone and not self.stalled


class Membership:
    """The workers of the job on one shard (see the module docstring)."""

    def __init__(self, known: frozenset[str] = frozenset(), elastic: int | None = None) -> None:
        self.known = known        # the cluster spec's worker names: always admitted
        self.elastic = elastic    # other names admitted, at most (None: any number)
        self._lock = threading.RLock()  # re-entrant: its methods call each other
        self.members: dict[str, Member] = {}
        self.retired: dict[str, collections.deque[int]] = {}
        self._intervals: collections.deque[float] = collections.deque(maxlen=_INTERVALS_KEPT)
        self._median = 0.0         # of the intervals, recomputed every _MEDIAN_EVERY new ones
        self._since_median = 0
        self.expired = 0   # leases that ran out
        self.stalls = 0    # progress timeouts

    @guarded
    def reset(self) -> None:
        """Forgets every member, retired incarnation, interval and counter (a new job); keeps the bound."""
        self.members, self.retired = {}, {}
        self._intervals.clear()
        self._median, self._since_median = 0.0, 0
        self.expired = self.stalls = 0

    # -- calls from workers ----------------------------------------------------------------------

    @guarded
    def check(self, worker: str, incarnation: int) -> None:
        """WorkerReplacedError if `incarnation` of `worker` was replaced by a newer one."""
        if incarnation in self.retired.get(worker, ()):
            current = self.members[worker].incarnation if worker in self.members else 0
            raise WorkerReplacedError(
                f"{worker} incarnation {incarnation:x} was replaced by a newer process (incarnation {current:x}); "
                f"this process must stop")

    @guarded
    def touch(self, worker: str, incarnation: int, *, now: float, step: int, start_step: int, level: int,
              progress: bool, rejoin: bool = True) -> tuple[str | None, int | None]:
        """Renews `worker`'s lease (and progress if it pushed); returns (what changed, retired incarnation).

        What changed is None, "joined", "rejoined", "restarted" or "resumed"
        (back from a stall). `step` is the shard's open step, `start_step` the
        step the worker is at, `level` the ssp clock a newcomer starts at.
        `rejoin` False (Bookkeeping.touch: a sync call naming a step this
        shard has passed): a gone or stalled worker stays so (a stalled one's
        lease is renewed), to count again from the step a later call names.
        Raises WorkerReplacedError for a retired incarnation.
        """
        self.check(worker, incarnation)
        member = self.members.get(worker)
        if member is None:
            self._admit(worker)
            counts_from = max(step, start_step)  # never a step it will not push for (in the grace too)
            self.members[worker] = Member(incarnation, now, now, counts_from=counts_from, clock=level)
            return "joined", None
        retired = None
        if incarnation and not member.incarnation:  # known so far only from calls that gave none
            member.incarnation = incarnation
        if incarnation and member.incarnation != incarnation:
            retired = member.incarnation
            self.retire(worker, retired)
            member.incarnation, member.last_push, member.held = incarnation, None, 0
            event = "restarted"
        elif member.gone or (member.stalled and progress):
            if not rejoin:  # left as it is: a stalled one (still heartbeating) only has its lease renewed
                if not member.gone:
                    member.last_seen = now
                return None, None
            event = "rejoined" if member.gone else "resumed"
        else:
            member.last_seen = now
            if progress:
                member.last_progress = now
            return None, None
        member.gone = member.stalled = member.left = False
        member.last_seen = member.last_progress = now
        member.counts_from = max(step, start_step)
        member.clock = max(member.clock, level)
        return event, retired

    @guarded
    def restarted(self, worker: str) -> bool:
        """Whether `worker` is known and its current incarnation replaced an earlier one (here, or before a
        restore or replay: it has retired incarnations), so what that one trained is done."""
        return worker in self.members and bool(self.retired.get(worker))

    def _admit(self, worker: str) -> None:
        """PermissionDeniedError unless a new `worker` may join (see the module docstring)."""
        if self.elastic is None or worker in self.known:
            return
        others = sum(1 for name in self.members if name not in self.known)
        if others >= self.elastic:
            raise PermissionDeniedError(
                f"{worker!r} is not a worker of this job's cluster spec, and the {self.elastic} places for other "
                f"workers (ps-server --elastic-workers) are taken; nothing was changed")

    @guarded
    def pushed(self, worker: str, now: float) -> None:
        """Records a push's arrival time (for the median push interval)."""
        member = self.members[worker]
        if member.last_push is not None:
            gap = now - member.last_push
            member.interval = gap if member.interval is None else \
                (1 - PACE_WEIGHT) * member.interval + PACE_WEIGHT * gap
            self._intervals.append(gap)
            self._since_median += 1
            if self._since_median >= _MEDIAN_EVERY or len(self._intervals) < _MEDIAN_EVERY:
                self._median, self._since_median = statistics.median(self._intervals), 0
        member.last_push = now

    @guarded
    def leave(self, worker: str, incarnation: int) -> bool:
        """Marks `worker` gone; True if that changed anything. WorkerReplacedError for a retired incarnation."""
        self.check(worker, incarnation)
        member = self.members.get(worker)
        if member is None or member.incarnation != incarnation or member.gone:
            return False
        member.gone = member.left = True
        return True

    @guarded
    def retire(self, worker: str, incarnation: int) -> None:
        """Fences `incarnation` of `worker` off for good (idempotent)."""
        retired = self.retired.setdefault(worker, collections.deque(maxlen=RETIRED_PER_WORKER))
        if incarnation not in retired:
            retired.append(incarnation)

    @guarded
    def retired_of(self, worker: str) -> list[int]:
        """The retired incarnations of `worker`, oldest first."""
        return list(self.retired.get(worker, ()))

    @guarded
    def count_push(self, worker: str, step: int) -> None:
        """Counts one push of `worker` computed at `step` (applied, summed or dropped as stale; live and at
        replay); nothing for an unknown worker."""
        member = self.members.get(worker)
        if member is not None:
            member.pushes += 1
            member.last_push_step = step

    @guarded
    def advance_clock(self, worker: str) -> None:
        """Counts one push of `worker` applied (its ssp clock); nothing for an unknown worker."""
        member = self.members.get(worker)
        if member is not None:
            member.clock += 1

    @guarded
    def clock_of(self, worker: str) -> int | None:
        """`worker`'s ssp clock, or None if it is unknown."""
        member = self.members.get(worker)
        return None if member is None else member.clock

    @guarded
    def hold(self, worker: str) -> Member | None:
        """Counts a push of `worker` that the shard holds (it never stalls meanwhile); returns the member to
        give to unhold(), None if `worker` is unknown."""
        member = self.members.get(worker)
        if member is not None:
            member.held += 1
        return member

    @guarded
    def unhold(self, member: Member | None, now: float) -> bool:
        """A push hold() counted is let go at `now` (its progress renewed); True if none of that member's
        pushes is held any more (its progress deadline counts again)."""
        if member is None:
            return False
        member.held -= 1
        member.last_progress = now
        return not member.held

    @guarded
    def joined(self) -> int:
        """Workers that ever joined this job here, live or not."""
        return len(self.members)

    @guarded
    def never_joined(self, names: list[str]) -> list[str]:
        """Those of `names` that never joined this job here, in order."""
        return [name for name in names if name not in self.members]

    @guarded
    def standing(self, names: list[str]) -> list[tuple[str, str, int, int, int]]:
        """(name, state, pushes, last push step, restarts) of each of `names` that joined here, in order."""
        return [(name, m.state, m.pushes, m.last_push_step, len(self.retired.get(name, ())))
                for name in names if (m := self.members.get(name)) is not None]

    # -- the passing of time ---------------------------------------------------------------------

    @guarded
    def progress_timeout(self, floor: float) -> float:
        """Seconds without a push after which a heartbeating worker counts as stalled."""
        return max(floor, PROGRESS_MULTIPLE * self._median)

    @guarded
    def expire(self, now: float, lease: float, progress_floor: float) -> tuple[list[str], list[str]]:
        """Marks workers whose lease or progress ran out; returns (expired, stalled) names."""
        timeout = self.progress_timeout(progress_floor)
        expired, stalled = [], []
        for worker, member in self.members.items():
            if not member.live:
                continue
            if now - member.last_seen > lease:
                member.gone = True
                expired.append(worker)
            elif member.held == 0 and now - member.last_progress > timeout:
                member.stalled = True
                stalled.append(worker)
        self.expired += len(expired)
        self.stalls += len(stalled)
        return expired, stalled

    @guarded
    def next_deadline(self, lease: float, progress_floor: float) -> float | None:
        """The earliest moment a lease or a progress timeout can run out, or None."""
        timeout = self.progress_timeout(progress_floor)
        deadlines = []
        for member in self.members.values():
            if member.live:
                deadlines.append(member.last_seen + lease)
                if member.held == 0:
                    deadlines.append(member.last_progress + timeout)
        return min(deadlines, default=None)

    # -- counts ----------------------------------------------------------------------------------

    @guarded
    def live(self) -> int:
        return sum(1 for m in self.members.values() if m.live)

    @guarded
    def counted(self, step: int) -> int:
        """Live workers counted in step `step`'s quorum."""
        return sum(1 for m in self.members.values() if m.live and m.counts_from <= step)

    @guarded
    def absent(self) -> int:
        """Workers that joined and are not live now."""
        return sum(1 for m in self.members.values() if not m.live)

    @guarded
    def not_yet_counted(self, step: int) -> int:
        return sum(1 for m in self.members.values() if m.live and m.counts_from > step)

    @guarded
    def intervals(self) -> dict[str, float]:
        """{worker: its push interval} for live workers that pushed twice or more (paces_of's input)."""
        return {w: m.interval for w, m in self.members.items() if m.live and m.interval is not None}

    @guarded
    def paces(self) -> dict[str, tuple[float, float]]:
        """paces_of(self.intervals())."""
        return paces_of(self.intervals())

    @guarded
    def min_clock(self) -> int:
        return min((m.clock for m in self.members.values() if m.live), default=0)

    # -- checkpoints -----------------------------------------------------------------------------

    @guarded
    def export(self) -> dict:
        """What a checkpoint keeps: each member's incarnation, clock and first counted step, and the
        retired incarnations (leases start afresh on restore)."""
        return {"members": {w: self.export_member(w) for w in self.members},
                "retired": {w: list(incs) for w, incs in self.retired.items()}}

    @guarded
    def export_member(self, worker: str) -> dict:
        m = self.members[worker]
        return {"incarnation": m.incarnation, "clock": m.clock, "counts_from": m.counts_from,
                "gone": m.gone or m.stalled, "left": m.left, "pushes": m.pushes, "last_push_step": m.last_push_step}

    @guarded
    def restore_member(self, worker: str, entry: dict, now: float) -> None:
        """Sets one member as export_member() gave it, with a fresh lease."""
        self.members[worker] = Member(entry["incarnation"], now, now, counts_from=entry["counts_from"],
                                      clock=entry["clock"], gone=entry["gone"], left=entry.get("left", False),
                                      pushes=entry.get("pushes", 0), last_push_step=entry.get("last_push_step", -1))

    @guarded
    def take(self, worker: str, entry: Mapping, now: float) -> None:
        """Gives `worker` the state a "member" record holds (export_member's, with "retired": its retired
        incarnations): one not known here joins with a fresh lease at `now`; a known one keeps its lease,
        progress and pace, and one stalled stays stalled (the record counts it as gone). Live, the record
        was made from the member after its change: nothing changes."""
        member = self.members.get(worker)
        if member is None:
            self.restore_member(worker, entry, now)
        else:
            member.incarnation, member.clock, member.counts_from = (entry["incarnation"], entry["clock"],
                                                                    entry["counts_from"])
            # At replay the pushes journaled after the record may have been counted before it was made: the
            # larger count is the right one (live, the two are equal).
            if entry.get("pushes", 0) > member.pushes:
                member.pushes, member.last_push_step = entry["pushes"], entry.get("last_push_step", -1)
            member.left = entry.get("left", False)
            if not entry["gone"]:
                member.gone = member.stalled = False
            elif not member.stalled:
                member.gone = True
        for incarnation in entry["retired"]:
            self.retire(worker, incarnation)

    @guarded
    def export_leases(self, now: float) -> dict[str, dict]:
        """Every member as export_member gives it, with "silent": seconds since it was last heard from."""
        return {w: {**self.export_member(w), "silent": max(0.0, now - m.last_seen)} for w, m in self.members.items()}

    @guarded
    def adopt(self, entries: Mapping[str, dict], now: float) -> list[str]:
        """Takes each worker of `entries` (export_leases' form) it does not know, last heard from "silent"
        seconds before `now` (a shard added to a running job takes ps 0's workers and their leases); returns
        their names."""
        new = [worker for worker in entries if worker not in self.members]
        for worker in new:
            self.restore_member(worker, entries[worker], now - entries[worker].get("silent", 0.0))
        return new

    @guarded
    def restore(self, state: dict, now: float) -> None:
        for worker, entry in state.get("members", {}).items():
            self.restore_member(worker, entry, now)
        for worker, incarnations in state.get("retired", {}).items():
            for incarnation in incarnations:
                self.retire(worker, incarnation)


def paces_of(intervals: dict[str, float]) -> dict[str, tuple[float, float]]:
    """{worker: (its push interval, straggler score)}, by name; the score is its interval over the median of
    the other workers' (1: typical, or alone; 2: twice as slow as the others). O(N): every worker's median of
    the others is one of three neighbours of the middle of all intervals, found by selection, not sorting."""
    n = len(intervals)
    if n < 2:
        return {w: (i, 1.0) for w, i in intervals.items()}
    values = np.fromiter(intervals.values(), dtype=np.float64, count=n)
    m = n // 2  # n even: the others' median is a[m - 1] or a[m]; n odd: a pair among a[m - 1], a[m], a[m + 1]
    wanted = [k for k in (m - 1, m, m + 1) if 0 <= k < n]
    a = dict(zip(wanted, np.partition(values, wanted)[wanted].tolist()))
    paces = {}
    for worker, v in sorted(intervals.items()):
        if n % 2 == 0:  # n - 1 others: their median is the middle one left once v is out
            median = a[m] if v <= a[m - 1] else a[m - 1]
        elif v <= a[m - 1]:
            median = (a[m] + a[m + 1]) / 2
        elif v >= a[m + 1]:
            median = (a[m - 1] + a[m]) / 2
        else:
            median = (a[m - 1] + a[m + 1]) / 2
        paces[worker] = (v, v / median if median > 0 else 1.0)
    return paces
