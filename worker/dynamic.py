"""ps-worker --dynamic-sharding: train from the data queue on ps 0 instead of a fixed slice of the data.

The chief creates the queue (one epoch = every training example, shards of
--dynamic-sharding examples, --epochs epochs, the order drawn from --seed);
the other workers wait for it as they wait for the variables. Each worker
takes a shard, trains it batch by batch (each push carries the positions it
trained: client/dataqueue.py), and takes the next, until the queue says every
epoch is done (or --steps is reached). The chief reports what ps 0 counted.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..client import DataQueue, ModuleBinding, PSClient
from .models import Task
from .observe import StepObserver
from .trainer import TrainOptions, step_once

__all__ = ["QUEUE_NAME", "open_queue", "train_dynamic", "queue_summary"]

_LOGGER = logging.getLogger(__name__)
QUEUE_NAME = "train"
QUEUE_WAIT_SECONDS = 3600.0  # the longest a worker waits for a shard: a dead holder's lease runs out long before


def open_queue(client: PSClient, task: Task, shard_size: int, epochs: int | None, seed: int,
               wait_timeout: float = 600.0) -> DataQueue:
    """The job's queue: created by the chief (idempotent: a restarted chief goes on mid-epoch), waited for by
    the others."""
    queue = DataQueue(client, QUEUE_NAME)
    examples = len(task.dataset.y_train)
    if client.is_chief:
        created = queue.create(examples, shard_size, epochs=epochs or 0, seed=seed)
        _LOGGER.info("%s: data queue %r %s: %d examples an epoch in shards of %d, %s", client.worker, QUEUE_NAME,
                     "created" if created else "found as it stands", examples, shard_size,
                     f"{epochs} epochs" if epochs else "until --steps")
    else:
        status = queue.wait_created(wait_timeout)
        if status.spec.num_examples != examples:
            _LOGGER.warning("%s: the data queue counts %d examples an epoch, this worker's dataset has %d",
                            client.worker, status.spec.num_examples, examples)
    return queue


def train_dynamic(client: PSClient, task: Task, binding: ModuleBinding, queue: DataQueue, *, options: TrainOptions,
                  on_step: Callable[[dict], None] | None = None, observer: StepObserver | None = None) -> dict:
    """Takes shards from `queue` and trains them (forward, backward, exchange per batch) until every epoch is
    done or the global step reaches options.steps. Blocks. Returns this worker's numbers, as trainer.train."""
    data = task.dataset
    x, y = data.x_train, data.y_train
    started = last_log = time.monotonic()
    local_steps, loss_value = 0, float("nan")
    done = False
    for shard in queue.shards(QUEUE_WAIT_SECONDS):
        order = queue.order(shard.epoch)
        for begin, end in shard.batches(options.batch_size):
            if options.steps is not None and binding.step >= options.steps:
                done = True
                break
            take = order[begin:end]
            record = step_once(client, task, binding, x[take], y[take], device=options.device, epoch=shard.epoch,
                               local_steps=local_steps, observer=observer,
                               pushing=queue.pushing(shard, begin, end))
            local_steps, loss_value = record["local_steps"], record["loss"]
            if on_step:
                on_step(record)
            now = time.monotonic()
            if now - last_log >= options.log_every:
                last_log = now
                _LOGGER.info("%s epoch %d step %d loss %.4f | data shard %d [%d, %d) at %d | %s", client.worker,
                             shard.epoch, binding.step, loss_value, shard.lease, shard.begin, shard.end,
                             shard.progress, client.stats.summary())
        if done:
            break
    binding.wait()
    if observer is not None:
        observer.close()
    wall = time.monotonic() - started
    _LOGGER.info("%s trained %d data shards (%d examples) from queue %r", client.worker, queue.shards_taken,
                 queue.examples_pushed, queue.name)
    return {"local_steps": local_steps, "global_step": binding.step, "last_loss": loss_value,
            "wall_seconds": wall, "local_steps_per_second": local_steps / wall if wall else 0.0,
            "data_shards_taken": queue.shards_taken, "data_examples_pushed": queue.examples_pushed,
            **{f"sync_{k}": v for k, v in client.stats.as_dict().items()}}


def queue_summary(queue: DataQueue) -> dict:
    """What ps 0 counted (the chief's summary; read before the shards stop), and a log line of it."""
    status = queue.status()
    trained = list(status.trained)
    examples = status.spec.num_examples
    _LOGGER.info("data queue %r: %s; %d shards trained, %d given back by workers gone (%d examples handed out "
                 "again), %d retried pushes counted once", queue.name,
                 ", ".join(f"epoch {e} trained {n} of {examples} examples" for e, n in enumerate(trained)) or
                 "nothing trained", status.shards_done, status.reclaimed, status.requeued_examples, status.duplicates)
    return {"data_examples_per_epoch": examples, "data_trained": trained, "data_epochs_done": status.epochs_done,
            "data_shards_done": status.shards_done, "data_reclaimed": status.reclaimed,
            "data_requeued_examples": status.requeued_examples, "data_duplicates": status.duplicates}
