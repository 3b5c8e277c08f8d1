"""Built-in models for ps-worker, and loading a user's own through --entry."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import torch
from torch import nn

from .data import Dataset, load_dataset

__all__ = ["MODELS", "MODEL_DEFAULTS", "Task", "build_model", "load_entry", "mlp", "cnn", "default_lr"]


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

# What trains each built-in model well, used for the flags a user leaves out (any flag changes only itself).
# mlp: 0.87 on Fashion-MNIST in 10 epochs with 2 workers (the README's demo); cnn: 0.92-0.94 on mnist5k in
# 5 epochs with 2 workers (3 seeds; lr 0.05 diverged once, 0.01 reached 0.91).
# An --entry model gets the mlp's.
MODEL_DEFAULTS = {
    "mlp": {"epochs": 10, "sgd_lr": 0.1, "momentum": 0.9},
    "cnn": {"epochs": 5, "sgd_lr": 0.02, "momentum": 0.9},
}
_OTHER_LR = {"adam": 1e-3, "adamw": 1e-3, "adagrad": 1e-2}  # the usual starting points of torch.optim's others


def default_lr(model: str, optimizer: str) -> float:
    """The learning rate ps-worker uses for `model` and `optimizer` when --lr is left out."""
    return MODEL_DEFAULTS.get(model, MODEL_DEFAULTS["mlp"])["sgd_lr"] if optimizer == "sgd" else _OTHER_LR[optimizer]


@dataclasses.dataclass
class Task:
    """What a worker trains: a model, its data and a loss (what an --entry function returns)."""

    model: nn.Module
    dataset: Dataset
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = dataclasses.field(
        default_factory=lambda: nn.functional.cross_entropy)


def build_model(name: str, dataset: str, hidden: int = 100) -> Task:
    """A built-in model on a named dataset (or idx folder) with cross-entropy loss."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built in: {sorted(MODELS)} (or use --entry module:function)")
    model = mlp(hidden) if name == "mlp" else MODELS[name]()
    return Task(model, load_dataset(dataset))


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
