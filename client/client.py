"""PSClient: the Python API training code uses to talk to the shards.

    datapath.py    pull, push, exchange (PSClient's)    transfer.py    tensor bytes in and out
    device.py      CUDA tensors: staging, streams      host.py        one push per multi-GPU host
    fanout.py      one call per shard, all at once     channels.py    deadlines, retries with backoff
    membership.py  join, heartbeats, leave
    recovery.py    shards that restarted empty         checkpoints.py two-phase checkpoints
    module.py      torch.nn.Module bindings            tables.py      embedding tables (PSClient's)
    embedding.py   Embedding, EmbeddingBag
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import threading
from typing import Callable, Iterable, Mapping, TypeVar

import torch

from .. import codec
from ..cluster import Cluster, TaskSpec
from ..compression import Compression, Encoder, policies_for
from ..errors import ClusterConfigError, InvalidArgumentError, PSError
from ..lanes import tls_context
from ..partitioning import MinSizePartitioner, NoPartitioner, Partitioner, Partitions
from ..placement import Placement
from ..proto import ps_pb2
from ..security import Security
from ..specs import Optimizer, wire_hyperparams
from . import checkpoints
from . import resize as live_resize
from .datapath import GLOBAL_STEP_SHARD, DataPath
from .device import DeviceStaging
from .fanout import CONTROL_TIMEOUT_SECONDS, ShardFanout
from .held import HeldPushWatch, held_reason
from .lanes import LANE_MIN_BYTES, ClientLanes
from .layout import LayoutFollower
from .membership import Heartbeats, LiveWorkers
from .overlap import OVERLAP_INFLIGHT_BYTES, PushLock
from .recovery import ShardRefill
from .stats import WorkerStats
from .tables import TableLayout, TablePath, tables_in

__all__ = ["PSClient"]

T = TypeVar("T")
_LOGGER = logging.getLogger(__name__)
LEAVE_ON_CLOSE_SECONDS = 3.0    # close() does not wait longer for shards to hear it leave: leases expire anyway
LANE_PORT_RETRY_SECONDS = 2.0   # how long a shard's lane port is asked for before its call goes inline


class PSClient(DataPath, TablePath):
    """A connection to every shard of a cluster, for one training process.

        with PSClient(cluster) as ps:
            model = ps.register_module(net, Optimizer("sgd", lr=0.1), create=is_chief)
            model.pull(); loss.backward(); model.push()

    Connecting is lazy: no call blocks in the constructor. Deadlines: every
    attempt of a call that may wait for training (push, pull, exchange, save)
    gets `timeout` seconds, every other call CONTROL_TIMEOUT_SECONDS; a shard
    that is unreachable, or refuses a call at its waiting-call limit, is
    retried with jittered backoff for up to `connect_timeout` from the first
    failure, then ServerUnavailableError names its address. Calls to several
    shards run concurrently (the caller's thread takes one shard), and calls
    from several threads never wait for each other, except pushes, which go
    one at a time. Methods are thread-safe. Errors are PSError subclasses
    (torchps.errors), never grpc.RpcError.

    A shard that restarts without its state (no --checkpoint-dir) is refilled
    by the client that created its variables; other clients wait up to
    `refill_timeout` for that, then raise ShardLostError. A replicated shard
    whose primary is lost (killed, paused, cut off) is looked up at its
    arbiter and at its own address while a call to it fails or hangs, and
    the call is sent again to the promoted backup (client/failover_watch.py;
    a push acknowledged before is answered as a duplicate there).

    Variables larger than the `partitioner` allows (default: TensorFlow's
    MinSizePartitioner: pieces of at least 256 KiB, at most one per shard;
    None: never) are cut along axis 0 into pieces on different shards
    (torchps.partitioning); every call here still takes and gives whole
    variables.

    `security` (torchps.security.Security: the task's certificate, key, the
    job's CA and tokens) secures every channel; by default it is read from
    the TORCHPS_TLS_CERT/KEY/CA and TORCHPS_TOKEN_FILE (TORCHPS_ADMIN_TOKEN_FILE)
    environment variables, and is plaintext without them.

    Tensors may live on CUDA devices: values and gradients go through host
    buffers allocated once and reused (pinned memory unless `pin_memory` is
    False), copied by non-blocking copies on side streams ordered by events
    (client/device.py); on a host without CUDA nothing of that is used.

    With `lanes` (default), pulls into known tensors and pushes of
    `lane_min_bytes` (1 MiB) or more to a shard that offers bulk lanes
    (torchps/lanes.py; TLS with these credentials where the shard serves
    TLS) move their bytes on a TCP connection beside the gRPC call, copied
    only by the kernel (and TLS); a lane that breaks fails the attempt, which
    is retried (on a new lane, or inline) like a lost connection.
    """

    def __init__(
        self,
        cluster: Cluster | None = None,
        *,
        task: TaskSpec | None = None,
        connect_timeout: float = 60.0,
        timeout: float = 300.0,
        chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
        placement: str = "round_robin",
        partitioner: Partitioner | None = MinSizePartitioner(),
        refill_timeout: float = 120.0,
        security: Security | None = None,
        pin_memory: bool = True,
        lanes: bool = True,
        lane_min_bytes: int = LANE_MIN_BYTES,
    ):
        if cluster is None:
            cluster, env_task = Cluster.from_tf_config()
            task = task or env_task
        try:
            codec.check_chunk_bytes(chunk_bytes)
        except InvalidArgumentError as exc:
            raise ClusterConfigError(str(exc)) from None
        for name, value in (("connect_timeout", connect_timeout), ("timeout", timeout),
                            ("refill_timeout", refill_timeout)):
            if not value > 0:
                raise ClusterConfigError(f"{name} must be > 0. Received: {value}")
        self.cluster = cluster
        self.task = task
        self.placement = Placement(cluster.num_ps, placement)
        self.partitions = Partitions(partitioner or NoPartitioner(), cluster.num_ps)
        self._declared: dict[str, None] = {}  # the variables declared, whole, in order
        self._placement_lock = threading.Lock()
        self.security = Security.load() if security is None else security
        self._fanout = ShardFanout(cluster, connect_timeout=connect_timeout, security=self.security, timeout=timeout,
                                   control_timeout=min(timeout, CONTROL_TIMEOUT_SECONDS), chunk_bytes=chunk_bytes)
        self._layout = LayoutFollower(self._fanout, self.placement)  # the layout across live resizes
        self._lanes = ClientLanes(lambda shard: self._fanout.channels.addresses[shard], self._lane_port, enabled=lanes,
                                  context=tls_context(self.security, server=False), min_bytes=lane_min_bytes)
        self._closed = False
        self.worker = str(task) if task else f"client-{os.getpid()}"
        self.incarnation = random.getrandbits(63) or 1  # new per start: shards tell restarts from retries
        self._seq = itertools.count(1)
        # One push at a time per client: shards keep only each worker's latest push number for dedup,
        # so two concurrent pushes could reach a shard out of order and the older look like a retry.
        self._push_lock = PushLock()  # a streamed push (overlap.py) gives way to any other
        self.mode: ps_pb2.SyncConfig | None = None  # set by join()
        self.step = 0  # the step this worker computes at: set by join(), then by every push
        self.restarted = False  # set by join(): this process replaced an earlier one of its task (shard 0 says)
        self.stats = WorkerStats()
        self._device = DeviceStaging(pinned=pin_memory)  # staging buffers, streams and events for CUDA tensors
        self.last_replies: dict[int, ps_pb2.PushResponse] = {}  # shard -> its reply to this client's last push
        self._heartbeats = Heartbeats(self._fanout.channels, self._worker_ref, self._on_heartbeat)
        self._live = LiveWorkers()  # shard 0's count of live workers, and the callbacks on its changes
        self._refill = ShardRefill(self._fanout, self.placement, refill_timeout, step=lambda: self.step)
        self._encoder = Encoder()  # wire compression: a policy per variable, error-feedback residuals
        self._tables: dict[str, TableLayout] = {}  # embedding tables created or waited for (tables.py)
        self._table_padding: dict[str, int | None] = {}  # a registered module's padding_idx, by table
        self._held = HeldPushWatch(self._held_reason)  # names what a push held long on ps 0 waits for

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Leaves the job if joined (best effort: LEAVE_ON_CLOSE_SECONDS at most, the leases do the rest),
        then closes all channels. Idempotent."""
        if not self._closed:
            if self.mode is not None:
                try:
                    self.leave(retry_for=LEAVE_ON_CLOSE_SECONDS)
                except PSError as exc:
                    _LOGGER.warning("could not leave cleanly: %s", exc)
            self._heartbeats.stop()
            self._held.close()
            self._closed = True
            self._lanes.close()
            self._fanout.close()
            self._device.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch_held(self) -> contextlib.AbstractContextManager:
        """Around a push's wait for its replies: in sync and ssp modes, where ps 0 may hold it, a push held
        longer than usual is named in a warning saying what it waits for (held.py)."""
        if self.mode is None or self.mode.mode not in ("sync", "ssp"):
            return contextlib.nullcontext()
        return self._held.watching()

    def _held_reason(self, waited: float) -> str | None:
        names = self.cluster.training_names()
        return held_reason(self.status(GLOBAL_STEP_SHARD, joined_of=names), names, self.worker, waited)

    # -- what the fan-out keeps (fanout.ShardFanout) -----------------------------------------------

    @property
    def timeout(self) -> float:
        """Each attempt's deadline for calls that may wait for training (push, pull, exchange, save)."""
        return self._fanout.timeout

    @property
    def control_timeout(self) -> float:
        """Each attempt's deadline for calls that never wait for training (status, join, configure, ...)."""
        return self._fanout.control_timeout

    @property
    def chunk_bytes(self) -> int:
        return self._fanout.chunk_bytes

    @property
    def tracer(self) -> Callable[[str, int, float, float], None] | None:
        """tracer(phase, shard, start, end) (monotonic seconds) for every shard's push, pull, push_pull and lookup
        call, when set (ps-worker --trace-out); called from the threads making the calls."""
        return self._fanout.tracer

    @tracer.setter
    def tracer(self, tracer: Callable[[str, int, float, float], None] | None) -> None:
        self._fanout.tracer = tracer

    @property
    def generations(self) -> dict[int, int]:
        """{shard: the generation it last answered with}; a change means a restart."""
        return self._fanout.generations

    @property
    def restarts_seen(self) -> int:
        """Shard restarts this client noticed (a reply with another generation)."""
        return self._fanout.restarts_seen

    @property
    def is_chief(self) -> bool:
        """True if this client's task is the cluster's chief (chief, or worker 0 without one)."""
        return self.task is not None and self.task == self.cluster.chief_task

    # -- placement --------------------------------------------------------------------------

    def declare(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, int]]) -> None:
        """Places names without creating them (in the given order), so later calls know their shard.

        Accepts {name: tensor} (cut into pieces as the partitioner says) or
        (name, nbytes) pairs (never cut). Never blocks; idempotent.
        """
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        with self._placement_lock:
            for name, value in items:
                self._declared[name] = None
                if isinstance(value, int):
                    self.placement.add(name, value)
                    continue
                for wire_name, nbytes in self.partitions.add(name, tuple(value.shape), value.dtype):
                    self.placement.add(wire_name, nbytes)

    def placement_report(self) -> str:
        """variable -> shard and bytes per shard, as printable text; then the partitioned variables' pieces;
        then the embedding tables this client knows, with each shard's counters (rows, admitted, evicted,
        bytes: one GetStatus per shard, so with tables it blocks for a round trip)."""
        report = self.placement.report(list(self.cluster.ps))
        pieces = self.partitions.report()
        lines = [report, f"partitioned ({len(pieces)}):", *pieces] if pieces else [report]
        return "\n".join(lines + (self._tables_report() if self._tables else []))

    def variable_names(self) -> list[str]:
        """Every variable this client declared, whole (partitioned ones by their own name), in order."""
        return list(self._declared)

    # -- variables --------------------------------------------------------------------------

    def create_variables(self, tensors: Mapping[str, torch.Tensor], optimizer: Optimizer | None = None) -> dict[str, bool]:
        """Creates variables with these initial values on their shards; {name: created}.

        Idempotent: a variable that exists with the same spec is kept as it is
        (False). Blocks until every shard has stored its part. Raises
        SpecConflictError if one exists with another spec; each shard applies
        its part all-or-nothing, but if one shard fails the others' parts may
        already exist (calling again with the right spec completes the job).
        This client then refills these variables into a shard that restarts
        without its state (from `tensors`, which it keeps referring to). A
        partitioned variable counts as created if any of its pieces was.
        """
        self.declare(tensors)
        self._layout.refresh()  # a job resized live places its variables as its layout says
        spec = (optimizer or Optimizer("none")).to_proto()
        self._own(tensors, spec)
        pieces = self.partitions.split(tensors)
        groups = self.placement.group(pieces)
        results = self._fanout.each(groups, lambda shard, names: self._fanout.create_on(
            shard, {name: pieces[name] for name in names}, spec))
        created = {name: flag for shard, names in groups.items() for name, flag in zip(names, results[shard])}
        return {name: any(created[piece] for piece in self.partitions.wire_names([name])) for name in tensors}

    def _own(self, tensors: Mapping[str, torch.Tensor], spec: ps_pb2.OptimizerSpec) -> None:
        """Makes this client the refiller of `tensors`' variables, taking their values as they are then."""
        for name, value in tensors.items():
            pieces = self.partitions.splits.get(name)
            if pieces is None:
                self._refill.own(name, lambda value=value: value.detach().cpu(), spec)
                continue
            for piece, start, stop in pieces.pieces:
                self._refill.own(piece, lambda value=value, start=start, stop=stop: value.detach()[start:stop].cpu(),
                                 spec)

    def wait_for_variables(self, names: Iterable[str], timeout: float = 600.0) -> None:
        """Blocks until every name (placed by declare) exists on its shard.

        Raises WaitTimeoutError naming the missing variables after `timeout` s,
        or ServerUnavailableError if a shard stays unreachable.
        """
        self._layout.refresh()
        self._fanout.wait_listed(self.placement.group(self.partitions.wire_names(names)), "ListVariables", timeout)

    def list_variables(self) -> list[ps_pb2.VariableInfo]:
        """Every variable on every shard (spec, version, bytes), shard by shard."""
        replies = self._fanout.every(lambda stub, t: stub.ListVariables(ps_pb2.ListRequest(), timeout=t))
        return [info for shard in sorted(replies) for info in replies[shard].variables]

    # -- checkpoints, export, end of job -------------------------------------------------------

    def save_checkpoint(self, step: int | None = None, *, keep: int = 3, timeout: float = 600.0,
                        full: bool = False) -> int:
        """Makes every shard save its state at the same step, then commits it; returns that step.

        step None: the step after the global step (shard 0's count; saved as
        training reaches it; asked again with a later step if a shard got past
        it first); 0: each shard's state now, numbered with the global step
        (an idle job, or at shutdown). A save whose step never comes because
        every worker left is taken as with 0: a checkpoint's number is always
        the global step its state holds.
        Blocks until every shard has durably written its file and shard 0 has
        written the manifest that makes the checkpoint count (at most `timeout`).
        Keeps the `keep` newest committed checkpoints. `full`: the stores of
        tables kept on SSD are copied whole, file by file (by default a
        checkpoint hard-links the table files it shares with the live store
        or the previous checkpoint). ModeConflictError if a
        shard has no --checkpoint-dir; CheckpointError if a write failed (the
        previous committed checkpoint then stays the newest).
        """
        self._layout.refresh()
        return checkpoints.save(self._fanout, self.placement, self.partitions, step, keep=keep, timeout=timeout,
                                layout_epoch=self._layout.epoch, full=full)

    def resize(self, addresses: list[str], *, drain_seconds: float = live_resize.DRAIN_SECONDS,
               quiet_seconds: float = live_resize.QUIET_SECONDS, lease_seconds: float = live_resize.LEASE_SECONDS
               ) -> live_resize.ResizeReport:
        """Makes the job's shards `addresses` while training goes on: the chief's call (client/resize.py says
        how). The shards it adds must be running and empty (ps-server --index N --join); the ones it removes
        are stopped. Embedding tables are re-laid out onto the new count (their rows frozen meanwhile); a sync
        job pauses at a step boundary while variables move. ps 0 records the resize, which this client drives
        under a lease of `lease_seconds` (renewed by a thread of its own; should this process die, the
        resize is cut off once it runs out: see resume_resize and abort_resize). Blocks until every variable
        and table row is at its new shard. Raises ResizeConflictError (nothing changed) while another resize
        runs or was cut off, ClusterConfigError for addresses that drop or reorder current shards or add one
        that does not answer; once begun, a failure (WaitTimeoutError: a sync job did not apply the steps
        before the hold within `quiet_seconds`; a shard refused an import, or went away) rolls the resize
        back before it is raised, so every variable is where it was, unless the tables' re-layout had begun
        (past that point the resize only goes forward: it is left cut off, for resume_resize)."""
        return live_resize.run(self._fanout, self._layout, list(addresses), driver=self._driver_name(),
                               drain_seconds=drain_seconds, quiet_seconds=quiet_seconds, lease_seconds=lease_seconds)

    def resume_resize(self, *, drain_seconds: float = live_resize.DRAIN_SECONDS,
                      quiet_seconds: float = live_resize.QUIET_SECONDS,
                      lease_seconds: float = live_resize.LEASE_SECONDS) -> live_resize.ResizeReport:
        """Takes over a resize that was cut off (its driver stopped renewing its lease) and finishes it, as
        resize() would have. Blocks until done; ResizeConflictError if no resize is cut off (or its driver
        still renews it); raises as resize() does, without rolling back."""
        return live_resize.resume(self._fanout, self._layout, driver=self._driver_name(),
                                  drain_seconds=drain_seconds, quiet_seconds=quiet_seconds,
                                  lease_seconds=lease_seconds)

    def abort_resize(self, *, drain_seconds: float = live_resize.DRAIN_SECONDS,
                     quiet_seconds: float = live_resize.QUIET_SECONDS,
                     lease_seconds: float = live_resize.LEASE_SECONDS) -> live_resize.ResizeReport:
        """Takes over a resize that was cut off and rolls it back: every variable not confirmed on its new
        shard goes back to its old one; one that had begun to re-lay out the embedding tables, or had set its
        last epoch on some shard, is finished instead (the report's outcome is "done"; the shards it removes
        stopped after `drain_seconds`). Blocks until done; ResizeConflictError if no resize is cut off (or its
        driver still renews it); PSError if a shard cannot be reached (the resize stays cut off)."""
        return live_resize.abort(self._fanout, self._layout, driver=self._driver_name(), drain_seconds=drain_seconds,
                                 quiet_seconds=quiet_seconds, lease_seconds=lease_seconds)

    def resize_state(self) -> ps_pb2.ResizeState:
        """ps 0's record of the job's last live resize: its phase, driver, lease, shards and moves (one call)."""
        return live_resize.state(self._fanout)

    def _driver_name(self) -> str:
        return live_resize.driver_name(str(self.task) if self.task is not None else "a client")

    def shard_addresses(self) -> list[str]:
        """The job's shards now, in index order (the cluster's, after a live resize the layout's): asks shard 0
        for the layout first (one call)."""
        self._layout.refresh()
        return list(self._fanout.channels.addresses[:self._layout.shards])

    @property
    def layout_epoch(self) -> int:
        """The layout epoch this client follows (0 until a live resize)."""
        return self._layout.epoch

    @property
    def layout_waits(self) -> tuple[int, int]:
        """(parts refused by a shard their variables or table rows had left, sent again; attempts retried while a variable
        was on its way to its shard): what live resizes cost this client."""
        return self._layout.refused, self._fanout.channels.moving_waits

    def export_state_dict(self, names: Iterable[str] | None = None, *, strip_prefix: str = "") -> dict[str, torch.Tensor]:
        """The current values of `names` (default: every declared variable and every fixed-size embedding
        table this client knows) as a plain state_dict.

        `model.load_state_dict(client.export_state_dict(...))` works when the
        names are the module's parameter names (strip the prefix given to
        register_module). A fixed-size table (Embedding or EmbeddingBag with
        num_embeddings=N, named like the weight it stands for: "<module
        path>.weight") is exported whole, as the (N, dim) weight torch's
        nn.Embedding and nn.EmbeddingBag load, read from every shard without
        admitting anything, its padding row zeroed where a module registered
        here has padding_idx (torch's modules keep it zero, torchps's read it
        as zeros). A dynamic table (num_embeddings=None) has no such weight:
        it is left out of the default, and naming one raises
        InvalidArgumentError (export_rows streams its rows). UnknownVariableError
        for a name that is neither a variable nor a table. Blocks for one pull
        and the lookups of every exported table's rows, which this process
        then holds whole; variables and tables are read one after the other,
        so export a job that is not training (its end) for one step's values.
        """
        tables = self._exported_tables(names)
        variables = self.variable_names() if names is None else [name for name in names if name not in tables]
        values = self.pull(variables)
        values.update({name: self._export_table(name) for name in tables})
        return {name.removeprefix(strip_prefix): value for name, value in values.items()}

    def shutdown_cluster(self, reason: str = "job done") -> None:
        """Tells every shard the job is done: each replies, then exits with code 0. Best effort per shard,
        all at once, at most CONTROL_TIMEOUT_SECONDS."""
        calls = {shard: stub.Shutdown.future(ps_pb2.ShutdownRequest(reason=reason), timeout=self.control_timeout)
                 for shard, stub in enumerate(self._fanout.channels.stubs)}
        for shard, call in calls.items():
            try:
                call.result()
            except Exception as exc:  # noqa: BLE001 - a shard already gone is fine
                _LOGGER.info("ps:%d did not confirm shutdown: %s", shard, exc)

    # -- mode and membership ------------------------------------------------------------------

    def configure(self, mode: str = "async", *, replicas_to_aggregate: int = 0, total_num_replicas: int = 0,
                  max_staleness: int = 0, lease_seconds: float = 10.0, startup_grace_seconds: float = 60.0,
                  progress_seconds: float = 60.0, replicas_fraction: float = 0.0) -> None:
        """Sets the training mode on every shard (the chief does this before creating variables).

        mode: "async", "sync" (SyncReplicasOptimizer: replicas_to_aggregate R
        of total_num_replicas N per step, or with replicas_fraction f in (0, 1]
        instead, ceil(f x the live workers): the quorum follows workers joining
        and leaving) or "ssp" (bounded staleness: max_staleness). A worker that heartbeats but pushes nothing for
        max(progress_seconds, 20 x the median push interval) is left out like
        a dead one until it pushes again. Idempotent; ModeConflictError if the
        shards already run another mode with workers joined;
        InvalidArgumentError for values out of range. Blocks for one round
        trip per shard.
        """
        config = ps_pb2.SyncConfig(mode=mode, replicas_to_aggregate=replicas_to_aggregate,
                                   total_num_replicas=total_num_replicas, max_staleness=max_staleness,
                                   lease_seconds=lease_seconds, startup_grace_seconds=startup_grace_seconds,
                                   progress_seconds=progress_seconds, replicas_fraction=replicas_fraction)
        self._fanout.every(lambda stub, t: stub.Configure(config, timeout=t))
        self._refill.config = config

    def join(self) -> int:
        """Announces this worker to every shard and returns the step to start at; `restarted` then says whether
        shard 0 knew an earlier process of this task (one that trained: see JoinResponse.restarted).

        It then keeps its lease alive with heartbeats from a background
        thread until leave() or close(). Idempotent. WorkerReplacedError if a
        newer process of this task already joined.
        """
        def join(shard: int, step: int) -> ps_pb2.JoinResponse:
            ref = ps_pb2.WorkerRef(worker=self.worker, incarnation=self.incarnation, step=step)
            reply = self._fanout.call(shard, lambda stub, t: stub.Join(ref, timeout=t), self.control_timeout)
            self._fanout.note_generation(shard, reply.generation)
            return reply

        lead = join(GLOBAL_STEP_SHARD, 0)  # shard 0 first: the others learn the step this worker starts at
        self._layout.refresh(seen=lead.layout_epoch)
        others = {s: [] for s in range(self._layout.shards) if s != GLOBAL_STEP_SHARD}
        if others:
            self._fanout.each(others, lambda shard, _: join(shard, lead.step))
        self.mode = lead.config
        self.step = lead.step
        self.restarted = lead.restarted
        self._live.note(lead.live_workers)
        self._heartbeats.start(lead.config.lease_seconds / 3)
        return lead.step

    def leave(self, *, retry_for: float | None = None) -> None:
        """Tells every shard this worker is done, so the quorum drops at once. Idempotent. An unreachable
        shard is retried for `retry_for` seconds (default: connect_timeout)."""
        self._heartbeats.stop()
        ref = ps_pb2.WorkerRef(worker=self.worker, incarnation=self.incarnation)
        self._fanout.each(self._fanout.all_shards(), lambda shard, _: self._fanout.call(
            shard, lambda stub, t: stub.Leave(ref, timeout=t), self.control_timeout, retry_for))
        self.mode = None

    def _worker_ref(self) -> ps_pb2.WorkerRef:
        return ps_pb2.WorkerRef(worker=self.worker, incarnation=self.incarnation, step=self.step)

    def _on_heartbeat(self, shard: int, reply: ps_pb2.HeartbeatResponse) -> None:
        self._fanout.note_generation(shard, reply.generation)
        self._layout.refresh(seen=reply.layout_epoch)
        if shard == GLOBAL_STEP_SHARD:
            self._live.note(reply.live_workers)

    @property
    def live_workers(self) -> int | None:
        """The live workers of the job as shard 0 last reported them (its reply to join(), then to heartbeats,
        every lease / 3 while joined); None before join(). Never blocks."""
        return self._live.count

    def on_live_workers_change(self, fn: Callable[[int, int | None], None]) -> None:
        """Registers fn(live, previous): run when the live workers' count changes (previous None the first
        time), in the thread that pushes, before its next push or push_pull (so it may set hyperparameters for
        that push: `ps-worker --scale-lr` scales the learning rate with the count this way). Horovod's elastic
        reset callbacks, for a job whose workers come and go. A callback that raises fails that push, which
        then sends nothing."""
        self._live.add(fn)

    def dispatch_live_workers(self) -> None:
        """Runs the on_live_workers_change callbacks if the count changed since they last ran (push and
        push_pull call it first; so does an overlapped ModuleBinding.push). Blocks for the callbacks."""
        self._live.dispatch()

    def check_fenced(self) -> None:
        """WorkerReplacedError if the heartbeats learned that a newer process of this task joined. Never
        blocks."""
        if self._heartbeats.fenced is not None:
            raise self._heartbeats.fenced

    def call(self, shard: int, fn: Callable[[object, float], T], timeout: float | None = None) -> T:
        """fn(stub, deadline seconds) against `shard`, with this client's connection and retries (as every
        call it makes: an unreachable shard is retried until connect_timeout, then ServerUnavailableError);
        `timeout`: each attempt's deadline (default control_timeout). For helpers that add calls of their own
        (DataQueue). Blocks; raises what the call raises, mapped to torchps errors."""
        return self._fanout.call(shard, fn, self.control_timeout if timeout is None else timeout)

    # -- optimizer and step ---------------------------------------------------------------------

    def set_hyperparams(self, names: Iterable[str] | None = None, **hyperparams) -> int:
        """Changes optimizer hyperparameters (e.g. lr=0.01) of `names`, or of every trainable variable.

        Takes effect from the next update on each shard. Returns how many
        variables changed. OptimizerSpecError (nothing changed on that shard)
        for an unknown name or a value torch.optim refuses, NaN or Inf included.
        """
        values = wire_hyperparams(hyperparams)
        groups = self.placement.group(self.partitions.wire_names(names)) if names is not None else self._fanout.all_shards()

        def update(shard: int, shard_names: list[str], first: bool = True, again: bool = False) -> int:
            request = ps_pb2.UpdateOptimizerRequest(names=shard_names, hyperparams=values)
            return self._fanout.call(shard, lambda stub, t: stub.UpdateOptimizer(request, timeout=t),
                                     self.control_timeout).updated

        if names is None:
            return sum(self._fanout.each(groups, update).values())
        return sum(self._layout.each(groups, update).values())  # names that moved in a live resize: their owners

    # -- compression --------------------------------------------------------------------------------

    def set_compression(self, policies: Mapping[str, Compression]) -> None:
        """Sets how these variables travel from now on ({name: Compression}; the others keep theirs).

        Declare partitioned variables first (register_module does): each piece
        then follows its variable's policy, min_bytes counting per piece.

        Each push is encoded once (a retry resends the same bytes); a shard's
        residuals (error feedback) move on once it applied its part, so if a
        push raises, the residuals of what was not applied are as they were.
        In-place pulls (pull_into, exchange) ask for the policy's cast; pull()
        and export_state_dict() read values as stored. Never blocks;
        ClusterConfigError (nothing set) for a value that is not a Compression.
        """
        self._encoder.set_policies({wire_name: policy for name, policy in policies.items()
                                    for wire_name in self.partitions.wire_names([name])})

    def compression_state_dict(self) -> dict[str, torch.Tensor]:
        """The error-feedback residuals, {variable: tensor} on CPU, for torch.save. Call it between pushes."""
        return self._encoder.residuals.state_dict()

    def load_compression_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replaces the residuals with saved ones (compression_state_dict's); ClusterConfigError, nothing
        changed, if `state` is not one. Call it between pushes."""
        self._encoder.residuals.load_state_dict(state)

    def global_step(self) -> int:
        """The global step (shard 0's counter of applied pushes). Blocks for one round trip."""
        return self.status(GLOBAL_STEP_SHARD).step

    def _lane_port(self, shard: int) -> int:
        """The shard's bulk-lane port (0: none), asked without waiting long for a shard that is down: its call
        then goes inline, and the call's own retries wait for the shard."""
        return self._fanout.call(shard, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t),
                                 self.control_timeout, retry_for=LANE_PORT_RETRY_SECONDS).lane_port

    def status(self, shard: int, joined_of: Iterable[str] = ()) -> ps_pb2.StatusResponse:
        """One shard's status (index, step, variable count, bytes, pid, counters); its `not_joined` lists the
        names of `joined_of` that never joined the job there. Never waits for training."""
        request = ps_pb2.StatusRequest(joined_of=list(joined_of))
        return self._fanout.call(shard, lambda stub, t: stub.GetStatus(request, timeout=t), self.control_timeout)

    # -- modules --------------------------------------------------------------------------------

    def register_module(self, module: torch.nn.Module, optimizer: Optimizer | None = None, *,
                        create: bool | None = None, prefix: str = "", wait_timeout: float = 600.0,
                        join: bool = True, compression: Compression | Mapping[str, Compression] | None = None,
                        overlap: bool = False, overlap_inflight_bytes: int = OVERLAP_INFLIGHT_BYTES,
                        dense: str = "ps", process_group=None, dense_optimizer: torch.optim.Optimizer | None = None,
                        delta_pulls: bool = False):
        """Binds a module's parameters to variables named prefix + parameter name.

        With create (default: this client is the chief), creates them from the
        module's current values; otherwise waits up to `wait_timeout` s for the
        chief to create them (WaitTimeoutError names the missing ones). With
        join (workers; not evaluators) it then joins the job (see join()).
        Either way it ends with a pull (blocking, with or without overlap), so
        the module holds the shared values. `compression`: one Compression for
        every parameter, or {parameter name or prefix: Compression} (the
        longest match wins; see set_compression). With `overlap`, the
        binding's push streams each gradient to its shards while backward
        runs (at most `overlap_inflight_bytes` per shard encoded and not yet
        sent before backward waits) and its pull streams the values while
        forward runs, each submodule waiting for its own parameters only (see
        ModuleBinding). With `delta_pulls`, the binding's pulls fetch only
        what changed since the values its parameters hold, where the shards
        know it (PSClient.pull_into's `bases`; CPU parameters; not with
        overlap: ClusterConfigError). Returns a ModuleBinding with pull(), push(),
        exchange() and wait(). If it raises, nothing is bound (the module
        keeps no hooks); variables created or joined stay so.

        Embedding and EmbeddingBag submodules (torchps.client.embedding) are
        tables on the shards, named prefix + their path + ".weight": created
        with the variables (their own optimizer, else `optimizer` if it is
        sgd or adagrad) or waited for alike; their row gradients ride in the
        binding's pushes. Not with overlap (ClusterConfigError: not yet).

        dense="allreduce" (the hybrid; client/allreduce.py): the dense
        parameters are not variables on the shards but averaged over
        `process_group` (an AllreduceGroup) every step and stepped by a local
        torch.optim optimizer (`dense_optimizer`, else the one `optimizer`
        names); only the tables live on the shards. Every member starts from
        the chief's values (a broadcast, which blocks until every member
        registered, at most the group's timeout; AllreduceError if a member is
        lost). Returns a HybridBinding; not with overlap or compression.
        """
        from .module import ModuleBinding

        if dense != "ps":
            if dense != "allreduce":
                raise ClusterConfigError(f"dense must be 'ps' or 'allreduce'. Received: {dense!r}")
            if overlap or compression is not None or delta_pulls:
                raise ClusterConfigError("dense='allreduce' sends no dense parameter to the shards: no overlap, "
                                         "compression or delta pulls")
            from .hybrid import _register_allreduce

            return _register_allreduce(self, module, optimizer, process_group,
                                       create=self.is_chief if create is None else create, prefix=prefix,
                                       wait_timeout=wait_timeout, join=join, dense_optimizer=dense_optimizer)

        if isinstance(overlap_inflight_bytes, bool) or not isinstance(overlap_inflight_bytes, int) \
                or overlap_inflight_bytes < 1:
            raise ClusterConfigError(f"overlap_inflight_bytes must be a positive integer. "
                                     f"Received: {overlap_inflight_bytes!r}")
        if overlap and delta_pulls:
            raise ClusterConfigError("delta_pulls=True with overlap=True: not yet; choose one")
        tables = tables_in(module, prefix)
        if tables and overlap:
            raise ClusterConfigError("overlap=True with Embedding or EmbeddingBag tables: not yet; register the "
                                     "module without overlap")
        table_specs = [table.table_spec(name, optimizer) for name, table in tables.items()]
        named = {prefix + name: p for name, p in module.named_parameters()}
        params = {name: p.detach().cpu() for name, p in named.items()}
        self.declare(params)
        if compression is not None:
            self.set_compression({prefix + name: policy for name, policy in policies_for(
                [name for name, _ in module.named_parameters()], compression).items()})
        create = self.is_chief if create is None else create
        if create:
            self.create_variables(params, optimizer)
            self._own(named, (optimizer or Optimizer("none")).to_proto())  # a refill takes their values now
            if tables:
                self.create_tables(table_specs)
        else:
            _LOGGER.info("waiting up to %g s for %d variables and %d tables from the chief", wait_timeout,
                         len(params), len(tables))
            self.wait_for_variables(params, wait_timeout)
            if tables:
                self.wait_for_tables(tables, wait_timeout)
        for name, table in tables.items():
            table.check_spec(self.table_layout(name).spec)
        if join:
            self.join()
        binding = ModuleBinding(self, module, prefix, delta_pulls=delta_pulls)
        binding.pull()
        if overlap:
            binding = ModuleBinding(self, module, prefix, overlap=True, inflight_bytes=overlap_inflight_bytes)
        self._bind_tables(tables)
        return binding

    def _bind_tables(self, tables: Mapping[str, torch.nn.Module]) -> None:
        """Binds each module to its table (ShardedTable.bind) and keeps its padding_idx, whose row
        export_state_dict zeroes as torch's modules keep it. Never blocks."""
        for name, table in tables.items():
            table.bind(self, name)
            self._table_padding[name] = table.padding_idx
