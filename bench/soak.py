#!/usr/bin/env python
"""Chaos soak: real shards and workers under random faults, then an audit of exactly-once and checkpoints.

    python bench/soak.py --minutes 10 --json soak.json     # the full soak
    python bench/soak.py --minutes 0.5 --fault-every 0.5,1.25   # what the test suite runs
    python bench/soak.py --minutes 10 --replicas 2               # a backup beside every shard

Two phases (async, then sync; half the time each, or longer until every kind of
fault below was injected once), each a fresh job: 2 ps-server shards with a
checkpoint folder (so each keeps a journal) and 4 worker
processes that push counters as fast as they can, with roles on (per-task
tokens from ps-certs, no TLS). Shard 1 is reached through a small TCP proxy. Every push and pull_into
travels on a bulk lane (PSClient(lane_min_bytes=0)): lanes go to the shards directly, not through the
proxy, so their failures come from the kills, pauses and disk-full stops below.
Meanwhile a chaos loop injects, at random, every kind once per round:
  kill-worker        SIGKILL a worker, start it again (a new incarnation)
  kill-shard         SIGKILL a shard, start it again on its port (it recovers from its journal)
  pause-worker       SIGSTOP a worker for longer than its lease, then SIGCONT it
  pause-shard        SIGSTOP a shard for a few seconds, then SIGCONT it
  cut-connections    the proxy drops every connection to shard 1 at once
  hostile-evaluator  the evaluator's token sends each shard Pull(min_step=2**62): it must wait until its
                     deadline, never be answered (an evaluator moves no step)
  toggle-optimizer   the chief turns momentum on for variables that have stepped: every shard must refuse
                     (FAILED_PRECONDITION); an accepted change would break the counters' sums
  disk-full          a shard's files may grow no further (RLIMIT_FSIZE, as `prlimit --fsize` sets it): its next
                     journal append fails with EFBIG, so it must stop itself (exit 70, a fail-stop, counted in
                     `failstops`) before acknowledging that push; it is started again with room
and the job's size changes (bench/resizes.py, a table of resize kinds drawn with the faults):
  worker-added       a worker starts under a name with no process: past the starting spec (its credentials
                     minted then, `ps-certs --add`; the shards re-read their token file), or a removed one's
  worker-removed     a worker other than the chief leaves for good (Leave) and exits 0
  shard-added        a shard starts and the chief resizes the job onto it live (PSClient.resize)
  shard-removed      the chief resizes the job off its last added shard, which is then stopped
and shard resizes fail (bench/resize_faults.py, drawn the same way; each failed one is repaired, and
recovered once a later resize succeeds):
  driver-killed      the driver (`ps-admin resize`, a 3 s lease) is SIGKILLed at its hold (sync) or once a variable
                     was exported (async); repaired by --resume, --abort or the chief started again, in turn
  import-refused     the added shard's --max-memory refuses its import: the driver rolls the resize back
  importer-killed    the added shard is SIGKILLed once it took a variable in; started again (its journal), the
                     resize left cut off is resumed, aborted or rolled back by the chief
  save-during-move   the chief saves a checkpoint while a resize moves variables: committed with every variable
                     in exactly one shard file, or refused (CheckpointError)
With --replicas 2 every shard runs as a primary and a backup (bench/soak_replicas.py, whose docstring says how
each kind above that strikes a shard then strikes one of its two processes, and what the proxy does after a
failover), with four more kinds: host-lost (a primary killed and its journal folder deleted, a fresh backup
started in its place), backup-lost (a backup killed and started again), backup-disk-full (a backup's files
may grow no further for a while: it must follow anew, not stop) and partition-primary (a primary
paused until its backup took over, then resumed: it must stop by itself, fenced); every resize is drawn
(a shard added runs with a backup of its own), their failures left out. Each primary struck is timed from the strike to
the first push acknowledged by its successor (the "g=" of an "acked" line: each shard's generation).
A fault kind is a `_fault_<kind>` method and an entry of FAULT_KINDS; a resize kind an entry of RESIZES. A shard that stops by itself (fail-stop: exit code
70) is counted and started again by the loop, as a launcher or Kubernetes would. At the end of the chaos, with faults over,
each shard that answers health must apply something within WEDGE_SECONDS while the workers push: one that
does not is wedged. Worker 0, the chief, checkpoints every CHECKPOINT_EVERY global steps.

Every push of a worker has a number of its own, kept across its restarts, and
adds 1 to that number's slot (SLOTS of them, more than a worker pushes in a
phase) of the worker's counter variables (one on each shard, SGD with lr 1).
The worker logs each push before sending it ("sent N t=TIME") and once acknowledged
("acked N STEP STALE... g=SHARD:GENERATION,... t=TIME"), so every slot of every counter is checked on its own: an
acknowledged push must be there exactly once (not at all where the shard
dropped it as stale), one that was sent but never acknowledged at most once.
Anything below is lost, anything above duplicated. In the async phase each push also adds 1 to the
worker's row for that slot of a fixed-size embedding table kept on SSD (ROWS: `--table-dir`, a 32 KiB
cache, so its rows are read and written back all the time), pushed with the counters in one call and
audited the same way, then restored from the final checkpoint with them: the table's rows move in every
shard resize, store to store. In sync mode a step applies
the mean of the gradients it counted, and a worker can have two pushes counted
in one step on a shard (one it was told failed because another shard did not
answer, then its next, at the same step): each then holds 1/2 of its slot. So
there a push counts as present when its slot is above 0, and as duplicated
when its slot is above 1 (sync_slots_averaged counts the shared slots).
A counter's staleness is that of the shard holding it (a resize moves
counters, and in sync mode shards drop a backup worker's push as stale each
on its own); a sync push during which its counter changed shards (held by a
resize, sent again to the new owner) logs "m" for it: present at most once,
the exact count being test_live_resize.py's to check. In async mode the global
step (every push counts one on shard 0) lies between the pushes acknowledged
and sent; in sync mode a shared counter on each shard must equal minus the
global step (every shard applied every released step exactly once). A phase ends with every worker asked to stop: a
process that does not end within its deadline, or a stretch of
STALL_SECONDS with faults over and no push acknowledged, or an audit that cannot read the job, is a hang. Last, the
job's final checkpoint must be committed for the job's shards, hold every variable in exactly one shard
file, and restore, through `ps-server --restore-from` onto one shard, to exactly the values served.
`--kinds` draws only the kinds it names (the test suite's one-minute soak leaves the failing resizes out).

Keys: faults_injected (by kind), resizes (how many resize events happened),
resizes_by_kind, resize_pause_p99_s (the pause each resize of RESIZES caused, defined in
bench/resizes.py; a failing one's is in its resize_events entry), pushes_acked, lost, duplicated, hangs,
checkpoint_complete, resizes_failed (resizes that raised or were cut off) and resizes_recovered (of those,
the ones a later resize succeeded after), each phase's timeline (seconds since it began: faults, resizes'
spans, failed resizes' time cut off, pushes acknowledged per second), saves_during_moves (committed, refused) and
moved_checkpoint_problems (a committed one not holding every variable once), failstops (shards that
stopped themselves, each started
again), wedged (shards that answered health but applied nothing within
WEDGE_SECONDS), hostile_pulls and hostile_pulls_answered, optimizer_toggles
and optimizer_toggles_accepted; with --replicas 2: failovers (each primary struck: kind, shard, when, failover_s,
promoted_s: the part of it until the arbiter granted the promotion), failover_p99_s, promotion_p99_s,
failovers_unserved (a strike no successor acknowledged a push after), fenced (partitioned
primaries that stopped by themselves), fresh_backups (host-lost's); per phase the same and more. Target: lost =
duplicated = hangs = wedged = hostile_pulls_answered =
optimizer_toggles_accepted = moved_checkpoint_problems = failovers_unserved = 0, resizes_recovered =
resizes_failed, and a fail-stop for every disk-full; failover_p99_s and resize_pause_p99_s are measured, not
checked.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import itertools
import json
import os
import pathlib
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from resizes import RESIZES, percentile, pause_around  # noqa: E402  (bench/ is no package)
from resize_faults import REPAIRS, RESIZE_FAULTS, Watch, checkpoint_problems, settle  # noqa: E402
from soak_replicas import REPLICA_FAULTS, REPLICA_KINDS, ReplicatedShards, failover_figures, generations  # noqa: E402

if typing.TYPE_CHECKING:  # imported where used: a soak worker imports torchps after its setup
    from torchps.cluster import Cluster
    from torchps.forkserver import ForkedChild

WORKERS, SHARDS = 4, 2       # the starting spec's workers (worker 0 the chief) and the shards
MAX_WORKERS = WORKERS + 2    # names a phase may ever run: worker-added starts 4 and 5 past the spec
LEASE_SECONDS = 3.0
PROGRESS_SECONDS = 10.0
CHECKPOINT_EVERY = 200
STALL_SECONDS = 60.0         # no acknowledged push for this long, outside faults: a hang
EXIT_SECONDS = 60.0          # a worker asked to stop must be gone within this
FAULT_EVERY = (2.0, 5.0)     # seconds between faults, uniformly (--fault-every)
ROUND_SECONDS = 120.0        # a phase goes on past its time, at most this long, until every kind of fault happened
START_SECONDS = 120.0        # a (re)started worker retries its start this long while a shard is away
FAULT_KINDS = ("kill-worker", "kill-shard", "pause-worker", "pause-shard", "cut-connections", "hostile-evaluator",
               "toggle-optimizer", "disk-full")
KINDS = FAULT_KINDS + tuple(RESIZES) + tuple(RESIZE_FAULTS)  # the default (--replicas 1)
# With --replicas 2: the replica kinds too, and no failed resize (bench/soak_replicas.py)
REPLICATED_KINDS = FAULT_KINDS + REPLICA_KINDS + tuple(RESIZES)
WEDGE_SECONDS = 30.0         # a shard answering health that applies nothing this long while workers push: wedged
HOSTILE_DEADLINE = 0.5       # seconds a hostile far-min_step pull waits before its deadline
FAR = 1 << 62                # the hostile evaluator's min_step
FAILSTOP_SECONDS = 60.0      # a shard whose disk is full must have stopped itself within this
FULL_DISK_ROOM = 64 << 10    # bytes a full disk still lets a shard's files grow past its log's size
FAILSTOP_CODE = 70           # ps_server.failstop.EXIT_CODE
SLOTS = 1 << 15              # one per push of a worker; a 10-minute soak pushes ~4,000 per worker and phase
EPS = 1e-4                   # the counters hold sums of ones (async) or of shares 1/c (sync): far above this


# -- the worker process ------------------------------------------------------------------------------

def counter_names(index: int) -> list[str]:
    return [f"w{index}/a", f"w{index}/b"]  # created in this order: a on ps 0, b on ps 1


ALL_NAMES = [name for i in range(MAX_WORKERS) for name in counter_names(i)] + ["ones/a", "ones/b"]


ROWS = "rows"  # a fixed-size table on SSD: row index * SLOTS + slot counts worker index's pushes (async phases)


def rows_spec():
    """The table of counter rows: one row of one float per slot of every worker name, zeros at first, SGD lr 1,
    kept on SSD (every row written when it is created; live resizes stream them store to store)."""
    from torchps.client import Optimizer
    from torchps.proto import ps_pb2

    return ps_pb2.TableSpec(name=ROWS, dim=1, num_embeddings=MAX_WORKERS * SLOTS, dtype=ps_pb2.FLOAT32,
                            init=ps_pb2.TableInit(distribution="uniform", scale=0.0),
                            optimizer=Optimizer("sgd", lr=1.0).to_proto(), storage="ssd")


def sizes() -> dict[str, int]:
    """Every variable's number of float32 elements: slots for the workers' counters, one for the shared ones."""
    return {name: 1 if name.startswith("ones/") else SLOTS for name in ALL_NAMES}


def pushes_logged(log: pathlib.Path) -> int:
    """How many pushes earlier incarnations of a worker sent: its next push's number."""
    return sum(line.startswith("sent") for line in log.read_text().splitlines()) if log.exists() else 0


