#!/usr/bin/env python
"""The data plane alone: torchps beside TensorFlow's ParameterServerStrategy, the workers computing nothing.

    python bench/dataplane.py --json /tmp/dataplane.json       # 1ps,2ps x none,10gbit,1gbit, 3 rounds (most of an hour)
    python bench/dataplane.py --links none --setups 1ps --rounds 1 --seconds 8   # a try, a few minutes
    python bench/dataplane.py --model small --variants fp32,bf16 --no-tf
    python bench/dataplane.py --links none --setups 1ps --profile /tmp/dp-profile   # + perf, per process
    python bench/dataplane.py --smoke                            # the suite's check: seconds, no TensorFlow
    python bench/dataplane.py --links none --setups 1ps --variants fp32,nocache --mode sync --no-tf --rounds 1

Each step a worker moves the whole model from the ps and a gradient of the same
size back, SGD applied on the ps, and computes nothing else: only the PS, the
transport and serialization are timed. Model: the 784-8192-2304-10 MLP
(pullpush.BIG_DIMS, 25.3M float32, 101 MB each way) or, with --model small,
the 784-100-10 seed MLP. Setups: 1ps (1 ps + 2 workers) and 2ps (2 ps + 4
workers, partitioned as bench/peers.py does: MinSizePartitioner(256 KiB,
max_shards=2) on both sides). SGD lr 0.01.

TensorFlow side: bench/tf_peer.py --no-compute. Each scheduled step reads
every variable onto its worker, multiplies it there by a constant (the
gradient, as large as the variable) and applies assign_sub(lr * gradient) on
the ps; every task runs 1 intra-op thread. torchps side: fresh ps-server
shards (--torch-threads 1) and worker processes (torch.set_num_threads(1)),
each a PSClient + register_module(model, Optimizer("sgd", lr)), the chief
creating the variables; every .grad is set once to fixed random tensors, then
each step is binding.exchange() (push and pull in one call per shard):
peers.run_torch(compute=False). Variants: fp32; bf16 (compression both ways);
tls (mutual TLS + the job token on every shard and client); inline (fp32
with PSClient(lanes=False): every byte over gRPC, as before bulk lanes); journal (fp32,
the shards started with --checkpoint-dir in a temporary folder: the journal
on, as every shipped manifest runs it); nocache and bf16_nocache (fp32 and bf16
with the shards started with --no-pull-cache: every pull copies or casts its
variables itself). --mode sync runs the torchps workers in sync mode (every
step waits for every worker's gradient, then each pulls the same version);
the default is async.

Every run starts in a fresh network namespace holding only lo, unshaped or
shaped to the link's rate (bench/network.py: `tc qdisc add dev lo root tbf rate
RATE burst 256kb latency 20ms`; every address 127.0.0.1, both directions on
the one loopback). Each round runs, per setup and link, TensorFlow then each
torchps variant, each on fresh processes; medians over --rounds.

Per run: steps/s of all workers together over the timed window (after warm-up
steps); CPU seconds per step of every process (user + system from /proc: each
worker, each shard, TensorFlow's chief too) and their sum; MB on the wire per
step (lo's transmitted bytes over the window / steps, headers included) and
that over twice the model's bytes: about 1 (0.5 with bf16) when the whole
model went each way, flagged in the table below 0.9 of that. Where
PSClient.stats has stage_seconds, each stage's milliseconds per step (the
workers' average). Ratios of the medians: torchps / TF in steps/s and in CPU
per step, per setup, link and variant; tls, bf16 and journal over fp32; the
issue's bars with met / NOT met.

--profile DIR: every run also records the machine with `perf record -a -g`
for a few seconds from a second into the window (bench/perf_profile.py) and
summarizes each of its processes (every shard and worker; TensorFlow's ps,
workers and chief): self time grouped into memcpy, kernel socket copy,
context switches / futex, python interpreter, grpc / protobuf / ssl, tensor
kernels, malloc / page faults and other, the top symbols, the cores it kept
busy. DIR/RUN/ holds perf.data and summary.json; the summaries are in the
run's JSON too. A profiled run's figures include perf's own cost.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

from network import LINKS, RESULT_PREFIX, TBF_OPTIONS, finish, fmt, in_namespace, prepare, setup_namespace, \
    target_rows, unshare_prefix, verdicts
from peers import LR, MODELS, default_tf_python, run_tf, run_torch
from perf_profile import Recording, summarize_folder
from pullpush import environment, log, median, mlp_numel

SETUPS = {"1ps": (1, 2), "2ps": (2, 4)}  # name -> (ps, workers)
# name -> (peers.VARIANTS entry, shards with the journal, more shard flags)
VARIANTS = {"fp32": ("fp32", False, []), "inline": ("inline", False, []), "bf16": ("bf16", False, []),
            "tls": ("tls", False, []), "journal": ("fp32", True, []), "nocache": ("fp32", False, ["--no-pull-cache"]),
            "bf16_nocache": ("bf16", False, ["--no-pull-cache"])}
OVER_FP32 = ("inline", "tls", "bf16", "journal")
WIRE_SHARE = {"bf16": 0.5, "bf16_nocache": 0.5}  # the wire's share of 2 x the model's float32 bytes (else 1)
SHARD_ARGS = ["--torch-threads", "1"]
PROFILE_DELAY = 1.0  # seconds into the window before perf starts

# (key, threshold, at most, what): the issue's bars.
TARGETS = (
    ("1ps_none_ratio_fp32", 1.0, False, "no compute, 1 ps + 2 workers, unshaped: steps/s >= 1.0 x TF"),
    ("1ps_none_cpu_ratio_fp32", 1.0, True, "no compute, 1 ps + 2 workers, unshaped: CPU per step <= TF's"),
    ("1ps_10gbit_ratio_fp32", 1.0, False, "no compute, 1 ps + 2 workers, 10 Gbit/s: steps/s >= 1.0 x TF"),
    ("1ps_10gbit_cpu_ratio_fp32", 1.0, True, "no compute, 1 ps + 2 workers, 10 Gbit/s: CPU per step <= TF's"),
    ("1ps_none_tls_over_fp32", 0.85, False, "TLS >= 0.85 x plaintext (1 ps, unshaped)"),
    ("1ps_10gbit_tls_over_fp32", 0.85, False, "TLS >= 0.85 x plaintext (1 ps, 10 Gbit/s)"),
    ("1ps_none_journal_over_fp32", 0.90, False, "journal >= 0.90 x journal off (1 ps, unshaped)"),
    ("1ps_10gbit_journal_over_fp32", 0.90, False, "journal >= 0.90 x journal off (1 ps, 10 Gbit/s)"),
)
RUN_KEYS = ("steps_per_s", "cpu_ms_per_step", "cpu_ms_per_step_each", "MB_per_step", "wire_over_2x_model",
            "stage_ms_per_step")


def window(args) -> tuple[float, int, int]:
    """(seconds, warm-up steps per torchps worker, per TensorFlow worker); --seconds sets the first."""
    if args.smoke:
        return 1.0, 2, 2
    if args.model == "small":
        return args.seconds or 5.0, 30, 30
    return args.seconds or 10.0, 3, 3


def profile_seconds(seconds: float) -> float:
    """How long perf records in a window of `seconds`: a few seconds, ending before the window does."""
    return max(1.0, min(5.0, seconds - PROFILE_DELAY - 1.0))


def inside(args) -> int:
    """The namespaced run of one (setup, entry): prints RESULT_PREFIX + its JSON."""
    qdisc = setup_namespace(args.inside)
    num_ps, workers = SETUPS[args.setup]
    dims, folder = MODELS[args.model], args.profile_dir
    if args.entry == "tf":
        profile = ["--profile", folder, "--profile-seconds", str(profile_seconds(args.seconds))] if folder else []
        result = run_tf(dims, num_ps, args.seconds, args.tf_warmup * workers, args, prefix=[], workers=workers,
                        extra=["--isolated", "--no-compute", *profile])
        wire = result.get("loopback_bytes")
        result["MB_on_wire_per_step"] = None if wire is None else wire / result["steps"] / 1e6
    else:
        variant, journal, flags = VARIANTS[args.entry]
        recordings = []

        def record(pids: dict, start_at: float) -> None:
            recordings.append(Recording({f"torchps-{name}": pid for name, pid in pids.items()}, folder,
                                        delay=start_at + PROFILE_DELAY - time.time(),
                                        seconds=profile_seconds(args.seconds)))

        with tempfile.TemporaryDirectory(prefix="torchps-dataplane-") as journal_dir:
            result = run_torch(dims, num_ps, variant, args.seconds, args.warmup, count_loopback=True,
                               shard_args=[*SHARD_ARGS, *flags,
                                           *(["--checkpoint-dir", journal_dir] if journal else [])],
                               workers=workers, compute=False, during=record if folder else None, mode=args.mode)
        for recording in recordings:
            recording.finish()
        result["stage_ms_per_step_each"] = stage_ms(result["workers"])
        result["stage_ms_per_step"] = average(result["stage_ms_per_step_each"])
    if folder:
        result["profile"] = summarize_folder(folder)
    each = result["cpu_seconds_per_step_each"]
    result["cpu_seconds_per_step_total"] = None if None in each.values() else sum(each.values())
    model_mb = mlp_numel(dims) * 4 / 1e6
    wire = result["MB_on_wire_per_step"]
    result.update(qdisc=qdisc, setup=args.setup, model=args.model, model_MB=model_mb,
                  wire_over_2x_model=None if wire is None else wire / (2 * model_mb))
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)
    return 0


def stage_ms(workers: list[dict]) -> dict | None:
    """Each worker's ms per step in each stage over the window (PSClient.stats.stage_seconds), by worker; None
    where the client keeps no stage times."""
    each = {f"worker-{i}": {k: 1e3 * v / w["steps"] for k, v in w["stage_seconds"].items()}
            for i, w in enumerate(workers) if w.get("stage_seconds") is not None and w["steps"]}
    return each or None


def average(each: dict | None) -> dict | None:
    """The workers' average of stage_ms()."""
    if not each:
        return None
    stages = {k for by_stage in each.values() for k in by_stage}
    return {k: sum(w.get(k, 0.0) for w in each.values()) / len(each) for k in sorted(stages)}


