#!/usr/bin/env python
"""Transport benchmark: torchps pull/push against bare gRPC, and async training throughput.

    python bench/pullpush.py --json results.json          # full run, a few minutes
    python bench/pullpush.py --quick --json quick.json    # under a minute
    python bench/pullpush.py --only bandwidth --repeats 15
    python bench/pullpush.py --security plain            # as before security existed

Three measurements, each taken beside its baseline in the same run (the
development machine is shared and noisy, so only ratios measured together mean
anything):

1. bandwidth: one push of every gradient then one pull of every variable of a
   25.3M-float32 MLP (784-8192-2304-10, ~101 MB each way) through PSClient over
   2 shards (LocalCluster(2), server-side SGD), interleaved with the same round
   trip over bare gRPC between this process and a plain server process (generic
   handlers, 1 MiB `BytesValue` chunks, numpy copies at both ends, no torchps
   code). Also over 1 shard. Medians of --repeats.
2. small: the seed's 784-100-10 sigmoid MLP, 1 ps and 2 async worker processes
   (forward/backward on a random batch of 100, then push and pull in one call
   per shard: ModuleBinding.exchange), total steps/s,
   beside the same model trained in one process with no PS.
3. big: the 784-8192-2304-10 MLP, 1 ps and 2 async workers, beside one process.

Security (--security both, the default): the 2-shard round trip of 1 and the
async run of 2 are also measured against shards started with mutual TLS and
per-task tokens (credentials from torchps.certs, as ps-certs makes them: a CA,
a certificate and token per task, the shards' table of tokens, the admin
token; the shards get the ps task's
--tls-cert/--tls-key/--tls-ca/--token-file/--admin-token-file, the clients the
chief's or their worker's files through Security.load), interleaved with the
plaintext runs (--insecure shards) repetition by repetition, and reported side
by side with secure / plaintext ratios of bandwidth and steps/s beside the
issue's targets (TLS costs at most 15% of bandwidth, 10% of small-model
steps/s). --secure-big adds the big model's async run. Each shard's log is
checked for the security it reports serving with.

Each also records CPU time (Linux /proc): per round trip, client and servers,
ours and the baseline's; per training step, compute, exchange and the ps. From
those comes the big model's ceiling: the steps/s two workers could reach if a
step cost only the one-process step's CPU plus the bare gRPC round trip's, with
every core busy; and the same with gRPC's floor (raw bytes, no protobuf, no
copies) in place of the baseline.

Data are random (this measures transport, not accuracy). Warm-ups run before
any timing. Only torchps's public client API is used, so transport internals
may change underneath. The baseline server (`--baseline-server`) imports no
torch and no torchps.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import platform
import queue
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent import futures

import grpc
import numpy as np
from google.protobuf import wrappers_pb2

SMALL_DIMS = (784, 100, 10)          # the seed's MNIST MLP: 79,510 parameters
BIG_DIMS = (784, 8192, 2304, 10)     # 25,330,442 parameters, ~101 MB of float32
BATCH = 100
BASELINE_CHUNK_BYTES = 1 << 20       # 1 MiB: the brief's (and transport.md's) baseline chunk
MESSAGE_LIMIT = 64 << 20
PUSH_METHOD = "/bench.Baseline/Push"
PULL_METHOD = "/bench.Baseline/Pull"
RAW_PUSH_METHOD = "/bench.Baseline/PushRaw"
RAW_PULL_METHOD = "/bench.Baseline/PullRaw"
READY_TIMEOUT = 180.0                # worker start-up (spawn imports torch) on a loaded 2-core box

REFERENCES = {  # transport figures measured on this machine earlier (docs/peers.md)
    "grpc_baseline_seconds": "0.228 s in transport.md (0.207 s with glibc malloc tuning)",
    "ratio": "target >= 0.8",
    "mlp_async_steps_per_s": "target >= 350; TF ParameterServerStrategy 176",
    "mlp_local_steps_per_s": "transport.md: 1,146 (1 thread)",
    "big_async_steps_per_s": "target: TF ParameterServerStrategy 5.30",
    "big_local_steps_per_s": "transport.md: 5.1 (1 thread)",
    "secure_bandwidth_ratio": "target >= 0.85 (TLS costs at most 15% of bandwidth)",
    "secure_mlp_steps_ratio": "target >= 0.90 (TLS costs at most 10% of small-model steps/s)",
}
SECURE_TARGETS = {"secure_bandwidth_ratio": 0.85, "secure_mlp_steps_ratio": 0.90}


def worker_processes():
    """multiprocessing's forkserver context, its server having imported torch and torchps.client: each worker
    process is forked from it (a new process without the parent's threads, started in a fraction of a second)
    rather than a spawned interpreter importing torch again. Nothing measured includes a process's start."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchps.client"])
    return ctx


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def mlp_numel(dims) -> int:
    return sum(i * o + o for i, o in zip(dims[:-1], dims[1:]))


def collect(res_q, procs, kind: str, timeout: float) -> list:
    """One (kind, index, payload) message of `kind` from each of `procs`, by index, off `res_q`: the payloads.
    RuntimeError if one reports an error or something else, exits with a failure code first, or is late."""
    deadline = time.monotonic() + timeout
    got = [None] * len(procs)
    for _ in procs:
        while True:
            try:
                what, index, payload = res_q.get(timeout=1.0)
                break
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"process(es) {dead} failed before reporting '{kind}'") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"processes did not report '{kind}' within {timeout:.0f} s") from None
        if what == "error":
            raise RuntimeError(f"process {procs[index].name} failed:\n{payload}")
        if what != kind:
            raise RuntimeError(f"process {procs[index].name} reported {what!r}, expected {kind!r}")
        got[index] = payload
    return got


def median(values) -> float:
    return statistics.median(values) if values else float("nan")


