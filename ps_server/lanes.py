"""A shard's bulk lanes (torchps/lanes.py): the listening port, the lanes clients opened, one call per lane.

LaneServer owns the lanes: a thread of its own accepts connections on a port
of the shard's gRPC host, welcomes each with a fresh random key and keeps it
idle until a call names that key (claim); the call gives it back (release)
in step, or it is closed. While idle, a lane whose client closed it is
closed; one with bytes waiting (a push's first frame, sent just before its
call claims the lane) is left alone until claimed; one no call claimed for
`idle_seconds` is closed (its client, if still there, retries the call that
finds it closed on a new lane), and TCP keepalive closes one whose client's
host is gone. At most MAX_LANES are open: past that a new connection is
closed at once.
"""

from __future__ import annotations

import logging
import secrets
import select
import socket
import ssl
import threading
import time

from ..errors import LaneBrokenError
from ..lanes import KEY_BYTES, WELCOME, Lane

__all__ = ["IDLE_SECONDS", "LaneServer", "MAX_LANES"]

_LOGGER = logging.getLogger(__name__)
MAX_LANES = 256
IDLE_SECONDS = 600.0  # a lane no call claimed for this long is closed
_KEEPALIVE = ((getattr(socket, "TCP_KEEPIDLE", None), 60), (getattr(socket, "TCP_KEEPINTVL", None), 10),
              (getattr(socket, "TCP_KEEPCNT", None), 3))  # a dead peer's lane errors within about 90 s
_POLL_SECONDS = 1.0  # how often the thread wakes to notice close()
_WELCOME_SECONDS = 5.0
RELEASE_WAIT_SECONDS = 5.0  # a call naming a lane its last call has not given back yet waits this long for it


