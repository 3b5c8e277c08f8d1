"""ps-launch --restart-on-failure: how long to wait before a restart, and which deaths no restart can mend.

    backoff(1), backoff(2), backoff(3)          # 1.0, 2.0, 4.0 seconds (doubling, at most BACKOFF_MAX_SECONDS)
    no_room(lines, pathlib.Path("ckpt"))        # None, or NoRoom('the disk is full (/data/ckpt/...: 0 bytes free)', ...)

A restart waits, so a cause that lasts seconds (a peer restarting, a port not
yet free) is waited out instead of every restart being spent at once. A process
that died because a file could not be written (ENOSPC: the disk is full;
EFBIG: a file reached the file-size limit, `ulimit -f`) would meet the same
wall at once if restarted: `no_room` recognises it from the lines its log
ended with (ps_server/failstop.py's line names the journal's path and the
error), and ps-launch stops the job instead (see launch.py).
"""

from __future__ import annotations

import errno
import os
import pathlib
import re
import resource
import shutil
from typing import Iterable, NamedTuple

__all__ = ["BACKOFF_FIRST_SECONDS", "BACKOFF_MAX_SECONDS", "NoRoom", "backoff", "no_room"]

BACKOFF_FIRST_SECONDS = 1.0  # before a process's first restart: the time a dying peer or a port needs to settle
BACKOFF_MAX_SECONDS = 30.0   # no restart waits longer: a job stays at most this long without the process
_CAUSES = [(re.compile(rf"\[Errno {number}\]|{re.escape(os.strerror(number))}"), kind)
           for number, kind in ((errno.ENOSPC, "disk"), (errno.EFBIG, "file size"))]
_PATH = re.compile(r"(?:^|[\s'\"(=])(/[^\s:'\"]+)")  # an absolute path on a log line (not the "/" of "I/O")


class NoRoom(NamedTuple):
    """Why a process could not write: `cause` ('the disk is full (PATH: N bytes free)'), the `wall` a restart would
    meet ('full disk'), and what the operator does about it (`remedy`, 'Free some room there')."""

    cause: str
    wall: str
    remedy: str


def backoff(restart: int) -> float:
    """Seconds to wait before a process's `restart`-th restart (1 for the first): doubling, capped."""
    return min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2 ** (restart - 1))


def no_room(lines: Iterable[str], writes_to: pathlib.Path) -> NoRoom | None:
    """What stopped the process writing, if its log `lines` say a write failed for want of room (the disk is
    full, or PATH could grow no further: File too large); None otherwise. PATH is the last absolute path on the
    last such line, else `writes_to` (where the process writes most)."""
    for line in reversed(list(lines)):
        for pattern, kind in _CAUSES:
            if pattern.search(line):
                paths = _PATH.findall(line)
                return _describe(kind, pathlib.Path(paths[-1]) if paths else writes_to.absolute())
    return None


def _describe(kind: str, path: pathlib.Path) -> NoRoom:
    if kind == "file size":
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]  # the children's, inherited from this process
        which = ("a file-size limit set on the process alone, or the filesystem's largest file"
                 if limit == resource.RLIM_INFINITY else f"the file-size limit, `ulimit -f`, is {limit:,} bytes")
        return NoRoom(f"{path} could grow no further ({os.strerror(errno.EFBIG)}: {which})", "limit",
                      "Raise the limit or make room for the file elsewhere")
    existing = next((p for p in (path, *path.parents) if p.exists()), pathlib.Path("/"))
    return NoRoom(f"the disk is full ({path}: {shutil.disk_usage(existing).free:,} bytes free)", "full disk",
                  "Free some room there")
