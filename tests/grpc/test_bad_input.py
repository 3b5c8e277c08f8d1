"""Bad input, sent straight through the generated stubs to real ps-server processes.

The standard (ps.proto): bad input gets a clear error with the right gRPC
status code and changes nothing; a shard never crashes on input. So after each
bad call we check (a) the status code, (b) that the details say what is wrong
(naming the variable where there is one), (c) the `torchps-error` trailing
metadata, (d) that the shard's values, versions, variable set and step are
unchanged, and (e) that the shard still serves and its process is alive.

Every hand-made push starts with a header whose step_increment is 1, so a push
that was wrongly (even partly) applied also shows in the step counter.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import wait_until

from torchps import codec
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server.server import SERVICE_NAME

TIMEOUT = 30.0  # seconds per RPC: a hang fails the test quickly instead of at pytest's timeout
CHUNK = codec.MIN_CHUNK_BYTES  # bytes per chunk in hand-made streams (the smallest a shard takes but a last one)
N = CHUNK  # float32 elements of the test variables: N * 4 bytes, 4 chunks of CHUNK bytes
B = 4 * N  # their bytes
INVALID = grpc.StatusCode.INVALID_ARGUMENT
# Not a protobuf: a varint that never ends.
JUNK = b"\xff" * 12 + b"this is not a protobuf"


@dataclasses.dataclass
class Shard:
    stub: ps_pb2_grpc.ParameterServerStub
    channel: grpc.Channel
    proc: subprocess.Popen
    address: str
    local: object  # the LocalCluster, for its logs


def _connect(local, index: int = 0) -> Shard:
    address = local.cluster.ps[index]
    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=TIMEOUT)
    return Shard(ps_pb2_grpc.ParameterServerStub(channel), channel, local.procs[index], address, local)


@pytest.fixture(scope="module")
def shard(shared_cluster):
    """Raw stub on shard 0 of the module's shared cluster."""
    connected = _connect(shared_cluster)
    yield connected
    connected.channel.close()


# -- helpers: building streams ----------------------------------------------------------------


def spec_of(name: str, value: torch.Tensor, optimizer: str = "sgd", **hyper) -> ps_pb2.VariableSpec:
    return ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value),
                               optimizer=ps_pb2.OptimizerSpec(name=optimizer, hyperparams=hyper))


def create_requests(name: str, value: torch.Tensor, optimizer: str = "sgd", chunk_bytes: int = CHUNK,
                    **hyper) -> list[ps_pb2.CreateRequest]:
    return [ps_pb2.CreateRequest(spec=spec_of(name, value, optimizer, **hyper))] + [
        ps_pb2.CreateRequest(chunk=c) for c in codec.encode_chunks(name, value, chunk_bytes)]


def create(stub, name: str, value: torch.Tensor, optimizer: str = "sgd", chunk_bytes: int = CHUNK,
           **hyper) -> list[bool]:
    hyper = hyper or ({"lr": 1.0} if optimizer == "sgd" else {})
    reply = stub.CreateVariables(iter(create_requests(name, value, optimizer, chunk_bytes, **hyper)), timeout=TIMEOUT)
    return list(reply.created)


def header(step_increment: int = 1, tensors: int = 0) -> ps_pb2.PushRequest:
    return ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="worker:7", step=0, step_increment=step_increment,
                                                       tensors=tensors))


def chunks(name: str, tensor: torch.Tensor, chunk_bytes: int = CHUNK) -> list[ps_pb2.TensorChunk]:
    return list(codec.encode_chunks(name, tensor, chunk_bytes))


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


def good_grad() -> torch.Tensor:
    return torch.ones(N, dtype=torch.float32)


def initial_value() -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32)


# -- helpers: observing the shard -------------------------------------------------------------


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


def snapshot(stub, names=()) -> dict:
    """Everything a bad call must leave alone: versions (any applied update bumps them), specs, the variable
    set, the step, and the values of `names` (the variables the call aimed at)."""
    wait_quiescent(stub)
    listing = stub.ListVariables(ps_pb2.ListRequest(), timeout=TIMEOUT)
    status = stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT)
    return {
        "values": pull_all(stub, names) if names else {},
        "versions": {info.spec.name: info.version for info in listing.variables},
        "specs": {info.spec.name: info.spec.SerializeToString(deterministic=True) for info in listing.variables},
        "list_step": listing.step,
        "step": status.step,
        "num_variables": status.num_variables,
        "total_bytes": status.total_bytes,
    }


