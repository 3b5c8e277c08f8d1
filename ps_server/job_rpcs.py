"""The shard's job-structure RPCs, a part of its servicer (servicer.ParameterServerServicer mixes it in):
embedding tables (CreateTables, LookupRows, ListTables) and data queues (ps 0's: CreateDataQueue,
TakeDataShard, GetDataQueue); live resizes are resize_rpcs.py's. Each
body is blocking code on the shard's pool (edge.py). The mixin reads the servicer's store, coordinator,
authority, index, quotas and queue desk.
"""

from __future__ import annotations

import logging
import math

from .. import codec, rows, wire
from ..errors import InvalidArgumentError, ModeConflictError, PermissionDeniedError
from ..proto import ps_pb2
from .dataqueue import QueueSpec
from .rpc_support import MAX_LIST_WAIT_SECONDS, map_errors

__all__ = ["JobRPCs"]

_LOGGER = logging.getLogger(__name__)


class JobRPCs:
    """Table and data-queue RPCs of ParameterServerServicer."""

    @map_errors
    def CreateTables(self, request, context):
        if request.shard_index != self.index:
            raise ModeConflictError(f"this is ps {self.index}; the request was made for ps {request.shard_index}")
        with self._creating:  # against CreateVariables: one namespace, one memory quota
            def check_memory(adding: dict[str, int]) -> None:
                self.quotas.check_total(self.held_total(), adding)

            created = self.coordinator.create_tables(list(request.tables), request.shard_index, request.num_shards,
                                                     check_memory=check_memory)
        return ps_pb2.CreateTablesResponse(created=created, generation=self.generation)

    @map_errors
    def LookupRows(self, request, context):
        """Yields serialized PullResponses (wire.py) with each table's rows, read by tables.TableStore.lookup;
        then the rows announced as upcoming are read into SSD tables' caches in the background."""
        if request.admit and self.authority.caller("LookupRows", context).role == "evaluator":
            raise PermissionDeniedError(f"ps {self.index} refused an admitting LookupRows from an evaluator: "
                                        f"evaluators read rows without admit")
        if request.chunk_bytes and request.chunk_bytes < codec.MIN_CHUNK_BYTES:
            raise InvalidArgumentError(f"chunk_bytes must be 0 or at least {codec.MIN_CHUNK_BYTES}. "
                                       f"Received: {request.chunk_bytes}")
        chunk_bytes = min(request.chunk_bytes or codec.DEFAULT_CHUNK_BYTES, self.max_chunk_bytes)
        names = [t.name for t in request.tables]
        tables = self.coordinator.tables
        if request.admit and self.quotas.max_memory:  # dynamic tables grow by admitting: within --max-memory
            dynamic = [name for name in names if tables.get(name).table.admits]
            if dynamic:
                self.quotas.check_admission(self.held_total(), dynamic)
        upcoming = tables.check_upcoming([(t.name, rows.ids_from_bytes(t.ids)) for t in request.upcoming])
        found = self.coordinator.lookup_rows([(t.name, rows.ids_from_bytes(t.ids)) for t in request.tables],
                                             admit=request.admit)
        tables.warm(upcoming)
        step = self.store.step
        pieces = (piece for name, value in zip(names, found) for piece in wire.tensor_pieces(name, value, chunk_bytes))
        sent = False
        for batch in wire.pack(pieces, chunk_bytes):
            sent = True
            self.pull_bytes.add(sum(len(piece[3]) for piece in batch))
            yield wire.encode_pull_response(batch, step)
        if not sent:
            yield wire.encode_pull_response([], step)

    @map_errors
    def ListTables(self, request, context):
        names = list(request.names)
        if not (math.isfinite(request.wait_seconds) and request.wait_seconds >= 0):
            raise InvalidArgumentError(f"wait_seconds must be finite and >= 0. Received: {request.wait_seconds}")
        tables = self.coordinator.tables
        if names and request.wait_seconds > 0:
            context.add_callback(tables.wake)
            with self.coordinator.waits.slot("list"):
                tables.wait_for(names, min(request.wait_seconds, MAX_LIST_WAIT_SECONDS),
                                lambda: not context.is_active())
        return ps_pb2.ListTablesResponse(tables=tables.infos(names or None), step=self.store.step,
                                         generation=self.generation)

    # -- data queues (dynamic sharding) -----------------------------------------------------------

    @map_errors
    def CreateDataQueue(self, request, context):
        spec = QueueSpec(request.name, request.num_examples, request.shard_size, request.epochs, request.seed)
        return ps_pb2.CreateDataQueueResponse(created=self.queue_desk.create(spec))

    @map_errors
    def TakeDataShard(self, request, context):
        self._check_self(context, request.worker, "TakeDataShard")
        wait = _wait_seconds(request.wait_seconds)
        context.add_callback(self.coordinator.wake)
        lease, finished = self.queue_desk.take(request.queue, request.worker, request.incarnation, wait,
                                               lambda: not context.is_active())
        return ps_pb2.TakeDataShardResponse(shard=_data_shard(request.queue, lease) if lease else None,
                                            finished=finished)

    @map_errors
    def GetDataQueue(self, request, context):
        wait = _wait_seconds(request.wait_seconds)
        context.add_callback(self.coordinator.wake)
        status = self.queue_desk.status(request.name, wait, lambda: not context.is_active())
        spec = status["spec"]
        return ps_pb2.DataQueueStatus(
            spec=ps_pb2.DataQueueSpec(name=spec.name, num_examples=spec.num_examples, shard_size=spec.shard_size,
                                      epochs=spec.epochs, seed=spec.seed),
            epoch=status["epoch"], trained=status["trained"], epochs_done=status["epochs_done"],
            finished=status["finished"], shards_done=status["shards_done"],
            held=[_data_shard(spec.name, lease) for lease in status["held"]],
            holders=[lease.worker for lease in status["held"]], reclaimed=status["reclaimed"],
            requeued_examples=status["requeued_examples"], duplicates=status["duplicates"])


def _wait_seconds(seconds: float) -> float:
    """A request's wait_seconds; InvalidArgumentError unless finite and >= 0."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise InvalidArgumentError(f"wait_seconds must be finite and >= 0. Received: {seconds}")
    return seconds


def _data_shard(queue: str, lease) -> ps_pb2.DataShard:
    return ps_pb2.DataShard(queue=queue, lease=lease.id, epoch=lease.epoch, begin=lease.begin, end=lease.end,
                            progress=lease.progress)