def cpu_seconds(pids) -> float | None:
    """User + system CPU seconds used so far by the processes `pids`, all their threads (Linux /proc); None elsewhere."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


# -- bare gRPC baseline ---------------------------------------------------------------------

def baseline_server_main(port_file: str, nbytes: int, chunk_bytes: int) -> int:
    """A plain gRPC server: Push copies chunks into a numpy array; Pull slices another to bytes.

    PushRaw and PullRaw are gRPC's floor: raw bytes messages, no protobuf, no
    copies; PushRaw drops what it receives and PullRaw sends prebuilt bytes.
    """
    values = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    received = np.zeros(nbytes, dtype=np.uint8)  # preallocated and touched
    raw_messages = [values[offset:offset + chunk_bytes].tobytes() for offset in range(0, nbytes, chunk_bytes)]

    def push(request_iterator, context):
        offset = 0
        for message in request_iterator:
            data = message.value
            received[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            offset += len(data)
        if offset != nbytes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"got {offset} of {nbytes} bytes")
        return wrappers_pb2.BytesValue()

    def pull(request, context):
        for offset in range(0, nbytes, chunk_bytes):
            yield wrappers_pb2.BytesValue(value=values[offset:offset + chunk_bytes].tobytes())

    def push_raw(request_iterator, context):
        size = sum(len(message) for message in request_iterator)
        if size != nbytes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"got {size} of {nbytes} bytes")
        return b""

    handler = grpc.method_handlers_generic_handler("bench.Baseline", {
        "Push": grpc.stream_unary_rpc_method_handler(
            push, request_deserializer=wrappers_pb2.BytesValue.FromString,
            response_serializer=wrappers_pb2.BytesValue.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(
            pull, request_deserializer=wrappers_pb2.BytesValue.FromString,
            response_serializer=wrappers_pb2.BytesValue.SerializeToString),
        "PushRaw": grpc.stream_unary_rpc_method_handler(push_raw),
        "PullRaw": grpc.unary_stream_rpc_method_handler(lambda request, context: iter(raw_messages)),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", MESSAGE_LIMIT),
                                  ("grpc.max_send_message_length", MESSAGE_LIMIT)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tmp = pathlib.Path(port_file + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(port_file)
    server.wait_for_termination()
    return 0


class BaselineServer:
    """The baseline server as a child process of this script (no torch, no torchps)."""

    def __init__(self, nbytes: int, chunk_bytes: int):
        self._tmp = tempfile.TemporaryDirectory(prefix="torchps-bench-")
        port_file = os.path.join(self._tmp.name, "port")
        self.log_path = os.path.join(self._tmp.name, "server.log")
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--baseline-server", port_file,
                 "--baseline-bytes", str(nbytes), "--baseline-chunk-bytes", str(chunk_bytes)],
                stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"baseline server did not start: {pathlib.Path(self.log_path).read_text()}")
            time.sleep(0.02)
        self.address = f"127.0.0.1:{pathlib.Path(port_file).read_text()}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._tmp.cleanup()


def baseline_channel(address: str) -> grpc.Channel:
    """A connected channel to the baseline server, with its message limits."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", MESSAGE_LIMIT),
                                                      ("grpc.max_send_message_length", MESSAGE_LIMIT)])
    grpc.channel_ready_future(channel).result(timeout=60)
    return channel


