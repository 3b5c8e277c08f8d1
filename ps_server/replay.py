"""A journal replayed into a shard being recovered, record by record, before it serves. No gRPC.

Each record (recording.py says when each kind is queued) is applied as the
change it records was: applies, sync adds and steps, creations, admitting
lookups, hyperparameters, the mode, members, data queues' events; a compressed gradient is decoded
again from the bytes that came (recording.as_received). Replaying every record
after a base brings back exactly what the shard had acknowledged.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .. import compression
from ..proto import ps_pb2
from . import table_state
from .aggregation import apply_step
from .bookkeeping import Bookkeeping
from .dataqueue import DataQueues
from .journal import Record
from .ledger import PushRecord
from .modes import PushResult, SyncConfig
from .store import NewVariable, VariableStore
from .tables import TableStore

__all__ = ["replay", "from_received"]


def from_received(store: VariableStore, meta: Mapping, tensors: dict[str, torch.Tensor]) -> None:
    """Decodes in place the gradients as_received recorded as they came, as the shard did when they came."""
    for name, wire in meta.get("received", {}).items():
        tensor_meta = ps_pb2.TensorMeta.FromString(bytes.fromhex(wire))
        tensors[name] = compression.decode(name, tensor_meta, tensors[name].numpy(), store.get(name).spec.meta)


def replay(book: Bookkeeping, tables: TableStore, queues: DataQueues, record: Record) -> bool:
    """Re-applies one journal record to a shard being recovered (before it starts); True if it is the
    record of the job's end (Coordinator.finish). Raises ValueError for an unknown kind of record."""
    store, pending, ledger, membership = book.store, book.pending, book.ledger, book.membership
    kind, meta, tensors = record.kind, record.meta, record.tensors
    if kind == "finish":
        return True
    if kind in ("apply", "add"):
        from_received(store, meta, tensors)
    with book.cond:  # nothing runs concurrently yet; the condition only keeps the bookkeeping's rules
        if kind == "configure":
            book.set_config(SyncConfig(**meta["config"]))
        elif kind == "create":
            store.create([NewVariable(v["name"], tensors[v["name"]], v["optimizer"], v["hyperparams"])
                          for v in meta["variables"]])
        elif kind == "hyperparams":
            store.set_hyperparams(meta["names"], meta["updates"])
        elif kind == "tables":
            tables.create(table_state.specs_of_record(meta), meta["shard_index"], meta["num_shards"],
                          taken=store.names())
        elif kind == "admit":
            tables.lookup([(name, tensors[name]) for name in meta["tables"]], admit=True)
        elif kind == "apply":
            table_rows = table_state.rows_of_record(meta, tensors)
            step, versions = store.apply(tensors, meta["step_increment"], validated=True)
            tables.apply(table_rows, step)
            _replayed_push(book, meta, PushResult(step=step, next_step=step, versions=versions))
            membership.advance_clock(meta["worker"])
        elif kind == "add":
            buffer = pending.reserve(meta["step"])
            table_rows = table_state.rows_of_record(meta, tensors)
            buffer.add(tensors, rows=table_rows)
            pending.counted(buffer, meta["worker"])
            ledger.mark_applied(_replayed_push(book, meta, None), pending=True)
        elif kind == "step":
            apply_step(pending.buffer(meta["step"]), meta["step"], store, tables)  # rows, then dense
            pending.drop_before(store.step)
        elif kind == "set_step":
            store.set_step(meta["step"])
            pending.clear() if meta.get("clear") else pending.drop_before(meta["step"])
        elif kind == "queue":
            queues.replay(meta)
        elif kind == "member":
            worker = meta["worker"]
            membership.restore_member(worker, meta, book.clock.now())
            for incarnation in meta["retired"]:
                membership.retire(worker, incarnation)
                ledger.forget(worker, incarnation)
            book.update_quorum()
        else:
            raise ValueError(f"unknown journal record {kind!r}")
    return False


def _replayed_push(book: Bookkeeping, meta: dict, result: PushResult | None) -> PushRecord | None:
    """The ledger's record of a replayed push, applied, with its reply `result`."""
    pushed = book.ledger.begin(meta["worker"], meta["incarnation"], meta["seq"], meta["step"])
    book.ledger.mark_applied(pushed)
    book.ledger.answer(pushed, result)
    return pushed
