#!/usr/bin/env python
"""Freshness pays: on a click stream whose click probabilities drift, the version a serving replica follows
scores the next hour better than yesterday's model does.

    python bench/freshness.py --json bench/results/freshness.json     # about 2 minutes on 2 cores
    python bench/freshness.py --quick                                  # a try: small and short (the test's)

The stream is made here (seeded): examples/dlrm.py's hidden click model,
drifting. Hour h's per-id effects and latent vectors are cos(a h) X0 +
sin(a h) X1 of two independent draws X0, X1 (a = pi/2 / --drift-hours: after
--drift-hours hours the effects are X1's, uncorrelated with the start's),
and each table's popularity ranks move by --churn of its ids per hour (ids
of the long tail become hot: new items). --hours-per-day hours make a day.

One asynchronous worker (this process) trains examples/dlrm.py's DLRM online
on two ps-server shards on 127.0.0.1: each hour's --samples-per-hour samples
once, in time order, in batches of --batch-size. Two ps-serve replicas follow
the job (--dense-every 1). At the end of day 1, once both have caught up,
one is held (ps-serve hold): it serves the "daily checkpoint" from then on.
At the end of each hour of day 2 training pauses until the fresh replica has
caught up (the rows of the last step, and the dense layers read after it),
and the next hour's samples, not trained on yet (progressive validation),
are scored with each replica's version through its Lookup and GetDense with
DLRM's forward (examples/serve_dlrm.py's served_logits), beside the ground
truth's own AUC on them (the best any model can do).

The same run on a stationary stream (no drift, no churn: the control) shows
how much of the gain is only the fresh model's extra hours of data.

Reported: each hour's AUC for the fresh and the daily version and the
oracle's, their means (`fresh_auc`, `daily_auc`, `oracle_auc`) and
`fresh_minus_daily`, and the control's (`stationary`). The bar (issue 41):
fresh above daily on the drifting stream.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from pullpush import environment, log

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import dlrm  # noqa: E402 - examples/dlrm.py: the click model and DLRM
from serve_dlrm import served_logits  # noqa: E402 - the forward on a replica's rows and layers

DENSE_EVERY = 1.0        # ps-serve --dense-every
CATCH_UP_SECONDS = 120.0  # a replica catches up within this, or the run fails
PREFIX = "fresh/"


class DriftingClicks:
    """dlrm.ClickModel whose id effects and latents rotate from one draw to another over `drift_hours` hours and
    whose popularity ranks move by `churn` of each table's ids per hour (see the module docstring)."""

    def __init__(self, cardinalities: list[int], alpha: float, seed: int, drift_hours: float, churn: float):
        self.start = dlrm.ClickModel(cardinalities, alpha, seed)
        self.end = dlrm.ClickModel(cardinalities, alpha, seed + 1_000)
        self.drift_hours, self.churn = drift_hours, churn

    def at(self, hour: int) -> dlrm.ClickModel:
        angle = math.pi / 2 * hour / self.drift_hours
        c, s = math.cos(angle), math.sin(angle)
        model = copy.copy(self.start)
        model.effects = [c * a + s * b for a, b in zip(self.start.effects, self.end.effects)]
        model.latents = [c * a + s * b for a, b in zip(self.start.latents, self.end.latents)]
        model.permutations = [np.roll(p, int(hour * self.churn * len(p))) for p in self.start.permutations]
        return model


def wait_caught_up(serving, step: int, since: float, what: str) -> None:
    """Blocks until the replica's version holds global step `step`'s rows and dense layers read after `since`
    (wall clock). RuntimeError after CATCH_UP_SECONDS."""
    deadline = time.monotonic() + CATCH_UP_SECONDS
    while True:
        status = serving.status()
        current = status.current
        if current.step >= step and status.dense_read_unix >= since:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {what} replica did not catch up with step {step} in {CATCH_UP_SECONDS:g} s "
                               f"(it holds step {current.step})")
        time.sleep(0.05)


