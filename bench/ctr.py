#!/usr/bin/env python
"""Criteo-shaped click-through-rate benchmark: DLRM on a Criteo Kaggle-layout click stream, trained sync and async.

    python bench/ctr.py --json bench/results/ctr.json     # about 4 minutes on 2 cores
    python bench/ctr.py --quick                            # a try: small and short (the test's)
    python bench/ctr.py --cardinality-cap 0                # Criteo's full cardinalities (33.8M ids)
    python bench/ctr.py --criteo-tsv train.txt             # real Criteo data: one file cut into days
    python bench/ctr.py --criteo-tsv day_0 --criteo-tsv day_1 --criteo-tsv day_2   # a file a day
    python bench/ctr.py --server-arg=--torch-threads=2     # a ps-server flag for every shard (repeatable)

The data (bench/ctr_data.py): 13 dense features and 26 categorical fields
with Criteo Kaggle's cardinalities (at most --cardinality-cap ids each: the
tables' hash size), days 1 .. --days for training, in time order, and the
next day held out. Made here by default: ids drawn Zipf(--alpha), clicks from
a hidden model drifting slowly from day to day (--drift-days, --churn);
or read from Criteo TSV files (--criteo-tsv).

The model is DLRM (examples/dlrm.py) with the MLPs of DLRM's Criteo Kaggle
run (bottom 13-512-256-64-16, top 367-512-256-1, --bottom/--top) and one
embedding table of width --dim per field on the shards. The tables are
dynamic (num_embeddings None): a row exists once its id was trained on, so a
table holds the ids the stream used, not its whole id space; unseen ids read
zeros. Rows train by server-side Adagrad, dense layers by server-side Adam.

For each mode of --modes, one after the other on the same days: --ps
ps-server processes (LocalCluster; --server-arg flags passed to each), this
process as the chief (it configures the mode, creates the variables and
tables, and evaluates), and --workers worker processes. Worker i trains
samples i, i + W, ... of each day, in time order, in batches of
--batch-size: prefetch the batch's rows (one LookupRows per shard), forward
and backward, exchange (rows' and dense gradients pushed, dense values
pulled; sync: held until every worker's push of the step is in, and
averaged). Timing starts when every worker is ready and ends when the last
has finished. Then the chief scores the held-out day.

Reported per mode: samples/s, CPU seconds of every process over the timed
part (shards from /proc, workers and chief their own) and samples/s per core
of that CPU, each shard's rows looked up and updated per second (its tables'
rows_read and rows_pushed counters in GetStatus), bytes the shards read from
and wrote to storage per sample (/proc/PID/io), gradient bytes pushed per
sample, peak RSS of every process (VmHWM), and the held-out day's AUC and
log loss (with the hidden model's own AUC on synthetic data). A cache hit
rate applies to tables kept on SSD only: these tables are in memory, so
there is none to report. The bars (issue 42): >= 140 samples/s per core
(NVIDIA's CPU-only DLRM: 17.7k samples/s on 128 cores) and async AUC within
0.002 of sync AUC.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F

import ctr_data
from ctr_data import dlrm
from ctr_memory import MemoryBound, RssSampler, status_bytes
from pullpush import collect, cpu_seconds, environment, log, worker_processes
from torchps.sizes import parse_bytes

PREFIX = "ctr/"
READY_SECONDS = 300.0    # workers start, load their days and join: on a loaded 2-core machine
TRAIN_SECONDS = 3600.0   # the longest a mode's training may take before the run fails
RECOVERY_SECONDS = 900.0  # the longest a SIGKILLed shard may take to replay its journal and serve again
PER_CORE_BAR = 140.0     # samples/s per core: NVIDIA's CPU-only DLRM, 17.7k samples/s on 128 cores
AUC_BAR = 0.002          # |async AUC - sync AUC|
SSD_BAR = 0.70           # samples/s with the tables on SSD over the same job's in RAM (Meta's offloading: 0.74 at 37x)
TABLE_OVER_LIMIT = 10.0  # a shard's table rows (their bytes in RAM) over its --max-memory
SSD_STORAGES = {"ssd": "SSD", "ssd-next": "SSD, next batch announced"}  # --storages on SSD: their names in targets
# The default hash size: 287,398 ids in all, so that the default's 360,000 training samples are 1.25 an id, near
# Criteo Kaggle's 1.16 (6/7 of its 45.8M samples to train on, 33.8M ids): most ids are seen a few times at most.
CARDINALITY_CAP = 30_000
NO_CACHE = "cache hit rate: applies to tables on SSD only; these tables are in memory"


def widths(text: str) -> tuple[int, ...]:
    return tuple(int(w) for w in text.split(",") if w.strip())


def make_model(args) -> dlrm.DLRM:
    return dlrm.DLRM([None] * len(ctr_data.CRITEO_KAGGLE_CARDINALITIES), args.dim, args.table_lr,
                     bottom=args.bottom, top=args.top)


def peak_rss(pid: int | str) -> int | None:
    """A process's peak resident set (VmHWM), in bytes; None if it cannot be read."""
    return status_bytes(pid, "VmHWM")


