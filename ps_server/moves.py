"""Live resize on one shard: taking a layout epoch, handing variables over, taking them in. No gRPC.

See layout.py for what a shard answers about names it does not hold. Here:
* `set_layout` records the epoch (journaled before it is acknowledged);
  refused with embedding tables (their rows change shards at a restore).
  In sync mode it may set a hold (layout.py): from the step asked for, or
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
The state travels as torch.save bytes of store.snapshot() entries, read back
with weights_only (tensors, numbers, strings, lists and dicts only).
"""

from __future__ import annotations

import io
from typing import Mapping

import torch

from ..errors import InvalidArgumentError, ModeConflictError, SpecConflictError
from .bookkeeping import Bookkeeping
from .gate import ApplyGate
from .layout import ShardLayout
from .recording import Recorder
from .store import VariableStore
from .tables import TableStore

__all__ = ["Moves", "encode_entries", "decode_entries"]


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
        store.explain_missing(layout.missing)

    def set_layout(self, epoch: int, addresses: list[str], placement: Mapping[str, int], hold_from: int = 0
                   ) -> bool:
        """Takes a later layout epoch (True) or the same again (False), holding sync pushes from `hold_from`
        or later (see the module docstring; 0: no hold); raises as ps.proto's SetLayout says. Wakes the
        pushes a hold ended. Blocks until its journal record is written."""
        book = self._book
        if not 0 <= hold_from < 2 ** 62:
            raise InvalidArgumentError(f"a hold's step must be in [0, 2**62). Received: {hold_from}")
        if hold_from and book.clock.config.mode != "sync":
            raise InvalidArgumentError(f"a hold (hold_from_step {hold_from}) is for sync jobs; this one is "
                                       f"{book.clock.config.mode}; nothing was changed")
        if self._tables.names():
            raise ModeConflictError("a job with embedding tables changes its shard count at a restore "
                                    "(--restore-from onto another count); nothing was changed")
        with self._gate.change(), self._recorder.ordering, book.cond:
            hold = max(hold_from, book.pending.hold_floor(self._store.step)) if hold_from else 0
            adopt = hold > self._store.step and not self._store.names() and book.pending.idle()
            changed = self.layout.set(epoch, addresses, placement, hold_from, hold)
            ticket = None
            if changed:
                if adopt:
                    self._store.set_step(hold)
                    book.pending.clear()
                ticket = self._recorder.log("layout", {"epoch": epoch, "addresses": list(addresses),
                                                       "placement": dict(placement), "asked": hold_from,
                                                       "hold": hold, "step": hold if adopt else None})
                book.cond.notify_all()
        self._recorder.durable(ticket)
        return changed

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
        elif kind == "export":
            self._store.remove(meta["names"])
            self.layout.exported(meta["names"], meta["to"], tensors["state"].numpy().tobytes())
        elif kind == "import":
            entries = decode_entries(tensors["state"].numpy().tobytes())
            self._store.adopt(entries, meta["step"])
            self.layout.imported([entry["name"] for entry in entries])
        else:
            raise ValueError(f"not a move record: {kind}")
