"""The shard's replication RPCs, a part of its servicer (servicer.ParameterServerServicer mixes it in): a
backup's Replicate stream and ps 0's SetReplica; and the arbiter a shard asks ps 0 through. SetReplica's body
is blocking code on the shard's pool (edge.py); Replicate has a handler of its own (replicate_handler), which
sends the frames on the event loop, and takes there the acks of a backup that sends them in its stream (one
with an acks lane sends them there: Feed.take_acks). The feeds are replication.Replication's, ps 0's
record replicas.ReplicaRegistry's (through Coordinator.set_replica). The mixin reads the servicer's
coordinator and `replication`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import AsyncIterator, Callable

import grpc

from ..cluster import arbiter_of
from ..errors import MalformedStreamError, ModeConflictError, ServerUnavailableError
from ..proto import ps_pb2
from ..security import Security
from .auth import aborting
from .backup import arbiter_channels
from .coordinator import Coordinator
from .deposals import ACTIONS as DEPOSAL_ACTIONS, TIE_BREAKER
from .replicas import ACTIONS
from .edge import CallContext
from .feed import IDLE_WAKE_SECONDS, NOTHING_YET, OFF_LOOP, ON_LOOP, Feed
from .replication import Arbiter
from .rpc_support import answering, decode_request, map_errors

__all__ = ["ReplicaRPCs", "RoleFence", "arbiter_for", "replicas_of", "replicate_handler", "TiebreakerLink",
           "WIRE_ACTIONS"]

ARBITER_TIMEOUT_SECONDS = 5.0  # one ask of ps 0 (replication.Replication asks again while it cannot reach it)
MAX_ARBITRATION_SECONDS = 30.0  # a SetReplica call waits at most this long, with or without a deadline of its own
WIRE_ACTIONS = (*ACTIONS, "lease", *DEPOSAL_ACTIONS)  # ReplicaChange.Action, in order


def replicas_of(index: int, entry: dict) -> ps_pb2.ShardReplicas:
    """ReplicaRegistry's record of shard `index` as its message."""
    return ps_pb2.ShardReplicas(index=index, primary=entry["primary"], backup=entry["backup"],
                                failovers=entry["failovers"], last_failover_unix=entry["last_failover"],
                                changes=entry.get("changes", 0), copy=entry.get("copy", ""))


class RoleFence(grpc.aio.ServerInterceptor):
    """Until open(), refuses every call but GetStatus and GetLayout with UNAVAILABLE (retried by clients): a
    restarted shard that had a backup serves nothing until its arbiter confirmed it still serves its shard,
    yet answers the layout meanwhile, which is how ps 0 and ps 1, each the other's arbiter, confirm each
    other when a whole job starts again."""

    OPEN_METHODS = frozenset({"GetStatus", "GetLayout"})

    def __init__(self, why: str):
        self._why: str | None = why
        self._open_methods = self.OPEN_METHODS

    def confirmed(self) -> None:
        """The arbiter confirmed this shard: its own record of the shards it arbitrates is the job's, so it
        answers SetReplica too (ps 0 and ps 1 then drop each other's stale backups) before it opens."""
        self._open_methods = self.OPEN_METHODS | {"SetReplica"}

    def open(self) -> None:
        self._why = None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        why, name = self._why, handler_call_details.method.rpartition("/")[2]
        if why is None or handler is None or name in self._open_methods or \
                handler_call_details.method.startswith("/grpc.health."):
            return handler
        return aborting(handler, grpc.StatusCode.UNAVAILABLE, ServerUnavailableError.__name__, why)


