"""The shard's job-structure RPCs, a part of its servicer (servicer.ParameterServerServicer mixes it in):
embedding tables (CreateTables, LookupRows, ListTables), data queues (ps 0's: CreateDataQueue,
TakeDataShard, GetDataQueue) and live resizes (GetLayout, SetLayout, ExportVariables, ImportVariables). Each
body is blocking code on the shard's pool (edge.py). The mixin reads the servicer's store, coordinator,
authority, index, quotas and queue desk.
"""

from __future__ import annotations

import logging
import math

from .. import codec, rows, wire
from ..errors import InvalidArgumentError, MalformedStreamError, ModeConflictError, PermissionDeniedError
from ..proto import ps_pb2
from .dataqueue import QueueSpec
from .rpc_support import MAX_LIST_WAIT_SECONDS, decoded, map_errors, require_active

__all__ = ["JobRPCs"]

_LOGGER = logging.getLogger(__name__)


class JobRPCs:
    """Table, data-queue and live-resize RPCs of ParameterServerServicer."""

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
        """Yields serialized PullResponses (wire.py) with each table's rows, read by tables.TableStore.lookup."""
        if request.admit and self.authority.caller("LookupRows", context).role == "evaluator":
            raise PermissionDeniedError(f"ps {self.index} refused an admitting LookupRows from an evaluator: "
                                        f"evaluators read rows without admit")
        if request.chunk_bytes and request.chunk_bytes < codec.MIN_CHUNK_BYTES:
            raise InvalidArgumentError(f"chunk_bytes must be 0 or at least {codec.MIN_CHUNK_BYTES}. "
                                       f"Received: {request.chunk_bytes}")
        chunk_bytes = min(request.chunk_bytes or codec.DEFAULT_CHUNK_BYTES, self.max_chunk_bytes)
        names = [t.name for t in request.tables]
        if request.admit and self.quotas.max_memory:  # dynamic tables grow by admitting: within --max-memory
            tables = self.coordinator.tables
            dynamic = [name for name in names if not tables.get(name).table.fixed]
            if dynamic:
                self.quotas.check_admission(self.held_total(), dynamic)
        found = self.coordinator.lookup_rows([(t.name, rows.ids_from_bytes(t.ids)) for t in request.tables],
                                             admit=request.admit)
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

    # -- live resize (moves.py, layout.py) ------------------------------------------------------------

    @map_errors
    def GetLayout(self, request, context):
        epoch, addresses, placement = self.coordinator.layout.layout()
        held = self.coordinator.tables.held()
        members, grace_left = self.coordinator.moves.job_members()
        return ps_pb2.Layout(epoch=epoch, addresses=addresses, placement=placement, outbox=[
            ps_pb2.MoveRequest(names=names, epoch=epoch, to=to) for names, to in self.coordinator.layout.outbox()],
            hold_from_step=self.coordinator.layout.hold_from, quiet=self.coordinator.moves.quiet(),
            table_shards=self.coordinator.layout.table_shards or (held[0].num_shards if held else 0),
            members=[ps_pb2.JobMember(worker=worker, incarnation=entry["incarnation"],
                                      counts_from=entry["counts_from"], gone=entry["gone"],
                                      silent_seconds=entry["silent"])
                     for worker, entry in sorted(members.items())], grace_left_seconds=grace_left)

    @map_errors
    def SetLayout(self, request, context):
        members = {m.worker: {"incarnation": m.incarnation, "counts_from": m.counts_from, "gone": m.gone, "clock": 0,
                              "silent": m.silent_seconds} for m in request.members}
        if self.coordinator.moves.set_layout(request.epoch, list(request.addresses), dict(request.placement),
                                             request.hold_from_step, request.table_shards, members,
                                             request.grace_left_seconds):
            hold = self.coordinator.layout.hold_from
            relaying = self.coordinator.layout.table_shards
            _LOGGER.info("ps %d: layout epoch %d, %d shards, %d variables placed%s%s", self.index, request.epoch,
                         len(request.addresses), len(request.placement),
                         f", pushes from step {hold} held" if hold else "",
                         f", embedding tables re-laid out onto {relaying} shards" if relaying else "")
        return self.GetLayout(request, context)

    @map_errors
    def ExportVariables(self, request, context):
        """Yields the exported state in chunks of at most max_chunk_bytes (moves.Moves.export)."""
        if request.tables:
            if request.names:
                raise InvalidArgumentError("an export of table rows names no variables")
            data, step = self.coordinator.moves.export_tables(request.epoch, request.to)
        else:
            data, step = self.coordinator.moves.export(list(request.names), request.epoch, request.to)
        _LOGGER.info("ps %d: %s (%d bytes) exported to ps %d at layout epoch %d", self.index,
                     "embedding-table rows" if request.tables else f"{len(request.names)} variables", len(data),
                     request.to, request.epoch)
        view = memoryview(data)
        for offset in range(0, max(1, len(data)), self.max_chunk_bytes):
            first = {"epoch": request.epoch, "from_shard": self.index, "step": step, "total_bytes": len(data),
                     "tables": request.tables}
            yield ps_pb2.MoveChunk(data=bytes(view[offset:offset + self.max_chunk_bytes]),
                                   **(first if offset == 0 else {}))

    @map_errors
    def ImportVariables(self, request_iterator, context):
        """Takes an exported state (moves.Moves.import_) once every byte its first chunk declared arrived."""
        data, head = bytearray(), None
        for chunk in decoded(request_iterator, ps_pb2.MoveChunk.FromString):
            if head is None:
                head = chunk
                self.quotas.check_total(self.held_total(), {"imported variables": 2 * chunk.total_bytes})
            data += chunk.data
            if len(data) > head.total_bytes:
                raise MalformedStreamError(f"the moved state is longer than the {head.total_bytes} bytes declared")
        require_active(context)
        if head is None or len(data) != head.total_bytes:
            raise MalformedStreamError(f"the moved state ended after {len(data)} of "
                                       f"{0 if head is None else head.total_bytes} bytes; nothing was imported")
        if head.tables:
            names = self.coordinator.moves.import_tables(bytes(data), head.epoch, head.from_shard, head.step)
            _LOGGER.info("ps %d: embedding-table rows of ps %d imported at layout epoch %d%s", self.index,
                         head.from_shard, head.epoch, f"; tables {names} built" if names else "")
            return ps_pb2.MoveResponse(names=names, step=self.store.step)
        names = self.coordinator.moves.import_(bytes(data), head.epoch, head.step)
        _LOGGER.info("ps %d: %d variables imported from ps %d at layout epoch %d", self.index, len(names),
                     head.from_shard, head.epoch)
        return ps_pb2.MoveResponse(names=names, step=self.store.step)


def _wait_seconds(seconds: float) -> float:
    """A request's wait_seconds; InvalidArgumentError unless finite and >= 0."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise InvalidArgumentError(f"wait_seconds must be finite and >= 0. Received: {seconds}")
    return seconds


def _data_shard(queue: str, lease) -> ps_pb2.DataShard:
    return ps_pb2.DataShard(queue=queue, lease=lease.id, epoch=lease.epoch, begin=lease.begin, end=lease.end,
                            progress=lease.progress)
