"""Client streams that stall: a stream (a Push, a CreateVariables) with no message for `idle_seconds` is ended,
so a client that stops sending mid-upload cannot hold an RPC thread for ever. No gRPC.

One thread per shard (run under the shard's FailStop) watches every open
stream: each message a stream receives moves its deadline on (`touch`, an
attribute write), and the thread wakes at the earliest deadline; a stream
past its deadline is ended with `stop(idle_seconds)` (the servicer's: the
call ends with DEADLINE_EXCEEDED), and its handler, woken with an error,
applies nothing.

    with watch.watching(lambda idle: end_the_call(idle)) as touch:
        for message in stream:
            touch()
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from .failstop import FailStop

__all__ = ["StallWatch", "DEFAULT_IDLE_SECONDS"]

DEFAULT_IDLE_SECONDS = 60.0  # between two messages of one stream; a streamed push waits for backward's next layer


class _Stream:
    __slots__ = ("last", "stop")

    def __init__(self, last: float, stop: Callable[[float], None]):
        self.last, self.stop = last, stop


class StallWatch:
    """Ends streams with no message for `idle_seconds` (see the module docstring). Thread-safe."""

    def __init__(self, idle_seconds: float, failstop: FailStop, *, clock: Callable[[], float] = time.monotonic):
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._cond = threading.Condition()
        self._open: set[_Stream] = set()  # at most one per RPC thread
        self._thread = failstop.thread(self._run, name="stall-watch")
        self._started = False
        self.stalled = 0  # streams ended so far

    @contextlib.contextmanager
    def watching(self, stop: Callable[[float], None]) -> Iterator[Callable[[], None]]:
        """Watches one stream while the block runs; yields its `touch()`, to call at each message."""
        stream = _Stream(self._clock(), stop)
        with self._cond:
            if not self._started:
                self._started = True
                self._thread.start()
            self._open.add(stream)
            if len(self._open) == 1:
                self._cond.notify()  # the watch waits for a stream to watch

        def touch() -> None:
            stream.last = self._clock()

        try:
            yield touch
        finally:
            with self._cond:
                self._open.discard(stream)

    def _run(self) -> None:
        while True:
            with self._cond:
                stalled = self._wait_for_stalled()
            for stream in stalled:
                self.stalled += 1
                stream.stop(self.idle_seconds)

    def _wait_for_stalled(self) -> list[_Stream]:
        """Waits (holds the lock) until some open streams are past their deadline; takes them off the watch."""
        while True:
            if not self._open:
                self._cond.wait()
                continue
            now = self._clock()
            stalled = [s for s in self._open if now - s.last >= self.idle_seconds]
            if stalled:
                self._open.difference_update(stalled)
                return stalled
            self._cond.wait(min(s.last for s in self._open) + self.idle_seconds - now)
