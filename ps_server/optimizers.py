"""Server-side optimizers: torch.optim's own arithmetic, one optimizer per variable.

A shard keeps, for each trainable variable, the state torch.optim would keep
for it (momentum buffers, Adam's moments, step counts) and steps it with
torch.optim's functional forms (torch.optim.sgd.sgd, adam.adam, ...), the
functions torch.optim's classes call themselves, with the same arguments: its
updates are torch.optim's bit for bit. (The classes are not used: making one,
and each step, imports torch._dynamo, a second and more of CPU in every shard
process for a compiler a shard never runs.) The variable is stepped as pieces
of PIECE_ELEMENTS elements (views of its memory; every optimizer here works
element by element), so the temporaries of a step (Adam's square root and
quotient, a weight decay's sum) are a piece's size, not the variable's;
state_dict and load_state_dict speak for the whole variable, as torch.optim
over one tensor would. This module also turns an OptimizerSpec (name +
hyperparameters as floats) into one and back. No gRPC here.
"""

from __future__ import annotations

import inspect
import math
from typing import Mapping

import torch
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

from ..errors import OptimizerSpecError

__all__ = ["OPTIMIZERS", "normalize_spec", "structural_changes", "torch_refusal", "VariableOptimizer"]

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
    refusal = torch_refusal(cls, _torch_kwargs(hyperparams))
    if refusal is not None:
        raise OptimizerSpecError(f"{name}: {refusal}")


_NO_PARAMETERS = "optimizer got an empty parameter list"


