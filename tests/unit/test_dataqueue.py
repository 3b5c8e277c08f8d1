"""Data queues (ps_server/dataqueue.py), the pure core of dynamic sharding: threads, leases, give-back,
exactly-once counts, replay and restore. No sockets, no coordinator.

The harness plays the shard's part: a push is "applied" when the test says so, between check_push and
pushed; every event the queues return is kept, in order, as the journal would keep it.
"""

from __future__ import annotations

import random
import threading

import pytest

from torchps.errors import DataShardError, InvalidArgumentError, SpecConflictError, UnknownDataQueueError
from torchps.ps_server.dataqueue import MAX_QUEUES, DataQueues, QueueSpec


class Shard:
    """DataQueues with its events journaled in order, and per-epoch counts of every position counted."""

    def __init__(self, spec: QueueSpec | None = None):
        self.queues = DataQueues()
        self.events: list[dict] = []
        self.lock = threading.Lock()  # the coordinator's lock: events are journaled in the order they happen
        self.counted: dict[tuple[int, int], int] = {}
        self.seq: dict[tuple[str, int], int] = {}
        if spec is not None:
            self.create(spec)

    def create(self, spec: QueueSpec) -> bool:
        with self.lock:
            created, events = self.queues.create(spec)
            self.events += events
        return created

    def take(self, worker: str, incarnation: int = 1, name: str = "q"):
        with self.lock:
            lease, finished, events = self.queues.take(name, worker, incarnation)
            self.events += events
        return lease, finished

    def push(self, worker: str, lease, begin: int, end: int, *, incarnation: int = 1, applied: bool = True,
             seq: int | None = None, name: str = "q"):
        """check_push, then (the push applied or not), then pushed; returns the ticket (None: counted already)."""
        with self.lock:
            if seq is None:
                seq = self.seq[(worker, incarnation)] = self.seq.get((worker, incarnation), 0) + 1
            ticket, events = self.queues.check_push(name, lease.id, begin, end, worker, incarnation, seq)
            self.events += events
        if ticket is not None:
            with self.lock:
                events = self.queues.pushed(ticket, applied)
                self.events += events
                self._count(lease.epoch, events, lease)
        return ticket

    def _count(self, epoch: int, events: list[dict], lease) -> None:
        for event in events:
            if event["op"] == "progress":
                for position in range(lease.progress, event["end"]):
                    self.counted[(epoch, position)] = self.counted.get((epoch, position), 0) + 1
                lease.progress = event["end"]

    def reclaim(self, lease_id: int, name: str = "q") -> list[dict]:
        with self.lock:
            events = self.queues.reclaim(name, lease_id)
            self.events += events
        return events

    def replayed(self) -> DataQueues:
        fresh = DataQueues()
        for event in self.events:
            fresh.replay(event)
        return fresh


def train(shard: Shard, worker: str, lease, batch: int = 3, **kwargs) -> None:
    """Pushes every batch of `lease` from where it stands."""
    position = lease.progress
    while position < lease.end:
        end = min(position + batch, lease.end)
        shard.push(worker, lease, position, end, **kwargs)
        position = end


def test_an_epoch_is_handed_out_in_shards_and_counted_once_then_the_next_until_the_last():
    shard = Shard(QueueSpec("q", num_examples=10, shard_size=4, epochs=2))
    ranges = []
    while True:
        lease, finished = shard.take("worker:0")
        if lease is None:
            assert finished
            break
        ranges.append((lease.epoch, lease.begin, lease.end))
        train(shard, "worker:0", lease)
    assert ranges == [(0, 0, 4), (0, 4, 8), (0, 8, 10), (1, 0, 4), (1, 4, 8), (1, 8, 10)]
    status = shard.queues.status("q")
    assert status["trained"] == [10, 10] and status["epochs_done"] == 2 and status["finished"]
    assert status["shards_done"] == 6 and not status["held"]
    assert set(shard.counted.values()) == {1} and len(shard.counted) == 20


def test_a_worker_holds_one_shard_and_a_take_again_answers_it_where_it_stands():
    shard = Shard(QueueSpec("q", num_examples=100, shard_size=10))
    first, _ = shard.take("worker:0")
    shard.push("worker:0", first, 0, 4)
    again, _ = shard.take("worker:0")
    assert (again.id, again.begin, again.end, again.progress) == (first.id, 0, 10, 4)
    other, _ = shard.take("worker:1")
    assert (other.begin, other.end) == (10, 20)
    replaced, _ = shard.take("worker:0", incarnation=2)  # a new incarnation holds nothing yet
    assert replaced.id not in (first.id, other.id)


