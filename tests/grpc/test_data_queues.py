"""Data queues over real gRPC (ps.proto's "Data queues"): CreateDataQueue, TakeDataShard, GetDataQueue and
PushHeader.data against real ps-server processes on 127.0.0.1, through PSClient's DataQueue and through the
raw stubs (bad input).

Nothing is ordered by sleeping: a worker held back waits on an event set from what the queue's status shows.
"""

from __future__ import annotations

import math
import signal
import struct
import threading

import grpc
import pytest
import torch

from torchps.client import DataQueue, Optimizer, PSClient, TaskSpec
from torchps.errors import ERROR_METADATA_KEY
from torchps.proto import ps_pb2, ps_pb2_grpc

TIMEOUT = 30.0
W = "w"  # the one variable: float32[2], SGD lr 1, so each applied push of ones moves it by -1


def setup_job(local, *, workers: int = 2, lease_seconds: float = 30.0) -> list[PSClient]:
    """The chief (worker:0) configures and creates `w`; every worker joins. The caller closes the clients."""
    clients = [PSClient(local.cluster, task=TaskSpec("worker", i), connect_timeout=TIMEOUT, timeout=TIMEOUT)
               for i in range(workers)]
    chief = clients[0]
    chief.configure("async", lease_seconds=lease_seconds, progress_seconds=600.0)
    chief.create_variables({W: torch.zeros(2)}, Optimizer("sgd", lr=1.0))
    for client in clients:
        client.declare({W: torch.zeros(2)})
        client.join()
    return clients


def train_shard(queue: DataQueue, shard, batch: int, trained: list, hold=None) -> None:
    for begin, end in shard.batches(batch):
        with queue.pushing(shard, begin, end):
            queue.client.push({W: torch.ones(2)})
        trained.extend((shard.epoch, p) for p in range(begin, end))
        if hold is not None:
            hold()


def test_workers_train_each_example_once_per_epoch_and_a_fast_one_takes_more(local_cluster):
    """Two workers on two shards: every position of both epochs is trained once (the workers' own records and
    ps 0's counts agree), the global step is the number of batches, and while one worker is held on its first
    shard the other trains all the rest."""
    local = local_cluster(2, workers=2)
    clients = setup_job(local)
    try:
        spec = dict(num_examples=103, shard_size=10, epochs=2, seed=4)
        queues = [DataQueue(clients[0], "train"), DataQueue(clients[1], "train")]
        assert queues[0].create(**spec) is True and queues[0].create(**spec) is False
        assert queues[1].wait_created(TIMEOUT).spec.num_examples == 103
        trained = {0: [], 1: []}
        slow_may_go_on = threading.Event()
        errors = []

        def slow() -> None:
            try:
                first = queues[1].take(TIMEOUT)
                taken.set()
                slow_may_go_on.wait(TIMEOUT)
                train_shard(queues[1], first, 4, trained[1])
                for shard in queues[1].shards(TIMEOUT):
                    train_shard(queues[1], shard, 4, trained[1])
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        taken = threading.Event()
        thread = threading.Thread(target=slow)
        thread.start()
        assert taken.wait(TIMEOUT)
        fast_shards = 0
        for shard in queues[0].shards(TIMEOUT):
            fast_shards += 1
            train_shard(queues[0], shard, 4, trained[0])
            status = queues[0].status()
            if len(status.held) == 1 and status.epoch == 2:  # only the slow one's first shard is left
                slow_may_go_on.set()
        slow_may_go_on.set()
        thread.join(TIMEOUT)
        assert not errors, errors
        status = queues[0].status()
        assert list(status.trained) == [103, 103] and status.finished and status.epochs_done == 2
        assert status.shards_done == 2 * 11 and not status.held and status.reclaimed == 0
        everything = sorted(trained[0] + trained[1])
        assert everything == sorted((e, p) for e in range(2) for p in range(103)), "each position trained once"
        assert fast_shards == 21 and queues[1].shards_taken == 1, (fast_shards, queues[1].shards_taken)
        batches = sum(len(range(0, 10, 4)) for _ in range(20)) + 2 * len(range(0, 3, 4))
        assert clients[0].global_step() == batches
        assert queues[0].examples_pushed + queues[1].examples_pushed == 206
        assert torch.equal(clients[0].pull([W])[W], torch.full((2,), -float(batches)))
        order = queues[0].order(1)
        assert sorted(order.tolist()) == list(range(103)) and torch.equal(order, queues[1].order(1))
    finally:
        for client in clients:
            client.close()


