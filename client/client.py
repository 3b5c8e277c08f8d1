"""PSClient: the Python API training code uses to talk to the shards."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import random
import threading
import time
from concurrent import futures
from typing import Callable, Iterable, Mapping, TypeVar

import numpy as np
import torch

from .. import codec, wire
from ..cluster import Cluster, TaskSpec
from ..errors import (ClusterConfigError, MalformedStreamError, ModeConflictError, PSError, TensorMismatchError,
                                WaitTimeoutError)
from ..proto import ps_pb2
from .channels import ShardChannels
from ..placement import Placement
from .stats import WorkerStats
from ..specs import Optimizer, wire_hyperparams

__all__ = ["PSClient"]

_LOGGER = logging.getLogger(__name__)
T = TypeVar("T")
GLOBAL_STEP_SHARD = 0  # shard 0 counts the global step, as TensorFlow keeps global_step on ps 0
WAIT_SLICE_SECONDS = 5.0  # longest single server-side wait for variables; the client repeats until its deadline


class PSClient:
    """A connection to every shard of a cluster, for one training process.

        with PSClient(cluster) as ps:
            model = ps.register_module(net, Optimizer("sgd", lr=0.1), create=is_chief)
            model.pull(); loss.backward(); model.push()

    Connecting is lazy: no call blocks in the constructor. Every call that
    reaches a shard waits up to `connect_timeout` seconds for it to be
    reachable (gRPC reconnects with backoff) and then raises
    ServerUnavailableError naming its address. Calls to several shards run
    concurrently, one stream per shard. Methods are thread-safe. Errors are
    PSError subclasses (torchps.errors), never grpc.RpcError.
    """

    def __init__(
        self,
        cluster: Cluster | None = None,
        *,
        task: TaskSpec | None = None,
        connect_timeout: float = 60.0,
        chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
        placement: str = "round_robin",
    ):
        if cluster is None:
            cluster, env_task = Cluster.from_tf_config()
            task = task or env_task
        if chunk_bytes <= 0:
            raise ClusterConfigError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.cluster = cluster
        self.task = task
        self.chunk_bytes = chunk_bytes
        self.placement = Placement(cluster.num_ps, placement)
        self._placement_lock = threading.Lock()
        self._channels = ShardChannels(list(cluster.ps), connect_timeout=connect_timeout)
        # Per-shard calls of one client call run in this pool. Calls that may block for long
        # (saves, waits for variables) run in threads of their own, so they never hold the
        # pool against the pushes they wait for.
        self._pool = futures.ThreadPoolExecutor(max_workers=cluster.num_ps, thread_name_prefix="torchps-client")
        self._closed = False
        self.worker = str(task) if task else f"client-{os.getpid()}"
        self.incarnation = random.getrandbits(63) or 1  # new per start: shards tell restarts from retries
        self._seq = itertools.count(1)
        # One push at a time per client: shards keep only each worker's latest push number for dedup,
        # so two concurrent pushes could reach a shard out of order and the older look like a retry.
        self._push_lock = threading.Lock()
        self.mode: ps_pb2.SyncConfig | None = None  # set by join()
        self.step = 0  # the step this worker computes at: set by join(), then by every push
        self.stats = WorkerStats()
        self.generations: dict[int, int] = {}  # shard -> generation last seen; a change means a restart
        self.restarts_seen = 0
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Leaves the job if joined (best effort), then closes all channels. Idempotent."""
        if not self._closed:
            if self.mode is not None:
                try:
                    self.leave()
                except PSError as exc:
                    _LOGGER.warning("could not leave cleanly: %s", exc)
            self._closed = True
            self._pool.shutdown(wait=False)
            self._channels.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def is_chief(self) -> bool:
        """True if this client's task is the cluster's chief (chief, or worker 0 without one)."""
        return self.task is not None and self.task == self.cluster.chief_task

    # -- placement --------------------------------------------------------------------------

    def declare(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, int]]) -> None:
        """Places names without creating them (in the given order), so later calls know their shard.

        Accepts {name: tensor} or (name, nbytes) pairs. Never blocks; idempotent.
        """
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        with self._placement_lock:
            for name, value in items:
                nbytes = value if isinstance(value, int) else value.numel() * value.element_size()
                self.placement.add(name, nbytes)

    def placement_report(self) -> str:
        """variable -> shard and bytes per shard, as printable text."""
        return self.placement.report(list(self.cluster.ps))

    # -- variables --------------------------------------------------------------------------

    def create_variables(self, tensors: Mapping[str, torch.Tensor], optimizer: Optimizer | None = None) -> dict[str, bool]:
        """Creates variables with these initial values on their shards; {name: created}.

        Idempotent: a variable that exists with the same spec is kept as it is
        (False). Blocks until every shard has stored its part. Raises
        SpecConflictError if one exists with another spec; each shard applies
        its part all-or-nothing, but if one shard fails the others' parts may
        already exist (calling again with the right spec completes the job).
        """
        self.declare(tensors)
        spec = (optimizer or Optimizer("none")).to_proto()
        groups = self.placement.group(tensors)

        def create(shard: int, names: list[str]) -> list[bool]:
            def requests():
                for i, name in enumerate(names):
                    value = tensors[name].detach().cpu()
                    yield ps_pb2.CreateRequest(spec=ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value), optimizer=spec),
                                               count=len(names) if i == 0 else 0)
                    for chunk in codec.encode_chunks(name, value, self.chunk_bytes):
                        yield ps_pb2.CreateRequest(chunk=chunk)
            reply = self._channels.call(shard, lambda stub: stub.CreateVariables(requests()))
            return list(reply.created)

        results = self._each_shard(groups, create)
        return {name: flag for shard, names in groups.items() for name, flag in zip(names, results[shard])}

    def wait_for_variables(self, names: Iterable[str], timeout: float = 600.0) -> None:
        """Blocks until every name (placed by declare) exists on its shard.

        Raises WaitTimeoutError naming the missing variables after `timeout` s,
        or ServerUnavailableError if a shard stays unreachable.
        """
        groups = self.placement.group(list(names))
        deadline = time.monotonic() + timeout

        def wait(shard: int, shard_names: list[str]) -> None:
            while True:  # short server-side waits, so waiting workers never hold a shard's threads for long
                remaining = deadline - time.monotonic()
                request = ps_pb2.ListRequest(names=shard_names, wait_seconds=max(0.001, min(WAIT_SLICE_SECONDS, remaining)))
                try:
                    self._channels.call(shard, lambda stub: stub.ListVariables(
                        request, timeout=WAIT_SLICE_SECONDS + 30))
                    return
                except WaitTimeoutError as exc:
                    if time.monotonic() >= deadline:
                        raise WaitTimeoutError(str(exc).replace(f"waited {request.wait_seconds:g} s",
                                                                f"waited {timeout:g} s")) from None

        self._each_shard(groups, wait, own_threads=True)

    def list_variables(self) -> list[ps_pb2.VariableInfo]:
        """Every variable on every shard (spec, version, bytes), shard by shard."""
        replies = self._each_shard({s: [] for s in range(self.cluster.num_ps)}, lambda shard, _: self._channels.call(
            shard, lambda stub: stub.ListVariables(ps_pb2.ListRequest())))
        return [info for shard in sorted(replies) for info in replies[shard].variables]

    # -- pull and push ------------------------------------------------------------------------

    def pull(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Fetches variables into new CPU tensors: {name: tensor}.

        Each tensor is one consistent version. Blocks until all arrive; on
        error nothing is returned.
        """
        names = list(names)
        out: dict[str, torch.Tensor] = {}

        def sink(chunk: codec.WireChunk) -> np.ndarray:
            value = torch.empty(tuple(chunk.meta.shape), dtype=codec.torch_dtype(chunk.meta.dtype))
            out[chunk.name] = value
            return codec.byte_array(value)

        self._pull(names, sink)
        return {name: out[name] for name in names}

    def pull_into(self, targets: Mapping[str, torch.Tensor], *, min_step: int = 0) -> int:
        """Overwrites each target tensor in place with its variable; returns shard 0's step counter
        (-1 if shard 0 holds none of the targets).

        With min_step, each shard first waits until it has applied that many
        steps (sync mode: the step this worker was released at).
        Targets may live on CPU or CUDA (CUDA goes through pinned staging
        memory). Dtype and shape must match (TensorMismatchError). If it
        raises midway, targets may be partly overwritten: pull again.
        """
        sink, finish = self._target_sink(targets)
        step = self._pull(list(targets), sink, min_step)
        finish()
        return step

    @staticmethod
    def _target_sink(targets: Mapping[str, torch.Tensor]):
        """(sink, finish) writing pulled chunks into `targets` in place; finish() completes CUDA copies."""
        staging: dict[str, torch.Tensor] = {}

        def sink(chunk: codec.WireChunk) -> np.ndarray:
            target = targets[chunk.name]
            if codec.meta_of(target) != chunk.meta:
                raise TensorMismatchError(
                    f"{chunk.name!r} is {codec.describe_meta(chunk.meta)} on the shard but the local tensor is "
                    f"{codec.describe_meta(codec.meta_of(target))}")
            if target.device.type == "cpu" and target.is_contiguous():
                return codec.byte_array(target.data)
            staging[chunk.name] = torch.empty(target.shape, dtype=target.dtype,
                                              pin_memory=target.device.type == "cuda")
            return codec.byte_array(staging[chunk.name])

        def finish() -> None:
            with torch.no_grad():
                for name, buffer in staging.items():
                    targets[name].copy_(buffer, non_blocking=True)
            if any(t.device.type == "cuda" for t in targets.values()):
                torch.cuda.synchronize()

        return sink, finish

    def _pull(self, names: list[str], sink: Callable[[codec.WireChunk], np.ndarray], min_step: int = 0) -> int:
        """Streams `names` from their shards; sink(first chunk) gives each tensor's byte buffer.

        Returns the global-step counter seen by shard 0's stream, or -1 if shard 0 was not read.
        """
        groups = self.placement.group(names)
        lock = threading.Lock()

        def pull(shard: int, shard_names: list[str]) -> int:
            def run(stub) -> int:
                request = ps_pb2.PullRequest(names=shard_names, chunk_bytes=self.chunk_bytes, min_step=min_step)
                return self._receive(stub.Pull(request), sink, lock)[0]
            return self._channels.call(shard, run)

        steps = self._each_shard(groups, pull)
        return steps.get(GLOBAL_STEP_SHARD, -1)

    @staticmethod
    def _receive(responses, sink: Callable[[codec.WireChunk], np.ndarray], lock: threading.Lock
                 ) -> tuple[int, ps_pb2.PushResponse | None]:
        """Copies a Pull/PushPull response stream into sink's buffers; returns (step, push result)."""
        step, result, buffer, filled, name = -1, None, None, 0, None
        for chunks, step, first_result in responses:
            result = result or first_result
            for chunk in chunks:
                if chunk.meta is not None:
                    with lock:
                        buffer, filled, name = sink(chunk), 0, chunk.name
                end = filled + len(chunk.data)
                if buffer is None or chunk.name != name or chunk.offset != filled or end > buffer.size:
                    raise MalformedStreamError(f"shard sent a malformed chunk of {chunk.name!r}")
                buffer[filled:end] = np.frombuffer(chunk.data, dtype=np.uint8)
                filled = end
        return step, result

    def _push_messages(self, header: ps_pb2.PushHeader, grads: Mapping[str, torch.Tensor], names: list[str]):
        """Serialized PushRequests: the header with the first batch, tensors packed up to chunk_bytes."""
        pieces = (piece for name in names
                  for piece in wire.tensor_pieces(name, grads[name].detach().cpu(), self.chunk_bytes))
        first = True
        for batch in wire.pack(pieces, self.chunk_bytes):
            yield wire.encode_push_request(header if first else None, batch)
            first = False
        if first:
            yield wire.encode_push_request(header, [])

    def _header(self, step: int, seq: int, advance_step: bool, tensors: int, pull: list[str] = ()
                ) -> ps_pb2.PushHeader:
        return ps_pb2.PushHeader(worker=self.worker, step=step, step_increment=int(advance_step),
                                 incarnation=self.incarnation, seq=seq, pull=pull, tensors=tensors)

    def _finish_push(self, replies: Mapping[int, ps_pb2.PushResponse]) -> int:
        for shard, reply in replies.items():
            self._note_generation(shard, reply.generation)
        lead = replies[GLOBAL_STEP_SHARD]
        self.stats.record(stale=lead.stale, duplicate=lead.duplicate, wait_seconds=lead.wait_seconds,
                          quorum=lead.quorum)
        self.step = lead.next_step
        return lead.next_step

    def push_pull(self, grads: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], *,
                  step: int | None = None, advance_step: bool = True) -> int:
        """push(grads) then pull_into(targets), in one round trip per shard (PushPull) in every mode.

        Used when each shard's gradients and variables fit in one chunk_bytes
        message; otherwise this is push() then pull_into(). In sync mode every
        shard holds its reply until this worker may go on, and a shard whose
        values predate the step shard 0 released is read again (min_step), so
        the guarantees are those of push then pull_into. Returns the next step.
        """
        groups = self.placement.group(grads)
        pulls = self.placement.group(targets)
        sync = self.mode is not None and self.mode.mode == "sync"

        def nbytes(tensors: Mapping[str, torch.Tensor], names: list[str]) -> int:
            return sum(tensors[n].numel() * tensors[n].element_size() for n in names)

        if any(nbytes(grads, groups.get(s, [])) > self.chunk_bytes or nbytes(targets, pulls.get(s, [])) > self.chunk_bytes
               for s in range(self.cluster.num_ps)):
            self.push(grads, step=step, advance_step=advance_step)
            self.pull_into(targets, min_step=self.step if sync else 0)
            return self.step
        with self._push_lock:
            return self._push_pull(grads, targets, groups, pulls, sync, step, advance_step)

    def _push_pull(self, grads, targets, groups, pulls, sync: bool, step: int | None, advance_step: bool) -> int:
        seq = next(self._seq)
        step = self.step if step is None else step
        sink, finish = self._target_sink(targets)
        lock = threading.Lock()

        def exchange(shard: int, names: list[str]) -> tuple[int, ps_pb2.PushResponse]:
            header = self._header(step, seq, advance_step, len(names), pulls.get(shard, []))
            (request,) = self._push_messages(header, grads, names)
            return self._channels.call(
                shard, lambda stub: self._receive([stub.PushPull(request)], sink, lock))

        replies = self._each_shard({s: groups.get(s, []) for s in range(self.cluster.num_ps)}, exchange)
        next_step = self._finish_push({shard: result for shard, (_, result) in replies.items()})
        behind = [name for shard, (read_at, _) in replies.items() if sync and read_at < next_step
                  for name in pulls.get(shard, [])]
        if behind:
            self._pull(behind, sink, min_step=next_step)
        finish()
        return next_step

    def push(self, grads: Mapping[str, torch.Tensor], *, step: int | None = None, advance_step: bool = True) -> int:
        """Sends gradients; each shard applies (async, ssp) or aggregates (sync) its part.

        `step` is the step the gradients were computed at (default: self.step,
        what the last push or join returned). Returns the step to compute at
        next, and keeps it in self.step: in sync
        mode shard 0 replies only once this worker may go on (its step was
        applied, or another batch is wanted); in async mode it is the global
        step after this push. Blocks until every shard has replied.

        Every shard gets the push, empty if it holds none of these variables:
        each counts pushes (its step counter, and its quorum in sync mode).
        With advance_step (default) the push counts as one step; shard 0's
        count is the global step.

        Pushes are numbered, so a push retried after a lost connection is
        applied once. If it raises, shards that replied have the gradients and
        the others do not; NaN/Inf and shape errors change nothing anywhere.
        """
        with self._push_lock:
            return self._push(grads, step, advance_step)

    def _push(self, grads: Mapping[str, torch.Tensor], step: int | None, advance_step: bool) -> int:
        groups = self.placement.group(grads)
        groups = {shard: groups.get(shard, []) for shard in range(self.cluster.num_ps)}
        seq = next(self._seq)
        step = self.step if step is None else step

        def push(shard: int, names: list[str]) -> ps_pb2.PushResponse:
            header = self._header(step, seq, advance_step, len(names))
            return self._channels.call(
                shard, lambda stub: stub.Push(self._push_messages(header, grads, names)))

        return self._finish_push(self._each_shard(groups, push))

    # -- checkpoints, export, lifecycle ------------------------------------------------------------

    def save_checkpoint(self, step: int | None = None, *, keep: int = 3, timeout: float = 600.0) -> int:
        """Makes every shard save its state at the same step; returns that step.

        step None: the step after the furthest shard's current one (the save
        happens as training reaches it; retried later if a shard got past it
        first); 0: each shard's state now (for an idle job, or at shutdown).
        Blocks until every shard has written its file (atomically). Shards
        keep their `keep` newest checkpoints. ModeConflictError if a shard has
        no --checkpoint-dir.
        """
        manifest = json.dumps({"strategy": self.placement.strategy, "num_ps": self.cluster.num_ps,
                               "variables": [[n, b] for n, b in zip(self.placement.names(),
                                                                     self.placement.nbytes())]})
        for _ in range(5):
            target = step if step is not None else 1 + max(
                self._each_shard({s: [] for s in range(self.cluster.num_ps)},
                                 lambda shard, _: self.status(shard).step).values())
            request = ps_pb2.SaveRequest(step=target, manifest_json=manifest, keep=keep)
            try:
                replies = self._each_shard({s: [] for s in range(self.cluster.num_ps)}, lambda shard, _: self._channels.call(
                    shard, lambda stub: stub.Save(request, timeout=timeout)),
                    own_threads=True)
            except ModeConflictError as exc:
                if step is not None or "past the requested" not in str(exc):
                    raise
                continue
            return replies[GLOBAL_STEP_SHARD].step
        raise ModeConflictError("shards kept moving past the requested checkpoint step; try step=0 when idle")

    def export_state_dict(self, names: Iterable[str] | None = None, *, strip_prefix: str = "") -> dict[str, torch.Tensor]:
        """The current values of `names` (default: every placed variable) as a plain state_dict.

        `model.load_state_dict(client.export_state_dict(...))` works when the
        names are the module's parameter names (strip the prefix given to
        register_module). Blocks for one pull.
        """
        values = self.pull(self.placement.names() if names is None else names)
        return {name.removeprefix(strip_prefix): value for name, value in values.items()}

    def shutdown_cluster(self, reason: str = "job done") -> None:
        """Tells every shard the job is done: each replies, then exits with code 0. Best effort per shard."""
        for shard in range(self.cluster.num_ps):
            try:
                self._channels.stubs[shard].Shutdown(ps_pb2.ShutdownRequest(reason=reason), timeout=10)
            except Exception as exc:  # noqa: BLE001 - a shard already gone is fine
                _LOGGER.info("ps:%d did not confirm shutdown: %s", shard, exc)

    # -- membership --------------------------------------------------------------------------------

    def configure(self, mode: str = "async", *, replicas_to_aggregate: int = 0, total_num_replicas: int = 0,
                  max_staleness: int = 0, lease_seconds: float = 10.0, startup_grace_seconds: float = 60.0) -> None:
        """Sets the training mode on every shard (the chief does this before creating variables).

        mode: "async", "sync" (SyncReplicasOptimizer: replicas_to_aggregate R
        of total_num_replicas N per step) or "ssp" (bounded staleness:
        max_staleness). Idempotent; ModeConflictError if the shards already
        run another mode with workers joined. Blocks for one round trip per shard.
        """
        config = ps_pb2.SyncConfig(mode=mode, replicas_to_aggregate=replicas_to_aggregate,
                                   total_num_replicas=total_num_replicas, max_staleness=max_staleness,
                                   lease_seconds=lease_seconds, startup_grace_seconds=startup_grace_seconds)
        self._each_shard({s: [] for s in range(self.cluster.num_ps)}, lambda shard, _: self._channels.call(
            shard, lambda stub: stub.Configure(config)))

    def join(self) -> int:
        """Announces this worker to every shard and returns the step to start at.

        It then keeps its lease alive with heartbeats from a background
        thread until leave() or close(). Idempotent.
        """
        def join(shard: int, step: int) -> ps_pb2.JoinResponse:
            ref = ps_pb2.WorkerRef(worker=self.worker, incarnation=self.incarnation, step=step)
            return self._channels.call(shard, lambda stub: stub.Join(ref))

        lead = join(GLOBAL_STEP_SHARD, 0)  # shard 0 first: the others learn the step this worker starts at
        others = {s: [] for s in range(self.cluster.num_ps) if s != GLOBAL_STEP_SHARD}
        if others:
            self._each_shard(others, lambda shard, _: join(shard, lead.step))
        self.mode = lead.config
        self.step = lead.step
        if self._heartbeat is None:
            self._heartbeat_stop.clear()
            self._heartbeat = threading.Thread(target=self._beat, args=(lead.config.lease_seconds / 3,),
                                               name="torchps-heartbeat", daemon=True)
            self._heartbeat.start()
        return lead.step

    def leave(self) -> None:
        """Tells every shard this worker is done, so the quorum drops at once. Idempotent."""
        if self._heartbeat is not None:
            self._heartbeat_stop.set()
            self._heartbeat.join()
            self._heartbeat = None
        ref = ps_pb2.WorkerRef(worker=self.worker, incarnation=self.incarnation)
        self._each_shard({s: [] for s in range(self.cluster.num_ps)}, lambda shard, _: self._channels.call(
            shard, lambda stub: stub.Leave(ref, timeout=10)))
        self.mode = None

    def _note_generation(self, shard: int, generation: int) -> None:
        known = self.generations.get(shard)
        self.generations[shard] = generation
        if known is not None and known != generation:
            _LOGGER.warning("ps:%d restarted (generation %x -> %x): it restored its last checkpoint; "
                            "the next pull re-reads its variables", shard, known, generation)
            self.restarts_seen += 1

    def _beat(self, interval: float) -> None:
        while not self._heartbeat_stop.wait(interval):
            ref = ps_pb2.WorkerRef(worker=self.worker, incarnation=self.incarnation, step=self.step)
            for shard in range(self.cluster.num_ps):
                try:
                    self._channels.stubs[shard].Heartbeat(ref, timeout=interval)
                except Exception as exc:  # noqa: BLE001 - a missed beat is logged, the lease decides
                    _LOGGER.debug("heartbeat to ps:%d failed: %s", shard, exc)

    # -- optimizer and step ---------------------------------------------------------------------

    def set_hyperparams(self, names: Iterable[str] | None = None, **hyperparams) -> int:
        """Changes optimizer hyperparameters (e.g. lr=0.01) of `names`, or of every trainable variable.

        Takes effect from the next update on each shard. Returns how many variables changed.
        """
        wire = wire_hyperparams(hyperparams)
        groups = self.placement.group(names) if names is not None else {s: [] for s in range(self.cluster.num_ps)}

        def update(shard: int, shard_names: list[str]) -> int:
            request = ps_pb2.UpdateOptimizerRequest(names=shard_names, hyperparams=wire)
            return self._channels.call(shard, lambda stub: stub.UpdateOptimizer(request)).updated

        return sum(self._each_shard(groups, update).values())

    def global_step(self) -> int:
        """The global step (shard 0's counter of applied pushes). Blocks for one round trip."""
        return self.status(GLOBAL_STEP_SHARD).step

    def status(self, shard: int) -> ps_pb2.StatusResponse:
        """One shard's status (index, step, variable count, bytes, pid)."""
        return self._channels.call(shard, lambda stub: stub.GetStatus(ps_pb2.StatusRequest()))

    # -- modules --------------------------------------------------------------------------------

    def register_module(self, module: torch.nn.Module, optimizer: Optimizer | None = None, *,
                        create: bool | None = None, prefix: str = "", wait_timeout: float = 600.0,
                        join: bool = True):
        """Binds a module's parameters to variables named prefix + parameter name.

        With create (default: this client is the chief), creates them from the
        module's current values; otherwise waits up to `wait_timeout` s for the
        chief to create them (WaitTimeoutError names the missing ones). With
        join (workers; not evaluators) it then joins the job (see join()).
        Either way it ends with a pull, so the module holds the shared values.
        Returns a ModuleBinding with pull() and push().
        """
        from .module import ModuleBinding

        binding = ModuleBinding(self, module, prefix)
        params = binding.cpu_values()
        create = self.is_chief if create is None else create
        if create:
            self.create_variables(params, optimizer)
        else:
            self.declare(params)
            _LOGGER.info("waiting up to %g s for %d variables from the chief", wait_timeout, len(params))
            self.wait_for_variables(params, wait_timeout)
        if join:
            self.join()
        binding.pull()
        return binding

    # -- helpers --------------------------------------------------------------------------------

    def _each_shard(self, groups: Mapping[int, list[str]], fn: Callable[[int, list[str]], T], *,
                    own_threads: bool = False) -> dict[int, T]:
        """Runs fn(shard, names) for every shard concurrently; the first error is raised after all finish.

        own_threads: in fresh threads instead of the shared pool (for calls that can block for long).
        """
        if len(groups) == 1 and not own_threads:
            ((shard, names),) = groups.items()
            return {shard: fn(shard, names)}
        if own_threads:
            with futures.ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="torchps-wait") as pool:
                pending = {shard: pool.submit(fn, shard, names) for shard, names in groups.items()}
        else:
            pending = {shard: self._pool.submit(fn, shard, names) for shard, names in groups.items()}
            futures.wait(pending.values())
        return {shard: future.result() for shard, future in pending.items()}
