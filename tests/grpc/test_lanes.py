"""Bulk lanes against real shards: the same bytes as inline, and every way a lane can fail applies nothing.

Hand-made calls go through the generated stub with a lane opened by torchps.lanes.connect, so a test can
break the lane at a chosen point: half a frame then gone, no frame at all, a lane another call holds, a key
the shard never gave. Each check waits for the event (the failed call's handler has returned: GetStatus's
calls_done) before it compares, never a sleep.
"""

from __future__ import annotations

import socket

import grpc
import pytest
import torch
from helpers import wait_until

from torchps import lanes as lane_wire
from torchps import wire
from torchps.client import Optimizer, PSClient
from torchps.lanes import connect
from torchps.proto import ps_pb2, ps_pb2_grpc

MIB = 1 << 20
N = 2 * MIB // 4  # float32 elements: 2 MiB, over the client's lane threshold
TIMEOUT = 30.0


def test_pulls_and_pushes_over_lanes_match_inline_ones_bit_for_bit(local_cluster):
    local = local_cluster(1)
    values = {"w": torch.randn(N), "b": torch.randn(3)}
    grads = {"w": torch.randn(N), "b": torch.randn(3)}
    results = {}
    for lanes in (True, False):
        with PSClient(local.cluster, lanes=lanes) as ps:
            prefix = "lane/" if lanes else "inline/"
            ps.create_variables({prefix + k: v.clone() for k, v in values.items()}, Optimizer("sgd", lr=0.5))
            for _ in range(3):
                ps.push({prefix + k: g for k, g in grads.items()})
            targets = {prefix + k: torch.empty_like(v) for k, v in values.items()}
            ps.pull_into(targets)
            results[lanes] = {k.partition("/")[2]: t for k, t in targets.items()}
            assert (ps._lanes.opened == 1) == lanes  # one lane, kept for every call after the first
            copied = ps.stats.bytes_copied
            stages = ps.stats.as_dict()["stage_seconds"]  # the client's own timers, by stage
            assert {"push_call", "push_encode", "pull_call", "pull_into_place"} <= set(stages)
            assert ("push_lane_send" in stages) == lanes
        if lanes:
            lane_copied = copied
    assert torch.equal(results[True]["w"], results[False]["w"]) and torch.equal(results[True]["b"],
                                                                                 results[False]["b"])
    torch.testing.assert_close(results[True]["w"], values["w"] - 1.5 * grads["w"])
    assert lane_copied < copied / 10  # the lane's bytes are only sent and received, never copied here


def test_a_secure_shard_and_a_shard_started_with_no_lanes_offer_none(local_cluster):
    local = local_cluster(1, server_args=["--no-lanes"])
    with PSClient(local.cluster) as ps:
        assert ps.status(0).lane_port == 0
        ps.create_variables({"v": torch.zeros(N)}, Optimizer("sgd", lr=1.0))
        ps.push({"v": torch.ones(N)})
        assert ps._lanes.opened == 0
        torch.testing.assert_close(ps.pull(["v"])["v"], -torch.ones(N))


class Raw:
    """A shard with one 2 MiB variable "v" of zeros, reached through the generated stub."""

    def __init__(self, local):
        self.local = local
        self.ps = PSClient(local.cluster, lanes=False)
        self.ps.create_variables({"v": torch.zeros(N)}, Optimizer("sgd", lr=1.0))
        self.channel = grpc.insecure_channel(local.cluster.ps[0])
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        service = "/" + ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
        self.push = self.channel.stream_unary(f"{service}/Push", request_serializer=None,  # serialized requests
                                              response_deserializer=ps_pb2.PushResponse.FromString)
        self.port = self.ps.status(0).lane_port
        assert self.port

    def lane(self):
        return connect("127.0.0.1", self.port, TIMEOUT)

    def push_messages(self, lane, seq: int, grad: torch.Tensor):
        """A one-message push of "v" whose bytes go on `lane` (sent by the caller)."""
        header = ps_pb2.PushHeader(worker="raw", incarnation=7, seq=seq, step_increment=1, tensors=1,
                                   lane=lane.key)
        meta = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[N])
        return wire.encode_push_request(header, [("v", meta, 0, memoryview(grad.numpy()).cast("B"), 0)],
                                        lane=True)

    def settled(self) -> ps_pb2.StatusResponse:
        """GetStatus once every call but this one has returned."""
        return wait_until(lambda: (lambda s: s if s.calls_done + 1 == s.calls_started else None)(
            self.ps.status(0)), TIMEOUT, "the shard's calls to return")

    def value(self) -> torch.Tensor:
        return self.ps.pull(["v"])["v"]

    def close(self):
        self.ps.close()
        self.channel.close()


