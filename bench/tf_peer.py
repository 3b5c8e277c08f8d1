#!/usr/bin/env python
"""TensorFlow's ParameterServerStrategy on bench/pullpush.py's MLPs: the peer bench/peers.py compares torchps with.

    python bench/tf_peer.py --dims 784,100,10 --num-ps 1 --seconds 5
    python bench/tf_peer.py --dims 784,8192,2304,10 --num-ps 2 --seconds 10 --isolated
    python bench/tf_peer.py --dims 784,8192,2304,10 --local --seconds 5 --warmup 2   # forward + backward alone
    python bench/tf_peer.py --dims 784,8192,2304,10 --no-compute --seconds 10 --isolated   # the data plane alone

Runs with TensorFlow's interpreter (tensorflow-cpu 2.21; see bench/README.md),
imports neither torch nor torchps, and prints one line
`TF_PEER_RESULT {json}` on stdout (logs go to stderr).

The cluster is this process (the chief: ClusterCoordinator) plus one
tf.distribute.Server process per ps and per worker, all named by 127.0.0.1
addresses. TensorFlow's servers listen on every interface ([::]:port) and
have no option to bind to one, so peers.py runs this script in a private
network namespace (`unshare -rn`) holding only a loopback interface; with
--isolated this script brings that interface up and checks that it is the only
one (it refuses to start otherwise).

The model is the same as pullpush.make_mlp: Linear layers with sigmoid between
them (both models), torch's default initialisation, logits out, mean
softmax cross-entropy. Variables are tf.Variables created under
ParameterServerStrategy's scope, so they live on the ps tasks; with more than
one ps they are cut by MinSizePartitioner(256 KiB, max_shards=num_ps) like
torchps's default partitioner. Each step (a tf.function given to
coordinator.schedule) reads the variables from the ps tasks, takes a random
batch of 100 from a per-worker dataset (4 fixed random batches, repeated, as
the torch workers cycle through 4), computes the gradients on the worker and
applies SGD (variable.assign_sub(lr * gradient)) on the ps tasks: asynchronous
training, each worker at its own pace. With --no-compute (bench/dataplane.py)
there is no batch, forward or backward: each step reads every variable onto
the worker and multiplies it there by a constant (the "gradient", as large as
the variable; a Mul has no device of its own, so it runs on the step's worker,
where an Identity would be placed beside its input on the ps), and applies
assign_sub(lr * gradient) on the ps: the whole model crosses the wire each
way per step. After warm-up steps, steps are
scheduled for `--seconds` (at most 4 waiting per worker) and the run ends when
they have all finished: steps/s = steps / that time.

CPU seconds per step (Linux /proc) are given per group (workers, ps, chief)
and per process. --profile DIR records the machine with `perf record -a -g`
(bench/perf_profile.py) for --profile-seconds, starting a second into the
timed window, for the caller to summarize per task (DIR/targets.json).

Threads: every task (chief, workers, ps) runs with 1 intra-op thread (as the
torch workers run torch.set_num_threads(1)) and 2 inter-op threads: with 1
the first step never finishes (TensorFlow 2.21, this setup). The chief's
setting also reaches the remote tasks' eager contexts through the cluster's
default session config; the servers get the same in their own config.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULT_PREFIX = "TF_PEER_RESULT "
MIN_SHARD_BYTES = 256 << 10


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] tf_peer: {message}", file=sys.stderr, flush=True)


def loopback_only() -> list[str]:
    """Brings `lo` up (a fresh network namespace has it down); returns the interfaces there are."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, struct.pack("16sh", b"lo", 0)))[1]
        if not flags & iff_up:
            fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))
    return [name for _, name in socket.if_nameindex()]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports on 127.0.0.1 (held together, then released for the servers)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cpu_seconds(pids) -> float | None:
    """User + system CPU seconds of `pids` so far (Linux /proc); None elsewhere."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


def loopback_bytes() -> int | None:
    """Bytes `lo` has transmitted (Linux /proc/net/dev): every byte between two local processes, headers
    included, counted once. Only this benchmark's inside a network namespace of its own (bench/network.py)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == "lo":
                    return int(counters.split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return None


def die_with_parent(parent: int) -> None:
    """Linux: this process is killed when its parent ends, however it ends (no server outlives a killed run)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent ended before that took effect
        os._exit(1)


def serve(cluster: dict, job: str, index: int, intra: int, inter: int, parent: int) -> None:
    """One ps or worker task: a tf.distribute.Server until terminated."""
    die_with_parent(parent)
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=intra, inter_op_parallelism_threads=inter)
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc",
                                  config=config, start=True)
    server.join()


def run(args, report) -> None:
    """Starts the cluster, trains, and calls report(result) before the servers are stopped."""
    import numpy as np
    import tensorflow as tf

    started = time.monotonic()
    dims = tuple(int(d) for d in args.dims.split(","))
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_threads)

    ports = iter(free_ports(args.num_ps + args.workers + 1))
    cluster = {"chief": [f"127.0.0.1:{next(ports)}"],
               "ps": [f"127.0.0.1:{next(ports)}" for _ in range(args.num_ps)],
               "worker": [f"127.0.0.1:{next(ports)}" for _ in range(args.workers)]}
    ctx = mp.get_context("spawn")
    threads = (args.intra_threads, args.inter_threads)
    procs = [ctx.Process(target=serve, args=(cluster, job, i, *threads, os.getpid()), daemon=True, name=f"tf-{job}-{i}")
             for job in ("ps", "worker") for i in range(len(cluster[job]))]
    for proc in procs:
        proc.start()
    try:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
        partitioner = (tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=MIN_SHARD_BYTES, max_shards=args.num_ps) if args.num_ps > 1 else None)
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)

        rng = np.random.default_rng(0)
        initial = []  # the first kernel's starting values, to show afterwards that SGD changed it
        with strategy.scope():
            layers = []
            for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
                bound = 1.0 / np.sqrt(fan_in)  # torch.nn.Linear's default initialisation
                kernel = rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32)
                initial = initial or [kernel]
                w = tf.Variable(kernel, name=f"kernel{i}")
                b = tf.Variable(rng.uniform(-bound, bound, (fan_out,)).astype(np.float32), name=f"bias{i}")
                layers.append((w, b))

        def parts(v):  # a ShardedVariable's pieces, or the variable
            return list(getattr(v, "variables", [v]))

        train_vars = [p for w, b in layers for v in (w, b) for p in parts(v)]
        numel = sum(int(np.prod(p.shape)) for p in train_vars)
        placement = {p.name: p.device for p in train_vars}
        lr = tf.constant(args.lr)

        def dataset_fn(_=None):
            x = tf.random.uniform((4 * args.batch, dims[0]))
            y = tf.random.uniform((4 * args.batch,), maxval=dims[-1], dtype=tf.int64)
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat()

        per_worker_iter = iter(coordinator.create_per_worker_dataset(dataset_fn))

        gradient_scale = tf.constant(0.01)

        def replica_fn_no_compute(x, y):  # the data plane alone: x and y unused
            for v in train_vars:
                g = tf.convert_to_tensor(v) * gradient_scale  # read on the ps, multiplied on this worker
                v.assign_sub(lr * g)
            return tf.constant(float("nan"))

        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                h = x
                for i, (w, b) in enumerate(layers):
                    h = tf.matmul(h, tf.convert_to_tensor(w)) + tf.convert_to_tensor(b)
                    if i < len(layers) - 1:
                        h = tf.sigmoid(h)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
            grads = tape.gradient(loss, train_vars)
            for v, g in zip(train_vars, grads):
                v.assign_sub(lr * g)
            return loss

        @tf.function
        def train_step(iterator):
            x, y = next(iterator)
            return strategy.run(replica_fn_no_compute if args.no_compute else replica_fn, args=(x, y))

        log(f"{args.num_ps} ps + {args.workers} workers, {numel:,} parameters in {len(train_vars)} variables; "
            f"warming up")
        for _ in range(args.warmup):
            coordinator.schedule(train_step, args=(per_worker_iter,))
        coordinator.join()
        setup_seconds = time.monotonic() - started

        pids = {"workers": [p.pid for p in procs if p.name.startswith("tf-worker")],
                "ps": [p.pid for p in procs if p.name.startswith("tf-ps")], "chief": [os.getpid()]}
        pids.update({p.name[len("tf-"):]: [p.pid] for p in procs})  # per process: ps-0, worker-1, ...
        cpu_before, wire_before = {k: cpu_seconds(v) for k, v in pids.items()}, loopback_bytes()
        recording = None
        if args.profile:
            from perf_profile import Recording

            recording = Recording({f"tf-{k}": v[0] for k, v in pids.items() if "-" in k} | {"tf-chief": os.getpid()},
                                  args.profile, delay=1.0, seconds=args.profile_seconds)
        backlog_limit = 4 * args.workers
        pending: list = []
        steps, last_loss = 0, float("nan")
        t0 = time.perf_counter()
        end = t0 + args.seconds
        while time.perf_counter() < end:
            pending.append(coordinator.schedule(train_step, args=(per_worker_iter,)))
            steps += 1
            if len(pending) >= backlog_limit:
                last_loss = float(pending.pop(0).fetch())
        coordinator.join()
        seconds = time.perf_counter() - t0
        if recording is not None:
            recording.finish()
        if pending:
            last_loss = float(pending[-1].fetch())
        cpu_after, wire_after = {k: cpu_seconds(v) for k, v in pids.items()}, loopback_bytes()
        first_kernel = tf.convert_to_tensor(layers[0][0]).numpy()
        max_change = float(np.max(np.abs(first_kernel - initial[0])))
        if not max_change > 0:
            raise RuntimeError("the first kernel did not change: SGD was not applied on the ps tasks")
        cpu = {k: (cpu_after[k] - cpu_before[k]) / steps if cpu_before[k] is not None and cpu_after[k] is not None
               else None for k in pids}
        each = {k: cpu.pop(k) for k in list(cpu) if k.startswith(("ps-", "worker-"))} | {"chief": cpu["chief"]}
        report({
            "steps_per_s": steps / seconds, "steps": steps, "seconds": seconds, "warmup_steps": args.warmup,
            "last_loss": last_loss, "first_kernel_max_change": max_change, "parameters": numel,
            "variables": len(train_vars), "placement": placement,
            "partitioner": (f"MinSizePartitioner(min_shard_bytes={MIN_SHARD_BYTES}, max_shards={args.num_ps})"
                            if partitioner else None),
            "cpu_seconds_per_step": cpu, "cpu_seconds_per_step_each": each, "setup_seconds": setup_seconds,
            "no_compute": args.no_compute,
            "loopback_bytes": None if None in (wire_before, wire_after) else wire_after - wire_before,
            "threads": {"intra_op": args.intra_threads, "inter_op": args.inter_threads,
                        "applies_to": "chief, every worker and ps (server config and the cluster's session config)"},
            "num_ps": args.num_ps, "workers": args.workers, "dims": list(dims), "activation": "sigmoid",
            "batch": args.batch, "lr": args.lr, "tf_version": tf.__version__, "python": sys.version.split()[0],
            "isolation": args.isolation,
        })
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def run_local(args, report) -> None:
    """One process, no cluster: the model's forward and backward (gradients computed, not applied) on the same
    batches, for `--seconds` after `--warmup` steps; reports its CPU seconds per step (all its threads)."""
    import numpy as np
    import tensorflow as tf

    dims = tuple(int(d) for d in args.dims.split(","))
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_threads)
    rng = np.random.default_rng(0)
    layers = []
    for fan_in, fan_out in zip(dims[:-1], dims[1:]):
        bound = 1.0 / np.sqrt(fan_in)
        layers.append((tf.Variable(rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32)),
                       tf.Variable(rng.uniform(-bound, bound, (fan_out,)).astype(np.float32))))
    train_vars = [v for layer in layers for v in layer]
    xs = tf.random.uniform((4, args.batch, dims[0]))
    ys = tf.random.uniform((4, args.batch), maxval=dims[-1], dtype=tf.int64)

    @tf.function
    def gradients(x, y):
        with tf.GradientTape() as tape:
            h = x
            for i, (w, b) in enumerate(layers):
                h = tf.matmul(h, w) + b
                if i < len(layers) - 1:
                    h = tf.sigmoid(h)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
        return tape.gradient(loss, train_vars)

    for i in range(args.warmup):
        [g.numpy() for g in gradients(xs[i % 4], ys[i % 4])]
    steps, cpu0, t0 = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        [g.numpy() for g in gradients(xs[steps % 4], ys[steps % 4])]
        steps += 1
    report({"steps": steps, "seconds": time.perf_counter() - t0,
            "cpu_seconds_per_step": (time.process_time() - cpu0) / steps, "dims": list(dims),
            "what": "forward + backward in one process, gradients not applied",
            "threads": {"intra_op": args.intra_threads, "inter_op": args.inter_threads},
            "tf_version": tf.__version__})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--dims", default="784,100,10", help="layer widths (default the seed MLP 784,100,10)")
    parser.add_argument("--num-ps", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0, help="timed window")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (all workers together)")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--intra-threads", type=int, default=1, help="intra-op threads of every task (default 1)")
    parser.add_argument("--inter-threads", type=int, default=2, help="inter-op threads of every task (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="end the run (exit status 3) if it has not finished after this many seconds")
    parser.add_argument("--isolated", action="store_true",
                        help="this process is alone in a fresh network namespace (unshare -rn): bring lo up and "
                             "refuse to run if any other interface is there")
    parser.add_argument("--local", action="store_true",
                        help="no cluster: the CPU of the model's forward and backward in this one process")
    parser.add_argument("--no-compute", action="store_true",
                        help="no forward or backward: each step moves every variable to the worker and a gradient "
                             "of its size back (the data plane alone)")
    parser.add_argument("--profile", metavar="DIR",
                        help="perf record -a -g into DIR for part of the window (bench/perf_profile.py)")
    parser.add_argument("--profile-seconds", type=float, default=4.0, help="how long --profile records (default 4)")
    args = parser.parse_args(argv)
    if args.local:
        run_local(args, lambda result: print(RESULT_PREFIX + json.dumps(result), flush=True))
        return 0
    args.isolation = "none: TensorFlow's servers listen on every interface"
    if args.isolated:
        interfaces = loopback_only()
        if interfaces != ["lo"]:
            log(f"--isolated, but this network namespace has interfaces {interfaces}: refusing to start")
            return 2
        args.isolation = "private network namespace with only lo"
    else:
        log("not --isolated: TensorFlow's servers will listen on every interface of this machine")
    def expire():
        log(f"no result after {args.timeout:.0f} s: giving up")
        os._exit(3)

    watchdog = threading.Timer(args.timeout, expire)
    watchdog.daemon = True
    watchdog.start()
    run(args, lambda result: print(RESULT_PREFIX + json.dumps(result), flush=True))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the coordinator's threads can hold up a normal exit
