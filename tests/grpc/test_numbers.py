"""Numbers a client sends, checked by a real ps-server before they change anything.

Every number in a request is validated at the shard: steps (push, join and
heartbeat steps, min_step, a refill's and a checkpoint's step) in [0, 2^62],
step increments in {0, 1}, a sync step at most one past the shard's open step,
list waits finite and >= 0, chunk sizes at least the minimum, mode settings
(leases, grace, progress timeout, replicas, staleness) finite and in range,
and optimizer hyperparameters finite, flags 0 or 1, and accepted by torch.optim
itself, both when a variable is created and when a schedule changes them.
A bad one gets INVALID_ARGUMENT (torchps-error InvalidArgumentError, or
OptimizerSpecError for hyperparameters) with a message naming it, and leaves
the shard exactly as it was: variables, versions, values, step, mode,
membership and counters.

One two-shard cluster serves the module: ps 0 runs async, ps 1 sync (two
workers); each case uses names of its own, so a bad call that wrongly took
effect shows as a new member, a new version or a moved step. Raw stubs only.
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

TIMEOUT = 30.0
MAX_STEP = 1 << 62
MIN = codec.MIN_CHUNK_BYTES
INVALID = grpc.StatusCode.INVALID_ARGUMENT
N = 8  # float32 elements of the test variables
LONG = 600.0  # lease and progress timeout: no member of these shards expires or stalls during the module
ASYNC = ps_pb2.SyncConfig(mode="async", lease_seconds=LONG, progress_seconds=LONG)
SYNC = ps_pb2.SyncConfig(mode="sync", total_num_replicas=2, lease_seconds=LONG, progress_seconds=LONG,
                         startup_grace_seconds=0.001)


@pytest.fixture(scope="module")
def stubs():
    """[ps 0 (async), ps 1 (sync, N=2)] of the module's own cluster."""
    with LocalCluster(2) as local:
        channels = [grpc.insecure_channel(address) for address in local.cluster.ps]
        stubs = [ps_pb2_grpc.ParameterServerStub(channel) for channel in channels]
        assert stubs[0].Configure(ASYNC, timeout=TIMEOUT).changed
        assert stubs[1].Configure(SYNC, timeout=TIMEOUT).changed
        # The sync shard's grace (1 ms) is over at once, but its quorum drops to what its live workers give
        # (none: 1) at the reaper's next look: let that happen first, or a test could see it as its change.
        wait_until(lambda: status_of(stubs[1]).quorum == 1, 30, "the sync shard's quorum after its grace")
        yield stubs
        for channel in channels:
            channel.close()


# -- helpers -------------------------------------------------------------------------------------


def status_of(stub) -> ps_pb2.StatusResponse:
    return stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT)


def create_requests(name: str, value: torch.Tensor, optimizer: str = "sgd", step: int = 0,
                    **hyper) -> list[ps_pb2.CreateRequest]:
    spec = ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value),
                               optimizer=ps_pb2.OptimizerSpec(name=optimizer, hyperparams=hyper))
    return [ps_pb2.CreateRequest(spec=spec, step=step)] + [
        ps_pb2.CreateRequest(chunk=c) for c in codec.encode_chunks(name, value, MIN)]


def create(stub, name: str, optimizer: str = "sgd", step: int = 0, **hyper) -> ps_pb2.CreateResponse:
    return stub.CreateVariables(iter(create_requests(name, torch.zeros(N), optimizer, step, **hyper)),
                                timeout=TIMEOUT)


def push_requests(worker: str, name: str, grad: torch.Tensor, *, step: int = 0, step_increment: int = 1,
                  seq: int = 0) -> list[ps_pb2.PushRequest]:
    head = ps_pb2.PushHeader(worker=worker, step=step, step_increment=step_increment, incarnation=1, seq=seq,
                             tensors=1)
    return [ps_pb2.PushRequest(header=head)] + [ps_pb2.PushRequest(chunks=[c])
                                                for c in codec.encode_chunks(name, grad, MIN)]


