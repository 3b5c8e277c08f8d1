"""The shard's serving-replica RPC, a part of its servicer (servicer.ParameterServerServicer mixes it in):
ReadChanges, what changed in the shard's embedding tables since a replica last read them, or a table read
whole (tables.py's TableStore.changes: each part read under its table's lock; a read never blocks a push for
longer than a part's copy). The mixin reads the servicer's coordinator, store and chunk size.
"""

from __future__ import annotations

from .. import codec
from ..errors import InvalidArgumentError
from ..proto import ps_pb2
from .rpc_support import map_errors

__all__ = ["ChangeRPCs"]

MIN_ROWS = 1  # a reply message holds at least one row
ID_BYTES = 9  # an id (int64) and its held byte, beside each row's values


class ChangeRPCs:
    """ReadChanges of ParameterServerServicer."""

    @map_errors
    def ReadChanges(self, request, context):
        """Yields each table's TableChanges messages (ps.proto), the tables by name, each table's read a
        message at a time (an SSD table's whole read streams its store)."""
        names, tables = [cursor.table for cursor in request.cursors], list(request.tables)
        for what, listed in (("names a table", names), ("lists a table to read", tables)):
            if len(set(listed)) != len(listed):
                raise InvalidArgumentError(f"a ReadChanges request {what} more than once: {sorted(listed)}")
        cursors = {c.table: (c.incarnation, c.seq) for c in request.cursors}
        step = self.store.step

        def per_message(held) -> int:
            row_bytes = held.table.dim * held.table.dtype.itemsize + ID_BYTES  # a row's values, its id, held byte
            return max(MIN_ROWS, min(request.max_rows or self.max_chunk_bytes // row_bytes,
                                     self.max_chunk_bytes // row_bytes))

        for name, held, parts in self.coordinator.tables.changes(cursors, request.min_updates, tables, per_message):
            part, first = next(parts), True
            while part is not None:
                following = next(parts, None)
                incarnation, seq, whole, ids, rows, kept = part
                yield ps_pb2.TableChanges(
                    table=name, incarnation=incarnation, seq=seq, whole=whole, first=first, last=following is None,
                    dim=held.table.dim, dtype=codec.wire_dtype(rows.dtype),
                    ids=ids.numpy().astype("<i8").tobytes(), rows=codec.tensor_bytes(rows).tobytes(),
                    held=kept.numpy().astype("u1").tobytes(), step=step, partition=held.spec.partition,
                    num_shards=held.num_shards, shard=self.index,
                    num_embeddings=held.spec.num_embeddings).SerializeToString()
                part, first = following, False
