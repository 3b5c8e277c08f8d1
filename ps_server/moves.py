"""Live resize on one shard: taking a layout epoch, handing variables over, taking them in. No gRPC.

See layout.py for what a shard answers about names it does not hold. Here:
* `set_layout` records the epoch (journaled before it is acknowledged),
  beginning or ending a re-layout of the embedding tables when it sets
  `table_shards` (layout.py). In sync mode it may set a hold (layout.py): from the step asked for, or
  the lowest this shard may hold from if that is later (a step it counted a
  push for must complete); a shard that holds nothing takes the hold's step
  as its own (one added to the job starts at the job's step);
* `quiet` says when a sync shard's variables may move: under a hold, every
  step before it applied, nothing summed; export and import need it there;
* `export` takes the named variables out at one instant, holding the apply
  gate alone: an update in progress finishes first and is in the state
  exported; one that comes after finds them gone (store.apply checks every
  name before changing any) and changes nothing. The record carries the
  state, so a shard restarted from its journal still has it to send again;
* `import_` adds exported variables (value, optimizer state, version), and
  moves the step counter up to the exporter's, so a checkpoint's step is
  reached here as on the others; not on the shard that owns the step (ps 0),
  whose count is the global step: an async exporter ahead of it by the
  pushes in flight would count those twice there.
* `export_tables` cuts every table's rows (with their optimizer state and a
  dynamic table's metadata) for each shard of the new count at one instant,
  journaled and kept; `import_tables` takes one old shard's part, and once
  every old shard's arrived builds this shard's tables from them
  (table_state.built_from), moving the step counter up as `import_` does.
The state travels as torch.save bytes of store.snapshot() entries, read back
with weights_only (tensors, numbers, strings, lists and dicts only).
"""

from __future__ import annotations

import io
import math
import threading
from typing import Mapping

import torch

from ..errors import InvalidArgumentError, ModeConflictError, SpecConflictError
from . import table_state
from .bookkeeping import Bookkeeping
from .gate import ApplyGate
from .layout import ShardLayout
from .modes import MAX_SECONDS
from .recording import Recorder
from .store import VariableStore
from .tables import TableStore

__all__ = ["Moves", "encode_entries", "decode_entries"]

MAX_MEMBERS = 1_000_000  # workers a layout may name (Layout.members), as many as --elastic-workers admits
MAX_NAME_CHARS = 256     # characters of a member's name


def encode_entries(entries: list[dict]) -> bytes:
    """store.snapshot() entries as bytes (torch.save)."""
    buffer = io.BytesIO()
    torch.save(entries, buffer)
    return buffer.getvalue()


