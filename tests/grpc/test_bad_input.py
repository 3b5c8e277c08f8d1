"""Bad input, sent straight through the generated stubs to a real ps-server process.

The standard (ps.proto): bad input gets a clear error with the right gRPC
status code and changes nothing; a shard never crashes on input. So after each
bad call we check (a) the status code, (b) that the details say what is wrong
(naming the variable where there is one), (c) the `torchps-error` trailing
metadata, (d) that the shard's versions, variable set, specs and step (and the
values of the variables the call aimed at) are unchanged, and (e) that the
shard still serves and its process is alive.

Nothing here is ordered by sleeping. Before comparing, a check waits for the
event itself: the failed call's handler has returned (GetStatus's
calls_started / calls_done), or the bytes a vanishing client sent have arrived
(GetStatus's push_bytes_received).

Variables: small ones (float32[64], 256 bytes) travel as one chunk and serve
every check that is not about the shape of a chunk stream; the stream-shape
checks (missing, out-of-order, duplicated, overrunning, too small chunks...)
use a multi-chunk variable of 4 x codec.MIN_CHUNK_BYTES, the smallest a shard
takes for every chunk but a tensor's last.

Every hand-made push starts with a header whose step_increment is 1, so a push
that was wrongly (even partly) applied also shows in the step counter.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import wait_until
from torchps.ps_server.server import SERVICE_NAME
from torchps.worker.local_cluster import LocalCluster

from torchps import codec
from torchps.proto import ps_pb2, ps_pb2_grpc

TIMEOUT = 30.0  # seconds per RPC and per awaited event: a hang fails the test quickly, naming what it awaited
MIN = codec.MIN_CHUNK_BYTES  # 64 KiB: the smallest chunk a shard takes, but for a tensor's last
N = 64  # float32 elements of the small test variables: 256 bytes, always one chunk
B = 4 * N  # their bytes
M = MIN  # float32 elements of the multi-chunk variables: 4 * MIN bytes, 4 chunks of MIN
MB = 4 * M  # their bytes
INVALID = grpc.StatusCode.INVALID_ARGUMENT
# Not a protobuf: a varint that never ends.
JUNK = b"\xff" * 12 + b"this is not a protobuf"


@dataclasses.dataclass
class Shard:
    stub: ps_pb2_grpc.ParameterServerStub
    channel: grpc.Channel
    proc: subprocess.Popen
    address: str
    local: LocalCluster  # for its logs


def _connect(local: LocalCluster, index: int = 0) -> Shard:
    address = local.cluster.ps[index]
    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=TIMEOUT)
    return Shard(ps_pb2_grpc.ParameterServerStub(channel), channel, local.procs[index], address, local)


@pytest.fixture(scope="module")
def shard():
    """Raw stub on the module's own one-shard cluster (async, never configured)."""
    with LocalCluster(1) as local:
        connected = _connect(local)
        yield connected
        connected.channel.close()


# -- helpers: building streams ----------------------------------------------------------------


def spec_of(name: str, value: torch.Tensor, optimizer: str = "sgd", **hyper) -> ps_pb2.VariableSpec:
    return ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value),
                               optimizer=ps_pb2.OptimizerSpec(name=optimizer, hyperparams=hyper))


def create_requests(name: str, value: torch.Tensor, optimizer: str = "sgd", chunk_bytes: int = MIN,
                    **hyper) -> list[ps_pb2.CreateRequest]:
    return [ps_pb2.CreateRequest(spec=spec_of(name, value, optimizer, **hyper))] + [
        ps_pb2.CreateRequest(chunk=c) for c in codec.encode_chunks(name, value, chunk_bytes)]


def create(stub, name: str, value: torch.Tensor, optimizer: str = "sgd", chunk_bytes: int = MIN,
           **hyper) -> list[bool]:
    hyper = hyper or ({"lr": 1.0} if optimizer == "sgd" else {})
    reply = stub.CreateVariables(iter(create_requests(name, value, optimizer, chunk_bytes, **hyper)), timeout=TIMEOUT)
    return list(reply.created)


def header(step_increment: int = 1, tensors: int = 0, streamed: bool = False) -> ps_pb2.PushRequest:
    return ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="worker:7", step=0, step_increment=step_increment,
                                                       tensors=tensors, streamed=streamed))


def end(tensors: int, *items: ps_pb2.TensorChunk) -> ps_pb2.PushRequest:
    """The last message of a streamed push: PushEnd{tensors}, after these chunks if any."""
    return ps_pb2.PushRequest(chunks=list(items), end=ps_pb2.PushEnd(tensors=tensors))


def chunks(name: str, tensor: torch.Tensor, chunk_bytes: int = MIN) -> list[ps_pb2.TensorChunk]:
    """The tensor in chunks of chunk_bytes: one for a small variable, four of MIN for a multi-chunk one."""
    return list(codec.encode_chunks(name, tensor, chunk_bytes))


def cut(name: str, tensor: torch.Tensor, sizes: list[int]) -> list[ps_pb2.TensorChunk]:
    """The tensor in chunks of exactly these byte sizes (they must add up to its bytes)."""
    raw = codec.tensor_bytes(tensor).tobytes()
    assert sum(sizes) == len(raw), (sizes, len(raw))
    out, offset = [], 0
    for size in sizes:
        out.append(ps_pb2.TensorChunk(name=name, meta=codec.meta_of(tensor) if offset == 0 else None, offset=offset,
                                      data=raw[offset:offset + size]))
        offset += size
    return out


def push_msgs(*items) -> list[ps_pb2.PushRequest]:
    """PushRequests from PushRequests and TensorChunks (chunks get wrapped)."""
    return [m if isinstance(m, ps_pb2.PushRequest) else ps_pb2.PushRequest(chunks=[m]) for m in items]


def packed(*items: ps_pb2.TensorChunk, with_header: bool = False) -> ps_pb2.PushRequest:
    """One PushRequest carrying several chunks (as clients pack small tensors), optionally with the header."""
    request = ps_pb2.PushRequest(chunks=list(items))
    if with_header:
        request.header.CopyFrom(header().header)
    return request


def no_meta(chunk: ps_pb2.TensorChunk) -> ps_pb2.TensorChunk:
    out = ps_pb2.TensorChunk()
    out.CopyFrom(chunk)
    out.ClearField("meta")
    return out


def edited(chunk: ps_pb2.TensorChunk, **fields) -> ps_pb2.TensorChunk:
    out = ps_pb2.TensorChunk()
    out.CopyFrom(chunk)
    for key, value in fields.items():
        if key == "meta":
            out.meta.CopyFrom(value)
        else:
            setattr(out, key, value)
    return out


def push(stub, messages) -> ps_pb2.PushResponse:
    return stub.Push(iter(messages), timeout=TIMEOUT)


def good_grad(n: int = N) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32)


def initial_value(n: int = N) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


# -- helpers: observing the shard -------------------------------------------------------------


def status_of(stub) -> ps_pb2.StatusResponse:
    return stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT)


def pull_all(stub, names=(), chunk_bytes: int = 0) -> dict[str, tuple[bytes, int]]:
    out: dict[str, tuple[bytearray, int]] = {}
    for message in stub.Pull(ps_pb2.PullRequest(names=list(names), chunk_bytes=chunk_bytes), timeout=TIMEOUT):
        for chunk in message.chunks:
            if chunk.HasField("meta"):
                out[chunk.name] = (bytearray(), chunk.version)
            out[chunk.name][0].extend(chunk.data)
    return {name: (bytes(data), version) for name, (data, version) in out.items()}


def value_of(stub, name: str) -> torch.Tensor:
    data, _ = pull_all(stub, [name])[name]
    return torch.frombuffer(bytearray(data), dtype=torch.float32).clone()