def storage_io(pid: int) -> tuple[int, int] | None:
    """(bytes read from, bytes written to) storage by a process so far (/proc/PID/io); None if unreadable."""
    try:
        fields = dict(line.split(": ") for line in pathlib.Path(f"/proc/{pid}/io").read_text().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, ValueError, KeyError):
        return None


def tensors(arrays: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense, ids as one-id bags (n, 26, 1), clicks) as dlrm.DLRM takes them."""
    return (torch.from_numpy(arrays["dense"]), torch.from_numpy(arrays["ids"]).unsqueeze(2),
            torch.from_numpy(arrays["clicks"]))


# -- a worker ---------------------------------------------------------------------------------------------------

def worker_main(index: int, cluster, args, folder: pathlib.Path, go, leave, results, announce: bool = False) -> None:
    """Worker process `index`: reports 'ready' once joined with its days loaded, trains them in order when `go`
    is set, reports 'done' with its figures, and leaves the job only once `leave` is set (a sync quorum stays
    whole while the chief measures). With `announce`, each lookup announces the next batch's ids (warming
    the shards' caches). Anything raised is reported as 'error'."""
    try:
        from torchps.client import Optimizer, PSClient, TaskSpec, tune_malloc

        tune_malloc()
        torch.set_num_threads(1)  # shards and workers share the machine's cores
        days = [tensors(ctr_data.load_share(folder, d, index, args.workers)) for d in range(args.days)]
        model = make_model(args)
        with PSClient(cluster, task=TaskSpec("worker", index), connect_timeout=60, timeout=600) as ps:
            binding = ps.register_module(model, Optimizer("adam", lr=args.lr), create=False, prefix=PREFIX)
            results.put(("ready", index, None))
            if not go.wait(READY_SECONDS):
                raise RuntimeError(f"no start within {READY_SECONDS:g} s")
            cpu = {"lookup": 0.0, "compute": 0.0, "exchange": 0.0}
            started, samples, steps = time.perf_counter(), 0, 0
            for dense, ids, clicks in days:
                for i in range(0, len(clicks), args.batch_size):
                    t0 = time.process_time()
                    batch_ids = ids[i:i + args.batch_size]
                    upcoming = ids[i + args.batch_size:i + 2 * args.batch_size] if announce else None
                    model.prefetch(batch_ids, upcoming if upcoming is not None and len(upcoming) else None)
                    t1 = time.process_time()
                    model.zero_grad(set_to_none=True)
                    F.binary_cross_entropy_with_logits(model(dense[i:i + args.batch_size], batch_ids),
                                                       clicks[i:i + args.batch_size]).backward()
                    t2 = time.process_time()
                    binding.exchange()
                    t3 = time.process_time()
                    cpu["lookup"] += t1 - t0
                    cpu["compute"] += t2 - t1
                    cpu["exchange"] += t3 - t2
                    samples += len(batch_ids)
                    steps += 1
            results.put(("done", index, {"samples": samples, "steps": steps, "seconds": time.perf_counter() - started,
                                         "cpu_s": sum(cpu.values()), "cpu_s_by_stage": cpu,
                                         "peak_rss_bytes": peak_rss("self")}))
            if not leave.wait(READY_SECONDS):
                raise RuntimeError(f"not released within {READY_SECONDS:g} s")
    except BaseException:  # noqa: BLE001 - report everything to the chief
        results.put(("error", index, traceback.format_exc()))


