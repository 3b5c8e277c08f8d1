"""The shard's serving-replica RPC, a part of its servicer (servicer.ParameterServerServicer mixes it in):
ReadChanges, what changed in the shard's embedding tables since a replica last read them (tables.py's
TableStore.changes: each table read at one moment under its own lock; a read never blocks a push for longer
than that copy). The mixin reads the servicer's coordinator, store and chunk size.
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
        """Yields each table's TableChanges messages (ps.proto), the tables by name."""
        names = [cursor.table for cursor in request.cursors]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"a ReadChanges request names a table more than once: {sorted(names)}")
        cursors = {c.table: (c.incarnation, c.seq) for c in request.cursors}
        step = self.store.step
        changed = self.coordinator.tables.changes(cursors, request.min_updates)
        for name, held, (incarnation, seq, whole, ids, rows, kept) in changed:
            row_bytes = held.table.dim * rows.element_size() + ID_BYTES  # a row's values, its id and held byte
            per_message = max(MIN_ROWS, min(request.max_rows or self.max_chunk_bytes // row_bytes,
                                            self.max_chunk_bytes // row_bytes))
            starts = range(0, max(1, len(ids)), per_message)
            for start in starts:
                part = slice(start, start + per_message)
                yield ps_pb2.TableChanges(
                    table=name, incarnation=incarnation, seq=seq, whole=whole, first=start == 0,
                    last=start + per_message >= len(ids), dim=held.table.dim, dtype=codec.wire_dtype(rows.dtype),
                    ids=ids[part].numpy().astype("<i8").tobytes(), rows=codec.tensor_bytes(rows[part]).tobytes(),
                    held=kept[part].numpy().astype("u1").tobytes(), step=step, partition=held.spec.partition,
                    num_shards=held.num_shards, shard=self.index,
                    num_embeddings=held.spec.num_embeddings).SerializeToString()
