#!/usr/bin/env python
"""torchps beside TensorFlow where the link is the limit: every run in a network namespace of its own.

    python bench/network.py --json bench/results/network.json   # links 1gbit,10gbit,none, 3 rounds (about an hour)
    python bench/network.py --links 1gbit --variants fp32,topk_delta --rounds 1
    python bench/network.py --smoke                              # the suite's check: seconds, no TensorFlow

Each run (TensorFlow's ParameterServerStrategy, each torchps variant, and the
two frameworks' one-process forward + backward) starts in a fresh network
namespace (`unshare -n`; `-rn` without root) holding only `lo`, which it
brings up and, for a link, shapes with `tc qdisc add dev lo root tbf rate
RATE burst 256kb latency 20ms`. Every address is 127.0.0.1 inside it; both
directions of every connection share the one shaped loopback, as a host's
traffic shares its link. MB on the wire per step are lo's transmitted bytes
(TCP/IP headers included) over the timed window, per step of either worker.

Setups (bench/peers.py's code and models): the 25.3M MLP at every link, the
seed MLP unshaped (`--small-links`), 1 ps + 2 async workers, SGD lr 0.01,
batches of 100. torchps variants (peers.py's VARIANTS): fp32, tls (fp32 with
mutual TLS + the job token, what a deployment runs), bf16 (both ways), topk
(1% with error feedback, pulls whole), topk_delta (the same with delta
pulls), overlap. The shard runs one torch thread (`--torch-threads 1`: it
shares 2 cores with 2 workers; TensorFlow's ps runs one intra-op thread).
Each round runs every link's TensorFlow run then each torchps variant, each
on fresh processes; medians over rounds, ratios torchps / TensorFlow of the
medians, the issue's targets with met / NOT met.

The PS's own cost per step (unshaped, 25.3M MLP, fp32): CPU per step of
everything the run used (workers, shard; TensorFlow's coordinator too) minus
the same framework's forward + backward in one process (`local`), both
measured in the run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

from peers import (LR, MODELS, TF_INSTALL, VARIANTS, WORKERS, default_tf_python, run_tf,
                   run_torch)
from pullpush import BATCH, environment, log, make_mlp, median

HERE = pathlib.Path(__file__).resolve().parent
RESULT_PREFIX = "NETWORK_RESULT "
LINKS = {"1gbit": "1gbit", "10gbit": "10gbit", "none": None}  # tbf rate, None: not shaped
TBF_OPTIONS = ["burst", "256kb", "latency", "20ms"]
SHARD_ARGS = ["--torch-threads", "1"]
DEFAULT_VARIANTS = "fp32,tls,bf16,topk,topk_delta"
RUN_TIMEOUT = 900.0  # one namespaced run: start-up on a loaded machine, warm-up, the window

# (key, threshold, at most, what): the issue's bars.
TARGETS = (
    ("link_1gbit_ratio_fp32", 1.0, False, "1 Gbit/s: fp32 >= 1.0 x TF"),
    ("link_1gbit_ratio_bf16", 1.8, False, "1 Gbit/s: bf16 >= 1.8 x TF"),
    ("link_1gbit_ratio_topk_delta", 4.0, False, "1 Gbit/s: top-k 1% + delta pulls >= 4 x TF"),
    ("link_10gbit_ratio_fp32", 1.0, False, "10 Gbit/s: fp32 >= 1.0 x TF"),
    ("link_10gbit_ratio_bf16", 1.3, False, "10 Gbit/s: bf16 >= 1.3 x TF"),
    ("link_none_small_ratio_fp32", 2.5, False, "seed MLP, unshaped: >= 2.5 x TF"),
    ("ps_cost_ratio", 1.0, True, "the PS's own CPU per step, torchps / TF <= 1 (unshaped, 25.3M, fp32)"),
)


def unshare_prefix() -> list[str]:
    """A new network namespace for the command (as root; otherwise inside a user namespace of its own)."""
    return ["unshare", "-n", "--"] if os.geteuid() == 0 else ["unshare", "-rn", "--"]


def probe() -> str | None:
    """None if a namespace with a shaped loopback can be made here; else why not."""
    if shutil.which("unshare") is None or shutil.which("tc") is None or shutil.which("ip") is None:
        return "needs unshare, ip and tc (util-linux, iproute2)"
    shape = f"ip link set lo up && tc qdisc add dev lo root tbf rate 1gbit {' '.join(TBF_OPTIONS)}"
    run = subprocess.run([*unshare_prefix(), "sh", "-c", shape], capture_output=True, text=True)
    if run.returncode != 0:
        return f"`unshare -n` with a tbf-shaped lo is not permitted here: {(run.stderr or run.stdout).strip()}"
    return None


def setup_namespace(link: str) -> str:
    """Inside a fresh namespace: brings lo up, shapes it for `link`, checks it is the only interface; returns
    the qdisc in force."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    if LINKS[link] is not None:
        subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", LINKS[link], *TBF_OPTIONS],
                       check=True)
    interfaces = [name for _, name in socket.if_nameindex()]
    if interfaces != ["lo"]:
        raise RuntimeError(f"not a private namespace: interfaces {interfaces}")
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout.strip()