# -- one mode ---------------------------------------------------------------------------------------------------

def shard_counters(ps, pids: list[int]) -> list[dict]:
    """Each shard's counters now: its tables' rows read and pushed, rows and bytes held (RAM: the cache's for
    tables on SSD; and the rows' own bytes, as RAM tables would hold them), the SSD tables' cache hits and
    misses and store bytes, gradient bytes received, CPU seconds, storage bytes read and written."""
    out = []
    for shard, pid in enumerate(pids):
        status = ps.status(shard)
        tables = [t for t in status.tables if t.name.startswith(PREFIX)]
        out.append({"rows_read": sum(t.rows_read for t in tables), "rows_pushed": sum(t.rows_pushed for t in tables),
                    "rows": sum(t.rows for t in tables), "table_bytes": sum(t.bytes for t in tables),
                    "row_bytes": sum(t.rows * t.row_bytes for t in tables),
                    **{k: sum(getattr(t, k) for t in tables) for k in (
                        "cache_hits", "cache_misses", "cache_warmed", "disk_bytes_read", "disk_bytes_written",
                        "disk_bytes")},
                    "push_bytes": status.push_bytes_received, "cpu_s": cpu_seconds([pid]), "io": storage_io(pid)})
    return out


def storage_args(storage: str, args, folder: pathlib.Path, tag: str) -> list[str]:
    """The shards' flags for a run with `storage`: with --storages every run keeps a journal (the same job on
    both storages); on "ssd", --table-storage and --max-memory (and --table-cache)."""
    if args.storages == ["ram"]:
        return []
    out = ["--checkpoint-dir", str(folder / f"ckpt-{tag}")]
    if storage in SSD_STORAGES:
        out += ["--table-storage", "ssd", "--table-dir", str(folder / f"tables-{tag}"), "--max-memory", args.max_memory]
        out += ["--table-cache", args.table_cache] if args.table_cache else []
    return out


def recover_one(local, ps, pids: list[int], sampler: RssSampler | None, bounds: list) -> dict:
    """Kills shard 1 (SIGKILL), starts it again and waits until it answers: seconds until it answers, its peak
    resident set meanwhile, and whether every row it held reads back equal (a sample of 20,000 ids a table)."""
    ids = {t.name: torch.arange(20_000) for t in ps.status(1).tables if t.name.startswith(PREFIX)}
    before = ps.lookup_rows(ids)
    local.kill_ps(1)
    began = time.perf_counter()

    def spawned(pid: int) -> None:  # bounded and sampled from its start: its recovery too
        if bounds[1] is not None:
            bounds[1].add(pid)
        if sampler is not None:
            sampler.set("ps1", pid)

    local.start_ps(1, timeout=RECOVERY_SECONDS, spawned=spawned)
    pid = ps.status(1).pid
    after = ps.lookup_rows(ids)
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "peak_rss_bytes": peak_rss(pid), "rows_compared": sum(len(i) for i in ids.values()),
            "rows_equal": all(torch.equal(before[n], after[n]) for n in ids), "pid": pid}


