"""The coordinator's journal glue: records queued as changes happen, compactions, and replay. No gRPC.

Appending a record only queues it (journal.Journal.append never touches the
disk), so it is done under whichever lock makes the change; the caller waits
for the record to be written (Coordinator._durable) after letting go of every
lock, before it acknowledges the change. So membership, heartbeats and status
never wait on the disk, and neither does any apply.

Locking rules for a record (they keep a compaction's base and the new log in
agreement, and the log in the order things happened): a record of a change to
variables or the step is appended under the apply gate (shared) together with
the change, and, for creations, applies, sync steps and hyperparameters, under
the coordinator's `_ordered` lock too, so no push to a variable is recorded
before its creation and no apply on the wrong side of an lr change; a record of bookkeeping
only (membership, a step adopted while catching up) under the coordinator's
lock. Embedding tables (table_state.py) are recorded the same way: their
creation ("tables") and admitting lookups of dynamic tables ("admit") under the
gate and `_ordered`, and a push's row gradients inside its own "apply" (or
sync "add") record, so a push is replayed whole or not at all. A compressed
gradient is recorded as it came (as_received) and decoded again on replay. A
compaction writes the state as a base under the gate alone, from the shard's
own tensors, having rotated the log under the coordinator's lock in the same
instant (snapshots.state_of(then=)).

Membership records are queued in order too but nobody waits for them: a
process killed at once may lose the last joins and lease renewals not followed
by a push it acknowledged (the workers join the restarted shard again).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Mapping

import numpy as np
import torch

from .. import compression
from ..proto import ps_pb2
from . import table_state
from .journal import Journal, Record
from .ledger import PushRecord
from .modes import PushResult, SyncConfig
from .snapshots import state_of
from .store import NewVariable

if TYPE_CHECKING:
    from .coordinator import Coordinator

__all__ = ["Recorder", "as_received", "replay"]

_LOGGER = logging.getLogger(__name__)


class Recorder:
    """Writes a coordinator's changes into its journal and compacts the journal when it grows."""

    def __init__(self, coordinator: "Coordinator", journal: Journal):
        self._c = coordinator
        self._journal = journal
        self._lock = threading.Lock()
        self._compactor: threading.Thread | None = None

    @property
    def directory(self):
        """The journal's folder (for messages)."""
        return self._journal.directory

    def log(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor]) -> int:
        """Queues one record (see the module docstring for the lock the caller holds); returns its ticket.
        Never blocks on the disk."""
        ticket = self._journal.append(kind, meta, tensors)
        with self._lock:
            if self._journal.wants_compaction() and (self._compactor is None or not self._compactor.is_alive()):
                self._compactor = threading.Thread(target=self._compact, name="journal-compaction", daemon=True)
                self._compactor.start()
        return ticket

    def wait(self, ticket: int | None, timeout: float | None) -> None:
        """Blocks until record `ticket` (None: every record queued so far) is written; see Journal.wait."""
        self._journal.wait(ticket, timeout)

    def _compact(self) -> None:
        """Writes the whole state as the journal's new base, so its log starts afresh (thread body)."""
        try:
            with self._c.gate.snapshot():  # written from the shard's own tensors: nothing changes them meanwhile
                state = state_of(self._c, with_pending=True, then=self._journal.rotate, copy=False)
                number = state.pop("then")
                written = self._journal.write_base(number, state)
            self._journal.finish_compaction(number, written)
        except Exception:  # noqa: BLE001 - the log keeps growing; recovery still works from the old base
            _LOGGER.exception("journal compaction failed")

    def wait_for_compaction(self, timeout: float | None = None) -> None:
        """Returns once no compaction is running (at most `timeout` s)."""
        with self._lock:
            compactor = self._compactor
        if compactor is not None:
            compactor.join(timeout)