def worker_main(args: argparse.Namespace) -> int:
    """One worker: push ones into its own counters and the shared ones, log each push, until told to stop."""
    import torch
    from torchps.client import Cluster, Optimizer, PSClient, PSError, ServerUnavailableError, TaskSpec

    cluster = Cluster.from_json(args.cluster)
    rng = random.Random(args.index * 7919 + os.getpid())
    number = pushes_logged(pathlib.Path(args.log))
    log = open(args.log, "a", buffering=1)
    from torchps.worker.chief import Checkpointer, repair_resize

    task = TaskSpec("worker", args.index)
    with PSClient(cluster, task=task, connect_timeout=15, timeout=60, refill_timeout=60,
                  security=task_security(pathlib.Path(args.credentials), cluster, task),
                  lane_min_bytes=0) as ps:  # every push and pull_into on a bulk lane: their failures are soaked
        def start() -> None:  # idempotent: retried while a shard the chaos loop killed comes back
            if args.index == 0:
                ps.configure(args.mode, total_num_replicas=WORKERS, lease_seconds=LEASE_SECONDS,
                             progress_seconds=PROGRESS_SECONDS)
                repair_resize(ps)  # as ps-worker's chief: a resize cut off (its driver killed) is rolled back
                ps.create_variables({name: torch.zeros(n) for name, n in sizes().items()}, Optimizer("sgd", lr=1.0))
                if args.rows:
                    ps.create_tables([rows_spec()])
            else:
                ps.declare({name: torch.zeros(n) for name, n in sizes().items()})
                ps.wait_for_variables(ALL_NAMES, timeout=120)
                if args.rows:
                    ps.wait_for_tables([ROWS], timeout=120)
            ps.join()

        started = time.monotonic()
        while True:
            try:
                start()
                break
            except ServerUnavailableError:
                if time.monotonic() - started > START_SECONDS:
                    raise
        shared = {"ones/a": torch.ones(1), "ones/b": torch.ones(1)}
        targets = {name: torch.zeros(n) for name, n in sizes().items() if name in shared or
                   name in counter_names(args.index)}
        checkpointer = Checkpointer(ps, every_steps=CHECKPOINT_EVERY, keep=2).start() if args.index == 0 else None
        while not (os.path.exists(args.stop_file) or os.path.exists(args.leave_file)):
            one_hot = torch.zeros(SLOTS)
            one_hot[number % SLOTS] = 1.0
            mine = {**{name: one_hot for name in counter_names(args.index)}, **shared}
            rows = {ROWS: (torch.tensor([args.index * SLOTS + number % SLOTS]), torch.ones(1, 1))} if args.rows \
                else None
            log.write(f"sent {number} t={time.monotonic():.4f}\n")
            number += 1
            before = _holders(ps, args.index)
            try:
                if rng.random() < 0.5:
                    ps.push_pull(mine, targets, rows=rows)
                else:
                    ps.push(mine, rows=rows)
                    ps.pull_into(targets, min_step=ps.step if args.mode == "sync" else 0)
            except PSError as exc:
                log.write(f"error {type(exc).__name__} t={time.monotonic():.4f}: {str(exc)[:200]}\n")
                continue
            after = _holders(ps, args.index)
            stale = " ".join(_stale_flag(ps, b, a) if args.mode == "sync" else "0" for b, a in zip(before, after))
            served = ",".join(f"{shard}:{reply.generation:x}" for shard, reply in sorted(ps.last_replies.items()))
            log.write(f"acked {number - 1} {ps.step} {stale} g={served} t={time.monotonic():.4f}\n")
            if checkpointer is not None:
                checkpointer.note_step(ps.step)
        if checkpointer is not None:
            checkpointer.stop(final=False)
    log.write("exit\n")  # leaving the `with`: Leave on every shard (a removed worker leaves for good)
    return 0


