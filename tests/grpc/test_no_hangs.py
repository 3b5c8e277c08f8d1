"""Nothing waits for ever: client deadlines, threads that never starve each other, heartbeats that reach
every shard at once, status that never waits behind applies, and shards that come back empty.

Real ps-server processes on 127.0.0.1; a shard that must stall is SIGSTOPped (it then answers nothing,
the way a hung host does) and always SIGCONTed in a finally.
"""

from __future__ import annotations

import signal
from contextlib import nullcontext
import statistics
import threading
import time

import pytest
import torch

from torchps.client import (Optimizer, PSClient, ServerUnavailableError, ShardLostError, TaskSpec,
                            UnknownVariableError, WaitTimeoutError)
from torchps.client.channels import Backoff, ShardChannels
from torchps.proto import ps_pb2

from helpers import stopped, wait_until


def test_every_call_has_a_deadline_even_against_a_shard_that_answers_nothing(local_cluster):
    local = local_cluster(1)
    # Setting up and checking afterwards get generous deadlines (a loaded CI machine can take seconds to
    # create the first variable); only the calls made while the shard is stopped use the short ones.
    with PSClient(local.cluster, connect_timeout=30, timeout=30) as patient, \
            PSClient(local.cluster, connect_timeout=1, timeout=1.5) as client:
        patient.create_variables({"dl/v": torch.zeros(4)}, Optimizer("sgd", lr=1.0))
        client.declare({"dl/v": torch.zeros(4)})  # the same placement, without a call
        client.status(0)  # its channel is up while the shard still answers
        with stopped(local.procs[0]):
            for call in (lambda: client.push({"dl/v": torch.ones(4)}), lambda: client.pull(["dl/v"]),
                         lambda: client.status(0)):
                started = time.monotonic()
                with pytest.raises((WaitTimeoutError, ServerUnavailableError)):
                    call()
                assert time.monotonic() - started < 1.5 + 1 + 5, "a call outlived its deadline and retry window"
        value = patient.pull(["dl/v"])["dl/v"]
        assert torch.equal(value, -torch.ones(4)) or torch.equal(value, torch.zeros(4)), \
            "the shard serves again once resumed"


def test_a_prefetching_pull_waiting_for_a_step_never_starves_a_push_from_another_thread(local_cluster):
    """The issue's hang: pull_into(min_step=far) in one thread, push in another, same client."""
    local = local_cluster(2)
    with PSClient(local.cluster, connect_timeout=10, timeout=20) as client:
        names = {"st/a": torch.zeros(3), "st/b": torch.zeros(3)}  # one per shard
        client.create_variables(names, Optimizer("sgd", lr=1.0))
        targets = {n: torch.empty(3) for n in names}
        prefetch_errors: list[BaseException] = []

        def prefetch():
            try:
                client.pull_into(targets, min_step=5)
            except BaseException as exc:  # noqa: BLE001
                prefetch_errors.append(exc)

        prefetchers = [threading.Thread(target=prefetch, daemon=True) for _ in range(4)]
        for thread in prefetchers:
            thread.start()
        wait_until(lambda: client.status(0).waiting_calls >= 4 and client.status(1).waiting_calls >= 4, 20,
                   "four prefetching pulls to wait on both shards")
        for _ in range(5):  # these pushes are what the prefetching pulls wait for
            client.push({n: torch.ones(3) for n in names})
        for thread in prefetchers:
            thread.join(20)
        assert not any(t.is_alive() for t in prefetchers) and not prefetch_errors, prefetch_errors
        assert all(torch.equal(t, -5 * torch.ones(3)) for t in targets.values())


