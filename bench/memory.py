#!/usr/bin/env python
"""Memory benchmark: what a shard (and a worker) keeps resident per byte it holds.

    python bench/memory.py --json results.json      # every model, SGD and Adam, 1 and 2 shards: ~2.5 minutes
    python bench/memory.py --quick                  # the big MLP only: about 40 s
    python bench/memory.py --models big --optimizers adam --shards 1

For each model, optimizer and shard count, real ps-server processes
(LocalCluster, --insecure) are measured from /proc (smaps_rollup's Rss; the
peak from VmHWM after resetting it through clear_refs), summed over shards,
beside what the shards report of their allocator (GetStatus's memory):

- empty: after a warm-up (one 1 KiB variable per shard, with the same
  optimizer, created, pushed and pulled, so the code paths' pages and the
  libraries they load are in), before the model's variables exist;
- created: after the variables are created (their values);
- pushed, pulled: after the first push of every gradient, then the first pull
  of every variable (Adam's moments appear with the first push);
- steady: after three such rounds, one call at a time (the shard idle again);
- peak: the highest RSS during a push of every gradient and a pull of every
  variable at the same time, from two clients.

held = values + optimizer state (bytes the shard must keep: SGD without
momentum has none, Adam two moments per value). steady ratio = (steady -
empty) / held; peak ratio = (peak - empty) / held. Targets: steady at most 1.2,
peak under 2. A push is applied all or nothing, so its whole gradient is held
until it has arrived and been checked: with an optimizer that keeps no state,
the peak cannot go under 2 (values + one gradient), and `peak_ratio_sgd`
shows by how little it is above. The seed MLP (0.3 MB) is reported in MiB
above empty, not as a ratio: its bytes are noise beside a process's fixed
costs.

Headline keys: `steady_ratio_sgd` and `steady_ratio_adam` (the worst over the
big MLP and the 1 GiB variable, 1 and 2 shards), `peak_ratio` (the worst of
all those runs), `peak_ratio_sgd` and `peak_ratio_adam`. `worker` measures a
ps-worker-like process (tune_malloc("worker"), a PSClient bound to the big
MLP on 2 shards): RSS of its parameters, of its gradients, and what the
client adds after three rounds, in copies of the parameters' bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import platform
import sys
import threading
import time

MIB = 1 << 20
MODELS = {
    "seed": [(784, 100), (100,), (100, 10), (10,)],                  # the seed's MLP: 79,510 floats
    "big": [(784, 8192), (8192,), (8192, 2304), (2304,), (2304, 10), (10,)],  # 25.3M floats, ~101 MB
    "1gib": [(16384, 16384)],                                        # one 1 GiB variable
}
OPTIMIZERS = {"sgd": ({"lr": 0.01}, 0), "adam": ({"lr": 1e-3}, 2)}  # hyperparameters, state tensors per value
ROUNDS = 3
TARGETS = {"steady_ratio": 1.2, "peak_ratio": 2.0}
STATUS_MEMORY_SECONDS = 1.1  # a shard refreshes the memory figures GetStatus reports once a second


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def rss(pids) -> int:
    """Resident bytes of the processes `pids`, summed (smaps_rollup)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("Rss:")) * 1024
    return total


def reset_peak(pids) -> None:
    """Sets each process's VmHWM (peak RSS) back to its current RSS (Linux 4.0+)."""
    for pid in pids:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")


def peak(pids) -> int:
    return sum(_status_kib(pid, "VmHWM") * 1024 for pid in pids)


def make_model(shapes):
    import torch

    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(shape) * 0.01) for shape in shapes])
    for p in model:
        p.grad = torch.randn_like(p) * 1e-3
    return model


def allocator(clients_status) -> dict:
    """Summed over shards: RSS and malloc's figures, as the shards report them (StatusResponse.memory;
    zeros from a torchps that predates it, as bench/against.py may run)."""
    keys = ("rss_bytes", "heap_in_use_bytes", "heap_free_bytes", "mapped_bytes")
    return {k: sum(getattr(getattr(s, "memory", None), k, 0) for s in clients_status) for k in keys}


