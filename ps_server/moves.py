"""Live resize on one shard: taking a layout epoch, handing variables over, taking them in. No gRPC.

See layout.py for what a shard answers about names it does not hold. Here:
* `set_layout` records the epoch (journaled before it is acknowledged);
  refused in sync mode (a step's pending sums span every shard) and with
  embedding tables (their rows change shards at a restore);
* `export` takes the named variables out at one instant, holding the apply
  gate alone: an update in progress finishes first and is in the state
  exported; one that comes after finds them gone (store.apply checks every
  name before changing any) and changes nothing. The record carries the
  state, so a shard restarted from its journal still has it to send again;
* `import_` adds exported variables (value, optimizer state, version), and
  moves the step counter up to the exporter's, so a checkpoint's step is
  reached here as on the others.
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
                 recorder: Recorder, layout: ShardLayout):
        self._book = book
        self._store = store
        self._tables = tables
        self._gate = gate
        self._recorder = recorder
        self.layout = layout
        store.explain_missing(layout.missing)

    def set_layout(self, epoch: int, addresses: list[str], placement: Mapping[str, int]) -> bool:
        """Takes a later layout epoch (True) or the same again (False); raises as ps.proto's SetLayout says.
        Blocks until its journal record is written."""
        if self._book.clock.config.mode == "sync":
            raise ModeConflictError("a sync job's shards change only at a restore (--restore-from onto another "
                                    "count): a step's pending sums span every shard; nothing was changed")
        if self._tables.names():
            raise ModeConflictError("a job with embedding tables changes its shard count at a restore "
                                    "(--restore-from onto another count); nothing was changed")
        with self._gate.change(), self._recorder.ordering:
            changed = self.layout.set(epoch, addresses, placement)
            ticket = self._recorder.log("layout", {"epoch": epoch, "addresses": list(addresses),
                                                   "placement": dict(placement)}) if changed else None
        self._recorder.durable(ticket)
        return changed

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
        """Takes the variables in `data` (export's bytes) and moves the step counter up to `step`; returns
        their names. Variables already held that came at this epoch are kept as they are (a repeated import).
        Blocks until its journal record is written. Raises (nothing changed) ModeConflictError for another
        epoch than the one set, SpecConflictError for a name held from before, InvalidArgumentError for
        bytes that are not exported state."""
        self.layout.check_epoch(epoch, "an import")
        entries = decode_entries(data)
        names = [entry["name"] for entry in entries]
        held = set(self._store.names())
        with self._gate.change(), self._recorder.ordering:
            placement = self.layout.layout()[2]
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
                self._store.adopt(fresh, step)
                self.layout.imported(names)
                ticket = self._recorder.log("import", {"step": step}, _blob(data))
        self._recorder.durable(ticket)
        return names

    def replay(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor]) -> None:
        """Re-applies a "layout", "export" or "import" journal record (recovery, before the shard serves)."""
        if kind == "layout":
            self.layout.set(meta["epoch"], meta["addresses"], meta["placement"])
        elif kind == "export":
            self._store.remove(meta["names"])
            self.layout.exported(meta["names"], meta["to"], tensors["state"].numpy().tobytes())
        elif kind == "import":
            entries = decode_entries(tensors["state"].numpy().tobytes())
            self._store.adopt(entries, meta["step"])
            self.layout.imported([entry["name"] for entry in entries])
        else:
            raise ValueError(f"not a move record: {kind}")