def plan(args) -> list[tuple[str, str, str]]:
    """(setup, link, entry) of one round, in order: per setup and link, TensorFlow then each variant."""
    entries = (["tf"] if args.tf else []) + args.variants
    return [(setup, link, entry) for setup in args.setups for link in args.links for entry in entries]


def bench(args) -> dict:
    seconds, warmup, tf_warmup = window(args)
    raw: dict = {}
    status: dict = {}
    rounds = []
    for r in range(args.rounds):
        for setup, link, entry in plan(args):
            key = f"{setup}/{link}/{entry}"
            script_args = ["--inside", link, "--setup", setup, "--entry", entry, "--model", args.model,
                           "--mode", args.mode, "--seconds", str(seconds), "--warmup", str(warmup),
                           "--tf-warmup", str(tf_warmup), "--tf-python", args.tf_python]
            if args.profile:
                script_args += ["--profile-dir", str(args.profile.resolve() / f"r{r + 1}-{setup}-{link}-{entry}")]
            t0 = time.monotonic()
            record = {"round": r + 1, "setup": setup, "link": link, "entry": entry}
            try:
                result = in_namespace(__file__, script_args)
                raw.setdefault(key, []).append(result)
                record["result"] = result
                status.setdefault(key, "ok")
                log(f"round {r + 1}/{args.rounds} {key}: {result['steps_per_s']:.2f} steps/s, "
                    f"{fmt(ms(result['cpu_seconds_per_step_total']), 0)} ms CPU/step, "
                    f"{fmt(result['MB_on_wire_per_step'], 1)} MB/step on the wire ({time.monotonic() - t0:.0f} s)")
            except Exception as exc:  # noqa: BLE001 - one failed run must not end the others
                status[key] = f"failed: {str(exc).strip()}"
                record["error"] = status[key]
                log(f"round {r + 1}/{args.rounds} {key} FAILED: {str(exc).strip()[-1500:]}")
            rounds.append(record)
    return {"raw": raw, "status": status, "rounds": rounds}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def medians(runs: list[dict]) -> dict:
    """One run key's medians over its rounds (RUN_KEYS); None where no round measured it."""
    def med(values) -> float | None:
        values = [v for v in values if v is not None]
        return median(values) if values else None

    def med_dict(dicts) -> dict | None:
        dicts = [d for d in dicts if d]
        return {k: med(d.get(k) for d in dicts) for k in dicts[0]} if dicts else None

    return {"steps_per_s": med(r["steps_per_s"] for r in runs),
            "cpu_ms_per_step": med(ms(r["cpu_seconds_per_step_total"]) for r in runs),
            "cpu_ms_per_step_each": med_dict({k: ms(v) for k, v in r["cpu_seconds_per_step_each"].items()}
                                             for r in runs),
            "MB_per_step": med(r["MB_on_wire_per_step"] for r in runs),
            "wire_over_2x_model": med(r["wire_over_2x_model"] for r in runs),
            "stage_ms_per_step": med_dict(r.get("stage_ms_per_step") for r in runs)}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(out: dict) -> dict:
    """Medians per run key; ratios torchps / TF (steps/s, CPU per step) and over fp32 for every setup, link and
    variant (None where not measured); the targets."""
    keys: dict = {"medians": {key: medians(runs) for key, runs in out["raw"].items()}}
    empty = dict.fromkeys(RUN_KEYS)
    for setup in SETUPS:
        for link in LINKS:
            at = {entry: keys["medians"].get(f"{setup}/{link}/{entry}", empty) for entry in ["tf", *VARIANTS]}
            for entry in VARIANTS:
                keys[f"{setup}_{link}_ratio_{entry}"] = ratio(at[entry]["steps_per_s"], at["tf"]["steps_per_s"])
                keys[f"{setup}_{link}_cpu_ratio_{entry}"] = ratio(at[entry]["cpu_ms_per_step"],
                                                                  at["tf"]["cpu_ms_per_step"])
            for entry in OVER_FP32:
                keys[f"{setup}_{link}_{entry}_over_fp32"] = ratio(at[entry]["steps_per_s"], at["fp32"]["steps_per_s"])
    keys["targets"] = verdicts(keys, TARGETS)
    return keys


