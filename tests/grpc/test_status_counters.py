"""GetStatus's counters against a real ps-server, each checked to the unit.

    calls_started / calls_done  RPC handlers entered / returned, whatever the outcome
    push_bytes_received         gradient bytes taken in by Push and PushPull, complete or not
    waiting_calls               calls waiting now (min_step pulls, list waits, held pushes, ...)
    duplicates                  retried pushes recognised and not applied again
    workers_expired             leases that ran out (a worker sent nothing for lease_seconds)
    workers_stalled             workers left out for heartbeating without pushing (progress timeout)

The other tests wait on these counters instead of sleeping, so each must move
exactly when its event happens. This module is the only client of its shards:
every delta is exact.
"""

from __future__ import annotations

import math
import threading

import grpc
import pytest
import torch
from helpers import wait_until
from torchps.worker.local_cluster import LocalCluster

from torchps import codec
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server.control_rpcs import MAX_JOINED_OF

TIMEOUT = 30.0
N = 8  # float32 elements: 32 bytes
MIN = codec.MIN_CHUNK_BYTES
LONG = 600.0
LEASE, PROGRESS = 2.0, 4.0  # ps 1: a silent worker expires after LEASE s, a heartbeating one stalls after PROGRESS s


@pytest.fixture(scope="module")
def stubs():
    """ps 0: async, nobody expires; ps 1: async, short lease and progress timeout."""
    with LocalCluster(2) as local:
        channels = [grpc.insecure_channel(address) for address in local.cluster.ps]
        stubs = [ps_pb2_grpc.ParameterServerStub(channel) for channel in channels]
        stubs[0].Configure(ps_pb2.SyncConfig(mode="async", lease_seconds=LONG, progress_seconds=LONG), timeout=TIMEOUT)
        stubs[1].Configure(ps_pb2.SyncConfig(mode="async", lease_seconds=LEASE, progress_seconds=PROGRESS),
                           timeout=TIMEOUT)
        create(stubs[0], "w", torch.zeros(N))
        create(stubs[0], "big", torch.zeros(MIN))  # 4 chunks of MIN bytes
        yield stubs
        for channel in channels:
            channel.close()


def status_of(stub) -> ps_pb2.StatusResponse:
    return stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT)


def create(stub, name: str, value: torch.Tensor) -> None:
    spec = ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value),
                               optimizer=ps_pb2.OptimizerSpec(name="sgd", hyperparams={"lr": 1.0}))
    requests = [ps_pb2.CreateRequest(spec=spec)] + [ps_pb2.CreateRequest(chunk=c)
                                                    for c in codec.encode_chunks(name, value, MIN)]
    assert list(stub.CreateVariables(iter(requests), timeout=TIMEOUT).created) == [True]


def push_requests(name: str | None, grad: torch.Tensor | None = None, *, seq: int = 0, worker: str = "counter:0",
                  chunks: slice = slice(None)) -> list[ps_pb2.PushRequest]:
    head = ps_pb2.PushHeader(worker=worker, incarnation=1, seq=seq, step_increment=1)
    parts = [] if name is None else list(codec.encode_chunks(name, torch.ones(N) if grad is None else grad, MIN))
    return [ps_pb2.PushRequest(header=head)] + [ps_pb2.PushRequest(chunks=[c]) for c in parts[chunks]]


def push(stub, *args, **kwargs) -> ps_pb2.PushResponse:
    return stub.Push(iter(push_requests(*args, **kwargs)), timeout=TIMEOUT)