class ReplicaRPCs:
    """Replication RPCs of ParameterServerServicer."""

    def open_replica(self, raw: bytes, context: CallContext) -> tuple[Feed, bytes]:
        """(Replicate's first part, on the pool: replicate_handler.) The feed the backup's hello `raw` asks for,
        attached at a new base (Replication.open: blocks while it is written), its records' bytes on the lane
        the hello names, its acks off the acks lane it names; and the layout, the stream's first frame. The
        call's end (on the pool, at once if it ended meanwhile) loses the feed and closes the lanes."""
        hello = decode_request(ps_pb2.ReplicaAck.FromString, raw).hello

        def claimed(key: bytes):  # a lane of the stream's, let go (closed) once its call ended, however it ended
            lane = self._claim_lane(key, context)
            if lane is not None:
                context.add_callback(lambda: self._release_lane(lane, False))
            return lane

        feed = self.replication.open(hello, claimed(hello.lane), claimed(hello.acks_lane))
        context.add_callback(lambda: feed.lose("its stream ended"))
        return feed, self.replication.layout()

    @map_errors
    def SetReplica(self, request, context):
        remaining = context.time_remaining()  # None: no deadline (its threads are few: every call ends)
        timeout = MAX_ARBITRATION_SECONDS if remaining is None else min(remaining, MAX_ARBITRATION_SECONDS)
        action = WIRE_ACTIONS[request.action] if request.action < len(WIRE_ACTIONS) else str(request.action)
        entry = self.coordinator.set_replica(action, request.index, request.primary,
                                             request.backup, timeout=timeout,
                                             changes=request.changes if request.HasField("changes") else None,
                                             released=self.replication.released if self.replication is not None
                                             else lambda ask, timeout: None, copy=request.copy,
                                             failovers=request.failovers, asker=request.asker,
                                             grant=request.grant)
        if action in DEPOSAL_ACTIONS:  # the tie-breaker's record of the shard
            return ps_pb2.ShardReplicas(index=request.index, primary=entry["primary"], failovers=entry["failovers"],
                                        backup=entry["successor"])
        return replicas_of(request.index, entry)


def replicate_handler(servicer, pool: concurrent.futures.Executor,
                      fail: Callable[[str, Exception, CallContext], tuple[grpc.StatusCode, str, tuple]]):
    """The Replicate stream's asyncio handler. Unlike edge.handler's, its frames and the backup's acks in the
    stream are taken on the event loop itself: a record goes from the journal's writer (Feed.on_queued) to
    the loop that sends it, an ack from the loop that reads it to the journal (Replication.acked), with no
    pool thread between (acks on an acks lane have a thread of their own: Feed.take_acks). The opening (the
    hello, the lanes, the base: open_replica) runs on `pool`, the reading of store files (Feed.pieces'
    OFF_LOOP) on a thread of the stream's own, and the feed's loss, once the call ended however it ended,
    on `pool`. `fail` maps an exception to (code, details, trailing
    metadata), as for edge.handler."""

    async def replicate(request_iterator, context):
        loop = asyncio.get_running_loop()
        call = CallContext(context, loop, pool)
        context.add_done_callback(lambda _: call.end())
        try:
            with answering(servicer, "Replicate", call):
                acks = request_iterator.__aiter__()
                try:
                    raw = await acks.__anext__()
                except StopAsyncIteration:
                    raise MalformedStreamError("a Replicate stream begins with the backup's hello: it sent "
                                               "nothing") from None
                feed, layout = await asyncio.wrap_future(pool.submit(servicer.open_replica, raw, call))
                reading = loop.create_task(_read_acks(servicer.replication, feed, acks, pool))
                try:
                    async for frame in _pump(feed, layout):
                        yield frame
                finally:
                    reading.cancel()
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            call.end()
            raise
        except Exception as exc:  # noqa: BLE001 - the edge maps everything
            code, details, trailing = fail("Replicate", exc, call)
            await context.abort(code, details, trailing)
    return replicate


