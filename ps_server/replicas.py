"""Which address serves each replicated shard, as its arbiter records it: ps 0 for the others, ps 1 for ps 0.
No gRPC.

A shard with a backup (ps-server --replica-of) acknowledges a change only
once its backup wrote it too. When the two lose each other, one of them must
go on alone, and never both: the primary without its backup (DROP), or the
backup in the primary's place (PROMOTE). Both ask the shard's arbiter (ps 0,
or ps 1 for ps 0: `arbiter_of`), which grants the first
request whose view of the record is current and refuses the other
(ReplicaFencedError), so a primary cut off from its backup cannot acknowledge
a change the promoted backup never saw. The same rule as chain replication's
master: the members of a chain change only through one record. ps 0 and ps 1
promote each other's backups only once ps 2 recorded the primary replaced
deposed (deposals.py, through Coordinator.set_replica).

    shard i: primary P, backup ""  --IN_SYNC(P, B, c)--> primary P, backup B (copy c)
             primary P, backup B   --DROP(P, B)--------> primary P, backup ""
             primary P, backup B   --PROMOTE(P?, B, c)-> primary B, backup "", failovers + 1

A backup's copy has a name (c: a fresh random one each time a stream's first
base replaces the backup's folder), recorded with it: a PROMOTE naming
another is refused, so a backup started again at the address of the one in
sync but on another folder (an older copy) never takes over.

Each change is counted in the shard's record (`changes`). A primary reads
the count once its backup holds the base, then asks IN_SYNC naming it: the
IN_SYNC changes nothing if anything changed since. The primary's DROP of a
backup it lost is asked by another thread and may reach the arbiter first;
it names the count the IN_SYNC names, and counts as a change where the
record names no backup yet if that count is still the record's, so an
IN_SYNC asked before it can never put the lost backup back on the record
(whose promotion would then lose every change the primary acknowledged
alone). Its retries find the count moved on and change nothing (the
coordinator answers a repeat once what it repeats is durable, past a lost
backup of the arbiter's own).

A primary with a backup in sync renews its lease here (`renew`, every
replication.LEASE_EVERY_SECONDS; never journaled): a PROMOTE is refused
(LeaseHeldError: the backup follows its primary again) while the primary
renewed within `lease_seconds` (the arbiter's --failover-after), so a backup
whose stream went silent takes over a primary that is stopped or cut off
after one window of silence, and never one that still runs. Leases are only
heard while this arbiter runs: a new or restarted arbiter hears them for a
whole window before it promotes anyone, and one that did not run for a
while (paused, starved: `run_clock` notices) credits every lease with that
time. The lease is liveness
only; safety stays with the record (a primary acknowledges nothing its
backup did not write, and a promoted backup writes nothing more for it).

Which shards there are is the arbiter's layout epoch (`shards`: a live
resize's addresses, the cluster spec's before any resize), and one rule
(`_entry`) says who serves shard i:
* a shard in the record (from its first change on) is served where the
  record says: an epoch naming another address for it never undoes a
  failover;
* a shard the layout has and the record does not is served at the layout's
  address (the spec's, or where a resize added it);
* a shard past the layout's count (a resize removed it, or has not added it
  yet) is served nowhere: its record is dropped when an epoch removes it
  (`left`), its PROMOTE is refused (its backup stops), its DROP is granted
  (nothing can take it over) and its IN_SYNC waits for an epoch that names it
  (ModeConflictError: the primary asks again).
Every change is an event (a small JSON-able dict) made by `apply`, live and
when the arbiter's journal is replayed (`left` runs with the layout's own
record); `export` and `restore` carry the record in journal bases and
checkpoints.

Thread-safe: its own lock (an "owner" in locks.LOCK_ORDER), under which `changed` is notified at every
change (GetLayout's long poll waits on it: `promotion`). `run_clock` is a thread body (returns at close()).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Mapping, Sequence

from ..errors import InvalidArgumentError, LeaseHeldError, ModeConflictError, ReplicaFencedError
from .layout import MAX_SHARDS
from .locks import guarded
from .waits import Wait, WatchedCondition

__all__ = ["ReplicaRegistry", "ACTIONS"]

ACTIONS = ("in_sync", "drop", "promote")  # ps.proto's ReplicaChange.Action, in order (LEASE is renew())
MAX_ADDRESS_CHARS = 1024
MAX_COPY_CHARS = 64  # a copy's name (ReplicaHello.copy)
LEFT_KEY = "left_changes"  # export()'s counts of the records a resize removed
CLOCK_TICKS = 10  # run_clock looks at its own progress this often per lease


class ReplicaRegistry:
    """The arbiter's record of every replicated shard (see the module docstring). `shards`: the job's shard
    addresses now (the arbiter's layout epoch's; called outside this record's lock, as the layout is an owner of
    its own); a list stands for a job that is never resized. `lease_seconds`: how long a primary's lease holds
    after its last renewal (0: PROMOTE is granted whenever the record allows it); `clock`: monotonic seconds."""

    def __init__(self, shards: Callable[[], Sequence[str]] | Sequence[str] = (), *, lease_seconds: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self._shards_now = shards if callable(shards) else lambda: shards
        self._lock = threading.Lock()
        self._shards: dict[int, dict] = {}  # index -> {"primary", "backup", "failovers", "last_failover"}
        self.changed = WatchedCondition(self._lock, level=lambda: 0)  # notified at every change of the record
        self.lease_seconds, self._clock = lease_seconds, clock
        self._renewed: dict[int, float] = {}  # index -> when its recorded primary last renewed its lease
        # index -> the count of changes a record a resize removed had, plus one: a new record there goes on from
        # it (in export(), as LEFT_KEY)
        self._left_changes: dict[int, int] = {}
        self._hearing_since = self._ticked = clock()  # leases heard from then on; run_clock's last look
        self._closed = threading.Event()

    def promotion(self, index: int, primary: str, left: Callable[[], float | None],
                  cancelled: Callable[[], bool]) -> Wait:
        """A Wait (waits.py) that ends once shard `index`'s record names another primary than `primary`, or it
        holds no backup in sync (no promotion can come), or `left()` is 0, or cancelled(): GetLayout's long
        poll."""
        def ready() -> bool:  # holding the lock (the condition's)
            entry = self._shards.get(index)
            return entry is None or not entry["backup"] or entry["primary"] != primary or cancelled()
        return Wait(self.changed, ready, left)

    def entry(self, index: int) -> dict:
        """Shard `index`'s record (its layout address and no backup if it has none; no primary past the
        layout's shards)."""
        return self._copy(index, list(self._shards_now()))

    @guarded
    def _copy(self, index: int, shards: list[str]) -> dict:
        return dict(self._entry(index, shards))

    @guarded
    def entries(self) -> list[tuple[int, dict]]:
        """(index, record) of every shard in the record, by index."""
        return [(index, dict(entry)) for index, entry in sorted(self._shards.items())]

    def _entry(self, index: int, shards: list[str]) -> dict:
        """Who serves shard `index` of the job's `shards` (the module docstring's rule: the one place it is
        made)."""
        if index >= len(shards):
            return {"primary": "", "backup": "", "failovers": 0, "last_failover": 0.0, "changes": 0}
        found = self._shards.get(index)
        if found is not None:
            return found
        return {"primary": shards[index], "backup": "", "failovers": 0, "last_failover": 0.0,
                "changes": self._left_changes.get(index, 0)}

    def decide(self, action: str, index: int, primary: str, backup: str, changes: int | None = None,
               copy: str = "") -> dict | None:
        """The event that makes `action` (ACTIONS) of shard `index`, None if the record says so already (a
        repeat, or a DROP of a shard past the layout's), or for an IN_SYNC whose `changes` (the record's count
        as its primary read it; None: not checked) is not the record's now. A DROP where no backup is in sync
        is an event (counted) only if its `changes` is the record's count now (an IN_SYNC naming it may be on
        its way; a retry then finds the count moved on and changes nothing). InvalidArgumentError for a
        malformed request; ReplicaFencedError when the record names another primary than `primary` (for
        PROMOTE, another backup than `backup`, or none: a shard past the layout's, or another copy than `copy`,
        the name of the backup's copy that IN_SYNC records): the caller must stop serving shard `index`;
        ModeConflictError for IN_SYNC of a shard past the layout's (asked again once an epoch names it).
        Changes nothing: apply() the event."""
        return self._decide(action, index, primary, backup, changes, copy, list(self._shards_now()))

    @guarded
    def _decide(self, action: str, index: int, primary: str, backup: str, changes: int | None, copy: str,
                shards: list[str]) -> dict | None:
        if action not in ACTIONS:
            raise InvalidArgumentError(f"a replica change is one of {', '.join(ACTIONS)}. Received: {action!r}")
        if not 0 <= index < MAX_SHARDS:
            raise InvalidArgumentError(f"a replica change names a shard in [0, {MAX_SHARDS}). Received: {index}")
        needed = {"in_sync": ("primary", "backup"), "drop": ("primary",), "promote": ("backup",)}[action]
        for what, address in (("primary", primary), ("backup", backup)):
            if len(address) > MAX_ADDRESS_CHARS or (what in needed and not address):
                raise InvalidArgumentError(f"a replica change {action} of ps:{index} names its {what}'s address "
                                           f"(1 to {MAX_ADDRESS_CHARS} characters). Received: {address!r}")
        if len(copy) > MAX_COPY_CHARS:
            raise InvalidArgumentError(f"a replica change names a backup's copy in at most {MAX_COPY_CHARS} "
                                       f"characters. Received: {len(copy)}")
        if index >= len(shards):
            return self._outside(action, index, backup, len(shards))
        entry = self._entry(index, shards)
        if action == "promote":
            if entry["primary"] == backup:
                return None  # granted already: a retry
            if entry["backup"] != backup:
                why = f"its backup in sync is {entry['backup']}" if entry["backup"] else "it has no backup in sync"
                raise ReplicaFencedError(f"ps:{index} is served by {entry['primary']} and {why}: {backup} may not "
                                         f"take it over (it holds no promise of every acknowledged change)")
            if entry.get("copy", "") and entry["copy"] != copy:
                raise ReplicaFencedError(f"ps:{index}'s backup in sync at {backup} holds the copy "
                                         f"{entry['copy']}, and this process holds {copy or 'an unnamed one'}: "
                                         f"it may not take ps:{index} over (started on another folder than the "
                                         f"one in sync, it lacks what that copy holds)")
            self._check_lease(index, entry["primary"])
            return {"action": action, "index": index, "primary": backup, "when": time.time()}
        if entry["primary"] != primary:
            raise ReplicaFencedError(f"ps:{index} is served by {entry['primary']} now (failover "
                                     f"{entry['failovers']}), not by {primary}: {primary} must stop serving it")
        if action == "in_sync":
            if (entry["backup"] == backup and entry.get("copy", "") == copy) or (
                    changes is not None and changes != entry["changes"]):
                return None  # a repeat, or asked before a change it did not see (a DROP of that backup)
            return {"action": action, "index": index, "backup": backup, **({"copy": copy} if copy else {})}
        if backup and entry["backup"] and entry["backup"] != backup:
            return None  # another backup is in sync: nothing of this one to drop
        if entry["backup"] or (changes is not None and changes == entry["changes"]):
            return {"action": action, "index": index}  # (none in sync: counted, an IN_SYNC naming it refused)
        return None  # dropped already, or changed since the count it names: a repeat

    def _check_lease(self, index: int, primary: str) -> None:
        """LeaseHeldError if `primary` renewed its lease of shard `index` within lease_seconds, or this arbiter
        has not heard leases for that long (holding the lock)."""
        if not self.lease_seconds:
            return
        now = self._clock()
        self._look(now)  # run_clock may not have run since this arbiter did not
        heard = max(self._renewed.get(index, self._hearing_since), self._hearing_since)
        if now - heard < self.lease_seconds:
            raise LeaseHeldError(left=self.lease_seconds - (now - heard), message=f"ps:{index}'s primary {primary} holds its lease ({now - heard:.3f} s since this "
                                 f"arbiter heard it, of {self.lease_seconds:g} s): it runs, and its backup follows "
                                 f"it again")

    def renew(self, index: int, primary: str) -> dict:
        """`primary` renews its lease of shard `index` (see the module docstring): nothing journaled. Returns the
        shard's record. ReplicaFencedError if the record names another primary (it must stop serving the shard);
        nothing to renew for a shard past the layout's; InvalidArgumentError for a malformed request."""
        return self._renew(index, primary, list(self._shards_now()))

    @guarded
    def _renew(self, index: int, primary: str, shards: list[str]) -> dict:
        if not 0 <= index < MAX_SHARDS or not primary or len(primary) > MAX_ADDRESS_CHARS:
            raise InvalidArgumentError(f"a lease names a shard in [0, {MAX_SHARDS}) and its primary's address (1 "
                                       f"to {MAX_ADDRESS_CHARS} characters). Received: {index}, {primary[:80]!r}")
        entry = self._entry(index, shards)
        if index < len(shards):
            if entry["primary"] != primary:
                raise ReplicaFencedError(f"ps:{index} is served by {entry['primary']} now (failover "
                                         f"{entry['failovers']}), not by {primary}: {primary} must stop serving it")
            self._renewed[index] = self._clock()
        return dict(entry)

    def run_clock(self) -> None:
        """Looks at this arbiter's own progress every lease_seconds / CLOCK_TICKS (thread body; returns at
        close()): see _look."""
        while not self._closed.wait(self.lease_seconds / CLOCK_TICKS):
            self._tick()

    @guarded
    def _tick(self) -> None:
        self._look(self._clock())

    def _look(self, now: float) -> None:
        """(Holding the lock.) A look at `now`: one later than the clock's period by more than a quarter lease
        means this arbiter did not run meanwhile (paused, starved), when no renewal could be heard; every lease
        is credited with that time (a primary must be silent for a lease's worth of this arbiter's running
        time), never past `now`."""
        late = now - self._ticked - self.lease_seconds / CLOCK_TICKS
        if late > self.lease_seconds / 4:
            self._hearing_since = min(now, self._hearing_since + late)
            for index, renewed in self._renewed.items():
                self._renewed[index] = min(now, renewed + late)
        self._ticked = max(self._ticked, now)

    def close(self) -> None:
        """Ends run_clock."""
        self._closed.set()

    @staticmethod
    def _outside(action: str, index: int, backup: str, count: int) -> None:
        """decide() of shard `index` past the layout's `count` shards (see the module docstring)."""
        where = f"ps:{index} is not in the job's layout of {count} shards (a live resize removed it, or has not " \
                f"added it yet)"
        if action == "promote":
            raise ReplicaFencedError(f"{where}: no backup takes it over; {backup} must stop following it")
        if action == "in_sync":
            raise ModeConflictError(f"{where}: its backup is recorded once a layout epoch names it; ask again")
        return None  # drop: no backup of it can be promoted, so its primary may go on alone

    def apply(self, event: Mapping) -> None:
        """Makes one decide()d event's change (live and on replay)."""
        self._apply(event, list(self._shards_now()))

    @guarded
    def _apply(self, event: Mapping, shards: list[str]) -> None:
        index = int(event["index"])
        entry = self._shards.setdefault(index, dict(self._entry(index, shards)))
        self._left_changes.pop(index, None)
        entry["changes"] += 1
        if event["action"] == "in_sync":
            entry.update(backup=event["backup"], copy=event.get("copy", ""))  # (none in a record made before copies)
        elif event["action"] == "drop":
            entry.update(backup="", copy="")
        else:
            entry.update(primary=event["primary"], backup="", copy="", failovers=entry["failovers"] + 1,
                         last_failover=float(event["when"]))
        self.changed.notify_all()

    @guarded
    def left(self, count: int) -> None:
        """A layout epoch of `count` shards was taken: the record of every shard past them is dropped (a resize
        removed them; one that adds such an index again adds a new shard, served at its new address). Its count
        of changes goes on from where it was (an IN_SYNC its last primary asked, decided late, changes nothing)."""
        for index in [index for index in self._shards if index >= count]:
            self._left_changes[index] = self._shards.pop(index)["changes"] + 1
            self._renewed.pop(index, None)
        self.changed.notify_all()

    @guarded
    def export(self) -> dict:
        """The whole record, for a journal base or a checkpoint (restore() takes it): {str(index): record}, and
        the counts of records a resize removed under LEFT_KEY."""
        record: dict = {str(index): dict(entry) for index, entry in self._shards.items()}
        if self._left_changes:
            record[LEFT_KEY] = {str(index): count for index, count in self._left_changes.items()}
        return record

    @guarded
    def restore(self, state: Mapping | None) -> None:
        """Takes export()'s record (None: empty; one written before changes were counted: counts from 0)."""
        state = dict(state or {})
        self._left_changes = {int(index): int(count) for index, count in state.pop(LEFT_KEY, {}).items()}
        self._shards = {int(index): {"changes": 0, **entry} for index, entry in state.items()}
        self.changed.notify_all()
