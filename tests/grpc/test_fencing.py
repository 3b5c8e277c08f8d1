"""Worker incarnations against real ps-server processes: a restarted worker fences its old process off, and a
retried push is applied at most once.

Join, Heartbeat, Push and Leave carry the worker's incarnation (random per
client process). When a worker name joins with a new incarnation, the old one
is retired for good: every later call from it (heartbeat, push, leave, join,
and the retry of a push it made before) gets FAILED_PRECONDITION with
torchps-error WorkerReplacedError and changes nothing, so a dying old process
can neither evict its successor, lower a sync quorum, nor have a gradient
counted. A push repeated with the same (worker, incarnation, seq) is answered
as the first was and never applied again, also after the worker's lease ran
out and it came back.

One three-shard cluster serves the module: ps 0 async, ps 1 sync (two workers;
not shard 0, so it holds no push), ps 2 async with a 1 s lease. Raw stubs only.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from helpers import wait_until
from torchps.worker.local_cluster import LocalCluster

from torchps import codec
from torchps.proto import ps_pb2, ps_pb2_grpc

TIMEOUT = 30.0
N = 8
LONG = 600.0
OLD, NEW, NEWER = 0xA1, 0xB2, 0xC3  # incarnations


@pytest.fixture(scope="module")
def stubs():
    with LocalCluster(3, server_args=["--elastic-workers", "64"]) as local:  # the tests' names are not the spec's
        channels = [grpc.insecure_channel(address) for address in local.cluster.ps]
        stubs = [ps_pb2_grpc.ParameterServerStub(channel) for channel in channels]
        configs = [ps_pb2.SyncConfig(mode="async", lease_seconds=LONG, progress_seconds=LONG),
                   ps_pb2.SyncConfig(mode="sync", total_num_replicas=2, lease_seconds=LONG, progress_seconds=LONG,
                                     startup_grace_seconds=0.001),
                   ps_pb2.SyncConfig(mode="async", lease_seconds=1.0, progress_seconds=LONG)]
        for stub, config in zip(stubs, configs):
            assert stub.Configure(config, timeout=TIMEOUT).changed
        yield stubs
        for channel in channels:
            channel.close()


# -- helpers ------------------------------------------------------------------------------------------


def status_of(stub) -> ps_pb2.StatusResponse:
    return stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT)


def create(stub, name: str) -> None:
    value = torch.zeros(N)
    spec = ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value),
                               optimizer=ps_pb2.OptimizerSpec(name="sgd", hyperparams={"lr": 1.0}))
    requests = [ps_pb2.CreateRequest(spec=spec)] + [ps_pb2.CreateRequest(chunk=c) for c in codec.encode_chunks(name, value)]
    assert list(stub.CreateVariables(iter(requests), timeout=TIMEOUT).created) == [True]


def ref(worker: str, incarnation: int, step: int = 0) -> ps_pb2.WorkerRef:
    return ps_pb2.WorkerRef(worker=worker, incarnation=incarnation, step=step)


def header(worker: str, incarnation: int, seq: int, step: int = 0, pull=()) -> ps_pb2.PushHeader:
    return ps_pb2.PushHeader(worker=worker, incarnation=incarnation, seq=seq, step=step, step_increment=1, tensors=1,
                             pull=list(pull))


def push(stub, name: str, worker: str, incarnation: int, seq: int, value: float = 1.0,
         step: int = 0) -> ps_pb2.PushResponse:
    requests = [ps_pb2.PushRequest(header=header(worker, incarnation, seq, step))] + [
        ps_pb2.PushRequest(chunks=[c]) for c in codec.encode_chunks(name, torch.full((N,), value))]
    return stub.Push(iter(requests), timeout=TIMEOUT)


def pushpull(stub, name: str, worker: str, incarnation: int, seq: int) -> ps_pb2.PullResponse:
    request = ps_pb2.PushRequest(header=header(worker, incarnation, seq, pull=[name]),
                                 chunks=list(codec.encode_chunks(name, torch.ones(N))))
    return stub.PushPull(request, timeout=TIMEOUT)


def value_of(stub, name: str) -> torch.Tensor:
    data = b"".join(c.data for m in stub.Pull(ps_pb2.PullRequest(names=[name]), timeout=TIMEOUT) for c in m.chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.float32).clone()


def state(stub, name: str) -> dict:
    """What a fenced-off call must leave alone, once every handler on the shard has returned."""
    wait_until(lambda: (lambda s: s.calls_done >= s.calls_started - 1)(status_of(stub)), TIMEOUT,
               "every call on the shard to return (GetStatus calls_done)")
    status = status_of(stub)
    (info,) = stub.ListVariables(ps_pb2.ListRequest(names=[name]), timeout=TIMEOUT).variables
    return {"value": value_of(stub, name).tolist(), "version": info.version,
            **{key: getattr(status, key) for key in ("step", "live_workers", "quorum", "quorum_changes",
                                                     "duplicates", "stale_dropped", "waiting_calls")}}


def check_fenced(stub, name: str, call, worker: str, incarnation: int) -> None:
    before = state(stub, name)
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, f"{err.code().name}: {err.details()}"
    assert dict(err.trailing_metadata() or ()).get("torchps-error") == "WorkerReplacedError", err.trailing_metadata()
    for fragment in (worker, f"incarnation {incarnation:x}", "replaced by a newer process"):
        assert fragment in err.details(), f"details {err.details()!r} should mention {fragment!r}"
    assert state(stub, name) == before, f"a call from the replaced incarnation ({err.details()}) changed the shard"


def fenced_calls(stub, name: str, worker: str, incarnation: int, next_seq: int) -> dict:
    """Every call an old process could still make, by what it is."""
    return {
        "heartbeat": lambda: stub.Heartbeat(ref(worker, incarnation), timeout=TIMEOUT),
        "leave": lambda: stub.Leave(ref(worker, incarnation), timeout=TIMEOUT),
        "join": lambda: stub.Join(ref(worker, incarnation), timeout=TIMEOUT),
        "new push": lambda: push(stub, name, worker, incarnation, next_seq, 100.0),
        "retried push": lambda: push(stub, name, worker, incarnation, next_seq - 1, 100.0),
        "pushpull": lambda: pushpull(stub, name, worker, incarnation, next_seq + 1),
    }


# -- fencing ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["heartbeat", "leave", "join", "new push", "retried push", "pushpull"])
def test_a_replaced_incarnation_is_fenced_off_and_changes_nothing(stubs, call):
    stub = stubs[0]
    name, worker = f"fence/{call}", f"fenced/{call}"
    create(stub, name)
    stub.Join(ref(worker, OLD), timeout=TIMEOUT)
    assert push(stub, name, worker, OLD, seq=1).versions[name] == 1
    live = status_of(stub).live_workers
    stub.Join(ref(worker, NEW), timeout=TIMEOUT)  # the task restarted: a new process, a new incarnation
    assert status_of(stub).live_workers == live, "a restart is the same worker, not a new one"

    check_fenced(stub, name, fenced_calls(stub, name, worker, OLD, next_seq=2)[call], worker, OLD)

    # The successor is untouched and numbers its pushes afresh: its seq 1 is a new push, applied.
    stub.Heartbeat(ref(worker, NEW), timeout=TIMEOUT)
    reply = push(stub, name, worker, NEW, seq=1)
    assert not reply.duplicate and reply.versions[name] == 2
    assert torch.equal(value_of(stub, name), -2 * torch.ones(N))
    stub.Leave(ref(worker, NEW), timeout=TIMEOUT)
    assert status_of(stub).live_workers == live - 1, "the successor's own leave is honoured"


def test_every_replaced_incarnation_stays_fenced_off(stubs):
    """Two restarts: both older processes are fenced off, the newest works."""
    stub, name, worker = stubs[0], "fence/twice", "fenced/twice"
    create(stub, name)
    for incarnation in (OLD, NEW, NEWER):
        stub.Join(ref(worker, incarnation), timeout=TIMEOUT)
    for incarnation in (OLD, NEW):
        check_fenced(stub, name, lambda i=incarnation: push(stub, name, worker, i, 1), worker, incarnation)
        check_fenced(stub, name, lambda i=incarnation: stub.Heartbeat(ref(worker, i), timeout=TIMEOUT), worker,
                     incarnation)
    assert push(stub, name, worker, NEWER, 1).versions[name] == 1


def test_an_old_incarnation_can_neither_lower_a_sync_quorum_nor_count_in_a_step(stubs):
    stub, name = stubs[1], "fence/sync"
    create(stub, name)
    stub.Join(ref("worker:0", OLD), timeout=TIMEOUT)
    stub.Join(ref("worker:1", OLD), timeout=TIMEOUT)
    assert status_of(stub).quorum == 2
    stub.Join(ref("worker:1", NEW), timeout=TIMEOUT)  # worker 1 restarted before its lease ran out
    assert (status_of(stub).quorum, status_of(stub).live_workers) == (2, 2)

    check_fenced(stub, name, lambda: stub.Leave(ref("worker:1", OLD), timeout=TIMEOUT), "worker:1", OLD)
    check_fenced(stub, name, lambda: push(stub, name, "worker:1", OLD, 1, 100.0), "worker:1", OLD)
    check_fenced(stub, name, lambda: stub.Heartbeat(ref("worker:1", OLD), timeout=TIMEOUT), "worker:1", OLD)

    # Step 0 is made of worker 0's ones and the new incarnation's threes, nothing of the old one's hundreds.
    assert push(stub, name, "worker:0", OLD, 1, 1.0).next_step in (0, 1)
    assert status_of(stub).step == 0, "one gradient of a quorum of two completed the step"
    push(stub, name, "worker:1", NEW, 1, 3.0)
    wait_until(lambda: status_of(stub).step == 1, TIMEOUT, "step 0 to be applied (GetStatus step == 1)")
    assert torch.equal(value_of(stub, name), -2 * torch.ones(N))
    assert status_of(stub).quorum == 2


# -- exactly once ---------------------------------------------------------------------------------------------


def test_a_retried_push_is_answered_as_the_first_and_never_applied_again(stubs):
    stub, name, worker = stubs[0], "once/retry", "once:1"
    create(stub, name)
    first = push(stub, name, worker, OLD, 1)
    before = state(stub, name)
    retry = push(stub, name, worker, OLD, 1)
    assert retry.duplicate and not first.duplicate
    assert dict(retry.versions) == dict(first.versions) and retry.step == first.step
    after = state(stub, name)
    assert after == {**before, "duplicates": before["duplicates"] + 1}, "the retry was applied again"
    # A straggler of an older push (seq 1 after seq 2) is not applied either.
    assert not push(stub, name, worker, OLD, 2).duplicate
    assert push(stub, name, worker, OLD, 1).duplicate
    assert torch.equal(value_of(stub, name), -2 * torch.ones(N))
    # seq 0 asks for no dedup: the same push twice is applied twice.
    for _ in range(2):
        assert not push(stub, name, worker, OLD, 0).duplicate
    assert torch.equal(value_of(stub, name), -4 * torch.ones(N))


def test_a_retry_after_the_lease_ran_out_and_the_worker_came_back_is_still_a_duplicate(stubs):
    """The issue's first bug: cut off longer than its lease, a worker whose heartbeat gets through before its
    retried push rejoins with the same incarnation; the retry must not be applied again."""
    stub, name, worker = stubs[2], "once/after-expiry", "once:2"
    create(stub, name)
    stub.Join(ref(worker, OLD), timeout=TIMEOUT)
    assert push(stub, name, worker, OLD, 1).versions[name] == 1
    expired = status_of(stub).workers_expired
    wait_until(lambda: status_of(stub).workers_expired == expired + 1, TIMEOUT,
               f"{worker}'s 1 s lease to run out (GetStatus workers_expired)")
    assert status_of(stub).live_workers == 0
    stub.Heartbeat(ref(worker, OLD), timeout=TIMEOUT)  # back, same process
    assert status_of(stub).live_workers == 1
    kept = ("value", "version", "step", "duplicates", "stale_dropped")  # not the 1 s lease, which may run out again
    before = {key: value for key, value in state(stub, name).items() if key in kept}
    retry = push(stub, name, worker, OLD, 1)
    assert retry.duplicate and retry.versions[name] == 1
    after = {key: value for key, value in state(stub, name).items() if key in kept}
    assert after == {**before, "duplicates": before["duplicates"] + 1}, "the retry was applied again"
    assert torch.equal(value_of(stub, name), -torch.ones(N))


def test_a_retry_after_the_shard_restored_its_checkpoint_is_still_a_duplicate(tmp_path):
    """The ledger travels in the checkpoint: a shard SIGKILLed and restarted without a journal restores the
    committed checkpoint, and the retry of the push it holds is answered as a duplicate, not applied again;
    the worker's next push is applied."""
    from torchps.client import PSClient

    name, worker = "once/restored", "worker:0"
    flags = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--no-journal"]
    with LocalCluster(1, workers=1, server_args=flags) as local, PSClient(local.cluster, connect_timeout=20) as chief:
        channel = grpc.insecure_channel(local.cluster.ps[0])
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        assert stub.Configure(ps_pb2.SyncConfig(mode="async", lease_seconds=LONG, progress_seconds=LONG),
                              timeout=TIMEOUT).changed
        create(stub, name)
        stub.Join(ref(worker, OLD), timeout=TIMEOUT)
        first = push(stub, name, worker, OLD, 1)
        assert not first.duplicate and first.versions[name] == 1
        assert chief.save_checkpoint(1) == 1
        assert local.kill_ps(0) == -9
        local.start_ps(0)
        wait_until(lambda: status_of(stub).restored_step == 1, TIMEOUT, "the shard to restore the checkpoint of step 1")
        retry = push(stub, name, worker, OLD, 1)
        assert retry.duplicate and retry.versions[name] == 1, retry
        assert torch.equal(value_of(stub, name), -torch.ones(N)), "the retry was applied again after the restore"
        assert not push(stub, name, worker, OLD, 2).duplicate
        assert torch.equal(value_of(stub, name), -2 * torch.ones(N))
        channel.close()


def test_join_says_restarted_only_for_a_new_process_of_a_name_that_joined_before(stubs):
    """JoinResponse.restarted: what ps-worker reads to skip the batches an earlier process trained. A name
    joining late for the first time is not restarted (it skips nothing), however far the step has gone."""
    stub = stubs[0]
    create(stub, "restarted/w")
    assert not stub.Join(ref("worker:restarted-a", OLD), timeout=TIMEOUT).restarted
    for seq in range(1, 4):
        push(stub, "restarted/w", "worker:restarted-a", OLD, seq)
    late = stub.Join(ref("worker:restarted-b", OLD, step=3), timeout=TIMEOUT)
    assert late.step >= 3 and not late.restarted
    assert stub.Join(ref("worker:restarted-a", NEW), timeout=TIMEOUT).restarted
    assert stub.Join(ref("worker:restarted-a", NEW), timeout=TIMEOUT).restarted  # a retry says the same
    assert not stub.Join(ref("worker:restarted-b", OLD), timeout=TIMEOUT).restarted
