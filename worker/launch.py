"""`ps-launch`: a whole torchps cluster on this machine, one command.

    ps-launch                                   # the README demo: 2 ps, 2 workers, MLP, Fashion-MNIST
    ps-launch --ps 1 --workers 3 --mode sync --epochs 5 --metrics-out out.json

Starts `--ps` ps-servers on 127.0.0.1 with free ports, then the chief
(worker 0, or a separate chief with --chief), the other workers and, with
--evaluator, an evaluator, each a separate process whose log lines are
prefixed with its role. ps-worker's flags are accepted and passed to every
worker (checked first, before torch is imported: a bad flag or value stops
ps-launch before anything starts). Secure by default: a throw-away CA, a
certificate per task and the tokens are made in memory for the job, the CA's
key kept in memory only (never written, to sign the certificates of workers
added later), and each task's files go to a folder of its own (jobfolder.py)
removed with the job (--credentials DIR: a folder ps-certs made instead;
--tokens-only: tokens without TLS; --insecure: plaintext, no tokens).

Workers come and go while the job runs: `ps-launch scale --job-dir DIR
--workers N` (control.py; DIR is the job folder the launcher prints) starts
new workers, each under a new name with credentials of its own, or stops the
newest ones (SIGTERM: each leaves the job, its data shard going back to the
queue with --dynamic-sharding). At most --max-workers names ever join.

With --dense allreduce the chief's cluster entry gets a port free when the
job starts (the all-reduce group meets there, unless --allreduce-port says
otherwise), and a worker lost stops the others (the group cannot go on).

A worker that dies does not stop the others; the chief failing, a shard
failing (unless --restart-on-failure brings it back), the end of training,
Ctrl-C, SIGTERM or SIGHUP stops everything, and every child also dies with
the launcher if it is killed (the parent-death signal), or with the fork
server they were forked from (its death is named; --restart-on-failure
restarts them from a new one). Once the chief has ended the job nothing is
restarted. The exit code is 0, 1 if a process failed and was not restarted
(its last lines are shown), 2 for a usage error (one line, nothing started;
or a shard refusing its configuration), 3 if the chief ended the job with
part of its planned data not trained (the line before the last says what;
ps-worker --allow-partial makes it 0; where only workers failed, the chief's
account of the data is the job's outcome: its code, 0 or 3), 74 if a process died for want of room
to write (a full disk, a file-size limit: one line names the path; nothing is
restarted into it), 130 if interrupted. --restart-on-failure waits before each
restart, doubling from 1 s (restarts.py). What a failed process's log shows is
its last traceback, warnings and errors, and final lines (lastlines.py). A
launcher killed with SIGKILL leaves its job folder; the next ps-launch removes
it, in one line (jobfolder.py).

With --replicas 2 every shard gets a backup (ps-server --replica-of), at addresses picked and kept before
anything starts (launch_replicas.py): one of a shard's two processes dying while the other runs does not
stop the job, and --restart-on-failure restarts it with its own command.

With --checkpoint-dir, a job that ends well is noted in the folder
(job-finished.json); run again on that folder, ps-launch says so in one line
and exits 0 instead of resuming a job that has ended, unless --steps asks
for more global steps than it reached. The folder is one job's: a second
ps-launch on it is refused at once, naming the first (torchps/checkpoint_folder.py);
--replace-journal moves its journals aside so the job starts from its newest
committed checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import typing

from ..certs import issue_job_credentials, read_job_credentials
from ..checkpoint_folder import hold_launch, move_journals_aside
from ..cli import INTERRUPTED, PARTIAL_JOB, USAGE_ERROR, ArgumentParser, grpc_log_env
from ..cluster import Cluster, TaskSpec
from ..errors import ClusterConfigError
from ..forkserver import ForkedChild, ProcessStarter, run_main
from ..security import ENV
from .datasets import DatasetNotFoundError, default_dataset_name
from .flags import (DEFAULT_PARTITION, add_training_flags, check_entry, check_output, check_specs,
                    finish_training_flags)
from .control import ControlServer, scale_main
from .jobfolder import JobFolder, remove_dead_folders
from .lastlines import LastLines, death
from .launch_replicas import BackupTask, ReplicaPlan, check_folder, served_on
from .local_cluster import SHARD_MODULE, local_shard_threads
from .restarts import backoff, no_room

__all__ = ["main", "Launcher"]

START_TIMEOUT_SECONDS = 60.0
STOP_GRACE_SECONDS = 10.0
WORKER_MODULE = "torchps.worker.__main__"
MAX_RESTARTS = 3  # per task, with --restart-on-failure, each after a backoff (restarts.py)
NO_ROOM = 74      # exit code (EX_IOERR, sysexits.h): a process died for want of room to write (restarts.py)
DEFAULT_CHECKPOINT_STEPS = 100  # with --checkpoint-dir and no --checkpoint-every-* flag
FINISHED_FILE = "job-finished.json"  # in --checkpoint-dir: the summary of a job that ended well
SHARDS_MEMORY_PERCENT = 50  # of the machine's memory, split among the shards: the workers need the rest
DEFAULT_MAX_WORKERS = 16    # worker names a job may ever have (ps-launch scale), unless --workers is more


class StartError(Exception):
    """A ps-server exited, or never reported its port, while starting."""

    def __init__(self, proc: "Proc"):
        super().__init__(f"{proc.name} did not start (exit {proc.popen.poll()})")
        self.proc = proc


@dataclasses.dataclass
class Proc:
    """One child process, its role, its output, and the lines of it that explain its end (lastlines.py)."""

    task: TaskSpec
    popen: subprocess.Popen | ForkedChild
    output: typing.TextIO
    tail: LastLines = dataclasses.field(default_factory=LastLines)
    reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        return str(self.task)


def job_tasks(num_ps: int, workers: int, chief: bool, evaluator: bool) -> Cluster:
    """The job's tasks, on placeholder addresses: certificates name tasks, not ports, so they can be made or
    checked before any port is known."""
    return Cluster(ps=tuple(f"127.0.0.1:{i + 1}" for i in range(num_ps)), chief=("127.0.0.1:0",) if chief else (),
                   worker=tuple(f"127.0.0.1:{100 + i}" for i in range(workers)),
                   evaluator=("127.0.0.1:99",) if evaluator else ())


class Launcher:
    """Starts, watches and stops the processes of a local cluster.

    Credentials: a throw-away set made for the job (`secure`), or the folder
    ps-certs wrote (`credentials`), or none; with `tls` False only the tokens
    are used.
    """

    def __init__(self, *, num_ps: int, workers: int, chief: bool, evaluator: bool, worker_args: list[str],
                 metrics_out: pathlib.Path | None, ps_args: list[str] = (), restart_on_failure: bool = False,
                 secure: bool = True, tls: bool = True, credentials: str | os.PathLike | None = None,
                 out=sys.stdout, rendezvous_port: bool = False, log_level: str = "INFO",
                 max_workers: int | None = None, allreduce: bool = False, replicas: ReplicaPlan | None = None):
        self.num_ps, self.workers, self.chief, self.evaluator = num_ps, workers, chief, evaluator
        self.replicas = replicas  # --replicas 2: a backup per shard (launch_replicas.py)
        self.max_workers = max(workers, DEFAULT_MAX_WORKERS) if max_workers is None else max_workers
        self.worker_indices = list(range(workers))  # every worker started, added ones too
        self.removed: set[TaskSpec] = set()         # workers ps-launch scale stopped: they left for good
        self.control: ControlServer | None = None
        self.allreduce = allreduce  # --dense allreduce: the group's members are fixed when it forms
        self.worker_args = worker_args + (["--keep-ps"] if evaluator else [])  # the evaluator sees the end too
        self.ps_args = [*ps_args, "--log-level", log_level]
        self.log_level = log_level
        self.restart_on_failure = restart_on_failure
        self.rendezvous_port = rendezvous_port  # --dense allreduce: the chief's entry gets a port free now
        self.restarts: collections.Counter[TaskSpec] = collections.Counter()
        self.ports: list[int] = []
        self.metrics_out = metrics_out
        self.out = out
        self.procs: dict[TaskSpec, Proc] = {}
        # Every child forked from one warm interpreter, started with the gRPC log settings the children get.
        self.starter = ProcessStarter(env={**os.environ, **grpc_log_env(self.log_level, os.environ)})
        self._print_lock = threading.Lock()
        self.cluster: Cluster | None = None
        self.summary: dict | None = None  # the chief's final summary line, parsed
        tasks = job_tasks(num_ps, workers, chief, evaluator)
        # The user's folder is only read. Made here, the credentials live in memory (the CA's key too, never
        # written: it signs the certificates of workers added later) and each task's files in its own subfolder
        # of the job's folder, which close() removes.
        user_files = read_job_credentials(credentials, tasks) if credentials is not None else None
        issued = issue_job_credentials(tasks, days=1, keep_ca_key=True) if credentials is None and secure else None
        if left := remove_dead_folders():  # launchers killed with SIGKILL could not remove theirs (jobfolder.py)
            self.say(f"[launch] removed {len(left)} job folder{'s' * (len(left) > 1)} of ps-launch processes no longer "
                     f"running, with their keys and tokens: {'; '.join(left)}")
        self.folder = JobFolder(credentials=issued, user_files=user_files, tls=tls, user_dir=credentials)
        self._starter_log = _SayLog(self.say)  # the starter's one line when it starts a new fork server
        logging.getLogger(ProcessStarter.__module__).addHandler(self._starter_log)

    def say(self, line: str) -> None:
        with self._print_lock:
            print(line, file=self.out, flush=True)

    def _spawn(self, task: TaskSpec, module: str, argv: list[str]) -> Proc:
        env = {k: v for k, v in os.environ.items() if k not in ENV.values()}
        env.update(self.folder.credential_env(TaskSpec(task.type, task.index)))  # its own files (a backup: its shard's)
        env.update(grpc_log_env(self.log_level, env))
        # A session of its own: a terminal's Ctrl-C reaches the launcher alone, which stops workers before
        # shards. Should the launcher die without stopping them, the kernel kills them all (the parent-death
        # signal is SIGKILL: a shard that had to be stopped cleanly could hang, and its journal keeps what it
        # acknowledged; a worker must not save against shards that are going). Children are forked from the
        # fork server, which ends with the launcher, and die with it.
        read_end, write_end = os.pipe()
        try:
            popen = self.starter.start(module, argv, prog="ps-worker" if module == WORKER_MODULE else "ps-server", env={**env, "PYTHONUNBUFFERED": "1"}, stdout=write_end,
                                       new_session=True, parent_death_signal=signal.SIGKILL)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        proc = Proc(task, popen, open(read_end, encoding="utf-8", errors="replace"))  # noqa: SIM115
        proc.reader = threading.Thread(target=self._relay, args=(proc,), daemon=True)
        proc.reader.start()
        self.procs[task] = proc
        return proc

    def _relay(self, proc: Proc) -> None:
        with proc.output:
            self._relay_lines(proc)

    def _relay_lines(self, proc: Proc) -> None:
        for line in proc.output:
            line = line.rstrip("\n")
            proc.tail.append(line)
            if line.startswith("summary {") and proc.task == self.cluster.chief_task:
                self.summary = json.loads(line.removeprefix("summary "))
            self.say(f"[{proc.name}] {line}")

    def start_ps(self) -> Cluster:
        """Starts the ps-servers on free ports (with --replicas 2, their backups too) and builds the cluster
        naming them."""
        self.ports = self._start_replicated() if self.replicas is not None else self._start_shards()
        # Workers serve nothing; TF_CONFIG still names an address for each, so give distinct unused ones.
        taken = set(self.ports) | (self.replicas.ports() if self.replicas is not None else set())
        spare = (p for p in range(20000, 65535) if p not in taken)
        chief = [f"127.0.0.1:{next(spare)}" for _ in range(int(self.chief))]
        worker = [f"127.0.0.1:{next(spare)}" for _ in range(self.workers)]
        evaluator = [f"127.0.0.1:{next(spare)}" for _ in range(int(self.evaluator))]
        if self.rendezvous_port:  # the chief listens there for the all-reduce group: a port nothing holds now
            taken |= {int(a.rpartition(":")[2]) for a in chief + worker + evaluator}
            (chief or worker)[0] = f"127.0.0.1:{_free_port(taken)}"
        self.cluster = Cluster(ps=tuple(f"127.0.0.1:{p}" for p in self.ports), chief=tuple(chief),
                               worker=tuple(worker), evaluator=tuple(evaluator))
        return self.cluster

    def _start_shards(self) -> list[int]:
        """Starts every shard and returns their ports once each serves; StartError for one that did not start."""
        for index in range(self.num_ps):
            self._spawn_ps(index, 0)
        return [self._wait_port(index) for index in range(self.num_ps)]

    def _start_replicated(self) -> list[int]:
        """The shards at the plan's addresses, then a backup each (launch_replicas.py); the shards once more on
        new ports if an address was taken since it was picked."""
        try:
            ports = self._start_shards()
        except StartError as exc:
            if (taken := self.replicas.bind_failed(exc.proc)) is None:
                raise
            self.say(taken[0])
            if not taken[1]:
                raise
            self.stop()
            self.replicas = ReplicaPlan.pick(self.replicas.folder, self.num_ps)
            ports = self._start_shards()
        for index in range(self.num_ps):
            self._spawn_backup(index)
        self.say(f"[launch] {self.replicas.describe()}")
        return ports

    def _spawn_backup(self, index: int) -> Proc:
        return self._spawn(BackupTask("ps", index), SHARD_MODULE,
                           [*self.replicas.backup_flags(index), *self._insecure(), *self.ps_args])

    def _port_file(self, index: int) -> pathlib.Path:
        return self.folder.port_file(index)

    def _insecure(self) -> list[str]:
        return [] if self.folder.secure else ["--insecure"]

    def _spawn_ps(self, index: int, port: int) -> Proc:
        self._port_file(index).unlink(missing_ok=True)
        where = self.replicas.shard_flags(index) if self.replicas is not None else [
            "--num-ps", str(self.num_ps), "--bind", f"127.0.0.1:{port}"]
        return self._spawn(TaskSpec("ps", index), SHARD_MODULE, [
            "--index", str(index), *where, *self._insecure(), "--port-file", str(self._port_file(index)),
            *self.ps_args])

    def _wait_port(self, index: int) -> int:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        proc = self.procs[TaskSpec("ps", index)]
        while not self._port_file(index).exists():
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                if proc.popen.poll() is None:
                    proc.popen.kill()
                proc.popen.wait()
                proc.reader.join(timeout=5)  # every line it printed is in its tail
                raise StartError(proc)
            time.sleep(0.05)
        return int(self._port_file(index).read_text())

    def training_tasks(self) -> list[TaskSpec]:
        """The chief and every worker started and not removed (ps-launch scale)."""
        tasks = [TaskSpec("chief", 0)] if self.chief else []
        return tasks + [t for t in (TaskSpec("worker", i) for i in self.worker_indices) if t not in self.removed]

    def start_task(self, task: TaskSpec) -> Proc:
        argv = ["--cluster", json.dumps(self.cluster.to_dict()), "--task-type", task.type, "--index", str(task.index),
                *self.worker_args, *self._insecure()]
        if task == self.cluster.chief_task and self.metrics_out:
            argv += ["--metrics-out", str(self.metrics_out)]
        return self._spawn(task, WORKER_MODULE, argv)

    def run(self) -> int:
        """Runs the job to the end; returns the exit code. Always stops every process."""
        try:
            try:
                self.start_ps()
            except StartError as exc:  # a shard refusing its flags (exit 2) is the user's configuration
                self._show_tail(exc.proc)
                if (room := self._no_room(exc.proc)) is not None:
                    self.say(f"[launch] {exc.proc.name} did not start: {room}")
                    return NO_ROOM
                return USAGE_ERROR if exc.proc.popen.returncode == USAGE_ERROR else 1
            self.say(f"[launch] cluster: {json.dumps(self.cluster.to_dict())}")
            self.control = ControlServer(self.folder.path)
            self.say(f"[launch] job folder {self.folder.path}: ps-launch scale --job-dir {self.folder.path} "
                     "--workers N adds or removes workers")
            for task in self.training_tasks():
                self.start_task(task)
            if self.evaluator:
                self.start_task(TaskSpec("evaluator", 0))
            return self._watch()
        except KeyboardInterrupt:
            self.say("[launch] interrupted: stopping every process")
            return INTERRUPTED
        finally:
            self.close()

    def close(self) -> None:
        """Stops every process, then the fork server, and removes the job's private folder (its credentials
        with it)."""
        try:
            if self.control is not None:
                self.control.close()
            self.stop()
            self.starter.close()
        finally:
            logging.getLogger(ProcessStarter.__module__).removeHandler(self._starter_log)
            self.folder.remove()

    def _show_tail(self, proc: Proc) -> None:
        code = proc.popen.returncode
        self.say(f"[launch] {proc.name} failed (exit {code}{f', {death(code)}' if death(code) else ''}); its last lines:")
        for line in proc.tail.shown():
            self.say(f"[launch]   | {line}")

    def _no_room(self, proc: Proc) -> str | None:
        """What the launcher says of `proc`, dead, if its log says a write failed for want of room (restarts.py):
        why, and what to do; None otherwise (or if a signal ended it)."""
        if proc.popen.returncode is None or proc.popen.returncode < 0:
            return None
        if proc.reader is not None:
            proc.reader.join(timeout=5)  # the lines it printed as it died are in its tail
        flags = self.ps_args
        folder = flags[flags.index("--checkpoint-dir") + 1] if "--checkpoint-dir" in flags else None
        room = no_room(proc.tail.shown(), pathlib.Path(folder if folder and proc.task.type == "ps" else "."))
        if room is None:
            return None
        return (f"{room.cause}; stopping the job: restarting it would meet the same {room.wall}. {room.remedy} and run "
                "ps-launch again" + (" (with the same --checkpoint-dir, the shards go on from their journals)"
                                     if folder else ""))

    def _watch(self) -> int:
        chief = self.cluster.chief_task
        failed: dict[TaskSpec, Proc] = {}  # failed while the job ran, and not restarted
        seen: set[TaskSpec] = set()         # exits already dealt with
        stopping = False                    # the chief or a shard failed: the job cannot go on
        ended_at = None                     # when the chief was seen to have ended the job (exit code 0 or 3)
        pending: dict[TaskSpec, float] = {}  # restarts waiting out their backoff: when each is due (monotonic)
        out_of_room = False                 # a process died for want of room to write: the job stopped
        while True:
            if ended_at is None and self.procs[chief].popen.poll() in (0, PARTIAL_JOB):
                ended_at = time.monotonic()
            self.control.serve_pending(lambda body: self._control_request(body, over=ended_at is not None or stopping))
            restarted = self._restart_due(pending, seen, over=ended_at is not None)
            training = self.training_tasks()
            for task, proc in list(self.procs.items()):
                code = proc.popen.poll()
                if code in (None, 0) or (task == chief and code == PARTIAL_JOB) or task in seen or \
                        task in self.removed:
                    continue
                seen.add(task)
                ended = _ended(proc, code)
                if ended_at is not None:  # the job is over: nothing is restarted against it, nothing fails it
                    if task.type != "ps":
                        self.say(f"[launch] {task} {ended} after the chief ended the job")
                    continue
                room = self._no_room(proc)
                served = served_on(self, task) if room is None else ""  # its shard's other process serves on
                if room is None and self.restart_on_failure and self.restarts[task] < MAX_RESTARTS:
                    self.restarts[task] += 1
                    delay = backoff(self.restarts[task])
                    self.say(f"[launch] {task} {ended}{served}; restarting it in {delay:g} s ({self.restarts[task]} "
                             f"of {MAX_RESTARTS})")
                    pending[task] = time.monotonic() + delay
                    continue
                if served:  # no failure of the job: its shard is served
                    self.say(f"[launch] {task} {ended}{served}; --restart-on-failure restarts one")
                    continue
                failed[task] = proc
                if room is not None:  # a restart would meet the same wall at once
                    self.say(f"[launch] {task} {ended}: {room}")
                    out_of_room = stopping = True
                    break
                if task == chief:  # nobody else creates, checkpoints or ends the job
                    self.say(f"[launch] {task} (the chief) {ended}: stopping the job")
                    stopping = True
                    break
                if task.type == "ps":  # its variables are nowhere else: no step can be taken without it
                    why = "it did not come back" if self.restart_on_failure else "--restart-on-failure restarts one"
                    self.say(f"[launch] {task} {ended}; the job cannot go on without it ({why}): "
                             "stopping the job")
                    stopping = True
                    break
                self.say(f"[launch] {task} {ended}; the others go on")
            if stopping or (not restarted and not pending and
                            all(self.procs[t].popen.poll() is not None for t in training)):
                break
            if ended_at is not None and time.monotonic() - ended_at > STOP_GRACE_SECONDS:
                for task in training:  # never joined, or stuck: it has no job to take part in any more
                    if self.procs[task].popen.poll() is None:
                        self.say(f"[launch] {task} still runs {STOP_GRACE_SECONDS:g} s after the chief ended the job: "
                                 "stopping it")
                break
            time.sleep(0.2)
        if self.evaluator and not stopping:  # it ends by itself once the workers are gone; else SIGTERM
            # makes it evaluate once more and report (the shards stay up: the chief runs with --keep-ps)
            evaluator = self.procs[TaskSpec("evaluator", 0)]
            self._wait(evaluator, STOP_GRACE_SECONDS)
            if evaluator.popen.poll() is None:
                evaluator.popen.send_signal(signal.SIGTERM)
                self._wait(evaluator, STOP_GRACE_SECONDS)
        if stopping:
            self.stop()
        elif ended_at is None:  # exits the loop's last pass did not see
            failed.update({p.task: p for p in self.procs.values() if p.task.type != "ps" and p.task not in seen
                           and p.task not in self.removed and p.popen.poll() not in (None, 0)})
        for proc in failed.values():
            self._show_tail(proc)
        if out_of_room:
            return NO_ROOM
        chief_code = self.procs[chief].popen.poll()
        if failed and ended_at is not None and all(task.type == "worker" for task in failed):
            return chief_code  # the chief ended the job, its account stating what the lost workers left untrained
        return 1 if failed else PARTIAL_JOB if chief_code == PARTIAL_JOB else 0

    def _control_request(self, body: dict, *, over: bool) -> dict:
        """The answer to a control request (control.py): {"workers": N} scales the workers to N."""
        workers = body.get("workers")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            return {"error": f"workers must be a number >= 0. Received: {workers!r}"}
        if over:
            return {"error": "the job is ending: no worker is added or removed any more"}
        if self.allreduce:
            return {"error": "a --dense allreduce job's group is fixed when it forms: its workers cannot change"}
        try:
            added, removed = self.scale(workers)
        except ClusterConfigError as exc:
            return {"error": " ".join(str(exc).split())}
        return {"workers": workers, "added": [str(t) for t in added], "removed": [str(t) for t in removed]}

    def scale(self, workers: int) -> tuple[list[TaskSpec], list[TaskSpec]]:
        """Runs `workers` workers from now on (the chief counted when it is worker 0): starts new ones, each
        under a new name, or stops the newest (SIGTERM: they leave the job; SIGKILL after STOP_GRACE_SECONDS);
        returns (added, removed) once started or exited. ClusterConfigError (nothing changed) past
        --max-workers, for removing the chief, or for missing credentials of the user's folder."""
        running = [t for t in self.training_tasks() if t.type == "worker" and self.procs[t].popen.poll() is None]
        if workers > len(running):
            wanted = [TaskSpec("worker", i) for i in range(len(self.worker_indices),
                                                           len(self.worker_indices) + workers - len(running))]
            if wanted[-1].index >= self.max_workers:
                raise ClusterConfigError(f"{wanted[-1]} would be past --max-workers {self.max_workers} (the worker "
                                         "names the shards admit over the job's life, removed ones included)")
            for task in wanted:
                self.folder.add_task(task)  # credentials first: a refusal changes nothing
            for task in wanted:
                taken = {int(a.rpartition(":")[2]) for _, a in self.cluster.tasks()}
                self.cluster = dataclasses.replace(
                    self.cluster, worker=(*self.cluster.worker, f"127.0.0.1:{_free_port(taken)}"))
                self.worker_indices.append(task.index)
                self.start_task(task)
                self.say(f"[launch] {task} added: it joins the running job")
            return wanted, []
        leaving = sorted((t for t in running if t != self.cluster.chief_task), key=lambda t: -t.index)
        leaving = leaving[:len(running) - workers]
        if len(running) - workers > len(leaving):
            raise ClusterConfigError(f"{self.cluster.chief_task} is the chief (it creates, checkpoints and ends the "
                                     f"job): at least 1 worker runs")
        for task in leaving:
            self.removed.add(task)
            self.procs[task].popen.send_signal(signal.SIGTERM)  # it leaves the job (PSClient.close)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for task in leaving:
            proc = self.procs[task]
            self._wait(proc, max(0.0, deadline - time.monotonic()))
            if proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()
            self.say(f"[launch] {task} removed (exit code {proc.popen.returncode}): it left the job")
        return [], leaving

    def _restart_due(self, pending: dict[TaskSpec, float], seen: set[TaskSpec], *, over: bool) -> bool:
        """Restarts each task of `pending` whose backoff has passed (none once the job is `over`: they are
        dropped); True if it restarted any. Its next exit is dealt with afresh (taken out of `seen`)."""
        if over:
            pending.clear()
        due = [task for task, when in pending.items() if when <= time.monotonic()]
        for task in due:
            del pending[task]
            seen.discard(task)
            self._restart(task)
        return bool(due)

    def _restart(self, task: TaskSpec) -> None:
        """Starts `task` again (a ps on its old port), forked from a new fork server if the last one died. If it
        would not come up, says so: its exit is then dealt with as any other. With --replicas 2, a shard's
        process starts with its own command and is not waited for (it may come back as its shard's backup,
        which serves nothing)."""
        try:
            if isinstance(task, BackupTask):
                self._spawn_backup(task.index)
            elif task.type == "ps" and self.replicas is not None:
                self._spawn_ps(task.index, self.ports[task.index])
            elif task.type == "ps":
                self._spawn_ps(task.index, self.ports[task.index])
                self._wait_port(task.index)
            else:
                self.start_task(task)
        except (StartError, OSError) as exc:  # OSError: no process could be started
            self.say(f"[launch] {task} did not come back: {exc}")

    @staticmethod
    def _wait(proc: Proc, timeout: float) -> None:
        try:
            proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        """Stops every live process: workers and evaluator first (they leave the job while the shards
        still answer), then the shards; SIGTERM, then SIGKILL after a grace period. None is left behind."""
        for group in ([p for p in self.procs.values() if p.task.type != "ps"],
                      [p for p in self.procs.values() if p.task.type == "ps"]):
            for proc in group:
                if proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            for proc in group:
                self._wait(proc, max(0.0, deadline - time.monotonic()))
                if proc.popen.poll() is None:
                    proc.popen.kill()
                    proc.popen.wait()
                if proc.reader is not None:
                    proc.reader.join(timeout=5)


