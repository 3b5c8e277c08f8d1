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
- A backup's lanes to its primary serve its Replicate stream for as long
  as it lasts (ps_server/feed.py): there, once the stream says so
  (TO_LANE), each of the journal's frames is a lane frame of its own (a
  serialized ReplicaFrame), its tensors' bytes the next one.
- A lane serves one call at a time. Anything out of step (a bad magic, a
  sequence number or length other than expected, a lane that closes or
  stalls past the call's deadline) breaks the lane: LaneBrokenError, the
  call fails having applied nothing, and both ends close it; the client
  retries on a new lane or inline.

A shard that serves TLS speaks TLS on its lanes too, with the same
credentials (mutual: each side's certificate checked against the job's CA,
the shard's against the address the client dials, as gRPC does). A lane
carries no token: the gRPC call that names it does, and passes the shard's
access policy like any other; the key, 128 random bits sent only inside the
lane's TLS (or in plaintext where the gRPC calls are plaintext too), ties
the lane to calls of the client that opened it.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import tempfile
import threading
import time

from .errors import LaneBrokenError, MalformedStreamError

__all__ = ["KEY_BYTES", "WELCOME", "Lane", "LaneBytes", "bind", "connect", "tls_context"]

WELCOME = b"TPSW"
FRAME_MAGIC = b"TPSL"
KEY_BYTES = 16
_FRAME = struct.Struct("<4sIQ")
_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)
_STALL_PIECE = 4 << 20  # bytes handed to TLS at a time by a send that counts pauses (Lane.send's `stall`)


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
        self.received = 0            # bytes read so far (another thread may watch it grow: the reads' progress)
        self._closed = threading.Event()
        self._deadline: float | None = None
        self.scratch = None  # a buffer its user keeps with it between calls (a shard stages pulled chunks in it)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, buffers, timeout: float | None, *, stall: bool = False, head: bytes | None = None) -> None:
        """Sends one frame of `buffers` (bytes-like, each sent from its own memory), after a frame of `head` if
        given (one sendmsg for both where the lane is plaintext); blocks up to `timeout` (with `stall`, up to
        `timeout` without a byte going out: a frame of any size). No frame of `buffers` if they hold no bytes:
        a message whose chunks are all empty carries no lane_bytes, and its reader (bind) reads no frame.
        LaneBrokenError (and the lane closed) if it cannot."""
        views = [memoryview(b).cast("B") for b in buffers]
        views = [v for v in views if len(v)]
        pending = []
        if head is not None:  # (a frame of no bytes is its header alone)
            pending += [memoryview(self._header(len(head))), *([memoryview(head)] if len(head) else [])]
        if views:
            pending += [memoryview(self._header(sum(len(v) for v in views))), *views]
        if not pending:
            return
        self._start(timeout)
        try:
            if isinstance(self.sock, ssl.SSLSocket):  # no sendmsg under TLS: each buffer is encrypted from its memory
                for view in pending:
                    step = _STALL_PIECE if stall else max(1, len(view))
                    for at in range(0, len(view), step):
                        self._arm()
                        self.sock.sendall(view[at:at + step])
                        if stall:
                            self._start(timeout)
                return
            while pending:
                self._arm()
                sent = self.sock.sendmsg(pending[:_IOV_MAX])
                if stall and sent:
                    self._start(timeout)
                while sent:
                    if sent >= len(pending[0]):
                        sent -= len(pending.pop(0))
                    else:
                        pending[0], sent = pending[0][sent:], 0
        except LaneBrokenError:
            raise
        except (OSError, ValueError) as exc:
            raise self._broken(f"sending {sum(len(v) for v in pending)} bytes failed: {exc}") from None

    def _header(self, nbytes: int) -> bytes:
        header = _FRAME.pack(FRAME_MAGIC, self._sent & 0xFFFFFFFF, nbytes)
        self._sent += 1
        return header

    def begin_any(self, timeout: float | None, limit: int) -> int:
        """Reads the next frame's header, of any length up to `limit`, and returns that length; blocks up to
        `timeout` (it holds for the frame's reads too). LaneBrokenError if the header is out of step or says
        more than `limit`."""
        return self._begin(None, timeout, limit)

    def begin(self, nbytes: int, timeout: float | None) -> None:
        """Reads the next frame's header, which must say `nbytes`; blocks up to `timeout` (it holds for the
        frame's reads too). LaneBrokenError if the header is not the one expected."""
        self._begin(nbytes, timeout)

    def _begin(self, nbytes: int | None, timeout: float | None, limit: int = 0) -> int:
        if self._left:
            raise self._broken(f"a frame began with {self._left} bytes of the last one unread")
        self._start(timeout)
        header = bytearray(_FRAME.size)
        self._recv_exactly(memoryview(header))
        magic, seq, length = _FRAME.unpack(header)
        expected = self._read & 0xFFFFFFFF
        self._read += 1
        if magic != FRAME_MAGIC or seq != expected or (nbytes is not None and length != nbytes):
            size = f"{nbytes} bytes" if nbytes is not None else "any length"
            raise self._broken(f"frame header {bytes(magic)!r} #{seq} of {length} bytes where #{expected} of "
                               f"{size} was expected")
        if nbytes is None and length > limit:
            raise self._broken(f"a frame of {length} bytes where at most {limit} were expected")
        self._left = length
        return length

    def read_into(self, view: memoryview) -> None:
        """Reads len(view) bytes of the current frame into `view` (blocks, within begin()'s timeout)."""
        view = memoryview(view).cast("B")
        if len(view) > self._left:
            raise self._broken(f"a read of {len(view)} bytes past its frame's end ({self._left} left)")
        self._recv_exactly(view)
        self._left -= len(view)

    def rearm(self, timeout: float | None) -> None:
        """Gives the current frame's reads `timeout` s from now (a reader that counts a pause, not the whole
        frame's time)."""
        self._start(timeout)

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
                self.received += got
                view = view[got:]
        except LaneBrokenError:
            raise
        except (OSError, ValueError) as exc:
            raise self._broken(f"reading failed: {exc}") from None

    def _broken(self, why: str) -> LaneBrokenError:
        self.close()
        return LaneBrokenError(f"bulk lane broken: {why}; nothing was applied")


def tls_context(security, *, server: bool) -> ssl.SSLContext | None:
    """The TLS context of a lane with `security` (torchps.security.Security): mutual TLS against the job's CA,
    this task's certificate and key; None without TLS."""
    if not security.tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=security.ca.decode())
    with tempfile.TemporaryDirectory(prefix="torchps-lane-") as folder:  # ssl loads a key only from a file
        path = os.path.join(folder, "task.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as pem:
            pem.write(security.cert.rstrip(b"\n") + b"\n" + security.key)
        context.load_cert_chain(path)
    return context


def connect(host: str, port: int, timeout: float, context: ssl.SSLContext | None = None) -> Lane:
    """A new lane to a shard's lane port, TLS with `context` (tls_context) if given (blocks up to `timeout`);
    LaneBrokenError if none can be opened."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=host)
    except (OSError, ssl.SSLError) as exc:
        raise LaneBrokenError(f"cannot open a bulk lane to {host}:{port}: {exc}") from None
    lane = Lane(sock, b"")
    lane._start(timeout)
    welcome = bytearray(len(WELCOME) + KEY_BYTES)
    lane._recv_exactly(memoryview(welcome))
    if bytes(welcome[:len(WELCOME)]) != WELCOME:
        lane.close()
        raise LaneBrokenError(f"{host}:{port} is not a torchps bulk lane (it sent {bytes(welcome[:4])!r})")
    lane.key = bytes(welcome[len(WELCOME):])
    return lane