async def _pump(feed: Feed, layout: bytes) -> AsyncIterator[bytes]:
    """Feed.pieces on the loop: each frame as it is queued, a wait where none is (woken by Feed.on_queued,
    or after IDLE_WAKE_SECONDS: its heartbeat), its store files read on a thread of its own (never the
    shard's pool, whose threads may all wait for this stream's acks)."""
    loop = asyncio.get_running_loop()
    queued = asyncio.Event()
    idle = [False]  # the loop may be waiting: a frame queued now wakes it

    def wake() -> None:  # (the journal's writer, a compaction, an ack) something was queued, or the feed lost
        if idle[0]:
            loop.call_soon_threadsafe(queued.set)

    feed.on_queued = wake
    pieces = feed.pieces(layout)
    files: concurrent.futures.ThreadPoolExecutor | None = None  # made at the stream's first store file
    off_loop = False  # pieces reads a file: it is resumed on that thread
    reading: concurrent.futures.Future | None = None  # a next() of pieces on that thread
    try:
        while True:
            queued.clear()
            idle[0] = True  # before pieces looks at the queue: whatever is queued after it looked wakes the loop
            if not off_loop:
                piece = next(pieces, None)
            else:
                reading = files.submit(next, pieces, None)
                piece = await asyncio.wrap_future(reading)
                reading = None
            if piece is None:
                return
            if piece is NOTHING_YET:
                try:
                    async with asyncio.timeout(IDLE_WAKE_SECONDS):
                        await queued.wait()
                except TimeoutError:
                    pass
                continue
            idle[0] = False
            if piece is OFF_LOOP:
                files = files or concurrent.futures.ThreadPoolExecutor(1, "replica-files")
                off_loop = True
            elif piece is ON_LOOP:
                off_loop = False
            else:
                yield piece
    finally:  # its store links not sent go with it (a next() still running on the files' thread closes it after)
        if reading is not None:
            reading.add_done_callback(lambda _: pieces.close())
        else:
            pieces.close()
        if files is not None:
            files.shutdown(wait=False)


async def _read_acks(replication, feed: Feed, acks, pool: concurrent.futures.Executor) -> None:
    """Takes the backup's acks as they come, on the loop, until its stream ends: then the feed is lost (on
    `pool`)."""
    why = "its stream ended"
    try:
        async for raw in acks:
            replication.acked(feed, raw)
    except asyncio.CancelledError:
        return  # the call ended: its end loses the feed
    except Exception as exc:  # noqa: BLE001 - any end of the stream loses the feed
        why = f"its stream broke ({exc.__class__.__name__})"
    pool.submit(feed.lose, why)


def arbiter_for(coordinator: Coordinator, index: int, addresses: tuple[str, ...], security: Security
                ) -> Arbiter | None:
    """How shard `index` asks its arbiter (cluster.arbiter_of) for a change of its record: through its own
    coordinator where it is its own arbiter (a one-shard job's ps 0, or a standalone ps 0), else by a SetReplica
    call with its own credentials to the arbiter of the job's cluster spec `addresses`, followed to wherever it is
    served after its own failover, or where this shard's own record of it says (ps 0 and ps 1 arbitrate each
    other; attempts of `timeout` s, retried for as long: ARBITER_TIMEOUT_SECONDS by default; PSErrors as the
    client edge maps them). `action` is one of WIRE_ACTIONS. None for a shard started without the cluster spec,
    other than ps 0: it cannot reach an arbiter."""
    arbiter = arbiter_of(index, len(addresses))
    if arbiter == index:
        return lambda action, shard, primary, backup, timeout=ARBITER_TIMEOUT_SECONDS, changes=None, copy="": \
            coordinator.set_replica(action, shard, primary, backup, timeout, changes, copy=copy)
    if not addresses:
        return None
    channels = []  # made at the first ask: a shard that never has a backup never calls its arbiter

    def ask(action: str, shard: int, primary: str, backup: str, timeout: float = ARBITER_TIMEOUT_SECONDS,
            changes: int | None = None, copy: str = "") -> dict:
        if not channels:
            channels.append(arbiter_channels(addresses, ARBITER_TIMEOUT_SECONDS, security))
        if coordinator.replicas is not None:  # ps 0 and ps 1 record each other: the arbiter is where this one's
            served = coordinator.replicas.entry(arbiter)["primary"]  # record says (ps 0 moved, the spec's address
            if served:                                               # of ps 0 cannot say where ps 1 went)
                channels[0].redirect(arbiter, served)
        request = ps_pb2.ReplicaChange(action=WIRE_ACTIONS.index(action), index=shard, primary=primary,
                                       backup=backup, changes=changes, copy=copy)
        reply = channels[0].call(arbiter, lambda stub, t: stub.SetReplica(request, timeout=t), timeout,
                                 retry_for=timeout)
        return {"primary": reply.primary, "backup": reply.backup, "copy": reply.copy, "failovers": reply.failovers,
                "last_failover": reply.last_failover_unix, "changes": reply.changes}
    return ask


