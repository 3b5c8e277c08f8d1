"""Live resize on one shard: taking a layout epoch, handing variables over, taking them in. No gRPC.

See layout.py for what a shard answers about names it does not hold. Every
change here is a journal record made by one function, `_apply`, live (the
caller checks, builds the record, applies it and queues it) and when the
journal is replayed (`replay`), so recovery runs the live code. Here:
* `set_layout` records the epoch (journaled before it is acknowledged),
  beginning or ending a re-layout of the embedding tables when it sets
  `table_shards` (layout.py). In sync mode it may set a hold (layout.py): from the step asked for, or
  the lowest this shard may hold from if that is later (a step it counted a
  push for must complete); a shard that holds nothing takes the hold's step
  as its own (one added to the job starts at the job's step). The hold has a
  lease, renewed by the same layout set again: `run_hold_lease` (a thread)
  ends a hold whose lease ran out, as an epoch without it would, and says so;
  on an arbiter (ps 0, ps 1) an epoch drops the record of the replicated
  shards it removes (replicas.py);
* `quiet` says when a sync shard's variables may move: under a hold, every
  step before it applied, nothing summed; export and import need it there;
* `export` takes the named variables out at one instant, holding the apply
  gate alone: an update in progress finishes first and is in the state
  exported; one that comes after finds them gone (store.apply checks every
  name before changing any) and changes nothing. They go into the outbox as
  they were (no copy is made under the gate), and are encoded for the wire
  and the journal after the gate is let go; the outbox keeps them until the
  importer confirms them (`confirm`), and sends them again if asked, at any
  epoch;
* `import_` adds exported variables (value, optimizer state, version) the
  layout in force places here, whatever epoch they were exported at (a
  shard's own kept export too: a move rolled back), and moves the step
  counter up to the exporter's, so a checkpoint's step is reached here as
  on the others; not on the shard that owns the step (ps 0), whose count is
  the global step: an async exporter ahead of it by the pushes in flight
  would count those twice there. One import at a time: a retry that overlaps
  its original finds it done;
* `resize` (ps 0) changes the job's resize record (resizes.py) and journals it;
* `export_tables` cuts every table's rows (with their optimizer state and a
  dynamic table's metadata) for each shard of the new count at one instant,
  journaled and kept; `import_tables` takes one old shard's part, and once
  every old shard's arrived builds this shard's tables from them
  (table_state.built_from), moving the step counter up as `import_` does;
  the epoch that ends it drops the tables of a shard past the new count
  (every row is another's: one added again later takes them anew).
The state travels as torch.save bytes of store.snapshot() entries, read back
with weights_only (tensors, numbers, strings, lists and dicts only).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from ..errors import CheckpointError, InvalidArgumentError, ModeConflictError, SpecConflictError
from . import table_state
from .bookkeeping import Bookkeeping
from .entries import decode_entries, encode_entries
from .gate import ApplyGate
from .layout import ShardLayout, lease_of
from .locks import checked
from .modes import MAX_SECONDS
from .recording import Recorder
from .replicas import ReplicaRegistry
from .resizes import ResizeOwner
from .store import VariableStore
from .table_moves import RelayoutFolders, streamed_tables
from .tables import TableStore

__all__ = ["Moves", "KINDS"]

_LOGGER = logging.getLogger(__name__)

MAX_MEMBERS = 1_000_000  # workers a layout may name (Layout.members), as many as --elastic-workers admits
MAX_NAME_CHARS = 256     # characters of a member's name


def _check_members(members: Mapping[str, dict], grace_left: float) -> None:
    """InvalidArgumentError unless `members` and `grace_left` are what ps 0 could have sent (Layout.members)."""
    if not (math.isfinite(grace_left) and 0 <= grace_left <= MAX_SECONDS):
        raise InvalidArgumentError(f"grace_left_seconds must be in [0, {MAX_SECONDS:g}]. Received: {grace_left}")
    if len(members) > MAX_MEMBERS:
        raise InvalidArgumentError(f"a layout names at most {MAX_MEMBERS} members. Received: {len(members)}")
    for worker, entry in members.items():
        silent = entry.get("silent", 0.0)
        if (not worker or len(worker) > MAX_NAME_CHARS or not 0 <= entry["counts_from"] < 2 ** 62
                or not (math.isfinite(silent) and 0 <= silent <= MAX_SECONDS)):
            raise InvalidArgumentError(f"a layout's member needs a name of 1 to {MAX_NAME_CHARS} characters, a "
                                       f"step in [0, 2**62) and silent_seconds in [0, {MAX_SECONDS:g}]. Received: "
                                       f"{worker[:80]!r}, {entry['counts_from']}, {silent}")


def _blob(data: bytes) -> dict[str, torch.Tensor]:
    return {"state": torch.frombuffer(bytearray(data), dtype=torch.uint8)}


class Moves:
    """A shard's side of live resizes (see the module docstring). Thread-safe. `owner`: the job's resize record
    (ps 0's; None elsewhere). `replicas`: the arbiter's record of replicated shards (ps 0's and ps 1's; None
    elsewhere), which forgets the shards an epoch removes (ReplicaRegistry.left)."""

    def __init__(self, book: Bookkeeping, store: VariableStore, tables: TableStore, gate: ApplyGate,
                 recorder: Recorder, layout: ShardLayout, *, owns_step: bool, owner: ResizeOwner | None = None,
                 replicas: ReplicaRegistry | None = None):
        self._owns_step = owns_step
        self._book = book
        self._store = store
        self._tables = tables
        self._gate = gate
        self._recorder = recorder
        self.layout = layout
        self.owner = owner
        self._replicas = replicas
        self._receiving = checked(threading.Lock(), "receiving", "an import's (moves.Moves)")  # checked, then
                                            # made, at one time (variables or table rows)
        self._joined_at = 0  # the hold step this shard took as its own (it joined a running sync job), or 0;
                             # under the bookkeeping condition
        self._leases = threading.Condition()  # wakes run_hold_lease: a hold set, renewed or ended, or close;
                                              # taken alone, around the layout's own lock only
        self._closed = False
        self.folders = RelayoutFolders(tables.storage)  # tables kept on SSD: their rows' folders
        store.explain_missing(layout.missing)
        tables.guard(self._check_table)

    def set_layout(self, epoch: int, addresses: list[str], placement: Mapping[str, int], hold_from: int = 0,
                   table_shards: int = 0, members: Mapping[str, dict] | None = None, grace_left: float = 0.0,
                   hold_lease: float = 0.0, table_step: str = "") -> bool:
        """Takes a later layout epoch (True) or the same again (False: renews a hold's lease), holding sync
        pushes from `hold_from` or later (see the module docstring; 0: no hold) until an epoch without it or
        `hold_lease` s (0: layout.LEASE_SECONDS) without the same layout again, and with `table_shards`
        beginning or ending a re-layout of the embedding tables onto that many shards (`table_step` "begin",
        "end", or "": either, layout.relayout_tables); raises as
        ps.proto's SetLayout says. Wakes the pushes a hold ended. A shard that took the hold step as its own
        takes `members` (ps 0's workers, Membership.export_leases' form) and ends its startup grace in
        `grace_left` s (Bookkeeping.take_job_members). Blocks until its journal records are written."""
        book = self._book
        if not 0 <= hold_from < 2 ** 62:
            raise InvalidArgumentError(f"a hold's step must be in [0, 2**62). Received: {hold_from}")
        lease = lease_of(hold_lease, "a hold")
        _check_members(members or {}, grace_left)
        if table_step not in ("", "begin", "end"):
            raise InvalidArgumentError(f"a layout's table step is BEGIN, END or BY_COUNT. Received: {table_step!r}")
        if not 0 <= table_shards <= len(addresses):
            raise InvalidArgumentError(f"table_shards must be in [0, the layout's {len(addresses)} shards]. "
                                       f"Received: {table_shards}")
        if hold_from and book.clock.config.mode != "sync":
            raise InvalidArgumentError(f"a hold (hold_from_step {hold_from}) is for sync jobs; this one is "
                                       f"{book.clock.config.mode}; nothing was changed")
        with self._gate.change(), self._recorder.ordering, book.cond:
            hold = max(hold_from, book.pending.hold_floor(self._store.step)) if hold_from else 0
            adopt = (hold > self._store.step and not self._store.names() and not self._tables.names()
                     and book.pending.idle())  # a shard with table rows completes its steps as the others do
            if table_shards:
                self.layout.relayout_tables(table_shards, self._table_count(), table_step, check_only=True)
            meta = {"epoch": epoch, "addresses": list(addresses), "placement": dict(placement), "asked": hold_from,
                    "hold": hold, "step": hold if adopt else None, "table_shards": table_shards, "lease": lease,
                    "table_step": table_step}
            changed = self._apply("layout", meta)
            ticket = None
            if changed:
                if members and hold and self._joined_at == hold:
                    book.take_job_members(members, grace_left)
                ticket = self._recorder.log("layout", meta)
                book.cond.notify_all()
        self._wake_leases()
        self._recorder.durable(ticket)
        if changed and self._recorder.journal is not None:
            self._recorder.journal.note_shards(len(addresses))
        return changed

    def run_hold_lease(self) -> None:
        """Ends a hold whose lease ran out (thread body; returns at close)."""
        while True:
            with self._leases:
                _, left = self.layout.hold_lease()
                if self._closed:
                    return
                if left > 0:
                    self._leases.wait(None if left == math.inf else left + 0.01)
                    continue
            self._end_expired_hold()

    def close(self) -> None:
        """Stops run_hold_lease."""
        with self._leases:
            self._closed = True
            self._leases.notify_all()

    def _wake_leases(self) -> None:
        with self._leases:
            self._leases.notify_all()

    def _end_expired_hold(self) -> None:
        book = self._book
        with self._gate.change(), self._recorder.ordering, book.cond:
            lease, left = self.layout.hold_lease()
            epoch = self.layout.epoch
            if left > 0:  # renewed, or ended by an epoch, meanwhile
                return
            meta = {"epoch": epoch}
            hold = self._apply("hold_ended", meta)
            ticket = self._recorder.log("hold_ended", meta) if hold else None
            book.cond.notify_all()
        self._recorder.durable(ticket)
        if hold:
            _LOGGER.warning("ps %d: the hold of pushes from step %d (layout epoch %d) ended by itself: its resize "
                            "renewed nothing for %g s (its driver died or was cut off); held pushes go on. Run "
                            "`ps-admin resize --resume` to finish the resize or `--abort` to roll it back where it can",
                            self.layout.index, hold, epoch, lease)

    def job_members(self) -> tuple[dict[str, dict], float]:
        """Under a sync hold: (this shard's workers, seconds until its startup grace ends), for a shard the
        resize adds (ps.proto's Layout.members); else ({}, 0)."""
        with self._book.cond:
            if not self.layout.hold_from:
                return {}, 0.0
            return self._book.job_members()

    def _check_table(self, held) -> None:
        """TableStore's guard: a table frozen for a re-layout, or not built here yet, raises (layout.py). Reads
        table_shards without the layout's lock first: outside a re-layout (every push and lookup) it takes none."""
        count = self.layout.table_shards
        if count:
            self.layout.check_tables(held is not None and held.num_shards == count)
        if held is None:  # on a shard a resize removed (its tables dropped), the client asks for the layout
            self.layout.check_member()

    def _table_count(self) -> int | None:
        """The number of shards this shard's tables are spread over (None: it holds none)."""
        held = self._tables.held()
        return held[0].num_shards if held else None

    def export_tables(self, epoch: int, to: int) -> tuple[bytes, int]:
        """(bytes, this shard's step): the rows of every table that shard `to` owns under the re-layout in
        progress (layout.py), with their optimizer state and counters; of a table kept on SSD only its head,
        its rows following from export_table_rows(). The first export cuts them for every new shard at one
        instant (the tables are frozen) and keeps them (an SSD table's store copy in a folder of its own:
        table_moves.py); later ones, repeated ones too, send the kept bytes. Blocks until its journal record is
        written. ModeConflictError for another epoch than the one set or outside a re-layout, or for tables on
        SSD while a backup follows; InvalidArgumentError for a shard past the new count."""
        self.layout.check_epoch(epoch, "an export of table rows")
        count = self.layout.table_shards
        if not count:
            raise ModeConflictError(f"ps {self.layout.index} is not re-laying out its embedding tables (no "
                                    f"layout epoch set table_shards); nothing was exported")
        if not 0 <= to < count:
            raise InvalidArgumentError(f"table rows go to one of the {count} shards of the re-layout; asked for "
                                       f"ps {to}")
        ticket = None
        with self._gate.snapshot():
            parts = self.layout.tables_exported()
            if parts is None:
                self._check_quiet("an export of table rows")
                section = table_state.section(self._tables)
                copies = {entry["name"]: entry["state"] for entry in section if entry["state"].get("store")}
                if copies:
                    self.folders.check_unreplicated()
                parts = {shard: encode_entries(entries)
                         for shard, entries in table_state.parts_for(section, count).items()}
                stores = {name: self.folders.keep(name, state["store"], state["config"])
                          for name, state in copies.items()}
                meta = {"shards": sorted(parts), "stores": stores}
                with self._recorder.ordering:
                    self._apply("table_export", meta, parts=parts)
                    ticket = self._recorder.log("table_export", meta, {str(shard): _blob(data)["state"]
                                                                       for shard, data in parts.items()})
            step = self._store.step
        self._recorder.durable(ticket)
        return parts[to], step

    def export_table_rows(self, epoch: int, to: int, max_rows: int) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
        """(table, ids, records) chunks of at most `max_rows` rows: the rows shard `to` owns of every table kept
        on SSD that export_tables() (called first) exported, from their kept copies, table by table. Reads a
        chunk at a time, holding no lock. ModeConflictError as export_tables."""
        self.layout.check_epoch(epoch, "an export of table rows")
        count = self.layout.table_shards
        if not count or self.layout.tables_exported() is None:
            raise ModeConflictError(f"ps {self.layout.index} exported no table rows at this re-layout; nothing "
                                    f"was exported")
        for name, kept in self.layout.table_stores().items():
            for ids, records in self.folders.rows_for(kept, to, count, max_rows):
                yield name, ids, records

    def import_tables(self, data: bytes, epoch: int, source: int, step: int,
                      rows: Iterable[tuple[str, np.ndarray, np.ndarray]] = (),
                      sent: Callable[[], Mapping[str, int]] = dict) -> list[str]:
        """Takes the table rows old shard `source` exported for this one: `data` (export_tables' bytes) and,
        for its tables kept on SSD, `rows` ((table, ids, records) chunks, staged on disk as they come:
        table_moves.py) whose counts per table `sent()`, called once `rows` ended, declares. Unless this shard
        owns the step, moves the step counter up to `step`, the exporter's, as import_ does (a row's age counts
        this shard's steps); once every old shard's rows arrived, builds this shard's tables from them (they
        serve again; SSD tables stream their rows from the staged stores). Returns the tables' names once
        built, else []; a repeat changes nothing. Blocks until its journal record is written. Raises (nothing
        changed) ModeConflictError for another epoch or outside a re-layout, InvalidArgumentError for bytes
        that are not exported rows, rows of ids not this shard's or not their sender's, counts that differ
        from what was staged, or rows that do not fit together."""
        self.layout.check_epoch(epoch, "an import of table rows")
        entries = decode_entries(data)
        sources = {entry.get("num_shards") for entry in entries}
        if len(sources) != 1 or not isinstance(next(iter(sources)), int):
            raise InvalidArgumentError("table rows name no common number of old shards; nothing was imported")
        meta = {"from": source, "step": 0 if self._owns_step else step}
        streamed = streamed_tables(entries)
        staging = None
        if streamed:
            self.folders.check_unreplicated()
            staging = self.folders.staging(source, streamed)
        else:
            for name, _, _ in rows:
                raise InvalidArgumentError(f"rows of {name!r} came with a part that names no table kept on SSD; "
                                           f"nothing was imported")
        try:
            if staging is not None:
                count, index = self.layout.table_shards, self.layout.index
                for name, ids, records in rows:
                    staging.put(name, ids, records, to=index, count=count)
                stores = staging.finish(sent())
                for entry in entries:
                    if entry["name"] in stores:
                        entry["state"]["store"] = stores[entry["name"]]
                data = encode_entries(entries)
            blob, count = _blob(data), sources.pop()
            built = self._built_if_last(source, count, data)  # outside the gate: a build streams every row
            with self._gate.change(), self._recorder.ordering, self._receiving:  # one import at a time completes
                try:  # the same re-layout as when it was checked (staging and building take a while)
                    self.layout.check_epoch(epoch, "an import of table rows")
                except BaseException:
                    _close(built)
                    raise
                repeat = self.layout.received(source)
                names = self._apply("table_import", meta, blob, data=data, sources=count, built=built)
                ticket = None if repeat else self._recorder.log("table_import", meta, blob)
        except BaseException:
            if staging is not None:
                staging.discard()
            raise
        if repeat and staging is not None:
            staging.discard()
        self._recorder.durable(ticket)
        return names

    def _relayout_folders(self) -> list[str]:
        """The folders of table rows the re-layout under way names: its kept store copies and the staged rows
        of the parts that arrived (table_moves.py); [] if none is under way."""
        if not self.layout.table_shards:
            return []
        names = [kept["path"] for kept in self.layout.table_stores().values()]
        for data in self.layout.inbox().values():
            names += [state["store"]["path"] for state in streamed_tables(decode_entries(data)).values()]
        return names

    def _built_if_last(self, source: int, sources: int, data: bytes) -> list | None:
        """This shard's tables built from every old shard's rows if `data` (old shard `source`'s) is the last
        part missing now, else None."""
        inbox = self.layout.receive_tables(source, sources, data, check_only=True)
        return None if inbox is None else self._built(inbox)

    def _built(self, inbox: Mapping[int, bytes]) -> list:
        return table_state.built_from({s: decode_entries(d) for s, d in inbox.items()}, self.layout.index,
                                      self.layout.table_shards, self._tables.storage,
                                      lambda path: str(self.folders.path(path)))

    def _receive_tables(self, source: int, sources: int, data: bytes, step: int, built: list | None = None
                        ) -> list[str]:
        """Takes old shard `source`'s part; once every part arrived, installs this shard's tables: `built` if
        given (built from the same parts), else built here (raises if they do not fit, nothing changed; `built`
        is closed then, and when not installed)."""
        try:
            inbox = self.layout.receive_tables(source, sources, data, check_only=True)
        except BaseException:
            _close(built)
            raise
        if inbox is None and built is not None:  # a repeat: another import of the part completed first
            _close(built)
            built = None
        elif inbox is not None and built is None:
            built = self._built(inbox)
        self.layout.receive_tables(source, sources, data)
        if step > self._store.step:
            self._store.set_step(step)
        if built is None:
            return []
        self._tables.install(built)
        return [held.spec.name for held in built]

    def _moving_ssd_rows(self) -> bool:
        """A re-layout is under way on a shard that may keep tables on SSD: their rows' folders, which its
        journal records name, are in neither a checkpoint nor a backup's copy."""
        return bool(self.layout.table_shards) and self._tables.storage.on_disk

    def check_saveable(self) -> None:
        """CheckpointError while _moving_ssd_rows() (saved again once the resize ended)."""
        if self._moving_ssd_rows():
            raise CheckpointError(f"ps {self.layout.index} is re-laying out its embedding tables, which it may "
                                  f"keep on SSD: a checkpoint is saved once the resize ended; nothing was saved")

    def refuse_backup(self) -> str | None:
        """Why a backup may not attach now (Recorder.refuse_follower): _moving_ssd_rows(); else None."""
        if self._moving_ssd_rows():
            return (f"ps {self.layout.index} is re-laying out its embedding tables, which it may keep on SSD: a "
                    f"backup attaches once the resize ended")
        return None

    def quiet(self) -> bool:
        """Under a hold (sync): every step before it applied and nothing summed, so variables may move."""
        book = self._book
        with book.cond:
            hold = self.layout.hold_from
            return bool(hold) and self._store.step >= hold and book.pending.idle()

    def _check_quiet(self, what: str) -> None:
        if self._book.clock.config.mode == "sync" and not self.quiet():
            raise ModeConflictError(f"{what} in a sync job waits for a hold (SetLayout's hold_from_step) and for "
                                    f"ps {self.layout.index} to be quiet under it (step {self._store.step}, hold "
                                    f"from {self.layout.hold_from}); nothing was changed")

    def export(self, names: list[str], epoch: int, to: int) -> tuple[bytes, int]:
        """(state bytes, this shard's step) of `names`, which leave this shard for shard `to`; the same state
        again for names whose export is kept (at any epoch, until confirmed). Blocks while updates in
        progress finish, then until its journal record is written. Raises (nothing changed)
        ModeConflictError for another epoch than the one set (or, sync, unless quiet); UnknownVariableError
        for a name neither held nor kept; InvalidArgumentError for names kept for another shard."""
        if not names or len(set(names)) != len(names):
            raise InvalidArgumentError("an export names its variables, each once")
        if to == self.layout.index:
            raise InvalidArgumentError(f"ps {to} cannot export to itself")
        kept = self.layout.sent(names)
        if kept is not None:
            return self._send_again(names, to, kept)
        self.layout.check_epoch(epoch, "an export")
        with self._gate.snapshot():
            kept = self.layout.sent(names)  # the same export, made meanwhile
            if kept is None:
                self._check_quiet("an export")
                entries = self._store.snapshot_of(names, copy=False)  # UnknownVariableError: nothing changed
                meta = {"names": names, "to": to, "epoch": epoch}
                with self._recorder.ordering:
                    self._apply("export", meta, entries=entries)
            step = self._store.step
        if kept is not None:
            return self._send_again(names, to, kept)
        # Encoded and recorded once out of the gate (the outbox holds the entries meanwhile, so a compaction
        # or a checkpoint in between has them; replaying the record then finds them there already).
        data = encode_entries(entries)
        self._recorder.durable(self._recorder.log("export", meta, _blob(data)))
        return data, step

    def _send_again(self, names: list[str], to: int, kept: tuple[int, list]) -> tuple[bytes, int]:
        if kept[0] != to:
            raise InvalidArgumentError(f"ps {self.layout.index} exported {names} to ps {kept[0]}, not ps {to}; "
                                       f"nothing was sent")
        return encode_entries(kept[1]), self._store.step

    def import_(self, data: bytes, epoch: int, step: int) -> list[str]:
        """Takes the variables in `data` (export's bytes, at any epoch `epoch`) and, unless this shard owns the
        step, moves the step counter up to `step`; returns their names. Variables already held (all of them)
        are a repeated import: kept as they are. Blocks until its journal record is written. Raises (nothing
        changed) ModeConflictError for a name the layout in force does not place here (or, sync, unless
        quiet), SpecConflictError for some of the names held already, InvalidArgumentError for bytes that
        are not exported state."""
        entries = decode_entries(data)
        names = [entry["name"] for entry in entries]
        blob = _blob(data)  # the record's copy, made before any lock
        ticket = None
        with self._gate.change(), self._recorder.ordering, self._receiving:  # checked and made at one time
            held = set(self._store.names())
            if set(names) <= held:
                return names
            if held & set(names):
                raise SpecConflictError(f"ps {self.layout.index} holds some of {names} already; nothing was "
                                        f"imported")
            placement = self.layout.layout()[2]
            elsewhere = [name for name in names if placement.get(name) != self.layout.index]
            if elsewhere:
                raise ModeConflictError(f"layout epoch {self.layout.epoch} does not place {elsewhere[:5]} on ps "
                                        f"{self.layout.index} (exported at epoch {epoch}); nothing was imported")
            self._check_quiet("an import")
            meta = {"step": 0 if self._owns_step else step}  # the global step is ps 0's own count
            self._apply("import", meta, blob, entries=entries)
            ticket = self._recorder.log("import", meta, blob)
        self._recorder.durable(ticket)
        return names

    def confirm(self, names: list[str], to: int) -> list[str]:
        """Shard `to` holds `names`: drops the kept exports to it all of whose names are in `names`; returns the
        names dropped (none: a repeat). Blocks until its journal record is written."""
        if not names or len(set(names)) != len(names):
            raise InvalidArgumentError("a confirmation names its variables, each once")
        if to == self.layout.index:
            raise InvalidArgumentError(f"ps {to} cannot confirm a move to itself")
        meta = {"names": names, "to": to}
        with self._gate.change(), self._recorder.ordering:
            dropped = self._apply("confirm", meta)
            ticket = self._recorder.log("confirm", meta) if dropped else None
        self._recorder.durable(ticket)
        return dropped

    def resize(self, change: Callable[[ResizeOwner], dict | None]) -> dict:
        """ps 0: `change(owner)` makes a change to the job's resize record (resizes.py; it raises as that says,
        nothing changed), journaled; returns the record. ModeConflictError on another shard. Blocks until its
        journal record is written."""
        if self.owner is None:
            raise ModeConflictError(f"ps {self.layout.index} does not keep the job's resize: ask ps 0")
        with self._gate.change(), self._recorder.ordering:
            event = change(self.owner)
            ticket = None
            if event is not None:
                self._apply("resize", event)
                ticket = self._recorder.log("resize", event)
        self._recorder.durable(ticket)
        return self.owner.state()

    def replay(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor]) -> None:
        """Makes the change of one journal record of this module's kinds again (recovery, before the shard
        serves): the live path's own `_apply`, under the locks the live path of "layout" holds (the others'
        are fewer)."""
        with self._gate.change(), self._recorder.ordering, self._book.cond:
            self._apply(kind, meta, tensors)

    def _apply(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor] | None = None, *,
               entries: list[dict] | None = None, parts: Mapping[int, bytes] | None = None,
               data: bytes | None = None, sources: int | None = None, built: list | None = None):
        """The change one record describes (live, the caller holding the locks its kind needs, and at replay).
        The keywords hand the live path's decoded state over instead of decoding the record's tensors again."""
        if kind == "layout":
            changed = self.layout.set(meta["epoch"], meta["addresses"], meta["placement"], meta.get("asked", 0),
                                      meta.get("hold", 0), meta.get("lease") or lease_of(0, "a hold"))
            if changed and meta.get("step") is not None:
                self._book.set_step({"step": meta["step"], "clear": True})  # the quorum, as any step set
                self._joined_at = meta["step"]
            if changed and meta.get("table_shards"):
                named = self._relayout_folders()  # of the re-layout this epoch may end
                if self.layout.relayout_tables(meta["table_shards"], self._table_count(),
                                               meta.get("table_step", "")) == "ended":
                    self.folders.retire(named)  # the rows' folders of tables on SSD, once no record names them
                    if self.layout.index >= len(meta["addresses"]):  # a shard this epoch removes: every row is
                        self._tables.install([])                      # another's now; none stays here stale
            if changed and self._replicas is not None:
                self._replicas.left(len(meta["addresses"]))
            return changed
        if kind == "hold_ended":
            return self.layout.end_hold(meta["epoch"])
        if kind == "export":
            if entries is None:
                entries = decode_entries(_bytes(tensors["state"]))
            self._store.remove(meta["names"])
            self.layout.exported(meta["names"], meta["to"], entries, meta.get("epoch", self.layout.epoch))
        elif kind == "import":
            if entries is None:
                entries = decode_entries(_bytes(tensors["state"]))
            self._store.adopt(entries, meta["step"])
            self.layout.imported([entry["name"] for entry in entries])
        elif kind == "confirm":
            return self.layout.confirm(meta["names"], meta.get("to"))
        elif kind == "resize":
            self.owner.apply(meta)
        elif kind == "table_export":
            self.layout.export_tables(parts if parts is not None else
                                      {int(shard): _bytes(tensors[str(shard)]) for shard in meta["shards"]},
                                      meta.get("stores"))
        elif kind == "table_import":
            if data is None:
                data = _bytes(tensors["state"])
                sources = {entry["num_shards"] for entry in decode_entries(data)}.pop()
            return self._receive_tables(meta["from"], sources, data, meta.get("step", 0), built)
        else:
            raise ValueError(f"not a move record: {kind}")
        return None


KINDS = ("layout", "hold_ended", "export", "import", "confirm", "resize", "table_export", "table_import")


def _close(built: list | None) -> None:
    """Closes tables built for an import that does not install them."""
    for held in built or ():
        held.table.close()


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes()
