"""A shard's embedding tables: one EmbeddingTable (embeddings.py) per name, and what LookupRows and pushes do
with them. No gRPC.

The chief creates tables (idempotent per table, all-or-nothing per call);
LookupRows reads rows (admitting new ids of dynamic tables); a push's ROWS
tensors arrive as RowGradients, are checked with the rest of the push, then
applied at the shard's step, after which tables with max_age or capacity
evict. Every call checks everything it was given before it changes
anything, so a call that raises has changed nothing. Thread-safe: a lock
guards the name -> table map; each table has its own lock (embeddings.py).
Dynamic tables live where the shard's TableStorage says: in memory, or on
SSD (ssd_tables.py); a table replaced (a restore, a re-layout) is closed.
Ids a LookupRows announces for the caller's next lookup are read into SSD
tables' caches in the background (warming.py).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from .. import codec, rows
from ..errors import (InvalidArgumentError, LayoutChangedError, NonFiniteGradientError, SpecConflictError,
                      TensorMismatchError, UnknownVariableError)
from ..proto import ps_pb2
from .embeddings import EmbeddingTable, check_read
from .row_optimizers import RowOptimizer
from .ssd_tables import TableStorage
from .waits import NamesAwaited
from .warming import Warmer

__all__ = ["RowGradient", "TableStore", "split_rows"]

_FLOATS = (ps_pb2.FLOAT32, ps_pb2.FLOAT64, ps_pb2.FLOAT16, ps_pb2.BFLOAT16)


@dataclasses.dataclass(frozen=True)
class RowGradient:
    """A push's ROWS tensor for one table: values[i] is the gradient of row ids[i]."""

    ids: torch.Tensor     # 1-D int64
    values: torch.Tensor  # (len(ids), dim)
    counts_step: bool = True  # False: sent again after a live re-layout (PushHeader.rows_again)


def split_rows(grads: Mapping[str, object]) -> tuple[dict[str, torch.Tensor], dict[str, RowGradient]]:
    """A push's tensors as ({variable: dense gradient}, {table: RowGradient})."""
    dense, table_rows = {}, {}
    for name, grad in grads.items():
        (table_rows if isinstance(grad, RowGradient) else dense)[name] = grad
    return dense, table_rows


@dataclasses.dataclass
class _Held:
    spec: ps_pb2.TableSpec  # as created, defaults filled in
    num_shards: int
    table: EmbeddingTable
    rows_read: int = 0      # guarded by the store's lock
    rows_pushed: int = 0
    relaid: bool = False    # built in a live resize: ids a client placed by an older count are refused as moved

    @property
    def evicts(self) -> bool:
        return self.spec.HasField("max_age") or self.spec.capacity > 0


def _arguments(spec: ps_pb2.TableSpec, shard_index: int, num_shards: int) -> dict:
    """EmbeddingTable's keyword arguments for `spec`; InvalidArgumentError for a value it cannot take."""
    if spec.dtype not in _FLOATS:
        raise InvalidArgumentError(f"table {spec.name!r}: dtype must be FLOAT32, FLOAT64, FLOAT16 or BFLOAT16. "
                                   f"Received: {spec.dtype} (DType enum)")
    return dict(num_embeddings=spec.num_embeddings or None, shard_index=shard_index, num_shards=num_shards,
                partition=rows.partition_name(spec.partition), optimizer=spec.optimizer.name,
                hyperparams=dict(spec.optimizer.hyperparams), init=spec.init.distribution,
                init_scale=spec.init.scale, seed=spec.init.seed, dtype=codec.torch_dtype(spec.dtype),
                min_count=max(1, spec.min_count), max_age=spec.max_age if spec.HasField("max_age") else None,
                capacity=spec.capacity or None)


