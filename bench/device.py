#!/usr/bin/env python
"""Pull/push with the model on a device: staging (pinned vs pageable) and overlap (off vs on), one run.

    python bench/device.py --device cuda --json device.json      # the 25.3M MLP, 2 CPU shards, about 2 minutes
    python bench/device.py --device cpu --quick --dims 784,256,10 # the CPU fallback: no copies to time

The model is bench/pullpush.py's 784-8192-2304-10 MLP (25.3M float32
parameters, ~101 MB) on --device, its variables on 2 ps-server shards on this
host's CPUs (LocalCluster, plaintext), one in-process PSClient per setup
(PSClient(pin_memory=...), register_module(overlap=...)). For each setup:

1. round trip (overlap off only): push() of fixed gradients then pull(), the
   parameters and gradients on the device; medians of --repeats.
2. steps: forward and backward on a random batch of 100, then exchange();
   the device synchronized at each step's end; medians of --steps.
3. timeline (CUDA only): every host<->device copy the client makes is timed
   with CUDA events (DeviceStaging.trace), and so is the compute (each leaf
   module's forward, the backward), mapped onto the host clock through an
   event on an idle stream at each step's start; the wire is every shard
   call in flight (PSClient.tracer). A copy's time is hidden where compute or
   the wire runs beside it: hidden = |copies ∩ (compute ∪ wire)| / |copies|,
   over the timed steps. The bar: at least half hidden with overlap.

Prints a table; --json writes every figure and the raw timings.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from pullpush import BATCH, BIG_DIMS, environment, log, make_mlp, mlp_numel  # noqa: E402

from torchps.client import Optimizer, PSClient  # noqa: E402
from torchps.security import INSECURE  # noqa: E402
from torchps.worker.local_cluster import LocalCluster  # noqa: E402

SETUPS = [("pinned", True, False), ("pinned", True, True), ("pageable", False, False), ("pageable", False, True)]
HIDDEN_BAR = 0.5  # the issue's: with overlap, at least half of a step's copy time hidden


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def overlap_seconds(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Seconds of `intervals` (each counted once) that `cover` (merged) covers."""
    total = 0.0
    for start, end in union(intervals):
        for a, b in cover:
            total += max(0.0, min(end, b) - max(start, a))
    return total


class Timeline:
    """GPU events (copies, compute) on the host's monotonic clock, and the wire's calls, step by step."""

    def __init__(self, client: PSClient, model: torch.nn.Module, device: torch.device):
        self.client, self.device = client, device
        self.trace = client._device.trace = []
        self.wire: list[tuple[float, float]] = []
        client.tracer = lambda phase, shard, start, end: self.wire.append((start, end))
        self.compute: list[tuple[object, object]] = []
        self.clock = torch.cuda.Stream(device=device)
        self.anchor = None
        self.host0 = 0.0
        self.steps: list[dict] = []
        for module in model.modules():
            if not list(module.children()):  # leaves: their kernels, after overlap's waits (hooks in order)
                module.register_forward_pre_hook(lambda m, a: self._mark_start())
                module.register_forward_hook(lambda m, a, o: self._mark_end())
        self._open = None

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _mark_start(self) -> None:
        self._open = self._event()

    def _mark_end(self) -> None:
        self.compute.append((self._open, self._event()))

    def backward(self, loss: torch.Tensor) -> None:
        start = self._event()
        loss.backward()
        self.compute.append((start, self._event()))

    def begin(self) -> None:
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record(self.clock)
        self.host0 = time.monotonic()
        self.wire.clear()

    def end(self) -> None:
        """Closes the step (the device synchronized): its copies, compute and wire, and the hidden share."""
        done = [r for r in list(self.trace) if r.end.query()]  # the others (a background pull's): next step's
        for record in done:
            self.trace.remove(record)  # one at a time: the client's threads may be appending
        copies = {"h2d": [], "d2h": []}
        copied_bytes = {"h2d": 0, "d2h": 0}
        for record in done:
            interval = self._on_host(record.start, record.end)
            if interval is not None:
                copies[record.kind].append(interval)
                copied_bytes[record.kind] += record.nbytes
        compute = [i for i in (self._on_host(a, b) for a, b in self.compute) if i is not None]
        self.compute.clear()
        cover = union(compute + list(self.wire))
        every = copies["h2d"] + copies["d2h"]
        copy_time = sum(b - a for a, b in union(every))
        self.steps.append({"copy_seconds": copy_time, "hidden_seconds": overlap_seconds(every, cover),
                           "h2d_seconds": sum(b - a for a, b in union(copies["h2d"])),
                           "d2h_seconds": sum(b - a for a, b in union(copies["d2h"])),
                           "h2d_bytes": copied_bytes["h2d"], "d2h_bytes": copied_bytes["d2h"],
                           "compute_seconds": sum(b - a for a, b in union(compute)),
                           "wire_seconds": sum(b - a for a, b in union(list(self.wire)))})

    def _on_host(self, start, end) -> tuple[float, float] | None:
        """Two completed events as host monotonic seconds, through this step's anchor (None if CUDA cannot
        time them: recorded before the anchor, say)."""
        try:
            return (self.host0 + self.anchor.elapsed_time(start) / 1e3,
                    self.host0 + self.anchor.elapsed_time(end) / 1e3)
        except RuntimeError:
            return None

    def summary(self) -> dict:
        copy = sum(s["copy_seconds"] for s in self.steps)
        hidden = sum(s["hidden_seconds"] for s in self.steps)
        n = max(1, len(self.steps))
        return {"hidden_fraction": hidden / copy if copy else None,
                "copy_ms_per_step": 1e3 * copy / n, "hidden_ms_per_step": 1e3 * hidden / n,
                "h2d_ms_per_step": 1e3 * sum(s["h2d_seconds"] for s in self.steps) / n,
                "d2h_ms_per_step": 1e3 * sum(s["d2h_seconds"] for s in self.steps) / n,
                "h2d_MB_per_step": sum(s["h2d_bytes"] for s in self.steps) / n / 1e6,
                "d2h_MB_per_step": sum(s["d2h_bytes"] for s in self.steps) / n / 1e6,
                "compute_ms_per_step": 1e3 * sum(s["compute_seconds"] for s in self.steps) / n,
                "wire_ms_per_step": 1e3 * sum(s["wire_seconds"] for s in self.steps) / n}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_setup(cluster, dims, device: torch.device, pinned: bool, overlap: bool, args, create: bool) -> dict:
    torch.manual_seed(0)
    model = make_mlp(dims).to(device)
    with PSClient(cluster, security=INSECURE, pin_memory=pinned) as client:
        binding = client.register_module(model, Optimizer("sgd", lr=1e-3), prefix="m/", create=create,
                                         overlap=overlap)
        out: dict = {"pinned": client._device.pinned}
        if not overlap:  # the round trip: fixed gradients on the device, push() then pull()
            with torch.no_grad():
                for p in model.parameters():
                    p.grad = torch.randn_like(p) * 1e-3
            pushes, pulls = [], []
            for i in range(args.repeats + 1):
                synchronize(device)
                t0 = time.perf_counter()
                binding.push()
                t1 = time.perf_counter()
                binding.pull()
                synchronize(device)
                t2 = time.perf_counter()
                if i:  # the first is a warm-up
                    pushes.append(t1 - t0)
                    pulls.append(t2 - t1)
            out.update(push_seconds=statistics.median(pushes), pull_seconds=statistics.median(pulls))
        x = torch.rand(4, BATCH, dims[0], device=device)
        y = torch.randint(0, dims[-1], (4, BATCH), device=device)
        timeline = Timeline(client, model, device) if device.type == "cuda" else None
        times = []
        for i in range(args.warmup + args.steps):
            timed = i >= args.warmup
            synchronize(device)
            if timed and timeline is not None:
                timeline.begin()
            started = time.perf_counter()
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[i % 4]), y[i % 4])
            timeline.backward(loss) if timeline is not None else loss.backward()
            binding.exchange()
            synchronize(device)
            if timed:
                times.append(time.perf_counter() - started)
                if timeline is not None:
                    timeline.end()
            elif timeline is not None:
                timeline.trace.clear()
                timeline.compute.clear()
        binding.wait()
        out.update(step_seconds=statistics.median(times), steps_per_second=1 / statistics.median(times),
                   step_times=times, bytes_copied=client.stats.bytes_copied)
        if timeline is not None:
            out.update(timeline.summary(), timeline_steps=timeline.steps)
        return out