def push(stub, worker: str, name: str, grad: torch.Tensor | None = None, **kwargs) -> ps_pb2.PushResponse:
    grad = torch.ones(N) if grad is None else grad
    return stub.Push(iter(push_requests(worker, name, grad, **kwargs)), timeout=TIMEOUT)


def pushpull(stub, worker: str, name: str, *, step: int = 0, step_increment: int = 1) -> ps_pb2.PullResponse:
    request = ps_pb2.PushRequest(
        header=ps_pb2.PushHeader(worker=worker, step=step, step_increment=step_increment, incarnation=1,
                                 pull=[name]),
        chunks=list(codec.encode_chunks(name, torch.ones(N), MIN)))
    return stub.PushPull(request, timeout=TIMEOUT)


def value_of(stub, name: str) -> torch.Tensor:
    data = b"".join(c.data for m in stub.Pull(ps_pb2.PullRequest(names=[name]), timeout=TIMEOUT) for c in m.chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.float32).clone()


def join(stub, worker: str, step: int = 0) -> ps_pb2.JoinResponse:
    return stub.Join(ps_pb2.WorkerRef(worker=worker, incarnation=1, step=step), timeout=TIMEOUT)


def heartbeat(stub, worker: str, step: int = 0) -> ps_pb2.HeartbeatResponse:
    return stub.Heartbeat(ps_pb2.WorkerRef(worker=worker, incarnation=1, step=step), timeout=TIMEOUT)


def state(stub, names=()) -> dict:
    """What a refused call must leave alone, read once every handler on the shard has returned."""
    wait_until(lambda: (lambda s: s.calls_done >= s.calls_started - 1)(status_of(stub)), TIMEOUT,
               "every call on the shard to return (GetStatus calls_done)")
    listing = stub.ListVariables(ps_pb2.ListRequest(), timeout=TIMEOUT)
    status = status_of(stub)
    return {
        "variables": {i.spec.name: (i.version, i.spec.SerializeToString(deterministic=True)) for i in listing.variables},
        "values": {name: value_of(stub, name).tolist() for name in names},
        "step": status.step,
        "config": status.config.SerializeToString(deterministic=True),
        **{key: getattr(status, key) for key in ("live_workers", "quorum", "quorum_changes", "workers_expired",
                                                 "workers_stalled", "stale_dropped", "duplicates", "waiting_calls")},
    }


def assert_same(before: dict, after: dict, what: str) -> None:
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    assert not changed, f"{what} changed the shard: {changed}"


def check_invalid(stub, call, error_class: str, *fragments: str, names=()) -> grpc.RpcError:
    """Runs the bad `call`: INVALID_ARGUMENT, torchps-error `error_class`, details naming `fragments`, and the
    shard exactly as before once the call's handler has returned."""
    before = state(stub, names)
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert err.code() == INVALID, f"expected INVALID_ARGUMENT, got {err.code().name}: {err.details()}"
    trailing = dict(err.trailing_metadata() or ())
    assert trailing.get("torchps-error") == error_class, f"trailing metadata {trailing!r} ({err.details()})"
    for fragment in fragments:
        assert fragment in (err.details() or ""), f"details {err.details()!r} should mention {fragment!r}"
    assert_same(before, state(stub, names), f"a call refused with {err.details()!r}")
    return err


@pytest.fixture
def var(stubs, request) -> str:
    """A fresh float32[N] zeros variable (sgd, lr=1) on ps 0, named after the test."""
    name = "n/" + request.node.name
    assert list(create(stubs[0], name, lr=1.0).created) == [True]
    return name


# -- steps and step increments (ps 0, async) ---------------------------------------------------------------