def _normalized(spec: ps_pb2.TableSpec) -> ps_pb2.TableSpec:
    """`spec` with defaults filled in: min_count 0 is 1, the optimizer's name and every hyperparameter as the
    row optimizer normalizes them (OptimizerSpecError for a bad one)."""
    optimizer = RowOptimizer(spec.optimizer.name, dict(spec.optimizer.hyperparams))
    out = ps_pb2.TableSpec()
    out.CopyFrom(spec)
    out.min_count = max(1, spec.min_count)
    out.optimizer.CopyFrom(ps_pb2.OptimizerSpec(name=optimizer.name, hyperparams=optimizer.hyperparams))
    return out


def _fixed_bytes(spec: ps_pb2.TableSpec, num_shards: int) -> int:
    """Bytes a fixed-size table's part takes on one shard, from its spec alone (0 for a dynamic one): its rows
    with their optimizer state, and under "hash" partitioning the index of the ids it owns (8 bytes each;
    the hash spreads ids evenly); OptimizerSpecError for a bad optimizer."""
    if not spec.num_embeddings:
        return 0
    widths = RowOptimizer(spec.optimizer.name, dict(spec.optimizer.hyperparams)).state_spec(spec.dim)
    per_row = (spec.dim + sum(w for w, _ in widths.values())) * codec.torch_dtype(spec.dtype).itemsize
    if rows.partition_name(spec.partition) == "hash":
        per_row += 8
    return math.ceil(spec.num_embeddings / num_shards) * per_row


