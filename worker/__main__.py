"""`ps-worker`: train (or evaluate) as one task of a torchps cluster.

    TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 1}}' ps-worker --model mlp
    ps-worker --cluster cluster.json --task-type chief --index 0 --mode sync

The chief (task 'chief', else worker 0) configures the mode and creates the
variables; other workers wait for them; the evaluator only pulls and evaluates.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import signal
import sys
import time

import torch

from ..client import PSClient, PSError
from ..cluster import Cluster, TaskSpec
from ..errors import ClusterConfigError
from ..memory import tune_malloc
from ..specs import OPTIMIZER_NAMES
from .data import DatasetNotFoundError, default_dataset_name
from .models import MODELS, build_model, load_entry
from .chief import FINAL_WAIT_SECONDS, Checkpointer, finish_job
from .trainer import TrainOptions, evaluate, optimizer_from_flags, run_evaluator, train

_LOGGER = logging.getLogger("torchps.worker")
EVALUATOR_CONNECT_SECONDS = 10.0


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ps-launch passes through to every worker."""
    g = parser.add_argument_group("training")
    g.add_argument("--model", default="mlp", choices=sorted(MODELS), help="built-in model (default: %(default)s)")
    g.add_argument("--hidden", type=int, default=100, help="hidden units of the mlp (default: %(default)s)")
    g.add_argument("--entry", help="your own task: 'package.module:function' returning (model, dataset, loss)")
    g.add_argument("--dataset", "--data-dir", dest="dataset", default=None,
                   help="'fashion-mnist', 'mnist5k' or a folder of MNIST idx files "
                        "(default: fashion-mnist if installed, else mnist5k)")
    g.add_argument("--epochs", type=int, default=None, help="passes over each worker's shard (default: 1)")
    g.add_argument("--steps", type=int, default=None, help="stop at this global step instead of after epochs")
    g.add_argument("--batch-size", type=int, default=100)
    g.add_argument("--optimizer", default="sgd", choices=sorted(set(OPTIMIZER_NAMES) - {"none"}))
    g.add_argument("--lr", type=float, default=0.1)
    g.add_argument("--momentum", type=float, default=0.0, help="sgd momentum")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--mode", default="async", choices=["async", "sync", "ssp"])
    g.add_argument("--replicas-to-aggregate", type=int, default=0, help="sync: R (default: every worker)")
    g.add_argument("--max-staleness", type=int, default=2, help="ssp: the bound s (default: %(default)s)")
    g.add_argument("--lease-seconds", type=float, default=10.0, help="sync/ssp: a silent worker is dropped after this")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (default: %(default)s)")
    g.add_argument("--logdir", help="write TensorBoard scalars here")
    g.add_argument("--log-every", type=float, default=5.0, help="seconds between log lines (default: %(default)s)")
    g.add_argument("--eval-interval", type=float, default=5.0, help="evaluator: seconds between evaluations")
    c = parser.add_argument_group("checkpoints and export (chief)")
    c.add_argument("--checkpoint-every-steps", type=int, default=0, help="save every N global steps "
                   "(the ps-servers need --checkpoint-dir)")
    c.add_argument("--checkpoint-every-seconds", type=float, default=0.0, help="save every T seconds")
    c.add_argument("--keep-checkpoints", type=int, default=3, help="checkpoints each shard keeps (default: %(default)s)")
    c.add_argument("--export", type=pathlib.Path, help="write the final model as a plain PyTorch state_dict here")
    c.add_argument("--init-from", type=pathlib.Path, help="start from this state_dict file instead of a fresh init")
    c.add_argument("--keep-ps", action="store_true", help="leave the ps-servers running when the job ends "
                   "(default: the chief shuts them down, and they exit with code 0)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ps-worker", description="Train as one task of a torchps cluster.")
    parser.add_argument("--cluster", help="cluster JSON or file (default: TF_CONFIG)")
    parser.add_argument("--task-type", choices=["chief", "worker", "evaluator"], help="default: TF_CONFIG's task")
    parser.add_argument("--index", type=int, default=None, help="task index (default: TF_CONFIG's, or 0)")
    parser.add_argument("--metrics-out", type=pathlib.Path, help="write the final summary JSON here")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="tqdm progress bar (default: when stderr is a terminal)")
    add_training_flags(parser)
    return parser.parse_args(argv)


