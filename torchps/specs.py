"""Server-side optimizers as the wire names them: the names shards accept, and the client's value for one.

Shards implement variables' optimizers with torch.optim (ps_server/optimizers.py) and embedding tables' lazy
row optimizers in ps_server/row_optimizers.py; a test holds each list equal to the shards'.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from .proto import ps_pb2

__all__ = ["OPTIMIZER_NAMES", "ROW_OPTIMIZER_NAMES", "Optimizer", "wire_hyperparams"]

# "none" marks a variable gradients never update; the rest are torch.optim's classes, lower-cased.
OPTIMIZER_NAMES = ("none", "sgd", "adagrad", "adam", "adamw")
# Embedding tables' row optimizers (TableSpec.optimizer): torch.optim's sparse-capable ones, and FBGEMM's row-wise
# Adagrad. An Optimizer names one of these for a table.
ROW_OPTIMIZER_NAMES = ("sgd", "adagrad", "sparse_adam", "rowwise_adagrad")


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """A server-side optimizer: torch.optim's name and keyword arguments.

        Optimizer("sgd", lr=0.1, momentum=0.9, nesterov=True)
        Optimizer("adam", lr=1e-3, betas=(0.9, 0.999))
    """

    name: str
    hyperparams: Mapping[str, float | bool | tuple]

    def __init__(self, name: str, **hyperparams):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "hyperparams", dict(hyperparams))

    def to_proto(self) -> ps_pb2.OptimizerSpec:
        return ps_pb2.OptimizerSpec(name=self.name, hyperparams=wire_hyperparams(self.hyperparams))


def wire_hyperparams(hyperparams: Mapping) -> dict[str, float]:
    """torch.optim keyword arguments as the wire's float map (Adam's betas as beta1 and beta2)."""
    out = {}
    for key, value in hyperparams.items():
        if key == "betas":
            out["beta1"], out["beta2"] = (float(b) for b in value)
        else:
            out[key] = float(value)
    return out