def fails(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


# -- calls_started / calls_done --------------------------------------------------------------------------------


def test_calls_done_counts_every_handler_that_returned_whatever_its_outcome(stubs):
    stub = stubs[0]
    first = status_of(stub)
    assert first.calls_done == first.calls_started - 1, "only this GetStatus is running"
    outcomes = [
        stub.ListVariables(ps_pb2.ListRequest(), timeout=TIMEOUT).variables is not None,
        len(list(stub.Pull(ps_pb2.PullRequest(names=["w", "big"], chunk_bytes=MIN), timeout=TIMEOUT))) > 1,
        fails(lambda: list(stub.Pull(ps_pb2.PullRequest(names=["nope"]), timeout=TIMEOUT))) == grpc.StatusCode.NOT_FOUND,
        fails(lambda: push(stub, "w", torch.full((N,), math.nan))) == grpc.StatusCode.INVALID_ARGUMENT,
        fails(lambda: push(stub, "big", torch.ones(MIN), chunks=slice(0, 2))) == grpc.StatusCode.INVALID_ARGUMENT,  # truncated
        push(stub, "w").versions["w"] >= 1,
        stub.Join(ps_pb2.WorkerRef(worker="counter:0", incarnation=1), timeout=TIMEOUT) is not None,
        fails(lambda: stub.Configure(ps_pb2.SyncConfig(mode="bogus"), timeout=TIMEOUT)) == grpc.StatusCode.INVALID_ARGUMENT,
    ]
    assert all(outcomes), outcomes
    second = status_of(stub)
    calls = len(outcomes)
    assert second.calls_started == first.calls_started + calls + 1  # this GetStatus included
    assert second.calls_done == first.calls_done + 1 + calls  # the first GetStatus, then each call


def test_calls_done_counts_a_call_the_client_cancelled_once_its_handler_returned(stubs):
    stub = stubs[0]
    step = status_of(stub).step
    waiting = stub.Pull(ps_pb2.PullRequest(names=["w"], min_step=step + 1), timeout=TIMEOUT)
    wait_until(lambda: status_of(stub).waiting_calls == 1, TIMEOUT, "the pull to wait (waiting_calls == 1)")
    started = status_of(stub)
    assert started.calls_done == started.calls_started - 2, "the waiting pull has not returned"
    assert waiting.cancel()
    wait_until(lambda: (lambda s: s.calls_done == s.calls_started - 1)(status_of(stub)), TIMEOUT,
               "the cancelled pull's handler to return (calls_done)")
    assert status_of(stub).waiting_calls == 0


# -- push_bytes_received -------------------------------------------------------------------------------------

PUSHES = {  # case -> (requests, the gradient bytes in them)
    "good": (lambda: push_requests("w"), 4 * N),
    "nan": (lambda: push_requests("w", torch.full((N,), math.nan)), 4 * N),
    "wrong-shape": (lambda: push_requests("w", torch.ones(N + 2)), 4 * (N + 2)),
    "unknown-variable": (lambda: push_requests("nope", torch.ones(3)), 12),
    "truncated-after-two-chunks": (lambda: push_requests("big", torch.ones(MIN), chunks=slice(0, 2)), 2 * MIN),
    "whole-multi-chunk": (lambda: push_requests("big", torch.ones(MIN)), 4 * MIN),
    "header-only": (lambda: push_requests(None), 0),
}


@pytest.mark.parametrize("case", list(PUSHES))
def test_push_bytes_received_counts_every_gradient_byte_taken_in_complete_or_not(stubs, case):
    stub = stubs[0]
    build, size = PUSHES[case]
    before = status_of(stub).push_bytes_received
    try:
        stub.Push(iter(build()), timeout=TIMEOUT)
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), exc.details()
    assert status_of(stub).push_bytes_received == before + size


def test_push_bytes_received_counts_pushpull_and_retried_pushes(stubs):
    stub = stubs[0]
    before = status_of(stub).push_bytes_received
    request = ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="counter:0", incarnation=1, step_increment=1, pull=["w"]),
                                 chunks=list(codec.encode_chunks("w", torch.ones(N))))
    stub.PushPull(request, timeout=TIMEOUT)
    assert status_of(stub).push_bytes_received == before + 4 * N
    first = push(stub, "w", seq=7, worker="counter:bytes")
    retry = push(stub, "w", seq=7, worker="counter:bytes")
    assert retry.duplicate and not first.duplicate
    assert status_of(stub).push_bytes_received == before + 3 * 4 * N, "a retry's bytes are taken in too"


# -- waiting_calls ---------------------------------------------------------------------------------------------


def test_waiting_calls_counts_each_wait_while_it_waits(stubs):
    stub = stubs[0]
    step = status_of(stub).step
    assert status_of(stub).waiting_calls == 0
    pulls = [stub.Pull(ps_pb2.PullRequest(names=["w"], min_step=step + 1), timeout=TIMEOUT) for _ in range(2)]
    results: list = []
    readers = [threading.Thread(target=lambda call=call: results.append(list(call)), daemon=True) for call in pulls]
    for reader in readers:
        reader.start()
    wait_until(lambda: status_of(stub).waiting_calls == 2, TIMEOUT, "two pulls waiting (waiting_calls == 2)")
    listing = stub.ListVariables.future(ps_pb2.ListRequest(names=["late"], wait_seconds=20), timeout=TIMEOUT)
    wait_until(lambda: status_of(stub).waiting_calls == 3, TIMEOUT, "a list waiting too (waiting_calls == 3)")
    create(stub, "late", torch.zeros(1))  # what the list waits for
    assert [i.spec.name for i in listing.result(timeout=TIMEOUT).variables] == ["late"]
    assert status_of(stub).waiting_calls == 2
    push(stub, "w")  # the step the pulls wait for
    for reader in readers:
        reader.join(TIMEOUT)
    assert len(results) == 2 and all(messages[0].step >= step + 1 for messages in results)
    assert status_of(stub).waiting_calls == 0


