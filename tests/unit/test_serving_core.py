"""The pure parts of serving replicas: a table's change log (ps_server/row_changes.py, EmbeddingTable.changes) and
the replica's versions (serving/replica.py): atomic visibility under concurrent lookups, exact rollbacks, whole
reads that drop what a shard no longer holds, and refusals that change nothing. Threads, no gRPC."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from torchps.errors import ServingVersionError, UnknownVariableError
from torchps.ps_server.embeddings import EmbeddingTable
from torchps.ps_server.row_changes import RowChanges
from torchps.serving.replica import Replica, TableBatch

D = 4


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_the_log_answers_the_ids_changed_since_a_seq_and_says_when_it_cannot():
    log = RowChanges(limit=6)
    log.record(ids(3, 1))
    first = log.seq
    log.record(ids(1, 5))
    log.record(ids())  # nothing changed: no record
    assert log.seq == first + 1
    assert log.since(first, log.incarnation).tolist() == [1, 5]
    assert log.since(0, log.incarnation).tolist() == [1, 3, 5]
    assert log.since(log.seq, log.incarnation).tolist() == []
    assert log.since(log.seq + 1, log.incarnation) is None, "a seq it never reached"
    assert log.since(0, "another table object") is None
    log.record(ids(7, 8, 9))  # 7 ids held > 6: the oldest record goes
    assert log.since(0, log.incarnation) is None and log.since(first, log.incarnation).tolist() == [1, 5, 7, 8, 9]
    old = log.incarnation
    log.reset()
    assert log.since(log.seq, old) is None and log.since(log.seq, log.incarnation).tolist() == []


def test_a_table_logs_rows_admitted_updated_and_evicted():
    table = EmbeddingTable(D, capacity=3, optimizer="sgd", hyperparams={"lr": 1.0})
    inc, seq, whole, got, rows, held = table.changes(0, "")
    assert whole and len(got) == 0
    table.lookup(torch.tensor([10, 11, 12]), admit=True)
    inc, seq, whole, got, rows, held = table.changes(0, "")
    assert whole and got.tolist() == [10, 11, 12] and torch.equal(rows, table.lookup(got, admit=False))
    table.apply(torch.tensor([11]), torch.ones(1, D), step=1)
    _, seq2, whole, got, rows, held = table.changes(seq, inc)
    assert not whole and got.tolist() == [11] and torch.equal(rows, table.lookup(got, admit=False))
    table.lookup(torch.tensor([13]), admit=True)  # a fourth row: one is evicted at the next step
    table.apply(torch.tensor([13]), torch.ones(1, D), step=2)
    table.evict(2)
    _, _, whole, got, rows, held = table.changes(seq2, inc)
    gone = got[~held]
    assert not whole and len(gone) == 1 and set(got.tolist()) == {13, *gone.tolist()}
    assert torch.equal(rows[~held], torch.zeros(1, D)), "a dropped row is sent as zeros, not held"


def batch(values: dict[int, float], whole: bool = False, owner=(0, 1, "modulo"), drop=(), fixed: int = 0
          ) -> TableBatch:
    """A batch setting row id to [v] * D for each id: v of `values`, dropping the ids of `drop`; `fixed`: the
    table's num_embeddings (0: dynamic)."""
    keys = ids(*values, *drop)
    rows = torch.tensor([[v] * D for v in values.values()] + [[0.0] * D] * len(drop))
    held = np.array([True] * len(values) + [False] * len(drop))
    return TableBatch(D, torch.float32, keys, rows.reshape(len(keys), D), held, whole, owner, fixed)


def test_a_lookup_sees_one_whole_version_while_versions_are_published():
    """Each version sets every row to its own number: a lookup that mixed two versions would see two numbers."""
    replica = Replica(keep=3)
    every = ids(*range(2000))
    replica.publish(1, [("t", batch({i: 1.0 for i in range(2000)}))], None, replica.rewinds)
    stop, mixed = threading.Event(), []

    def read():
        while not stop.is_set():
            version, rows, held, _, _ = replica.lookup("t", every)
            if not bool((rows == float(version.step)).all()):
                mixed.append(version.step)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in readers:
        thread.start()
    for step in range(2, 60):
        replica.publish(step, [("t", batch({i: float(step) for i in range(2000)}))], None, replica.rewinds)
    stop.set()
    for thread in readers:
        thread.join()
    assert not mixed, f"lookups saw rows of two versions at steps {mixed[:5]}"


