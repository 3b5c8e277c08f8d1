"""Wire compression against a real ps-server process: casts both ways, top-k with error feedback, sync
aggregation of compressed pushes, and malformed compressed input sent straight through the generated stubs
(INVALID_ARGUMENT, the variable unchanged, as any bad push).

One async shard serves the module (distinct variable names per test); the sync test has its own. Nothing
is ordered by sleeping: a sync push's reply is the event that its step was released.
"""

from __future__ import annotations

import math
import threading

import grpc
import pytest
import torch

from torchps import codec
from torchps.client import Compression, Optimizer, PSClient, TaskSpec
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.worker.local_cluster import LocalCluster

TIMEOUT = 30.0
N = 4096  # float32 elements of the test variables: 16 KiB, one chunk
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EVERYTHING = dict(min_bytes=0)  # compress whatever the size


@pytest.fixture(scope="module")
def local():
    with LocalCluster(1) as cluster:
        yield cluster


@pytest.fixture
def ps(local):
    with PSClient(local.cluster, connect_timeout=10.0) as client:
        yield client


@pytest.fixture(scope="module")
def stub(local):
    channel = grpc.insecure_channel(local.cluster.ps[0])
    yield ps_pb2_grpc.ParameterServerStub(channel)
    channel.close()


def values(n: int = N, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def status(stub) -> ps_pb2.StatusResponse:
    return stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT)


def version(stub, name: str) -> int:
    (info,) = stub.ListVariables(ps_pb2.ListRequest(names=[name]), timeout=TIMEOUT).variables
    return info.version


# -- casts --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, narrow, eps", [("bf16", torch.bfloat16, 2.0 ** -8),
                                               ("fp16", torch.float16, 2.0 ** -11)])
def test_cast_push_and_pull_round_trip(ps, stub, kind, narrow, eps):
    """The gradient travels narrow (its bytes counted by the shard), is applied in fp32 (an exact pull shows
    value - narrow(grad)), and an in-place pull brings the value back narrow, cast up into the fp32 target."""
    name = f"cast/{kind}"
    value, grad = values(seed=1), values(seed=2)
    ps.create_variables({name: value}, Optimizer("sgd", lr=1.0))
    ps.set_compression({name: Compression(kind, **EVERYTHING)})
    before = status(stub).push_bytes_received
    ps.push({name: grad})
    assert status(stub).push_bytes_received - before == N * narrow.itemsize
    expected = value - grad.to(narrow).float()
    assert torch.equal(ps.pull([name])[name], expected)  # the shard keeps fp32: pull() reads it as stored
    target = torch.zeros(N)
    ps.pull_into({name: target})
    assert torch.equal(target, expected.to(narrow).float())
    exact = value - grad
    assert (target - exact).abs().max() <= eps * (grad.abs() + exact.abs()).max()


def test_exchange_pulls_cast_and_min_bytes_keeps_small_tensors_whole(ps, stub):
    """push_pull (one PushPull per shard) casts both ways; a tensor under min_bytes travels as it is."""
    big, small = "ex/big", "ex/small"
    ps.create_variables({big: values(seed=3), small: values(16, seed=4)}, Optimizer("sgd", lr=1.0))
    ps.set_compression({name: Compression("bf16", min_bytes=1024) for name in (big, small)})
    targets = {big: torch.zeros(N), small: torch.zeros(16)}
    before = status(stub).push_bytes_received
    ps.push_pull({big: torch.ones(N), small: torch.ones(16)}, targets)
    assert status(stub).push_bytes_received - before == N * 2 + 16 * 4
    exact = ps.pull([big, small])
    assert torch.equal(targets[big], exact[big].to(torch.bfloat16).float())
    assert torch.equal(targets[small], exact[small])