def test_bad_pushes_are_refused_and_change_nothing():
    shard = Shard(QueueSpec("q", num_examples=100, shard_size=10))
    lease, _ = shard.take("worker:0")
    shard.push("worker:0", lease, 0, 5)
    before = shard.queues.export()
    cases = [
        (DataShardError, dict(worker="worker:1")),                  # another worker's shard
        (DataShardError, dict(incarnation=9)),                      # another incarnation's
        (DataShardError, dict(begin=6, end=8)),                     # does not continue it where it stands
        (InvalidArgumentError, dict(begin=5, end=11)),              # past its end
        (InvalidArgumentError, dict(begin=5, end=5)),               # empty
        (InvalidArgumentError, dict(begin=7, end=3)),               # backwards
        (InvalidArgumentError, dict(seq=0)),                        # no exactly-once without a seq
        (UnknownDataQueueError, dict(name="other")),
    ]
    for error, change in cases:
        args = {"name": "q", "lease_id": lease.id, "begin": 5, "end": 8, "worker": "worker:0", "incarnation": 1,
                "seq": 99, **change}
        with pytest.raises(error):
            shard.queues.check_push(args["name"], args["lease_id"], args["begin"], args["end"], args["worker"],
                                    args["incarnation"], args["seq"])
    with pytest.raises(DataShardError):
        shard.queues.check_push("q", 12345, 0, 1, "worker:0", 1, 99)  # a lease that never was
    assert shard.queues.export() == before


def test_a_retried_push_counts_once_even_after_its_shard_is_done():
    shard = Shard(QueueSpec("q", num_examples=6, shard_size=6))
    lease, _ = shard.take("worker:0")
    assert shard.push("worker:0", lease, 0, 3) is not None
    assert shard.push("worker:0", lease, 0, 3, seq=1) is None      # the retry: counted already
    assert shard.push("worker:0", lease, 3, 6) is not None          # done: the lease closes
    assert shard.push("worker:0", lease, 3, 6, seq=2) is None       # its retry is still answered
    with pytest.raises(DataShardError):                              # but not another incarnation's
        shard.queues.check_push("q", lease.id, 3, 6, "worker:0", 2, 1)
    status = shard.queues.status("q")
    assert status["trained"] == [6] and status["duplicates"] == 2 and status["finished"]


def test_a_push_not_applied_counts_nothing_and_the_batch_comes_again():
    shard = Shard(QueueSpec("q", num_examples=10, shard_size=10))
    lease, _ = shard.take("worker:0")
    shard.push("worker:0", lease, 0, 4, applied=False)  # sync mode's stale drop, or a push that failed
    assert shard.queues.status("q")["held"][0].progress == 0 and shard.queues.status("q")["held"][0].pending is None
    shard.push("worker:0", lease, 0, 4)
    assert shard.queues.status("q")["trained"] == [4]


def test_a_reclaimed_shard_goes_back_from_where_it_stands_and_is_handed_out_first():
    shard = Shard(QueueSpec("q", num_examples=30, shard_size=10, epochs=1))
    dead, _ = shard.take("worker:0")
    shard.push("worker:0", dead, 0, 4)
    alive, _ = shard.take("worker:1")
    assert shard.reclaim(dead.id)
    with pytest.raises(DataShardError):  # the dead worker's late push is refused
        shard.queues.check_push("q", dead.id, 4, 7, "worker:0", 1, 50)
    back, _ = shard.take("worker:2")
    assert (back.epoch, back.begin, back.end, back.progress) == (0, 4, 10, 4)  # before any new shard
    train(shard, "worker:2", back)
    train(shard, "worker:1", alive)
    last, _ = shard.take("worker:1")
    train(shard, "worker:1", last)
    assert shard.take("worker:1") == (None, True)
    status = shard.queues.status("q")
    assert status["trained"] == [30] and status["reclaimed"] == 1 and status["requeued_examples"] == 6
    assert set(shard.counted.values()) == {1} and len(shard.counted) == 30


def test_a_shard_reclaimed_while_its_push_is_in_flight_goes_back_once_the_push_ends():
    for applied, expected_begin in ((True, 5), (False, 0)):
        shard = Shard(QueueSpec("q", num_examples=10, shard_size=10))
        lease, _ = shard.take("worker:0")
        ticket, _ = shard.queues.check_push("q", lease.id, 0, 5, "worker:0", 1, 1)
        assert shard.reclaim(lease.id) == []  # deferred: the push may yet be applied
        assert shard.queues.holders() == []
        with pytest.raises(DataShardError):   # no further push for it
            shard.queues.check_push("q", lease.id, 0, 5, "worker:0", 1, 1)
        events = shard.queues.pushed(ticket, applied)
        assert [e["op"] for e in events] == (["progress", "reclaim"] if applied else ["unpending", "reclaim"])
        back, _ = shard.take("worker:1")
        assert (back.begin, back.progress, back.end) == (expected_begin, expected_begin, 10)


def test_epoch_e_plus_1_is_handed_out_while_epoch_e_finishes_and_a_returned_rest_comes_first():
    shard = Shard(QueueSpec("q", num_examples=4, shard_size=4, epochs=3))
    slow, _ = shard.take("worker:0")
    fast, _ = shard.take("worker:1")
    assert (slow.epoch, fast.epoch) == (0, 1)  # nobody idles at the end of epoch 0
    shard.push("worker:0", slow, 0, 1)
    shard.reclaim(slow.id)
    train(shard, "worker:1", fast)
    back, _ = shard.take("worker:1")
    assert (back.epoch, back.begin, back.end) == (0, 1, 4)  # the oldest epoch's rest before epoch 2
    assert shard.queues.status("q")["trained"] == [1, 4]


