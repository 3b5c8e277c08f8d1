"""`ps-worker`: train (or evaluate) as one task of a torchps cluster.

    TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 1}}' ps-worker --model mlp
    ps-worker --cluster cluster.json --task-type chief --index 0 --mode sync

The chief (task 'chief', else worker 0) configures the mode and creates the
variables; other workers wait for them; the evaluator only pulls and evaluates.
With --dense allreduce (the hybrid, client/allreduce.py) the dense parameters
stay in the workers, averaged among them by torch.distributed every step (the
group meets at the chief's host, at --allreduce-port or its cluster port), and
only the embedding tables live on the shards, trained async. With
--nproc-per-host K the task is K processes on its host (host.py): they average
their gradients locally and this process pushes and pulls for them.

Exit codes: 0 done; 1 the task failed (one line naming the error); 2 a usage or
configuration error (one line, before anything starts); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import signal
import sys
import time

import torch

from ..client import AllreduceGroup, Compression, HostBinding, PSClient, PSError, Security
from ..cli import ArgumentParser
from ..cluster import Cluster, TaskSpec
from ..errors import ClusterConfigError
from ..memory import tune_malloc
from ..partitioning import partitioner_from_spec
from ..metrics_http import serve_metrics
from ..specs import OPTIMIZER_NAMES
from .data import DatasetNotFoundError, check_dataset, default_dataset_name
from .host import HostProcesses, check_host_flags, local_device, run_local_rank
from .models import MODEL_DEFAULTS, MODELS, build_model, default_lr, load_entry, load_init, read_init
from .chief import FINAL_WAIT_SECONDS, Checkpointer, StragglerWatch, finish_job, fixed_tables
from .observe import EvaluatorMetrics, StepObserver, Timeline, WorkerMetrics, parse_step_range
from .residuals import ResidualFile
from .trainer import TrainOptions, evaluate, evaluate_once, optimizer_from_flags, run_evaluator, train

_LOGGER = logging.getLogger("torchps.worker")
EVALUATOR_CONNECT_SECONDS = 10.0


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ps-launch passes through to every worker. Left out, --epochs, --optimizer, --lr and --momentum
    take the model's defaults (models.MODEL_DEFAULTS)."""
    g = parser.add_argument_group("training")
    g.add_argument("--model", default="mlp", choices=sorted(MODELS), help="built-in model (default: %(default)s)")
    g.add_argument("--hidden", type=int, default=100, help="hidden units of the mlp (default: %(default)s)")
    g.add_argument("--entry", help="your own task: 'package.module:function' returning (model, dataset, loss)")
    g.add_argument("--dataset", "--data-dir", dest="dataset", default=None,
                   help="'fashion-mnist', 'mnist5k' or a folder of MNIST idx files "
                        "(default: fashion-mnist if installed, else mnist5k)")
    g.add_argument("--epochs", type=int, default=None,
                   help="passes over each worker's shard (default: the model's: "
                        + ", ".join(f"{m} {d['epochs']}" for m, d in MODEL_DEFAULTS.items()) + ")")
    g.add_argument("--steps", type=int, default=None, help="stop at this global step instead of after epochs")
    g.add_argument("--batch-size", type=int, default=100)
    g.add_argument("--optimizer", default=None, choices=sorted(set(OPTIMIZER_NAMES) - {"none"}),
                   help="server-side optimizer (default: the model's: "
                        + ", ".join(f"{m} {d['optimizer']}" for m, d in MODEL_DEFAULTS.items()) + ")")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default: the model's and optimizer's: "
                   + ", ".join(f"{m} {d['sgd_lr']:g}" for m, d in MODEL_DEFAULTS.items()) + " with sgd; 0.001 adam and "
                   "adamw; 0.01 adagrad)")
    g.add_argument("--momentum", type=float, default=None, help="sgd momentum (default: 0.9)")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--mode", default="async", choices=["async", "sync", "ssp"])
    g.add_argument("--replicas-to-aggregate", type=int, default=0, help="sync: R (default: every worker)")
    g.add_argument("--max-staleness", type=int, default=2, help="ssp: the bound s (default: %(default)s)")
    g.add_argument("--lease-seconds", type=float, default=10.0, help="a silent worker is dropped after this")
    g.add_argument("--progress-timeout", type=float, default=60.0,
                   help="a worker that heartbeats but pushes nothing for max(this, 20 x the median step time) is "
                        "dropped until it pushes again (default: %(default)s s)")
    g.add_argument("--straggler-threshold", type=float, default=2.0,
                   help="chief: log a worker whose pushes arrive this many times less often than the others' "
                        "median (shard 0's view, checked every 10 s; 0: never; default: %(default)s)")
    g.add_argument("--compression", help="wire compression of every parameter, both ways: bf16, fp16, topk:RATIO, "
                   "randomk:RATIO or none, options after commas: min_bytes=N (default 65536), warmup=STEPS, "
                   "pull=none|bf16|fp16, error_feedback=0|1, seed=N (default: none)")
    g.add_argument("--overlap", action="store_true", help="push each gradient while backward still runs and pull "
                   "the next values while forward runs, each layer waiting for its own (same results; "
                   "register_module(overlap=True))")
    g.add_argument("--dense", default="ps", choices=["ps", "allreduce"],
                   help="where the dense parameters are trained: 'ps' (variables on the shards, the default) or "
                        "'allreduce' (kept in the workers and averaged among them every step with "
                        "torch.distributed, gloo on CPU, NCCL on CUDA, stepped by a local optimizer; only embedding "
                        "tables live on the shards, trained async; --steps counts the group's steps, every worker "
                        "taking each; no --overlap, --compression, sync or ssp, checkpoints or evaluator; a worker "
                        "lost stops the others)")
    g.add_argument("--allreduce-port", type=int, default=None,
                   help="--dense allreduce: the port the chief listens at for the group, on its cluster host "
                        "(default: the port of the chief's cluster entry; the chief is the 'chief' task, else "
                        "worker 0)")
    g.add_argument("--allreduce-timeout", type=float, default=300.0,
                   help="--dense allreduce and --nproc-per-host: seconds to form the group, and the longest a step "
                        "waits for the other workers (or the host's processes) before the group counts one as lost "
                        "(default: %(default)s)")
    g.add_argument("--state-dir", type=pathlib.Path, help="keep this task's compression residuals in "
                   "DIR/TASK-residuals.pt (e.g. worker-0-residuals.pt), loaded again when the task restarts")
    g.add_argument("--state-every-steps", type=int, default=100,
                   help="write --state-dir's file every N of this task's steps, and when it stops (default: "
                        "%(default)s)")
    g.add_argument("--partition", default="min_size", metavar="SPEC",
                   help="how big variables are cut across shards: min_size[:BYTES[:MAX_SHARDS]] (default: pieces of "
                        "at least 256 KiB, one per shard at most), max_size:BYTES[:MAX_SHARDS], fixed:N or none; "
                        "every task of a job must use the same")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--nproc-per-host", type=int, default=1, metavar="K",
                   help="train this task with K processes on its host (one per GPU: --device cuda gives process "
                        "I GPU I; CPU processes stand in without GPUs), each on its part of every batch of "
                        "--batch-size; they average their gradients locally and one of them pushes and pulls for "
                        "the host (in sync mode the host is one replica with K x the batch; default: %(default)s)")
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (default: %(default)s)")
    g.add_argument("--logdir", help="write TensorBoard scalars here")
    g.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at /metrics on this port, on the "
                   "task's host (0: a free one, logged; with ps-launch use 0; default: none)")
    g.add_argument("--trace-out", type=pathlib.Path, help="write a timeline of --trace-steps (Chrome-trace JSON, "
                   "for ui.perfetto.dev) to DIR/TASK.trace.json, e.g. worker-0.trace.json")
    g.add_argument("--trace-steps", default="10-20", help="this worker's steps the timeline covers, FIRST-LAST "
                   "(default: %(default)s)")
    g.add_argument("--log-every", type=float, default=5.0, help="seconds between log lines (default: %(default)s)")
    g.add_argument("--eval-interval", type=float, default=5.0, help="evaluator: seconds between evaluations")
    c = parser.add_argument_group("checkpoints and export (chief)")
    c.add_argument("--checkpoint-every-steps", type=int, default=0, help="save every N global steps "
                   "(the ps-servers need --checkpoint-dir; with one, the chief also saves at the end and on SIGTERM)")
    c.add_argument("--checkpoint-every-seconds", type=float, default=0.0, help="save every T seconds")
    c.add_argument("--keep-checkpoints", type=int, default=3, help="committed checkpoints kept (default: %(default)s)")
    c.add_argument("--export", type=pathlib.Path, help="write the final model as a plain PyTorch state_dict here")
    c.add_argument("--init-from", type=pathlib.Path, help="start from this state_dict file instead of a fresh init")
    c.add_argument("--keep-ps", action="store_true", help="leave the ps-servers running when the job ends "
                   "(default: the chief shuts them down, and they exit with code 0)")


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("security (ps-certs makes the files; the TORCHPS_* variables stand in)")
    s.add_argument("--tls-cert", help="this task's certificate ($TORCHPS_TLS_CERT)")
    s.add_argument("--tls-key", help="its key ($TORCHPS_TLS_KEY)")
    s.add_argument("--tls-ca", help="the job's CA certificate ($TORCHPS_TLS_CA)")
    s.add_argument("--token-file", help="the job token ($TORCHPS_TOKEN_FILE)")
    s.add_argument("--admin-token-file", help="the admin token, the chief's only ($TORCHPS_ADMIN_TOKEN_FILE)")


