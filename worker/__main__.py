"""`ps-worker`: train (or evaluate) as one task of a torchps cluster.

    TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 1}}' ps-worker --model mlp --insecure
    ps-worker --cluster cluster.json --task-type chief --index 0 --mode sync --tls-cert ... --token-file ...

Its flags are flags.py's (checked there before torch is imported). Without
credentials (the flags, or the TORCHPS_* variables) it refuses to start unless
told --insecure, as ps-server does.

The chief (task 'chief', else worker 0) configures the mode and creates the
variables; other workers wait for them; the evaluator only pulls and evaluates.
With --dense allreduce (the hybrid, client/allreduce.py) the dense parameters
stay in the workers, averaged among them by torch.distributed every step (the
group meets at the chief's host, at --allreduce-port or its cluster port), and
only the embedding tables live on the shards, trained async. With
--nproc-per-host K the task is K processes on its host (host.py): they average
their gradients locally and this process pushes and pulls for them.

Exit codes: 0 done; 1 the task failed (one line naming the error); 2 a usage or
configuration error (one line, before anything starts); 3 (the chief) the job
ended but part of its planned data was not trained (account.py; one line
saying what, and 0 with --allow-partial); 130 interrupted (Ctrl-C). SIGINT and
SIGTERM in the chief's training loop save a last checkpoint first (a second
Ctrl-C stops at once); a restarted task skips the batches ps 0 counted for
its name and trains the rest.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import pathlib
import signal
import sys
import time

import torch

from ..cli import INTERRUPTED, PARTIAL_JOB
from ..client import AllreduceGroup, Compression, HostBinding, PSClient, PSError
from ..cluster import Cluster, TaskSpec
from ..errors import ClusterConfigError
from ..forkserver import run_main
from ..memory import tune_malloc
from ..partitioning import partitioner_from_spec
from ..metrics_http import serve_metrics
from .datasets import DatasetNotFoundError, default_dataset_name
from .flags import check_output, check_specs, finish_training_flags, parse_args, resolve_security, resolve_task
from .host import HostProcesses, die_with_parent, local_device, run_local_rank
from .account import account_job, batches_pushed
from .models import build_model, load_entry, load_init, read_init
from .chief import FINAL_WAIT_SECONDS, Checkpointer, StragglerWatch, finish_job, fixed_tables, repair_resize
from .dynamic import open_queue, queue_summary, train_dynamic
from .observe import EvaluatorMetrics, StepObserver, Timeline, WorkerMetrics, parse_step_range
from .residuals import ResidualFile
from .trainer import TrainOptions, evaluate, evaluate_once, optimizer_from_flags, run_evaluator, train

_LOGGER = logging.getLogger("torchps.worker")
EVALUATOR_CONNECT_SECONDS = 10.0


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ClusterConfigError(f"--device {name}: CUDA is not available on this host; use --device cpu")
    return name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.local_rank:
        die_with_parent()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    tune_malloc()
    task = None
    try:
        finish_training_flags(args)
        check_output("--metrics-out", args.metrics_out)
        cluster, task = resolve_task(args)
        security = resolve_security(args)
        check_specs(args)
        args.device = resolve_device(args.device)  # 'auto' decided once: the host's processes agree on it
        device = local_device(args.device, args.local_rank)
        partitioner = partitioner_from_spec(args.partition)
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
                      connect_timeout=min(EVALUATOR_CONNECT_SECONDS, args.connect_timeout)
                      if task.type == "evaluator" else args.connect_timeout) as client:
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
        summary = _finite(summary)
        print("summary " + json.dumps(summary, sort_keys=True, allow_nan=False), flush=True)
        if args.metrics_out:
            args.metrics_out.write_text(json.dumps(summary, indent=2, sort_keys=True, allow_nan=False) + "\n")
        if summary.get("partial") and not args.allow_partial:
            print(f"ps-worker: {task}: part of the job's planned data was not trained: {summary['data_account']} "
                  f"(exit code {PARTIAL_JOB}; --allow-partial accepts a partial job)", file=sys.stderr, flush=True)
            return PARTIAL_JOB
    return 0


def _finite(summary: dict) -> dict:
    """The summary with every NaN or infinite number (a loss or accuracy never measured: no step trained, no
    evaluation made) as None, which JSON writes as null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}