def status_of(stub) -> ps_pb2.StatusResponse:
    return stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT)


def wait_quiescent(stub) -> None:
    """Returns once every call the shard took has finished (its handler returned), the status call aside:
    a handler that wrongly went on after a failed call would otherwise change the shard after we look."""
    wait_until(lambda: (lambda s: s.calls_done >= s.calls_started - 1)(status_of(stub)), TIMEOUT,
               "every call on the shard to finish")


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
        step = shard.stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT).step
        grad = torch.ones(tuple(info.spec.meta.shape))
        reply = push(shard.stub, push_msgs(header(), *chunks(good_push, grad, 1 << 18)))
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
                   good_push: str | None = None) -> grpc.RpcError:
    """Runs a bad `call`; asserts its status, that nothing changed, and that the shard still serves."""
    names = [good_push] if good_push else []
    before = snapshot(shard.stub, names)
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert_status(info.value, code, error_class, *fragments)
    assert_unchanged(before, snapshot(shard.stub, names), f"a call rejected with {info.value.code().name}")
    assert_serving(shard, good_push)
    return info.value


@pytest.fixture
def var(shard, request) -> str:
    """A fresh float32[N] variable (sgd, lr=1) on the shard, named after the test."""
    name = "bad/" + request.node.name
    assert create(shard.stub, name, initial_value()) == [True]
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
    pytest.param(lambda b: chunks(b, torch.ones(N, dtype=torch.float64)), INVALID, "TensorMismatchError",
                 f"float64[{N}]", id="wrong-dtype"),
    pytest.param(lambda b: chunks(b, torch.full((N,), float("nan"))), INVALID, "NonFiniteGradientError",
                 "NaN or Inf", id="nan"),
    pytest.param(lambda b: chunks(b, good_grad())[:2], INVALID, "MalformedStreamError", "incomplete",
                 id="truncated"),
    pytest.param(lambda b: chunks("nope/second", good_grad()), grpc.StatusCode.NOT_FOUND, "UnknownVariableError",
                 "'nope/second'", id="unknown"),
])
def test_push_second_variable_bad_applies_neither(shard, var, second, code, error_class, fragment):
    other = var + "/second"
    assert create(shard.stub, other, initial_value()) == [True]
    messages = push_msgs(header(), *chunks(var, good_grad()), *second(other))
    check_rejected(shard, lambda: push(shard.stub, messages), code, error_class, fragment, good_push=var)
    assert versions(shard.stub)[var] == 1  # only the good push of check_rejected


# -- malformed chunk streams ------------------------------------------------------------------

# Each case: var name -> push messages. The gradient is ones(64) float32 in 4 chunks c[0..3].
def _c(name):
    return chunks(name, good_grad())


