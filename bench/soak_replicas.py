"""The chaos soak's replicated shards (bench/soak.py --replicas 2): a backup beside every shard, the fault kinds
that strike one of a shard's two processes, and how long each failover took.

Every shard runs as two processes, its *hosts*, each with the job's cluster spec and a fixed --bind, picked
before anything starts (worker/launch_replicas.py's ReplicaPlan, written to the phase's folder): host 0
(--replicated) binds the shard's port and is known to the job at the spec's address (ps 1's is the soak's
proxy, which forwards to host 0's port), host 1 is the backup (`ps-server --replica-of SPEC_ADDRESS --bind B --journal-dir
CKPT/journal/ps-N-backup`). Both get the shards' flags: the job's --checkpoint-dir (a promoted backup writes
its shard's file of every later checkpoint there) and the shards' token table and admin token (a backup
calls its primary and the arbiter with its shard's own line of the table, ps:N, in the ps role, as every
shard does). Which host is the primary
changes with each failover: the soak asks the shard's arbiter (ps 0, ps 1 for ps 0), which records it.

A host's command stays its own: started again, host 0's original command asks the arbiter who serves the
shard and becomes that one's backup if it is not itself (the primary restarted on its disk); a backup's
command follows the other host, which is the primary whenever this one is not. The soak starts a struck
primary again only once its arbiter records its backup promoted (FAILOVER_SECONDS; else a failure): a
primary is struck only while its backup is in sync (IN_SYNC_SECONDS, else the kind waits for later in the
round), so the failover always has a backup to promote.

The kinds (REPLICA_FAULTS; those named as in bench/soak.py replace its own with --replicas 2):
  kill-shard         SIGKILL a shard's primary; its backup takes over; it is started again with its command
                     (it becomes the backup)
  pause-shard        SIGSTOP a shard's backup for 0.5-3 s: the primary acknowledges nothing it did not write,
                     and drops it past --replica-ack-timeout (the primary pauses in partition-primary)
  disk-full          a shard's primary's files may grow no further: it stops itself (exit 70, a fail-stop), its
                     backup takes over, and it is started again with room (it becomes the backup)
  host-lost          SIGKILL a shard's primary and delete its journal folder; its backup takes over; a fresh
                     backup is started on the old primary's address with a new empty journal folder
                     (`--replica-of` the promoted one), as an operator replacing the host would
  backup-lost        SIGKILL a shard's backup (in sync), then start it again with its command: its primary drops
                     it and it follows anew, from a new base
  backup-disk-full   a shard's backup's files may grow no further for 0.5-3 s (its soft RLIMIT_FSIZE, then lifted):
                     a record it cannot write ends its stream and it follows anew from a new base (it must not
                     stop); its primary acknowledges meanwhile, dropping it if it falls behind
  partition-primary  SIGSTOP a shard's primary until its arbiter promoted its backup (cut off from everyone),
                     then SIGCONT it: it must stop by itself (exit 70: fenced, counted in `fenced`) within
                     FENCE_SECONDS; it is then started again with its command (it becomes the backup).
                     Anything it acknowledged after it was cut off would be missing from its successor's copy:
                     the audit's per-push count finds it (lost)

Every strike of a primary (kill-shard, disk-full, host-lost, partition-primary) is timed: its failover is
from the strike (the SIGKILL or SIGSTOP sent; a full disk's: the primary seen gone) to the first push a
worker logged acknowledged by the shard's next process (the "g=" of an "acked" line: each shard's generation
in its reply, new in every process) with a later time (CLOCK_MONOTONIC). A strike no successor acknowledged
anything for before the phase ended counts in `failovers_unserved`.

The proxy of cut-connections always forwards to ps 1's host 0 (a fresh backup there is known at the proxy's
address too: --advertise). While host 0 is ps 1's primary, a cut drops the clients' connections and its
backup's stream (the backup follows the spec's address): the primary drops the backup, which follows anew.
While host 1 serves ps 1 (after a failover, until the next), clients reach it at its own address and host 0,
its backup, follows it there: nothing goes through the proxy, and a cut cuts nothing.

The resizes of bench/resizes.py are drawn. A shard that shard-added starts (add_pair) is a pair too, on new
ports and journal folders of its own (an index added again after a removal as well), both given the job's
shard addresses with it as their spec: its primary starts empty (--join) and, started again (--replicated),
finds its role at its arbiter (ps 0) as the others do; its backup follows it from the start and is recorded
in sync once the resize's epoch names the shard. The faults above then strike it as any other. shard-removed
resizes the job off its last shard: the process serving it is stopped by the resize, and its other one must
exit by itself (remove_pair). The failures of a resize (bench/resize_faults.py) are left out: they call the
shards at the ports they started on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import time
from typing import Callable

from resizes import percentile  # bench/ is on the path: soak.py put it there

__all__ = ["ReplicatedShards", "REPLICA_FAULTS", "REPLICA_KINDS", "failover_figures"]

IN_SYNC_SECONDS = 30.0   # a struck shard's backup must be in sync within this (else the kind waits for later)
REMOVED_SECONDS = 30.0   # both processes of a shard a resize removed must have exited within this
FAILOVER_SECONDS = 15.0  # a struck primary's arbiter must record its backup promoted within this
FENCE_SECONDS = 30.0     # a partitioned primary, resumed after its failover, must stop by itself within this
RECORD_SECONDS = 2.0     # one look at an arbiter's record, or at a shard's status
POLL_SECONDS = 0.05      # between two looks at a record that is to change
REPLICA_KINDS = ("host-lost", "backup-lost", "backup-disk-full", "partition-primary")  # only with --replicas 2


@dataclasses.dataclass
class Host:
    """One of shard `index`'s two processes: `bind` its address, `known_as` where its arbiter and the job
    know it (ps 1's host 0: the proxy's), `argv` its command now, `folder` its journal folder."""

    index: int
    seat: int
    bind: str
    known_as: str
    argv: list[str]
    folder: pathlib.Path
    log: pathlib.Path
    proc: object = None  # a Popen or the fork server's look-alike

    @property
    def name(self) -> str:
        return f"ps {self.index}" + ("" if self.seat == 0 else " host 1")

    def tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return " | ".join(text.splitlines()[-3:])


@dataclasses.dataclass
class Strike:
    """A fault that took shard `index`'s primary (its process's `generation`) away at `at` (CLOCK_MONOTONIC)."""

    kind: str
    index: int
    at: float
    generation: int
    at_unix: float = 0.0  # `at` on the wall clock, which the arbiter's record of a promotion uses
    failover_s: float | None = None
    promoted_s: float | None = None  # from the strike to the arbiter's grant of the promotion


class ReplicatedShards:
    """`num_shards` shards to start with, each a primary and a backup (see the module docstring), under
    `directory` (logs, the picked addresses) with `flags` (every host's: the checkpoint folder, credentials)."""

    def __init__(self, directory: pathlib.Path, ckpt: pathlib.Path, num_shards: int, flags: list[str]):
        from torchps.forkserver import ProcessStarter
        from torchps.worker.launch_replicas import ReplicaPlan
        from torchps.worker.local_cluster import local_shard_threads

        self.dir, self.ckpt, self._starting = directory, ckpt, num_shards
        self.flags = [*flags, *local_shard_threads(flags)]
        self.starter = ProcessStarter.shared()
        self.picked = ReplicaPlan.pick(directory, num_shards)  # the hosts' binds: primaries' and backups'
        self.hosts: list[tuple[Host, Host]] = []  # the job's shards now, in index order
        self.specs: list[str] = []   # each shard's cluster spec (--cluster): the job's, or the one it was added with
        self._added = 0              # shards add_pair started
        self.strikes: list[Strike] = []
        self.fenced = 0          # partitioned primaries that stopped by themselves (exit 70)
        self.fresh = 0           # backups started on a new empty folder (host-lost)
        self._arbiters = None    # channels to the arbiters (ps 0 and ps 1), following their own failovers
        self._token = None
        self.spec = ""           # the cluster spec every host is given (--cluster)

    @property
    def num_shards(self) -> int:
        """The job's shards now (resizes add and remove pairs)."""
        return len(self.hosts)

    def port(self, index: int) -> int:
        """Shard `index`'s host 0's port (ps 1's proxy forwards there)."""
        return int(self.picked.primaries[index].rpartition(":")[2])

    def start(self, spec: list[str], security) -> None:
        """Starts every shard (its address in the job's cluster `spec`) and its backup; returns once the
        primaries serve. `security`: the chief's, for the soak's own calls (the arbiters' records)."""
        from torchps.checkpoint_folder import journal_dir
        from torchps.ps_server.backup import arbiter_channels
        from torchps.worker.launch_replicas import ReplicaPlan
        from torchps.worker.local_cluster import START_TIMEOUT_SECONDS

        plan = ReplicaPlan(self.ckpt, list(spec), self.picked.backups)
        self.spec = plan.spec()
        self._token = security.call_token()
        self._arbiters = arbiter_channels(tuple(spec), RECORD_SECONDS, security)
        for index in range(self._starting):
            port_file = self.dir / f"ps{index}.port"
            primary = Host(index, 0, self.picked.primaries[index], spec[index],
                           ["--index", str(index), "--cluster", self.spec, "--bind", self.picked.primaries[index],
                            "--replicated", "--port-file", str(port_file), *self.flags],
                           journal_dir(self.ckpt, index), self.dir / f"ps{index}.log")
            backup = Host(index, 1, plan.backups[index], plan.backups[index], [*plan.backup_flags(index), *self.flags],
                          pathlib.Path(f"{journal_dir(self.ckpt, index)}-backup"), self.dir / f"ps{index}-backup.log")
            self.hosts.append((primary, backup))
            self.specs.append(self.spec)
            self._spawn(primary)
        for index in range(self._starting):
            deadline = time.monotonic() + START_TIMEOUT_SECONDS
            while not (self.dir / f"ps{index}.port").exists():
                if self.hosts[index][0].proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ps {index} did not start: {self.hosts[index][0].tail()}")
                time.sleep(POLL_SECONDS)
        for _, backup in self.hosts:
            self._spawn(backup)

    def _spawn(self, host: Host) -> None:
        from torchps.worker.local_cluster import SHARD_MODULE

        with open(host.log, "ab") as log:
            host.proc = self.starter.start(SHARD_MODULE, host.argv, prog="ps-server",
                                           env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log.fileno(),
                                           parent_death_signal=signal.SIGTERM)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM to every host, SIGKILL after `grace` s."""
        procs = [host.proc for pair in self.hosts for host in pair if host.proc is not None]
        for proc in procs:
            proc.send_signal(signal.SIGCONT)  # a paused one must see its SIGTERM
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._arbiters is not None:
            self._arbiters.close()

    # -- the arbiters' records -------------------------------------------------------------------------

    def record(self, index: int) -> tuple[str, str, float] | None:
        """(primary, backup in sync or "", when its last failover was granted: Unix seconds, 0 if never) of
        shard `index` as its arbiter records it; None if it does not answer."""
        from torchps.errors import PSError
        from torchps.ps_server.backup import arbiter_layout

        try:
            layout = arbiter_layout(self._arbiters, index)  # followed to where the arbiter is served
        except PSError:
            return None
        entry = next((e for e in layout.replicas if e.index == index), None)
        return (entry.primary, entry.backup, entry.last_failover_unix) if entry is not None \
            else (self.hosts[index][0].known_as, "", 0.0)

    def layout_names(self) -> list[str]:
        """The job's shards as ps 0's layout names them ([] before any resize: the cluster spec's; a resize names
        each shard that stays where it was served then, and a later one must name it so, or where it is served
        now); [] if ps 0 does not answer."""
        from torchps.errors import PSError
        from torchps.ps_server.backup import arbiter_layout

        try:
            return list(arbiter_layout(self._arbiters, 1).addresses)  # ps 0's, followed to where it is served
        except PSError:
            return []

    def _host(self, index: int, address: str) -> Host | None:
        return next((host for host in self.hosts[index] if host.known_as == address), None)

    def primary(self, index: int) -> Host | None:
        """The host its arbiter says serves shard `index` (None if it does not answer)."""
        found = self.record(index)
        return self._host(index, found[0]) if found else None

    def serving_port(self, index: int) -> int | None:
        """The port shard `index` is served at now (its primary's own, not the proxy's), None if unknown."""
        host = self.primary(index)
        return None if host is None else int(host.bind.rpartition(":")[2])

    def in_sync(self, index: int) -> tuple[Host, Host] | None:
        """(primary, backup) of shard `index` once its arbiter records the backup in sync (within
        IN_SYNC_SECONDS, and the primary answers its status); else None."""
        deadline = time.monotonic() + IN_SYNC_SECONDS
        while time.monotonic() < deadline:
            found = self.record(index)
            if found and found[1]:
                primary, backup = self._host(index, found[0]), self._host(index, found[1])
                if primary is not None and backup is not None and primary.proc.poll() is None \
                        and backup.proc.poll() is None:
                    return primary, backup
            time.sleep(POLL_SECONDS)
        return None

    def promoted(self, index: int, backup: Host) -> float | None:
        """When (Unix seconds) shard `index`'s arbiter granted `backup` the primary's role, once it records it
        so within FAILOVER_SECONDS; None if it does not."""
        deadline = time.monotonic() + FAILOVER_SECONDS
        while time.monotonic() < deadline:
            found = self.record(index)
            if found and found[0] == backup.known_as:
                return found[2]
            time.sleep(POLL_SECONDS)
        return None

    def generation(self, host: Host) -> int | None:
        """The generation of the process serving at `host` (GetStatus), None if it does not answer."""
        import grpc
        from torchps.proto import ps_pb2, ps_pb2_grpc
        from torchps.security import TOKEN_METADATA_KEY

        with grpc.insecure_channel(host.bind) as channel:
            try:
                return ps_pb2_grpc.ParameterServerStub(channel).GetStatus(
                    ps_pb2.StatusRequest(), timeout=RECORD_SECONDS,
                    metadata=((TOKEN_METADATA_KEY, self._token),)).generation
            except grpc.RpcError:
                return None

    # -- restarts -------------------------------------------------------------------------------------------

    def restart(self, host: Host, failures: list[str]) -> None:
        """Starts `host` again with its command once its arbiter no longer records it as the primary (its
        backup promoted; a failure after FAILOVER_SECONDS, and it starts anyway)."""
        found = self.record(host.index)
        other = self.hosts[host.index][1 - host.seat]
        if found and found[0] == host.known_as and found[1] == other.known_as \
                and self.promoted(host.index, other) is None:
            failures.append(f"ps {host.index}'s backup was not promoted within {FAILOVER_SECONDS:g} s of its "
                            f"primary's end")
        self._spawn(host)

    def restart_exited(self, failures: list[str]) -> list[tuple[str, int, str]]:
        """(name, exit code, last lines) of every host that exited by itself, each started again (restart)."""
        out = []
        for host in (host for pair in self.hosts for host in pair):
            if host.proc.poll() is not None:
                out.append((host.name, host.proc.returncode, host.tail()))
                self.restart(host, failures)
        return out

    def replace(self, lost: Host, primary: Host) -> None:
        """Starts a fresh backup of `primary` where `lost` was: its address, a new empty journal folder."""
        self.fresh += 1
        folder = pathlib.Path(f"{self.hosts[lost.index][0].folder}-fresh{self.fresh}")
        advertise = ["--advertise", lost.known_as] if lost.known_as != lost.bind else []
        lost.argv = ["--index", str(lost.index), "--cluster", self.specs[lost.index], "--replica-of",
                     primary.known_as, "--bind", lost.bind, *advertise, "--journal-dir", str(folder), *self.flags]
        lost.folder = folder
        self._spawn(lost)

    # -- resizes -----------------------------------------------------------------------------------------------

    def add_pair(self, shards: list[str]) -> str:
        """Starts the next shard for a resize that adds it to the job's `shards` (their addresses, as the resize
        names them), and its backup; its address, once it serves (a RuntimeError if it does not start)."""
        from torchps.checkpoint_folder import journal_dir
        from torchps.worker.launch_replicas import ReplicaPlan
        from torchps.worker.local_cluster import START_TIMEOUT_SECONDS

        index, self._added = len(self.hosts), self._added + 1
        folder = self.dir / f"added{self._added}"
        folder.mkdir()
        plan = ReplicaPlan.pick(folder, 1)
        address, backup_address = plan.primaries[0], plan.backups[0]
        spec = json.dumps({"ps": [*shards, address]})
        journal = pathlib.Path(f"{journal_dir(self.ckpt, index)}-added{self._added}")
        primary = Host(index, 0, address, address,
                       ["--index", str(index), "--cluster", spec, "--bind", address, "--journal-dir", str(journal),
                        "--port-file", str(folder / "ps.port"), *self.flags], journal, folder / "ps.log")
        backup = Host(index, 1, backup_address, backup_address,
                      ["--index", str(index), "--cluster", spec, "--replica-of", address, "--bind", backup_address,
                       "--journal-dir", f"{journal}-backup", *self.flags], pathlib.Path(f"{journal}-backup"),
                      folder / "backup.log")
        restart_argv, primary.argv = [*primary.argv, "--replicated"], [*primary.argv, "--join"]  # empty once only
        self._spawn(primary)
        primary.argv = restart_argv
        self.hosts.append((primary, backup))
        self.specs.append(spec)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not (folder / "ps.port").exists():
            if primary.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ps {index}, added, did not start: {primary.tail()}")
            time.sleep(POLL_SECONDS)
        self._spawn(backup)
        return address

    def set_job(self, shards: list[str]) -> None:
        """The job's shards are `shards` now (a resize succeeded): each host started again from now on is given
        them as its cluster spec, as an operator would after `ps-admin resize` (one given the spec from before
        a resize refuses its journal, which is of the job since: journal.Layout)."""
        spec = json.dumps({"ps": list(shards)})
        self.specs = [spec] * len(self.hosts)
        for host in (host for pair in self.hosts for host in pair):
            host.argv[host.argv.index("--cluster") + 1] = spec

    def remove_pair(self, failures: list[str], stop: bool = False) -> None:
        """Forgets the job's last shard, which a resize removed: the process serving it was stopped by the resize,
        and its other one must exit by itself; each must exit with code 0 within REMOVED_SECONDS (a failure
        otherwise, and it is killed). `stop`: past the shards a failed resize left, both are stopped (SIGTERM)."""
        pair = self.hosts.pop()
        self.specs.pop()
        for host in pair:
            if stop and host.proc.poll() is None:
                host.proc.terminate()
            try:
                code = host.proc.wait(timeout=REMOVED_SECONDS)
            except subprocess.TimeoutExpired:
                failures.append(f"{host.name}, of the shard a resize removed, still ran {REMOVED_SECONDS:g} s "
                                f"after it: {host.tail()}")
                host.proc.kill()
                host.proc.wait()
                continue
            if code != 0:
                failures.append(f"{host.name}, of the shard a resize removed, exited with code {code}: {host.tail()}")


# -- the fault kinds --------------------------------------------------------------------------------------------

def _target(phase) -> tuple[Host, Host, int] | None:
    """(primary, backup in sync, the primary's generation) of a shard drawn at random; None if its backup is not
    in sync in time or its primary does not answer (the kind waits for later in the round)."""
    pair = phase.shards.in_sync(phase.rng.randrange(phase.shards.num_shards))
    generation = phase.shards.generation(pair[0]) if pair is not None else None
    return None if generation is None else (*pair, generation)


def _strike(phase, kind: str, sig: int) -> tuple[Host, Host] | None:
    """Sends `sig` to the primary of a shard drawn at random (_target; else None), records the strike and waits
    for its arbiter to promote the backup; (primary, backup). host-lost deletes the killed primary's journal
    folder with it."""
    found = _target(phase)
    if found is None:
        return None
    primary, backup, generation = found
    primary.proc.send_signal(sig)
    at = time.monotonic()
    if sig == signal.SIGKILL:
        primary.proc.wait()
        if kind == "host-lost":
            shutil.rmtree(primary.folder, ignore_errors=True)
    _failed_over(phase, kind, primary, backup, generation, at)
    return primary, backup


def _failed_over(phase, kind: str, primary: Host, backup: Host, generation: int, at: float) -> None:
    """Records the strike of `primary` at `at`, and waits for its arbiter to promote `backup` (the strike's
    promoted_s: from `at` to the arbiter's grant)."""
    strike = Strike(kind, primary.index, at, generation, at_unix=time.time() - (time.monotonic() - at))
    phase.shards.strikes.append(strike)
    granted = phase.shards.promoted(primary.index, backup)
    if granted is None:
        phase.failures.append(f"{kind}: ps {primary.index}'s backup was not promoted within {FAILOVER_SECONDS:g} s")
    elif granted >= strike.at_unix:  # (a grant before the strike would be an earlier failover's)
        strike.promoted_s = round(granted - strike.at_unix, 3)


def kill_shard(phase) -> bool:
    """SIGKILLs a shard's primary and, once its backup took over, starts it again (it becomes the backup)."""
    struck = _strike(phase, "kill-shard", signal.SIGKILL)
    if struck is not None:
        phase.shards.restart(struck[0], phase.failures)
    return struck is not None


def host_lost(phase) -> bool:
    """SIGKILLs a shard's primary and deletes its journal folder; a fresh backup of the promoted one takes its
    address."""
    struck = _strike(phase, "host-lost", signal.SIGKILL)
    if struck is not None:
        phase.shards.replace(*struck)
    return struck is not None


def backup_lost(phase) -> bool:
    """SIGKILLs a shard's backup in sync and starts it again with its command (it follows its primary anew)."""
    pair = phase.shards.in_sync(phase.rng.randrange(phase.shards.num_shards))
    if pair is None:
        return False
    backup = pair[1]
    backup.proc.kill()
    backup.proc.wait()
    phase.shards.restart(backup, phase.failures)
    return True


def partition_primary(phase) -> bool:
    """SIGSTOPs a shard's primary until its backup is promoted, then SIGCONTs it: it must stop by itself, fenced
    (exit 70); it is started again with its command (it becomes the backup)."""
    from torchps.ps_server.failstop import EXIT_CODE

    struck = _strike(phase, "partition-primary", signal.SIGSTOP)
    if struck is None:
        return False
    primary = struck[0]
    primary.proc.send_signal(signal.SIGCONT)
    code = phase.await_exit(primary.proc, FENCE_SECONDS, f"ps {primary.index}'s old primary, resumed after its "
                                                         f"backup took over, went on {FENCE_SECONDS:g} s")
    if code == EXIT_CODE:
        phase.shards.fenced += 1
    elif code is not None:
        phase.failures.append(f"ps {primary.index}'s old primary, resumed after its backup took over, ended with code "
                              f"{code}, not {EXIT_CODE} (fenced): {primary.tail()}")
    phase.shards.restart(primary, phase.failures)
    return True


def pause_shard(phase) -> bool:
    """SIGSTOPs a shard's backup for 0.5-3 s, then SIGCONTs it."""
    index = phase.rng.randrange(phase.shards.num_shards)
    primary = phase.shards.primary(index)
    if primary is None:
        return False
    phase.pause(phase.shards.hosts[index][1 - primary.seat].proc, phase.rng.uniform(0.5, 3.0))
    return True


def backup_disk_full(phase) -> bool:
    """Lets a shard's backup's files grow past its log plus 1 MiB no further for 0.5-3 s (its soft file-size
    limit, raised back to its hard one after); a backup that ended meanwhile is a failure (it must follow anew)."""
    index = phase.rng.randrange(phase.shards.num_shards)
    primary = phase.shards.primary(index)
    if primary is None:
        return False
    backup = phase.shards.hosts[index][1 - primary.seat]
    hard = resource.prlimit(backup.proc.pid, resource.RLIMIT_FSIZE)[1]
    resource.prlimit(backup.proc.pid, resource.RLIMIT_FSIZE, (backup.log.stat().st_size + (1 << 20), hard))
    time.sleep(phase.rng.uniform(0.5, 3.0))
    try:
        resource.prlimit(backup.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
    except ProcessLookupError:
        pass
    if backup.proc.poll() is not None:
        phase.failures.append(f"{backup.name}, a backup whose disk was full, ended with code {backup.proc.poll()} "
                              f"instead of following its primary anew: {backup.tail()}")
        phase.check_shards()  # started again
    return True


def disk_full(phase) -> bool:
    """Fills a shard's primary's disk: it stops itself (a fail-stop, counted and started again by the phase's
    check of its shards, once its backup took over)."""
    found = _target(phase)
    if found is None:
        return False
    primary, backup, generation = found
    if phase.fill_disk(primary.proc, primary.log, primary.name) is None:  # a hang: it was killed
        phase.shards.restart(primary, phase.failures)
        return True
    _failed_over(phase, "disk-full", primary, backup, generation, time.monotonic())
    phase.check_shards()
    return True


REPLICA_FAULTS: dict[str, Callable[[object], bool]] = {
    "kill-shard": kill_shard,
    "pause-shard": pause_shard,
    "disk-full": disk_full,
    "host-lost": host_lost,
    "backup-lost": backup_lost,
    "backup-disk-full": backup_disk_full,
    "partition-primary": partition_primary,
}


# -- the failover times ----------------------------------------------------------------------------------------

def generations(field: str) -> dict[int, int]:
    """An "acked" line's g= field ("g=0:1f,1:a0"): each shard's generation in its reply."""
    pairs = (item.split(":") for item in field[2:].split(",") if item)
    return {int(shard): int(generation, 16) for shard, generation in pairs}


def failover_figures(strikes: list[Strike], acks: list[tuple[float, dict[int, int]]], started: float) -> dict:
    """Each strike's failover (the module docstring) from `acks` (time, generations by shard; sorted by time):
    `failovers` (kind, shard, at: seconds since `started`, failover_s or None, promoted_s: from the strike to
    its arbiter's grant, or None), `failover_p99_s`, `promotion_p99_s`, `failovers_unserved`."""
    for strike in strikes:
        strike.failover_s = next((round(t - strike.at, 3) for t, gens in acks if t > strike.at and strike.index
                                  in gens and gens[strike.index] != strike.generation), None)
    served = [s.failover_s for s in strikes if s.failover_s is not None]
    return {"failovers": [{"kind": s.kind, "shard": s.index, "at": round(s.at - started, 2),
                           "failover_s": s.failover_s, "promoted_s": s.promoted_s} for s in strikes],
            "failover_p99_s": percentile(served, 99),
            "promotion_p99_s": percentile([s.promoted_s for s in strikes if s.promoted_s is not None], 99),
            "failovers_unserved": len(strikes) - len(served)}