def resolve_task(args: argparse.Namespace) -> tuple[Cluster, TaskSpec]:
    """(cluster, this task) from --cluster/--task-type/--index or TF_CONFIG."""
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
    cluster.address(task)
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
    try:
        cluster, task = resolve_task(args)
        device = resolve_device(args.device)
        torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        job = load_entry(args.entry) if args.entry else build_model(args.model, args.dataset or default_dataset_name(),
                                                                    args.hidden)
    except (ClusterConfigError, DatasetNotFoundError, ValueError, ImportError) as exc:
        print(f"ps-worker: error: {exc}", file=sys.stderr)
        return 2
    job.model.to(device)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        # An evaluator gives up on unreachable shards sooner: after the job they are gone for good.
        with PSClient(cluster, task=task, connect_timeout=EVALUATOR_CONNECT_SECONDS if task.type == "evaluator"
                      else 60.0) as client:
            summary = run_task(client, cluster, task, job, args, device)
    except PSError as exc:
        print(f"ps-worker: {task}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except Terminated:  # SIGTERM outside the training loop (which handles it itself): a clean stop
        _LOGGER.info("%s: SIGTERM; stopped", task)
        return 0
    if summary is not None:
        print("summary " + json.dumps(summary, sort_keys=True), flush=True)
        if args.metrics_out:
            args.metrics_out.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return 0


def run_task(client: PSClient, cluster: Cluster, task: TaskSpec, job, args, device: str) -> dict | None:
    """Runs this task's role; returns the summary (chief, evaluator) or None (other workers)."""
    started = time.monotonic()
    writer = _tensorboard(args.logdir, task)
    optimizer = optimizer_from_flags(args.optimizer, args.lr, args.momentum, args.weight_decay)
    replicas = len(cluster.chief) + len(cluster.worker)
    if task.type == "evaluator":
        binding = client.register_module(job.model, create=False, join=False, wait_timeout=FINAL_WAIT_SECONDS)
        last = [0, float("nan")]

        def on_eval(step: int, accuracy: float) -> None:
            last[:] = [step, accuracy]
            if writer is not None:
                writer.add_scalar("eval/accuracy", accuracy, step)

        try:
            run_evaluator(client, job, binding, device=device, interval=args.eval_interval,
                          target_steps=args.steps, timeout=24 * 3600, on_eval=on_eval)
        except Terminated:
            _LOGGER.info("evaluator: SIGTERM; stopping")
        return {"role": str(task), "global_step": last[0], "test_accuracy": last[1],
                "wall_seconds": time.monotonic() - started}
    if client.is_chief:
        client.configure(args.mode, replicas_to_aggregate=args.replicas_to_aggregate, total_num_replicas=replicas,
                         max_staleness=args.max_staleness, lease_seconds=args.lease_seconds)
        if args.init_from:
            job.model.load_state_dict(torch.load(args.init_from, map_location=device, weights_only=True))
    binding = client.register_module(job.model, optimizer, create=client.is_chief)
    replica = task.index + (len(cluster.chief) if task.type == "worker" else 0)
    _LOGGER.info("%s: replica %d of %d, %s mode, dataset %s, %s", task, replica, replicas, args.mode,
                 job.dataset, client.placement_report().splitlines()[0])
    checkpointer = None
    if client.is_chief and (args.checkpoint_every_steps or args.checkpoint_every_seconds):
        checkpointer = Checkpointer(client, every_steps=args.checkpoint_every_steps,
                                    every_seconds=args.checkpoint_every_seconds, keep=args.keep_checkpoints).start()

    def on_step(record: dict) -> None:
        if checkpointer is not None:
            checkpointer.note_step(record["global_step"])
        if writer is not None:
            for key in ("loss", "accuracy", "staleness"):
                writer.add_scalar(f"train/{key}", record[key], record["global_step"])
            writer.add_scalar("train/steps_per_second", client.stats.steps_per_second, record["global_step"])

    options = TrainOptions(epochs=args.epochs if args.epochs or args.steps else 1, steps=args.steps,
                           batch_size=args.batch_size, seed=args.seed + replica, device=device,
                           log_every=args.log_every, progress=args.progress)
    try:
        result = train(client, job, binding, replica=replica, num_replicas=replicas, options=options,
                       on_step=on_step)
    except Terminated:
        _LOGGER.warning("%s: SIGTERM; %s", task, "saving a last checkpoint" if checkpointer else "stopping")
        if checkpointer is not None:
            checkpointer.stop(final=True)
        return None
    client.leave()
    _LOGGER.info("%s finished: %d local steps, %s", task, result["local_steps"], client.stats.summary())
    if writer is not None:
        writer.close()
    if not client.is_chief:
        return None
    global_step = finish_job(client, binding, export=args.export, checkpointer=checkpointer,
                             shutdown=not args.keep_ps)
    accuracy = evaluate(job.model, job.dataset.x_test, job.dataset.y_test, device)
    wall = time.monotonic() - started
    return {**result, "role": str(task), "mode": args.mode, "dataset": job.dataset.name, "test_accuracy": accuracy,
            "global_step": global_step, "wall_seconds": wall, "steps_per_second": global_step / wall,
            "workers": replicas, "ps": cluster.num_ps,
            "checkpoints": checkpointer.saved_steps if checkpointer else []}


class Terminated(Exception):
    """SIGTERM arrived: the chief saves a last checkpoint and stops."""


def _raise_terminated(*_) -> None:
    raise Terminated()


def _tensorboard(logdir: str | None, task: TaskSpec):
    if not logdir:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(pathlib.Path(logdir) / f"{task.type}{task.index}"))


if __name__ == "__main__":
    sys.exit(main())