def test_a_queue_with_no_end_goes_on_and_never_finishes():
    shard = Shard(QueueSpec("q", num_examples=3, shard_size=2, epochs=0))
    for _ in range(10):
        lease, finished = shard.take("worker:0")
        assert lease is not None and not finished
        train(shard, "worker:0", lease)
    status = shard.queues.status("q")
    assert status["epochs_done"] >= 4 and not status["finished"] and status["epoch"] >= 4


def test_specs_are_checked_and_creation_is_idempotent():
    shard = Shard()
    spec = QueueSpec("q", num_examples=10, shard_size=3, epochs=2, seed=5)
    assert shard.create(spec) and not shard.create(spec)
    with pytest.raises(SpecConflictError):
        shard.create(QueueSpec("q", num_examples=10, shard_size=4, epochs=2, seed=5))
    for bad in (dict(name=""), dict(name="x" * 129), dict(num_examples=0), dict(num_examples=(1 << 62) + 1),
                dict(shard_size=0), dict(epochs=1_000_001), dict(seed=-1)):
        with pytest.raises(InvalidArgumentError):
            shard.create(QueueSpec(**{"name": "other", "num_examples": 10, "shard_size": 3, **bad}))
    for index in range(MAX_QUEUES - 1):
        shard.create(QueueSpec(f"q{index}", num_examples=1, shard_size=1))
    with pytest.raises(InvalidArgumentError):
        shard.create(QueueSpec("one-too-many", num_examples=1, shard_size=1))
    with pytest.raises(UnknownDataQueueError):
        shard.queues.take("absent", "worker:0", 1)
    assert len(shard.queues) == MAX_QUEUES


def test_threads_with_workers_dying_count_every_position_exactly_once_and_replay_to_the_same_state():
    """Workers take and train shards concurrently; now and then one of them reclaims a random held shard (its
    holder counted as gone, maybe itself: its later pushes are refused, and it goes on as a new incarnation).
    Every position of every epoch is counted exactly once, the journal of events replays to the same state,
    and an export restores to it."""
    epochs, examples = 3, 500
    shard = Shard(QueueSpec("q", num_examples=examples, shard_size=37, epochs=epochs))
    errors = []

    def worker(name: str) -> None:
        rng = random.Random(name)
        incarnation = 1
        try:
            while True:
                lease, finished = shard.take(name, incarnation)
                if finished:
                    return
                if lease is None:
                    continue  # every shard left is held: a reclaim may give one back
                position = lease.progress
                while position < lease.end:
                    end = min(position + rng.randint(1, 9), lease.end)
                    try:
                        shard.push(name, lease, position, end, incarnation=incarnation,
                                   applied=rng.random() > 0.05)
                    except DataShardError:
                        incarnation += 1  # reclaimed: as a worker replaced by its next incarnation
                        break
                    if rng.random() < 0.03:  # a holder counted as gone
                        held = shard.queues.holders()
                        if held:
                            shard.reclaim(rng.choice(held)[1])
                    if lease.progress < end:  # not applied: the same batch again
                        continue
                    position = end
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"worker:{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    status = shard.queues.status("q")
    assert status["finished"] and status["trained"] == [examples] * epochs, status
    assert len(shard.counted) == epochs * examples and set(shard.counted.values()) == {1}
    assert status["reclaimed"] > 0
    assert shard.replayed().export() == shard.queues.export()
    restored = DataQueues()
    restored.restore(shard.queues.export())
    assert restored.export() == shard.queues.export()


def test_a_restored_mid_epoch_queue_goes_on_and_settles_pushes_in_flight_from_the_ledger():
    shard = Shard(QueueSpec("q", num_examples=20, shard_size=10, epochs=1))
    a, _ = shard.take("worker:0")
    b, _ = shard.take("worker:1")
    shard.push("worker:0", a, 0, 4)
    shard.queues.check_push("q", a.id, 4, 7, "worker:0", 1, 2)  # in flight when the state was taken
    shard.queues.check_push("q", b.id, 10, 13, "worker:1", 1, 1)  # in flight too, but never applied
    state = shard.queues.export()

    back = DataQueues()
    back.restore(state)
    in_ledger = {("worker:0", 1, 2)}
    events = back.settle(lambda worker, incarnation, seq: (worker, incarnation, seq) in in_ledger)
    assert sorted(e["op"] for e in events) == ["progress", "unpending"]
    held = {lease.worker: lease for lease in back.status("q")["held"]}
    assert (held["worker:0"].progress, held["worker:1"].progress) == (7, 10)
    assert back.status("q")["trained"] == [7]
    for name, lease in held.items():  # the workers go on (as new incarnations: their shards were reclaimed)
        back.reclaim("q", lease.id)
    done = 0
    while True:
        lease, finished, _ = back.take("q", "worker:2", 1)
        if finished:
            break
        for begin in range(lease.progress, lease.end):
            ticket, _ = back.check_push("q", lease.id, begin, begin + 1, "worker:2", 1, 100 + done)
            back.pushed(ticket, True)
            done += 1
    assert done == 20 - 7 and back.status("q")["trained"] == [20]
