"""A push held on ps 0 longer than usual says what it waits for, in a warning of the torchps logger.

In sync mode ps 0 holds a worker's push until its step is released (its
quorum of gradients arrived), in ssp mode until the worker is within the
staleness bound. A step that waits for a worker that has not joined yet,
died or hangs would otherwise be a silent wait (up to the startup grace, the
lease or the progress timeout). HeldPushWatch's thread notices a push held
past max(NOTICE_SECONDS, NOTICE_MULTIPLE x the usual push time), asks ps 0
for its status (GetStatus: the awaited step, who pushed for it, how each
worker of the cluster spec stands) and logs, e.g.

    step 0 waits for 1 more of 2 gradients: worker:1 has not joined (waited 5 s)

then again every REPEAT_SECONDS while the push is still held.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

from ..errors import PSError
from ..proto import ps_pb2

__all__ = ["HeldPushWatch", "held_reason"]

_LOGGER = logging.getLogger(__name__)
NOTICE_SECONDS = 5.0     # the shortest hold that is named in a warning
NOTICE_MULTIPLE = 5.0    # ... and a hold this many times the usual push time (a slow job's steps are no news)
REPEAT_SECONDS = 15.0    # between two warnings about the same held push
USUAL_WEIGHT = 0.2       # weight of a push's time in the moving average of push times


def held_reason(status: ps_pb2.StatusResponse, names: list[str], worker: str, waited: float) -> str | None:
    """What a push of `worker` held on ps 0 waits for, from ps 0's `status` asked with joined_of=`names` (the
    cluster spec's training tasks); None when nothing is missing (the step is being applied)."""
    standing = {m.worker: m for m in status.members}
    not_joined = [n for n in status.not_joined if n != worker]
    mode = status.config.mode
    if mode == "sync":
        missing = status.quorum - status.awaited_pushes
        if missing <= 0:
            return None
        pushed = set(status.awaited_pushers)
        who = [f"{n} has not joined" for n in not_joined]
        who += [f"{n} has not pushed for it" for n in names
                if n not in pushed and n not in not_joined and n in standing and standing[n].state == "live"]
        who_text = "; ".join(who) or "the live workers' next batches"
        return (f"step {status.awaited_step} waits for {missing} more of {status.quorum} gradients: {who_text} "
                f"(waited {waited:.0f} s)")
    if mode == "ssp":
        live = [m for m in status.members if m.state == "live" and m.worker != worker]
        behind = min(live, key=lambda m: m.pushes, default=None)
        mine = standing[worker].pushes if worker in standing else 0
        who = [f"{n} has not joined" for n in not_joined]
        if behind is not None and behind.pushes < mine:
            who.append(f"{behind.worker} is {mine - behind.pushes} pushes behind it")
        who_text = "; ".join(who) or "a worker past the cluster spec"
        return (f"a push of {worker} waits for the slowest worker to come within {status.config.max_staleness} "
                f"pushes: {who_text} (waited {waited:.0f} s)")
    return None


class HeldPushWatch:
    """Watches this client's pushes, one at a time (PSClient's push lock): `watching()` around the wait for
    the replies. A background thread, started with the first push watched, logs what a push held longer
    than usual waits for: `describe(waited)` (a line, or None for nothing to say), called in that thread.
    watching() costs a lock and a notify; close() stops it."""

    def __init__(self, describe: Callable[[float], str | None]):
        self._describe = describe
        self._cond = threading.Condition()
        self._since: float | None = None  # when the push being watched started
        self._push = 0                    # pushes watched so far (the current one's number)
        self._usual = 0.0                 # moving average of the pushes' times
        self._closed = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        with self._cond:
            if self._closed:
                yield
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="torchps-held-push", daemon=True)
                self._thread.start()
            self._push += 1
            self._since = since = time.monotonic()
            self._cond.notify()
        try:
            yield
        finally:
            took = time.monotonic() - since
            with self._cond:
                self._since = None
                self._usual = (1 - USUAL_WEIGHT) * self._usual + USUAL_WEIGHT * took

    def close(self) -> None:
        """Stops watching; never blocks. The thread ends by itself (a status call it makes then fails once
        the client's channels close) and logs nothing more. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._since is None:
                    self._cond.wait()
                if self._closed:
                    return
                push, since = self._push, self._since
                if not self._still_held(push, since + max(NOTICE_SECONDS, NOTICE_MULTIPLE * self._usual)):
                    continue
            self._notice(push, since)

    def _notice(self, push: int, since: float) -> None:
        """Logs what push `push` (watched since `since`) waits for, every REPEAT_SECONDS while it is held."""
        while True:
            try:
                line = self._describe(time.monotonic() - since)
            except PSError as exc:  # ps 0 not answering is itself the news
                line = f"a push has waited {time.monotonic() - since:.0f} s for ps 0, which does not answer its " \
                       f"status: {exc}"
            with self._cond:
                if not self._held(push):
                    return  # it ended (or the client closed) while ps 0 was asked
            if line is not None:
                _LOGGER.warning("%s", line)
            with self._cond:
                if not self._still_held(push, time.monotonic() + REPEAT_SECONDS):
                    return

    def _held(self, push: int) -> bool:
        """Whether push `push` is still being watched (holds the condition)."""
        return not self._closed and self._push == push and self._since is not None

    def _still_held(self, push: int, due: float) -> bool:
        """Waits (holding the condition) until `due`, or until push `push` ends or the watch closes; whether it
        is still held."""
        while self._held(push) and (now := time.monotonic()) < due:
            self._cond.wait(due - now)
        return self._held(push)
