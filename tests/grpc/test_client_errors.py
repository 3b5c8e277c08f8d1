"""Errors as PSClient users see them: torchps exceptions that say what to do, never grpc.RpcError.

Also the client's patience: an unreachable shard fails after connect_timeout
naming its address, a shard that starts late is waited for, and workers
waiting for the chief's variables time out clearly or go on once they exist.
A call a stopping shard answered CANCELLED (gRPC's answer to a call no
handler took yet, as a struck primary started again steps down to be its
successor's backup) is sent again, one the client cancelled is not; and a
failover watch asking where a shard is served after its client closed gets
no answer, where once the process crashed (SIGSEGV).
"""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from helpers import free_port, start_ps_server, wait_until
from torchps.client.channels import ShardChannels
from torchps.client.membership import Heartbeats
from torchps.proto import ps_pb2
from torchps.client import (Cluster, NonFiniteGradientError, Optimizer, OptimizerSpecError, PSClient, PSError,
                            ServerUnavailableError, SpecConflictError, TaskSpec, TensorMismatchError,
                            UnknownVariableError, WaitTimeoutError)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SLOW_CALL = 30.0  # loose upper bound in seconds for anything that "waits about the timeout" on a loaded machine


@contextlib.contextmanager
def raises_ps(error_class: type[PSError], *fragments: str):
    """Like pytest.raises, also asserting the error is a PSError (not grpc.RpcError) whose message has `fragments`."""
    with pytest.raises(Exception) as info:  # noqa: PT011 - checked precisely below
        yield info
    exc = info.value
    assert not isinstance(exc, grpc.RpcError), f"grpc.RpcError reached the user: {exc!r}"
    assert isinstance(exc, error_class), f"expected {error_class.__name__}, got {type(exc).__name__}: {exc}"
    assert isinstance(exc, PSError)
    for fragment in fragments:
        assert fragment in str(exc), f"{str(exc)!r} should mention {fragment!r}"


def sgd() -> Optimizer:
    return Optimizer("sgd", lr=1.0)


# -- server-side errors through the public API ----------------------------------------------


def test_pull_of_name_never_declared(client):
    with raises_ps(UnknownVariableError, "'ce/never'", "register"):
        client.pull(["ce/never"])


def test_pull_and_push_of_variable_never_created(client):
    client.declare({"ce/ghost": torch.zeros(3)})
    with raises_ps(UnknownVariableError, "'ce/ghost'", "create it first"):
        client.pull(["ce/ghost"])
    with raises_ps(UnknownVariableError, "'ce/ghost'"):
        client.push({"ce/ghost": torch.ones(3)})


@pytest.mark.parametrize("grad, error_class, fragments", [
    pytest.param(torch.ones(2, 3), TensorMismatchError, ["float32[2, 3]", "float32[6]"], id="shape"),
    pytest.param(torch.ones(6, dtype=torch.float64), TensorMismatchError, ["float64[6]", "float32[6]"], id="dtype"),
    pytest.param(torch.tensor([1.0, float("nan"), 1, 1, 1, 1]), NonFiniteGradientError,
                 ["NaN or Inf", "nothing was applied", "--allow-nonfinite"], id="nan"),
    pytest.param(torch.tensor([1.0, 1, 1, 1, 1, float("inf")]), NonFiniteGradientError, ["NaN or Inf"], id="inf"),
])
def test_bad_push_raises_and_changes_nothing(client, request, grad, error_class, fragments):
    name = f"ce/push-{request.node.callspec.id}"
    client.create_variables({name: torch.arange(6, dtype=torch.float32)}, sgd())
    step = client.global_step()
    with raises_ps(error_class, repr(name), *fragments):
        client.push({name: grad})
    assert torch.equal(client.pull([name])[name], torch.arange(6, dtype=torch.float32))
    assert client.global_step() == step


def test_create_with_another_spec_shows_both(client):
    client.create_variables({"ce/spec": torch.zeros(4)}, sgd())
    assert client.create_variables({"ce/spec": torch.ones(4)}, sgd()) == {"ce/spec": False}
    with raises_ps(SpecConflictError, "'ce/spec'", "float32[4]", "float32[5]", "Use another name"):
        client.create_variables({"ce/spec": torch.zeros(5)}, sgd())
    with raises_ps(SpecConflictError, "lr=1", "lr=0.5"):
        client.create_variables({"ce/spec": torch.zeros(4)}, Optimizer("sgd", lr=0.5))
    assert torch.equal(client.pull(["ce/spec"])["ce/spec"], torch.zeros(4))


def test_unknown_optimizer_and_hyperparameter(client):
    with raises_ps(OptimizerSpecError, "'rmsprop'", "available"):
        client.create_variables({"ce/opt": torch.zeros(2)}, Optimizer("rmsprop", lr=0.1))
    with raises_ps(OptimizerSpecError, "betaz", "allowed"):
        client.create_variables({"ce/opt": torch.zeros(2)}, Optimizer("sgd", lr=0.1, betaz=0.5))
    client.create_variables({"ce/opt": torch.zeros(2)}, sgd())
    with raises_ps(OptimizerSpecError, "betaz", "allowed"):
        client.set_hyperparams(["ce/opt"], betaz=0.5)


