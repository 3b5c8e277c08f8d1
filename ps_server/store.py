"""The variable store of one shard: values, optimizer state, versions, step.

Pure core (no gRPC), safe to call from many threads:
* creating variables is idempotent per name and all-or-nothing per call;
* `apply` validates every gradient of a push before touching any variable,
  then updates each variable under its own lock, so a reader never sees half
  of an update and a failed push changes nothing;
* `read` runs a caller's copy function under the variable's lock, so the
  copy is one consistent version; `versioned_read` reads a big variable a
  chunk at a time as one version without copying it whole (reads.py);
  `read_delta` copies only what changed since a version a caller holds,
  from the variable's change log (deltas.py), which `apply` keeps.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Callable, Iterable, Mapping, TypeVar

import numpy as np
import torch

from .. import codec, compression
from ..errors import (ModeConflictError, NonFiniteGradientError, OptimizerSpecError, SpecConflictError,
                      TensorMismatchError, UnknownVariableError)
from .deltas import ChangeLog, changed_elements, delta_pays, keeps_zeros
from .optimizers import VariableOptimizer, normalize_spec, structural_changes
from .reads import VersionedRead
from .waits import NamesAwaited
from ..proto import ps_pb2

__all__ = ["Variable", "VariableStore", "NewVariable"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class NewVariable:
    """A creation request: the spec fields plus the initial value."""

    name: str
    value: torch.Tensor
    optimizer: str = "none"
    hyperparams: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Variable:
    """One stored variable. `lock` guards value, optimizer state and version."""

    spec: ps_pb2.VariableSpec  # as created, optimizer hyperparameters normalized
    value: torch.Tensor
    optimizer: VariableOptimizer
    version: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    readers: list = dataclasses.field(default_factory=list)  # reads.VersionedRead in progress (under lock)
    changes: ChangeLog | None = None  # what each update changed, once a delta pull asked for it (deltas.py)

    @property
    def nbytes(self) -> int:
        return self.value.numel() * self.value.element_size()


class VariableStore(NamesAwaited):
    """All variables of one shard, in creation order, and the shard's step counter."""

    _what = "variable"

    def __init__(self, *, allow_nonfinite: bool = False):
        self.allow_nonfinite = allow_nonfinite
        self._changed = threading.Condition()  # guards _variables and _step; notified on create
        self._variables: dict[str, Variable] = {}
        self._step = 0
        self._closed = False
        self._missing: Callable[[str], None] = lambda name: None

    def explain_missing(self, explain: Callable[[str], None]) -> None:
        """`explain(name)` runs before UnknownVariableError is raised for a name not held, and may raise
        something more telling instead (a live resize: layout.ShardLayout.missing)."""
        self._missing = explain

    # -- creation -------------------------------------------------------------------------

    def spec_for(self, new: NewVariable) -> ps_pb2.VariableSpec:
        """The normalized spec `new` would be stored with (validates the optimizer)."""
        name, hyper = normalize_spec(new.optimizer, new.hyperparams)
        return ps_pb2.VariableSpec(
            name=new.name, meta=codec.meta_of(new.value),
            optimizer=ps_pb2.OptimizerSpec(name=name, hyperparams=hyper))

    def create(self, requests: Iterable[NewVariable]) -> list[bool]:
        """Creates variables; per request True if created, False if it existed with the same spec.

        Blocks only on the store lock. All-or-nothing: raises SpecConflictError
        (a name exists with another spec, or is repeated with different specs) or
        OptimizerSpecError before storing any of them. The values are taken over,
        not copied: the caller must not modify them afterwards.
        """
        prepared: list[tuple[ps_pb2.VariableSpec, NewVariable]] = []
        for new in requests:
            prepared.append((self.spec_for(new), new))
        built = [(spec, new, self._build(spec, new)) for spec, new in prepared]
        created: list[bool] = []
        with self._changed:
            pending: dict[str, ps_pb2.VariableSpec] = {}
            for spec, _, _ in built:
                existing = self._variables[spec.name].spec if spec.name in self._variables else pending.get(spec.name)
                if existing is not None and existing != spec:
                    raise SpecConflictError(
                        f"variable {spec.name!r} already exists with spec {_show(existing)}; "
                        f"the request asked for {_show(spec)}. Use another name, or the same spec.")
                created.append(existing is None)
                pending[spec.name] = spec
            for (spec, _, variable), is_new in zip(built, created):
                if is_new and spec.name not in self._variables:
                    self._variables[spec.name] = variable
            self._changed.notify_all()
        return created

    @staticmethod
    def _build(spec: ps_pb2.VariableSpec, new: NewVariable) -> Variable:
        value = new.value.detach()
        trainable = spec.optimizer.name != "none"
        if trainable and not value.is_floating_point():
            raise OptimizerSpecError(
                f"variable {spec.name!r} is {value.dtype}: only floating-point variables can have an optimizer")
        param = torch.nn.Parameter(value, requires_grad=trainable)
        return Variable(spec, param, VariableOptimizer(spec.optimizer.name, spec.optimizer.hyperparams, param))

    # -- lookups ---------------------------------------------------------------------------

    def get(self, name: str) -> Variable:
        """The variable called `name`; UnknownVariableError if absent."""
        with self._changed:
            variable = self._variables.get(name)
        if variable is None:
            self._missing(name)
            raise UnknownVariableError(
                f"no variable {name!r} on this shard; create it first (the chief does, via "
                f"PSClient.register_module or create_variables)")
        return variable

    def holds(self, name: str) -> bool:
        with self._changed:
            return name in self._variables

    def names(self) -> list[str]:
        with self._changed:
            return list(self._variables)

    def _waited_names(self) -> dict[str, Variable]:
        return self._variables

    @property
    def step(self) -> int:
        with self._changed:
            return self._step

    def check_gradient(self, name: str, meta: ps_pb2.TensorMeta) -> None:
        """Raises unless a gradient with `meta` may be pushed to `name`, compressed ones included (its shape,
        its dtype or a narrower float: compression.check_gradient_meta)."""
        variable = self.get(name)
        compression.check_gradient_meta(name, meta, variable.spec.meta)
        if not variable.optimizer.trainable:
            raise TensorMismatchError(f"variable {name!r} has no optimizer (optimizer 'none'); it takes no gradients")

    # -- updates ---------------------------------------------------------------------------

    def validate(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Raises unless every gradient may be applied: known name, dtype and shape, trainable, finite."""
        for name, grad in grads.items():
            variable = self.get(name)
            if grad.dtype != variable.value.dtype or grad.shape != variable.value.shape:
                meta = codec.meta_of(grad)  # (only to say what differs: a gradient that fits needs no message)
                self.check_gradient(name, meta)
                raise TensorMismatchError(f"gradient for {name!r} is {codec.describe_meta(meta)}: a compressed "
                                          f"gradient is applied decoded, in its variable's dtype")
            if not variable.optimizer.trainable:
                self.check_gradient(name, codec.meta_of(grad))  # (raises: no optimizer)
            if not self.allow_nonfinite and not _all_finite(grad):
                raise NonFiniteGradientError(
                    f"gradient for {name!r} contains NaN or Inf; nothing was applied. Fix the loss or "
                    f"clip gradients (or start ps-server with --allow-nonfinite)")

    def apply(self, grads: Mapping[str, torch.Tensor], step_increment: int = 0, *,
              validated: bool = False) -> tuple[int, dict[str, int]]:
        """Applies one gradient per variable; returns (step after, {name: version after}).

        Validates all gradients first (skipped if the caller already did):
        on any error nothing is applied. Each variable's update holds that
        variable's lock; the step counter then advances by `step_increment`.
        """
        if not validated:
            self.validate(grads)
        variables = {name: self.get(name) for name in grads}  # every one still here (a live resize) before any
        versions = {}                                           # changes
        with torch.no_grad():
            for name, grad in grads.items():
                variable = variables[name]
                with variable.lock:
                    for reader in variable.readers:
                        reader.preserve()
                    variable.optimizer.apply(grad)
                    variable.version += 1
                    versions[name] = variable.version
                    if variable.changes is not None:
                        optimizer = variable.optimizer
                        variable.changes.record(variable.version, changed_elements(grad, variable.changes.limit)
                                                if keeps_zeros(optimizer.name, optimizer.hyperparams) else None)
        with self._changed:
            self._step += step_increment
            return self._step, versions

    def read(self, name: str, copy: Callable[[torch.Tensor, int], T]) -> T:
        """copy(value, version), run under the variable's lock so it sees one consistent version."""
        variable = self.get(name)
        with variable.lock:
            return copy(variable.value.detach(), variable.version)

    def read_delta(self, name: str, base: int, cast: torch.dtype | None = None
                   ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """(version, flat indices, their values) of what changed in `name` since version `base`, copied under its
        lock (values cast to `cast` if given), or None where a whole read is due: no base (0), a base the change
        log does not know, or changes too many to pay. The first call for a variable starts its change log
        (and answers None). UnknownVariableError if absent."""
        variable = self.get(name)
        with variable.lock:
            if variable.changes is None:
                variable.changes = ChangeLog(variable.version, variable.value.numel())
                return None
            if not base:
                return None
            index = variable.changes.since(base, variable.version)
            itemsize = variable.value.element_size() if cast is None else cast.itemsize
            if index is None or not delta_pays(index.numel(), variable.value.numel(), itemsize):
                return None
            values = variable.value.detach().reshape(-1).index_select(0, index)
            return variable.version, index, values if cast is None else values.to(cast)

    def versioned_read(self, name: str) -> VersionedRead:
        """An unopened VersionedRead of `name` (use it as a context manager); UnknownVariableError if absent."""
        return VersionedRead(self.get(name))

    # -- checkpoints -------------------------------------------------------------------------

    def snapshot(self, *, copy: bool = True) -> list[dict]:
        """Every variable's spec, value, version and optimizer state, copied (each under its lock); with
        `copy=False` the values are the variables' own tensors, for a caller that stops every update."""
        return self.snapshot_of(self.names(), copy=copy)

    def snapshot_of(self, names: list[str], *, copy: bool = True) -> list[dict]:
        """snapshot()'s entries of `names` only, in that order (UnknownVariableError for one not held)."""
        entries = []
        for name in names:
            variable = self.get(name)
            spec = variable.spec
            with variable.lock:
                entries.append({
                    "name": name, "dtype": spec.meta.dtype, "shape": list(spec.meta.shape),
                    "optimizer": spec.optimizer.name, "hyperparams": dict(spec.optimizer.hyperparams),
                    "current": variable.optimizer.current(),
                    "value": _copied(variable.value.detach()) if copy else variable.value.detach(),
                    "version": variable.version, "optimizer_state": variable.optimizer.state_dict()})
        return entries

    def restore(self, entries: list[dict], step: int) -> None:
        """Recreates variables from snapshot() entries and sets the step. For an empty store only."""
        with self._changed:
            if self._variables:
                raise SpecConflictError("restore needs an empty store")
        self._add_entries(entries)
        self.set_step(step)

    def adopt(self, entries: list[dict], step: int) -> None:
        """Adds variables from snapshot() entries (a live resize brings them) and moves the step counter up
        to `step` if it is behind. SpecConflictError (nothing added) if one of the names is held: checked
        and added at one instant, so two adoptions of a name never both succeed."""
        built = self._built(entries)
        with self._changed:
            taken = [name for name in built if name in self._variables]
            if taken:
                raise SpecConflictError(f"variables {taken} are held here already; nothing was added")
            self._variables.update(built)
            self._step = max(self._step, step)
            self._changed.notify_all()

    def remove(self, names: list[str]) -> None:
        """Drops `names` (they moved to another shard: a live resize). Reads in progress finish on the
        values they hold."""
        with self._changed:
            for name in names:
                self._variables.pop(name, None)

    def _add_entries(self, entries: list[dict]) -> None:
        built = self._built(entries)
        with self._changed:
            self._variables.update(built)
            self._changed.notify_all()

    def _built(self, entries: list[dict]) -> dict[str, Variable]:
        """Variables (value, optimizer state, version) built from snapshot() entries, in their order."""
        built = {}
        for entry in entries:
            new = NewVariable(entry["name"], entry["value"], entry["optimizer"], entry["hyperparams"])
            variable = self._build(self.spec_for(new), new)
            variable.optimizer.load_state_dict(entry["optimizer_state"])
            if variable.optimizer.trainable:
                variable.optimizer.set_hyperparams(entry["current"])
            variable.version = entry["version"]
            built[entry["name"]] = variable
        return built

    def set_step(self, step: int) -> None:
        """Sets the step counter (restores, and a restored shard catching up with the job)."""
        with self._changed:
            self._step = step
            self._changed.notify_all()

    def trainable(self, names: list[str]) -> list[Variable]:
        """The variables `names` (empty: every trainable one); OptimizerSpecError for one without an optimizer,
        UnknownVariableError for an unknown name."""
        targets = [self.get(n) for n in names] if names else [
            v for v in (self.get(n) for n in self.names()) if v.optimizer.trainable]
        for variable in targets:
            if not variable.optimizer.trainable:
                raise OptimizerSpecError(f"variable {variable.spec.name!r} has no optimizer to update")
        return targets

    def set_hyperparams(self, names: list[str], updates: Mapping[str, float]) -> int:
        """Sets optimizer hyperparameters of `names` (empty: all trainable). Returns how many changed.

        Validates every variable first; on error nothing changes. A change of
        the optimizer state's structure (optimizers.structural_changes:
        amsgrad, momentum from or to 0, nesterov, ...) is ModeConflictError
        (FAILED_PRECONDITION) once the variable has stepped: the state it
        has was made for the old flags.
        """
        targets = self.trainable(names)
        for variable in targets:
            normalize_spec(variable.optimizer.name, {**variable.optimizer.hyperparams, **updates})
            changes = structural_changes(variable.optimizer.name, variable.optimizer.hyperparams, updates)
            if changes and variable.version > 0:
                raise ModeConflictError(
                    f"variable {variable.spec.name!r} has taken {variable.version} updates: {', '.join(changes)} "
                    f"would change the structure of its {variable.optimizer.name} state, which is refused after "
                    f"the first step; nothing was changed. Set it when the variable is created")
        for variable in targets:
            with variable.lock:
                variable.optimizer.set_hyperparams(updates)
        return len(targets)


def _all_finite(tensor: torch.Tensor) -> bool:
    """True if no element is NaN or Inf.

    A sum is finite only if every element is (NaN and Inf propagate), and it
    takes one pass without allocating, where torch.isfinite(t).all() makes a
    mask of the whole tensor. The sum is looked at as a Python float: a
    second torch call costs a small gradient more than its sum. A non-finite
    sum can also be an overflow of finite values, so that case is settled
    element by element.
    """
    if not tensor.is_floating_point() or math.isfinite(tensor.sum().item()):
        return True
    return bool(torch.isfinite(tensor).all())


def _show(spec: ps_pb2.VariableSpec) -> str:
    hyper = ", ".join(f"{k}={v:g}" for k, v in sorted(spec.optimizer.hyperparams.items()))
    return f"{codec.describe_meta(spec.meta)} optimizer={spec.optimizer.name}({hyper})"


def _copied(value: torch.Tensor) -> torch.Tensor:
    """A copy of `value` in memory numpy allocates, which asks the kernel for huge pages for a large block: a
    snapshot of a large variable then takes a page fault per 2 MiB, not per 4 KiB as a torch clone's memory."""
    if not value.numel():
        return value.clone()
    raw = torch.from_numpy(np.empty(value.numel() * value.element_size(), dtype=np.uint8))
    return raw.view(value.dtype).view(value.shape).copy_(value)
