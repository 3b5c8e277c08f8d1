"""One gRPC channel and stub per shard, with readiness waits and retries.

`ShardChannels.call(shard, fn)` runs `fn(stub)` against a shard: it first
waits (with gRPC's reconnect backoff) until the shard is reachable or
`connect_timeout` passes, raising ServerUnavailableError naming the address; a
call that then fails with UNAVAILABLE is retried the same way, for up to
`connect_timeout` from the failure. Every call torchps makes may be retried:
creates and optimizer updates are idempotent, and pushes carry numbers that
shards deduplicate.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import grpc

from ..errors import ServerUnavailableError
from .. import wire
from ..proto import ps_pb2, ps_pb2_grpc
from ..codec import DEFAULT_MAX_CHUNK_BYTES, ENVELOPE_BYTES
from .errors import error_from_rpc

__all__ = ["ShardChannels"]

T = TypeVar("T")
_MESSAGE_LIMIT = DEFAULT_MAX_CHUNK_BYTES + ENVELOPE_BYTES


def _stub(channel: grpc.Channel) -> ps_pb2_grpc.ParameterServerStub:
    """The generated stub, with Pull and Push using wire.py's codecs for their bulk messages.

    Pull yields and PushPull returns (chunks, step, push result) triples;
    Push (a stream) and PushPull (one message) take serialized PushRequest bytes.
    """
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    service = "/" + ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
    stub.Pull = channel.unary_stream(f"{service}/Pull", request_serializer=ps_pb2.PullRequest.SerializeToString,
                                     response_deserializer=wire.decode_pull_response)
    stub.Push = channel.stream_unary(f"{service}/Push", request_serializer=None,
                                     response_deserializer=ps_pb2.PushResponse.FromString)
    stub.PushPull = channel.unary_unary(f"{service}/PushPull", request_serializer=None,
                                        response_deserializer=wire.decode_pull_response)
    return stub


class ShardChannels:
    """Channels to every shard of a cluster. Thread-safe (gRPC channels are)."""

    def __init__(self, addresses: list[str], *, connect_timeout: float):
        self.addresses = list(addresses)
        self.connect_timeout = connect_timeout
        options = [
            ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
            ("grpc.max_send_message_length", _MESSAGE_LIMIT),
            # Reconnect to a restarted shard within a second or two; gRPC's defaults wait
            # at least 20 s between attempts, which stalls every worker that long.
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            # Notice a shard that vanished without closing its connections (host lost).
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
        ]
        self._channels = [grpc.insecure_channel(a, options=options) for a in self.addresses]
        self.stubs = [_stub(c) for c in self._channels]
        self._ready = [False] * len(self.addresses)

    def target(self, shard: int) -> str:
        return f"ps:{shard} at {self.addresses[shard]}"

    def wait_ready(self, shard: int, deadline: float) -> None:
        """Blocks until the shard's channel connects; ServerUnavailableError at `deadline` (monotonic)."""
        try:
            grpc.channel_ready_future(self._channels[shard]).result(timeout=max(0.0, deadline - time.monotonic()))
        except grpc.FutureTimeoutError:
            raise ServerUnavailableError(
                f"could not reach {self.target(shard)} within {self.connect_timeout:g} s; "
                f"is ps-server running there and is the address right?") from None
        self._ready[shard] = True

    def call(self, shard: int, fn: Callable[[ps_pb2_grpc.ParameterServerStub], T]) -> T:
        """Runs fn(stub) for `shard`, mapping errors to PSError; see the module docstring."""
        deadline = time.monotonic() + self.connect_timeout
        failed = False
        while True:
            if not self._ready[shard]:
                self.wait_ready(shard, deadline)
            try:
                return fn(self.stubs[shard])
            except grpc.RpcError as exc:
                if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                    raise error_from_rpc(exc, self.target(shard)) from exc
                self._ready[shard] = False
                if not failed:  # a long call (a held push, a save) gets its full reconnect time from here
                    failed, deadline = True, max(deadline, time.monotonic() + self.connect_timeout)
                if time.monotonic() >= deadline:
                    raise error_from_rpc(exc, self.target(shard)) from exc

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
