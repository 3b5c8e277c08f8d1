#!/usr/bin/env python
"""Sync with hundreds of workers: 256 lightweight clients against 2 shards, R = N = 256.

    python bench/scale.py                      # 256 workers, 20 steps; writes bench/results/scale.json
    python bench/scale.py --workers 16 --steps 3 --json /tmp/scale.json   # a quick look

Two shards (LocalCluster(2), --insecure on loopback, --elastic-workers for
the workers' names) run sync mode with replicas_to_aggregate =
total_num_replicas = --workers. The workers are threads, --processes
processes of them, each worker speaking gRPC directly (one channel per
process and shard, threads under SCHED_IDLE so that the shards come first, as
on a job whose workers run on other hosts) over a small model: one --floats
variable on each shard.
A step of a worker: push its gradient (ones) to shard 1, which answers at
once; push to shard 0, which holds it until the step is released; pull
shard 1's variable with min_step, which waits until shard 1 applied the step.
Every push is checked to be released for the next step.

Meanwhile a poller in this process calls GetStatus on both shards every
--poll-ms and records each call's latency, the shards' waiting calls and
their thread counts (/proc/PID/status). Printed as a table and written as
JSON: whether every step completed on both shards, the GetStatus latency
percentiles over the whole run, the most threads a shard had while calls
waited, and the load average of the machine before and after.
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

import grpc
import numpy as np

# Only what the spawned worker processes need (each imports this module again): torch and the shards' side are
# imported where used, in this process, and the workers get their gradients' chunks encoded already.
from torchps.proto import ps_pb2, ps_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]

TIMEOUT = 120.0
RESULTS = ROOT / "bench" / "results" / "scale.json"


def _push_requests(worker: str, step: int, chunks: list) -> list:
    header = ps_pb2.PushHeader(worker=worker, incarnation=1, seq=step + 1, step=step, step_increment=1,
                               tensors=1)
    return [ps_pb2.PushRequest(header=header), ps_pb2.PushRequest(chunks=chunks)]


def _ones(floats: int) -> list[list[bytes]]:
    """A gradient of ones for each shard's variable, w0 and w1: the chunks a push carries, serialized (a
    spawned process takes them as bytes)."""
    import torch
    from torchps import codec

    return [[c.SerializeToString() for c in codec.encode_chunks(f"w{i}", torch.ones(floats))] for i in range(2)]


def _worker(stubs, worker: str, steps: int, ones: list[list], out: dict) -> None:
    """One worker's steps, pushing the chunks `ones`; out[worker] = its step times, or the error that stopped it."""
    times = []
    try:
        for stub in stubs:
            stub.Join(ps_pb2.WorkerRef(worker=worker, incarnation=1, step=0), timeout=TIMEOUT)
        out[worker + "/joined"] = True
        for step in range(steps):
            started = time.monotonic()
            stubs[1].Push(iter(_push_requests(worker, step, ones[1])), timeout=TIMEOUT)
            reply = stubs[0].Push(iter(_push_requests(worker, step, ones[0])), timeout=TIMEOUT)
            if reply.next_step != step + 1:
                raise RuntimeError(f"{worker}: step {step}'s push was answered for step {reply.next_step}")
            pulled = list(stubs[1].Pull(ps_pb2.PullRequest(names=["w1"], min_step=step + 1), timeout=TIMEOUT))
            if pulled[0].step < step + 1:
                raise RuntimeError(f"{worker}: the pull for step {step + 1} read step {pulled[0].step}")
            times.append(time.monotonic() - started)
        out[worker] = times
    except Exception as exc:  # noqa: BLE001 - reported by the main process
        out[worker] = f"{type(exc).__name__}: {exc}"