def run_task(client: PSClient, cluster: Cluster, task: TaskSpec, job, args, device: str) -> dict | None:
    """Runs this task's role; returns the summary (chief, evaluator) or None (other workers)."""
    started = time.monotonic()
    writer = _tensorboard(args.logdir, task)
    try:
        if task.type == "evaluator":
            metrics = _serve_metrics(EvaluatorMetrics(), cluster, task, args.metrics_port) \
                if args.metrics_port is not None else None
            return _evaluate(client, cluster, task, job, args, device, writer, started, metrics)
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
        replica = task.index + (len(cluster.chief) if task.type == "worker" else 0)
        timeline = Timeline(args.trace_out / f"{task.type}-{task.index}.trace.json", str(task), first, last,
                            pid=1 + replica)
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
                         progress_seconds=args.progress_timeout, replicas_fraction=args.replicas_fraction)
        repair_resize(client)  # a resize its driver (this chief's earlier incarnation?) left cut off
        if args.scale_lr:  # the chief's to set (UpdateOptimizer is an admin call), before its next push
            client.on_live_workers_change(lambda live, _: _scale_lr(client, args.lr, cluster.training_names()))
    compression = Compression.parse(args.compression) if args.compression else None
    if group is not None:
        binding = client.register_module(job.model, optimizer, create=client.is_chief, dense="allreduce",
                                         process_group=group)
    else:
        binding = client.register_module(job.model, optimizer, create=client.is_chief, compression=compression,
                                         overlap=args.overlap, delta_pulls=args.delta_pulls)
    ps_binding = binding  # the shards' side (finish_job pulls the final values through it)
    if host is not None:
        binding = HostBinding(binding, host.group)
    start_step = binding.step  # a restarted task joins a job already under way
    ps0_generation = client.generations.get(0)  # the end-of-job account judges ps 0's counts if it kept them
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
        _raise_noted()
        if residuals is not None:
            residuals.stepped(client)
        if checkpointer is not None:
            checkpointer.note_step(record["global_step"])
        if writer is not None:
            for key in ("loss", "accuracy", "staleness"):
                writer.add_scalar(f"train/{key}", record[key], record["global_step"])
            writer.add_scalar("train/steps_per_second", client.stats.steps_per_second, record["global_step"])

    # Only a restarted task skips: a task joining late for the first time has trained nothing yet. With
    # --dynamic-sharding nothing is skipped: the queue on ps 0 knows what was trained.
    queue = open_queue(client, job, args.dynamic_sharding, args.epochs, args.seed) if args.dynamic_sharding else None
    done_before = batches_pushed(client) if client.restarted and queue is None else 0
    if client.restarted and queue is None and not done_before:
        _LOGGER.info("%s restarted: ps 0 counts no batch pushed by its earlier processes; it trains its whole part",
                     task)
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
    gc.freeze()  # the modules, model and dataset live as long as the task: out of the collector's full passes
    try:
        if queue is not None:
            result = train_dynamic(client, job, binding, queue, options=options, on_step=on_step, observer=observer)
        else:
            result = train(client, job, binding, replica=replica, num_replicas=replicas, options=options,
                           on_step=on_step, observer=observer)
    except (Terminated, KeyboardInterrupt) as stop:
        interrupted = isinstance(stop, KeyboardInterrupt)
        if interrupted:
            _stop_at_next_interrupt(task)
        _LOGGER.warning("%s: %s; %s", task, "SIGINT" if interrupted else "SIGTERM",
                        ("saving a last checkpoint" + (" (Ctrl-C again stops at once)" if interrupted else ""))
                        if checkpointer else "stopping")
        if checkpointer is not None:
            checkpointer.stop(final=True)
        if interrupted:
            raise
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
        return _finish_allreduce(client, task, job, args, device, binding, result, started, start_step, replicas)
    # With static slices, a spec worker that has not joined yet still has its slice to train, unless the job
    # has nothing left to train (its --steps reached, or the chief itself, resuming it, trained nothing);
    # with dynamic sharding the queue hands every data shard out once, and a latecomer has nothing left to do.
    training_left = result["local_steps"] > 0 and (args.steps is None or client.global_step() < args.steps)
    global_step = finish_job(client, ps_binding, export=args.export, checkpointer=checkpointer,
                             expected=cluster.training_names() if queue is None and training_left else (),
                             join_wait=args.connect_timeout)
    # What ps 0 counted, read once the other workers left and before the shards stop.
    if queue is not None:
        result = {**result, **queue_summary(queue)}
    account = account_job(client, cluster, examples=len(job.dataset.y_train), batch_size=args.batch_size,
                          epochs=args.epochs, steps=args.steps, nproc=args.nproc_per_host, global_step=global_step,
                          generation=ps0_generation, queue=result if queue is not None else None)
    shards = len(client.shard_addresses())  # the job's shards now: a live resize may have changed them
    if not args.keep_ps:
        client.shutdown_cluster("the chief finished the job")
    accuracy = evaluate(job.model, job.dataset.x_test, job.dataset.y_test, device)
    wall = time.monotonic() - started
    return {**result, **account.summary(), "role": str(task), "mode": args.mode, "dense": args.dense,
            "dataset": job.dataset.name, "test_accuracy": accuracy,
            "global_step": global_step, "start_step": start_step, "wall_seconds": wall,
            "steps_per_second": (global_step - start_step) / wall, "workers": replicas, "ps": shards,
            "nproc_per_host": args.nproc_per_host,
            "checkpoints": checkpointer.saved_steps if checkpointer else []}


