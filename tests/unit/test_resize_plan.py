"""The pure parts of a live resize: the plan, its batches, and a shard's layout owner."""

import pytest

from torchps.client.resize import _batches, plan
from torchps.errors import InvalidArgumentError, LayoutChangedError, ModeConflictError, VariableMovingError
from torchps.ps_server.layout import ShardLayout


def test_growing_moves_the_largest_variables_until_the_load_is_even():
    held = {0: [("a", 40), ("b", 30), ("c", 10)], 1: [("d", 40), ("e", 20)]}
    placement = plan(held, 3, balance=True)
    load = [sum(dict(sum(held.values(), []))[n] for n, s in placement.items() if s == shard) for shard in range(3)]
    assert sorted(placement) == ["a", "b", "c", "d", "e"]
    assert max(load) - min(load) <= 20 and load[2] > 0
    assert plan(held, 3, balance=True) == placement  # deterministic


def test_shrinking_moves_only_the_removed_shards_variables():
    held = {0: [("a", 10)], 1: [("b", 10)], 2: [("c", 30), ("d", 5)]}
    placement = plan(held, 2, balance=False)
    assert placement["a"] == 0 and placement["b"] == 1
    assert {placement["c"], placement["d"]} == {0, 1}  # the largest to one, the next to the other


def test_nothing_moves_when_the_load_cannot_get_more_even():
    held = {0: [("a", 10)], 1: [("b", 10)]}
    assert plan(held, 2, balance=True) == {"a": 0, "b": 1}


def test_batches_hold_at_most_the_limit_and_a_larger_variable_alone():
    sizes = {"a": 10, "b": 6, "c": 5, "d": 30}
    assert _batches(["d", "a", "b", "c"], sizes, 16) == [["d"], ["a", "b"], ["c"]]
    assert _batches([], sizes, 16) == []


def test_a_layout_explains_names_it_does_not_hold():
    layout = ShardLayout(1)
    layout.missing("x")  # epoch 0: nothing to say
    assert layout.set(1, ["h:0", "h:1"], {"x": 1, "y": 0})
    with pytest.raises(VariableMovingError):
        layout.missing("x")
    with pytest.raises(LayoutChangedError, match="on ps 0"):
        layout.missing("y")
    layout.exported(["z"], 0, [{"name": "z"}], 1)
    with pytest.raises(LayoutChangedError, match="moved from ps 1 to ps 0"):
        layout.missing("z")
    assert layout.sent(["z"]) == (0, [{"name": "z"}]) and layout.sent(["y"]) is None
    assert layout.set(2, ["h:0", "h:1"], {"x": 1, "y": 0, "z": 0})  # kept whatever epochs pass
    assert layout.outbox() == [(["z"], 0, 1)] and layout.confirm(["z"], 1) == []  # not ps 1's to confirm
    assert layout.confirm(["z", "w"], 0) == ["z"] and layout.sent(["z"]) is None
    layout.check_member()


def test_a_layout_takes_later_epochs_only():
    layout = ShardLayout(2)
    assert layout.set(1, ["h:0", "h:1", "h:2"], {"x": 2})
    assert not layout.set(1, ["h:0", "h:1", "h:2"], {"x": 2})  # the same again: a no-op
    with pytest.raises(ModeConflictError, match="another layout"):
        layout.set(1, ["h:0", "h:1", "h:2"], {"x": 0})
    assert layout.set(2, ["h:0", "h:1"], {"x": 0})
    with pytest.raises(ModeConflictError, match="older"):
        layout.set(1, ["h:0", "h:1", "h:2"], {"x": 2})
    with pytest.raises(LayoutChangedError, match="left the job"):
        layout.check_member()
    with pytest.raises(InvalidArgumentError):
        layout.set(3, ["h:0"], {"x": 1})  # placed past the shards
    state = layout.export()
    again = ShardLayout(2)
    again.restore(state, decode=None)
    assert again.layout() == layout.layout()
