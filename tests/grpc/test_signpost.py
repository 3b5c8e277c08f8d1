"""A backup's signpost (ps_server/signpost.py) hands its address over to the promoted backup's shard: calls that
came in after the promotion wait there, the shard binds the address while they wait, and they are answered once
it is bound, so that their clients call again at once, on a listening address. A real signpost, a real shard
server (create_server) and real channels, in this process."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
from helpers import free_ports, wait_until

from torchps.client.channels import ShardChannels
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server.server import create_server
from torchps.ps_server.signpost import Signpost
from torchps.ps_server.store import VariableStore
from torchps.security import INSECURE

PRIMARY = "127.0.0.1:1"  # the primary the signpost names before the promotion (never called)


@pytest.fixture
def signpost():
    address = f"127.0.0.1:{free_ports(1)[0]}"
    post = Signpost(1, address, INSECURE, lambda: PRIMARY)
    assert post.start()
    yield post
    post.stop()


def test_a_signpost_names_the_primary_until_the_promotion_then_holds_calls_while_the_shard_takes_its_address(
        signpost):
    channel = grpc.insecure_channel(signpost.address)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    server = None
    try:
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetStatus(ps_pb2.StatusRequest(), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE and PRIMARY in refused.value.details()
        assert stub.GetLayout(ps_pb2.LayoutRequest(), timeout=10).replicas[0].primary == PRIMARY

        signpost.hold(signpost.address)
        layout = stub.GetLayout(ps_pb2.LayoutRequest(), timeout=10)
        assert [(entry.index, entry.primary) for entry in layout.replicas] == [(1, signpost.address)]
        held = stub.GetStatus.future(ps_pb2.StatusRequest(), timeout=60)
        wait_until(lambda: signpost.holding == 1, 10, "the signpost to hold the call")

        # The shard binds the address, the signpost letting go of it first; the call waits on meanwhile.
        server, port, _ = create_server(VariableStore(), 1, signpost.address, before_bind=signpost.let_go)
        assert f"127.0.0.1:{port}" == signpost.address and not held.done()
        signpost.stop()
        with pytest.raises(grpc.RpcError) as answered:
            held.result(timeout=10)
        assert answered.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "was promoted and serves it here" in answered.value.details()
        server.start()
        # The same channel calls again and reaches the shard at the address.
        status = stub.GetStatus(ps_pb2.StatusRequest(), timeout=10, wait_for_ready=True)
        assert status.index == 1
    finally:
        channel.close()
        if server is not None:
            server.stop(None).wait(10)


def test_a_client_redirected_to_a_promoted_backup_is_answered_by_the_shard_once_it_serves_there(signpost):
    """ShardChannels' wait for the shard (a probe the signpost holds) ends with the shard's own answer."""
    signpost.hold(signpost.address)
    channels = ShardChannels([signpost.address], connect_timeout=30)
    server = None
    try:
        waited = threading.Thread(target=channels.wait_ready, args=(0, float("inf")))
        waited.start()
        wait_until(lambda: signpost.holding == 1, 10, "the signpost to hold the client's probe")
        server, _, _ = create_server(VariableStore(), 1, signpost.address, before_bind=signpost.let_go)
        signpost.stop()
        server.start()
        waited.join(30)
        assert not waited.is_alive() and channels._ready[0]
        status = channels.call(0, lambda stub, timeout: stub.GetStatus(ps_pb2.StatusRequest(), timeout=timeout), 10)
        assert status.index == 1
    finally:
        channels.close()
        if server is not None:
            server.stop(None).wait(10)


def test_a_shard_binds_an_address_whose_listener_closes_only_after_before_bind_returned():
    """gRPC closes a stopped server's listener on its own thread: the shard waits for the address to be free."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    listener = socket.create_server(("127.0.0.1", int(address.rsplit(":", 1)[1])))
    closing = threading.Timer(0.2, listener.close)  # closed 0.2 s after before_bind returned, as under load
    server = None
    try:
        server, port, _ = create_server(VariableStore(), 1, address, before_bind=closing.start)
        assert f"127.0.0.1:{port}" == address and listener.fileno() == -1
    finally:
        closing.join(10)
        listener.close()
        if server is not None:
            server.stop(None).wait(10)


def test_a_signpost_names_no_primary_while_its_backup_asks_to_be_promoted():
    """A client that heard of the promotion from the arbiter before the backup did is not sent back to the old
    primary by the signpost; once the arbiter refused, the signpost names the primary again."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    post = Signpost(0, address, INSECURE, lambda: PRIMARY)
    assert post.start()
    channels = ShardChannels([address], connect_timeout=30)  # one shard: its own address says where it is
    try:
        post.asking(True)
        assert not channels.relocate(0) and channels.addresses == [address]
        post.asking(False)  # refused: the primary serves on
        assert channels.relocate(0) and channels.addresses == [PRIMARY]
    finally:
        channels.close()
        post.stop()
