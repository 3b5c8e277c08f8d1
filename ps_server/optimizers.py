"""Server-side optimizers: torch.optim's own implementations, one per variable.

A shard keeps, for each trainable variable, a torch.optim optimizer over that
variable, so its updates are torch.optim's updates bit for bit. The optimizer
sees the variable as pieces of PIECE_ELEMENTS elements (views of its memory;
every optimizer here works element by element), so the temporaries of a step
(Adam's square root and quotient, a weight decay's sum) are a piece's size,
not the variable's; state_dict and load_state_dict speak for the whole
variable, as torch.optim over one tensor would. This module also turns an
OptimizerSpec (name + hyperparameters as floats) into one and back. No gRPC
here.
"""

from __future__ import annotations

import inspect
import math
from typing import Mapping

import torch

from ..errors import OptimizerSpecError

__all__ = ["OPTIMIZERS", "normalize_spec", "structural_changes", "VariableOptimizer"]

# name -> (torch.optim class, hyperparameters accepted on the wire).
# Adam's `betas` travels as beta1/beta2 because the wire map holds floats.
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer] | None, tuple[str, ...]]] = {
    "none": (None, ()),
    "sgd": (torch.optim.SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")),
    "adagrad": (torch.optim.Adagrad,
                ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize")),
    "adam": (torch.optim.Adam, ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize")),
    "adamw": (torch.optim.AdamW, ("lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize")),
}
_BOOLEAN = {"nesterov", "amsgrad", "maximize"}
# Hyperparameters that change what the optimizer keeps per element, or read state it may not have kept:
# amsgrad (Adam's max_exp_avg_sq), momentum turned on or off (SGD's momentum buffer), nesterov (SGD's
# update rule over that buffer), initial_accumulator_value (read only when Adagrad's state is made).
_STRUCTURAL = {"sgd": ("momentum", "nesterov"), "adam": ("amsgrad",), "adamw": ("amsgrad",),
               "adagrad": ("initial_accumulator_value",)}
PIECE_ELEMENTS = 1 << 20  # 4 MiB of float32: a step's temporaries stay this small
_SCALAR_STATE = {"step"}  # torch.optim state entries that are per parameter, not per element


def _defaults(cls: type) -> dict[str, float]:
    params = inspect.signature(cls).parameters
    out = {k: float(p.default) for k, p in params.items()
           if k not in ("params", "betas") and isinstance(p.default, (int, float, bool))}
    if "betas" in params:
        out["beta1"], out["beta2"] = (float(b) for b in params["betas"].default)
    return out


def normalize_spec(name: str, hyperparams: Mapping[str, float]) -> tuple[str, dict[str, float]]:
    """(lower-case name, every hyperparameter with torch.optim's defaults filled in).

    Raises OptimizerSpecError for an unknown optimizer or hyperparameter, a
    value that is not finite, a flag other than 0 or 1, or one torch.optim
    itself refuses (a negative learning rate, betas outside [0, 1), ...).
    Two specs are equal exactly when their normalized forms are.
    """
    key = (name or "").lower()
    if key not in OPTIMIZERS:
        raise OptimizerSpecError(f"unknown optimizer {name!r}; available: {sorted(OPTIMIZERS)}")
    cls, allowed = OPTIMIZERS[key]
    unknown = sorted(set(hyperparams) - set(allowed))
    if unknown:
        raise OptimizerSpecError(f"optimizer {key!r} has no hyperparameter(s) {unknown}; allowed: {list(allowed)}")
    if cls is None:
        return key, {}
    full = {k: v for k, v in _defaults(cls).items() if k in allowed}
    full.update({k: float(v) for k, v in hyperparams.items()})
    _check_values(key, cls, full)
    return key, full


def structural_changes(name: str, current: Mapping[str, float], updates: Mapping[str, float]) -> list[str]:
    """The updates of optimizer `name`'s hyperparameters (in force: `current`) that change the structure of
    its state, as "key a -> b" (momentum counts only from or to 0); after a variable's first step they are
    refused (the store's set_hyperparams)."""
    changes = []
    for key in _STRUCTURAL.get(name, ()):
        if key not in updates:
            continue
        old, new = float(current.get(key, 0.0)), float(updates[key])
        if (old != 0.0) != (new != 0.0) if key == "momentum" else old != new:
            changes.append(f"{key} {old:g} -> {new:g}")
    return changes


def _check_values(name: str, cls: type, hyperparams: Mapping[str, float]) -> None:
    """OptimizerSpecError unless every value is finite, flags are 0 or 1, and torch.optim accepts them all."""
    bad = {k: v for k, v in hyperparams.items() if not math.isfinite(v) or (k in _BOOLEAN and v not in (0.0, 1.0))}
    if bad:
        raise OptimizerSpecError(f"{name}: hyperparameters must be finite numbers (flags 0 or 1). Received: {bad}")
    probe = torch.zeros(1, requires_grad=True)
    try:
        cls([probe], **_torch_kwargs(hyperparams))
    except (ValueError, TypeError, RuntimeError) as exc:  # torch's own range checks: "Invalid learning rate: -1"
        raise OptimizerSpecError(f"{name}: {exc}") from None


def _piece_of(key: str, value, start: int, end: int):
    """A piece's own copy of one entry of a whole variable's optimizer state (a step counter whole: every
    piece counts its own steps, and a shared tensor would be counted once per piece)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.clone() if key in _SCALAR_STATE else value.reshape(-1)[start:end].clone()


def _torch_kwargs(hyperparams: Mapping[str, float]) -> dict:
    kwargs = {k: (bool(v) if k in _BOOLEAN else v) for k, v in hyperparams.items() if k not in ("beta1", "beta2")}
    if "beta1" in hyperparams:
        kwargs["betas"] = (hyperparams["beta1"], hyperparams["beta2"])
    return kwargs


class VariableOptimizer:
    """The optimizer of one variable. Not thread-safe: the store holds the lock."""

    def __init__(self, name: str, hyperparams: Mapping[str, float], param: torch.Tensor):
        self.name, self.hyperparams = normalize_spec(name, hyperparams)
        self.param = param
        cls = OPTIMIZERS[self.name][0]
        self._optimizer = None
        flat = param.detach().view(-1)
        self._bounds = [(start, min(start + PIECE_ELEMENTS, flat.numel()))
                        for start in range(0, max(flat.numel(), 1), PIECE_ELEMENTS)]
        self._pieces: list[torch.nn.Parameter] = []
        if cls is not None:
            if not param.is_floating_point():
                raise OptimizerSpecError(f"optimizer {self.name!r} needs a floating-point variable, got {param.dtype}")
            self._pieces = [torch.nn.Parameter(flat[start:end]) for start, end in self._bounds]  # views: no copy
            try:
                self._optimizer = cls(self._pieces, **_torch_kwargs(self.hyperparams))
            except ValueError as exc:  # torch validates ranges: "Invalid learning rate: -1"
                raise OptimizerSpecError(f"{self.name}: {exc}") from None

    @property
    def trainable(self) -> bool:
        return self._optimizer is not None

    def apply(self, grad: torch.Tensor) -> None:
        """One optimizer step on the variable with `grad` (same dtype and shape)."""
        flat = grad.reshape(-1)
        for piece, (start, end) in zip(self._pieces, self._bounds):
            piece.grad = flat[start:end]
        self._optimizer.step()
        for piece in self._pieces:
            piece.grad = None

    def set_hyperparams(self, updates: Mapping[str, float]) -> None:
        """Changes hyperparameters from the next step on (e.g. {'lr': 0.01})."""
        _, current = normalize_spec(self.name, {**self.hyperparams, **updates})
        self._optimizer.param_groups[0].update(_torch_kwargs(current))
        self.hyperparams = current

    def state_dict(self) -> dict:
        """The torch optimizer's state (momentum buffers, Adam moments, step counts), copied, as torch.optim
        over the variable as one tensor would give it: {"state": {0: ...}, "param_groups": [...]}."""
        if self._optimizer is None:
            return {}
        state = self._optimizer.state_dict()
        pieces = [state["state"].get(i, {}) for i in range(len(self._pieces))]
        whole = {}
        for key, value in pieces[0].items():
            if isinstance(value, torch.Tensor) and key not in _SCALAR_STATE:
                whole[key] = torch.cat([p[key].reshape(-1) for p in pieces]).view(self.param.shape)
            else:
                whole[key] = value.clone() if isinstance(value, torch.Tensor) else value
        (group,) = state["param_groups"]
        return {"state": {0: whole} if whole else {}, "param_groups": [{**group, "params": [0]}]}

    def load_state_dict(self, state: dict) -> None:
        """Restores what state_dict() returned (hyperparameters included)."""
        if self._optimizer is None or not state:
            return
        whole = state["state"].get(0, state["state"].get("0", {}))
        pieces = {}
        if whole:
            for i, (start, end) in enumerate(self._bounds):
                pieces[i] = {key: _piece_of(key, value, start, end) for key, value in whole.items()}
        (group,) = state["param_groups"]
        self._optimizer.load_state_dict({"state": pieces,
                                         "param_groups": [{**group, "params": list(range(len(self._pieces)))}]})

    def current(self) -> dict[str, float]:
        """The hyperparameters in force now."""
        return dict(self.hyperparams)
