"""Bulk lanes: tensor bytes beside a gRPC call, on a TCP connection of their own, copied only by the kernel.

Python gRPC copies a message's bytes several times on each side (into a
slice when sending; one bytes object per slice, then their join, when
receiving), and hands each message between threads. A lane carries the
`data` of a Pull's or a Push's chunks instead: the call's messages go over
gRPC as before, with TensorChunk.lane_bytes in place of `data`, and after
each message its chunks' bytes follow on the lane as one frame, sent with
sendmsg straight from the tensors' memory and read with recv_into straight
into the buffer they belong in (a pulled parameter, a shard's receive
buffer). Everything a call means (exactly-once pushes, versions, deadlines,
errors) stays with the gRPC call; a lane is only where the bytes travel.

Protocol (ps.proto names the fields; this module is the rest of it):

- A shard listens on StatusResponse.lane_port, on its gRPC host. On
  connecting, a client reads the welcome, b"TPSW" and a 16-byte random key;
  it names the lane by that key in PullRequest.lane or PushHeader.lane.
- Each frame is a header, b"TPSL", the frame's sequence number on that lane
  and direction (uint32, from 0) and its length (uint64), little-endian,
  then that many bytes: the concatenated `data` of one message's chunks, in
  their order in the message.
- A lane serves one call at a time. Anything out of step (a bad magic, a
  sequence number or length other than expected, a lane that closes or
  stalls past the call's deadline) breaks the lane: LaneBrokenError, the
  call fails having applied nothing, and both ends close it; the client
  retries on a new lane or inline.

Lanes are plaintext and carry no credential: a shard offers them only when
it serves without TLS and tokens (ps-server --insecure), and a client uses
them only when the shard offers them.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from .errors import LaneBrokenError, MalformedStreamError

__all__ = ["KEY_BYTES", "WELCOME", "Lane", "LaneBytes", "bind", "connect"]

WELCOME = b"TPSW"
FRAME_MAGIC = b"TPSL"
KEY_BYTES = 16
_FRAME = struct.Struct("<4sIQ")
_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)


class LaneBytes:
    """A chunk's `data` that follows on a lane (TensorChunk.lane_bytes): its length, and read_into() once the
    call's lane is bound (`lane`)."""

    __slots__ = ("nbytes", "lane")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.lane: Lane | None = None

    def __len__(self) -> int:
        return self.nbytes

    def read_into(self, view: memoryview) -> None:
        """Reads len(view) bytes of the current frame into `view`; MalformedStreamError without a lane."""
        if self.lane is None:
            raise MalformedStreamError("a chunk's data follows on a bulk lane, but the call names none")
        self.lane.read_into(view)


def bind(chunks, lane: "Lane | None", timeout: float | None) -> None:
    """Binds the LaneBytes of one decoded message's `chunks` to `lane` and reads their frame's header (blocks
    up to `timeout`); nothing if none of them is on a lane. MalformedStreamError if some are and `lane` is
    None."""
    on_lane = [chunk.data for chunk in chunks if isinstance(chunk.data, LaneBytes)]
    if not on_lane:
        return
    if lane is None:
        raise MalformedStreamError("a chunk's data follows on a bulk lane, but the call names none")
    lane.begin(sum(data.nbytes for data in on_lane), timeout)
    for data in on_lane:
        data.lane = lane


