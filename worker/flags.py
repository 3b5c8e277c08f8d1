"""ps-worker's and ps-launch's flags, checked before anything slow: this module imports neither torch nor
grpc, so a mistyped flag or a bad value is one line and exit code 2 at once.

    args = parse_args(argv)          # ps-worker's parser; ps-launch's adds its own flags to add_training_flags's
    finish_training_flags(args)      # defaults from the model, ranges, the dataset, output folders
    check_specs(args)                # --compression and --partition, parsed by the modules that use them
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import math
import os
import pathlib
import sys

from ..cli import ArgumentParser, USAGE_ERROR
from ..cluster import Cluster, TaskSpec
from ..errors import ClusterConfigError
from ..credential_flags import add_security_flags, resolve_security
from ..specs import OPTIMIZER_NAMES
from .datasets import DatasetNotFoundError, check_dataset, default_dataset_name
from .observe import parse_step_range

__all__ = ["MODEL_DEFAULTS", "DEFAULT_PARTITION", "add_training_flags", "add_security_flags", "check_entry",
           "check_output", "check_specs", "default_lr", "finish_training_flags", "parse_args", "preflight",
           "resolve_security", "resolve_task"]

DEFAULT_PARTITION = "min_size"
# A worker waits this long for a shard it cannot reach before it gives up: long enough for a pod to be
# scheduled and pull its image on a cluster, or for a killed shard to be restarted in place.
DEFAULT_CONNECT_TIMEOUT_SECONDS = 300.0
CONNECT_TIMEOUT_ENV = "TORCHPS_CONNECT_TIMEOUT"
LOG_LEVEL_ENV = "TORCHPS_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# What trains each built-in model well, used for the flags a user leaves out (any flag changes only itself).
# mlp: 0.87 on Fashion-MNIST in 10 epochs with 2 async workers (the README's demo). cnn: Adam at lr 0.001 gave
# 0.93-0.95 on mnist5k in 5 epochs with 2 async workers (5 runs); SGD with momentum 0.9 varied from run to run
# (lr 0.02: 0.81-0.94, lr 0.01: 0.86-0.91, 4 runs each), so sgd_lr is only what --optimizer sgd starts from.
# An --entry model gets the mlp's.
MODEL_DEFAULTS = {
    "mlp": {"epochs": 10, "optimizer": "sgd", "sgd_lr": 0.1, "momentum": 0.9},
    "cnn": {"epochs": 5, "optimizer": "adam", "sgd_lr": 0.02, "momentum": 0.9},
}
_OTHER_LR = {"adam": 1e-3, "adamw": 1e-3, "adagrad": 1e-2}  # the usual starting points of torch.optim's others


def default_lr(model: str, optimizer: str) -> float:
    """The learning rate ps-worker uses for `model` and `optimizer` when --lr is left out."""
    return MODEL_DEFAULTS.get(model, MODEL_DEFAULTS["mlp"])["sgd_lr"] if optimizer == "sgd" else _OTHER_LR[optimizer]


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ps-launch passes through to every worker. Left out, --epochs, --optimizer, --lr and --momentum
    take the model's defaults (MODEL_DEFAULTS)."""
    g = parser.add_argument_group("training")
    g.add_argument("--model", default="mlp", choices=sorted(MODEL_DEFAULTS),
                   help="built-in model (default: %(default)s)")
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
    g.add_argument("--replicas-to-aggregate", default="0", metavar="R|P%",
                   help="sync: R gradients per step (default: every worker), or P%% of the live workers, which "
                        "follows workers joining and leaving (e.g. 75%%)")
    g.add_argument("--scale-lr", action="store_true",
                   help="scale the learning rate with the live workers: lr x (live + the cluster spec's training "
                        "tasks yet to join) / the spec's training tasks (a job starts at --lr), set again whenever "
                        "shard 0 reports another count (workers joining or leaving)")
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
    g.add_argument("--delta-pulls", action="store_true", help="pull only what changed since the values this "
                   "worker holds, where the shards know it (sparse updates: top-k pushes with plain SGD, frozen or "
                   "embedding-like layers; register_module(delta_pulls=True)); not with --overlap")
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
    g.add_argument("--partition", default=DEFAULT_PARTITION, metavar="SPEC",
                   help="how big variables are cut across shards: min_size[:BYTES[:MAX_SHARDS]] (default: pieces of "
                        "at least 256 KiB, one per shard at most), max_size:BYTES[:MAX_SHARDS], fixed:N or none; "
                        "every task of a job must use the same")
    g.add_argument("--dynamic-sharding", type=int, default=None, metavar="EXAMPLES",
                   help="take the training data from a queue on ps 0 in shards of EXAMPLES examples (a multiple of "
                        "--batch-size trains whole batches) instead of a fixed slice per worker: each example of an "
                        "epoch is trained once however workers come and go (a dead worker's shard goes back to the "
                        "queue from where it stands), and fast workers take more shards; the chief creates the "
                        "queue, and reports what each epoch trained (async mode; not with --dense allreduce or "
                        "--nproc-per-host; default: off)")
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
                   "for ui.perfetto.dev) to DIR/TASK.trace.json, e.g. worker-0.trace.json; the tasks' files overlay "
                   "(a pid per task, wall-clock timestamps)")
    g.add_argument("--trace-steps", default="10-20", help="this worker's steps the timeline covers, FIRST-LAST "
                   "(default: %(default)s)")
    g.add_argument("--log-every", type=float, default=5.0, help="seconds between log lines (default: %(default)s)")
    g.add_argument("--log-level", type=str.upper, default=os.environ.get(LOG_LEVEL_ENV, "INFO").upper(),
                   choices=LOG_LEVELS, help="DEBUG also shows gRPC's own log (default: $TORCHPS_LOG_LEVEL or INFO)")
    g.add_argument("--connect-timeout", type=float, default=None, help="seconds to keep trying a shard that cannot "
                   "be reached (not yet scheduled, restarting), logging every few seconds what it waits for (default: "
                   f"${CONNECT_TIMEOUT_ENV}, else {DEFAULT_CONNECT_TIMEOUT_SECONDS:g})")
    g.add_argument("--eval-interval", type=float, default=5.0, help="evaluator: seconds between evaluations")
    c = parser.add_argument_group("checkpoints and export (chief)")
    c.add_argument("--checkpoint-every-steps", type=int, default=0, help="save every N global steps "
                   "(the ps-servers need --checkpoint-dir; with one, the chief also saves at the end and on SIGTERM "
                   "or Ctrl-C)")
    c.add_argument("--checkpoint-every-seconds", type=float, default=0.0, help="save every T seconds")
    c.add_argument("--keep-checkpoints", type=int, default=3, help="committed checkpoints kept (default: %(default)s)")
    c.add_argument("--export", type=pathlib.Path, help="write the final model as a plain PyTorch state_dict here")
    c.add_argument("--init-from", type=pathlib.Path, help="start from this state_dict file instead of a fresh init")
    c.add_argument("--keep-ps", action="store_true", help="leave the ps-servers running when the job ends "
                   "(default: the chief shuts them down, and they exit with code 0)")
    c.add_argument("--allow-partial", action="store_true", help="the chief exits 0 for a job that ended with part "
                   "of its planned data not trained (a worker died or left and did not come back, or never joined; "
                   "it still says so); default: exit code 3")


