"""Tensor bytes between a client and one shard: push requests out, pull responses in.

Responses are checked with the same rules a shard applies to requests
(codec.ChunkAssembler): chunks in order, none missing, none too small, every
asked-for variable complete, nothing else. Bytes land directly in the
caller's memory (a new tensor, or the target tensor in place).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from .. import codec, wire
from ..compression import Encoded
from ..errors import MalformedStreamError, TensorMismatchError
from ..proto import ps_pb2
from .stats import WorkerStats

__all__ = ["push_requests", "wire_pieces", "read_stream", "NewTensors", "IntoTargets"]

Sink = Callable[[str, ps_pb2.TensorMeta], np.ndarray]
_WIDE, _NARROW = (torch.float32, torch.float64), (torch.float16, torch.bfloat16)  # pulls cast (PullRequest.cast)


def push_requests(header: ps_pb2.PushHeader, grads: Mapping[str, torch.Tensor | Encoded], names: list[str],
                  chunk_bytes: int, stats: WorkerStats | None = None) -> Iterator[bytes]:
    """Serialized PushRequests: the header with the first batch, tensors packed up to chunk_bytes.

    A gradient is a tensor (sent as it is) or compression.Encoded (its meta and bytes). Each piece's bytes
    are copied once, into its message (counted in `stats` as sent and copied, as the messages are made).
    """
    pieces = (piece for name in names for piece in wire_pieces(name, grads[name], chunk_bytes, stats))
    first = True
    for batch in wire.pack(pieces, chunk_bytes):
        yield wire.encode_push_request(header if first else None, batch)
        if stats is not None:
            nbytes = sum(memoryview(piece[3]).nbytes for piece in batch)
            stats.count_bytes(sent=nbytes, copied=nbytes)
        first = False
    if first:
        yield wire.encode_push_request(header, [])


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
                stats: WorkerStats | None = None) -> tuple[int, ps_pb2.PushResponse | None]:
    """Copies a Pull or PushPull response stream into sink's buffers; returns (step, push result).

    Each chunk's bytes are copied once, from the message into the buffer (counted in `stats` as received
    and copied).
    `on_tensor(name)` is called as each variable's last chunk lands in its buffer (overlap.py's
    per-layer waits). MalformedStreamError if the shard's stream breaks the contract or lacks a
    variable asked for.
    """
    assembler = codec.ChunkAssembler(sink=sink)
    step, result = -1, None
    for chunks, message_step, first_result in responses:
        step = message_step
        result = result or first_result
        if stats is not None:
            nbytes = sum(memoryview(chunk.data).nbytes for chunk in chunks)
            stats.count_bytes(received=nbytes, copied=nbytes)
        for chunk in chunks:
            done = assembler.add(chunk)
            if done is not None and on_tensor is not None:
                on_tensor(done[0])
    assembler.finish()
    if assembler.seen != set(names):
        missing, extra = sorted(set(names) - assembler.seen), sorted(assembler.seen - set(names))
        raise MalformedStreamError(f"{shard} sent an incomplete pull: missing {missing}, unexpected {extra}")
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

    Contiguous CPU targets receive the bytes directly; others (CUDA, strided)
    and a float32 or float64 target pulled cast (float16, bfloat16) go
    through a staging tensor (pinned memory for CUDA), copied and cast up by finish() (counted in `stats`).
    """

    def __init__(self, targets: Mapping[str, torch.Tensor], stats: WorkerStats | None = None):
        self.targets = targets
        self.stats = stats
        self._staging: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, meta: ps_pb2.TensorMeta) -> np.ndarray:
        target = self.targets[name]
        dtype = codec.torch_dtype(meta.dtype)
        cast = dtype in _NARROW and target.dtype in _WIDE
        if (dtype != target.dtype and not cast) or tuple(meta.shape) != tuple(target.shape):
            raise TensorMismatchError(f"{name!r} is {codec.describe_meta(meta)} on the shard but the local tensor is "
                                      f"{codec.describe_meta(codec.meta_of(target))}")
        if not cast and target.device.type == "cpu" and target.is_contiguous():
            return codec.byte_array(target.data)
        staging = torch.empty(target.shape, dtype=dtype, pin_memory=target.device.type == "cuda")
        self._staging[name] = staging
        return codec.byte_array(staging)

    def finish(self) -> None:
        with torch.no_grad():
            for name, buffer in self._staging.items():
                self.targets[name].copy_(buffer, non_blocking=True)
                self._count(name)
        if any(t.device.type == "cuda" for t in self.targets.values()):
            torch.cuda.synchronize()

    def complete(self, name: str) -> None:
        """Finishes one target as soon as its bytes are in (overlap.py): its staged copy, if it has one, is
        copied (and cast up) into it now, and finish() leaves it alone. Blocks until the copy is done."""
        buffer = self._staging.pop(name, None)
        if buffer is not None:
            with torch.no_grad():
                self.targets[name].copy_(buffer)
            self._count(name)

    def _count(self, name: str) -> None:
        if self.stats is not None:
            target = self.targets[name]
            self.stats.count_bytes(copied=target.numel() * target.element_size())
