"""Fail-stop: a shard that cannot go on stops, and says so. No gRPC.

A shard is one process of several parts: RPC handlers, the lease reaper, the
sync applier, the metrics endpoint, the journal. A part that dies while the
rest answers would leave a shard that says SERVING and never releases a step
or expires a lease. So every long-lived thread of a shard runs under a
`FailStop`: an exception that escapes it calls `fatal(cause)`, which marks
the shard NOT_SERVING (the `on_stop` hook: the health service), logs one line
naming the cause, flushes the logs and ends the process with EXIT_CODE. The
launcher, Kubernetes or systemd starts it again, and the journal brings back
everything it acknowledged.

    failstop = FailStop(on_stop=lambda: set_health(health, serving=False))
    failstop.thread(apply_steps, coordinator, name="sync-applier").start()
    failstop.fatal("journal append failed: [Errno 28] No space left on device")   # never returns
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from typing import Callable, NoReturn

__all__ = ["FailStop", "EXIT_CODE"]

_LOGGER = logging.getLogger(__name__)
EXIT_CODE = 70  # EX_SOFTWARE (sysexits.h): not a usage error (2), not a clean stop (0) or Ctrl-C (130)


class FailStop:
    """Stops the process when a part of it fails (see the module docstring). Thread-safe.

    `on_stop()` runs first (mark the shard NOT_SERVING); `exit(code)` ends
    the process (os._exit by default: no cleanup runs that could block or
    acknowledge anything more). Tests pass an `exit` that records the code.
    """

    def __init__(self, *, on_stop: Callable[[], None] | None = None, exit: Callable[[int], None] = os._exit,
                 what: str = "this shard"):
        self._on_stop = on_stop
        self._exit = exit
        self._what = what
        self._lock = threading.Lock()
        self._stopped = threading.Event()  # the first fatal() has called exit
        self.cause: str | None = None      # what the first fatal() named

    def fatal(self, cause: str | BaseException) -> NoReturn:
        """Marks the process NOT_SERVING, logs one line naming `cause`, and exits with EXIT_CODE.

        Never returns: when `exit` returns (a test's), it raises SystemExit;
        a second caller waits for the first to finish, then raises too. Call
        it where going on would lose or invent state (a journal that cannot
        be written, a background part that died)."""
        self._stop(_describe(cause))
        raise SystemExit(EXIT_CODE)

    def run(self, name: str, body: Callable[..., None], *args) -> None:
        """body(*args); an exception escaping it is fatal, naming `name` (a thread's target)."""
        try:
            body(*args)
        except Exception as exc:  # noqa: BLE001 - any escape is a dead part
            self._stop(f"{name} failed: {_describe(exc)}")

    def _stop(self, text: str) -> None:
        """fatal() up to the exit: returns only if `exit` returned (or, for a second caller, once it has)."""
        with self._lock:
            first = self.cause is None
            if first:
                self.cause = text
        if not first:
            self._stopped.wait()
            return
        try:
            if self._on_stop is not None:
                self._on_stop()
        except Exception as exc:  # noqa: BLE001 - stopping must not depend on the health service
            text += f" (and marking it NOT_SERVING failed: {exc!r})"
        _LOGGER.critical("%s stops (fail-stop, exit code %d): %s; restart it (once the disk has room, if it is full): its "
                         "journal brings back everything it acknowledged", self._what, EXIT_CODE, text)
        _flush_logs()
        self._exit(EXIT_CODE)
        self._stopped.set()

    def thread(self, body: Callable[..., None], *args, name: str) -> threading.Thread:
        """A daemon thread (not started) running body(*args) under `run`."""
        return threading.Thread(target=self.run, args=(name, body, *args), name=name, daemon=True)

    def watch(self, thread: threading.Thread, name: str, *, expected: Callable[[], bool] = lambda: False) -> None:
        """Stops the process if `thread` (a started thread that is not ours, e.g. a library's server loop) ever
        ends while `expected()` is false."""
        def wait() -> None:
            thread.join()
            if not expected():
                self._stop(f"{name} ended unexpectedly")

        threading.Thread(target=wait, name=f"watch-{name}", daemon=True).start()


def _describe(cause: str | BaseException) -> str:
    """One line: a message as it is, an exception as its type, message and innermost frame."""
    if not isinstance(cause, BaseException):
        return str(cause)
    frames = traceback.extract_tb(cause.__traceback__)
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return f"{type(cause).__name__}: {cause}{where}".replace("\n", " ")


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - a full disk must not stop the exit
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
