"""`ps-launch --replicas 2`: a backup per shard (docs/operations/replication.md), its addresses and its restarts.

Every process of a replicated shard knows the job's cluster spec (ps 0
records who serves each shard, ps 1 who serves ps 0), so the addresses are
picked before anything starts: a port each for the shards and their
backups, drawn from just below the kernel's ephemeral range (no outgoing
connection takes one between two runs of the job), bound all at once on
127.0.0.1 and released. Shard N runs as two
processes, each with shard N's credentials:

    ps:N         ps-server --index N --cluster SPEC --bind 127.0.0.1:P --replicated   (journal: DIR/journal/ps-N)
    ps:N-backup  ps-server --index N --cluster SPEC --replica-of 127.0.0.1:P --bind 127.0.0.1:B
                           --journal-dir DIR/journal/ps-N-backup

DIR is --checkpoint-dir. The arbiters journal the addresses they record (in
their checkpoints too), so they are kept in DIR/ps-launch-addresses.json and
given again to the job run again on DIR; a folder with that file is refused
to `--replicas 1` (its shards' newest state may be in a backup's folder).

When one of a shard's two processes dies and the other runs, the job goes
on: a dead primary's backup takes over by itself (its arbiter, ps 0, or ps 1
for ps 0, promotes it), and a dead backup leaves its primary alone. With
--restart-on-failure either is restarted with its own command: a backup
follows its primary again; a primary (--replicated) asks the arbiter who
serves its shard before it serves, whatever its journal folder holds (it
may have been a backup's copy, or be gone), and, if its backup took over,
becomes that one's backup. A one-shard job's ps 0 is its own arbiter: its death is dealt with
as without backups (`fails_over`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import random
import socket

from ..checkpoint_folder import journal_dir
from ..cluster import TaskSpec, arbiter_of
from ..errors import ClusterConfigError

__all__ = ["BackupTask", "ReplicaPlan", "ADDRESSES_FILE", "check_folder", "served_on"]

KEPT_PORTS = 2768  # ports just below the ephemeral range a replicated job's addresses are drawn from
ADDRESSES_FILE = "ps-launch-addresses.json"  # in --checkpoint-dir: a replicated job's shards' and backups' addresses
BIND_FAILED = "cannot bind"  # what ps-server prints when its --bind address is taken (ps_server/server.py)


@dataclasses.dataclass(frozen=True)
class BackupTask(TaskSpec):
    """The backup process of shard `index` ("ps:N-backup"). Its type is "ps" (it is stopped with the shards,
    and holds shard N's credentials), yet it is never equal to TaskSpec("ps", N): the launcher keeps both."""

    def __str__(self) -> str:
        return f"ps:{self.index}-backup"


def check_folder(checkpoint_dir: str | None, replicas: int) -> None:
    """ClusterConfigError (one line) for `--replicas 1` on a folder a replicated job ran in."""
    if replicas == 1 and checkpoint_dir and (pathlib.Path(checkpoint_dir) / ADDRESSES_FILE).is_file():
        raise ClusterConfigError(f"{checkpoint_dir} holds a job run with --replicas 2 ({ADDRESSES_FILE}): run it with "
                                 "--replicas 2 (a shard's newest state may be in its backup's folder), or give "
                                 "another --checkpoint-dir")


@dataclasses.dataclass
class ReplicaPlan:
    """The addresses of a replicated job's shards (`primaries`) and of their backups, under `folder`
    (--checkpoint-dir). `kept`: they are the ones the folder's job ran at (its shards come back there)."""

    folder: pathlib.Path
    primaries: list[str]
    backups: list[str]
    kept: bool = False

    @classmethod
    def load_or_pick(cls, folder: str | pathlib.Path, num_ps: int) -> "ReplicaPlan":
        """The addresses `folder` keeps for a job of `num_ps` shards, else new free ones (written there)."""
        folder = pathlib.Path(folder)
        try:
            kept = json.loads((folder / ADDRESSES_FILE).read_text())
            if len(kept["ps"]) == len(kept["backups"]) == num_ps:
                return cls(folder, list(kept["ps"]), list(kept["backups"]), kept=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return cls.pick(folder, num_ps)

    @classmethod
    def pick(cls, folder: pathlib.Path, num_ps: int) -> "ReplicaPlan":
        """New free loopback ports for `num_ps` shards and their backups, written to `folder`."""
        ports = [f"127.0.0.1:{port}" for port in _free_ports(2 * num_ps)]
        plan = cls(folder, ports[:num_ps], ports[num_ps:])
        path = folder / ADDRESSES_FILE
        path.with_suffix(".tmp").write_text(json.dumps({"ps": plan.primaries, "backups": plan.backups}) + "\n")
        path.with_suffix(".tmp").replace(path)
        return plan

    def ports(self) -> set[int]:
        return {int(address.rpartition(":")[2]) for address in self.primaries + self.backups}

    def spec(self) -> str:
        """The cluster spec every shard and backup is given (--cluster)."""
        return json.dumps({"ps": self.primaries})

    def shard_flags(self, index: int) -> list[str]:
        """Shard `index`'s flags beyond the launcher's own (--bind: its fixed address; --replicated: started
        again, even on a folder that was a backup's copy or is empty, it asks its arbiter who serves its shard
        before serving, instead of serving beside its promoted backup)."""
        return ["--cluster", self.spec(), "--bind", self.primaries[index], "--replicated"]

    def backup_flags(self, index: int) -> list[str]:
        """The whole command line of shard `index`'s backup, but for the flags every shard gets."""
        return ["--index", str(index), "--cluster", self.spec(), "--replica-of", self.primaries[index],
                "--bind", self.backups[index], "--journal-dir", f"{journal_dir(self.folder, index)}-backup"]

    def fails_over(self, task: TaskSpec) -> bool:
        """Whether shard `task.index` is served on when `task` dies and its other process runs: a backup's death
        loses nothing, nor does a primary's whose backup its arbiter promotes (a one-shard job's ps 0 is its
        own arbiter: its backup is promoted by hand only)."""
        return isinstance(task, BackupTask) or arbiter_of(task.index, len(self.primaries)) != task.index

    @staticmethod
    def other(task: TaskSpec) -> TaskSpec:
        """The other process of `task`'s shard."""
        return TaskSpec("ps", task.index) if isinstance(task, BackupTask) else BackupTask("ps", task.index)

    def describe(self) -> str:
        """One line naming each backup, its address and folder."""
        return "backups (--replicas 2): " + ", ".join(
            f"ps:{i} at {address} (copy in {journal_dir(self.folder, i)}-backup)"
            for i, address in enumerate(self.backups))

    def bind_failed(self, proc) -> tuple[str, bool] | None:
        """For a shard's process (launch.Proc) that did not start: None unless its last lines say its --bind
        address was taken; else (the launcher's line, whether to start the shards again on new ports: not at
        addresses the folder keeps, which the arbiters record)."""
        if not any(BIND_FAILED in line for line in proc.tail.shown()):
            return None
        address = self.primaries[proc.task.index]
        if self.kept:
            return (f"[launch] {address} is taken: {proc.name} of the job in {self.folder} comes back there (its "
                    "arbiter records it); stop what listens there and run again", False)
        return f"[launch] {proc.name} could not bind {address} (taken since it was picked): starting the shards " \
               "again on new ports", True


def served_on(launcher, task: TaskSpec) -> str:
    """For the launcher's process `task` that died: "; shard N goes on with OTHER alone (...)" where it is one
    of a replicated shard's processes whose other one runs and takes over if it must; else ""."""
    plan: ReplicaPlan | None = launcher.replicas
    if plan is None or task.type != "ps" or not plan.fails_over(task):
        return ""
    other = launcher.procs.get(plan.other(task))
    if other is None or other.popen.poll() is not None:
        return ""
    return f"; shard {task.index} goes on with {other.name} alone (promoted, if it was the backup)"


def _free_ports(count: int) -> list[int]:
    """`count` different loopback ports nothing listens at now, for a job that keeps them from run to run: drawn
    from just below the kernel's ephemeral range (KEPT_PORTS), which the kernel never hands out by itself, so no
    outgoing connection or port-0 listener takes one between runs; bound all at once, then released. Where that
    range leaves no room, the kernel's picks."""
    with contextlib.ExitStack() as stack:
        sockets = []
        for port in _kept_ports():
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            sockets.append(sock)
            if len(sockets) == count:
                return [s.getsockname()[1] for s in sockets]
        for sock in sockets:
            sock.close()
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def kept_ports_floor() -> int:
    """The first of the KEPT_PORTS ports just below the kernel's ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range); 0 where that cannot be read."""
    try:
        low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(1024, low - KEPT_PORTS)


def _kept_ports() -> list[int]:
    """The KEPT_PORTS ports just below the ephemeral range, shuffled."""
    floor = kept_ports_floor()
    if not floor:
        return []
    ports = list(range(floor, floor + KEPT_PORTS))
    random.shuffle(ports)
    return ports