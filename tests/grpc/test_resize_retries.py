"""A retry is answered as one across a live resize: never applied twice, whatever moved since it was sent.

Raw Push and PushPull calls repeat a push number, as a client's retry does after a lost reply, once the
variable it carried has left the shard (the push was applied before it left, so its effect moved with it).
"""

import struct

import grpc
import pytest
import torch

from torchps.client import Optimizer, PSClient
from torchps.errors import ERROR_METADATA_KEY, VariableMovingError
from torchps.proto import ps_pb2

SERVICE = "/torchps.v1.ParameterServer/"
META = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[2])


def _push(chan: grpc.Channel, seq: int, names: list[str], pull: list[str] | None = None):
    """One raw push of ones (worker "retrier", incarnation 7) to `names`; PushPull if `pull` is given.
    (status, trailing error name, reply)."""
    header = ps_pb2.PushHeader(worker="retrier", incarnation=7, seq=seq, step_increment=1, tensors=len(names),
                               pull=pull or [])
    request = ps_pb2.PushRequest(header=header, chunks=[
        ps_pb2.TensorChunk(name=name, meta=META, offset=0, data=struct.pack("<2f", 1, 1)) for name in names])
    try:
        if pull is None:
            call = chan.stream_unary(SERVICE + "Push", request_serializer=ps_pb2.PushRequest.SerializeToString,
                                     response_deserializer=ps_pb2.PushResponse.FromString)
            return grpc.StatusCode.OK, None, call(iter([request]), timeout=30)
        call = chan.unary_unary(SERVICE + "PushPull", request_serializer=ps_pb2.PushRequest.SerializeToString,
                                response_deserializer=ps_pb2.PullResponse.FromString)
        return grpc.StatusCode.OK, None, call(request, timeout=30)
    except grpc.RpcError as exc:
        error = dict(exc.trailing_metadata() or ()).get(ERROR_METADATA_KEY)
        return exc.code(), error, None


@pytest.fixture
def moved(local_cluster):
    """Two shards; "r/a" and "r/b" created on ps 0 with SGD lr 1, then retrier's push 1 (both) and PushPull 2
    (a, reading b) applied there; then a live resize moves "r/b" to ps 1. Yields (local, chief, chan to ps 0)."""
    local = local_cluster(2)
    with PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief:
        chief.declare([("r/a", 8), ("r/filler", 8), ("r/b", 8)])  # round robin: a, b on ps 0
        chief.create_variables({n: torch.zeros(2) for n in ("r/a", "r/filler", "r/b")}, Optimizer("sgd", lr=1.0))
        assert [chief.placement.shard_of(n) for n in ("r/a", "r/b")] == [0, 0]
        with grpc.insecure_channel(local.address(0)) as chan:
            assert _push(chan, 1, ["r/a", "r/b"])[0] == grpc.StatusCode.OK
            code, _, reply = _push(chan, 2, ["r/a"], pull=["r/b"])
            assert code == grpc.StatusCode.OK and not reply.result.duplicate
            layout = ps_pb2.Layout(epoch=1, addresses=[local.address(0), local.address(1)],
                                   placement={"r/a": 0, "r/filler": 1, "r/b": 1})
            for shard in (1, 0):
                chief.call(shard, lambda stub, t: stub.SetLayout(layout, timeout=t))
            chunks = chief.call(0, lambda stub, t: list(stub.ExportVariables(
                ps_pb2.MoveRequest(names=["r/b"], epoch=1, to=1), timeout=t)))
            chief.call(1, lambda stub, t: stub.ImportVariables(iter(chunks), timeout=t))
            yield local, chief, chan


def _values(chief: PSClient) -> list[list[float]]:
    values = chief.pull(["r/a", "r/b"])
    return [values["r/a"].tolist(), values["r/b"].tolist()]