@pytest.mark.parametrize("fixed", [0, 8], ids=["dynamic", "fixed-size"])
def test_a_rollback_restores_a_kept_version_exactly_and_holds(fixed):
    replica = Replica(keep=3)
    replica.publish(10, [("t", batch({1: 1.0, 2: 2.0}, fixed=fixed))], {"w": torch.zeros(2)}, replica.rewinds)
    replica.publish(20, [("t", batch({2: 5.0, 3: 3.0}, fixed=fixed))], None, replica.rewinds)
    replica.publish(30, [("t", batch({1: 9.0}, drop=(3,), fixed=fixed))], {"w": torch.ones(2)}, replica.rewinds)
    version = replica.rollback(25)
    assert version.step == 20 and replica.held and replica.rewinds == 1
    _, rows, held, _, _ = replica.lookup("t", ids(1, 2, 3, 4))
    assert rows[:, 0].tolist() == [1.0, 5.0, 3.0, 0.0] and held.tolist() == [True, True, True, False]
    assert torch.equal(replica.dense()[1]["w"], torch.zeros(2))
    with pytest.raises(ServingVersionError, match="held"):
        replica.publish(40, [("t", batch({1: 7.0}))], None, replica.rewinds)
    with pytest.raises(ServingVersionError, match="no kept version"):
        replica.rollback(5)  # keep=3: steps 10, 20 were kept, 30 undone; 5 is older than all
    assert replica.lookup("t", ids(1))[1][0, 0] == 1.0, "a refused rollback changed the rows"
    replica.resume()
    with pytest.raises(ServingVersionError, match="rolled back"):
        replica.publish(40, [("t", batch({1: 7.0}))], None, rewinds=0)  # read before the rollback
    replica.publish(40, [("t", batch({1: 7.0}))], None, replica.rewinds)
    assert replica.lookup("t", ids(1))[1][0, 0] == 7.0


@pytest.mark.parametrize("fixed", [0, 4], ids=["dynamic", "fixed-size"])
def test_a_whole_read_drops_only_the_rows_its_shard_owns_that_it_no_longer_holds(fixed):
    replica = Replica()
    replica.publish(1, [("t", batch({0: 1.0, 2: 1.0}, owner=(0, 2, "modulo"), fixed=fixed)),
                        ("t", batch({1: 1.0, 3: 1.0}, owner=(1, 2, "modulo"), fixed=fixed))], None, replica.rewinds)
    replica.publish(2, [("t", batch({2: 2.0}, whole=True, owner=(0, 2, "modulo"), fixed=fixed))], None,
                    replica.rewinds)
    _, rows, held, _, _ = replica.lookup("t", ids(0, 1, 2, 3, 9, -1))
    assert held.tolist() == [False, True, True, True, False, False]
    assert rows[:, 0].tolist() == [0.0, 1.0, 2.0, 1.0, 0.0, 0.0]
    assert replica.status()[3] == 3
    with pytest.raises(UnknownVariableError, match="no table 'u'"):
        replica.lookup("u", ids(0))


def test_the_status_ranks_the_latest_lookups_times_and_counts_them_all():
    """ServingStatus's p50 and p99 are nearest ranks over the last RECENT_LOOKUPS lookups' times (a ring the
    lookups write under a lock that a status call holds only to copy it); `lookups` counts every one."""
    from types import SimpleNamespace

    from torchps.serving.server import RECENT_LOOKUPS, ServingServicer

    follower = SimpleNamespace(fresh_at=0.0, step=0, resyncs=0, error="", rows_applied=0)
    servicer = ServingServicer(Replica(2), follower, authority=None)
    assert (servicer._status().lookup_p50_seconds, servicer._status().lookups) == (0.0, 0)
    times = [((i * 7919) % 10_061) / 1e4 for i in range(RECENT_LOOKUPS + 50)]  # distinct, unordered
    for seconds in times:
        servicer.answered("Lookup", seconds)
    servicer.answered("GetDense", 99.0)  # not a lookup
    status = servicer._status()
    kept = sorted(times[-RECENT_LOOKUPS:])
    assert status.lookups == len(times)
    assert status.lookup_p50_seconds == kept[RECENT_LOOKUPS // 2 - 1]
    assert status.lookup_p99_seconds == kept[int(RECENT_LOOKUPS * 0.99) - 1]
