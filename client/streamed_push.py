"""A streamed push: a module's gradients sent while backward still runs (overlap.py's first half).

At the first gradient of a step (a post-accumulate-grad hook on every
parameter that requires grad) StreamedPush opens one streamed Push per shard
(PushHeader.streamed, ps.proto), each sent by a pool thread from a list that
keeps every message's pieces (views of the gradients' bytes, never copies)
until the push is over, so a retry (channels.py calls the stub again) replays
the stream from its header. Each hook cuts its parameter's gradient (its
pieces, compressed as the client's policies say) into the right shards'
streams, last layer first, and blocks while more than a bound of bytes is
queued but not yet handed to gRPC. An attempt to a shard whose part of the
module reaches lane_min_bytes borrows a bulk lane (client/lanes.py) if one is
lent: its messages carry lane_bytes and each one's bytes follow on the lane
(torchps/lanes.py); other attempts copy the bytes into the messages as they
send them. push() closes every stream with PushEnd{tensors} and waits for the
replies: a shard applies a streamed push only once its end arrived with the
right count (and on a lane, its bytes), so a stream cut short, aborted or
never closed, or a lane broken, changes nothing. PushLock keeps other pushes
of the client out meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from typing import Iterator, Mapping

import grpc
import torch

from .. import wire
from ..errors import LayoutChangedError, PSError, WaitTimeoutError
from ..lanes import Lane
from ..proto import ps_pb2
from .datapath import DataPath, with_lane
from .transfer import wire_pieces

__all__ = ["OVERLAP_INFLIGHT_BYTES", "PushLock", "StreamedPush"]

_LOGGER = logging.getLogger(__name__)
OVERLAP_INFLIGHT_BYTES = 4 << 20  # per shard: gradient bytes encoded but not yet handed to gRPC before a hook waits


class _Aborted(Exception):
    """A streamed push given up (its step's gradients go by a normal push); never leaves this module."""


class PushLock:
    """PSClient's push lock: one push at a time, in order. A streamed push still taking gradients gives way.

    A blocking acquire (any push: PSClient.push, push_pull, another
    binding's push()) first makes an open streamed push that is not yet
    finishing give up (nothing of it is applied; its binding's push() then
    sends its gradients whole), so two modules pushed in any order never
    wait for each other. A non-blocking acquire (a streamed push opening)
    never does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.streaming: StreamedPush | None = None  # the streamed push holding the lock, if one does

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        streaming = self.streaming
        if blocking and streaming is not None:
            streaming.give_way()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> "PushLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _Message:
    """One message of a stream after its header: chunk pieces (views of the bytes), and the end if it closes the
    stream. Encoded by each attempt that sends it: the bytes copied in, or on a lane lane_bytes in their place."""

    __slots__ = ("pieces", "end", "nbytes")

    def __init__(self, pieces: list, end: ps_pb2.PushEnd | None):
        self.pieces, self.end = pieces, end
        self.nbytes = sum(len(piece[3]) for piece in pieces)


def _placed_bytes(client: DataPath, params: Mapping[str, torch.Tensor], shards: int) -> list[int]:
    """Per shard of the first `shards` (the layout followed when the push opened), the bytes of the gradients
    of `params` (those that require grad) placed there, before compression."""
    placed = [0] * shards
    wire_params = client.partitions.split({name: p.detach() for name, p in params.items() if p.requires_grad})
    for name, value in wire_params.items():
        shard = client.placement.shard_of(name)
        if shard < len(placed):  # placed on a shard a live resize added after this push opened: not streamed
            placed[shard] += value.nbytes
    return placed


class _ShardStream:
    """One shard's part of a streamed push: every message so far (kept for replays) and its sender."""

    def __init__(self, shard: int, lane_bytes: int):
        self.shard = shard
        self.lane_bytes = lane_bytes  # what its attempts ask a lane for: the module's gradient bytes placed there
        self.messages: list[_Message] = []
        self.handed = 0              # messages handed to gRPC at least once (over every attempt)
        self.closed = False          # the end (or an abort) was appended: no more messages
        self.names: list[str] = []   # wire variables in this stream, in order
        self.pending: list = []      # pieces not yet in a message (less than chunk_bytes)
        self.pending_bytes = 0
        self.calls: list = []        # the attempts' gRPC calls, to cancel on abort
        self.failed = False          # its sender gave up: its bytes no longer count against the bound
        self.future: futures.Future | None = None


class StreamedPush:
    """One push, streamed to every shard while backward runs. Made by Overlap at a step's first gradient.

    The caller holds client._push_lock, which this push owns from then on:
    finish() and abort() release it. add() is called from autograd hooks,
    one at a time; finish() and abort() from the training thread. With an
    `encoder` (a one-thread executor), a gradient on a GPU is copied to a
    reused pinned buffer by a non-blocking copy (device.py) and encoded there
    once its copy's event completed, so the hook returns at once and backward
    keeps the GPU busy; every gradient of the push is then encoded there, in
    order (a CPU or compressed one as it is). The pinned buffers are kept
    until the push is over: its messages are views of them. `params` are the
    module's parameters: a shard's attempts ask for a lane if its share of
    their bytes (before compression) reaches the client's lane_min_bytes.
    """

    def __init__(self, client: DataPath, inflight_bytes: int, encoder: futures.Executor | None = None,
                 params: Mapping[str, torch.Tensor] | None = None):
        self.client = client
        self._encoder = encoder  # one thread: encodes CUDA gradients once their copy to the host is done
        self._queued: list[futures.Future] = []  # encodings handed to it, in order
        self.inflight_bytes = inflight_bytes * client.cluster.num_ps
        self.header = client._header(None, True)  # this client's incarnation and the push's number: kept by retries
        self.header.streamed = True
        self.grads: dict[str, tuple[torch.Tensor, int]] = {}  # parameter -> (its .grad, the grad's version) as sent
        self._left: dict[str, torch.Tensor] = {}  # residuals to keep once each shard applied its part
        self._cond = threading.Condition()
        self._unsent = 0  # bytes encoded and not yet handed to gRPC, over the shards still sending
        self._aborted = False
        self._finishing = False
        self._released = False
        self._timed_out: PSError | None = None  # the bound's wait ran out: the push was abandoned
        self._held: list[tuple] = []  # (key, pinned buffer, its copy's event): released once the push is over
        shards = client._layout.shards  # read once: a layout followed meanwhile (a live resize) may name more
        placed = _placed_bytes(client, params or {}, shards)
        self._streams = [_ShardStream(shard, placed[shard]) for shard in range(shards)]
        self._unstreamed: list[str] = []  # wire variables placed past the streams (a live resize): sent after them
        if isinstance(client._push_lock, PushLock):
            client._push_lock.streaming = self
        for stream in self._streams:
            stream.future = client._fanout.submit(self._send, stream)

    # -- the hooks' side -----------------------------------------------------------------------

    def add(self, name: str, grad: torch.Tensor) -> None:
        """Encodes one parameter's gradient into its shards' streams; blocks while too many bytes are unsent.

        The gradient's bytes are sent from where they lie, until the push is
        over: it must not change meanwhile (finish()'s caller checks it did
        not, else aborts). Raises what encoding raises (a wrong shape).
        With an encoder thread the gradient is only queued (on a GPU, its copy
        to the host starts): the thread encodes it and waits for room, never
        this hook, and its errors are raised by finish().
        """
        self.grads[name] = (grad, grad._version)
        client = self.client
        if self._encoder is not None:
            if grad.device.type == "cuda" and name not in client._encoder.policies:  # compression: on the device
                key = f"stream/{name}"
                host, copied = client._device.copy_out(key, grad)
                client.stats.count_bytes(copied=host.numel() * host.element_size())
                self._queued.append(self._encoder.submit(self._encode_copied, name, host, copied, key))
            else:
                self._queued.append(self._encoder.submit(self._encode_queued, name, grad.detach()))
            return
        self._encode(name, grad.detach())
        self._wait_for_room()

    def _encode_copied(self, name: str, host: torch.Tensor, copied, key: str) -> None:
        """(encoder thread) Encodes a gradient copied to `host` once its copy is done; the buffer is handed back
        when the push is over."""
        with self._cond:
            held = not self._released
            if held:  # its messages are views of it: kept until the push is over
                self._held.append((key, host, copied))
        if not held:
            self.client._device.release(key, host, copied)  # the copy may still run: its next user waits for it
            return
        if self._aborted:
            return
        copied.synchronize()  # this copy's event only
        self._encode(name, host)
        self._wait_for_room()

    def _encode_queued(self, name: str, grad: torch.Tensor) -> None:
        """(encoder thread) Encodes a gradient that was queued behind others."""
        if not self._aborted:
            self._encode(name, grad)
            self._wait_for_room()

    def _drain(self) -> None:
        """Waits for the encoder thread's work on this push; raises its first error."""
        queued, self._queued = self._queued, []
        error = None
        for future in queued:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - the first is raised once all are done
                error = error or exc
        if error is not None:
            raise error

    def _encode(self, name: str, grad: torch.Tensor) -> None:
        """Encodes one gradient (on the host, or on its device when compressed) into its shards' streams."""
        client = self.client
        wire_grads = client.partitions.split({name: grad})
        sent, left = client._encode(wire_grads, self.header.step)
        self._left.update(left)
        chunk_bytes = client.chunk_bytes
        for wire_name, value in sent.items():
            shard = client.placement.shard_of(wire_name)
            if shard >= len(self._streams):  # placed on a shard a live resize added after this push opened
                self._unstreamed.append(wire_name)
                continue
            stream = self._streams[shard]
            stream.names.append(wire_name)
            for piece in wire_pieces(wire_name, value, chunk_bytes, client.stats):
                if stream.pending and stream.pending_bytes + len(piece[3]) > chunk_bytes:
                    self._flush(stream)
                stream.pending.append(piece)
                stream.pending_bytes += len(piece[3])
                if stream.pending_bytes >= chunk_bytes:
                    self._flush(stream)

    def _flush(self, stream: _ShardStream, end: ps_pb2.PushEnd | None = None) -> None:
        """The pending pieces (and `end`) as the stream's next message."""
        if stream.pending or end is not None:
            message = _Message(stream.pending, end)
            with self._cond:
                stream.messages.append(message)
                if not stream.failed:
                    self._unsent += message.nbytes
                self._cond.notify_all()
        stream.pending, stream.pending_bytes = [], 0

    def _wait_for_room(self) -> None:
        """Blocks while more than inflight_bytes are unsent, at most the client's timeout (then this push is
        failed: finish() raises WaitTimeoutError and nothing is applied anywhere)."""
        deadline = time.monotonic() + self.client.timeout
        with self._cond:
            while self._unsent > self.inflight_bytes and not self._aborted:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._abort_locked()
                    self._timed_out = WaitTimeoutError(
                        f"overlap: {self._unsent} gradient bytes still unsent after {self.client.timeout:g} s; "
                        f"the push was abandoned, nothing was applied")
                    return
                self._cond.wait(left)

    # -- the senders -----------------------------------------------------------------------------

    def _requests(self, stream: _ShardStream, attempt: dict, lane: Lane | None, timeout: float
                  ) -> Iterator[bytes]:
        """One attempt's request stream: the header (naming `lane` if given), then every message, waiting for
        the next ones; on a lane each message's bytes follow it there once gRPC took it (blocking up to
        `timeout`). Ends (without the end: the shard applies nothing) when the attempt is over or the push
        aborted."""
        stats = self.client.stats
        yield wire.encode_push_request(with_lane(self.header, lane), [])
        index = 0
        while True:
            with self._cond:
                while index >= len(stream.messages) and not stream.closed and not attempt["over"]:
                    self._cond.wait()
                if attempt["over"] or self._aborted or index >= len(stream.messages):
                    return
                message = stream.messages[index]
                if index >= stream.handed:
                    stream.handed = index + 1
                    if not stream.failed:
                        self._unsent -= message.nbytes
                        self._cond.notify_all()
            started = time.perf_counter()
            encoded = wire.encode_push_request(None, message.pieces, message.end, lane=lane is not None)
            stats.add_stage("push_encode", time.perf_counter() - started)
            stats.count_bytes(sent=message.nbytes, copied=0 if lane is not None else message.nbytes)
            yield encoded
            if lane is not None:
                started = time.perf_counter()
                lane.send([piece[3] for piece in message.pieces], timeout)
                stats.add_stage("push_lane_send", time.perf_counter() - started)
            index += 1

    def _attempt(self, stream: _ShardStream, stub, timeout: float) -> ps_pb2.PushResponse:
        """One call of the stream, on a bulk lane if one is lent (given back in step, or closed if the call
        failed: LaneBrokenError if it broke, which the caller's fanout call retries)."""
        attempt = {"over": False}
        if self._aborted:
            raise _Aborted()
        lanes, ok = self.client._lanes, False
        lane = lanes.borrow(stream.shard, stream.lane_bytes, timeout)
        call = stub.Push.future(self._requests(stream, attempt, lane, timeout), timeout=timeout)
        with self._cond:
            stream.calls.append(call)
            if self._aborted:
                call.cancel()
        try:
            reply = call.result()
            ok = True
            return reply
        except grpc.RpcError:
            if lane is not None and lane.closed:  # the lane broke while gRPC read the requests
                raise self.client._lane_broke(stream.shard) from None
            raise
        finally:
            with self._cond:
                attempt["over"] = True
                self._cond.notify_all()
            lanes.give_back(stream.shard, lane, ok)

    def _send(self, stream: _ShardStream) -> ps_pb2.PushResponse:
        """The shard's Push (retried by channels.call, each attempt replaying the stream); commits its residuals."""
        client = self.client
        started = time.monotonic()
        try:
            reply = client._fanout.call(stream.shard, lambda stub, t: self._attempt(stream, stub, t), client.timeout)
            client._encoder.commit(self._left, stream.names)  # applied there: their residuals move on
            return reply
        except BaseException:
            with self._cond:
                stream.failed = True
                self._unsent -= sum(m.nbytes for m in stream.messages[stream.handed:])
                self._cond.notify_all()
            raise
        finally:
            tracer = client.tracer
            if tracer is not None:
                tracer("push", stream.shard, started, time.monotonic())

    def _replay(self, shard: int) -> ps_pb2.PushResponse:
        """The whole (closed) stream again to one shard, after a refill; commits its residuals."""
        client, stream = self.client, self._streams[shard]
        reply = client._fanout.call(shard, lambda stub, t: self._attempt(stream, stub, t), client.timeout)
        client._encoder.commit(self._left, stream.names)
        return reply

    # -- the training thread's side --------------------------------------------------------------

    @property
    def aborted(self) -> bool:
        """True once given up (abort(), give_way(), the bound's wait ran out): nothing of it is applied."""
        return self._aborted

    @property
    def gave_way(self) -> bool:
        """True if given up for another push or by abort(): its gradients can still go whole (not so when the
        bound's wait ran out: finish() raises that)."""
        return self._aborted and self._timed_out is None

    def matches(self, grads: Mapping[str, torch.Tensor]) -> bool:
        """True if `grads` are exactly the gradients streamed: the same tensors, unchanged since."""
        return grads.keys() == self.grads.keys() and all(
            grads[name] is sent and grads[name]._version == version for name, (sent, version) in self.grads.items())

    def finish(self) -> int:
        """Closes every stream with its end, waits for every shard's reply; the next step (as PSClient.push).

        Blocks until every shard replied (each attempt at most the client's
        timeout, counted from the first gradient). Raises the first error after
        all shards are done: shards that replied applied their part, the
        others did not; a shard that restarted empty is refilled (or waited
        for) and gets the same stream again, with the same number. Releases
        the push lock.
        """
        client = self.client
        with self._cond:
            self._finishing = True  # from here on, other pushes wait for this one (PushLock)
        try:
            try:
                self._drain()  # the gradients still being encoded (CUDA): every one in its stream first
            except BaseException:
                with self._cond:
                    self._abort_locked()
                raise
            for stream in self._streams:
                self._flush(stream, ps_pb2.PushEnd(tensors=len(stream.names)))
            with self._cond:
                for stream in self._streams:
                    stream.closed = True
                self._cond.notify_all()
            replies: dict[int, ps_pb2.PushResponse] = {}
            retry = [False]

            def gather() -> None:
                if retry[0]:  # a shard was refilled: the closed streams go again to the shards without a reply
                    replies.update(client._fanout.each(
                        {s.shard: [] for s in self._streams if s.shard not in replies},
                        lambda shard, _: self._replay(shard), "push"))
                    return
                retry[0] = True
                if self._timed_out is not None:
                    raise self._timed_out
                error = None
                for stream in self._streams:
                    try:
                        replies[stream.shard] = stream.future.result()
                    except LayoutChangedError:  # its variables left that shard: nothing of it applied there
                        moved.extend(stream.names)
                    except BaseException as exc:  # noqa: BLE001 - the first is raised once all are done
                        error = error or exc
                if error is not None:
                    raise error

            moved: list[str] = []
            names = [name for stream in self._streams for name in stream.names]
            with client._watch_held():
                client._refill.guard(names, gather)
            if moved or self._unstreamed:
                replies.update(self._send_placed_anew([*moved, *self._unstreamed], replies))
            return client._finish_push(replies)
        finally:
            self._release()

    def _send_placed_anew(self, names: list[str], replies: Mapping[int, ps_pb2.PushResponse]
                          ) -> dict[int, ps_pb2.PushResponse]:
        """The wire variables a live resize took from their streams' shards (refused there, or placed past
        them), as a normal push's parts (LayoutFollower.each) to their owners in the layout followed now: new
        numbers, no second step where a stream was applied. Encoded again from the unchanged gradients."""
        client = self.client
        client._layout.refresh()
        wanted = set(names)
        grads = {name: value for name, value in client.partitions.split(
            {name: grad.detach() for name, (grad, _) in self.grads.items()}).items() if name in wanted}
        staged = client._stage_out(grads)
        try:
            sent, left = client._encode(staged.tensors, self.header.step)
            push = client._part_sender(self.header, sent, left, None)  # unstreamed pushes (_shard_header)
            groups = client.placement.group(grads)
            for shard in range(client._layout.shards):  # one that counted no step of this push counts it now
                if shard not in replies:
                    groups.setdefault(shard, [])
            return client._layout.each(groups,
                                       lambda shard, part, first, again: push(shard, part, first and shard not in
                                                                              replies, True), "push")
        finally:
            staged.release()

    def abort(self) -> None:
        """Gives this push up: every stream ends without its end (each shard applies nothing), the calls are
        cancelled, the push lock released. Never blocks."""
        with self._cond:
            self._abort_locked()
        self._release()

    def give_way(self) -> None:
        """Another push wants the lock: this one is given up unless it is already finishing. Never blocks."""
        with self._cond:
            if self._finishing or self._aborted:
                return
            _LOGGER.info("overlap: another push on this client came before push(); this step's gradients will "
                         "be pushed whole")
            self._abort_locked()
        self._release()

    def _abort_locked(self) -> None:
        self._aborted = True
        for stream in self._streams:
            stream.closed = True
            for call in stream.calls:
                call.cancel()
        self._cond.notify_all()

    def _release(self) -> None:
        with self._cond:
            if self._released:
                return
            self._released = True
            held, self._held = self._held, []
        for key, host, copied in held:
            self.client._device.release(key, host, copied)
        lock = self.client._push_lock
        if isinstance(lock, PushLock) and lock.streaming is self:
            lock.streaming = None
        lock.release()
