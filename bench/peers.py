#!/usr/bin/env python
"""torchps beside TensorFlow's ParameterServerStrategy: same models, same data shapes, same machine, one run.

    python bench/peers.py --json peers.json         # 3 rounds, about 10 minutes on 2 cores (13 with overlap)
    python bench/peers.py --quick                   # 1 round, shorter windows, about 3 minutes
    python bench/peers.py --only small --no-tf      # torchps only (no TensorFlow installed)
    python bench/peers.py --only big --big-ps 2 --variants fp32,bf16

Models: bench/pullpush.py's seed MLP 784-100-10 and the 784-8192-2304-10 MLP
(25.3M parameters), sigmoid between the layers (pullpush.make_mlp; both
models), random batches of 100, SGD lr 0.01, 2 asynchronous workers.
Setups: the seed MLP with 1 ps, the big MLP with 1 ps and with 2 ps
(partitioned: MinSizePartitioner(256 KiB, max_shards=2) on both sides).

TensorFlow side (bench/tf_peer.py, run with --tf-python): tf.distribute.Server
processes for the ps tasks and the 2 workers, this-side ClusterCoordinator,
ParameterServerStrategy, tf.Variables, a tf.function step scheduled
asynchronously, 1 intra-op thread per task (2 inter-op: 1 deadlocks). Its
servers listen on every interface, so it runs inside a private network
namespace holding only loopback (`unshare -rn`; --tf-isolation none to skip).

torchps side: real ps-server shards (LocalCluster, 127.0.0.1) and 2 worker
processes (torch.set_num_threads(1)), each PSClient + register_module, then per
step forward/backward on one of 4 fixed random batches and the variant's update
(exchange(), or push() + pull()). Variants (VARIANTS below, one line each):
fp32 (default), tls (fp32 with mutual TLS + the job token on every shard and
client), bf16 and top-k 1% with error feedback compression, top-k with delta
pulls, overlap. bench/network.py runs the same inside network namespaces
whose loopback is shaped to a link's rate.
A variant that fails is reported as failed, without stopping the others.

Each round runs, for every setup, TensorFlow then each torchps variant, each
on fresh processes: warm-up steps, then a timed window with both workers
started together; steps/s of both workers together. Medians over --rounds,
ratios torchps / TensorFlow of the medians (and in the JSON the median of the
per-round ratios), the issue's targets with met / NOT met.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import traceback

from pullpush import (BATCH, BIG_DIMS, SMALL_DIMS, collect, cpu_seconds, environment, log, make_mlp, median,
                      worker_processes)
from tf_peer import loopback_bytes  # stdlib only at import: the same count on both sides

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
TF_PEER = HERE / "tf_peer.py"
TF_RESULT_PREFIX = "TF_PEER_RESULT "
TF_INSTALL = "pip install -e '.[bench]'  (or: pip install tensorflow-cpu==2.21.0)"
LR = 0.01
WORKERS = 2
MIN_SHARD_BYTES = 256 << 10  # TensorFlow's MinSizePartitioner default in its tutorial; torchps's default too
READY_TIMEOUT = 240.0
MODELS = {"small": SMALL_DIMS, "big": BIG_DIMS}

# torchps variants: name -> (what, PSClient kwargs, register_module kwargs, update per step).
# ("Compression", kind, kwargs) is built as torchps.client.Compression(kind, **kwargs) when the run starts.
# A client spec's "tls": True runs the variant with mutual TLS + the job token on every shard and client (the
# deployment's configuration; every other variant is plaintext).
VARIANTS = {
    "fp32": ("float32 (defaults)", {}, {}, "exchange"),
    "tls": ("float32, mutual TLS + job token (what a deployment runs)", {"tls": True}, {}, "exchange"),
    "inline": ("float32, no bulk lanes: every byte over gRPC", {"lanes": False}, {}, "exchange"),
    "bf16": ("bf16 compression", {}, {"compression": ("Compression", "bf16", {})}, "exchange"),
    "topk": ("top-k 1% + error feedback", {}, {"compression": ("Compression", "topk", {"ratio": 0.01})}, "exchange"),
    "topk_delta": ("top-k 1% + error feedback, delta pulls", {},
                   {"compression": ("Compression", "topk", {"ratio": 0.01}), "delta_pulls": True}, "exchange"),
    "overlap": ("overlap, push() + pull()", {}, {"overlap": True}, "push_pull"),
}

# (key, threshold, what): ratio targets from the issue.
TARGETS = (
    ("big_ratio_fp32", 0.9, "fp32 >= 0.9 x TF (big, 1 ps)"),
    ("big_ratio_bf16", 1.3, "bf16 >= 1.3 x TF (big, 1 ps)"),
    ("big_ratio_topk", 2.0, "top-k 1% + error feedback >= 2 x TF (big, 1 ps)"),
    ("big_2ps_ratio_fp32", 0.9, "fp32 >= 0.9 x TF (big, 2 ps)"),
    ("big_2ps_ratio_bf16", 1.3, "bf16 >= 1.3 x TF (big, 2 ps)"),
    ("big_2ps_ratio_topk", 2.0, "top-k 1% + error feedback >= 2 x TF (big, 2 ps)"),
    ("big_2ps_over_1ps", 1.0, "2 ps partitioned >= 1 ps (torchps fp32, big)"),
    ("small_ratio", 2.0, "seed MLP >= 2 x TF (fp32, 1 ps)"),
)


def setup_name(model: str, num_ps: int) -> str:
    """JSON key prefix of a setup: small, big, big_2ps, ..."""
    return model if num_ps == 1 else f"{model}_{num_ps}ps"


def resolve(variant: str, num_ps: int) -> tuple[dict, dict, str, dict]:
    """(PSClient kwargs, register_module kwargs, update, what was used) of a variant. The worker processes
    call it too, so they build the same arguments."""
    from torchps.client import Compression, MinSizePartitioner

    what, client_spec, register_spec, update = VARIANTS[variant]
    client_kw, register_kw = dict(client_spec), {}
    info = {"variant": what, "tls": client_kw.pop("tls", False),
            "update": "binding.exchange()" if update == "exchange" else "binding.push(); binding.pull()"}
    if num_ps > 1:
        client_kw["partitioner"] = MinSizePartitioner(min_shard_bytes=MIN_SHARD_BYTES, max_shards=num_ps)
        info["partitioning"] = f"MinSizePartitioner(min_shard_bytes={MIN_SHARD_BYTES}, max_shards={num_ps})"
    for key, value in register_spec.items():
        if isinstance(value, tuple) and value and value[0] == "Compression":
            _, kind, kwargs = value
            value = Compression(kind, **kwargs)
            info["compression"] = repr(value)
        register_kw[key] = value
    if update == "push_pull":
        info["overlap"] = True
    return client_kw, register_kw, update, info


# -- torchps side -------------------------------------------------------------------------------

def torch_worker(dims, cluster, index: int, variant: str, warmup: int, cmd_q, res_q, security=None,
                 compute: bool = True) -> None:
    """One async worker: register, warm up, then train for the window the parent sends; reports its steps.
    Without `compute`, no forward or backward: every .grad is set once to fixed random tensors and each step
    is the variant's update alone (the data plane)."""
    try:
        import torch
        import torch.nn.functional as F
        from torchps.client import Optimizer, PSClient, TaskSpec, tune_malloc
        from torchps.security import INSECURE

        tune_malloc()
        torch.set_num_threads(1)
        torch.manual_seed(100 + index)
        model = make_mlp(dims)
        xs, ys = torch.rand(4, BATCH, dims[0]), torch.randint(0, dims[-1], (4, BATCH))
        client_kw, register_kw, update_kind, _ = resolve(variant, cluster.num_ps)
        with PSClient(cluster, task=TaskSpec("worker", index), security=security or INSECURE, **client_kw) as ps:
            binding = ps.register_module(model, Optimizer("sgd", lr=LR), create=False, **register_kw)
            if not compute:
                for p in model.parameters():
                    p.grad = torch.randn_like(p) * 1e-3
            if update_kind == "push_pull":
                def update():
                    binding.push()
                    binding.pull()
            else:
                update = binding.exchange
            update_cpu = 0.0

            def step(i: int) -> float:
                nonlocal update_cpu
                loss = None
                if compute:
                    model.zero_grad()
                    loss = F.cross_entropy(model(xs[i % 4]), ys[i % 4])
                    loss.backward()
                started = time.process_time()
                update()
                update_cpu += time.process_time() - started
                return float("nan") if loss is None else loss.item()

            def stages() -> dict | None:  # PSClient.stats.stage_seconds where the client keeps it
                held = getattr(ps.stats, "stage_seconds", None)
                return None if held is None else dict(held)

            for i in range(warmup):
                step(i)
            res_q.put(("ready", index, None))
            start_at, duration = cmd_q.get()
            while time.time() < start_at:
                time.sleep(min(0.01, max(0.0, start_at - time.time())))
            end, steps, loss = start_at + duration, 0, float("nan")
            update_cpu, cpu0, copied0, stages0 = 0.0, time.process_time(), ps.stats.bytes_copied, stages()
            while time.time() < end:
                loss = step(steps)
                steps += 1
            stages1 = stages()
            res_q.put(("result", index, {"steps": steps, "seconds": time.time() - start_at, "last_loss": loss,
                                         "cpu_seconds": time.process_time() - cpu0, "update_cpu_seconds": update_cpu,
                                         "bytes_copied": ps.stats.bytes_copied - copied0,
                                         "stage_seconds": None if stages1 is None else
                                         {k: v - (stages0 or {}).get(k, 0.0) for k, v in stages1.items()},
                                         "stats": ps.stats.as_dict()}))
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        res_q.put(("error", index, traceback.format_exc()))


