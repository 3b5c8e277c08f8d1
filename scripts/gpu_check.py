#!/usr/bin/env python
"""The device check's runner (scripts/gpu_check.sh installs, then runs this): every check as a subprocess with a
time limit, its output in OUT/<check>.log, its figures in OUT/<check>.json, and OUT/summary.json.

    python scripts/gpu_check.py OUT [--device cuda|cpu|auto] [--quick] [--dataset D] [--budget SECONDS]

Checks, in this order (a check that would not fit the time left is skipped, and said so):
  gpu-tests          pytest -m gpu: a CUDA module through the whole client (tests/grpc/test_cuda.py)
  demo-DEVICE        ps-launch (2 shards, 2 async workers, the MLP on real data) with --device DEVICE
  custom-loop        examples/custom_loop.py --device DEVICE
  device-bench       bench/device.py: the 25.3M MLP's pull/push, pinned vs pageable, overlap off vs on, hidden copies
  host-shards        bench/host_shards.py: the 101 MB model over k = 1, 2, 4, 8 shard processes of the host
  shared-device      ps-launch: 2 worker processes sharing the device, against CPU shards
  host-2-procs       ps-launch --nproc-per-host 2 --entry examples.custom_entry:task: one task's 2 processes on
                     the device, one push per host step, an --entry model
  demo-cpu           the demo on the CPU, for its accuracy beside the device's (when DEVICE is not the CPU)
  peers-torchps      bench/peers.py --quick --no-tf: torchps's side (TensorFlow is not on the GPU machine)

Exit code 0 when every check that ran passed (its command exited 0), 1 otherwise. The bars (the demo's accuracy on
the device against the CPU's, at least half the copy time hidden with overlap) are reported in the summary, met or
not; they do not change the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TF_NOTE = ("TensorFlow side skipped: TensorFlow is not installed on the GPU machine, and its wheel is far over the "
           "64 MiB that can be carried there")
ACCURACY_SLACK = 0.01  # the demo on the device "reaches the CPU's accuracy": within a point of it (runs vary ~0.5)


def say(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Runner:
    """Runs the checks one after the other within the budget; keeps their results."""

    def __init__(self, out: pathlib.Path, budget: float):
        self.out = out
        self.deadline = time.monotonic() + budget
        self.results: dict[str, dict] = {}

    def run(self, name: str, argv: list[str], limit: float, parse=None, env: dict | None = None) -> dict:
        left = self.deadline - time.monotonic()
        if left < min(limit, 30):
            say(f"{name}: SKIPPED (only {left:.0f} s of the budget left)")
            result = self.results[name] = {"status": "skipped", "why": "time budget"}
            return result
        limit = min(limit, left)
        say(f"{name}: {' '.join(argv[1:])[:160]} (limit {limit:.0f} s)")
        log = self.out / f"{name}.log"
        started = time.monotonic()
        with open(log, "w") as sink:
            try:
                code = subprocess.run(argv, cwd=self.out, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                      stdin=subprocess.DEVNULL, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                code = None
        seconds = time.monotonic() - started
        text = log.read_text(errors="replace")
        result = {"status": "ok" if code == 0 else "failed", "exit_code": code, "seconds": round(seconds, 1),
                  "log": log.name}
        if code is None:
            result["why"] = f"ran past {limit:.0f} s"
        if parse is not None:
            try:
                result.update(parse(text))
            except Exception as exc:  # noqa: BLE001 - a figure missing is reported, not fatal
                result["parse_error"] = f"{type(exc).__name__}: {exc}"
        if code != 0:
            result["tail"] = text.splitlines()[-15:]
        self.results[name] = result
        (self.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        figures = {k: v for k, v in result.items() if k not in ("log", "tail", "status", "exit_code", "seconds")}
        say(f"{name}: {result['status'].upper()} in {seconds:.0f} s {json.dumps(figures)[:300]}")
        return result


def launch_summary(path: pathlib.Path):
    def parse(text: str) -> dict:
        summary = json.loads(path.read_text())
        return {key: summary.get(key) for key in ("test_accuracy", "global_step", "steps_per_second",
                                                  "wall_seconds", "dataset", "mode", "workers", "nproc_per_host")}
    return parse


def pytest_counts(text: str) -> dict:
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", text.splitlines()[-1])}
    return {"tests": counts}


def custom_loop_figures(text: str) -> dict:
    final = re.search(r"^final test accuracy: ([\d.]+)$", text, re.MULTILINE)
    summary = re.search(r"steps_per_s=([\d.]+)", text)
    return {"test_accuracy": float(final[1]), "steps_per_second": float(summary[1])}


def device_figures(path: pathlib.Path):
    def parse(text: str) -> dict:
        data = json.loads(path.read_text())
        keep = ("step_seconds", "steps_per_second", "push_seconds", "pull_seconds", "hidden_fraction",
                "copy_ms_per_step", "h2d_ms_per_step", "d2h_ms_per_step", "compute_ms_per_step", "wire_ms_per_step")
        return {"gpu": data.get("gpu"), "parameters": data["parameters"], "hidden_bar": data.get("hidden_bar"),
                "setups": {name: {k: r.get(k) for k in keep if k in r} for name, r in data["setups"].items()}}
    return parse


def peers_figures(path: pathlib.Path):
    def parse(text: str) -> dict:
        data = json.loads(path.read_text())
        return {"note": TF_NOTE, "medians": {k: v for k, v in data.items() if k.endswith("_steps_per_s")}}
    return parse


def git_head() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def commit(out: pathlib.Path) -> dict:
    """The commit torchps was built from, and where that came from. When gpu_check.sh installed the wheels this run
    it copied their COMMIT (gpu_wheels.sh's) to OUT/commit.txt: that one, since the tree's git HEAD can be stale
    there (on the GPU machine the copied tree's HEAD said acf94fd for a wheel built from 103e5d9); it is then kept
    as tree_git_head when it differs. Else (--no-install: torchps is the interpreter's, i.e. this tree's) the git
    HEAD, and with no git the wheels folder's COMMIT."""
    head = git_head()
    installed = out / "commit.txt"
    if installed.is_file() and installed.read_text().strip():
        found = {"commit": installed.read_text().strip(), "commit_source": "commit.txt (the installed wheels' COMMIT)"}
        if head and not found["commit"].startswith(head):
            found["tree_git_head"] = head
        return found
    if head:
        return {"commit": head, "commit_source": "git HEAD"}
    commit_file = pathlib.Path(os.environ.get("TORCHPS_WHEELS", ROOT / ".whl")) / "COMMIT"
    if commit_file.is_file():  # the GPU machine's copy of the tree may carry no .git
        return {"commit": commit_file.read_text().strip(), "commit_source": str(commit_file)}
    return {"commit": None, "commit_source": None}


def environment(device: str, out: pathlib.Path) -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
           "device": device, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    for module in ("grpc", "google.protobuf", "numpy"):
        try:
            env[module] = __import__(module, fromlist=["__version__"]).__version__
        except ImportError as exc:
            env[module] = f"missing: {exc}"
    env.update(commit(out))
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (default: cuda if available)")
    parser.add_argument("--quick", action="store_true", help="every check shrunk to seconds (the suite's test)")
    parser.add_argument("--dataset", help="passed to the demos and the example (default: .gpu-data/fashion-mnist "
                        "if gpu_wheels.sh copied it there, else ps-worker's default)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all checks (default: %(default)s)")
    args = parser.parse_args(argv)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device, out)
    (out / "environment.json").write_text(json.dumps(env, indent=2) + "\n")
    say(f"environment: {json.dumps(env)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        say("CUDA is not available here: run with --device cpu for the CPU fallback")
        return 1
    carried = ROOT / ".gpu-data" / "fashion-mnist"
    dataset = args.dataset or (str(carried) if carried.is_dir() else None)
    data = ["--dataset", dataset] if dataset else []
    quick = args.quick
    py = sys.executable
    launch = [py, "-m", "torchps.worker.launch"]
    runner = Runner(out, args.budget)

    runner.run("gpu-tests", [py, "-m", "pytest", "-q", "-o", "addopts=", "-m", "gpu", "-p", "no:cacheprovider",
                             str(ROOT / "tests" / "grpc" / "test_cuda.py")], 150, pytest_counts)
    demo_steps = ["--steps", "100", "--ps", "1"] if quick else []
    runner.run(f"demo-{device}", [*launch, *data, *demo_steps, "--device", device, "--metrics-out",
                                  str(out / f"demo-{device}.summary.json")], 150,
               launch_summary(out / f"demo-{device}.summary.json"))
    # --quick: one epoch in plaintext (the suite runs the example with TLS in tests/integration/
    # test_custom_loop_example.py; test_gpu_check.py holds this run to the example's plaintext mode)
    runner.run("custom-loop", [py, str(ROOT / "examples" / "custom_loop.py"), *data, "--device", device,
                               *(["--epochs", "1", "--insecure"] if quick else [])], 120, custom_loop_figures)
    bench = ["--quick", "--steps", "2", "--repeats", "1", "--dims", "784,256,10"] if quick else []
    runner.run("device-bench", [py, str(ROOT / "bench" / "device.py"), "--device", device, *bench, "--json",
                                str(out / "device-bench.figures.json")], 200,
               device_figures(out / "device-bench.figures.json"))
    shards = ["--shards", "1,2", "--seconds", "0.5", "--floats", "1000000"] if quick else ["--shards", "1,2,4,8",
                                                                                        "--seconds", "5"]
    runner.run("host-shards", [py, str(ROOT / "bench" / "host_shards.py"), *shards, "--rounds", "1", "--json",
                               str(out / "host-shards.figures.json")], 150,
               lambda text: json.loads((out / "host-shards.figures.json").read_text())["summary"])
    steps = ["--steps", "60", "--ps", "1"] if quick else ["--steps", "1500", "--ps", "2"]
    runner.run("shared-device", [*launch, *data, *steps, "--device", device, "--workers", "2",
                                 "--hidden", "256" if quick else "2048", "--insecure", "--metrics-out",
                                 str(out / "shared-device.summary.json")], 120,
               launch_summary(out / "shared-device.summary.json"))
    # examples/custom_entry.py's model (an --entry) on mnist5k: importable with the repository after the
    # installed torchps on the path
    with_examples = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"),
                                                                               str(ROOT)]))}
    runner.run("host-2-procs", [*launch, *steps, "--device", device, "--workers", "1", "--nproc-per-host", "2",
                                "--entry", "examples.custom_entry:task", "--insecure",
                                "--metrics-out", str(out / "host-2-procs.summary.json")], 120,
               launch_summary(out / "host-2-procs.summary.json"), env=with_examples)
    if device != "cpu":
        runner.run("demo-cpu", [*launch, *data, *demo_steps, "--device", "cpu", "--metrics-out",
                                str(out / "demo-cpu.summary.json")], 150, launch_summary(out / "demo-cpu.summary.json"))
    # within the 8 minutes; --quick: a 0.5 s window, enough to show the benchmark runs and reports
    peers = ["--only", "small", "--variants", "fp32", "--seconds", "0.5"] if quick else ["--big-ps", "1"]
    say(TF_NOTE)
    runner.run("peers-torchps", [py, str(ROOT / "bench" / "peers.py"), "--quick", "--no-tf", *peers, "--json",
                                 str(out / "peers-torchps.figures.json")], 240,
               peers_figures(out / "peers-torchps.figures.json"))

    results = runner.results
    bars = {}
    on_device, on_cpu = results.get(f"demo-{device}", {}), results.get("demo-cpu", {})
    if device != "cpu" and on_device.get("test_accuracy") is not None and on_cpu.get("test_accuracy") is not None:
        got, want = on_device["test_accuracy"], on_cpu["test_accuracy"]
        bars["demo_accuracy_as_on_cpu"] = {"device": got, "cpu": want, "met": got >= want - ACCURACY_SLACK}
    hidden = results.get("device-bench", {}).get("hidden_bar")
    if hidden:
        bars["copies_hidden_at_least_half"] = hidden
    failed = [name for name, r in results.items() if r["status"] == "failed"]
    summary = {"environment": env, "quick": quick, "checks": results, "bars": bars, "failed": failed,
               "tensorflow": TF_NOTE}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    say("summary: " + ", ".join(f"{name} {r['status']}" for name, r in results.items()))
    for name, bar in bars.items():
        say(f"bar {name}: {'met' if bar.get('met') else 'NOT met'} {json.dumps(bar)}")
    say(f"{'FAILED: ' + ', '.join(failed) if failed else 'every check that ran passed'}; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
