"""Calls that wait, against real ps-server processes: the cap on them, and how a stopping shard answers them.

A call that waits (a sync push held for its release, an ssp push held by the
staleness bound, a pull waiting for min_step, a list waiting for variables, a
save waiting for its step, a retry waiting for its original) takes one of
`--max-waiting-calls` slots; the pushes, retries and pulls wait on the
shard's event loop and hold no thread, the lists and saves hold one of
`--threads T` (at most max(1, T - max(1, T // 4)) of them). Past either
limit a waiting call is refused at once with RESOURCE_EXHAUSTED
(torchps-error ShardBusyError, which clients retry) naming it, and changes nothing, while
status, membership and plain calls are still served. A shard that stops (Shutdown, SIGTERM) answers every
waiting call UNAVAILABLE (ServerUnavailableError), never with a success.

Waits are observed through GetStatus.waiting_calls, and every handler's return
through calls_started / calls_done: nothing here is ordered by sleeping.
"""

from __future__ import annotations

import signal
import threading

import grpc
import pytest
import torch
from helpers import wait_until

from torchps import codec
from torchps.proto import ps_pb2, ps_pb2_grpc

TIMEOUT = 30.0
N = 8
LONG = 600.0  # leases and progress timeouts that never run out during a test
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


# -- helpers ---------------------------------------------------------------------------------------


def connect(local) -> tuple[grpc.Channel, ps_pb2_grpc.ParameterServerStub]:
    channel = grpc.insecure_channel(local.cluster.ps[0])
    return channel, ps_pb2_grpc.ParameterServerStub(channel)


def status_of(stub) -> ps_pb2.StatusResponse:
    return stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT)


def configure(stub, mode: str, **fields) -> None:
    config = ps_pb2.SyncConfig(mode=mode, lease_seconds=LONG, progress_seconds=LONG, **fields)
    assert stub.Configure(config, timeout=TIMEOUT).changed


def create(stub, name: str = "w") -> None:
    value = torch.zeros(N)
    spec = ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value),
                               optimizer=ps_pb2.OptimizerSpec(name="sgd", hyperparams={"lr": 1.0}))
    requests = [ps_pb2.CreateRequest(spec=spec)] + [ps_pb2.CreateRequest(chunk=c) for c in codec.encode_chunks(name, value)]
    assert list(stub.CreateVariables(iter(requests), timeout=TIMEOUT).created) == [True]


def join(stub, worker: str) -> None:
    stub.Join(ps_pb2.WorkerRef(worker=worker, incarnation=1), timeout=TIMEOUT)


def push_header(worker: str, step: int, seq: int, tensors: int, pull=()) -> ps_pb2.PushHeader:
    return ps_pb2.PushHeader(worker=worker, step=step, step_increment=1, incarnation=1, seq=seq, tensors=tensors,
                             pull=list(pull))


def _chunks(value: float | None, name: str) -> list[ps_pb2.TensorChunk]:
    return [] if value is None else list(codec.encode_chunks(name, torch.full((N,), value)))


def _push_requests(worker: str, value: float | None = 1.0, *, step: int = 0, seq: int = 1, name: str = "w"):
    chunks = _chunks(value, name)
    return [ps_pb2.PushRequest(header=push_header(worker, step, seq, len(chunks)))] + [
        ps_pb2.PushRequest(chunks=[c]) for c in chunks]


def push(stub, worker: str, value: float | None = 1.0, *, step: int = 0, seq: int = 1, name: str = "w"):
    """A push of `value`s to `name`; value None: a header-only push (a contribution of no gradient)."""
    return stub.Push(iter(_push_requests(worker, value, step=step, seq=seq, name=name)), timeout=TIMEOUT)


def pushpull(stub, worker: str, value: float | None = 1.0, *, step: int = 0, seq: int = 1, name: str = "w"):
    chunks = _chunks(value, name)
    request = ps_pb2.PushRequest(header=push_header(worker, step, seq, len(chunks), pull=[name] if chunks else []),
                                 chunks=chunks)
    return stub.PushPull(request, timeout=TIMEOUT)


def pull_min_step(stub, min_step: int, name: str | None = "w"):
    """The Pull call object (started at once; iterate it for the values, cancel() it to end it); name None:
    every variable (a shard that holds none)."""
    return stub.Pull(ps_pb2.PullRequest(names=[name] if name else [], min_step=min_step), timeout=TIMEOUT)