def run_torch(dims, num_ps: int, variant: str, seconds: float, warmup: int, *, shard_args=(),
              count_loopback: bool = False, workers: int = WORKERS, compute: bool = True, during=None,
              mode: str = "async") -> dict:
    """Fresh shards and `workers` worker processes for one variant; steps/s of the workers together over the
    window. `shard_args` go to every shard (e.g. --torch-threads 1); with `count_loopback`, the window's bytes on
    `lo` (`loopback_bytes`) as MB per step; `compute` False: the workers only update (torch_worker). `mode`
    "sync": every step waits for all the workers' gradients (the quorum follows the live workers, so a worker
    that ends its window first lets the others finish theirs).
    `during({name: pid}, start_at)`, if given, is called as the window is announced (it must not block)."""
    import torch
    from torchps.client import Optimizer, PSClient, TaskSpec
    from torchps.security import INSECURE
    from torchps.worker.local_cluster import LocalCluster
    from pullpush import JobSecurity

    client_kw, register_kw, _, info = resolve(variant, num_ps)
    started = time.monotonic()
    ctx = worker_processes()
    job = JobSecurity(num_ps, workers) if info["tls"] else None
    chief_security = job.security(TaskSpec("chief", 0)) if job else INSECURE
    securities = [job.security(TaskSpec("worker", i)) if job else None for i in range(workers)]
    try:
        with LocalCluster(num_ps, workers=workers, server_args=[*(job.server_args() if job else []), *shard_args]
                          ) as local:
            torch.manual_seed(0)
            with PSClient(local.cluster, security=chief_security, **client_kw) as chief:
                if mode == "sync":
                    chief.configure("sync", total_num_replicas=workers, replicas_fraction=1.0)
                chief.register_module(make_mlp(dims), Optimizer("sgd", lr=LR), create=True, **register_kw)
                placement = chief.placement_report()
            res_q = ctx.Queue()
            cmd_qs = [ctx.Queue() for _ in range(workers)]
            procs = [ctx.Process(target=torch_worker, daemon=True, name=f"peers-{variant}-{i}",
                                 args=(dims, local.cluster, i, variant, warmup, cmd_qs[i], res_q, securities[i],
                                       compute))
                     for i in range(workers)]
            for proc in procs:
                proc.start()
            try:
                collect(res_q, procs, "ready", READY_TIMEOUT)
                setup_seconds = time.monotonic() - started
                ps_pids = [p.pid for p in local.procs]
                start_at = time.time() + 0.2
                ps_cpu0, wire0 = [cpu_seconds([pid]) for pid in ps_pids], loopback_bytes()
                for q in cmd_qs:
                    q.put((start_at, seconds))
                if during is not None:
                    during({**{f"ps-{i}": pid for i, pid in enumerate(ps_pids)},
                            **{f"worker-{i}": proc.pid for i, proc in enumerate(procs)}}, start_at)
                got = collect(res_q, procs, "result", seconds + 120)
                ps_cpu1, wire1 = [cpu_seconds([pid]) for pid in ps_pids], loopback_bytes()
            finally:
                for proc in procs:
                    proc.join(timeout=30)
                    if proc.is_alive():
                        proc.terminate()
                        proc.join()
    finally:
        if job is not None:
            job.close()
    steps = sum(w["steps"] for w in got)
    each = {f"ps-{i}": None if None in (a, b) else (b - a) / steps for i, (a, b) in enumerate(zip(ps_cpu0, ps_cpu1))}
    each.update({f"worker-{i}": w["cpu_seconds"] / steps for i, w in enumerate(got)})
    shards = [v for k, v in each.items() if k.startswith("ps-")]
    cpu = {"workers": sum(w["cpu_seconds"] for w in got) / steps,
           "workers_update": sum(w["update_cpu_seconds"] for w in got) / steps,
           "ps": None if None in shards else sum(shards)}
    wire = (wire1 - wire0) / steps / 1e6 if count_loopback and None not in (wire0, wire1) else None
    return {"steps_per_s": sum(w["steps"] / w["seconds"] for w in got), "steps": steps,
            "MB_copied_per_step": sum(w["bytes_copied"] for w in got) / steps / 1e6, "MB_on_wire_per_step": wire,
            "seconds": max(w["seconds"] for w in got), "last_loss": median([w["last_loss"] for w in got]),
            "cpu_seconds_per_step": cpu, "cpu_seconds_per_step_each": each, "setup_seconds": setup_seconds,
            "workers": got, "placement": placement, "shard_args": list(shard_args), "compute": compute, "mode": mode,
            **info}