STREAMS = {
    "missing-chunk": (lambda v: push_msgs(header(), *[_c(v)[i] for i in (0, 2, 3)]),
                      "MalformedStreamError", [f"offset {2 * CHUNK}", f"offset {CHUNK} was expected"]),
    "out-of-order": (lambda v: push_msgs(header(), *[_c(v)[i] for i in (0, 2, 1, 3)]),
                     "MalformedStreamError", [f"offset {2 * CHUNK}"]),
    "duplicated-chunk": (lambda v: push_msgs(header(), *[_c(v)[i] for i in (0, 1, 1, 2, 3)]),
                         "MalformedStreamError", [f"offset {CHUNK}", f"offset {2 * CHUNK} was expected"]),
    "overrun-last-chunk": (lambda v: push_msgs(header(), *_c(v)[:3], edited(_c(v)[3], data=bytes(2 * CHUNK))),
                           "MalformedStreamError", [f"past the {B} bytes", f"float32[{N}]"]),
    "overrun-single-chunk": (lambda v: push_msgs(header(), edited(_c(v)[0], data=bytes(8 * N))),
                             "MalformedStreamError", [f"byte {2 * B}", f"past the {B} bytes"]),
    "overrun-extra-chunk": (lambda v: push_msgs(header(), *_c(v), edited(_c(v)[1], offset=4 * N)),
                            "MalformedStreamError", [f"offset {B}"]),
    "truncated": (lambda v: push_msgs(header(), *_c(v)[:2]),
                  "MalformedStreamError", ["incomplete", f"{2 * CHUNK} of {B} bytes"]),
    "truncated-to-meta-only": (lambda v: push_msgs(header(), edited(_c(v)[0], data=b"")),
                               "MalformedStreamError", [f"carries 0 bytes and is not its last", f"at least {CHUNK} bytes"]),
    "first-chunk-without-meta": (lambda v: push_msgs(header(), no_meta(_c(v)[0]), *_c(v)[1:]),
                                 "MalformedStreamError", ["no meta"]),
    "meta-in-later-chunk": (lambda v: push_msgs(header(), _c(v)[0], edited(_c(v)[1], meta=_c(v)[0].meta), *_c(v)[2:]),
                            "MalformedStreamError", ["meta set: True"]),
    "chunk-without-name": (lambda v: push_msgs(header(), *[edited(c, name="") for c in _c(v)]),
                           "MalformedStreamError", ["without a variable name"]),
    "interleaved-variables": (lambda v: push_msgs(header(), _c(v)[0], _c(v + "/other")[0], *_c(v)[1:]),
                              "MalformedStreamError", ["/other'", f"{CHUNK} of {B} bytes"]),
    "same-variable-twice": (lambda v: push_msgs(header(), *_c(v), *_c(v)),
                            "MalformedStreamError", ["appears twice"]),
    "no-header": (lambda v: push_msgs(*_c(v)), "MalformedStreamError", ["must start with a header"]),
    "header-twice-at-start": (lambda v: push_msgs(header(), header(), *_c(v)),
                              "MalformedStreamError", ["header twice"]),
    "header-twice-later": (lambda v: push_msgs(header(), *_c(v)[:2], header(), *_c(v)[2:]),
                           "MalformedStreamError", ["header twice"]),
    "empty-stream": (lambda v: [], "MalformedStreamError", ["no header"]),
    "packed-missing-chunk": (lambda v: [header(), packed(*[_c(v)[i] for i in (0, 2, 3)])],
                             "MalformedStreamError", [f"offset {2 * CHUNK}"]),
    "packed-duplicated-chunk": (lambda v: [header(), packed(*_c(v)[:2]), packed(*_c(v)[1:])],
                                "MalformedStreamError", [f"offset {CHUNK}"]),
    "packed-with-header-truncated": (lambda v: [packed(*_c(v)[:3], with_header=True)],
                                     "MalformedStreamError", ["incomplete", f"{3 * CHUNK} of {B} bytes"]),
    "packed-second-variable-interleaved": (lambda v: [header(), packed(_c(v)[0], _c(v + "/other")[0], *_c(v)[1:])],
                                           "MalformedStreamError", ["/other'"]),
    "negative-dimension": (lambda v: push_msgs(header(), edited(_c(v)[0], meta=ps_pb2.TensorMeta(
        dtype=ps_pb2.FLOAT32, shape=[-1, -64])), *_c(v)[1:]), "InvalidArgumentError", ["negative dimension"]),
    "unspecified-dtype": (lambda v: push_msgs(header(), edited(_c(v)[0], meta=ps_pb2.TensorMeta(shape=[N])),
                                              *_c(v)[1:]), "InvalidArgumentError", ["dtype"]),
}


@pytest.mark.parametrize("case", list(STREAMS))
def test_push_malformed_stream(shard, var, case):
    build, error_class, fragments = STREAMS[case]
    messages = build(var)
    name_fragment = [] if case in ("no-header", "empty-stream", "header-twice-at-start", "header-twice-later",
                                   "chunk-without-name", "negative-dimension", "unspecified-dtype") else [repr(var)]
    check_rejected(shard, lambda: push(shard.stub, messages), INVALID, error_class, *name_fragment, *fragments,
                   good_push=var)


# -- PushPull: the same rules in one unary call ------------------------------------------------


def pushpull(*items: ps_pb2.TensorChunk, pull=(), with_header: bool = True) -> ps_pb2.PushRequest:
    request = ps_pb2.PushRequest(chunks=list(items))
    if with_header:
        request.header.CopyFrom(ps_pb2.PushHeader(worker="worker:7", step_increment=1, pull=list(pull)))
    return request