def _holders(ps, index: int) -> list[int]:
    """The shard each of worker `index`'s counters is on, as the client places them now (live resizes move
    them)."""
    held = {name: shard for shard, names in ps.placement.group(counter_names(index)).items() for name in names}
    return [held[name] for name in counter_names(index)]


def _stale_flag(ps, before: int, after: int) -> str:
    """A sync push's staleness for a counter held by shard `before` when it was sent and `after` now: that
    shard's (1: dropped as stale), or "m" if it moved meanwhile."""
    reply = ps.last_replies.get(after)
    return "m" if before != after or reply is None else str(int(reply.stale))


def job_tasks() -> Cluster:
    """The soak's tasks on placeholder addresses (credentials name tasks, not ports)."""
    from torchps.cluster import Cluster

    return Cluster(ps=tuple(f"127.0.0.1:{i + 1}" for i in range(SHARDS)),
                   worker=tuple(f"127.0.0.1:{100 + i}" for i in range(WORKERS)), evaluator=("127.0.0.1:99",))


def task_security(credentials: pathlib.Path, cluster, task):
    """A task's per-task token (and the admin token for the chief, worker 0), without TLS."""
    from torchps.certs import TaskCredentials
    from torchps.security import Security

    files = TaskCredentials.of(credentials, cluster, task)
    return Security.load(token_file=str(files.token), environ={},
                         admin_token_file=str(files.admin_token) if files.admin_token else None)


# -- a TCP proxy whose connections can be cut --------------------------------------------------------