class TiebreakerLink:
    """How ps 0 or ps 1, serving at `me`, asks the tie-breaker (ps 2 of its layout epoch, followed to wherever it
    is served after a failover) for a DEPOSE or REINSTATE (deposals.Tiebreaker): a SetReplica call with its own
    credentials, attempts of `timeout` s (ARBITER_TIMEOUT_SECONDS if None) retried for as long; returns ps 2's
    record of the shard (Deposals.deposed). PSErrors as the client edge maps them: ReplicaFencedError when ps 2
    refuses the deposal; ModeConflictError when the layout has no ps 2; ServerUnavailableError once close()
    closed its channels."""

    def __init__(self, coordinator: Coordinator, me: str, security: Security):
        self._coordinator, self._me, self._security = coordinator, me, security
        self._made: tuple | None = None  # (the addresses they were made for, ShardChannels), made at the first ask
        self._lock = threading.Lock()

    def __call__(self, action: str, index: int, primary: str, failovers: int, successor: str, grant: str,
                 timeout: float | None) -> dict:
        channels = self._channels()
        request = ps_pb2.ReplicaChange(action=WIRE_ACTIONS.index(action), index=index, primary=primary,
                                       failovers=failovers, backup=successor, asker=self._me, grant=grant)
        limit = ARBITER_TIMEOUT_SECONDS if timeout is None else timeout
        try:
            reply = channels.call(TIE_BREAKER, lambda stub, t: stub.SetReplica(request, timeout=t), limit,
                                  retry_for=limit)
        except ValueError:  # gRPC's "Cannot invoke RPC on closed channel!": close() ran meanwhile (a stop)
            raise ServerUnavailableError(f"ps {TIE_BREAKER} was not asked: this shard's link to it closed") from None
        return {"primary": reply.primary, "failovers": reply.failovers, "successor": reply.backup}

    def _channels(self):
        """The channels to the layout's first three shards, each where this arbiter's own record says it is.
        ModeConflictError when the layout has no ps 2 (a live resize removed it)."""
        addresses = list(self._coordinator.layout.layout()[1][:TIE_BREAKER + 1])
        if len(addresses) <= TIE_BREAKER:
            raise ModeConflictError(f"the job's layout has {len(addresses)} shards: no ps {TIE_BREAKER} breaks "
                                    f"the tie between ps 0 and ps 1")
        with self._lock:
            if self._made is not None and self._made[0] != addresses:  # a resize put another ps 2 (or ps 0, 1) there
                self._made[1].close()
                self._made = None
            if self._made is None:
                self._made = (addresses, arbiter_channels(addresses, ARBITER_TIMEOUT_SECONDS, self._security,
                                                          TIE_BREAKER + 1))
            channels = self._made[1]
        for shard, entry in self._coordinator.replicas.entries():  # where this arbiter's own record says they moved
            if shard <= TIE_BREAKER and entry["primary"]:
                channels.redirect(shard, entry["primary"])
        return channels

    def close(self) -> None:
        with self._lock:
            if self._made is not None:
                self._made[1].close()
            self._made = None