def test_pull_into_wrong_local_tensor(client):
    client.create_variables({"ce/into": torch.zeros(4)}, sgd())
    with raises_ps(TensorMismatchError, "'ce/into'", "float32[4]", "float32[2, 2]"):
        client.pull_into({"ce/into": torch.empty(2, 2)})


# -- reachability ----------------------------------------------------------------------------


def test_unreachable_shard_raises_server_unavailable_naming_it():
    address = f"127.0.0.1:{free_port()}"
    with PSClient(Cluster(ps=(address,)), connect_timeout=2) as ps:
        for call in (lambda: ps.create_variables({"w": torch.zeros(2)}, sgd()),
                     lambda: ps.push({"w": torch.ones(2)})):
            start = time.monotonic()
            with raises_ps(ServerUnavailableError, address, "ps-server"):
                call()
            elapsed = time.monotonic() - start
            assert 1.0 <= elapsed < SLOW_CALL, f"raised after {elapsed:.1f} s with connect_timeout=2"


def test_shard_that_starts_late_is_waited_for(tmp_path):
    port = free_port()
    procs = []
    delay = 2.0

    def start_late():
        time.sleep(delay)
        procs.append(start_ps_server(["--index", "0", "--bind", f"127.0.0.1:{port}", "--insecure"],
                                     tmp_path / "late-ps.log"))

    starter = threading.Thread(target=start_late)
    try:
        with PSClient(Cluster(ps=(f"127.0.0.1:{port}",)), connect_timeout=60) as ps:
            start = time.monotonic()
            starter.start()
            assert ps.create_variables({"late/w": torch.arange(4.0)}, sgd()) == {"late/w": True}
            assert time.monotonic() - start >= delay
            assert torch.equal(ps.pull(["late/w"])["late/w"], torch.arange(4.0))
    finally:
        starter.join()
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- waiting for the chief -------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))


def test_non_chief_wait_times_out_naming_missing_variable(shared_cluster):
    with PSClient(shared_cluster.cluster, task=TaskSpec("worker", 1), connect_timeout=10) as worker:
        assert not worker.is_chief
        start = time.monotonic()
        with raises_ps(WaitTimeoutError, "'wt/0.weight'", "chief"):
            worker.register_module(_model(), sgd(), prefix="wt/", wait_timeout=1.0, join=False)
        assert time.monotonic() - start < SLOW_CALL
        worker.declare({"wt/extra": torch.zeros(1)})
        with raises_ps(WaitTimeoutError, "'wt/extra'"):
            worker.wait_for_variables(["wt/extra"], timeout=0.5)


def test_non_chief_wait_succeeds_once_chief_creates(shared_cluster):
    cluster = shared_cluster.cluster
    results: dict[str, object] = {}

    def worker_side():
        try:
            with PSClient(cluster, task=TaskSpec("worker", 1), connect_timeout=10) as worker:
                module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))  # other initial values
                worker.register_module(module, sgd(), prefix="ws/", wait_timeout=SLOW_CALL, join=False)
                results["values"] = [p.detach().clone() for p in module.parameters()]
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            results["error"] = exc

    waiter = threading.Thread(target=worker_side)
    start = time.monotonic()
    with PSClient(cluster, task=TaskSpec("worker", 0), connect_timeout=10) as chief:
        before = sum(chief.status(s).waiting_calls for s in (0, 1))
        waiter.start()
        wait_until(lambda: sum(chief.status(s).waiting_calls for s in (0, 1)) > before or not waiter.is_alive(),
                   SLOW_CALL, "the worker to wait on a shard for the chief's variables")
        assert waiter.is_alive(), f"the worker did not wait: {results}"
        model = _model()
        chief.register_module(model, sgd(), create=True, prefix="ws/", join=False)
    waiter.join(SLOW_CALL + 10)
    assert not waiter.is_alive()
    assert "error" not in results, results.get("error")
    assert time.monotonic() - start < SLOW_CALL
    for got, want in zip(results["values"], model.parameters()):
        assert torch.equal(got, want.detach())