class Proxy:
    """Forwards 127.0.0.1:port to a shard; cut() drops every connection at once (clients reconnect)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> int:
        with self._lock:
            doomed, self._open = self._open, []
        for s in doomed:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                s.close()
            except OSError:
                pass
        return len(doomed) // 2

    def close(self) -> None:
        self._listener.close()
        self.cut()


# -- one phase -----------------------------------------------------------------------------------------

class Phase:
    """One job (mode) under chaos for `seconds`, then its audit."""

    def __init__(self, mode: str, seconds: float, workdir: pathlib.Path, rng: random.Random,
                 fault_every: tuple[float, float] = FAULT_EVERY, kinds: tuple[str, ...] = KINDS, replicas: int = 1):
        from torchps.certs import TaskCredentials, make_job_credentials
        from torchps.cluster import TaskSpec
        from torchps.worker.local_cluster import LocalCluster

        self.mode, self.seconds, self.rng, self.fault_every = mode, seconds, rng, fault_every
        self.dir = workdir / mode
        self.dir.mkdir(parents=True)
        self.ckpt = self.dir / "ckpt"
        self.stop_file = self.dir / "stop"
        self.credentials = self.dir / "job"
        make_job_credentials(self.credentials, job_tasks())
        shard = TaskCredentials.of(self.credentials, job_tasks(), TaskSpec("ps", 0))
        flags = ["--checkpoint-dir", str(self.ckpt), "--token-file", str(shard.token),
                 "--admin-token-file", str(shard.admin_token)]
        self.replicated = replicas == 2  # a backup beside every shard (bench/soak_replicas.py)
        self.rows = not self.replicated and mode == "async"  # the table of counter rows, on SSD
        if self.rows:
            flags += ["--table-dir", str(self.dir / "tables"), "--table-cache", "32K"]  # under import-refused's 64K
        self.shards = ReplicatedShards(self.dir, self.ckpt, SHARDS, flags) if self.replicated else \
            LocalCluster(SHARDS, log_dir=self.dir, server_args=flags)
        self.faults: collections.Counter[str] = collections.Counter()
        self.fault_times: list[tuple[float, str]] = []  # (monotonic time, kind) of each fault injected
        self.started = time.monotonic()
        self.workers: dict[int, ForkedChild | subprocess.Popen] = {}  # a Popen where the fork server is off
        self.hangs: list[str] = []
        self.failures: list[str] = []  # a worker that died by itself: its exit code and last lines
        self.active: set[int] = set()   # the workers running (resizes add and remove some)
        self.max_workers = MAX_WORKERS
        self.kinds = kinds
        self.live_shards: list[str] = []  # the job's shards now, in index order (shard resizes change them)
        self.resizes: list = []         # resizes.Resize records, in order
        self.resize_failures: list = []  # resize_faults.Failure records: resizes that raised or were cut off
        self.repairs = itertools.cycle(REPAIRS)  # how the next cut-off resize is repaired
        self.saves = collections.Counter()  # checkpoints saved during a resize's moves: committed, refused
        self.save_lines: list[str] = []     # why each refused one was
        self.checkpoint_problems: list[str] = []  # a committed one missing a variable or holding one twice
        self._admin_runs = 0
        self.failstops: list[str] = []  # a shard that stopped itself (exit code 70), started again
        self.crashes: list[str] = []    # a shard that exited by itself otherwise, started again
        self.wedged: list[str] = []     # a shard that answered health but applied nothing in time
        self.hostile = collections.Counter()  # far-min_step pulls: sent, answered (must be 0), unreachable
        self.toggles = collections.Counter()  # structural optimizer changes: refused, accepted (must be 0), ...
        self._order: list[str] = []

    def log_path(self, index: int) -> pathlib.Path:
        return self.dir / f"worker{index}.log"

    def security(self, task_type: str):
        from torchps.cluster import TaskSpec

        return task_security(self.credentials, self.cluster, TaskSpec(task_type, 0))

    def leave_file(self, index: int) -> pathlib.Path:
        return self.dir / f"leave{index}"

    def start_worker(self, index: int) -> None:
        self.leave_file(index).unlink(missing_ok=True)
        # forked by the shards' fork server, as ps-launch starts ps-worker (real processes, torch imported
        # once); run from this folder, whose soak.py its `python -m`-like start then imports
        with open(self.dir / f"worker{index}.out", "ab") as out:
            self.workers[index] = self.shards.starter.start(
                pathlib.Path(__file__).stem,
                ["--worker", "--cluster", json.dumps(self.cluster.to_dict()), "--index", str(index), "--mode",
                 self.mode, "--log", str(self.log_path(index)), "--stop-file", str(self.stop_file), "--leave-file",
                 str(self.leave_file(index)), "--credentials", str(self.credentials),
                 *(["--rows"] if self.rows else [])],
                prog="soak-worker", env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=str(pathlib.Path(__file__).parent),
                stdout=out.fileno(), parent_death_signal=signal.SIGTERM)  # a soak that dies leaves none pushing
        self.active.add(index)

    def ensure_credentials(self, index: int, task_type: str = "worker") -> None:
        """Mints task `index`'s credentials into the job folder if it has none (a name past the starting spec):
        a worker's token, a shard's line of the token table (its backup calls its primary and arbiter with it)."""
        from torchps.certs import add_to_job
        from torchps.cluster import TaskSpec

        if not (self.credentials / f"{task_type}-{index}.crt").exists():
            add_to_job(self.credentials, [TaskSpec(task_type, index)])

    def retire_worker(self, index: int) -> None:
        """Asks worker `index` to leave for good and waits for it (EXIT_SECONDS, else a hang)."""
        self.active.discard(index)
        proc = self.workers.pop(index)
        self.leave_file(index).touch()
        code = self.await_exit(proc, EXIT_SECONDS, f"worker {index} did not leave within {EXIT_SECONDS:g} s of "
                                                    f"being removed")
        if code not in (0, None):
            self.failures.append(f"worker {index} ended with code {code} when removed")

    def await_exit(self, proc, seconds: float, hang: str) -> int | None:
        """`proc`'s exit code once it ended, within `seconds`; else `hang` is recorded, it is killed, and None."""
        try:
            return proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.hangs.append(hang)
            proc.kill()
            proc.wait()
            return None

    def indices(self) -> list[int]:
        """Every worker that ever ran in this phase (it has a log)."""
        return [i for i in range(MAX_WORKERS) if self.log_path(i).exists()]

    def acked(self) -> int:
        """Pushes acknowledged so far, every worker and incarnation: the logs' "acked" lines, counted alone (the
        chaos loop asks after every event; the audit's per-slot tally in _counts is far costlier)."""
        return sum(line.startswith("acked ") for i in self.indices()
                   for line in self.log_path(i).read_text().splitlines())

    def run(self) -> dict:
        started = self.started = time.monotonic()
        if self.replicated:  # every address known before anything starts: the shards are told the spec
            self.proxy = Proxy(("127.0.0.1", self.shards.port(1)))
            self.cluster = self._cluster(self.shards.port(0))
            self.shards.start(list(self.cluster.ps), self.security("worker"))
        else:
            self.shards.start()
            self.proxy = Proxy(("127.0.0.1", self.shards.ports[1]))
            self.cluster = self._cluster(self.shards.ports[0])
        self.live_shards = list(self.cluster.ps)
        try:
            for index in range(WORKERS):
                self.start_worker(index)
            self._chaos(started + self.seconds)
            settle(self)  # a failed resize no later one recovered gets one now
            self._check_wedged()
            self._stop_workers()
            return self._audit(time.monotonic() - started)
        finally:
            for proc in self.workers.values():
                if proc.poll() is None:
                    proc.kill()
            self.proxy.close()
            self.shards.stop()

    def _cluster(self, port0: int) -> Cluster:
        """The job's cluster: ps 0 at `port0`, ps 1 at the proxy, the workers and the evaluator at placeholders."""
        from torchps.cluster import Cluster

        return Cluster(ps=(f"127.0.0.1:{port0}", f"127.0.0.1:{self.proxy.port}"),
                       worker=tuple(f"127.0.0.1:{p}" for p in range(20001, 20001 + MAX_WORKERS)),
                       evaluator=("127.0.0.1:20000",))

    def _chaos(self, until: float) -> None:
        """Injects faults until `until`, and past it (at most ROUND_SECONDS) until every kind was injected once."""
        last_acked, last_progress = 0, time.monotonic()
        while (now := time.monotonic()) < until or (self._kinds_seen() < len(self.kinds)
                                                    and now < until + ROUND_SECONDS):
            time.sleep(self.rng.uniform(*self.fault_every))
            self._check_workers()
            self.check_shards()
            if not self._order:  # every kind once per round, in a random order
                self._order = self.rng.sample(self.kinds, len(self.kinds))
            kind = self._order.pop()
            if kind in RESIZES or kind in RESIZE_FAULTS:
                self._await_training()
                done = (RESIZES.get(kind) or RESIZE_FAULTS[kind])(self)
                if done is not None:
                    self.resizes.append(done)
            else:
                fault = REPLICA_FAULTS.get(kind) if self.replicated else None
                done = (fault(self) if fault else getattr(self, "_fault_" + kind.replace("-", "_"))()) is not False
                if done:
                    self.faults[kind] += 1
                    self.fault_times.append((time.monotonic(), kind))
            if not done:
                self._order.insert(0, kind)  # it could not be injected yet: later in this round
                continue
            acked = self.acked()
            if acked > last_acked:
                last_acked, last_progress = acked, time.monotonic()
            elif time.monotonic() - last_progress > STALL_SECONDS:
                self.hangs.append(f"no push acknowledged for {STALL_SECONDS:g} s (at {acked})")
                return

    def _await_training(self) -> None:
        """Returns once every running worker had a push acknowledged after this call (the job trains, no fault
        still settling), or after STALL_SECONDS."""
        since, deadline = time.monotonic(), time.monotonic() + STALL_SECONDS
        while time.monotonic() < deadline and any(self._last_ack(i) <= since for i in self.active):
            time.sleep(0.05)

    def await_ack(self, index: int, since: float) -> None:
        """Returns once worker `index` logged a push acknowledged after `since`; a hang after START_SECONDS."""
        deadline = time.monotonic() + START_SECONDS
        while self._last_ack(index) <= since:
            if time.monotonic() > deadline:
                self.hangs.append(f"worker {index} had no push acknowledged {START_SECONDS:g} s after it started")
                return
            time.sleep(0.05)

    def trained_since(self, since: float) -> bool:
        """Whether a running worker logged a push acknowledged after `since` (CLOCK_MONOTONIC)."""
        return any(self._last_ack(i) > since for i in self.active)

    def _last_ack(self, index: int) -> float:
        """When worker `index` last logged an acknowledged push (CLOCK_MONOTONIC), or 0: its log's tail only."""
        try:
            with open(self.log_path(index), "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 4096))
                tail = log.read().decode(errors="replace").splitlines()
        except OSError:
            return 0.0
        stamps = [line.split()[-1] for line in tail if line.startswith("acked ")]
        return float(stamps[-1][2:]) if stamps and stamps[-1].startswith("t=") else 0.0

    def _kinds_seen(self) -> int:
        return len(self.faults) + len({r.kind for r in self.resizes})

    def resize_shards(self, addresses: list[str]) -> bool:
        """The chief (worker 0's credentials, the admin token) resizes the job onto `addresses` live; whether it
        succeeded. A failure is recorded, and the shards taken from ps 0's layout."""
        from torchps.client import PSClient, PSError

        asked = addresses
        if self.replicated:  # the shards that stay, named as ps 0's layout names them (a failover moves none there)
            named = self.shards.layout_names()[:len(addresses)]
            asked = [*named, *addresses[len(named):]]
        with PSClient(self.cluster, connect_timeout=30, security=self.security("worker")) as chief:
            try:
                chief.resize(asked)
            except PSError as exc:
                self.failures.append(f"resize onto {len(addresses)} shards failed: {type(exc).__name__}: {exc}")
                self.follow_layout()
                return False
        self.live_shards = list(addresses)
        if self.replicated:
            while self.shards.num_shards > len(addresses):
                self.shards.remove_pair(self.failures)
            self.shards.set_job(self.live_shards)
        self.resize_succeeded()
        return True

    def resize_succeeded(self) -> None:
        """A resize of the job succeeded: every failed one before it is recovered."""
        for failure in self.resize_failures:
            failure.recovered = True

    def add_shard(self, index: int, extra: list[str] | tuple[str, ...] = ()) -> str:
        """Starts shard `index` for a resize to add, with the job's flags and `extra`; its address. With --replicas
        2 with a backup (ReplicatedShards.add_pair; the failures of a resize, which pass `extra`, are not drawn)."""
        if self.replicated:
            self.ensure_credentials(index, "ps")
            return self.shards.add_pair(list(self.live_shards))
        return self.shards.add_ps(index, args=[*self.shards.server_args, *extra])

    def follow_layout(self) -> None:
        """Takes the job's shards from ps 0's layout (a failed or repaired resize leaves the shards it says) and
        stops a shard past them that still runs: it must hold nothing, not even in its outbox."""
        from torchps.client import PSClient

        with PSClient(self.cluster, connect_timeout=30, security=self.security("worker")) as chief:
            shards = chief.shard_addresses()
        # The shards that stay keep the names the soak gave them (a replicated one's host is known by it: its spec)
        self.live_shards = [*self.live_shards[:len(shards)], *shards[len(self.live_shards):]] if self.replicated \
            else shards
        if self.replicated:  # (only a failed resize comes here: a failure already)
            while self.shards.num_shards > len(self.live_shards):
                self.shards.remove_pair(self.failures, stop=True)
            self.shards.set_job(self.live_shards)
            return
        for index in range(len(self.live_shards), len(self.shards.procs)):
            proc = self.shards.procs[index]
            if proc is None or proc.poll() is not None:
                continue
            with Watch(self) as watch:
                held, layout = watch.held(index), watch.layout(index)
            if held or (layout is not None and layout.outbox):
                self.failures.append(f"ps {index}, past the job's {len(self.live_shards)} shards, still holds "
                                     f"{held[:3] if held else list(layout.outbox)[:1]}")
            self.shards.kill_ps(index, signal.SIGTERM)

    def start_admin(self, argv: list[str]) -> tuple:
        """Starts `ps-admin ARGV[0] --cluster CLUSTER ARGV[1:]` with the chief's credentials, forked as the
        workers are; returns it (a Popen or its look-alike) and the file its output goes to."""
        from torchps.certs import TaskCredentials
        from torchps.cluster import TaskSpec

        files = TaskCredentials.of(self.credentials, self.cluster, TaskSpec("worker", 0))
        self._admin_runs += 1
        path = self.dir / f"ps-admin{self._admin_runs}.out"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHPS_TOKEN_FILE": str(files.token),
               "TORCHPS_ADMIN_TOKEN_FILE": str(files.admin_token)}
        argv = [argv[0], "--cluster", json.dumps(self.cluster.to_dict()), *argv[1:]]
        with open(path, "wb") as out:
            proc = self.shards.starter.start("torchps.admin", argv, prog="ps-admin", env=env, stdout=out.fileno(),
                                             parent_death_signal=signal.SIGTERM)
        return proc, path

    def restart_chief(self) -> None:
        """SIGKILLs the chief (worker 0) and starts it again: as it starts it rolls back a resize cut off."""
        self.workers[0].kill()
        self.workers[0].wait()
        self.start_worker(0)

    @staticmethod
    def declared() -> list[tuple[str, int]]:
        """Every variable of the job with its bytes, as a client declares them."""
        return [(name, 4 * n) for name, n in sizes().items()]

    def _check_workers(self) -> None:
        """Records and restarts a worker that ended by itself (the chaos loop only ever kills them)."""
        for index, proc in self.workers.items():
            if proc.poll() is not None:
                tail = (self.dir / f"worker{index}.out").read_text(errors="replace").splitlines()[-5:]
                self.failures.append(f"worker {index} exited with code {proc.returncode}: " + " | ".join(tail))
                self.start_worker(index)

    def check_shards(self) -> None:
        """Counts and starts again a shard that exited by itself (the chaos loop restarts the ones it kills at
        once): exit code 70 is a fail-stop, anything else a crash. With --replicas 2, each of a shard's
        processes, with its own command (ReplicatedShards.restart)."""
        if self.replicated:
            exited = self.shards.restart_exited(self.failures)
        else:
            exited = []
            for index, proc in enumerate(self.shards.procs[:len(self.live_shards)]):  # not those a resize removed
                if proc.poll() is None:
                    continue
                exited.append((f"ps {index}", proc.returncode, " | ".join(self.shards.log(index).splitlines()[-3:])))
                self.shards.start_ps(index)
        for name, code, tail in exited:
            (self.failstops if code == FAILSTOP_CODE else self.crashes).append(f"{name} exited with code {code}: "
                                                                                f"{tail}")

    def shard_port(self, index: int) -> int | None:
        """The port shard `index` is served at now (not the proxy's); None if its arbiter cannot say."""
        return self.shards.serving_port(index) if self.replicated else self.shards.ports[index]

    def _fault_kill_worker(self) -> None:
        index = self.rng.choice(sorted(self.active))
        self.workers[index].kill()
        self.workers[index].wait()
        self.start_worker(index)

    def _fault_kill_shard(self) -> None:
        index = self.rng.randrange(len(self.live_shards))
        self.shards.kill_ps(index)
        self.shards.start_ps(index)

    def _fault_pause_worker(self) -> None:
        self.pause(self.workers[self.rng.choice(sorted(self.active))], LEASE_SECONDS * 1.7)

    def _fault_pause_shard(self) -> None:
        self.pause(self.shards.procs[self.rng.randrange(len(self.live_shards))], self.rng.uniform(0.5, 3.0))

    @staticmethod
    def pause(proc: subprocess.Popen, seconds: float) -> None:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        proc.send_signal(signal.SIGCONT)

    def _fault_cut_connections(self) -> None:
        self.proxy.cut()

    def _fault_hostile_evaluator(self) -> None:
        """The evaluator's token asks every shard (directly) for a step no job reaches: a read-only role never
        moves a step, so each call must wait out its deadline (or find the shard away), never be answered."""
        import grpc
        from torchps.proto import ps_pb2, ps_pb2_grpc
        from torchps.security import TOKEN_METADATA_KEY

        metadata = ((TOKEN_METADATA_KEY, self.security("evaluator").call_token()),)
        for port in map(self.shard_port, range(len(self.live_shards))):
            if port is None:
                self.hostile["away"] += 1
                continue
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                pull = ps_pb2_grpc.ParameterServerStub(channel).Pull
                self.hostile["sent"] += 1
                try:
                    list(pull(ps_pb2.PullRequest(min_step=FAR), timeout=HOSTILE_DEADLINE, metadata=metadata))
                    self.hostile["answered"] += 1
                except grpc.RpcError as exc:
                    self.hostile["waited" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "away"] += 1

    def _fault_toggle_optimizer(self) -> bool:
        """The chief turns momentum on (a structural change) for the variables that have stepped, shard by
        shard: each must refuse it; one that accepted would apply momentum to the counters from then on.
        False (nothing sent) until a variable on every shard has stepped."""
        from torchps.client import ModeConflictError, PSClient, PSError

        with PSClient(self.cluster, connect_timeout=5, timeout=10, security=self.security("worker")) as chief:
            chief.declare([(name, 4 * n) for name, n in sizes().items()])
            try:
                shards = len(chief.shard_addresses())  # follows the layout (shard resizes)
                stepped = [info.spec.name for info in chief.list_variables() if info.version > 0]
            except PSError:
                return False
            by_shard = {shard: [name for name in stepped if chief.placement.shard_of(name) == shard]
                        for shard in range(shards)}
            if not all(by_shard.values()):
                return False
            for names in by_shard.values():
                try:
                    chief.set_hyperparams(names, momentum=0.9)
                    self.toggles["accepted"] += 1
                except ModeConflictError:
                    self.toggles["refused"] += 1
                except PSError:
                    self.toggles["shard away"] += 1
        return True

    def _fault_disk_full(self) -> None:
        """A shard's disk fills (fill_disk); it is counted and started again by check_shards."""
        index = self.rng.randrange(SHARDS)
        if self.fill_disk(self.shards.procs[index], self.dir / f"ps{index}.log", f"ps {index}") is None:
            self.shards.start_ps(index)
            return
        self.check_shards()

    def fill_disk(self, proc, log: pathlib.Path, name: str) -> int | None:
        """Lets a shard process's files grow no further than its log file plus FULL_DISK_ROOM (its log keeps
        room to say why it stops; its journal soon does not, even on a shard whose variables no running worker
        pushes: the sync steps' records alone, ~9 KB/s, once took over a minute to pass 1 MiB), waits for it
        to stop itself; its exit code, None if it went on (a hang: it is killed). A code but 70 is a failure."""
        limit = log.stat().st_size + FULL_DISK_ROOM
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
        code = self.await_exit(proc, FAILSTOP_SECONDS, f"{name} went on {FAILSTOP_SECONDS:g} s with a full disk "
                                                       f"instead of stopping")
        if code is not None and code != FAILSTOP_CODE:
            self.failures.append(f"{name} with a full disk ended with code {code}, not {FAILSTOP_CODE}")
        return code

    def _check_wedged(self) -> None:
        """Faults over, workers pushing: every shard that answers health must apply something (its variables'
        versions move) within WEDGE_SECONDS; one that answers SERVING and does not is wedged. A shard that
        stopped itself meanwhile is counted by check_shards."""
        versions = {index: self._versions(index) for index in range(len(self.live_shards))}
        serving = dict.fromkeys(versions, True)
        deadline = time.monotonic() + WEDGE_SECONDS
        waiting = {i for i, v in versions.items() if v is not None}
        while waiting and time.monotonic() < deadline:
            for index in sorted(waiting):
                now = self._versions(index)
                if now is None:
                    serving[index] = False
                if now is None or now != versions[index]:
                    waiting.discard(index)
            time.sleep(0.2)
        self.check_shards()
        for index in sorted(waiting):
            if serving[index]:
                self.wedged.append(f"ps {index} answered health (SERVING) but applied nothing in {WEDGE_SECONDS:g} "
                                   f"s while the workers pushed (versions stayed {versions[index]})")

    def _versions(self, index: int) -> int | None:
        """The sum of the versions of the variables shard `index` holds that running workers push, if it answers
        health SERVING and holds any, else None (a shard resizes left only the counters of workers that left
        or never ran, or none, has nothing to apply)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from torchps.proto import ps_pb2, ps_pb2_grpc
        from torchps.security import TOKEN_METADATA_KEY

        metadata = ((TOKEN_METADATA_KEY, self.security("worker").call_token()),)
        port = self.shard_port(index)
        if port is None:
            return None
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                if health.status != health_pb2.HealthCheckResponse.SERVING:
                    return None
                listed = ps_pb2_grpc.ParameterServerStub(channel).ListVariables(ps_pb2.ListRequest(), timeout=5,
                                                                              metadata=metadata)
            except grpc.RpcError:
                return None
        pushed = {"ones/a", "ones/b"} | {name for i in self.active for name in counter_names(i)}
        versions = [info.version for info in listed.variables if info.spec.name in pushed]
        return sum(versions) if versions else None


    def _stop_workers(self) -> None:
        self.stop_file.touch()
        deadline = time.monotonic() + EXIT_SECONDS
        for index, proc in self.workers.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.hangs.append(f"worker {index} did not end within {EXIT_SECONDS:g} s of being asked")
                proc.kill()
                continue
            if proc.returncode != 0:
                self.failures.append(f"worker {index} ended with code {proc.returncode} when asked to stop")

    def _audit(self, wall: float) -> dict:
        import torch
        from torchps.client import PSClient, PSError
        from torchps.ps_server.checkpoint import latest_committed

        counts = [self._counts(index) if self.log_path(index).exists() else (0, 0, [0] * SHARDS, [0] * SHARDS)
                  for index in range(MAX_WORKERS)]
        acks = self._acks()
        lost = duplicated = averaged = 0
        misses: list[str] = []  # the first few slots that did not add up, for the report
        values = global_step = steps_ok = final = refused = None
        try:
            with PSClient(self.cluster, connect_timeout=30, security=self.security("worker")) as admin:
                admin.declare(self.declared())
                values = admin.pull(ALL_NAMES)
                if self.rows:
                    admin.wait_for_tables([ROWS], timeout=30)
                    values[ROWS] = admin.lookup_rows({ROWS: torch.arange(MAX_WORKERS * SLOTS)})[ROWS][:, 0]
                global_step = admin.global_step()
                lost, duplicated, averaged, steps_ok, misses = self._tally(counts, values, global_step)
                try:  # refused while a resize is left cut off (a variable in two places, the shards' epochs differ)
                    final, refused = admin.save_checkpoint(0, keep=2, timeout=120), None
                except PSError as exc:
                    final, refused = None, f"{type(exc).__name__}: {exc}"[:500]
                admin.shutdown_cluster("the soak phase is over")
        except PSError as exc:  # a shard no one serves: nothing to count, a hang
            self.hangs.append(f"the audit could not read the job: {type(exc).__name__}: {exc}"[:500])
        found = latest_committed(self.ckpt)
        not_once = checkpoint_problems(self.ckpt, found[0], ALL_NAMES) if found else []
        complete = (final is not None and found is not None and found[0] == final
                    and len(found[1]["shards"]) == len(self.live_shards) and not not_once)
        differing = self._restore_differences(values) if complete else None
        restored_equal = differing == []
        checkpoint_detail = {"saved_step": final, "save_refused": refused,
                             "latest_committed_step": found[0] if found else None,
                             "shard_files": len(found[1]["shards"]) if found else 0,
                             "not_in_exactly_one_file": not_once[:10], "restored_differing": differing}
        return {"mode": self.mode, "seconds": round(wall, 1), "faults_injected": dict(self.faults),
                "failstops": len(self.failstops), "failstop_lines": self.failstops, "shard_crashes": self.crashes,
                "wedged": len(self.wedged), "wedged_reasons": self.wedged,
                "hostile_pulls": self.hostile["sent"], "hostile_pulls_answered": self.hostile["answered"],
                "hostile_pull_outcomes": dict(self.hostile),
                "optimizer_toggles": self.toggles["refused"] + self.toggles["accepted"],
                "optimizer_toggles_accepted": self.toggles["accepted"], "optimizer_toggle_outcomes": dict(self.toggles),
                **self._resize_figures([t for t, _ in acks]), **self._replica_figures(acks),
                "resizes_failed": len(self.resize_failures),
                "resizes_recovered": sum(f.recovered for f in self.resize_failures),
                "saves_during_moves": dict(self.saves), "save_refusals": self.save_lines[:10],
                "moved_checkpoint_problems": self.checkpoint_problems,
                "pushes_acked": sum(a for _, a, _, _ in counts), "pushes_sent": sum(s for s, _, _, _ in counts),
                "global_step": global_step, "lost": lost, "duplicated": duplicated, "hangs": len(self.hangs),
                "hang_reasons": self.hangs, "worker_failures": self.failures, "audit_misses": misses[:20],
                "sync_slots_averaged": averaged if self.mode == "sync" else None, "sync_steps_applied_once": steps_ok,
                "checkpoint_complete": bool(complete and restored_equal), "final_checkpoint_step": final,
                "checkpoint_detail": checkpoint_detail}

    def _tally(self, counts: list, values: dict, global_step: int) -> tuple[int, int, int, bool | None, list[str]]:
        """(lost, duplicated, sync slots averaged, every sync step applied once (None in async), the first few
        slots that did not add up) of the workers' `counts` (_counts) against the `values` the job holds."""
        lost = duplicated = averaged = 0
        misses: list[str] = []
        for index, (_, _, must, may) in enumerate(counts):
            for shard, name in enumerate(counter_names(index)):
                applied = -values[name].double()
                if self.mode == "sync":  # a share 1/c of a step that counted c of this worker's pushes
                    averaged += int(((applied > EPS) & (applied < 1 - EPS)).sum())
                    missing = (must[shard] > 0) & (applied <= EPS)
                else:
                    missing = applied < must[shard] - EPS
                extra = applied > may[shard] + EPS
                lost += int(missing.sum())
                duplicated += int(extra.sum())
                for slot in (missing | extra).nonzero().flatten()[:5].tolist():
                    misses.append(f"worker {index} push {slot} on ps {shard}: applied {float(applied[slot]):g}, "
                                  f"must {int(must[shard][slot])}, may {int(may[shard][slot])}")
            if ROWS in values:  # async: each acknowledged push's row once, each one only sent at most once
                applied = -values[ROWS][index * SLOTS:(index + 1) * SLOTS].double()
                missing, extra = applied < must[0] - EPS, applied > may[0] + EPS
                lost += int(missing.sum())
                duplicated += int(extra.sum())
                for slot in (missing | extra).nonzero().flatten()[:5].tolist():
                    misses.append(f"worker {index} push {slot}'s row: applied {float(applied[slot]):g}, "
                                  f"must {int(must[0][slot])}, may {int(may[0][slot])}")
        steps_ok = None
        if self.mode == "async":  # each push counted once on shard 0
            lost += max(0, sum(a for _, a, _, _ in counts) - global_step)
            duplicated += max(0, global_step - sum(s for s, _, _, _ in counts))
        if self.mode == "sync":  # every shard applied every released step exactly once
            applied_steps = [int(round(-values[n].item())) for n in ("ones/a", "ones/b")]
            steps_ok = applied_steps == [global_step, global_step]
            lost += sum(max(0, global_step - s) for s in applied_steps)
            duplicated += sum(max(0, s - global_step) for s in applied_steps)
        return lost, duplicated, averaged, steps_ok, misses

    def _acks(self) -> list[tuple[float, dict[int, int]]]:
        """Every push acknowledged in the phase, by time (CLOCK_MONOTONIC): (time, each shard's generation)."""
        fields = (line.split() for index in self.indices() for line in self.log_path(index).read_text().splitlines()
                  if line.startswith("acked"))
        return sorted(((float(f[-1][2:]), generations(f[-2])) for f in fields if f[-1].startswith("t=")),
                      key=lambda ack: ack[0])  # two at the same time: the generations (dicts) never compared

    def _replica_figures(self, acks: list[tuple[float, dict[int, int]]]) -> dict:
        """With --replicas 2: each failover and its time (bench/soak_replicas.py), the partitioned primaries
        fenced, the fresh backups started; else nothing."""
        if not self.replicated:
            return {}
        return {**failover_figures(self.shards.strikes, acks, self.started), "fenced": self.shards.fenced,
                "fresh_backups": self.shards.fresh}

    def _resize_figures(self, acks: list[float]) -> dict:
        """resizes, resizes_by_kind, resize_pause_p99_s and each resize with its pause (bench/resizes.py), from
        the times of the pushes acknowledged (sorted)."""
        for resize in self.resizes:
            resize.pause_s = round(pause_around(acks, resize), 3)
        p99 = percentile([r.pause_s for r in self.resizes if r.kind in RESIZES], 99)  # failing ones: listed alone
        failures = [{**f.figures(), "acked_while_cut_off": None if f.cut_off is None else
                     bisect.bisect(acks, f.cut_off[1]) - bisect.bisect(acks, f.cut_off[0])}
                    for f in self.resize_failures]
        return {"resizes": len(self.resizes), "resizes_by_kind": dict(collections.Counter(r.kind for r in self.resizes)),
                "resize_pause_p99_s": p99,
                "resize_events": [{"kind": r.kind, "what": r.what, "seconds": round(r.ended - r.began, 3),
                                   "pause_s": r.pause_s} for r in self.resizes],
                "resize_failures": failures, "timeline": self._timeline(acks)}

    def _timeline(self, acks: list[float]) -> dict:
        """Seconds since the phase began: each fault injected, each resize's span, each failed resize's time cut
        off, and the pushes acknowledged in each second (every worker's, merged)."""
        def since(moment: float) -> float:
            return round(moment - self.started, 2)

        per_second = collections.Counter(int(moment - self.started) for moment in acks)
        return {"faults": [[since(moment), kind] for moment, kind in self.fault_times],
                "resizes": [[since(r.began), since(r.ended), r.kind] for r in self.resizes],
                "cut_off": [[since(f.cut_off[0]), since(f.cut_off[1]), f.kind] for f in self.resize_failures
                            if f.cut_off is not None],
                "acked_per_second": [per_second[s] for s in range(max(per_second, default=-1) + 1)]}

    def _counts(self, index: int) -> tuple[int, int, list, list]:
        """Worker `index`'s pushes over all its incarnations: (sent, acknowledged, and for each shard, per
        slot, how many pushes must be there and how many may: acknowledged ones exactly once unless the shard
        dropped them as stale, sent ones that were never acknowledged at most once)."""
        import torch

        sent = acked = 0
        must = [torch.zeros(SLOTS, dtype=torch.long) for _ in range(SHARDS)]
        may = [torch.zeros(SLOTS, dtype=torch.long) for _ in range(SHARDS)]
        for line in self.log_path(index).read_text().splitlines():
            fields = line.split()
            if fields[0] == "sent":
                sent += 1
                for shard in range(SHARDS):
                    may[shard][int(fields[1]) % SLOTS] += 1
            elif fields[0] == "acked":
                acked += 1
                for shard, stale in enumerate(fields[3:3 + SHARDS]):
                    slot = int(fields[1]) % SLOTS
                    must[shard][slot] += int(stale == "0")
                    may[shard][slot] -= int(stale == "1")
        return sent, acked, must, may

    def _restore_differences(self, values: dict) -> list[str]:
        """The names whose value, restored onto one shard from the final checkpoint, differs from `values`."""
        import torch
        from torchps.client import PSClient
        from torchps.worker.local_cluster import LocalCluster

        tables = ["--table-dir", str(self.dir / "restored-tables")] if self.rows else []
        with LocalCluster(1, server_args=["--restore-from", str(self.ckpt), "--num-ps", "1", "--no-journal",
                                          *tables]) as one, \
                PSClient(one.cluster, connect_timeout=30) as client:
            client.declare([(name, 4 * n) for name, n in sizes().items()])
            restored = client.pull(ALL_NAMES)
            if self.rows:
                client.wait_for_tables([ROWS], timeout=30)
                restored[ROWS] = client.lookup_rows({ROWS: torch.arange(MAX_WORKERS * SLOTS)})[ROWS][:, 0]
        return [name for name in values if not torch.equal(restored[name], values[name])]


