"""`ps-worker --nproc-per-host K`: one task trained by K processes on its host, one push per host step.

The process started as ps-worker is local rank 0: it picks a free loopback
port, starts local ranks 1..K-1 (its own command with --local-rank I
--host-port P; each dies with it), forms the host's group with them
(AllreduceGroup.connect_local), and trains as the task's worker through a
HostBinding (client/host.py), the only process of the host the shards see.
The others (run_local_rank) train their part of every host batch and follow
its steps. Each process takes every K-th example of the task's shard of the
training set and --batch-size of them per step, so the host's step is K x
--batch-size examples (in sync mode the host counts as one replica).

Devices: --device cuda gives local rank I cuda:(I mod the GPUs); the group
reduces with NCCL when every process has a GPU of its own, else with gloo
(on the CPU, or processes sharing a GPU).

A process that dies fails the collective under way on the others: local
rank 0 exits 1 with one line naming it and kills the rest, which die with
it in any case; ps-launch --restart-on-failure (or Kubernetes) restarts the
task, whose new processes rejoin the job as any restarted worker does.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import torch

from ..client import AllreduceError, AllreduceGroup, LocalRank, LocalReplica
from ..cluster import Cluster, TaskSpec
from ..errors import ClusterConfigError
from .data import batches, shard_indices

__all__ = ["HostProcesses", "local_backend", "local_device", "run_local_rank"]

_LOGGER = logging.getLogger(__name__)
END_WAIT_SECONDS = 60.0    # after the host's last step, the longest local rank 0 waits for the others to exit
_PR_SET_PDEATHSIG = 1
PARENT_ENV = "TORCHPS_LOCAL_RANK0_PID"  # local rank 0's pid, for the others' parent-death check


def local_device(device: str, local_rank: int) -> str:
    """Local rank `local_rank`'s device: for 'cuda', the GPU local_rank mod the GPUs; any other as it is."""
    if device == "cuda":
        return f"cuda:{local_rank % torch.cuda.device_count()}"
    return device


def local_backend(device: str, nproc: int) -> str:
    """The host group's backend: NCCL (gloo for CPU tensors) when 'cuda' gives each process a GPU of its own,
    else gloo (it also moves CUDA tensors, so processes sharing a GPU use it)."""
    if device == "cuda" and nproc <= torch.cuda.device_count():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """In a local rank other than 0, first thing: SIGKILL when local rank 0 dies (Linux's parent-death signal);
    if it died already (before the signal was set), this process dies now. Set by the child itself, not in a
    preexec_fn: code between fork and exec in local rank 0, which has gRPC's and torch's threads, is unsafe."""
    parent = os.environ.get(PARENT_ENV)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        return  # not Linux: local rank 0 stops them itself
    if parent is not None and str(os.getppid()) != parent:
        os.kill(os.getpid(), signal.SIGKILL)


