"""A job's --checkpoint-dir as the processes that share it see it: who writes it, and where the shards'
journals are. No torch, no gRPC: ps-launch checks the folder before it starts anything.

    CHECKPOINT_DIR/ps-launch.lock    held by the ps-launch that runs a job there
    CHECKPOINT_DIR/ps-N.lock         held by shard N: its checkpoint files and its journal (journal/ps-N)
    JOURNAL_DIR.lock                 held by the shard given --journal-dir JOURNAL_DIR (beside the folder,
                                     which --replace-journal may rename)

Each lock is an exclusive flock(2), taken without waiting and held until the process exits: the kernel lets
go of it when its holder dies, however it dies (SIGKILL included), so a restarted shard takes it at once.
The holder writes its pid and host into the file; a process refused names the holder (pid and command line)
in one line (ClusterConfigError). A file system without flock (some network mounts) logs a warning and locks
nothing.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pathlib
import socket
import time

from .errors import ClusterConfigError

__all__ = ["JOURNALS", "LAUNCH_ADVICE", "Held", "journal_dir", "hold_shard", "hold_launch", "move_journals_aside"]

_LOGGER = logging.getLogger(__name__)
JOURNALS = "journal"          # CHECKPOINT_DIR/journal/ps-N: shard N's journal unless --journal-dir says otherwise
LAUNCH_LOCK = "ps-launch.lock"
SHARD_LOCKS = "ps-[0-9]*.lock"  # every shard's lock in a checkpoint folder (not ps-launch's)
COMMAND_CHARS = 160           # of a holder's command line in a refusal
# What a shard ps-launch started says to do about a journal it refuses (corrupt, or another job's or layout's).
LAUNCH_ADVICE = ("run ps-launch again with --replace-journal added: every shard's journal is moved aside (kept, not "
                 "deleted) and the job starts from the newest committed checkpoint in --checkpoint-dir")
_ELSEWHERE = "another job writes it; give this job its own --checkpoint-dir"


class Held:
    """Locks this process holds until it exits or calls release()."""

    def __init__(self):
        self._fds: list[int] = []

    def add(self, fd: int | None) -> None:
        if fd is not None:
            self._fds.append(fd)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def journal_dir(checkpoint_dir: str | os.PathLike, index: int) -> pathlib.Path:
    """Shard `index`'s journal folder under a checkpoint folder (its default --journal-dir)."""
    return pathlib.Path(checkpoint_dir) / JOURNALS / f"ps-{index}"


def hold_shard(checkpoint_dir: str | None, own_journal_dir: str | None, index: int) -> Held:
    """Shard `index`'s locks: on its part of `checkpoint_dir` and on `own_journal_dir` (a --journal-dir),
    each if given. Returns at once; ClusterConfigError naming the holder if another process holds one."""
    held = Held()
    try:
        if checkpoint_dir:
            held.add(_take(pathlib.Path(checkpoint_dir) / f"ps-{index}.lock", f"checkpoint folder {checkpoint_dir}",
                           _ELSEWHERE))
        if own_journal_dir:
            path = pathlib.Path(own_journal_dir)
            held.add(_take(path.with_name(path.name + ".lock"), f"journal folder {own_journal_dir}",
                           "another shard writes it; give this shard its own --journal-dir"))
    except BaseException:
        held.release()
        raise
    return held


def hold_launch(checkpoint_dir: str) -> Held:
    """ps-launch's lock on `checkpoint_dir`, for the whole job. Returns at once; ClusterConfigError naming
    the holder if another ps-launch runs a job there."""
    held = Held()
    held.add(_take(pathlib.Path(checkpoint_dir) / LAUNCH_LOCK, f"checkpoint folder {checkpoint_dir}", _ELSEWHERE))
    return held


def move_journals_aside(checkpoint_dir: str) -> pathlib.Path | None:
    """Renames CHECKPOINT_DIR/journal (every shard's journal) to journal.aside-TIME, kept, never deleted, so
    that every shard starts from the newest committed checkpoint; returns the new name, None if there was no
    journal. Call it holding hold_launch(): ClusterConfigError (nothing moved) while a shard holds its lock."""
    folder = pathlib.Path(checkpoint_dir)
    journals = folder / JOURNALS
    if not journals.is_dir():
        return None
    shards = Held()
    try:
        for path in sorted(folder.glob(SHARD_LOCKS)):
            shards.add(_take(path, f"checkpoint folder {checkpoint_dir}", _ELSEWHERE))
        aside = folder / f"{JOURNALS}.aside-{time.strftime('%Y%m%dT%H%M%S')}"
        while aside.exists():
            aside = aside.with_name(aside.name + "x")
        journals.rename(aside)
    finally:
        shards.release()
    return aside


def _take(path: pathlib.Path, what: str, advice: str) -> int | None:
    """The open lock file `path`, locked, this process's pid written in it; None where the file system has
    no locks. ClusterConfigError naming the holder if another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ClusterConfigError(f"{what} is in use by {_holder(path)}: {advice}") from None
        _LOGGER.warning("%s cannot be locked (%s): nothing stops another job from writing it too", path,
                        exc.strerror or exc)
        return None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError as exc:  # a full disk: the lock holds all the same; only a refusal cannot name its holder
        _LOGGER.warning("%s: could not record this process in it (%s): a job refused for it will not learn "
                        "which process holds it", path, exc.strerror or exc)
    return fd


def _holder(path: pathlib.Path) -> str:
    """'pid N (its command line)' of the process the lock file names, 'pid N on HOST' for one on another host
    (a folder shared over the network, another pod), else 'another process' (it has just taken the lock and
    not written its name yet)."""
    try:
        pid_text, host = path.read_text().split()
        pid = int(pid_text)
        if host != socket.gethostname():
            return f"pid {pid} on {host}"
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode(errors="replace").split("\0")
    except (OSError, ValueError):
        return "another process"
    if len(argv) > 1:  # as executed (a forked shard's title is one string): its program by name, not path
        argv[0] = os.path.basename(argv[0])
        if argv[0].startswith("python") and argv[1].endswith(("ps-launch", "ps-server")):
            argv = [os.path.basename(argv[1]), *argv[2:]]  # a console script: python .../bin/ps-launch ...
    command = " ".join(argv).strip()
    command = command if len(command) <= COMMAND_CHARS else command[:COMMAND_CHARS - 3] + "..."
    return f"pid {pid} ({command})" if command else f"pid {pid}"
