#!/usr/bin/env python
"""What the journal costs: async training with and without it, interleaved (pullpush.py's training runs).

    python bench/journal.py --json bench/results/journal.json     # the README's figures, a few minutes
    python bench/journal.py --dims 784,64,10 --seconds 1 --repeats 1 --warmup 1   # a smoke run, seconds
    python bench/journal.py --stores --json bench/results/journal_stores.json      # the log beside SQLite, LMDB
    python bench/journal.py --calls --seconds 20 --json bench/results/journal_calls.json  # GetStatus, Join p99
    python bench/journal.py --no-compute --json bench/results/journal_no_compute.json   # the record path alone

1 ps and 2 async worker processes push and pull the 784-8192-2304-10 MLP
(25.3M float32, 101 MB each way, server-side SGD) as fast as they can, in
three setups started side by side and run in turn, rotated every repeat:

    plain         ps-server --no-journal (what the other benchmarks measure)
    journal       ps-server --checkpoint-dir DIR: the journal's default guarantee (process crash:
                  each record in the kernel's page cache before its push is acknowledged)
    journal_sync  ... --journal-sync: each record on the disk (fdatasync) before it is acknowledged

`journal_over_plain` is the journal's steps/s over plain's (medians over the
repeats), `journal_sync_over_plain` the synced one's; `_paired` variants are
the medians of the per-repeat ratios. DIR is a fresh folder under --dir
(default: the system's temporary folder), so the journal goes to that disk.
Every setup's workers take --warmup steps first: a journal's first
compactions allocate its files, which it then writes over (journal.py), so
the timed runs measure it as a long job runs.

--stores measures instead what one record of the model's gradient (101 MB)
costs to append, in CPU seconds of this process (user + system), to the
journal's log (ps_server/journal.py, into the page cache), to SQLite in WAL
mode (the standard library's sqlite3, one row per record, synchronous=OFF:
the page cache too), and to LMDB (if the lmdb package is importable,
sync=False), each keeping the last few records as a journal does (see
bench_stores); the median of --store-records timed records.

--no-compute measures the record path alone, as GPU workers see it: 1 ps
(--torch-threads 1) and --workers processes that only exchange() the MLP
(push its gradient, pull its values), the .grad of every parameter set once
to fixed random tensors, no forward or backward. plain and journal shards are
started side by side and run in turn (the order rotated every round),
--repeats rounds of --seconds each after --warmup steps per worker; the
steps/s ratio (medians, and the median of the paired rounds) and the shard's
and the workers' CPU ms per step in each. The shards' pids are logged at the
start, for a profiler to attach to (perf record -g -p PID, py-spy --native).

--calls measures instead what the control calls wait while the journal
works: one shard with the journal (--checkpoint-dir DIR), one variable of the
model's size (101 MB), and --workers processes pushing its whole gradient
(SGD, async) back to back, each push's record written before it is
acknowledged and the log compacted every few pushes (a new base of the whole
state). Meanwhile this process calls GetStatus and Join (a worker joining
under a new incarnation each time: a membership change, queued for the
journal) in turn, one every --probe-ms, for --seconds after every worker's
first push; each call's latency percentiles (nearest rank), the pushes and
the compactions in that time. The same runs first on a shard without the
journal (--no-journal), for comparison. The pushing processes run under
SCHED_IDLE (as bench/scale.py's workers: on a job they run on other hosts).
The bar (CALLS_TARGET_MS) is the journaled shard's p99 under 50 ms.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import pullpush  # noqa: E402 - bench/ is not a package

SETUPS = ("plain", "journal", "journal_sync")
TARGET = 0.90  # the journal costs under 10% (issue #22)
CALLS_TARGET_MS = 50.0  # --calls: GetStatus's and Join's p99 while the journal takes 100 MB pushes


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--json", type=pathlib.Path, help="write all results and raw timings here")
    parser.add_argument("--dims", default=",".join(map(str, pullpush.BIG_DIMS)),
                        help="the MLP's layer sizes (default: the 25.3M-float model)")
    parser.add_argument("--seconds", type=float, default=10.0, help="wall time of one timed run (default 10)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per setup (default 5)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps per worker first (default 8: past "
                        "the journal's third compaction, from which on it writes over its retired files)")
    parser.add_argument("--workers", type=int, default=2, help="async workers (default 2)")
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (default 1e-3)")
    parser.add_argument("--setups", help=f"which of {', '.join(SETUPS)} (default all; plain,journal with "
                        "--no-compute)")
    parser.add_argument("--dir", type=pathlib.Path, help="where the journals go (default: the temporary folder)")
    parser.add_argument("--stores", action="store_true", help="only the stores' cost of appending a record")
    parser.add_argument("--store-records", type=int, default=8, help="records per store with --stores (default 8)")
    parser.add_argument("--calls", action="store_true", help="only GetStatus's and Join's latency under pushes")
    parser.add_argument("--no-compute", action="store_true", help="workers that only push and pull, no "
                        "forward or backward: the journal's cost as GPU workers see it")
    parser.add_argument("--probe-ms", type=float, default=10.0, help="one control call every so many ms with "
                        "--calls (default 10)")
    args = parser.parse_args(argv)
    args.dims = tuple(int(d) for d in args.dims.split(","))
    default = "plain,journal" if args.no_compute else ",".join(SETUPS)
    args.setups = [s.strip() for s in (args.setups or default).split(",") if s.strip()]
    args.shard_args = []  # pullpush's --shard-torch-threads: LocalCluster's default (1) here
    if "plain" not in args.setups or set(args.setups) - set(SETUPS):
        parser.error(f"--setups: plain and any of {', '.join(SETUPS[1:])}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from torchps.client import tune_malloc
    from torchps.memory import malloc_env

    os.environ.update(malloc_env())  # as pullpush.py: every process gets the same allocator settings
    tune_malloc()
    started = time.monotonic()
    results: dict = {"config": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
                     **pullpush.environment()}
    if args.stores:
        return report_stores(args, results, started)
    if args.calls:
        return report_calls(args, results, started)
    if args.no_compute:
        return report_no_compute(args, results, started)
    with tempfile.TemporaryDirectory(prefix="torchps-bench-journal-", dir=args.dir) as folder:
        flags = setup_flags(folder)
        # pullpush.bench_training reads these from its args; "async" setups are --insecure shards
        args.train_repeats, args.train_warmup = args.repeats, args.warmup
        names = {f"async_{s}": s for s in args.setups}
        run = pullpush.bench_training("journal", args.dims, args, args.seconds, args.lr, with_local=False,
                                      setups=tuple(names), server_args={n: flags[s] for n, s in names.items()})
    rates = {names[n]: v for n, v in run["rates"].items()}
    medians = {names[n]: v for n, v in run["medians"].items()}
    results.update(rates=rates, steps_per_s=medians, cpu_per_step={names[n]: v for n, v in run["cpu"].items()},
                   raw={names[n]: v for n, v in run["raw"].items()}, target=TARGET,
                   flags={s: " ".join(f).replace(folder, "DIR") for s, f in flags.items()})
    for setup in args.setups[1:]:
        results[f"{setup}_over_plain"] = medians[setup] / medians["plain"]
        results[f"{setup}_over_plain_paired"] = pullpush.median(
            [j / p for p, j in zip(rates["plain"], rates[setup])])
    print(table(finish(results, started, args), args))
    return 0


def finish(results: dict, started: float, args) -> dict:
    """`results` with the load at the end and the wall time, written to --json if given."""
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["wall_seconds"] = time.monotonic() - started
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return results


def report_stores(args, results: dict, started: float) -> int:
    results["stores"] = bench_stores(args)
    finish(results, started, args)
    mb = pullpush.mlp_numel(args.dims) * 4 / 1e6
    print(f"| store | CPU per {mb:.0f} MB record, ms (median of {args.store_records}) |\n| --- | --- |")
    for store, ms in results["stores"].items():
        print(f"| {store} | {'not installed' if ms is None else f'{ms:.0f}'} |")
    print(f"\nload {results['machine']['loadavg_start'][0]:.1f} -> {results['machine']['loadavg_end'][0]:.1f}; "
          f"{results['wall_seconds']:.0f} s")
    return 0


def bench_stores(args) -> dict[str, float | None]:
    """{store: median CPU ms to append one record of the model's gradient, in steady state}; None where not
    installed. Every store keeps the last few records and drops older ones as it goes (the journal by its
    compaction, which writes its next log over a retired one; SQLite and LMDB by deleting them, which frees
    their pages for the next), and is timed once it has dropped some."""
    import resource
    import sqlite3

    import torch

    from torchps.ps_server.journal import Journal

    keep = 4
    grad = torch.randn(pullpush.mlp_numel(args.dims))
    data = memoryview(grad.numpy()).cast("B")

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def median_ms(append) -> float:
        spent = []
        for i in range(3 * keep + args.store_records):
            before = cpu()
            append(i)
            spent.append(cpu() - before)
        return 1e3 * pullpush.median(spent[3 * keep:])

    out: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="torchps-bench-stores-", dir=args.dir) as folder:
        journal = Journal(os.path.join(folder, "journal"))
        journal.start(None)

        def append(i: int) -> None:
            journal.wait(journal.append("apply", {}, {"g": grad}))
            if (i + 1) % keep == 0:  # a compaction, with an empty state for its base
                number = journal.rotate()
                journal.finish_compaction(number, journal.write_base(number, {}))

        out["journal log"] = median_ms(append)
        journal.close()
        db = sqlite3.connect(os.path.join(folder, "wal.db"), isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=OFF")
        db.execute("CREATE TABLE log (id INTEGER PRIMARY KEY, data BLOB)")

        def insert(i: int) -> None:
            db.execute("INSERT INTO log (id, data) VALUES (?, ?)", (i, data))
            db.execute("DELETE FROM log WHERE id <= ?", (i - keep,))

        out["SQLite, WAL, synchronous=OFF"] = median_ms(insert)
        db.close()
        try:
            import lmdb
        except ImportError:
            out["LMDB, sync=False"] = None
        else:
            env = lmdb.open(os.path.join(folder, "lmdb"), map_size=4 * keep * len(data) + (1 << 30), sync=False,
                            metasync=False)

            def put(i: int) -> None:
                with env.begin(write=True) as txn:
                    txn.put(i.to_bytes(8, "big"), data)
                    if i >= keep:
                        txn.delete((i - keep).to_bytes(8, "big"))

            out["LMDB, sync=False"] = median_ms(put)
            env.close()
    return out


def report_no_compute(args, results: dict, started: float) -> int:
    with tempfile.TemporaryDirectory(prefix="torchps-bench-no-compute-", dir=args.dir) as folder:
        flags = setup_flags(folder)
        raw, shard_cpu = bench_no_compute(args, {s: flags[s] for s in args.setups})
        flags = {s: " ".join(flags[s]).replace(folder, "DIR") for s in args.setups}
    rates = {s: [sum(w["steps"] / w["seconds"] for w in run) for run in runs] for s, runs in raw.items()}
    medians = {s: pullpush.median(v) for s, v in rates.items()}
    cpu = {}
    for setup, runs in raw.items():
        steps = sum(w["steps"] for run in runs for w in run)
        cpu[setup] = {"server_ms": 1e3 * sum(shard_cpu[setup]) / steps,
                      "workers_ms": 1e3 * sum(w["cpu_seconds"] for run in runs for w in run) / steps}
    results.update(rates=rates, steps_per_s=medians, cpu_per_step=cpu, raw=raw, shard_cpu_seconds=shard_cpu,
                   target=TARGET, flags=flags)
    for setup in args.setups[1:]:
        results[f"{setup}_over_plain"] = medians[setup] / medians["plain"]
        results[f"{setup}_over_plain_paired"] = pullpush.median(
            [j / p for p, j in zip(rates["plain"], rates[setup])])
    finish(results, started, args)
    rows = ["| setup | ps-server flags | steps/s (median) | over plain (paired) | CPU per step, ms: ps | workers |",
            "| --- " * 6 + "|"]
    for setup in args.setups:
        ratio = "1" if setup == "plain" else \
            f"{results[f'{setup}_over_plain']:.3f} ({results[f'{setup}_over_plain_paired']:.3f})"
        rows.append(f"| {setup} | {flags[setup]} | {medians[setup]:.2f} | {ratio} | {cpu[setup]['server_ms']:.0f} | "
                    f"{cpu[setup]['workers_ms']:.0f} |")
    print("\n".join(rows))
    print(f"\n{pullpush.mlp_numel(args.dims):,} parameters, 1 ps, {args.workers} workers exchanging with no compute, "
          f"{args.repeats} x {args.seconds:g} s per setup; journal_over_plain "
          f"{results.get('journal_over_plain', float('nan')):.3f} (target >= {TARGET:.2f}); load "
          f"{results['machine']['loadavg_start'][0]:.1f} -> {results['machine']['loadavg_end'][0]:.1f}; "
          f"{results['wall_seconds']:.0f} s")
    return 0


def setup_flags(folder: str) -> dict[str, list[str]]:
    """Each setup's ps-server flags, its journal (if any) under `folder`."""
    return {"plain": ["--no-journal"],
            "journal": ["--checkpoint-dir", os.path.join(folder, "journal")],
            "journal_sync": ["--checkpoint-dir", os.path.join(folder, "journal_sync"), "--journal-sync"]}


def bench_no_compute(args, flags: dict[str, list[str]]) -> tuple[dict[str, list], dict[str, list[float]]]:
    """--no-compute (see the module docstring): ({setup: [each round's per-worker results]}, {setup: the shard's
    CPU seconds in each round})."""
    import contextlib

    import torch

    from torchps.client import Optimizer, PSClient
    from torchps.security import INSECURE

    raw: dict[str, list] = {s: [] for s in flags}
    shard_cpu: dict[str, list[float]] = {s: [] for s in flags}
    pools, pids = {}, {}
    context = pullpush.worker_processes()
    with contextlib.ExitStack() as stack:
        for setup, extra in flags.items():
            local = pullpush.start_cluster(1, None, ["--torch-threads", "1", *extra], workers=args.workers)
            stack.callback(local.stop)
            pids[setup] = [p.pid for p in local.procs]
            torch.manual_seed(0)
            with PSClient(local.cluster, security=INSECURE) as client:
                client.register_module(pullpush.make_mlp(args.dims), Optimizer("sgd", lr=args.lr), create=True)
            res_q, cmd_qs = context.Queue(), [context.Queue() for _ in range(args.workers)]
            procs = [context.Process(target=exchange_main, daemon=True, name=f"exchange-{setup}-{i}",
                                     args=(args.dims, local.cluster, i, args.warmup, cmd_qs[i], res_q))
                     for i in range(args.workers)]
            for proc in procs:
                proc.start()
            stack.callback(stop_workers, procs, cmd_qs)
            pools[setup] = (procs, cmd_qs, res_q)
        for setup, (procs, _, res_q) in pools.items():
            pullpush.collect(res_q, procs, "ready", pullpush.READY_TIMEOUT)
        pullpush.log(f"no-compute: shard pids {pids}")
        names = list(pools)
        for r in range(args.repeats):
            for setup in names[r % len(names):] + names[:r % len(names)]:  # rotated to cancel drift
                procs, cmd_qs, res_q = pools[setup]
                before = pullpush.cpu_seconds(pids[setup])
                start_at = time.time() + 0.2
                for q in cmd_qs:
                    q.put((start_at, args.seconds))
                raw[setup].append(pullpush.collect(res_q, procs, "result", args.seconds + 120))
                shard_cpu[setup].append(pullpush.cpu_seconds(pids[setup]) - before)
            pullpush.log(f"no-compute round {r + 1}/{args.repeats}: " + ", ".join(
                f"{s} {sum(w['steps'] / w['seconds'] for w in raw[s][-1]):.2f} steps/s" for s in names))
    return raw, shard_cpu


def exchange_main(dims, cluster, index: int, warmup: int, cmd_q, res_q) -> None:
    """A --no-compute worker: the MLP's .grads set once, then exchange() (push, pull) in a loop for each
    (start time, seconds) command off `cmd_q` until None; its steps, seconds and CPU seconds to `res_q`."""
    import traceback

    try:
        import torch

        from torchps.client import PSClient, TaskSpec
        from torchps.security import INSECURE

        torch.set_num_threads(1)
        torch.manual_seed(100 + index)
        model = pullpush.make_mlp(dims)
        with torch.no_grad():
            for p in model.parameters():
                p.grad = torch.randn_like(p) * 1e-3
        with PSClient(cluster, task=TaskSpec("worker", index), security=INSECURE) as client:
            binding = client.register_module(model, create=False)
            for _ in range(warmup):
                binding.exchange()
            res_q.put(("ready", index, None))
            while (cmd := cmd_q.get()) is not None:
                start_at, seconds = cmd
                time.sleep(max(0.0, start_at - time.time()))
                steps, cpu = 0, time.process_time()
                while time.time() < start_at + seconds:
                    binding.exchange()
                    steps += 1
                res_q.put(("result", index, {"steps": steps, "seconds": time.time() - start_at,
                                             "cpu_seconds": time.process_time() - cpu}))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        res_q.put(("error", index, traceback.format_exc()))


def stop_workers(procs, cmd_qs) -> None:
    """Tells each --no-compute worker to end (None), then joins it; terminates one that does not end in 10 s."""
    for q in cmd_qs:
        q.put(None)
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join()


def report_calls(args, results: dict, started: float) -> int:
    with tempfile.TemporaryDirectory(prefix="torchps-bench-calls-", dir=args.dir) as folder:
        results["calls"] = {"plain": bench_calls(args, None), "journal": bench_calls(args, folder)}
    journaled = results["calls"]["journal"]
    results.update(target_ms=CALLS_TARGET_MS, met=all(journaled[call]["p99_ms"] < CALLS_TARGET_MS
                                                       for call in ("GetStatus", "Join")))
    finish(results, started, args)
    print("| shard | call | calls | p50 ms | p99 ms | max ms | pushes | compactions |\n" + "| --- " * 8 + "|")
    for setup, run in results["calls"].items():
        for call in ("GetStatus", "Join"):
            r = run[call]
            print(f"| {setup} | {call} | {r['calls']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} | "
                  f"{run['pushes']} | {run['compactions']} |")
    print(f"\n{args.workers} processes pushing {journaled['push_mb']:.0f} MB gradients, {args.seconds:g} s per shard; "
          f"p99 under {CALLS_TARGET_MS:g} ms with the journal: {results['met']}; load "
          f"{results['machine']['loadavg_start'][0]:.1f} -> {results['machine']['loadavg_end'][0]:.1f}")
    return 0


def bench_calls(args, checkpoint_dir: str | None) -> dict:
    """--calls on one shard (see the module docstring), with its journal under `checkpoint_dir` (None: without
    one): the latencies of GetStatus and Join while `args.workers` processes push, and the pushes and
    compactions meanwhile."""
    import grpc
    import torch

    from torchps.client import Optimizer, PSClient
    from torchps.proto import ps_pb2, ps_pb2_grpc
    from torchps.worker.local_cluster import LocalCluster

    numel = pullpush.mlp_numel(args.dims)
    flags = ["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else ["--no-journal"]
    journal = pathlib.Path(checkpoint_dir, "journal", "ps-0") if checkpoint_dir else None
    with LocalCluster(1, server_args=flags) as local:
        with PSClient(local.cluster) as client:
            client.create_variables({"w": torch.zeros(numel)}, Optimizer("sgd", lr=args.lr))
        context = pullpush.worker_processes()
        stop = context.Event()
        procs = [context.Process(target=push_loop, args=(local.cluster, numel, stop), name=f"pusher-{i}")
                 for i in range(args.workers)]
        for proc in procs:
            proc.start()
        channel = grpc.insecure_channel(local.cluster.ps[0])
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        deadline = time.monotonic() + 300
        while stub.GetStatus(ps_pb2.StatusRequest(), timeout=60).step < args.workers:  # every worker pushing
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                raise RuntimeError("the pushing processes did not all push in time")
            time.sleep(0.05)
        step, compacted = stub.GetStatus(ps_pb2.StatusRequest(), timeout=60).step, newest_log(journal)
        latencies: dict[str, list[float]] = {"GetStatus": [], "Join": []}
        began = time.monotonic()
        # The window lasts --seconds and until a push landed in it: a push may take longer than a short window
        # on a loaded machine, and latencies beside no push would show nothing.
        while time.monotonic() - began < args.seconds or (
                stub.GetStatus(ps_pb2.StatusRequest(), timeout=60).step == step and time.monotonic() < deadline):
            for call, latency in latencies.items():
                before = time.perf_counter()
                if call == "GetStatus":
                    stub.GetStatus(ps_pb2.StatusRequest(), timeout=60)
                else:
                    stub.Join(ps_pb2.WorkerRef(worker="worker:99", incarnation=len(latency) + 1), timeout=60)
                latency.append(time.perf_counter() - before)
                time.sleep(args.probe_ms / 1e3)
        pushes = stub.GetStatus(ps_pb2.StatusRequest(), timeout=60).step - step
        compactions = newest_log(journal) - compacted
        stop.set()
        for proc in procs:
            proc.join(300)
        channel.close()
    return {**{call: percentiles(values) for call, values in latencies.items()}, "pushes": pushes,
            "compactions": compactions, "push_mb": numel * 4 / 1e6, "flags": " ".join(flags[:1])}


def push_loop(cluster, numel: int, stop) -> None:
    """A pushing process (--calls): the variable's whole gradient, again and again, until `stop`. It runs
    under SCHED_IDLE, as bench/scale.py's workers: on a job they are on other hosts, and here the shard comes
    first on the cores they share."""
    import torch

    from torchps.client import PSClient

    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    torch.set_num_threads(1)
    grad = {"w": torch.full((numel,), 1e-6)}
    with PSClient(cluster, timeout=300) as client:
        client.declare(grad)
        while not stop.is_set():
            client.push(grad)


def newest_log(journal: pathlib.Path | None) -> int:
    """The number of the newest log in a journal folder: the compactions so far (0 without a journal)."""
    return max((int(p.stem.split("-")[1]) for p in journal.glob("log-*.bin")), default=0) if journal else 0


def percentiles(seconds: list[float]) -> dict:
    """Calls, p50, p99 and max in ms (nearest rank)."""
    ranked = sorted(seconds)

    def rank(q: float) -> float:
        return 1e3 * ranked[max(0, math.ceil(q * len(ranked)) - 1)]

    return {"calls": len(ranked), "p50_ms": rank(0.50), "p99_ms": rank(0.99), "max_ms": 1e3 * ranked[-1]}


def table(results: dict, args) -> str:
    rows = [("setup", "ps-server flags", "steps/s (median)", "over plain (paired)", "CPU per step, ms (ps)"),
            ("---",) * 5]
    for setup in args.setups:
        cpu = results["cpu_per_step"][setup]
        ratio = "1" if setup == "plain" else \
            f"{results[f'{setup}_over_plain']:.3f} ({results[f'{setup}_over_plain_paired']:.3f})"
        rows.append((setup, results["flags"][setup],
                     f"{results['steps_per_s'][setup]:.2f}", ratio,
                     f"{cpu['total_ms']:.0f} ({cpu.get('server_ms', float('nan')):.0f})"))
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    numel = pullpush.mlp_numel(args.dims)
    lines.append(f"\n{numel:,} parameters, 1 ps, {args.workers} async workers, {args.repeats} x {args.seconds:g} s "
                 f"per setup; journal_over_plain {results.get('journal_over_plain', float('nan')):.3f} "
                 f"(target >= {TARGET:.2f}); load {results['machine']['loadavg_start'][0]:.1f} -> "
                 f"{results['machine']['loadavg_end'][0]:.1f}; {results['wall_seconds']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