def start_replica(cluster_json: str, folder: pathlib.Path, name: str) -> tuple[subprocess.Popen, pathlib.Path]:
    port_file = folder / f"{name}.port"
    with open(folder / f"{name}.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torchps.serving.daemon", "--cluster", cluster_json,
                                 "--bind", "127.0.0.1:0", "--port-file", str(port_file), "--insecure",
                                 "--dense-every", str(DENSE_EVERY)], stdout=out, stderr=subprocess.STDOUT)
    return proc, port_file


def replica_address(proc: subprocess.Popen, port_file: pathlib.Path, log_file: pathlib.Path) -> str:
    deadline = time.monotonic() + CATCH_UP_SECONDS
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"a replica did not start: {log_file.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    return f"127.0.0.1:{port_file.read_text().strip()}"


def run(args, folder: pathlib.Path, drift_hours: float, churn: float) -> dict:
    """One run on the stream drifting over `drift_hours` with `churn` (see the module docstring)."""
    from torchps.client import Optimizer, PSClient, TaskSpec
    from torchps.serving import ServingClient
    from torchps.worker.local_cluster import LocalCluster

    torch.manual_seed(args.seed)
    stream = DriftingClicks(args.cardinalities, args.alpha, args.seed, drift_hours, churn)
    hours = 2 * args.hours_per_day + 1  # day 1, day 2, and the hour after day 2's last (scored, never trained)
    data = [stream.at(h).sample(np.random.default_rng([args.seed, h]), args.samples_per_hour, 1) for h in range(hours)]
    model = dlrm.DLRM(args.cardinalities, args.dim, args.table_lr)
    scorer = dlrm.DLRM(args.cardinalities, args.dim, args.table_lr)  # receives a replica's dense layers
    per_hour, replicas = [], []
    with LocalCluster(2, workers=1, log_dir=folder, server_args=["--torch-threads", "1"]) as local:
        cluster_json = json.dumps({"ps": list(local.cluster.ps)})
        try:
            replicas = [start_replica(cluster_json, folder, name) for name in ("fresh", "daily")]
            with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=60, timeout=600) as ps:
                binding = ps.register_module(model, Optimizer("adam", lr=args.lr), prefix=PREFIX)
                addresses = [replica_address(proc, port, folder / f"{name}.log")
                             for (proc, port), name in zip(replicas, ("fresh", "daily"))]
                with ServingClient(addresses[0]) as fresh, ServingClient(addresses[1]) as daily:
                    began = time.monotonic()
                    for hour in range(hours - 1):
                        dense, ids, clicks, _ = data[hour]
                        for i in range(0, len(clicks), args.batch_size):
                            model.zero_grad(set_to_none=True)
                            batch_ids = ids[i:i + args.batch_size]
                            model.prefetch(batch_ids)
                            loss = F.binary_cross_entropy_with_logits(model(dense[i:i + args.batch_size], batch_ids),
                                                                      clicks[i:i + args.batch_size])
                            loss.backward()
                            step = binding.exchange()
                        ended = time.time()
                        if hour == args.hours_per_day - 1:  # the end of day 1: the daily replica keeps this version
                            wait_caught_up(daily, step, ended, "daily")
                            daily_step = daily.hold().current.step
                            log(f"day 1 ends at step {step}: the daily replica holds step {daily_step}")
                        if hour < args.hours_per_day:
                            continue
                        wait_caught_up(fresh, step, ended, "fresh")
                        dense, ids, clicks, truth = data[hour + 1]
                        fresh_logits, _, fresh_step = served_logits(fresh, scorer, PREFIX, dense, ids)
                        daily_logits, _, held_step = served_logits(daily, scorer, PREFIX, dense, ids)
                        row = {"hour": hour + 1, "fresh_step": fresh_step, "daily_step": held_step,
                               "fresh_auc": dlrm.auc(fresh_logits.numpy(), clicks.numpy()),
                               "daily_auc": dlrm.auc(daily_logits.numpy(), clicks.numpy()),
                               "oracle_auc": dlrm.auc(truth, clicks.numpy()),
                               "click_rate": float(clicks.mean())}
                        per_hour.append(row)
                        log(f"hour {hour + 1}: fresh (step {fresh_step}) {row['fresh_auc']:.4f}  daily (step "
                            f"{held_step}) {row['daily_auc']:.4f}  oracle {row['oracle_auc']:.4f}")
                    train_s = time.monotonic() - began
        finally:
            for proc, _ in replicas:
                proc.terminate()
                proc.wait(timeout=30)
    mean = {key: float(np.mean([row[key] for row in per_hour])) for key in ("fresh_auc", "daily_auc", "oracle_auc")}
    return {"hours": per_hour, **mean, "fresh_minus_daily": mean["fresh_auc"] - mean["daily_auc"],
            "hours_fresh_better": sum(row["fresh_auc"] > row["daily_auc"] for row in per_hour),
            "daily_step": daily_step, "final_step": step, "wall_train_s": train_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--cardinalities", default="50000,20000,10000,5000,1000,100",
                        help="rows of each table (default %(default)s)")
    parser.add_argument("--dim", type=int, default=8, help="embedding width (default 8)")
    parser.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids (default 1.05)")
    parser.add_argument("--hours-per-day", type=int, default=6, help="hours in a day (default 6)")
    parser.add_argument("--samples-per-hour", type=int, default=16_000, help="(default 16,000)")
    parser.add_argument("--drift-hours", type=float, default=24.0,
                        help="hours for the effects to turn into an independent draw (default 24)")
    parser.add_argument("--churn", type=float, default=0.02,
                        help="share of each table's ids the popularity ranks move per hour (default 0.02)")
    parser.add_argument("--batch-size", type=int, default=256, help="(default 256)")
    parser.add_argument("--lr", type=float, default=1e-3, help="server-side Adam for the dense layers")
    parser.add_argument("--table-lr", type=float, default=0.05, help="server-side Adagrad for the rows")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-control", action="store_true", help="skip the stationary stream's run")
    parser.add_argument("--quick", action="store_true", help="2-hour days of 3,000 samples, small tables")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.cardinalities, args.hours_per_day, args.samples_per_hour = "5000,1000,100", 2, 3_000
    args.cardinalities = [int(n) for n in args.cardinalities.split(",")]
    if args.hours_per_day < 1 or args.samples_per_hour < args.batch_size or args.drift_hours <= 0:
        parser.error("--hours-per-day >= 1, --samples-per-hour >= --batch-size and --drift-hours > 0")
    torch.set_num_threads(1)
    started = time.monotonic()
    results = {}
    runs = [("drifting", args.drift_hours, args.churn)] + ([] if args.no_control else [("stationary", math.inf, 0.0)])
    for name, drift_hours, churn in runs:
        log(f"the {name} stream")
        with tempfile.TemporaryDirectory(prefix="torchps-bench-freshness-") as folder:
            results[name] = run(args, pathlib.Path(folder), drift_hours, churn)
    for name, _, _ in runs:
        got = results[name]
        print(f"\n{name} stream:\n\n| hour | fresh version's step | fresh AUC | daily version's step | daily AUC | "
              f"oracle AUC |\n| --- | --- | --- | --- | --- | --- |")
        for row in got["hours"]:
            print(f"| {row['hour']} | {row['fresh_step']} | {row['fresh_auc']:.4f} | {row['daily_step']} | "
                  f"{row['daily_auc']:.4f} | {row['oracle_auc']:.4f} |")
        print(f"| mean | | {got['fresh_auc']:.4f} | | {got['daily_auc']:.4f} | {got['oracle_auc']:.4f} |")
        print(f"\nfresh - daily: {got['fresh_minus_daily']:+.4f} AUC ({got['hours_fresh_better']} of "
              f"{len(got['hours'])} hours better)")
    drifting = results["drifting"]
    results.update(fresh_auc=drifting["fresh_auc"], daily_auc=drifting["daily_auc"],
                   fresh_minus_daily=drifting["fresh_minus_daily"],
                   targets={"fresh_auc > daily_auc": drifting["fresh_auc"] > drifting["daily_auc"]})
    print(f"\ntarget fresh_auc > daily_auc (drifting stream): "
          f"{'met' if results['targets']['fresh_auc > daily_auc'] else 'NOT met'}")
    results.update(config={k: v for k, v in vars(args).items() if k != "json"}, environment=environment(),
                   wall_seconds=time.monotonic() - started, command=" ".join(["python", *sys.argv]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
