"""The gRPC edge of a shard: decode requests, call the store, encode replies, map errors.

Every method runs as an asyncio handler (edge.py): its body here is blocking
code on the shard's thread pool, and the bodies that wait for a sync release
or a step (Push, PushPull, Pull) yield their waits (waits.Wait) to the event
loop instead of holding a thread. This module holds the servicer and its data
path (CreateVariables, Pull, Push, PushPull, UpdateOptimizer, ListVariables);
control_rpcs.py (status, mode, membership, checkpoints, shutdown) and
job_rpcs.py (tables, data queues, live resizes) hold the other RPCs, mixed in;
rpc_support.py maps errors to status codes, so a bad request never takes the
server down.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
from concurrent.futures import Executor
from typing import Callable

import grpc
import numpy as np

from .. import codec, compression, rows, wire
from ..errors import (InvalidArgumentError, LaneBrokenError, LayoutChangedError, MalformedStreamError,
                      ResourceExhaustedError, ShardBusyError, SpecConflictError)
from ..lanes import Lane, bind as bind_lane
from ..memory import memory_usage
from ..proto import ps_pb2, ps_pb2_grpc
from ..security import INSECURE, Security
from .auth import Authority
from .buffers import ReceiveBuffers
from .change_rpcs import ChangeRPCs
from .lanes import LaneServer
from .control_rpcs import ControlRPCs
from .coordinator import Coordinator
from .edge import CallContext, handler
from .job_rpcs import JobRPCs
from .replica_rpcs import ReplicaRPCs, replicate_handler
from .replication import Replication
from .resize_rpcs import ResizeRPCs
from .metrics import ShardMetrics
from .pull_cache import PullCache
from .quotas import Quotas, optimizer_slots
from .rpc_support import (MAX_LIST_WAIT_SECONDS, decode_request, decoded, map_errors, remaining, require_active,
                          status_of, step_authority)
from .stalls import DEFAULT_IDLE_SECONDS, StallWatch
from .store import NewVariable, VariableStore
from .tables import RowGradient
from .tokens import TokenFile
from .waits import Wait, Waiting

__all__ = ["ParameterServerServicer", "add_to_server"]

_LOGGER = logging.getLogger(__name__)
MEMORY_REFRESH_SECONDS = 1.0  # GetStatus is the clients' readiness probe: /proc and malloc are read this often


def _check_same_meta(declared: ps_pb2.VariableSpec, held: ps_pb2.VariableSpec) -> None:
    """SpecConflictError if a stream re-declares a held variable with another dtype or shape."""
    if declared.meta != held.meta:
        raise SpecConflictError(f"variable {held.name!r} already exists as {codec.describe_meta(held.meta)}; the "
                                f"request declared {codec.describe_meta(declared.meta)}. Use another name, or the "
                                f"same spec.")


class _Count:
    """A thread-safe counter (calls finished, bytes received) for GetStatus."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, amount: int = 1) -> None:
        with self._lock:
            self.value += amount


class _Recent:
    """compute()'s value, computed again at most every `seconds` (thread-safe)."""

    def __init__(self, compute: Callable[[], dict], seconds: float):
        self._compute, self._seconds = compute, seconds
        self._lock = threading.Lock()
        self._value: dict | None = None
        self._at = 0.0

    def get(self) -> dict:
        with self._lock:
            now = time.monotonic()
            if self._value is None or now - self._at >= self._seconds:
                self._value, self._at = self._compute(), now
            return self._value