def torch_local(dims, seconds: float, warmup: int) -> dict:
    """One process, no PS: CPU seconds per forward + backward of the model (1 torch thread, as the workers)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_mlp(dims)
    xs, ys = torch.rand(4, BATCH, dims[0]), torch.randint(0, dims[-1], (4, BATCH))

    def step(i: int) -> None:
        model.zero_grad()
        F.cross_entropy(model(xs[i % 4]), ys[i % 4]).backward()

    for i in range(warmup):
        step(i)
    steps, cpu0, t0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step(steps)
        steps += 1
    return {"steps": steps, "seconds": time.perf_counter() - t0,
            "cpu_seconds_per_step": (time.process_time() - cpu0) / steps,
            "what": "forward + backward in one process, 1 torch thread, gradients not applied"}


def inside(args) -> int:
    """The namespaced run of one entry: prints RESULT_PREFIX + its JSON."""
    qdisc = setup_namespace(args.inside)
    dims = MODELS[args.model]
    if args.entry == "tf":
        result = run_tf(dims, 1, args.seconds, args.tf_warmup, args, prefix=[], extra=["--isolated"])
        wire = result.get("loopback_bytes")
        result["MB_on_wire_per_step"] = None if wire is None else wire / result["steps"] / 1e6
    elif args.entry == "tf_local":
        result = run_tf(dims, 1, args.seconds, args.warmup, args, prefix=[], extra=["--local"])
    elif args.entry == "torch_local":
        result = torch_local(dims, args.seconds, args.warmup)
    else:
        result = run_torch(dims, 1, args.entry, args.seconds, args.warmup, shard_args=SHARD_ARGS,
                           count_loopback=True)
    result["qdisc"] = qdisc
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)
    return 0


def namespaced(args, link: str, model: str, entry: str) -> dict:
    """Runs one entry in a fresh namespace for `link`; its result, or RuntimeError with its output's tail."""
    seconds, warmup, tf_warmup = window(model, args)
    return in_namespace(pathlib.Path(__file__), ["--inside", link, "--model", model, "--entry", entry,
                                                 "--seconds", str(seconds), "--warmup", str(warmup),
                                                 "--tf-warmup", str(tf_warmup), "--tf-python", args.tf_python])


def in_namespace(script, script_args: list[str]) -> dict:
    """Runs `script` with this interpreter in a fresh network namespace (it calls setup_namespace and prints
    RESULT_PREFIX + its JSON): that JSON, or RuntimeError with its output's tail."""
    cmd = [*unshare_prefix(), sys.executable, str(pathlib.Path(script).resolve()), *script_args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=HERE)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no result in {RUN_TIMEOUT:.0f} s") from None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    noise = ("I0000", "W0000", "WARNING: All log")
    tail = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if not ln.startswith(noise))[-2000:]
    raise RuntimeError(f"exited with {proc.returncode} and no result:\n{tail}")


def window(model: str, args) -> tuple[float, int, int]:
    """(seconds, torch warm-up steps per worker, TF warm-up steps over both workers)."""
    if args.smoke:
        return 1.0, 5, 10
    if model == "small":
        return (3.0 if args.quick else 6.0), 50, 100
    return (5.0 if args.quick else 15.0), 3, 6


