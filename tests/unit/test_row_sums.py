"""Sync mode's row-gradient sums (ps_server/row_sums.py, aggregation.StepBuffer) and embedding tables in sync
mode through the Coordinator, without sockets.

A step's row sums are the union of the ids pushed, repeats summed, averaged over the pushes that carried the
table (a dense variable's divisor); an add is all or nothing, also with many threads adding at once. Through
the Coordinator: the average is applied once per step on the union of ids, untouched rows and their optimizer
state stay bit for bit, stale pushes are dropped whole, retries are not added twice, a push that raises
changes nothing, and dynamic tables admit and evict as in async mode. Waits are on events (the shard's step),
never on time.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import wait_until

from torchps.errors import InvalidArgumentError, NonFiniteGradientError, TensorMismatchError, UnknownVariableError
from torchps.proto import ps_pb2
from torchps.ps_server.aggregation import StepBuffer
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.modes import SyncConfig
from torchps.ps_server.row_sums import RowSums
from torchps.ps_server.store import NewVariable, VariableStore
from torchps.ps_server.tables import RowGradient

D = 3
TIMEOUT = 10.0


def rg(ids, values) -> RowGradient:
    return RowGradient(torch.tensor(ids, dtype=torch.int64), torch.tensor(values, dtype=torch.float32))


def spec(name: str, *, optimizer: str = "sgd", num_embeddings: int = 10, **fields) -> ps_pb2.TableSpec:
    return ps_pb2.TableSpec(name=name, dim=D, num_embeddings=num_embeddings, dtype=ps_pb2.FLOAT32,
                            optimizer=ps_pb2.OptimizerSpec(name=optimizer, hyperparams={"lr": 0.5}),
                            init=ps_pb2.TableInit(distribution="normal", scale=1.0, seed=11), **fields)


# -- the accumulator ------------------------------------------------------------------------------------

def test_sums_are_the_union_of_ids_with_repeats_summed_and_average_over_the_pushes():
    sums = RowSums()
    first = rg([5, 2, 5], [[1, 1, 1], [2, 2, 2], [3, 3, 3]])
    kept = first.values.clone()
    sums.add({"t": first, "u": RowGradient(torch.zeros(0, dtype=torch.int64), torch.zeros(0, D))})
    sums.add({"t": rg([7, 2], [[4, 4, 4], [6, 6, 6]])})
    assert sums.pushes("t") == 2 and sums.pushes("u") == 1 and sums.pushes("v") == 0
    averaged = sums.averages()
    t = averaged["t"]
    assert t.ids.tolist() == [2, 5, 7] and t.received == 5
    assert torch.equal(t.values, torch.tensor([[4.0] * 3, [2.0] * 3, [2.0] * 3]))  # (2+6)/2, (1+3)/2, 4/2
    assert averaged["u"].ids.numel() == 0 and averaged["u"].values.shape == (0, D)  # counts a step, names no row
    assert torch.equal(first.values, kept), "the pushed tensor must not be summed or divided in place"


def test_an_add_that_raises_leaves_the_buffer_as_it_was():
    buffer = StepBuffer()
    buffer.add({"w": torch.ones(2)}, rows={"t": rg([1], [[1, 1, 1]])})
    bad = RowGradient(torch.tensor([1, 2], dtype=torch.int32), torch.ones(2, D))  # int32 ids
    journal = []
    with pytest.raises(InvalidArgumentError, match="int64"):
        buffer.add({"w": torch.full((2,), 5.0)}, lambda: journal.append("add"), rows={"t": bad})
    assert not journal and buffer.counts["w"] == 1 and torch.equal(buffer.sums["w"], torch.ones(2))
    assert buffer.rows.pushes("t") == 1
    wide = RowGradient(torch.tensor([1]), torch.ones(1, D + 1))
    with pytest.raises(TensorMismatchError, match="earlier ones"):
        buffer.add({"w": torch.full((2,), 5.0)}, lambda: journal.append("add"), rows={"t": wide})
    assert not journal and buffer.counts["w"] == 1 and torch.equal(buffer.sums["w"], torch.ones(2))
    assert torch.equal(buffer.row_averages()["t"].values, torch.ones(1, D))


def test_a_buffers_row_sums_travel_in_its_export_as_copies():
    buffer = StepBuffer()
    buffer.add({"w": torch.ones(2)}, rows={"t": rg([4, 2, 4], [[1, 1, 1], [2, 2, 2], [3, 3, 3]])})
    state = buffer.export()
    buffer.add({"w": torch.ones(2)}, rows={"t": rg([9], [[5, 5, 5]])})  # after the export: not in it
    restored = StepBuffer.restore(state)
    t = restored.row_averages()["t"]
    assert (t.ids.tolist(), t.received) == ([2, 4], 3) and torch.equal(t.values, torch.tensor([[2.0] * 3, [4.0] * 3]))
    assert buffer.row_averages()["t"].ids.tolist() == [2, 4, 9]
    assert StepBuffer.restore({k: v for k, v in state.items() if k != "rows"}).rows.names() == []  # older states


def test_threads_adding_to_one_buffer_get_every_push_exactly_once():
    """8 threads x 40 pushes of small whole numbers (exact in float32): the sums are the sequential ones."""
    buffer = StepBuffer()
    threads, per_thread = 8, 40
    start = threading.Barrier(threads)

    def pusher(k: int) -> None:
        start.wait(TIMEOUT)
        for i in range(per_thread):
            ids = torch.tensor([k, 100 + i % 5, 100 + i % 5, 1000 + k * per_thread + i])  # own, shared, repeated
            buffer.add({"w": torch.full((2,), float(k))}, rows={"t": RowGradient(ids, torch.ones(4, D) * (k + 1))})

    workers = [threading.Thread(target=pusher, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in workers)
    pushes = threads * per_thread
    assert buffer.counts["w"] == pushes and buffer.rows.pushes("t") == pushes
    assert torch.equal(buffer.averages()["w"], torch.full((2,), sum(range(threads)) * per_thread / pushes))
    got = buffer.row_averages()["t"]
    assert got.received == 4 * pushes
    expected: dict[int, float] = {}
    for k in range(threads):
        expected[k] = per_thread * (k + 1)
        for i in range(per_thread):
            expected[100 + i % 5] = expected.get(100 + i % 5, 0) + 2 * (k + 1)
            expected[1000 + k * per_thread + i] = k + 1
    assert got.ids.tolist() == sorted(expected)
    assert torch.equal(got.values, torch.tensor([[expected[i] / pushes] * D for i in sorted(expected)]))


# -- through the Coordinator (no sockets) -------------------------------------------------------------------

@pytest.fixture
def shard():
    """Factory shard(tables, n=2, r=0) -> a sync-mode Coordinator that is not shard 0 (it holds only pushes
    with rows) holding SGD variable "w" = zeros(2) (lr 1) and `tables`, with workers 0..n-1 joined."""
    made: list[Coordinator] = []

    def make(tables, n: int = 2, r: int = 0) -> Coordinator:
        c = Coordinator(VariableStore(), owns_step=False)
        made.append(c)
        c.configure(SyncConfig(mode="sync", total_num_replicas=n, replicas_to_aggregate=r))
        c.create([NewVariable("w", torch.zeros(2), "sgd", {"lr": 1.0})])
        assert c.create_tables(tables, 0, 1) == [True] * len(tables), "sync mode creates tables"
        for i in range(n):
            c.join(f"worker:{i}", 1)
        return c

    yield make
    for c in made:
        c.close()


class Held:
    """c.push(...) in a thread that the coordinator holds (a sync push waiting for its step); result() joins it."""

    def __init__(self, c: Coordinator, *args):
        self._out: list = []
        held = c.waits.waiting("release")
        self._thread = threading.Thread(target=lambda: self._out.append(self._run(c, args)), daemon=True)
        self._thread.start()
        wait_until(lambda: c.waits.waiting("release") > held or not self._thread.is_alive(), TIMEOUT,
                   "the push held for its step")
        assert self._thread.is_alive(), f"the push was not held: {self._out}"

    @staticmethod
    def _run(c: Coordinator, args):
        try:
            return c.push(*args, timeout=TIMEOUT)
        except BaseException as exc:  # noqa: BLE001 - returned to the test thread
            return exc

    def result(self):
        self._thread.join(TIMEOUT)
        assert not self._thread.is_alive(), "a held push was never released"
        (out,) = self._out
        if isinstance(out, BaseException):
            raise out
        return out


def rows_of(c: Coordinator, name: str) -> dict:
    return c.tables.get(name).table.state_dict()


def test_a_sync_step_applies_the_average_once_on_the_union_and_leaves_other_rows_alone(shard):
    c = shard([spec("t", optimizer="adagrad")])
    before = rows_of(c, "t")
    first = Held(c, "worker:0", 1, 1, 0, {"w": torch.ones(2), "t": rg([1, 4, 4], [[1, 2, 3], [1, 1, 1], [1, 1, 1]])},
                 1)
    assert c.store.step == 0 and torch.equal(rows_of(c, "t")["values"], before["values"]), "applied too early"
    second = c.push("worker:1", 1, 1, 0, {"w": torch.full((2,), 3.0), "t": rg([4, 6], [[2, 2, 2], [4, 4, 4]])}, 1,
                    timeout=TIMEOUT)
    assert first.result().next_step == second.next_step == 1
    after = rows_of(c, "t")  # held until applied: no wait needed
    grads = {1: torch.tensor([0.5, 1.0, 1.5]), 4: torch.full((D,), 2.0), 6: torch.full((D,), 2.0)}  # sums / 2
    for i in range(10):
        if i in grads:  # torch.optim.Adagrad, one step from a zero accumulator: row -= lr * g / (|g| + eps)
            assert torch.equal(after["state"]["sum"][i], grads[i] ** 2)
            torch.testing.assert_close(after["values"][i], before["values"][i] - 0.5 * grads[i] / (grads[i].abs()
                                                                                                   + 1e-10))
        else:
            assert torch.equal(after["values"][i], before["values"][i]), f"row {i} moved"
            assert torch.equal(after["state"]["sum"][i], before["state"]["sum"][i]), f"row {i}'s state moved"
    assert torch.equal(c.store.get("w").value.detach(), torch.full((2,), -2.0))
    (status,) = c.tables.status()
    assert status.optimizer_steps == 1 and status.rows_pushed == 5


def test_a_stale_push_with_rows_is_dropped_whole_and_a_retry_is_added_once(shard):
    c = shard([spec("t")])
    before = rows_of(c, "t")
    grads = {"w": torch.ones(2), "t": rg([2], [[2, 2, 2]])}
    original = Held(c, "worker:0", 1, 1, 0, grads, 1)
    retry = Held(c, "worker:0", 1, 1, 0, grads, 1)  # its original's reply was lost: waits for the same release
    assert c.store.step == 0 and c.pending.buffers[0].pushes == 1
    c.push("worker:1", 1, 1, 0, {"w": torch.ones(2), "t": rg([3], [[4, 4, 4]])}, 1, timeout=TIMEOUT)
    assert not original.result().duplicate and retry.result().duplicate
    applied = rows_of(c, "t")
    torch.testing.assert_close(applied["values"][2], before["values"][2] - 0.5 * 1.0)  # (2) / 2: the retry added
    torch.testing.assert_close(applied["values"][3], before["values"][3] - 0.5 * 2.0)  # nothing
    stale = c.push("worker:1", 1, 2, 0, {"w": torch.ones(2), "t": rg([5], [[9, 9, 9]])}, 1, timeout=TIMEOUT)
    assert stale.stale and c.stale_dropped == 1
    assert torch.equal(rows_of(c, "t")["values"], applied["values"]), "the stale push's rows moved"
    first = Held(c, "worker:0", 1, 2, 1, {"w": torch.ones(2), "t": rg([7], [[1, 1, 1]])}, 1)
    c.push("worker:1", 1, 3, 1, {"w": torch.ones(2), "t": rg([7], [[3, 3, 3]])}, 1, timeout=TIMEOUT)
    first.result()
    after = rows_of(c, "t")
    assert torch.equal(after["values"][5], applied["values"][5]), "the stale push's row moved"
    torch.testing.assert_close(after["values"][7], applied["values"][7] - 0.5 * 2.0)
    assert c.tables.status()[0].optimizer_steps == 2


def test_a_backup_workers_late_push_with_rows_is_dropped(shard):
    c = shard([spec("t")], n=3, r=2)
    before = rows_of(c, "t")
    first = Held(c, "worker:0", 1, 1, 0, {"w": torch.ones(2), "t": rg([1], [[2, 2, 2]])}, 1)
    c.push("worker:1", 1, 1, 0, {"w": torch.ones(2), "t": rg([2], [[2, 2, 2]])}, 1, timeout=TIMEOUT)
    first.result()
    late = c.push("worker:2", 1, 1, 0, {"w": torch.ones(2), "t": rg([1, 3], [[8, 8, 8], [8, 8, 8]])}, 1,
                  timeout=TIMEOUT)
    assert late.stale and c.stale_dropped == 1 and c.store.step == 1
    after = rows_of(c, "t")
    for i, moved in ((1, 0.5), (2, 0.5), (3, 0.0)):  # lr 0.5 * (2 / 2); row 3: only the late push named it
        torch.testing.assert_close(after["values"][i], before["values"][i] - moved, rtol=0, atol=0)
    assert c.tables.status()[0].optimizer_steps == 1


def test_sync_rows_match_the_async_arithmetic_for_one_worker(shard):
    """With one worker the sync average is its own gradient: the same rows as the table's own apply."""
    c = shard([spec("t", optimizer="sparse_adam")], n=1)
    twin = c.tables.get("t").table.from_state_dict(rows_of(c, "t"))
    for step, (ids, values) in enumerate([([1, 1, 3], [[1, 0, 0], [0, 1, 0], [2, 2, 2]]), ([3, 9], [[1] * 3] * 2)]):
        assert c.push("worker:0", 1, step + 1, step, {"t": rg(ids, values)}, 1, timeout=TIMEOUT).next_step == step + 1
        twin.apply(torch.tensor(ids), torch.tensor(values, dtype=torch.float32), step + 1)
        assert torch.equal(rows_of(c, "t")["values"], twin.state_dict()["values"])