def quiesce(stub, what: str) -> None:
    """Returns once every handler the shard entered has returned (the polling GetStatus aside). Use it once
    the call awaited is known to have entered its handler (e.g. its bytes arrived)."""
    wait_until(lambda: (lambda s: s.calls_done >= s.calls_started - 1)(status_of(stub)), TIMEOUT,
               f"{what} (GetStatus calls_done to catch up with calls_started)")


def settle(stub, mark: ps_pb2.StatusResponse, handlers: int, what: str) -> None:
    """Waits until exactly `handlers` calls made after the status reading `mark` have entered their handler on
    the shard and every handler has returned: a handler that wrongly went on after its call failed would
    otherwise change the shard after we look. Fails naming `what` if that never happens."""
    polls, entered = 0, []

    def settled() -> bool:
        nonlocal polls
        polls += 1
        status = status_of(stub)
        entered[:] = [status.calls_started - mark.calls_started - polls]  # handlers entered, our polls aside
        return entered[0] >= handlers and status.calls_done >= status.calls_started - 1

    wait_until(settled, TIMEOUT, f"{what}: {handlers} handler(s) to be entered and return on the shard "
                                 f"(GetStatus calls_started / calls_done)")
    assert entered[0] == handlers, f"{what}: {entered[0]} handlers ran on the shard, expected {handlers}"


def wait_received(stub, at_least: int, what: str) -> None:
    """Returns once the shard has taken in `at_least` gradient bytes in all (GetStatus.push_bytes_received)."""
    wait_until(lambda: status_of(stub).push_bytes_received >= at_least, TIMEOUT,
               f"the shard to take in {what} (push_bytes_received >= {at_least})")


def snapshot(stub, names=()) -> dict:
    """Everything a bad call must leave alone: versions (any applied update bumps them), specs, the variable
    set, the step, the push counters, and the values of `names` (the variables the call aimed at)."""
    quiesce(stub, "every call on the shard to finish before a snapshot")
    listing = stub.ListVariables(ps_pb2.ListRequest(), timeout=TIMEOUT)
    status = status_of(stub)
    return {
        "values": pull_all(stub, names) if names else {},
        "versions": {info.spec.name: info.version for info in listing.variables},
        "specs": {info.spec.name: info.spec.SerializeToString(deterministic=True) for info in listing.variables},
        "list_step": listing.step,
        "step": status.step,
        "num_variables": status.num_variables,
        "total_bytes": status.total_bytes,
        "duplicates": status.duplicates,
        "stale_dropped": status.stale_dropped,
        "waiting_calls": status.waiting_calls,
    }


def versions(stub) -> dict[str, int]:
    return {i.spec.name: i.version for i in stub.ListVariables(ps_pb2.ListRequest(), timeout=TIMEOUT).variables}


def assert_status(err: grpc.RpcError, code: grpc.StatusCode, error_class: str | None, *fragments: str) -> None:
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    details = err.details() or ""
    for fragment in fragments:
        assert fragment in details, f"details {details!r} should mention {fragment!r}"
    if error_class is not None:
        trailing = dict(err.trailing_metadata() or ())
        assert trailing.get("torchps-error") == error_class, f"trailing metadata {trailing!r}"


def assert_serving(shard: Shard, good_push: str | None = None) -> None:
    """The process is alive and answers; optionally a good push to `good_push` (sgd, lr=1) works."""
    assert shard.proc.poll() is None, f"ps-server died (exit {shard.proc.returncode}):\n{shard.local.log(0)[-3000:]}"
    health = health_pb2_grpc.HealthStub(shard.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT).status == \
        health_pb2.HealthCheckResponse.SERVING
    if good_push is not None:
        before_value = value_of(shard.stub, good_push)
        (info,) = shard.stub.ListVariables(ps_pb2.ListRequest(names=[good_push]), timeout=TIMEOUT).variables
        before = info.version
        step = status_of(shard.stub).step
        grad = torch.ones(tuple(info.spec.meta.shape))
        reply = push(shard.stub, push_msgs(header(), *chunks(good_push, grad)))
        assert reply.versions[good_push] == before + 1
        assert reply.step == step + 1
        assert torch.equal(value_of(shard.stub, good_push), before_value - 1)


def assert_unchanged(before: dict, after: dict, what: str) -> None:
    """Names exactly what changed, rather than dumping two whole snapshots."""
    changes = []
    for key in before:
        if after[key] == before[key]:
            continue
        if isinstance(before[key], dict):
            names = sorted(n for n in before[key].keys() | after[key].keys() if before[key].get(n) != after[key].get(n))
            detail = "; ".join(
                f"{n}: {'added' if n not in before[key] else 'removed' if n not in after[key] else 'changed'}"
                + (f" (version {before[key][n]} -> {after[key][n]})" if key == "versions" and n in before[key]
                   and n in after[key] else "") for n in names)
            changes.append(f"{key}: {detail}")
        else:
            changes.append(f"{key}: {before[key]} -> {after[key]}")
    assert not changes, f"{what} changed the shard: " + " | ".join(changes)


def check_rejected(shard: Shard, call, code: grpc.StatusCode, error_class: str | None, *fragments: str,
                   good_push: str | None = None, handlers: int = 1) -> grpc.RpcError:
    """Runs a bad `call` (`handlers` RPCs that reach the servicer); asserts its status, that its handlers
    returned and changed nothing, and that the shard still serves."""
    names = [good_push] if good_push else []
    before = snapshot(shard.stub, names)
    mark = status_of(shard.stub)
    with pytest.raises(grpc.RpcError) as info:
        call()
    settle(shard.stub, mark, handlers, f"a call rejected with {info.value.code().name}")
    assert_status(info.value, code, error_class, *fragments)
    assert_unchanged(before, snapshot(shard.stub, names), f"a call rejected with {info.value.code().name}")
    assert_serving(shard, good_push)
    return info.value


@pytest.fixture
def var(shard, request) -> str:
    """A fresh float32[N] variable (sgd, lr=1), one chunk on the wire, named after the test."""
    name = "bad/" + request.node.name
    assert create(shard.stub, name, initial_value()) == [True]
    return name


@pytest.fixture
def multi(shard, request) -> str:
    """A fresh float32[M] variable (sgd, lr=1): 4 chunks of MIN bytes on the wire, named after the test."""
    name = "multi/" + request.node.name
    assert create(shard.stub, name, initial_value(M)) == [True]
    return name