class ParameterServerServicer(ControlRPCs, JobRPCs, ResizeRPCs, ReplicaRPCs, ChangeRPCs,
                              ps_pb2_grpc.ParameterServerServicer):
    """Serves one shard's VariableStore over the ParameterServer service.

    Register it with `add_to_server`, which uses wire.py's codecs for Pull's
    responses and Push's requests and the generated classes for the rest.
    """

    def __init__(self, store: VariableStore, coordinator: Coordinator, index: int, *, max_chunk_bytes: int,
                 checkpoint_dir: str | None = None, on_shutdown: Callable[[str], None] | None = None,
                 security: Security = INSECURE, quotas: Quotas | None = None, metrics: ShardMetrics | None = None,
                 stream_idle_seconds: float = DEFAULT_IDLE_SECONDS, tokens: TokenFile | None = None,
                 keep_receive_bytes: int = -1, lanes: LaneServer | None = None, pull_cache: bool = True,
                 replication: Replication | None = None):
        self.store = store
        self.coordinator = coordinator
        self.index = index
        self.authority = Authority(security, index, tokens)  # `tokens`: security's, following its token file
        self.quotas = quotas or Quotas()
        self.checkpoint_dir = checkpoint_dir
        self.on_shutdown = on_shutdown
        self.generation = random.getrandbits(63) or 1  # new on every start: clients notice restarts
        self.max_chunk_bytes = max_chunk_bytes
        self.calls_started = _Count()    # handlers entered, and returned whatever the outcome:
        self.calls_done = _Count()       # tests wait on them
        self.push_bytes = _Count()       # gradient bytes taken in, complete or not
        self.pull_bytes = _Count()       # value bytes encoded into replies
        self.metrics = metrics           # Prometheus (ps-server --metrics-port), or None
        self.metrics_port = 0            # its HTTP port once served, for GetStatus
        if metrics is not None:
            metrics.watch(self)
        self._creating = threading.Lock()
        self.stalls = StallWatch(stream_idle_seconds, coordinator.failstop)  # ends client streams that stall
        self.memory = _Recent(memory_usage, MEMORY_REFRESH_SECONDS)  # the process's memory, at most a second old
        self.queue_desk = coordinator.queue_desk  # data queues: ps 0's
        self.lanes = lanes  # bulk lanes (ps_server/lanes.py), or None
        self.replication = replication  # its backups' feeds (Replicate)
        self._lanes_in_calls: set[Lane] = set()  # claimed by a call: closed if the call ends first
        self.receive_buffers = ReceiveBuffers(self.quotas, self.held_total,
                                              lambda: self.held_bytes()[0] if keep_receive_bytes < 0
                                              else keep_receive_bytes)
        self.pull_cache = PullCache(self.quotas, self.held_total, enabled=pull_cache,
                                    eager=lambda: coordinator.config.mode == "sync")  # sync: N pulls per version

    @map_errors
    def CreateVariables(self, request_iterator, context):
        requests: list[NewVariable] = []
        pending = None  # the spec whose initial value is arriving
        declared = job_step = None
        assembler = codec.ChunkAssembler()
        existing = set(self.store.names())
        held = self.held_total()
        incoming = 0
        for message in decoded(self._watched(request_iterator, context, "CreateVariables"),
                                ps_pb2.CreateRequest.FromString):
            if declared is None:
                declared, job_step = message.count, message.step
            if message.HasField("spec"):
                if pending is not None:
                    raise MalformedStreamError(f"no complete initial value for {pending.name!r} before the next spec")
                if not message.spec.name:
                    raise MalformedStreamError("a VariableSpec without a name")
                if message.spec.name not in existing:  # checked before a byte of its value is taken in
                    incoming += self.quotas.check_variable(message.spec, held, incoming)
                else:  # the same spec, or a conflict: refused before its value is taken in
                    _check_same_meta(message.spec, self.store.get(message.spec.name).spec)
                pending = message.spec
            if message.HasField("chunk"):
                if pending is None or message.chunk.name != pending.name:
                    raise MalformedStreamError(
                        f"chunk for {message.chunk.name!r} does not follow a spec of that name")
                done = assembler.add(message.chunk, meta=pending.meta)
                if done is not None:
                    optimizer = pending.optimizer
                    requests.append(NewVariable(pending.name, done[1], optimizer.name, dict(optimizer.hyperparams)))
                    pending = None
        if pending is not None:
            raise MalformedStreamError(f"stream ended before the initial value of {pending.name!r} was complete")
        if declared and len(requests) != declared:
            raise MalformedStreamError(f"the stream declared {declared} variables but {len(requests)} arrived")
        require_active(context)
        with self._creating:  # the memory check again, now that no other stream can create in between
            names = set(self.store.names())
            self.quotas.check_total(self.held_total(),
                                    {r.name: r.value.nbytes * (1 + optimizer_slots(r.optimizer, r.hyperparams))
                                     for r in requests if r.name not in names})
            created = self.coordinator.create(requests, job_step=job_step or 0)
        return ps_pb2.CreateResponse(created=created, generation=self.generation)

    @map_errors
    def Pull(self, request, context):
        """Yields serialized PullResponse messages (see wire.py); each variable is copied under its lock."""
        yield from self._pull_replies(request, context)

    @map_errors
    def PullOne(self, request, context):
        """Pull whose reply is one message, as a unary call: INVALID_ARGUMENT, before anything is read, for
        variables larger than this shard's --max-chunk-bytes or a request naming a lane."""
        if request.lane:
            raise InvalidArgumentError("PullOne carries its reply in the message: it takes no lane")
        size = sum(self.store.get(name).nbytes for name in request.names or self.store.names())
        if size > self.max_chunk_bytes:
            raise InvalidArgumentError(f"PullOne's reply would hold {size} bytes, more than this shard's "
                                       f"{self.max_chunk_bytes}; use Pull")
        request.chunk_bytes = self.max_chunk_bytes  # every variable in one message
        replies = []
        for reply in self._pull_replies(request, context):
            if isinstance(reply, Wait):
                yield reply
            else:
                replies.append(reply)
        (reply,) = replies
        return reply

    def _pull_replies(self, request, context):
        """Pull's serialized replies, among the Waits of a min_step."""
        self.coordinator.layout.check_member()
        names = list(request.names) or self.store.names()
        for name in names:
            self.store.get(name)  # NOT_FOUND before anything is sent
        if request.chunk_bytes and request.chunk_bytes < codec.MIN_CHUNK_BYTES:  # above the shard's limit: cut to it
            raise InvalidArgumentError(f"chunk_bytes must be 0 or at least {codec.MIN_CHUNK_BYTES}. "
                                       f"Received: {request.chunk_bytes}")
        casts = self._casts(list(request.names), list(request.cast), "cast")
        bases = self._bases(list(request.names), list(request.base_versions), request.base_generation,
                            "base_versions")
        lane = self._claim_lane(request.lane, context)
        ok = False
        try:
            if request.min_step:  # waits on the event loop (edge.py)
                yield from self.coordinator.step_waiting(request.min_step, remaining(context),
                                                         lambda: not context.is_active())
            yield from self._read(names, request.chunk_bytes, casts=casts, bases=bases, lane=lane, context=context)
            ok = True
        finally:
            self._release_lane(lane, ok)

    def _claim_lane(self, key: bytes, context: CallContext) -> Lane | None:
        """The bulk lane (torchps/lanes.py) a call names, now the call's (None if it names none); the call's
        end closes it unless _release_lane gave it back first. LaneBrokenError (UNAVAILABLE: the client
        opens another) if this shard has no such lane idle."""
        if not key:
            return None
        if self.lanes is None:
            raise LaneBrokenError("this shard offers no bulk lanes (StatusResponse.lane_port is 0); nothing "
                                  "was applied")
        lane = self.lanes.claim(key)
        held = self._lanes_in_calls
        held.add(lane)
        context.add_callback(lambda: lane.close() if lane in held else None)  # a client gone mid-transfer
        return lane

    def _release_lane(self, lane: Lane | None, ok: bool) -> None:
        if lane is not None:
            self._lanes_in_calls.discard(lane)
            self.lanes.release(lane, ok)

    def _lane_seconds(self, context: CallContext) -> float:
        """How long one lane frame may take: what is left of the call, at most the stream idle limit."""
        left = remaining(context)
        idle = self.stalls.idle_seconds
        return idle if left is None else min(left, idle) if idle else left

    @map_errors
    def Push(self, request_iterator, context):
        """Applies a complete, valid stream of gradients (see Coordinator.push); a held push waits on the event
        loop (edge.py)."""
        header, reply = yield from self._receive_push(
            decoded(self._watched(request_iterator, context, "Push"), wire.decode_push_request), context)
        return reply

    @map_errors
    def PushOne(self, request, context):
        """Push of one message (a unary call): applied as Push applies a stream of it."""
        header, reply = yield from self._receive_push([decode_request(wire.decode_push_request, request)], context)
        return reply

    def _watched(self, request_iterator, context: CallContext, method: str):
        """The stream's messages; one that sends nothing for the shard's idle limit is ended (stalls.py) with
        DEADLINE_EXCEEDED, and its handler, woken with an error, applies nothing."""
        def stop(idle: float) -> None:
            _LOGGER.warning("%s from %s sent nothing for %g s: the call was ended, nothing was applied", method,
                            context.peer(), idle)
            context.end_stalled(f"ps {self.index} ended this {method} stream: no message for {idle:g} s "
                                f"(--stream-idle-seconds); nothing was applied")

        with self.stalls.watching(stop) as touch:
            for raw in request_iterator:
                touch()
                yield raw

    @map_errors
    def PushPull(self, request, context):
        """Push of one message, then the header's `pull` variables in one reply.

        In sync mode the reply waits until the worker may go on, as shard 0's
        reply to a Push does, so it carries the released step's values.
        """
        header, chunks, end = decode_request(wire.decode_push_request, request)
        if header is None:
            raise MalformedStreamError("a PushPull request must carry a header")
        asked = list(header.pull)
        # A retry is answered as one whatever moved since (a live resize): names this shard no longer holds are
        # left out of its reply, and listed (PushResponse.moved).
        repeat = self.coordinator.repeats(header.worker, header.incarnation, header.seq)
        keep = [i for i, name in enumerate(asked) if not repeat or self.store.holds(name)]
        names = [asked[i] for i in keep]
        size = sum(self.store.get(name).nbytes for name in names)
        if size > self.max_chunk_bytes:
            raise InvalidArgumentError(f"PushPull's reply would hold {size} bytes, more than this shard's "
                                       f"{self.max_chunk_bytes}; use Push and Pull")
        casts = self._casts(asked, list(header.pull_cast), "pull_cast")  # checked before the push is applied
        bases = self._bases(asked, list(header.pull_base_versions), header.pull_base_generation,
                            "pull_base_versions")
        casts = [casts[i] for i in keep]
        bases = None if bases is None else [bases[i] for i in keep]
        _, result = yield from self._receive_push([(header, chunks, end)], context, hold=True)
        result.moved.extend(name for name in asked if name not in names)
        try:
            (reply,) = self._read(names, self.max_chunk_bytes, result, casts, bases)
        except LayoutChangedError:  # a pull name left (a live resize) after the push was applied: the push stands
            result.moved.extend(name for name in names if name not in result.moved)
            result.layout_epoch = self.coordinator.layout.epoch  # the client follows, then reads them elsewhere
            (reply,) = self._read([], self.max_chunk_bytes, result)
        return reply

    def _casts(self, names: list[str], casts: list[int], field: str) -> list:
        """Per name, the dtype PullRequest.cast (PushHeader.pull_cast) sends it as, None as stored;
        InvalidArgumentError for a count or cast the contract does not allow."""
        if not casts:
            return [None] * len(names)
        if len(casts) != len(names):
            raise InvalidArgumentError(f"{field} must be empty or name a dtype for each of the {len(names)} "
                                       f"variables asked for. Received {len(casts)}")
        return [compression.pull_dtype(name, self.store.get(name).spec.meta, cast) for name, cast in zip(names, casts)]

    def _bases(self, names: list[str], versions: list[int], generation: int, field: str) -> list[int] | None:
        """Per name, the version a delta pull may start from (0: none; all 0 when the versions were read from
        another generation of this shard), or None without base versions; InvalidArgumentError for a count
        other than one per name."""
        if not versions:
            return None
        if len(versions) != len(names):
            raise InvalidArgumentError(f"{field} must be empty or hold a version for each of the {len(names)} "
                                       f"variables asked for. Received {len(versions)}")
        return versions if generation == self.generation else [0] * len(names)

    def _check_gradient(self, name: str, meta: ps_pb2.TensorMeta) -> None:
        """Raises unless a pushed tensor with `meta` fits: a table's ROWS tensor, or a variable's gradient."""
        if meta.encoding == ps_pb2.ROWS:
            self.coordinator.tables.check_meta(name, meta)
        else:
            self.store.check_gradient(name, meta)

    def _receive_bytes(self, name: str, meta: ps_pb2.TensorMeta) -> int:
        """Bytes receiving a pushed tensor takes (checked by _check_gradient): its buffer (a compressed one is
        kept for the journal until the push ends), and the tensor it is decoded into when that is not a view of
        it (a compressed gradient)."""
        nbytes = codec.meta_nbytes(meta)
        if meta.encoding == ps_pb2.ROWS:
            return nbytes
        variable = self.store.get(name).spec.meta
        return nbytes if meta == variable else nbytes + codec.meta_nbytes(variable)

    def _decode_gradient(self, name: str, meta: ps_pb2.TensorMeta, raw, received: dict, again: bool,
                         allocate: Callable[[int], np.ndarray]):
        """A complete pushed tensor (checked by _check_gradient): a table's RowGradient (`again`: the push's
        rows_again), or a dense tensor of its variable's dtype (decoded into memory from `allocate`, where it
        is not a view of `raw`); a compressed one is also kept as it came in `received` (for the journal)."""
        if meta.encoding == ps_pb2.ROWS:
            return RowGradient(*rows.decode_rows(meta, raw), counts_step=not again)
        variable = self.store.get(name).spec.meta
        if meta.encoding != ps_pb2.DENSE or meta.dtype != variable.dtype:
            received[name] = (meta, raw)
        return compression.decode(name, meta, raw, variable, allocate)

    def _receive_push(self, messages, context, *, hold: bool = False
                      ) -> Waiting[tuple[ps_pb2.PushHeader, ps_pb2.PushResponse]]:
        """Assembles decoded (header, chunks, end) messages, then hands the push to the coordinator; yields
        where the push waits (Coordinator.push_waiting).

        The tensor count is checked before anything is applied: the header's `tensors` if declared, or for
        a streamed push (PushHeader.streamed) the `end` its last message carries, which must be there.
        """
        started = time.monotonic()
        header = end = done = lane = None
        grads, received = {}, {}
        reservation = self.quotas.reservation(self.held_total)  # the push's buffers, within --max-memory

        moved: set[str] = set()  # a retry's gradients for variables that left since: never applied here

        def begin(name: str, meta: ps_pb2.TensorMeta) -> None:  # before the tensor's buffer is allocated
            try:
                self._check_gradient(name, meta)
            except LayoutChangedError:
                if not self.coordinator.repeats(header.worker, header.incarnation, header.seq):
                    raise
                moved.add(name)
                return
            if self.quotas.max_memory:
                nbytes = self._receive_bytes(name, meta)
                try:
                    reservation.add(nbytes, f"the gradient for {name!r}")
                except (ShardBusyError, ResourceExhaustedError):
                    for drop in (self.receive_buffers.drop, self.pull_cache.drop):  # the room they keep first
                        if drop():
                            try:
                                reservation.add(nbytes, f"the gradient for {name!r}")
                                return
                            except (ShardBusyError, ResourceExhaustedError):
                                pass
                    raise

        taken: list = []  # the receive buffers, kept for the next push once nothing holds them (buffers.py)

        def allocate(nbytes: int):
            taken.append(self.receive_buffers.take(nbytes))
            return taken[-1]

        assembler = codec.ChunkAssembler(
            begin=begin, decode=lambda name, meta, raw: None if name in moved
            else self._decode_gradient(name, meta, raw, received, header.rows_again, allocate), allocate=allocate)
        try:
            for message_header, chunks, message_end in messages:
                if end is not None:
                    raise MalformedStreamError("a streamed push carries messages after its end; nothing was applied")
                if message_header is not None:
                    if header is not None:
                        raise MalformedStreamError("a Push stream carries its header twice")
                    header = message_header
                    if not self.coordinator.repeats(header.worker, header.incarnation, header.seq):
                        self.coordinator.layout.check_member()  # a retry is answered even by a shard that left
                    if header.streamed and header.tensors:
                        raise MalformedStreamError(f"a streamed push declares its tensors in its end, not in its "
                                                   f"header (tensors {header.tensors} with streamed set)")
                    lane = self._claim_lane(header.lane, context)
                elif header is None:
                    raise MalformedStreamError("a Push stream must start with a header")
                bind_lane(chunks, lane, self._lane_seconds(context))
                for chunk in chunks:
                    self.push_bytes.add(len(chunk.data))
                    done = assembler.add(chunk)
                    if done is not None:
                        grads[done[0]] = done[1]
                if message_end is not None:
                    if not header.streamed:
                        raise MalformedStreamError("a push that is not streamed (PushHeader.streamed unset) "
                                                   "carries an end; nothing was applied")
                    end = message_end
            assembler.finish()
            if header is None:
                raise MalformedStreamError("empty Push stream: no header")
            if lane is not None:  # every byte it carried was read: give it back before the push waits
                self._release_lane(lane, lane.finished())
                lane = None
            if header.streamed:
                if end is None:
                    raise MalformedStreamError(f"a streamed push ended without its end message ({len(grads)} "
                                               f"tensors arrived); nothing was applied")
                if end.tensors != len(grads):
                    raise MalformedStreamError(f"the streamed push's end counted {end.tensors} tensors but "
                                               f"{len(grads)} arrived complete; nothing was applied")
            if header.tensors and len(grads) != header.tensors:
                raise MalformedStreamError(f"the push declared {header.tensors} tensors but {len(grads)} arrived "
                                           f"complete; nothing was applied")
            require_active(context)
            caller = self._check_self(context, header.worker, "Push")
            staleness = self.store.step - header.step if self.metrics is not None else 0
            data = self.queue_desk.before_push(header)  # its data positions (ps 0): checked before it is applied
            result = None
            try:
                result = yield from self.coordinator.push_waiting(
                    header.worker, header.incarnation, header.seq, header.step,
                    {n: g for n, g in grads.items() if n not in moved}, header.step_increment,
                    cancelled=lambda: not context.is_active(), hold=hold, timeout=remaining(context),
                    by=step_authority(caller), received=received, repeat=bool(moved),
                    layout_epoch=header.layout_epoch)
            finally:
                self.queue_desk.after_push(data, header, result)  # counted once applied, before it is answered
            if self.metrics is not None:
                self.metrics.pushed(time.monotonic() - started, result.wait_seconds, staleness, result.duplicate)
        finally:
            grads.clear()  # the gradients' memory goes now, not when gRPC lets go of this frame
            received.clear()
            self._release_lane(lane, False)  # still held: the stream failed before its end
            del assembler, done  # a tensor it was filling; the last one it completed
            reservation.release()  # before the buffers are kept: they count as kept from then on
            while taken:
                self.receive_buffers.give_back(taken.pop())
        return header, ps_pb2.PushResponse(
            step=result.step, versions=result.versions, next_step=result.next_step, stale=result.stale,
            duplicate=result.duplicate, wait_seconds=result.wait_seconds, quorum=result.quorum,
            generation=self.generation, layout_epoch=self.coordinator.layout.epoch)

    def _read(self, names: list[str], chunk_bytes: int, result: ps_pb2.PushResponse | None = None,
              casts: list | None = None, bases: list[int] | None = None, lane: Lane | None = None,
              context: CallContext | None = None):
        """_messages' replies; with a bulk `lane`, each message without its chunks' data, which follows on
        the lane as one frame once gRPC took the message (the client reads it after the message)."""
        if lane is None:
            yield from self._messages(names, chunk_bytes, result, casts, bases)
            return
        pending: list = []
        for message in self._messages(names, chunk_bytes, result, casts, bases, pending, lane):
            yield message
            lane.send(pending, self._lane_seconds(context))
            pending.clear()

    def _messages(self, names: list[str], chunk_bytes: int, result: ps_pb2.PushResponse | None = None,
                  casts: list | None = None, bases: list[int] | None = None, pending: list | None = None,
                  lane: Lane | None = None):
        """Serialized PullResponses for `names`, in order; `result` rides on the first message.

        Each variable is sent as one consistent version with at most one
        message's worth of copies: a variable larger than a chunk is encoded a
        chunk at a time under its lock (reads.VersionedRead: an update racing
        the read first saves the unread bytes); smaller ones are copied under
        their lock and packed several to a message. No lock is held while
        bytes go out. `casts` (from _casts) sends variables as a narrower
        float, converted a chunk's worth of whole elements at a time. A
        variable the pull cache holds at its version (pull_cache.py) is sent
        from the cache's bytes instead, held until the last message went out.
        With `bases` (from _bases), a variable whose changes since its base
        the store knows goes as a DELTA of them (store.read_delta), packed as
        small ones are.
        """
        chunk_bytes = min(chunk_bytes or codec.DEFAULT_CHUNK_BYTES, self.max_chunk_bytes)
        step = self.store.step
        small: list[wire.Piece] = []
        small_bytes = 0
        sent = False

        def message(pieces) -> bytes:
            nonlocal sent
            first, sent = not sent, True
            self.pull_bytes.add(sum(len(piece[3]) for piece in pieces))
            if pending is not None:
                pending.extend(piece[3] for piece in pieces)
            return wire.encode_pull_response(pieces, step, result if first else None, self.generation,
                                             lane=pending is not None)

        def staged(view):
            """`view` (a variable's memory, under its lock) itself inline, where encoding copies it; copied
            into the lane's scratch buffer for a lane (sent after the lock is let go)."""
            if pending is None:
                return view
            if lane.scratch is None or len(lane.scratch) < len(view):  # kept with the lane, reused call to call
                lane.scratch = np.empty(max(chunk_bytes, len(view)), dtype=np.uint8)
            out = lane.scratch[:len(view)]
            out[:] = np.frombuffer(view, dtype=np.uint8)
            return memoryview(out)

        def add_small(pieces, size):
            nonlocal small, small_bytes
            if small and small_bytes + size > chunk_bytes:
                yield message(small)
                small, small_bytes = [], 0
            small += pieces
            small_bytes += size

        with contextlib.ExitStack() as held:  # the cached bytes this pull sends from, held to its end
            for name, cast, base in zip(names, casts or [None] * len(names), bases or [None] * len(names)):
                delta = None if base is None else self.store.read_delta(name, base, cast)
                if delta is not None:
                    for piece in wire.delta_pieces(name, self.store.get(name).spec.meta.shape, *delta, chunk_bytes):
                        yield from add_small([piece], len(piece[3]))
                    continue
                variable = self.store.get(name)
                stored, width = variable.value.dtype, variable.value.element_size()
                size = variable.nbytes if cast is None else variable.nbytes // width * cast.itemsize
                meta = variable.spec.meta if cast is None else ps_pb2.TensorMeta(
                    dtype=codec.wire_dtype(cast), shape=variable.spec.meta.shape)
                cached = held.enter_context(self.pull_cache.lookup(variable, cast))
                if cached is not None:  # as read below, from the cache's bytes
                    pieces = wire.byte_pieces(name, meta, memoryview(cached.data), chunk_bytes if cast is None
                                              else chunk_bytes // cast.itemsize * cast.itemsize, cached.version)
                    if size > chunk_bytes:
                        for piece in pieces:
                            yield message([piece])
                    else:
                        yield from add_small(pieces, size)
                    continue
                if size > chunk_bytes:
                    def piece(view, offset):  # under the variable's lock: encodes (copies) before returning
                        if cast is not None:
                            view, offset = compression.cast_bytes(view, stored, cast), offset // width * cast.itemsize
                        else:
                            view = staged(view)
                        return message([(name, meta if offset == 0 else None, offset, view,
                                         read.version if offset == 0 else 0)])

                    with self.store.versioned_read(name) as read:
                        while read.offset < read.nbytes:
                            yield read.take(chunk_bytes if cast is None else chunk_bytes // cast.itemsize * width,
                                            piece)
                    continue
                yield from add_small(self.store.read(name, lambda value, version: wire.tensor_pieces(
                    name, value.clone() if cast is None else value.to(cast), chunk_bytes, version)), size)
            if small or not sent:
                yield message(small)

    @map_errors
    def UpdateOptimizer(self, request, context):
        """Sets hyperparameters (store.set_hyperparams, which refuses a change of the state's structure after
        a variable's first step); optimizer state the change adds (momentum turned on) must fit --max-memory."""
        names, updates = list(request.names), dict(request.hyperparams)
        with self._creating:  # against creations: one memory quota
            if self.quotas.max_memory:
                growth = {}
                for variable in self.store.trainable(names):
                    optimizer = variable.optimizer
                    now = optimizer_slots(optimizer.name, optimizer.current())
                    after = optimizer_slots(optimizer.name, {**optimizer.current(), **updates})
                    if after > now:
                        growth[variable.spec.name] = variable.nbytes * (after - now)
                if growth:
                    self.quotas.check_total(self.held_total(), growth, what="optimizer state")
            updated = self.coordinator.set_hyperparams(names, updates)
        return ps_pb2.UpdateOptimizerResponse(updated=updated)

    @map_errors
    def ListVariables(self, request, context):
        names = list(request.names)
        if not (math.isfinite(request.wait_seconds) and request.wait_seconds >= 0):
            raise InvalidArgumentError(f"wait_seconds must be finite and >= 0. Received: {request.wait_seconds}")
        if names and request.wait_seconds > 0:
            context.add_callback(self.store.wake)
            with self.coordinator.waits.slot("list"):
                self.store.wait_for(names, min(request.wait_seconds, MAX_LIST_WAIT_SECONDS),
                                    lambda: not context.is_active())
        wanted = set(names)
        infos = []
        for name in self.store.names():
            if wanted and name not in wanted:
                continue
            variable = self.store.get(name)
            infos.append(ps_pb2.VariableInfo(spec=variable.spec, version=variable.version, nbytes=variable.nbytes))
        return ps_pb2.ListResponse(variables=infos, step=self.store.step, generation=self.generation)


def add_to_server(servicer: ParameterServerServicer, server: grpc.aio.Server, pool: Executor,
                  arbitration: Executor) -> None:
    """Registers every RPC of ps.proto's ParameterServer service on `server` (edge.handler: bodies on `pool`,
    waits on the event loop; GetStatus on the loop itself; SetReplica on `arbitration`: a call on `pool` may
    wait for this shard's journal, which may wait for a DROP this shard decides as an arbiter)."""
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]

    def fail(name: str, exc: Exception, context: CallContext) -> tuple[grpc.StatusCode, str, tuple]:
        code, details, trailing = status_of(name, exc, context)
        if servicer.metrics is not None:
            servicer.metrics.failed(name, code.name)
        return code, details, trailing

    def on_loop(kind, body, deserializer, serializer):
        streaming = kind in (unary_stream, stream_stream)
        return kind(handler(body, name=body.__name__, inline=body.__name__ == "GetStatus",
                            pool=arbitration if body.__name__ == "SetReplica" else pool, fail=fail,
                            streaming=streaming), deserializer, serializer)

    unary, unary_stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    stream_stream = grpc.stream_stream_rpc_method_handler
    stream_unary = grpc.stream_unary_rpc_method_handler
    handlers = {
        # Streams of requests, and PushPull, are decoded by the handlers (see decoded).
        "CreateVariables": on_loop(stream_unary, servicer.CreateVariables, None,
            ps_pb2.CreateResponse.SerializeToString),
        "Pull": on_loop(unary_stream, servicer.Pull, ps_pb2.PullRequest.FromString,
            bytes),  # Pull yields serialized messages
        "Push": on_loop(stream_unary, servicer.Push, None, ps_pb2.PushResponse.SerializeToString),
        "PullOne": on_loop(unary, servicer.PullOne, ps_pb2.PullRequest.FromString, bytes),  # one serialized message
        "PushOne": on_loop(unary, servicer.PushOne, None, ps_pb2.PushResponse.SerializeToString),
        "PushPull": on_loop(unary, servicer.PushPull, None, bytes),  # returns a serialized message
        "UpdateOptimizer": on_loop(unary, servicer.UpdateOptimizer, ps_pb2.UpdateOptimizerRequest.FromString,
            ps_pb2.UpdateOptimizerResponse.SerializeToString),
        "ListVariables": on_loop(unary, servicer.ListVariables, ps_pb2.ListRequest.FromString,
            ps_pb2.ListResponse.SerializeToString),
        "GetStatus": on_loop(unary, servicer.GetStatus, ps_pb2.StatusRequest.FromString,
            ps_pb2.StatusResponse.SerializeToString),
        "Configure": on_loop(unary, servicer.Configure, ps_pb2.SyncConfig.FromString,
            ps_pb2.ConfigureResponse.SerializeToString),
        "Join": on_loop(unary, servicer.Join, ps_pb2.WorkerRef.FromString, ps_pb2.JoinResponse.SerializeToString),
        "Heartbeat": on_loop(unary, servicer.Heartbeat, ps_pb2.WorkerRef.FromString,
            ps_pb2.HeartbeatResponse.SerializeToString),
        "Leave": on_loop(unary, servicer.Leave, ps_pb2.WorkerRef.FromString, ps_pb2.LeaveResponse.SerializeToString),
        "Save": on_loop(unary, servicer.Save, ps_pb2.SaveRequest.FromString, ps_pb2.SaveResponse.SerializeToString),
        "CommitCheckpoint": on_loop(unary, servicer.CommitCheckpoint, ps_pb2.CommitRequest.FromString,
            ps_pb2.CommitResponse.SerializeToString),
        "Shutdown": on_loop(unary, servicer.Shutdown, ps_pb2.ShutdownRequest.FromString,
            ps_pb2.ShutdownResponse.SerializeToString),
        "CreateTables": on_loop(unary, servicer.CreateTables, ps_pb2.CreateTablesRequest.FromString,
            ps_pb2.CreateTablesResponse.SerializeToString),
        "LookupRows": on_loop(unary_stream, servicer.LookupRows, ps_pb2.LookupRowsRequest.FromString,
            bytes),  # yields serialized PullResponses
        "ListTables": on_loop(unary, servicer.ListTables, ps_pb2.ListRequest.FromString,
            ps_pb2.ListTablesResponse.SerializeToString),
        "CreateDataQueue": on_loop(unary, servicer.CreateDataQueue, ps_pb2.DataQueueSpec.FromString,
            ps_pb2.CreateDataQueueResponse.SerializeToString),
        "TakeDataShard": on_loop(unary, servicer.TakeDataShard, ps_pb2.TakeDataShardRequest.FromString,
            ps_pb2.TakeDataShardResponse.SerializeToString),
        "GetDataQueue": on_loop(unary, servicer.GetDataQueue, ps_pb2.DataQueueRequest.FromString,
            ps_pb2.DataQueueStatus.SerializeToString),
        "GetLayout": on_loop(unary, servicer.GetLayout, ps_pb2.LayoutRequest.FromString,
            ps_pb2.Layout.SerializeToString),
        "SetLayout": on_loop(unary, servicer.SetLayout, ps_pb2.Layout.FromString, ps_pb2.Layout.SerializeToString),
        "ExportVariables": on_loop(unary_stream, servicer.ExportVariables, ps_pb2.MoveRequest.FromString,
            ps_pb2.MoveChunk.SerializeToString),
        "ImportVariables": on_loop(stream_unary, servicer.ImportVariables, None,
            ps_pb2.MoveResponse.SerializeToString),
        "ConfirmMove": on_loop(unary, servicer.ConfirmMove, ps_pb2.MoveRequest.FromString,
            ps_pb2.MoveResponse.SerializeToString),
        "Resize": on_loop(unary, servicer.Resize, ps_pb2.ResizeRequest.FromString,
            ps_pb2.ResizeState.SerializeToString),
        "Replicate": stream_stream(replicate_handler(servicer, pool, fail), None, bytes),  # serialized frames
        "SetReplica": on_loop(unary, servicer.SetReplica, ps_pb2.ReplicaChange.FromString,
            ps_pb2.ShardReplicas.SerializeToString),
        "ReadChanges": on_loop(unary_stream, servicer.ReadChanges, ps_pb2.ChangesRequest.FromString,
            bytes),  # yields serialized TableChanges
    }
    missing = {m.name for m in service.methods} ^ set(handlers)
    if missing:
        raise RuntimeError(f"servicer and ps.proto disagree on methods: {sorted(missing)}")
    # Registered, each method is accepted on its own: gRPC's aio server takes its next call of each registered
    # method as soon as one came in, where one generic handler takes every call in one line, so a GetStatus
    # would wait behind each of the hundreds of pushes a sync step's release sets off.
    server.add_registered_method_handlers(service.full_name, handlers)
