"""One gRPC channel and stub per shard, with deadlines, readiness waits and retries.

`ShardChannels.call(shard, fn, timeout)` runs `fn(stub, deadline_seconds)`
against a shard; `fn` must pass the deadline to its stub call, so no attempt
waits longer than `timeout`. A shard that cannot be reached (UNAVAILABLE), that
was stopping as the call came (CANCELLED, though this client cancelled nothing:
gRPC's answer to a call no handler took yet when its server stopped), or
that refuses a call at a limit on work in progress (ShardBusyError, which
changes nothing), is retried with exponential backoff and jitter for up to
`connect_timeout` from the first failure, then ServerUnavailableError (or
ShardBusyError) names the address; its other limits (ResourceExhaustedError:
memory, a variable's size) are raised at once. While a shard cannot be reached,
a line every PROGRESS_SECONDS (logging, INFO) names it, its address and what
answers there. Every call torchps makes may be
retried: creates and optimizer updates are idempotent, and pushes carry
numbers that shards deduplicate. A client that follows failovers (a replicated
job: client/layout.py) looks a shard that does not answer up at its arbiter and
at its own address (relocate), also while a call to it hangs
(client/failover_watch.py), and sends the call again where it is served now.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from typing import Callable, TypeVar

import grpc

from ..sizes import DEFAULT_MAX_CHUNK_BYTES, ENVELOPE_BYTES
from ..cluster import arbiter_of
from ..errors import LaneBrokenError, ServerUnavailableError, ShardBusyError, VariableMovingError
from ..proto import ps_pb2, ps_pb2_grpc
from ..security import INSECURE, TOKEN_METADATA_KEY, Security, diagnose
from .errors import error_from_rpc
from .failover_watch import FailoverWatch

__all__ = ["ShardChannels", "Backoff", "secured_channel"]

_LOGGER = logging.getLogger(__name__)
T = TypeVar("T")
_MESSAGE_LIMIT = DEFAULT_MAX_CHUNK_BYTES + ENVELOPE_BYTES
BACKOFF_FIRST_SECONDS = 0.05   # first pause after a failed attempt
BACKOFF_MAX_SECONDS = 2.0      # pauses double up to this, each scaled by a random factor in [0.5, 1.5)
MOVING_RETRY_SECONDS = 0.05  # pause before asking again for a variable on its way to its shard (live resize)
DIAGNOSE_AFTER_SECONDS = 2.0   # a shard not connected by then is checked for a TLS mismatch
DIAGNOSE_SECONDS = 3.0         # that look at what answers takes this long at most...
DIAGNOSE_LEAST_SECONDS = 0.05  # ...or what is left of the wait's deadline, but this long at least
PROGRESS_SECONDS = 5.0         # then every this often: a line saying what answers at its address
RELOCATE_SECONDS = 0.25        # a shard not answering: its arbiter is asked where it is served this often
RELOCATE_ASK_SECONDS = 1.0     # one such ask


def _decode_pull(data: bytes):
    """wire.decode_pull_response, wire (and torch) imported at the first reply that needs it: ps-admin, which
    never pulls, runs without torch."""
    from .. import wire

    return wire.decode_pull_response(data)


class _Unregistered:
    """`channel`, making every method the generated stub asks for unregistered. Through an interceptor (the
    token's: secured_channel) gRPC looks a registered method up at each call, and that look-up on a closed
    channel crashes the process (SIGSEGV); a call of an unregistered method raises ValueError there instead, as
    ShardChannels expects: a redirect closes a shard's old channel, and close() every channel, while other
    threads (a fanout's, the failover watch's) may be about to call them."""

    def __init__(self, channel: grpc.Channel):
        self._channel = channel

    def unary_unary(self, path, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._channel.unary_unary(path, request_serializer, response_deserializer)

    def unary_stream(self, path, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._channel.unary_stream(path, request_serializer, response_deserializer)

    def stream_unary(self, path, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._channel.stream_unary(path, request_serializer, response_deserializer)

    def stream_stream(self, path, request_serializer=None, response_deserializer=None, _registered_method=False):
        return self._channel.stream_stream(path, request_serializer, response_deserializer)


def _stub(channel: grpc.Channel) -> ps_pb2_grpc.ParameterServerStub:
    """The generated stub (its methods unregistered: _Unregistered), with Pull and Push using wire.py's codecs for
    their bulk messages.

    Pull and LookupRows yield and PullOne and PushPull return wire.PullMessage (chunks, step, push result, generation);
    Push (a stream), PushOne and PushPull (one message) take serialized PushRequest bytes.
    """
    stub = ps_pb2_grpc.ParameterServerStub(_Unregistered(channel))
    service = "/" + ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
    stub.Pull = channel.unary_stream(f"{service}/Pull", request_serializer=ps_pb2.PullRequest.SerializeToString,
                                     response_deserializer=_decode_pull)
    stub.PullOne = channel.unary_unary(f"{service}/PullOne",
                                       request_serializer=ps_pb2.PullRequest.SerializeToString,
                                       response_deserializer=_decode_pull)
    stub.Push = channel.stream_unary(f"{service}/Push", request_serializer=None,
                                     response_deserializer=ps_pb2.PushResponse.FromString)
    stub.PushOne = channel.unary_unary(f"{service}/PushOne", request_serializer=None,
                                       response_deserializer=ps_pb2.PushResponse.FromString)
    stub.PushPull = channel.unary_unary(f"{service}/PushPull", request_serializer=None,
                                        response_deserializer=_decode_pull)
    stub.LookupRows = channel.unary_stream(f"{service}/LookupRows",
                                           request_serializer=ps_pb2.LookupRowsRequest.SerializeToString,
                                           response_deserializer=_decode_pull)
    return stub


class Backoff:
    """Pauses between attempts: doubling from BACKOFF_FIRST_SECONDS, jittered, never past `deadline`."""

    def __init__(self, deadline: float, rng: random.Random | None = None):
        self.deadline = deadline
        self._next = BACKOFF_FIRST_SECONDS
        self._rng = rng or random.Random()

    def pause(self, fixed: float | None = None, sleep: Callable[[float], object] = time.sleep) -> bool:
        """Sleeps before the next attempt (`fixed` seconds, jittered, if given: no doubling) with `sleep`
        (which may return early); False (without sleeping) once the deadline has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return False
        sleep(min(left, (fixed or self._next) * self._rng.uniform(0.5, 1.5)))
        if fixed is None:
            self._next = min(BACKOFF_MAX_SECONDS, self._next * 2)
        return True


def _server_cancelled(exc: grpc.RpcError) -> bool:
    """Whether `exc` is a CANCELLED the call was not cancelled for by its caller: the server stopped before a
    handler took the call (grpc/grpc#41785: a shard stopping, a struck primary started again stepping down to be
    its successor's backup, a backup's signpost giving way at its promotion), or the channel was closed (a
    redirect, the client's close)."""
    return exc.code() is grpc.StatusCode.CANCELLED and not getattr(exc, "cancelled", lambda: False)()


def _retryable(exc: grpc.RpcError) -> bool:
    code = exc.code()
    if code is grpc.StatusCode.UNAVAILABLE:
        return True
    # A shard at a limit on work in progress (ShardBusyError) changed nothing and may take the call later; its
    # other limits (memory, a variable's size) stand until the caller changes something, and gRPC's own (a
    # message over the size limit) carries no torchps-error: neither is retried.
    return code is grpc.StatusCode.RESOURCE_EXHAUSTED and isinstance(error_from_rpc(exc, ""), ShardBusyError)


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the job (or admin) token to every call's metadata."""

    def __init__(self, token: str):
        self._entry = (TOKEN_METADATA_KEY, token)

    def _details(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self._entry])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def secured_channel(address: str, security: Security, options: list) -> grpc.Channel:
    """A channel to `address` with `security`'s TLS (if any) whose calls carry its token (if any)."""
    channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(
        root_certificates=security.ca, private_key=security.key, certificate_chain=security.cert),
        options=options) if security.tls else grpc.insecure_channel(address, options=options)
    token = security.call_token()
    return grpc.intercept_channel(channel, _TokenMetadata(token)) if token else channel


