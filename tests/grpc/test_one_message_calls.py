"""PushOne and PullOne: a push or pull of one message as a unary call, against a real shard.

A client sends a push or pull whose bytes fit in one message as PushOne / PullOne and a larger one as a Push
or Pull stream (the shard's Prometheus counter of calls by method shows which came); a PushOne is applied
exactly as Push applies the same message, its retry is answered as a duplicate and applies nothing, a
malformed one changes nothing; a PullOne waits for its min_step as Pull does and refuses what would not fit.
"""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
import torch
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from torchps import wire
from torchps.client import Optimizer, PSClient
from torchps.codec import MIN_CHUNK_BYTES as MIN_CHUNK
from torchps.proto import ps_pb2, ps_pb2_grpc

TIMEOUT = 30.0
CHUNK = 64 << 10  # the client's chunk_bytes: a push over it goes as a stream


def calls_by_method(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.labels["method"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "torchps_calls_total"}


def test_a_push_that_fits_one_message_is_one_unary_call_and_a_larger_one_a_stream(local_cluster):
    local = local_cluster(1, server_args=["--metrics-port", "0"])
    with PSClient(local.cluster, chunk_bytes=CHUNK) as ps:
        ps.create_variables({"small": torch.zeros(16), "large": torch.zeros(CHUNK)}, Optimizer("sgd", lr=1.0))
        port = ps.status(0).metrics_port
        before = calls_by_method(port)
        for _ in range(3):
            ps.push({"small": torch.ones(16)})
        ps.push({"large": torch.ones(CHUNK)})  # 4 x CHUNK bytes
        small, large = torch.empty(16), torch.empty(CHUNK)
        ps.pull_into({"small": small})
        ps.pull_into({"large": large})
        after = calls_by_method(port)
    assert after.get("PushOne", 0) - before.get("PushOne", 0) == 3
    assert after.get("Push", 0) - before.get("Push", 0) == 1
    assert after.get("PullOne", 0) - before.get("PullOne", 0) == 1
    assert after.get("Pull", 0) - before.get("Pull", 0) == 1
    torch.testing.assert_close(small, torch.full((16,), -3.0))
    torch.testing.assert_close(large, torch.full((CHUNK,), -1.0))


@pytest.fixture
def raw(local_cluster):
    """A shard holding "v" (4 zeros, SGD lr 1), and a PushOne taking serialized requests."""
    local = local_cluster(1)
    with PSClient(local.cluster) as ps:
        ps.create_variables({"v": torch.zeros(4)}, Optimizer("sgd", lr=1.0))
    channel = grpc.insecure_channel(local.cluster.ps[0])
    service = "/" + ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
    push_one = channel.unary_unary(f"{service}/PushOne", request_serializer=None,
                                   response_deserializer=ps_pb2.PushResponse.FromString)
    pull_one = channel.unary_unary(f"{service}/PullOne", request_serializer=ps_pb2.PullRequest.SerializeToString,
                                   response_deserializer=wire.decode_pull_response)

    def values() -> torch.Tensor:
        with PSClient(local.cluster) as ps:
            ps.declare({"v": torch.zeros(4)})
            return ps.pull(["v"])["v"]

    def status() -> ps_pb2.StatusResponse:
        with PSClient(local.cluster) as ps:
            return ps.status(0)

    yield push_one, values, pull_one, status
    channel.close()


def request(grad: torch.Tensor, *, seq: int, header: bool = True) -> bytes:
    head = ps_pb2.PushHeader(worker="raw:0", incarnation=7, seq=seq, step_increment=1, tensors=1) if header else None
    meta = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=list(grad.shape))
    return wire.encode_push_request(head, [("v", meta, 0, memoryview(grad.numpy()).cast("B"), 0)])


def test_a_push_one_is_applied_once_and_its_retry_is_a_duplicate(raw):
    push_one, values, *_ = raw
    grad = torch.tensor([1.0, 2.0, 3.0, 4.0])
    first = push_one(request(grad, seq=1), timeout=TIMEOUT)
    again = push_one(request(grad, seq=1), timeout=TIMEOUT)  # a retry: same worker, incarnation and number
    assert not first.duplicate and again.duplicate and first.step == again.step == 1
    torch.testing.assert_close(values(), -grad)


@pytest.mark.parametrize("payload, fragment", [
    (b"\xff\x00junk", "malformed protobuf message"),
    (request(torch.ones(4), seq=1, header=False), "must start with a header"),
    (request(torch.ones(3), seq=1), "is float32[3] but the variable is float32[4]"),
], ids=["junk", "without-header", "wrong-shape"])
def test_a_bad_push_one_is_invalid_argument_and_changes_nothing(raw, payload, fragment):
    push_one, values, *_ = raw
    with pytest.raises(grpc.RpcError) as info:
        push_one(payload, timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in info.value.details(), \
        info.value.details()
    assert torch.equal(values(), torch.zeros(4))


def test_a_pull_one_waits_for_its_min_step_and_answers_in_one_message(raw):
    push_one, values, pull_one, status = raw
    replies = []
    waiting = threading.Thread(target=lambda: replies.append(pull_one(
        ps_pb2.PullRequest(names=["v"], min_step=1), timeout=TIMEOUT)))
    waiting.start()
    wait_until(lambda: status().waiting_calls == 1, TIMEOUT, "the PullOne to wait for step 1")
    assert not replies
    push_one(request(torch.ones(4), seq=1), timeout=TIMEOUT)
    waiting.join(TIMEOUT)
    (reply,) = replies
    assert reply.step == 1 and [chunk.name for chunk in reply.chunks] == ["v"]
    assert torch.equal(torch.frombuffer(bytearray(reply.chunks[0].data), dtype=torch.float32), -torch.ones(4))


@pytest.mark.parametrize("pull, code, fragment", [
    (ps_pb2.PullRequest(names=["v"], lane=b"k" * 16), grpc.StatusCode.INVALID_ARGUMENT, "takes no lane"),
    (ps_pb2.PullRequest(names=["nothing"]), grpc.StatusCode.NOT_FOUND, "nothing"),
], ids=["with-a-lane", "unknown-name"])
def test_a_pull_one_it_cannot_answer_is_refused(raw, pull, code, fragment):
    *_, pull_one, _ = raw
    with pytest.raises(grpc.RpcError) as info:
        pull_one(pull, timeout=TIMEOUT)
    assert info.value.code() == code and fragment in info.value.details(), info.value.details()


def test_a_pull_one_over_the_shards_largest_message_is_refused_before_reading(local_cluster):
    local = local_cluster(1, server_args=["--max-chunk-bytes", str(MIN_CHUNK)])
    with PSClient(local.cluster, chunk_bytes=MIN_CHUNK) as ps:
        ps.create_variables({"big": torch.zeros(MIN_CHUNK // 4 + 1)}, Optimizer("sgd", lr=1.0))
    with grpc.insecure_channel(local.cluster.ps[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.PullOne(ps_pb2.PullRequest(names=["big"]), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"would hold {MIN_CHUNK + 4} bytes, more than this shard's {MIN_CHUNK}; use Pull" in info.value.details()
