"""The shard's live-resize RPCs, a part of its servicer (servicer.ParameterServerServicer mixes it in): the
layout (GetLayout, SetLayout), moves (ExportVariables, ImportVariables, ConfirmMove) and ps 0's record of the
job's resize (Resize). Each body is blocking code on the shard's pool (edge.py); the changes are
moves.Moves's (and resizes.ResizeOwner's). The mixin reads the servicer's coordinator, index, quotas and chunk
size.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from ..errors import InvalidArgumentError, MalformedStreamError
from ..proto import ps_pb2
from .layout import MAX_SHARDS
from .replica_rpcs import replicas_of
from .resizes import PHASES, STATUSES
from .rpc_support import decoded, map_errors, require_active

__all__ = ["ResizeRPCs", "resize_state_of"]

_LOGGER = logging.getLogger(__name__)
_ACTIONS = ps_pb2.ResizeRequest.Action
_TABLE_STEPS = {ps_pb2.Layout.BY_COUNT: "", ps_pb2.Layout.BEGIN: "begin", ps_pb2.Layout.END: "end"}
MAX_WATCH_SECONDS = 10.0  # GetLayout's longest long poll


def resize_state_of(record: dict) -> ps_pb2.ResizeState:
    """ResizeOwner.state()'s record as its message."""
    return ps_pb2.ResizeState(
        id=record["id"], phase=PHASES.index(record["phase"]), driver=record["driver"], before=record["before"],
        after=record["after"], hold_from_step=record["hold"], lease_seconds=record["lease"],
        lease_left_seconds=record["lease_left"], ended_why=record["why"],
        table_shards=(record["tables"] or {}).get("count", 0), tables_from=(record["tables"] or {}).get("from", 0),
        tables_built=(record["tables"] or {}).get("built", False),
        moves=[ps_pb2.ResizeMove(name=name, from_shard=source, to=target, bytes=nbytes,
                                 status=STATUSES.index(status))
               for name, source, target, nbytes, status in record["moves"]])