PUSHPULL = {
    "good-control": (lambda v: pushpull(*_c(v), pull=[v]), None, None, []),
    "unknown-variable": (lambda v: pushpull(*_c("nope/pp"), pull=[v]), grpc.StatusCode.NOT_FOUND,
                         "UnknownVariableError", ["'nope/pp'"]),
    "pull-unknown-variable": (lambda v: pushpull(*_c(v), pull=[v, "nope/pp-pull"]), grpc.StatusCode.NOT_FOUND,
                              "UnknownVariableError", ["'nope/pp-pull'"]),
    "wrong-shape": (lambda v: pushpull(*chunks(v, torch.ones(8, 8)), pull=[v]), INVALID, "TensorMismatchError",
                    ["float32[8, 8]"]),
    "nan": (lambda v: pushpull(*chunks(v, torch.full((N,), float("nan"))), pull=[v]), INVALID,
            "NonFiniteGradientError", ["NaN or Inf"]),
    "missing-chunk": (lambda v: pushpull(*[_c(v)[i] for i in (0, 1, 3)], pull=[v]), INVALID, "MalformedStreamError",
                      [f"offset {3 * CHUNK}"]),
    "truncated": (lambda v: pushpull(*_c(v)[:3], pull=[v]), INVALID, "MalformedStreamError", ["incomplete"]),
    "no-header": (lambda v: pushpull(*_c(v), with_header=False), INVALID, "MalformedStreamError", ["header"]),
}


@pytest.mark.parametrize("case", list(PUSHPULL))
def test_pushpull_bad_input(shard, var, case):
    build, code, error_class, fragments = PUSHPULL[case]
    request = build(var)
    if code is None:  # the control: the same request, well formed, is applied and read back
        reply = shard.stub.PushPull(request, timeout=TIMEOUT)
        assert reply.result.versions[var] == 1
        assert b"".join(c.data for c in reply.chunks) == (initial_value() - 1).numpy().tobytes()
        return
    check_rejected(shard, lambda: shard.stub.PushPull(request, timeout=TIMEOUT), code, error_class, *fragments,
                   good_push=var)


def test_header_only_push_is_valid(shard):
    """Not bad input (shard 0 gets a header-only stream to advance the step): the control for the cases above."""
    step = shard.stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT).step
    assert push(shard.stub, [header()]).step == step + 1


# -- message size limit -----------------------------------------------------------------------


def test_chunk_over_max_chunk_bytes_is_resource_exhausted(local_cluster):
    local = local_cluster(1, server_args=["--max-chunk-bytes", "65536"])
    small = _connect(local)
    try:
        name, n = "limited/w", 1 << 18  # float32[262144]: 1 MiB
        value = torch.zeros(n)
        assert create(small.stub, name, value, chunk_bytes=65536) == [True]
        one_mib_chunk = push_msgs(header(tensors=1), *chunks(name, torch.ones(n), 1 << 20))
        assert len(one_mib_chunk) == 2 and len(one_mib_chunk[1].chunks[0].data) == 1 << 20
        # gRPC ends the shard's request stream when it refuses the message, racing with the cancellation the
        # handler must notice; five tries make a handler that takes the cut stream for a whole one show.
        # The header declares its one tensor, as PSClient's do: a stream cut after the header is not a push.
        for _ in range(5):
            err = check_rejected(small, lambda: push(small.stub, one_mib_chunk), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 None)
            assert "torchps-error" not in dict(err.trailing_metadata() or ())  # refused by gRPC, before the servicer
        # Creating with a 1 MiB chunk is refused the same way and creates nothing.
        check_rejected(small, lambda: create(small.stub, "limited/new", value, chunk_bytes=1 << 20),
                       grpc.StatusCode.RESOURCE_EXHAUSTED, None)
        # The same gradient in chunks within the limit is applied, and pulls are cut to the limit too.
        reply = push(small.stub, push_msgs(header(), *chunks(name, torch.ones(n), 65536)))
        assert reply.versions[name] == 1
        messages = list(small.stub.Pull(ps_pb2.PullRequest(names=[name], chunk_bytes=1 << 20), timeout=TIMEOUT))
        assert max(len(c.data) for m in messages for c in m.chunks) <= 65536
        assert_serving(small)
    finally:
        small.channel.close()


# -- bytes that are not protobuf --------------------------------------------------------------