# -- duplicates ----------------------------------------------------------------------------------------------


def test_duplicates_counts_retries_and_stragglers_not_applied_again(stubs):
    stub = stubs[0]
    before = status_of(stub)
    push(stub, "w", seq=1, worker="counter:dup")
    assert push(stub, "w", seq=1, worker="counter:dup").duplicate
    push(stub, "w", seq=2, worker="counter:dup")
    assert push(stub, "w", seq=1, worker="counter:dup").duplicate  # a straggler of an older push
    push(stub, "w", seq=0, worker="counter:dup")
    push(stub, "w", seq=0, worker="counter:dup")  # seq 0: no dedup asked, not a duplicate
    after = status_of(stub)
    assert after.duplicates == before.duplicates + 2
    assert after.step == before.step + 4, "only the four new pushes were applied"


# -- workers_expired and workers_stalled -----------------------------------------------------------------------


def test_workers_expired_and_stalled_count_leases_and_progress_that_ran_out(stubs):
    """ps 1: a worker that goes silent expires after the lease; one that heartbeats but never pushes stalls
    after the progress timeout; both count again once they come back, and the counters keep their events."""
    stub = stubs[1]
    create(stub, "p", torch.zeros(N))
    stop = threading.Event()

    def heartbeats():  # the stalled worker's client: alive, but its training loop pushes nothing
        while not stop.is_set():
            stub.Heartbeat(ps_pb2.WorkerRef(worker="stall:0", incarnation=1), timeout=TIMEOUT)
            stop.wait(LEASE / 8)

    stub.Join(ps_pb2.WorkerRef(worker="stall:0", incarnation=1), timeout=TIMEOUT)
    stub.Join(ps_pb2.WorkerRef(worker="silent:0", incarnation=1), timeout=TIMEOUT)
    beating = threading.Thread(target=heartbeats, daemon=True)
    beating.start()
    try:
        status = status_of(stub)
        assert (status.live_workers, status.workers_expired, status.workers_stalled) == (2, 0, 0)
        wait_until(lambda: status_of(stub).workers_expired == 1, TIMEOUT,
                   f"silent:0's {LEASE} s lease to run out (workers_expired == 1)")
        status = status_of(stub)
        assert (status.live_workers, status.workers_stalled) == (1, 0), "the heartbeating worker is still live"
        wait_until(lambda: status_of(stub).workers_stalled == 1, TIMEOUT,
                   f"stall:0 to push nothing for {PROGRESS} s while heartbeating (workers_stalled == 1)")
        status = status_of(stub)
        assert (status.live_workers, status.workers_expired) == (0, 1)
        push(stub, "p", worker="stall:0")  # it pushes again: live again
        stub.Heartbeat(ps_pb2.WorkerRef(worker="silent:0", incarnation=1), timeout=TIMEOUT)  # back as well
        status = status_of(stub)
        assert (status.live_workers, status.workers_expired, status.workers_stalled) == (2, 1, 1)
    finally:
        stop.set()
        beating.join(TIMEOUT)


def test_not_joined_names_those_asked_about_that_never_joined_and_too_many_names_are_refused(stubs):
    """StatusRequest.joined_of (the chief's end-of-job question): the names that never joined, in the order
    asked; a worker that joined and left counts as joined. Over MAX_JOINED_OF names: INVALID_ARGUMENT."""
    stub = stubs[0]
    stub.Join(ps_pb2.WorkerRef(worker="worker:7", incarnation=1), timeout=TIMEOUT)
    stub.Leave(ps_pb2.WorkerRef(worker="worker:7", incarnation=1), timeout=TIMEOUT)
    asked = ["worker:9", "worker:7", "chief:0"]
    status = stub.GetStatus(ps_pb2.StatusRequest(joined_of=asked), timeout=TIMEOUT)
    assert list(status.not_joined) == ["worker:9", "chief:0"]
    assert list(status_of(stub).not_joined) == []  # nothing asked, nothing listed
    too_many = ps_pb2.StatusRequest(joined_of=[f"worker:{i}" for i in range(MAX_JOINED_OF + 1)])
    assert fails(lambda: stub.GetStatus(too_many, timeout=TIMEOUT)) == grpc.StatusCode.INVALID_ARGUMENT
