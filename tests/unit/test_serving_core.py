"""The pure parts of serving replicas: a table's change log (ps_server/row_changes.py, EmbeddingTable.changes) and
the replica's versions (serving/replica.py): atomic visibility under concurrent lookups, exact rollbacks, whole
reads that drop what a shard no longer holds, and refusals that change nothing. Threads, no gRPC."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from torchps.errors import InvalidArgumentError, ServingVersionError, UnknownVariableError
from torchps.ps_server.embeddings import EmbeddingTable
from torchps.ps_server.row_changes import RowChanges
from torchps.serving.guard import LossGuard
from torchps.serving.replica import Replica, TableBatch

D = 4


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_the_log_answers_the_ids_changed_since_a_seq_and_says_when_it_cannot():
    log = RowChanges(limit=6)
    asked = []

    def table(seq):  # the table's rows changed after seq, as its marks say
        asked.append(seq)
        return ids(7, 8)

    log.record(ids(3, 1))
    first = log.seq
    log.record(ids(1, 5))
    assert log.record(ids()) == log.seq == first + 1, "nothing changed: no record"
    assert log.since(first, log.incarnation, table).tolist() == [1, 5]
    assert log.since(0, log.incarnation, table).tolist() == [1, 3, 5]
    assert log.since(log.seq, log.incarnation, table).tolist() == []
    assert not asked, "the log held every record asked for"
    assert log.since(log.seq + 1, log.incarnation, table) is None, "a seq it never reached"
    assert log.since(0, "another table object", table) is None
    log.record(ids(7, 8, 9))  # 7 ids held > 6: the oldest record goes
    assert log.since(first, log.incarnation, table).tolist() == [1, 5, 7, 8, 9] and not asked
    log.record(ids(9, 4), dropped=True)
    assert log.since(0, log.incarnation, table).tolist() == [4, 7, 8, 9], "the table's rows and the drops"
    assert asked == [0]
    log.record(ids(11, 12, 13, 14, 15), dropped=True)  # 7 dropped ids held > 6: drops of before are gone
    assert log.since(0, log.incarnation, table) is None and asked == [0]
    old = log.incarnation
    log.reset()
    assert log.since(log.seq, old, table) is None and log.since(log.seq, log.incarnation, table).tolist() == []
    assert log.since(log.seq - 1, log.incarnation, table) is None, "a seq of before the reset"


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


def test_a_table_answers_a_cursor_older_than_its_log_from_its_rows_and_filters_by_update_count():
    table = EmbeddingTable(D, optimizer="sgd", hyperparams={"lr": 1.0}, max_age=5)
    table._changes = RowChanges(limit=6)  # a short log: older cursors are answered from the rows' marks
    table.lookup(torch.arange(10))
    saved = table.state_dict()
    inc, seq = saved["changes"]["incarnation"], saved["changes"]["seq"]
    table.apply(torch.tensor([1, 2]), torch.ones(2, D), step=1)
    table.apply(torch.tensor([2, 3, 4]), torch.ones(3, D), step=2)
    table.apply(torch.tensor([3, 4]), torch.ones(2, D), step=3)  # the log forgets the first update
    _, _, whole, got, rows, held = table.changes(seq, inc)
    assert not whole and got.tolist() == [1, 2, 3, 4] and held.all()
    assert torch.equal(rows, table.lookup(got, admit=False))
    _, _, _, got, rows, held = table.changes(seq, inc, min_updates=2)
    assert got.tolist() == [1, 2, 3, 4] and held.tolist() == [False, True, True, True]
    assert torch.equal(rows[0], torch.zeros(D)), "a row under the threshold is sent as not held"
    assert table.evict(6)["by_age"] == 6  # rows 0 and 5-9, never updated
    _, _, whole, got, rows, held = table.changes(seq, inc)
    assert not whole and got.tolist() == list(range(10)) and held.tolist() == [i in (1, 2, 3, 4) for i in range(10)]
    copy = EmbeddingTable(D, optimizer="sgd", max_age=5)
    copy.load_state_dict(table.state_dict())
    _, _, whole, got, _, held = copy.changes(0, "", min_updates=2)
    assert whole and got.tolist() == [1, 2, 3, 4] and held.tolist() == [False, True, True, True]
    older = {k: v for k, v in table.state_dict().items() if k != "update_counts"}  # an older torchps's state
    copy.load_state_dict(older)
    assert copy.changes(0, "", min_updates=1000)[5].all(), "rows of unknown update counts pass every threshold"
    with pytest.raises(InvalidArgumentError, match="min_updates"):
        table.changes(seq, inc, min_updates=-1)


def batch(values: dict[int, float], whole: bool = False, owner=(0, 1, "modulo"), drop=(), fixed: int = 0
          ) -> TableBatch:
    """A batch setting row id to [v] * D for each id: v of `values`, dropping the ids of `drop`; `fixed`: the
    table's num_embeddings (0: dynamic)."""
    keys = ids(*values, *drop)
    rows = torch.tensor([[v] * D for v in values.values()] + [[0.0] * D] * len(drop))
    held = np.array([True] * len(values) + [False] * len(drop))
    return TableBatch(D, torch.float32, keys, rows.reshape(len(keys), D), held, whole, owner, fixed)


