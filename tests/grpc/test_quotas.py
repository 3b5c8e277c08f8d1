"""A shard's limits against real ps-server processes: memory for values and optimizer state, one
variable's size, calls per client. Over a limit: RESOURCE_EXHAUSTED naming it, nothing changed, and the
shard keeps serving everyone else."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from torchps import codec
from torchps.client import Optimizer, PSClient, ResourceExhaustedError, ShardBusyError
from torchps.proto import ps_pb2

from helpers import run_ps_server, wait_until

QUARTER = 1 << 16  # float32 elements: 256 KiB


def names_on(client: PSClient) -> list[str]:
    return [info.spec.name for info in client.list_variables()]


def test_max_memory_counts_values_and_optimizer_state_before_allocating(local_cluster):
    local = local_cluster(1, server_args=["--max-memory", "1M"])
    with PSClient(local.cluster, connect_timeout=2) as client:
        client.create_variables({"adam": torch.zeros(QUARTER)}, Optimizer("adam", lr=0.1))  # 256K + 2 x 256K
        client.create_variables({"plain": torch.zeros(QUARTER)}, Optimizer("sgd", lr=0.1))  # 256K: at the limit
        with pytest.raises(ResourceExhaustedError, match="--max-memory") as info:
            client.create_variables({"one-more": torch.zeros(1)}, Optimizer("sgd", lr=0.1))
        assert "'one-more'" in str(info.value)
        with pytest.raises(ResourceExhaustedError, match="--max-memory"):  # momentum doubles sgd's bytes
            client.create_variables({"big": torch.zeros(QUARTER * 8)}, Optimizer("sgd", lr=0.1, momentum=0.9))
        assert names_on(client) == ["adam", "plain"], "nothing was created"
        with pytest.raises(ResourceExhaustedError, match="to be received.*--max-memory"):  # pushes count too
            client.push({"adam": torch.ones(QUARTER), "plain": torch.ones(QUARTER)})
        assert torch.equal(client.pull(["plain"])["plain"], torch.zeros(QUARTER)), "the shard keeps serving"
        assert client.status(0).step == 0
        assert client.create_variables({"adam": torch.zeros(QUARTER)}, Optimizer("adam", lr=0.1)) == \
            {"adam": False}, "re-creating an existing variable needs no new memory"


def memory_kib(pid: int) -> dict[str, int]:
    """The process's resident (VmRSS) and peak virtual (VmPeak) memory in KiB, from /proc."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmPeak")}


def declared(name: str, elements: int) -> list[ps_pb2.CreateRequest]:
    """A CreateVariables stream declaring `elements` float32 (sgd), with the first MiB of its value."""
    spec = ps_pb2.VariableSpec(name=name, meta=ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[elements]),
                               optimizer=ps_pb2.OptimizerSpec(name="sgd", hyperparams={"lr": 0.1}))
    return [ps_pb2.CreateRequest(count=1, spec=spec),
            ps_pb2.CreateRequest(chunk=ps_pb2.TensorChunk(name=name, offset=0, data=bytes(1 << 20)))]


def create_variables_call(channel: grpc.Channel):
    return channel.stream_unary("/torchps.v1.ParameterServer/CreateVariables",
                                request_serializer=ps_pb2.CreateRequest.SerializeToString,
                                response_deserializer=ps_pb2.CreateResponse.FromString)


def test_a_variable_declared_far_over_max_memory_is_refused_before_anything_is_allocated(local_cluster):
    local = local_cluster(1, server_args=["--max-memory", "1M"])
    with PSClient(local.cluster, connect_timeout=2) as client, grpc.insecure_channel(local.cluster.ps[0]) as channel:
        client.create_variables({"plain": torch.zeros(QUARTER)}, Optimizer("sgd", lr=0.1))
        create = create_variables_call(channel)
        with pytest.raises(grpc.RpcError) as warm:  # the refusal's code path runs once before measuring
            create(iter(declared("warm-up", QUARTER * 8)), timeout=10)
        assert warm.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        before = memory_kib(local.procs[0].pid)
        with pytest.raises(grpc.RpcError) as info:
            create(iter(declared("huge", 1 << 30)), timeout=10)  # 4 GiB
        after = memory_kib(local.procs[0].pid)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert "'huge'" in info.value.details() and "--max-memory" in info.value.details()
        assert after["VmRSS"] - before["VmRSS"] < 8 << 10, f"the shard's RSS grew: {before} -> {after}"
        assert after["VmPeak"] - before["VmPeak"] < 1 << 20, f"the shard reserved the 4 GiB: {before} -> {after}"
        assert names_on(client) == ["plain"] and client.status(0).total_bytes == 4 * QUARTER