@pytest.fixture
def raw(local_cluster):
    shard = Raw(local_cluster(1, server_args=["--stream-idle-seconds", "3"]))
    yield shard
    shard.close()


def test_a_lane_cut_halfway_through_a_push_applies_nothing_and_the_retry_applies_once(raw):
    grad = torch.ones(N)
    lane = raw.lane()
    message = raw.push_messages(lane, 1, grad)

    def requests():
        yield message
        header = lane_wire._FRAME.pack(lane_wire.FRAME_MAGIC, 0, 4 * N)
        lane.sock.sendall(header + bytes(MIB))  # half the frame, then the lane is gone
        lane.close()

    with pytest.raises(grpc.RpcError) as failed:
        raw.push(requests(), timeout=TIMEOUT)
    assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    status = raw.settled()
    assert status.step == 0
    assert torch.equal(raw.value(), torch.zeros(N))
    for attempt in range(2):  # the retry (same number) applies; a second retry is a duplicate
        lane = raw.lane()
        message = raw.push_messages(lane, 1, grad)

        def whole():
            yield message
            lane.send([memoryview(grad.numpy()).cast("B")], TIMEOUT)

        assert raw.push(whole(), timeout=TIMEOUT).duplicate == (attempt == 1)
    assert torch.equal(raw.value(), -grad)
    assert raw.ps.status(0).step == 1


def test_a_push_whose_lane_never_sends_ends_at_the_stream_idle_limit_having_applied_nothing(raw):
    lane = raw.lane()
    with pytest.raises(grpc.RpcError) as failed:
        raw.push(iter([raw.push_messages(lane, 1, torch.ones(N))]), timeout=TIMEOUT)
    # Whichever ends it first: the stream's idle watch, or the lane's read at the same limit.
    assert failed.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    assert "nothing was applied" in failed.value.details()
    raw.settled()
    assert torch.equal(raw.value(), torch.zeros(N)) and raw.ps.status(0).step == 0


def test_unknown_or_busy_lanes_and_lane_chunks_without_a_lane_are_refused(raw):
    grad = torch.ones(N)
    lane = raw.lane()
    unknown = ps_pb2.PullRequest(names=["v"], lane=b"x" * 16)
    with pytest.raises(grpc.RpcError) as failed:
        list(raw.stub.Pull(unknown, timeout=TIMEOUT))
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE and "not open on this shard" in failed.value.details()
    # Lane chunks in a push that names no lane: INVALID_ARGUMENT.
    message = raw.push_messages(lane, 1, grad)
    header, chunks, _ = wire.decode_push_request(message)
    header.lane = b""
    meta = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[N])
    bare = wire.encode_push_request(header, [("v", meta, 0, memoryview(grad.numpy()).cast("B"), 0)], lane=True)
    with pytest.raises(grpc.RpcError) as failed:
        raw.push(iter([bare]), timeout=TIMEOUT)
    assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "names none" in failed.value.details()
    raw.settled()
    assert torch.equal(raw.value(), torch.zeros(N)) and raw.ps.status(0).step == 0


def test_garbage_on_the_lane_port_never_hurts_the_shard(raw):
    for junk in (b"", b"GET / HTTP/1.1\r\n\r\n", b"\xff" * 4096):
        with socket.create_connection(("127.0.0.1", raw.port), timeout=TIMEOUT) as sock:
            welcome = sock.recv(64)
            assert welcome.startswith(lane_wire.WELCOME)
            sock.sendall(junk)
    # The shard still serves, on lanes too.
    with PSClient(raw.local.cluster) as ps:
        ps.declare({"v": torch.zeros(N)})
        ps.push({"v": torch.ones(N)})
        target = {"v": torch.empty(N)}
        ps.pull_into(target)
        assert ps._lanes.opened == 1
    torch.testing.assert_close(target["v"], -torch.ones(N))
    assert raw.local.procs[0].poll() is None


def test_a_client_retries_a_pull_whose_lane_the_shard_lost(raw):
    """The shard closed the client's idle lane (here: the test closes the client's end under it): the next pull
    fails on it, is retried on a new lane and gets the values."""
    with PSClient(raw.local.cluster) as ps:
        ps.declare({"v": torch.zeros(N)})
        target = {"v": torch.empty(N)}
        ps.pull_into(target)
        (idle,) = ps._lanes._idle[0]
        idle.sock.shutdown(socket.SHUT_RDWR)
        ps.push({"v": torch.ones(N)})
        ps.pull_into(target)
        assert ps._lanes.opened >= 2
    torch.testing.assert_close(target["v"], -torch.ones(N))