PUSH_HEADERS = {  # case -> (push keyword arguments, fragments)
    "step-minus-1": (dict(step=-1), ["push step", f"[0, {MAX_STEP}]", "Received: -1"]),
    "step-2^62+1": (dict(step=MAX_STEP + 1), ["push step", f"Received: {MAX_STEP + 1}"]),
    "step-int64-max": (dict(step=(1 << 63) - 1), ["push step", f"Received: {(1 << 63) - 1}"]),
    "step-int64-min": (dict(step=-(1 << 63)), ["push step", f"Received: {-(1 << 63)}"]),
    "step-increment-2": (dict(step_increment=2), ["step_increment must be 0 or 1", "Received: 2"]),
    "step-increment-minus-1": (dict(step_increment=-1), ["step_increment", "Received: -1"]),
    "step-increment-minus-1000": (dict(step_increment=-1000), ["step_increment", "Received: -1000"]),
    "step-increment-2^62": (dict(step_increment=MAX_STEP), ["step_increment", f"Received: {MAX_STEP}"]),
}


@pytest.mark.parametrize("case", list(PUSH_HEADERS))
def test_push_header_numbers_out_of_range(stubs, var, case):
    kwargs, fragments = PUSH_HEADERS[case]
    worker = f"pusher/{case}"  # a new name: a push that wrongly went on would make it a member
    check_invalid(stubs[0], lambda: push(stubs[0], worker, var, **kwargs), "InvalidArgumentError", *fragments,
                  names=[var])


@pytest.mark.parametrize("case", ["step-increment-2", "step-increment-minus-1000", "step-minus-1"])
def test_pushpull_header_numbers_out_of_range(stubs, var, case):
    kwargs, fragments = PUSH_HEADERS[case]
    check_invalid(stubs[0], lambda: pushpull(stubs[0], f"pushpull/{case}", var, **kwargs), "InvalidArgumentError",
                  *fragments, names=[var])


def test_push_numbers_at_the_edges_of_the_range_are_accepted(stubs, var):
    """The controls: step 2^62 and step_increment 0 and 1 are legal, and do what they say."""
    stub = stubs[0]
    step = status_of(stub).step
    assert push(stub, "edges:1", var, step=MAX_STEP, step_increment=0).step == step
    assert push(stub, "edges:1", var, step=0, step_increment=1).step == step + 1
    assert torch.equal(value_of(stub, var), -2 * torch.ones(N))


@pytest.mark.parametrize("min_step", [-1, -(1 << 63), MAX_STEP + 1, (1 << 63) - 1])
def test_pull_min_step_out_of_range(stubs, var, min_step):
    request = ps_pb2.PullRequest(names=[var], min_step=min_step)
    check_invalid(stubs[0], lambda: list(stubs[0].Pull(request, timeout=TIMEOUT)), "InvalidArgumentError",
                  "min_step", f"Received: {min_step}", names=[var])


@pytest.mark.parametrize("chunk_bytes", [1, MIN - 1])
def test_pull_chunk_bytes_below_the_minimum(stubs, var, chunk_bytes):
    request = ps_pb2.PullRequest(names=[var], chunk_bytes=chunk_bytes)
    check_invalid(stubs[0], lambda: list(stubs[0].Pull(request, timeout=TIMEOUT)), "InvalidArgumentError",
                  "chunk_bytes", str(MIN), f"Received: {chunk_bytes}")


@pytest.mark.parametrize("wait_seconds", [math.nan, math.inf, -math.inf, -1.0, -1e-9])
@pytest.mark.parametrize("names", [["list/missing"], []], ids=["waiting-for-a-name", "no-names"])
def test_list_wait_seconds_not_finite_or_negative(stubs, wait_seconds, names):
    request = ps_pb2.ListRequest(names=names, wait_seconds=wait_seconds)
    check_invalid(stubs[0], lambda: stubs[0].ListVariables(request, timeout=TIMEOUT), "InvalidArgumentError",
                  "wait_seconds", "finite")