class ShardChannels:
    """Channels to every shard of a cluster, secured as `security` says. Thread-safe (gRPC channels are)."""

    def __init__(self, addresses: list[str], *, connect_timeout: float, security: Security = INSECURE):
        self.addresses = list(addresses)
        self.connect_timeout = connect_timeout
        self.security = security
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
            # Connections of our own, not shared with other clients in this process: a shard tells clients
            # apart by connection when they have no certificate (--max-calls-per-client).
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self._options = options
        self._channels: list[grpc.Channel] = []
        self._retired: list[grpc.Channel] = []  # replaced by follow(): closed with the client
        self.stubs: list[ps_pb2_grpc.ParameterServerStub] = []
        self._ready: list[bool] = []
        for address in self.addresses:
            self._open(address)
        self.live = len(self.addresses)  # shards of the job now: the first `live` (a live resize changes it)
        self.moving_waits = 0  # attempts retried because a variable was on its way to the shard (live resize)
        self._closed = threading.Event()
        # True: a shard that does not answer is looked up at its arbiter (relocate) and called where it is
        # served now, if that changed (a replicated shard's failover; client/layout.py sets it).
        self.follows_failovers = False
        self.relocated = 0  # shards found served elsewhere
        self._spec_shards = len(self.addresses)  # the job's shards as it began: who arbitrates whom
        self._relocating = threading.local()
        self._redirecting = threading.Lock()  # one redirect of a shard at a time (relocate runs in many threads)
        self._moves = threading.Condition()  # notified at every redirect
        self._moved: dict[int, int] = {}  # redirects of each shard so far
        self._replicated: set[int] = set()  # shards their arbiter's last answer recorded a backup or failover for
        self.watch = FailoverWatch(self.relocate, lambda shard: shard in self._replicated, self._closed)

    def _open(self, address: str, index: int | None = None) -> None:
        """A channel to `address`: the next shard's, or shard `index`'s instead of the one it had."""
        channel = secured_channel(address, self.security, self._options)
        stub = _stub(channel)
        if index is None:
            self._channels.append(channel)
            self.stubs.append(stub)
            self._ready.append(False)
        else:
            self._channels[index], self.stubs[index], self._ready[index] = channel, stub, False

    def follow(self, addresses: list[str]) -> None:
        """The job's shards are now `addresses` (a live resize: the same first ones, some added or removed at
        the end): channels are opened to new ones; those beyond stay open but are no longer `live`. An index a
        resize removed and a later one added again may come back at another address: its channel is replaced
        (the old one is closed with the client). A shard that stays may be named at another address than this
        client calls: a replicated shard's failover, before or after the layout's epoch was set; with
        `follows_failovers` its arbiter says which address serves it (relocate: one call; this client keeps
        its own if the arbiter does not answer), else ServerUnavailableError."""
        for index, address in enumerate(addresses):
            if index >= len(self.addresses):
                self.addresses.append(address)
                self._open(address)
            elif self.addresses[index] != address and index >= self.live:
                self._retired.append(self._channels[index])
                self.addresses[index] = address
                self._open(address, index)
            elif self.addresses[index] != address and not self.follows_failovers:
                raise ServerUnavailableError(f"the job's layout puts {address} at ps:{index}, which this client "
                                             f"knows at {self.addresses[index]}: a resize keeps shard indices")
            elif self.addresses[index] != address:
                self.relocate(index)
        self.live = len(addresses)

    def relocate(self, shard: int, wait: float = 0.0, deadline: float | None = None) -> bool:
        """Asks the shard's arbiter (cluster.arbiter_of: ps 0, ps 1 for ps 0) where it is served, then, unless the
        arbiter's record named it, the shard's own address (a backup there answers where its primary is:
        ps_server/signpost.py), twice (the arbiter's address may have been a backup's, which named where the
        arbiter is); if at another address than this client calls, calls it there from now on (True). `wait`:
        the arbiter's answer waits up to this long for a promotion of the shard's backup (a long poll). Blocks
        for up to four calls of RELOCATE_ASK_SECONDS (plus `wait`), and not past `deadline` (monotonic) if
        given; False if none says, if the arbiter names the address this client calls (a stopped primary's
        own address is not asked), or while this thread is relocating."""
        arbiter = arbiter_of(shard, self._spec_shards)
        if getattr(self._relocating, "active", False):
            return False
        self._relocating.active = True
        try:
            for asked in [arbiter, shard] * 2 if arbiter != shard else [shard]:
                left = math.inf if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return False
                # The answer is compared with what this client called as it asked: another thread may move
                # the shard meanwhile, and an answer older than that move must not move it back.
                calling = {asked: self.addresses[asked], shard: self.addresses[shard]}
                served = self._served_by(asked, ps_pb2.LayoutRequest(
                    watch_primary=calling[shard], watch_shard=shard, watch_seconds=min(wait, left))
                    if wait and asked == arbiter else ps_pb2.LayoutRequest(), left)
                if asked != shard and served.get(asked, calling[asked]) != calling[asked]:
                    self._move(asked, served[asked], calling[asked])  # the arbiter's address was a backup's signpost
                if served.get(shard, calling[shard]) != calling[shard]:
                    self._move(shard, served[shard], calling[shard])
                    return True
                if asked != shard and shard in served:
                    return False  # the arbiter's record: served where this client calls (not promoted yet)
            return False
        finally:
            self._relocating.active = False

    def _served_by(self, shard: int, request: ps_pb2.LayoutRequest, limit: float = math.inf) -> dict[int, str]:
        """{index: primary} of the replicated shards that `shard`'s address names (an arbiter's record, or a
        backup's signpost of its own shard); {} if nothing answers within RELOCATE_ASK_SECONDS (plus the
        request's watch), or within `limit` seconds. One attempt."""
        try:
            layout = self.stubs[shard].GetLayout(
                request, timeout=min(RELOCATE_ASK_SECONDS + request.watch_seconds, limit))
        except (grpc.RpcError, ValueError):  # ValueError: its channel closed (a redirect, or this client closed)
            return {}
        for entry in layout.replicas:
            if entry.backup or entry.failovers:
                self._replicated.add(entry.index)
        return {entry.index: entry.primary for entry in layout.replicas if entry.primary}

    def _move(self, shard: int, address: str, was: str) -> None:
        if self.redirect(shard, address, instead_of=was):
            _LOGGER.warning("ps:%d is served at %s now (was %s)", shard, address, was)
            self.relocated += 1

    def redirect(self, shard: int, address: str, instead_of: str | None = None) -> bool:
        """Shard `shard` is served at `address` from now on (its backup was promoted): calls go there, and the
        old channel is closed, which ends the calls still in flight on it (CANCELLED: call() sends them
        again, to `address`). False if the client calls it there already, or (`instead_of`: the address the
        news replaces) calls it at another address than that one by now (news older than a later move)."""
        with self._redirecting:
            if self.addresses[shard] == address or instead_of not in (None, self.addresses[shard]):
                return False
            old = self._channels[shard]
            self.addresses[shard] = address
            self._open(address, shard)
        with self._moves:  # a call pausing before it tries the shard again tries it at once, there
            self._moved[shard] = self._moved.get(shard, 0) + 1
            self._moves.notify_all()
        old.close()
        return True

    def _until_moved(self, shard: int, moved: int) -> Callable[[float], object]:
        """A sleep that ends early once `shard` was redirected more than `moved` times."""
        def sleep(seconds: float) -> object:
            with self._moves:
                return self._moves.wait_for(lambda: self._moved.get(shard, 0) != moved, seconds)
        return sleep

    def target(self, shard: int) -> str:
        return f"ps:{shard} at {self.addresses[shard]}"

    def wait_ready(self, shard: int, deadline: float) -> None:
        """Blocks until the shard's channel connects, logging every PROGRESS_SECONDS what it waits for;
        ServerUnavailableError at `deadline` (monotonic: its looks at what answers and its asks where the shard
        is served keep to it, a last look taking about DIAGNOSE_LEAST_SECONDS past it), or at once, naming the
        cause, when what answers cannot work: TLS on one side only, a certificate refused, not a gRPC server
        (security.diagnose); at once too once this client is closed (its probe cancelled).

        The wait is a GetStatus call that waits for the connection (wait_for_ready): any answer, a refusal
        included, means connected. Not grpc.channel_ready_future: its watcher thread outlives a cancel by
        up to 0.2 s and, if the channel closes meanwhile (an interrupted client), prints a traceback."""
        started, wait = time.monotonic(), DIAGNOSE_AFTER_SECONDS
        relocatable = self.follows_failovers
        check = started + wait  # when what answers at the address is looked at
        while True:
            slice_ = min(check, deadline) - time.monotonic()
            if self._probe(shard, max(0.0, min(slice_, RELOCATE_SECONDS) if relocatable else slice_)):
                break
            if self._closed.is_set():  # closed meanwhile (its probe cancelled): no look at the address, no wait
                raise ServerUnavailableError(f"this client is closed; {self.target(shard)} was not called")
            if relocatable and self.relocate(shard, deadline=deadline):
                continue  # served elsewhere now: probe the new address
            if time.monotonic() < min(check, deadline):
                continue
            found, hopeless = diagnose(self.addresses[shard], self.security, timeout=min(
                DIAGNOSE_SECONDS, max(DIAGNOSE_LEAST_SECONDS, deadline - time.monotonic())))
            if hopeless:
                raise ServerUnavailableError(f"cannot connect to {self.target(shard)}: {found}")
            waited, limit = time.monotonic() - started, max(0.0, deadline - started)  # (a deadline already past: 0)
            if waited >= limit:
                raise ServerUnavailableError(
                    f"could not reach {self.target(shard)} within {limit:.0f} s: {found}; is ps-server running "
                    f"there and is the address right? (to wait longer: connect_timeout, ps-worker's "
                    f"--connect-timeout or TORCHPS_CONNECT_TIMEOUT)")
            _LOGGER.info("waiting for %s: %s (%.0f s of %.0f s)", self.target(shard), found, waited, limit)
            check = time.monotonic() + PROGRESS_SECONDS
        self._ready[shard] = True

    def _probe(self, shard: int, timeout: float) -> bool:
        """True if the shard answers (anything) within `timeout` s. A blocking call, which gRPC lets a
        signal (Ctrl-C, SIGTERM) interrupt cleanly on the main thread; a future's bookkeeping may not be."""
        try:
            self.stubs[shard].GetStatus(ps_pb2.StatusRequest(), timeout=max(0.0, timeout), wait_for_ready=True)
        except ValueError:  # gRPC's "Cannot invoke RPC on closed channel!": closed by this client or a redirect
            return False
        except grpc.RpcError as exc:
            return exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.CANCELLED)
        return True

    def call(self, shard: int, fn: Callable[[ps_pb2_grpc.ParameterServerStub, float], T], timeout: float,
             retry_for: float | None = None) -> T:
        """Runs fn(stub, timeout) for `shard`, retrying as the module docstring says; errors are PSErrors.

        Blocks for at most `timeout` per attempt, plus up to `retry_for`
        (default: connect_timeout) of retries after the first failure.
        """
        retry_for = self.connect_timeout if retry_for is None else retry_for
        backoff = None
        while True:
            if self._closed.is_set():
                raise ServerUnavailableError(f"this client is closed; {self.target(shard)} was not called")
            watched = self.watch.enter(shard) if self.follows_failovers else None
            moved = self._moved.get(shard, 0)  # a pause after this attempt ends once the shard is served elsewhere
            stub = self.stubs[shard]
            try:
                if not self._ready[shard]:
                    self.wait_ready(shard, time.monotonic() + retry_for if backoff is None else backoff.deadline)
                    stub = self.stubs[shard]
                return fn(stub, timeout)
            except LaneBrokenError:  # the attempt's bulk lane broke (closed, out of step): nothing applied
                backoff = backoff or Backoff(time.monotonic() + retry_for)
                if not backoff.pause(MOVING_RETRY_SECONDS, self._until_moved(shard, moved)):
                    raise
            except ValueError:  # gRPC's "Cannot invoke RPC on closed channel!": closed by a redirect before the call
                if self.stubs[shard] is not stub and not self._closed.is_set():
                    continue
                raise
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.CANCELLED and self.stubs[shard] is not stub \
                        and not self._closed.is_set():
                    continue  # its channel closed by a redirect (a failover): sent again, to the new address
                stopped = _server_cancelled(exc) and not self._closed.is_set()  # the shard's process stopped
                if not (stopped or _retryable(exc)):
                    raise error_from_rpc(exc, self.target(shard)) from exc
                backoff = backoff or Backoff(time.monotonic() + retry_for)
                if isinstance(error_from_rpc(exc, ""), VariableMovingError):
                    self.moving_waits += 1  # the shard is up: a variable is on its way to it (a live resize),
                    # there within a move's time: asked again soon
                    if backoff.pause(MOVING_RETRY_SECONDS, self._until_moved(shard, moved)):
                        continue
                    raise error_from_rpc(exc, self.target(shard)) from exc
                if stopped or exc.code() is grpc.StatusCode.UNAVAILABLE:
                    self._ready[shard] = False
                if not backoff.pause(sleep=self._until_moved(shard, moved)):
                    raise error_from_rpc(exc, self.target(shard)) from exc
            finally:
                if watched is not None:
                    self.watch.leave(watched)

    def close(self) -> None:
        self._closed.set()
        for channel in [*self._channels, *self._retired]:
            channel.close()