class LaneServer:
    """Listens for lanes on `host`:`port` (0: a free port), TLS with `context` (lanes.tls_context) if given;
    its thread runs under `failstop` (a dead accept loop stops the shard) when given. Thread-safe."""

    def __init__(self, host: str, port: int = 0, failstop=None, context: ssl.SSLContext | None = None,
                 idle_seconds: float = IDLE_SECONDS):
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._listener = socket.create_server((host.strip("[]"), port), family=family, backlog=64)
        self._listener.setblocking(False)  # a connection reset between the poll and accept(): no wait for the next
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # notified when a call gives its lane back
        self.claims_waited = 0  # claims that waited for their lane's last call to give it back (tests read it)
        self._idle: dict[bytes, Lane] = {}
        self._busy: dict[bytes, Lane] = {}
        self._waiting: set[bytes] = set()  # idle lanes with bytes waiting for the call that will claim them
        self._stop = threading.Event()
        self._context = context
        self._idle_seconds = idle_seconds
        self._idle_since: dict[bytes, float] = {}  # idle lane -> when it became idle
        self._welcoming = 0  # connections in their TLS handshake
        body = self._run if failstop is None else lambda: failstop.run("the bulk lanes' listener", self._run)
        self._thread = threading.Thread(target=body, name="bulk-lanes", daemon=True)
        self._thread.start()

    def claim(self, key: bytes, wait: float = RELEASE_WAIT_SECONDS) -> Lane:
        """The idle lane named `key`, now this call's; LaneBrokenError if there is none (unknown, closed, or
        in another call). A lane still in a call is waited for up to `wait` s: a client lends a lane to its
        next call as soon as the last one answered, which for a streamed answer (Pull) is before that call's
        body here has given the lane back."""
        with self._released:
            if key in self._busy:
                self.claims_waited += 1
                self._released.wait_for(lambda: key not in self._busy or self._stop.is_set(), wait)
            lane = self._idle.pop(key, None)
            if lane is not None:
                self._busy[key] = lane
                self._waiting.discard(key)
                self._idle_since.pop(key, None)
        if lane is None:
            raise LaneBrokenError("the bulk lane this call names is not open on this shard (closed, or in use "
                                  "by another call); nothing was applied")
        return lane

    def release(self, lane: Lane, ok: bool) -> None:
        """Gives a claimed lane back: idle again if the call ended `ok` with the lane in step, else closed."""
        with self._released:
            self._busy.pop(lane.key, None)
            keep = ok and not lane.closed and lane.finished() and not self._stop.is_set()
            if keep:
                self._idle[lane.key] = lane
                self._idle_since[lane.key] = time.monotonic()
            self._released.notify_all()
        if not keep:
            lane.close()

    @property
    def open_lanes(self) -> int:
        with self._lock:
            return len(self._idle) + len(self._busy)

    def close(self) -> None:
        """Stops listening and closes every lane (a call using one fails)."""
        self._stop.set()
        with self._released:
            lanes = [*self._idle.values(), *self._busy.values()]
            self._idle.clear()
            self._released.notify_all()
        for lane in lanes:
            lane.close()
        self._listener.close()
        self._thread.join(2 * _POLL_SECONDS)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._close_stale()
            with self._lock:
                idle = {lane.sock: lane for key, lane in self._idle.items() if key not in self._waiting}
            poller = select.poll()  # not select(): a shard's descriptors may pass FD_SETSIZE
            by_fd = {}
            for sock, lane in [(self._listener, None), *idle.items()]:
                try:
                    fd = sock.fileno()
                except OSError:
                    continue
                if fd >= 0:
                    poller.register(fd, select.POLLIN)
                    by_fd[fd] = lane
            for fd, _ in poller.poll(_POLL_SECONDS * 1000):
                if fd not in by_fd:
                    continue
                if by_fd[fd] is None:
                    self._accept()
                else:
                    self._check_idle(by_fd[fd])

    def _accept(self) -> None:
        try:
            sock, peer = self._listener.accept()
            sock.setblocking(True)
        except OSError:  # BlockingIOError too: the connection was reset before it was taken
            return
        with self._lock:
            full = len(self._idle) + len(self._busy) + self._welcoming >= MAX_LANES
            if not full:
                self._welcoming += 1
        if full:
            _LOGGER.warning("a bulk lane from %s was refused: %d are open (the most a shard keeps)", peer,
                            MAX_LANES)
            sock.close()
            return
        if self._context is None:
            self._welcome(sock)
        else:  # a TLS handshake takes round trips: never on the accept loop
            threading.Thread(target=self._welcome, args=(sock,), name="bulk-lane-welcome", daemon=True).start()

    def _welcome(self, sock: socket.socket) -> None:
        """Completes the handshake (TLS) and sends the welcome with a new key; the lane is then idle."""
        key = secrets.token_bytes(KEY_BYTES)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in _KEEPALIVE:
                if option is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, option, value)
            sock.settimeout(_WELCOME_SECONDS)
            if self._context is not None:
                sock = self._context.wrap_socket(sock, server_side=True)
            sock.sendall(WELCOME + key)
        except (OSError, ValueError):  # ssl.SSLError is an OSError: a client without the job's certificate
            sock.close()
            with self._lock:
                self._welcoming -= 1
            return
        with self._lock:
            self._welcoming -= 1
            if self._stop.is_set():
                sock.close()
                return
            self._idle[key] = Lane(sock, key)
            self._idle_since[key] = time.monotonic()

    def _close_stale(self) -> None:
        """Closes the idle lanes no call claimed for idle_seconds."""
        now = time.monotonic()
        with self._lock:
            stale = [key for key, since in self._idle_since.items() if now - since >= self._idle_seconds]
            lanes = [self._idle.pop(key) for key in stale]
            for key in stale:
                del self._idle_since[key]
                self._waiting.discard(key)
        for lane in lanes:
            lane.close()

    def _check_idle(self, lane: Lane) -> None:
        """A lane the poll saw readable while idle: closed if its client closed it; else bytes wait for the call
        that will claim it, and it is not watched until then. Never waits: checked holding the lock (no call
        claims the lane meanwhile) and peeked only if still readable, as a call may have taken its bytes since
        the poll, and a lane's socket keeps its last call's timeout, which CPython's recv waits out whatever
        its flags (this thread, waiting, welcomed no new lane)."""
        with self._lock:
            if self._idle.get(lane.key) is not lane:
                return  # claimed meanwhile: its call reads what came
            try:
                if not _readable(lane.sock):
                    return  # a call took what came: watched again
                # The TCP stream itself (under TLS too): b"" once the client closed it.
                closed = socket.socket.recv(lane.sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return
            except (OSError, ValueError):  # ValueError: its socket was closed meanwhile
                closed = True
            if not closed:
                self._waiting.add(lane.key)
                return
            del self._idle[lane.key]
            self._idle_since.pop(lane.key, None)
        lane.close()


def _readable(sock: socket.socket) -> bool:
    """Whether `sock` has bytes to read, or its end to report, now (a poll that does not wait)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))