def _raw(channel, method: str, kind: str, response_type):
    path = f"/torchps.v1.ParameterServer/{method}"
    factory = getattr(channel, kind)
    return factory(path, request_serializer=lambda b: b, response_deserializer=response_type.FromString)


@pytest.mark.parametrize("method, kind, response_type, requests", [
    pytest.param("Push", "stream_unary", ps_pb2.PushResponse, lambda v: [JUNK], id="push-junk"),
    pytest.param("Push", "stream_unary", ps_pb2.PushResponse,
                 lambda v: [m.SerializeToString() for m in push_msgs(header(), *_c(v)[:2])] + [JUNK],
                 id="push-junk-mid-stream"),
    pytest.param("Push", "stream_unary", ps_pb2.PushResponse,
                 lambda v: [m.SerializeToString() for m in push_msgs(header(), *_c(v))] + [JUNK],
                 id="push-junk-after-complete-gradient"),
    pytest.param("CreateVariables", "stream_unary", ps_pb2.CreateResponse,
                 lambda v: [m.SerializeToString() for m in create_requests(v + "/new", initial_value())] + [JUNK],
                 id="create-junk-after-complete-variable"),
    pytest.param("Pull", "unary_stream", ps_pb2.PullResponse, lambda v: JUNK, id="pull-junk"),
    pytest.param("PushPull", "unary_unary", ps_pb2.PullResponse, lambda v: JUNK, id="pushpull-junk"),
    pytest.param("ListVariables", "unary_unary", ps_pb2.ListResponse, lambda v: JUNK, id="list-junk"),
    pytest.param("UpdateOptimizer", "unary_unary", ps_pb2.UpdateOptimizerResponse, lambda v: JUNK,
                 id="update-junk"),
])
def test_garbage_bytes(shard, var, method, kind, response_type, requests):
    call = _raw(shard.channel, method, kind, response_type)
    payload = requests(var)

    def run():
        if kind == "unary_stream":
            return list(call(payload, timeout=TIMEOUT))
        if kind == "stream_unary":
            return call(iter(payload), timeout=TIMEOUT)
        return call(payload, timeout=TIMEOUT)

    before = snapshot(shard.stub, [var])
    with pytest.raises(grpc.RpcError) as info:
        run()
    assert info.value.code() not in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), info.value.details()
    assert_unchanged(before, snapshot(shard.stub, [var]),  # snapshot() waits for the handler to finish
                     f"a call that failed with {info.value.code().name} ({info.value.details()!r})")
    assert_serving(shard, good_push=var)


# -- clients that vanish mid-stream -----------------------------------------------------------

BIG_N = 1 << 20  # float32[1048576]: 4 MiB, pushed in 16 chunks of 256 KiB


@pytest.fixture
def big_var(shard, request) -> str:
    name = "big/" + request.node.name
    assert create(shard.stub, name, torch.zeros(BIG_N), chunk_bytes=1 << 20) == [True]
    return name


def wait_received(stub, at_least: int) -> None:
    """Returns once the shard has taken in `at_least` gradient bytes in all (GetStatus.push_bytes_received)."""
    wait_until(lambda: status_of(stub).push_bytes_received >= at_least, TIMEOUT,
               f"the shard to take in {at_least} gradient bytes")


def test_cancelled_push_applies_nothing(shard, big_var):
    sent, release = threading.Event(), threading.Event()

    def requests():
        yield header()
        for i, chunk in enumerate(chunks(big_var, torch.ones(BIG_N), 1 << 18)):
            if i == 8:
                sent.set()
                release.wait(TIMEOUT)
                return
            yield ps_pb2.PushRequest(chunks=[chunk])

    before = snapshot(shard.stub, [big_var])
    received = status_of(shard.stub).push_bytes_received
    future = shard.stub.Push.future(requests(), timeout=TIMEOUT)
    try:
        assert sent.wait(TIMEOUT)
        wait_received(shard.stub, received + 8 * (1 << 18))  # the first half of the gradient is in
        assert future.cancel()
    finally:
        release.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result(timeout=TIMEOUT)
    assert_unchanged(before, snapshot(shard.stub, [big_var]), "a vanished push")
    assert_serving(shard, good_push=big_var)


