"""Moving a client's tensors between CUDA devices and the host: reused staging buffers, side streams, events.

DeviceStaging (one per PSClient) owns them; no other client module calls torch.cuda.

- Pulls: the bytes of a variable whose parameter lives on a GPU land in a
  host buffer allocated once per variable and reused by every later pull
  (pinned memory, unless pinned=False), then go to the device with a
  non-blocking copy on a side stream. The copy is ordered after the work
  already queued on the device's current stream (what still reads the old
  values), and its completion is an event that the compute stream waits on
  (the forward of the layer that needs it, or the caller of pull_into): the
  host never waits for the device.
- Pushes: a gradient on a GPU is copied into a reused pinned buffer by a
  non-blocking copy on another side stream, ordered after the kernels that
  made it by an event on their stream; the host waits on that copy's event
  only, before it reads the bytes.

CPU tensors need none of it: they are read and written in place, and on a
host without CUDA nothing here touches pinned memory, streams or events.
Non-contiguous or cast CPU targets use the same reused (unpinned) buffers.
Buffers are kept until close(): about one more copy of the GPU parameters
pulled, and of the gradients pushed, in host memory.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Iterable, Mapping

import torch

__all__ = ["CopyRecord", "DeviceStaging", "Staged"]


@dataclasses.dataclass
class CopyRecord:
    """One timed copy (DeviceStaging.trace): 'h2d' or 'd2h', its bytes, and timing events around it."""

    kind: str
    nbytes: int
    start: object
    end: object


class Staged:
    """Tensors on the host for one push: CUDA ones copied into staging buffers, the others as they were.

    `tensors` is {name: host tensor}; release() hands the buffers back (call it once the bytes were read:
    the push is over, retries included). Not thread-safe; one push uses it.
    """

    def __init__(self, staging: "DeviceStaging", tensors: dict[str, torch.Tensor],
                 taken: list[tuple[str, torch.Tensor]]):
        self.tensors = tensors
        self._staging = staging
        self._taken = taken

    @property
    def nbytes(self) -> int:
        """Bytes copied from devices into staging buffers."""
        return sum(buffer.numel() * buffer.element_size() for _, buffer in self._taken)

    def release(self) -> None:
        for key, buffer in self._taken:
            self._staging.release(key, buffer)
        self._taken = []


class DeviceStaging:
    """A client's staging buffers, side streams and events for tensors on CUDA devices (see the module).

    Thread-safe: pulls land from the gRPC threads, gradients arrive from
    autograd's threads. Never blocks, except acquire() (for the last copy
    that used a buffer) and stage_out() (for its own copies).
    """

    def __init__(self, *, pinned: bool = True):
        self.pinned = bool(pinned) and torch.cuda.is_available()
        self.trace: list[CopyRecord] | None = None  # a list to time every copy into (bench/device.py); None: off
        self._lock = threading.Lock()
        self._free: dict[tuple, list[tuple[torch.Tensor, object]]] = {}  # (key, shape, dtype) -> [(buffer, event)]
        self._streams: dict[tuple, object] = {}  # (device, direction) -> torch.cuda.Stream

    # -- buffers ----------------------------------------------------------------------------------------

    def acquire(self, key: str, shape: Iterable[int], dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
        """A host buffer for `key` of this shape and dtype: the one released last time (once the copy that
        last used it is over: blocks for it), or a new one, pinned if `pin` and pinned memory is on. Two
        holders of one key at once get two buffers."""
        slot = (key, tuple(shape), dtype)
        with self._lock:
            free = self._free.get(slot)
            entry = free.pop() if free else None
        if entry is None:
            return torch.empty(slot[1], dtype=dtype, pin_memory=pin and self.pinned)
        buffer, event = entry
        if event is not None:
            event.synchronize()
        return buffer

    def release(self, key: str, buffer: torch.Tensor, event=None) -> None:
        """Hands `buffer` back for `key`; `event`: the device copy still using it (the next acquire waits)."""
        with self._lock:
            self._free.setdefault((key, tuple(buffer.shape), buffer.dtype), []).append((buffer, event))

    def close(self) -> None:
        """Drops every buffer (a copy still using one keeps it alive until it ends)."""
        with self._lock:
            self._free.clear()

    # -- host to device -----------------------------------------------------------------------------------

    def mark(self, tensors: Iterable[torch.Tensor]) -> dict:
        """{device: event} on the current stream of each CUDA device among `tensors`: copies into them wait
        for what is queued there now. Call it from the thread that runs the compute. Never blocks."""
        marks = {}
        for tensor in tensors:
            if tensor.device.type == "cuda" and tensor.device not in marks:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(tensor.device))
                marks[tensor.device] = event
        return marks

    def copy_in(self, key: str, target: torch.Tensor, buffer: torch.Tensor, after) -> object:
        """Copies (and casts) host `buffer` into CUDA `target` on the device's side stream, after event `after`
        (mark()'s); releases the buffer to `key` with the copy's event, and returns that event. Never blocks."""
        stream = self._stream(target.device, "h2d")
        with torch.cuda.device(target.device), torch.cuda.stream(stream):
            stream.wait_event(after)
            timed = self._timed("h2d", buffer, stream)
            with torch.no_grad():
                target.copy_(buffer, non_blocking=True)
            done = self._end(timed, stream)
        self.release(key, buffer, done)
        return done

    @staticmethod
    def wait(events: Iterable[tuple[torch.device, object]]) -> None:
        """The current stream of each event's device waits for it (later work there runs after the copy).
        Never blocks the host."""
        for device, event in events:
            torch.cuda.current_stream(device).wait_event(event)

    # -- device to host -----------------------------------------------------------------------------------

    def stage_out(self, tensors: Mapping[str, torch.Tensor], key: str = "push") -> Staged:
        """Host copies of the CUDA tensors among `tensors` (the others as they are), in reused pinned buffers,
        each copied on its device's side stream after the work queued on its current stream. Blocks until
        those copies are done (their events, not the whole device)."""
        out, taken, done = dict(tensors), [], []
        for name, tensor in tensors.items():
            if tensor.device.type != "cuda":
                continue
            buffer, event = self.copy_out(f"{key}/{name}", tensor)
            out[name] = buffer
            taken.append((f"{key}/{name}", buffer))
            done.append(event)
        for event in done:
            event.synchronize()
        return Staged(self, out, taken)

    def copy_out(self, key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """(host buffer, event): CUDA `tensor` copied into a reused buffer of `key` on the device's side stream,
        after what the current stream (the one that made it) has queued; the bytes are there once the event
        completed. The caller keeps `tensor` alive until then and release()s the buffer after reading it.
        Never blocks (except acquire's wait for the buffer's previous copy)."""
        buffer = self.acquire(key, tensor.shape, tensor.dtype, pin=True)
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(tensor.device))
        stream = self._stream(tensor.device, "d2h")
        with torch.cuda.device(tensor.device), torch.cuda.stream(stream):
            stream.wait_event(made)
            timed = self._timed("d2h", buffer, stream)
            buffer.copy_(tensor.detach(), non_blocking=True)
            done = self._end(timed, stream)
        return buffer, done

    # -- helpers ------------------------------------------------------------------------------------------

    def _stream(self, device: torch.device, direction: str):
        with self._lock:
            stream = self._streams.get((device, direction))
            if stream is None:
                stream = self._streams[(device, direction)] = torch.cuda.Stream(device=device)
            return stream

    def _timed(self, kind: str, buffer: torch.Tensor, stream) -> CopyRecord | None:
        if self.trace is None:
            return None
        record = CopyRecord(kind, buffer.numel() * buffer.element_size(), torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
        record.start.record(stream)
        return record

    def _end(self, timed: CopyRecord | None, stream):
        done = timed.end if timed is not None else torch.cuda.Event()
        done.record(stream)
        if timed is not None and self.trace is not None:
            self.trace.append(timed)
        return done