def plan(args) -> list[tuple[str, str, str]]:
    """(link, model, entry) of one round, in order: per link and model, TensorFlow then each variant; the
    one-process runs last."""
    runs = []
    for link in args.links:
        for model in args.only:
            if model == "small" and link not in args.small_links:
                continue
            runs += [(link, model, entry) for entry in (["tf"] if args.tf else []) + args.variants]
    if "none" in args.links and "big" in args.only and not args.smoke:
        runs += [("none", "big", "torch_local")] + ([("none", "big", "tf_local")] if args.tf else [])
    return runs


def bench(args) -> dict:
    raw: dict = {}
    status: dict = {}
    rounds = []
    for r in range(args.rounds):
        for link, model, entry in plan(args):
            key = f"{link}/{model}/{entry}"
            t0 = time.monotonic()
            record = {"round": r + 1, "link": link, "model": model, "entry": entry}
            try:
                result = namespaced(args, link, model, entry)
                raw.setdefault(key, []).append(result)
                record["result"] = result
                status.setdefault(key, "ok")
                figure = (f"{result['steps_per_s']:.2f} steps/s, {fmt(result.get('MB_on_wire_per_step'), 1)} MB/step"
                          if "steps_per_s" in result else f"{result['cpu_seconds_per_step'] * 1e3:.0f} ms CPU/step")
                log(f"round {r + 1}/{args.rounds} {key}: {figure} ({time.monotonic() - t0:.0f} s)")
            except Exception as exc:  # noqa: BLE001 - one failed run must not end the others
                status[key] = f"failed: {str(exc).strip()}"
                record["error"] = status[key]
                log(f"round {r + 1}/{args.rounds} {key} FAILED: {str(exc).strip()[-1500:]}")
            rounds.append(record)
    return {"raw": raw, "status": status, "rounds": rounds}


def prefix_of(link: str, model: str) -> str:
    """JSON key prefix: link_1gbit (the 25.3M MLP), link_none_small (the seed MLP)."""
    return f"link_{link}" + ("" if model == "big" else f"_{model}")


def summarize(out: dict, args) -> dict:
    """Medians per link, model and entry; ratios of the medians; the PS's own cost; targets."""
    keys: dict = {}
    for link in LINKS:
        for model in MODELS:
            name = prefix_of(link, model)
            for entry in ["tf", *VARIANTS]:
                runs = out["raw"].get(f"{link}/{model}/{entry}", [])
                keys[f"{name}_{entry}_steps_per_s"] = median([r["steps_per_s"] for r in runs]) if runs else None
                wire = [r["MB_on_wire_per_step"] for r in runs if r.get("MB_on_wire_per_step") is not None]
                keys[f"{name}_{entry}_MB_per_step"] = median(wire) if wire else None
            tf = keys[f"{name}_tf_steps_per_s"]
            for entry in VARIANTS:
                mine = keys[f"{name}_{entry}_steps_per_s"]
                keys[f"{name}_ratio_{entry}"] = mine / tf if mine and tf else None
    keys.update(ps_cost(out["raw"]))
    keys["targets"] = verdicts(keys, TARGETS)
    return keys


def verdicts(keys: dict, targets) -> dict:
    """{key: {what, threshold, value, met}} of (key, threshold, at most, what) targets against `keys` (met None
    where the key is None)."""
    out = {}
    for key, threshold, at_most, what in targets:
        value = keys.get(key)
        met = None if value is None else (value <= threshold if at_most else value >= threshold)
        out[key] = {"what": what, "threshold": threshold, "value": value, "met": met}
    return out