def test_many_waiting_workers_do_not_starve_the_chief(local_cluster):
    """Workers blocked waiting for variables must not take every RPC thread the chief's create needs."""
    local = local_cluster(1, server_args=["--threads", "2"])
    names = {"starve/w": torch.arange(3.0)}
    errors: list[BaseException] = []

    def wait():
        try:
            with PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=10) as worker:
                worker.declare(names)
                worker.wait_for_variables(names, timeout=12)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    waiters = [threading.Thread(target=wait) for _ in range(3)]
    with PSClient(local.cluster, connect_timeout=10) as chief:
        for thread in waiters:
            thread.start()
        wait_until(lambda: chief.status(0).waiting_calls >= 1, SLOW_CALL, "a worker to wait on the shard")
        created: dict = {}
        creator = threading.Thread(target=lambda: created.update(chief.create_variables(names, sgd())))
        start = time.monotonic()
        creator.start()
        creator.join(6)
        finished = not creator.is_alive()
        creator.join(60)
        for thread in waiters:
            thread.join(60)
    assert finished, (f"create_variables was still blocked after 6 s (it took {time.monotonic() - start:.1f} s): "
                      f"the waiting workers hold every RPC thread of the shard")
    assert created == {"starve/w": True}
    assert not errors, errors


def test_a_call_whose_channel_a_redirect_closed_is_sent_again_to_the_new_address(local_cluster):
    """A failover's redirect closes the old channel (client/failover_watch.py): a call that took the old stub just
    before is sent again on the new one, not failed with gRPC's 'closed channel' ValueError."""
    from torchps.client.channels import ShardChannels
    from torchps.proto import ps_pb2

    local = local_cluster(2)
    channels = ShardChannels([local.address(0), local.address(1)], connect_timeout=30)
    attempts = []

    def status(stub, timeout):
        attempts.append(stub)
        if len(attempts) == 1:
            assert channels.redirect(0, local.address(1))  # closes the channel this stub calls through
        return stub.GetStatus(ps_pb2.StatusRequest(), timeout=timeout)

    try:
        reply = channels.call(0, status, 10)
        assert len(attempts) == 2 and attempts[0] is not attempts[1] and reply.index == 1
    finally:
        channels.close()


class _StopsOnce(grpc.GenericRpcHandler):
    """A shard's GetLayout answered as a server that stopped before a handler took the call answers it
    (CANCELLED "CANCELLED", no torchps error: grpc/grpc#41785) the first time, then epoch 7; its Pull answered
    only once `released` is set."""

    def __init__(self):
        self.calls = 0
        self.released = threading.Event()

    def service(self, handler_call_details):
        method = handler_call_details.method.rpartition("/")[2]
        if method == "Pull":
            return grpc.unary_stream_rpc_method_handler(self._pull)
        if method != "GetLayout":
            return None  # the client's readiness probe (GetStatus): UNIMPLEMENTED, an answer
        return grpc.unary_unary_rpc_method_handler(self._layout, request_deserializer=ps_pb2.LayoutRequest.FromString,
                                                   response_serializer=ps_pb2.Layout.SerializeToString)

    def _pull(self, request, context):
        self.released.wait(30)
        return iter(())

    def _layout(self, request, context):
        self.calls += 1
        if self.calls == 1:
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        return ps_pb2.Layout(epoch=7)


def test_a_call_a_stopping_shard_answered_cancelled_is_sent_again_one_the_client_cancelled_is_not():
    shard = _StopsOnce()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[shard])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channels = ShardChannels([f"127.0.0.1:{port}"], connect_timeout=10)
    try:
        layout = channels.call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t), 10)
        assert (layout.epoch, shard.calls) == (7, 2), "the call the stopping server cancelled was sent again"
        attempts = []

        def cancelled_here(stub, t):  # the client's own cancel (a pull replaced by a newer one): never sent again
            attempts.append(stub.Pull(ps_pb2.PullRequest(), timeout=t))
            attempts[-1].cancel()
            return list(attempts[-1])

        with pytest.raises(PSError, match="CANCELLED"):
            channels.call(0, cancelled_here, 10)
        assert len(attempts) == 1
    finally:
        shard.released.set()
        channels.close()
        server.stop(None)


RELOCATE_AFTER_CLOSE = """
from torchps.client.channels import ShardChannels
from torchps.client.membership import Heartbeats
from torchps.security import Security

channels = ShardChannels(["127.0.0.1:1", "127.0.0.1:2"], connect_timeout=1, security=Security(token="t"))
channels.close()
print("relocated:", channels.relocate(1))  # as a failover watch's poller does once its client closed
"""


def test_a_failover_watch_asking_after_its_client_closed_gets_no_answer_and_no_crash():
    run = subprocess.run([sys.executable, "-c", RELOCATE_AFTER_CLOSE], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert (run.returncode, run.stdout.strip()) == (0, "relocated: False"), run.stderr[-3000:]


def test_a_heartbeat_whose_channel_closed_under_it_skips_that_shard_and_raises_nothing():
    """The heartbeat thread's beat races a redirect or the client's close: a closed channel's stub raises
    ValueError, which once ended the thread (the worker's leases then lapsed)."""
    channels = ShardChannels(["127.0.0.1:1", "127.0.0.1:2"], connect_timeout=1)
    replies = []
    beats = Heartbeats(channels, ps_pb2.WorkerRef, lambda *reply: replies.append(reply))
    channels.close()
    beats.beat(0.1)
    assert replies == [] and beats.fenced is None