def cpu_ms(value: float | None) -> str:
    return fmt(value, 0 if value is None or value >= 10 else 1)


def wire_note(entry: str, share: float | None) -> str:
    expected = WIRE_SHARE.get(entry, 1.0)
    return "" if share is None or share >= 0.9 * expected else f"wire {share:.2f} of 2 x model, expected ~{expected:g}"


def table(results: dict, args) -> str:
    rows = ["| setup | link | run | steps/s (median) | per round | torchps / TF steps/s | CPU ms/step (all) | "
            "torchps / TF CPU | CPU ms/step by process | MB on the wire/step | wire / (2 x model) | note |",
            "| --- " * 12 + "|"]
    for setup, link, entry in plan(args):
        key = f"{setup}/{link}/{entry}"
        runs = results["raw"].get(key, [])
        m = results["medians"].get(key, dict.fromkeys(RUN_KEYS))
        state = results["status"].get(key, "not run")
        tf = entry == "tf"
        each = ", ".join(f"{k} {cpu_ms(v)}" for k, v in (m["cpu_ms_per_step_each"] or {}).items())
        note = wire_note(entry, m["wire_over_2x_model"]) if state == "ok" else state.splitlines()[0][:160]
        rows.append(f"| {setup} | {link} | {'TensorFlow PSS' if tf else f'torchps {entry}'} | "
                    f"{fmt(m['steps_per_s'])} | {', '.join(fmt(r['steps_per_s']) for r in runs) or '-'} | "
                    f"{'1' if tf else fmt(results[f'{setup}_{link}_ratio_{entry}'])} | "
                    f"{cpu_ms(m['cpu_ms_per_step'])} | "
                    f"{'1' if tf else fmt(results[f'{setup}_{link}_cpu_ratio_{entry}'])} | {each or '-'} | "
                    f"{fmt(m['MB_per_step'], 1)} | {fmt(m['wire_over_2x_model'])} | {note} |")
    rows += ["", "| setup | link | " + " | ".join(f"{v} / fp32 steps/s" for v in OVER_FP32) + " |",
             "| --- " * (2 + len(OVER_FP32)) + "|"]
    for setup in args.setups:
        for link in args.links:
            rows.append(f"| {setup} | {link} | " + " | ".join(fmt(results[f"{setup}_{link}_{v}_over_fp32"])
                                                             for v in OVER_FP32) + " |")
    stages = [(key, m["stage_ms_per_step"]) for key, m in results["medians"].items() if m["stage_ms_per_step"]]
    rows += ["", "| run | stage ms per step (workers' average) |", "| --- | --- |"]
    rows += [f"| {key} | {', '.join(f'{k} {v:.1f}' for k, v in s.items())} |" for key, s in stages] or \
        ["| - | PSClient.stats has no stage_seconds |"]
    return "\n".join(rows + profile_rows(results) + target_rows(results["targets"]))