def run_mode(mode: str, args, folder: pathlib.Path, storage: str = "ram", tag: str = "") -> dict:
    """A fresh cluster trained in `mode` on the days in `folder`, its tables on `storage`, then scored on the
    held-out day. On "ssd": each shard under a memory cgroup of --memory-limit (if given) from its start, its
    resident set sampled every second, and shard 1 killed and restarted after the training (recover_one)."""
    from torchps.client import Optimizer, PSClient, TaskSpec
    from torchps.worker.local_cluster import LocalCluster

    ctx = worker_processes()
    torch.manual_seed(args.seed)  # the dense layers' initial values, the same in both modes
    model = make_model(args)
    ssd = storage in SSD_STORAGES
    tag = tag or mode
    (folder / f"logs-{tag}").mkdir()
    with LocalCluster(args.ps, workers=args.workers, chief=True,
                      server_args=[*args.server_arg, *storage_args(storage, args, folder, tag)],
                      log_dir=folder / f"logs-{tag}") as local, \
            PSClient(local.cluster, task=TaskSpec("chief", 0), connect_timeout=60, timeout=600) as ps:
        pids = [ps.status(s).pid for s in range(args.ps)]
        bounds = [MemoryBound.make(f"torchps-ctr-{os.getpid()}-{tag}-ps{s}", args.memory_limit)
                  if ssd and args.memory_limit else None for s in range(args.ps)]
        for bound, pid in zip(bounds, pids):
            if bound is not None:
                bound.add(pid)
        sampler = RssSampler({f"ps{s}": pid for s, pid in enumerate(pids)}).start() if ssd else None
        if mode == "sync":
            ps.configure("sync", replicas_to_aggregate=args.workers, total_num_replicas=args.workers)
        binding = ps.register_module(model, Optimizer("adam", lr=args.lr), prefix=PREFIX, join=False)
        go, leave, results = ctx.Event(), ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=worker_main, name=f"{mode}-worker-{i}",
                             args=(i, local.cluster, args, folder, go, leave, results, storage == "ssd-next"))
                 for i in range(args.workers)]
        for proc in procs:
            proc.start()
        try:
            collect(results, procs, "ready", READY_SECONDS)
            before, chief_cpu, began = shard_counters(ps, pids), time.process_time(), time.perf_counter()
            go.set()
            workers = collect(results, procs, "done", TRAIN_SECONDS)
            wall, chief_cpu = time.perf_counter() - began, time.process_time() - chief_cpu
            after = shard_counters(ps, pids)
            shard_rss = [peak_rss(pid) for pid in pids]
            recovery = recover_one(local, ps, pids, sampler, bounds) if ssd else None
            leave.set()
            for proc in procs:
                proc.join(timeout=60)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
                    proc.join()
        step = ps.global_step()
        binding.pull()
        auc, loss = dlrm.evaluate(model, *tensors(ctr_data.load_day(folder, args.days)))
        sampled = sampler.stop() if sampler is not None else {}
    out = figures(before, after, shard_rss, workers, wall, chief_cpu)
    out.update(held_out_auc=auc, held_out_log_loss=loss, global_step=step, storage=storage)
    if ssd:
        out.update(recovery=recovery, rss_samples=sampler.samples, memory_limit=args.memory_limit or None,
                   max_memory=args.max_memory, table_cache=args.table_cache or None,
                   memory_bound=[b.version if b is not None else MemoryBound.unavailable or None for b in bounds],
                   oom_kills=sum(b.oom_kills() for b in bounds if b is not None))
        for shard, bound in zip(out["shards"], bounds):
            shard["cgroup_peak_bytes"] = bound.peak() if bound is not None else None
        for s, shard in enumerate(out["shards"]):
            shard["rss_max_sampled_bytes"] = sampled.get(f"ps{s}")
    for bound in bounds:
        if bound is not None:
            bound.close()
    log(f"{mode} ({storage}): {out['samples']:,d} samples in {wall:.1f} s, {out['samples_per_s_per_core']:.0f} "
        f"samples/s per core, held-out AUC {auc:.4f}"
        + (f", cache hit rate {out['cache_hit_rate']:.3f}" if out["cache_hit_rate"] is not None else ""))
    return out