def as_received(meta: dict, tensors: Mapping[str, torch.Tensor], received: Mapping[str, tuple]
                ) -> tuple[dict, dict[str, torch.Tensor]]:
    """A push record's (meta, tensors) with the gradients named in `received` ({name: (TensorMeta, bytes)})
    as they came over the wire (a bf16 cast, top-k's indices and values) instead of decoded: meta "received"
    maps each to its TensorMeta, replay decodes them again (from_received)."""
    out = dict(tensors)
    wire = {}
    for name, (tensor_meta, raw) in received.items():
        out[name] = torch.from_numpy(np.asarray(raw, dtype=np.uint8))
        wire[name] = tensor_meta.SerializeToString(deterministic=True).hex()
    return {**meta, "received": wire}, out


def from_received(c: "Coordinator", meta: Mapping, tensors: dict[str, torch.Tensor]) -> None:
    """Decodes in place the gradients as_received recorded as they came, as the shard did when they came."""
    for name, wire in meta.get("received", {}).items():
        tensor_meta = ps_pb2.TensorMeta.FromString(bytes.fromhex(wire))
        tensors[name] = compression.decode(name, tensor_meta, tensors[name].numpy(), c.store.get(name).spec.meta)


def replay(c: "Coordinator", record: Record) -> bool:
    """Re-applies one journal record to a coordinator being recovered (before it starts); True if it is the
    record of the job's end (Coordinator.finish)."""
    kind, meta, tensors = record.kind, record.meta, record.tensors
    if kind == "finish":
        return True
    if kind in ("apply", "add"):
        from_received(c, meta, tensors)
    with c._cond:  # nothing runs concurrently yet; the lock only satisfies the bookkeeping's rules
        if kind == "configure":
            c._set_config(SyncConfig(**meta["config"]))
        elif kind == "create":
            c.store.create([NewVariable(v["name"], tensors[v["name"]], v["optimizer"], v["hyperparams"])
                            for v in meta["variables"]])
        elif kind == "hyperparams":
            c.store.set_hyperparams(meta["names"], meta["updates"])
        elif kind == "tables":
            c.tables.create(table_state.specs_of_record(meta), meta["shard_index"], meta["num_shards"],
                            taken=c.store.names())
        elif kind == "admit":
            c.tables.lookup([(name, tensors[name]) for name in meta["tables"]], admit=True)
        elif kind == "apply":
            table_rows = table_state.rows_of_record(meta, tensors)
            step, versions = c.store.apply(tensors, meta["step_increment"], validated=True)
            c.tables.apply(table_rows, step)
            _replayed_push(c, meta, PushResult(step=step, next_step=step, versions=versions))
            if meta["worker"] in c.membership.members:
                c.membership.members[meta["worker"]].clock += 1
        elif kind == "add":
            buffer = c.pending.reserve(meta["step"])
            table_rows = table_state.rows_of_record(meta, tensors)
            buffer.add(tensors, rows=table_rows)
            c.pending.counted(buffer, meta["worker"])
            pushed = _replayed_push(c, meta, None)
            if pushed is not None:
                pushed.pending = True
        elif kind == "step":
            c._apply_sync_step(c.pending.buffers[meta["step"]], meta["step"])  # rows, then dense (pushes.py)
            c.pending.drop_before(c.store.step)
        elif kind == "set_step":
            c.store.set_step(meta["step"])
            c.pending.clear() if meta.get("clear") else c.pending.drop_before(meta["step"])
        elif kind == "queue":
            c.queues.replay(meta)
        elif kind == "member":
            worker = meta["worker"]
            c.membership.restore_member(worker, meta, c._now())
            for incarnation in meta["retired"]:
                c.membership.retire(worker, incarnation)
                c.ledger.forget(worker, incarnation)
            c._update_quorum()
        else:
            raise ValueError(f"unknown journal record {kind!r}")
    return False


def _replayed_push(c: "Coordinator", meta: dict, result: PushResult | None) -> PushRecord | None:
    pushed = c.ledger.begin(meta["worker"], meta["incarnation"], meta["seq"], meta["step"])
    if pushed is not None:
        pushed.applied, pushed.result = True, result
    return pushed