def finish_training_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the flags left out with the model's defaults and checks every value and the dataset;
    ClusterConfigError or DatasetNotFoundError names the first problem. Imports neither torch nor grpc:
    ps-launch and ps-worker call it first. The specs of --compression and --partition are check_specs's;
    --init-from is the chief's alone (models.read_init)."""
    model = args.model if not args.entry else "mlp"
    defaults = MODEL_DEFAULTS[model]
    args.replicas_to_aggregate, args.replicas_fraction = _replicas(args.replicas_to_aggregate)
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
    if args.state_dir is not None and not args.compression:
        raise ClusterConfigError("--state-dir keeps the residuals of --compression: pass --compression too")
    if args.delta_pulls and args.overlap:
        raise ClusterConfigError("--delta-pulls cannot be combined with --overlap yet: choose one")
    _check_dense(args)
    check_host_flags(args)
    _check_dynamic_sharding(args)
    checks += [("--allreduce-port", args.allreduce_port is None or 1 <= args.allreduce_port <= 65535, "in 1-65535"),
               ("--allreduce-timeout", math.isfinite(args.allreduce_timeout) and args.allreduce_timeout > 0, "> 0")]
    try:
        parse_step_range(args.trace_steps)
    except ValueError as exc:
        raise ClusterConfigError(f"--trace-steps: {exc}") from None
    checks.append(("--metrics-port", args.metrics_port is None or 0 <= args.metrics_port <= 65535, "in 0-65535"))
    if args.connect_timeout is None:
        args.connect_timeout = _seconds_from_env(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_SECONDS)
    checks.append(("--connect-timeout", math.isfinite(args.connect_timeout) and args.connect_timeout > 0, "> 0"))
    for flag, ok, wanted in checks:
        if not ok:
            raise ClusterConfigError(f"{flag} must be {wanted}. Received: {getattr(args, flag[2:].replace('-', '_'))}")
    if not args.entry:
        check_dataset(args.dataset or default_dataset_name())
    check_output("--export", args.export)
    return args