def decode_entries(data: bytes) -> list[dict]:
    """encode_entries' bytes back as entries; InvalidArgumentError if they are not such bytes."""
    try:
        entries = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever torch.load raises for bytes that are not its own
        raise InvalidArgumentError(f"the moved state could not be read: {exc}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                                for e in entries):
        raise InvalidArgumentError("the moved state is not a list of variable entries")
    return entries


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
    """A shard's side of live resizes (see the module docstring). Thread-safe."""

    def __init__(self, book: Bookkeeping, store: VariableStore, tables: TableStore, gate: ApplyGate,
                 recorder: Recorder, layout: ShardLayout, *, owns_step: bool):
        self._owns_step = owns_step
        self._book = book
        self._store = store
        self._tables = tables
        self._gate = gate
        self._recorder = recorder
        self.layout = layout
        self._receiving = threading.Lock()  # table rows taken in (an inbox checked, then filled, at one time)
        self._joined_at = 0  # the hold step this shard took as its own (it joined a running sync job), or 0;
                             # under the bookkeeping condition
        store.explain_missing(layout.missing)
        tables.guard(self._check_table)

    def set_layout(self, epoch: int, addresses: list[str], placement: Mapping[str, int], hold_from: int = 0,
                   table_shards: int = 0, members: Mapping[str, dict] | None = None, grace_left: float = 0.0
                   ) -> bool:
        """Takes a later layout epoch (True) or the same again (False), holding sync pushes from `hold_from`
        or later (see the module docstring; 0: no hold), and with `table_shards` beginning or ending a
        re-layout of the embedding tables onto that many shards (layout.py); raises as ps.proto's SetLayout
        says. Wakes the pushes a hold ended. A shard that took the hold step as its own takes `members`
        (ps 0's workers, Membership.export_leases' form) and ends its startup grace in `grace_left` s
        (Bookkeeping.take_job_members). Blocks until its journal records are written."""
        book = self._book
        if not 0 <= hold_from < 2 ** 62:
            raise InvalidArgumentError(f"a hold's step must be in [0, 2**62). Received: {hold_from}")
        _check_members(members or {}, grace_left)
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
                self.layout.relayout_tables(table_shards, self._table_count(), check_only=True)
            changed = self.layout.set(epoch, addresses, placement, hold_from, hold)
            ticket = None
            if changed:
                if adopt:
                    self._store.set_step(hold)
                    book.pending.clear()
                    self._joined_at = hold
                if members and hold and self._joined_at == hold:
                    book.take_job_members(members, grace_left)
                if table_shards:
                    self.layout.relayout_tables(table_shards, self._table_count())
                ticket = self._recorder.log("layout", {"epoch": epoch, "addresses": list(addresses),
                                                       "placement": dict(placement), "asked": hold_from,
                                                       "hold": hold, "step": hold if adopt else None,
                                                       "table_shards": table_shards})
                book.cond.notify_all()
        self._recorder.durable(ticket)
        return changed

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

    def _table_count(self) -> int | None:
        """The number of shards this shard's tables are spread over (None: it holds none)."""
        held = self._tables.held()
        return held[0].num_shards if held else None

    def export_tables(self, epoch: int, to: int) -> tuple[bytes, int]:
        """(bytes, this shard's step): the rows of every table that shard `to` owns under the re-layout in
        progress (layout.py), with their optimizer state and counters. The first export cuts them for every
        new shard at one instant (the tables are frozen) and keeps them; later ones, repeated ones too, send
        the kept bytes. Blocks until its journal record is written. ModeConflictError for another epoch than
        the one set or outside a re-layout; InvalidArgumentError for a shard past the new count."""
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
                parts = {shard: encode_entries(entries)
                         for shard, entries in table_state.parts_for(table_state.section(self._tables), count).items()}
                with self._recorder.ordering:
                    self.layout.export_tables(parts)
                    ticket = self._recorder.log("table_export", {"shards": sorted(parts)},
                                                {str(shard): _blob(data)["state"] for shard, data in parts.items()})
            step = self._store.step
        self._recorder.durable(ticket)
        return parts[to], step

    def import_tables(self, data: bytes, epoch: int, source: int, step: int) -> list[str]:
        """Takes the table rows old shard `source` exported for this one, and (unless this shard owns the step)
        moves the step counter up to `step`, the exporter's, as import_ does (a row's age counts this shard's
        steps); once every old shard's rows arrived, builds this shard's tables from them (they serve again).
        Returns the tables' names once built, else []; a repeat changes nothing. Blocks until its journal record is written. Raises (nothing changed)
        ModeConflictError for another epoch or outside a re-layout, InvalidArgumentError for bytes that are
        not exported rows or rows that do not fit together."""
        self.layout.check_epoch(epoch, "an import of table rows")
        entries = decode_entries(data)
        sources = {entry.get("num_shards") for entry in entries}
        if len(sources) != 1 or not isinstance(next(iter(sources)), int):
            raise InvalidArgumentError("table rows name no common number of old shards; nothing was imported")
        step = 0 if self._owns_step else step
        with self._gate.change(), self._recorder.ordering, self._receiving:  # one import at a time completes
            built = self._receive_tables(source, sources.pop(), data, step)
            ticket = self._recorder.log("table_import", {"from": source, "step": step}, _blob(data))
        self._recorder.durable(ticket)
        return built

    def _receive_tables(self, source: int, sources: int, data: bytes, step: int) -> list[str]:
        inbox = self.layout.receive_tables(source, sources, data, check_only=True)
        built = None
        if inbox is not None:  # every old shard's rows: built before anything changes (raises if they do not fit)
            built = table_state.built_from({s: decode_entries(d) for s, d in inbox.items()}, self.layout.index,
                                           self.layout.table_shards)
        self.layout.receive_tables(source, sources, data)
        if step > self._store.step:
            self._store.set_step(step)
        if built is None:
            return []
        self._tables.install(built)
        return [held.spec.name for held in built]

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
        """(state bytes, this shard's step) of `names`, which leave this shard for shard `to`; the same bytes
        again for a repeated export at this epoch. Blocks while updates in progress finish, then until its
        journal record is written. ModeConflictError for another epoch than the one set;
        UnknownVariableError for a name neither held nor exported."""
        if not names or len(set(names)) != len(names):
            raise InvalidArgumentError("an export names its variables, each once")
        self.layout.check_epoch(epoch, "an export")
        if to == self.layout.index:
            raise InvalidArgumentError(f"ps {to} cannot export to itself")
        with self._gate.snapshot():
            again = self.layout.sent(names)
            if again is not None:
                return again, self._store.step
            self._check_quiet("an export")
            for name in names:
                self._store.get(name)  # UnknownVariableError (or the layout's answer) before anything changes
            data = encode_entries(self._store.snapshot_of(names))
            with self._recorder.ordering:
                self._store.remove(names)
                self.layout.exported(names, to, data)
                ticket = self._recorder.log("export", {"names": names, "to": to}, _blob(data))
            step = self._store.step
        self._recorder.durable(ticket)
        return data, step

    def import_(self, data: bytes, epoch: int, step: int) -> list[str]:
        """Takes the variables in `data` (export's bytes) and, unless this shard owns the step, moves the step
        counter up to `step`; returns their names. Variables already held that came at this epoch are kept as
        they are (a repeated import).
        Blocks until its journal record is written. Raises (nothing changed) ModeConflictError for another
        epoch than the one set, SpecConflictError for a name held from before, InvalidArgumentError for
        bytes that are not exported state."""
        self.layout.check_epoch(epoch, "an import")
        entries = decode_entries(data)
        names = [entry["name"] for entry in entries]
        held = set(self._store.names())
        with self._gate.change(), self._recorder.ordering:
            placement = self.layout.layout()[2]
            if not set(names) <= held:
                self._check_quiet("an import")
            for name in names:
                if placement.get(name) != self.layout.index:
                    raise InvalidArgumentError(f"layout epoch {epoch} does not place {name!r} on "
                                               f"ps {self.layout.index}; nothing was imported")
            fresh = [entry for entry in entries if entry["name"] not in held]
            if fresh and len(fresh) != len(entries):
                raise SpecConflictError(f"ps {self.layout.index} holds some of {names} already; nothing was "
                                        f"imported")
            ticket = None
            if fresh:
                step = 0 if self._owns_step else step  # the global step is this shard's own count
                self._store.adopt(fresh, step)
                self.layout.imported(names)
                ticket = self._recorder.log("import", {"step": step}, _blob(data))
        self._recorder.durable(ticket)
        return names

    def replay(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor]) -> None:
        """Re-applies a "layout", "export" or "import" journal record (recovery, before the shard serves)."""
        if kind == "layout":
            self.layout.set(meta["epoch"], meta["addresses"], meta["placement"], meta.get("asked", 0),
                            meta.get("hold", 0))
            if meta.get("step") is not None:
                self._store.set_step(meta["step"])
                self._book.pending.clear()
                self._joined_at = meta["step"]
            if meta.get("table_shards"):
                self.layout.relayout_tables(meta["table_shards"], self._table_count())
        elif kind == "table_export":
            self.layout.export_tables({int(shard): tensors[str(shard)].numpy().tobytes() for shard in meta["shards"]})
        elif kind == "table_import":
            data = tensors["state"].numpy().tobytes()
            sources = {entry["num_shards"] for entry in decode_entries(data)}
            self._receive_tables(meta["from"], sources.pop(), data, meta.get("step", 0))
        elif kind == "export":
            self._store.remove(meta["names"])
            self.layout.exported(meta["names"], meta["to"], tensors["state"].numpy().tobytes())
        elif kind == "import":
            entries = decode_entries(tensors["state"].numpy().tobytes())
            self._store.adopt(entries, meta["step"])
            self.layout.imported([entry["name"] for entry in entries])
        else:
            raise ValueError(f"not a move record: {kind}")