def list_wait(stub, seconds: float = 20.0):
    return stub.ListVariables(ps_pb2.ListRequest(names=["never/created"], wait_seconds=seconds), timeout=TIMEOUT)


def value_of(stub, name: str = "w") -> torch.Tensor:
    data = b"".join(c.data for m in stub.Pull(ps_pb2.PullRequest(names=[name]), timeout=TIMEOUT) for c in m.chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.float32).clone()


class Outcome:
    """A blocking call run in a thread: its reply or its grpc.RpcError."""

    def __init__(self, call, what: str):
        self.what = what
        self.value = self.error = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(call,), daemon=True).start()

    def _run(self, call) -> None:
        try:
            self.value = call()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def error_of(self) -> grpc.RpcError:
        assert self._done.wait(TIMEOUT), f"{self.what} never ended"
        assert self.error is not None, f"{self.what} succeeded ({self.value!r}) where it should have failed"
        return self.error

    def result(self):
        assert self._done.wait(TIMEOUT), f"{self.what} never ended"
        assert self.error is None, f"{self.what} failed: {self.error.code().name}: {self.error.details()}"
        return self.value


def wait_waiting(stub, count: int, what: str) -> None:
    wait_until(lambda: status_of(stub).waiting_calls == count, TIMEOUT, f"{what} (GetStatus waiting_calls == {count})")


def quiet(stub) -> ps_pb2.StatusResponse:
    """Status once every handler the shard entered has returned or is waiting (the polling GetStatus aside)."""
    return wait_until(lambda: (lambda s: s if s.calls_done + s.waiting_calls >= s.calls_started - 1 else None)(
        status_of(stub)), TIMEOUT, "every call on the shard to return or wait (GetStatus calls_done, waiting_calls)")


def state(stub) -> dict:
    """What a refused call must leave alone."""
    status = quiet(stub)
    listing = stub.ListVariables(ps_pb2.ListRequest(), timeout=TIMEOUT)
    return {"versions": {i.spec.name: i.version for i in listing.variables}, "value": value_of(stub).tolist(),
            **{key: getattr(status, key) for key in ("step", "live_workers", "quorum", "waiting_calls", "duplicates",
                                                     "stale_dropped", "num_variables")}}


def assert_error(err: grpc.RpcError, code: grpc.StatusCode, error_class: str, *fragments: str) -> None:
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    trailing = dict(err.trailing_metadata() or ())
    assert trailing.get("torchps-error") == error_class, f"trailing metadata {trailing!r} ({err.details()})"
    for fragment in fragments:
        assert fragment in (err.details() or ""), f"details {err.details()!r} should mention {fragment!r}"


def check_refused(stub, call, limit: int, kind: str) -> None:
    """The waiting `call` is refused at once, RESOURCE_EXHAUSTED naming the limit, and changes nothing."""
    before = state(stub)
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert_error(info.value, EXHAUSTED, "ShardBusyError", f"--max-waiting-calls {limit}",
                 f"the {kind} call was refused")
    assert quiet(stub).waiting_calls == limit, "the refused call is waiting after all"
    assert state(stub) == before, f"a refused {kind} call changed the shard"


# -- the cap -------------------------------------------------------------------------------------------------


