"""Which shard holds which variable, as one shard knows it across live resizes. No gRPC.

Before any resize the layout is epoch 0: every client computes the placement
itself (torchps/placement.py) and this owner is empty. A resize (the chief's
ps-admin resize, client/resize.py) sets epoch e + 1 on every shard, then
moves variables whole from their old shard to their new one. A shard then
explains a name it does not hold:
* exported from here, or placed elsewhere at this epoch: LayoutChangedError
  (the caller asks for the layout and calls the new owner);
* placed here at this epoch but not yet imported: VariableMovingError
  (retryable: it is on its way);
* otherwise nothing: the caller raises UnknownVariableError as before.

An export's state is kept (`outbox`, the exported entries themselves) until
its importer confirms it holds them (`confirm`), whatever epochs pass
meanwhile: a resize cut off between an export and its confirmation is
completed (the same state exported again, imported, confirmed) or rolled back
(imported back here, which drops it from the outbox). Checkpoints and journal
bases hold the outbox, so a variable in transit is in exactly one place.

Sync jobs: a resize first sets a hold (`hold_from`, a step): pushes computed
at it or later wait before anything of them is summed, so the steps before
it complete and no step's sums span a move; variables move; an epoch
without the hold ends it (`released`: that step and epoch). A push held
then, or computed later, that was placed by an earlier epoch than the one
that ended the hold is refused (LayoutChangedError): on every shard alike,
so its client places the whole push anew and no shard counts it twice.
A hold has a lease (`hold_lease`): the resize's driver renews it by setting
the same layout again; if it runs out (the driver died), `end_hold` ends it
as an epoch without it would, at the epoch in force (`released`: the hold's
step and that epoch).

Embedding tables: a table's rows are spread over every shard by id, so a
resize that changes the number of shards re-lays out every table. An epoch
that sets `table_shards` (the new count) starts it on every shard: the
tables freeze there (lookups and pushes naming one get VariableMovingError)
and each shard exports, once, the rows every shard owns under the new count
(`table_outbox`, kept until a later epoch, sent again if asked; a table
kept on SSD has its head there and its rows in a kept copy of its store,
`table_stores`: table_moves.py). A shard
takes the rows each old shard sends it (`inbox`); once all of them arrived,
the caller (moves.py) builds its tables from them and they serve again. The
next epoch that sets the same count ends the re-layout (refused while rows
are missing); a driver says which it means (Layout.table_step), so that one
that took a cut-off resize over may begin it again.

Thread-safe: its own lock (an "owner" in locks.LOCK_ORDER).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Mapping

from ..errors import InvalidArgumentError, LayoutChangedError, ModeConflictError, VariableMovingError
from .locks import guarded

__all__ = ["ShardLayout", "check_layout", "lease_of", "MAX_SHARDS", "LEASE_SECONDS", "MAX_LEASE_SECONDS"]

MAX_SHARDS = 100_000
LEASE_SECONDS = 30.0       # a hold (or a resize on ps 0: resizes.py) its driver does not renew this long ends
MAX_LEASE_SECONDS = 3600.0


def check_layout(epoch: int, addresses: list[str], placement: Mapping[str, int]) -> None:
    """InvalidArgumentError unless (epoch, addresses, placement) is a layout a shard may take."""
    if not 1 <= epoch < 2 ** 62:
        raise InvalidArgumentError(f"a layout's epoch must be in [1, 2**62). Received: {epoch}")
    if not 1 <= len(addresses) <= MAX_SHARDS or not all(addresses):
        raise InvalidArgumentError(f"a layout names 1 to {MAX_SHARDS} shard addresses, none empty. "
                                   f"Received: {len(addresses)}")
    for name, shard in placement.items():
        if not name or shard >= len(addresses):
            raise InvalidArgumentError(f"layout epoch {epoch} places {name!r} on ps {shard}, but it has "
                                       f"{len(addresses)} shards")


def lease_of(seconds: float, what: str) -> float:
    """A lease asked for in seconds (0: LEASE_SECONDS), of `what` ("a hold", "a resize");
    InvalidArgumentError unless in (0, MAX_LEASE_SECONDS]."""
    if seconds == 0:
        return LEASE_SECONDS
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_LEASE_SECONDS):
        raise InvalidArgumentError(f"{what}'s lease must be in (0, {MAX_LEASE_SECONDS:g}] seconds. "
                                   f"Received: {seconds}")
    return seconds


class ShardLayout:
    """One shard's layout epoch, the job's placement at it, and what it exported (see the module docstring).
    `addresses`: the job's shards as this shard was started with them (epoch 0; none for a standalone shard).
    `now`: monotonic seconds (injectable)."""

    def __init__(self, index: int, addresses: list[str] | tuple[str, ...] = (),
                 now: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self._now = now
        self._lock = threading.Lock()
        self.epoch = 0                          # read without the lock (replies carry it)
        self._addresses: list[str] = list(addresses)
        self._placement: dict[str, int] = {}
        self._exported: dict[str, int] = {}     # name -> the shard it went to
        self._outbox: dict[tuple[str, ...], tuple[int, list, int]] = {}  # exports by their names: (to, the
                                                # exported entries, the epoch), until their importer confirms them
        self._asked = 0                         # the hold this epoch was set with (a repeat must match it)
        self.hold_from = 0                      # pushes computed at this step or later wait (0: none); read
                                                # without the lock
        self._hold_lease = LEASE_SECONDS   # the hold in force ends by itself at _hold_deadline
        self._hold_deadline = math.inf
        self._released = (0, 0)                 # (step, epoch) of the last hold ended
        self.table_shards = 0                   # the count the tables are being re-laid out to (0: none); read
                                                # without the lock
        self._inbox: dict[int, bytes] = {}      # old shard -> the table rows it sent here at this re-layout
        self._inbox_from = 0                    # how many old shards send rows (0: not known yet)
        self._table_outbox: dict[int, bytes] = {}  # shard -> the table rows exported for it at this re-layout
        self._table_stores: dict[str, dict] = {}   # table on SSD -> its kept copy its rows are streamed from
                                                   # (table_moves.RelayoutFolders.keep)

    @guarded
    def set(self, epoch: int, addresses: list[str], placement: Mapping[str, int], asked: int = 0,
            hold: int = 0, lease: float = LEASE_SECONDS) -> bool:
        """Takes a later layout (True), or the one in force again (False: nothing changes but a hold's lease,
        renewed for `lease` s), holding pushes from step `hold` (0: none; `asked`: the hold it was asked for,
        which a repeat must ask again) until an epoch without it or `lease` s without a repeat.
        ModeConflictError for an earlier epoch, or another layout under this epoch; nothing changes then."""
        check_layout(epoch, addresses, placement)
        if (epoch == self.epoch and addresses == self._addresses and dict(placement) == self._placement
                and asked == self._asked):
            if self.hold_from:
                self._hold_lease, self._hold_deadline = lease, self._now() + lease
            return False
        if epoch <= self.epoch:
            raise ModeConflictError(f"ps {self.index} is at layout epoch {self.epoch}; epoch {epoch} "
                                    f"{'is older' if epoch < self.epoch else 'was set with another layout'}; "
                                    f"nothing was changed")
        if self.hold_from and not hold:
            self._released = (self.hold_from, epoch)
        self.epoch, self._addresses, self._placement = epoch, list(addresses), dict(placement)
        self._asked, self.hold_from = asked, hold
        self._hold_lease, self._hold_deadline = lease, (self._now() + lease if hold else math.inf)
        return True

    @guarded
    def hold_lease(self) -> tuple[float, float]:
        """(the hold's lease, seconds left of it); (lease, inf) without a hold."""
        return self._hold_lease, (self._hold_deadline - self._now() if self.hold_from else math.inf)

    @guarded
    def end_hold(self, epoch: int) -> int:
        """Ends the hold in force at `epoch` as an epoch without it would (its lease ran out); returns its step,
        0 if there is none at that epoch (nothing changes)."""
        hold = self.hold_from
        if not hold or epoch != self.epoch:
            return 0
        self._released, self.hold_from, self._hold_deadline = (hold, epoch), 0, math.inf
        return hold

    def holds(self, step: int) -> bool:
        """Whether a push computed at `step` waits for the hold to end."""
        hold = self.hold_from
        return bool(hold) and step >= hold

    @guarded
    def check_push(self, step: int, epoch: int) -> None:
        """LayoutChangedError for a push computed at `step` that was placed by layout `epoch`, if the last hold
        ended at a later epoch and not before `step` (see the module docstring)."""
        held_from, ended = self._released
        if ended and step >= held_from and epoch < ended:
            raise LayoutChangedError(f"a push computed at step {step} was placed by layout epoch {epoch}; the "
                                     f"variables moved at a hold from step {held_from}, ended at epoch {ended}; "
                                     f"nothing was changed here: ask for the layout and push again")

    @guarded
    def layout(self) -> tuple[int, list[str], dict[str, int]]:
        """(epoch, addresses, placement): (0, [], {}) before any resize."""
        return self.epoch, list(self._addresses), dict(self._placement)

    @guarded
    def check_epoch(self, epoch: int, what: str) -> None:
        """ModeConflictError unless `epoch` is the one in force (a move belongs to the epoch set before it)."""
        if epoch != self.epoch or epoch == 0:
            raise ModeConflictError(f"{what} for layout epoch {epoch}, but ps {self.index} is at epoch "
                                    f"{self.epoch}: set the layout first (SetLayout); nothing was changed")

    @guarded
    def check_member(self) -> None:
        """LayoutChangedError if this shard left the job (its index is past the layout's shards): from the
        layout that removes it on, it serves no pull or push, only the export of what it held."""
        if self.epoch and self.index >= len(self._addresses):
            raise LayoutChangedError(f"ps {self.index} left the job at layout epoch {self.epoch} "
                                     f"({len(self._addresses)} shards); nothing was changed here: ask for the layout")

    @guarded
    def missing(self, name: str) -> None:
        """Raises what a call naming `name`, which this shard does not hold, should get (module docstring);
        returns if the layout says nothing of it."""
        if name in self._exported:
            raise LayoutChangedError(
                f"variable {name!r} moved from ps {self.index} to ps {self._exported[name]} at layout epoch "
                f"{self.epoch}; nothing was changed here: ask for the layout and call its new owner")
        shard = self._placement.get(name)
        if shard is None:
            return
        if shard == self.index:
            raise VariableMovingError(f"variable {name!r} is on its way to ps {self.index} (layout epoch "
                                      f"{self.epoch}); nothing was changed: retry shortly")
        raise LayoutChangedError(f"variable {name!r} is on ps {shard} at layout epoch {self.epoch}, not on "
                                 f"ps {self.index}; nothing was changed here: ask for the layout")

    @guarded
    def exported(self, names: list[str], to: int, entries: list, epoch: int) -> None:
        """Records that `names` left for shard `to` at `epoch` as `entries` (store.snapshot_of's), kept until
        confirmed."""
        for name in names:
            self._exported[name] = to
        self._outbox[tuple(names)] = (to, entries, epoch)

    @guarded
    def sent(self, names: list[str]) -> tuple[int, list] | None:
        """(to, entries) of the kept export of exactly `names`, or None."""
        kept = self._outbox.get(tuple(names))
        return None if kept is None else kept[:2]

    @guarded
    def outbox(self) -> list[tuple[list[str], int, int]]:
        """(names, to, epoch) of each export kept."""
        return [(list(names), to, epoch) for names, (to, _, epoch) in self._outbox.items()]

    @guarded
    def kept(self) -> list[dict]:
        """The entries of every export kept (a checkpoint holds them with the variables)."""
        return [entry for _, entries, _ in self._outbox.values() for entry in entries]

    @guarded
    def confirm(self, names: list[str], to: int) -> list[str]:
        """Drops the kept exports to shard `to` all of whose names are in `names` (it holds them); returns the
        names dropped."""
        return self._drop(set(names), to)

    @guarded
    def imported(self, names: list[str]) -> None:
        """`names` arrived here: no longer exported from here (a variable may come back in a later epoch), and
        an export of them kept here is over (a move rolled back)."""
        for name in names:
            self._exported.pop(name, None)
        self._drop(set(names))

    def _drop(self, names: set[str], to: int | None = None) -> list[str]:
        gone = [key for key, kept in self._outbox.items() if set(key) <= names and to in (None, kept[0])]
        for key in gone:
            del self._outbox[key]
        return [name for key in gone for name in key]

    # -- embedding tables (see the module docstring) -------------------------------------------

    @guarded
    def relayout_tables(self, count: int, held: int | None, step: str = "", *, check_only: bool = False) -> str:
        """An epoch set `table_shards` = `count` (> 0) on a shard whose tables are spread over `held` shards
        (None: it holds none), as `step` "begin" or "end" of the re-layout ("": begins one, or ends the one under
        way onto `count`; ps.proto's Layout.table_step). Returns "begun" (the tables freeze), "ended" (every old
        shard's rows arrived) or "same" (a begin of the one under way, an end of one that ended here already, or
        tables spread over `count` already); ModeConflictError (nothing changed) for another count while one is
        under way, for the end of one whose rows did not all arrive, or for an end where none is under way and
        the tables are spread over another count. `check_only`: raises or returns, changing nothing."""
        if self.table_shards and count != self.table_shards:
            raise ModeConflictError(f"ps {self.index} is re-laying out its embedding tables onto "
                                    f"{self.table_shards} shards; a layout for {count} must wait for it")
        if self.table_shards and step != "begin":
            if self.index < count and not self._inbox_complete():  # a shard past the count takes no rows
                raise ModeConflictError(
                    f"ps {self.index} has the embedding-table rows of old shards {sorted(self._inbox)} of "
                    f"{self._inbox_from or '?'}; the re-layout onto {count} shards cannot end yet")
            if not check_only:
                self.table_shards = 0
                self._inbox, self._inbox_from, self._table_outbox, self._table_stores = {}, 0, {}, {}
            return "ended"
        if step == "end" and not self.table_shards and held not in (None, count):
            raise ModeConflictError(f"ps {self.index}'s embedding tables are spread over {held} shards and it is not "
                                    f"re-laying them out: it cannot end a re-layout onto {count} (it lost that "
                                    f"one's state?); nothing was changed")
        if self.table_shards or held == count or step == "end":
            return "same"
        if not check_only:
            self.table_shards = count
            self._inbox, self._inbox_from, self._table_outbox, self._table_stores = {}, 0, {}, {}
        return "begun"

    def _inbox_complete(self) -> bool:
        return bool(self._inbox_from) and len(self._inbox) == self._inbox_from

    @guarded
    def check_tables(self, installed: bool) -> None:
        """VariableMovingError while the tables are re-laid out and this shard's are not built yet
        (`installed`: they were, from every old shard's rows)."""
        if self.table_shards and not installed:
            raise VariableMovingError(f"ps {self.index}'s embedding tables are being re-laid out onto "
                                      f"{self.table_shards} shards (layout epoch {self.epoch}); nothing was "
                                      f"changed: retry shortly")

    @guarded
    def tables_exported(self) -> dict[int, bytes] | None:
        """The rows exported for each shard at this re-layout, or None before the first export."""
        return dict(self._table_outbox) if self._table_outbox else None

    @guarded
    def export_tables(self, parts: Mapping[int, bytes], stores: Mapping[str, dict] | None = None) -> None:
        """Records this shard's exported rows for every shard of the new count (kept for repeated exports), and
        the kept copies of its tables on SSD, whose rows follow each part."""
        self._table_outbox = dict(parts)
        self._table_stores = dict(stores or {})

    @guarded
    def table_stores(self) -> dict[str, dict]:
        """The kept copies of the tables on SSD this shard exports at this re-layout ({} if none)."""
        return dict(self._table_stores)

    @guarded
    def inbox(self) -> dict[int, bytes]:
        """The table rows each old shard sent here at this re-layout ({} if none)."""
        return dict(self._inbox)

    @guarded
    def received(self, source: int) -> bool:
        """Whether old shard `source`'s table rows arrived here at this re-layout (an import again is a repeat)."""
        return source in self._inbox

    @guarded
    def receive_tables(self, source: int, sources: int, data: bytes, *, check_only: bool = False
                       ) -> dict[int, bytes] | None:
        """Takes the rows old shard `source` (of `sources`) sent; every old shard's rows once all arrived (the
        caller builds the tables from them), else None. A repeat is ignored. ModeConflictError outside a
        re-layout, InvalidArgumentError for another number of old shards than the first sender said.
        `check_only`: raises or returns, changing nothing."""
        if not self.table_shards:
            raise ModeConflictError(f"ps {self.index} is not re-laying out its embedding tables (no layout epoch "
                                    f"set table_shards); nothing was imported")
        if not 0 <= source < sources or (self._inbox_from and sources != self._inbox_from):
            raise InvalidArgumentError(f"table rows from ps {source} of {sources} old shards, but ps {self.index} "
                                       f"takes them from {self._inbox_from} shards")
        if self._inbox_complete() or source in self._inbox:
            return None
        inbox = {**self._inbox, source: data}
        if not check_only:
            self._inbox_from, self._inbox = sources, inbox
        return inbox if len(inbox) == sources else None

    @guarded
    def export(self) -> dict:
        """The layout for a checkpoint or journal base, the outbox with it."""
        return {"epoch": self.epoch, "addresses": list(self._addresses), "placement": dict(self._placement),
                "exported": dict(self._exported), "asked": self._asked, "hold_from": self.hold_from,
                "released": list(self._released), "hold_lease": self._hold_lease,
                "outbox": [[list(names), to, entries, epoch] for names, (to, entries, epoch) in self._outbox.items()],
                "tables": {"shards": self.table_shards, "from": self._inbox_from,
                           "inbox": {str(k): v for k, v in self._inbox.items()},
                           "outbox": {str(k): v for k, v in self._table_outbox.items()},
                           "stores": dict(self._table_stores)}}

    @guarded
    def restore(self, state: dict | None, decode: Callable[[bytes], list]) -> None:
        """Takes export()'s state (None: epoch 0, nothing exported; the addresses stay the spec's). A hold
        restored gets a whole lease from now. `decode`: an outbox kept as bytes (an older journal) to entries."""
        state = state or {}
        self.epoch = state.get("epoch", 0)
        self._addresses = list(state.get("addresses", [])) or self._addresses
        self._placement = dict(state.get("placement", {}))
        self._exported = dict(state.get("exported", {}))
        self._outbox = {tuple(kept[0]): (kept[1], decode(kept[2]) if isinstance(kept[2], bytes) else kept[2],
                                         kept[3] if len(kept) > 3 else self.epoch)
                        for kept in state.get("outbox", [])}
        self._asked, self.hold_from = state.get("asked", 0), state.get("hold_from", 0)
        self._hold_lease = state.get("hold_lease", LEASE_SECONDS)
        self._hold_deadline = self._now() + self._hold_lease if self.hold_from else math.inf
        self._released = tuple(state.get("released", (0, 0)))
        tables = state.get("tables") or {}
        self.table_shards, self._inbox_from = tables.get("shards", 0), tables.get("from", 0)
        self._inbox = {int(k): v for k, v in (tables.get("inbox") or {}).items()}
        self._table_outbox = {int(k): v for k, v in (tables.get("outbox") or {}).items()}
        self._table_stores = dict(tables.get("stores") or {})
