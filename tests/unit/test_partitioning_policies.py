"""Partitioning policies and the name -> pieces map (torchps.partitioning), without shards."""

import pytest
import torch

from torchps.errors import ClusterConfigError, TensorMismatchError
from torchps.partitioning import (FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner, NoPartitioner,
                                  Partitions, check_manifest, partitioner_from_dict, partitioner_from_spec, row_ranges)

KIB = 1 << 10


@pytest.mark.parametrize("shape, num_ps, pieces", [
    ((8192, 784), 4, 4),    # 25.7 MB: one piece per shard
    ((8192, 784), 1, 1),    # max_shards defaults to the shard count
    ((784, 100), 2, 1),     # 313,600 B: two pieces would be under 256 KiB each
    ((1024, 128), 4, 2),    # 512 KiB: two pieces of 256 KiB
    ((3, 1 << 20), 8, 3),   # never more pieces than rows
    ((100,), 4, 1),         # small
    ((), 4, 1),             # a scalar is never cut
])
def test_min_size_partitioner_as_tensorflow_s(shape, num_ps, pieces):
    assert MinSizePartitioner().pieces(shape, 4, num_ps) == pieces


def test_max_size_fixed_and_none():
    assert MaxSizePartitioner(max_shard_bytes=100 * KIB).pieces((1000, 100), 4, 2) == 4  # 400,000 B / 102,400
    assert MaxSizePartitioner(max_shard_bytes=100 * KIB, max_shards=3).pieces((1000, 100), 4, 2) == 3
    assert FixedShardsPartitioner(5).pieces((1000, 1), 4, 2) == 5
    assert FixedShardsPartitioner(5).pieces((2, 1), 4, 2) == 2
    assert NoPartitioner().pieces((1 << 20, 1024), 4, 8) == 1


@pytest.mark.parametrize("make", [lambda: MinSizePartitioner(0), lambda: MinSizePartitioner(max_shards=-1),
                                  lambda: MaxSizePartitioner(0), lambda: FixedShardsPartitioner(1.5),
                                  lambda: FixedShardsPartitioner(True)])
def test_bad_policies_are_refused(make):
    with pytest.raises(ClusterConfigError):
        make()


def test_policies_survive_their_manifest_form():
    for policy in (MinSizePartitioner(), MinSizePartitioner(1024, 3), MaxSizePartitioner(4096), FixedShardsPartitioner(2),
                   NoPartitioner()):
        assert partitioner_from_dict(policy.to_dict()) == policy
    with pytest.raises(ClusterConfigError):
        partitioner_from_dict({"kind": "nonsense"})


def test_row_ranges_give_the_first_pieces_the_extra_rows():
    assert row_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert row_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_split_gives_views_and_join_rebuilds():
    partitions = Partitions(FixedShardsPartitioner(3), num_ps=3)
    wire = partitions.add("w", (10, 4), torch.float32)
    assert wire == [("w/part_0", 64), ("w/part_1", 48), ("w/part_2", 48)]
    assert partitions.add("b", (1, 4), torch.float32) == [("b", 16)]  # one row: whole
    assert partitions.add("w", (10, 4), torch.float32) == wire  # idempotent
    w, b = torch.randn(10, 4), torch.randn(1, 4)
    pieces = partitions.split({"w": w, "b": b})
    assert list(pieces) == ["w/part_0", "w/part_1", "w/part_2", "b"]
    assert pieces["w/part_1"].data_ptr() == w[4].data_ptr() and pieces["w/part_1"].is_contiguous()
    assert partitions.wire_names(["b", "w"]) == ["b", "w/part_0", "w/part_1", "w/part_2"]
    assert partitions.whole_of("w/part_2") == "w" and partitions.whole_of("b") == "b"
    joined = partitions.join({k: v.clone() for k, v in pieces.items()}, ["w", "b"])
    assert torch.equal(joined["w"], w) and torch.equal(joined["b"], b)
    with pytest.raises(TensorMismatchError):
        partitions.split({"w": torch.zeros(9, 4)})
    assert "w [10, 4] in 3 pieces: part_0 rows 0-3, part_1 rows 4-6, part_2 rows 7-9" in partitions.report()[0]


def test_manifest_checks():
    partitions = Partitions(MinSizePartitioner(1024), num_ps=2)
    partitions.add("w", (512, 4), torch.float32)
    manifest = partitions.manifest()
    check_manifest(manifest)
    manifest["splits"]["w"]["pieces"][1][1] = 300  # a gap in the rows
    with pytest.raises(ValueError):
        check_manifest(manifest)


def test_command_line_specs():
    assert partitioner_from_spec("min_size") == MinSizePartitioner()
    assert partitioner_from_spec("min_size:1024:2") == MinSizePartitioner(1024, 2)
    assert partitioner_from_spec("max_size:4096") == MaxSizePartitioner(4096)
    assert partitioner_from_spec("fixed:3") == FixedShardsPartitioner(3)
    assert partitioner_from_spec("none") == NoPartitioner()
    for bad in ("", "fixed", "fixed:x", "max_size", "none:1", "min_size:1:2:3", "greedy"):
        with pytest.raises(ClusterConfigError):
            partitioner_from_spec(bad)
    with pytest.raises(ClusterConfigError, match="num_shards must be a positive integer"):
        partitioner_from_spec("fixed:0")