def test_heartbeats_reach_every_shard_while_one_hangs(local_cluster):
    """With shard 0 hung, shard 1 still gets heartbeats in time: the lease there holds."""
    local = local_cluster(2, workers=1)
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=5) as client:
        client.configure("sync", total_num_replicas=1, lease_seconds=1.5)
        client.create_variables({"hb/a": torch.zeros(2), "hb/b": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        client.join()
        with PSClient(local.cluster, connect_timeout=5) as observer:
            with stopped(local.procs[0]):
                time_limit = time.monotonic() + 4 * 1.5
                while time.monotonic() < time_limit:  # four lease periods, watched from outside 20 times a second
                    assert observer.status(1).live_workers == 1, "the lease on ps 1 ran out while ps 0 hung"
                    time.sleep(0.05)
            assert observer.status(1).workers_expired == 0


def test_status_never_waits_behind_applies(local_cluster):
    """GetStatus stays fast while 80 MB Adam updates are applied back to back (it never takes their locks). One
    torch thread makes each apply long (hundreds of ms), so a GetStatus that waited behind them would wait out
    the rest of the apply in progress: half a push at the median. The bounds leave room for a loaded machine,
    where the slowest status calls took a quarter of a push (104 ms beside applies of 400 ms, in a CI run at
    load 7 from other jobs) without waiting for any apply."""
    local = local_cluster(1, server_args=["--torch-threads", "1"])
    size = 20 << 20  # float32: 80 MB
    with PSClient(local.cluster, connect_timeout=10, timeout=60) as client:
        client.create_variables({"lk/big": torch.zeros(size)}, Optimizer("adam", lr=0.01))
        grad = {"lk/big": torch.full((size,), 0.5)}
        stop = threading.Event()
        apply_seconds: list[float] = []

        def pushes():
            while not stop.is_set():
                started = time.monotonic()
                client.push(grad)
                apply_seconds.append(time.monotonic() - started)

        pusher = threading.Thread(target=pushes, daemon=True)
        pusher.start()
        latencies = []
        with PSClient(local.cluster, connect_timeout=10) as observer:
            wait_until(lambda: observer.status(0).step >= 2, 60, "two pushes applied")
            while len(apply_seconds) < 8:
                started = time.monotonic()
                observer.status(0)
                latencies.append(time.monotonic() - started)
        stop.set()
        pusher.join(60)
    median, p99 = statistics.median(latencies), statistics.quantiles(latencies, n=100)[98]
    push = statistics.median(apply_seconds)
    figures = f"GetStatus median {median * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms vs a push of {push * 1e3:.0f} ms"
    assert median < push / 8 and p99 < push / 2, f"{figures}: it waited behind applies"


def test_backoff_doubles_with_jitter_and_stops_at_the_deadline():
    import random

    pauses = []
    backoff = Backoff(time.monotonic() + 0.6, rng=random.Random(0))
    while True:
        started = time.monotonic()
        if not backoff.pause():
            break
        pauses.append(time.monotonic() - started)
    assert 3 <= len(pauses) <= 8 and sum(pauses) <= 0.6 + 0.05
    assert pauses[1] > pauses[0] * 1.1 or pauses[2] > pauses[1] * 1.1, f"pauses grow: {pauses}"


# -- a shard that comes back without its state (no --checkpoint-dir) ------------------------------------

def test_a_shard_restarted_empty_is_refilled_by_the_chief_and_training_goes_on(local_cluster):
    """ps 1 restarts without its state (no --checkpoint-dir): a worker's push waits for the refill instead of
    failing; the chief's next push refills ps 1 from its copy (the values it last pulled); both pushes are
    then applied once each."""
    local = local_cluster(2, workers=2)
    names = {"re/a": torch.zeros(3), "re/b": torch.zeros(3)}  # re/b lives on ps 1
    ones = {n: torch.ones(3) for n in names}
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=10) as chief, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=10, refill_timeout=30) as worker:
        chief.configure("async")
        chief.create_variables(names, Optimizer("sgd", lr=1.0))
        worker.declare(names)
        worker.wait_for_variables(names, 10)
        chief.join(), worker.join()
        chief.push(ones), worker.push(ones)
        chief.pull_into(names)  # the chief's copy, as a training loop keeps it
        assert local.kill_ps(1) == -signal.SIGKILL
        local.start_ps(1)
        result: list = []
        pushing = threading.Thread(target=lambda: result.append(worker.push(ones)), daemon=True)
        pushing.start()
        wait_until(lambda: chief.status(1).waiting_calls >= 1, 20, "the worker to wait for the refill on ps 1")
        chief.push(ones)  # finds ps 1 empty, refills it, pushes again
        pushing.join(30)
        assert result, "the worker's push went through after the refill"
        values = chief.pull(list(names))
        assert torch.equal(values["re/a"], -4 * torch.ones(3)), "ps 0 applied each push once"
        assert torch.equal(values["re/b"], -4 * torch.ones(3)), "ps 1: the chief's copy (-2), then both pushes"
        assert worker.restarts_seen == chief.restarts_seen == 1


