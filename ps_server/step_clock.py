"""A shard's step clock: its time, the mode it runs and since when, and who may move its step. No gRPC.

Time. `now()` is the shard's clock (monotonic seconds; injectable for tests).
A call waits until its deadline, at most MAX_WAIT_SECONDS away.

The mode (a SyncConfig) starts its startup grace when it is set: until the
grace ends, workers that have not joined yet count as live for the quorum.

Authority over the step. A shard restored from an older checkpoint is
behind the job, whose step ps 0 owns. It moves to a later step only as far
as an authority on the job's step vouches for: the committed checkpoint it
restored (the chief committed it), then the steps the chief's own writes
show (`by=CHIEF`: its Join, Heartbeat and Push carry the step ps 0 gave it).
The chief is whom the security policy gives the chief role
(torchps/access.py): its certificate, the admin token or its own token line
authenticates it; a shard without credentials (or with one job token and
no admin token) tells nobody apart and treats every caller as the chief, as
it does for every call. Anyone else's write (`by=WORKER`) moves the step up
to what the chief vouched for and no further. A read never moves it,
whoever sends it: Pull's min_step waits for the step, GetStatus and
LookupRows read it. Why the chief: it may already rewrite every shard
(commit a checkpoint, import variables, re-lay out), so its word on the
step grants no power it lacks; and every shard takes it rather than ask
ps 0 itself, which a shard of a token table (naming no shard) has no
credentials for. A push at the shard's own step shows it is not behind any
more.

Thread-safe: its own lock (an "owner" in locks.LOCK_ORDER) guards it all.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .modes import SyncConfig

__all__ = ["StepClock", "MAX_WAIT_SECONDS", "CHIEF", "WORKER"]

MAX_WAIT_SECONDS = 3600.0  # the longest any call waits when it brings no deadline
CHIEF, WORKER = "chief", "worker"  # whose write shows a step (see "Authority over the step")


class StepClock:
    """The shard's time, mode and authority over its step (see the module docstring). Never blocks."""

    def __init__(self, now: Callable[[], float] = time.monotonic):
        self.now = now
        self._lock = threading.Lock()
        self._config = SyncConfig()
        self._configured_at = now()
        self._grace_seen_end = 0.0   # the startup grace end grace_ended() reported
        self._restored_step = -1     # the checkpoint step this shard restored, or -1
        self._behind = False         # restored from an older checkpoint: catch up with the job's step
        self._vouched = -1           # the highest step the chief vouched for since (the checkpoint's first)

    # -- time ------------------------------------------------------------------------------------

    def deadline(self, timeout: float | None) -> float:
        """The moment a call given `timeout` seconds (None: none) stops waiting."""
        return self.now() + min(MAX_WAIT_SECONDS, MAX_WAIT_SECONDS if timeout is None else timeout)

    def left(self, deadline: float) -> float:
        """Seconds until `deadline` (0 once past)."""
        return max(0.0, deadline - self.now())

    # -- the mode ----------------------------------------------------------------------------------

    @property
    def config(self) -> SyncConfig:
        with self._lock:
            return self._config

    def set_config(self, config: SyncConfig) -> None:
        """Runs `config` from now on; its startup grace starts now."""
        now = self.now()
        with self._lock:
            self._config, self._configured_at = config, now

    def end_grace(self) -> None:
        """The startup grace is over from now on, if it was not already (a job restored or recovered after
        it had started)."""
        self.end_grace_by(self.now())

    def end_grace_by(self, end: float) -> None:
        """The startup grace ends at `end` at the latest (a shard added to a running job ends it with ps 0's)."""
        with self._lock:
            self._configured_at = min(self._configured_at, end - self._config.startup_grace_seconds)

    def grace_left(self, now: float) -> float:
        """Seconds from `now` until the startup grace ends (0 once it has)."""
        with self._lock:
            return max(0.0, self._configured_at + self._config.startup_grace_seconds - now)

    def in_grace(self, now: float) -> bool:
        """Whether the mode's startup grace still runs at `now`."""
        with self._lock:
            return now < self._configured_at + self._config.startup_grace_seconds

    def grace_end(self) -> float:
        with self._lock:
            return self._configured_at + self._config.startup_grace_seconds

    def grace_ended(self, now: float) -> bool:
        """True once for each startup grace that has ended by `now` (then unjoined workers stop counting)."""
        with self._lock:
            end = self._configured_at + self._config.startup_grace_seconds
            if end <= now and self._grace_seen_end != end:
                self._grace_seen_end = end
                return True
            return False

    # -- authority over the step -------------------------------------------------------------------

    def restore(self, step: int, *, exact: bool) -> None:
        """The shard restored a state of `step`; `exact`: its own latest (journal), so it is not behind."""
        with self._lock:
            self._restored_step = step
            self._behind = not exact
            self._vouched = step  # a committed checkpoint: the chief committed it

    @property
    def restored_step(self) -> int:
        with self._lock:
            return self._restored_step

    @property
    def behind(self) -> bool:
        """Whether the shard restored an older checkpoint and has not caught up with the job yet."""
        with self._lock:
            return self._behind

    def catch_up_to(self, step: int, by: str) -> int | None:
        """The step a shard that is behind may move to when a write of `by` shows `step`: as far as the chief
        vouched for (the chief's own step vouches for itself). None when it is not behind."""
        with self._lock:
            if not self._behind:
                return None
            if by == CHIEF:
                self._vouched = max(self._vouched, step)
            return min(step, self._vouched)

    def pushed_at(self, step: int, current: int) -> None:
        """A push computed at `step` arrived while the shard is at `current`: the same step shows it is not
        behind."""
        with self._lock:
            if step == current:
                self._behind = False