def test_waits_hold_no_thread_a_sync_quorum_above_the_threads_completes(local_cluster):
    """--threads 2: a sync step of 8 workers completes (before the asyncio edge no more than one push could wait
    for it): 7 pushes wait for its release and 4 pulls for its step, holding no thread, while status, joins,
    heartbeats and plain reads go on. A held push whose client goes away frees its slot, and its retry is held
    again as a duplicate, counted once. A wait that holds a thread (a wait for names) may take one of the 2
    (three quarters, at least 1); a second is refused, naming --threads."""
    local = local_cluster(1, server_args=["--threads", "2"])
    channel, stub = connect(local)
    with channel:
        workers = [f"worker:{i}" for i in range(8)]
        configure(stub, "sync", total_num_replicas=8)
        create(stub)
        for worker in workers:
            join(stub, worker)
        vanishing = stub.Push.future(iter(_push_requests(workers[6])), timeout=TIMEOUT)
        wait_waiting(stub, 1, "worker:6's push held for step 0's release")
        assert vanishing.cancel()
        wait_waiting(stub, 0, "the cancelled push to free its slot")
        held = [Outcome(lambda w=w: push(stub, w), f"{w}'s push held for step 0's release") for w in workers[:7]]
        pulls = [Outcome(lambda: list(pull_min_step(stub, 1)), f"pull {i} waiting for step 1") for i in range(4)]
        wait_waiting(stub, 11, "7 pushes (worker:6's retry among them) held and 4 pulls waiting for step 1")

        listing = stub.ListVariables.future(ps_pb2.ListRequest(names=["never/created"], wait_seconds=20.0),
                                            timeout=TIMEOUT)
        wait_waiting(stub, 12, "a wait for a variable holding one of the 2 threads")
        with pytest.raises(grpc.RpcError) as info:
            list_wait(stub)
        assert_error(info.value, EXHAUSTED, "ShardBusyError", "three quarters of ps-server --threads",
                     "the list call was refused")
        status = status_of(stub)  # the thread left serves everything that does not wait
        assert (status.waiting_calls, status.step, status.live_workers, status.quorum) == (12, 0, 8, 8)
        stub.Heartbeat(ps_pb2.WorkerRef(worker="worker:0", incarnation=1), timeout=TIMEOUT)
        assert torch.equal(value_of(stub), torch.zeros(N))
        assert not any(outcome.done for outcome in held + pulls), "a wait ended before step 0 was complete"

        last = push(stub, workers[7])  # completes step 0: every held push and waiting pull goes on
        assert last.next_step == 1
        assert [outcome.result().next_step for outcome in held] == [1] * 7
        assert [outcome.result().duplicate for outcome in held] == [False] * 6 + [True]
        for outcome in pulls:
            assert outcome.result()[0].step == 1
        assert torch.equal(value_of(stub), -torch.ones(N))  # the average of 8 ones, applied once
        assert listing.cancel()
        wait_waiting(stub, 0, "the cancelled wait for a variable to stop waiting")


def test_max_waiting_calls_refuses_every_kind_of_wait_before_it_changes_anything(local_cluster, tmp_path):
    local = local_cluster(1, server_args=["--max-waiting-calls", "1", "--checkpoint-dir", str(tmp_path),
                                          "--no-journal"])
    channel, stub = connect(local)
    with channel:
        configure(stub, "sync", total_num_replicas=2)
        create(stub)
        join(stub, "worker:0"), join(stub, "worker:1")
        occupying = pull_min_step(stub, 5)
        occupant = Outcome(lambda: list(occupying), "the pull holding the only slot")
        wait_waiting(stub, 1, "a pull waiting for step 5")

        check_refused(stub, lambda: list(pull_min_step(stub, 5)), 1, "pull")
        check_refused(stub, lambda: list_wait(stub), 1, "list")
        check_refused(stub, lambda: stub.Save(ps_pb2.SaveRequest(step=3), timeout=TIMEOUT), 1, "save")
        check_refused(stub, lambda: push(stub, "worker:0", 1.0, seq=1), 1, "release")
        check_refused(stub, lambda: pushpull(stub, "worker:1", 3.0, seq=1), 1, "release")
        assert not list(tmp_path.glob("step-*")), "the refused save wrote a checkpoint"

        assert occupying.cancel()
        assert occupant.error_of().code() == grpc.StatusCode.CANCELLED
        wait_waiting(stub, 0, "the cancelled pull to stop waiting")
        # worker:0's push (the same seq as its refused one) is new: it takes the slot, held for step 0's
        # release; its retry would wait for it too, and is refused.
        held = Outcome(lambda: push(stub, "worker:0", 1.0, seq=1), "worker:0's push held for step 0's release")
        wait_waiting(stub, 1, "worker:0's push to be held")
        check_refused(stub, lambda: push(stub, "worker:0", 1.0, seq=1), 1, "release")
        # With worker:1 gone the quorum is 1: worker:0's gradient alone makes step 0. Nothing of the refused
        # pushes was counted or recorded.
        stub.Leave(ps_pb2.WorkerRef(worker="worker:1", incarnation=1), timeout=TIMEOUT)
        reply = held.result()
        assert not reply.duplicate and not reply.stale and reply.next_step == 1
        assert torch.equal(value_of(stub), -torch.ones(N)), "worker:1's refused PushPull (3s) was counted"
        status = status_of(stub)
        assert (status.step, status.duplicates, status.stale_dropped, status.waiting_calls) == (1, 0, 0, 0)
        saved = stub.Save(ps_pb2.SaveRequest(step=1), timeout=TIMEOUT)  # with its slot free, a save goes through
        assert saved.step == 1 and saved.bytes > 0