def _replicas(value: str | int) -> tuple[int, float]:
    """--replicas-to-aggregate as (R, 0.0) or (0, a fraction in (0, 1]) for "P%"; ClusterConfigError (one line)
    otherwise. Idempotent on what it returned (ps-launch checks the flags its workers check again)."""
    text = str(value).strip()
    try:
        if text.endswith("%"):
            percent = float(text[:-1])
            if math.isfinite(percent) and 0 < percent <= 100:
                return 0, percent / 100
        elif int(text) >= 0:
            return int(text), 0.0
    except ValueError:
        pass
    raise ClusterConfigError(f"--replicas-to-aggregate must be a number >= 0 or a share of the live workers in "
                             f"(0%, 100%], e.g. 75%. Received: {value}")


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
        ("--delta-pulls", args.delta_pulls, "it pulls dense parameters from the shards, and " + why),
        ("--checkpoint-every-steps/--checkpoint-every-seconds",
         bool(args.checkpoint_every_steps or args.checkpoint_every_seconds),
         "the shards' checkpoints would not hold them: " + why),
    ]
    for flag, given, reason in refused:
        if given:
            raise ClusterConfigError(f"--dense allreduce cannot be combined with {flag}: {reason}")


def _check_dynamic_sharding(args: argparse.Namespace) -> None:
    """ClusterConfigError (one line) for --dynamic-sharding out of range or with a flag it cannot honour."""
    if args.dynamic_sharding is None:
        return
    if args.dynamic_sharding < 1:
        raise ClusterConfigError(f"--dynamic-sharding must be >= 1 (examples per data shard). Received: "
                                 f"{args.dynamic_sharding}")
    for flag, given, reason in [
        (f"--mode {args.mode}", args.mode != "async",
         "a worker waiting for a data shard at an epoch's end pushes nothing, and would hold every step (sync) or "
         "every worker ahead of it (ssp) until its progress timeout"),
        ("--dense allreduce", args.dense == "allreduce", "every member of the group must take each step"),
        ("--nproc-per-host", args.nproc_per_host > 1, "the host's processes split fixed slices of the data"),
    ]:
        if given:
            raise ClusterConfigError(f"--dynamic-sharding cannot be combined with {flag}: {reason}")


