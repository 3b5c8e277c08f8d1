"""The all-reduce group of the hybrid Persia runs (hybrid.py binds a module to it): dense parameters
all-reduced among the workers, embedding tables on the shards.

    group = AllreduceGroup.connect(cluster, task, port=29500)    # blocks until every training task is there
    binding = ps.register_module(model, Optimizer("sgd", lr=0.1), dense="allreduce", process_group=group)
    for ids, offsets, y in batches:
        model.zero_grad(); F.mse_loss(model(ids, offsets), y).backward()
        binding.exchange()     # dense gradients averaged over the group, a local optimizer step; rows to the shards
    group.close()

Dense parameters never reach the shards: every step their gradients are
summed over the group with torch.distributed (gloo on CPU, NCCL for CUDA
tensors), flattened into a few buckets (one all_reduce per bucket, not one
per parameter), divided by the group's size, and a local torch.optim
optimizer steps them, so N workers with batch b equal one process with the
combined batch N*b. Embedding and EmbeddingBag tables stay on the shards:
forward looks rows up, and the row gradients are pushed as without the
all-reduce (async: each push is applied when it arrives).

Rendezvous (explicit, from the cluster value, no environment variables): the
group's members are the cluster's training tasks, the chief (rank 0) then
the workers by index (rank = ps-worker's replica number); the others reach
the chief at its cluster host and `port` or, left out, the port of its own
cluster entry (the port TF_CONFIG gives the chief's task, which Kubeflow and
the Kubernetes manifests expose), where its torch.distributed TCPStore
listens (torch binds every interface). Forming the group and every
collective are bounded by `timeout`. Unlike the shards' gRPC, the store and
gloo are neither encrypted nor authenticated: keep the group on a trusted
network (GLOO_SOCKET_IFNAME picks gloo's interface).

The same group joins one task's processes on a host (ps-worker
--nproc-per-host; host.py binds a module to it): connect_local() forms it at
127.0.0.1 among the task's local ranks, which average their gradients in it
before local rank 0 pushes for the host, and receive its values after it
pulled.

A member lost mid-job (its process killed, its host gone, or stalled past
`timeout`) fails the collective under way on the others: gloo reports a
closed connection at once, a silent peer after `timeout`. The group cannot
go on: its membership is fixed when it forms and the dense parameters live
only in its members, so every other member stops with AllreduceError, whose
one-line message names the member lost (each member answers a small liveness
socket; the others ask it after a failure) and why the group cannot go on.
A job is restarted whole (the tables are still on the shards). That is
gloo's behaviour, tested on CPU; with NCCL (CUDA tensors) a lost peer is
noticed by NCCL's watchdog after `timeout`, which tears the process down its
own way (untested here: it needs two GPUs).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import re
import socket
import threading
import time
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from ..cluster import Cluster, TaskSpec
from ..errors import ClusterConfigError, PSError

__all__ = ["AllreduceError", "AllreduceGroup", "LocalRank", "Rendezvous"]

_LOGGER = logging.getLogger(__name__)
DEFAULT_TIMEOUT_SECONDS = 300.0  # as PSClient's timeout: the longest a member waits for the others' step
BUCKET_BYTES = 25 << 20          # DDP's bucket_cap_mb: gradients travel in flat buffers of about this size
PROBE_SECONDS = 2.0              # after a failure: how long a member's liveness socket gets to answer
PROBE_RESETS = 5                 # a reset connection (a process being killed) is asked again this often
PROBE_RESET_PAUSE = 0.1          # seconds between those asks
LINGER_SECONDS = 5.0             # a member that left still answers this long ('finished', 'failed'), so the
                                 # others can tell it from one that is gone
POLL_SECONDS = 0.05              # rendezvous: between two looks at the store (silent, unlike TCPStore's waits)
_KEY = "torchps/allreduce/member/"
_HYBRID_CONSEQUENCE = ("its members are fixed when it forms and the dense parameters live only in them, so {me} "
                       "stops (restart the job; the tables stay on the shards)")
_HOST_CONSEQUENCE = ("the host's processes train as one worker, so {me} stops and the host's worker with it "
                     "(restart it: it rejoins the job)")


class AllreduceError(PSError):
    """The all-reduce group could not form, or a collective failed (a member lost): the group cannot go on.
    The message is one line naming the members missing or lost and why."""


@dataclasses.dataclass(frozen=True)
class LocalRank:
    """One process of a task that runs several on its host (ps-worker --nproc-per-host; host.py): a member of
    the host's own group."""

    task: TaskSpec
    rank: int

    def __str__(self) -> str:
        return f"{self.task} local rank {self.rank}"


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a training task joins the all-reduce group; a pure function of the cluster (never
    blocks, opens nothing).

    members: the chief (the 'chief' task, else worker 0) first, then the
    workers by index; rank: this task's place among them. The chief listens
    at (host, port): its cluster host and `port` (default: its cluster entry's
    port). ClusterConfigError for a task that trains nothing (ps, evaluator),
    one not in the cluster, or no port (the chief's entry says 0 and no port
    was given).
    """

    host: str
    port: int
    task: TaskSpec | LocalRank
    members: tuple[TaskSpec | LocalRank, ...]

    @classmethod
    def from_cluster(cls, cluster: Cluster, task: TaskSpec, port: int | None = None) -> "Rendezvous":
        members = tuple(TaskSpec("chief", i) for i in range(len(cluster.chief))) + \
            tuple(TaskSpec("worker", i) for i in range(len(cluster.worker)))
        if task not in members:
            cluster.address(task)  # a task the cluster lacks: its own message
            raise ClusterConfigError(f"{task} trains nothing: only the chief and the workers form the all-reduce "
                                     f"group")
        host, _, own_port = cluster.address(members[0]).rpartition(":")
        if port is None:
            port = int(own_port)
            if port == 0:
                raise ClusterConfigError(f"the all-reduce group needs a port: {members[0]}'s cluster entry has port "
                                         f"0; pass one (ps-worker --allreduce-port)")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ClusterConfigError(f"the all-reduce port must be in 1-65535. Received: {port!r}")
        return cls(host.strip("[]"), port, task, members)

    @classmethod
    def local(cls, task: TaskSpec, local_rank: int, nproc: int, port: int) -> "Rendezvous":
        """The group of one task's `nproc` processes on its host: they meet at 127.0.0.1:`port`, where local
        rank 0 listens. ClusterConfigError for a rank or port out of range."""
        if not 0 <= local_rank < nproc:
            raise ClusterConfigError(f"the local rank must be in 0-{nproc - 1}. Received: {local_rank!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ClusterConfigError(f"the host's group port must be in 1-65535. Received: {port!r}")
        members = tuple(LocalRank(task, rank) for rank in range(nproc))
        return cls("127.0.0.1", port, members[local_rank], members)

    @property
    def rank(self) -> int:
        return self.members.index(self.task)

    @property
    def world_size(self) -> int:
        return len(self.members)


@dataclasses.dataclass
class _Bucket:
    """Tensors of one device and dtype flattened into one buffer; with `flags`, one presence flag per tensor
    after them (a gradient no member had stays None)."""

    tensors: list[torch.Tensor]
    buffer: torch.Tensor
    flags: bool

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors)


def _buckets(tensors: Iterable[torch.Tensor], bucket_bytes: int, flags: bool) -> list[_Bucket]:
    """Groups tensors by (device, dtype), in order, into buckets of at most `bucket_bytes` (one tensor larger
    than that is a bucket of its own)."""
    open_: dict[tuple, list[torch.Tensor]] = {}
    out: list[list[torch.Tensor]] = []
    for tensor in tensors:
        key = (tensor.device, tensor.dtype)
        current = open_.get(key)
        size = tensor.numel() * tensor.element_size()
        if current is None or sum(t.numel() for t in current) * tensor.element_size() + size > bucket_bytes:
            current = open_[key] = []
            out.append(current)
        current.append(tensor)
    return [_Bucket(group, torch.zeros(sum(t.numel() for t in group) + (len(group) if flags else 0),
                                       dtype=group[0].dtype, device=group[0].device), flags) for group in out]


class _Liveness:
    """A listening socket answering one line, '<task> <state>', to any connection: how the other members
    tell a member that is gone (refused, reset, silent) from one that is alive after a collective failed.
    Serves from a daemon thread until close(); never blocks its caller."""

    def __init__(self, host: str, task: TaskSpec):
        self.task = task
        self.state = "running"
        try:
            self._sock = socket.create_server((host, 0))
        except OSError:  # the cluster names this host by a name it cannot bind: every interface
            self._sock = socket.create_server(("", 0))
        self._sock.settimeout(0.5)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="allreduce-liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(f"{self.task} {self.state}\n".encode())
                except OSError:
                    pass

    def close(self, linger: float = 0.0) -> None:
        """Stops answering: at once, or after `linger` s (from a daemon timer: never blocks, and the process
        may exit before)."""
        if linger > 0:
            timer = threading.Timer(linger, self.close)
            timer.daemon = True
            timer.start()
            return
        self._closed.set()
        self._sock.close()
        self._thread.join(timeout=2)


def _probe(address: str, timeout: float) -> tuple[bool, str]:
    """(alive, what was found) for a member's liveness socket at `address`. A connection reset is asked again
    (a process being killed resets what its listening socket had accepted, then refuses): at most
    PROBE_RESETS times."""
    host, _, port = address.rpartition(":")
    for _attempt in range(PROBE_RESETS):
        try:
            with socket.create_connection((host, int(port)), timeout=timeout) as conn:
                conn.settimeout(timeout)
                reply = conn.recv(256).decode(errors="replace").split()
            break
        except ConnectionResetError as exc:
            reset = exc
            time.sleep(PROBE_RESET_PAUSE)
        except ConnectionRefusedError:
            return False, f"its process is gone: nothing listens at {address} any more"
        except (TimeoutError, socket.timeout):
            return False, f"it did not answer within {timeout:g} s: stalled, or its host unreachable"
        except OSError as exc:
            return False, f"it cannot be reached at {address}: {exc.strerror or exc}"
    else:
        return False, f"it cannot be reached at {address}: {reset.strerror or reset}"
    if len(reply) < 2:
        return False, f"its process is going: the connection to {address} closed without an answer"
    return True, reply[1]


def _gloo_reason(exc: BaseException) -> str:
    """The useful part of a torch.distributed error: its first line, without the source location and advice."""
    text = " ".join(str(exc).split("\n")[0].split())
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(" This is typically")[0].rstrip(". ") or type(exc).__name__


class AllreduceGroup:
    """The training tasks of a job joined by torch.distributed, for averaging dense gradients.

    Made by connect() (blocking until every member is there); the default
    torch.distributed process group of this process while open, so one per
    process. Collectives (broadcast_, average_gradients_) block until every
    member made the same call, at most `timeout` s; a member lost or stalled
    makes them raise AllreduceError naming it, and the group is then unusable
    (every later call raises at once). Not thread-safe: one training loop
    drives it. close() leaves the group (idempotent).
    """

    def __init__(self, rendezvous: Rendezvous, store: dist.Store, liveness: _Liveness, peers: dict[int, str], *,
                 backend: str, timeout: float, bucket_bytes: int, consequence: str = _HYBRID_CONSEQUENCE):
        self.rendezvous = rendezvous
        self.consequence = consequence  # why a loss stops a member, and what to do (the _diagnose line)
        self.backend = backend
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self._store = store  # kept while the group lives: rank 0's process serves it
        self._liveness = liveness
        self._peers = peers  # rank -> liveness address
        self._failed: str | None = None
        self._closed = False
        self._buckets: dict[tuple, list[_Bucket]] = {}
        self.calls = 0  # collectives issued (every bucket of every step counts one)

    @classmethod
    def connect(cls, cluster: Cluster, task: TaskSpec, *, port: int | None = None,
                timeout: float = DEFAULT_TIMEOUT_SECONDS, device: str | torch.device = "cpu",
                backend: str | None = None, bucket_bytes: int = BUCKET_BYTES) -> "AllreduceGroup":
        """Forms the group from the cluster (see Rendezvous): the chief listens at its host and `port`, the
        others connect; blocks until every member is there, at most `timeout` s.

        backend: default gloo when `device` is the CPU, "cpu:gloo,cuda:nccl" for CUDA. Raises
        ClusterConfigError for a bad cluster, port or value, or if torch.distributed is already initialized
        in this process; AllreduceError naming the members that did not arrive (or the chief's address, if
        it never listened) after `timeout`, or if the chief cannot listen at the port.
        """
        rendezvous = Rendezvous.from_cluster(cluster, task, port)
        return cls._form(rendezvous, cluster.address(task).rpartition(":")[0].strip("[]"), timeout=timeout,
                         device=device, backend=backend, bucket_bytes=bucket_bytes)

    @classmethod
    def connect_local(cls, task: TaskSpec, local_rank: int, nproc: int, port: int, *,
                      timeout: float = DEFAULT_TIMEOUT_SECONDS, device: str | torch.device = "cpu",
                      backend: str | None = None, bucket_bytes: int = BUCKET_BYTES,
                      abort_if: Callable[[], str | None] | None = None) -> "AllreduceGroup":
        """Forms the group of one task's `nproc` processes on its host (Rendezvous.local; host.py): local rank 0
        listens at 127.0.0.1:`port`. Blocks until every process is there, at most `timeout` s, or until
        `abort_if()` (asked while waiting) returns a reason: AllreduceError with it. Otherwise as connect()."""
        rendezvous = Rendezvous.local(task, local_rank, nproc, port)
        return cls._form(rendezvous, "127.0.0.1", timeout=timeout, device=device, backend=backend,
                         bucket_bytes=bucket_bytes, abort_if=abort_if, consequence=_HOST_CONSEQUENCE)

    @classmethod
    def _form(cls, rendezvous: Rendezvous, liveness_host: str, *, timeout: float, device: str | torch.device,
              backend: str | None, bucket_bytes: int, abort_if: Callable[[], str | None] | None = None,
              consequence: str = _HYBRID_CONSEQUENCE) -> "AllreduceGroup":
        """connect()'s and connect_local()'s work: the store, the liveness socket, the process group."""
        task = rendezvous.task
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ClusterConfigError(f"the all-reduce timeout must be > 0. Received: {timeout!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ClusterConfigError(f"bucket_bytes must be a positive integer. Received: {bucket_bytes!r}")
        if dist.is_initialized():
            raise ClusterConfigError("torch.distributed is already initialized in this process: an all-reduce "
                                     "group is its default process group, one per process")
        if backend is None:
            backend = "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"
        deadline = time.monotonic() + timeout
        rank, world = rendezvous.rank, rendezvous.world_size
        where = f"{rendezvous.host}:{rendezvous.port}"
        chief = rendezvous.members[0]
        if rank != 0:  # TCPStore's own retries print C++ warnings: wait for the chief's port quietly first
            _wait_for_port(rendezvous.host, rendezvous.port, deadline, f"{chief} never listened for the all-reduce "
                           f"group at {where} within {timeout:g} s (is it running, with the same port?)")
        remaining = datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))
        try:
            store = dist.TCPStore(rendezvous.host, rendezvous.port, world, is_master=rank == 0, timeout=remaining,
                                  wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            if rank == 0:
                raise AllreduceError(f"{task} cannot listen for the all-reduce group at {where}: "
                                     f"{_gloo_reason(exc)}") from None
            raise AllreduceError(f"{task} cannot reach {chief} at {where} for the all-reduce group: "
                                 f"{_gloo_reason(exc)}") from None
        liveness = _Liveness(liveness_host, task)
        try:
            store.set(f"{_KEY}{rank}", liveness.address)
            keys = [f"{_KEY}{r}" for r in range(world)]
            while not store.check(keys):  # polled: TCPStore.wait prints C++ warnings when it times out
                reason = abort_if() if abort_if is not None else None
                if reason:
                    raise AllreduceError(f"the all-reduce group did not form: {reason}")
                if time.monotonic() >= deadline:
                    missing = [str(rendezvous.members[r]) for r in range(world) if not store.check([keys[r]])]
                    raise AllreduceError(f"the all-reduce group did not form within {timeout:g} s: "
                                         f"{', '.join(missing)} never arrived at {where}")
                time.sleep(POLL_SECONDS)
            peers = {r: store.get(keys[r]).decode() for r in range(world) if r != rank}
            # Every member is at the store by now, so this is quick; its timeout is every collective's.
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout))
        except AllreduceError:
            liveness.close()
            raise
        except (RuntimeError, OSError) as exc:
            liveness.close()
            raise AllreduceError(f"the all-reduce group did not form: {_gloo_reason(exc)}") from None
        _LOGGER.info("%s: all-reduce group formed: rank %d of %d (%s) at %s", task, rank, world, backend, where)
        return cls(rendezvous, store, liveness, peers, backend=backend, timeout=timeout, bucket_bytes=bucket_bytes,
                   consequence=consequence)

    @property
    def rank(self) -> int:
        return self.rendezvous.rank

    @property
    def world_size(self) -> int:
        return self.rendezvous.world_size

    @property
    def members(self) -> tuple[TaskSpec, ...]:
        return self.rendezvous.members

    def close(self) -> None:
        """Leaves the group: destroys the process group; the liveness socket answers 'finished' (or 'failed')
        for LINGER_SECONDS more, from a daemon thread. Never blocks for the others; idempotent. A member still
        in a collective with this one then fails at once, and names it as having left."""
        if self._closed:
            return
        self._closed = True
        if self._failed is None:
            self._liveness.state = "finished"
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            self._liveness.close(linger=LINGER_SECONDS)
            self._store = None

    def __enter__(self) -> "AllreduceGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- collectives --------------------------------------------------------------------------------

    def broadcast_(self, tensors: Iterable[torch.Tensor], src: int = 0, *, what: str = "the broadcast") -> None:
        """Overwrites `tensors` in place with rank `src`'s values, a bucket per call. Blocks until every member
        made the same call; AllreduceError if one is lost (see the class)."""
        for bucket in _buckets(list(tensors), self.bucket_bytes, flags=False):  # once per model: not kept
            offset = 0
            if self.rank == src:
                for t in bucket.tensors:
                    bucket.buffer[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
                    offset += t.numel()
            self._collective(what, lambda: dist.broadcast(bucket.buffer, src))
            offset = 0
            with torch.no_grad():
                for t in bucket.tensors:
                    t.copy_(bucket.buffer[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def broadcast_int(self, value: int, src: int = 0, *, what: str = "the broadcast") -> int:
        """Rank `src`'s `value` (an int64; the others' are ignored), one small broadcast on the CPU. Blocks and
        raises as broadcast_."""
        tensor = torch.tensor([value if self.rank == src else 0], dtype=torch.int64)
        self._collective(what, lambda: dist.broadcast(tensor, src))
        return int(tensor.item())

    def average_gradients_(self, params: Iterable[torch.Tensor], *, what: str = "the all-reduce") -> None:
        """Replaces each parameter's .grad by the mean of the members' (a member without one counts zeros;
        a parameter no member has a gradient for keeps None), one all_reduce per bucket of `bucket_bytes`.

        Blocks until every member made the same call (at most `timeout` s); AllreduceError naming the member
        lost if one is gone or stalled (the gradients are then unchanged or partly averaged: stop).
        TypeError for a sparse gradient (use a torchps Embedding table for those).
        """
        params = list(params)
        if any(p.grad is not None and p.grad.is_sparse for p in params):  # before any collective: none made
            raise TypeError("a sparse gradient cannot be all-reduced densely: use a torchps.client "
                            "Embedding/EmbeddingBag table for it")
        key = tuple(map(id, params))
        buckets = self._buckets.get(key)
        if buckets is None:  # kept for the next steps: one more copy of the gradients, as DDP's buckets
            buckets = self._buckets[key] = _buckets(params, self.bucket_bytes, flags=True)
        for bucket in buckets:
            buffer, offset = bucket.buffer, 0
            count = bucket.numel
            for i, p in enumerate(bucket.tensors):
                piece = buffer[offset:offset + p.numel()]
                if p.grad is None:
                    piece.zero_()
                    buffer[count + i] = 0
                else:
                    piece.copy_(p.grad.reshape(-1))
                    buffer[count + i] = 1
                offset += p.numel()
            self._collective(what, lambda: dist.all_reduce(buffer))
            buffer.div_(self.world_size)
            present = (buffer[count:] > 0).tolist()  # a sum of 0s and 1s: > 0 exactly when some member had one
            offset = 0
            for p, has in zip(bucket.tensors, present):
                piece = buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if not has:
                    p.grad = None
                elif p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)

    def _collective(self, what: str, call: Callable[[], object]) -> None:
        if self._closed:
            raise AllreduceError("the all-reduce group is closed")
        if self._failed is not None:
            raise AllreduceError(self._failed)
        self.calls += 1
        try:
            call()
        except RuntimeError as exc:  # torch.distributed's errors (DistError, gloo's) are RuntimeErrors
            self._liveness.state = "failed"
            self._failed = self._diagnose(what, exc)
            raise AllreduceError(self._failed) from exc

    def _diagnose(self, what: str, exc: BaseException) -> str:
        """One line: which members are lost (asked through their liveness sockets, all at once, each for
        PROBE_SECONDS at most) and why the group cannot go on."""
        me, members = self.rendezvous.task, self.rendezvous.members
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self._peers))) as pool:
            answers = dict(zip(self._peers, pool.map(lambda a: _probe(a, PROBE_SECONDS), self._peers.values())))
        lost = [f"{members[r]} ({why})" for r, (alive, why) in sorted(answers.items()) if not alive]
        finished = [str(members[r]) for r, (alive, state) in sorted(answers.items()) if alive and state == "finished"]
        reason = _gloo_reason(exc)
        if lost:
            return (f"lost {', '.join(lost)} during {what}; the all-reduce group cannot go on without it: "
                    f"{self.consequence.format(me=me)} [{reason}]")
        if finished:
            return (f"{', '.join(finished)} already left the all-reduce group, so {what} cannot complete: the "
                    f"members ran different numbers of steps; {me} stops [{reason}]")
        return f"{what} failed though every member still answers; {me} stops [{reason}]"


def _wait_for_port(host: str, port: int, deadline: float, message: str) -> None:
    """Returns once something accepts connections at host:port; AllreduceError(message) at the deadline."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise AllreduceError(message) from None
            time.sleep(POLL_SECONDS * 2)