def figures(before: list[dict], after: list[dict], shard_rss: list, workers: list[dict], wall: float,
            chief_cpu: float) -> dict:
    """A mode's throughput, CPU and per-shard figures from the counters before and after its timed part."""
    samples = sum(w["samples"] for w in workers)
    shards = []
    for b, a, rss in zip(before, after, shard_rss):
        io = [y - x for x, y in zip(b["io"], a["io"])] if b["io"] and a["io"] else [None, None]
        shards.append({"rows_looked_up_per_s": (a["rows_read"] - b["rows_read"]) / wall,
                       "rows_updated_per_s": (a["rows_pushed"] - b["rows_pushed"]) / wall,
                       "cpu_s": a["cpu_s"] - b["cpu_s"], "peak_rss_bytes": rss, "rows_held": a["rows"],
                       "table_bytes": a["table_bytes"], "rows_bytes": a["row_bytes"],
                       "push_bytes": a["push_bytes"] - b["push_bytes"],
                       "storage_read_bytes": io[0], "storage_write_bytes": io[1],
                       **{k: a[k] - b[k] for k in ("cache_hits", "cache_misses", "cache_warmed", "disk_bytes_read",
                                                   "disk_bytes_written")}, "disk_bytes": a["disk_bytes"]})
    cpu = {"shards": sum(s["cpu_s"] for s in shards), "workers": sum(w["cpu_s"] for w in workers), "chief": chief_cpu}
    cpu["total"] = sum(cpu.values())

    def per_sample(key: str) -> float | None:
        values = [s[key] for s in shards]
        return None if None in values else sum(values) / samples

    asked = sum(s["cache_hits"] + s["cache_misses"] for s in shards)
    return {"samples": samples, "wall_s": wall, "samples_per_s": samples / wall, "cpu_s": cpu,
            "cores_busy": cpu["total"] / wall, "samples_per_s_per_core": samples / cpu["total"],
            "storage_read_bytes_per_sample": per_sample("storage_read_bytes"),
            "storage_write_bytes_per_sample": per_sample("storage_write_bytes"),
            "store_bytes_read_per_sample": per_sample("disk_bytes_read"),
            "store_bytes_written_per_sample": per_sample("disk_bytes_written"),
            "push_bytes_per_sample": per_sample("push_bytes"),
            "cache_hit_rate": sum(s["cache_hits"] for s in shards) / asked if asked else None,
            "cache_warmed_per_sample": sum(s["cache_warmed"] for s in shards) / samples,
            "shards": shards, "workers": workers, "chief_peak_rss_bytes": peak_rss("self")}


# -- report -----------------------------------------------------------------------------------------------------

