"""PSClient's embedding tables: create or wait for them, read rows, and the row gradients a push carries.

A mixin of PSClient: it uses the client's fan-out to the shards (fanout.py)
and timeouts (see PSClient.__init__); datapath.push and push_pull take `rows` through
`_summed_rows` and `_cut_rows`. A table's rows are spread over every shard by id
(torchps/rows.py), so each call goes to the shards holding the ids it
names, all at once.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, Mapping

import grpc
import numpy as np
import torch

from .. import codec, rows
from ..compression import Encoded
from ..errors import (ClusterConfigError, InvalidArgumentError, LayoutChangedError, NonFiniteGradientError,
                      TensorMismatchError, UnknownVariableError)
from ..proto import ps_pb2
from .embedding import ShardedTable
from .errors import error_from_rpc
from .layout import MAX_ROUNDS
from .transfer import NewTensors, read_stream

__all__ = ["TablePath", "TableLayout", "tables_in", "take_rows", "EXPORT_SECONDS"]

EXPORT_SECONDS = 600.0  # export_rows' deadline for one shard's stream


@dataclasses.dataclass(frozen=True)
class TableLayout:
    """A table as the shards hold it: its spec (defaults filled in) and the shards its rows are spread over."""

    spec: ps_pb2.TableSpec
    num_shards: int

    @property
    def partition(self) -> str:
        return rows.partition_name(self.spec.partition)

    @property
    def dtype(self) -> torch.dtype:
        return codec.torch_dtype(self.spec.dtype)


class TablePath:
    """create_tables, wait_for_tables, table_layout, lookup_rows, export_rows (PSClient inherits them)."""

    def create_tables(self, specs: Iterable[ps_pb2.TableSpec]) -> dict[str, bool]:
        """Creates embedding tables on every shard (each its part of each table): {name: created}.

        Idempotent per table: one that exists with the same spec is kept as it
        is (False). Blocks until every shard has its part (a fixed-size table's
        rows are made then). SpecConflictError if one exists with another spec
        (or the name is a variable's),
        InvalidArgumentError or OptimizerSpecError for a bad spec; each shard
        creates its part all-or-nothing, but if one shard fails the others'
        parts may exist (calling again with the right specs completes them).
        """
        specs = list(specs)
        self._layout.refresh()
        num_shards = self._layout.table_shards or self._layout.shards

        def create(shard: int, _) -> list[bool]:
            request = ps_pb2.CreateTablesRequest(tables=specs, shard_index=shard, num_shards=num_shards)
            reply = self._fanout.call(shard, lambda stub, t: stub.CreateTables(request, timeout=t), self.timeout)
            self._fanout.note_generation(shard, reply.generation)
            return list(reply.created)

        results = self._fanout.each({s: [] for s in range(num_shards)}, create)
        self._learn_tables([spec.name for spec in specs])
        return {spec.name: any(results[s][i] for s in results) for i, spec in enumerate(specs)}

    def wait_for_tables(self, names: Iterable[str], timeout: float = 600.0) -> None:
        """Blocks until every table in `names` exists on every shard (made by the chief), then learns their
        layout. WaitTimeoutError naming the missing ones after `timeout` s; ClusterConfigError if a table is
        spread over another number of shards than this cluster has."""
        names = list(names)
        self._layout.refresh()
        self._fanout.wait_listed({s: names for s in range(self._layout.table_shards or self._layout.shards)},
                                 "ListTables", timeout)
        self._learn_tables(names)

    def _learn_tables(self, names: list[str]) -> None:
        """Records the layout of `names` as shard 0 describes them."""
        reply = self._fanout.call(0, lambda stub, t: stub.ListTables(ps_pb2.ListRequest(names=names), timeout=t),
                                  self.control_timeout)
        count = self._layout.table_shards or self._layout.shards
        for info in reply.tables:
            if info.num_shards != count:
                raise ClusterConfigError(f"table {info.spec.name!r} is spread over {info.num_shards} shards; this "
                                         f"job has {count}")
            self._tables[info.spec.name] = TableLayout(info.spec, info.num_shards)

    def table_layout(self, name: str) -> TableLayout:
        """The layout of a table this client created or waited for, over the shards a live resize spread it
        (the layout this client follows); UnknownVariableError otherwise."""
        layout = self._tables.get(name)
        if layout is None:
            raise UnknownVariableError(f"embedding table {name!r} is not known to this client; create it or wait "
                                       f"for it first (register_module, create_tables or wait_for_tables)")
        count = self._layout.table_shards
        return dataclasses.replace(layout, num_shards=count) if count and count != layout.num_shards else layout

    def lookup_rows(self, ids: Mapping[str, torch.Tensor], *, admit: bool = False,
                    upcoming: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The rows of distinct ids: {table: (len(ids), dim) CPU tensor}, row i for ids[i].

        One LookupRows call per shard holding some of the ids (more only if
        a shard's ids exceed chunk_bytes), all shards at once. With `admit`
        (a training lookup) dynamic tables count it and create rows at
        min_count; rows that do not exist read as zeros. `upcoming`: {table:
        ids} the next lookup will ask for (repeats allowed), sent along to
        their shards, which read those of tables on SSD into their caches
        while the caller computes (a shard with upcoming ids only gets a call
        of its own; read nothing, changed nothing). Blocks until every
        row arrived (at most `timeout` per attempt). InvalidArgumentError for
        ids that repeat, are out of range or not int64; UnknownVariableError
        for an unknown table: then nothing was admitted on that shard. Ids a shard refuses as placed by an older
        table layout (a live resize re-laid the tables out: nothing read or admitted there) are looked up again
        at their owners in the layout then followed.
        """
        wanted = {name: (self.table_layout(name), _flat_ids(name, value)) for name, value in ids.items()}
        out = {name: torch.empty(len(value), layout.spec.dim, dtype=layout.dtype)
               for name, (layout, value) in wanted.items()}
        pending = [(name, value, torch.arange(len(value))) for name, (_, value) in wanted.items()]
        announced = self._upcoming_by_shard(upcoming or {})  # sent in the first round only
        limit = max(1, self.chunk_bytes // 8)  # ids per request: a request stays within one chunk's size

        def lookup(shard: int, parts: list[tuple[str, torch.Tensor, torch.Tensor]]) -> list:
            """[] once read; the parts not read if the shard refused them as placed by an older table layout."""
            slices = ([parts] if sum(len(value) for _, value, _ in parts) <= limit else  # else a call per slice
                      [[(name, value[i:i + limit], positions[i:i + limit])]
                       for name, value, positions in parts for i in range(0, len(value), limit)])
            for k, piece in enumerate(slices):
                try:
                    last = k == len(slices) - 1  # the shard warms its cache once its rows are read
                    self._lookup_on(shard, piece, admit, out, announced.get(shard, []) if last else [])
                except LayoutChangedError:  # a live resize re-laid the tables out: nothing was read or admitted
                    self._layout.count_refused()
                    return [part for later in slices[k:] for part in later]
            return []

        for _ in range(MAX_ROUNDS):
            per_shard: dict[int, dict[str, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
            for name, value, positions in pending:
                for shard, mine in self._by_shard(name, value):
                    per_shard.setdefault(shard, {}).setdefault(name, []).append((value[mine], positions[mine]))
            parts = {shard: [(name, torch.cat([v for v, _ in got]), torch.cat([p for _, p in got]))
                             for name, got in tables.items()] for shard, tables in per_shard.items()}
            parts.update({shard: [] for shard in announced if shard not in parts})  # upcoming ids only
            pending = [part for left in self._fanout.each(parts, lookup, "lookup").values() for part in left]
            announced = {}
            if not pending:
                return out
            self._layout.refresh()
        raise LayoutChangedError(f"rows of {sorted({name for name, _, _ in pending})} were refused as moved after "
                                 f"{MAX_ROUNDS} table layouts")

    def _by_shard(self, name: str, ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(shard, positions in `ids` of its ids) for each shard that owns some of table `name`'s `ids`."""
        layout = self.table_layout(name)
        owner = rows.shard_of(ids, layout.num_shards, layout.partition)
        return [(shard, torch.nonzero(owner == shard).flatten()) for shard in torch.unique(owner).tolist()]

    def _upcoming_by_shard(self, upcoming: Mapping[str, torch.Tensor]) -> dict[int, list[ps_pb2.TableIds]]:
        """lookup_rows' `upcoming`, distinct, as each shard's TableIds."""
        out: dict[int, list[ps_pb2.TableIds]] = {}
        for name, value in upcoming.items():
            value = torch.unique(_flat_ids(name, value, unique=False))
            for shard, mine in self._by_shard(name, value):
                out.setdefault(shard, []).append(ps_pb2.TableIds(name=name, ids=rows.ids_bytes(value[mine])))
        return out

    def _lookup_on(self, shard: int, parts: list[tuple[str, torch.Tensor, torch.Tensor]], admit: bool,
                   out: dict[str, torch.Tensor], upcoming: list[ps_pb2.TableIds]) -> None:
        """One LookupRows call: the rows of each (table, ids, their positions) land in out[table][positions]."""
        request = ps_pb2.LookupRowsRequest(tables=[ps_pb2.TableIds(name=name, ids=rows.ids_bytes(value))
                                                  for name, value, _ in parts],
                                           chunk_bytes=self.chunk_bytes, admit=admit, upcoming=upcoming)
        names = [name for name, _, _ in parts]
        sink = NewTensors()
        self._fanout.call(shard, lambda stub, t: read_stream(
            stub.LookupRows(request, timeout=t), names, sink, self._fanout.target(shard)), self.timeout)
        for name, value, positions in parts:
            got = sink.tensors[name]
            if tuple(got.shape) != (len(value), out[name].shape[1]) or got.dtype != out[name].dtype:
                raise TensorMismatchError(f"{self._fanout.target(shard)} sent the rows of {name!r} as "
                                          f"{got.dtype}{list(got.shape)}; {len(value)} rows were asked for")
            out[name][positions] = got

    def _exported_tables(self, names: Iterable[str] | None) -> list[str]:
        """The tables export_state_dict(names) exports: every fixed-size one this client knows (names None),
        else those of `names` that are tables (asking shard 0 about names that are neither a declared variable
        nor a known table). InvalidArgumentError if `names` has a dynamic table (no dense weight)."""
        if names is None:
            return [name for name, layout in self._tables.items() if layout.spec.num_embeddings]
        names, declared = list(names), set(self.variable_names())
        unknown = [n for n in names if n not in self._tables and n not in declared]
        if unknown:
            self._learn_tables(unknown)  # tables this client did not create or wait for, if they exist
        tables = [n for n in names if n in self._tables]
        dynamic = [n for n in tables if not self._tables[n].spec.num_embeddings]
        if dynamic:
            raise InvalidArgumentError(f"{dynamic} are dynamic embedding tables (num_embeddings=None): they have no "
                                       f"(num_embeddings, dim) weight to export; leave them out and read their rows "
                                       f"with export_rows(name)")
        return tables

    def export_rows(self, name: str, *, rows_per_part: int = 0, timeout: float = EXPORT_SECONDS
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row of table `name` (dynamic or fixed-size, in RAM or on SSD), streamed: an iterator of (ids,
        values) parts, one shard after the other, each part's ids ascending, every id once; values are
        (len(ids), dim) CPU tensors of the table's dtype. A part holds at most `rows_per_part` rows (0: as many
        as fit in the shard's --max-chunk-bytes).

        One ReadChanges stream per shard (its deadline `timeout`); a shard
        takes the table's ids at once and copies its rows a part at a time
        (one on SSD reads them from its store so), and the iterator holds one
        part: neither side ever copies the table whole. A part holds its rows
        as they are when its shard reads it: export a job that is not
        training (its end) for one step's rows. Raises here, before any
        call: UnknownVariableError for a table not known here (one another
        client made is learnt first), InvalidArgumentError for a negative
        `rows_per_part`. While iterating: the error of a shard that fails or
        dies mid-stream (ServerUnavailableError and the like), and
        LayoutChangedError if a live resize re-laid the tables out, or a shard
        replaced its table (a restore), while they were read; the parts
        yielded before are then incomplete: drop them and export again.
        """
        if rows_per_part < 0:
            raise InvalidArgumentError(f"rows_per_part must be >= 0 (0: the shard decides); got {rows_per_part}")
        self._layout.refresh()
        if name not in self._tables:
            self._learn_tables([name])
        epoch, layout = self._layout.epoch, self.table_layout(name)
        return self._rows_of_table(name, layout, epoch, rows_per_part, timeout)

    def _rows_of_table(self, name: str, layout: TableLayout, epoch: int, rows_per_part: int, timeout: float
                       ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """export_rows' iterator."""
        request = ps_pb2.ChangesRequest(tables=[name], max_rows=rows_per_part)
        for shard in range(layout.num_shards):
            stream = self._fanout.call(shard, lambda stub, t: stub.ReadChanges(request, timeout=t), timeout)
            try:
                for message in stream:
                    ids = torch.from_numpy(np.frombuffer(message.ids, dtype="<i8").astype(np.int64))
                    values = torch.frombuffer(bytearray(message.rows), dtype=layout.dtype) if message.rows \
                        else torch.empty(0, dtype=layout.dtype)
                    held = np.frombuffer(message.held, dtype=np.uint8).astype(bool)
                    if held.any():
                        keep = torch.from_numpy(held)
                        yield ids[keep], values.reshape(len(ids), layout.spec.dim)[keep]
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, self._fanout.target(shard)) from exc
            finally:
                stream.cancel()
        self._layout.refresh()
        if self._layout.epoch != epoch:
            raise LayoutChangedError(f"a live resize changed the layout (epoch {epoch} -> {self._layout.epoch}) "
                                     f"while table {name!r} was exported; export it again")

    def _export_table(self, name: str) -> torch.Tensor:
        """A fixed-size table's whole (num_embeddings, dim) weight, read without admitting (lookup_rows, every
        shard at once), its padding row zeroed if a module registered with this client has padding_idx."""
        layout = self.table_layout(name)
        weight = self.lookup_rows({name: torch.arange(layout.spec.num_embeddings)}, admit=False)[name]
        padding = self._table_padding.get(name)
        if padding is not None:
            weight[padding] = 0
        return weight

    def _tables_report(self) -> list[str]:
        """placement_report's lines on the tables this client knows, with each shard's counters (one GetStatus
        per shard, all at once)."""
        statuses = self._fanout.every(lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t))
        lines = [f"tables ({len(self._tables)}; rows spread over all {self._layout.table_shards or self._layout.shards} "
                 f"shards by id):"]
        for name, layout in self._tables.items():
            spec = layout.spec
            size = f"{spec.num_embeddings:,d}" if spec.num_embeddings else "dynamic"
            lines.append(f"  {name}  [{size}, {spec.dim}] {str(layout.dtype).removeprefix('torch.')}, "
                         f"{layout.partition}, {spec.optimizer.name}")
            for shard in sorted(statuses):
                for s in statuses[shard].tables:
                    if s.name == name:
                        lines.append(f"    ps:{shard}: {s.rows:,d} rows, {s.admitted:,d} admitted, {s.evicted:,d} "
                                     f"evicted, {s.bytes:,d} B")
        return lines

    def _cut_rows(self, summed: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *, every_shard: bool = True
                  ) -> dict[int, dict[str, Encoded]]:
        """{shard: {table: ROWS tensor}} of _summed_rows' (ids, gradients) by the shards each table is spread
        over now; with `every_shard` each of them gets every table's tensor (with no rows where it has none),
        as each counts one optimizer step of the table, else only those with rows."""
        out: dict[int, dict[str, Encoded]] = {}
        for name, (ids, grads) in summed.items():
            layout = self.table_layout(name)
            owner = rows.shard_of(ids, layout.num_shards, layout.partition)
            for shard in range(layout.num_shards):
                mine = owner == shard
                if every_shard or bool(mine.any()):
                    out.setdefault(shard, {})[name] = rows.encode_rows(ids[mine], grads[mine])
        return out

    def _summed_rows(self, table_rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each table's (ids, row gradients) for a push, repeated ids summed. Raises before anything is sent:
        UnknownVariableError (a table not known here), TensorMismatchError (not (len(ids), dim) of the table's
        dtype), NonFiniteGradientError."""
        out = {}
        for name, (ids, grads) in table_rows.items():
            layout = self.table_layout(name)
            ids = _flat_ids(name, ids, unique=False)
            grads = grads.detach().cpu()
            if grads.dtype != layout.dtype or grads.dim() != 2 or tuple(grads.shape) != (len(ids), layout.spec.dim):
                raise TensorMismatchError(f"row gradients of {name!r} are {grads.dtype}{list(grads.shape)}; the "
                                          f"table takes ({len(ids)}, {layout.spec.dim}) of {layout.dtype}")
            if grads.numel() and not bool(torch.isfinite(grads).all()):
                raise NonFiniteGradientError(f"row gradients of {name!r} contain NaN or Inf; nothing was pushed")
            out[name] = _summed(ids, grads)
        return out

    def _rows_placed_by(self, summed: Mapping[str, tuple[torch.Tensor, torch.Tensor]], counts: Mapping[str, int],
                        shards: set[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The rows of `summed` that tables spread over `counts` {table: shards} placed on one of `shards`."""
        out = {}
        for name, (ids, grads) in summed.items():
            owner = rows.shard_of(ids, counts[name], self.table_layout(name).partition)
            mine = torch.isin(owner, torch.tensor(sorted(shards), dtype=owner.dtype))
            if bool(mine.any()):
                out[name] = (ids[mine], grads[mine])
        return out


def _flat_ids(name: str, ids: torch.Tensor, unique: bool = True) -> torch.Tensor:
    """`ids` as a 1-D int64 CPU tensor; InvalidArgumentError if they are not integers (or, `unique`, repeat)."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InvalidArgumentError(f"ids of {name!r} must be an integer tensor, got {getattr(ids, 'dtype', type(ids))}")
    flat = ids.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
    if unique and len(torch.unique(flat)) != len(flat):
        raise InvalidArgumentError(f"ids of {name!r} to look up must be distinct")
    return flat


def _summed(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct ids, the sum of each one's rows), summed by torch's sparse coalesce as torch.optim's would be."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    if len(unique) == len(ids):
        order = torch.argsort(inverse)
        return unique, grads[order]
    summed = torch.sparse_coo_tensor(inverse[None], grads, (len(unique), grads.shape[1]),
                                     check_invariants=False).coalesce()
    return unique, summed.values()


def tables_in(module: torch.nn.Module, prefix: str = "") -> dict[str, ShardedTable]:
    """{table name: module} for each Embedding or EmbeddingBag in `module`, named like the weight it stands for:
    prefix + its path + ".weight"."""
    return {f"{prefix}{path}{'.' if path else ''}weight": sub for path, sub in module.named_modules()
            if isinstance(sub, ShardedTable)}


def take_rows(tables: Mapping[str, ShardedTable]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{table: (ids, row gradients)} of the tables a backward reached since the last push (push's `rows`)."""
    out = {}
    for name, table in tables.items():
        grads = table.take_gradients()
        if grads is not None:
            out[name] = grads
    return out