class TableStore(NamesAwaited):
    """The embedding tables of one shard, in creation order (see the module docstring)."""

    _what = "embedding table"

    def __init__(self, storage: TableStorage | None = None) -> None:
        self.storage = storage or TableStorage()  # where dynamic tables' rows live (ssd_tables.py)
        self._changed = threading.Condition()  # guards _tables and the read/push counters; notified on create
        self._tables: dict[str, _Held] = {}
        self._closed = False
        self._guard: Callable[[_Held | None], None] | None = None
        self._warmer = Warmer()  # reads announced rows into SSD tables' caches (check_upcoming, warm)

    # -- creation ---------------------------------------------------------------------------

    def create(self, specs: Iterable[ps_pb2.TableSpec], shard_index: int, num_shards: int, *,
               taken: Iterable[str] = (), check_memory: Callable[[dict[str, int]], None] | None = None
               ) -> list[bool]:
        """Creates this shard's part of each table; per spec True if created, False if it existed with the same
        spec and layout. All-or-nothing: raises InvalidArgumentError or OptimizerSpecError (a bad spec),
        SpecConflictError (a table exists with another spec or layout, or a name is in `taken`: a variable's)
        or what `check_memory({name: bytes of the new fixed-size tables})` raises, before creating any."""
        if not 0 <= shard_index < num_shards:
            raise InvalidArgumentError(f"shard_index must be in [0, num_shards); got {shard_index} of {num_shards}")
        wanted = []
        for spec in specs:
            if not spec.name:
                raise InvalidArgumentError("a TableSpec without a name")
            wanted.append((_normalized(spec), _arguments(spec, shard_index, num_shards)))
        clash = sorted({spec.name for spec, _ in wanted} & set(taken))
        if clash:
            raise SpecConflictError(f"{clash} already exist as variables on this shard; tables and variables "
                                    f"share one namespace")
        new: dict[str, tuple[ps_pb2.TableSpec, dict]] = {}
        with self._changed:
            for spec, args in wanted:
                if spec.name not in self._tables:
                    new.setdefault(spec.name, (spec, args))
        if check_memory is not None:  # a fixed-size table kept on SSD takes its cache's share only
            check_memory({name: _fixed_bytes(spec, num_shards) for name, (spec, _) in new.items()
                          if self.storage.where(name, spec.storage, bool(spec.num_embeddings)) == "ram"})
        built: dict[str, _Held] = {}
        try:
            for name, (spec, args) in new.items():
                built[name] = _Held(spec, num_shards, self.storage.table(name, spec.dim, spec.storage, **args))
            return self._created(wanted, built, num_shards)
        finally:
            with self._changed:
                unused = [h for h in built.values() if self._tables.get(h.spec.name) is not h]
            for held in unused:  # a spec refused, or a table another call created meanwhile
                held.table.close()

    def _created(self, wanted: list, built: dict[str, _Held], num_shards: int) -> list[bool]:
        """create()'s second half: installs the `built` tables that no other call created meanwhile."""
        created = []
        with self._changed:
            seen: dict[str, _Held] = {}
            for spec, _ in wanted:
                existing = self._tables.get(spec.name) or seen.get(spec.name)
                if existing is not None and (existing.spec != spec or existing.num_shards != num_shards):
                    raise SpecConflictError(
                        f"table {spec.name!r} already exists as {_show(existing.spec)} over {existing.num_shards} "
                        f"shards; the request asked for {_show(spec)} over {num_shards}. Use another name, "
                        f"or the same spec")
                created.append(existing is None)
                seen[spec.name] = existing or built[spec.name]
            for name, held in built.items():
                self._tables.setdefault(name, held)
            self._changed.notify_all()
        return created

    def guard(self, check: Callable[[_Held | None], None]) -> None:
        """`check(held)` runs first for every table a lookup or push names (None: not on this shard) and may
        raise instead (a live re-layout: layout.ShardLayout.check_tables)."""
        self._guard = check

    def get(self, name: str) -> _Held:
        """The table called `name`, after the guard's check; UnknownVariableError (NOT_FOUND) if absent."""
        with self._changed:
            held = self._tables.get(name)
        if self._guard is not None:
            self._guard(held)
        return self._found(name, held)

    def check_applies(self, names: Iterable[str]) -> None:
        """Raises what get() raises for a table of `names` (called under the apply gate right before a push's
        apply, so nothing is applied to a table frozen for a live re-layout meanwhile)."""
        for name in names:
            self.get(name)

    @staticmethod
    def _found(name: str, held: _Held | None) -> _Held:
        if held is None:
            raise UnknownVariableError(f"no embedding table {name!r} on this shard; create it first (the chief "
                                       f"does, via PSClient.register_module or create_tables)")
        return held

    def names(self) -> list[str]:
        with self._changed:
            return list(self._tables)

    def held(self) -> list[_Held]:
        """Every table (spec, layout, EmbeddingTable), in creation order: what a checkpoint saves
        (table_state.py). Never blocks on training."""
        with self._changed:
            return list(self._tables.values())

    def install(self, held: Iterable[_Held]) -> None:
        """Makes `held` the shard's tables, replacing any (a restore, table_state.py, before the shard serves;
        a live re-layout, moves.py)."""
        with self._changed:
            old, self._tables = self._tables, {h.spec.name: h for h in held}
            self._changed.notify_all()
        for gone in old.values():
            if self._tables.get(gone.spec.name) is not gone:
                gone.table.close()

    def check_free(self, names: Iterable[str]) -> None:
        """SpecConflictError if a name is a table's (variables and tables share one namespace)."""
        with self._changed:
            clash = sorted(set(names) & set(self._tables))
        if clash:
            raise SpecConflictError(f"{clash} already exist as embedding tables on this shard; tables and "
                                    f"variables share one namespace")

    def _waited_names(self) -> dict[str, _Held]:
        return self._tables

    # -- reads ------------------------------------------------------------------------------

    def lookup(self, requests: list[tuple[str, torch.Tensor]], *, admit: bool) -> list[torch.Tensor]:
        """The rows of each (table, distinct ids of this shard), in order (EmbeddingTable.lookup: zeros for
        ids without a row; `admit` counts and creates them). Raises UnknownVariableError or
        InvalidArgumentError (a table twice, bad ids) before reading or admitting anything."""
        held = [self.get(name) for name, _ in requests]
        names = [name for name, _ in requests]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"a LookupRows request names a table more than once: {names}")
        for h, (name, ids) in zip(held, requests):
            _check_placed(name, h, ids)
            h.table.check_ids(ids, unique=True)
        out = [h.table.lookup(ids, admit=admit) for h, (_, ids) in zip(held, requests)]
        with self._changed:
            for h, (_, ids) in zip(held, requests):
                h.rows_read += len(ids)
        return out

    def check_upcoming(self, requests: list[tuple[str, torch.Tensor]]) -> list[tuple[EmbeddingTable, np.ndarray]]:
        """The (table, ids) of each (table, distinct ids of this shard) a caller announced it looks up next that
        warming helps (tables on SSD). Raises what lookup() raises for them, and changes nothing."""
        names = [name for name, _ in requests]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"a LookupRows request announces a table more than once: {names}")
        held = [self.get(name) for name in names]
        for h, (name, ids) in zip(held, requests):
            _check_placed(name, h, ids)
            h.table.check_ids(ids, unique=True)
        return [(h.table, ids.numpy()) for h, (_, ids) in zip(held, requests) if h.table.storage == "ssd"]

    def warm(self, checked: list[tuple[EmbeddingTable, np.ndarray]]) -> None:
        """Queues check_upcoming()'s tables and ids to be read into their caches in the background
        (warming.py). Never blocks."""
        self._warmer.offer([(table, ids) for table, ids in checked if len(ids)])

    def close(self) -> None:
        """Ends every wait (NamesAwaited.close) and the cache warming."""
        super().close()
        self._warmer.close()

    def changes(self, cursors: Mapping[str, tuple[str, int]], min_updates: int = 0,
                tables: Sequence[str] = (), rows_per_part: Callable[[_Held], int] = lambda held: 1 << 16
                ) -> list[tuple[str, _Held, Iterator[tuple]]]:
        """(name, held, its EmbeddingTable.read_changes() parts) of every table, by name, or of `tables` only if
        given: since its cursor (incarnation, seq) in `cursors`, whole for a table without one, in parts of
        rows_per_part(held) rows; rows updated fewer than `min_updates` times are sent as not held. Each table is
        read as its parts are taken. UnknownVariableError for a cursor or a name of `tables` naming no table,
        InvalidArgumentError for a cursor of a table `tables` leaves out or a bad `min_updates`, before
        anything is read."""
        for name in [*cursors, *tables]:
            self.get(name)
        if tables and set(cursors) - set(tables):
            raise InvalidArgumentError(f"cursors name tables {sorted(set(cursors) - set(tables))} the read leaves "
                                       f"out (it reads {sorted(tables)})")
        check_read(min_updates)
        with self._changed:
            chosen = sorted(((name, held) for name, held in self._tables.items() if not tables or name in tables),
                            key=lambda item: item[0])
        return [(name, held, held.table.read_changes(*reversed(cursors.get(name, ("", 0))), min_updates,
                                                     rows_per_part(held)))
                for name, held in chosen]

    # -- pushes -----------------------------------------------------------------------------

    def check_meta(self, name: str, meta: ps_pb2.TensorMeta) -> None:
        """Raises unless a ROWS tensor with `meta` may be pushed to table `name`: UnknownVariableError,
        TensorMismatchError (not [n, dim] of the table's dtype)."""
        spec = self.get(name).spec
        if meta.dtype != spec.dtype or len(meta.shape) != 2 or meta.shape[1] != spec.dim:
            raise TensorMismatchError(f"row gradients for table {name!r} are {codec.describe_meta(meta)}; the table "
                                      f"takes [rows, {spec.dim}] of {ps_pb2.DType.Name(spec.dtype).lower()}")

    def validate(self, table_rows: Mapping[str, RowGradient]) -> None:
        """Raises unless every RowGradient may be applied: a known table, [n, dim] of its dtype, ids of this
        shard (in range for a fixed-size table), finite values (NonFiniteGradientError)."""
        for name, grad in table_rows.items():
            held = self.get(name)
            self.check_meta(name, codec.meta_of(grad.values))
            _check_placed(name, held, grad.ids)
            held.table.check_ids(grad.ids, unique=False)
            if grad.values.numel() and not bool(torch.isfinite(grad.values).all()):
                raise NonFiniteGradientError(f"row gradients for table {name!r} contain NaN or Inf; nothing was "
                                             f"applied")

    def apply(self, table_rows: Mapping[str, RowGradient], step: int, *,
              received: Mapping[str, int] | None = None) -> None:
        """One optimizer step of each table in `table_rows` (validated) at the shard's step `step`, then
        eviction of those with max_age or capacity. `received`: {table: gradient rows pushed} where that is
        not len(ids) (a sync step's sums, repeats summed across pushes)."""
        for name, grad in table_rows.items():
            with self._changed:
                held = self._found(name, self._tables.get(name))  # validated: no guard here, an apply never stops
            held.table.apply(grad.ids, grad.values, step, count_step=grad.counts_step)
            if held.evicts:
                held.table.evict(step)
            with self._changed:
                held.rows_pushed += (received or {}).get(name, len(grad.ids))

    # -- status -----------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes every table holds on this shard."""
        with self._changed:
            tables = list(self._tables.values())
        return sum(h.table.nbytes() for h in tables)

    def status(self, names: Iterable[str] | None = None) -> list[ps_pb2.TableStatus]:
        """Each table's counters (all tables, in creation order, or those of `names` that exist)."""
        return [status for _, status in self._described(names)]

    def infos(self, names: Iterable[str] | None = None) -> list[ps_pb2.TableInfo]:
        """Spec, layout and counters of each table (all, in creation order, or those of `names` that exist)."""
        return [ps_pb2.TableInfo(spec=held.spec, num_shards=held.num_shards, status=status)
                for held, status in self._described(names)]

    def _described(self, names: Iterable[str] | None) -> list[tuple[_Held, ps_pb2.TableStatus]]:
        wanted = None if names is None else set(names)
        with self._changed:
            tables = [(h, h.rows_read, h.rows_pushed) for n, h in self._tables.items()
                      if wanted is None or n in wanted]
        out = []
        for held, read, pushed in tables:
            c = held.table.counters()
            out.append((held, ps_pb2.TableStatus(
                name=held.spec.name, rows=c["rows"], pending=c["pending"], admitted=c["admitted"],
                evicted=c["evicted"], evicted_by_age=c["evicted_by_age"],
                evicted_by_capacity=c["evicted_by_capacity"], bytes=c["bytes"], row_bytes=c["row_bytes"],
                optimizer_steps=c["optimizer_steps"], rows_read=read, rows_pushed=pushed, storage=held.table.storage,
                **{k: c.get(k, 0) for k in _DISK_COUNTERS})))
        return out


