"""The gRPC edge of a shard: decode requests, call the store, encode replies, map errors.

Every method runs as an asyncio handler (edge.py): its body here is blocking
code on the shard's thread pool, and the bodies that wait for a sync release
or a step (Push, PushPull, Pull) yield their waits (waits.Wait) to the event
loop instead of holding a thread. `_status_of` is the one place where PSError
subclasses become gRPC status codes (with the class name in the trailing
metadata key `torchps-error`) and anything unexpected becomes INTERNAL, so a
bad request never takes the server down.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import random
import threading
import time
from concurrent.futures import Executor
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from .. import codec, compression, rows, wire
from . import checkpoint
from ..errors import (ERROR_METADATA_KEY, CheckpointError, InternalServerError, InvalidArgumentError,
                      LayoutChangedError, MalformedStreamError, ModeConflictError, PermissionDeniedError, PSError,
                      SpecConflictError)
from ..memory import memory_usage
from ..partitioning import check_manifest
from ..placement import Placement
from ..proto import ps_pb2, ps_pb2_grpc
from ..security import INSECURE, Security
from .auth import Authority, Caller
from .metrics import ShardMetrics
from .coordinator import CHIEF, MAX_STEP, READER, WORKER, Coordinator
from .edge import CallContext, CallEnded, handler
from .dataqueue import QueueSpec
from .quotas import Quotas, optimizer_slots
from .modes import SyncConfig
from .stalls import DEFAULT_IDLE_SECONDS, StallWatch
from .store import NewVariable, VariableStore
from .tables import RowGradient
from .tokens import TokenFile
from .waits import Waiting

__all__ = ["ParameterServerServicer", "add_to_server", "config_from_proto", "config_to_proto"]

_LOGGER = logging.getLogger(__name__)
MAX_JOINED_OF = 65536  # StatusRequest.joined_of: names looked up in one GetStatus
MAX_LIST_WAIT_SECONDS = 60.0  # a ListVariables wait holds an RPC thread; clients repeat shorter waits
MEMORY_REFRESH_SECONDS = 1.0  # GetStatus is the clients' readiness probe: /proc and malloc are read this often


def _status_of(method: str, exc: Exception, context: CallContext) -> tuple[grpc.StatusCode, str, tuple]:
    """The status a call that raised `exc` ends with: (code, details, trailing metadata)."""
    if context.stalled is not None:
        return grpc.StatusCode.DEADLINE_EXCEEDED, context.stalled, ()
    if isinstance(exc, PSError):
        _LOGGER.debug("%s rejected: %s", method, exc)
        return getattr(grpc.StatusCode, exc.grpc_code), str(exc), ((ERROR_METADATA_KEY, type(exc).__name__),)
    if isinstance(exc, (grpc.RpcError, CallEnded)) or not context.is_active():
        _LOGGER.info("%s: the client went away mid-call; nothing was applied", method)
        return grpc.StatusCode.CANCELLED, "the client cancelled the call", ()
    _LOGGER.exception("%s failed unexpectedly", method, exc_info=exc)
    error = InternalServerError(f"{method} failed on the shard: {type(exc).__name__}: {exc}")
    return grpc.StatusCode.INTERNAL, str(error), ((ERROR_METADATA_KEY, type(error).__name__),)


def _remaining(context: CallContext) -> float | None:
    """Seconds left before the call's deadline, or None without one (gRPC then reports a huge value)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e7 else max(0.0, remaining)


def _decode(decode, raw: bytes):
    """decode(raw), with any parse failure as MalformedStreamError (INVALID_ARGUMENT)."""
    try:
        return decode(raw)
    except DecodeError as exc:
        raise MalformedStreamError(f"malformed protobuf message: {exc}") from None


def _decoded(request_iterator, decode):
    """Decodes a request stream in the handler, not in gRPC: gRPC would end a stream whose next
    message does not parse as if it had simply finished, and the handler would apply a prefix."""
    for raw in request_iterator:
        yield _decode(decode, raw)