def test_big_variable_pulled_cast_chunk_by_chunk(local, stub):
    """A variable larger than a chunk is cast a chunk's worth of whole elements at a time: element-aligned
    chunks of at most chunk_bytes, together the whole value narrow."""
    name, n = "cast/big", codec.MIN_CHUNK_BYTES + 5  # 4 chunks and 20 bytes as stored, 2 and 10 bytes cast
    value = values(n, seed=5)
    with PSClient(local.cluster, connect_timeout=10.0, chunk_bytes=codec.MIN_CHUNK_BYTES) as ps:
        ps.create_variables({name: value}, Optimizer("sgd", lr=1.0))
        ps.set_compression({name: Compression("fp16", **EVERYTHING)})
        target = torch.zeros(n)
        ps.pull_into({name: target})
    assert torch.equal(target, value.to(torch.float16).float())
    request = ps_pb2.PullRequest(names=[name], chunk_bytes=codec.MIN_CHUNK_BYTES, cast=[ps_pb2.BFLOAT16])
    chunks = [c for message in stub.Pull(request, timeout=TIMEOUT) for c in message.chunks]
    assert chunks[0].meta.dtype == ps_pb2.BFLOAT16 and list(chunks[0].meta.shape) == [n]
    assert [len(c.data) for c in chunks] == [codec.MIN_CHUNK_BYTES] * 2 + [10]
    assert [c.offset for c in chunks] == [0, codec.MIN_CHUNK_BYTES, 2 * codec.MIN_CHUNK_BYTES]
    data = b"".join(c.data for c in chunks)
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.bfloat16), value.to(torch.bfloat16))


# -- top-k with error feedback -------------------------------------------------------------------------------


def test_topk_push_applies_exactly_the_sent_entries(ps):
    """Server SGD (lr 1) moves exactly the k largest |gradient| entries; the rest is the worker's residual,
    sent by the next push once it is among the largest."""
    name, k = "topk/w", 41  # ceil(0.01 * 4096)
    value, grad = values(seed=6), values(seed=7)
    ps.create_variables({name: value}, Optimizer("sgd", lr=1.0))
    ps.set_compression({name: Compression("topk", ratio=0.01, **EVERYTHING)})
    ps.push({name: grad})
    top = grad.abs().topk(k).indices
    sent = torch.zeros(N)
    sent[top] = grad[top]
    assert torch.equal(ps.pull([name])[name], value - sent)
    residual = ps.compression_state_dict()[name]
    assert torch.equal(residual, grad - sent)
    ps.push({name: torch.zeros(N)})  # nothing new: the residual's own top-k goes
    again = residual.abs().topk(k).indices
    sent[again] += residual[again]
    assert torch.allclose(ps.pull([name])[name], value - sent)


def test_randomk_and_error_feedback_lose_nothing(ps):
    """Over several pushes, what the shard applied plus the final residual is the sum of the gradients."""
    name = "randomk/w"
    value = values(seed=8)
    ps.create_variables({name: value}, Optimizer("sgd", lr=1.0))
    ps.set_compression({name: Compression("randomk", ratio=0.05, **EVERYTHING)})
    grads = [values(seed=10 + i) for i in range(4)]
    for grad in grads:
        ps.push({name: grad})
    applied = value - ps.pull([name])[name]
    assert torch.allclose(applied + ps.compression_state_dict()[name], sum(grads), atol=1e-5)


def test_sync_mode_aggregates_compressed_pushes():
    """Two workers' top-k and bf16 pushes of one sync step are averaged and applied once."""
    with LocalCluster(1, workers=2) as local:
        value, grads = values(seed=20), [values(seed=21), values(seed=22)]
        kinds = [Compression("topk", ratio=0.25, **EVERYTHING), Compression("bf16", **EVERYTHING)]
        clients = [PSClient(local.cluster, task=TaskSpec("worker", i), connect_timeout=10.0, timeout=TIMEOUT)
                   for i in range(2)]
        try:
            clients[0].configure("sync", total_num_replicas=2)
            clients[0].create_variables({"sync/w": value}, Optimizer("sgd", lr=1.0))
            clients[1].declare({"sync/w": value})
            for client, kind in zip(clients, kinds):
                client.set_compression({"sync/w": kind})
                client.join()
            other = threading.Thread(target=clients[1].push, args=({"sync/w": grads[1]},))
            other.start()
            assert clients[0].push({"sync/w": grads[0]}) == 1  # released: both gradients arrived
            other.join(TIMEOUT)
            assert clients[1].step == 1
            sent = grads[0] - clients[0].compression_state_dict()["sync/w"]
            expected = value - (sent + grads[1].to(torch.bfloat16).float()) / 2
            assert torch.allclose(clients[0].pull(["sync/w"])["sync/w"], expected, atol=1e-6)
        finally:
            for client in clients:
                client.close()


# -- malformed compressed input -------------------------------------------------------------------------------


def _sparse(name: str, index: list[int], vals: list[float], *, nnz: int | None = None, index_dtype=torch.int32,
            shape=(N,), extra: bytes = b"") -> ps_pb2.TensorChunk:
    data = torch.tensor(index, dtype=index_dtype).numpy().tobytes() + torch.tensor(vals).numpy().tobytes()
    meta = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=list(shape), encoding=ps_pb2.SPARSE,
                             nnz=len(index) if nnz is None else nnz)
    return ps_pb2.TensorChunk(name=name, meta=meta, offset=0, data=data + extra)


