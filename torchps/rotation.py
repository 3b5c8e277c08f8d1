"""ps-certs DIR --rotate: a new token for every task of a running job, the old ones accepted for a grace period.

The shards' table (DIR/tokens) gets each task's new line, and its old one
ends in `until=TIME` (now + the grace, UTC): the shards re-read the table
within a second (ps_server/tokens.py) and accept both until then
(torchps.access), so tasks running keep working and a task (re)started
reads its new token from its TYPE-INDEX.token. Once the grace ends an old
token gets UNAUTHENTICATED: restart every task before then. The table is
written first, then each task's token file, each whole (written aside,
renamed over it), so a new token is never sent before the shards can know
it. Lines an earlier rotation left retire by the new grace's end at the
latest (--grace 0 refuses every old token at once); those past are dropped. The
shards compare TIME with their own clock: the hosts' clocks must agree to
well within the grace.

The CA, the keys, the certificates and the admin token stay: a shard and
the chief read those once, at start, and mutual TLS has no way to revoke a
certificate the CA signed, so replacing them takes a new folder (ps-certs
--cluster) and a restart of the job.
"""

from __future__ import annotations

import os
import pathlib
import re
import time

from .cluster import TaskSpec
from .errors import ClusterConfigError
from .secret_files import new_token, replace_file
from .security import read_token_table, until_text

__all__ = ["DEFAULT_GRACE", "parse_grace", "rotate_tokens"]

DEFAULT_GRACE = "10m"  # the old tokens' validity: time to restart a job's tasks one by one
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_grace(text: str) -> float:
    """Seconds of a --grace value: N, Ns, Nm or Nh (N >= 0); ClusterConfigError (one line) otherwise."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if found is None:
        raise ClusterConfigError(f"--grace must be a duration such as 90s, 10m or 1h (0: the old tokens are refused "
                                 f"at once). Received: {text!r}")
    return float(found[1]) * _UNITS[found[2]]


def _task(name: str, path: pathlib.Path) -> TaskSpec:
    kind, _, index = name.partition(":")
    if not kind or not index.isdigit():
        raise ClusterConfigError(f"{path} names a task {name!r}: expected TYPE:INDEX (ps-certs writes the table)")
    return TaskSpec(kind, int(index))


def rotate_tokens(directory: str | os.PathLike, *, grace: float, now: float | None = None
                  ) -> tuple[dict[TaskSpec, str], str]:
    """A new token for every task of DIR/tokens (see the module docstring), its old one accepted for `grace`
    seconds from `now` (default: the clock's; 0: refused at once). Returns (each task's role, one line for the
    user). ClusterConfigError (one line, nothing written) for a folder without ca.crt or a table of per-task
    tokens."""
    directory = pathlib.Path(directory)
    for name in ("ca.crt", "tokens"):
        if not (directory / name).is_file():
            raise ClusterConfigError(f"{directory} has no {name}: --rotate needs the folder ps-certs made for the job")
    path = directory / "tokens"
    table = read_token_table(str(path))
    if table.token is not None:
        raise ClusterConfigError(f"{path} holds one job token, not ps-certs' table of per-task tokens: --rotate "
                                 "renews a table")
    now = time.time() if now is None else now
    retiring = {token: min(until, now + grace) for token, until in table.retiring}  # none outlives this grace
    kept = [f"{name} {role} {token} {until_text(retiring[token])}\n" for name, role, token in table.lines
            if token in retiring and retiring[token] > now]
    current = {_task(name, path): (role, token) for name, role, token in table.lines if token not in retiring}
    if not current:
        raise ClusterConfigError(f"{path} has no task's token to rotate")
    fresh = {task: new_token().decode() for task in current}
    lines = kept + [f"{task} {role} {old} {until_text(now + grace)}\n" for task, (role, old) in current.items()
                    if grace > 0]
    lines += [f"{task} {role} {fresh[task]}\n" for task, (role, _) in current.items()]
    replace_file(path, "".join(lines).encode())  # first: the shards know a new token before any task sends it
    for task in current:
        if task.type != "ps":  # a shard reads its new line in the table
            replace_file(directory / f"{task.type}-{task.index}.token", fresh[task].encode())
    names = ", ".join(str(task) for task in current)
    if grace > 0:
        until = until_text(now + grace).removeprefix("until=")
        line = (f"new tokens for {names}; the old ones are accepted until {until} (UTC): restart each task "
                f"before then (it reads its new token file)")
    else:
        line = f"new tokens for {names}; the old ones are refused now: restart each task (it reads its new token file)"
    return {task: role for task, (role, _) in current.items()}, line
