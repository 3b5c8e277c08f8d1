"""Tensor bytes between a client and one shard: push requests out, pull responses in.

Responses are checked with the same rules a shard applies to requests
(codec.ChunkAssembler): chunks in order, none missing, none too small, every
asked-for variable complete, nothing else. Bytes land directly in the
caller's memory (a new tensor, or the target tensor in place).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from .. import codec, compression, wire
from ..compression import Encoded
from ..errors import InvalidArgumentError, MalformedStreamError, TensorMismatchError
from ..lanes import Lane, LaneBytes, bind as bind_lane
from ..proto import ps_pb2
from .deltas import PullBases
from .device import DeviceStaging
from .stats import WorkerStats

__all__ = ["push_requests", "lane_messages", "wire_pieces", "read_stream", "NewTensors", "IntoTargets", "apply_delta"]

Sink = Callable[[str, ps_pb2.TensorMeta], np.ndarray]
_WIDE, _NARROW = (torch.float32, torch.float64), (torch.float16, torch.bfloat16)  # pulls cast (PullRequest.cast)


def push_requests(header: ps_pb2.PushHeader, grads: Mapping[str, torch.Tensor | Encoded], names: list[str],
                  chunk_bytes: int, stats: WorkerStats | None = None, lane: Lane | None = None,
                  timeout: float | None = None) -> Iterator[bytes]:
    """Serialized PushRequests: the header with the first batch, tensors packed up to chunk_bytes.

    A gradient is a tensor (sent as it is) or compression.Encoded (its meta and bytes). Each piece's bytes
    are copied once, into its message (counted in `stats` as sent and copied, as the messages are made).
    With a bulk `lane` (header.lane names it), a message carries its pieces' lengths, and their bytes go on
    the lane from their own memory once gRPC took the message (blocking up to `timeout`): sent, not copied.
    """
    pieces = (piece for name in names for piece in wire_pieces(name, grads[name], chunk_bytes, stats))
    first = True
    for batch in wire.pack(pieces, chunk_bytes):
        started = time.perf_counter()
        message = wire.encode_push_request(header if first else None, batch, lane=lane is not None)
        if stats is not None:
            stats.add_stage("push_encode", time.perf_counter() - started)
        yield message
        nbytes = sum(memoryview(piece[3]).nbytes for piece in batch)
        if lane is not None:
            started = time.perf_counter()
            lane.send([piece[3] for piece in batch], timeout)
            if stats is not None:
                stats.add_stage("push_lane_send", time.perf_counter() - started)
        if stats is not None:
            stats.count_bytes(sent=nbytes, copied=0 if lane is not None else nbytes)
        first = False
    if first:
        yield wire.encode_push_request(header, [])


def lane_messages(responses: Iterable, lane: Lane | None, timeout: float | None) -> Iterator:
    """Pull responses with each message's lane bytes bound to `lane` (read as the chunks are assembled)."""
    for message in responses:
        bind_lane(message.chunks, lane, timeout)
        yield message


def wire_pieces(name: str, grad: torch.Tensor | Encoded, chunk_bytes: int,
                stats: WorkerStats | None = None) -> list[wire.Piece]:
    """The chunk pieces of one wire tensor: as encoded (Encoded), or as it is (a tensor, copied to CPU)."""
    if isinstance(grad, Encoded):
        return [(name, grad.meta if offset == 0 else None, offset, view, 0)
                for offset, view in codec.split(grad.payload, chunk_bytes)]
    if stats is not None and (grad.device.type != "cpu" or not grad.is_contiguous()):
        stats.count_bytes(copied=grad.numel() * grad.element_size())  # to host memory, or made contiguous
    return wire.tensor_pieces(name, grad.detach().cpu(), chunk_bytes)


def read_stream(responses: Iterable, names: list[str], sink: Sink, shard: str,
                on_tensor: Callable[[str], None] | None = None,
                stats: WorkerStats | None = None, bases: PullBases | None = None
                ) -> tuple[int, ps_pb2.PushResponse | None]:
    """Copies a Pull or PushPull response stream into sink's buffers; returns (step, push result).

    Each chunk's bytes are copied once, from the message into the buffer (counted in `stats` as received
    and copied).
    `on_tensor(name)` is called as each variable's last chunk lands in its buffer (overlap.py's
    per-layer waits). With `bases` (a delta pull into an IntoTargets sink), DELTA tensors are written over
    their targets (deltas.apply_delta) and, once the whole stream is in, `bases` learns every variable's
    version. MalformedStreamError if the shard's stream breaks the contract or lacks a
    variable asked for.
    """
    def delta(name: str, meta: ps_pb2.TensorMeta, raw: np.ndarray) -> None:
        written = apply_delta(name, meta, raw, sink.targets[name])
        if stats is not None:
            stats.count_bytes(copied=written, delta_tensors=1)

    assembler = codec.ChunkAssembler(sink=sink, delta=None if bases is None else delta)
    step, result, generation = -1, None, 0
    for chunks, message_step, first_result, generation in responses:
        step = message_step
        result = result or first_result
        if stats is not None:
            inline = sum(memoryview(chunk.data).nbytes for chunk in chunks if not isinstance(chunk.data, LaneBytes))
            stats.count_bytes(received=sum(len(chunk.data) for chunk in chunks), copied=inline)
        started = time.perf_counter()
        for chunk in chunks:
            done = assembler.add(chunk)
            if done is not None and on_tensor is not None:
                on_tensor(done[0])
        if stats is not None:
            stats.add_stage("pull_into_place", time.perf_counter() - started)
    assembler.finish()
    if result is not None and result.moved:  # a retried exchange's names that moved since: read elsewhere
        names = [name for name in names if name not in set(result.moved)]
    if assembler.seen != set(names):
        missing, extra = sorted(set(names) - assembler.seen), sorted(assembler.seen - set(names))
        raise MalformedStreamError(f"{shard} sent an incomplete pull: missing {missing}, unexpected {extra}")
    if bases is not None:
        bases.learn(generation, assembler.versions, sink.targets)
    return step, result