def test_the_push_that_completes_a_sync_step_is_not_refused_by_the_limit(local_cluster):
    local = local_cluster(1, server_args=["--max-waiting-calls", "1"])
    channel, stub = connect(local)
    with channel:
        configure(stub, "sync", total_num_replicas=2)  # no variables: header-only pushes still make up a step
        join(stub, "worker:0"), join(stub, "worker:1")
        held = Outcome(lambda: push(stub, "worker:0", None), "worker:0's held push")
        wait_waiting(stub, 1, "worker:0's push to be held for step 0's release")
        try:
            last = push(stub, "worker:1", None)  # completes step 0: nothing is left to wait for
        except grpc.RpcError as exc:
            pytest.fail(f"the push completing step 0 was refused: {exc.code().name}: {exc.details()}")
        assert last.next_step == 1 and held.result().next_step == 1
        assert status_of(stub).step == 1


# -- a stopping shard ----------------------------------------------------------------------------------------


def _assert_stopping(outcomes: list[Outcome]) -> None:
    for outcome in outcomes:
        err = outcome.error_of()
        assert_error(err, UNAVAILABLE, "ServerUnavailableError", "stopping")


def test_shutdown_answers_every_waiting_call_unavailable_never_with_a_success(local_cluster, tmp_path):
    local = local_cluster(1, server_args=["--checkpoint-dir", str(tmp_path), "--no-journal"])
    channel, stub = connect(local)
    with channel:
        configure(stub, "sync", total_num_replicas=3)  # no variables (a fresh shard's first costs seconds)
        for i in range(3):
            join(stub, f"worker:{i}")
        received: list = []
        outcomes = [
            Outcome(lambda: received.extend(pull_min_step(stub, 5, None)), "a pull waiting for step 5"),
            Outcome(lambda: push(stub, "worker:0", None), "worker:0's push held for step 0's release"),
            Outcome(lambda: pushpull(stub, "worker:1", None), "worker:1's PushPull held for step 0's release"),
            Outcome(lambda: stub.Save(ps_pb2.SaveRequest(step=4), timeout=TIMEOUT), "a save waiting for step 4"),
        ]
        wait_waiting(stub, 4, "a pull, a push, a PushPull and a save to wait")
        stub.Shutdown(ps_pb2.ShutdownRequest(reason="the test"), timeout=TIMEOUT)
        _assert_stopping(outcomes)
        assert received == [], "the waiting pull streamed values from before its min_step"
        assert local.procs[0].wait(TIMEOUT) == 0
        assert not list(tmp_path.glob("step-*")), "the waiting save wrote a checkpoint while stopping"


def test_sigterm_answers_waiting_calls_unavailable(local_cluster, tmp_path):
    local = local_cluster(1, server_args=["--checkpoint-dir", str(tmp_path), "--no-journal"])
    channel, stub = connect(local)
    with channel:
        configure(stub, "ssp", total_num_replicas=2, max_staleness=0)  # no variables: header-only pushes
        join(stub, "worker:0"), join(stub, "worker:1")
        outcomes = [
            Outcome(lambda: push(stub, "worker:0", None), "worker:0's push held by the staleness bound"),
            Outcome(lambda: list(pull_min_step(stub, 5, None)), "a pull waiting for step 5"),
            Outcome(lambda: stub.Save(ps_pb2.SaveRequest(step=5), timeout=TIMEOUT), "a save waiting for step 5"),
        ]
        wait_waiting(stub, 3, "an ssp push, a pull and a save to wait")
        local.procs[0].send_signal(signal.SIGTERM)
        _assert_stopping(outcomes)
        assert local.procs[0].wait(TIMEOUT) == 0


def test_shutdown_answers_a_list_waiting_for_variables_unavailable(local_cluster):
    local = local_cluster(1)
    channel, stub = connect(local)
    with channel:
        waiting = Outcome(lambda: list_wait(stub), "a list waiting for a variable nobody creates")
        wait_waiting(stub, 1, "the list to wait")
        stub.Shutdown(ps_pb2.ShutdownRequest(reason="the test"), timeout=TIMEOUT)
        _assert_stopping([waiting])
        assert local.procs[0].wait(TIMEOUT) == 0