def table(results: dict) -> str:
    nbytes = results["model_bytes"]
    lines = [f"model {results['parameters']:,} parameters ({nbytes / 1e6:.1f} MB) on {results['device']}, "
             f"2 CPU shards", "",
             "| staging | overlap | push + pull (GB/s each way) | step ms | steps/s | copies ms/step | hidden |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results["setups"].items():
        staging, overlap = name.split("/")
        trip = (f"{r['push_seconds'] + r['pull_seconds']:.3f} s ({nbytes / r['push_seconds'] / 1e9:.2f} / "
                f"{nbytes / r['pull_seconds'] / 1e9:.2f})") if "push_seconds" in r else "-"
        copies = f"{r['copy_ms_per_step']:.1f}" if "copy_ms_per_step" in r else "none (CPU)"
        hidden = f"{r['hidden_fraction']:.2f}" if r.get("hidden_fraction") is not None else "-"
        lines.append(f"| {staging} | {overlap} | {trip} | {1e3 * r['step_seconds']:.1f} | "
                     f"{r['steps_per_second']:.2f} | {copies} | {hidden} |")
    bar = results.get("hidden_bar")
    if bar is not None:
        lines += ["", f"with overlap (pinned), {bar['value']:.2f} of the copy time hidden "
                      f"(bar >= {HIDDEN_BAR}): {'met' if bar['met'] else 'NOT met'}"]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto (default: %(default)s)")
    parser.add_argument("--json", type=pathlib.Path, help="write every figure here")
    parser.add_argument("--quick", action="store_true", help="3 repeats, 5 steps (default 7 and 15)")
    parser.add_argument("--dims", default=",".join(map(str, BIG_DIMS)), help="MLP layer widths (default: the "
                        "25.3M model's %(default)s)")
    parser.add_argument("--repeats", type=int, help="timed round trips per setup")
    parser.add_argument("--steps", type=int, help="timed steps per setup")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per setup first")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.steps = args.steps or (5 if args.quick else 15)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        print("bench/device.py: CUDA is not available on this host; use --device cpu", file=sys.stderr)
        return 2
    device = torch.device(name)
    dims = tuple(int(d) for d in args.dims.split(","))
    results = {"device": str(device), "dims": dims, "parameters": mlp_numel(dims), "model_bytes": 4 * mlp_numel(dims),
               "setups": {}, "environment": environment(),
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    with LocalCluster(2) as local:
        for i, (staging, pinned, overlap) in enumerate(SETUPS):
            label = f"{staging}/{'on' if overlap else 'off'}"
            log(f"{label}: {args.steps} steps")
            results["setups"][label] = run_setup(local.cluster, dims, device, pinned, overlap, args, create=i == 0)
    on = results["setups"]["pinned/on"].get("hidden_fraction")
    results["hidden_bar"] = None if on is None else {"value": on, "bar": HIDDEN_BAR, "met": on >= HIDDEN_BAR}
    print(table(results), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
