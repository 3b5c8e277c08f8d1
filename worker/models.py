"""Built-in models for ps-worker, and loading a user's own through --entry."""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
from typing import Callable

import torch
from torch import nn

from ..errors import ClusterConfigError
from .data import Dataset, load_dataset

__all__ = ["MODELS", "Task", "build_model", "load_entry", "mlp", "cnn", "new_model", "read_init", "load_init"]


def mlp(hidden: int = 100) -> nn.Module:
    """The seed blog post's model: 784-hidden-10 with a sigmoid hidden layer."""
    return nn.Sequential(nn.Linear(784, hidden), nn.Sigmoid(), nn.Linear(hidden, 10))


def cnn() -> nn.Module:
    """A small convolutional net for 28x28 images (about 50k parameters)."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)),
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 32), nn.ReLU(), nn.Linear(32, 10))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "cnn": cnn}

@dataclasses.dataclass
class Task:
    """What a worker trains: a model, its data and a loss (what an --entry function returns)."""

    model: nn.Module
    dataset: Dataset
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = dataclasses.field(
        default_factory=lambda: nn.functional.cross_entropy)


def new_model(name: str, hidden: int = 100) -> nn.Module:
    """A freshly initialised built-in model."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built in: {sorted(MODELS)} (or use --entry module:function)")
    return mlp(hidden) if name == "mlp" else MODELS[name]()


def build_model(name: str, dataset: str, hidden: int = 100) -> Task:
    """A built-in model on a named dataset (or idx folder) with cross-entropy loss."""
    return Task(new_model(name, hidden), load_dataset(dataset))


def read_init(path: str | os.PathLike) -> dict:
    """The state_dict saved in `path` (--init-from); ClusterConfigError in one line if the file is
    missing or holds no state_dict torch.load reads."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ClusterConfigError(f"--init-from {path}: no such file") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        raise ClusterConfigError(f"--init-from {path}: not a file torch.load can read ({type(exc).__name__})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ClusterConfigError(f"--init-from {path}: not a state_dict (a dict of tensors, as "
                                 "torch.save(model.state_dict(), path) writes)")
    return state


def load_init(model: nn.Module, state: dict, path: str | os.PathLike) -> None:
    """Loads `state` (read from `path`) into `model`; ClusterConfigError in one line if it does not fit."""
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ClusterConfigError(f"--init-from {path} does not fit the model: {' '.join(str(exc).split())}") from None


def load_entry(spec: str) -> Task:
    """Calls 'package.module:function', which returns a Task or a (model, dataset, loss) tuple."""
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"--entry must look like 'package.module:function', got {spec!r}")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function()
    if isinstance(result, Task):
        return result
    model, dataset, loss = result
    return Task(model, dataset, loss)