def ps_cost(raw: dict) -> dict:
    """The PS's own CPU per step, unshaped, 25.3M MLP, fp32: the run's CPU per step less the framework's
    forward + backward alone (medians), ms; and torchps's over TensorFlow's."""
    def med(key: str, pick) -> float | None:
        values = [v for v in (pick(r) for r in raw.get(key, [])) if v is not None]
        return median(values) * 1e3 if values else None

    def total(cpu: dict) -> float | None:
        return None if any(v is None for v in cpu.values()) else sum(cpu.values())

    torch_run = med("none/big/fp32", lambda r: total({k: r["cpu_seconds_per_step"][k] for k in ("workers", "ps")}))
    tf_run = med("none/big/tf", lambda r: total(r["cpu_seconds_per_step"]))
    torch_local_ms = med("none/big/torch_local", lambda r: r["cpu_seconds_per_step"])
    tf_local_ms = med("none/big/tf_local", lambda r: r["cpu_seconds_per_step"])
    out = {"step_cpu_ms_torchps": torch_run, "step_cpu_ms_tf": tf_run, "local_cpu_ms_torchps": torch_local_ms,
           "local_cpu_ms_tf": tf_local_ms, "ps_cost_ms_torchps": None, "ps_cost_ms_tf": None, "ps_cost_ratio": None}
    if torch_run is not None and torch_local_ms is not None:
        out["ps_cost_ms_torchps"] = torch_run - torch_local_ms
    if tf_run is not None and tf_local_ms is not None:
        out["ps_cost_ms_tf"] = tf_run - tf_local_ms
    if out["ps_cost_ms_torchps"] is not None and out["ps_cost_ms_tf"]:
        out["ps_cost_ratio"] = out["ps_cost_ms_torchps"] / out["ps_cost_ms_tf"]
    return out


def fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict, args) -> str:
    rows = ["| link | model | run | steps/s (median) | per round | torchps / TF | MB on the wire per step | note |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for link in args.links:
        for model in args.only:
            if model == "small" and link not in args.small_links:
                continue
            name = prefix_of(link, model)
            for entry in (["tf"] if args.tf else []) + args.variants:
                runs = results["raw"].get(f"{link}/{model}/{entry}", [])
                state = results["status"].get(f"{link}/{model}/{entry}", "not run")
                what = "TensorFlow ParameterServerStrategy" if entry == "tf" else f"torchps {entry}"
                ratio = "1" if entry == "tf" else fmt(results.get(f"{name}_ratio_{entry}"))
                rows.append(f"| {link} | {model} | {what} | {fmt(results.get(f'{name}_{entry}_steps_per_s'))} | "
                            f"{', '.join(fmt(r['steps_per_s']) for r in runs) or '-'} | {ratio} | "
                            f"{fmt(results.get(f'{name}_{entry}_MB_per_step'), 1)} | "
                            f"{'' if state == 'ok' else state.splitlines()[0][:160]} |")
    rows += ["", "| the PS's own CPU per step (unshaped, 25.3M, fp32), ms | torchps | TensorFlow |", "| --- | --- | --- |",
             f"| the run's CPU per step | {fmt(results['step_cpu_ms_torchps'], 0)} | {fmt(results['step_cpu_ms_tf'], 0)} |",
             f"| forward + backward alone | {fmt(results['local_cpu_ms_torchps'], 0)} | "
             f"{fmt(results['local_cpu_ms_tf'], 0)} |",
             f"| the PS's own | {fmt(results['ps_cost_ms_torchps'], 0)} | {fmt(results['ps_cost_ms_tf'], 0)} |"]
    return "\n".join(rows + target_rows(results["targets"]))


def target_rows(targets: dict) -> list[str]:
    """verdicts() as a markdown table: met, NOT met or not measured."""
    rows = ["", "| target | figure | |", "| --- | --- | --- |"]
    for key, target in targets.items():
        verdict = "not measured" if target["met"] is None else ("met" if target["met"] else "NOT met")
        rows.append(f"| {target['what']} (`{key}`) | {fmt(target['value'])} | {verdict} |")
    return rows


def check_tf(args) -> str | None:
    """None if TensorFlow runs with --tf-python; else why not (with how to install it)."""
    if not os.path.exists(args.tf_python):
        return f"--tf-python {args.tf_python} does not exist; install the TF side with: {TF_INSTALL}"
    probe_run = subprocess.run([args.tf_python, "-c", "import tensorflow as tf; print(tf.__version__)"],
                               capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if probe_run.returncode != 0:
        return f"{args.tf_python} cannot import tensorflow; install it with: {TF_INSTALL}"
    args.tf_version = probe_run.stdout.strip().splitlines()[-1]
    return None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--json", type=pathlib.Path, help="write medians, ratios, targets and every run here")
    parser.add_argument("--links", default="1gbit,10gbit,none", help=f"comma-separated, of {', '.join(LINKS)}")
    parser.add_argument("--small-links", default="none", help="links the seed MLP runs at (default none)")
    parser.add_argument("--only", default="big,small", help="models: big, small or both (default)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"torchps variants (default {DEFAULT_VARIANTS}; known: {', '.join(VARIANTS)})")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="1 round, 5 s (25.3M) and 3 s (seed) windows")
    parser.add_argument("--smoke", action="store_true",
                        help="the suite's check: 1 Gbit/s, the seed MLP, torchps fp32 only, 1 s, no TensorFlow")
    parser.add_argument("--no-tf", dest="tf", action="store_false", help="torchps only")
    parser.add_argument("--tf-python", default=None,
                        help="interpreter with tensorflow-cpu (default .venv-tf/bin/python if present, else this one)")
    # internal: one run inside its namespace
    parser.add_argument("--inside", choices=list(LINKS), help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--entry", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tf-warmup", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tf_python = args.tf_python or default_tf_python()
    args.tf_isolation, args.tf_version = "none", None  # run_tf's view: the namespace is this script's own
    if args.smoke:
        args.links, args.small_links, args.only, args.variants, args.tf = "1gbit", "1gbit", "small", "fp32", False
        args.rounds = 1
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.links = [x.strip() for x in args.links.split(",") if x.strip()]
    args.small_links = [x.strip() for x in args.small_links.split(",") if x.strip()]
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    args.variants = [x.strip() for x in args.variants.split(",") if x.strip()]
    for what, given, known in (("--links", args.links, LINKS), ("--small-links", args.small_links, LINKS),
                               ("--only", args.only, MODELS), ("--variants", args.variants, VARIANTS)):
        if set(given) - set(known):
            parser.error(f"{what}: unknown {sorted(set(given) - set(known))}; known: {', '.join(known)}")
    return args


def prepare(args) -> tuple[str | None, str | None]:
    """Before the first run: torchps's malloc settings for every process to come (TensorFlow's too); (why
    namespaces cannot be made here, why TensorFlow cannot run: args.tf turned off, logged), None where they can."""
    from torchps.client import tune_malloc
    from torchps.memory import malloc_env

    os.environ.update(malloc_env())
    tune_malloc()
    problem = probe()
    tf_problem = check_tf(args) if args.tf and not problem else None
    if tf_problem:
        log(f"TensorFlow side skipped: {tf_problem}")
        args.tf = False
    return problem, tf_problem


def finish(results: dict, started: float, tables: str, args, lead: str = "") -> None:
    """Adds the load at the end and the wall time to `results`; prints `tables` and a line of the machine (after
    `lead`); writes --json."""
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["wall_seconds"] = time.monotonic() - started
    print(tables)
    print(f"\n{lead}{results['machine']['nproc']} CPUs; torch {results['versions']['torch']}; "
          f"TensorFlow {args.tf_version or 'not run'}; load {results['machine']['loadavg_start'][0]:.1f} -> "
          f"{results['machine']['loadavg_end'][0]:.1f}; {results['wall_seconds']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.inside:
        return inside(args)
    problem, tf_problem = prepare(args)
    if problem:
        print(f"network.py: {problem}", file=sys.stderr)
        return 2
    started = time.monotonic()
    results: dict = {**environment()}
    results["config"] = {
        "links": args.links, "small_links": args.small_links, "only": args.only, "variants": args.variants,
        "rounds": args.rounds, "quick": args.quick, "smoke": args.smoke, "batch": BATCH, "lr": LR,
        "workers": WORKERS, "num_ps": 1, "shard_args": SHARD_ARGS, "tbf": TBF_OPTIONS,
        "windows_seconds": {m: window(m, args)[0] for m in MODELS},
        "namespace": " ".join(unshare_prefix()),
        "tf": {"python": args.tf_python if args.tf else None, "version": args.tf_version,
               "skipped": tf_problem or (None if args.tf else "--no-tf")},
    }
    out = bench(args)
    results.update(summarize(out, args))
    results["raw"], results["status"], results["rounds"] = out["raw"], out["status"], out["rounds"]
    finish(results, started, table(results, args), args)
    return 0 if all(state == "ok" for state in out["status"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