def test_a_tls_shard_s_lanes_are_tls_and_refuse_a_client_without_the_job_s_certificate(local_cluster, tmp_path):
    from torchps.certs import make_job_credentials
    from torchps.client import TaskSpec
    from torchps.cluster import Cluster
    from torchps.lanes import tls_context
    from torchps.security import Security

    chief, ps_task = TaskSpec("chief", 0), TaskSpec("ps", 0)
    files = make_job_credentials(tmp_path / "job", Cluster(ps=("127.0.0.1:1",), chief=("127.0.0.1:2",)))
    ours = make_job_credentials(tmp_path / "other", Cluster(ps=("127.0.0.1:1",), chief=("127.0.0.1:2",)))

    def security(found) -> Security:
        f = found[chief]
        return Security.load(tls_cert=str(f.cert), tls_key=str(f.key), tls_ca=str(f.ca), token_file=str(f.token),
                             admin_token_file=str(f.admin_token), environ={})

    p = files[ps_task]
    local = local_cluster(1, server_args=["--tls-cert", str(p.cert), "--tls-key", str(p.key), "--tls-ca", str(p.ca),
                                          "--token-file", str(p.token), "--admin-token-file",
                                          str(files[chief].admin_token)])
    with PSClient(local.cluster, task=chief, security=security(files)) as ps:
        port = ps.status(0).lane_port
        ps.create_variables({"v": torch.zeros(N)}, Optimizer("sgd", lr=1.0))
        ps.push({"v": torch.ones(N)})
        target = {"v": torch.empty(N)}
        ps.pull_into(target)
        assert ps._lanes.opened >= 1  # on a TLS lane (one given up under load is retried on a new one)
        torch.testing.assert_close(target["v"], -torch.ones(N))
        # Plaintext, or TLS with another job's certificate: no welcome, no lane.
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
            sock.sendall(b"TPSW" + bytes(16))
            try:
                answer = sock.recv(64)
            except ConnectionResetError:  # the handshake failed: the shard closed it
                answer = b""
            assert not answer.startswith(lane_wire.WELCOME)
        with pytest.raises(Exception, match="cannot open a bulk lane"):
            connect("127.0.0.1", port, TIMEOUT, tls_context(security(ours), server=False))
        ps.push({"v": torch.ones(N)})  # the shard serves on
        ps.pull_into(target)
    torch.testing.assert_close(target["v"], -2 * torch.ones(N))


def test_an_overlapped_pull_lands_each_layer_from_a_lane(local_cluster):
    """overlap=True pulls layer by layer in background threads: on lanes too, to the same values as inline."""
    local = local_cluster(1)
    results, copied = {}, {}
    for lanes in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 4))  # 2 MiB of weight
        with PSClient(local.cluster, lanes=lanes) as ps:
            binding = ps.register_module(model, Optimizer("sgd", lr=0.1), create=True,
                                         prefix="overlap-lane/" if lanes else "overlap-inline/", overlap=True)
            for _ in range(3):
                model(torch.ones(2, 1024)).sum().backward()
                binding.push()
                binding.pull()
            model(torch.ones(1, 1024))  # waits for the last pull, layer by layer
            results[lanes] = [p.detach().clone() for p in model.parameters()]
            copied[lanes] = ps.stats.bytes_copied
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    # Inline, each pulled and pushed byte is copied into or out of its message; on lanes, none of them.
    assert copied[True] < 0.6 * copied[False], copied


def test_a_small_model_s_exchange_is_one_inline_call_timed_as_such(local_cluster):
    """Below lane_min_bytes a step's push and pull are one PushPull per shard, inline, and its timer says so."""
    local = local_cluster(1)
    model = torch.nn.Linear(16, 4)
    with PSClient(local.cluster) as ps:
        binding = ps.register_module(model, Optimizer("sgd", lr=0.1), create=True, prefix="small-exchange/")
        model(torch.ones(2, 16)).sum().backward()
        binding.exchange()
        stages = ps.stats.as_dict()["stage_seconds"]
        assert stages.get("exchange_call", 0) > 0 and ps._lanes.opened == 0, stages


def test_a_call_with_no_bytes_sends_no_frame_and_the_lane_stays_in_step(local_cluster):
    """A push of only empty tensors borrows a lane (lane_min_bytes 0) but sends no frame, as its messages carry
    no lane_bytes for the shard to read; the next calls use the same lane, in step."""
    local = local_cluster(1)
    with PSClient(local.cluster, lane_min_bytes=0) as ps:
        ps.create_variables({"e": torch.zeros(0), "w": torch.zeros(N)}, Optimizer("sgd", lr=1.0))
        ps.push({"e": torch.zeros(0)})
        ps.push({"w": torch.ones(N)})
        target = torch.empty(N)
        ps.pull_into({"w": target})
        assert ps._lanes.opened == 1  # a frame the shard never read would have broken it: a second lane
    torch.testing.assert_close(target, -torch.ones(N))