def _check_same_meta(declared: ps_pb2.VariableSpec, held: ps_pb2.VariableSpec) -> None:
    """SpecConflictError if a stream re-declares a held variable with another dtype or shape."""
    if declared.meta != held.meta:
        raise SpecConflictError(f"variable {held.name!r} already exists as {codec.describe_meta(held.meta)}; the "
                                f"request declared {codec.describe_meta(declared.meta)}. Use another name, or the "
                                f"same spec.")


def _require_active(context: CallContext) -> None:
    """Raises unless the call is still alive: gRPC may have cut the stream (an oversized message)."""
    if not context.is_active():
        raise MalformedStreamError("the call ended before the stream was complete; nothing was applied")


def _map_errors(method):
    """Checks the caller's role and the client's quota of calls, then runs a handler's body (edge.handler maps
    what it raises); counts finished calls. A generator body (streaming replies, or yielding its waits) stays
    one."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def waiting(self, request, context):
            self.calls_started.add()
            try:
                caller = self.authority.caller(method.__name__, context)
                with self.quotas.call(caller.name or context.peer()):
                    return (yield from method(self, request, context))
            finally:
                self.calls_done.add()
        return waiting

    @functools.wraps(method)
    def unary(self, request, context):
        self.calls_started.add()
        try:
            caller = self.authority.caller(method.__name__, context)
            with self.quotas.call(caller.name or context.peer()):
                return method(self, request, context)
        finally:
            self.calls_done.add()
    return unary


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


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    """Serves one shard's VariableStore over the ParameterServer service.

    Register it with `add_to_server`, which uses wire.py's codecs for Pull's
    responses and Push's requests and the generated classes for the rest.
    """

    def __init__(self, store: VariableStore, coordinator: Coordinator, index: int, *, max_chunk_bytes: int,
                 checkpoint_dir: str | None = None, on_shutdown: Callable[[str], None] | None = None,
                 security: Security = INSECURE, quotas: Quotas | None = None, metrics: ShardMetrics | None = None,
                 stream_idle_seconds: float = DEFAULT_IDLE_SECONDS, tokens: TokenFile | None = None):
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

    @_map_errors
    def CreateVariables(self, request_iterator, context):
        requests: list[NewVariable] = []
        pending = None  # the spec whose initial value is arriving
        declared = job_step = None
        assembler = codec.ChunkAssembler()
        existing = set(self.store.names())
        held = self.held_total()
        incoming = 0
        for message in _decoded(self._watched(request_iterator, context, "CreateVariables"),
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
        _require_active(context)
        with self._creating:  # the memory check again, now that no other stream can create in between
            names = set(self.store.names())
            self.quotas.check_total(self.held_total(),
                                    {r.name: r.value.nbytes * (1 + optimizer_slots(r.optimizer, r.hyperparams))
                                     for r in requests if r.name not in names})
            created = self.coordinator.create(requests, job_step=job_step or 0)
        return ps_pb2.CreateResponse(created=created, generation=self.generation)

    @_map_errors
    def Pull(self, request, context):
        """Yields serialized PullResponse messages (see wire.py); each variable is copied under its lock."""
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
        if request.min_step:  # waits on the event loop (edge.py)
            yield from self.coordinator.step_waiting(request.min_step, _remaining(context),
                                                     lambda: not context.is_active(),
                                                     by=_step_authority(self.authority.caller("Pull", context)))
        yield from self._read(names, request.chunk_bytes, casts=casts, bases=bases)

    @_map_errors
    def Push(self, request_iterator, context):
        """Applies a complete, valid stream of gradients (see Coordinator.push); a held push waits on the event
        loop (edge.py)."""
        header, reply = yield from self._receive_push(
            _decoded(self._watched(request_iterator, context, "Push"), wire.decode_push_request), context)
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

    @_map_errors
    def PushPull(self, request, context):
        """Push of one message, then the header's `pull` variables in one reply.

        In sync mode the reply waits until the worker may go on, as shard 0's
        reply to a Push does, so it carries the released step's values.
        """
        header, chunks, end = _decode(wire.decode_push_request, request)
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

    def _decode_gradient(self, name: str, meta: ps_pb2.TensorMeta, raw, received: dict):
        """A complete pushed tensor (checked by _check_gradient): a table's RowGradient, or a dense tensor of
        its variable's dtype; a compressed one is also kept as it came in `received` (for the journal)."""
        if meta.encoding == ps_pb2.ROWS:
            return RowGradient(*rows.decode_rows(meta, raw))
        variable = self.store.get(name).spec.meta
        if meta.encoding != ps_pb2.DENSE or meta.dtype != variable.dtype:
            received[name] = (meta, raw)
        return compression.decode(name, meta, raw, variable)

    def _receive_push(self, messages, context, *, hold: bool = False
                      ) -> Waiting[tuple[ps_pb2.PushHeader, ps_pb2.PushResponse]]:
        """Assembles decoded (header, chunks, end) messages, then hands the push to the coordinator; yields
        where the push waits (Coordinator.push_waiting).

        The tensor count is checked before anything is applied: the header's `tensors` if declared, or for
        a streamed push (PushHeader.streamed) the `end` its last message carries, which must be there.
        """
        started = time.monotonic()
        header = end = None
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
                reservation.add(self._receive_bytes(name, meta), f"the gradient for {name!r}")

        assembler = codec.ChunkAssembler(
            begin=begin, decode=lambda name, meta, raw: None if name in moved
            else self._decode_gradient(name, meta, raw, received))
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
                elif header is None:
                    raise MalformedStreamError("a Push stream must start with a header")
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
            _require_active(context)
            caller = self._check_self(context, header.worker, "Push")
            context.add_callback(self.coordinator.wake)
            staleness = self.store.step - header.step if self.metrics is not None else 0
            data = self.queue_desk.before_push(header)  # its data positions (ps 0): checked before it is applied
            result = None
            try:
                result = yield from self.coordinator.push_waiting(
                    header.worker, header.incarnation, header.seq, header.step,
                    {n: g for n, g in grads.items() if n not in moved}, header.step_increment,
                    cancelled=lambda: not context.is_active(), hold=hold, timeout=_remaining(context),
                    by=_step_authority(caller), received=received, repeat=bool(moved))
            finally:
                self.queue_desk.after_push(data, header, result)  # counted once applied, before it is answered
            if self.metrics is not None:
                self.metrics.pushed(time.monotonic() - started, result.wait_seconds, staleness, result.duplicate)
        finally:
            grads.clear()  # the gradients' memory goes now, not when gRPC lets go of this frame
            received.clear()
            reservation.release()
        return header, ps_pb2.PushResponse(
            step=result.step, versions=result.versions, next_step=result.next_step, stale=result.stale,
            duplicate=result.duplicate, wait_seconds=result.wait_seconds, quorum=result.quorum,
            generation=self.generation, layout_epoch=self.coordinator.layout.epoch)

    def _read(self, names: list[str], chunk_bytes: int, result: ps_pb2.PushResponse | None = None,
              casts: list | None = None, bases: list[int] | None = None):
        """Serialized PullResponses for `names`, in order; `result` rides on the first message.

        Each variable is sent as one consistent version with at most one
        message's worth of copies: a variable larger than a chunk is encoded a
        chunk at a time under its lock (reads.VersionedRead: an update racing
        the read first saves the unread bytes); smaller ones are copied under
        their lock and packed several to a message. No lock is held while
        bytes go out. `casts` (from _casts) sends variables as a narrower
        float, converted a chunk's worth of whole elements at a time. With
        `bases` (from _bases), a variable whose changes since its base the
        store knows goes as a DELTA of them (store.read_delta), packed as
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
            return wire.encode_pull_response(pieces, step, result if first else None, self.generation)

        for name, cast, base in zip(names, casts or [None] * len(names), bases or [None] * len(names)):
            delta = None if base is None else self.store.read_delta(name, base, cast)
            if delta is not None:
                for piece in wire.delta_pieces(name, self.store.get(name).spec.meta.shape, *delta, chunk_bytes):
                    if small and small_bytes + len(piece[3]) > chunk_bytes:
                        yield message(small)
                        small, small_bytes = [], 0
                    small.append(piece)
                    small_bytes += len(piece[3])
                continue
            variable = self.store.get(name)
            stored, width = variable.value.dtype, variable.value.element_size()
            size = variable.nbytes if cast is None else variable.nbytes // width * cast.itemsize
            if size > chunk_bytes:
                meta = variable.spec.meta if cast is None else ps_pb2.TensorMeta(
                    dtype=codec.wire_dtype(cast), shape=variable.spec.meta.shape)

                def piece(view, offset):  # under the variable's lock: encodes (copies) before returning
                    if cast is not None:
                        view, offset = compression.cast_bytes(view, stored, cast), offset // width * cast.itemsize
                    return message([(name, meta if offset == 0 else None, offset, view,
                                     read.version if offset == 0 else 0)])

                with self.store.versioned_read(name) as read:
                    while read.offset < read.nbytes:
                        yield read.take(chunk_bytes if cast is None else chunk_bytes // cast.itemsize * width, piece)
                continue
            pieces = self.store.read(name, lambda value, version: wire.tensor_pieces(
                name, value.clone() if cast is None else value.to(cast), chunk_bytes, version))
            if small and small_bytes + size > chunk_bytes:
                yield message(small)
                small, small_bytes = [], 0
            small += pieces
            small_bytes += size
        if small or not sent:
            yield message(small)

    @_map_errors
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

    @_map_errors
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

    def held_bytes(self) -> tuple[int, int]:
        """(bytes of values, bytes of optimizer state, as the hyperparameters in force keep it) of the
        variables the shard holds."""
        variables = [self.store.get(name) for name in self.store.names()]
        values = sum(v.nbytes for v in variables)
        return values, sum(v.nbytes * optimizer_slots(v.optimizer.name, v.optimizer.current()) for v in variables)

    def held_total(self) -> int:
        """What the memory quota counts as held: variables with their optimizer state, and embedding tables."""
        return sum(self.held_bytes()) + self.coordinator.tables.nbytes()

    @_map_errors
    def GetStatus(self, request, context):
        coordinator = self.coordinator
        if len(request.joined_of) > MAX_JOINED_OF:
            raise InvalidArgumentError(f"GetStatus looks up at most {MAX_JOINED_OF} names in joined_of. "
                                       f"Received: {len(request.joined_of)}")
        values, state = self.held_bytes()
        return ps_pb2.StatusResponse(
            index=self.index, step=self.store.step, num_variables=len(self.store.names()), total_bytes=values,
            state_bytes=state, pid=os.getpid(),
            memory=ps_pb2.MemoryUsage(**self.memory.get()), metrics_port=self.metrics_port,
            paces=[ps_pb2.WorkerPace(worker=w, push_interval_seconds=i, straggler_score=score)
                   for w, (i, score) in coordinator.paces().items()],
            config=config_to_proto(coordinator.config), generation=self.generation,
            restored_step=coordinator.restored_step, checkpoints=bool(self.checkpoint_dir),
            calls_started=self.calls_started.value, calls_done=self.calls_done.value,
            push_bytes_received=self.push_bytes.value, tables=coordinator.tables.status(),
            layout_epoch=coordinator.layout.epoch, not_joined=coordinator.never_joined(list(request.joined_of)),
            **coordinator.counters())

    @_map_errors
    def Configure(self, request, context):
        return ps_pb2.ConfigureResponse(changed=self.coordinator.configure(config_from_proto(request)))

    def _check_self(self, context: CallContext, worker: str, method: str) -> Caller:
        """The caller; PermissionDeniedError if a named worker names another worker in its request."""
        caller = self.authority.caller(method, context)
        self.authority.check_self(caller, worker, method)
        return caller

    @_map_errors
    def Join(self, request, context):
        caller = self._check_self(context, request.worker, "Join")
        step = self.coordinator.join(request.worker, request.incarnation, request.step, by=_step_authority(caller))
        return ps_pb2.JoinResponse(step=step, config=config_to_proto(self.coordinator.config),
                                   generation=self.generation, restarted=self.coordinator.restarted(request.worker),
                                   live_workers=self.coordinator.live_workers(),
                                   layout_epoch=self.coordinator.layout.epoch)

    @_map_errors
    def Heartbeat(self, request, context):
        caller = self._check_self(context, request.worker, "Heartbeat")
        step = self.coordinator.heartbeat(request.worker, request.incarnation, request.step,
                                          by=_step_authority(caller))
        return ps_pb2.HeartbeatResponse(step=step, generation=self.generation,
                                        live_workers=self.coordinator.live_workers(),
                                        layout_epoch=self.coordinator.layout.epoch)

    @_map_errors
    def Leave(self, request, context):
        self._check_self(context, request.worker, "Leave")
        self.coordinator.leave(request.worker, request.incarnation)
        return ps_pb2.LeaveResponse()

    @_map_errors
    def Save(self, request, context):
        """Writes this shard's state at the checkpoint's step (snapshots.py): variables and every embedding
        table (table_state.py), copied at one instant under the apply gate. Blocks until the shard reaches
        the step (at most the call's deadline), then for the copy and the file's write and fsync; if it
        raises, no file of this shard counts for the checkpoint (shard 0 will not commit it)."""
        if not 0 <= request.step <= MAX_STEP:
            raise InvalidArgumentError(f"step must be in [0, {MAX_STEP}]. Received: {request.step}")
        self._require_checkpoints()
        started = time.monotonic()
        context.add_callback(self.coordinator.wake)
        state = self.coordinator.snapshot_at(request.step, _remaining(context), lambda: not context.is_active(),
                                             now=request.now)
        try:
            path, size = checkpoint.write_shard(self.checkpoint_dir, self.index, request.step, state)
        except OSError as exc:
            raise CheckpointError(f"ps {self.index} could not write its checkpoint under {self.checkpoint_dir}: "
                                  f"{exc}") from None
        _LOGGER.info("ps %d saved its state at step %d for checkpoint %d (%s, %d bytes)", self.index, state["step"],
                     request.step, path, size)
        if self.metrics is not None:
            self.metrics.saved(time.monotonic() - started)
        return ps_pb2.SaveResponse(step=state["step"], path=str(path), bytes=size, index=self.index)

    @_map_errors
    def CommitCheckpoint(self, request, context):
        """Shard 0 commits a checkpoint every shard saved: checks each file (size, table section) and writes
        the manifest with the client's placement and the tables the files hold (checkpoint.commit). Blocks
        for the checks and writes; if it raises, the checkpoint is not committed."""
        self._require_checkpoints()
        if not 0 <= request.step <= MAX_STEP:
            raise InvalidArgumentError(f"step must be in [0, {MAX_STEP}]. Received: {request.step}")
        if self.index != 0:
            raise ModeConflictError(f"ps {self.index} does not commit checkpoints; ask ps 0")
        manifest = _placement_manifest(request.manifest_json)
        shards = [(s.index, s.bytes, s.step) for s in request.shards]
        try:
            path = checkpoint.commit(self.checkpoint_dir, request.step, manifest, shards, request.keep)
        except OSError as exc:
            raise CheckpointError(f"ps 0 could not commit checkpoint {request.step}: {exc}") from None
        _LOGGER.info("checkpoint %d committed (%s)", request.step, path)
        return ps_pb2.CommitResponse(path=str(path))

    def _require_checkpoints(self) -> None:
        if not self.checkpoint_dir:
            raise ModeConflictError(f"ps {self.index} has no checkpoint directory: start ps-server with --checkpoint-dir")

    # -- embedding tables ---------------------------------------------------------------------

    @_map_errors
    def CreateTables(self, request, context):
        if request.shard_index != self.index:
            raise ModeConflictError(f"this is ps {self.index}; the request was made for ps {request.shard_index}")
        with self._creating:  # against CreateVariables: one namespace, one memory quota
            def check_memory(adding: dict[str, int]) -> None:
                self.quotas.check_total(self.held_total(), adding)

            created = self.coordinator.create_tables(list(request.tables), request.shard_index, request.num_shards,
                                                     check_memory=check_memory)
        return ps_pb2.CreateTablesResponse(created=created, generation=self.generation)

    @_map_errors
    def LookupRows(self, request, context):
        """Yields serialized PullResponses (wire.py) with each table's rows, read by tables.TableStore.lookup."""
        if request.admit and self.authority.caller("LookupRows", context).role == "evaluator":
            raise PermissionDeniedError(f"ps {self.index} refused an admitting LookupRows from an evaluator: "
                                        f"evaluators read rows without admit")
        if request.chunk_bytes and request.chunk_bytes < codec.MIN_CHUNK_BYTES:
            raise InvalidArgumentError(f"chunk_bytes must be 0 or at least {codec.MIN_CHUNK_BYTES}. "
                                       f"Received: {request.chunk_bytes}")
        chunk_bytes = min(request.chunk_bytes or codec.DEFAULT_CHUNK_BYTES, self.max_chunk_bytes)
        names = [t.name for t in request.tables]
        if request.admit and self.quotas.max_memory:  # dynamic tables grow by admitting: within --max-memory
            tables = self.coordinator.tables
            dynamic = [name for name in names if not tables.get(name).table.fixed]
            if dynamic:
                self.quotas.check_admission(self.held_total(), dynamic)
        found = self.coordinator.lookup_rows([(t.name, rows.ids_from_bytes(t.ids)) for t in request.tables],
                                             admit=request.admit)
        step = self.store.step
        pieces = (piece for name, value in zip(names, found) for piece in wire.tensor_pieces(name, value, chunk_bytes))
        sent = False
        for batch in wire.pack(pieces, chunk_bytes):
            sent = True
            self.pull_bytes.add(sum(len(piece[3]) for piece in batch))
            yield wire.encode_pull_response(batch, step)
        if not sent:
            yield wire.encode_pull_response([], step)

    @_map_errors
    def ListTables(self, request, context):
        names = list(request.names)
        if not (math.isfinite(request.wait_seconds) and request.wait_seconds >= 0):
            raise InvalidArgumentError(f"wait_seconds must be finite and >= 0. Received: {request.wait_seconds}")
        tables = self.coordinator.tables
        if names and request.wait_seconds > 0:
            context.add_callback(tables.wake)
            with self.coordinator.waits.slot("list"):
                tables.wait_for(names, min(request.wait_seconds, MAX_LIST_WAIT_SECONDS),
                                lambda: not context.is_active())
        return ps_pb2.ListTablesResponse(tables=tables.infos(names or None), step=self.store.step,
                                         generation=self.generation)

    # -- data queues (dynamic sharding) -----------------------------------------------------------

    @_map_errors
    def CreateDataQueue(self, request, context):
        spec = QueueSpec(request.name, request.num_examples, request.shard_size, request.epochs, request.seed)
        return ps_pb2.CreateDataQueueResponse(created=self.queue_desk.create(spec))

    @_map_errors
    def TakeDataShard(self, request, context):
        self._check_self(context, request.worker, "TakeDataShard")
        wait = _wait_seconds(request.wait_seconds)
        context.add_callback(self.coordinator.wake)
        lease, finished = self.queue_desk.take(request.queue, request.worker, request.incarnation, wait,
                                               lambda: not context.is_active())
        return ps_pb2.TakeDataShardResponse(shard=_data_shard(request.queue, lease) if lease else None,
                                            finished=finished)

    @_map_errors
    def GetDataQueue(self, request, context):
        wait = _wait_seconds(request.wait_seconds)
        context.add_callback(self.coordinator.wake)
        status = self.queue_desk.status(request.name, wait, lambda: not context.is_active())
        spec = status["spec"]
        return ps_pb2.DataQueueStatus(
            spec=ps_pb2.DataQueueSpec(name=spec.name, num_examples=spec.num_examples, shard_size=spec.shard_size,
                                      epochs=spec.epochs, seed=spec.seed),
            epoch=status["epoch"], trained=status["trained"], epochs_done=status["epochs_done"],
            finished=status["finished"], shards_done=status["shards_done"],
            held=[_data_shard(spec.name, lease) for lease in status["held"]],
            holders=[lease.worker for lease in status["held"]], reclaimed=status["reclaimed"],
            requeued_examples=status["requeued_examples"], duplicates=status["duplicates"])

    # -- live resize (moves.py, layout.py) ------------------------------------------------------------

    @_map_errors
    def GetLayout(self, request, context):
        epoch, addresses, placement = self.coordinator.layout.layout()
        return ps_pb2.Layout(epoch=epoch, addresses=addresses, placement=placement, outbox=[
            ps_pb2.MoveRequest(names=names, epoch=epoch, to=to) for names, to in self.coordinator.layout.outbox()])

    @_map_errors
    def SetLayout(self, request, context):
        if self.coordinator.moves.set_layout(request.epoch, list(request.addresses), dict(request.placement)):
            _LOGGER.info("ps %d: layout epoch %d, %d shards, %d variables placed", self.index, request.epoch,
                         len(request.addresses), len(request.placement))
        return self.GetLayout(request, context)

    @_map_errors
    def ExportVariables(self, request, context):
        """Yields the exported state in chunks of at most max_chunk_bytes (moves.Moves.export)."""
        data, step = self.coordinator.moves.export(list(request.names), request.epoch, request.to)
        _LOGGER.info("ps %d: %d variables (%d bytes) exported to ps %d at layout epoch %d", self.index,
                     len(request.names), len(data), request.to, request.epoch)
        view = memoryview(data)
        for offset in range(0, max(1, len(data)), self.max_chunk_bytes):
            first = {"epoch": request.epoch, "from_shard": self.index, "step": step, "total_bytes": len(data)}
            yield ps_pb2.MoveChunk(data=bytes(view[offset:offset + self.max_chunk_bytes]),
                                   **(first if offset == 0 else {}))

    @_map_errors
    def ImportVariables(self, request_iterator, context):
        """Takes an exported state (moves.Moves.import_) once every byte its first chunk declared arrived."""
        data, head = bytearray(), None
        for chunk in _decoded(request_iterator, ps_pb2.MoveChunk.FromString):
            if head is None:
                head = chunk
                self.quotas.check_total(self.held_total(), {"imported variables": 2 * chunk.total_bytes})
            data += chunk.data
            if len(data) > head.total_bytes:
                raise MalformedStreamError(f"the moved state is longer than the {head.total_bytes} bytes declared")
        _require_active(context)
        if head is None or len(data) != head.total_bytes:
            raise MalformedStreamError(f"the moved state ended after {len(data)} of "
                                       f"{0 if head is None else head.total_bytes} bytes; nothing was imported")
        names = self.coordinator.moves.import_(bytes(data), head.epoch, head.step)
        _LOGGER.info("ps %d: %d variables imported from ps %d at layout epoch %d", self.index, len(names),
                     head.from_shard, head.epoch)
        return ps_pb2.MoveResponse(names=names, step=self.store.step)

    @_map_errors
    def Shutdown(self, request, context):
        _LOGGER.info("ps %d: shutdown requested (%s)", self.index, request.reason or "no reason given")
        self.coordinator.finish(request.reason or "shutdown requested")  # the job is done: its journal says so
        if self.on_shutdown is not None:
            context.add_callback(lambda: self.on_shutdown(request.reason))
        return ps_pb2.ShutdownResponse()


def _wait_seconds(seconds: float) -> float:
    """A request's wait_seconds; InvalidArgumentError unless finite and >= 0."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise InvalidArgumentError(f"wait_seconds must be finite and >= 0. Received: {seconds}")
    return seconds


def _data_shard(queue: str, lease) -> ps_pb2.DataShard:
    return ps_pb2.DataShard(queue=queue, lease=lease.id, epoch=lease.epoch, begin=lease.begin, end=lease.end,
                            progress=lease.progress)


def _step_authority(caller: Caller) -> str:
    """What a caller's step counts for on a shard catching up (coordinator: "Authority over the step")."""
    return {"chief": CHIEF, "worker": WORKER}.get(caller.role, READER)


def _placement_manifest(text: str) -> dict:
    """The client's placement manifest, checked the way a restore will read it; InvalidArgumentError if not."""
    try:
        manifest = json.loads(text)
        num_ps, strategy, variables = manifest["num_ps"], manifest["strategy"], manifest["variables"]
        if not isinstance(num_ps, int) or not 1 <= num_ps <= 100_000:
            raise ValueError(f"num_ps must be in [1, 100000], got {num_ps!r}")
        placement = Placement(num_ps, strategy)
        for name, nbytes in variables:
            if not isinstance(name, str) or not isinstance(nbytes, int) or nbytes < 0:
                raise ValueError(f"variables must be [name, bytes] pairs, got {[name, nbytes]!r}")
            placement.add(name, nbytes)
        check_manifest(manifest.get("partitions") or {"splits": {}})
    except (ValueError, KeyError, TypeError, PSError) as exc:
        raise InvalidArgumentError(f"manifest_json is not a placement manifest: {exc}") from None
    return manifest


def config_from_proto(message: ps_pb2.SyncConfig) -> SyncConfig:
    """SyncConfig from its message; zero lease, grace and progress timeout take the defaults."""
    defaults = SyncConfig()
    return SyncConfig(
        mode=message.mode or "async", replicas_to_aggregate=message.replicas_to_aggregate,
        total_num_replicas=message.total_num_replicas, max_staleness=message.max_staleness,
        lease_seconds=message.lease_seconds or defaults.lease_seconds,
        startup_grace_seconds=message.startup_grace_seconds or defaults.startup_grace_seconds,
        progress_seconds=message.progress_seconds or defaults.progress_seconds,
        replicas_fraction=message.replicas_fraction)


def config_to_proto(config: SyncConfig) -> ps_pb2.SyncConfig:
    return ps_pb2.SyncConfig(**dataclasses.asdict(config))


def add_to_server(servicer: ParameterServerServicer, server: grpc.aio.Server, pool: Executor) -> None:
    """Registers every RPC of ps.proto's ParameterServer service on `server` (edge.handler: bodies on `pool`,
    waits on the event loop; GetStatus on the loop itself)."""
    service = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]

    def on_loop(kind, body, deserializer, serializer):
        streaming = kind is unary_stream
        return kind(handler(body, name=body.__name__, inline=body.__name__ == "GetStatus", pool=pool, fail=_status_of,
                            streaming=streaming), deserializer, serializer)

    unary, unary_stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    stream_unary = grpc.stream_unary_rpc_method_handler
    handlers = {
        # Streams of requests, and PushPull, are decoded by the handlers (see _decoded).
        "CreateVariables": on_loop(stream_unary, servicer.CreateVariables, None,
            ps_pb2.CreateResponse.SerializeToString),
        "Pull": on_loop(unary_stream, servicer.Pull, ps_pb2.PullRequest.FromString,
            bytes),  # Pull yields serialized messages
        "Push": on_loop(stream_unary, servicer.Push, None, ps_pb2.PushResponse.SerializeToString),
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
    }
    missing = {m.name for m in service.methods} ^ set(handlers)
    if missing:
        raise RuntimeError(f"servicer and ps.proto disagree on methods: {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
