"""The chief's account, at the end of a job, of the data it planned and what was trained of it.

The plan: with --epochs (static sharding), each training task of the cluster
spec pushes --epochs passes over its slice of the training set, one push per
batch (per host step with --nproc-per-host); with --steps, the global step.
What was trained: the pushes ps 0 counted for each task's name, every process
of it (restarts included), and how it stands (GetStatus's members). A task
that pushed fewer batches than planned (it died and did not come back, was
stopped, or never joined) makes the job partial, unless --steps was reached;
with --dynamic-sharding the queue's count of examples trained decides. The
chief logs the account in one line, puts it in its summary, and ps-worker
exits PARTIAL_JOB (3) for a partial job unless --allow-partial.

A restarted task asks the same count (`batches_pushed`): it skips exactly the
batches its earlier processes pushed.
"""

from __future__ import annotations

import dataclasses
import logging

from ..client import PSClient
from ..cluster import Cluster, TaskSpec
from ..proto import ps_pb2
from .host import host_shard

__all__ = ["JobAccount", "TaskAccount", "account_job", "batches_pushed", "planned_batches"]

_LOGGER = logging.getLogger(__name__)


def planned_batches(examples: int, replicas: int, replica: int, batch_size: int, epochs: int, nproc: int) -> int:
    """The pushes replica `replica` of `replicas` makes in `epochs` passes over its slice (its host's local rank
    0's, whose steps the host's push counts with --nproc-per-host)."""
    return epochs * -(-len(host_shard(examples, replicas, replica, 0, nproc)) // batch_size)


def batches_pushed(client: PSClient) -> int:
    """The pushes ps 0 counted for this client's task name so far, every process of it (one call)."""
    status = client.status(0, joined_of=[client.worker])
    return next((m.pushes for m in status.members if m.worker == client.worker), 0)


@dataclasses.dataclass(frozen=True)
class TaskAccount:
    """One training task: its plan (None: no plan of its own, --steps alone) and what ps 0 counted."""

    name: str
    planned: int | None
    pushed: int
    state: str            # "live", "left", "lost" (MemberStatus.state) or "never joined"
    last_push_step: int   # -1: none
    restarts: int

    @property
    def short(self) -> bool:
        return self.planned is not None and self.pushed < self.planned

    def why(self) -> str:
        """What became of the task (one short of its plan, or gone)."""
        if self.state == "never joined":
            return f"{self.name} never joined" + (f": its {self.planned} batches were not trained"
                                                  if self.planned is not None else "")
        restarts = f" (restarted {self.restarts} time{'s' if self.restarts > 1 else ''})" if self.restarts else ""
        of = f" of its {self.planned}" if self.planned is not None else ""
        pushed = f"{self.name}{restarts} pushed {self.pushed}{of} batches"
        if self.last_push_step >= 0:
            pushed += f", the last at step {self.last_push_step}"
        return pushed + {"lost": "; then its lease ran out and it did not come back",
                         "left": ", and left the job (it was stopped, or failed)",
                         "live": ", and is still live (it did not finish in time)"}.get(self.state, "")


@dataclasses.dataclass(frozen=True)
class JobAccount:
    """The job's account: `line` says it, `partial` whether part of the plan was not trained."""

    line: str
    partial: bool
    planned: int | None   # units planned; None: no data plan (--steps alone)
    trained: int
    unit: str = "batches"  # "examples" with --dynamic-sharding

    def summary(self) -> dict:
        """The chief's summary fields: partial, data_account, and UNIT_planned, UNIT_trained."""
        return {"partial": self.partial, "data_account": self.line, f"{self.unit}_planned": self.planned,
                f"{self.unit}_trained": self.trained}


def account_job(client: PSClient, cluster: Cluster, *, examples: int, batch_size: int, epochs: int | None,
                steps: int | None, nproc: int, global_step: int, generation: int | None,
                queue: dict | None = None) -> JobAccount:
    """The account of a job whose training ended (one GetStatus on ps 0, before the shards stop); logs it
    (INFO when whole, WARNING when partial). `generation`: ps 0's when the chief joined; should ps 0 have
    restarted since without --checkpoint-dir, its counts started over and the job is not judged by them.
    `queue`: the --dynamic-sharding queue's summary fields."""
    steps_reached = steps is not None and global_step >= steps
    if queue is not None:
        account = _queue_account(queue, epochs, steps_reached)
    else:
        tasks = [TaskSpec("chief", i) for i in range(len(cluster.chief))] + \
                [TaskSpec("worker", i) for i in range(len(cluster.worker))]
        status = client.status(0, joined_of=[str(t) for t in tasks])
        accounts = _tasks(status, tasks, examples, batch_size, epochs, nproc)
        if generation is not None and status.generation != generation and not status.checkpoints:
            account = JobAccount(f"ps 0 restarted without --checkpoint-dir during the job: its counts of the "
                                 f"pushes started over ({sum(t.pushed for t in accounts)} since), so the data "
                                 f"trained is not judged", False, None, sum(t.pushed for t in accounts))
        else:
            account = _task_account(accounts, steps, steps_reached, global_step)
    _LOGGER.log(logging.WARNING if account.partial else logging.INFO, "%s", account.line)
    return account


def _tasks(status: ps_pb2.StatusResponse, tasks: list[TaskSpec], examples: int, batch_size: int,
           epochs: int | None, nproc: int) -> list[TaskAccount]:
    """Each training task's plan and ps 0's count of it (`status`, GetStatus asked for the tasks' names)."""
    replicas = len(tasks)
    members = {m.worker: m for m in status.members}
    out = []
    for replica, task in enumerate(tasks):
        member = members.get(str(task))
        planned = planned_batches(examples, replicas, replica, batch_size, epochs, nproc) if epochs else None
        out.append(TaskAccount(str(task), planned, member.pushes if member else 0,
                               member.state if member else "never joined",
                               member.last_push_step if member else -1, member.restarts if member else 0))
    return out


def _task_account(tasks: list[TaskAccount], steps: int | None, steps_reached: bool, global_step: int
                  ) -> JobAccount:
    """Static sharding: partial if a task pushed fewer batches than planned and --steps (if given) was not
    reached; with --steps alone the global step is the plan, and the tasks that were lost are named."""
    trained = sum(t.pushed for t in tasks)
    short = [t for t in tasks if t.short]
    lost = "; ".join(t.why() for t in tasks if t.state in ("lost", "never joined"))
    if tasks and tasks[0].planned is None:  # --steps alone: the global step is the plan
        return JobAccount(f"trained {global_step} of {steps} planned global steps ({trained} batches pushed)"
                          + (f"; {lost}" if lost else ""), False, None, trained)
    planned = sum(t.planned for t in tasks)
    if short and not steps_reached:
        return JobAccount(f"trained {trained} of {planned} planned batches: {'; '.join(t.why() for t in short)}",
                          True, planned, trained)
    if short:  # --steps came first: the plan is met
        return JobAccount(f"trained {global_step} of {steps} planned global steps ({trained} of {planned} planned "
                          f"batches)" + (f"; {lost}" if lost else ""), False, planned, trained)
    return JobAccount(f"trained every planned batch: {trained} of {planned} "
                      f"({', '.join(f'{t.name} {t.pushed}' for t in tasks)})", False, planned, trained)


def _queue_account(queue: dict, epochs: int | None, steps_reached: bool) -> JobAccount:
    """--dynamic-sharding: the examples ps 0's data queue counted trained against --epochs passes."""
    examples = queue["data_examples_per_epoch"]
    trained = sum(queue["data_trained"])
    if not epochs:
        return JobAccount(f"trained {trained} examples from the data queue", False, None, trained, "examples")
    planned = epochs * examples
    partial = queue["data_epochs_done"] < epochs and not steps_reached
    line = (f"trained {trained} of {planned} planned examples from the data queue ({queue['data_epochs_done']} "
            f"of {epochs} epochs done)")
    return JobAccount(line, partial, planned, trained, "examples")
