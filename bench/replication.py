#!/usr/bin/env python
"""What a shard's backup costs, and how fast and how exactly it takes its primary's place (issue #40).

    python bench/replication.py --mode cost --json bench/results/replication_cost.json   # about 10 minutes
    python bench/replication.py --mode failover --strike kill,partition --json bench/results/replication_failover.json
                                                                            # 10 rounds, 2 min
    python bench/replication.py --mode cost --only small --training async --rounds 3 --seconds 4
    python bench/replication.py --quick --json /tmp/replication.json   # the suite's check: both, seconds

Cost (--mode cost): 1 ps + 2 workers train an MLP in two jobs started side by
side, both with the journal on (--checkpoint-dir, the default guarantee):

    unreplicated  the shard alone
    replicated    the shard and a backup of it (ps-server --index 0 --cluster SPEC --replica-of PRIMARY
                  --bind 127.0.0.1:PORT --journal-dir DIR): every change is acknowledged once the
                  backup wrote its record too

Each worker process (torch.set_num_threads(1)) registers the model, computes
forward and backward on 4 fixed random batches of 100 in turn and
exchange()s (push the gradient, pull the values; SGD lr 0.01 on the ps), as
bench/journal.py's workers; with --no-compute it only exchange()s fixed
gradients, as journal.py --no-compute. Per model (--only: small, the seed
MLP 784-100-10; large, the 784-8192-2304-10 MLP, 25.3M float32) and training
mode (--training: async; sync, every step waiting for both workers'
gradients, and a worker idle while the other job runs kept in the quorum:
progress_seconds SYNC_IDLE_SECONDS), both jobs' workers join, take --warmup
steps together, then run --rounds windows each, the
jobs taking turns, the order rotated every round. An async window lasts
--seconds; a sync one is a fixed number of steps per worker (a worker that
stopped by the clock would leave the other waiting for its gradient), as
many as --seconds took in the unreplicated job's warm-up. The ratio is the
replicated job's steps/s over the unreplicated one's (medians; `_paired`:
the median of the per-round ratios). CPU ms per step of every process, the
backup's included: the ps and the backup from /proc over each window, the
workers' own (forward/backward and exchange apart). A backup that is not in
sync at the end (ps 0 dropped it) fails that model and mode's runs. Shards
and backups are forked from the same warm fork server (LocalCluster's).

Failover (--mode failover): --kills rounds, each a fresh 2-shard job with a
backup of ps 1 and --pushers processes pushing gradients of ones (async, SGD
lr 1, so a value is minus the pushes applied to it) to a variable of their
own on each shard, one push every --push-every s. Once every pusher had its
pushes acknowledged, ps 1's primary is SIGKILLed and its journal folder
deleted (its host is gone). `failover_s`: from the kill to the first push
acknowledged by the promoted backup (a pusher's first acknowledgement after
its client found ps 1 served elsewhere); `resumed_s`: to the last pusher's.
With --strike partition (or kill,partition: in turn) ps 1's primary is
SIGSTOPped instead, cut off from everyone with its connections open, and
SIGCONTed once the pushers stopped: it must find itself fenced and stop by
itself (exit 70) within 30 s (`fenced`).
The pushers go on --after s more and stop; then every value is pulled:
`lost` counts acknowledged pushes missing from a value, `duplicated` pushes
applied beyond those sent, and a round is `exact` when every value equals
minus its pusher's acknowledged pushes, as an uninterrupted run of the same
pushes leaves it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import pullpush  # noqa: E402 - bench/ is not a package
from journal import finish, percentiles, stop_workers  # noqa: E402
from network import fmt, target_rows, verdicts  # noqa: E402
from tf_peer import free_ports  # noqa: E402

MODELS = {"small": pullpush.SMALL_DIMS, "large": pullpush.BIG_DIMS}
TRAINING = ("async", "sync")
ARMS = ("unreplicated", "replicated")
LR = 0.01
IN_SYNC_TIMEOUT = 120.0  # a backup copies the primary's base before ps 0 records it in sync: seconds when loaded
SYNC_IDLE_SECONDS = 3600.0  # sync: a worker idle this long is left out of the quorum (a job waits for its turn)
FAILOVER_TIMEOUT = 60.0  # a kill round in which some pusher got no push acknowledged by then fails
STRIKES = ("kill", "partition")
FENCE_TIMEOUT = 30.0     # a resumed partitioned primary stops by itself (fenced) within this
TARGET_RATIO = {"async": 0.75, "sync": 0.90}
TARGETS = (
    *((f"{model}_{mode}_ratio", TARGET_RATIO[mode], False,
       f"{what}, 1 ps + 2 {mode} workers: replicated >= {TARGET_RATIO[mode]:.2f} x unreplicated steps/s")
      for model, what in (("small", "seed MLP"), ("large", "25.3M MLP")) for mode in TRAINING),
    ("failover_p99_s", 1.0, True, "the promoted backup acknowledges a push within 1 s of the kill (p99)"),
    ("failover_lost", 0, True, "acknowledged pushes lost"),
    ("failover_duplicated", 0, True, "pushes applied twice"),
    ("failover_inexact_rounds", 0, True, "rounds whose values differ from an uninterrupted run's"),
    ("failover_unfenced", 0, True, "partitioned primaries that did not stop by themselves once resumed"),
)


# -- a job on real processes ------------------------------------------------------------------------------

class Job:
    """`num_ps` shards on pre-picked ports of 127.0.0.1, each with its journal under `folder`, and with
    `backup_of` a backup of that shard (its copy in folder/backup-N). Started when made (a ServerUnavailableError
    if a shard does not serve); stop() ends every process."""

    def __init__(self, num_ps: int, folder: pathlib.Path, backup_of: int | None, workers: int):
        from torchps.cluster import Cluster
        from torchps.worker.local_cluster import SHARD_MODULE, LocalCluster

        folder.mkdir(parents=True)
        ports = free_ports(num_ps + 1)
        self.folder, self.backup_of = folder, backup_of
        self.spec = json.dumps({"ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
                                "worker": [f"127.0.0.1:{i + 1}" for i in range(max(1, workers))]})
        self.cluster = Cluster.from_json(self.spec)
        self.local = LocalCluster(num_ps, ports=ports[:num_ps], log_dir=folder,
                                  server_args=["--cluster", self.spec, "--checkpoint-dir", str(folder)])
        self.backup = None  # a ForkedChild or Popen
        self.backup_address = f"127.0.0.1:{ports[-1]}"
        try:
            self.local.start()
            if backup_of is not None:
                with open(folder / "backup.log", "wb") as log:  # forked as the shards are
                    self.backup = self.local.starter.start(
                        SHARD_MODULE, prog="ps-server", env={**os.environ, "PYTHONUNBUFFERED": "1"},
                        argv=["--index", str(backup_of), "--cluster", self.spec, "--replica-of",
                              self.cluster.ps[backup_of], "--bind", self.backup_address, "--journal-dir",
                              str(folder / f"backup-{backup_of}"), "--insecure", "--torch-threads", "1"],
                        stdout=log.fileno(), parent_death_signal=signal.SIGTERM)
        except BaseException:
            self.stop()
            raise

    def pids(self) -> dict[str, int]:
        """{"ps-N": pid, "backup": pid} of the processes running now."""
        pids = {f"ps-{i}": p.pid for i, p in enumerate(self.local.procs) if p is not None and p.poll() is None}
        return {**pids, **({"backup": self.backup.pid} if self.backup and self.backup.poll() is None else {})}

    def replica(self) -> object | None:
        """ps 0's record of the replicated shard (primary, backup, failovers), None if it has none. One call."""
        import grpc
        from torchps.proto import ps_pb2, ps_pb2_grpc

        with grpc.insecure_channel(self.cluster.ps[0]) as channel:
            layout = ps_pb2_grpc.ParameterServerStub(channel).GetLayout(ps_pb2.LayoutRequest(), timeout=30)
        return next((e for e in layout.replicas if e.index == self.backup_of), None)

    def wait_in_sync(self) -> None:
        """Blocks until ps 0 records the backup in sync; RuntimeError (with the logs) after IN_SYNC_TIMEOUT s."""
        deadline = time.monotonic() + IN_SYNC_TIMEOUT
        while (entry := self.replica()) is None or entry.backup != self.backup_address:
            if time.monotonic() > deadline or self.backup.poll() is not None:
                raise RuntimeError(f"the backup of ps {self.backup_of} was not in sync within {IN_SYNC_TIMEOUT:g} s"
                                   f"\n{self.logs()}")
            time.sleep(0.05)

    def logs(self) -> str:
        """The tail of every process's log."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                         for p in sorted(self.folder.glob("*.log")))

    def stop(self) -> None:
        if self.backup is not None and self.backup.poll() is None:
            self.backup.terminate()
            try:
                self.backup.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.backup.kill()
                self.backup.wait()
        self.local.stop()


# -- cost -----------------------------------------------------------------------------------------------------

def trainer_main(dims, cluster, index: int, compute: bool, cmd_q, res_q) -> None:
    """One worker: registers the MLP (created by the chief; it joins the job) and reports ready; then for each
    (start time, seconds, steps) off `cmd_q` trains from the start time for exactly `steps` steps, or without
    them until the seconds are up, and reports its steps, seconds and CPU seconds (all, and exchange()'s); None
    ends it. Without `compute` every .grad is set once and a step is exchange() alone."""
    try:
        import torch
        import torch.nn.functional as F

        from torchps.client import PSClient, TaskSpec
        from torchps.security import INSECURE

        torch.set_num_threads(1)
        torch.manual_seed(100 + index)
        model = pullpush.make_mlp(dims)
        xs, ys = torch.rand(4, pullpush.BATCH, dims[0]), torch.randint(0, dims[-1], (4, pullpush.BATCH))
        with PSClient(cluster, task=TaskSpec("worker", index), security=INSECURE) as client:
            exchange = client.register_module(model, create=False).exchange
            if not compute:
                for p in model.parameters():
                    p.grad = torch.randn_like(p) * 1e-3
            res_q.put(("ready", index, None))
            while (cmd := cmd_q.get()) is not None:
                start_at, seconds, steps = cmd
                time.sleep(max(0.0, start_at - time.time()))
                done, spent, cpu = 0, 0.0, time.process_time()
                while done < steps if steps else time.time() < start_at + seconds:
                    if compute:
                        model.zero_grad()
                        F.cross_entropy(model(xs[done % 4]), ys[done % 4]).backward()
                    began = time.process_time()
                    exchange()
                    spent += time.process_time() - began
                    done += 1
                res_q.put(("result", index, {"steps": done, "seconds": time.time() - start_at,
                                             "cpu_seconds": time.process_time() - cpu, "update_cpu_seconds": spent}))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        res_q.put(("error", index, traceback.format_exc()))


class Pool:
    """A job's worker processes (trainer_main), started at once; close() ends them."""

    def __init__(self, job: Job, dims, args, context):
        self.job = job
        self.res_q, self.cmd_qs = context.Queue(), [context.Queue() for _ in range(args.workers)]
        self.procs = [context.Process(target=trainer_main, daemon=True, name=f"replication-worker-{i}",
                                      args=(dims, job.cluster, i, not args.no_compute, self.cmd_qs[i], self.res_q))
                      for i in range(args.workers)]
        for proc in self.procs:
            proc.start()

    def run(self, seconds: float, steps: int) -> tuple[list[dict], dict[str, float]]:
        """One window of every worker (`steps` each, or without them `seconds`): their results, and the CPU
        seconds each of the job's shard processes used meanwhile. Blocks until every worker reported."""
        pids = self.job.pids()
        before = {name: pullpush.cpu_seconds([pid]) for name, pid in pids.items()}
        start_at = time.time() + 0.2
        for q in self.cmd_qs:
            q.put((start_at, seconds, steps))
        got = pullpush.collect(self.res_q, self.procs, "result", seconds * 20 + 300)
        return got, {name: pullpush.cpu_seconds([pid]) - before[name] for name, pid in pids.items()}

    def close(self) -> None:
        stop_workers(self.procs, self.cmd_qs)


def cost_group(model: str, mode: str, args, folder: pathlib.Path) -> dict:
    """Both jobs of one model and training mode, interleaved (see the module docstring): per job every round's
    per-worker results, the ps's and the backup's CPU seconds per round, and the warm-up's steps/s."""
    import torch

    from torchps.client import Optimizer, PSClient
    from torchps.security import INSECURE

    dims = MODELS[model]
    context = pullpush.worker_processes()
    pools: dict[str, Pool] = {}
    with contextlib.ExitStack() as stack:
        for arm in ARMS:
            job = Job(1, folder / f"{model}-{mode}-{arm}", 0 if arm == "replicated" else None, args.workers)
            stack.callback(job.stop)
            torch.manual_seed(0)
            with PSClient(job.cluster, security=INSECURE) as chief:
                if mode == "sync":  # every step all N workers' gradients; a job idles while the other runs
                    chief.configure("sync", replicas_to_aggregate=args.workers, total_num_replicas=args.workers,
                                    progress_seconds=SYNC_IDLE_SECONDS)
                chief.register_module(pullpush.make_mlp(dims), Optimizer("sgd", lr=LR), create=True)
            if job.backup is not None:
                job.wait_in_sync()
            pools[arm] = Pool(job, dims, args, context)
            stack.callback(pools[arm].close)
        for pool in pools.values():  # every worker joined: a sync job's warm-up steps are in step
            pullpush.collect(pool.res_q, pool.procs, "ready", pullpush.READY_TIMEOUT)
        warm = {arm: sum(w["steps"] / w["seconds"] for w in pool.run(0, args.warmup[model])[0]) / args.workers
                for arm, pool in pools.items()}  # each worker's steps/s
        # sync: every worker takes as many steps as the unreplicated job's warm-up took in --seconds
        steps = max(2, round(args.seconds[model] * warm["unreplicated"])) if mode == "sync" else 0
        out = {arm: {"raw": [], "ps_cpu_seconds": [], "backup_cpu_seconds": [], "warmup_steps_per_s": warm[arm]}
               for arm in ARMS}
        for r in range(args.rounds):
            for arm in ARMS[r % 2:] + ARMS[:r % 2]:  # rotated to cancel drift
                got, spent = pools[arm].run(args.seconds[model], steps)
                out[arm]["raw"].append(got)
                out[arm]["ps_cpu_seconds"].append(spent["ps-0"])
                out[arm]["backup_cpu_seconds"].append(spent.get("backup"))
            pullpush.log(f"{model} {mode} round {r + 1}/{args.rounds}: " + ", ".join(
                f"{arm} {sum(w['steps'] / w['seconds'] for w in out[arm]['raw'][-1]):.2f} steps/s" for arm in ARMS))
        replicated = pools["replicated"].job
        entry = replicated.replica()
        if entry is None or entry.backup != replicated.backup_address:
            raise RuntimeError(f"ps 0 dropped its backup during the run\n{replicated.logs()}")
    return {**out, "sync_steps_per_window": steps or None}


def summarize_group(group: dict) -> dict:
    """steps/s per job (each round's, the median), the ratio and its paired form, CPU ms per step by process."""
    out = {"rates": {}, "steps_per_s": {}, "cpu_per_step": {}}
    for arm in ARMS:
        runs = group[arm]["raw"]
        out["rates"][arm] = [sum(w["steps"] / w["seconds"] for w in run) for run in runs]
        out["steps_per_s"][arm] = pullpush.median(out["rates"][arm])
        backup = group[arm]["backup_cpu_seconds"]
        server = [p + (b or 0.0) for p, b in zip(group[arm]["ps_cpu_seconds"], backup)]
        cpu = pullpush.cpu_per_step(runs, server)  # compute, exchange, server (ps + backup), total, cores busy
        steps = sum(w["steps"] for run in runs for w in run)
        cpu["ps_ms"] = 1e3 * sum(group[arm]["ps_cpu_seconds"]) / steps
        cpu["backup_ms"] = 1e3 * sum(backup) / steps if None not in backup else None
        out["cpu_per_step"][arm] = cpu
    out["ratio"] = out["steps_per_s"]["replicated"] / out["steps_per_s"]["unreplicated"]
    out["ratio_paired"] = pullpush.median([r / u for u, r in zip(out["rates"]["unreplicated"],
                                                                   out["rates"]["replicated"])])
    return out


def cost(args, results: dict, folder: pathlib.Path) -> bool:
    """Every model and training mode's cost_group into `results` (its ratio keys too); a group that fails is
    recorded with its error and the others go on. True if none failed."""
    ok = True
    for model in args.models:
        for mode in args.training:
            try:
                group = cost_group(model, mode, args, folder)
            except Exception as exc:  # noqa: BLE001 - one failed group must not end the others
                results["cost"].setdefault(model, {})[mode] = {"error": str(exc)}
                pullpush.log(f"{model} {mode} FAILED: {str(exc)[-3000:]}")
                ok = False
                continue
            summary = results["cost"].setdefault(model, {})[mode] = {**summarize_group(group), "raw": group}
            results[f"{model}_{mode}_ratio"] = summary["ratio"]
            results[f"{model}_{mode}_ratio_paired"] = summary["ratio_paired"]
    return ok


# -- failover ---------------------------------------------------------------------------------------------------

def pusher_main(cluster, index: int, floats: int, every: float, warm: int, stop, res_q) -> None:
    """Pushes ones to its variables fo/INDEX/a (ps 0) and fo/INDEX/b (ps 1), one push every `every` s, until
    `stop`; reports "warm" after `warm` acknowledged pushes, "moved" with the time of its first push acknowledged
    once its client found ps 1 served elsewhere (a failover), and its counts at the end."""
    try:
        import torch

        from torchps.client import PSClient
        from torchps.errors import PSError
        from torchps.security import INSECURE

        torch.set_num_threads(1)
        grads = {f"fo/{index}/a": torch.ones(floats), f"fo/{index}/b": torch.ones(floats)}
        sent = acked = 0
        moved_at, errors = None, []
        with PSClient(cluster, security=INSECURE) as client:
            client.declare(grads)
            while not stop.is_set():
                sent += 1
                try:
                    client.push(grads)
                except PSError as exc:  # not acknowledged: it may or may not have been applied
                    errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                    continue
                acked += 1
                if acked == warm:
                    res_q.put(("warm", index, None))
                # the first push acknowledged at ps 1's new address: by the promoted backup (the client's
                # addresses are private; the one it calls changes only when it follows a failover)
                if moved_at is None and client._fanout.channels.addresses[1] != cluster.ps[1]:
                    moved_at = time.time()
                    res_q.put(("moved", index, moved_at))
                time.sleep(every)
        res_q.put(("result", index, {"sent": sent, "acked": acked, "errors": errors, "moved_at": moved_at}))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        res_q.put(("error", index, traceback.format_exc()))


def kill_round(args, folder: pathlib.Path, strike: str) -> dict:
    """One failover round (see the module docstring) of `strike` (kill, partition): its timings, the pushers'
    counts and the audit."""
    import torch

    from torchps.client import Optimizer, PSClient
    from torchps.ps_server.failstop import EXIT_CODE
    from torchps.security import INSECURE

    names = [f"fo/{i}/{part}" for i in range(args.pushers) for part in "ab"]  # round robin: a on ps 0, b on ps 1
    job = Job(2, folder, 1, args.pushers)
    context = pullpush.worker_processes()
    procs = []
    fenced = None
    try:
        with PSClient(job.cluster, security=INSECURE) as chief:
            chief.create_variables({n: torch.zeros(args.push_floats) for n in names}, Optimizer("sgd", lr=1.0))
            if [chief.placement.shard_of(n) for n in names[:2]] != [0, 1]:
                raise RuntimeError("the pushers' variables are not on ps 0 and ps 1 as expected")
        job.wait_in_sync()
        stop, res_q = context.Event(), context.Queue()
        procs = [context.Process(target=pusher_main, daemon=True, name=f"pusher-{i}",
                                 args=(job.cluster, i, args.push_floats, args.push_every, args.warm, stop, res_q))
                 for i in range(args.pushers)]
        for proc in procs:
            proc.start()
        pullpush.collect(res_q, procs, "warm", pullpush.READY_TIMEOUT)
        time.sleep(args.before)
        killed_at = time.time()
        if strike == "kill":
            job.local.kill_ps(1)  # SIGKILL; then the host's disk is gone too
            shutil.rmtree(folder / "journal" / "ps-1")
        else:
            job.local.procs[1].send_signal(signal.SIGSTOP)  # cut off from everyone, its connections open
        moved = pullpush.collect(res_q, procs, "moved", FAILOVER_TIMEOUT)
        time.sleep(args.after)
        stop.set()
        pushers = pullpush.collect(res_q, procs, "result", 120)
        for proc in procs:
            proc.join(timeout=30)
        if strike == "partition":  # resumed, the old primary finds itself fenced and stops by itself
            job.local.procs[1].send_signal(signal.SIGCONT)
            fenced = job.local.procs[1].wait(timeout=FENCE_TIMEOUT) == EXIT_CODE
        with PSClient(job.cluster, security=INSECURE) as client:  # finds ps 1 at its backup's address
            client.declare({n: torch.zeros(args.push_floats) for n in names})
            values = client.pull(names)
        entry = job.replica()
    except Exception as exc:
        raise RuntimeError(f"{exc}\n{job.logs()}") from exc
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()
        job.stop()
    lost = duplicated = 0
    exact = True
    for i, pusher in enumerate(pushers):
        for part in "ab":
            value = values[f"fo/{i}/{part}"]
            applied = -int(value[0])
            exact &= bool(torch.all(value == value[0])) and applied == pusher["acked"]
            lost += max(0, pusher["acked"] - applied)
            duplicated += max(0, applied - pusher["sent"])
            pusher[f"applied_{part}"] = applied
    return {"strike": strike, "failover_s": min(moved) - killed_at, "resumed_s": max(moved) - killed_at,
            "fenced": fenced, "lost": lost,
            "duplicated": duplicated, "exact": exact, "pushers": pushers,
            "replica": {"primary": entry.primary, "backup": entry.backup, "failovers": entry.failovers},
            "promoted_address": job.backup_address}


def failover(args, folder: pathlib.Path) -> dict:
    """--kills rounds; a round that fails is recorded with its error and the others go on."""
    rounds = []
    for k in range(args.kills):
        began = time.monotonic()
        strike = args.strikes[k % len(args.strikes)]
        try:
            result = kill_round(args, folder / f"kill-{k + 1}", strike)
            pullpush.log(f"{strike} {k + 1}/{args.kills}: failover {result['failover_s']:.3f} s, all pushers "
                         f"{result['resumed_s']:.3f} s, lost {result['lost']}, duplicated {result['duplicated']}, "
                         f"exact {result['exact']} ({time.monotonic() - began:.0f} s)")
        except Exception as exc:  # noqa: BLE001 - one failed round must not end the others
            result = {"strike": strike, "error": str(exc)}
            pullpush.log(f"{strike} {k + 1}/{args.kills} FAILED: {str(exc)[-3000:]}")
        rounds.append(result)
    done = [r for r in rounds if "error" not in r]
    times = [r["failover_s"] for r in done]
    spread = {k.replace("_ms", "_s"): v / 1e3 for k, v in percentiles(times).items() if k.endswith("_ms")} \
        if times else {}
    return {"rounds": rounds, "failed_rounds": len(rounds) - len(done), "failover_s": times,
            "failover_p50_s": spread.get("p50_s"), "failover_p99_s": spread.get("p99_s"),
            "failover_max_s": spread.get("max_s"),
            "resumed_s": [r["resumed_s"] for r in done],
            "failover_lost": sum(r["lost"] for r in done) if done else None,
            "failover_duplicated": sum(r["duplicated"] for r in done) if done else None,
            "failover_inexact_rounds": sum(not r["exact"] for r in done) if done else None,
            "failover_unfenced": sum(r["fenced"] is False for r in done) if done else None,
            **{f"failover_{strike}_max_s": max((r["failover_s"] for r in done if r["strike"] == strike),
                                               default=None) for strike in STRIKES},
            "pushes_acked": sum(p["acked"] for r in done for p in r["pushers"])}


# -- the report ----------------------------------------------------------------------------------------------

def cost_table(results: dict) -> list[str]:
    rows = ["| model | training | job | steps/s (median) | per round | replicated / unreplicated (paired) | "
            "CPU ms/step: ps | backup | workers' compute | workers' exchange | all | cores busy |",
            "| --- " * 12 + "|"]
    for model, by_mode in results["cost"].items():
        for mode, g in by_mode.items():
            if "error" in g:
                rows.append(f"| {model} | {mode} | failed: {g['error'].splitlines()[0][:160]} |" + " |" * 9)
                continue
            for arm in ARMS:
                cpu = g["cpu_per_step"][arm]
                ratio = "1" if arm == "unreplicated" else f"{g['ratio']:.3f} ({g['ratio_paired']:.3f})"
                rows.append(f"| {model} | {mode} | {arm} | {g['steps_per_s'][arm]:.2f} | "
                            f"{', '.join(f'{v:.2f}' for v in g['rates'][arm])} | {ratio} | {cpu['ps_ms']:.1f} | "
                            f"{fmt(cpu['backup_ms'], 1)} | {cpu['compute_ms']:.1f} | {cpu['update_ms']:.1f} | "
                            f"{cpu['total_ms']:.1f} | {cpu['cores_busy']:.2f} |")
    return rows


def failover_table(f: dict) -> list[str]:
    rows = ["", "| round | strike | failover s | all pushers s | pushes acked | lost | duplicated | exact | "
            "fenced |", "| --- " * 9 + "|"]
    for k, r in enumerate(f["rounds"], 1):
        strike = r.get("strike", "kill")
        rows.append(f"| {k} | {strike} | failed: {r['error'].splitlines()[0][:160]} | | | | | | |" if "error" in r
                    else f"| {k} | {strike} | {r['failover_s']:.3f} | {r['resumed_s']:.3f} | "
                    f"{sum(p['acked'] for p in r['pushers'])} | {r['lost']} | {r['duplicated']} | {r['exact']} | "
                    f"{'' if r.get('fenced') is None else r['fenced']} |")
    rows.append(f"\nfailover_s p50 {fmt(f['failover_p50_s'], 3)}, p99 {fmt(f['failover_p99_s'], 3)}, max "
                f"{fmt(f['failover_max_s'], 3)} over {len(f['failover_s'])} rounds; {f['failed_rounds']} failed")
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--json", type=pathlib.Path, help="write all results and raw figures here")
    parser.add_argument("--mode", default="both", choices=["cost", "failover", "both"])
    parser.add_argument("--only", choices=list(MODELS), help="cost: one model (default both)")
    parser.add_argument("--training", default=",".join(TRAINING), help="cost: of async,sync (default both)")
    parser.add_argument("--rounds", type=int, default=5, help="cost: windows per job (default 5)")
    parser.add_argument("--seconds", type=float, help="cost: one window (default 5 small, 10 large)")
    parser.add_argument("--warmup", type=int, help="cost: untimed steps per worker first (default 30 small, "
                        "8 large: past the journal's third compaction)")
    parser.add_argument("--workers", type=int, default=2, help="cost: workers per job (default 2)")
    parser.add_argument("--no-compute", action="store_true", help="cost: workers that only exchange() fixed "
                        "gradients, no forward or backward")
    parser.add_argument("--kills", type=int, default=10, help="failover: rounds (default 10)")
    parser.add_argument("--strike", default="kill", help="failover: of kill (SIGKILL, journal folder deleted), "
                        "partition (SIGSTOP until the backup served, then SIGCONT: the old primary must stop by "
                        "itself), taken in turn (default kill)")
    parser.add_argument("--pushers", type=int, default=3, help="failover: pushing processes (default 3)")
    parser.add_argument("--push-floats", type=int, default=1024, help="failover: floats per variable (default 1024)")
    parser.add_argument("--push-every", type=float, default=0.01, help="failover: s between a pusher's pushes "
                        "(default 0.01)")
    parser.add_argument("--warm", type=int, default=20, help="failover: pushes each pusher has acknowledged "
                        "before the kill (default 20)")
    parser.add_argument("--before", type=float, default=1.0, help="failover: s of pushes after that, before the "
                        "kill (default 1)")
    parser.add_argument("--after", type=float, default=1.0, help="failover: s of pushes after every pusher's "
                        "first one after the kill (default 1)")
    parser.add_argument("--dir", type=pathlib.Path, help="where the journals go (default: the temporary folder)")
    parser.add_argument("--quick", action="store_true", help="the suite's check: the seed MLP, 1 round of 0.5 s, "
                        "2 kills, 2 pushers")
    args = parser.parse_args(argv)
    if args.quick:
        args.only, args.rounds, args.seconds, args.warmup = "small", 1, 0.5, 3
        args.kills, args.pushers, args.warm, args.before, args.after = 2, 2, 5, 0.2, 0.2
    args.models = [args.only] if args.only else list(MODELS)
    args.training = [t.strip() for t in args.training.split(",") if t.strip()]
    args.strikes = [t.strip() for t in args.strike.split(",") if t.strip()]
    if set(args.strikes) - set(STRIKES) or not args.strikes:
        parser.error(f"--strike: of {', '.join(STRIKES)}")
    if set(args.training) - set(TRAINING) or not args.training:
        parser.error(f"--training: of {', '.join(TRAINING)}")
    args.seconds = {m: args.seconds or (5.0 if m == "small" else 10.0) for m in args.models}
    args.warmup = {m: args.warmup or (30 if m == "small" else 8) for m in args.models}
    if args.rounds < 1 or args.kills < 1 or args.pushers < 1 or min(args.warmup.values()) < 2:
        parser.error("--rounds, --kills and --pushers must be >= 1 and --warmup >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from torchps.client import tune_malloc
    from torchps.memory import malloc_env

    os.environ.update(malloc_env())  # every process gets the same allocator settings, as pullpush.py
    tune_malloc()
    started = time.monotonic()
    config = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
    results: dict = {"config": config, "cost": {}, "failover": None, **pullpush.environment(),
                     **{key: None for key, *_ in TARGETS}}
    failed = False
    with tempfile.TemporaryDirectory(prefix="torchps-bench-replication-", dir=args.dir) as folder:
        if args.mode in ("cost", "both"):
            failed = not cost(args, results, pathlib.Path(folder, "cost"))
        if args.mode in ("failover", "both"):
            results["failover"] = failover(args, pathlib.Path(folder, "failover"))
            results.update({k: v for k, v in results["failover"].items()
                            if k.startswith("failover_") and k != "failover_s"})
            failed |= results["failover"]["failed_rounds"] > 0
    results["targets"] = verdicts(results, TARGETS)
    finish(results, started, args)
    lines = cost_table(results) if results["cost"] else []
    lines += failover_table(results["failover"]) if results["failover"] else []
    print("\n".join(lines + target_rows(results["targets"])))
    print(f"\n{args.workers} workers per job, {args.rounds} rounds; load {results['machine']['loadavg_start'][0]:.1f} "
          f"-> {results['machine']['loadavg_end'][0]:.1f}; {results['wall_seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