def test_a_shard_restarted_empty_that_nobody_refills_fails_fast_with_one_clear_error(local_cluster):
    local = local_cluster(1)
    with PSClient(local.cluster, connect_timeout=10) as creator:
        creator.create_variables({"lost/v": torch.zeros(3)}, Optimizer("sgd", lr=1.0))
    with PSClient(local.cluster, connect_timeout=10, refill_timeout=1) as worker:
        worker.declare({"lost/v": torch.zeros(3)})
        worker.wait_for_variables(["lost/v"], 10)
        assert local.kill_ps(0) == -signal.SIGKILL
        local.start_ps(0)
        with pytest.raises(ShardLostError, match="restarted without its variables"):
            worker.push({"lost/v": torch.ones(3)})
    with PSClient(local.cluster, connect_timeout=10) as newcomer:
        newcomer.declare({"never/v": torch.zeros(1)})
        with pytest.raises(UnknownVariableError):  # a name that was never created is not a lost shard
            newcomer.pull(["never/v"])


def test_an_upload_stream_that_stalls_is_ended_and_changes_nothing(local_cluster):
    """A client that sends a push's header and first chunk, then nothing, with no deadline of its own: the
    shard ends the stream after --stream-idle-seconds (DEADLINE_EXCEEDED naming the limit), frees the RPC
    thread and applies nothing; the same for a CreateVariables stream."""
    import grpc

    from torchps import codec
    from torchps.proto import ps_pb2

    local = local_cluster(1, server_args=["--stream-idle-seconds", "1"])
    n = 1 << 18
    chunks = list(codec.encode_chunks("stall/w", torch.ones(n), 256 << 10))
    never = threading.Event()

    def stalled(first):
        yield first
        never.wait(60)  # the client neither sends more nor ends the stream

    with PSClient(local.cluster, connect_timeout=10) as client, grpc.insecure_channel(local.cluster.ps[0]) as channel:
        client.create_variables({"stall/w": torch.zeros(n)}, Optimizer("sgd", lr=1.0))
        push = channel.stream_unary("/torchps.v1.ParameterServer/Push",
                                    request_serializer=ps_pb2.PushRequest.SerializeToString,
                                    response_deserializer=ps_pb2.PushResponse.FromString)
        create = channel.stream_unary("/torchps.v1.ParameterServer/CreateVariables",
                                      request_serializer=ps_pb2.CreateRequest.SerializeToString,
                                      response_deserializer=ps_pb2.CreateResponse.FromString)
        spec = ps_pb2.VariableSpec(name="stall/new", meta=codec.meta_of(torch.zeros(n)),
                                   optimizer=ps_pb2.OptimizerSpec(name="sgd"))
        try:
            for call, first in ((push, ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="w", seq=1, tensors=1),
                                                          chunks=chunks[:1])),
                                (create, ps_pb2.CreateRequest(count=1, spec=spec))):
                with pytest.raises(grpc.RpcError) as info:
                    call(stalled(first), timeout=60)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
                assert "no message for 1 s" in info.value.details()
        finally:
            never.set()
        status = client.status(0)
        assert status.step == 0 and [v.spec.name for v in client.list_variables()] == ["stall/w"]
        assert torch.equal(client.pull(["stall/w"])["stall/w"], torch.zeros(n)), "nothing was applied"
        wait_until(lambda: (lambda s: s.calls_done == s.calls_started - 1)(client.status(0)), 20,
                   "every handler on the shard to return (GetStatus calls_done)")


@pytest.mark.parametrize("arbiter", ["answering", "stopped too"])
def test_a_first_call_to_a_shard_that_answers_nothing_ends_at_its_deadline(local_cluster, arbiter):
    """A channel that never connected, to a shard that answers nothing (SIGSTOPped: the kernel still accepts
    its connections), following failovers as a shard's asks of its arbiter do: the call ends at its deadline,
    its look at what answers there and its asks of the shard's arbiter where it is served included."""
    local = local_cluster(2)
    channels = ShardChannels(list(local.cluster.ps), connect_timeout=0.5)
    channels.follows_failovers = True
    try:
        with stopped(local.procs[0]), (stopped(local.procs[1]) if arbiter == "stopped too" else nullcontext()):
            started = time.monotonic()
            with pytest.raises(ServerUnavailableError):
                channels.call(0, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t), 0.5,
                              retry_for=0.5)
            took = time.monotonic() - started
        # (Before, its look at what answers took 3 s more, and each ask of the arbiter up to 1 s; the margin is
        # a loaded machine's.)
        assert took < 0.5 + 2.0, f"took {took:.2f} s against a 0.5 s deadline"
    finally:
        channels.close()
