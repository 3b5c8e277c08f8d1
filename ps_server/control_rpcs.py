"""The shard's control RPCs, a part of its servicer (servicer.ParameterServerServicer mixes it in): status,
the mode, membership (Join, Heartbeat, Leave), checkpoints (Save, CommitCheckpoint) and Shutdown. Each body
is blocking code on the shard's pool (edge.py), GetStatus on the event loop itself. The mixin reads the
servicer's store, coordinator, authority, index, generation, checkpoint folder, counters and replication.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from ..errors import CheckpointError, InvalidArgumentError, ModeConflictError, PSError, ServerUnavailableError
from ..partitioning import check_manifest
from ..placement import Placement
from ..proto import ps_pb2
from . import checkpoint
from .auth import Caller
from .coordinator import MAX_STEP
from .edge import CallContext
from .modes import SyncConfig
from .quotas import optimizer_slots
from .rpc_support import map_errors, remaining, step_authority

__all__ = ["ControlRPCs", "MAX_JOINED_OF", "config_from_proto", "config_to_proto"]

_LOGGER = logging.getLogger(__name__)
MAX_JOINED_OF = 65536  # StatusRequest.joined_of: names looked up in one GetStatus


class ControlRPCs:
    """Status, mode, membership, checkpoint and shutdown RPCs of ParameterServerServicer."""

    def held_bytes(self) -> tuple[int, int]:
        """(bytes of values, bytes of optimizer state, as the hyperparameters in force keep it) of the
        variables the shard holds."""
        variables = [self.store.get(name) for name in self.store.names()]
        values = sum(v.nbytes for v in variables)
        return values, sum(v.nbytes * optimizer_slots(v.optimizer.name, v.optimizer.current()) for v in variables)

    def held_total(self) -> int:
        """What the memory quota counts as held: variables with their optimizer state, and embedding tables."""
        return sum(self.held_bytes()) + self.coordinator.tables.nbytes()

    @map_errors
    def GetStatus(self, request, context):
        coordinator = self.coordinator
        if len(request.joined_of) > MAX_JOINED_OF:
            raise InvalidArgumentError(f"GetStatus looks up at most {MAX_JOINED_OF} names in joined_of. "
                                       f"Received: {len(request.joined_of)}")
        values, state = self.held_bytes()
        names = list(request.joined_of)
        awaited_step, awaited_pushes, awaited_pushers = coordinator.awaited()
        return ps_pb2.StatusResponse(
            index=self.index, step=self.store.step, num_variables=len(self.store.names()), total_bytes=values,
            state_bytes=state, pid=os.getpid(),
            memory=ps_pb2.MemoryUsage(**self.memory.get(), kept_receive_bytes=self.receive_buffers.free_bytes,
                                      receive_buffers_reused=self.receive_buffers.reused,
                                      pull_cache_bytes=self.pull_cache.nbytes, pull_cache_hits=self.pull_cache.hits),
            metrics_port=self.metrics_port,
            lane_port=self.lanes.port if self.lanes is not None else 0,
            paces=[ps_pb2.WorkerPace(worker=w, push_interval_seconds=i, straggler_score=score)
                   for w, (i, score) in coordinator.paces().items()],
            config=config_to_proto(coordinator.config), generation=self.generation,
            restored_step=coordinator.restored_step, checkpoints=bool(self.checkpoint_dir),
            calls_started=self.calls_started.value, calls_done=self.calls_done.value,
            push_bytes_received=self.push_bytes.value, tables=coordinator.tables.status(),
            layout_epoch=coordinator.layout.epoch, not_joined=coordinator.never_joined(names),
            members=[ps_pb2.MemberStatus(worker=w, state=s, pushes=p, last_push_step=last, restarts=r)
                     for w, s, p, last, r in coordinator.standing(names)],
            awaited_step=awaited_step, awaited_pushes=awaited_pushes, awaited_pushers=awaited_pushers,
            awaits_backup=self.replication.awaited_backup if self.replication is not None else "",
            replication=self.replication.status() if self.replication is not None else None,
            tables_on_disk=coordinator.tables.storage.on_disk, **coordinator.counters())

    @map_errors
    def Configure(self, request, context):
        return ps_pb2.ConfigureResponse(changed=self.coordinator.configure(config_from_proto(request)))

    def _check_self(self, context: CallContext, worker: str, method: str) -> Caller:
        """The caller; PermissionDeniedError if a named worker names another worker in its request."""
        caller = self.authority.caller(method, context)
        self.authority.check_self(caller, worker, method)
        return caller

    @map_errors
    def Join(self, request, context):
        caller = self._check_self(context, request.worker, "Join")
        step = self.coordinator.join(request.worker, request.incarnation, request.step, by=step_authority(caller))
        return ps_pb2.JoinResponse(step=step, config=config_to_proto(self.coordinator.config),
                                   generation=self.generation, restarted=self.coordinator.restarted(request.worker),
                                   live_workers=self.coordinator.live_workers(),
                                   layout_epoch=self.coordinator.layout.epoch)

    @map_errors
    def Heartbeat(self, request, context):
        caller = self._check_self(context, request.worker, "Heartbeat")
        step = self.coordinator.heartbeat(request.worker, request.incarnation, request.step,
                                          by=step_authority(caller))
        return ps_pb2.HeartbeatResponse(step=step, generation=self.generation,
                                        live_workers=self.coordinator.live_workers(),
                                        layout_epoch=self.coordinator.layout.epoch)

    @map_errors
    def Leave(self, request, context):
        self._check_self(context, request.worker, "Leave")
        self.coordinator.leave(request.worker, request.incarnation)
        return ps_pb2.LeaveResponse()

    @map_errors
    def Save(self, request, context):
        """Writes this shard's state at the checkpoint's step (snapshots.py): variables and every embedding
        table (table_state.py), copied at one instant under the apply gate. Blocks until the shard reaches
        the step (at most the call's deadline), then for the copy and the file's write and fsync; if it
        raises, no file of this shard counts for the checkpoint (shard 0 will not commit it). UNAVAILABLE while
        it may not write one (_require_saving), asked before the wait and again before the write."""
        if not 0 <= request.step <= MAX_STEP:
            raise InvalidArgumentError(f"step must be in [0, {MAX_STEP}]. Received: {request.step}")
        self._require_checkpoints()
        self._require_saving()
        started = time.monotonic()
        context.add_callback(self.coordinator.wake)
        state = self.coordinator.snapshot_at(request.step, remaining(context), lambda: not context.is_active(),
                                             now=request.now)
        self._require_saving()
        try:
            path, size = checkpoint.write_shard(self.checkpoint_dir, self.index, request.step, state,
                                                full=request.full)
        except OSError as exc:
            raise CheckpointError(f"ps {self.index} could not write its checkpoint under {self.checkpoint_dir}: "
                                  f"{exc}") from None
        _LOGGER.info("ps %d saved its state at step %d for checkpoint %d (%s, %d bytes)", self.index, state["step"],
                     request.step, path, size)
        if self.metrics is not None:
            self.metrics.saved(time.monotonic() - started)
        return ps_pb2.SaveResponse(step=state["step"], path=str(path), bytes=size, index=self.index,
                                   layout_epoch=state.get("layout", {}).get("epoch", 0))

    @map_errors
    def CommitCheckpoint(self, request, context):
        """Shard 0 commits a checkpoint every shard saved: checks each file (size, table section) and writes
        the manifest with the client's placement and the tables the files hold (checkpoint.commit). Blocks
        for the checks and writes; if it raises, the checkpoint is not committed. UNAVAILABLE while this shard
        may not write one (_require_saving)."""
        self._require_checkpoints()
        if not 0 <= request.step <= MAX_STEP:
            raise InvalidArgumentError(f"step must be in [0, {MAX_STEP}]. Received: {request.step}")
        if self.index != 0:
            raise ModeConflictError(f"ps {self.index} does not commit checkpoints; ask ps 0")
        manifest = _placement_manifest(request.manifest_json)
        shards = [(s.index, s.bytes, s.step, s.layout_epoch) for s in request.shards]
        self._require_saving()
        try:
            path = checkpoint.commit(self.checkpoint_dir, request.step, manifest, shards, request.keep)
        except OSError as exc:
            raise CheckpointError(f"ps 0 could not commit checkpoint {request.step}: {exc}") from None
        _LOGGER.info("checkpoint %d committed (%s)", request.step, path)
        return ps_pb2.CommitResponse(path=str(path))

    def _require_saving(self) -> None:
        """ServerUnavailableError (retried) while this shard may not write a checkpoint (Replication.saving_refused:
        its backup may have been promoted in its place, so what it would write could miss changes the promoted
        one acknowledged; or, promoted itself, it does not hold its part of the checkpoint folder yet)."""
        refused = self.replication.saving_refused() if self.replication is not None else None
        if refused:
            raise ServerUnavailableError(f"{refused}; retry")

    def _require_checkpoints(self) -> None:
        if not self.checkpoint_dir:
            raise ModeConflictError(f"ps {self.index} has no checkpoint directory: start ps-server with --checkpoint-dir")

    # -- embedding tables ---------------------------------------------------------------------

    @map_errors
    def Shutdown(self, request, context):
        _LOGGER.info("ps %d: shutdown requested (%s)", self.index, request.reason or "no reason given")
        self.coordinator.finish(request.reason or "shutdown requested")  # the job is done: its journal says so
        if self.on_shutdown is not None:
            context.add_callback(lambda: self.on_shutdown(request.reason))
        return ps_pb2.ShutdownResponse()


def _placement_manifest(text: str) -> dict:
    """The client's placement manifest, checked the way a restore will read it; InvalidArgumentError if not."""
    try:
        manifest = json.loads(text)
        num_ps, strategy, variables = manifest["num_ps"], manifest["strategy"], manifest["variables"]
        if not isinstance(num_ps, int) or not 1 <= num_ps <= 100_000:
            raise ValueError(f"num_ps must be in [1, 100000], got {num_ps!r}")
        placement = Placement(num_ps, strategy)
        for name, nbytes in variables:
            if not isinstance(name, str) or not isinstance(nbytes, int) or nbytes < 0:
                raise ValueError(f"variables must be [name, bytes] pairs, got {[name, nbytes]!r}")
            placement.add(name, nbytes)
        check_manifest(manifest.get("partitions") or {"splits": {}})
    except (ValueError, KeyError, TypeError, PSError) as exc:
        raise InvalidArgumentError(f"manifest_json is not a placement manifest: {exc}") from None
    return manifest


def config_from_proto(message: ps_pb2.SyncConfig) -> SyncConfig:
    """SyncConfig from its message; zero lease, grace and progress timeout take the defaults."""
    defaults = SyncConfig()
    return SyncConfig(
        mode=message.mode or "async", replicas_to_aggregate=message.replicas_to_aggregate,
        total_num_replicas=message.total_num_replicas, max_staleness=message.max_staleness,
        lease_seconds=message.lease_seconds or defaults.lease_seconds,
        startup_grace_seconds=message.startup_grace_seconds or defaults.startup_grace_seconds,
        progress_seconds=message.progress_seconds or defaults.progress_seconds,
        replicas_fraction=message.replicas_fraction)


def config_to_proto(config: SyncConfig) -> ps_pb2.SyncConfig:
    return ps_pb2.SyncConfig(**dataclasses.asdict(config))