# -- the driver -----------------------------------------------------------------------------------------

def _seconds_range(text: str) -> tuple[float, float]:
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH in seconds, got {text!r}") from None
    if not 0 <= low <= high <= 600:
        raise argparse.ArgumentTypeError(f"expected 0 <= LOW <= HIGH <= 600, got {text!r}")
    return low, high


def _kinds(text: str) -> tuple[str, ...]:
    chosen = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = sorted(set(chosen) - set(KINDS + REPLICA_KINDS))
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown kinds {unknown}; the kinds are {', '.join(KINDS + REPLICA_KINDS)}")
    return chosen


def _kinds_for(kinds: tuple[str, ...] | None, replicas: int) -> tuple[str, ...]:
    """The kinds a run draws: `kinds` (--kinds), or every kind its --replicas allows; ArgumentTypeError for one
    it does not (replica kinds without backups, shard resizes with them)."""
    allowed = REPLICATED_KINDS if replicas == 2 else KINDS
    if kinds is None:
        return allowed
    refused = [kind for kind in kinds if kind not in allowed]
    if refused:
        raise argparse.ArgumentTypeError(f"--replicas {replicas} draws none of {', '.join(refused)}: "
                                         + ("the replica kinds need --replicas 2" if replicas == 1 else
                                            "shard resizes are left out with backups (bench/soak_replicas.py)"))
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Chaos soak of torchps (see the module docstring).")
    parser.add_argument("--minutes", type=float, default=10.0, help="total time, split between async and sync")
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    parser.add_argument("--seed", type=int, default=0, help="the chaos loop's random seed")
    parser.add_argument("--fault-every", type=_seconds_range, default=FAULT_EVERY, metavar="LOW,HIGH",
                        help="seconds between two faults, drawn uniformly from this range (default 2,5)")
    parser.add_argument("--modes", default="async,sync", choices=["async,sync", "async", "sync"], metavar="MODES",
                        help="the phases, in order; --minutes is split between them")
    parser.add_argument("--kinds", type=_kinds, metavar="KIND,...",
                        help="the kinds of fault and resize drawn, each once per round (default: all that "
                             "--replicas allows)")
    parser.add_argument("--replicas", type=int, default=1, choices=[1, 2],
                        help="processes per shard: 2 runs a backup beside each (bench/soak_replicas.py)")
    parser.add_argument("--keep", type=pathlib.Path, help="keep every log, checkpoint and journal in this new folder")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--cluster", "--index", "--mode", "--log", "--stop-file", "--leave-file", "--credentials"):
        parser.add_argument(flag, help=argparse.SUPPRESS, type=int if flag == "--index" else str)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.worker:
        return worker_main(args)
    try:
        kinds = _kinds_for(args.kinds, args.replicas)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    rng = random.Random(args.seed)
    phases = []
    modes = args.modes.split(",")
    workdir = (contextlib.nullcontext(str(args.keep)) if args.keep
               else tempfile.TemporaryDirectory(prefix="torchps-soak-"))
    with workdir as tmp:
        for mode in modes:
            seconds = args.minutes * 60 / len(modes)
            print(f"[soak] {mode} phase: {seconds:.0f} s of chaos", flush=True)
            phases.append(Phase(mode, seconds, pathlib.Path(tmp), rng, args.fault_every, kinds, args.replicas).run())
    faults, resizes, saves = collections.Counter(), collections.Counter(), collections.Counter()
    for phase in phases:
        faults.update(phase["faults_injected"])
        resizes.update(phase["resizes_by_kind"])
        saves.update(phase["saves_during_moves"])
    pauses = [event["pause_s"] for phase in phases for event in phase["resize_events"] if event["kind"] in RESIZES]
    result = {"minutes": args.minutes, "seed": args.seed, "faults_injected": dict(faults),
              "resizes": sum(resizes.values()), "resizes_by_kind": dict(resizes),
              "resize_pause_p99_s": percentile(pauses, 99),
              "resizes_failed": sum(p["resizes_failed"] for p in phases),
              "resizes_recovered": sum(p["resizes_recovered"] for p in phases),
              "saves_during_moves": dict(saves),
              "moved_checkpoint_problems": sum(len(p["moved_checkpoint_problems"]) for p in phases),
              "pushes_acked": sum(p["pushes_acked"] for p in phases), "lost": sum(p["lost"] for p in phases),
              "duplicated": sum(p["duplicated"] for p in phases), "hangs": sum(p["hangs"] for p in phases),
              "checkpoint_complete": all(p["checkpoint_complete"] for p in phases),
              "worker_failures": sum(len(p["worker_failures"]) for p in phases),
              **{key: sum(p[key] for p in phases) for key in (
                  "failstops", "wedged", "hostile_pulls", "hostile_pulls_answered", "optimizer_toggles",
                  "optimizer_toggles_accepted")},
              "shard_crashes": sum(len(p["shard_crashes"]) for p in phases), **_replica_summary(phases),
              "phases": phases}
    print(f"{'phase':<6} {'faults':>6} {'acked':>7} {'lost':>5} {'dup':>4} {'hangs':>5} {'wedged':>6} "
          f"{'failstops':>9} {'checkpoint':>10}")
    for p in phases:
        print(f"{p['mode']:<6} {sum(p['faults_injected'].values()):>6} {p['pushes_acked']:>7} {p['lost']:>5} "
              f"{p['duplicated']:>4} {p['hangs']:>5} {p['wedged']:>6} {p['failstops']:>9} "
              f"{str(p['checkpoint_complete']):>10}")
    print("faults by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(faults.items())))
    print("resizes by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(resizes.items())))
    print(f"resizes failed {result['resizes_failed']}, recovered {result['resizes_recovered']}; checkpoints saved "
          "during moves: " + ", ".join(f"{k} {v}" for k, v in sorted(saves.items())))
    if args.replicas == 2:
        print(f"failovers {len(result['failovers'])}, p99 {result['failover_p99_s']} s (promoted: p99 "
              f"{result['promotion_p99_s']} s), unserved {result['failovers_unserved']}; partitioned primaries "
              f"fenced {result['fenced']}")
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    for phase in phases:
        unrecovered = [f"{f['kind']} ({f['what']}) not recovered: {f['how']}; repair {f['repair']}"
                       for f in phase["resize_failures"] if not f["recovered"]]
        for problem in (phase["hang_reasons"] + phase["worker_failures"] + phase["audit_misses"]
                        + phase["wedged_reasons"] + phase["failstop_lines"] + phase["shard_crashes"] + unrecovered
                        + phase["moved_checkpoint_problems"]):
            print(f"[soak] {phase['mode']}: {problem}")
    ok = (result["lost"] == result["duplicated"] == result["hangs"] == result["worker_failures"] == result["wedged"]
          == result["hostile_pulls_answered"] == result["optimizer_toggles_accepted"] == result["shard_crashes"]
          == result["moved_checkpoint_problems"] == 0
          and result["resizes_recovered"] == result["resizes_failed"] and result["checkpoint_complete"]
          and not result.get("failovers_unserved"))
    return 0 if ok else 1


def _replica_summary(phases: list[dict]) -> dict:
    """With --replicas 2 (phases that hold failovers): every failover of the run, with the phase's mode, their
    p99, those no successor served, and the partitioned primaries fenced; else nothing."""
    if not phases or "failovers" not in phases[0]:
        return {}
    failovers = [{"mode": p["mode"], **f} for p in phases for f in p["failovers"]]
    return {"replicas": 2, "failovers": failovers,
            "failover_p99_s": percentile([f["failover_s"] for f in failovers if f["failover_s"] is not None], 99),
            "promotion_p99_s": percentile([f["promoted_s"] for f in failovers if f["promoted_s"] is not None], 99),
            "failovers_unserved": sum(p["failovers_unserved"] for p in phases),
            "fenced": sum(p["fenced"] for p in phases), "fresh_backups": sum(p["fresh_backups"] for p in phases)}


if __name__ == "__main__":
    sys.exit(main())
