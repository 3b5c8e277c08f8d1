"""ps-launch's private folder: the shards' port files and each task's own credentials, removed with the job.

    folder = JobFolder(credentials=issue_job_credentials(tasks, days=1))   # the CA's key is not kept
    env = folder.credential_env(TaskSpec("worker", 1))   # TORCHPS_* naming worker:1's files only
    folder.remove()                                       # on every way out the launcher sees

The folder (mode 0700, in the system's temporary directory) holds one
subfolder per task with that task's certificate, key, the CA's certificate,
its own token (a shard's: the table of every other task's, so a token names
its task without TLS too) and, for the chief and the shards, the admin
token: the TORCHPS_* variables a child gets name its own files only. Nothing in it can
sign a certificate. With a folder ps-certs made (`user_files`), the child is
pointed at the user's files instead, which the launcher never removes.

A worker added to the running job (`add_task`, ps-launch scale) gets
credentials of its own: signed with the CA key the launcher keeps in memory
(never written), its token added to every shard's table (which the shards
re-read); with the user's folder, the files `ps-certs DIR --add` made there.

A launcher killed with SIGKILL cannot remove its folder, so the next one does:
each folder holds LOCK_FILE, locked (flock) by its launcher for as long as it
lives and naming its pid and start time. `remove_dead_folders()` removes every
folder of this user's in the temporary directory whose lock it can take (its
launcher is gone: the kernel dropped the lock with the process), never one whose
lock is held, nor one without the file (being made, or made before launchers
kept one).
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import tempfile
import time

from ..certs import JobCredentials, TaskCredentials, append_tokens, token_line
from ..cluster import TaskSpec
from ..errors import ClusterConfigError
from ..security import ENV

__all__ = ["JobFolder", "remove_dead_folders"]

PREFIX = "ps-launch-"        # the job folders' names in the temporary directory
LOCK_FILE = "launcher.lock"  # flock'ed by the launcher while it lives; {"pid": ..., "started": ...} inside


class JobFolder:
    """The launcher's folder for one job. Not thread-safe: the launcher's main thread owns it."""

    def __init__(self, *, credentials: JobCredentials | None = None,
                 user_files: dict[TaskSpec, TaskCredentials] | None = None, tls: bool = True,
                 user_dir: str | os.PathLike | None = None):
        self.path = pathlib.Path(tempfile.mkdtemp(prefix=PREFIX))  # mode 0700
        self._lock: int | None = _hold_lock(self.path)
        self._credentials = credentials
        self._user_files = user_files
        self._user_dir = pathlib.Path(user_dir) if user_dir is not None else None  # where user_files lie
        self._tls = tls
        self._written: dict[TaskSpec, TaskCredentials] = {}

    @property
    def secure(self) -> bool:
        """True if the tasks get credentials (else every process runs --insecure)."""
        return self._credentials is not None or self._user_files is not None

    def port_file(self, index: int) -> pathlib.Path:
        return self.path / f"ps{index}.port"

    def credential_env(self, task: TaskSpec) -> dict[str, str]:
        """The TORCHPS_* variables naming `task`'s files (written on first use), or {} for an insecure job."""
        files = self._files(task)
        if files is None:
            return {}
        env = {ENV["token_file"]: str(files.token)}
        if self._tls:
            env.update({ENV["tls_cert"]: str(files.cert), ENV["tls_key"]: str(files.key), ENV["tls_ca"]: str(files.ca)})
        if files.admin_token is not None:
            env[ENV["admin_token_file"]] = str(files.admin_token)
        return env

    def _files(self, task: TaskSpec) -> TaskCredentials | None:
        if self._user_files is not None:
            return self._user_files[task]
        if self._credentials is None:
            return None
        if task not in self._written:
            self._written[task] = self._credentials.write_task(task, self.path / f"{task.type}-{task.index}")
        return self._written[task]

    def add_task(self, task: TaskSpec) -> None:
        """Credentials for `task`, a worker joining the running job (see the module docstring); nothing for an
        insecure job. ClusterConfigError (one line, nothing changed) if the user's folder lacks its files."""
        if self._user_files is not None:
            stem = self._user_dir / f"{task.type}-{task.index}"
            files = TaskCredentials(stem.with_suffix(".crt"), stem.with_suffix(".key"), self._user_dir / "ca.crt",
                                    stem.with_suffix(".token"))
            missing = [p.name for p in (files.cert, files.key, files.token) if not p.is_file()]
            if missing:
                raise ClusterConfigError(f"{self._user_dir} has no {', '.join(missing)} for {task}: run "
                                         f"`ps-certs {self._user_dir} --add {task}` first")
            self._user_files[task] = files
        elif self._credentials is not None:
            self._credentials = self._credentials.with_task(task)
            line = token_line(task, self._credentials.tokens[task])
            for shard, files in self._written.items():
                if shard.type == "ps":  # its table of tokens: the shard re-reads it (ps_server/tokens.py)
                    append_tokens(files.token, line)

    def remove(self) -> None:
        """Removes the folder and everything in it, then lets go of its lock. Idempotent."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _hold_lock(folder: pathlib.Path) -> int:
    """The descriptor of folder/LOCK_FILE, locked for this process's life (the kernel drops the lock when the process
    ends, however it ends; the descriptor is not inherited). Written and locked under another name, then renamed:
    no other launcher ever finds the file unlocked while this one lives."""
    making = folder / (LOCK_FILE + ".new")
    fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    os.rename(making, folder / LOCK_FILE)
    return fd


def remove_dead_folders(root: str | os.PathLike | None = None) -> list[str]:
    """Removes the job folders in `root` (the temporary directory) that this user's dead launchers left (see the
    module docstring); returns 'FOLDER (pid P, started T)' for each. Never blocks; a folder that cannot be
    looked at is left alone."""
    removed = []
    for folder in sorted(pathlib.Path(root or tempfile.gettempdir()).glob(PREFIX + "*")):
        try:
            if folder.is_symlink() or folder.lstat().st_uid != os.geteuid():
                continue
            fd = os.open(folder / LOCK_FILE, os.O_RDONLY)
        except OSError:
            continue
        try:
            if _left_behind(folder, fd):
                said = _launcher_of(fd)
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(f"{folder} (pid {said.get('pid', '?')}, started {said.get('started', '?')})")
        finally:
            os.close(fd)  # the lock, held while removing: no other launcher removes the folder too
    return removed


def _left_behind(folder: pathlib.Path, fd: int) -> bool:
    """True once this process holds the lock of `folder`'s LOCK_FILE (open as `fd`) and the file is still there:
    its launcher died without removing the folder."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # its launcher lives
        return False
    return (folder / LOCK_FILE).exists()  # else its launcher removed the folder as it ended, then let go


def _launcher_of(fd: int) -> dict:
    """What the launcher wrote into its LOCK_FILE ({} if unreadable)."""
    try:
        said = json.loads(os.read(fd, 4096))
    except (OSError, ValueError):
        return {}
    return said if isinstance(said, dict) else {}