def test_health_check_serving(shard):
    health = health_pb2_grpc.HealthStub(shard.channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    assert SERVICE_NAME == "torchps.v1.ParameterServer"
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_variables_have_the_chunk_counts_the_checks_rely_on(shard, var, multi):
    """The premise of this file: small variables are one chunk, the multi-chunk one four chunks of MIN."""
    assert len(chunks(var, good_grad())) == 1 and len(chunks(var, good_grad())[0].data) == B
    assert [len(c.data) for c in chunks(multi, good_grad(M))] == [MIN] * 4
    assert versions(shard.stub)[var] == versions(shard.stub)[multi] == 0


# -- unknown variables ------------------------------------------------------------------------


def test_pull_unknown_variable_is_not_found(shard, var):
    check_rejected(shard, lambda: list(shard.stub.Pull(ps_pb2.PullRequest(names=["nope/w"]), timeout=TIMEOUT)),
                   grpc.StatusCode.NOT_FOUND, "UnknownVariableError", "'nope/w'", good_push=var)


def test_pull_unknown_among_known_sends_nothing(shard, var):
    received = []

    def call():
        for message in shard.stub.Pull(ps_pb2.PullRequest(names=[var, "nope/w"]), timeout=TIMEOUT):
            received.append(message)

    check_rejected(shard, call, grpc.StatusCode.NOT_FOUND, "UnknownVariableError", "'nope/w'", good_push=var)
    assert received == [], "NOT_FOUND must come before any chunk is streamed"


def test_push_unknown_variable_is_not_found(shard, var):
    messages = push_msgs(header(), *chunks("nope/w", good_grad()))
    check_rejected(shard, lambda: push(shard.stub, messages), grpc.StatusCode.NOT_FOUND, "UnknownVariableError",
                   "'nope/w'", good_push=var)


# -- wrong gradients --------------------------------------------------------------------------


@pytest.mark.parametrize("grad, code, error_class, fragments", [
    pytest.param(torch.ones(8, 8), INVALID, "TensorMismatchError", ["float32[8, 8]", f"float32[{N}]"], id="shape"),
    pytest.param(torch.ones(N + 1), INVALID, "TensorMismatchError", [f"float32[{N + 1}]", f"float32[{N}]"], id="length"),
    pytest.param(torch.ones(N, dtype=torch.float64), INVALID, "TensorMismatchError", [f"float64[{N}]", f"float32[{N}]"],
                 id="dtype"),
    pytest.param(torch.ones(N, dtype=torch.int32), INVALID, "TensorMismatchError", [f"int32[{N}]"], id="int-dtype"),
    pytest.param(torch.ones(()), INVALID, "TensorMismatchError", ["float32[]"], id="scalar"),
    pytest.param(torch.cat([torch.ones(N - 1), torch.tensor([float("nan")])]), INVALID, "NonFiniteGradientError",
                 ["NaN or Inf", "--allow-nonfinite"], id="nan-last-element"),
    pytest.param(torch.cat([torch.tensor([float("inf")]), torch.ones(N - 1)]), INVALID, "NonFiniteGradientError",
                 ["NaN or Inf"], id="inf"),
    pytest.param(torch.full((N,), float("-inf")), INVALID, "NonFiniteGradientError", ["NaN or Inf"], id="-inf"),
])
def test_push_bad_gradient(shard, var, grad, code, error_class, fragments):
    messages = push_msgs(header(), *chunks(var, grad))
    check_rejected(shard, lambda: push(shard.stub, messages), code, error_class, repr(var), *fragments,
                   good_push=var)


def test_push_nan_in_the_last_chunk_of_a_multi_chunk_gradient(shard, multi):
    grad = good_grad(M)
    grad[-1] = float("nan")
    messages = push_msgs(header(), *chunks(multi, grad))
    check_rejected(shard, lambda: push(shard.stub, messages), INVALID, "NonFiniteGradientError", repr(multi),
                   "NaN or Inf", good_push=multi)


def test_push_to_variable_without_optimizer(shard):
    name = "bad/frozen"
    assert create(shard.stub, name, initial_value(), optimizer="none") == [True]
    messages = push_msgs(header(), *chunks(name, good_grad()))
    check_rejected(shard, lambda: push(shard.stub, messages), INVALID, "TensorMismatchError", repr(name),
                   "no optimizer")


def test_nonfinite_accepted_with_allow_nonfinite(local_cluster):
    local = local_cluster(1, server_args=["--allow-nonfinite"])
    lenient = _connect(local)
    try:
        name = "lenient/w"
        assert create(lenient.stub, name, initial_value()) == [True]
        grad = good_grad()
        grad[3], grad[5] = float("nan"), float("inf")
        reply = push(lenient.stub, push_msgs(header(), *chunks(name, grad)))
        assert reply.versions[name] == 1 and reply.step == 1
        value = value_of(lenient.stub, name)
        assert torch.isnan(value[3]) and torch.isinf(value[5])
        assert torch.equal(value[:3], initial_value()[:3] - 1)
        assert_serving(lenient)
    finally:
        lenient.channel.close()


# -- all or nothing across the variables of one push ---------------------------------------


@pytest.mark.parametrize("second, code, error_class, fragment", [
    pytest.param(lambda b: chunks(b, torch.ones(M, dtype=torch.float64)), INVALID, "TensorMismatchError",
                 f"float64[{M}]", id="wrong-dtype"),
    pytest.param(lambda b: chunks(b, torch.full((M,), float("nan"))), INVALID, "NonFiniteGradientError",
                 "NaN or Inf", id="nan"),
    pytest.param(lambda b: chunks(b, good_grad(M))[:2], INVALID, "MalformedStreamError", "incomplete",
                 id="truncated"),
    pytest.param(lambda b: cut(b, good_grad(M), [MIN - 4, 3 * MIN + 4]), INVALID, "MalformedStreamError",
                 f"at least {MIN} bytes", id="chunk-below-the-minimum"),
    pytest.param(lambda b: chunks("nope/second", good_grad()), grpc.StatusCode.NOT_FOUND, "UnknownVariableError",
                 "'nope/second'", id="unknown"),
])
def test_push_second_variable_bad_applies_neither(shard, var, second, code, error_class, fragment):
    other = var + "/second"  # multi-chunk
    assert create(shard.stub, other, initial_value(M)) == [True]
    messages = push_msgs(header(), *chunks(var, good_grad()), *second(other))
    check_rejected(shard, lambda: push(shard.stub, messages), code, error_class, fragment, good_push=var)
    assert versions(shard.stub)[var] == 1  # only the good push of check_rejected
    assert versions(shard.stub)[other] == 0


# -- the minimum chunk: every chunk but a tensor's last carries at least MIN bytes ---------------


@pytest.mark.parametrize("sizes, fragments", [
    pytest.param([MIN - 4, MIN + 4, MIN, MIN], [f"carries {MIN - 4} bytes and is not its last"], id="first-4-short"),
    pytest.param([MIN, MIN - 1, MIN + 1, MIN], [f"carries {MIN - 1} bytes"], id="second-1-byte-short"),
    pytest.param([1] * 16 + [MB - 16], ["carries 1 bytes"], id="one-byte-chunks"),
    pytest.param([0, MB], ["carries 0 bytes"], id="empty-chunk-first"),
    pytest.param([MIN // 2] * 8, [f"carries {MIN // 2} bytes"], id="half-minimum-chunks"),
])
def test_push_chunk_below_the_minimum_is_malformed(shard, multi, sizes, fragments):
    messages = push_msgs(header(), *cut(multi, good_grad(M), sizes))
    check_rejected(shard, lambda: push(shard.stub, messages), INVALID, "MalformedStreamError", repr(multi),
                   f"at least {MIN} bytes", *fragments, good_push=multi)


@pytest.mark.parametrize("sizes", [
    pytest.param([MIN] * 4, id="four-of-the-minimum"),
    pytest.param([MB], id="one-chunk"),
    pytest.param([MIN + 8] * 3 + [MIN - 24], id="short-last-chunk"),
    pytest.param([MB - 4, 4], id="4-byte-last-chunk"),
    pytest.param([2 * MIN, MIN, MIN], id="uneven"),
])
def test_push_chunks_at_or_above_the_minimum_are_applied(shard, multi, sizes):
    """The controls of the cases above: the same gradient in legal chunks is applied, once."""
    before = value_of(shard.stub, multi)
    step = status_of(shard.stub).step
    reply = push(shard.stub, push_msgs(header(), *cut(multi, good_grad(M), sizes)))
    assert reply.versions[multi] == 1 and reply.step == step + 1
    assert torch.equal(value_of(shard.stub, multi), before - 1)


def test_a_small_variable_is_one_short_chunk_and_is_applied(shard, var):
    reply = push(shard.stub, push_msgs(header(), *cut(var, good_grad(), [B])))
    assert reply.versions[var] == 1
    assert torch.equal(value_of(shard.stub, var), initial_value() - 1)


def test_create_with_a_chunk_below_the_minimum_creates_nothing(shard, var):
    fresh = var + "/short-chunks"
    requests = [ps_pb2.CreateRequest(spec=spec_of(fresh, initial_value(M), lr=1.0))] + [
        ps_pb2.CreateRequest(chunk=c) for c in cut(fresh, initial_value(M), [MIN - 4, MIN + 4, MIN, MIN])]
    check_rejected(shard, lambda: shard.stub.CreateVariables(iter(requests), timeout=TIMEOUT), INVALID,
                   "MalformedStreamError", repr(fresh), f"carries {MIN - 4} bytes", f"at least {MIN} bytes",
                   good_push=var)
    assert fresh not in versions(shard.stub)
    # The control: the same value in chunks at or above the minimum (a short last one) creates it, intact.
    requests = [ps_pb2.CreateRequest(spec=spec_of(fresh, initial_value(M), lr=1.0))] + [
        ps_pb2.CreateRequest(chunk=c) for c in cut(fresh, initial_value(M), [MIN + 8] * 3 + [MIN - 24])]
    assert list(shard.stub.CreateVariables(iter(requests), timeout=TIMEOUT).created) == [True]
    assert torch.equal(value_of(shard.stub, fresh), initial_value(M))


@pytest.mark.parametrize("chunk_bytes", [1, 4096, MIN - 1])
def test_pull_chunk_bytes_below_the_minimum_is_invalid(shard, multi, chunk_bytes):
    request = ps_pb2.PullRequest(names=[multi], chunk_bytes=chunk_bytes)
    check_rejected(shard, lambda: list(shard.stub.Pull(request, timeout=TIMEOUT)), INVALID, "InvalidArgumentError",
                   "chunk_bytes", str(MIN), str(chunk_bytes), good_push=multi)


@pytest.mark.parametrize("chunk_bytes, expected", [
    pytest.param(0, [MB], id="default"),
    pytest.param(MIN, [MIN] * 4, id="minimum"),
    pytest.param(MIN + 4, [MIN + 4] * 3 + [MB - 3 * (MIN + 4)], id="minimum-plus-4"),
    pytest.param(3 * MIN, [3 * MIN, MIN], id="three-minimums"),
])
def test_pull_chunks_obey_the_minimum_too(shard, multi, var, chunk_bytes, expected):
    """A shard's own pull streams follow the rule it enforces (clients check them with the same assembler)."""
    messages = list(shard.stub.Pull(ps_pb2.PullRequest(names=[multi, var], chunk_bytes=chunk_bytes),
                                    timeout=TIMEOUT))
    sizes = [len(c.data) for m in messages for c in m.chunks if c.name == multi]
    assert sizes == expected
    assembler = codec.ChunkAssembler()
    got = dict(done for m in messages for c in m.chunks if (done := assembler.add(c)) is not None)
    assembler.finish()
    assert torch.equal(got[multi], initial_value(M)) and torch.equal(got[var], initial_value())


# -- malformed chunk streams ------------------------------------------------------------------

# Each case: multi-chunk variable name -> push messages. The gradient is ones(M) float32 in 4 chunks c[0..3] of MIN.
def _c(name):
    return chunks(name, good_grad(M))


STREAMS = {
    "missing-chunk": (lambda v: push_msgs(header(), *[_c(v)[i] for i in (0, 2, 3)]),
                      "MalformedStreamError", [f"offset {2 * MIN}", f"offset {MIN} was expected"]),
    "out-of-order": (lambda v: push_msgs(header(), *[_c(v)[i] for i in (0, 2, 1, 3)]),
                     "MalformedStreamError", [f"offset {2 * MIN}"]),
    "duplicated-chunk": (lambda v: push_msgs(header(), *[_c(v)[i] for i in (0, 1, 1, 2, 3)]),
                         "MalformedStreamError", [f"offset {MIN}", f"offset {2 * MIN} was expected"]),
    "overrun-last-chunk": (lambda v: push_msgs(header(), *_c(v)[:3], edited(_c(v)[3], data=bytes(2 * MIN))),
                           "MalformedStreamError", [f"past the {MB} bytes", f"float32[{M}]"]),
    "overrun-single-chunk": (lambda v: push_msgs(header(), edited(_c(v)[0], data=bytes(2 * MB))),
                             "MalformedStreamError", [f"byte {2 * MB}", f"past the {MB} bytes"]),
    "overrun-extra-chunk": (lambda v: push_msgs(header(), *_c(v), edited(_c(v)[1], offset=MB)),
                            "MalformedStreamError", [f"offset {MB}"]),
    "truncated": (lambda v: push_msgs(header(), *_c(v)[:2]),
                  "MalformedStreamError", ["incomplete", f"{2 * MIN} of {MB} bytes"]),
    "truncated-to-meta-only": (lambda v: push_msgs(header(), edited(_c(v)[0], data=b"")),
                               "MalformedStreamError", ["carries 0 bytes and is not its last", f"at least {MIN} bytes"]),
    "first-chunk-without-meta": (lambda v: push_msgs(header(), no_meta(_c(v)[0]), *_c(v)[1:]),
                                 "MalformedStreamError", ["no meta"]),
    "meta-in-later-chunk": (lambda v: push_msgs(header(), _c(v)[0], edited(_c(v)[1], meta=_c(v)[0].meta), *_c(v)[2:]),
                            "MalformedStreamError", ["meta set: True"]),
    "chunk-without-name": (lambda v: push_msgs(header(), *[edited(c, name="") for c in _c(v)]),
                           "MalformedStreamError", ["without a variable name"]),
    "interleaved-variables": (lambda v: push_msgs(header(), _c(v)[0], _c(v + "/other")[0], *_c(v)[1:]),
                              "MalformedStreamError", ["/other'", f"{MIN} of {MB} bytes"]),
    "same-variable-twice": (lambda v: push_msgs(header(), *_c(v), *_c(v)),
                            "MalformedStreamError", ["appears twice"]),
    "no-header": (lambda v: push_msgs(*_c(v)), "MalformedStreamError", ["must start with a header"]),
    "header-twice-at-start": (lambda v: push_msgs(header(), header(), *_c(v)),
                              "MalformedStreamError", ["header twice"]),
    "header-twice-later": (lambda v: push_msgs(header(), *_c(v)[:2], header(), *_c(v)[2:]),
                           "MalformedStreamError", ["header twice"]),
    "empty-stream": (lambda v: [], "MalformedStreamError", ["no header"]),
    "declared-more-tensors": (lambda v: push_msgs(header(tensors=2), *_c(v)),
                              "MalformedStreamError", ["declared 2 tensors but 1 arrived"]),
    "packed-missing-chunk": (lambda v: [header(), packed(*[_c(v)[i] for i in (0, 2, 3)])],
                             "MalformedStreamError", [f"offset {2 * MIN}"]),
    "packed-duplicated-chunk": (lambda v: [header(), packed(*_c(v)[:2]), packed(*_c(v)[1:])],
                                "MalformedStreamError", [f"offset {MIN}"]),
    "packed-with-header-truncated": (lambda v: [packed(*_c(v)[:3], with_header=True)],
                                     "MalformedStreamError", ["incomplete", f"{3 * MIN} of {MB} bytes"]),
    "packed-second-variable-interleaved": (lambda v: [header(), packed(_c(v)[0], _c(v + "/other")[0], *_c(v)[1:])],
                                           "MalformedStreamError", ["/other'"]),
    # Streamed pushes (PushHeader.streamed): the count comes last, in PushEnd; nothing without it.
    "streamed-without-end": (lambda v: push_msgs(header(streamed=True), *_c(v)),
                             "MalformedStreamError", ["without its end", "1 tensors arrived"]),
    "streamed-end-counts-more": (lambda v: push_msgs(header(streamed=True), *_c(v), end(2)),
                                 "MalformedStreamError", ["end counted 2 tensors but 1 arrived"]),
    "streamed-end-counts-none": (lambda v: push_msgs(header(streamed=True), *_c(v), end(0)),
                                 "MalformedStreamError", ["end counted 0 tensors but 1 arrived"]),
    "streamed-end-in-the-last-chunk-message-counts-more": (
        lambda v: push_msgs(header(streamed=True), *_c(v)[:3], end(3, _c(v)[3])),
        "MalformedStreamError", ["end counted 3 tensors but 1 arrived"]),
    "streamed-end-before-the-last-chunk": (lambda v: push_msgs(header(streamed=True), *_c(v)[:3], end(1)),
                                           "MalformedStreamError", ["incomplete", f"{3 * MIN} of {MB} bytes"]),
    "end-in-a-push-not-streamed": (lambda v: push_msgs(header(), *_c(v), end(1)),
                                   "MalformedStreamError", ["not streamed", "carries an end"]),
    "end-in-a-push-declaring-tensors": (lambda v: push_msgs(header(tensors=1), *_c(v), end(1)),
                                        "MalformedStreamError", ["not streamed"]),
    "streamed-end-twice": (lambda v: push_msgs(header(streamed=True), *_c(v), end(1), end(1)),
                           "MalformedStreamError", ["after its end"]),
    "streamed-chunks-after-end": (lambda v: push_msgs(header(streamed=True), *_c(v)[:2], end(1), *_c(v)[2:]),
                                  "MalformedStreamError", ["after its end"]),
    "streamed-header-declaring-tensors": (lambda v: push_msgs(header(tensors=1, streamed=True), *_c(v), end(1)),
                                          "MalformedStreamError", ["tensors 1 with streamed set"]),
    "negative-dimension": (lambda v: push_msgs(header(), edited(_c(v)[0], meta=ps_pb2.TensorMeta(
        dtype=ps_pb2.FLOAT32, shape=[-1, -M])), *_c(v)[1:]), "InvalidArgumentError", ["negative dimension"]),
    "unspecified-dtype": (lambda v: push_msgs(header(), edited(_c(v)[0], meta=ps_pb2.TensorMeta(shape=[M])),
                                              *_c(v)[1:]), "InvalidArgumentError", ["dtype"]),
}
_NAMELESS = ("no-header", "empty-stream", "header-twice-at-start", "header-twice-later", "chunk-without-name",
             "negative-dimension", "unspecified-dtype", "declared-more-tensors", "streamed-without-end",
             "streamed-end-counts-more", "streamed-end-counts-none", "streamed-end-in-the-last-chunk-message-counts-more",
             "end-in-a-push-not-streamed", "end-in-a-push-declaring-tensors", "streamed-end-twice",
             "streamed-chunks-after-end", "streamed-header-declaring-tensors")


@pytest.mark.parametrize("case", list(STREAMS))
def test_push_malformed_stream(shard, multi, case):
    build, error_class, fragments = STREAMS[case]
    messages = build(multi)
    name_fragment = [] if case in _NAMELESS else [repr(multi)]
    check_rejected(shard, lambda: push(shard.stub, messages), INVALID, error_class, *name_fragment, *fragments,
                   good_push=multi)


def test_the_stream_cases_are_malformed_only_by_their_defect(shard, multi):
    """The control of the cases above: the gradient they cut up, in its own four chunks, is a good push."""
    reply = push(shard.stub, push_msgs(header(tensors=1), *_c(multi)))
    assert reply.versions[multi] == 1
    assert torch.equal(value_of(shard.stub, multi), initial_value(M) - 1)


@pytest.mark.parametrize("last", ["end-alone", "end-with-the-last-chunk"])
def test_a_streamed_push_with_the_right_end_is_applied(shard, multi, last):
    """The control of the streamed cases: the count in PushEnd, alone or in the last chunk's message."""
    step = status_of(shard.stub).step
    tail = [end(1)] if last == "end-alone" else [end(1, _c(multi)[3])]
    body = _c(multi) if last == "end-alone" else _c(multi)[:3]
    reply = push(shard.stub, push_msgs(header(streamed=True), *body, *tail))
    assert reply.versions[multi] == 1 and reply.step == step + 1
    assert torch.equal(value_of(shard.stub, multi), initial_value(M) - 1)


def test_an_empty_streamed_push_counts_a_step(shard):
    """A shard holding none of a streamed push's gradients gets header and end(0): a push, as header-only."""
    step = status_of(shard.stub).step
    assert push(shard.stub, [header(streamed=True), end(0)]).step == step + 1
    assert push(shard.stub, [ps_pb2.PushRequest(header=header(streamed=True).header, end=ps_pb2.PushEnd())]
                ).step == step + 2


def test_a_streamed_push_cut_before_its_end_applies_nothing(shard, multi):
    """A client gone after every chunk but before the end (unlike a push that declared its count, which a
    shard may apply then): the shard took in every byte and applies nothing."""
    release = threading.Event()

    def requests():
        yield from push_msgs(header(streamed=True), *_c(multi))
        release.wait(TIMEOUT)  # the call is cancelled meanwhile

    before = snapshot(shard.stub, [multi])
    received = status_of(shard.stub).push_bytes_received
    future = shard.stub.Push.future(requests(), timeout=TIMEOUT)
    try:
        wait_received(shard.stub, received + MB, "every chunk of the streamed push")
        assert future.cancel()
    finally:
        release.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result(timeout=TIMEOUT)
    quiesce(shard.stub, "the cancelled push's handler to return")
    assert_unchanged(before, snapshot(shard.stub, [multi]), "a streamed push cut before its end")
    assert_serving(shard, good_push=multi)


# -- PushPull: the same rules in one unary call ------------------------------------------------


def pushpull(*items: ps_pb2.TensorChunk, pull=(), with_header: bool = True) -> ps_pb2.PushRequest:
    request = ps_pb2.PushRequest(chunks=list(items))
    if with_header:
        request.header.CopyFrom(ps_pb2.PushHeader(worker="worker:7", step_increment=1, pull=list(pull)))
    return request


PUSHPULL = {  # name -> (request for the small variable v or the multi-chunk one m, code, error class, fragments)
    "good-control": (lambda v, m: pushpull(*_c(m), pull=[m, v]), None, None, []),
    "unknown-variable": (lambda v, m: pushpull(*chunks("nope/pp", good_grad()), pull=[v]), grpc.StatusCode.NOT_FOUND,
                         "UnknownVariableError", ["'nope/pp'"]),
    "pull-unknown-variable": (lambda v, m: pushpull(*chunks(v, good_grad()), pull=[v, "nope/pp-pull"]),
                              grpc.StatusCode.NOT_FOUND, "UnknownVariableError", ["'nope/pp-pull'"]),
    "wrong-shape": (lambda v, m: pushpull(*chunks(v, torch.ones(8, 8)), pull=[v]), INVALID, "TensorMismatchError",
                    ["float32[8, 8]"]),
    "nan": (lambda v, m: pushpull(*chunks(v, torch.full((N,), float("nan"))), pull=[v]), INVALID,
            "NonFiniteGradientError", ["NaN or Inf"]),
    "missing-chunk": (lambda v, m: pushpull(*[_c(m)[i] for i in (0, 1, 3)], pull=[m]), INVALID,
                      "MalformedStreamError", [f"offset {3 * MIN}"]),
    "truncated": (lambda v, m: pushpull(*_c(m)[:3], pull=[m]), INVALID, "MalformedStreamError", ["incomplete"]),
    "chunk-below-the-minimum": (lambda v, m: pushpull(*cut(m, good_grad(M), [MIN - 4, 3 * MIN + 4]), pull=[m]),
                                INVALID, "MalformedStreamError", [f"at least {MIN} bytes"]),
    "no-header": (lambda v, m: pushpull(*chunks(v, good_grad()), with_header=False), INVALID, "MalformedStreamError",
                  ["header"]),
    "streamed-without-end": (lambda v, m: streamed_pushpull(pushpull(*chunks(v, good_grad()), pull=[v]), None),
                             INVALID, "MalformedStreamError", ["without its end"]),
    "streamed-end-counts-more": (lambda v, m: streamed_pushpull(pushpull(*chunks(v, good_grad()), pull=[v]), 2),
                                 INVALID, "MalformedStreamError", ["end counted 2 tensors but 1 arrived"]),
}


def streamed_pushpull(request: ps_pb2.PushRequest, tensors: int | None) -> ps_pb2.PushRequest:
    """The PushPull request made streamed, with PushEnd{tensors} (None: without an end)."""
    request.header.streamed = True
    if tensors is not None:
        request.end.tensors = tensors
    return request


def test_a_streamed_pushpull_with_its_end_is_applied(shard, var):
    reply = shard.stub.PushPull(streamed_pushpull(pushpull(*chunks(var, good_grad()), pull=[var]), 1),
                                timeout=TIMEOUT)
    assert reply.result.versions[var] == 1
    assert {c.name: c.data for c in reply.chunks} == {var: (initial_value() - 1).numpy().tobytes()}


@pytest.mark.parametrize("case", list(PUSHPULL))
def test_pushpull_bad_input(shard, var, multi, case):
    build, code, error_class, fragments = PUSHPULL[case]
    request = build(var, multi)
    if code is None:  # the control: the same kind of request, well formed, is applied and read back
        reply = shard.stub.PushPull(request, timeout=TIMEOUT)
        assert reply.result.versions[multi] == 1
        data = {c.name: c.data for c in reply.chunks}
        assert data == {multi: (initial_value(M) - 1).numpy().tobytes(), var: initial_value().numpy().tobytes()}
        return
    target = multi if case in ("missing-chunk", "truncated", "chunk-below-the-minimum") else var
    check_rejected(shard, lambda: shard.stub.PushPull(request, timeout=TIMEOUT), code, error_class, *fragments,
                   good_push=target)
    assert versions(shard.stub)[multi if target == var else var] == 0


def test_header_only_push_is_valid(shard):
    """Not bad input (shard 0 gets a header-only stream to advance the step): the control for the cases above."""
    step = status_of(shard.stub).step
    assert push(shard.stub, [header()]).step == step + 1


# -- message size limit -----------------------------------------------------------------------


def test_chunk_over_max_chunk_bytes_is_resource_exhausted(local_cluster):
    local = local_cluster(1, server_args=["--max-chunk-bytes", str(MIN)])
    small = _connect(local)
    try:
        name = "limited/w"  # float32[M]: 4 * MIN bytes
        assert create(small.stub, name, initial_value(M)) == [True]
        one_chunk = push_msgs(header(tensors=1), *chunks(name, good_grad(M), MB))
        assert len(one_chunk) == 2 and len(one_chunk[1].chunks[0].data) == MB  # above MIN + the envelope
        # gRPC ends the shard's request stream when it refuses the message, racing with the cancellation the
        # handler must notice; five tries make a handler that takes the cut stream for a whole one show.
        # The header declares its one tensor, as clients do: a stream cut after the header is not a push.
        for _ in range(5):
            err = check_rejected(small, lambda: push(small.stub, one_chunk), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 None)
            assert "torchps-error" not in dict(err.trailing_metadata() or ())  # refused by gRPC, before the servicer
        # Creating with a chunk over the limit is refused the same way and creates nothing.
        check_rejected(small, lambda: create(small.stub, "limited/new", initial_value(M), chunk_bytes=MB),
                       grpc.StatusCode.RESOURCE_EXHAUSTED, None)
        assert "limited/new" not in versions(small.stub)
        # The same gradient in chunks within the limit is applied, and pulls asking more are cut to the limit.
        reply = push(small.stub, push_msgs(header(), *chunks(name, good_grad(M), MIN)))
        assert reply.versions[name] == 1
        messages = list(small.stub.Pull(ps_pb2.PullRequest(names=[name], chunk_bytes=MB), timeout=TIMEOUT))
        assert [len(c.data) for m in messages for c in m.chunks] == [MIN] * 4
        assert_serving(small, good_push=name)
    finally:
        small.channel.close()


# -- bytes that are not protobuf --------------------------------------------------------------


def _raw(channel, method: str, kind: str, response_type):
    path = f"/torchps.v1.ParameterServer/{method}"
    factory = getattr(channel, kind)
    return factory(path, request_serializer=lambda b: b, response_deserializer=response_type.FromString)


# handlers: 1 where the servicer decodes the request itself (streams, PushOne, PushPull), 0 where gRPC's own decoding
# refuses it before any handler runs.
@pytest.mark.parametrize("method, kind, response_type, requests, handlers", [
    pytest.param("Push", "stream_unary", ps_pb2.PushResponse, lambda v: [JUNK], 1, id="push-junk"),
    pytest.param("Push", "stream_unary", ps_pb2.PushResponse,
                 lambda v: [m.SerializeToString() for m in push_msgs(header(), *_c(v)[:2])] + [JUNK], 1,
                 id="push-junk-mid-stream"),
    pytest.param("Push", "stream_unary", ps_pb2.PushResponse,
                 lambda v: [m.SerializeToString() for m in push_msgs(header(), *_c(v))] + [JUNK], 1,
                 id="push-junk-after-complete-gradient"),
    pytest.param("CreateVariables", "stream_unary", ps_pb2.CreateResponse,
                 lambda v: [m.SerializeToString() for m in create_requests(v + "/new", initial_value(M))] + [JUNK], 1,
                 id="create-junk-after-complete-variable"),
    pytest.param("Pull", "unary_stream", ps_pb2.PullResponse, lambda v: JUNK, 0, id="pull-junk"),
    pytest.param("PullOne", "unary_unary", ps_pb2.PullResponse, lambda v: JUNK, 0, id="pullone-junk"),
    pytest.param("PushPull", "unary_unary", ps_pb2.PullResponse, lambda v: JUNK, 1, id="pushpull-junk"),
    pytest.param("PushOne", "unary_unary", ps_pb2.PushResponse, lambda v: JUNK, 1, id="pushone-junk"),
    pytest.param("PushOne", "unary_unary", ps_pb2.PushResponse,
                 lambda v: ps_pb2.PushRequest(chunks=_c(v)[:1]).SerializeToString(), 1, id="pushone-without-header"),
    pytest.param("ListVariables", "unary_unary", ps_pb2.ListResponse, lambda v: JUNK, 0, id="list-junk"),
    pytest.param("UpdateOptimizer", "unary_unary", ps_pb2.UpdateOptimizerResponse, lambda v: JUNK, 0,
                 id="update-junk"),
    # Replicate's handler takes its stream on the event loop itself (replica_rpcs.replicate_handler).
    pytest.param("Replicate", "stream_stream", ps_pb2.ReplicaFrame, lambda v: [JUNK], 1, id="replicate-junk-hello"),
    pytest.param("Replicate", "stream_stream", ps_pb2.ReplicaFrame, lambda v: [], 1, id="replicate-without-hello"),
])
def test_garbage_bytes(shard, multi, method, kind, response_type, requests, handlers):
    call = _raw(shard.channel, method, kind, response_type)
    payload = requests(multi)

    def run():
        if kind == "unary_stream":
            return list(call(payload, timeout=TIMEOUT))
        if kind == "stream_unary":
            return call(iter(payload), timeout=TIMEOUT)
        if kind == "stream_stream":
            return list(call(iter(payload), timeout=TIMEOUT))
        return call(payload, timeout=TIMEOUT)

    before = snapshot(shard.stub, [multi])
    mark = status_of(shard.stub)
    with pytest.raises(grpc.RpcError) as info:
        run()
    assert info.value.code() not in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), info.value.details()
    if method == "Replicate":  # its handler decodes the hello (the others' codes are pinned elsewhere)
        assert_status(info.value, INVALID, "MalformedStreamError")
    what = f"a call that failed with {info.value.code().name} ({info.value.details()!r})"
    settle(shard.stub, mark, handlers, what)
    assert_unchanged(before, snapshot(shard.stub, [multi]), what)
    assert multi + "/new" not in versions(shard.stub)
    assert_serving(shard, good_push=multi)


# -- clients that vanish mid-stream -----------------------------------------------------------


def test_cancelled_push_applies_nothing(shard, multi):
    parts = _c(multi)
    release = threading.Event()

    def requests():
        yield header()
        yield from (ps_pb2.PushRequest(chunks=[c]) for c in parts[:2])  # half the gradient, then nothing more
        release.wait(TIMEOUT)

    before = snapshot(shard.stub, [multi])
    received = status_of(shard.stub).push_bytes_received
    future = shard.stub.Push.future(requests(), timeout=TIMEOUT)
    try:
        wait_received(shard.stub, received + 2 * MIN, "the first half of the gradient")
        assert future.cancel()
    finally:
        release.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result(timeout=TIMEOUT)
    quiesce(shard.stub, "the cancelled push's handler to return")
    assert status_of(shard.stub).push_bytes_received == received + 2 * MIN
    assert_unchanged(before, snapshot(shard.stub, [multi]), "a vanished push")
    assert_serving(shard, good_push=multi)


_DOOMED_CLIENT = textwrap.dedent("""
    import sys, time
    import grpc
    from torchps.proto import ps_pb2, ps_pb2_grpc

    address, name, n, piece, pieces = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(address))
    ones = b"\\x00\\x00\\x80\\x3f" * (piece // 4)

    def requests():
        yield ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="doomed", step_increment=1, incarnation=77,
                                                          seq=int(sys.argv[6])))
        meta = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[n])
        for offset in range(0, pieces * piece, piece):
            fields = dict(name=name, offset=offset, data=ones)
            if offset == 0:
                fields["meta"] = meta
            yield ps_pb2.PushRequest(chunks=[ps_pb2.TensorChunk(**fields)])
        print("sent", flush=True)
        time.sleep(600)  # never closes the stream: the test's SIGKILL comes first

    stub.Push(requests())
""")


def _kill_mid_push(shard: Shard, name: str, pieces: int, seq: int = 0) -> None:
    """A child process pushes `pieces` chunks of MIN to `name` without closing its stream and is SIGKILLed once
    the shard has taken them in; returns once the shard's handler for that push has returned."""
    received = status_of(shard.stub).push_bytes_received
    child = subprocess.Popen([sys.executable, "-c", _DOOMED_CLIENT, shard.address, name, str(M), str(MIN),
                              str(pieces), str(seq)], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()  # the child is killed by the finally below if this hangs past pytest's timeout
        assert line.strip() == "sent", line
        wait_received(shard.stub, received + pieces * MIN, f"the {pieces} chunks the client sent")
    finally:
        child.kill()
        child.wait(timeout=TIMEOUT)
        child.stdout.close()
    quiesce(shard.stub, "the killed client's push handler to return")
    assert status_of(shard.stub).push_bytes_received == received + pieces * MIN


def test_killed_client_mid_push_applies_nothing(shard, multi):
    before = snapshot(shard.stub, [multi])
    _kill_mid_push(shard, multi, 2)  # half the gradient
    assert_unchanged(before, snapshot(shard.stub, [multi]), "a push whose client was killed")
    assert_serving(shard, good_push=multi)


def test_a_whole_push_whose_client_died_before_closing_its_stream_is_applied_at_most_once(shard, multi):
    """Every byte of the push arrived, then the client was killed before closing its stream. gRPC may end the
    shard's request stream before it marks the call cancelled, so the push may be applied (ps.proto: a push is
    applied once every tensor it carries arrived whole); the client never saw a reply and retries it with the
    same number. Ten such deaths of the same push apply it at most once."""
    before = snapshot(shard.stub, [multi])
    for _ in range(10):
        _kill_mid_push(shard, multi, 4, seq=1)  # every byte of the gradient, but the stream was never closed
    (info,) = shard.stub.ListVariables(ps_pb2.ListRequest(names=[multi]), timeout=TIMEOUT).variables
    applied = info.version - before["versions"][multi]
    assert applied in (0, 1), f"the same push was applied {applied} times"
    expected = torch.frombuffer(bytearray(before["values"][multi][0]), dtype=torch.float32) - applied
    assert torch.equal(value_of(shard.stub, multi), expected)
    assert_serving(shard, good_push=multi)


# -- CreateVariables --------------------------------------------------------------------------


def test_create_same_spec_twice_keeps_value(shard, var):
    push(shard.stub, push_msgs(header(), *chunks(var, good_grad())))  # version 1, value changed
    before = snapshot(shard.stub, [var])
    assert create(shard.stub, var, torch.full((N,), 42.0)) == [False]
    assert_unchanged(before, snapshot(shard.stub, [var]), "creating an existing variable again")  # value sent discarded


@pytest.mark.parametrize("value, optimizer, hyper, fragments", [
    pytest.param(torch.zeros(N // 2), "sgd", {"lr": 1.0}, [f"float32[{N}]", f"float32[{N // 2}]"], id="shape"),
    pytest.param(torch.zeros(N, dtype=torch.float64), "sgd", {"lr": 1.0}, [f"float32[{N}]", f"float64[{N}]"],
                 id="dtype"),
    pytest.param(initial_value(), "sgd", {"lr": 0.5}, ["lr=1", "lr=0.5"], id="lr"),
    pytest.param(initial_value(), "adam", {}, ["optimizer=sgd", "optimizer=adam"], id="optimizer"),
])
def test_create_conflicting_spec(shard, var, value, optimizer, hyper, fragments):
    requests = create_requests(var, value, optimizer, **hyper)
    check_rejected(shard, lambda: shard.stub.CreateVariables(iter(requests), timeout=TIMEOUT),
                   grpc.StatusCode.ALREADY_EXISTS, "SpecConflictError", repr(var), *fragments, good_push=var)


def test_create_stream_with_conflict_creates_none(shard, var):
    fresh = var + "/fresh"
    requests = create_requests(fresh, initial_value()) + create_requests(var, torch.zeros(3), lr=1.0)
    check_rejected(shard, lambda: shard.stub.CreateVariables(iter(requests), timeout=TIMEOUT),
                   grpc.StatusCode.ALREADY_EXISTS, "SpecConflictError", repr(var), "float32[3]", good_push=var)
    assert fresh not in versions(shard.stub)
    assert create(shard.stub, fresh, initial_value()) == [True]  # the name is still free


def _spec_msg(name, value=None, optimizer="sgd", **hyper):
    value = initial_value(M) if value is None else value
    return ps_pb2.CreateRequest(spec=spec_of(name, value, optimizer, **hyper))


def _chunk_msgs(name, value=None):
    value = initial_value(M) if value is None else value
    return [ps_pb2.CreateRequest(chunk=c) for c in codec.encode_chunks(name, value, MIN)]


def _multi_requests(name):
    return create_requests(name, initial_value(M))


CREATE_CASES = {
    # name -> (requests for a fresh name n, error class, fragments); values are multi-chunk where the case
    # is about the chunk stream, small otherwise.
    "chunk-before-spec": (lambda n: _chunk_msgs(n) + _multi_requests(n), "MalformedStreamError", ["does not follow a spec"]),
    "spec-without-value": (lambda n: [_spec_msg(n)], "MalformedStreamError", ["stream ended before"]),
    "spec-with-partial-value": (lambda n: [_spec_msg(n), *_chunk_msgs(n)[:2]], "MalformedStreamError",
                                ["initial value"]),
    "partial-value-then-next-spec": (lambda n: [_spec_msg(n), *_chunk_msgs(n)[:2]] + _multi_requests(n + "/b"),
                                     "MalformedStreamError", ["initial value"]),
    "spec-without-value-then-next-variable": (lambda n: [_spec_msg(n)] + _multi_requests(n + "/b"),
                                              "MalformedStreamError", ["initial value"]),
    "value-missing-chunk": (lambda n: [_spec_msg(n), *[_chunk_msgs(n)[i] for i in (0, 2, 3)]], "MalformedStreamError",
                            [f"offset {2 * MIN}", f"offset {MIN} was expected"]),
    "value-overrun-last-chunk": (lambda n: [_spec_msg(n), *_chunk_msgs(n)[:3], ps_pb2.CreateRequest(
        chunk=ps_pb2.TensorChunk(name=n, offset=3 * MIN, data=bytes(2 * MIN)))], "MalformedStreamError",
        [f"past the {MB} bytes"]),
    "value-overrun-extra-chunk": (lambda n: [_spec_msg(n), *_chunk_msgs(n), ps_pb2.CreateRequest(
        chunk=ps_pb2.TensorChunk(name=n, offset=MB, data=b"1234"))], "MalformedStreamError", ["does not follow"]),
    "chunk-for-other-name": (lambda n: [_spec_msg(n), *_chunk_msgs(n + "/other")], "MalformedStreamError",
                             ["/other'", "does not follow"]),
    "chunk-meta-disagrees": (lambda n: [_spec_msg(n), *_chunk_msgs(n, torch.zeros(8, 8))], "TensorMismatchError",
                             ["float32[8, 8]", f"float32[{M}]"]),
    "declared-more-variables": (lambda n: [edited_create(_spec_msg(n), count=2), *_chunk_msgs(n)],
                                "MalformedStreamError", ["declared 2 variables but 1 arrived"]),
    "spec-without-name": (lambda n: create_requests("", initial_value()), "MalformedStreamError", ["without a name"]),
    "unknown-optimizer": (lambda n: create_requests(n, initial_value(), "rmsprop"), "OptimizerSpecError",
                          ["'rmsprop'", "adam"]),
    "unknown-hyperparameter": (lambda n: create_requests(n, initial_value(), "sgd", lr=0.1, betaz=0.9),
                               "OptimizerSpecError", ["betaz"]),
    "invalid-lr": (lambda n: create_requests(n, initial_value(), "sgd", lr=-1.0), "OptimizerSpecError", ["-1"]),
    "optimizer-on-integer-variable": (lambda n: create_requests(n, torch.arange(N), "sgd", lr=0.1),
                                      "OptimizerSpecError", ["int64"]),
    "second-variable-bad-optimizer": (lambda n: create_requests(n + "/a", initial_value())
                                      + create_requests(n, initial_value(), "rmsprop"),
                                      "OptimizerSpecError", ["'rmsprop'"]),
}
_CREATE_NAMELESS = ("spec-without-name", "unknown-optimizer", "second-variable-bad-optimizer", "invalid-lr",
                    "unknown-hyperparameter", "chunk-for-other-name", "declared-more-variables")


def edited_create(request: ps_pb2.CreateRequest, **fields) -> ps_pb2.CreateRequest:
    out = ps_pb2.CreateRequest()
    out.CopyFrom(request)
    for key, value in fields.items():
        setattr(out, key, value)
    return out


@pytest.mark.parametrize("case", list(CREATE_CASES))
def test_create_bad_stream(shard, var, case):
    build, error_class, fragments = CREATE_CASES[case]
    fresh = f"new/{case}"
    requests = build(fresh)
    name_fragment = [] if case in _CREATE_NAMELESS else [repr(fresh)]
    check_rejected(shard, lambda: shard.stub.CreateVariables(iter(requests), timeout=TIMEOUT), INVALID, error_class,
                   *name_fragment, *fragments, good_push=var)
    existing = versions(shard.stub)
    assert not [n for n in existing if n.startswith(fresh)], "a rejected CreateVariables created variables"


# -- ListVariables and UpdateOptimizer --------------------------------------------------------


def test_list_wait_for_missing_is_deadline_exceeded(shard, var):
    request = ps_pb2.ListRequest(names=[var, "never/created"], wait_seconds=0.5)
    err = check_rejected(shard, lambda: shard.stub.ListVariables(request, timeout=TIMEOUT),
                         grpc.StatusCode.DEADLINE_EXCEEDED, "WaitTimeoutError", "'never/created'", good_push=var)
    assert repr(var) not in err.details(), "only missing variables should be named"


def _push_ones_twice(stub, name: str) -> torch.Tensor:
    for _ in range(2):
        push(stub, push_msgs(header(), *chunks(name, good_grad())))
    return value_of(stub, name)


def test_update_optimizer_unknown_hyperparameter(shard, var):
    request = ps_pb2.UpdateOptimizerRequest(names=[var], hyperparams={"lr": 0.5, "betaz": 1.0})
    check_rejected(shard, lambda: shard.stub.UpdateOptimizer(request, timeout=TIMEOUT), INVALID,
                   "OptimizerSpecError", "'betaz'", "'sgd'")
    # lr is still 1 (not half-updated to 0.5): two pushes of ones subtract exactly 2.
    assert torch.equal(_push_ones_twice(shard.stub, var), initial_value() - 2)


def test_update_optimizer_all_or_nothing_across_variables(shard, var):
    adam = var + "/adam"
    assert create(shard.stub, adam, initial_value(), optimizer="adam") == [True]
    request = ps_pb2.UpdateOptimizerRequest(names=[var, adam], hyperparams={"momentum": 0.9})
    check_rejected(shard, lambda: shard.stub.UpdateOptimizer(request, timeout=TIMEOUT), INVALID,
                   "OptimizerSpecError", "'momentum'", "'adam'")
    # momentum was not set on the sgd variable either: with 0.9 the second step would subtract 1.9.
    assert torch.equal(_push_ones_twice(shard.stub, var), initial_value() - 2)


def test_update_optimizer_unknown_variable(shard, var):
    request = ps_pb2.UpdateOptimizerRequest(names=[var, "nope/opt"], hyperparams={"lr": 0.5})
    check_rejected(shard, lambda: shard.stub.UpdateOptimizer(request, timeout=TIMEOUT), grpc.StatusCode.NOT_FOUND,
                   "UnknownVariableError", "'nope/opt'")
    assert torch.equal(_push_ones_twice(shard.stub, var), initial_value() - 2)


def test_update_optimizer_on_variable_without_optimizer(shard):
    name = "bad/frozen-opt"
    assert create(shard.stub, name, initial_value(), optimizer="none") == [True]
    request = ps_pb2.UpdateOptimizerRequest(names=[name], hyperparams={"lr": 0.5})
    check_rejected(shard, lambda: shard.stub.UpdateOptimizer(request, timeout=TIMEOUT), INVALID,
                   "OptimizerSpecError", repr(name), "no optimizer")


# -- GetLayout's long poll ---------------------------------------------------------------------


@pytest.mark.parametrize("request_, fragments", [
    pytest.param(ps_pb2.LayoutRequest(watch_primary="127.0.0.1:1", watch_shard=1, watch_seconds=0.0),
                 ["watch_seconds is in (0, 10]", "Received: 0.0"], id="no-seconds"),
    pytest.param(ps_pb2.LayoutRequest(watch_primary="127.0.0.1:1", watch_shard=1, watch_seconds=-1.0),
                 ["Received: -1.0"], id="negative"),
    pytest.param(ps_pb2.LayoutRequest(watch_primary="127.0.0.1:1", watch_shard=1, watch_seconds=float("nan")),
                 ["Received: nan"], id="nan"),
    pytest.param(ps_pb2.LayoutRequest(watch_primary="127.0.0.1:1", watch_shard=1, watch_seconds=10.5),
                 ["Received: 10.5"], id="over-ten"),
    pytest.param(ps_pb2.LayoutRequest(watch_primary="127.0.0.1:1", watch_shard=2 ** 31, watch_seconds=1.0),
                 ["watch_shard is in [0,", f"Received: {2 ** 31}"], id="shard-out-of-range"),
])
def test_get_layout_with_a_bad_watch_is_invalid(shard, var, request_, fragments):
    check_rejected(shard, lambda: shard.stub.GetLayout(request_, timeout=TIMEOUT), INVALID, "InvalidArgumentError",
                   *fragments, good_push=var)
