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


def _relaying(index: int, parts: dict[int, bytes]) -> ShardLayout:
    """Shard `index` re-laying its tables out from 2 shards onto 3, with the parts of `parts` arrived."""
    layout = ShardLayout(index)
    assert layout.relayout_tables(3, 2, "begin") == "begun"
    for source, data in parts.items():
        layout.receive_tables(source, 2, data)
    return layout


@pytest.mark.parametrize("held, step, parts, expected", [
    (2, "begin", None, "begun"),          # tables spread over 2: they freeze
    (None, "begin", None, "begun"),       # an added shard
    (3, "begin", None, "same"),           # spread over 3 already (its re-layout ended before the driver died)
    (3, "end", None, "same"),             # its re-layout ended here already: an end again changes nothing
    (None, "end", None, "same"),          # ... a shard it removed, which dropped its part
    (2, "end", None, "lost"),             # tables over 2 and no re-layout under way: it lost that one's state
    (2, "", None, "begun"),               # a driver that does not say: begins ...
    (2, "begin", {0: b"a"}, "same"),      # begun again while under way: nothing more, the part kept
    (2, "", {0: b"a", 1: b"b"}, "ended"),  # ... or ends the one under way
    (2, "end", {0: b"a", 1: b"b"}, "ended"),
    (2, "end", {0: b"a"}, ModeConflictError),  # a part missing: cannot end
    (2, "", {0: b"a"}, ModeConflictError),
])
def test_a_tables_relayout_is_begun_and_ended_as_the_epoch_says(held, step, parts, expected):
    layout = ShardLayout(1) if parts is None else _relaying(1, parts)
    before = (layout.table_shards, layout.inbox())
    if expected == "lost":
        with pytest.raises(ModeConflictError, match="spread over 2 shards and it is not re-laying them out"):
            layout.relayout_tables(3, held, step)
        assert (layout.table_shards, layout.inbox()) == before
        return
    if expected is ModeConflictError:
        with pytest.raises(ModeConflictError, match="cannot end yet"):
            layout.relayout_tables(3, held, step)
        assert (layout.table_shards, layout.inbox()) == before
        return
    assert layout.relayout_tables(3, held, step, check_only=True) == expected
    assert (layout.table_shards, layout.inbox()) == before  # check_only changes nothing
    assert layout.relayout_tables(3, held, step) == expected
    assert layout.table_shards == (3 if expected == "begun" or (expected == "same" and parts) else 0)
    assert layout.inbox() == (parts if expected == "same" and parts else {})


def test_a_tables_relayout_onto_another_count_waits_for_the_one_under_way():
    layout = _relaying(0, {0: b"a"})
    for step in ("begin", "end", ""):
        with pytest.raises(ModeConflictError, match="onto 3 shards; a layout for 2 must wait"):
            layout.relayout_tables(2, 3, step)
    assert layout.table_shards == 3 and layout.inbox() == {0: b"a"}