def _ended(proc: Proc, code: int) -> str:
    """'exited with code C', and what ended it when that was the fork server's death (it takes with it
    the children asked to die with their parent, as the launcher's are)."""
    cause = proc.popen.server_death if isinstance(proc.popen, ForkedChild) else None
    return f"exited with code {code}" + (f" ({cause})" if cause else "")


class _SayLog(logging.Handler):
    """Log records as the launcher's own lines, "[launch] MESSAGE"."""

    def __init__(self, say: typing.Callable[[str], None]):
        super().__init__()
        self._say = say

    def emit(self, record: logging.LogRecord) -> None:
        self._say(f"[launch] {record.getMessage()}")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(every flag's value, the ps-worker flags to pass on); a usage error (exit 2, one line) for any other
    flag, a bad value or a combination that cannot work, before anything starts. What needs no torch is
    checked before torch is imported (--init-from, --compression and --partition need it)."""
    own = argparse.ArgumentParser(add_help=False)
    g = own.add_argument_group("the cluster")
    g.add_argument("--ps", type=int, default=2, help="ps-servers (default: %(default)s)")
    g.add_argument("--workers", type=int, default=2, help="training workers (default: %(default)s)")
    g.add_argument("--chief", action="store_true", help="add a separate chief task (else worker 0 is chief)")
    g.add_argument("--evaluator", action="store_true", help="add an evaluator task")
    g.add_argument("--metrics-out", type=pathlib.Path, help="the chief's summary JSON goes here")
    g.add_argument("--checkpoint-dir", help="the ps-servers save checkpoints here and keep their journals under "
                   "it (and recover from them when restarted); the chief saves every "
                   f"{DEFAULT_CHECKPOINT_STEPS} steps unless --checkpoint-every-* says otherwise, and at the end")
    g.add_argument("--restore-from", help="start the ps-servers from the newest committed checkpoint in this "
                   "folder, whatever number of shards wrote it")
    g.add_argument("--replace-journal", action="store_true", help="move the shards' journals under --checkpoint-dir "
                   "aside (renamed, kept) before starting: the job starts from the newest committed checkpoint there "
                   "(what a shard refusing a corrupt journal, or another job's, asks for)")
    g.add_argument("--replicas", type=int, default=1, metavar="N", help="processes per shard: 1, or 2 for a "
                   "backup of each shard that takes over when its primary dies (needs --checkpoint-dir: a backup "
                   "copies the shard's journal; docs/operations/replication.md) (default: %(default)s)")
    g.add_argument("--max-memory", metavar="SIZE", help="each ps-server's --max-memory: what it may hold, e.g. 2G "
                   f"or a share of this machine's memory, e.g. 20%% (default: {SHARDS_MEMORY_PERCENT}%% split among "
                   "the shards)")
    g.add_argument("--max-workers", type=int, default=None, help="worker names the job may ever have, added "
                   f"ones included (ps-launch scale; default: --workers or {DEFAULT_MAX_WORKERS}, the larger)")
    g.add_argument("--restart-on-failure", action="store_true",
                   help=f"restart a ps or worker process that dies (at most {MAX_RESTARTS} times each, waiting 1 s, "
                   "then 2, 4, ... first; not one that died of a full disk: that stops the job, exit code 74)")
    g.add_argument("--insecure", action="store_true", help="no TLS, no tokens (default: a throw-away CA, "
                   "certificates and tokens made for this job)")
    g.add_argument("--credentials", metavar="DIR", help="use the CA, certificates and tokens ps-certs wrote into "
                   "DIR for this job's tasks instead of making throw-away ones")
    g.add_argument("--tokens-only", action="store_true", help="per-task and admin tokens without TLS: the same "
                   "protection on one host (only root reads loopback traffic, and root reads the keys too) "
                   "without TLS's cost per byte")
    parser = ArgumentParser(prog="ps-launch", parents=[own], description="Run a whole torchps cluster on "
                            "127.0.0.1. ps-worker's training flags go to every worker. With no arguments: the "
                            "README demo.")
    add_training_flags(parser)
    everything = parser.parse_args(argv)  # unknown flags and bad types stop here
    if everything.ps < 1 or everything.workers + int(everything.chief) < 1:
        parser.error("need --ps >= 1 and at least one training task (--workers or --chief)")
    if everything.max_workers is not None and everything.max_workers < everything.workers:
        parser.error(f"--max-workers must be >= --workers ({everything.workers}). Received: {everything.max_workers}")
    if everything.replicas not in (1, 2):
        parser.error(f"--replicas is 1 (no backups) or 2 (a backup per shard). Received: {everything.replicas}")
    if everything.replicas == 2 and not everything.checkpoint_dir:
        parser.error("--replicas 2 needs --checkpoint-dir: a backup keeps a copy of its shard's journal, which lives "
                     "there")
    if everything.insecure and everything.tokens_only:
        parser.error("--tokens-only and --insecure contradict each other (tokens, or nothing)")
    if everything.insecure and everything.credentials:
        parser.error("--credentials and --insecure contradict each other (a job's credentials, or nothing)")
    processes = everything.workers + int(everything.chief) + int(everything.evaluator)
    if everything.metrics_port and processes > 1:
        parser.error(f"--metrics-port {everything.metrics_port} would be the same port for {processes} processes on "
                     "this host: pass --metrics-port 0 (each picks a free port and logs it)")
    try:
        finish_training_flags(everything)
        _check_dense(everything)
        check_output("--metrics-out", everything.metrics_out)
        if everything.entry:  # the workers import it from the folder they start in, as `python -m` does
            check_entry(everything.entry, [os.getcwd(), *sys.path])
        if everything.replace_journal and not everything.checkpoint_dir:
            raise ClusterConfigError("--replace-journal moves the journals under --checkpoint-dir aside: pass that too")
        if everything.restore_from and not pathlib.Path(everything.restore_from).is_dir():
            raise ClusterConfigError(f"--restore-from {everything.restore_from}: no such folder")
        if everything.credentials:
            read_job_credentials(everything.credentials, job_tasks(everything.ps, everything.workers,
                                                                   everything.chief, everything.evaluator))
        if everything.compression or everything.partition != DEFAULT_PARTITION:
            check_specs(everything)
        if everything.init_from:  # what the chief would find at startup, found before anything starts
            from .models import load_init, new_model, read_init  # torch: only for this check

            state = read_init(everything.init_from)
            if not everything.entry:
                load_init(new_model(everything.model, everything.hidden), state, everything.init_from)
    except (ClusterConfigError, DatasetNotFoundError) as exc:
        parser.error(" ".join(str(exc).split()))
    everything.rendezvous_port = everything.dense == "allreduce" and everything.allreduce_port is None
    return everything, own.parse_known_args(argv)[1]


def _check_dense(args: argparse.Namespace) -> None:
    """ClusterConfigError (one line) for --dense allreduce with a ps-launch flag it cannot honour."""
    if args.dense != "allreduce":
        return
    for flag, given, reason in [
        ("--restart-on-failure", args.restart_on_failure,
         "a restarted worker cannot rejoin the all-reduce group (its members are fixed when it forms)"),
        ("--evaluator", args.evaluator, "an evaluator cannot see the dense parameters (they live in the workers)"),
        ("--checkpoint-dir", bool(args.checkpoint_dir), "the shards' checkpoints would not hold the dense "
         "parameters (they live in the workers)"),
        ("--restore-from", bool(args.restore_from), "the shards' checkpoints hold no dense parameters to restore"),
    ]:
        if given:
            raise ClusterConfigError(f"--dense allreduce cannot be combined with {flag}: {reason}")


def _free_port(taken: set[int]) -> int:
    """A loopback port nothing listens at now (the kernel's pick), not in `taken`."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in taken:
            return port


def _stop_once(signum, _frame) -> None:
    """SIGINT (Ctrl-C), SIGTERM, SIGHUP (the terminal closed): one KeyboardInterrupt, the rest ignored, so
    stopping is never cut short and a second Ctrl-C prints no traceback."""
    for other in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(other, signal.SIG_IGN)
    raise KeyboardInterrupt()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["scale"]:  # ps-launch scale --job-dir DIR --workers N: talk to a running launcher
        return scale_main(argv[1:])
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop_once)
    launcher = None
    try:
        args, worker_args = parse_args(argv)
        try:  # the folder is this job's until ps-launch exits (the lock's file stays open): another job's is
            if args.checkpoint_dir:  # refused before anything starts
                hold_launch(args.checkpoint_dir)
            check_folder(args.checkpoint_dir, args.replicas)
            if args.checkpoint_dir and not _finished_job_may_go_on(args.checkpoint_dir, args.steps):
                return 0
            if args.replace_journal and (moved := move_journals_aside(args.checkpoint_dir)):
                print(f"[launch] the journals in {args.checkpoint_dir} moved aside to {moved}: every shard starts "
                      "from the newest committed checkpoint", flush=True)
        except ClusterConfigError as exc:
            print(f"ps-launch: error: {exc}", file=sys.stderr, flush=True)
            return USAGE_ERROR
        launcher = _launcher(args, worker_args, demo=not argv)
        code = launcher.run()
    except KeyboardInterrupt:  # before the processes started (run() answers it from then on)
        if launcher is not None:
            launcher.close()
        print("ps-launch: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
    if launcher.summary and code != INTERRUPTED:
        s = launcher.summary
        print(f"[launch] test accuracy {s['test_accuracy']:.4f} on {s['dataset']} after {s['global_step']} global steps "
              f"in {s['wall_seconds']:.1f} s ({s['steps_per_second']:.0f} steps/s, {s['mode']})", flush=True)
        if s.get("partial"):  # the chief's account of what its plan left untrained
            print(f"[launch] part of the planned data was not trained: {s['data_account']}", flush=True)
        if code == 0 and args.checkpoint_dir:
            _write_finished(pathlib.Path(args.checkpoint_dir), s)
    print(f"[launch] done, exit code {code}", flush=True)
    return code


def _finished_job_may_go_on(folder: str, steps: int | None) -> bool:
    """False, after one line saying so, if the --checkpoint-dir `folder` holds a job that ended well and
    --steps asks for no step beyond it; True otherwise (no such job, or training it further: the note goes
    until the job ends again)."""
    directory = pathlib.Path(folder)
    try:
        finished = json.loads((directory / FINISHED_FILE).read_text())
        step = int(finished["global_step"])
    except (OSError, ValueError, KeyError, TypeError):  # no job ended here
        if any(directory.glob("journal/ps-*/*")) or any(directory.glob("step-*")):
            print(f"[launch] {folder} holds a job that stopped before its end: it goes on from where it stood (the "
                  "shards' journals, else the newest checkpoint); another --checkpoint-dir starts afresh", flush=True)
        return True
    if steps is not None and steps > step:
        print(f"[launch] {folder} holds a job that finished at global step {step}: training it on to global "
              f"step {steps}", flush=True)
        (directory / FINISHED_FILE).unlink()
        return True
    accuracy = finished.get("test_accuracy")
    print(f"[launch] {folder} holds a job that already finished at global step {step}"
          + (f" (test accuracy {accuracy:.4f})" if isinstance(accuracy, float) else "")
          + f": nothing to do; --steps N (N > {step}, the global step to end at) trains it further, another "
          f"--checkpoint-dir (or removing {folder}) starts afresh", flush=True)
    return False


def _write_finished(directory: pathlib.Path, summary: dict) -> None:
    """Notes in `directory` that its job ended well (the chief's summary), whole or not at all."""
    tmp = directory / (FINISHED_FILE + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    tmp.replace(directory / FINISHED_FILE)


def _launcher(args: argparse.Namespace, worker_args: list[str], demo: bool) -> Launcher:
    """The Launcher for ps-launch's flags; ps-worker's flags go to every worker as they are."""
    if demo:
        print(f"[launch] demo: {args.ps} ps, {args.workers} workers, the MLP on {default_dataset_name()}", flush=True)
    ps_args = ["--launched-by", "ps-launch"]
    if args.checkpoint_dir:
        ps_args += ["--checkpoint-dir", args.checkpoint_dir]
        if not any(a.startswith("--checkpoint-every") for a in worker_args):
            worker_args = [*worker_args, "--checkpoint-every-steps", str(DEFAULT_CHECKPOINT_STEPS)]
    if args.restore_from:
        ps_args += ["--restore-from", args.restore_from]
    # Quotas: the shards share the machine with the workers; the job's tasks join under their own names.
    max_workers = max(args.workers, DEFAULT_MAX_WORKERS) if args.max_workers is None else args.max_workers
    ps_args += ["--max-memory", args.max_memory or f"{SHARDS_MEMORY_PERCENT / args.ps:.4g}%",
                "--elastic-workers", str(max_workers + int(args.chief))]
    ps_args += local_shard_threads(ps_args)  # the shards share this machine with each other and the workers
    return Launcher(num_ps=args.ps, workers=args.workers, chief=args.chief, evaluator=args.evaluator,
                    worker_args=worker_args, metrics_out=args.metrics_out, ps_args=ps_args,
                    restart_on_failure=args.restart_on_failure, secure=not args.insecure, tls=not args.tokens_only,
                    credentials=args.credentials, rendezvous_port=args.rendezvous_port, log_level=args.log_level,
                    max_workers=max_workers, allreduce=args.dense == "allreduce",
                    replicas=ReplicaPlan.load_or_pick(args.checkpoint_dir, args.ps) if args.replicas == 2 else None)


if __name__ == "__main__":  # as the console script: ends at once with main's code
    run_main(main, sys.argv[1:], "ps-launch")