def test_a_push_that_raises_changes_nothing_and_its_retry_counts(shard):
    c = shard([spec("t")])
    before = rows_of(c, "t")
    bad = {"w": torch.ones(2), "t": rg([1], [[float("nan"), 0, 0]])}
    with pytest.raises(NonFiniteGradientError):
        c.push("worker:0", 1, 1, 0, bad, 1)
    with pytest.raises(UnknownVariableError):
        c.push("worker:0", 1, 1, 0, {"w": torch.ones(2), "nope": rg([1], [[1, 1, 1]])}, 1)
    assert not c.pending.buffers, "a refused push reserved or filled a buffer"
    first = Held(c, "worker:0", 1, 1, 0, {"w": torch.ones(2), "t": rg([1], [[2, 2, 2]])}, 1)  # not a retry
    c.push("worker:1", 1, 1, 0, {"w": torch.ones(2), "t": rg([1], [[2, 2, 2]])}, 1, timeout=TIMEOUT)
    assert not first.result().duplicate
    torch.testing.assert_close(rows_of(c, "t")["values"][1], before["values"][1] - 0.5 * 2.0)


def test_dynamic_tables_admit_on_lookup_and_evict_after_a_sync_apply(shard):
    c = shard([spec("d", num_embeddings=0, max_age=0)])
    (admitted,) = c.tables.lookup([("d", torch.tensor([4, 8]))], admit=True)
    first = Held(c, "worker:0", 1, 1, 0, {"d": rg([4, 5], [[1, 1, 1], [1, 1, 1]])}, 1)  # 5: no row
    c.push("worker:1", 1, 1, 0, {"d": rg([4], [[3, 3, 3]])}, 1, timeout=TIMEOUT)
    first.result()
    state = rows_of(c, "d")
    assert state["ids"].tolist() == [4], "row 8 (not updated for more than max_age 0 steps) is evicted"
    assert state["last_update"].tolist() == [1]
    torch.testing.assert_close(state["values"][0], admitted[0] - 0.5 * 2.0)  # (1 + 3) / 2
    counters = c.tables.get("d").table.counters()
    assert counters["evicted_by_age"] == 1 and counters["optimizer_steps"] == 1