class BaselineClient:
    """Push: numpy slices -> bytes -> BytesValue stream. Pull: BytesValue stream -> copies into numpy."""

    def __init__(self, address: str, nbytes: int, chunk_bytes: int):
        self.nbytes, self.chunk_bytes = nbytes, chunk_bytes
        self.channel = baseline_channel(address)
        self._push = self.channel.stream_unary(PUSH_METHOD, request_serializer=wrappers_pb2.BytesValue.SerializeToString,
                                               response_deserializer=wrappers_pb2.BytesValue.FromString)
        self._pull = self.channel.unary_stream(PULL_METHOD, request_serializer=wrappers_pb2.BytesValue.SerializeToString,
                                               response_deserializer=wrappers_pb2.BytesValue.FromString)
        self.grads = np.random.default_rng(2).standard_normal(nbytes // 4, dtype=np.float32).view(np.uint8)
        self.values = np.zeros(nbytes, dtype=np.uint8)  # preallocated and touched, as model parameters are

    def push(self) -> None:
        grads, chunk = self.grads, self.chunk_bytes

        def requests():
            for offset in range(0, self.nbytes, chunk):
                yield wrappers_pb2.BytesValue(value=grads[offset:offset + chunk].tobytes())
        self._push(requests())

    def pull(self) -> None:
        offset = 0
        for message in self._pull(wrappers_pb2.BytesValue()):
            data = message.value
            self.values[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
            offset += len(data)
        if offset != self.nbytes:
            raise RuntimeError(f"baseline pull got {offset} of {self.nbytes} bytes")

    def close(self) -> None:
        self.channel.close()


class RawClient:
    """gRPC's floor: prebuilt bytes messages out, received messages dropped; no protobuf, no copies."""

    def __init__(self, address: str, nbytes: int, chunk_bytes: int):
        self.nbytes = nbytes
        self.channel = baseline_channel(address)
        self._push = self.channel.stream_unary(RAW_PUSH_METHOD)
        self._pull = self.channel.unary_stream(RAW_PULL_METHOD)
        grads = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
        self.messages = [grads[offset:offset + chunk_bytes].tobytes() for offset in range(0, nbytes, chunk_bytes)]

    def push(self) -> None:
        self._push(iter(self.messages))

    def pull(self) -> None:
        size = sum(len(message) for message in self._pull(b""))
        if size != self.nbytes:
            raise RuntimeError(f"raw pull got {size} of {self.nbytes} bytes")

    def close(self) -> None:
        self.channel.close()


# -- security ----------------------------------------------------------------------------------

class JobSecurity:
    """A job's credentials made by torchps.certs in a temporary folder: shard flags and clients' Security values.

    The certificates name 127.0.0.1 (and localhost) whatever the cluster's ports,
    so one set serves every LocalCluster of the run; every shard uses the ps
    task's files (its certificate, the table of per-task tokens, the admin token it checks).
    """

    def __init__(self, num_ps: int, workers: int):
        from torchps.certs import make_job_credentials
        from torchps.cluster import Cluster

        self._tmp = tempfile.TemporaryDirectory(prefix="torchps-bench-job-")
        ports = iter(range(1, 1 << 16))
        job = Cluster(ps=tuple(f"127.0.0.1:{next(ports)}" for _ in range(num_ps)), chief=(f"127.0.0.1:{next(ports)}",),
                      worker=tuple(f"127.0.0.1:{next(ports)}" for _ in range(workers)))
        self.files = make_job_credentials(pathlib.Path(self._tmp.name) / "job", job)

    def server_args(self) -> list[str]:
        from torchps.cluster import TaskSpec

        return self.files[TaskSpec("ps", 0)].flags()

    def security(self, task):
        """`task`'s Security (certificate, key, CA, its own token; the chief's also the admin token)."""
        return self.files[task].security()

    def close(self) -> None:
        self._tmp.cleanup()


def start_cluster(num_ps: int, job: JobSecurity | None, server_args=(), **kwargs):
    """A started LocalCluster: --insecure shards without `job`, mutual TLS + per-task tokens with it; `server_args`:
    more ps-server flags."""
    from torchps.worker.local_cluster import LocalCluster

    local = LocalCluster(num_ps, server_args=[*(job.server_args() if job else ()), *server_args], **kwargs)
    local.__enter__()
    return local


def check_shard_security(local, secure: bool) -> list[str]:
    """The line each shard logged about its security; RuntimeError unless it is what was asked for."""
    want = "mutual TLS, per-task tokens" if secure else "INSECURE: no TLS, no token"
    lines = []
    for index in range(local.num_ps):
        deadline = time.monotonic() + 10
        while True:  # the shard logs it right after writing its port file
            found = [ln for ln in local.log(index).splitlines() if "serving on" in ln]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not found or want not in found[-1]:
            raise RuntimeError(f"ps {index} should serve with {want!r}; its log:\n{local.log(index)[-2000:]}")
        lines.append(found[-1].split(": ", 1)[-1] if ": " in found[-1] else found[-1])
    return lines


# -- models ------------------------------------------------------------------------------------

def make_mlp(dims):
    """Linear layers with sigmoid between them (the seed's model family); logits out."""
    import torch

    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i < len(dims) - 2:
            layers.append(torch.nn.Sigmoid())
    return torch.nn.Sequential(*layers)


# -- 1. bandwidth ---------------------------------------------------------------------------

class OursRoundTrip:
    """A PSClient bound to the big MLP on `cluster`, with fixed random gradients."""

    def __init__(self, cluster, lr: float, placement: str, job: JobSecurity | None = None):
        import torch
        from torchps.client import Optimizer, PSClient, TaskSpec
        from torchps.security import INSECURE

        torch.manual_seed(0)
        self.model = make_mlp(BIG_DIMS)
        if job is None:
            self.client = PSClient(cluster, placement=placement, security=INSECURE)
        else:  # the chief: it creates the variables (admin token), then pushes and pulls
            chief = TaskSpec("chief", 0)
            self.client = PSClient(cluster, task=chief, placement=placement, security=job.security(chief))
        self.binding = self.client.register_module(self.model, Optimizer("sgd", lr=lr), create=True)
        self.placement = self.client.placement_report()
        with torch.no_grad():
            for p in self.model.parameters():
                p.grad = torch.randn_like(p) * 1e-3

    def push(self) -> None:
        self.binding.push()

    def pull(self) -> None:
        self.binding.pull()

    def bytes_copied(self) -> int:
        """Bytes this client copied so far to move tensors (WorkerStats.bytes_copied; 0 from a torchps that
        predates it, as bench/against.py may run)."""
        return getattr(self.client.stats, "bytes_copied", 0)

    def close(self) -> None:
        self.client.close()


def timed_round_trip(target, server_pids=()) -> tuple[float, float, float, float | None]:
    """(push seconds, pull seconds, this process's CPU seconds, the servers' CPU seconds or None)."""
    s0, c0 = cpu_seconds(server_pids), time.process_time()
    t0 = time.perf_counter()
    target.push()
    t1 = time.perf_counter()
    target.pull()
    t2 = time.perf_counter()
    c1, s1 = time.process_time(), cpu_seconds(server_pids)
    return t1 - t0, t2 - t1, c1 - c0, (s1 - s0 if s0 is not None and s1 is not None else None)


def bench_bandwidth(args, job: JobSecurity | None) -> dict:
    nbytes = mlp_numel(BIG_DIMS) * 4
    variants: dict[str, object] = {}
    server_pids: dict[str, list[int]] = {}
    shard_security: dict[str, list[str]] = {}
    closers = []
    plain, secure = args.security in ("both", "plain"), args.security in ("both", "secure")
    starting = [n for n, on in (("plaintext 2-shard", plain), ("secure 2-shard", secure),
                                ("1-shard", plain and not args.no_1ps)) if on]
    log(f"bandwidth: starting {', '.join(starting)} clusters and the bare gRPC server ({nbytes / 1e6:.1f} MB model)")
    setup_started = time.monotonic()
    placement = None
    try:
        clusters = {}
        if plain:
            clusters["ours_2ps"] = start_cluster(2, None, args.shard_args)
            closers.append(clusters["ours_2ps"].stop)
        if secure:
            clusters["ours_2ps_secure"] = start_cluster(2, job, args.shard_args)
            closers.append(clusters["ours_2ps_secure"].stop)
        if plain and not args.no_1ps:
            clusters["ours_1ps"] = start_cluster(1, None, args.shard_args)
            closers.append(clusters["ours_1ps"].stop)
        server = BaselineServer(nbytes, args.chunk_bytes)
        closers.append(server.close)
        baseline = BaselineClient(server.address, nbytes, args.chunk_bytes)
        closers.append(baseline.close)
        raw_floor = RawClient(server.address, nbytes, args.chunk_bytes)
        closers.append(raw_floor.close)
        server_pids = {"baseline": [server.proc.pid], "raw": [server.proc.pid]}
        for name, local in clusters.items():
            variants[name] = OursRoundTrip(local.cluster, args.lr_big, args.placement,
                                           job if name.endswith("_secure") else None)
            closers.append(variants[name].close)
            server_pids[name] = [p.pid for p in local.procs]
            shard_security[name] = check_shard_security(local, name.endswith("_secure"))
            placement = placement or variants[name].placement
        variants["baseline"] = baseline
        variants["raw"] = raw_floor
        log(f"bandwidth: set up in {time.monotonic() - setup_started:.1f} s; 2-shard placement ({args.placement}):\n"
            + placement)

        names = list(variants)
        for _ in range(args.warmup):
            for name in names:
                timed_round_trip(variants[name])
        raw = {name: {"push": [], "pull": [], "total": [], "client_cpu": [], "server_cpu": []} for name in names}
        copied_before = {name: variants[name].bytes_copied() for name in clusters}
        for r in range(args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]  # rotate to cancel drift
            for name in order:
                push_s, pull_s, client_cpu, server_cpu = timed_round_trip(variants[name], server_pids[name])
                raw[name]["push"].append(push_s)
                raw[name]["pull"].append(pull_s)
                raw[name]["total"].append(push_s + pull_s)
                raw[name]["client_cpu"].append(client_cpu)
                if server_cpu is not None:
                    raw[name]["server_cpu"].append(server_cpu)
            log("bandwidth repeat %d/%d: %s" % (r + 1, args.repeats, ", ".join(
                f"{n} {raw[n]['total'][-1]:.3f} s" for n in names)))
        copied = {name: (variants[name].bytes_copied() - before) / args.repeats
                  for name, before in copied_before.items()}
    finally:
        for close in reversed(closers):
            close()

    med = {name: {k: median(v) for k, v in parts.items()} for name, parts in raw.items()}
    out = {
        "grpc_baseline_seconds": med["baseline"]["total"],
        "grpc_raw_seconds": med["raw"]["total"],
        "bandwidth_detail": {
            "bytes_each_way": nbytes,
            "placement": args.placement,
            "placement_report": placement,
            "shard_security": shard_security,
            "median_seconds": med,
            "round_trip_GBps": {n: 2 * nbytes / m["total"] / 1e9 for n, m in med.items()},
            "client_bytes_copied_per_round_trip": copied,
        },
        "bandwidth_raw": raw,
    }
    if "ours_2ps" in med:
        out["pullpush_seconds"] = med["ours_2ps"]["total"]
        out["client_copies_per_byte"] = copied["ours_2ps"] / (2 * nbytes)  # bytes copied / bytes moved
        out["ratio"] = med["baseline"]["total"] / med["ours_2ps"]["total"]
    if "ours_2ps_secure" in med:
        out["pullpush_secure_seconds"] = med["ours_2ps_secure"]["total"]
    if "ours_2ps" in med and "ours_2ps_secure" in med:
        # secure bandwidth / plaintext bandwidth (same bytes, so plaintext seconds / secure seconds); also the
        # median of the per-repeat ratios (each repeat times both within a second or two of each other)
        out["secure_bandwidth_ratio"] = med["ours_2ps"]["total"] / med["ours_2ps_secure"]["total"]
        out["secure_bandwidth_ratio_paired"] = median(
            [p / s for p, s in zip(raw["ours_2ps"]["total"], raw["ours_2ps_secure"]["total"])])
    if "ours_1ps" in med:
        out["pullpush_1ps_seconds"] = med["ours_1ps"]["total"]
    if all(raw[name]["server_cpu"] for name in names):
        # CPU seconds of one round trip, client + servers: what the transport costs a CPU-bound host.
        out["grpc_baseline_cpu_seconds"] = med["baseline"]["client_cpu"] + med["baseline"]["server_cpu"]
        out["grpc_raw_cpu_seconds"] = med["raw"]["client_cpu"] + med["raw"]["server_cpu"]
        for name, key in (("ours_2ps", "pullpush_cpu_seconds"), ("ours_2ps_secure", "pullpush_secure_cpu_seconds")):
            if name in med:
                out[key] = med[name]["client_cpu"] + med[name]["server_cpu"]
    return out


# -- 2 and 3. training throughput -------------------------------------------------------------

def trainer_main(mode, dims, cluster, index, lr, warmup, cmd_q, res_q, security=None) -> None:
    """One training process: 'ps' (fwd/bwd -> push+pull in one call per shard) or 'local' (fwd/bwd -> torch.optim.SGD)."""
    try:
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(1)
        torch.manual_seed(100 + index)
        model = make_mlp(dims)
        xs = torch.rand(4, BATCH, dims[0])
        ys = torch.randint(0, dims[-1], (4, BATCH))
        client = None
        update_cpu = 0.0  # CPU seconds spent in update() since the timed run began
        if mode == "ps":
            from torchps.client import PSClient, TaskSpec
            from torchps.security import INSECURE

            client = PSClient(cluster, task=TaskSpec("worker", index), security=security or INSECURE)
            update = client.register_module(model, create=False).exchange
        else:
            update = torch.optim.SGD(model.parameters(), lr=lr).step

        def step(i: int) -> float:
            nonlocal update_cpu
            model.zero_grad()
            loss = F.cross_entropy(model(xs[i % 4]), ys[i % 4])
            loss.backward()
            started = time.process_time()
            update()
            update_cpu += time.process_time() - started
            return loss.item()

        for i in range(warmup):
            step(i)
        res_q.put(("ready", index, None))
        while True:
            cmd = cmd_q.get()
            if cmd is None:
                break
            start_at, duration = cmd
            while time.time() < start_at:
                time.sleep(min(0.01, max(0.0, start_at - time.time())))
            end, steps, loss = start_at + duration, 0, float("nan")
            update_cpu, started_cpu = 0.0, time.process_time()
            copied = getattr(client.stats, "bytes_copied", 0) if client is not None else 0
            while time.time() < end:
                loss = step(steps)
                steps += 1
            used = time.process_time() - started_cpu
            res_q.put(("result", index, {"steps": steps, "seconds": time.time() - start_at, "last_loss": loss,
                                         "cpu_seconds": used, "update_cpu_seconds": update_cpu,
                                         "bytes_copied": getattr(client.stats, "bytes_copied", copied) - copied
                                         if client else 0}))
        if client is not None:
            client.close()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        res_q.put(("error", index, traceback.format_exc()))


class TrainerPool:
    """`count` persistent training processes (spawned once, warmed up, then run on command)."""

    def __init__(self, mode: str, dims, cluster, count: int, lr: float, warmup: int,
                 job: JobSecurity | None = None):
        from torchps.client import TaskSpec

        ctx = worker_processes()
        self.res_q = ctx.Queue()
        self.cmd_qs = [ctx.Queue() for _ in range(count)]
        securities = [job.security(TaskSpec("worker", i)) if job else None for i in range(count)]
        self.procs = [ctx.Process(target=trainer_main, daemon=True, name=f"bench-{mode}-{i}",
                                  args=(mode, dims, cluster, i, lr, warmup, self.cmd_qs[i], self.res_q, securities[i]))
                      for i in range(count)]
        for proc in self.procs:
            proc.start()
        self._collect("ready", READY_TIMEOUT)

    def _collect(self, kind: str, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        results = [None] * len(self.procs)
        for _ in self.procs:
            try:
                got, index, payload = self.res_q.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"trainer processes did not report '{kind}' within {timeout:.0f} s") from None
            if got == "error":
                raise RuntimeError(f"trainer {index} failed:\n{payload}")
            results[index] = payload
        return results

    def run(self, duration: float) -> list[dict]:
        start_at = time.time() + 0.2
        for q in self.cmd_qs:
            q.put((start_at, duration))
        return self._collect("result", duration + 120)

    def close(self) -> None:
        for q in self.cmd_qs:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def bench_training(label: str, dims, args, duration: float, lr: float, with_local: bool, setups=("async",),
                   job: JobSecurity | None = None, server_args: dict[str, list[str]] | None = None) -> dict:
    """1 ps + 2 async workers per setup ("async": --insecure shard; "async_secure": mutual TLS + per-task tokens;
    `server_args[setup]`: more ps-server flags), interleaved with each other and with a 1-process no-PS run;
    steps/s (medians)."""
    import contextlib

    import torch
    from torchps.client import Optimizer, PSClient, TaskSpec
    from torchps.security import INSECURE

    log(f"{label}: starting {len(setups)} ps ({', '.join(setups)}), creating {mlp_numel(dims):,} parameters, "
        f"spawning workers")
    raw: dict[str, list] = {name: [] for name in setups}
    server_cpu: dict[str, list[float]] = {name: [] for name in setups}  # each ps's CPU seconds during its runs
    server_pids: dict[str, list[int]] = {}
    shard_security: dict[str, list[str]] = {}
    pools: dict[str, TrainerPool] = {}
    with contextlib.ExitStack() as stack:
        for name in setups:
            secure = name.endswith("_secure")
            local = start_cluster(1, job if secure else None, [*args.shard_args, *(server_args or {}).get(name, ())],
                                  workers=args.workers)
            stack.callback(local.stop)
            server_pids[name] = [p.pid for p in local.procs]
            shard_security[name] = check_shard_security(local, secure)
            torch.manual_seed(0)
            chief = TaskSpec("chief", 0)
            with PSClient(local.cluster, task=chief if secure else None,
                          security=job.security(chief) if secure else INSECURE) as client:
                client.register_module(make_mlp(dims), Optimizer("sgd", lr=lr), create=True)
            pools[name] = TrainerPool("ps", dims, local.cluster, args.workers, lr, args.train_warmup,
                                      job if secure else None)
            stack.callback(pools[name].close)
        if with_local:
            raw["local"] = []
            pools["local"] = TrainerPool("local", dims, None, 1, lr, args.train_warmup)
            stack.callback(pools["local"].close)
        names = list(pools)
        for r in range(args.train_repeats):
            order = names[r % len(names):] + names[:r % len(names)]  # rotate to cancel drift
            for name in order:
                pids = server_pids.get(name, [])
                before = cpu_seconds(pids)
                raw[name].append(pools[name].run(duration))
                after = cpu_seconds(pids)
                if pids and before is not None and after is not None:
                    server_cpu[name].append(after - before)
            summary = ", ".join(f"{n} {sum(w['steps'] / w['seconds'] for w in raw[n][-1]):.1f} steps/s"
                                for n in names)
            log(f"{label} repeat {r + 1}/{args.train_repeats}: {summary}")
    rates = {name: [sum(w["steps"] / w["seconds"] for w in run) for run in runs] for name, runs in raw.items()}
    cpu = {name: cpu_per_step(runs, server_cpu.get(name)) for name, runs in raw.items()}
    out = {"rates": rates, "medians": {n: median(v) for n, v in rates.items()}, "raw": raw, "cpu": cpu,
           "shard_security": shard_security}
    if "async" in rates and "async_secure" in rates:
        out["secure_ratio"] = out["medians"]["async_secure"] / out["medians"]["async"]
        out["secure_ratio_paired"] = median([s / p for p, s in zip(rates["async"], rates["async_secure"])])
    return out


def cpu_per_step(runs: list[list[dict]], server_cpu: list[float] | None) -> dict:
    """Where a training step's CPU time goes, in ms per step over all runs, and how many cores were busy.

    compute: forward and backward; update: exchange() with the PS (client side,
    all threads) or opt.step() with none; server: the ps process.
    """
    steps = sum(w["steps"] for run in runs for w in run)
    wall = sum(max(w["seconds"] for w in run) for run in runs)
    worker = sum(w["cpu_seconds"] for run in runs for w in run)
    update = sum(w["update_cpu_seconds"] for run in runs for w in run)
    out = {"compute_ms": 1e3 * (worker - update) / steps, "update_ms": 1e3 * update / steps,
           "client_MB_copied_per_step": sum(w.get("bytes_copied", 0) for run in runs for w in run) / steps / 1e6}
    busy = worker
    if server_cpu is not None and len(server_cpu) == len(runs):
        out["server_ms"] = 1e3 * sum(server_cpu) / steps
        busy += sum(server_cpu)
    out["total_ms"] = 1e3 * busy / steps
    out["cores_busy"] = busy / wall
    return out


# -- report ---------------------------------------------------------------------------------------

def environment() -> dict:
    import google.protobuf
    import torch
    from google.protobuf.internal import api_implementation

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    cpu = None
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "machine": {"nproc": os.cpu_count(), "sched_affinity": len(os.sched_getaffinity(0)), "cpu": cpu,
                    "platform": platform.platform(), "loadavg_start": os.getloadavg()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "grpcio": grpc.__version__,
                     "protobuf": google.protobuf.__version__, "protobuf_impl": api_implementation.Type(),
                     "numpy": np.__version__},
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "git": {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))},
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
    }


