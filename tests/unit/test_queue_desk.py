"""Data queues on a shard (ps_server/queue_desk.py): leases tied to membership, shards of workers gone given
back, pushes counted once applied, and the queue's state in the journal and checkpoints. Real Coordinators
and journals, no sockets.

A push with data positions goes through the desk as the servicer drives it: before_push (checked, pending
mark), Coordinator.push, after_push (counted). A "crash" drops a coordinator without closing anything, as a
killed process leaves its journal.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers import wait_until
from torchps.errors import DataShardError, InvalidArgumentError, ModeConflictError, UnknownDataQueueError, \
    WorkerReplacedError
from torchps.proto import ps_pb2
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.dataqueue import QueueSpec
from torchps.ps_server.journal import Journal
from torchps.ps_server.modes import SyncConfig
from torchps.ps_server.queue_desk import QueueDesk
from torchps.ps_server.server import recover
from torchps.ps_server.store import NewVariable, VariableStore

TIMEOUT = 10.0
SPEC = QueueSpec("train", num_examples=20, shard_size=10, epochs=1, seed=3)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def coordinator(tmp_path=None, *, clock=None, config=SyncConfig(lease_seconds=5.0), create=True) -> Coordinator:
    """Shard 0 with one SGD variable "w" (recovered from the journal in `tmp_path`, if given)."""
    c = Coordinator(VariableStore(), owns_step=True, start=False, **({"clock": clock} if clock else {}))
    recover(c, Journal(tmp_path, compact_factor=0, min_compact_bytes=1 << 30) if tmp_path else None, None)
    if create:
        c.create([NewVariable("w", torch.zeros(2), "sgd", {"lr": 1.0})])
        c.configure(config)
    return c


def push(c: Coordinator, desk: QueueDesk, worker: str, incarnation: int, seq: int, lease, begin: int, end: int, *,
         counted: bool = True):
    """A push of ones with positions [begin, end) of `lease`; with counted=False the shard "dies" before
    after_push (the push applied and written, its count not)."""
    header = ps_pb2.PushHeader(worker=worker, incarnation=incarnation, seq=seq, step=0, step_increment=1,
                               data=ps_pb2.DataProgress(queue=SPEC.name, lease=lease.id, begin=begin, end=end))
    ticket = desk.before_push(header)
    result = None
    try:
        result = c.push(worker, incarnation, seq, 0, {"w": torch.ones(2)}, step_increment=1)
    finally:
        if counted:
            desk.after_push(ticket, header, result)
    return result


def status(desk: QueueDesk) -> dict:
    return desk.status(SPEC.name)


def test_a_take_needs_a_live_member_with_that_incarnation():
    c = coordinator()
    desk = c.queue_desk
    desk.create(SPEC)
    with pytest.raises(DataShardError, match="has not joined"):
        desk.take(SPEC.name, "worker:0", 7)
    c.join("worker:0", 7)
    with pytest.raises(DataShardError, match="has not joined"):
        desk.take(SPEC.name, "worker:0", 8)  # an incarnation the shard has not seen
    with pytest.raises(InvalidArgumentError):
        desk.take(SPEC.name, "worker:0", 0)
    with pytest.raises(UnknownDataQueueError):
        desk.take("absent", "worker:0", 7)
    lease, finished = desk.take(SPEC.name, "worker:0", 7)
    assert (lease.begin, lease.end, finished) == (0, 10, False)
    c.join("worker:0", 9)  # a new process of the task: 7 is retired
    with pytest.raises(WorkerReplacedError):
        desk.take(SPEC.name, "worker:0", 7)
    c.leave("worker:0", 9)
    with pytest.raises(DataShardError, match="not live"):
        desk.take(SPEC.name, "worker:0", 9)
    other = Coordinator(VariableStore(), owns_step=False, start=False)  # not ps 0: it serves no queue
    with pytest.raises(ModeConflictError, match="live on ps 0"):
        other.queue_desk.take(SPEC.name, "worker:0", 9)
    other.close()
    c.close()


@pytest.mark.parametrize("how", ["leaves", "replaced", "lease runs out"])
def test_the_shard_of_a_worker_gone_goes_back_from_where_it_stands(how):
    clock = FakeClock()
    c = coordinator(clock=clock)
    desk = c.queue_desk
    desk.create(SPEC)
    c.join("worker:0", 1)
    c.join("worker:1", 2)
    lease, _ = desk.take(SPEC.name, "worker:0", 1)
    push(c, desk, "worker:0", 1, 1, lease, 0, 3)
    other, _ = desk.take(SPEC.name, "worker:1", 2)
    for seq, begin in enumerate(range(10, 20, 5), start=1):
        push(c, desk, "worker:1", 2, seq, other, begin, begin + 5)
    if how == "leaves":
        c.leave("worker:0", 1)
    elif how == "replaced":
        c.join("worker:0", 3)
    else:
        clock.now += 6.0  # past lease_seconds; worker:1 heartbeats
        c.heartbeat("worker:1", 2)
        wait_until(lambda: (c.wake(), c.membership.expired)[1] == 1, TIMEOUT, "the reaper to expire worker:0")
    back, finished = desk.take(SPEC.name, "worker:1", 2)
    assert (back.begin, back.progress, back.end, finished) == (3, 3, 10, False)
    with pytest.raises((DataShardError, WorkerReplacedError)):  # the dead worker's late push changes nothing
        push(c, desk, "worker:0", 1, 2, lease, 3, 6)
    for seq, begin in enumerate(range(3, 10), start=10):
        push(c, desk, "worker:1", 2, seq, back, begin, begin + 1)
    assert desk.take(SPEC.name, "worker:1", 2) == (None, True)
    assert status(desk)["trained"] == [20] and status(desk)["reclaimed"] == 1
    assert c.store.step == 1 + 2 + 7, "the refused push was not applied"
    c.close()


def test_a_waiting_take_gets_the_shard_of_a_worker_whose_lease_runs_out():
    clock = FakeClock()
    c = coordinator(clock=clock)
    desk = c.queue_desk
    desk.create(QueueSpec("train", num_examples=10, shard_size=10))
    c.join("worker:0", 1)
    c.join("worker:1", 2)
    held, _ = desk.take("train", "worker:0", 1)
    push(c, desk, "worker:0", 1, 1, held, 0, 4)
    got = []
    waiter = threading.Thread(target=lambda: got.append(desk.take("train", "worker:1", 2, wait=TIMEOUT)))
    waiter.start()
    wait_until(lambda: c.waits.waiting("take") == 1, TIMEOUT, "the take to wait")
    clock.now += 6.0
    c.heartbeat("worker:1", 2)
    wait_until(lambda: (c.wake(), not waiter.is_alive())[1], TIMEOUT, "the waiting take to be answered")
    (lease, finished), = got
    assert (lease.begin, lease.progress, lease.end, finished) == (4, 4, 10, False)
    c.close()


def test_a_stale_sync_push_counts_nothing():
    c = coordinator(config=SyncConfig(mode="sync", total_num_replicas=2, replicas_to_aggregate=1))
    desk = c.queue_desk
    desk.create(SPEC)
    c.join("worker:0", 1)
    c.join("worker:1", 2)
    a, _ = desk.take(SPEC.name, "worker:0", 1)
    b, _ = desk.take(SPEC.name, "worker:1", 2)
    assert not push(c, desk, "worker:0", 1, 1, a, 0, 5).stale  # R = 1: applies step 0
    assert push(c, desk, "worker:1", 2, 1, b, 10, 15).stale   # computed at step 0: dropped
    assert status(desk)["trained"] == [5]
    assert [l.progress for l in status(desk)["held"]] == [5, 10]
    c.close()


def test_the_queue_survives_a_crash_mid_epoch_in_the_journal(tmp_path):
    c = coordinator(tmp_path)
    desk = c.queue_desk
    desk.create(SPEC)
    c.join("worker:0", 1)
    lease, _ = desk.take(SPEC.name, "worker:0", 1)
    push(c, desk, "worker:0", 1, 1, lease, 0, 4)
    push(c, desk, "worker:0", 1, 2, lease, 4, 6)
    before = c.queues.export()
    c.recorder.durable_all(TIMEOUT)  # every record queued so far written (a crash now loses none)

    back = coordinator(tmp_path, create=False)
    assert back.queues.export() == before
    desk = back.queue_desk
    again, _ = desk.take(SPEC.name, "worker:0", 1)  # its lease came back with the membership
    assert (again.id, again.progress) == (lease.id, 6)
    assert push(back, desk, "worker:0", 1, 2, lease, 4, 6).duplicate  # a retry: applied and counted once
    assert status(desk)["trained"] == [6] and status(desk)["duplicates"] == 1
    back.close()


def test_a_push_written_before_a_crash_that_lost_its_count_is_settled_from_the_ledger(tmp_path):
    c = coordinator(tmp_path)
    desk = c.queue_desk
    desk.create(SPEC)
    c.join("worker:0", 1)
    lease, _ = desk.take(SPEC.name, "worker:0", 1)
    push(c, desk, "worker:0", 1, 1, lease, 0, 4)
    push(c, desk, "worker:0", 1, 2, lease, 4, 7, counted=False)  # applied and written; the shard dies then
    assert c.store.step == 2 and status(desk)["trained"] == [4]
    c.recorder.durable_all(TIMEOUT)

    back = coordinator(tmp_path, create=False)  # recover() settles before it serves
    desk = back.queue_desk
    assert status(desk)["trained"] == [7] and back.store.step == 2
    assert desk.take(SPEC.name, "worker:0", 1)[0].progress == 7
    back.close()


def test_a_checkpoint_holds_the_queue_with_its_variables_and_a_restore_goes_on_mid_epoch():
    c = coordinator()
    desk = c.queue_desk
    desk.create(SPEC)
    c.join("worker:0", 1)
    lease, _ = desk.take(SPEC.name, "worker:0", 1)
    push(c, desk, "worker:0", 1, 1, lease, 0, 4)
    state = c.state(with_pending=False)  # what Save writes
    push(c, desk, "worker:0", 1, 2, lease, 4, 8)  # after the checkpoint: not in it, nor its update
    c.close()

    back = Coordinator(VariableStore(), owns_step=True, start=False)
    recover(back, None, state)
    desk = back.queue_desk
    assert back.store.step == 1 and status(desk)["trained"] == [4]
    back.join("worker:0", 5)  # the job restarted: a new process of the task
    lease, _ = desk.take(SPEC.name, "worker:0", 5)
    assert (lease.begin, lease.progress, lease.end) == (4, 4, 10), "the old incarnation's shard went back"
    back.close()


def test_a_push_in_flight_when_a_checkpoint_was_taken_counts_if_the_checkpoint_holds_it():
    """The pending mark and the ledger are taken at one instant with the variables: the restore counts the
    push exactly when its update is in the restored values."""
    c = coordinator()
    desk = c.queue_desk
    desk.create(SPEC)
    c.join("worker:0", 1)
    lease, _ = desk.take(SPEC.name, "worker:0", 1)
    header = ps_pb2.PushHeader(worker="worker:0", incarnation=1, seq=1, step=0, step_increment=1,
                               data=ps_pb2.DataProgress(queue=SPEC.name, lease=lease.id, begin=0, end=5))
    desk.before_push(header)
    not_yet = c.state(with_pending=False)
    c.push("worker:0", 1, 1, 0, {"w": torch.ones(2)}, step_increment=1)
    applied = c.state(with_pending=False)
    c.close()
    for state, step, trained in ((not_yet, 0, 0), (applied, 1, 5)):
        back = Coordinator(VariableStore(), owns_step=True, start=False)
        recover(back, None, state)
        assert back.store.step == step and back.queues.status(SPEC.name)["trained"] == [trained]
        back.close()


def test_takes_from_threads_hand_out_each_shard_once():
    c = coordinator()
    desk = c.queue_desk
    desk.create(QueueSpec("train", num_examples=1000, shard_size=7, epochs=2))
    workers = [f"worker:{i}" for i in range(4)]
    for incarnation, worker in enumerate(workers, start=1):
        c.join(worker, incarnation)
    taken: dict[str, list] = {w: [] for w in workers}
    seqs = {w: 0 for w in workers}

    def run(worker: str, incarnation: int) -> None:
        while True:
            lease, finished = desk.take("train", worker, incarnation, wait=TIMEOUT)
            if finished:
                return
            taken[worker].append((lease.epoch, lease.begin, lease.end))
            seqs[worker] += 1
            push(c, desk, worker, incarnation, seqs[worker], lease, lease.begin, lease.end)

    threads = [threading.Thread(target=run, args=(w, i)) for i, w in enumerate(workers, start=1)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT * 3)
    assert time.monotonic() - started < TIMEOUT * 3
    ranges = sorted(r for rs in taken.values() for r in rs)
    assert len(ranges) == len(set(ranges)) == 2 * 143
    assert status(desk)["trained"] == [1000, 1000]
    assert c.store.step == 2 * 143
    c.close()