_DOOMED_CLIENT = textwrap.dedent("""
    import sys, time
    import grpc
    from torchps.proto import ps_pb2, ps_pb2_grpc

    address, name, n, fraction = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(address))
    piece = 1 << 18
    ones = b"\\x00\\x00\\x80\\x3f" * (piece // 4)

    def requests():
        yield ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="doomed", step_increment=1))
        meta = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[n])
        for offset in range(0, int(4 * n * fraction), piece):
            fields = dict(name=name, offset=offset, data=ones)
            if offset == 0:
                fields["meta"] = meta
            yield ps_pb2.PushRequest(chunks=[ps_pb2.TensorChunk(**fields)])
        print("sent", flush=True)
        time.sleep(600)  # never closes the stream: SIGKILL comes first

    stub.Push(requests())
""")


@pytest.mark.parametrize("fraction", [0.5, 1.0], ids=["half-the-gradient", "whole-gradient-stream-not-closed"])
def test_killed_client_mid_push_applies_nothing(shard, big_var, fraction):
    before = snapshot(shard.stub, [big_var])
    received = status_of(shard.stub).push_bytes_received
    child = subprocess.Popen([sys.executable, "-c", _DOOMED_CLIENT, shard.address, big_var, str(BIG_N), str(fraction)],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()  # the child is killed by the finally below if this hangs past pytest's timeout
        assert line.strip() == "sent", line
        wait_received(shard.stub, received + int(4 * BIG_N * fraction))  # everything it sent is in
    finally:
        child.kill()
        child.wait(timeout=TIMEOUT)
        child.stdout.close()
    assert_unchanged(before, snapshot(shard.stub, [big_var]), "a push whose client was killed")
    assert_serving(shard, good_push=big_var)


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
    value = initial_value() if value is None else value
    return ps_pb2.CreateRequest(spec=spec_of(name, value, optimizer, **hyper))


def _chunk_msgs(name, value=None):
    value = initial_value() if value is None else value
    return [ps_pb2.CreateRequest(chunk=c) for c in codec.encode_chunks(name, value, CHUNK)]


CREATE_CASES = {
    # name -> (requests for a fresh name n, error class, fragments)
    "chunk-before-spec": (lambda n: _chunk_msgs(n) + create_requests(n, initial_value()),
                          "MalformedStreamError", ["does not follow a spec"]),
    "spec-without-value": (lambda n: [_spec_msg(n)], "MalformedStreamError", ["stream ended before"]),
    "spec-with-partial-value": (lambda n: [_spec_msg(n), *_chunk_msgs(n)[:2]], "MalformedStreamError",
                                ["initial value"]),
    "partial-value-then-next-spec": (lambda n: [_spec_msg(n), *_chunk_msgs(n)[:2]] + create_requests(n + "/b", initial_value()),
                                     "MalformedStreamError", ["initial value"]),
    "spec-without-value-then-next-variable": (lambda n: [_spec_msg(n)] + create_requests(n + "/b", initial_value()),
                                              "MalformedStreamError", ["initial value"]),
    "value-overrun-last-chunk": (lambda n: [_spec_msg(n), *_chunk_msgs(n)[:3], ps_pb2.CreateRequest(
        chunk=ps_pb2.TensorChunk(name=n, offset=3 * CHUNK, data=bytes(2 * CHUNK)))], "MalformedStreamError",
        [f"past the {B} bytes"]),
    "value-overrun-extra-chunk": (lambda n: [_spec_msg(n), *_chunk_msgs(n), ps_pb2.CreateRequest(
        chunk=ps_pb2.TensorChunk(name=n, offset=4 * N, data=b"1234"))], "MalformedStreamError", ["does not follow"]),
    "chunk-for-other-name": (lambda n: [_spec_msg(n), *_chunk_msgs(n + "/other")], "MalformedStreamError",
                             ["/other'", "does not follow"]),
    "chunk-meta-disagrees": (lambda n: [_spec_msg(n), *_chunk_msgs(n, torch.zeros(8, 8))], "TensorMismatchError",
                             ["float32[8, 8]", f"float32[{N}]"]),
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


@pytest.mark.parametrize("case", list(CREATE_CASES))
def test_create_bad_stream(shard, var, case):
    build, error_class, fragments = CREATE_CASES[case]
    fresh = f"new/{case}"
    requests = build(fresh)
    name_fragment = [] if case in ("spec-without-name", "unknown-optimizer", "second-variable-bad-optimizer",
                                   "invalid-lr", "unknown-hyperparameter", "chunk-for-other-name") else [repr(fresh)]
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


# -- numbers out of range ------------------------------------------------------------------------


def _header_with(**fields) -> ps_pb2.PushRequest:
    return ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="worker:7", **{"step_increment": 1, **fields}))