@pytest.mark.parametrize("step", [-1, MAX_STEP + 1])
def test_create_refill_step_out_of_range_creates_nothing(stubs, step):
    name = f"refill/{step}"
    check_invalid(stubs[0], lambda: create(stubs[0], name, lr=1.0, step=step), "InvalidArgumentError", "step",
                  f"Received: {step}")
    assert name not in {i.spec.name for i in stubs[0].ListVariables(ps_pb2.ListRequest(), timeout=TIMEOUT).variables}


@pytest.mark.parametrize("step", [-1, -(1 << 63), MAX_STEP + 1])
def test_save_step_out_of_range(stubs, step):
    check_invalid(stubs[0], lambda: stubs[0].Save(ps_pb2.SaveRequest(step=step), timeout=TIMEOUT),
                  "InvalidArgumentError", "step must be in", f"Received: {step}")


# -- sync mode: steps more than one past the shard's open step (ps 1) ------------------------------------------


@pytest.fixture
def sync_var(stubs, request) -> str:
    name = "s/" + request.node.name
    assert list(create(stubs[1], name, lr=1.0).created) == [True]
    return name


AHEAD = {  # case -> (call(stub, worker, var), fragments); the open step of ps 1 is 0 throughout
    "push-step-2": (lambda s, w, v: push(s, w, v, step=2), ["push step 2", "ahead"]),
    "push-step-10^12": (lambda s, w, v: push(s, w, v, step=10 ** 12), [f"push step {10 ** 12}", "ahead"]),
    "push-step-2^62": (lambda s, w, v: push(s, w, v, step=MAX_STEP), ["ahead"]),
    "pushpull-step-2": (lambda s, w, v: pushpull(s, w, v, step=2), ["push step 2", "ahead"]),
    "join-step-2": (lambda s, w, v: join(s, w, step=2), ["join step 2", "ahead"]),
    "join-step-10^12": (lambda s, w, v: join(s, w, step=10 ** 12), ["ahead"]),
    "heartbeat-step-2": (lambda s, w, v: heartbeat(s, w, step=2), ["step 2", "ahead"]),
    "join-step-minus-1": (lambda s, w, v: join(s, w, step=-1), ["join step", "Received: -1"]),
    "heartbeat-step-2^62+1": (lambda s, w, v: heartbeat(s, w, step=MAX_STEP + 1), [f"Received: {MAX_STEP + 1}"]),
}


@pytest.mark.parametrize("case", list(AHEAD))
def test_sync_steps_ahead_of_the_shard_or_out_of_range(stubs, sync_var, case):
    call, fragments = AHEAD[case]
    stub = stubs[1]
    assert status_of(stub).step == 0
    worker = f"ahead/{case}"  # a new name: live_workers would show it if the call wrongly went on
    check_invalid(stub, lambda: call(stub, worker, sync_var), "InvalidArgumentError", *fragments, names=[sync_var])


# -- mode settings (Configure) ---------------------------------------------------------------------------------