def torch_refusal(cls: type, kwargs: Mapping) -> str | None:
    """What torch.optim class `cls` says against `kwargs` ("Invalid learning rate: -1"), or None if it takes
    them. Asked of the class with no parameters: each torch.optim class checks its hyperparameters before
    torch.optim.Optimizer refuses the empty list, which it does before anything imports torch._dynamo."""
    try:
        cls([], **kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        return None if str(exc) == _NO_PARAMETERS else str(exc)
    return None


def _piece_of(key: str, value, start: int, end: int, dtype: torch.dtype):
    """A piece's own copy of one entry of a whole variable's optimizer state, in the variable's dtype as
    torch.optim loads it (a step counter whole: every piece counts its own steps, and a shared tensor would be
    counted once per piece)."""
    if not isinstance(value, torch.Tensor):
        return value
    if key in _SCALAR_STATE:
        return value.clone()
    return value.reshape(-1)[start:end].to(dtype=dtype, copy=True)


def _torch_kwargs(hyperparams: Mapping[str, float]) -> dict:
    kwargs = {k: (bool(v) if k in _BOOLEAN else v) for k, v in hyperparams.items() if k not in ("beta1", "beta2")}
    if "beta1" in hyperparams:
        kwargs["betas"] = (hyperparams["beta1"], hyperparams["beta2"])
    return kwargs


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim gives a step counter."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _sgd(h: Mapping[str, float], params: list, grads: list, states: list[dict]) -> None:
    momentum = h["momentum"]
    if momentum == 0 and h["weight_decay"] == 0 and not h["maximize"] and params[0].device.type == "cpu":
        for param, grad in zip(params, grads):  # torch.optim's plain step on the CPU (its single-tensor one),
            param.add_(grad, alpha=-h["lr"])  # without its per-call dispatch
        return
    buffers = [state.get("momentum_buffer") for state in states] if momentum != 0 else []
    sgd(params, grads, buffers, weight_decay=h["weight_decay"], momentum=momentum, lr=h["lr"],
        dampening=h["dampening"], nesterov=bool(h["nesterov"]), maximize=bool(h["maximize"]), has_sparse_grad=False,
        foreach=None, fused=None)
    for state, buffer in zip(states, buffers):
        state["momentum_buffer"] = buffer


def _adam_family(function):
    def step(h: Mapping[str, float], params: list, grads: list, states: list[dict]) -> None:
        amsgrad = bool(h["amsgrad"])
        for state, param in zip(states, params):
            if not state:  # torch.optim makes Adam's state at a parameter's first step
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        function(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                 [s["max_exp_avg_sq"] for s in states] if amsgrad else [], [s["step"] for s in states],
                 foreach=None, capturable=False, differentiable=False, fused=None, amsgrad=amsgrad,
                 beta1=h["beta1"], beta2=h["beta2"], lr=h["lr"], weight_decay=h["weight_decay"], eps=h["eps"],
                 maximize=bool(h["maximize"]))
    return step


def _adagrad(h: Mapping[str, float], params: list, grads: list, states: list[dict]) -> None:
    adagrad(params, grads, [s["sum"] for s in states], [s["step"] for s in states], lr=h["lr"],
            weight_decay=h["weight_decay"], lr_decay=h["lr_decay"], eps=h["eps"], maximize=bool(h["maximize"]),
            has_sparse_grad=False, foreach=None, differentiable=False, fused=None)


def _adagrad_state(h: Mapping[str, float], param: torch.Tensor) -> dict:
    """Adagrad's state, which torch.optim makes with the optimizer."""
    return {"step": torch.tensor(0.0, dtype=_scalar_dtype()),
            "sum": torch.full_like(param, h["initial_accumulator_value"], memory_format=torch.preserve_format)}


_STEPS = {"sgd": _sgd, "adam": _adam_family(adam), "adamw": _adam_family(adamw),
          "adagrad": _adagrad}


class VariableOptimizer:
    """The optimizer of one variable. Not thread-safe: the store holds the lock."""

    def __init__(self, name: str, hyperparams: Mapping[str, float], param: torch.Tensor):
        self.name, self.hyperparams = normalize_spec(name, hyperparams)
        self.param = param
        self._step = _STEPS.get(self.name)
        flat = param.detach().view(-1)
        self._bounds = [(start, min(start + PIECE_ELEMENTS, flat.numel()))
                        for start in range(0, max(flat.numel(), 1), PIECE_ELEMENTS)]
        self._pieces: list[torch.Tensor] = []
        self._states: list[dict] = []  # torch.optim's state of each piece
        if self._step is not None:
            if not param.is_floating_point():
                raise OptimizerSpecError(f"optimizer {self.name!r} needs a floating-point variable, got {param.dtype}")
            self._pieces = [flat[start:end] for start, end in self._bounds]  # views: no copy
            self._states = [self._new_state(piece) for piece in self._pieces]

    def _new_state(self, piece: torch.Tensor) -> dict:
        return _adagrad_state(self.hyperparams, piece) if self.name == "adagrad" else {}

    @property
    def trainable(self) -> bool:
        return self._step is not None

    def apply(self, grad: torch.Tensor) -> None:
        """One optimizer step on the variable with `grad` (same dtype and shape), under torch.no_grad() (the
        caller's: VariableStore.apply enters it once for all of a push's variables)."""
        flat = grad.reshape(-1)
        pieces = [flat] if len(self._bounds) == 1 else [flat[start:end] for start, end in self._bounds]
        self._step(self.hyperparams, self._pieces, pieces, self._states)

    def set_hyperparams(self, updates: Mapping[str, float]) -> None:
        """Changes hyperparameters from the next step on (e.g. {'lr': 0.01})."""
        _, self.hyperparams = normalize_spec(self.name, {**self.hyperparams, **updates})

    def state_dict(self) -> dict:
        """The optimizer's state (momentum buffers, Adam moments, step counts), copied, as torch.optim over the
        variable as one tensor would give it: {"state": {0: ...}, "param_groups": [{hyperparameters...}]}."""
        if self._step is None:
            return {}
        whole = {}
        for key, value in self._states[0].items():
            if isinstance(value, torch.Tensor) and key not in _SCALAR_STATE:
                whole[key] = torch.cat([s[key].reshape(-1) for s in self._states]).view(self.param.shape)
            else:
                whole[key] = value.clone() if isinstance(value, torch.Tensor) else value
        group = {**_torch_kwargs(self.hyperparams), "params": [0]}
        return {"state": {0: whole} if whole else {}, "param_groups": [group]}

    def load_state_dict(self, state: dict) -> None:
        """Restores what state_dict() returned (hyperparameters included; also torch.optim's own state_dict of
        an optimizer over the variable as one tensor)."""
        if self._step is None or not state:
            return
        whole = state["state"].get(0, state["state"].get("0", {}))
        (group,) = state["param_groups"]
        allowed = OPTIMIZERS[self.name][1]
        loaded = {k: float(v) for k, v in group.items() if k in allowed}
        if "betas" in group and "beta1" in allowed:
            loaded["beta1"], loaded["beta2"] = (float(b) for b in group["betas"])
        self.set_hyperparams(loaded)
        if not whole:
            self._states = [self._new_state(piece) for piece in self._pieces]
            return
        self._states = [{key: _piece_of(key, value, start, end, self.param.dtype) for key, value in whole.items()}
                        for start, end in self._bounds]

    def current(self) -> dict[str, float]:
        """The hyperparameters in force now."""
        return dict(self.hyperparams)
