"""Embedding and EmbeddingBag: nn.Embedding and nn.EmbeddingBag whose table lives on the shards.

    emb = EmbeddingBag(1_000_000, 64, mode="sum", optimizer=Optimizer("adagrad", lr=0.05))
    model = nn.Sequential(...)                     # uses emb beside dense layers
    binding = ps.register_module(model, Optimizer("sgd", lr=0.1))
    loss = model(batch).sum(); loss.backward(); binding.push()

The table is row-partitioned over every shard by id (modulo by default,
hash as an option); no worker ever holds it. Forward reads the rows of the
batch's distinct ids (one LookupRows call per shard, all shards at once) into
a small local tensor and runs F.embedding / F.embedding_bag on ids remapped
into it, so outputs equal torch's modules holding the same rows. Backward
leaves each distinct id's gradient (repeats summed by autograd), which the
module's ModuleBinding sends with its next push: ids and rows only, in the
same push as the dense gradients. padding_idx rows read as zeros and are
never sent or updated. With num_embeddings=None the table is dynamic: ids are
any int64, a row is created at its id's min_count-th training lookup (zeros
before) and evicted after max_age of a shard's steps without update, or
beyond `capacity` rows per shard.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Mapping

import torch
import torch.nn.functional as F

from .. import codec, rows
from ..errors import InvalidArgumentError, OptimizerSpecError, SpecConflictError
from ..proto import ps_pb2
from ..specs import ROW_OPTIMIZER_NAMES, Optimizer

__all__ = ["ShardedTable", "Embedding", "EmbeddingBag", "prefetch_rows"]

_MODES = ("sum", "mean", "max")


class ShardedTable(torch.nn.Module):
    """What Embedding and EmbeddingBag share: the table's settings, its binding to a client (made by
    PSClient.register_module), the lookups, and the row gradients a push takes.

    Keyword settings beyond torch's: partition "modulo" or "hash"; optimizer,
    the table's lazy row optimizer (an Optimizer named sgd, adagrad,
    sparse_adam or rowwise_adagrad; None: register_module's optimizer if it is
    sgd or adagrad); init "normal" or "uniform" with init_scale (torch's N(0,
    1) by default); seed (None: derived from the table's name, so every
    process agrees and tables differ); storage (None: the shard's
    --table-storage, which keeps fixed-size tables in memory; "ram"; "ssd":
    on the shards' local disk with a RAM cache, needing ps-server
    --table-dir); and, for dynamic tables only, min_count, max_age (shard
    steps) and capacity (rows per shard), and padding_idx is an id as any
    other (no counting from the end). dtype is
    the table's; device, where looked-up rows go (None: the input's device).
    Raises InvalidArgumentError (OptimizerSpecError) for settings a table
    cannot take, max_norm included: renormalizing rows in place would change
    the table behind the optimizer's back.
    """

    def __init__(self, num_embeddings: int | None, embedding_dim: int, padding_idx: int | None, max_norm, norm_type,
                 scale_grad_by_freq: bool, device, dtype, *, partition: str, optimizer: Optimizer | None, init: str,
                 init_scale: float, seed: int | None, min_count: int, max_age: int | None, capacity: int | None,
                 storage: str | None):
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        fixed = num_embeddings is not None
        problems = [what for what, bad in [
            ("num_embeddings must be None or >= 1", fixed and not (isinstance(num_embeddings, int)
                                                                   and num_embeddings >= 1)),
            ("embedding_dim must be >= 1", not (isinstance(embedding_dim, int) and embedding_dim >= 1)),
            ("max_norm is not supported", max_norm is not None),
            ("partition must be 'modulo' or 'hash'", partition not in rows.PARTITIONS),
            ("init must be 'normal' or 'uniform'", init not in ("normal", "uniform")),
            ("dtype must be float32, float64, float16 or bfloat16",
             dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16)),
            ("min_count must be >= 1", not (isinstance(min_count, int) and min_count >= 1)),
            ("max_age must be None or >= 0", max_age is not None and not (isinstance(max_age, int) and max_age >= 0)),
            ("capacity must be None or >= 1", capacity is not None and not (isinstance(capacity, int)
                                                                             and capacity >= 1)),
            ("fixed-size tables take no min_count, max_age or capacity",
             fixed and (min_count, max_age, capacity) != (1, None, None)),
            ("storage must be None, 'ram' or 'ssd'", storage not in (None, "ram", "ssd")),
        ] if bad]
        if padding_idx is not None and fixed and not problems:
            if not -num_embeddings <= padding_idx < num_embeddings:
                problems.append("padding_idx must be within num_embeddings")
            padding_idx %= num_embeddings  # torch's: a negative index counts from the end
        if problems:
            raise InvalidArgumentError(f"{type(self).__name__}: {'; '.join(problems)}")
        if optimizer is not None and optimizer.name.lower() not in ROW_OPTIMIZER_NAMES:
            raise OptimizerSpecError(f"{optimizer.name!r} is not a row optimizer; use one of {ROW_OPTIMIZER_NAMES}")
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.norm_type, self.scale_grad_by_freq = norm_type, scale_grad_by_freq
        self.dtype, self.device = dtype, None if device is None else torch.device(device)
        self.partition, self.optimizer, self.seed = partition, optimizer, seed
        self.init, self.init_scale = init, init_scale
        self.min_count, self.max_age, self.capacity, self.storage = min_count, max_age, capacity, storage
        self.table_name: str | None = None
        self._client = None
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (distinct ids, their gradient), per backward
        self._grads_lock = threading.Lock()  # backward may run hooks on another thread (CUDA)
        self._prefetched = None  # (input, _prepare's result, rows) from prefetch_rows, for the next forward

    def table_spec(self, name: str, default: Optimizer | None = None) -> ps_pb2.TableSpec:
        """The TableSpec of this table under `name`; `default` is register_module's optimizer, used when the
        table has none of its own (OptimizerSpecError if it has no row version)."""
        optimizer = self.optimizer
        if optimizer is None:
            if default is None or default.name.lower() not in ("sgd", "adagrad"):
                raise OptimizerSpecError(
                    f"table {name!r} needs a row optimizer: pass optimizer=Optimizer(...) naming one of "
                    f"{ROW_OPTIMIZER_NAMES} to its {type(self).__name__}"
                    + (f" (register_module's {default.name!r} has no row version)" if default is not None else ""))
            optimizer = default
        seed = self.seed if self.seed is not None else int.from_bytes(hashlib.sha256(name.encode()).digest()[:8],
                                                                      "little") >> 1
        spec = ps_pb2.TableSpec(
            name=name, dim=self.embedding_dim, num_embeddings=self.num_embeddings or 0,
            dtype=codec.wire_dtype(self.dtype), partition=rows.partition_enum(self.partition),
            optimizer=optimizer.to_proto(), init=ps_pb2.TableInit(distribution=self.init, scale=self.init_scale,
                                                                 seed=seed),
            min_count=self.min_count, capacity=self.capacity or 0, storage=self.storage or "")
        if self.max_age is not None:
            spec.max_age = self.max_age
        return spec

    def check_spec(self, spec: ps_pb2.TableSpec) -> None:
        """SpecConflictError unless the shards' `spec` has this module's size, width and dtype."""
        if (spec.num_embeddings or None, spec.dim, spec.dtype) != (self.num_embeddings, self.embedding_dim,
                                                                   codec.wire_dtype(self.dtype)):
            raise SpecConflictError(f"table {spec.name!r} on the shards has {spec.num_embeddings or 'any'} rows of "
                                    f"{spec.dim} {codec.torch_dtype(spec.dtype)}; this module has "
                                    f"{self.num_embeddings or 'any'} of {self.embedding_dim} {self.dtype}")

    def bind(self, client, name: str) -> None:
        """Reads and pushes this table as `name` through `client` (a PSClient that knows it) from now on;
        register_module calls it once the table exists and check_spec passed. Never blocks."""
        self._client, self.table_name = client, name

    def _prepare(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the batch's distinct ids, input remapped to them, which are not padding); InvalidArgumentError for
        ids that are not integers or out of range, or an unbound module. Never blocks."""
        if self._client is None:
            raise InvalidArgumentError(f"{type(self).__name__} is not bound to a table yet: register the model "
                                       f"with PSClient.register_module first")
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int32, torch.int64):
            raise InvalidArgumentError(f"{type(self).__name__} takes int32 or int64 ids, got "
                                       f"{getattr(input, 'dtype', type(input))}")
        ids = input.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        if self.num_embeddings is not None and len(unique) and (unique[0] < 0 or unique[-1] >= self.num_embeddings):
            raise InvalidArgumentError(f"ids must be in [0, {self.num_embeddings}); got "
                                       f"{int(unique[0]) if unique[0] < 0 else int(unique[-1])}")
        keep = unique != self.padding_idx if self.padding_idx is not None else torch.ones(len(unique), dtype=torch.bool)
        return unique, inverse, keep

    def _gather(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(input remapped to rows of `weight`, weight: the batch's distinct rows, the padding row or None).

        Uses the rows prefetch_rows read for an equal input, if it did;
        otherwise blocks for one LookupRows per shard holding some of the ids.
        Raises what _prepare and PSClient.lookup_rows raise.
        """
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and _same(prefetched[0], input):
            _, (unique, inverse, keep), values = prefetched
        else:
            unique, inverse, keep = self._prepare(input)
            values = self._read(unique, keep, self._admits())
        device = self.device or input.device
        weight = values.to(device)
        if torch.is_grad_enabled():
            weight.requires_grad_()
            weight.register_hook(lambda grad: self._keep(unique, keep, grad))
        padding = None if bool(keep.all()) else int(torch.nonzero(~keep)[0])
        return inverse.view(input.shape).to(device), weight, padding

    def _admits(self) -> bool:
        """Whether a lookup now is a training one (dynamic tables count it and admit ids)."""
        return self.training and torch.is_grad_enabled()

    def _read(self, unique: torch.Tensor, keep: torch.Tensor, admit: bool,
              rows_read: torch.Tensor | None = None) -> torch.Tensor:
        """The (len(unique), dim) rows of `unique`: padding's zeros, the others `rows_read` or looked up."""
        values = torch.zeros(len(unique), self.embedding_dim, dtype=self.dtype)
        if keep.any():
            if rows_read is None:
                rows_read = self._client.lookup_rows({self.table_name: unique[keep]}, admit=admit)[self.table_name]
            values[keep] = rows_read
        return values

    def _keep(self, unique: torch.Tensor, keep: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward's gradient for the rows of `unique`: kept, by id, for the next push (padding's left out)."""
        if grad.is_sparse:
            grad = grad.coalesce()
            positions, values = grad.indices()[0].cpu(), grad.values()
        else:  # mode "max" or scale_grad_by_freq (torch has no sparse gradient for them): the batch's rows
            positions = torch.nonzero(keep).flatten()
            values = grad[positions.to(grad.device)]
        with self._grads_lock:
            self._grads.append((unique[positions], values.detach().cpu()))

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, row gradients) from every backward since the last call (ids may repeat: a push sums them), or
        None if no backward reached this table; forgets them. The binding's push calls it. Never blocks."""
        with self._grads_lock:
            grads, self._grads = self._grads, []
        if not grads:
            return None
        return torch.cat([ids for ids, _ in grads]), torch.cat([values for _, values in grads])

    def extra_repr(self) -> str:
        size = self.num_embeddings if self.num_embeddings is not None else "dynamic"
        extra = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        extra += f", storage={self.storage!r}" if self.storage is not None else ""
        return f"{size}, {self.embedding_dim}{extra}, partition={self.partition}, table={self.table_name!r}"


def prefetch_rows(inputs: Mapping[ShardedTable, torch.Tensor],
                  upcoming: Mapping[ShardedTable, torch.Tensor] | None = None) -> None:
    """Reads the rows several tables' next forwards need in one LookupRows call per shard, not one per table.

        prefetch_rows({model.bags[i]: ids[i] for i in range(8)})   # then run forward as usual
        loss = model(dense, ids, offsets)

    Each module's next forward on an equal input (the same ids in the same
    shape) uses the rows read here; a forward on any other input looks up as
    usual, and the prefetched rows are dropped then. `upcoming`: the inputs
    of the prefetch after this one (the next batch's ids, per module), sent
    along so that shards keeping the tables on SSD read those rows into
    their caches while this step computes (they change nothing else).
    Tables bound to different clients, or not all in training mode alike,
    take a call each. Blocks until every row arrived; raises what forward
    would (ids out of range, before any row is read; PSError from the
    shards), and then nothing is prefetched.
    """
    groups: dict[tuple[int, bool], list[tuple[ShardedTable, torch.Tensor, tuple]]] = {}
    for module, input in inputs.items():
        prepared = module._prepare(input)
        groups.setdefault((id(module._client), module._admits()), []).append((module, input, prepared))
    announced: dict[int, tuple[object, dict[str, torch.Tensor]]] = {}  # id(client): (client, upcoming ids)
    for module, input in (upcoming or {}).items():
        unique, _, keep = module._prepare(input)
        tables = announced.setdefault(id(module._client), (module._client, {}))[1]
        earlier = tables.get(module.table_name)  # modules sharing a table: the union of their ids
        tables[module.table_name] = unique[keep] if earlier is None else torch.cat([earlier, unique[keep]])
    read = []
    for (client, admit), members in groups.items():
        wanted = {m.table_name: prepared[0][prepared[2]] for m, _, prepared in members if prepared[2].any()}
        _, next_ids = announced.pop(client, (None, None))
        found = members[0][0]._client.lookup_rows(wanted, admit=admit, upcoming=next_ids) \
            if wanted or next_ids else {}
        read += [(m, input, prepared, m._read(prepared[0], prepared[2], admit, found.get(m.table_name)))
                 for m, input, prepared in members]
    for other, next_ids in announced.values():  # clients with upcoming ids only
        other.lookup_rows({}, upcoming=next_ids)
    for module, input, prepared, values in read:
        module._prefetched = (input, prepared, values)


def _same(prefetched: torch.Tensor, input: torch.Tensor) -> bool:
    return prefetched is input or (prefetched.shape == input.shape and prefetched.device == input.device
                                   and torch.equal(prefetched, input))


class Embedding(ShardedTable):
    """nn.Embedding with its table on the shards (see ShardedTable for the settings beyond torch's).

    forward(input) -> input.shape + (embedding_dim,): blocks for the batch's
    rows; raises InvalidArgumentError for ids out of range, before any row is
    read, and PSError subclasses from the shards.
    """

    def __init__(self, num_embeddings: int | None, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, device=None, dtype: torch.dtype | None = None, *, partition: str = "modulo",
                 optimizer: Optimizer | None = None, init: str = "normal", init_scale: float = 1.0,
                 seed: int | None = None, min_count: int = 1, max_age: int | None = None,
                 capacity: int | None = None, storage: str | None = None):
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq, device,
                         dtype, partition=partition, optimizer=optimizer, init=init, init_scale=init_scale, seed=seed,
                         min_count=min_count, max_age=max_age, capacity=capacity, storage=storage)
        self.sparse = sparse  # accepted for torch's signature: row gradients are always sparse here

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        inverse, weight, padding = self._gather(input)
        return F.embedding(inverse, weight, padding, None, self.norm_type, self.scale_grad_by_freq,
                           sparse=not self.scale_grad_by_freq)


class EmbeddingBag(ShardedTable):
    """nn.EmbeddingBag with its table on the shards (see ShardedTable for the settings beyond torch's).

    forward(input, offsets=None, per_sample_weights=None) -> (bags,
    embedding_dim), mode "sum", "mean" or "max" as torch's (per_sample_weights
    with "sum" only; include_last_offset; padding_idx entries left out of
    their bag). Blocks and raises as Embedding's forward does.
    """

    def __init__(self, num_embeddings: int | None, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False,
                 include_last_offset: bool = False, padding_idx: int | None = None, device=None,
                 dtype: torch.dtype | None = None, *, partition: str = "modulo", optimizer: Optimizer | None = None,
                 init: str = "normal", init_scale: float = 1.0, seed: int | None = None, min_count: int = 1,
                 max_age: int | None = None, capacity: int | None = None, storage: str | None = None):
        if mode not in _MODES:
            raise InvalidArgumentError(f"EmbeddingBag: mode must be one of {_MODES}. Received: {mode!r}")
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq, device,
                         dtype, partition=partition, optimizer=optimizer, init=init, init_scale=init_scale, seed=seed,
                         min_count=min_count, max_age=max_age, capacity=capacity, storage=storage)
        self.mode, self.sparse, self.include_last_offset = mode, sparse, include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        inverse, weight, padding = self._gather(input)
        return F.embedding_bag(inverse, weight, offsets, None, self.norm_type, self.scale_grad_by_freq, self.mode,
                               self.mode != "max" and not self.scale_grad_by_freq, per_sample_weights,
                               self.include_last_offset, padding)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
