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
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

from ..certs import JobCredentials, TaskCredentials, append_tokens, token_line
from ..cluster import TaskSpec
from ..errors import ClusterConfigError
from ..security import ENV

__all__ = ["JobFolder"]


class JobFolder:
    """The launcher's folder for one job. Not thread-safe: the launcher's main thread owns it."""

    def __init__(self, *, credentials: JobCredentials | None = None,
                 user_files: dict[TaskSpec, TaskCredentials] | None = None, tls: bool = True,
                 user_dir: str | os.PathLike | None = None):
        self.path = pathlib.Path(tempfile.mkdtemp(prefix="ps-launch-"))  # mode 0700
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
        """Removes the folder and everything in it. Idempotent."""
        shutil.rmtree(self.path, ignore_errors=True)
