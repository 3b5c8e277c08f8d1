"""A journal replayed into a shard being recovered, record by record, before it serves. No gRPC.

Each kind of record (recording.py says when each is queued) is made again by
the one function that made its change live, called as the live path calls it
(under the same locks), so recovery cannot drift from the live paths:

    configure, create, hyperparams, tables, admit   coordinator.Coordinator._apply
    apply, add                                      pushes.PushPath._apply, after what the push's
                                                    admission did (its ledger record, its step's place)
    step                                            background.take_step (the sync applier's); one
                                                    that carries the step's averages (no "add"
                                                    records: background.step_record) applies them
    set_step, member                                bookkeeping.Bookkeeping.set_step, _members
    queue                                           dataqueue.DataQueues: each event, applied as it was
    layout, hold_ended, export, import, confirm,    moves.Moves._apply
    resize, table_export, table_import
    replica                                         replicas.ReplicaRegistry.apply (ps 0's and ps 1's)
    deposal                                         deposals.Deposals.apply (ps 2's)
    ask                                             own_promotions.OwnPromotions.apply (ps 0's and ps 1's)
    finish                                          none: the job ended (server.recover begins a new one)

This module only dispatches, after decoding again the compressed gradients
recorded as they came (recording.as_received), as the shard decoded them.
Replaying every record after a base brings back exactly what the shard had
acknowledged.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from .. import compression
from ..proto import ps_pb2
from .journal import Record
from .moves import KINDS as MOVE_KINDS
from .store import VariableStore

__all__ = ["Change", "changes", "replay", "from_received"]

Change = Callable[[str, dict, dict], object]  # (kind, meta, tensors): one record's change made again


def changes(*, coordinator: Change, pushes: Change, step: Change, book: Change, queues: Change, moves: Change,
            replicas: Change, deposals: Change, asks: Change) -> dict[str, Change]:
    """{kind of record: what makes it again}, from each owner's replay entry (see the module docstring)."""
    return {**dict.fromkeys(("configure", "create", "hyperparams", "tables", "admit"), coordinator),
            **dict.fromkeys(("apply", "add"), pushes), "step": step, **dict.fromkeys(("set_step", "member"), book),
            "queue": queues, **dict.fromkeys(MOVE_KINDS, moves), "replica": replicas,
            "deposal": deposals, "ask": asks}


def replay(record: Record, made_by: Mapping[str, Change], store: VariableStore) -> bool:
    """Makes one journal record's change again with made_by[its kind] (`changes`), holding no lock, before the
    shard starts; True if it is the record of the job's end (Coordinator.finish). Raises ValueError for an
    unknown kind of record."""
    kind, meta, tensors = record.kind, record.meta, record.tensors
    if kind == "finish":
        return True
    change = made_by.get(kind)
    if change is None:
        raise ValueError(f"unknown journal record {kind!r}")
    from_received(store, meta, tensors)
    change(kind, meta, tensors)
    return False


def from_received(store: VariableStore, meta: Mapping, tensors: dict[str, torch.Tensor]) -> None:
    """Decodes in place the gradients as_received recorded as they came, as the shard did when they came."""
    for name, wire in meta.get("received", {}).items():
        tensor_meta = ps_pb2.TensorMeta.FromString(bytes.fromhex(wire))
        tensors[name] = compression.decode(name, tensor_meta, tensors[name].numpy(), store.get(name).spec.meta)
