"""The shard's table of tokens, re-read when its file changes, so new tasks join without a restart. No gRPC.

A job that grows (a worker not in the starting spec, its token minted by
`ps-certs DIR --add worker:N`) appends a line to the shards' token file; a
Kubernetes Secret updated with `kubectl apply` is swapped in place by the
kubelet. The shard notices either without a signal (SIGHUP already stops a
shard, and a kubelet cannot send one): `current()` looks at the file's
identity (inode, size, modification time) at most every RECHECK_SECONDS, and
`refresh()` looks at once (the interceptor calls it for a token it does not
know, so a new task's first call is accepted, not refused). A changed file is
read whole and replaces the table: a line removed revokes that token within
RECHECK_SECONDS. `ps-certs DIR --rotate` writes each task's new token and
leaves its old line ending in `until=TIME`: the policy accepts both until
then, without another re-read. A file that cannot be read or parsed
(mid-write by a writer that does not rename into place) keeps the table in
force, with one warning per version of the file.

A re-read file that changes the security policy in force (one job token
replaced by a table of per-task tokens) says so in a warning naming the new
one (torchps.access.describe; ps-server logs the first at start).

Thread-safe: its own lock (a leaf, an "owner" in locks.LOCK_ORDER) guards the
table and the file's identity; reads return an immutable Security.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable

from ..access import describe
from ..errors import ClusterConfigError
from ..security import Security, read_token_table

__all__ = ["TokenFile", "RECHECK_SECONDS"]

_LOGGER = logging.getLogger(__name__)
RECHECK_SECONDS = 1.0  # the longest a changed token file goes unnoticed (a revoked token still accepted)


def _identity(path: str) -> tuple | None:
    try:
        st = os.stat(path)  # follows symlinks: a Kubernetes Secret's files point into a folder swapped whole
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class TokenFile:
    """`security`'s tokens, following the file they were read from (`security.token_path`; None: fixed)."""

    def __init__(self, security: Security, *, recheck: float = RECHECK_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._security = security
        self._path = security.token_path
        self._recheck = recheck
        self._clock = clock
        self._identity: tuple | None = None
        self._checked = clock()
        self._warned: tuple | None = None
        self.reloads = 0  # times a changed file replaced the table
        # Read again now: the file may have changed since `security` was read (a backup promoted long after it
        # started serves with the table of its promotion, not of its start).
        self.refresh()

    def current(self) -> Security:
        """The credentials in force, the file looked at if RECHECK_SECONDS passed since the last look. Never
        raises; a stat at most."""
        if self._path is not None and self._clock() - self._checked >= self._recheck:
            self.refresh()
        return self._security

    def refresh(self) -> bool:
        """Looks at the file now; re-reads it if it changed. True if the table changed. Never raises."""
        if self._path is None:
            return False
        with self._lock:
            self._checked = self._clock()
            identity = _identity(self._path)
            if identity is None or identity == self._identity:
                return False
            try:
                table = read_token_table(self._path)
            except ClusterConfigError as exc:
                if identity != self._warned:
                    self._warned = identity
                    _LOGGER.warning("token file changed but cannot be read, the tokens in force stay: %s", exc)
                return False
            self._identity = identity
            previous = self._security
            if (table.token, table.lines, table.retiring) == (previous.token, previous.task_tokens, previous.retiring):
                return False  # rewritten with the same tokens
            self._security = current = dataclasses.replace(previous, token=table.token, task_tokens=table.lines,
                                                           retiring=table.retiring)
            self.reloads += 1
        before, after = {task for task, _, _ in previous.task_tokens}, {task for task, _, _ in table.lines}
        _LOGGER.info("token file %s re-read: %d task tokens%s%s%s", self._path, len(table.lines),
                     f", added {sorted(after - before)}" if after - before else "",
                     f", removed {sorted(before - after)}" if before - after else "",
                     f", {len(table.retiring)} retiring (replaced by a rotation)" if table.retiring else "")
        if describe(current) != describe(previous):
            _LOGGER.warning("security policy now: %s", describe(current))
        return True