# -- TensorFlow side ------------------------------------------------------------------------------

def default_tf_python() -> str:
    separate = ROOT / ".venv-tf" / "bin" / "python"
    return str(separate) if separate.exists() else sys.executable


def tf_prefix(isolation: str) -> list[str]:
    return ["unshare", "-rn", "--"] if isolation == "netns" else []


def check_tf(args) -> str | None:
    """None if the TensorFlow side can run; else why not (with how to install it)."""
    if not os.path.exists(args.tf_python):
        return f"--tf-python {args.tf_python} does not exist; install the TF side with: {TF_INSTALL}"
    if args.tf_isolation == "netns":
        if shutil.which("unshare") is None:
            return ("TensorFlow's servers listen on every interface; no `unshare` here to give them a private "
                    "network namespace (--tf-isolation none runs them anyway)")
        probe = subprocess.run(["unshare", "-rn", "--", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            return ("TensorFlow's servers listen on every interface, and `unshare -rn` (a private network "
                    f"namespace) fails here: {probe.stderr.strip()} (--tf-isolation none runs them anyway)")
    probe = subprocess.run([args.tf_python, "-c", "import tensorflow as tf; print(tf.__version__)"],
                           capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if probe.returncode != 0:
        return f"{args.tf_python} cannot import tensorflow; install it with: {TF_INSTALL}"
    args.tf_version = probe.stdout.strip().splitlines()[-1]
    return None


def run_tf(dims, num_ps: int, seconds: float, warmup: int, args, *, prefix: list[str] | None = None,
           extra=(), workers: int = WORKERS) -> dict:
    """bench/tf_peer.py's result; `prefix` (default: args.tf_isolation's) goes before its command, `extra` after."""
    cmd = [*(tf_prefix(args.tf_isolation) if prefix is None else prefix), args.tf_python, str(TF_PEER),
           "--dims", ",".join(map(str, dims)), "--num-ps", str(num_ps), "--workers", str(workers),
           "--seconds", str(seconds), "--warmup", str(warmup), "--batch", str(BATCH), "--lr", str(LR), *extra]
    if args.tf_isolation == "netns" and prefix is None:
        cmd.append("--isolated")
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"TensorFlow run did not finish in {exc.timeout:.0f} s") from None
    for line in proc.stdout.splitlines():
        if line.startswith(TF_RESULT_PREFIX):
            result = json.loads(line[len(TF_RESULT_PREFIX):])
            result["wall_seconds"] = time.monotonic() - started
            return result
    noise = ("I0000", "W0000", "WARNING: All log")
    tail = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith(noise))[-2000:]
    raise RuntimeError(f"TensorFlow run exited with {proc.returncode} and no result; stderr:\n{tail}")


# -- the run ----------------------------------------------------------------------------------------

def plan(args) -> list[tuple[str, int]]:
    setups = []
    for model in args.only:
        for num_ps in (args.small_ps if model == "small" else args.big_ps):
            setups.append((model, num_ps))
    return setups


def window(model: str, args) -> tuple[float, int, int]:
    """(seconds, torch warm-up steps per worker, TF warm-up steps over both workers); --seconds sets the first."""
    if model == "small":
        return args.seconds or (3.0 if args.quick else 6.0), 50, 100
    return args.seconds or (4.0 if args.quick else 10.0), 3, 6


def bench(args) -> dict:
    entries = (["tf"] if args.tf else []) + args.variants
    setups = plan(args)
    raw = {setup_name(m, p): {e: [] for e in entries} for m, p in setups}
    status: dict[str, dict[str, str]] = {setup_name(m, p): {} for m, p in setups}
    rounds = []
    for r in range(args.rounds):
        for model, num_ps in setups:
            name = setup_name(model, num_ps)
            seconds, torch_warmup, tf_warmup = window(model, args)
            for entry in entries:
                t0 = time.monotonic()
                record = {"round": r + 1, "setup": name, "entry": entry}
                try:
                    if entry == "tf":
                        result = run_tf(MODELS[model], num_ps, seconds, tf_warmup, args)
                    else:
                        result = run_torch(MODELS[model], num_ps, entry, seconds, torch_warmup)
                    raw[name][entry].append(result["steps_per_s"])
                    record["result"] = result
                    status[name].setdefault(entry, "ok")
                    log(f"round {r + 1}/{args.rounds} {name} {entry}: {result['steps_per_s']:.2f} steps/s "
                        f"({time.monotonic() - t0:.0f} s)")
                except Exception as exc:  # noqa: BLE001 - one failed variant must not end the run
                    status[name][entry] = f"failed: {str(exc).strip()}"
                    record["error"] = status[name][entry]
                    log(f"round {r + 1}/{args.rounds} {name} {entry} FAILED: {str(exc).strip()[-1500:]}")
                rounds.append(record)
    return {"setups": setups, "entries": entries, "raw": raw, "status": status, "rounds": rounds}


def summarize(out: dict, args) -> dict:
    """The issue's keys (null where not measured), medians, ratios of the medians and paired ratios."""
    keys: dict = {}
    for model, pss in (("small", (1, 2)), ("big", (1, 2))):
        for num_ps in pss:
            name = setup_name(model, num_ps)
            keys[f"tf_{name}_steps_per_s"] = None
            for variant in VARIANTS:
                keys[f"{name}_{variant}_steps_per_s"] = None
                keys[f"{name}_ratio_{variant}"] = None
    keys["small_ratio"] = None
    keys["big_2ps_over_1ps"] = None
    paired: dict = {}
    raw = out["raw"]
    for name, by_entry in raw.items():
        tf_runs = by_entry.get("tf", [])
        if tf_runs:
            keys[f"tf_{name}_steps_per_s"] = median(tf_runs)
        for variant in VARIANTS:
            runs = by_entry.get(variant, [])
            if not runs:
                continue
            keys[f"{name}_{variant}_steps_per_s"] = median(runs)
            if tf_runs:
                keys[f"{name}_ratio_{variant}"] = median(runs) / median(tf_runs)
                if len(runs) == len(tf_runs):
                    paired[f"{name}_ratio_{variant}"] = median([a / b for a, b in zip(runs, tf_runs)])
    keys["small_ratio"] = keys["small_ratio_fp32"]
    if keys["big_fp32_steps_per_s"] and keys["big_2ps_fp32_steps_per_s"]:
        keys["big_2ps_over_1ps"] = keys["big_2ps_fp32_steps_per_s"] / keys["big_fp32_steps_per_s"]
        one, two = raw.get("big", {}).get("fp32", []), raw.get("big_2ps", {}).get("fp32", [])
        if one and len(one) == len(two):
            paired["big_2ps_over_1ps"] = median([b / a for a, b in zip(one, two)])
    keys["paired_ratios"] = paired
    copied: dict = {}  # a worker step's bytes copied to move tensors (WorkerStats.bytes_copied), MB, medians
    for record in out["rounds"]:
        if "MB_copied_per_step" in record.get("result", {}):
            copied.setdefault(record["setup"], {}).setdefault(record["entry"], []).append(
                record["result"]["MB_copied_per_step"])
    keys["MB_copied_per_step"] = {name: {entry: median(v) for entry, v in by.items()} for name, by in copied.items()}
    keys["targets"] = {key: {"what": what, "threshold": threshold,
                             "value": keys.get(key),
                             "met": None if keys.get(key) is None else keys[key] >= threshold}
                       for key, threshold, what in TARGETS}
    return keys


def fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict) -> str:
    rows = ["| setup | run | steps/s (median) | per round | torchps / TF | MB copied per step | note |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, by_entry in results["raw"].items():
        digits = 0 if name.startswith("small") else 2
        for entry, runs in by_entry.items():
            state = results["status"][name].get(entry, "ok")
            if entry == "tf":
                what, ratio = "TensorFlow ParameterServerStrategy", "1"
            else:
                what, ratio = f"torchps {entry}", fmt(results.get(f"{name}_ratio_{entry}"))
            note = "" if state == "ok" else state.splitlines()[0][:160]
            copied = fmt(results.get("MB_copied_per_step", {}).get(name, {}).get(entry), 1)
            rows.append(f"| {name} | {what} | {fmt(median(runs) if runs else None, digits)} | "
                        f"{', '.join(fmt(x, digits) for x in runs) or '-'} | {ratio} | {copied} | {note} |")
    rows += ["", "| target | figure | |", "| --- | --- | --- |"]
    for key, target in results["targets"].items():
        verdict = "not measured" if target["met"] is None else ("met" if target["met"] else "NOT met")
        rows.append(f"| {target['what']} (`{key}`) | {fmt(target['value'])} | {verdict} |")
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--json", type=pathlib.Path, help="write medians, ratios, targets and every round here")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true",
                        help="1 round, 3 s (seed MLP) and 4 s (big MLP) windows instead of 6 s and 10 s")
    parser.add_argument("--seconds", type=float, help="every timed window this long instead (a smoke run: its "
                        "figures are not comparable to the others')")
    parser.add_argument("--only", default="small,big", help="small, big or small,big (default)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"torchps variants, comma-separated (default {','.join(VARIANTS)})")
    parser.add_argument("--big-ps", default="1,2", help="ps counts for the big MLP (default 1,2)")
    parser.add_argument("--small-ps", default="1", help="ps counts for the seed MLP (default 1)")
    parser.add_argument("--no-tf", dest="tf", action="store_false", help="torchps only (no TensorFlow here)")
    parser.add_argument("--tf-python", default=None,
                        help="interpreter with tensorflow-cpu for bench/tf_peer.py (default .venv-tf/bin/python "
                             "if present, else this one)")
    parser.add_argument("--tf-isolation", default="netns", choices=("netns", "none"),
                        help="netns (default): run TensorFlow in a private network namespace holding only "
                             "loopback (unshare -rn), as its servers listen on every interface; none: as is")
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="leave glibc malloc at its defaults (default: torchps's settings for every process, "
                             "TensorFlow's included)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.only = [m.strip() for m in args.only.split(",") if m.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.big_ps = [int(p) for p in args.big_ps.split(",") if p.strip()]
    args.small_ps = [int(p) for p in args.small_ps.split(",") if p.strip()]
    if set(args.only) - set(MODELS) or not args.only:
        parser.error(f"--only takes small, big or both; got {args.only}")
    if set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(args.variants) - set(VARIANTS))}; known: {', '.join(VARIANTS)}")
    if any(p < 1 for p in args.big_ps + args.small_ps):
        parser.error("ps counts must be >= 1")
    if args.seconds is not None and args.seconds <= 0:
        parser.error("--seconds must be > 0")
    args.tf_python = args.tf_python or default_tf_python()
    args.tf_version = None
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.no_malloc_tuning:
        from torchps.client import tune_malloc
        from torchps.memory import malloc_env

        os.environ.update(malloc_env())  # shards, workers and TensorFlow's processes inherit them
        tune_malloc()
    started = time.monotonic()
    results: dict = {**environment()}
    tf_problem = None
    if args.tf:
        tf_problem = check_tf(args)
        if tf_problem:
            log(f"TensorFlow side skipped: {tf_problem}")
            args.tf = False
    results["config"] = {
        "rounds": args.rounds, "quick": args.quick, "only": args.only, "variants": args.variants,
        "big_ps": args.big_ps, "small_ps": args.small_ps, "batch": BATCH, "lr": LR, "workers": WORKERS,
        "dims": {m: list(d) for m, d in MODELS.items()}, "activation": "sigmoid (pullpush.make_mlp, both models)",
        "windows_seconds": {m: window(m, args)[0] for m in MODELS},
        "torch_threads": "workers torch.set_num_threads(1); shards 1 unless --torch-threads in shard_args",
        "tf_threads": "every task 1 intra-op, 2 inter-op thread(s) (1 inter-op deadlocks TF 2.21's first step)",
        "tf": {"python": args.tf_python if args.tf else None, "version": args.tf_version,
               "isolation": args.tf_isolation if args.tf else None,
               "skipped": "--no-tf" if tf_problem is None and not args.tf else tf_problem},
    }
    results["versions"]["tensorflow"] = args.tf_version
    out = bench(args)
    results.update(summarize(out, args))
    results["raw"] = out["raw"]
    results["status"] = out["status"]
    results["rounds"] = out["rounds"]
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["wall_seconds"] = time.monotonic() - started

    print(table(results))
    tf_line = (f"TensorFlow {args.tf_version} ({args.tf_python}, isolation {args.tf_isolation})" if args.tf
               else f"no TensorFlow ({results['config']['tf']['skipped']})")
    print(f"\n{results['machine']['nproc']} CPUs; torch {results['versions']['torch']}; {tf_line}; load "
          f"{results['machine']['loadavg_start'][0]:.1f} -> {results['machine']['loadavg_end'][0]:.1f}; "
          f"{results['wall_seconds']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
