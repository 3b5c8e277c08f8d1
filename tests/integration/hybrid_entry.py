"""An --entry for `ps-worker --dense allreduce` in test_hybrid_allreduce.py: an EmbeddingBag on the shards
under a dense head, on synthetic data (no dataset package needed). A bag of ids is class 1 when more of its
ids are below the middle of the table."""

from __future__ import annotations

import torch
from torch import nn

from torchps.client import EmbeddingBag, Optimizer
from torchps.worker.data import Dataset

ROWS, DIM, BAG = 50, 8, 4


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = EmbeddingBag(ROWS, DIM, mode="mean", optimizer=Optimizer("adagrad", lr=0.1))
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids))


def _split(count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, ROWS, (count, BAG), generator=gen)
    return ids, ((ids < ROWS // 2).sum(1) > BAG // 2).long()


def task():
    gen = torch.Generator().manual_seed(7)
    (x_train, y_train), (x_test, y_test) = _split(400, gen), _split(100, gen)
    return Model(), Dataset("synthetic-bags", x_train, y_train, x_test, y_test), nn.functional.cross_entropy
