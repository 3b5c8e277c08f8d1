"""Lazy row optimizers for embedding tables: only the rows a step's gradient names change.

Each optimizer updates rows of a table shard given (the rows tensor, the
slots of the step's unique ids in it, their coalesced gradients), with the
same arithmetic as torch.optim on the sparse gradient of
nn.Embedding(sparse=True):

* "sgd": torch.optim.SGD (lr, maximize). torch refuses weight_decay with a
  sparse gradient and its momentum buffer would touch every row it ever saw,
  so neither is accepted.
* "adagrad": torch.optim.Adagrad (lr, lr_decay, initial_accumulator_value,
  eps, maximize); per-element accumulator "sum". Its sparse path keeps ONE step
  count per parameter: lr_decay decays with the table's steps, not the row's.
  weight_decay is refused, as torch does with sparse gradients.
* "sparse_adam": torch.optim.SparseAdam (lr, beta1, beta2, eps, maximize);
  per-element "exp_avg" and "exp_avg_sq", and ONE step count per parameter for
  the bias corrections, as torch's.
* "rowwise_adagrad": FBGEMM / torchrec EXACT_ROWWISE_ADAGRAD (lr, eps,
  initial_accumulator_value, maximize): one accumulator "sum" per row,
  sum += mean(g^2 over the row); row -= lr * g / (sqrt(sum) + eps).

Per-row state lives in tensors of shape (rows, width) in the same slot order as
the values (state_spec says which), so a row and its state move together. The
step count is the optimizer's own and counts every step() call, an empty one
included (torch counts a step whose sparse gradient names no row): a caller
matching torch on a whole table calls step() on every shard at every training
step. Untouched rows and their state are never written. No gRPC here.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from ..errors import InvalidArgumentError, OptimizerSpecError, TensorMismatchError
from .optimizers import torch_refusal

__all__ = ["ROW_OPTIMIZERS", "normalize_row_spec", "coalesce", "RowOptimizer"]

# name -> (the torch.optim class it matches, or None, and its hyperparameters with their defaults).
ROW_OPTIMIZERS: dict[str, tuple[type | None, dict[str, float]]] = {
    "sgd": (torch.optim.SGD, {"lr": 1e-3, "maximize": 0.0}),
    "adagrad": (torch.optim.Adagrad,
                {"lr": 1e-2, "lr_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10, "maximize": 0.0}),
    "sparse_adam": (torch.optim.SparseAdam, {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "maximize": 0.0}),
    "rowwise_adagrad": (None, {"lr": 1e-2, "eps": 1e-8, "initial_accumulator_value": 0.0, "maximize": 0.0}),
}
# Hyperparameters torch.optim has but cannot honour lazily on sparse gradients: why each is refused.
_REFUSED = {
    "momentum": "torch.optim.SGD's momentum buffer would update every row it has seen, not only the step's rows",
    "dampening": "it only applies with momentum, which a lazy optimizer cannot have",
    "nesterov": "it only applies with momentum, which a lazy optimizer cannot have",
    "weight_decay": "torch.optim refuses weight_decay with sparse gradients",
}


def normalize_row_spec(name: str, hyperparams: Mapping[str, float] | None = None) -> tuple[str, dict[str, float]]:
    """(lower-case name, every hyperparameter with its default filled in).

    Raises OptimizerSpecError for an unknown optimizer or hyperparameter, one
    that cannot be lazy (momentum, weight_decay), a value that is not finite,
    a maximize other than 0 or 1, or a value torch.optim itself refuses.
    """
    key = (name or "").lower()
    if key not in ROW_OPTIMIZERS:
        raise OptimizerSpecError(f"unknown row optimizer {name!r}; available: {sorted(ROW_OPTIMIZERS)}")
    cls, defaults = ROW_OPTIMIZERS[key]
    hyperparams = dict(hyperparams or {})
    refused = sorted(set(hyperparams) & set(_REFUSED))
    if refused:
        raise OptimizerSpecError(f"row optimizer {key!r} cannot take {refused}: {_REFUSED[refused[0]]}")
    unknown = sorted(set(hyperparams) - set(defaults))
    if unknown:
        raise OptimizerSpecError(f"row optimizer {key!r} has no hyperparameter(s) {unknown}; allowed: {list(defaults)}")
    try:
        full = {**defaults, **{k: float(v) for k, v in hyperparams.items()}}
    except (TypeError, ValueError):
        raise OptimizerSpecError(f"{key}: hyperparameters must be numbers. Received: {hyperparams}") from None
    bad = {k: v for k, v in full.items() if not math.isfinite(v) or (k == "maximize" and v not in (0.0, 1.0))}
    if bad:
        raise OptimizerSpecError(f"{key}: hyperparameters must be finite numbers (maximize 0 or 1). Received: {bad}")
    if cls is None:
        if full["lr"] < 0 or full["eps"] <= 0 or full["initial_accumulator_value"] < 0:
            raise OptimizerSpecError(f"{key}: needs lr >= 0, eps > 0 and initial_accumulator_value >= 0. "
                                     f"Received: {full}")
        return key, full
    kwargs = {k: v for k, v in full.items() if k not in ("beta1", "beta2", "maximize")}
    if "beta1" in full:
        kwargs["betas"] = (full["beta1"], full["beta2"])
    refusal = torch_refusal(cls, {**kwargs, "maximize": bool(full["maximize"])})  # "Invalid learning rate: -1"
    if refusal is not None:
        raise OptimizerSpecError(f"{key}: {refusal}")
    return key, full


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted unique ids, the sum of each id's gradient rows): torch's own sparse coalesce, same sums.

    Raises InvalidArgumentError unless ids is 1-D int64 and grads has one row per id.
    """
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise InvalidArgumentError(f"ids must be a 1-D int64 tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
    if grads.dim() != 2 or grads.shape[0] != ids.shape[0]:
        raise TensorMismatchError(f"gradients must be (len(ids), dim) = ({ids.shape[0]}, dim); "
                                  f"got {tuple(grads.shape)}")
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    summed = torch.sparse_coo_tensor(inverse[None], grads, (unique.shape[0], grads.shape[1]),
                                     check_invariants=False).coalesce()  # torch's own order of summation
    return unique, summed.values()


class RowOptimizer:
    """One table shard's lazy optimizer: hyperparameters and the step count. Not thread-safe: the table's
    lock guards it."""

    def __init__(self, name: str, hyperparams: Mapping[str, float] | None = None, steps: int = 0):
        self.name, self.hyperparams = normalize_row_spec(name, hyperparams)
        self.steps = int(steps)

    def state_spec(self, dim: int) -> dict[str, tuple[int, float]]:
        """Per-row state: name -> (columns per row, the value a new row starts with)."""
        if self.name in ("adagrad", "rowwise_adagrad"):
            return {"sum": (dim if self.name == "adagrad" else 1, self.hyperparams["initial_accumulator_value"])}
        if self.name == "sparse_adam":
            return {"exp_avg": (dim, 0.0), "exp_avg_sq": (dim, 0.0)}
        return {}

    def step(self, parts: Iterable[tuple[torch.Tensor, Mapping[str, torch.Tensor], torch.Tensor, torch.Tensor]],
             *, count: bool = True) -> None:
        """One optimizer step (torch's optimizer.step()): counts it (unless `count` is False: as the step
        counted last), then, for each (values, states, rows, grads) part, updates values[rows] and
        states[*][rows] in place with the unique rows' coalesced grads. Parts are disjoint pieces of one table
        (slabs); an empty iterable still counts the step."""
        if count or not self.steps:
            self.steps += 1
        update = getattr(self, "_" + self.name)
        coefficients = self._coefficients()
        for values, states, rows, grads in parts:
            if rows.numel():
                update(values, states, rows, -grads if self.hyperparams["maximize"] else grads, coefficients)

    def _coefficients(self) -> float:
        """The step's scalar: the learning rate, decayed or bias-corrected as torch does at this step count."""
        h = self.hyperparams
        if self.name == "adagrad":
            return h["lr"] / (1 + (self.steps - 1) * h["lr_decay"])
        if self.name == "sparse_adam":
            return h["lr"] * math.sqrt(1 - h["beta2"] ** self.steps) / (1 - h["beta1"] ** self.steps)
        return h["lr"]

    @staticmethod
    def _sgd(values, states, rows, grads, lr):
        values.index_add_(0, rows, grads, alpha=-lr)

    def _adagrad(self, values, states, rows, grads, clr):
        total = states["sum"].index_select(0, rows).add_(grads.pow(2))
        states["sum"].index_copy_(0, rows, total)
        std = total.sqrt_().add_(self.hyperparams["eps"])
        values.index_add_(0, rows, grads / std, alpha=-clr)

    def _sparse_adam(self, values, states, rows, grads, step_size):
        beta1, beta2, eps = (self.hyperparams[k] for k in ("beta1", "beta2", "eps"))
        old_avg = states["exp_avg"].index_select(0, rows)
        avg = grads.sub(old_avg).mul_(1 - beta1).add_(old_avg)
        states["exp_avg"].index_copy_(0, rows, avg)
        old_sq = states["exp_avg_sq"].index_select(0, rows)
        sq = grads.pow(2).sub_(old_sq).mul_(1 - beta2).add_(old_sq)
        states["exp_avg_sq"].index_copy_(0, rows, sq)
        values.index_add_(0, rows, -step_size * avg.div_(sq.sqrt_().add_(eps)))

    def _rowwise_adagrad(self, values, states, rows, grads, lr):
        total = states["sum"].index_select(0, rows).add_(grads.pow(2).mean(dim=1, keepdim=True))
        states["sum"].index_copy_(0, rows, total)
        values.index_add_(0, rows, grads * (lr / total.sqrt_().add_(self.hyperparams["eps"])), alpha=-1)

    def state_dict(self) -> dict:
        """{"name", "hyperparams", "steps"}: everything but the per-row state, which the table holds."""
        return {"name": self.name, "hyperparams": dict(self.hyperparams), "steps": self.steps}

    @classmethod
    def from_state_dict(cls, state: Mapping) -> RowOptimizer:
        """The optimizer state_dict() described; OptimizerSpecError if it names a bad spec."""
        return cls(state["name"], state["hyperparams"], state["steps"])