def test_a_guard_reads_a_rounds_version_before_anyone_sees_it_and_refuses_a_worse_one():
    replica = Replica(keep=4)
    replica.publish(1, [("t", batch({1: 1.0, 2: 2.0}))], {"w": torch.zeros(1)}, replica.freezes)
    calls = []

    def loss(model):  # row 1's first value plus w
        calls.append(model)
        return float(model.lookup("t", torch.tensor([1, 2]))[0, 0] + model.dense(["w"])["w"][0])

    guard = LossGuard(loss, max_increase=0.5)
    candidate = replica.candidate([("t", batch({1: 1.4}, drop=(2,)))], {"w": torch.zeros(1)})
    assert torch.equal(candidate.lookup("t", torch.tensor([1, 2, 3])), torch.tensor([[1.4] * D, [0.0] * D, [0.0] * D]))
    assert replica.lookup("t", ids(1))[1][0, 0] == 1.0, "a candidate is not visible to lookups"
    assert guard.refusal(replica.view(), candidate) == "" and guard.baseline == pytest.approx(1.4)
    replica.publish(2, [("t", batch({1: 1.4}, drop=(2,)))], None, replica.freezes)
    worse = replica.candidate([("t", batch({1: 1.0}))], {"w": torch.ones(1)})  # 1.0 + 1.0 > 1.4 + 0.5
    assert "refused" in guard.refusal(replica.view(), worse) and guard.refused == 1
    assert guard.baseline == pytest.approx(1.4), "a refused candidate is not the baseline"
    assert "failed" in LossGuard(lambda m: m.lookup("nope", torch.tensor([1])), 0.5).refusal(None, worse)
    assert "refused" in LossGuard(lambda m: math.nan, 0.5).refusal(None, worse), "a loss that is not finite"
    first = LossGuard(loss, 0.0)
    assert first.refusal(None, worse) == "", "with no version served, any finite loss passes"
    with pytest.raises(InvalidArgumentError):
        LossGuard(loss, -1.0)


def test_a_lookup_sees_one_whole_version_while_versions_are_published():
    """Each version sets every row to its own number: a lookup that mixed two versions would see two numbers."""
    replica = Replica(keep=3)
    every = ids(*range(2000))
    replica.publish(1, [("t", batch({i: 1.0 for i in range(2000)}))], None, replica.freezes)
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
        replica.publish(step, [("t", batch({i: float(step) for i in range(2000)}))], None, replica.freezes)
    stop.set()
    for thread in readers:
        thread.join()
    assert not mixed, f"lookups saw rows of two versions at steps {mixed[:5]}"


@pytest.mark.parametrize("fixed", [0, 8], ids=["dynamic", "fixed-size"])
def test_a_rollback_restores_a_kept_version_exactly_and_holds(fixed):
    replica = Replica(keep=3)
    replica.publish(10, [("t", batch({1: 1.0, 2: 2.0}, fixed=fixed))], {"w": torch.zeros(2)}, replica.freezes)
    replica.publish(20, [("t", batch({2: 5.0, 3: 3.0}, fixed=fixed))], None, replica.freezes)
    replica.publish(30, [("t", batch({1: 9.0}, drop=(3,), fixed=fixed))], {"w": torch.ones(2)}, replica.freezes)
    version = replica.rollback(25)
    assert version.step == 20 and replica.held and replica.rewinds == 1
    _, rows, held, _, _ = replica.lookup("t", ids(1, 2, 3, 4))
    assert rows[:, 0].tolist() == [1.0, 5.0, 3.0, 0.0] and held.tolist() == [True, True, True, False]
    assert torch.equal(replica.dense()[1]["w"], torch.zeros(2))
    with pytest.raises(ServingVersionError, match="held"):
        replica.publish(40, [("t", batch({1: 7.0}))], None, replica.freezes)
    with pytest.raises(ServingVersionError, match="no kept version"):
        replica.rollback(5)  # keep=3: steps 10, 20 were kept, 30 undone; 5 is older than all
    assert replica.lookup("t", ids(1))[1][0, 0] == 1.0, "a refused rollback changed the rows"
    replica.resume()
    with pytest.raises(ServingVersionError, match="rolled back"):
        replica.publish(40, [("t", batch({1: 7.0}))], None, freezes=0)  # read before the rollback
    replica.publish(40, [("t", batch({1: 7.0}))], None, replica.freezes)
    assert replica.lookup("t", ids(1))[1][0, 0] == 7.0


def test_a_round_read_before_a_hold_is_refused_after_the_resume():
    """A round that began before a hold may hold part of a push made while held (its step label, read later,
    would not tell): once resumed, it is refused, and the next round, begun after, is published."""
    replica = Replica()
    replica.publish(1, [("t", batch({1: 1.0}))], None, replica.freezes)
    began = replica.freezes
    replica.hold()
    replica.resume()
    with pytest.raises(ServingVersionError, match="held or rolled back while the round was read"):
        replica.publish(2, [("t", batch({1: 2.0}))], None, began)
    assert replica.current().version == 1 and replica.rewinds == 0  # (no whole read needed: nothing undone)
    assert replica.publish(2, [("t", batch({1: 2.0}))], None, replica.freezes).version == 2


@pytest.mark.parametrize("fixed", [0, 4], ids=["dynamic", "fixed-size"])
def test_a_whole_read_drops_only_the_rows_its_shard_owns_that_it_no_longer_holds(fixed):
    replica = Replica()
    replica.publish(1, [("t", batch({0: 1.0, 2: 1.0}, owner=(0, 2, "modulo"), fixed=fixed)),
                        ("t", batch({1: 1.0, 3: 1.0}, owner=(1, 2, "modulo"), fixed=fixed))], None, replica.freezes)
    replica.publish(2, [("t", batch({2: 2.0}, whole=True, owner=(0, 2, "modulo"), fixed=fixed))], None,
                    replica.freezes)
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

    follower = SimpleNamespace(fresh_at=0.0, step=0, resyncs=0, error="", rows_applied=0, guard=None, dense_at=0.0)
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