def _dense(name: str, tensor: torch.Tensor, **meta_fields) -> ps_pb2.TensorChunk:
    meta = codec.meta_of(tensor)
    for key, value in meta_fields.items():
        setattr(meta, key, value)
    return ps_pb2.TensorChunk(name=name, meta=meta, offset=0, data=codec.tensor_bytes(tensor).tobytes())


# case -> (the chunk for variable `bad/w`, float32[N], the error class, a fragment of the details)
BAD_PUSHES = {
    "nnz-0": (lambda n: _sparse(n, [], [], nnz=0), "InvalidArgumentError", "nnz must be in [1, 4096]"),
    "nnz-over-numel": (lambda n: _sparse(n, list(range(N)) + [0], [1.0] * (N + 1)), "InvalidArgumentError",
                       "nnz must be in [1, 4096]"),
    "index-out-of-range": (lambda n: _sparse(n, [3, N], [1.0, 1.0]), "InvalidArgumentError", "out of range"),
    "negative-index": (lambda n: _sparse(n, [-1, 3], [1.0, 1.0]), "InvalidArgumentError", "out of range"),
    "repeated-index": (lambda n: _sparse(n, [3, 3], [1.0, 1.0]), "InvalidArgumentError", "strictly increasing"),
    "decreasing-index": (lambda n: _sparse(n, [7, 3], [1.0, 1.0]), "InvalidArgumentError", "strictly increasing"),
    "bytes-over": (lambda n: _sparse(n, [3], [1.0], extra=bytes(4)), "MalformedStreamError", "past the 8 bytes"),
    "bytes-short": (lambda n: _sparse(n, [3, 4], [1.0, 1.0], nnz=3), "MalformedStreamError",
                    "carries 16 bytes and is not its last"),
    "int64-indices": (lambda n: _sparse(n, [3, 4], [1.0, 1.0], index_dtype=torch.int64), "MalformedStreamError",
                      "past the 16 bytes"),
    "nan-value": (lambda n: _sparse(n, [3], [math.nan]), "NonFiniteGradientError", "NaN or Inf"),
    "inf-in-fp16": (lambda n: _dense(n, torch.full((N,), math.inf, dtype=torch.float16)), "NonFiniteGradientError",
                    "NaN or Inf"),
    "sparse-wrong-shape": (lambda n: _sparse(n, [3], [1.0], shape=(N, 1)), "TensorMismatchError", "float32[4096, 1]"),
    "fp16-wrong-shape": (lambda n: _dense(n, torch.ones(N + 1, dtype=torch.float16)), "TensorMismatchError",
                         "float16[4097]"),
    "dense-with-nnz": (lambda n: _dense(n, torch.ones(N), nnz=3), "InvalidArgumentError", "nnz is for SPARSE"),
    "unknown-encoding": (lambda n: _dense(n, torch.ones(N), encoding=7), "InvalidArgumentError", "unknown encoding"),
}


