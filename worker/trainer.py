"""The training loop of one worker and the evaluation loop of the evaluator."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import sys
import time
from typing import Callable, Sequence

import torch

from ..client import ModuleBinding, Optimizer, PSClient, ServerUnavailableError
from ..proto import ps_pb2
from .data import batches
from .host import host_shard
from .models import Task
from .observe import StepObserver

__all__ = ["TrainOptions", "train", "evaluate", "evaluate_once", "run_evaluator", "optimizer_from_flags"]

_LOGGER = logging.getLogger(__name__)
STATUS_POLL_SECONDS = 0.5  # the evaluator's status calls between evaluations: one small unary call each


@dataclasses.dataclass
class TrainOptions:
    """How a worker trains (ps-worker's flags)."""

    epochs: int | None = 1           # passes over this worker's shard; None: until `steps`
    steps: int | None = None         # stop once the global step reaches this (sync: exactly; async, ssp:
                                     # the other workers' pushes under way still land, W - 1 at most)
    batch_size: int = 100
    seed: int = 0
    device: str = "cpu"
    log_every: float = 5.0           # seconds between log lines (no terminal)
    progress: bool | None = None     # tqdm bar; None: when stderr is a terminal
    skip_batches: int = 0            # batches this task's earlier processes pushed (ps 0's count): not redone
    max_local_steps: int | None = None  # stop after this many steps of this worker (--dense allreduce: every
                                        # worker the same number, as each step is a collective all must make)
    local_shard: tuple[int, int] = (0, 1)  # (local rank, processes) of a --nproc-per-host host: this process
                                           # trains every processes-th example of the task's shard


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: str, batch: int = 2000) -> float:
    """Accuracy of `model` on (x, y)."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(y), batch):
            logits = model(x[start:start + batch].to(device))
            correct += int((logits.argmax(1).cpu() == y[start:start + batch]).sum())
    model.train()
    return correct / max(1, len(y))


def step_once(client: PSClient, task: Task, binding: ModuleBinding, xb: torch.Tensor, yb: torch.Tensor, *,
              device: str, epoch: int, local_steps: int, observer: StepObserver | None,
              pushing: contextlib.AbstractContextManager | None = None) -> dict:
    """One step on the batch (xb, yb): to `device`, forward, backward, then binding.exchange() (push, pull),
    the compute and the exchange inside `pushing` (dynamic sharding's DataQueue.pushing) if given; the step's
    phase times go to `observer`. Blocks for the exchange; raises what it raises. Returns the step's record:
    loss, accuracy, global step, epoch, staleness and `local_steps` counting this step."""
    step_started = time.monotonic()
    if observer is not None:
        observer.begin(local_steps + 1)
    model = task.model
    xb, yb = xb.to(device), yb.to(device)
    with pushing if pushing is not None else contextlib.nullcontext():
        model.zero_grad(set_to_none=True)
        logits = model(xb)
        loss = task.loss(logits, yb)
        loss.backward()
        loss, logits = loss.detach(), logits.detach()
        computed_at, computed = binding.step, time.monotonic()
        waited, stale = client.stats.wait_seconds, client.stats.stale_dropped
        binding.exchange()
    exchanged = time.monotonic()
    record = {"loss": loss.item(), "accuracy": float((logits.argmax(1) == yb).float().mean()),
              "global_step": binding.step, "epoch": epoch,
              "staleness": max(0, binding.step - computed_at - 1), "local_steps": local_steps + 1}
    if observer is not None:
        observer.step(started=step_started, computed=computed, ended=exchanged,
                      wait_seconds=client.stats.wait_seconds - waited,
                      stale=client.stats.stale_dropped - stale, record=record)
    return record


def train(client: PSClient, task: Task, binding: ModuleBinding, *, replica: int, num_replicas: int,
          options: TrainOptions, on_step: Callable[[dict], None] | None = None,
          observer: StepObserver | None = None) -> dict:
    """Runs this worker's loop (compute, push, pull) until its epochs or the global steps are done.

    Trains on shard `replica` of `num_replicas` of the training set. Blocks.
    With a HybridBinding (--dense allreduce), `binding.step` counts the
    group's synchronous steps, and each exchange waits for every worker's
    all-reduce (AllreduceError, a PSError, if one is lost).
    Returns this worker's numbers; `on_step(record)` sees every step's loss,
    accuracy, global step and staleness (for TensorBoard); `observer` each
    step's phase times (metrics, timeline: observe.py).
    """
    data, device = task.dataset, options.device
    mine = host_shard(len(data.y_train), num_replicas, replica, *options.local_shard)
    x, y = data.x_train[mine], data.y_train[mine]
    per_epoch = -(-len(y) // options.batch_size)
    first_epoch, skip = divmod(options.skip_batches, per_epoch)
    epochs = range(first_epoch, options.epochs) if options.epochs else itertools.count(first_epoch)
    if options.skip_batches and options.epochs and first_epoch >= options.epochs:
        _LOGGER.info("%s: its earlier processes pushed all %d of its batches (ps 0's count): nothing is left for it "
                     "to train", client.worker, options.skip_batches)
    elif options.skip_batches:
        _LOGGER.info("%s goes on from epoch %d, batch %d: its earlier processes pushed its %d batches before (ps 0's "
                     "count), which are not trained again", client.worker, first_epoch, skip, options.skip_batches)
    bar = _progress_bar(options, total=per_epoch * options.epochs - options.skip_batches if options.epochs
                        else options.steps)
    started = last_log = time.monotonic()
    local_steps, loss_value = 0, float("nan")
    done = False
    for epoch in epochs:
        for batch, (xb, yb) in enumerate(batches(x, y, options.batch_size, options.seed, epoch)):
            if epoch == first_epoch and batch < skip:
                continue
            if (options.steps is not None and binding.step >= options.steps) or \
                    (options.max_local_steps is not None and local_steps >= options.max_local_steps):
                done = True
                break
            record = step_once(client, task, binding, xb, yb, device=device, epoch=epoch,
                               local_steps=local_steps, observer=observer)
            local_steps, loss_value = record["local_steps"], record["loss"]
            if on_step:
                on_step(record)
            now = time.monotonic()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}", step=binding.step)
            elif now - last_log >= options.log_every:
                last_log = now
                _LOGGER.info("%s epoch %d step %d loss %.4f | %s", client.worker, epoch, binding.step,
                             loss_value, client.stats.summary())
        if done:
            break
    binding.wait()  # with overlap, the last pull runs in the background: the module holds its values from here
    if bar is not None:
        bar.close()
    if observer is not None:
        observer.close()
    wall = time.monotonic() - started
    return {"local_steps": local_steps, "global_step": binding.step, "last_loss": loss_value,
            "wall_seconds": wall, "local_steps_per_second": local_steps / wall if wall else 0.0,
            **{f"sync_{k}": v for k, v in client.stats.as_dict().items()}}


def run_evaluator(client: PSClient, task: Task, binding: ModuleBinding, *, device: str, interval: float,
                  target_steps: int | None, timeout: float, on_eval: Callable[[int, float], None] | None = None,
                  members: Sequence[str] = ()) -> tuple[int, float]:
    """Every `interval` s: pull, evaluate on the test set, log. Never pushes.

    Stops when the global step reaches target_steps, when the workers that
    joined have all left (seen live here, or `members`, the job's training
    task names, of which shard 0 says one left and none is live: an
    evaluator started again at the end of the job sees it ended), or after
    `timeout` s. Between evaluations it asks shard 0 every
    STATUS_POLL_SECONDS whether workers are left, so the end of training is
    met at once; the status is read before the pull, so the last evaluation
    is of the final model. Shards that stop answering end it as the end of
    the job once training was seen, else raise ServerUnavailableError.
    Returns the last (step, accuracy).
    """
    deadline = time.monotonic() + timeout
    seen_workers = False
    step, accuracy = 0, float("nan")
    try:
        while True:
            step, accuracy, status = evaluate_once(client, task, binding, device, on_eval, members)
            seen_workers = seen_workers or status.live_workers > 0 or _left(status)
            finished = (target_steps is not None and step >= target_steps) or (seen_workers and not status.live_workers)
            if finished or time.monotonic() > deadline:
                return step, accuracy
            seen_workers = _until_next_evaluation(client, min(deadline, time.monotonic() + interval), seen_workers,
                                                  members)
    except ServerUnavailableError:
        if not seen_workers:
            raise
        _LOGGER.info("evaluator: the shards are gone; the job has ended")
        return step, accuracy


def _left(status: ps_pb2.StatusResponse) -> bool:
    """Whether the status (with `joined_of`) names a training task that left the job (called Leave)."""
    return any(member.state == "left" for member in status.members)


def _until_next_evaluation(client: PSClient, due: float, seen_workers: bool, members: Sequence[str]) -> bool:
    """Waits until `due` (monotonic) or, once workers have been seen, until none is left; returns whether
    workers have been seen."""
    while (now := time.monotonic()) < due:
        status = client.status(0, joined_of=members)
        if status.live_workers or _left(status):
            seen_workers = True
        if seen_workers and not status.live_workers:
            break
        time.sleep(min(STATUS_POLL_SECONDS, due - now))
    return seen_workers


def evaluate_once(client: PSClient, task: Task, binding: ModuleBinding, device: str,
                  on_eval: Callable[[int, float], None] | None = None, members: Sequence[str] = ()
                  ) -> tuple[int, float, ps_pb2.StatusResponse]:
    """(global step, test accuracy, shard 0's status with `joined_of` = `members`): the status first, then the
    values, then the evaluation; `on_eval(step, accuracy)` runs before the log line, which is the evaluation's
    last act."""
    status = client.status(0, joined_of=members)
    binding.pull()
    accuracy = evaluate(task.model, task.dataset.x_test, task.dataset.y_test, device)
    if on_eval:
        on_eval(status.step, accuracy)
    _LOGGER.info("evaluator: global step %d test accuracy %.4f", status.step, accuracy)
    return status.step, accuracy, status


def _progress_bar(options: TrainOptions, total: int | None):
    show = sys.stderr.isatty() if options.progress is None else options.progress
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True)


def optimizer_from_flags(name: str, lr: float, momentum: float, weight_decay: float) -> Optimizer:
    """The server-side Optimizer for ps-worker's --optimizer/--lr/--momentum/--weight-decay."""
    kwargs: dict = {"lr": lr, "weight_decay": weight_decay}
    if name == "sgd":
        kwargs["momentum"] = momentum
    return Optimizer(name, **kwargs)