class Lane:
    """One end of a lane. One call at a time: not thread-safe, except close(), which any thread may call (it
    makes a blocked send or read fail at once)."""

    def __init__(self, sock: socket.socket, key: bytes):
        self.sock, self.key = sock, key
        self._sent = self._read = 0  # frames sent / begun, this direction
        self._left = 0               # bytes of the current frame not read yet
        self._closed = threading.Event()
        self._deadline: float | None = None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, buffers, timeout: float | None) -> None:
        """Sends one frame of `buffers` (bytes-like, each sent from its own memory); blocks up to `timeout`.
        LaneBrokenError (and the lane closed) if it cannot."""
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if len(v)]
        header = _FRAME.pack(FRAME_MAGIC, self._sent & 0xFFFFFFFF, sum(len(v) for v in views))
        self._sent += 1
        pending = [memoryview(header), *views]
        self._start(timeout)
        try:
            while pending:
                self._arm()
                sent = self.sock.sendmsg(pending[:_IOV_MAX])
                while sent:
                    if sent >= len(pending[0]):
                        sent -= len(pending.pop(0))
                    else:
                        pending[0], sent = pending[0][sent:], 0
        except LaneBrokenError:
            raise
        except (OSError, ValueError) as exc:
            raise self._broken(f"sending {sum(len(v) for v in pending)} bytes failed: {exc}") from None

    def begin(self, nbytes: int, timeout: float | None) -> None:
        """Reads the next frame's header, which must say `nbytes`; blocks up to `timeout` (it holds for the
        frame's reads too). LaneBrokenError if the header is not the one expected."""
        if self._left:
            raise self._broken(f"a frame began with {self._left} bytes of the last one unread")
        self._start(timeout)
        header = bytearray(_FRAME.size)
        self._recv_exactly(memoryview(header))
        magic, seq, length = _FRAME.unpack(header)
        expected = self._read & 0xFFFFFFFF
        self._read += 1
        if magic != FRAME_MAGIC or seq != expected or length != nbytes:
            raise self._broken(f"frame header {bytes(magic)!r} #{seq} of {length} bytes where #{expected} of "
                               f"{nbytes} was expected")
        self._left = nbytes

    def read_into(self, view: memoryview) -> None:
        """Reads len(view) bytes of the current frame into `view` (blocks, within begin()'s timeout)."""
        view = memoryview(view).cast("B")
        if len(view) > self._left:
            raise self._broken(f"a read of {len(view)} bytes past its frame's end ({self._left} left)")
        self._recv_exactly(view)
        self._left -= len(view)

    def finished(self) -> bool:
        """Whether the current frame was read to its end (a call ends only on a lane in step)."""
        return self._left == 0

    def close(self) -> None:
        """Closes the connection (idempotent, any thread): a send or read in progress fails."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _start(self, timeout: float | None) -> None:
        if self._closed.is_set():
            raise LaneBrokenError("the bulk lane was closed")
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def _arm(self) -> None:
        """Sets the socket's timeout to what is left of the deadline; LaneBrokenError once it passed."""
        if self._deadline is None:
            self.sock.settimeout(None)
            return
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._broken("the call's deadline passed")
        self.sock.settimeout(left)

    def _recv_exactly(self, view: memoryview) -> None:
        try:
            while len(view):
                self._arm()
                got = self.sock.recv_into(view)
                if not got:
                    raise self._broken("the other end closed it")
                view = view[got:]
        except LaneBrokenError:
            raise
        except (OSError, ValueError) as exc:
            raise self._broken(f"reading failed: {exc}") from None

    def _broken(self, why: str) -> LaneBrokenError:
        self.close()
        return LaneBrokenError(f"bulk lane broken: {why}; nothing was applied")


def connect(host: str, port: int, timeout: float) -> Lane:
    """A new lane to a shard's lane port (blocks up to `timeout`); LaneBrokenError if none can be opened."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise LaneBrokenError(f"cannot open a bulk lane to {host}:{port}: {exc}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    lane = Lane(sock, b"")
    lane._start(timeout)
    welcome = bytearray(len(WELCOME) + KEY_BYTES)
    lane._recv_exactly(memoryview(welcome))
    if bytes(welcome[:len(WELCOME)]) != WELCOME:
        lane.close()
        raise LaneBrokenError(f"{host}:{port} is not a torchps bulk lane (it sent {bytes(welcome[:4])!r})")
    lane.key = bytes(welcome[len(WELCOME):])
    return lane