_DISK_COUNTERS = ("cache_rows", "cache_hits", "cache_misses", "cache_warmed", "disk_bytes_read", "disk_bytes_written",
                  "disk_bytes")


def _check_placed(name: str, held: _Held, ids: torch.Tensor) -> None:
    """LayoutChangedError if a table built in a live re-layout is sent ids another shard owns now (a client that
    placed them by the old count; nothing is changed, it asks for the layout and sends them again)."""
    if not held.relaid or not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        return
    config = held.table.config()
    owner = rows.shard_of(ids, config["num_shards"], config["partition"])
    if bool((owner != config["shard_index"]).any()):
        raise LayoutChangedError(f"embedding table {name!r} is spread over {config['num_shards']} shards since a "
                                 f"live resize; ps {config['shard_index']} was sent ids of others; nothing was "
                                 f"changed here: ask for the layout and send them to their owners")


def _show(spec: ps_pb2.TableSpec) -> str:
    hyper = ", ".join(f"{k}={v:g}" for k, v in sorted(spec.optimizer.hyperparams.items()))
    dynamic = (f"dynamic (min_count {spec.min_count}, max_age "
               f"{spec.max_age if spec.HasField('max_age') else 'none'}, capacity {spec.capacity or 'none'})")
    return (f"{ps_pb2.DType.Name(spec.dtype).lower()}[{spec.num_embeddings or 'dynamic'}, {spec.dim}] "
            f"{rows.partition_name(spec.partition)} optimizer={spec.optimizer.name}({hyper}) "
            f"init={spec.init.distribution}({spec.init.scale:g}, seed {spec.init.seed})"
            + ("" if spec.num_embeddings else f" {dynamic}"))