CONFIGS = {  # case -> (SyncConfig fields over SYNC's, fragments)
    "lease-nan": (dict(lease_seconds=math.nan), ["lease_seconds", "finite"]),
    "lease-inf": (dict(lease_seconds=math.inf), ["lease_seconds"]),
    "lease-negative": (dict(lease_seconds=-1.0), ["lease_seconds"]),
    "lease-over-a-week": (dict(lease_seconds=7 * 24 * 3600 + 1.0), ["lease_seconds", "at most"]),
    "grace-nan": (dict(startup_grace_seconds=math.nan), ["startup_grace_seconds"]),
    "grace-inf": (dict(startup_grace_seconds=math.inf), ["startup_grace_seconds"]),
    "grace-negative": (dict(startup_grace_seconds=-5.0), ["startup_grace_seconds"]),
    "progress-nan": (dict(progress_seconds=math.nan), ["progress_seconds"]),
    "progress-inf": (dict(progress_seconds=math.inf), ["progress_seconds"]),
    "progress-negative": (dict(progress_seconds=-0.5), ["progress_seconds"]),
    "progress-1e9": (dict(progress_seconds=1e9), ["progress_seconds"]),
    "replicas-to-aggregate-100001": (dict(replicas_to_aggregate=100_001), ["replicas_to_aggregate", "100000"]),
    "total-num-replicas-100001": (dict(total_num_replicas=100_001), ["total_num_replicas", "100000"]),
    "total-num-replicas-uint32-max": (dict(total_num_replicas=(1 << 32) - 1), ["total_num_replicas"]),
    "max-staleness-negative": (dict(mode="ssp", max_staleness=-1), ["max_staleness"]),
    "max-staleness-int64-min": (dict(mode="ssp", max_staleness=-(1 << 63)), ["max_staleness"]),
    "max-staleness-huge": (dict(mode="ssp", max_staleness=10 ** 12), ["max_staleness"]),
    "unknown-mode": (dict(mode="bogus"), ["'bogus'"]),
    "sync-without-workers": (dict(total_num_replicas=0), ["total_num_replicas"]),
}