def check_output(flag: str, path: pathlib.Path | None) -> None:
    """ClusterConfigError unless the folder `path` (a file written at the end of the job) goes in exists."""
    if path is not None and not path.parent.is_dir():
        raise ClusterConfigError(f"{flag} {path}: no folder {path.parent} to write it in")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """ps-worker's flags; a usage error (one line, exit 2) for an unknown flag or a value of the wrong type."""
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


def check_host_flags(args: argparse.Namespace) -> None:
    """ClusterConfigError (one line) for --nproc-per-host out of range or with a flag it cannot honour."""
    if args.nproc_per_host < 1:
        raise ClusterConfigError(f"--nproc-per-host must be >= 1. Received: {args.nproc_per_host}")
    if args.nproc_per_host == 1:
        return
    for flag, given, reason in [
        ("--dense allreduce", args.dense == "allreduce", "both use torch.distributed's one process group"),
        ("--overlap", args.overlap, "the host's gradients are averaged after backward, not streamed during it"),
    ]:
        if given:
            raise ClusterConfigError(f"--nproc-per-host cannot be combined with {flag}: {reason}")


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


def check_specs(args: argparse.Namespace) -> None:
    """--compression and --partition, parsed by the modules that use them (they import torch);
    ClusterConfigError naming the flag."""
    from ..compression import Compression
    from ..partitioning import partitioner_from_spec

    for flag, spec, parse in (("--compression", args.compression, Compression.parse),
                              ("--partition", args.partition, partitioner_from_spec)):
        try:
            if spec:
                parse(spec)
        except ClusterConfigError as exc:
            raise ClusterConfigError(f"{flag}: {exc}") from None


def check_entry(spec: str, search_path: list[str] | None = None) -> None:
    """ClusterConfigError unless --entry's 'package.module:function' names a module found on `search_path`
    (default: sys.path) whose source binds `function` at its top level. The module is not run (its parent
    packages are imported, as finding it needs)."""
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name.isidentifier():
        raise ClusterConfigError(f"--entry must look like 'package.module:function'. Received: {spec!r}")
    saved = sys.path[:]
    if search_path is not None:
        sys.path[:] = search_path
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a parent package is missing
        found = None
    finally:
        sys.path[:] = saved
    if found is None:
        raise ClusterConfigError(f"--entry {spec}: no module {module_name!r} on PYTHONPATH or in this folder")
    if found.origin and found.origin.endswith(".py") and function_name not in _top_level_names(found.origin):
        raise ClusterConfigError(f"--entry {spec}: {found.origin} defines no {function_name!r}")


def _top_level_names(path: str) -> set[str] | _Anything:
    """The names a module's source binds outside functions and classes (everything, if it star-imports or
    has a module __getattr__, or cannot be parsed: nothing is refused on a guess)."""
    try:
        tree = ast.parse(pathlib.Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return _Anything()
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return _Anything()
                names.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
            todo += [s for handler in getattr(node, "handlers", []) for s in handler.body]
        else:
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return _Anything() if "__getattr__" in names else names


class _Anything:
    """A set that holds every name."""

    def __contains__(self, _name: object) -> bool:
        return True


def preflight(argv: list[str]) -> None:
    """What ps-worker checks before its slow imports: the flags, the task, the credentials, the dataset. A
    problem is one line on stderr and exit code 2."""
    args = parse_args(argv)
    try:
        finish_training_flags(args)
        check_output("--metrics-out", args.metrics_out)
        resolve_task(args)
        resolve_security(args)
        if args.entry:
            check_entry(args.entry)
    except (ClusterConfigError, DatasetNotFoundError) as exc:
        print(f"ps-worker: error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _seconds_from_env(name: str, default: float) -> float:
    """A number of seconds from environment variable `name`, else `default`; ClusterConfigError if it is not
    a number."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise ClusterConfigError(f"{name} must be a number of seconds. Received: {text!r}") from None