def _process(addresses: list[str], names: list[str], steps: int, ones: list[list[bytes]], go, results) -> None:
    """A process of worker threads: joins them all, waits for `go`, runs them; puts {worker: times|error}.
    Its threads run under SCHED_IDLE: on a real job the workers are on other hosts, and here the shards and
    the poller come first (with nice alone, 256 runnable worker threads outweigh a shard's few)."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    channels = [grpc.insecure_channel(a, options=[("grpc.max_receive_message_length", 64 << 20)])
                for a in addresses]
    stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
    out: dict = {}
    for stub in stubs:
        for name in names:
            stub.Join(ps_pb2.WorkerRef(worker=name, incarnation=1, step=0), timeout=TIMEOUT)
    ones = [[ps_pb2.TensorChunk.FromString(c) for c in chunks] for chunks in ones]
    go.wait()
    threads = [threading.Thread(target=_worker, args=(stubs, n, steps, ones, out)) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.put({k: v for k, v in out.items() if not k.endswith("/joined")})


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads_of(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


class Poller:
    """GetStatus on every shard every `period` s, in a thread: latencies, waiting calls, thread counts."""

    def __init__(self, stubs, pids: list[int], period: float):
        self.stubs, self.pids, self.period = stubs, pids, period
        self.latencies: list[float] = []
        self.by_shard: list[list[float]] = [[] for _ in stubs]
        self.samples: list[dict] = []  # {"shard", "waiting", "threads", "step"}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poller", daemon=True)

    def __enter__(self) -> "Poller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for shard, (stub, pid) in enumerate(zip(self.stubs, self.pids)):
                started = time.perf_counter()
                try:
                    status = stub.GetStatus(ps_pb2.StatusRequest(), timeout=10.0)
                except grpc.RpcError as exc:
                    self.errors.append(f"ps {shard}: {exc.code().name}: {exc.details()}")
                    continue
                self.latencies.append(time.perf_counter() - started)
                self.by_shard[shard].append(self.latencies[-1])
                self.samples.append({"shard": shard, "waiting": status.waiting_calls, "threads": _threads_of(pid),
                                     "step": status.step})


def _configure(stubs, workers: int, floats: int) -> None:
    import torch
    from torchps import codec

    config = ps_pb2.SyncConfig(mode="sync", replicas_to_aggregate=workers, total_num_replicas=workers,
                               lease_seconds=300.0, startup_grace_seconds=300.0, progress_seconds=300.0)
    value = torch.zeros(floats)
    for index, stub in enumerate(stubs):
        name = f"w{index}"
        spec = ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value),
                                   optimizer=ps_pb2.OptimizerSpec(name="sgd", hyperparams={"lr": 0.01}))
        requests = [ps_pb2.CreateRequest(spec=spec)] + [ps_pb2.CreateRequest(chunk=c)
                                                        for c in codec.encode_chunks(name, value)]
        stub.CreateVariables(iter(requests), timeout=TIMEOUT)
        stub.Configure(config, timeout=TIMEOUT)


def run(workers: int, steps: int, processes: int, floats: int, poll_ms: float, threads: int) -> dict:
    from torchps.worker.local_cluster import LocalCluster

    load_before = os.getloadavg()
    with LocalCluster(2, server_args=["--elastic-workers", str(workers), "--no-journal", "--threads", str(threads),
                                      "--torch-threads", "1"]) as local:
        channels = [grpc.insecure_channel(a) for a in local.cluster.ps]
        stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
        _configure(stubs, workers, floats)
        pids = [stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT).pid for stub in stubs]
        idle_threads = [_threads_of(pid) for pid in pids]
        cpu_before = [_cpu_seconds(pid) for pid in pids]
        names = [f"worker:{i}" for i in range(workers)]
        context = mp.get_context("spawn")
        go, results = context.Event(), context.Queue()
        ones = _ones(floats)
        procs = [context.Process(target=_process, args=(list(local.cluster.ps), names[p::processes], steps, ones,
                                                        go, results)) for p in range(processes)]
        for proc in procs:
            proc.start()
        ready = time.monotonic() + TIMEOUT
        while any(s.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT).live_workers < workers for s in stubs):
            if time.monotonic() > ready:
                raise RuntimeError("the workers did not all join in time")
            time.sleep(0.05)
        with Poller(stubs, pids, poll_ms / 1000.0) as poller:
            started = time.monotonic()
            go.set()
            outcome: dict = {}
            for _ in procs:
                outcome.update(results.get(timeout=TIMEOUT * steps))
            wall = time.monotonic() - started
        for proc in procs:
            proc.join(timeout=TIMEOUT)
        final = [s.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT) for s in stubs]
        shard_cpu = [round(_cpu_seconds(pid) - before, 2) for pid, before in zip(pids, cpu_before)]
        for channel in channels:
            channel.close()
    errors = {w: v for w, v in outcome.items() if isinstance(v, str)}
    step_times = [t for v in outcome.values() if not isinstance(v, str) for t in v]
    latencies = np.array(poller.latencies) * 1000.0
    busy = [s for s in poller.samples if s["waiting"] > 0]
    return {
        "bench": "scale", "command": " ".join(["python", "bench/scale.py", *sys.argv[1:]]),
        "workers": workers, "replicas_to_aggregate": workers, "shards": 2, "steps": steps, "processes": processes,
        "floats_per_shard": floats, "shard_threads_flag": threads,
        "steps_completed": [s.step for s in final], "every_step_completed": all(s.step == steps for s in final)
        and not errors, "worker_errors": dict(list(errors.items())[:5]), "worker_error_count": len(errors),
        "wall_seconds": round(wall, 2), "step_seconds_median": round(float(np.median(step_times)), 3)
        if step_times else None,
        "getstatus_calls": int(latencies.size), "getstatus_errors": poller.errors[:5],
        "getstatus_p50_ms": round(float(np.percentile(latencies, 50)), 2),
        "getstatus_p99_ms": round(float(np.percentile(latencies, 99)), 2),
        "getstatus_max_ms": round(float(latencies.max()), 2),
        "getstatus_p99_ms_by_shard": [round(float(np.percentile(np.array(x) * 1000.0, 99)), 2)
                                      for x in poller.by_shard],
        "max_waiting_calls_seen": max((s["waiting"] for s in poller.samples), default=0),
        "shard_threads_idle": idle_threads,
        "shard_threads_max_while_waiting": [max((s["threads"] for s in busy if s["shard"] == i), default=0)
                                            for i in range(2)],
        "shard_threads_max": [max((s["threads"] for s in poller.samples if s["shard"] == i), default=0)
                              for i in range(2)],
        "shard_cpu_seconds": shard_cpu,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(), "python": platform.python_version(), "grpc": grpc.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--floats", type=int, default=1024, help="floats of the variable on each shard")
    parser.add_argument("--threads", type=int, default=16, help="each shard's --threads (fewer than the workers)")
    parser.add_argument("--poll-ms", type=float, default=20.0)
    parser.add_argument("--json", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = run(args.workers, args.steps, args.processes, args.floats, args.poll_ms, args.threads)
    rows = [("workers (R = N)", result["workers"]), ("steps completed (ps 0, ps 1)", result["steps_completed"]),
            ("every step completed", result["every_step_completed"]), ("wall seconds", result["wall_seconds"]),
            ("step seconds, median", result["step_seconds_median"]),
            ("GetStatus calls", result["getstatus_calls"]),
            ("GetStatus p50 / p99 / max ms", f"{result['getstatus_p50_ms']} / {result['getstatus_p99_ms']} / "
                                             f"{result['getstatus_max_ms']}"),
            ("most waiting calls seen", result["max_waiting_calls_seen"]),
            ("shard threads: idle, most while calls waited", f"{result['shard_threads_idle']}, "
                                                             f"{result['shard_threads_max_while_waiting']}"),
            ("shard CPU seconds", result["shard_cpu_seconds"]),
            ("load average before / after", f"{result['load_average_before']} / {result['load_average_after']}")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {args.json}")
    return 0 if result["every_step_completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