class ResizeRPCs:
    """Live-resize RPCs of ParameterServerServicer."""

    @map_errors
    def GetLayout(self, request, context):
        """The layout; with watch_primary, once the watched shard's record names another primary, or at the
        watch's end (ps.proto's LayoutRequest): a wait that holds no thread."""
        if request.watch_primary:
            if not 0 < request.watch_seconds <= MAX_WATCH_SECONDS:  # NaN too
                raise InvalidArgumentError(f"GetLayout's watch_seconds is in (0, {MAX_WATCH_SECONDS:g}]. "
                                           f"Received: {request.watch_seconds}")
            if request.watch_shard >= MAX_SHARDS:
                raise InvalidArgumentError(f"GetLayout's watch_shard is in [0, {MAX_SHARDS}). "
                                           f"Received: {request.watch_shard}")
            if self.coordinator.replicas is not None:
                deadline = time.monotonic() + request.watch_seconds
                with self.coordinator.waits.slot("layout"):
                    yield self.coordinator.replicas.promotion(request.watch_shard, request.watch_primary,
                                                              lambda: max(0.0, deadline - time.monotonic()),
                                                              lambda: not context.is_active())
        return self._layout()

    def _layout(self) -> ps_pb2.Layout:
        layout = self.coordinator.layout
        epoch, addresses, placement = layout.layout()
        held = self.coordinator.tables.held()
        members, grace_left = self.coordinator.moves.job_members()
        lease, left = layout.hold_lease()
        return ps_pb2.Layout(epoch=epoch, addresses=addresses, placement=placement, outbox=[
            ps_pb2.MoveRequest(names=names, epoch=at, to=to) for names, to, at in layout.outbox()],
            hold_from_step=layout.hold_from, quiet=self.coordinator.moves.quiet(),
            table_shards=layout.table_shards or (held[0].num_shards if held else 0),
            members=[ps_pb2.JobMember(worker=worker, incarnation=entry["incarnation"],
                                      counts_from=entry["counts_from"], gone=entry["gone"],
                                      silent_seconds=entry["silent"])
                     for worker, entry in sorted(members.items())], grace_left_seconds=grace_left,
            hold_lease_seconds=lease, hold_lease_left_seconds=max(0.0, left) if math.isfinite(left) else 0.0,
            replicas=[replicas_of(index, entry) for index, entry in self.coordinator.replicas.entries()]
            if self.coordinator.replicas is not None else [])

    @map_errors
    def SetLayout(self, request, context):
        members = {m.worker: {"incarnation": m.incarnation, "counts_from": m.counts_from, "gone": m.gone, "clock": 0,
                              "silent": m.silent_seconds} for m in request.members}
        if self.coordinator.moves.set_layout(request.epoch, list(request.addresses), dict(request.placement),
                                             request.hold_from_step, request.table_shards, members,
                                             request.grace_left_seconds, request.hold_lease_seconds,
                                             _TABLE_STEPS.get(request.table_step, str(request.table_step))):
            hold = self.coordinator.layout.hold_from
            relaying = self.coordinator.layout.table_shards
            _LOGGER.info("ps %d: layout epoch %d, %d shards, %d variables placed%s%s", self.index, request.epoch,
                         len(request.addresses), len(request.placement),
                         f", pushes from step {hold} held" if hold else "",
                         f", embedding tables re-laid out onto {relaying} shards" if relaying else "")
        return self._layout()

    @map_errors
    def ExportVariables(self, request, context):
        """Yields the exported state in chunks of at most max_chunk_bytes (moves.Moves.export); table rows of
        tables kept on SSD follow their part, streamed from their kept copies, then their counts."""
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
        if request.tables:
            yield from self._stored_rows(request)

    def _stored_rows(self, request):
        """The rows of the tables kept on SSD that shard request.to owns, then their counts (none: nothing)."""
        moves = self.coordinator.moves
        stores = moves.layout.table_stores()
        if not stores:
            return
        sent, messages = {name: 0 for name in stores}, 0
        widest = max(int(kept["record_bytes"]) for kept in stores.values()) + 8
        for name, ids, records in moves.export_table_rows(request.epoch, request.to,
                                                          max(1, self.max_chunk_bytes // widest)):
            sent[name] += len(ids)
            messages += 1
            yield ps_pb2.MoveChunk(rows=ps_pb2.StoredRows(table=name, ids=ids.astype("<i8").tobytes(),
                                                          records=records.tobytes(),
                                                          record_bytes=records.shape[1]))
        _LOGGER.info("ps %d: rows of tables on SSD streamed to ps %d: %s in %d messages", self.index, request.to,
                     sent, messages)
        yield ps_pb2.MoveChunk(rows_done=sent)

    @map_errors
    def ImportVariables(self, request_iterator, context):
        """Takes an exported state (moves.Moves.import_) once every byte its first chunk declared arrived; table
        rows of tables kept on SSD are staged as they come after it (moves.Moves.import_tables)."""
        data, head = bytearray(), None
        chunks = decoded(request_iterator, ps_pb2.MoveChunk.FromString)
        for chunk in chunks:
            if head is None:
                head = chunk
                self.quotas.check_total(self.held_total(), {"imported variables": 2 * chunk.total_bytes})
            if chunk.HasField("rows") or chunk.rows_done:
                raise MalformedStreamError("table rows came before the part they belong to was whole")
            data += chunk.data
            if len(data) > head.total_bytes:
                raise MalformedStreamError(f"the moved state is longer than the {head.total_bytes} bytes declared")
            if len(data) == head.total_bytes and head.tables:
                break
        if head is None or len(data) != head.total_bytes:
            raise MalformedStreamError(f"the moved state ended after {len(data)} of "
                                       f"{0 if head is None else head.total_bytes} bytes; nothing was imported")
        if head.tables:
            counted: list[dict] = []
            names = self.coordinator.moves.import_tables(bytes(data), head.epoch, head.from_shard, head.step,
                                                         _rows_of(chunks, counted, context),
                                                         lambda: _counted(counted))
            _LOGGER.info("ps %d: embedding-table rows of ps %d imported at layout epoch %d%s", self.index,
                         head.from_shard, head.epoch, f"; tables {names} built" if names else "")
            return ps_pb2.MoveResponse(names=names, step=self.store.step)
        require_active(context)
        names = self.coordinator.moves.import_(bytes(data), head.epoch, head.step)
        _LOGGER.info("ps %d: %d variables imported from ps %d (exported at layout epoch %d)", self.index,
                     len(names), head.from_shard, head.epoch)
        return ps_pb2.MoveResponse(names=names, step=self.store.step)

    @map_errors
    def ConfirmMove(self, request, context):
        """Drops the kept exports shard `to` confirmed (moves.Moves.confirm)."""
        dropped = self.coordinator.moves.confirm(list(request.names), request.to)
        if dropped:
            _LOGGER.info("ps %d: ps %d confirmed %d variables; their kept state is dropped", self.index, request.to,
                         len(dropped))
        return ps_pb2.MoveResponse(names=dropped, step=self.store.step)

    @map_errors
    def Resize(self, request, context):
        """ps 0's record of the job's resize (resizes.ResizeOwner): one action of its driver."""
        action, resize_id, driver = request.action, request.id, request.driver
        if action == _ACTIONS.GET:
            change = lambda owner: None  # noqa: E731
        elif action == _ACTIONS.BEGIN:
            change = lambda owner: owner.begin(driver, list(request.before), list(request.after),  # noqa: E731
                                               request.lease_seconds)
        elif action == _ACTIONS.RENEW:
            change = lambda owner: owner.renew(resize_id, driver)  # noqa: E731
        elif action == _ACTIONS.TAKE_OVER:
            change = lambda owner: owner.take_over(resize_id, driver, request.lease_seconds)  # noqa: E731
        elif action == _ACTIONS.PLAN:
            moves = [(m.name, m.from_shard, m.to, m.bytes) for m in request.moves]
            change = lambda owner: owner.plan(resize_id, driver, moves, request.hold_from_step)  # noqa: E731
        elif action == _ACTIONS.MOVED:
            moves = [(m.name, STATUSES[m.status] if m.status < len(STATUSES) else str(m.status))
                     for m in request.moves]
            change = lambda owner: owner.moved(resize_id, driver, moves)  # noqa: E731
        elif action == _ACTIONS.TABLES:
            change = lambda owner: owner.tables(resize_id, driver, request.table_shards,  # noqa: E731
                                                request.tables_from, request.tables_built)
        elif action == _ACTIONS.END:
            phase = PHASES[request.phase] if request.phase < len(PHASES) else str(request.phase)
            change = lambda owner: owner.end(resize_id, driver, phase, request.why)  # noqa: E731
        else:
            raise InvalidArgumentError(f"unknown resize action {action}")
        record = self.coordinator.moves.resize(change)
        if action in (_ACTIONS.BEGIN, _ACTIONS.END):
            _LOGGER.info("ps %d: resize %d %s (%d -> %d shards, driver %s)%s", self.index, record["id"],
                         "begun" if action == _ACTIONS.BEGIN else record["phase"], len(record["before"]),
                         len(record["after"]), record["driver"], f": {record['why']}" if record["why"] else "")
        return resize_state_of(record)


def _rows_of(chunks, counted: list[dict], context):
    """(table, ids, records) of the StoredRows chunks that follow a part of table rows; the rows_done counts
    go into `counted`. MalformedStreamError for anything else, or for rows after the counts."""
    for chunk in chunks:
        if counted or chunk.data or not (chunk.HasField("rows") or chunk.rows_done):
            raise MalformedStreamError("after a part of table rows come only rows of tables on SSD, then their "
                                       "counts; nothing was imported")
        if chunk.rows_done:
            counted.append(dict(chunk.rows_done))
            continue
        rows = chunk.rows
        if not rows.record_bytes or len(rows.ids) % 8 or len(rows.records) != len(rows.ids) // 8 * rows.record_bytes:
            raise MalformedStreamError(f"rows of {rows.table!r}: {len(rows.ids)} bytes of ids and {len(rows.records)} "
                                       f"of records of {rows.record_bytes} bytes do not match")
        ids = np.frombuffer(rows.ids, dtype="<i8").astype(np.int64)
        yield rows.table, ids, np.frombuffer(rows.records, dtype=np.uint8).reshape(len(ids), rows.record_bytes)
    require_active(context)


def _counted(counted: list[dict]) -> dict:
    """The rows_done counts the stream ended with; MalformedStreamError if it ended without them (cut)."""
    if not counted:
        raise MalformedStreamError("the stream of table rows ended before their counts: it was cut; nothing was "
                                   "imported")
    return counted[0]