def _scale_lr(client: PSClient, lr: float, names: list[str]) -> None:
    """--scale-lr: lr x counted / the spec's training tasks `names`, counted = the live workers and the spec's
    tasks that have not joined yet (they are coming: a job starts at lr); one that left or died is not
    counted. One status call to ps 0; logged."""
    status = client.status(0, joined_of=names)
    coming = len(status.not_joined)
    counted = max(1, status.live_workers + coming)
    scaled = lr * counted / len(names)
    client.set_hyperparams(lr=scaled)
    _LOGGER.info("%d live workers%s: learning rate %g (--scale-lr: %g x %d / %d)", status.live_workers,
                 f" and {coming} yet to join" if coming else "", scaled, lr, counted, len(names))


def _lockstep_steps(args, examples: int, replicas: int) -> int:
    """--dense allreduce: the steps every worker takes, the same for all (each step is a collective every
    member must make): --steps, or --epochs over the smallest worker's shard (the last worker's: shards are
    every replicas-th example), whichever comes first."""
    smallest = len(range(replicas - 1, examples, replicas))
    by_epochs = args.epochs * -(-smallest // args.batch_size) if args.epochs else None
    return min(n for n in (args.steps, by_epochs) if n is not None)


def _finish_allreduce(client: PSClient, task: TaskSpec, job, args, device: str, binding, result: dict,
                      started: float, start_step: int, replicas: int) -> dict:
    """The chief's end of a --dense allreduce job: waits for the other workers to leave (their last row
    pushes are in), evaluates while the shards still serve the tables, exports the dense state_dict and the
    fixed-size tables whole, stops the shards; returns the summary. `global_step` counts the group's
    synchronous steps, `table_pushes` the shards' step (every worker's row pushes)."""
    table_pushes = finish_job(client, binding, export=None, checkpointer=None)
    accuracy = evaluate(job.model, job.dataset.x_test, job.dataset.y_test, device)
    if args.export is not None:
        state = {name: value.detach().cpu() for name, value in job.model.state_dict().items()}
        state.update(client.export_state_dict(fixed_tables(binding)) if fixed_tables(binding) else {})
        torch.save(state, args.export)
        _LOGGER.info("exported %d tensors to %s (dense, and fixed-size tables whole)", len(state), args.export)
    shards = len(client.shard_addresses())
    if not args.keep_ps:
        client.shutdown_cluster("the chief finished the job")
    wall = time.monotonic() - started
    return {**result, "role": str(task), "mode": args.mode, "dense": args.dense, "dataset": job.dataset.name,
            "test_accuracy": accuracy, "global_step": binding.step, "table_pushes": table_pushes,
            "start_step": start_step, "wall_seconds": wall, "steps_per_second": (binding.step - start_step) / wall,
            "workers": replicas, "ps": shards, "checkpoints": []}


def _evaluate(client: PSClient, cluster: Cluster, task: TaskSpec, job, args, device: str, writer, started: float,
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
                      timeout=24 * 3600, on_eval=on_eval, members=cluster.training_names())
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


_SIGNALLED: list[type[BaseException]] = []  # stops a signal raised: raised again at the next step if swallowed


def _terminate_once() -> None:
    """SIGTERM raises Terminated once; a second one while the first is handled is ignored. SIGINT raises
    KeyboardInterrupt. Each is also noted, and raised again at the next step (_raise_noted) where a blocking
    gRPC call it interrupted swallowed it."""
    def handler(*_) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _SIGNALLED.append(Terminated)
        raise Terminated()

    def interrupt(*_) -> None:
        _SIGNALLED.append(KeyboardInterrupt)
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, interrupt)


def _raise_noted() -> None:
    """Raises the stop a signal raised, if it has not ended training already (see _terminate_once)."""
    if _SIGNALLED:
        raise _SIGNALLED.pop()()


def _stop_at_next_interrupt(task: TaskSpec) -> None:
    """From now on a Ctrl-C (SIGINT) ends the process at once, with INTERRUPTED and one line: the first one is
    being handled (a last checkpoint), a second means the user will not wait for it."""
    def handler(*_) -> None:
        print(f"ps-worker: {task}: interrupted again: stopping now", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)

    signal.signal(signal.SIGINT, handler)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _tensorboard(logdir: str | None, task: TaskSpec):
    if not logdir:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(pathlib.Path(logdir) / f"{task.type}{task.index}"))


if __name__ == "__main__":  # as the console script: ends at once with main's code
    run_main(main, sys.argv[1:], "ps-worker")