class HostProcesses:
    """Local rank 0's side: starts the other local ranks, forms the host's group, and stops them.

        with HostProcesses(argv, nproc, task, device="cuda", timeout=300) as host:
            binding = HostBinding(ps.register_module(model, opt), host.group); ...; binding.close(); host.done()

    Entering blocks until the group formed (at most `timeout`; AllreduceError if a local rank exits first or
    never arrives: the others are killed). Leaving after done() waits for the others to exit (they do after
    HostBinding.close()) and raises AllreduceError naming one that exited non-zero; leaving otherwise (an
    error, SIGTERM) kills them: they hold no state of their own and cannot go on without local rank 0. Never
    leaves one running.
    """

    def __init__(self, argv: list[str], nproc: int, task: TaskSpec, *, device: str, timeout: float):
        self.argv, self.nproc, self.task = list(argv), nproc, task
        self.device, self.timeout = device, timeout
        self.procs: dict[int, subprocess.Popen] = {}
        self.group: AllreduceGroup | None = None
        self._done = False

    def __enter__(self) -> "HostProcesses":
        port = _free_port()
        try:
            for rank in range(1, self.nproc):
                self.procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "torchps.worker", *self.argv, "--local-rank", str(rank),
                     "--host-port", str(port)], env={**os.environ, PARENT_ENV: str(os.getpid())})
                _LOGGER.info("%s: started (pid %d)", LocalRank(self.task, rank), self.procs[rank].pid)
            self.group = AllreduceGroup.connect_local(self.task, 0, self.nproc, port, timeout=self.timeout,
                                                      device=local_device(self.device, 0),
                                                      backend=local_backend(self.device, self.nproc),
                                                      abort_if=self._exited)
        except BaseException:
            self._kill()
            raise
        return self

    def done(self) -> None:
        """The host's training ended well (HostBinding.close() was called): leaving waits for the others."""
        self._done = True

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._done and exc_type is None:
                self._wait_all()
            else:
                self._kill()
        finally:
            if self.group is not None:
                self.group.close()

    def _exited(self) -> str | None:
        """Why the group cannot form: a local rank that exited already, or None."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return f"{LocalRank(self.task, rank)} exited with code {proc.returncode} before it formed"
        return None

    def _wait_all(self) -> None:
        deadline = time.monotonic() + END_WAIT_SECONDS
        failed = []
        for rank, proc in self.procs.items():
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            if code != 0:
                failed.append(f"{LocalRank(self.task, rank)} exited with code {code}")
        if failed:
            raise AllreduceError(f"the host's training ended but {', '.join(failed)}")

    def _kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()


def run_local_rank(job, args, cluster: Cluster, task: TaskSpec, device: str) -> int:
    """A host's process other than local rank 0 (--local-rank I): joins the host's group, receives the values,
    then trains its part of each host batch until local rank 0 ends the training. Returns the exit code: 0,
    or 1 with one line on stderr if the group could not form or lost a process."""
    me = LocalRank(task, args.local_rank)
    try:
        group = AllreduceGroup.connect_local(task, args.local_rank, args.nproc_per_host, args.host_port,
                                             timeout=args.allreduce_timeout, device=device,
                                             backend=local_backend(args.device, args.nproc_per_host))
    except (AllreduceError, ClusterConfigError) as exc:
        print(f"ps-worker: {me}: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 1
    with group:
        try:
            steps = _follow(job, args, cluster, task, device, LocalReplica(job.model, group))
        except AllreduceError as exc:
            print(f"ps-worker: {me}: AllreduceError: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
            return 1
    _LOGGER.info("%s finished: %d host steps", me, steps)
    return 0


def _follow(job, args, cluster: Cluster, task: TaskSpec, device: str, replica: LocalReplica) -> int:
    """This process's part of every host step, until local rank 0 ends them; returns the steps taken."""
    skip = replica.share()  # the batches an earlier incarnation of the task trained on (local rank 0's count)
    replicas = len(cluster.chief) + len(cluster.worker)
    index = task.index + (len(cluster.chief) if task.type == "worker" else 0)
    data, model = job.dataset, job.model
    mine = host_shard(len(data.y_train), replicas, index, args.local_rank, args.nproc_per_host)
    x, y = data.x_train[mine], data.y_train[mine]
    if not len(y):  # fewer examples than processes: this one adds no gradient (zeros) to the host's steps
        while replica.exchange():
            pass
        return replica.step
    first_epoch, skip = divmod(skip, -(-len(y) // args.batch_size))
    for epoch in itertools.count(first_epoch):
        for batch, (xb, yb) in enumerate(batches(x, y, args.batch_size, args.seed + index, epoch)):
            if epoch == first_epoch and batch < skip:
                continue
            model.zero_grad(set_to_none=True)
            job.loss(model(xb.to(device)), yb.to(device)).backward()
            if not replica.exchange():
                return replica.step


def host_shard(examples: int, replicas: int, replica: int, local_rank: int, nproc: int) -> torch.Tensor:
    """The examples local rank `local_rank` of `nproc` trains on: every nproc-th of its task's shard."""
    return shard_indices(examples, replicas, replica)[local_rank::nproc]