def measure_shards(model_name: str, optimizer: str, num_ps: int) -> dict:
    """One run: a fresh cluster, the stages of the module docstring."""
    import torch
    from torchps.client import Optimizer, PSClient, TaskSpec
    from torchps.security import INSECURE
    from torchps.worker.local_cluster import LocalCluster

    hyper, slots = OPTIMIZERS[optimizer]
    values = sum(torch.Size(s).numel() for s in MODELS[model_name]) * 4
    stages = {}
    with LocalCluster(num_ps, workers=2) as local, \
            PSClient(local.cluster, task=TaskSpec("worker", 0), security=INSECURE) as ps, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), security=INSECURE) as reader:
        pids = [p.pid for p in local.procs]

        def stage(name: str) -> int:
            time.sleep(STATUS_MEMORY_SECONDS)  # GetStatus's malloc figures are at most this old: let them be fresh
            stages[name] = allocator([ps.status(shard) for shard in range(num_ps)])
            stages[name]["rss_bytes"] = rss(pids)
            return stages[name]["rss_bytes"]

        # Warm-up: one tiny variable per shard created, pushed and pulled, so the code paths' pages are in.
        warm = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(256)) for _ in range(num_ps)])
        for p in warm:
            p.grad = torch.zeros(256)
        warm_binding = ps.register_module(warm, Optimizer(optimizer, **hyper), create=True, prefix="warmup/")
        warm_binding.push()
        warm_binding.pull()
        reader.register_module(warm, create=False, prefix="warmup/").pull()
        empty = stage("empty")
        model = make_model(MODELS[model_name])
        binding = ps.register_module(model, Optimizer(optimizer, **hyper), create=True)
        created = stage("created")
        binding.push()
        stage("pushed")
        binding.pull()
        stage("pulled")
        for _ in range(ROUNDS - 1):
            binding.push()
            binding.pull()
        steady = stage("steady")
        reader_binding = reader.register_module(make_model(MODELS[model_name]), create=False)
        reset_peak(pids)
        pusher = threading.Thread(target=binding.push)
        pusher.start()
        reader_binding.pull()
        pusher.join()
        top = max(peak(pids), rss(pids))
        status = [ps.status(shard) for shard in range(num_ps)]
    held = values * (1 + slots)
    reported = sum(s.total_bytes for s in status) - 256 * 4 * num_ps
    if reported != values:
        raise RuntimeError(f"the shards report {reported} bytes of values, expected {values}")
    run = {"model": model_name, "optimizer": optimizer, "num_ps": num_ps, "held_bytes": held,
           "values_bytes": values, "rss_empty": empty, "rss_created": created, "rss_steady": steady,
           "rss_peak": top, "above_empty_steady": steady - empty, "above_empty_peak": top - empty,
           "stages": stages}
    if model_name != "seed":
        run["steady_ratio"] = (steady - empty) / held
        run["peak_ratio"] = (top - empty) / held
    return run


def worker_main(results) -> None:
    """A worker's RSS by stage: imports, parameters, gradients, a client after three rounds (child process)."""
    import torch
    from torchps.client import Optimizer, PSClient, tune_malloc
    from torchps.security import INSECURE
    from torchps.worker.local_cluster import LocalCluster

    tune_malloc()  # as ps-worker does
    torch.set_num_threads(1)
    me = [os.getpid()]
    with LocalCluster(2) as local:
        base = rss(me)
        model = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(s).normal_(0, 0.01)) for s in MODELS["big"]])
        params = rss(me)
        for p in model:
            p.grad = torch.empty_like(p).normal_(0, 1e-3)  # no temporaries: each stage adds exactly its tensors
        grads = rss(me)
        with PSClient(local.cluster, security=INSECURE) as ps:
            binding = ps.register_module(model, Optimizer("sgd", lr=0.01), create=True)
            reset_peak(me)
            for _ in range(ROUNDS):
                binding.push()
                binding.pull()
            steady, top = rss(me), max(peak(me), rss(me))
    nbytes = sum(p.numel() for p in model) * 4
    results.put({"param_bytes": nbytes, "rss_base": base, "rss_params": params, "rss_grads": grads,
                 "rss_steady": steady, "rss_peak": top, "param_copies": (params - base) / nbytes,
                 "grad_copies": (grads - params) / nbytes, "client_copies_steady": (steady - grads) / nbytes,
                 "client_copies_peak": (top - grads) / nbytes})


