#!/usr/bin/env python
"""Training modes side by side: async, sync (R = N = 2) and bounded staleness, 1 ps + 2 workers.

    python bench/modes.py --json modes.json     # a few minutes
    python bench/modes.py --quick               # about a minute and a half

For the seed's 784-100-10 MLP and the 25.3M-parameter 784-8192-2304-10 MLP,
each run starts a fresh shard and two worker processes that train on random
batches of 100 (forward/backward, then ModuleBinding.exchange: push+pull in
one call in async and ssp modes; push, wait for the release, pull in sync
mode). Runs of the three modes are interleaved, repeated, and the medians
reported: total steps/s, and per worker the step time. The sync overhead is
sync step time minus async step time; the target is at most one extra round
trip, measured in the same run as the median of unary GetStatus calls.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from pullpush import BATCH, BIG_DIMS, SMALL_DIMS, environment, log, make_mlp, median, worker_processes

MODES = ("async", "sync", "ssp")
MAX_STALENESS = 1


def worker_main(mode: str, dims, cluster, index: int, warmup: int, steps: int, barrier, results) -> None:
    """One worker: the chief (index 0) configures the mode and creates the model; both then train."""
    import torch
    import torch.nn.functional as F
    from torchps.client import Optimizer, PSClient, TaskSpec, tune_malloc

    tune_malloc()
    torch.set_num_threads(1)
    torch.manual_seed(index)
    model = make_mlp(dims)
    xs, ys = torch.rand(4, BATCH, dims[0]), torch.randint(0, dims[-1], (4, BATCH))
    with PSClient(cluster, task=TaskSpec("worker", index)) as ps:
        if index == 0:
            ps.configure(mode, total_num_replicas=2, max_staleness=MAX_STALENESS, lease_seconds=60.0)
        binding = ps.register_module(model, Optimizer("sgd", lr=0.01), create=index == 0)

        def step(i: int) -> None:
            model.zero_grad()
            F.cross_entropy(model(xs[i % 4]), ys[i % 4]).backward()
            binding.exchange()

        for i in range(warmup):
            step(i)
        barrier.wait()
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        elapsed = time.perf_counter() - start
        barrier.wait()  # nobody leaves (lowering a sync quorum) before everyone has finished timing
        results.put((index, elapsed, ps.stats.as_dict()))


def round_trip_ms(cluster, count: int = 200) -> float:
    """Median latency of a unary GetStatus call to shard 0, in ms."""
    from torchps.client import PSClient

    with PSClient(cluster) as ps:
        ps.status(0)
        samples = []
        for _ in range(count):
            start = time.perf_counter()
            ps.status(0)
            samples.append(time.perf_counter() - start)
    return median(samples) * 1e3


def run(mode: str, dims, warmup: int, steps: int) -> dict:
    """One fresh shard and two workers in `mode`; steps/s of both and per-worker step time."""
    from torchps.worker.local_cluster import LocalCluster

    ctx = worker_processes()
    with LocalCluster(1, workers=2) as local:
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=worker_main, args=(mode, dims, local.cluster, i, warmup, steps, barrier, results))
                 for i in range(2)]
        for proc in procs:
            proc.start()
        got = [results.get(timeout=600) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
            if proc.exitcode != 0:
                raise RuntimeError(f"{mode} worker exited with {proc.exitcode}")
        rtt = round_trip_ms(local.cluster)
    seconds = max(elapsed for _, elapsed, _ in got)
    return {"steps_per_s": 2 * steps / seconds, "step_ms": 1e3 * median([e / steps for _, e, _ in got]),
            "round_trip_ms": rtt, "wait_seconds": sum(s["wait_seconds"] for _, _, s in got),
            "stale_dropped": sum(s["stale_dropped"] for _, _, s in got)}


def bench(label: str, dims, args) -> dict:
    steps, warmup = (args.big_steps, 3) if dims == BIG_DIMS else (args.small_steps, 50)
    raw = {mode: [] for mode in MODES}
    for r in range(args.repeats):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            raw[mode].append(run(mode, dims, warmup, steps))
            log(f"{label} repeat {r + 1}/{args.repeats} {mode}: {raw[mode][-1]['steps_per_s']:.2f} steps/s, "
                f"{raw[mode][-1]['step_ms']:.2f} ms/step")
    med = {mode: {key: median([x[key] for x in runs]) for key in runs[0]} for mode, runs in raw.items()}
    overhead = med["sync"]["step_ms"] - med["async"]["step_ms"]
    rtt = median([x["round_trip_ms"] for runs in raw.values() for x in runs])
    return {"medians": med, "sync_overhead_ms": overhead, "round_trip_ms": rtt,
            "overhead_in_round_trips": overhead / rtt, "raw": raw}


def table(results: dict) -> str:
    rows = ["| model | mode | steps/s (2 workers) | ms/step per worker | stale dropped |", "| --- | --- | --- | --- | --- |"]
    for label in ("small", "big"):
        if label not in results:
            continue
        for mode in MODES:
            m = results[label]["medians"][mode]
            name = f"{mode} (s={MAX_STALENESS})" if mode == "ssp" else mode
            rows.append(f"| {label} | {name} | {m['steps_per_s']:.2f} | {m['step_ms']:.2f} | {m['stale_dropped']:.0f} |")
        r = results[label]
        rows.append(f"| {label} | sync overhead | | {r['sync_overhead_ms']:+.2f} ms = {r['overhead_in_round_trips']:+.2f} "
                    f"round trips ({r['round_trip_ms']:.2f} ms each) | |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="1 repeat, fewer steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small-steps", type=int, default=1500, help="timed steps per worker, small model")
    parser.add_argument("--big-steps", type=int, default=15, help="timed steps per worker, 25M model")
    parser.add_argument("--only", default="small,big", help="small, big or both (default)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.small_steps, args.big_steps = 1, 500, 8
    from torchps.client import tune_malloc
    from torchps.memory import malloc_env

    os.environ.update(malloc_env())
    tune_malloc()
    results = {"command": " ".join([sys.executable, *sys.argv]), **environment()}
    started = time.monotonic()
    for label, dims in (("small", SMALL_DIMS), ("big", BIG_DIMS)):
        if label in args.only.split(","):
            results[label] = bench(label, dims, args)
    results["wall_seconds"] = time.monotonic() - started
    print(table(results))
    print(f"\nload {os.getloadavg()[0]:.1f}; {results['wall_seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