def finish_training_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the flags left out with the model's defaults and checks every value and the dataset;
    ClusterConfigError or DatasetNotFoundError names the first problem. Cheap: ps-launch calls it before
    starting anything. --init-from is the chief's alone (load_init)."""
    model = args.model if not args.entry else "mlp"
    defaults = MODEL_DEFAULTS[model]
    if args.epochs is None and args.steps is None:
        args.epochs = defaults["epochs"]
    if args.optimizer is None:
        args.optimizer = defaults["optimizer"]
    if args.lr is None:
        args.lr = default_lr(model, args.optimizer)
    if args.momentum is None:
        args.momentum = defaults["momentum"] if args.optimizer == "sgd" else 0.0
    checks = [
        ("--epochs", args.epochs is None or args.epochs >= 1, ">= 1"),
        ("--steps", args.steps is None or args.steps >= 1, ">= 1"),
        ("--batch-size", args.batch_size >= 1, ">= 1"),
        ("--hidden", args.hidden >= 1, ">= 1"),
        ("--lr", math.isfinite(args.lr) and args.lr > 0, "a finite number > 0"),
        ("--momentum", 0 <= args.momentum < 1, "in [0, 1)"),
        ("--weight-decay", math.isfinite(args.weight_decay) and args.weight_decay >= 0, ">= 0"),
        ("--replicas-to-aggregate", args.replicas_to_aggregate >= 0, ">= 0"),
        ("--max-staleness", args.max_staleness >= 0, ">= 0"),
        ("--lease-seconds", math.isfinite(args.lease_seconds) and args.lease_seconds > 0, "> 0"),
        ("--progress-timeout", math.isfinite(args.progress_timeout) and args.progress_timeout > 0, "> 0"),
        ("--straggler-threshold", math.isfinite(args.straggler_threshold) and
         (args.straggler_threshold == 0 or args.straggler_threshold > 1), "0 (off) or a number > 1"),
        ("--threads", args.threads >= 1, ">= 1"),
        ("--log-every", args.log_every > 0, "> 0"),
        ("--eval-interval", args.eval_interval > 0, "> 0"),
        ("--checkpoint-every-steps", args.checkpoint_every_steps >= 0, ">= 0"),
        ("--checkpoint-every-seconds", args.checkpoint_every_seconds >= 0, ">= 0"),
        ("--keep-checkpoints", args.keep_checkpoints >= 1, ">= 1"),
        ("--state-every-steps", args.state_every_steps >= 1, ">= 1"),
        ("--state-dir", args.state_dir is None or not args.state_dir.exists() or args.state_dir.is_dir(),
         "a folder"),
    ]
    if args.compression:
        try:
            Compression.parse(args.compression)
        except ClusterConfigError as exc:
            raise ClusterConfigError(f"--compression: {exc}") from None
    elif args.state_dir is not None:
        raise ClusterConfigError("--state-dir keeps the residuals of --compression: pass --compression too")
    _partitioner(args.partition)
    _check_dense(args)
    check_host_flags(args)
    checks += [("--allreduce-port", args.allreduce_port is None or 1 <= args.allreduce_port <= 65535, "in 1-65535"),
               ("--allreduce-timeout", math.isfinite(args.allreduce_timeout) and args.allreduce_timeout > 0, "> 0")]
    try:
        parse_step_range(args.trace_steps)
    except ValueError as exc:
        raise ClusterConfigError(f"--trace-steps: {exc}") from None
    checks.append(("--metrics-port", args.metrics_port is None or 0 <= args.metrics_port <= 65535, "in 0-65535"))
    for flag, ok, wanted in checks:
        if not ok:
            raise ClusterConfigError(f"{flag} must be {wanted}. Received: {getattr(args, flag[2:].replace('-', '_'))}")
    if not args.entry:
        check_dataset(args.dataset or default_dataset_name())
    check_output("--export", args.export)
    return args