def measure_worker() -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=worker_main, args=(results,))
    proc.start()
    try:
        out = results.get(timeout=600)
    finally:
        proc.join(60)
    return out


def table(results: dict) -> str:
    rows = ["| model | optimizer | shards | held MiB | empty MiB | created +MiB | steady +MiB | peak +MiB "
            "| steady ratio | peak ratio |", "|" + " --- |" * 10]
    for r in results["runs"]:
        ratio = (f"{r['steady_ratio']:.2f} | {r['peak_ratio']:.2f}" if "steady_ratio" in r else "- | -")
        rows.append(f"| {r['model']} | {r['optimizer']} | {r['num_ps']} | {r['held_bytes'] / MIB:.1f} "
                    f"| {r['rss_empty'] / MIB:.0f} | {(r['rss_created'] - r['rss_empty']) / MIB:.1f} "
                    f"| {r['above_empty_steady'] / MIB:.1f} | {r['above_empty_peak'] / MIB:.1f} | {ratio} |")
    lines = ["\n".join(rows), ""]
    for key, target in (("steady_ratio_sgd", TARGETS["steady_ratio"]), ("steady_ratio_adam", TARGETS["steady_ratio"]),
                        ("peak_ratio", TARGETS["peak_ratio"]), ("peak_ratio_sgd", TARGETS["peak_ratio"]),
                        ("peak_ratio_adam", TARGETS["peak_ratio"])):
        if key in results:
            verdict = "met" if results[key] <= target else "NOT met"
            lines.append(f"{key} = {results[key]:.2f} (target <= {target}: {verdict})")
    w = results.get("worker")
    if w:
        lines.append(f"worker (big MLP, 2 shards): parameters {w['param_copies']:.2f} copies, gradients "
                     f"{w['grad_copies']:.2f}, the client adds {w['client_copies_steady']:.2f} at steady state "
                     f"and {w['client_copies_peak']:.2f} at its peak (copies of {w['param_bytes'] / MIB:.0f} MiB)")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    parser.add_argument("--models", default="seed,big,1gib", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--optimizers", default="sgd,adam", help=f"comma-separated, of {sorted(OPTIMIZERS)}")
    parser.add_argument("--shards", default="1,2", help="shard counts, comma-separated")
    parser.add_argument("--no-worker", action="store_true", help="skip the worker measurement")
    parser.add_argument("--quick", action="store_true", help="the big MLP only, no worker")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.no_worker = "big", True
    args.models = args.models.split(",")
    args.optimizers = args.optimizers.split(",")
    args.shards = [int(s) for s in args.shards.split(",")]
    for name in args.models:
        if name not in MODELS:
            parser.error(f"unknown model {name!r}")
    for name in args.optimizers:
        if name not in OPTIMIZERS:
            parser.error(f"unknown optimizer {name!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import grpc
    import torch

    started = time.monotonic()
    results: dict = {"config": {**{k: v for k, v in vars(args).items() if k != "json"},
                                "json": str(args.json) if args.json else None},
                     "targets": TARGETS, "runs": [],
                     "versions": {"python": platform.python_version(), "torch": torch.__version__,
                                  "grpcio": grpc.__version__}}
    for model in args.models:
        for optimizer in args.optimizers:
            for num_ps in args.shards:
                log(f"{model}, {optimizer}, {num_ps} shard(s)")
                results["runs"].append(measure_shards(model, optimizer, num_ps))
    for optimizer in OPTIMIZERS:
        ratios = [r["steady_ratio"] for r in results["runs"] if r["optimizer"] == optimizer and "steady_ratio" in r]
        if ratios:
            results[f"steady_ratio_{optimizer}"] = max(ratios)
    peaks = [r["peak_ratio"] for r in results["runs"] if "peak_ratio" in r]
    if peaks:
        results["peak_ratio"] = max(peaks)
    for optimizer in OPTIMIZERS:
        peaks = [r["peak_ratio"] for r in results["runs"] if r["optimizer"] == optimizer and "peak_ratio" in r]
        if peaks:
            results[f"peak_ratio_{optimizer}"] = max(peaks)
    if not args.no_worker:
        log("worker")
        results["worker"] = measure_worker()
    results["wall_seconds"] = time.monotonic() - started
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