def test_max_variable_bytes_refuses_one_variable_too_big(local_cluster):
    local = local_cluster(1, server_args=["--max-variable-bytes", "64K"])
    with PSClient(local.cluster, connect_timeout=2) as client:
        client.create_variables({"small": torch.zeros(100)})
        with pytest.raises(ResourceExhaustedError, match="'large' declares 65540 bytes.*--max-variable-bytes 65536"):
            client.create_variables({"large": torch.zeros(QUARTER // 4 + 1)})
        assert names_on(client) == ["small"]


def test_max_calls_per_client_refuses_the_extra_call_not_the_others(local_cluster):
    local = local_cluster(1, server_args=["--max-calls-per-client", "1"])
    with PSClient(local.cluster, connect_timeout=1) as client, PSClient(local.cluster, connect_timeout=5) as other:
        client.create_variables({"v": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        waiting = threading.Thread(target=lambda: client.pull_into({"v": torch.zeros(2)}, min_step=1), daemon=True)
        waiting.start()
        wait_until(lambda: other.status(0).waiting_calls == 1, 20, "the first client's pull to wait")
        with pytest.raises(ShardBusyError, match="--max-calls-per-client"):  # retried for connect_timeout
            client.status(0)
        other.declare({"v": torch.zeros(2)})
        other.push({"v": torch.ones(2)})  # another client is served, and releases the waiting pull
        waiting.join(20)
        assert not waiting.is_alive() and client.status(0).step == 1


def test_a_held_name_redeclared_bigger_is_refused_before_its_value_is_taken_in(local_cluster):
    """A stream re-declaring a held variable with another shape is a conflict at its spec: the shard does
    not reserve the declared 4 GiB for the value that would follow."""
    local = local_cluster(1, server_args=["--max-memory", "1M"])
    with PSClient(local.cluster, connect_timeout=2) as client, grpc.insecure_channel(local.cluster.ps[0]) as channel:
        client.create_variables({"plain": torch.zeros(QUARTER)}, Optimizer("sgd", lr=0.1))
        create = create_variables_call(channel)
        before = memory_kib(local.procs[0].pid)
        with pytest.raises(grpc.RpcError) as info:
            create(iter(declared("plain", 1 << 30)), timeout=10)
        after = memory_kib(local.procs[0].pid)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS, info.value.details()
        assert "already exists" in info.value.details() and "'plain'" in info.value.details()
        assert after["VmPeak"] - before["VmPeak"] < 1 << 20, f"the shard reserved the 4 GiB: {before} -> {after}"
        assert torch.equal(client.pull(["plain"])["plain"], torch.zeros(QUARTER))


def test_two_creations_at_once_cannot_pass_max_memory_together(local_cluster):
    """Stream A declares 768 KiB and waits; stream B creates 768 KiB meanwhile; A's value then arrives:
    the limit is checked again when A creates, so A is refused and the shard holds B alone."""
    local = local_cluster(1, server_args=["--max-memory", "1M"])
    elements = 3 << 16
    first_spec, first_value = declared("a", elements)
    first_value.chunk.data = bytes(4 * elements)
    release = threading.Event()

    def stream_a():
        yield first_spec
        release.wait(30)
        yield first_value

    with PSClient(local.cluster, connect_timeout=2) as client, grpc.insecure_channel(local.cluster.ps[0]) as channel:
        create = create_variables_call(channel)
        calls_before = client.status(0).calls_started
        a = create.future(stream_a(), timeout=30)
        wait_until(lambda: client.status(0).calls_started >= calls_before + 2, 10, "stream A's handler running")
        client.create_variables({"b": torch.zeros(elements)}, Optimizer("sgd", lr=0.1))
        release.set()
        with pytest.raises(grpc.RpcError) as info:
            a.result()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-memory" in info.value.details()
        assert "now holds" in info.value.details(), f"refused at its spec, before B existed? {info.value.details()}"
        assert names_on(client) == ["b"] and client.status(0).total_bytes == 4 * elements


def test_optimizer_state_an_update_adds_counts_against_max_memory(local_cluster):
    """Turning momentum on (before the first step) adds a buffer the size of the variable: UpdateOptimizer checks
    it against --max-memory like a creation, and GetStatus counts it once accepted."""
    local = local_cluster(1, server_args=["--max-memory", "1M"])
    with PSClient(local.cluster, connect_timeout=2) as client:
        client.create_variables({"big": torch.zeros(3 * QUARTER)}, Optimizer("sgd", lr=0.1))  # 768K, no state
        with pytest.raises(ResourceExhaustedError, match="--max-memory"):
            client.set_hyperparams(["big"], momentum=0.9)  # + 768K of momentum
        assert client.status(0).state_bytes == 0, "nothing changed"
        client.create_variables({"small": torch.zeros(QUARTER // 2)}, Optimizer("sgd", lr=0.1))  # 128K
        assert client.set_hyperparams(["small"], momentum=0.9) == 1  # + 128K: 1M in all, at the limit
        assert client.status(0).state_bytes == 4 * QUARTER // 2
        with pytest.raises(ResourceExhaustedError, match="--max-memory"):
            client.create_variables({"one-more": torch.zeros(1)}, Optimizer("sgd", lr=0.1))


def _scrape(port: int) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels}


def _push_call(channel: grpc.Channel):
    return channel.stream_unary("/torchps.v1.ParameterServer/Push", request_serializer=ps_pb2.PushRequest.SerializeToString,
                                response_deserializer=ps_pb2.PushResponse.FromString)


def test_pushes_being_received_count_against_max_memory(local_cluster):
    """A push's buffers are reserved before they are allocated: with 512 KiB held and a first push's 512 KiB
    arriving, a second push at once would pass --max-memory 1M and is refused (RESOURCE_EXHAUSTED, nothing
    applied); once the first is applied, the next push is served."""
    local = local_cluster(1, server_args=["--max-memory", "1M", "--metrics-port", "0"])
    n = 2 * QUARTER  # 512 KiB of float32
    release = threading.Event()
    gradient = list(codec.encode_chunks("w", torch.ones(n), 64 << 10))

    def slow_push():  # the first chunk, then the rest once released
        yield ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="slow", seq=1, tensors=1), chunks=[gradient[0]])
        release.wait(30)
        for chunk in gradient[1:]:
            yield ps_pb2.PushRequest(chunks=[chunk])

    with PSClient(local.cluster, connect_timeout=2) as client, grpc.insecure_channel(local.cluster.ps[0]) as channel:
        client.create_variables({"w": torch.zeros(n)}, Optimizer("sgd", lr=1.0))
        port = client.status(0).metrics_port
        push = _push_call(channel)
        first = push.future(slow_push(), timeout=30)
        wait_until(lambda: _scrape(port)["torchps_push_receiving_bytes"] == 4 * n, 20, "the first push's reservation")
        with pytest.raises(grpc.RpcError) as info:
            push(iter([ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="fast", seq=1, tensors=1),
                                          chunks=gradient)]), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-memory" in info.value.details()
        release.set()
        assert first.result().versions["w"] == 1
        assert _scrape(port)["torchps_push_receiving_bytes"] == 0
        client.push({"w": torch.ones(n)})
        assert torch.equal(client.pull(["w"])["w"], -2 * torch.ones(n)), "the refused push changed nothing"


def test_a_rows_push_declaring_more_rows_than_the_budget_is_refused_before_allocating(local_cluster):
    """A ROWS tensor's first chunk declares its row count: rows x (8 + dim x 4) bytes are reserved within
    --max-memory before the buffer is made, so a push declaring far more is refused at once."""
    from torch import nn

    from torchps.client import Embedding

    local = local_cluster(1, server_args=["--max-memory", "1M"])
    with PSClient(local.cluster, connect_timeout=2) as client, grpc.insecure_channel(local.cluster.ps[0]) as channel:
        model = nn.ModuleDict({"emb": Embedding(1000, 16, optimizer=Optimizer("sgd", lr=1.0))})
        client.register_module(model, Optimizer("sgd", lr=1.0), create=True, join=False)
        name = model["emb"].table_name
        meta = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[1 << 24, 16], encoding=ps_pb2.ROWS)  # 1.2 GB declared
        chunk = ps_pb2.TensorChunk(name=name, meta=meta, offset=0, data=bytes(64 << 10))
        before = memory_kib(local.procs[0].pid)
        with pytest.raises(grpc.RpcError) as info:
            _push_call(channel)(iter([ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="w", seq=1, tensors=1),
                                                         chunks=[chunk])]), timeout=10)
        after = memory_kib(local.procs[0].pid)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-memory" in info.value.details()
        assert after["VmPeak"] - before["VmPeak"] < 64 << 10, f"the shard reserved the rows: {before} -> {after}"


def test_max_memory_as_a_share_of_the_machines_memory(local_cluster):
    """--max-memory P%: P percent of what the process may use (the machine's memory, or its cgroup's limit),
    logged at start and enforced like a size."""
    from torchps.memory import memory_limit

    percent = 100 * (1 << 20) / memory_limit()  # about 1 MiB on any machine
    local = local_cluster(1, server_args=["--max-memory", f"{percent!r}%"])
    limit = int(memory_limit() * percent / 100)
    assert f"ps 0 holds at most {limit} bytes (--max-memory)" in local.log(0)
    with PSClient(local.cluster, connect_timeout=2) as client:
        client.create_variables({"most": torch.zeros((limit - (64 << 10)) // 4)}, Optimizer("sgd", lr=0.1))
        with pytest.raises(ResourceExhaustedError, match="--max-memory"):
            client.create_variables({"more": torch.zeros(QUARTER)}, Optimizer("sgd", lr=0.1))


def test_a_checkpoint_relaid_out_over_max_memory_is_refused_at_start(local_cluster, tmp_path):
    """A re-layout counts against --max-memory: two shards' 256 KiB each, onto one shard allowed 256 KiB, is one
    line and exit code 2 before the shard serves (and fits one allowed 1 MiB)."""
    source = local_cluster(2, server_args=["--checkpoint-dir", str(tmp_path / "ckpt"), "--no-journal"])
    with PSClient(source.cluster, connect_timeout=10) as client:
        client.create_variables({"a": torch.ones(QUARTER), "b": torch.ones(QUARTER)}, Optimizer("sgd", lr=0.1))
        assert client.status(0).num_variables == client.status(1).num_variables == 1
        client.save_checkpoint(0)
    flags = ["--index", "0", "--bind", "127.0.0.1:0", "--insecure", "--restore-from", str(tmp_path / "ckpt"),
             "--num-ps", "1", "--max-memory", "256K"]
    code, printed = run_ps_server(flags, tmp_path / "refused.log", 120)
    assert code == 2, printed
    (line,) = [line for line in printed.splitlines() if line.startswith("ps-server: error:")]
    assert f"would restore {8 * QUARTER} bytes" in line and f"--max-memory {4 * QUARTER}" in line, line
    fits = local_cluster(1, server_args=["--restore-from", str(tmp_path / "ckpt"), "--num-ps", "1",
                                         "--max-memory", "1M"])
    with PSClient(fits.cluster, connect_timeout=10) as client:
        client.declare({"a": torch.zeros(QUARTER), "b": torch.zeros(QUARTER)})
        assert torch.equal(client.pull(["a"])["a"], torch.ones(QUARTER))