def test_a_worker_that_leaves_mid_shard_gives_back_what_it_did_not_train(local_cluster):
    local = local_cluster(1, workers=2)
    clients = setup_job(local)
    try:
        queues = [DataQueue(c, "q") for c in clients]
        queues[0].create(20, 10, epochs=1)
        shard = queues[0].take(TIMEOUT)
        for begin, end in shard.batches(3):
            with queues[0].pushing(shard, begin, end):
                clients[0].push({W: torch.ones(2)})
            if end == 6:
                break
        assert shard.progress == 6
        clients[0].close()  # leaves
        back = queues[1].take(TIMEOUT)
        assert (back.epoch, back.begin, back.progress, back.end) == (0, 6, 6, 10)
        trained = []
        train_shard(queues[1], back, 3, trained)
        for rest in queues[1].shards(TIMEOUT):
            train_shard(queues[1], rest, 3, trained)
        status = queues[1].status()
        assert list(status.trained) == [20] and status.reclaimed == 1 and status.requeued_examples == 4
        assert sorted(p for _, p in trained) == list(range(6, 20))
    finally:
        for client in clients:
            client.close()


def test_a_killed_shard_0_comes_back_mid_epoch_from_its_journal_and_the_epoch_counts_once(local_cluster, tmp_path):
    """ps 0 is SIGKILLed mid-epoch and started again on its port (journal under --checkpoint-dir): the queue
    is where it was, the worker's push in flight is retried and counted once, and the epoch ends exact."""
    local = local_cluster(1, workers=1, server_args=["--checkpoint-dir", str(tmp_path)])
    (client,) = setup_job(local, workers=1)
    try:
        queue = DataQueue(client, "train")
        queue.create(50, 10, epochs=1)
        trained = []
        killed = []

        def kill_once() -> None:
            if len(trained) == 23 and not killed:
                killed.append(local.kill_ps(0, signal.SIGKILL))
                local.start_ps(0)

        for shard in queue.shards(TIMEOUT):
            train_shard(queue, shard, 3, trained, kill_once)
        assert killed == [-signal.SIGKILL]
        status = queue.status()
        assert list(status.trained) == [50] and status.finished, status
        assert sorted(p for _, p in trained) == list(range(50))
        assert client.global_step() == 5 * 4
    finally:
        client.close()


# -- bad input, through the raw stubs ---------------------------------------------------------------


def _ones(n: int) -> bytes:
    return struct.pack(f"<{n}f", *([1.0] * n))


def raw_push(stub, data: ps_pb2.DataProgress | None, *, seq: int, worker: str = "worker:0", incarnation: int = 1,
             empty: bool = False):
    """A push of ones to `w` (`empty`: of nothing, as to a shard that holds no variable of it)."""
    header = ps_pb2.PushHeader(worker=worker, step=0, step_increment=1, incarnation=incarnation, seq=seq,
                               tensors=0 if empty else 1, data=data)
    chunks = [] if empty else [ps_pb2.TensorChunk(name=W, meta=ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[2]),
                                                  offset=0, data=_ones(2))]
    return stub.Push(iter([ps_pb2.PushRequest(header=header, chunks=chunks)]), timeout=TIMEOUT)