def profile_rows(results: dict) -> list[str]:
    """Self time by group (%), each profiled process of each run; nothing without --profile."""
    summaries = [(f"{rec['setup']}/{rec['link']}/{rec['entry']} r{rec['round']}", name, s)
                 for rec in results["rounds"] for name, s in rec.get("result", {}).get("profile", {}).items()]
    if not summaries:
        return []
    groups = next((list(s["groups"]) for _, _, s in summaries if "groups" in s), [])
    rows = ["", "| run | process | cores | " + " | ".join(f"{g} %" for g in groups) + " | kernel (all) % |",
            "| --- " * (4 + len(groups)) + "|"]
    for run, name, s in summaries:
        cells = [fmt(s["cores"])] + [fmt(s["groups"][g], 1) for g in groups] + [fmt(s["kernel_percent"], 1)] \
            if "groups" in s else [s.get("error", "?")[:120]]
        rows.append(f"| {run} | {name} | " + " | ".join(cells) + " |")
    return rows


def check_smoke(results: dict) -> list[str]:
    """What the --smoke run's JSON lacks (empty: all there)."""
    missing = [k for k in ("medians", "targets", "raw", "rounds", "config", "1ps_1gbit_ratio_fp32",
                           "1ps_1gbit_cpu_ratio_fp32", "1ps_1gbit_tls_over_fp32") if k not in results]
    run = results.get("medians", {}).get("1ps/1gbit/fp32", {})
    missing += [f"medians 1ps/1gbit/fp32 {k}" for k in RUN_KEYS if k not in run]
    missing += [f"medians 1ps/1gbit/fp32 {k}" for k in ("steps_per_s", "cpu_ms_per_step", "MB_per_step")
                if k in run and not run[k]]
    each = run.get("cpu_ms_per_step_each") or {}
    missing += [f"CPU of {p}" for p in ("ps-0", "worker-0", "worker-1") if each.get(p) is None]
    return missing


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--json", type=pathlib.Path, help="write medians, ratios, targets and every run here")
    parser.add_argument("--setups", default="1ps,2ps", help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--links", default="none,10gbit,1gbit", help=f"comma-separated, of {', '.join(LINKS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"torchps variants, of {', '.join(VARIANTS)}")
    parser.add_argument("--model", default="big", choices=list(MODELS),
                        help="big: the 25.3M MLP (default); small: the seed MLP")
    parser.add_argument("--mode", default="async", choices=["async", "sync"], help="the torchps workers' mode "
                        "(default async; TensorFlow's side is always its own)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--seconds", type=float, help="timed window per run (default 10; 5 for the seed MLP)")
    parser.add_argument("--no-tf", dest="tf", action="store_false", help="torchps only")
    parser.add_argument("--tf-python", default=None,
                        help="interpreter with tensorflow-cpu (default .venv-tf/bin/python if present, else this one)")
    parser.add_argument("--profile", type=pathlib.Path, metavar="DIR",
                        help="perf record -a -g part of every run's window; data and per-process summaries under DIR")
    parser.add_argument("--smoke", action="store_true",
                        help="the suite's check: the seed MLP, 1 ps, 1 Gbit/s, torchps fp32 only, 1 s, no TensorFlow")
    # internal: one run inside its namespace
    parser.add_argument("--inside", choices=list(LINKS), help=argparse.SUPPRESS)
    parser.add_argument("--setup", choices=list(SETUPS), help=argparse.SUPPRESS)
    parser.add_argument("--entry", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tf-warmup", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--profile-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tf_python = args.tf_python or default_tf_python()
    args.tf_isolation, args.tf_version = "none", None  # run_tf's view: the namespace is this script's own
    if args.smoke:
        args.links, args.setups, args.variants, args.model, args.tf, args.rounds = "1gbit", "1ps", "fp32", "small", \
            False, 1
    args.links = [x.strip() for x in args.links.split(",") if x.strip()]
    args.setups = [x.strip() for x in args.setups.split(",") if x.strip()]
    args.variants = [x.strip() for x in args.variants.split(",") if x.strip()]
    for what, given, known in (("--links", args.links, LINKS), ("--setups", args.setups, SETUPS),
                               ("--variants", args.variants, VARIANTS)):
        if set(given) - set(known) or not given:
            parser.error(f"{what}: unknown {sorted(set(given) - set(known))}; known: {', '.join(known)}")
    if args.rounds < 1 or (args.seconds is not None and args.seconds <= 0):
        parser.error("--rounds must be >= 1 and --seconds > 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.inside:
        return inside(args)
    problem, tf_problem = prepare(args)
    if problem:
        print(f"dataplane.py: {problem}", file=sys.stderr)
        return 2
    started = time.monotonic()
    dims = MODELS[args.model]
    results: dict = {**environment()}
    results["config"] = {
        "setups": {s: {"ps": SETUPS[s][0], "workers": SETUPS[s][1]} for s in args.setups}, "links": args.links,
        "variants": {v: {"peers_variant": VARIANTS[v][0], "journal": VARIANTS[v][1], "shard_flags": VARIANTS[v][2]}
                     for v in args.variants}, "mode": args.mode,
        "model": args.model, "dims": list(dims), "parameters": mlp_numel(dims), "rounds": args.rounds,
        "window": dict(zip(("seconds", "torch_warmup_per_worker", "tf_warmup_per_worker"), window(args))),
        "lr": LR, "shard_args": SHARD_ARGS, "tbf": TBF_OPTIONS, "namespace": " ".join(unshare_prefix()),
        "profile": str(args.profile) if args.profile else None, "smoke": args.smoke,
        "tf": {"python": args.tf_python if args.tf else None, "version": args.tf_version,
               "skipped": tf_problem or (None if args.tf else "--no-tf")},
    }
    out = bench(args)
    results.update(summarize(out))
    results["raw"], results["status"], results["rounds"] = out["raw"], out["status"], out["rounds"]
    finish(results, started, table(results, args), args,
           lead=f"{args.model} MLP ({mlp_numel(dims):,} parameters, {mlp_numel(dims) * 4 / 1e6:.1f} MB float32); ")
    if args.smoke and (missing := check_smoke(results)):
        print(f"dataplane.py --smoke: the JSON lacks {missing}", file=sys.stderr)
        return 1
    return 0 if all(state == "ok" for state in out["status"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
