"""The coordinator's journal glue: records written as changes happen, compactions, and replay. No gRPC.

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
sync "add") record, so a push is replayed whole or not at all. A compaction
copies the state under the gate alone and rotates the log under the
coordinator's lock in the same instant (snapshots.state_of(then=)).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Mapping

import torch

from . import table_state
from .journal import Journal, Record
from .ledger import PushRecord
from .modes import PushResult, SyncConfig
from .snapshots import state_of
from .store import NewVariable

if TYPE_CHECKING:
    from .coordinator import Coordinator

__all__ = ["Recorder", "replay"]

_LOGGER = logging.getLogger(__name__)


class Recorder:
    """Writes a coordinator's changes into its journal and compacts the journal when it grows."""

    def __init__(self, coordinator: "Coordinator", journal: Journal):
        self._c = coordinator
        self._journal = journal
        self._lock = threading.Lock()
        self._compactor: threading.Thread | None = None

    def log(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor]) -> None:
        """Appends one record (see the module docstring for the lock the caller holds)."""
        self._journal.append(kind, meta, tensors)
        with self._lock:
            if self._journal.wants_compaction() and (self._compactor is None or not self._compactor.is_alive()):
                self._compactor = threading.Thread(target=self._compact, name="journal-compaction", daemon=True)
                self._compactor.start()

    def _compact(self) -> None:
        """Writes the whole state as the journal's new base, so its log starts afresh (thread body)."""
        try:
            with self._c.gate.snapshot():
                state = state_of(self._c, with_pending=True, then=self._journal.rotate)
            self._journal.finish_compaction(state.pop("then"), state)
        except Exception:  # noqa: BLE001 - the log keeps growing; recovery still works from the old base
            _LOGGER.exception("journal compaction failed")

    def wait(self, timeout: float | None = None) -> None:
        """Returns once no compaction is running (at most `timeout` s)."""
        with self._lock:
            compactor = self._compactor
        if compactor is not None:
            compactor.join(timeout)


def replay(c: "Coordinator", record: Record) -> None:
    """Re-applies one journal record to a coordinator being recovered (before it starts)."""
    kind, meta, tensors = record.kind, record.meta, record.tensors
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
        elif kind == "member":
            worker = meta["worker"]
            c.membership.restore_member(worker, meta, c._now())
            for incarnation in meta["retired"]:
                c.membership.retire(worker, incarnation)
                c.ledger.forget(worker, incarnation)
            c._update_quorum()
        else:
            raise ValueError(f"unknown journal record {kind!r}")


def _replayed_push(c: "Coordinator", meta: dict, result: PushResult | None) -> PushRecord | None:
    pushed = c.ledger.begin(meta["worker"], meta["incarnation"], meta["seq"], meta["step"])
    if pushed is not None:
        pushed.applied, pushed.result = True, result
    return pushed