def refused(call) -> tuple[grpc.StatusCode, str, str]:
    """(code, error class, details) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as raised:
        call()
    exc = raised.value
    return exc.code(), dict(exc.trailing_metadata() or ()).get(ERROR_METADATA_KEY, ""), exc.details()


def test_bad_input_gets_a_clear_error_and_changes_nothing(local_cluster):
    local = local_cluster(2, workers=1)
    (client,) = setup_job(local, workers=1)
    channels = [grpc.insecure_channel(address) for address in local.cluster.ps]
    ps0, ps1 = (ps_pb2_grpc.ParameterServerStub(c) for c in channels)
    try:
        ps0.CreateDataQueue(ps_pb2.DataQueueSpec(name="q", num_examples=30, shard_size=10, epochs=1), timeout=TIMEOUT)
        lease = ps0.TakeDataShard(ps_pb2.TakeDataShardRequest(queue="q", worker="worker:0",
                                                              incarnation=client.incarnation), timeout=TIMEOUT).shard
        assert (lease.begin, lease.end, lease.progress) == (0, 10, 0)
        inc = client.incarnation
        raw_push(ps0, ps_pb2.DataProgress(queue="q", lease=lease.lease, begin=0, end=4), seq=1, incarnation=inc)

        def state():
            status = ps0.GetDataQueue(ps_pb2.DataQueueRequest(name="q"), timeout=TIMEOUT)
            return (status.SerializeToString(deterministic=True), ps0.GetStatus(ps_pb2.StatusRequest()).step,
                    client.pull([W])[W].tolist())

        before = state()
        assert before[1] == 1 and list(ps0.GetDataQueue(ps_pb2.DataQueueRequest(name="q")).trained) == [4]

        def progress(**fields):
            return ps_pb2.DataProgress(**{"queue": "q", "lease": lease.lease, "begin": 4, "end": 8, **fields})

        invalid, precondition, missing = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                          grpc.StatusCode.NOT_FOUND)
        cases = [
            (lambda: ps0.CreateDataQueue(ps_pb2.DataQueueSpec(name="", num_examples=1, shard_size=1)),
             invalid, "InvalidArgumentError", "name"),
            (lambda: ps0.CreateDataQueue(ps_pb2.DataQueueSpec(name="x", num_examples=0, shard_size=1)),
             invalid, "InvalidArgumentError", "num_examples"),
            (lambda: ps0.CreateDataQueue(ps_pb2.DataQueueSpec(name="x", num_examples=1 << 63, shard_size=1)),
             invalid, "InvalidArgumentError", "num_examples"),
            (lambda: ps0.CreateDataQueue(ps_pb2.DataQueueSpec(name="x", num_examples=5, shard_size=0)),
             invalid, "InvalidArgumentError", "shard_size"),
            (lambda: ps0.CreateDataQueue(ps_pb2.DataQueueSpec(name="x", num_examples=5, shard_size=1,
                                                              epochs=2_000_000)),
             invalid, "InvalidArgumentError", "epochs"),
            (lambda: ps0.CreateDataQueue(ps_pb2.DataQueueSpec(name="q", num_examples=31, shard_size=10, epochs=1)),
             grpc.StatusCode.ALREADY_EXISTS, "SpecConflictError", "exists as"),
            (lambda: ps1.CreateDataQueue(ps_pb2.DataQueueSpec(name="y", num_examples=5, shard_size=1)),
             precondition, "ModeConflictError", "live on ps 0"),
            (lambda: ps0.TakeDataShard(ps_pb2.TakeDataShardRequest(queue="nope", worker="worker:0", incarnation=inc)),
             missing, "UnknownDataQueueError", "no data queue 'nope'"),
            (lambda: ps0.TakeDataShard(ps_pb2.TakeDataShardRequest(queue="q", worker="worker:7", incarnation=3)),
             precondition, "DataShardError", "has not joined"),
            (lambda: ps0.TakeDataShard(ps_pb2.TakeDataShardRequest(queue="q", worker="worker:0", incarnation=0)),
             invalid, "InvalidArgumentError", "incarnation"),
            (lambda: ps0.TakeDataShard(ps_pb2.TakeDataShardRequest(queue="q", worker="worker:0", incarnation=inc,
                                                                   wait_seconds=-1)),
             invalid, "InvalidArgumentError", "wait_seconds"),
            (lambda: ps0.TakeDataShard(ps_pb2.TakeDataShardRequest(queue="q", worker="worker:0", incarnation=inc,
                                                                   wait_seconds=math.nan)),
             invalid, "InvalidArgumentError", "wait_seconds"),
            (lambda: ps1.TakeDataShard(ps_pb2.TakeDataShardRequest(queue="q", worker="worker:0", incarnation=inc)),
             precondition, "ModeConflictError", "live on ps 0"),
            (lambda: ps0.GetDataQueue(ps_pb2.DataQueueRequest(name="nope")),
             missing, "UnknownDataQueueError", "no data queue"),
            (lambda: ps0.GetDataQueue(ps_pb2.DataQueueRequest(name="q", wait_seconds=math.inf)),
             invalid, "InvalidArgumentError", "wait_seconds"),
            # Pushes naming data positions: refused before anything is applied.
            (lambda: raw_push(ps0, progress(lease=999), seq=2, incarnation=inc),
             precondition, "DataShardError", "holds no data shard 999"),
            (lambda: raw_push(ps0, progress(begin=5, end=8), seq=2, incarnation=inc),
             precondition, "DataShardError", "stands at 4"),
            (lambda: raw_push(ps0, progress(end=11), seq=2, incarnation=inc),
             invalid, "InvalidArgumentError", "outside data shard"),
            (lambda: raw_push(ps0, progress(begin=8, end=8), seq=2, incarnation=inc),
             invalid, "InvalidArgumentError", "begin < end"),
            (lambda: raw_push(ps0, progress(), seq=0, incarnation=inc),
             invalid, "InvalidArgumentError", "seq"),
            (lambda: raw_push(ps0, progress(queue="nope"), seq=2, incarnation=inc),
             missing, "UnknownDataQueueError", "no data queue"),
            (lambda: raw_push(ps0, progress(), seq=2, worker="worker:9", incarnation=5),
             precondition, "DataShardError", "held by worker:0"),
        ]
        for call, code, error, words in cases:
            got = refused(call)
            assert got[:2] == (code, error) and words in got[2], (got, words)
            assert state() == before, f"{got} changed the shard"
        # A retry of the counted push: applied once, counted once.
        reply = raw_push(ps0, ps_pb2.DataProgress(queue="q", lease=lease.lease, begin=0, end=4), seq=1,
                         incarnation=inc)
        assert reply.duplicate
        status = ps0.GetDataQueue(ps_pb2.DataQueueRequest(name="q"))
        assert list(status.trained) == [4] and status.duplicates == 1 and state()[1:] == before[1:]
        # Another shard ignores the positions (ps 0 counts them): its part of the push is applied.
        assert raw_push(ps1, progress(lease=999), seq=1, incarnation=inc, empty=True).step == 1
        assert ps0.GetStatus(ps_pb2.StatusRequest()).pid == local.procs[0].pid and local.procs[0].poll() is None
    finally:
        for chan in channels:
            chan.close()
        client.close()
