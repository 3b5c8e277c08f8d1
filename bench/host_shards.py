#!/usr/bin/env python
"""Several shard processes on one host: how a host's bytes per second grow with the shards it runs.

    python bench/host_shards.py --json bench/results/host_shards.json   # k = 1, 2 shards, 3 rounds
    python bench/host_shards.py --shards 1,2,4,8 --seconds 10           # the GPU machine (16 cores)
    python bench/host_shards.py --shards 1,2 --seconds 2 --rounds 1     # a try

The model (`--floats`, default 25.3M float32: the 25.3M MLP's 101 MB) is cut
into k variables of equal size, placed round-robin on k ps-server processes
of this host (LocalCluster(k), --torch-threads 1, lanes on: their default).
One client process (a worker, as a GPU host's one process per device) pushes
a gradient of every variable and pulls every variable back into its
parameters, the shards in parallel (one thread per shard), for `--seconds`;
SGD is applied on the shards. Per k: round trips per second, GB/s each way,
the scaling against k = 1 (rate_k / rate_1) and the efficiency (rate_k / (k x
rate_1)), and the CPU per GB moved of the client and of the shards together
(/proc). Rounds interleave the k's; medians over rounds. The issue's bar
(k shards move >= 0.8 k times one shard's bytes per second) needs as many
cores as shards plus the client's: on a 2-core machine only k = 1, 2 are
meaningful.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from pullpush import cpu_seconds, environment, log, median, start_cluster

DEFAULT_FLOATS = 25_330_442
BAR_EFFICIENCY = 0.8


def run_once(shards: int, floats: int, seconds: float) -> dict:
    """One k: a fresh LocalCluster of `shards`, one PSClient here moving the whole model each round trip."""
    import torch
    from torchps.client import Optimizer, PSClient
    from torchps.security import INSECURE

    torch.set_num_threads(1)
    local = start_cluster(shards, None, server_args=["--torch-threads", "1"])
    try:
        pids = [proc.pid for proc in local.procs]
        size = floats // shards
        names = [f"part{i}" for i in range(shards)]
        with PSClient(local.cluster, security=INSECURE) as client:
            client.create_variables({name: torch.zeros(size) for name in names}, Optimizer("sgd", lr=1e-6))
            params = {name: torch.zeros(size) for name in names}
            grads = {name: torch.full((size,), 1e-3) for name in names}
            for _ in range(2):  # warm-up: lanes opened, receive buffers kept
                client.push(grads)
                client.pull_into(params)
            shard0, client0, started = cpu_seconds(pids), time.process_time(), time.perf_counter()
            trips = 0
            while time.perf_counter() - started < seconds:
                client.push(grads)
                client.pull_into(params)
                trips += 1
            wall = time.perf_counter() - started
            client_cpu, shard_cpu = time.process_time() - client0, cpu_seconds(pids) - shard0
            lanes = client._lanes.opened
    finally:
        local.__exit__(None, None, None)
    gigabytes = trips * size * shards * 4 / 1e9  # each way
    return {"shards": shards, "round_trips": trips, "seconds": wall, "round_trips_per_s": trips / wall,
            "gb_per_s_each_way": gigabytes / wall, "client_cpu_s_per_gb": client_cpu / (2 * gigabytes),
            "shards_cpu_s_per_gb": shard_cpu / (2 * gigabytes), "lanes_opened": lanes}


def summarize(runs: dict[int, list[dict]]) -> dict:
    """Medians per k, scaling and efficiency against k = 1 (when measured)."""
    out = {}
    for shards, rounds in runs.items():
        out[shards] = {key: median([r[key] for r in rounds]) for key in
                       ("gb_per_s_each_way", "round_trips_per_s", "client_cpu_s_per_gb", "shards_cpu_s_per_gb")}
    if 1 in out:
        one = out[1]["gb_per_s_each_way"]
        for shards, figures in out.items():
            figures["scaling"] = figures["gb_per_s_each_way"] / one
            figures["efficiency"] = figures["scaling"] / shards
            figures["bar_met"] = shards == 1 or figures["efficiency"] >= BAR_EFFICIENCY
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,2", help="comma-separated shard counts (default 1,2)")
    parser.add_argument("--floats", type=int, default=DEFAULT_FLOATS, help="model size in float32 elements")
    parser.add_argument("--seconds", type=float, default=8.0, help="timed window per run (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    args = parser.parse_args(argv)
    counts = [int(k) for k in args.shards.split(",") if k.strip()]
    if not counts or min(counts) < 1 or args.floats < max(counts) or args.seconds <= 0 or args.rounds < 1:
        parser.error("--shards takes counts >= 1, --floats at least the largest count, --seconds and --rounds > 0")
    started = time.monotonic()
    runs: dict[int, list[dict]] = {k: [] for k in counts}
    for round_ in range(args.rounds):
        for shards in counts:
            result = run_once(shards, args.floats, args.seconds)
            runs[shards].append(result)
            log(f"round {round_ + 1}/{args.rounds} k={shards}: {result['gb_per_s_each_way']:.2f} GB/s each way, "
                f"client {result['client_cpu_s_per_gb']:.3f} s/GB, shards {result['shards_cpu_s_per_gb']:.3f} s/GB")
    summary = summarize(runs)
    print("| shard processes | GB/s each way | round trips/s | scaling | efficiency | client CPU s/GB | "
          "shards CPU s/GB |\n| --- | --- | --- | --- | --- | --- | --- |")
    for shards, f in summary.items():
        print(f"| {shards} | {f['gb_per_s_each_way']:.2f} | {f['round_trips_per_s']:.2f} | "
              f"{f.get('scaling', float('nan')):.2f} | {f.get('efficiency', float('nan')):.2f} | "
              f"{f['client_cpu_s_per_gb']:.3f} | {f['shards_cpu_s_per_gb']:.3f} |")
    results = {"summary": {str(k): v for k, v in summary.items()}, "runs": {str(k): v for k, v in runs.items()},
               "config": {"floats": args.floats, "seconds": args.seconds, "rounds": args.rounds,
                          "shard_args": ["--torch-threads", "1"], "client": "one PSClient, lanes on"},
               "bar": f"efficiency >= {BAR_EFFICIENCY} (k shards move >= {BAR_EFFICIENCY} k x one shard's bytes/s)",
               "environment": environment(), "wall_seconds": time.monotonic() - started}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
