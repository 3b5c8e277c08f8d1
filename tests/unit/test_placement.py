"""Placement: the deterministic variable -> shard map."""

import pytest

from torchps.client import ClusterConfigError, Placement, UnknownVariableError


def test_round_robin_matches_replica_device_setter():
    """The i-th variable goes to shard i mod P (TF's replica_device_setter), whatever its size."""
    placement = Placement(2)
    assert [placement.add(f"v{i}", nbytes) for i, nbytes in enumerate([10, 1, 10_000, 5, 0], 1)] == [0, 1, 0, 1, 0]
    three = Placement(3, "round_robin")
    assert [three.add(f"v{i}", 4) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert three.names() == [f"v{i}" for i in range(7)]


def test_single_shard():
    placement = Placement(1, "greedy")
    assert {placement.add(n, 8) for n in "abc"} == {0}


def test_greedy_least_loaded_ties_to_lowest():
    """Greedy puts each variable on the shard with the fewest bytes, ties to the lowest index."""
    placement = Placement(3, "greedy")
    placed = [placement.add(name, nbytes) for name, nbytes in
              [("a", 100), ("b", 50), ("c", 10), ("d", 30), ("e", 5), ("f", 200), ("g", 0)]]
    # loads: a->0 [100,0,0]; b->1 [100,50,0]; c->2 [100,50,10]; d->2 [100,50,40];
    # e->2 [100,50,45]; f->2 [100,50,245]; g->1 (least loaded: 50)
    assert placed == [0, 1, 2, 2, 2, 2, 1]
    assert placement.bytes_per_shard() == [100, 50, 245]


def test_greedy_ties():
    placement = Placement(2, "greedy")
    assert [placement.add(n, 8) for n in "abcd"] == [0, 1, 0, 1]
    assert [Placement(3, "greedy").add("x", 0)] == [0]


@pytest.mark.parametrize("strategy", ["round_robin", "greedy"])
def test_deterministic(strategy):
    """Two placements fed the same names in the same order agree."""
    items = [(f"layer{i}.weight", (i * 7919) % 1000) for i in range(50)]
    first, second = Placement(4, strategy), Placement(4, strategy)
    for name, nbytes in items:
        first.add(name, nbytes)
    for name, nbytes in items:
        second.add(name, nbytes)
    assert [first.shard_of(n) for n, _ in items] == [second.shard_of(n) for n, _ in items]
    assert first.report() == second.report()


@pytest.mark.parametrize("strategy", ["round_robin", "greedy"])
def test_add_is_idempotent(strategy):
    """Adding a known name again keeps its shard and does not count its bytes twice."""
    placement = Placement(2, strategy)
    assert placement.add("a", 100) == 0
    assert placement.add("a", 100) == 0
    assert placement.add("a", 999) == 0
    assert placement.bytes_per_shard() == [100, 0]
    assert placement.add("b", 1) == 1  # the repeats did not advance round robin either
    assert placement.names() == ["a", "b"]


def test_group_keeps_order_per_shard():
    placement = Placement(2)
    for name in "abcde":
        placement.add(name, 1)
    assert placement.group(["e", "b", "a", "d"]) == {0: ["e", "a"], 1: ["b", "d"]}
    assert "c" in placement and "z" not in placement


def test_report():
    placement = Placement(2, "greedy")
    placement.add("big", 1_234_567)
    placement.add("small", 10)
    placement.add("tiny", 1)
    text = placement.report(["h0:1", "h1:2"])
    lines = text.splitlines()
    assert lines[0] == "placement (greedy, 2 shards):"
    assert any("big" in line and "ps:0" in line and "1,234,567 B" in line for line in lines)
    assert any("small" in line and "ps:1" in line for line in lines)
    assert any("tiny" in line and "ps:1" in line for line in lines)
    assert "ps:0 (h0:1): 1 variables, 1,234,567 B" in text
    assert "ps:1 (h1:2): 2 variables, 11 B" in text
    assert "(h0:1)" not in placement.report()


def test_unknown_name():
    placement = Placement(2)
    placement.add("a", 1)
    with pytest.raises(UnknownVariableError, match="'nope' is not placed"):
        placement.shard_of("nope")
    with pytest.raises(UnknownVariableError, match="'nope'"):
        placement.group(["a", "nope"])


def test_bad_arguments():
    with pytest.raises(ClusterConfigError, match="unknown placement strategy 'fastest'"):
        Placement(2, "fastest")
    with pytest.raises(ClusterConfigError, match="at least one shard"):
        Placement(0)