def table(results: dict) -> str:
    modes = list(results["modes"])
    got = [results["modes"][m] for m in modes]

    def row(label: str, values) -> str:
        return f"| {label} | " + " | ".join(values) + " |"

    def mb(value) -> str:
        return "n/a" if value is None else f"{value / 2**20:.0f}"

    def opt(value, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    lines = [row("figure", modes), row("---", ["---"] * len(modes)),
             row("samples trained", [f"{g['samples']:,d}" for g in got]),
             row("wall seconds", [f"{g['wall_s']:.1f}" for g in got]),
             row("samples/s", [f"{g['samples_per_s']:,.0f}" for g in got]),
             row("CPU s: shards / workers / chief", [
                 f"{g['cpu_s']['shards']:.1f} / {g['cpu_s']['workers']:.1f} / {g['cpu_s']['chief']:.1f}" for g in got]),
             row("cores busy", [f"{g['cores_busy']:.2f}" for g in got]),
             row(f"samples/s per core (bar >= {PER_CORE_BAR:g})", [f"{g['samples_per_s_per_core']:.0f}" for g in got]),
             row("held-out AUC", [f"{g['held_out_auc']:.4f}" for g in got]),
             row("held-out log loss", [f"{g['held_out_log_loss']:.4f}" for g in got])]
    for s in range(len(got[0]["shards"])):
        lines.append(row(f"shard {s}: rows looked up / updated per s", [
            f"{g['shards'][s]['rows_looked_up_per_s']:,.0f} / {g['shards'][s]['rows_updated_per_s']:,.0f}"
            for g in got]))
        lines.append(row(f"shard {s}: CPU s, peak RSS MB", [
            f"{g['shards'][s]['cpu_s']:.1f}, {mb(g['shards'][s]['peak_rss_bytes'])}" for g in got]))
    for w in range(len(got[0]["workers"])):
        lines.append(row(f"worker {w}: CPU s lookup / compute / exchange, peak RSS MB", [
            " / ".join(f"{v:.1f}" for v in g["workers"][w]["cpu_s_by_stage"].values())
            + f", {mb(g['workers'][w]['peak_rss_bytes'])}" for g in got]))
    lines += [row("chief (this process) peak RSS MB", [mb(g["chief_peak_rss_bytes"]) for g in got]),
              row("storage bytes read / written per sample (shards)", [
                  f"{opt(g['storage_read_bytes_per_sample'], '.1f')} / "
                  f"{opt(g['storage_write_bytes_per_sample'], '.1f')}" for g in got]),
              row("gradient bytes pushed per sample", [opt(g["push_bytes_per_sample"], ",.0f") for g in got]),
              row("cache hit rate", ["n/a (SSD tables only)" for _ in got])]
    return "\n".join(lines)


def storage_table(results: dict) -> str:
    """A row per run of --storages: throughput, cache, store traffic, memory and the recovery of shard 1."""
    def mb(value) -> str:
        return "n/a" if value is None else f"{value / 2**20:,.0f}"

    lines = ["| round | storage | mode | samples/s | per core | AUC | hit rate | store B read / written per sample "
             "| rows' MB per shard (min) | RSS MB max sampled (peak) | recovery s, peak MB, rows equal |",
             "|" + " --- |" * 11]
    for r in results["storage_runs"]:
        ssd = r["storage"] in SSD_STORAGES
        rec = r.get("recovery") or {}
        lines.append(
            f"| {r['round']} | {r['storage']} | {r['mode']} | {r['samples_per_s']:,.0f} | "
            f"{r['samples_per_s_per_core']:,.0f} | {r['held_out_auc']:.4f} | "
            + (f"{r['cache_hit_rate']:.3f} | {r['store_bytes_read_per_sample']:,.0f} / "
               f"{r['store_bytes_written_per_sample']:,.0f} | " if ssd else "n/a | n/a | ")
            + f"{mb(min(s['rows_bytes'] for s in r['shards']))} | "
            + (f"{mb(max(s['rss_max_sampled_bytes'] or 0 for s in r['shards']))} "
               f"({mb(max(s['peak_rss_bytes'] or 0 for s in r['shards']))}) | "
               f"{rec.get('seconds', 0):.1f}, {mb(rec.get('peak_rss_bytes'))}, {rec.get('rows_equal')} |" if ssd
               else f"n/a ({mb(max(s['peak_rss_bytes'] or 0 for s in r['shards']))}) | n/a |"))
    lines.append("")
    for storage, label in SSD_STORAGES.items():
        ratios = "; ".join(f"{m}: median {v['median']:.3f} of {', '.join(f'{x:.3f}' for x in v['ratios'])}"
                           for m, v in results.get(f"{storage.replace('-', '_')}_over_ram", {}).items())
        if ratios or storage == "ssd":
            lines.append(f"{label} samples/s over RAM's, pairs of rounds: {ratios or 'n/a'}")
    warmed = [f"{r['cache_warmed_per_sample']:.1f}" for r in results["storage_runs"] if r["storage"] == "ssd-next"]
    if warmed:
        lines.append(f"rows read into the caches ahead of their lookup per sample (ssd-next): {', '.join(warmed)}")
    lines.append(f"each shard's table rows over --max-memory: {results.get('table_over_max_memory') or 0:.1f}x")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--days", type=int, default=6, help="training days; the next one is held out (default 6)")
    parser.add_argument("--samples-per-day", type=int, default=60_000,
                        help="samples a day (with --criteo-tsv: at most, the day's first) (default 60,000)")
    parser.add_argument("--cardinality-cap", type=int, default=CARDINALITY_CAP,
                        help="ids per field at most: the tables' hash size; 0: Criteo's own (default 30,000)")
    parser.add_argument("--criteo-tsv", type=pathlib.Path, action="append",
                        help="read this Criteo TSV file (repeat: a file a day, the last held out) instead")
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids (default 1.05)")
    parser.add_argument("--drift-days", type=float, default=28.0,
                        help="days for the click model to turn into an independent draw; inf: stationary (default 28)")
    parser.add_argument("--churn", type=float, default=0.01,
                        help="share of each field's ids that change popularity rank a day (default 0.01)")
    parser.add_argument("--dim", type=int, default=16, help="embedding width (default 16, DLRM's for Kaggle)")
    parser.add_argument("--bottom", type=widths, default=(512, 256, 64), help="bottom MLP's hidden widths")
    parser.add_argument("--top", type=widths, default=(512, 256), help="top MLP's hidden widths")
    parser.add_argument("--batch-size", type=int, default=512, help="per worker (default 512)")
    parser.add_argument("--lr", type=float, default=1e-3, help="server-side Adam for the dense layers")
    parser.add_argument("--table-lr", type=float, default=0.05, help="server-side Adagrad for the rows")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--ps", type=int, default=2, help="ps-server processes (default 2)")
    parser.add_argument("--modes", default="sync,async", help="modes to run, in order (default sync,async)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="a flag for every ps-server, e.g. --server-arg=--torch-threads=2 (repeatable)")
    parser.add_argument("--storages", default="ram", help="where the shards keep the tables, run by run: ram, ssd, "
                        "ssd-next (on SSD, each lookup announcing the next batch's ids), or a comma-separated "
                        "order such as ram,ssd,ram,ssd (each mode of --modes in each); with more than ram every "
                        "run keeps a journal (default ram)")
    parser.add_argument("--max-memory", default="48M", help="ps-server --max-memory of a run on ssd (default 48M)")
    parser.add_argument("--table-cache", default="", help="ps-server --table-cache of a run on ssd (default: the "
                        "shard's, half of --max-memory)")
    parser.add_argument("--memory-limit", type=parse_bytes, default=0, help="a memory cgroup of this many bytes "
                        "around each shard of a run on ssd, e.g. 700M (default: none)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 days of 6,000 samples, small tables and MLPs")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.days, args.samples_per_day, args.cardinality_cap = 2, 6_000, 500
        args.bottom, args.top, args.batch_size = (64,), (64,), 256
    args.storages = [m.strip() for m in args.storages.split(",") if m.strip()]
    if not args.storages or not set(args.storages) <= {"ram", *SSD_STORAGES}:
        parser.error(f"--storages takes ram, ssd and/or ssd-next, comma-separated. Received: "
                     f"{','.join(args.storages)}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or not set(args.modes) <= {"sync", "async"} or len(set(args.modes)) != len(args.modes):
        parser.error(f"--modes takes sync and/or async, comma-separated. Received: {','.join(args.modes)}")
    for name in ("days", "samples_per_day", "dim", "batch_size", "workers", "ps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.cardinality_cap < 0 or not args.alpha > 0 or not args.drift_days > 0 or not 0 <= args.churn <= 1:
        parser.error("--cardinality-cap >= 0, --alpha > 0, --drift-days > 0 and 0 <= --churn <= 1")
    for path in args.criteo_tsv or ():
        if not path.is_file():
            parser.error(f"--criteo-tsv {path}: no such file")
    return args


def summarize(results: dict) -> None:
    """Adds the headline figures (each mode's AUC and samples/s per core, async - sync AUC) and the targets."""
    modes = results["modes"]
    targets = {}
    for m, got in modes.items():
        results[f"{m}_auc"] = got["held_out_auc"]
        results[f"{m}_samples_per_s_per_core"] = got["samples_per_s_per_core"]
        targets[f"{m} samples/s per core >= {PER_CORE_BAR:g}"] = got["samples_per_s_per_core"] >= PER_CORE_BAR
    if {"sync", "async"} <= set(modes):
        results["auc_async_minus_sync"] = modes["async"]["held_out_auc"] - modes["sync"]["held_out_auc"]
        targets[f"|async AUC - sync AUC| <= {AUC_BAR:g}"] = abs(results["auc_async_minus_sync"]) <= AUC_BAR
    if "storage_runs" in results:
        results.update(summarize_storages(results["storage_runs"], targets), targets=targets)
    else:
        results.update(cache_hit_rate=None, cache_hit_rate_note=NO_CACHE, targets=targets)


def summarize_storages(runs: list[dict], targets: dict) -> dict:
    """The SSD runs against the RAM runs of the same mode and round pair (ram and ssd runs interleaved: the i-th
    ssd run of a mode beside the i-th ram run): samples/s ratios (their median the headline), the table's bytes
    over --max-memory, resident sets and recovery against the limit; the bars' targets added to `targets`."""
    out: dict = {"ssd_over_ram": {}, "ssd_next_over_ram": {}}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        ram = [r for r in runs if r["mode"] == mode and r["storage"] == "ram"]
        for storage in SSD_STORAGES:
            ssd = [r for r in runs if r["mode"] == mode and r["storage"] == storage]
            ratios = [s["samples_per_s"] / r["samples_per_s"] for r, s in zip(ram, ssd)]
            if ratios:
                out[f"{storage.replace('-', '_')}_over_ram"][mode] = {"ratios": ratios,
                                                                       "median": float(np.median(ratios))}
                targets[f"{mode}: {SSD_STORAGES[storage]} samples/s >= {SSD_BAR:g} x RAM (median of pairs)"] = \
                    float(np.median(ratios)) >= SSD_BAR
    ssd = [r for r in runs if r["storage"] in SSD_STORAGES]
    if ssd:
        limit = parse_bytes(ssd[0]["max_memory"]) if ssd[0].get("max_memory") else None
        over = [min(s["rows_bytes"] for s in r["shards"]) / limit for r in ssd] if limit else []
        out["table_over_max_memory"] = min(over) if over else None
        out["cache_hit_rate"] = float(np.mean([r["cache_hit_rate"] for r in ssd]))
        if over:
            targets[f"each shard's table >= {TABLE_OVER_LIMIT:g} x --max-memory"] = min(over) >= TABLE_OVER_LIMIT
        if ssd[0]["memory_limit"]:
            rss = [s["rss_max_sampled_bytes"] or 0 for r in ssd for s in r["shards"]]
            out["rss_max_sampled_bytes"] = max(rss)
            targets["every shard's sampled RSS under --memory-limit, no OOM kill"] = \
                max(rss) < ssd[0]["memory_limit"] and not any(r["oom_kills"] for r in ssd)
            targets["a SIGKILLed shard recovers under --memory-limit, rows equal"] = all(
                r["recovery"]["rows_equal"] and (r["recovery"]["peak_rss_bytes"] or 0) < r["memory_limit"]
                for r in ssd)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    started, env = time.monotonic(), environment()
    with tempfile.TemporaryDirectory(prefix="torchps-bench-ctr-") as tmp:
        folder = pathlib.Path(tmp)
        log("making the days" if not args.criteo_tsv else f"reading {len(args.criteo_tsv)} Criteo TSV file(s)")
        try:
            data = ctr_data.make_days(args, folder)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        args.days = data["training_days"]  # with a TSV file a day: as many as files, less the held-out one
        log(f"{args.days} training days and a held-out one: {sum(data['samples_per_day']):,d} samples, "
            f"{data['rows_in_id_spaces']:,d} ids in the fields' id spaces")
        if args.storages == ["ram"]:
            results = {"data": data, "modes": {mode: run_mode(mode, args, folder) for mode in args.modes}}
        else:
            runs = [{"round": k, "storage": storage, "mode": mode,
                     **run_mode(mode, args, folder, storage, f"{k}-{storage}-{mode}")}
                    for k, storage in enumerate(args.storages) for mode in args.modes]
            results = {"data": data, "storage_runs": runs,
                       "modes": {r["mode"]: r for r in reversed(runs) if r["storage"] == args.storages[0]}}
    summarize(results)
    print("\n" + table(results))
    if "storage_runs" in results:
        print("\n" + storage_table(results))
    if "oracle_auc" in data:
        print(f"\nthe hidden model's own AUC on the held-out day: {data['oracle_auc']:.4f} (click rate "
              f"{data['held_out_click_rate']:.3f})")
    if "auc_async_minus_sync" in results:
        print(f"async AUC - sync AUC: {results['auc_async_minus_sync']:+.4f}")
    if "storage_runs" not in results:
        print(NO_CACHE)
    for name, ok in results["targets"].items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")
    env["machine"]["loadavg_end"] = os.getloadavg()  # the machine is shared: its load at both ends of the run
    results.update(config={k: v for k, v in vars(args).items() if k != "json"}, environment=env,
                   wall_seconds=time.monotonic() - started, command=" ".join(["python", *sys.argv]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