def _check_dense(args: argparse.Namespace) -> None:
    """ClusterConfigError (one line) for --dense allreduce with a flag it cannot honour."""
    if args.dense != "allreduce":
        if args.allreduce_port is not None:
            raise ClusterConfigError("--allreduce-port is for --dense allreduce")
        return
    why = "the dense parameters live in the workers, not on the shards"
    refused = [
        ("--overlap", args.overlap, "it overlaps the shards' pushes and pulls of dense parameters, and " + why),
        (f"--mode {args.mode}", args.mode != "async",
         "the embedding tables train async (the all-reduce keeps the workers in step)"),
        ("--compression", bool(args.compression), "it compresses dense parameters on their way to the shards, and "
         + why),
        ("--state-dir", args.state_dir is not None, "it keeps --compression's residuals, and " + why),
        ("--checkpoint-every-steps/--checkpoint-every-seconds",
         bool(args.checkpoint_every_steps or args.checkpoint_every_seconds),
         "the shards' checkpoints would not hold them: " + why),
    ]
    for flag, given, reason in refused:
        if given:
            raise ClusterConfigError(f"--dense allreduce cannot be combined with {flag}: {reason}")


def check_output(flag: str, path: pathlib.Path | None) -> None:
    """ClusterConfigError unless the folder `path` (a file written at the end of the job) goes in exists."""
    if path is not None and not path.parent.is_dir():
        raise ClusterConfigError(f"{flag} {path}: no folder {path.parent} to write it in")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="ps-worker", description="Train as one task of a torchps cluster.")
    parser.add_argument("--cluster", help="cluster JSON or file (default: TF_CONFIG)")
    parser.add_argument("--task-type", choices=["chief", "worker", "evaluator"], help="default: TF_CONFIG's task")
    parser.add_argument("--index", type=int, default=None, help="task index (default: TF_CONFIG's, or 0)")
    parser.add_argument("--metrics-out", type=pathlib.Path, help="write the final summary JSON here")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="tqdm progress bar (default: when stderr is a terminal)")
    add_training_flags(parser)
    add_security_flags(parser)
    # A --nproc-per-host task's other processes: started by its local rank 0 (host.py), never by hand.
    parser.add_argument("--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--host-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # local rank 0 starts the others with the same
    return args


def resolve_task(args: argparse.Namespace) -> tuple[Cluster, TaskSpec]:
    """(cluster, this task) from --cluster/--task-type/--index or TF_CONFIG; ClusterConfigError if it is no
    task ps-worker serves."""
    env_task = None
    if args.cluster:
        cluster = Cluster.from_json(args.cluster)
    else:
        cluster, env_task = Cluster.from_tf_config()
    kind = args.task_type or (env_task.type if env_task else None)
    if kind is None:
        raise ClusterConfigError("no task: pass --task-type (and --index) or set TF_CONFIG's task")
    index = args.index if args.index is not None else (env_task.index if env_task else 0)
    task = TaskSpec(kind, index)
    if kind == "ps":
        raise ClusterConfigError(f"this task is {task}: run ps-server for it, not ps-worker")
    cluster.address(task)
    if kind == "evaluator" and getattr(args, "dense", "ps") == "allreduce":
        raise ClusterConfigError("--dense allreduce: an evaluator cannot see the dense parameters (they live in "
                                 "the workers, not on the shards); the chief reports the test accuracy at the end")
    return cluster, task


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ClusterConfigError(f"--device {name}: CUDA is not available on this host; use --device cpu")
    return name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("TORCHPS_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    tune_malloc()
    task = None
    try:
        finish_training_flags(args)
        check_output("--metrics-out", args.metrics_out)
        cluster, task = resolve_task(args)
        args.device = resolve_device(args.device)  # 'auto' decided once: the host's processes agree on it
        device = local_device(args.device, args.local_rank)
        partitioner = _partitioner(args.partition)
        security = Security.load(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                                 token_file=args.token_file, admin_token_file=args.admin_token_file)
        # The chief's alone (the others pull what it creates); a bad file is refused before the data is read.
        init = read_init(args.init_from) if args.init_from and task == cluster.chief_task else None
        torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        job = load_entry(args.entry) if args.entry else build_model(args.model, args.dataset or default_dataset_name(),
                                                                    args.hidden)
        if init is not None:
            load_init(job.model, init, args.init_from)
    except (ClusterConfigError, DatasetNotFoundError, ValueError, ImportError, RuntimeError) as exc:
        print(f"ps-worker: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ps-worker: interrupted", file=sys.stderr)
        return 130
    job.model.to(device)
    _terminate_once()
    if args.local_rank:  # one of a --nproc-per-host task's other processes: no client, it follows local rank 0
        try:
            return run_local_rank(job, args, cluster, task, device)
        except Terminated:
            return 0
        except KeyboardInterrupt:
            return 130
    try:
        # An evaluator gives up on unreachable shards sooner: after the job they are gone for good.
        with PSClient(cluster, task=task, security=security, partitioner=partitioner,
                      connect_timeout=EVALUATOR_CONNECT_SECONDS if task.type == "evaluator" else 60.0) as client:
            summary = run_task(client, cluster, task, job, args, device)
    except PSError as exc:
        print(f"ps-worker: {task}: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 1
    except Terminated:  # SIGTERM outside the training loop (which handles it itself): a clean stop
        _LOGGER.info("%s: SIGTERM; stopped", task)
        return 0
    except KeyboardInterrupt:
        print(f"ps-worker: {task}: interrupted", file=sys.stderr)
        return 130
    if summary is not None:
        print("summary " + json.dumps(summary, sort_keys=True), flush=True)
        if args.metrics_out:
            args.metrics_out.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return 0


def _partitioner(spec: str):
    try:
        return partitioner_from_spec(spec)
    except ClusterConfigError as exc:
        raise ClusterConfigError(f"--partition: {exc}") from None


def run_task(client: PSClient, cluster: Cluster, task: TaskSpec, job, args, device: str) -> dict | None:
    """Runs this task's role; returns the summary (chief, evaluator) or None (other workers)."""
    started = time.monotonic()
    writer = _tensorboard(args.logdir, task)
    try:
        if task.type == "evaluator":
            metrics = _serve_metrics(EvaluatorMetrics(), cluster, task, args.metrics_port) \
                if args.metrics_port is not None else None
            return _evaluate(client, task, job, args, device, writer, started, metrics)
        if args.dense == "allreduce":  # formed before anything else: it waits for every training task
            with AllreduceGroup.connect(cluster, task, port=args.allreduce_port, timeout=args.allreduce_timeout,
                                        device=device) as group:
                return _train(client, cluster, task, job, args, device, writer, started, group)
        if args.nproc_per_host > 1:  # this process is local rank 0: it starts the others and pushes for them
            with HostProcesses(args.argv, args.nproc_per_host, task, device=args.device,
                               timeout=args.allreduce_timeout) as host:
                return _train(client, cluster, task, job, args, device, writer, started, host=host)
        return _train(client, cluster, task, job, args, device, writer, started)
    finally:
        if writer is not None:
            writer.close()


def _serve_metrics(metrics, cluster: Cluster, task: TaskSpec, port: int):
    """Serves `metrics`' registry on the task's host at `port` and logs where; ClusterConfigError if it cannot."""
    host = cluster.address(task).rpartition(":")[0]
    try:
        port = serve_metrics(metrics.registry, host, port)
    except OSError as exc:
        raise ClusterConfigError(f"--metrics-port {port} on {host}: {exc}") from None
    _LOGGER.info("%s: metrics on http://%s:%d/metrics", task, host, port)
    return metrics


def _observer(cluster: Cluster, task: TaskSpec, args) -> StepObserver | None:
    """The metrics endpoint and the timeline the flags ask for, or None."""
    if args.metrics_port is None and args.trace_out is None:
        return None
    metrics = timeline = None
    if args.metrics_port is not None:
        metrics = _serve_metrics(WorkerMetrics(), cluster, task, args.metrics_port)
    if args.trace_out is not None:
        first, last = parse_step_range(args.trace_steps)
        timeline = Timeline(args.trace_out / f"{task.type}-{task.index}.trace.json", str(task), first, last)
    return StepObserver(metrics, timeline)


def _train(client: PSClient, cluster: Cluster, task: TaskSpec, job, args, device: str, writer,
           started: float, group: AllreduceGroup | None = None, host: HostProcesses | None = None) -> dict | None:
    """A chief's or worker's part: train, then (the chief) end the job; the chief's summary, else None.
    With `group` (--dense allreduce) the dense parameters are averaged in it and stay in the workers; with
    `host` (--nproc-per-host) this process pushes and pulls for the host's processes."""
    optimizer = optimizer_from_flags(args.optimizer, args.lr, args.momentum, args.weight_decay)
    replicas = len(cluster.chief) + len(cluster.worker)
    if client.is_chief:
        client.configure(args.mode, replicas_to_aggregate=args.replicas_to_aggregate, total_num_replicas=replicas,
                         max_staleness=args.max_staleness, lease_seconds=args.lease_seconds,
                         progress_seconds=args.progress_timeout)
    compression = Compression.parse(args.compression) if args.compression else None
    if group is not None:
        binding = client.register_module(job.model, optimizer, create=client.is_chief, dense="allreduce",
                                         process_group=group)
    else:
        binding = client.register_module(job.model, optimizer, create=client.is_chief, compression=compression,
                                         overlap=args.overlap)
    ps_binding = binding  # the shards' side (finish_job pulls the final values through it)
    if host is not None:
        binding = HostBinding(binding, host.group)
    start_step = binding.step  # a restarted task joins a job already under way
    residuals = ResidualFile(args.state_dir, task, args.state_every_steps) if args.state_dir and compression else None
    if residuals is not None:
        residuals.restore(client)
    replica = task.index + (len(cluster.chief) if task.type == "worker" else 0)
    if group is not None:
        _LOGGER.info("%s: replica %d of %d, dense parameters all-reduced (%d tensors, %s), %d table(s) on %d "
                     "shard(s), %s, dataset %s", task, replica, replicas, len(binding.names), group.backend,
                     len(binding.tables), cluster.num_ps, args.mode, job.dataset)
    else:
        _LOGGER.info("%s: replica %d of %d, %s mode, dataset %s, %d variables over %d shard(s) (%s placement)%s%s",
                     task, replica, replicas, args.mode, job.dataset, len(binding.names), cluster.num_ps,
                     client.placement.strategy, ", overlap" if binding.overlap else "",
                     f", joining at global step {start_step}" if start_step else "")
    if host is not None:
        _LOGGER.info("%s: %d processes on this host (%s): each step averages their gradients, then one push and "
                     "one pull of %d x %d examples' step for the host", task, args.nproc_per_host,
                     host.group.backend, args.nproc_per_host, args.batch_size)
    checkpointer = None
    if client.is_chief and group is None and any(client.status(s).checkpoints for s in range(cluster.num_ps)):
        checkpointer = Checkpointer(client, every_steps=args.checkpoint_every_steps,
                                    every_seconds=args.checkpoint_every_seconds, keep=args.keep_checkpoints).start()
    stragglers = StragglerWatch(client, args.straggler_threshold).start() \
        if client.is_chief and args.straggler_threshold and replicas > 1 else None

    def on_step(record: dict) -> None:
        if residuals is not None:
            residuals.stepped(client)
        if checkpointer is not None:
            checkpointer.note_step(record["global_step"])
        if writer is not None:
            for key in ("loss", "accuracy", "staleness"):
                writer.add_scalar(f"train/{key}", record[key], record["global_step"])
            writer.add_scalar("train/steps_per_second", client.stats.steps_per_second, record["global_step"])

    done_before = _batches_done(start_step, args, replicas)
    if host is not None:
        binding.share(done_before)  # the other processes skip as many of their batches
    options = TrainOptions(epochs=args.epochs, steps=args.steps, batch_size=args.batch_size,
                           seed=args.seed + replica, device=device, log_every=args.log_every, progress=args.progress,
                           skip_batches=done_before,
                           max_local_steps=_lockstep_steps(args, len(job.dataset.y_train), replicas) if group else None,
                           local_shard=(0, args.nproc_per_host) if host is not None else (0, 1))
    observer = _observer(cluster, task, args)
    if observer is not None and observer.timeline is not None:
        client.tracer = observer.tracer
    try:
        result = train(client, job, binding, replica=replica, num_replicas=replicas, options=options,
                       on_step=on_step, observer=observer)
    except Terminated:
        _LOGGER.warning("%s: SIGTERM; %s", task, "saving a last checkpoint" if checkpointer else "stopping")
        if checkpointer is not None:
            checkpointer.stop(final=True)
        return None
    finally:
        if stragglers is not None:
            stragglers.stop()
        if residuals is not None:
            residuals.save(client)
    if host is not None:
        binding.close()  # the host's other processes stop
        host.done()
    client.leave()
    _LOGGER.info("%s finished: %d local steps, %s", task, result["local_steps"], client.stats.summary())
    if not client.is_chief:
        return None
    if group is not None:
        return _finish_allreduce(client, task, job, args, device, binding, result, started, start_step, replicas,
                                 cluster.num_ps)
    global_step = finish_job(client, ps_binding, export=args.export, checkpointer=checkpointer,
                             shutdown=not args.keep_ps)
    accuracy = evaluate(job.model, job.dataset.x_test, job.dataset.y_test, device)
    wall = time.monotonic() - started
    return {**result, "role": str(task), "mode": args.mode, "dense": args.dense, "dataset": job.dataset.name,
            "test_accuracy": accuracy,
            "global_step": global_step, "start_step": start_step, "wall_seconds": wall,
            "steps_per_second": (global_step - start_step) / wall, "workers": replicas, "ps": cluster.num_ps,
            "nproc_per_host": args.nproc_per_host,
            "checkpoints": checkpointer.saved_steps if checkpointer else []}


def _lockstep_steps(args, examples: int, replicas: int) -> int:
    """--dense allreduce: the steps every worker takes, the same for all (each step is a collective every
    member must make): --steps, or --epochs over the smallest worker's shard (the last worker's: shards are
    every replicas-th example), whichever comes first."""
    smallest = len(range(replicas - 1, examples, replicas))
    by_epochs = args.epochs * -(-smallest // args.batch_size) if args.epochs else None
    return min(n for n in (args.steps, by_epochs) if n is not None)


def _finish_allreduce(client: PSClient, task: TaskSpec, job, args, device: str, binding, result: dict,
                      started: float, start_step: int, replicas: int, num_ps: int) -> dict:
    """The chief's end of a --dense allreduce job: waits for the other workers to leave (their last row
    pushes are in), evaluates while the shards still serve the tables, exports the dense state_dict and the
    fixed-size tables whole, stops the shards; returns the summary. `global_step` counts the group's
    synchronous steps, `table_pushes` the shards' step (every worker's row pushes)."""
    table_pushes = finish_job(client, binding, export=None, checkpointer=None, shutdown=False)
    accuracy = evaluate(job.model, job.dataset.x_test, job.dataset.y_test, device)
    if args.export is not None:
        state = {name: value.detach().cpu() for name, value in job.model.state_dict().items()}
        state.update(client.export_state_dict(fixed_tables(binding)) if fixed_tables(binding) else {})
        torch.save(state, args.export)
        _LOGGER.info("exported %d tensors to %s (dense, and fixed-size tables whole)", len(state), args.export)
    if not args.keep_ps:
        client.shutdown_cluster("the chief finished the job")
    wall = time.monotonic() - started
    return {**result, "role": str(task), "mode": args.mode, "dense": args.dense, "dataset": job.dataset.name,
            "test_accuracy": accuracy, "global_step": binding.step, "table_pushes": table_pushes,
            "start_step": start_step, "wall_seconds": wall, "steps_per_second": (binding.step - start_step) / wall,
            "workers": replicas, "ps": num_ps, "checkpoints": []}


def _batches_done(start_step: int, args, replicas: int) -> int:
    """The batches this task's earlier incarnation worked through, judged from the global step it rejoins at:
    in sync mode each step takes k = ceil(R / N) batches from every worker, otherwise steps count every
    worker's pushes."""
    if args.mode == "sync":
        aggregate = args.replicas_to_aggregate or replicas
        return start_step * max(1, -(-aggregate // replicas))
    return start_step // max(1, replicas)


def _evaluate(client: PSClient, task: TaskSpec, job, args, device: str, writer, started: float,
              metrics: EvaluatorMetrics | None) -> dict:
    binding = client.register_module(job.model, create=False, join=False, wait_timeout=FINAL_WAIT_SECONDS)
    last = [0, float("nan")]

    def on_eval(step: int, accuracy: float) -> None:
        last[:] = [step, accuracy]
        if metrics is not None:
            metrics.evaluated(step, accuracy)
        if writer is not None:
            writer.add_scalar("eval/accuracy", accuracy, step)

    try:
        run_evaluator(client, job, binding, device=device, interval=args.eval_interval, target_steps=args.steps,
                      timeout=24 * 3600, on_eval=on_eval)
    except Terminated:  # asked to stop (ps-launch does once training is over): evaluate what is there now
        _LOGGER.info("evaluator: SIGTERM; a last evaluation")
        try:
            evaluate_once(client, job, binding, device, on_eval)
        except PSError as exc:
            _LOGGER.info("evaluator: no last evaluation: %s", exc)
    return {"role": str(task), "global_step": last[0], "test_accuracy": last[1],
            "wall_seconds": time.monotonic() - started}


class Terminated(BaseException):
    """SIGTERM arrived: the chief saves a last checkpoint and stops. A BaseException, as KeyboardInterrupt
    is, so that no `except Exception` it is raised through (logging's, a retry loop's) swallows it."""


def _terminate_once() -> None:
    """SIGTERM raises Terminated once; a second one while the first is handled is ignored."""
    def handler(*_) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _tensorboard(logdir: str | None, task: TaskSpec):
    if not logdir:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(pathlib.Path(logdir) / f"{task.type}{task.index}"))


if __name__ == "__main__":
    sys.exit(main())