@pytest.mark.parametrize("shard", [0, 1], ids=["async-shard", "sync-shard"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_configure_numbers_out_of_range(stubs, case, shard):
    fields, fragments = CONFIGS[case]
    config = ps_pb2.SyncConfig()
    config.CopyFrom(SYNC)
    for key, value in fields.items():
        setattr(config, key, value)
    check_invalid(stubs[shard], lambda: stubs[shard].Configure(config, timeout=TIMEOUT), "InvalidArgumentError",
                  *fragments)


# -- optimizer hyperparameters -----------------------------------------------------------------------------------

HYPER = {  # case -> (optimizer, hyperparameters, fragments)
    "sgd-lr-nan": ("sgd", {"lr": math.nan}, ["finite", "'lr'"]),
    "sgd-lr-inf": ("sgd", {"lr": math.inf}, ["finite", "'lr'"]),
    "sgd-lr-minus-inf": ("sgd", {"lr": -math.inf}, ["finite"]),
    "sgd-lr-negative": ("sgd", {"lr": -1.0}, ["Invalid learning rate"]),
    "sgd-momentum-negative": ("sgd", {"lr": 0.1, "momentum": -0.5}, ["Invalid momentum value"]),
    "sgd-weight-decay-negative": ("sgd", {"lr": 0.1, "weight_decay": -1.0}, ["Invalid weight_decay value"]),
    "sgd-dampening-nan": ("sgd", {"lr": 0.1, "dampening": math.nan}, ["finite", "'dampening'"]),
    "sgd-nesterov-2": ("sgd", {"lr": 0.1, "nesterov": 2.0}, ["flags 0 or 1", "'nesterov'"]),
    "sgd-nesterov-without-momentum": ("sgd", {"lr": 0.1, "nesterov": 1.0}, ["Nesterov momentum requires"]),
    "sgd-maximize-half": ("sgd", {"lr": 0.1, "maximize": 0.5}, ["flags 0 or 1", "'maximize'"]),
    "adam-lr-nan": ("adam", {"lr": math.nan}, ["finite"]),
    "adam-beta1-1": ("adam", {"beta1": 1.0}, ["Invalid beta parameter at index 0"]),
    "adam-beta2-negative": ("adam", {"beta2": -0.1}, ["Invalid beta parameter at index 1"]),
    "adam-eps-negative": ("adam", {"eps": -1.0}, ["Invalid epsilon value"]),
    "adam-eps-inf": ("adam", {"eps": math.inf}, ["finite"]),
    "adam-amsgrad-2": ("adam", {"amsgrad": 2.0}, ["flags 0 or 1"]),
    "adamw-weight-decay-nan": ("adamw", {"weight_decay": math.nan}, ["finite"]),
    "adagrad-lr-decay-negative": ("adagrad", {"lr_decay": -1.0}, ["Invalid lr_decay value"]),
    "adagrad-initial-accumulator-negative": ("adagrad", {"initial_accumulator_value": -1.0},
                                             ["Invalid initial_accumulator_value"]),
}


@pytest.mark.parametrize("case", list(HYPER))
def test_create_with_bad_hyperparameters_creates_nothing(stubs, case):
    optimizer, hyper, fragments = HYPER[case]
    name = f"hyper/{case}"
    check_invalid(stubs[0], lambda: create(stubs[0], name, optimizer, **hyper), "OptimizerSpecError", *fragments)
    assert name not in {i.spec.name for i in stubs[0].ListVariables(ps_pb2.ListRequest(), timeout=TIMEOUT).variables}


@pytest.mark.parametrize("case", [c for c in HYPER if HYPER[c][0] == "sgd"])
def test_update_sgd_to_bad_hyperparameters_changes_nothing(stubs, var, case):
    _, hyper, fragments = HYPER[case]
    stub = stubs[0]
    request = ps_pb2.UpdateOptimizerRequest(names=[var], hyperparams=hyper)
    check_invalid(stub, lambda: stub.UpdateOptimizer(request, timeout=TIMEOUT), "OptimizerSpecError", *fragments,
                  names=[var])
    # lr 1, no momentum, no weight decay, not maximizing: two pushes of ones subtract exactly 2.
    for _ in range(2):
        push(stub, "hyper:sgd", var)
    assert torch.equal(value_of(stub, var), -2 * torch.ones(N))


@pytest.mark.parametrize("case", [c for c in HYPER if HYPER[c][0] in ("adam", "adamw")])
def test_update_adam_to_bad_hyperparameters_changes_nothing(stubs, case):
    optimizer, hyper, fragments = HYPER[case]
    stub = stubs[0]
    name = f"hyper-update/{case}"
    assert list(create(stub, name, optimizer, lr=0.5).created) == [True]
    request = ps_pb2.UpdateOptimizerRequest(names=[name], hyperparams=hyper)
    check_invalid(stub, lambda: stub.UpdateOptimizer(request, timeout=TIMEOUT), "OptimizerSpecError", *fragments,
                  names=[name])
    push(stub, "hyper:adam", name)  # Adam's first step moves each element by lr against the gradient's sign
    assert torch.allclose(value_of(stub, name), -0.5 * torch.ones(N), atol=1e-6)


def test_update_making_a_combination_torch_refuses_changes_nothing(stubs):
    """Each value is fine alone; together (nesterov with no momentum left) torch.optim refuses them."""
    stub = stubs[0]
    name = "hyper-update/nesterov"
    assert list(create(stub, name, "sgd", lr=1.0, momentum=0.5, nesterov=1.0).created) == [True]
    for hyper in ({"momentum": 0.0}, {"dampening": 0.5}):
        request = ps_pb2.UpdateOptimizerRequest(names=[name], hyperparams=hyper)
        check_invalid(stub, lambda r=request: stub.UpdateOptimizer(r, timeout=TIMEOUT), "OptimizerSpecError",
                      "Nesterov momentum requires", names=[name])
    push(stub, "hyper:nesterov", name)  # nesterov, momentum 0.5: the first step is g + 0.5 g
    assert torch.equal(value_of(stub, name), -1.5 * torch.ones(N))


def test_update_every_variable_to_a_nan_lr_changes_none(stubs, var):
    stub = stubs[0]
    request = ps_pb2.UpdateOptimizerRequest(names=[], hyperparams={"lr": math.nan})
    check_invalid(stub, lambda: stub.UpdateOptimizer(request, timeout=TIMEOUT), "OptimizerSpecError", "finite",
                  names=[var])
    push(stub, "hyper:all", var)
    assert torch.equal(value_of(stub, var), -torch.ones(N))


# -- the controls on the sync shard, last: they change it ------------------------------------------------------


def test_sync_steps_one_past_the_open_step_are_accepted(stubs, sync_var):
    """A worker released by shard 0 may reach a shard that has not applied the step yet: open step + 1 is legal."""
    stub = stubs[1]
    live = status_of(stub).live_workers
    assert join(stub, "near:1", step=1).step == 0
    assert heartbeat(stub, "near:1", step=1).step == 0
    assert status_of(stub).live_workers == live + 1
    reply = push(stub, "near:1", sync_var, step=1)
    assert not reply.stale and reply.next_step >= 1


# -- steps one ahead cannot make a sync shard drop a counted gradient ------------------------------------------


def _outcome(call, results: list, index: int) -> None:
    try:
        results[index] = call()
    except grpc.RpcError as exc:
        results[index] = exc


def test_pushes_one_step_ahead_never_drop_a_gradient_counted_for_the_open_step(local_cluster):
    """Step 0 has worker:0's gradient counted (its push held) when two other pushes complete step 1 (one past
    the open step: legal). The shard must not jump over step 0: worker:1's step-0 push completes it, step 1
    follows, and no push is answered stale. The regression (the applier jumping to step 1 as soon as it is
    complete) drops a gradient, so worker:1's push comes back stale and the value misses step 0, however
    worker:0's push is answered."""
    local = local_cluster(1)
    with grpc.insecure_channel(local.cluster.ps[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Configure(ps_pb2.SyncConfig(mode="sync", total_num_replicas=2, lease_seconds=LONG,
                                         progress_seconds=LONG), timeout=TIMEOUT)
        assert list(create(stub, "w", lr=1.0).created) == [True]
        join(stub, "worker:0"), join(stub, "worker:1")
        results: list = [None] * 4
        threads = [threading.Thread(target=_outcome, args=(lambda: push(stub, "worker:0", "w", step=0, seq=1),
                                                           results, 0), daemon=True)]
        threads[0].start()
        wait_until(lambda: status_of(stub).waiting_calls == 1, TIMEOUT, "worker:0's step-0 push to be held")
        for i, worker in ((1, "made-up:1"), (2, "made-up:2")):
            threads.append(threading.Thread(target=_outcome, args=(
                lambda w=worker: push(stub, w, "w", torch.full((N,), 100.0), step=1, seq=1), results, i),
                daemon=True))
            threads[-1].start()

        def step_one_complete() -> bool:  # both counted: held on the shard, or answered once a jump let them go
            answered = sum(r is not None for r in results[1:3])
            held = status_of(stub).waiting_calls - (results[0] is None)
            return answered + held >= 2

        wait_until(step_one_complete, TIMEOUT, "the two step-1 pushes to be counted")
        _outcome(lambda: push(stub, "worker:1", "w", torch.full((N,), 3.0), step=0, seq=1), results, 3)
        for thread in threads:
            thread.join(TIMEOUT)
        assert not any(thread.is_alive() for thread in threads), f"a push is still held: {results}"
        replies = dict(zip(("worker:0", "made-up:1", "made-up:2", "worker:1"), results))
        assert all(isinstance(r, ps_pb2.PushResponse) for r in results), f"a push failed: {replies}"
        stale = [worker for worker, reply in replies.items() if reply.stale]
        status = status_of(stub)
        value = value_of(stub, "w")
        # Step 0 is the average of worker:0's ones and worker:1's threes, step 1 the made-up 100s.
        assert not stale and status.stale_dropped == 0 and status.step == 2 and torch.equal(
            value, -102 * torch.ones(N)), (
            f"a gradient counted for step 0 was dropped: pushes answered stale {stale}, stale_dropped "
            f"{status.stale_dropped}, step {status.step}, value {value.tolist()} (want -102 at step 2)")