def _create(stub, name: str, value: torch.Tensor, optimizer: str = "sgd") -> None:
    spec = ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value), optimizer=ps_pb2.OptimizerSpec(
        name=optimizer, hyperparams={"lr": 1.0} if optimizer == "sgd" else {}))
    requests = [ps_pb2.CreateRequest(spec=spec)] + [ps_pb2.CreateRequest(chunk=c)
                                                    for c in codec.encode_chunks(name, value)]
    stub.CreateVariables(iter(requests), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def bad(stub):
    """Variables only malformed calls aim at: float32 `bad/w` (sgd), float16 `bad/h` (sgd), int64 `bad/i`."""
    originals = {"bad/w": values(seed=30), "bad/h": values(seed=31).half(), "bad/i": torch.arange(N)}
    for name, value in originals.items():
        _create(stub, name, value, "none" if name == "bad/i" else "sgd")
    return originals


def _header(**fields) -> ps_pb2.PushHeader:
    return ps_pb2.PushHeader(worker="worker:7", step=0, step_increment=1, tensors=1, **fields)


def _assert_rejected(stub, bad, call, error: str, fragment: str) -> None:
    """call() fails with INVALID_ARGUMENT, `error` and `fragment`; nothing on the shard changed."""
    versions = {name: version(stub, name) for name in bad}
    step = status(stub).step
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == INVALID, info.value.details()
    assert dict(info.value.trailing_metadata())["torchps-error"] == error, info.value.details()
    assert fragment in info.value.details()
    assert {name: version(stub, name) for name in bad} == versions and status(stub).step == step
    pulled = _values(stub, list(bad))
    assert all(torch.equal(pulled[name], value) for name, value in bad.items())


def _values(stub, names: list[str]) -> dict[str, torch.Tensor]:
    """The variables as stored, through the generated stub."""
    assembler, out = codec.ChunkAssembler(min_chunk=1), {}
    for message in stub.Pull(ps_pb2.PullRequest(names=names), timeout=TIMEOUT):
        for chunk in message.chunks:
            done = assembler.add(chunk)
            if done is not None:
                out[done[0]] = done[1]
    return out


@pytest.mark.parametrize("case", sorted(BAD_PUSHES))
def test_malformed_compressed_push_is_rejected_and_changes_nothing(stub, bad, case):
    make, error, fragment = BAD_PUSHES[case]
    request = ps_pb2.PushRequest(header=_header(), chunks=[make("bad/w")])
    _assert_rejected(stub, bad, lambda: stub.Push(iter([request]), timeout=TIMEOUT), error, fragment)


@pytest.mark.parametrize("name, tensor, fragment", [
    ("bad/i", torch.ones(N, dtype=torch.float16), "for float32 and float64 variables only"),
    ("bad/h", torch.ones(N, dtype=torch.bfloat16), "for float32 and float64 variables only"),
], ids=["fp16-for-int64", "bf16-for-fp16"])
def test_narrow_gradient_for_a_variable_that_is_not_fp32_or_fp64_is_rejected(stub, bad, name, tensor, fragment):
    request = ps_pb2.PushRequest(header=_header(), chunks=[_dense(name, tensor)])
    _assert_rejected(stub, bad, lambda: stub.Push(iter([request]), timeout=TIMEOUT), "TensorMismatchError", fragment)


def test_sparse_initial_value_is_rejected(stub, bad):
    """SPARSE is for pushes only: CreateVariables refuses it (and creates nothing)."""
    chunk = _sparse("bad/new", [3], [1.0])
    spec = ps_pb2.VariableSpec(name="bad/new", meta=chunk.meta, optimizer=ps_pb2.OptimizerSpec(name="none"))
    requests = [ps_pb2.CreateRequest(spec=spec), ps_pb2.CreateRequest(chunk=chunk)]
    _assert_rejected(stub, bad, lambda: stub.CreateVariables(iter(requests), timeout=TIMEOUT),
                     "InvalidArgumentError", "for pushes only")
    assert not stub.ListVariables(ps_pb2.ListRequest(names=["bad/new"]), timeout=TIMEOUT).variables


@pytest.mark.parametrize("names, cast, error, fragment", [
    (["bad/i"], [ps_pb2.BFLOAT16], "TensorMismatchError", "cast to BFLOAT16"),
    (["bad/h"], [ps_pb2.FLOAT16], "TensorMismatchError", "cast to FLOAT16"),
    (["bad/w"], [ps_pb2.FLOAT32], "TensorMismatchError", "cast to FLOAT32"),
    (["bad/w"], [99], "TensorMismatchError", "dtype#99"),
    (["bad/w", "bad/h"], [ps_pb2.BFLOAT16], "InvalidArgumentError", "Received 1"),
    ([], [ps_pb2.BFLOAT16], "InvalidArgumentError", "Received 1"),
], ids=["int64", "fp16-variable", "fp32-cast", "unknown-dtype", "too-few", "without-names"])
def test_cast_pull_the_contract_does_not_allow_is_rejected(stub, bad, names, cast, error, fragment):
    request = ps_pb2.PullRequest(names=names, cast=cast)
    _assert_rejected(stub, bad, lambda: list(stub.Pull(request, timeout=TIMEOUT)), error, fragment)


def test_push_pull_with_a_bad_pull_cast_applies_nothing(stub, bad):
    """PushPull checks pull_cast before it applies its push: the good gradient stays out too."""
    request = ps_pb2.PushRequest(header=_header(pull=["bad/i"], pull_cast=[ps_pb2.FLOAT16]),
                                 chunks=[_dense("bad/w", torch.ones(N))])
    _assert_rejected(stub, bad, lambda: stub.PushPull(request, timeout=TIMEOUT),
                     "TensorMismatchError", "cast to FLOAT16")