class NewTensors:
    """A sink that makes a new CPU tensor per variable (PSClient.pull)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, meta: ps_pb2.TensorMeta) -> np.ndarray:
        value = torch.empty(tuple(meta.shape), dtype=codec.torch_dtype(meta.dtype))
        self.tensors[name] = value
        return codec.byte_array(value)


class IntoTargets:
    """A sink writing into target tensors in place (PSClient.pull_into); finish() completes the copies.

    Contiguous CPU targets receive the bytes directly. Others go through a
    host buffer of `staging` (DeviceStaging, device.py), reused from pull to
    pull: CUDA targets (pinned memory, then a non-blocking copy on a side
    stream), strided CPU targets and float32 or float64 targets pulled cast
    (float16, bfloat16), which the copy casts up (counted in `stats`). Make
    it in the thread that runs the compute: copies into CUDA targets wait
    for the work queued there by then.
    """

    def __init__(self, targets: Mapping[str, torch.Tensor], stats: WorkerStats | None = None,
                 staging: DeviceStaging | None = None):
        self.targets = targets
        self.stats = stats
        self._device = staging if staging is not None else DeviceStaging(pinned=False)
        self._lock = threading.Lock()
        self._staging: dict[str, torch.Tensor] = {}  # name -> its buffer, until complete()
        self._events: dict[str, tuple[torch.device, object]] = {}  # name -> its copy to the device, once queued
        self._marks = self._device.mark(targets.values())  # per CUDA device: what the copies come after

    def __call__(self, name: str, meta: ps_pb2.TensorMeta) -> np.ndarray:
        target = self.targets[name]
        dtype = codec.torch_dtype(meta.dtype)
        cast = dtype in _NARROW and target.dtype in _WIDE
        if (dtype != target.dtype and not cast) or tuple(meta.shape) != tuple(target.shape):
            raise TensorMismatchError(f"{name!r} is {codec.describe_meta(meta)} on the shard but the local tensor is "
                                      f"{codec.describe_meta(codec.meta_of(target))}")
        if not cast and target.device.type == "cpu" and target.is_contiguous():
            return codec.byte_array(target.data)
        with self._lock:
            buffer = self._staging.get(name)  # written again (a shard read twice): the same buffer
        if buffer is None or buffer.dtype != dtype:
            if buffer is not None:
                self._device.release(f"pull/{name}", buffer)
            buffer = self._device.acquire(f"pull/{name}", target.shape, dtype, pin=target.device.type == "cuda")
            with self._lock:
                self._staging[name] = buffer
        return codec.byte_array(buffer)

    def finish(self) -> None:
        """Completes every copy not yet completed, then makes the current stream of each CUDA target's device
        wait for the copies (the host does not wait). Call it from the thread that runs the compute."""
        self.complete_all()
        self.wait_device()

    def complete_all(self) -> None:
        """Completes every target still staged (complete()); the device copies are queued, not waited for."""
        with self._lock:
            names = list(self._staging)
        for name in names:
            self.complete(name)

    def complete(self, name: str) -> None:
        """Finishes one target as soon as its bytes are in (overlap.py; any thread): a staged CPU target is
        copied (and cast up) now; a CUDA one gets its copy queued on the side stream, which wait_device()
        waits for. finish() then leaves it alone."""
        with self._lock:
            buffer = self._staging.pop(name, None)
        if buffer is None:
            return
        target = self.targets[name]
        if target.device.type == "cuda":
            event = self._device.copy_in(f"pull/{name}", target, buffer, self._marks[target.device])
            with self._lock:
                self._events[name] = (target.device, event)
        else:
            with torch.no_grad():
                target.copy_(buffer)
            self._device.release(f"pull/{name}", buffer)
        if self.stats is not None:
            self.stats.count_bytes(copied=target.numel() * target.element_size())

    def wait_device(self, names: Iterable[str] | None = None) -> None:
        """The current stream of each CUDA target's device among `names` (default: all) waits for their
        copies queued so far. Never blocks the host; nothing to do for CPU targets."""
        with self._lock:
            events = list(self._events.values()) if names is None else \
                [self._events[name] for name in names if name in self._events]
        self._device.wait(events)


def apply_delta(name: str, meta: ps_pb2.TensorMeta, raw: np.ndarray, target: torch.Tensor) -> int:
    """Writes a DELTA tensor's values over `target` (contiguous CPU, its dtype or cast up from a 16-bit one)
    at its indices; returns the bytes written. MalformedStreamError for a shape or dtype that does not fit,
    or indices out of range or out of order."""
    dtype = codec.torch_dtype(meta.dtype)
    if tuple(meta.shape) != tuple(target.shape) or not (
            dtype == target.dtype or (dtype in _NARROW and target.dtype in _WIDE)) or not PullBases.accepts(target):
        raise MalformedStreamError(f"a delta of {name!r} ({codec.describe_meta(meta)}) does not fit the local "
                                   f"tensor {codec.describe_meta(codec.meta_of(target))}")
    try:
        index, values = compression.sparse_parts(f"the delta of {name!r}", meta, raw)
    except InvalidArgumentError as exc:
        raise MalformedStreamError(str(exc)) from None
    with torch.no_grad():
        target.view(-1)[index.long()] = values.to(target.dtype)
    return values.numel() * target.element_size()
