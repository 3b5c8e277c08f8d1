"""How long processes take to start: shards from LocalCluster, and a whole ps-launch job, forked from the
warm fork server (torchps/forkserver.py) and as fresh interpreters (TORCHPS_NO_FORK_SERVER=1), interleaved.

    python bench/startup.py --json bench/results/startup.json      # about 2 minutes
    python bench/startup.py --setups forked --rounds 1 --clusters 2   # the suite's smoke run

Rows:
- LocalCluster(2) up: from the constructor to both shards serving, then one CreateVariables on each (a
  shard's first optimizer is made there). "first" is the first cluster of the process (for the fork server:
  its imports included), "next" the median of the later ones.
- ps-launch --ps 2 --workers 2 --steps 1 --insecure --dataset mnist5k: wall and CPU seconds of the whole
  command (every process it starts, reaped, counted by getrusage), median over the rounds.
The machine is shared and noisy: the ratios of one run are what to compare.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

from torchps.forkserver import DISABLE_ENV

LAUNCH = ["--ps", "2", "--workers", "2", "--steps", "1", "--insecure", "--dataset", "mnist5k"]
CLUSTER_PROBE = r"""
import json, sys, time, torch
from torchps.client import Optimizer, PSClient
from torchps.worker.local_cluster import LocalCluster
times = []
for i in range(int(sys.argv[1])):
    start = time.monotonic()
    with LocalCluster(2) as local, PSClient(local.cluster, connect_timeout=60) as ps:
        ps.create_variables({f"a{i}": torch.zeros(784, 100), f"b{i}": torch.zeros(100)},
                            Optimizer("sgd", lr=0.1, momentum=0.9))
        times.append(time.monotonic() - start)
print(json.dumps(times))
"""


def cluster_times(clusters: int, fork_server: bool) -> list[float]:
    """Seconds to a 2-shard LocalCluster serving with its variables created, `clusters` times in one fresh
    process (so the first includes whatever the first costs)."""
    env = {k: v for k, v in os.environ.items() if k != DISABLE_ENV}
    if not fork_server:
        env[DISABLE_ENV] = "1"
    out = subprocess.run([sys.executable, "-c", CLUSTER_PROBE, str(clusters)], env=env, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    return json.loads(out.splitlines()[-1])


def launch_cost(fork_server: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every process) of one small ps-launch job."""
    env = {k: v for k, v in os.environ.items() if k != DISABLE_ENV}
    if not fork_server:
        env[DISABLE_ENV] = "1"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "torchps.worker.launch", *LAUNCH], env=env, capture_output=True,
                         text=True, timeout=600)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        raise SystemExit(f"ps-launch failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each setup (default: 5)")
    parser.add_argument("--clusters", type=int, default=4, help="LocalClusters per process (default: 4)")
    parser.add_argument("--setups", default="forked,fresh", help="forked, fresh or both (default: both)")
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    args = parser.parse_args(argv)
    setups = {name: name == "forked" for name in args.setups.split(",")}
    if not set(setups) <= {"forked", "fresh"}:
        parser.error(f"--setups: forked and/or fresh, not {args.setups!r}")
    firsts = {name: [] for name in setups}
    nexts = {name: [] for name in setups}
    walls = {name: [] for name in setups}
    cpus = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, fork_server in setups.items():
            times = cluster_times(args.clusters, fork_server)
            firsts[name].append(times[0])
            nexts[name].extend(times[1:])
            wall, cpu = launch_cost(fork_server)
            walls[name].append(wall)
            cpus[name].append(cpu)
    med = statistics.median
    result = {
        "cluster_first_seconds": {name: med(v) for name, v in firsts.items()},
        "cluster_next_seconds": {name: med(v) for name, v in nexts.items() if v},
        "launch_wall_seconds": {name: med(v) for name, v in walls.items()},
        "launch_cpu_seconds": {name: med(v) for name, v in cpus.items()},
        "raw": {"cluster_first": firsts, "cluster_next": nexts, "launch_wall": walls, "launch_cpu": cpus},
        "rounds": args.rounds, "clusters_per_process": args.clusters, "launch_args": LAUNCH,
        "load_average": os.getloadavg(), "nproc": os.cpu_count(), "torch": importlib.metadata.version("torch"),
        "command": " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
    }
    if len(setups) == 2:
        result["launch_wall_ratio"] = result["launch_wall_seconds"]["forked"] / result["launch_wall_seconds"]["fresh"]
        result["launch_cpu_ratio"] = result["launch_cpu_seconds"]["forked"] / result["launch_cpu_seconds"]["fresh"]
    print(f"{'':44} " + " ".join(f"{name:>8}" for name in setups) + (f" {'ratio':>6}" if len(setups) == 2 else ""))
    rows = [("LocalCluster(2) up, first of the process (s)", "cluster_first_seconds"),
            ("LocalCluster(2) up, later ones (s)", "cluster_next_seconds"),
            ("ps-launch --steps 1, wall (s)", "launch_wall_seconds"),
            ("ps-launch --steps 1, CPU of every process (s)", "launch_cpu_seconds")]
    for label, key in rows:
        values = result[key]
        if set(values) == set(setups):
            ratio = f" {values['forked'] / values['fresh']:6.2f}" if len(setups) == 2 else ""
            print(f"{label:44} " + " ".join(f"{values[name]:8.3f}" for name in setups) + ratio)
    print(f"(medians of {args.rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f} at the end)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