def test_a_retried_push_is_a_duplicate_after_its_variable_left(moved):
    local, chief, chan = moved
    assert _values(chief) == [[-2.0, -2.0], [-1.0, -1.0]]
    code, _, reply = _push(chan, 1, ["r/a", "r/b"])  # push 1 again: its reply was lost, say
    assert code == grpc.StatusCode.OK and reply.duplicate and reply.layout_epoch == 1
    assert _values(chief) == [[-2.0, -2.0], [-1.0, -1.0]]  # applied once, on ps 0, before r/b left


def test_a_retried_exchange_is_answered_without_what_left(moved):
    local, chief, chan = moved
    code, _, reply = _push(chan, 2, ["r/a"], pull=["r/b"])
    assert code == grpc.StatusCode.OK and reply.result.duplicate and list(reply.result.moved) == ["r/b"]
    assert not reply.chunks
    assert _values(chief) == [[-2.0, -2.0], [-1.0, -1.0]]


def test_a_new_push_naming_what_left_is_refused_and_changes_nothing(moved):
    local, chief, chan = moved
    assert _push(chan, 3, ["r/a", "r/b"])[:2] == (grpc.StatusCode.ABORTED, "LayoutChangedError")
    assert _push(chan, 4, ["r/a"], pull=["r/b"])[:2] == (grpc.StatusCode.ABORTED, "LayoutChangedError")
    assert _values(chief) == [[-2.0, -2.0], [-1.0, -1.0]]
    assert _push(chan, 5, ["r/a"])[0] == grpc.StatusCode.OK  # what stayed is still served
    assert _values(chief) == [[-3.0, -3.0], [-1.0, -1.0]]


def test_a_retry_whose_original_failed_is_refused_once_its_variable_left(moved):
    """Push 6 reaches ps 0 with r/a and an unknown name: refused, nothing applied. Its retry, after r/b left,
    names r/b: LayoutChangedError (the client sends again, renumbered), not a duplicate."""
    local, chief, chan = moved
    assert _push(chan, 6, ["r/a", "r/nowhere"])[0] == grpc.StatusCode.NOT_FOUND
    assert _push(chan, 6, ["r/a", "r/b"])[:2] == (grpc.StatusCode.ABORTED, "LayoutChangedError")
    assert _values(chief) == [[-2.0, -2.0], [-1.0, -1.0]]


def test_a_resize_cut_off_after_an_export_is_completed_by_the_next(local_cluster):
    """The admin dies between ExportVariables and ImportVariables: r/b is in transit (clients are told to
    retry). The next resize, even to the same shards, finds it in ps 0's outbox and imports it."""
    local = local_cluster(2)
    with PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief:
        chief.declare([("r/a", 8), ("r/filler", 8), ("r/b", 8)])
        chief.create_variables({n: torch.zeros(2) for n in ("r/a", "r/filler", "r/b")}, Optimizer("sgd", lr=1.0))
        chief.push({"r/b": torch.ones(2)})
        layout = ps_pb2.Layout(epoch=1, addresses=[local.address(0), local.address(1)],
                               placement={"r/a": 0, "r/filler": 1, "r/b": 1})
        for shard in (1, 0):
            chief.call(shard, lambda stub, t: stub.SetLayout(layout, timeout=t))
        chief.call(0, lambda stub, t: list(stub.ExportVariables(ps_pb2.MoveRequest(names=["r/b"], epoch=1, to=1),
                                                                timeout=t)))  # ... and the admin died
        with PSClient(local.cluster, connect_timeout=1, partitioner=None) as worker:
            worker.declare([("r/a", 8), ("r/filler", 8), ("r/b", 8)])
            with pytest.raises(VariableMovingError):
                worker.pull(["r/b"])
        report = chief.resize(list(local.cluster.ps))
        assert report.moved == 0 and report.epoch == 1  # nothing left to move once the import was completed
        assert chief.pull(["r/b"])["r/b"].tolist() == [-1.0, -1.0]
        assert [info.spec.name for info in chief.list_variables()].count("r/b") == 1
