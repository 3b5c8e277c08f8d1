"""A shard's embedding tables (ps_server/tables.py) and their pushes through the Coordinator, without sockets;
ROWS tensors (torchps/rows.py) on the wire.

Creation is idempotent per table and all-or-nothing per call; lookups and row pushes check everything before
they change anything; a push carrying dense and row gradients is applied whole, deduplicated like any push,
in sync mode too (tests/unit/test_row_sums.py has the sync sums).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from torchps import codec, rows
from torchps.errors import (InvalidArgumentError, NonFiniteGradientError, OptimizerSpecError,
                            ResourceExhaustedError, SpecConflictError, TensorMismatchError, UnknownVariableError,
                            WaitTimeoutError)
from torchps.proto import ps_pb2
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.embeddings import initial_rows
from torchps.ps_server.modes import SyncConfig
from torchps.ps_server.store import NewVariable, VariableStore
from torchps.ps_server.tables import RowGradient, TableStore

D = 3


def spec(name: str, *, num_embeddings: int = 10, optimizer: str = "sgd", **fields) -> ps_pb2.TableSpec:
    return ps_pb2.TableSpec(name=name, dim=D, num_embeddings=num_embeddings, dtype=ps_pb2.FLOAT32,
                            optimizer=ps_pb2.OptimizerSpec(name=optimizer, hyperparams={"lr": 1.0}),
                            init=ps_pb2.TableInit(distribution="normal", scale=1.0, seed=5), **fields)


def test_rows_tensors_round_trip_and_declare_their_size():
    ids, values = torch.tensor([4, -2, 4]), torch.arange(9, dtype=torch.float64).reshape(3, 3)
    encoded = rows.encode_rows(ids, values)
    assert encoded.meta.encoding == ps_pb2.ROWS and list(encoded.meta.shape) == [3, 3]
    assert codec.meta_nbytes(encoded.meta) == encoded.payload.numel() == 3 * (8 + 3 * 8)
    got_ids, got_values = rows.decode_rows(encoded.meta, encoded.payload.numpy())
    assert torch.equal(got_ids, ids) and torch.equal(got_values, values)
    empty = rows.encode_rows(torch.tensor([], dtype=torch.int64), torch.zeros(0, 3))
    assert codec.meta_nbytes(empty.meta) == 0 and rows.decode_rows(empty.meta, np.empty(0, np.uint8))[1].shape == (0, 3)
    with pytest.raises(InvalidArgumentError, match="ROWS tensors are"):
        codec.meta_nbytes(ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[3], encoding=ps_pb2.ROWS))
    with pytest.raises(InvalidArgumentError, match="8 bytes each"):
        rows.ids_from_bytes(b"\x00" * 12)
    assert torch.equal(rows.ids_from_bytes(rows.ids_bytes(ids)), ids)


def test_creation_is_idempotent_all_or_nothing_and_shares_the_variables_namespace():
    store = TableStore()
    assert store.create([spec("a"), spec("b", num_embeddings=0, min_count=0)], 1, 2) == [True, True]
    assert store.create([spec("a")], 1, 2) == [False]
    held = store.get("b").spec
    assert held.min_count == 1 and held.optimizer.hyperparams["maximize"] == 0.0  # defaults filled in
    with pytest.raises(SpecConflictError, match="over 2 shards; the request asked for .* over 3"):
        store.create([spec("c"), spec("a")], 1, 3)
    with pytest.raises(SpecConflictError, match="share one namespace"):
        store.create([spec("c"), spec("w")], 1, 2, taken=["w"])
    with pytest.raises(OptimizerSpecError):
        store.create([spec("c"), spec("d", optimizer="adam")], 1, 2)
    with pytest.raises(InvalidArgumentError, match="min_count, max_age or capacity"):
        store.create([spec("c"), spec("d", capacity=4)], 1, 2)  # a fixed-size table takes no capacity
    with pytest.raises(ResourceExhaustedError):
        def refuse(adding):
            assert adding == {"c": 5 * 4 * D}  # ceil(10 / 2) rows of 3 float32 (SGD keeps no state)
            raise ResourceExhaustedError("over the limit")
        store.create([spec("c"), spec("a")], 1, 2, check_memory=refuse)
    assert store.names() == ["a", "b"]  # none of the failed calls created "c"
    with pytest.raises(SpecConflictError, match="share one namespace"):
        store.check_free(["x", "b"])


def test_lookups_check_every_table_before_reading_or_admitting():
    store = TableStore()
    store.create([spec("fixed"), spec("dyn", num_embeddings=0, min_count=2)], 0, 2)
    for bad, error in [([("dyn", torch.tensor([4])), ("nope", torch.tensor([0]))], UnknownVariableError),
                       ([("dyn", torch.tensor([4])), ("fixed", torch.tensor([1]))], InvalidArgumentError),
                       ([("dyn", torch.tensor([4])), ("fixed", torch.tensor([2, 2]))], InvalidArgumentError),
                       ([("dyn", torch.tensor([4])), ("dyn", torch.tensor([6]))], InvalidArgumentError)]:
        with pytest.raises(error):
            store.lookup(bad, admit=True)
    assert [(s.pending, s.rows_read) for s in store.status()] == [(0, 0), (0, 0)]
    fixed, dyn = store.lookup([("fixed", torch.tensor([8, 0])), ("dyn", torch.tensor([4]))], admit=True)
    assert torch.equal(fixed, initial_rows(np.array([8, 0]), D, seed=5)) and torch.equal(dyn, torch.zeros(1, D))
    assert [(s.name, s.rows, s.pending, s.rows_read) for s in store.status()] == [("fixed", 5, 0, 2),
                                                                                  ("dyn", 0, 1, 1)]


def test_row_gradients_are_checked_then_applied_and_evicted():
    store = TableStore()
    store.create([spec("t"), spec("capped", num_embeddings=0, capacity=1)], 0, 1)
    store.check_meta("t", ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[0, D], encoding=ps_pb2.ROWS))
    with pytest.raises(TensorMismatchError, match=r"takes \[rows, 3\] of float32"):
        store.check_meta("t", ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT64, shape=[1, D], encoding=ps_pb2.ROWS))
    for bad, error in [({"t": RowGradient(torch.tensor([10]), torch.ones(1, D))}, InvalidArgumentError),
                       ({"t": RowGradient(torch.tensor([1]), torch.ones(1, D + 1))}, TensorMismatchError),
                       ({"t": RowGradient(torch.tensor([1]), torch.full((1, D), float("nan")))},
                        NonFiniteGradientError),
                       ({"nope": RowGradient(torch.tensor([1]), torch.ones(1, D))}, UnknownVariableError)]:
        with pytest.raises(error):
            store.validate(bad)
    before = store.lookup([("t", torch.tensor([1, 2]))], admit=False)[0]
    store.lookup([("capped", torch.tensor([7, 8]))], admit=True)
    grads = {"t": RowGradient(torch.tensor([1, 2, 1]), torch.ones(3, D)),
             "capped": RowGradient(torch.tensor([7, 8]), torch.ones(2, D))}
    store.validate(grads)
    store.apply(grads, step=4)
    after = store.lookup([("t", torch.tensor([1, 2]))], admit=False)[0]
    assert torch.equal(after, before - torch.tensor([[2.0], [1.0]]))  # lr 1: repeats summed
    t, capped = store.status()
    assert (t.optimizer_steps, t.rows_pushed) == (1, 3)
    assert (capped.rows, capped.evicted_by_capacity, capped.evicted) == (1, 1, 1)  # 7 went: the lower id of a tie


def test_waiting_for_tables_ends_when_they_exist_or_at_the_timeout():
    store = TableStore()
    with pytest.raises(WaitTimeoutError, match="'late'"):
        store.wait_for(["late"], 0.01)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (store.wait_for(["late"], 30.0), done.set()))
    waiter.start()
    store.create([spec("late")], 0, 1)
    waiter.join(30.0)
    assert done.is_set()


def _coordinator(mode: str = "async") -> Coordinator:
    c = Coordinator(VariableStore(), owns_step=True)
    c.configure(SyncConfig(mode=mode, total_num_replicas=1))
    c.create([NewVariable("w", torch.zeros(2), "sgd", {"lr": 1.0})])
    return c


def test_a_push_applies_dense_and_row_gradients_together_once():
    c = _coordinator()
    c.create_tables([spec("t")], 0, 1)
    with pytest.raises(SpecConflictError, match="share one namespace"):
        c.create([NewVariable("t", torch.zeros(1))])
    c.join("worker:0", 1)
    before = c.tables.lookup([("t", torch.tensor([3]))], admit=False)[0]
    grads = {"w": torch.ones(2), "t": RowGradient(torch.tensor([3]), torch.ones(1, D))}
    bad = {"w": torch.ones(2), "t": RowGradient(torch.tensor([3]), torch.full((1, D), float("inf")))}
    with pytest.raises(NonFiniteGradientError):
        c.push("worker:0", 1, 1, 0, bad, 1)
    assert c.store.step == 0 and torch.equal(c.store.get("w").value.detach(), torch.zeros(2))
    assert c.push("worker:0", 1, 1, 0, grads, 1).step == 1
    assert c.push("worker:0", 1, 1, 0, grads, 1).duplicate  # a retry: applied once
    assert torch.equal(c.store.get("w").value.detach(), -torch.ones(2))
    assert torch.equal(c.tables.lookup([("t", torch.tensor([3]))], admit=False)[0], before - 1)
    assert c.tables.status()[0].optimizer_steps == 1
    c.close()


def test_sync_mode_creates_tables_and_applies_row_gradients_with_the_step():
    c = _coordinator("sync")
    assert c.create_tables([spec("t")], 0, 1) == [True]  # no longer refused in sync mode
    c.join("worker:0", 1)
    before = c.tables.lookup([("t", torch.tensor([3]))], admit=False)[0]
    grads = {"w": torch.ones(2), "t": RowGradient(torch.tensor([3, 3]), torch.ones(2, D))}
    assert c.push("worker:0", 1, 1, 0, grads, 1).next_step == 1  # R = N = 1: released once applied
    assert c.push("worker:0", 1, 1, 0, grads, 1).duplicate  # a retry: added once
    assert c.store.step == 1 and torch.equal(c.store.get("w").value.detach(), -torch.ones(2))
    assert torch.equal(c.tables.lookup([("t", torch.tensor([3]))], admit=False)[0], before - 2)  # repeats summed
    assert c.tables.status()[0].optimizer_steps == 1
    c.close()