NUMBERS = {
    "pull-chunk-below-the-minimum": (lambda s, v: list(s.Pull(ps_pb2.PullRequest(names=[v], chunk_bytes=1),
                                                               timeout=TIMEOUT)), "chunk_bytes"),
    "pull-negative-min-step": (lambda s, v: list(s.Pull(ps_pb2.PullRequest(names=[v], min_step=-5), timeout=TIMEOUT)),
                               "min_step"),
    "push-step-increment-2": (lambda s, v: push(s, push_msgs(_header_with(step_increment=2), *chunks(v, good_grad()))),
                              "step_increment"),
    "push-step-increment-minus-1000": (lambda s, v: push(s, push_msgs(_header_with(step_increment=-1000),
                                                                      *chunks(v, good_grad()))), "step_increment"),
    "push-negative-step": (lambda s, v: push(s, push_msgs(_header_with(step=-1), *chunks(v, good_grad()))),
                           "push step"),
    "list-wait-nan": (lambda s, v: s.ListVariables(ps_pb2.ListRequest(names=["x"], wait_seconds=float("nan")),
                                                   timeout=TIMEOUT), "wait_seconds"),
    "configure-lease-nan": (lambda s, v: s.Configure(ps_pb2.SyncConfig(mode="sync", total_num_replicas=2,
                                                                       lease_seconds=float("nan")), timeout=TIMEOUT),
                            "lease_seconds"),
    "configure-huge-replicas": (lambda s, v: s.Configure(ps_pb2.SyncConfig(mode="sync", total_num_replicas=10 ** 9),
                                                         timeout=TIMEOUT), "total_num_replicas"),
    "update-lr-nan": (lambda s, v: s.UpdateOptimizer(ps_pb2.UpdateOptimizerRequest(names=[v], hyperparams={
        "lr": float("nan")}), timeout=TIMEOUT), "finite"),
    "update-lr-negative": (lambda s, v: s.UpdateOptimizer(ps_pb2.UpdateOptimizerRequest(names=[v], hyperparams={
        "lr": -1.0}), timeout=TIMEOUT), "Invalid learning rate"),
    "update-nesterov-2": (lambda s, v: s.UpdateOptimizer(ps_pb2.UpdateOptimizerRequest(names=[v], hyperparams={
        "nesterov": 2.0}), timeout=TIMEOUT), "flags 0 or 1"),
    "create-lr-nan": (lambda s, v: create(s, v + "/nan", initial_value(), lr=float("nan")), "finite"),
    "save-negative-step": (lambda s, v: s.Save(ps_pb2.SaveRequest(step=-3), timeout=TIMEOUT), "step must be"),
}


@pytest.mark.parametrize("case", list(NUMBERS))
def test_numbers_out_of_range_are_invalid_and_change_nothing(shard, var, case):
    call, fragment = NUMBERS[case]
    check_rejected(shard, lambda: call(shard.stub, var), INVALID, None, fragment, good_push=var)


def test_shutdown_answers_a_waiting_pull_unavailable_never_with_values(local_cluster):
    local = local_cluster(1)
    doomed = _connect(local)
    try:
        assert create(doomed.stub, "w", initial_value()) == [True]
        result: list = []
        thread = threading.Thread(target=lambda: result.append(_pull_or_error(doomed.stub, "w", 10)), daemon=True)
        thread.start()
        wait_until(lambda: status_of(doomed.stub).waiting_calls == 1, TIMEOUT, "the pull to wait for step 10")
        doomed.stub.Shutdown(ps_pb2.ShutdownRequest(reason="the test"), timeout=TIMEOUT)
        thread.join(TIMEOUT)
        assert isinstance(result[0], grpc.RpcError), f"the waiting pull returned {result[0]!r} below its min_step"
        assert result[0].code() == grpc.StatusCode.UNAVAILABLE, result[0].details()
    finally:
        doomed.channel.close()


def _pull_or_error(stub, name: str, min_step: int):
    try:
        return list(stub.Pull(ps_pb2.PullRequest(names=[name], min_step=min_step), timeout=TIMEOUT))
    except grpc.RpcError as exc:
        return exc