def table(results: dict) -> str:
    rows = [("metric", "ours", "reference / target"), ("---", "---", "---")]

    def add(key, label, fmt, ref):
        if key in results:
            rows.append((label, fmt.format(results[key]), ref))

    detail = results.get("bandwidth_detail", {})
    gbps = detail.get("round_trip_GBps", {})
    if "pullpush_seconds" in results:  # plaintext figures (absent with --security secure)
        med = detail["median_seconds"]
        rows.append(("push + pull 101 MB, 2 shards (s)",
                     f"{results['pullpush_seconds']:.3f} (push {med['ours_2ps']['push']:.3f} + pull "
                     f"{med['ours_2ps']['pull']:.3f}; {gbps['ours_2ps']:.2f} GB/s)",
                     f"bare gRPC, same run: {results['grpc_baseline_seconds']:.3f} (push "
                     f"{med['baseline']['push']:.3f} + pull {med['baseline']['pull']:.3f}; "
                     f"{gbps['baseline']:.2f} GB/s); transport.md 0.228"))
        if "ours_1ps" in med:
            rows.append(("push + pull 101 MB, 1 shard (s)",
                         f"{results['pullpush_1ps_seconds']:.3f} (push {med['ours_1ps']['push']:.3f} + pull "
                         f"{med['ours_1ps']['pull']:.3f})", "-"))
        add("ratio", "ratio = baseline / ours (2 shards)", "{:.2f}", REFERENCES["ratio"])
        add("client_copies_per_byte", "bytes the client copies per byte moved", "{:.2f}",
            "0 on bulk lanes (only the kernel copies); 1.00 inline: each byte once into its push message, once "
            "out of its pull message (gRPC's own copies aside)")
        if "pullpush_cpu_seconds" in results:
            rows.append(("CPU per push + pull, client + shards (ms)", f"{1e3 * results['pullpush_cpu_seconds']:.0f}",
                         f"bare gRPC, same run: {1e3 * results['grpc_baseline_cpu_seconds']:.0f}; raw bytes, "
                         f"no copies: {1e3 * results['grpc_raw_cpu_seconds']:.0f} "
                         f"({results['grpc_raw_seconds']:.3f} s)"))
    add("mlp_async_steps_per_s", "small MLP, 1 ps + 2 async workers (steps/s)", "{:.0f}",
        REFERENCES["mlp_async_steps_per_s"])
    add("mlp_local_steps_per_s", "small MLP, 1 process, no PS (steps/s)", "{:.0f}", REFERENCES["mlp_local_steps_per_s"])
    add("big_async_steps_per_s", "big MLP, 1 ps + 2 async workers (steps/s)", "{:.2f}",
        REFERENCES["big_async_steps_per_s"])
    add("big_local_steps_per_s", "big MLP, 1 process, no PS (steps/s)", "{:.2f}", REFERENCES["big_local_steps_per_s"])
    for label, key in (("small", "small_cpu_per_step"), ("big", "big_cpu_per_step")):
        cpu = results.get(key, {}).get("async")
        if cpu and "server_ms" in cpu:
            rows.append((f"{label} MLP async, CPU per step (ms)",
                         f"{cpu['total_ms']:.1f} = compute {cpu['compute_ms']:.1f} + exchange {cpu['update_ms']:.1f} "
                         f"+ ps {cpu['server_ms']:.1f}; {cpu['cores_busy']:.2f} cores busy; "
                         f"{cpu['client_MB_copied_per_step']:.1f} MB copied per worker step", "-"))
    add("big_ceiling_steps_per_s", "big MLP ceiling at bare gRPC's CPU cost (steps/s)", "{:.2f}",
        "cores / (1-process step CPU + bare gRPC round-trip CPU)")
    add("big_ceiling_raw_steps_per_s", "big MLP ceiling at raw gRPC's CPU cost (steps/s)", "{:.2f}",
        "cores / (1-process step CPU + raw-bytes round-trip CPU)")
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def security_table(results: dict) -> str:
    """Plaintext and secure figures side by side, the secure / plaintext ratio, and the issue's target."""
    rows = [("metric", "plaintext", "mutual TLS + token", "secure / plaintext", "target"), ("---",) * 5]

    def ratio(key: str) -> str:  # ratio of the medians, and the median of the per-repeat ratios
        if key not in results:
            return "-"
        paired = results.get(key + "_paired")
        return f"{results[key]:.3f}" + (f" (paired {paired:.3f})" if paired is not None else "")

    def target(key: str) -> str:
        if key not in SECURE_TARGETS:
            return "-"
        if key not in results:
            return f">= {SECURE_TARGETS[key]:.2f}"
        return f">= {SECURE_TARGETS[key]:.2f}: {'met' if results[key] >= SECURE_TARGETS[key] else 'NOT met'}"

    def step_cpu(c: dict | None) -> str:
        return f"{c['total_ms']:.1f} (exchange {c['update_ms']:.1f} + ps {c['server_ms']:.1f})" \
            if c and "server_ms" in c else "-"

    detail = results.get("bandwidth_detail", {})
    med, gbps = detail.get("median_seconds", {}), detail.get("round_trip_GBps", {})

    def round_trip(name: str) -> str:
        return f"{med[name]['total']:.3f} s ({gbps[name]:.2f} GB/s)" if name in med else "-"

    if "ours_2ps_secure" in med:
        rows.append(("push + pull 101 MB, 2 shards: s (GB/s); ratio of bandwidth", round_trip("ours_2ps"),
                     round_trip("ours_2ps_secure"), ratio("secure_bandwidth_ratio"),
                     target("secure_bandwidth_ratio")))
        plain_cpu, secure_cpu = results.get("pullpush_cpu_seconds"), results.get("pullpush_secure_cpu_seconds")
        if secure_cpu is not None:
            rows.append(("CPU per push + pull, client + shards (ms)",
                         f"{1e3 * plain_cpu:.0f}" if plain_cpu else "-", f"{1e3 * secure_cpu:.0f}",
                         f"{secure_cpu / plain_cpu:.3f}" if plain_cpu else "-", "-"))
    for label, plain_key, secure_key, ratio_key, fmt in (
            ("small", "mlp_async_steps_per_s", "mlp_async_secure_steps_per_s", "secure_mlp_steps_ratio", "{:.0f}"),
            ("big", "big_async_steps_per_s", "big_async_secure_steps_per_s", "secure_big_steps_ratio", "{:.2f}")):
        if secure_key not in results:
            continue
        rows.append((f"{label} MLP, 1 ps + {results['config']['workers']} async workers (steps/s)",
                     fmt.format(results[plain_key]) if plain_key in results else "-",
                     fmt.format(results[secure_key]), ratio(ratio_key), target(ratio_key)))
        cpu = results.get(f"{label}_cpu_per_step", {})
        plain_cpu, secure_cpu = cpu.get("async"), cpu.get("async_secure")
        if secure_cpu and "server_ms" in secure_cpu:
            rows.append((f"{label} MLP async, CPU per step (ms)", step_cpu(plain_cpu), step_cpu(secure_cpu),
                         f"{secure_cpu['total_ms'] / plain_cpu['total_ms']:.3f}" if plain_cpu else "-", "-"))
    if len(rows) == 2:
        return ""
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--json", type=pathlib.Path, help="write all results and raw timings here")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and shorter runs, no 1-shard or 1-process big-model variants (about a minute)")
    parser.add_argument("--repeats", type=int, help="bandwidth round trips timed per variant (default 11; quick 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed bandwidth round trips per variant first")
    parser.add_argument("--train-repeats", type=int, help="timed training runs per setup (default 3; quick 1)")
    parser.add_argument("--small-seconds", type=float, help="wall time of one small-model run (default 5; quick 3)")
    parser.add_argument("--big-seconds", type=float, help="wall time of one big-model run (default 10; quick 5)")
    parser.add_argument("--train-warmup", type=int, default=3, help="untimed steps per training process first")
    parser.add_argument("--workers", type=int, default=2, help="async workers (default 2)")
    parser.add_argument("--only", default="bandwidth,small,big",
                        help="comma-separated sections to run: bandwidth, small, big (default: all)")
    parser.add_argument("--no-1ps", action="store_true", help="skip the 1-shard bandwidth variant")
    parser.add_argument("--no-big-local", action="store_true", help="skip the 1-process big-model run")
    parser.add_argument("--security", default="both", choices=("both", "plain", "secure"),
                        help="shards and clients in plaintext (--insecure), with mutual TLS + per-task tokens, or "
                             "both, interleaved, with secure/plaintext ratios (default both)")
    parser.add_argument("--secure-big", action="store_true",
                        help="with --security both, also run the big model's async setup secured (about 45 s more)")
    parser.add_argument("--placement", default="greedy", choices=("greedy", "round_robin"),
                        help="PSClient placement for the 2-shard bandwidth case (default greedy: round_robin "
                             "puts every weight matrix of the MLP on shard 0 and only biases on shard 1)")
    parser.add_argument("--chunk-bytes", type=int, default=BASELINE_CHUNK_BYTES,
                        help="baseline gRPC chunk size (default 1 MiB); torchps uses its client's default")
    parser.add_argument("--shard-torch-threads", type=int, default=None,
                        help="every shard's --torch-threads (default: LocalCluster's, 1: the shards share the "
                             "cores with the client and workers; the core count for torch's own default)")
    parser.add_argument("--lr-small", type=float, default=0.05, help="SGD learning rate, small model")
    parser.add_argument("--lr-big", type=float, default=1e-3, help="SGD learning rate, big model")
    # internal: the bare gRPC server process
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="leave glibc malloc at its defaults in every process (default: tune all of them alike)")
    parser.add_argument("--baseline-server", metavar="PORT_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--baseline-chunk-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.repeats = args.repeats or (3 if quick else 11)
    args.train_repeats = args.train_repeats or (1 if quick else 3)
    args.small_seconds = args.small_seconds or (3.0 if quick else 5.0)
    args.big_seconds = args.big_seconds or (4.0 if quick else 10.0)
    if quick:  # start-up (processes importing torch, 100 MB creates) dominates a quick run
        args.no_1ps = args.no_big_local = True
    args.shard_args = [] if args.shard_torch_threads is None else ["--torch-threads", str(args.shard_torch_threads)]
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.sections) - {"bandwidth", "small", "big"}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.baseline_server:
        return baseline_server_main(args.baseline_server, args.baseline_bytes, args.baseline_chunk_bytes)

    if not args.no_malloc_tuning:
        # Every process of the run, ours and the baseline's alike, gets the same allocator settings.
        from torchps.client import tune_malloc
        from torchps.memory import malloc_env

        os.environ.update(malloc_env())
        tune_malloc()
    started = time.monotonic()
    results: dict = {"config": {k: v for k, v in vars(args).items() if not k.startswith("baseline")
                                and k != "json"}, **environment()}
    results["config"]["json"] = str(args.json) if args.json else None
    results["references"] = REFERENCES
    plain, secure = args.security in ("both", "plain"), args.security in ("both", "secure")
    results["security"] = {
        "mode": args.security,
        "secure_setup": "ps-server --tls-cert/--tls-key/--tls-ca (ps task's files) --token-file --admin-token-file; "
                        "clients: Security.load(the chief's or their worker's certificate, key, CA, token) - "
                        "mutual TLS on 127.0.0.1 and a per-task token on every call (torchps.certs, ECDSA P-256)",
        "plain_setup": "ps-server --insecure; clients security=INSECURE",
        "targets": SECURE_TARGETS,
    }
    job = JobSecurity(num_ps=2, workers=args.workers) if secure else None
    sections = results["section_seconds"] = {}
    try:
        if "bandwidth" in args.sections:
            t0 = time.monotonic()
            results.update(bench_bandwidth(args, job))
            sections["bandwidth"] = time.monotonic() - t0
        setups = (("async",) if plain else ()) + (("async_secure",) if secure else ())
        if "small" in args.sections:
            t0 = time.monotonic()
            small = bench_training("small", SMALL_DIMS, args, args.small_seconds, args.lr_small, with_local=True,
                                   setups=setups, job=job)
            for name, key in (("async", "mlp_async_steps_per_s"), ("async_secure", "mlp_async_secure_steps_per_s"),
                              ("local", "mlp_local_steps_per_s")):
                if name in small["medians"]:
                    results[key] = small["medians"][name]
            if "secure_ratio" in small:
                results["secure_mlp_steps_ratio"] = small["secure_ratio"]
                results["secure_mlp_steps_ratio_paired"] = small["secure_ratio_paired"]
            results["small_raw"] = small["raw"]
            results["small_cpu_per_step"] = small["cpu"]
            results["small_rates"] = small["rates"]
            results["small_shard_security"] = small["shard_security"]
            sections["small"] = time.monotonic() - t0
        if "big" in args.sections:
            t0 = time.monotonic()
            big_setups = setups if args.secure_big or not plain else ("async",)
            big = bench_training("big", BIG_DIMS, args, args.big_seconds, args.lr_big,
                                 with_local=not args.no_big_local, setups=big_setups, job=job)
            for name, key in (("async", "big_async_steps_per_s"), ("async_secure", "big_async_secure_steps_per_s"),
                              ("local", "big_local_steps_per_s")):
                if name in big["medians"]:
                    results[key] = big["medians"][name]
            if "secure_ratio" in big:
                results["secure_big_steps_ratio"] = big["secure_ratio"]
                results["secure_big_steps_ratio_paired"] = big["secure_ratio_paired"]
            results["big_raw"] = big["raw"]
            results["big_cpu_per_step"] = big["cpu"]
            results["big_shard_security"] = big["shard_security"]
            if "local" in big["cpu"] and "grpc_baseline_cpu_seconds" in results:
                # Throughput if every step cost the 1-process step's CPU plus bare gRPC's round trip and
                # every core were busy all the time: no transport over Python gRPC can go above it here.
                step_cpu, cores = big["cpu"]["local"]["total_ms"] / 1e3, results["machine"]["nproc"]
                results["big_ceiling_steps_per_s"] = cores / (step_cpu + results["grpc_baseline_cpu_seconds"])
                results["big_ceiling_raw_steps_per_s"] = cores / (step_cpu + results["grpc_raw_cpu_seconds"])
            results["big_rates"] = big["rates"]
            sections["big"] = time.monotonic() - t0
    finally:
        if job is not None:
            job.close()
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["wall_seconds"] = time.monotonic() - started

    print(table(results))
    secure_rows = security_table(results)
    if secure_rows:
        print("\nSecurity: plaintext (--insecure) vs mutual TLS + per-task tokens, interleaved in this run\n"
              if args.security == "both" else "\nSecurity: mutual TLS + per-task tokens only (--security secure)\n")
        print(secure_rows)
    print(f"\n{results['machine']['nproc']} CPUs, torch {results['versions']['torch']}, grpcio "
          f"{results['versions']['grpcio']}, protobuf {results['versions']['protobuf']} "
          f"({results['versions']['protobuf_impl']}); load {results['machine']['loadavg_start'][0]:.1f} -> "
          f"{results['machine']['loadavg_end'][0]:.1f}; {results['wall_seconds']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
