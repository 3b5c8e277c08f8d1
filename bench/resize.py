"""Live resizes under load: exact sums, and the pause a resize causes (PSClient.resize, client/resize.py).

    python bench/resize.py --json bench/results/resize.json    # a few minutes on 2 cores
    python bench/resize.py --quick                              # the suite's smoke run: small models
    python bench/resize.py --only table                         # one run (exact, pause, sync, table)
    python bench/resize.py --quick --only table sync --drain-seconds 0.5   # the suite's run

Four runs, each a LocalCluster of 2 shards with pusher processes pushing gradients of ones (SGD,
lr 1) as fast as they can while the chief resizes the job 2 -> 4 -> 3 -> 2 shards:
- "exact": 8 async pushers, a 4M-float model (32 variables of 128k floats). At the end every element
  must be exactly minus the pushes acknowledged, each variable on one shard with that many updates.
- "pause": 2 async pushers, a 100 MB model (50 variables of 500k floats). For each resize, each pusher's
  longest interval between two acknowledged pushes that overlaps the resize ("gap"), against its median
  interval away from every resize ("step"); the pause is gap - step (what the resize added).
- "sync": the same 100 MB model, a sync job of 2 workers (R = N = 2): each resize holds the job at a step
  boundary while the variables move (client/resize.py). Every step averages ones, so every element must
  end at exactly minus the global step, each variable with that many updates; the pause as above.
- "table": 2 async pushers, a 100 MB embedding table (400k rows of 64 floats, SGD lr 1, uniform init)
  beside one small variable, every push a gradient of ones for every row: each resize re-lays the table
  out onto the new count (its rows frozen meanwhile). Every row must end at exactly its initial value
  minus the pushes acknowledged; the pause as above.
A resize that removes shards stops them after --drain-seconds (client/resize.py's DRAIN_SECONDS by default), in
which they answer the pushers that did not yet follow the new layout with LayoutChangedError; the pushers push
throughout, so a shorter drain is a shorter (and cheaper) run.
Rows: per run and resize, the variables moved and the bytes moved (table rows included), the move's seconds (first SetLayout to last
import), the pause's p50/p99/max over pushers; the JSON has every figure and the exact-sum check.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import queue
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from pullpush import log, worker_processes  # noqa: E402

from torchps.client import Optimizer, PSClient, TaskSpec  # noqa: E402
from torchps.client.resize import DRAIN_SECONDS  # noqa: E402
from torchps.proto import ps_pb2  # noqa: E402
from torchps.worker.local_cluster import LocalCluster  # noqa: E402

RUNS = {  # name: (pushers, variables, floats per variable, mode, rows of the table (0: none))
    "exact": (8, 32, 128 << 10, "async", 0),
    "pause": (2, 50, 500_000, "async", 0),
    "sync": (2, 50, 500_000, "sync", 0),
    "table": (2, 1, 16, "async", 400_000),
}
QUICK = {"exact": (8, 16, 4096, "async", 0), "pause": (2, 8, 16_384, "async", 0), "sync": (2, 8, 16_384, "sync", 0),
         "table": (2, 1, 16, "async", 4096)}
TABLE_DIM = 64
PUSHES_BETWEEN = 3  # acknowledged pushes of every pusher before each resize and after the last


def _shapes(variables: int, floats: int) -> dict[str, tuple[int]]:
    return {f"bench/v{i:02d}": (floats,) for i in range(variables)}


def _table_spec(rows: int):
    return ps_pb2.TableSpec(name="bench/table", dim=TABLE_DIM, num_embeddings=rows, dtype=ps_pb2.FLOAT32,
                            init=ps_pb2.TableInit(distribution="uniform", scale=1.0, seed=1),
                            optimizer=Optimizer("sgd", lr=1.0).to_proto())


def _pusher(cluster, shapes, index, stop, counts, times, mode, table_rows):
    """Child process: pushes ones (and a row of ones for every row of the table, if any) until `stop` (sync:
    as worker:<index>, which then leaves, so the others' last steps complete); counts acknowledged pushes and
    sends their times."""
    acked = []
    with PSClient(cluster, task=TaskSpec("worker", index), connect_timeout=60, partitioner=None,
                  timeout=600) as ps:
        ps.declare({name: torch.zeros(shape) for name, shape in shapes.items()})
        ps.wait_for_variables(shapes, timeout=120)
        rows = None
        if table_rows:
            ps.wait_for_tables(["bench/table"], timeout=120)
            rows = {"bench/table": (torch.arange(table_rows), torch.ones(table_rows, TABLE_DIM))}
        if mode == "sync":
            ps.join()
        grads = {name: torch.ones(shape) for name, shape in shapes.items()}
        while not stop.is_set():
            ps.push(grads, rows=rows)
            acked.append(time.monotonic())
            counts[index] += 1
        if mode == "sync":
            ps.leave()
        times.put((index, acked, ps.layout_epoch, *ps.layout_waits))


def _minus_ones(start: torch.Tensor, updates: int) -> torch.Tensor:
    """`start` after `updates` SGD steps of gradient one, lr 1, rounded as float32 arithmetic rounds them."""
    out = start.clone()
    for _ in range(updates):
        out -= 1.0
    return out


def _wait_for_pushes(counts, more: int, procs) -> None:
    """Until every pusher acknowledged `more` pushes; RuntimeError at once if one ended (its traceback is in
    the output), TimeoutError after 600 s."""
    target = [c + more for c in counts[:]]
    deadline = time.monotonic() + 600
    while any(c < t for c, t in zip(counts[:], target)):
        ended = [i for i, proc in enumerate(procs) if proc.exitcode is not None]
        if ended:
            raise RuntimeError(f"pusher(s) {ended} ended (exit codes {[procs[i].exitcode for i in ended]}) "
                               f"with pushes at {counts[:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"pushes stalled at {counts[:]}")
        time.sleep(0.01)


def _pusher_ends(times, procs) -> list:
    """What each pusher sent when it stopped; a pusher that ended without sending it counts no wait."""
    ends, deadline = [], time.monotonic() + 600
    while len(ends) < len(procs) and time.monotonic() < deadline:
        try:
            ends.append(times.get(timeout=0.5))
        except queue.Empty:
            if all(proc.exitcode is not None for proc in procs) and times.empty():
                break
    return ends


def run(name: str, pushers: int, variables: int, floats: int, mode: str, table_rows: int,
        drain_seconds: float = DRAIN_SECONDS) -> dict:
    shapes = _shapes(variables, floats)
    ctx = worker_processes()
    with LocalCluster(2) as local, PSClient(local.cluster, connect_timeout=60, partitioner=None,
                                            timeout=600) as chief:
        if mode == "sync":
            chief.configure("sync", replicas_to_aggregate=pushers, total_num_replicas=pushers)
        chief.create_variables({n: torch.zeros(s) for n, s in shapes.items()}, Optimizer("sgd", lr=1.0))
        start_rows = None
        if table_rows:
            chief.create_tables([_table_spec(table_rows)])
            start_rows = chief.lookup_rows({"bench/table": torch.arange(table_rows)})["bench/table"]
        stop, counts, times = ctx.Event(), ctx.Array("q", pushers), ctx.Queue()
        procs = [ctx.Process(target=_pusher, args=(local.cluster, shapes, i, stop, counts, times, mode, table_rows))
                 for i in range(pushers)]
        for proc in procs:
            proc.start()
        resizes = []
        try:
            _wait_for_pushes(counts, PUSHES_BETWEEN, procs)
            for target in ([*local.cluster.ps, local.add_ps(), local.add_ps()], None, list(local.cluster.ps)):
                if target is None:
                    target = [local.address(i) for i in range(3)]
                started = time.monotonic()
                report = chief.resize(target, drain_seconds=drain_seconds)
                resizes.append({"from": report.shards_before, "to": report.shards_after, "moved": report.moved,
                                "moved_bytes": report.moved_bytes + report.table_bytes,
                                "table_bytes": report.table_bytes, "move_seconds": report.move_seconds,
                                "window": (started, time.monotonic())})
                log(f"{name}: {report.line()}")
                _wait_for_pushes(counts, PUSHES_BETWEEN, procs)
        except (RuntimeError, TimeoutError) as exc:  # the shards' own account goes with the pushers' tracebacks
            tails = "".join(f"\n--- ps {i}'s log (last lines)\n" + "\n".join(local.log(i).splitlines()[-40:])
                            for i in range(len(local.procs)))
            raise RuntimeError(f"{exc}{tails}") from exc
        finally:
            stop.set()
            ends = _pusher_ends(times, procs)
            for proc in procs:
                proc.join(timeout=120)
        total = sum(counts[:])
        updates = chief.status(0).step if mode == "sync" else total  # sync: one update per step, of mean 1
        values = chief.pull(shapes)
        exact = all(torch.equal(v, torch.full(shapes[n], -float(updates))) for n, v in values.items())
        versions = {info.spec.name: info.version for info in chief.list_variables()}
        exact = exact and versions == {n: updates for n in shapes}
        if table_rows:
            got = chief.lookup_rows({"bench/table": torch.arange(table_rows)})["bench/table"]
            exact = exact and bool(torch.equal(got, _minus_ones(start_rows, updates)))
    windows = [resize.pop("window") for resize in resizes]
    for resize, window in zip(resizes, windows):
        pauses = []
        for _, acked, _, _, _ in ends:
            intervals = list(zip(acked, acked[1:]))
            away = [b - a for a, b in intervals
                    if not any(a <= w1 and b >= w0 for w0, w1 in windows)]
            step = statistics.median(away) if away else 0.0
            overlapping = [b - a for a, b in intervals if a <= window[1] and b >= window[0]]
            pauses.append(max(0.0, max(overlapping, default=0.0) - step))
        pauses.sort()
        resize.update(pause_p50_s=statistics.median(pauses), pause_p99_s=pauses[min(len(pauses) - 1,
                      int(0.99 * len(pauses)))], pause_max_s=pauses[-1])
    return {"run": name, "mode": mode, "pushers": pushers,
            "model_bytes": variables * floats * 4 + table_rows * TABLE_DIM * 4, "table_rows": table_rows,
            "pushes": total,
            "updates": updates,
            "exact_sum": exact, "epochs_followed": [e for _, _, e, _, _ in ends],
            "refused_parts": sum(r for *_, r, _ in ends), "moving_waits": sum(w for *_, w in ends),
            "resizes": resizes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models (the suite's smoke run)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), help="these runs only (default: all)")
    parser.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS,
                        help="how long a removed shard answers before it is stopped (default: %(default)s)")
    args = parser.parse_args()
    if args.drain_seconds < 0:
        parser.error(f"--drain-seconds must be >= 0. Received: {args.drain_seconds}")
    results = [run(name, *spec, drain_seconds=args.drain_seconds)
               for name, spec in (QUICK if args.quick else RUNS).items() if not args.only or name in args.only]
    print(f"{'run':6} {'model':>9} {'resize':>7} {'moved':>6} {'MB':>7} {'move s':>7} {'pause p50':>9} "
          f"{'p99':>6} {'max':>6}")
    for result in results:
        for r in result["resizes"]:
            print(f"{result['run']:6} {result['model_bytes'] / 1e6:8.1f}M {r['from']}->{r['to']:<4} {r['moved']:6d} "
                  f"{r['moved_bytes'] / 1e6:7.1f} {r['move_seconds']:7.2f} {r['pause_p50_s']:9.2f} "
                  f"{r['pause_p99_s']:6.2f} {r['pause_max_s']:6.2f}")
        print(f"{result['run']:6} {result['pushes']} pushes, {result['updates']} updates, exact sum: {result['exact_sum']}, "
              f"refused parts {result['refused_parts']}, moving waits {result['moving_waits']}")
    summary = {"results": results, "exact_sum": all(r["exact_sum"] for r in results),
               "resize_pause_p99_s": max(r["pause_p99_s"] for res in results for r in res["resizes"]),
               "command": " ".join(["python", "bench/resize.py", *sys.argv[1:]])}
    print(json.dumps(summary))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["exact_sum"] else 1


if __name__ == "__main__":
    sys.exit(main())
