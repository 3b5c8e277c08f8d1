"""ps 0's record of the job's live resize (ps_server/resizes.py): one at a time, one driver under a lease, a
move's status only forward, every change an event that replays to the same record."""

import pytest

from torchps.errors import InvalidArgumentError, ResizeConflictError
from torchps.ps_server.resizes import ResizeOwner

BEFORE, AFTER = ["h:0", "h:1"], ["h:0", "h:1", "h:2"]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _replayed(events: list[dict]) -> ResizeOwner:
    owner = ResizeOwner(Clock())
    for event in events:
        owner.apply(event)
    return owner


def test_one_resize_runs_at_a_time_and_a_cut_off_one_is_taken_over_not_begun_over():
    clock = Clock()
    owner = ResizeOwner(clock)
    events = [owner.begin("ps-admin pid 1", BEFORE, AFTER, 10.0)]
    with pytest.raises(ResizeConflictError, match="holds the lease for 10.0 s more"):
        owner.begin("chief pid 2", BEFORE, AFTER, 10.0)
    with pytest.raises(ResizeConflictError, match="holds the lease"):
        owner.take_over(1, "chief pid 2", 10.0)
    clock.now += 9.0
    owner.renew(1, "ps-admin pid 1")  # the driver renews: another 10 s
    clock.now += 9.0
    assert owner.state()["lease_left"] == pytest.approx(1.0)
    clock.now += 2.0
    assert owner.state()["lease_left"] == 0  # cut off
    with pytest.raises(ResizeConflictError, match="cut off.*--resume.*--abort"):
        owner.begin("chief pid 2", BEFORE, AFTER, 10.0)
    events.append(owner.take_over(1, "chief pid 2", 10.0))
    with pytest.raises(ResizeConflictError, match="driven by chief pid 2 now"):
        owner.renew(1, "ps-admin pid 1")  # the old driver, back from a pause, can never act again
    events.append(owner.end(1, "chief pid 2", "aborted", "rolled back"))
    events.append(owner.begin("ps-admin pid 3", BEFORE, AFTER, 10.0))  # a new one may begin now
    assert owner.state()["id"] == 2
    assert _replayed(events).export() == owner.export()


def test_moves_go_forward_only_and_the_plan_keeps_what_ended():
    owner = ResizeOwner(Clock())
    events = [owner.begin("d", BEFORE, AFTER, 10.0),
              owner.plan(1, "d", [("a", 0, 2, 8), ("b", 1, 2, 4)], 0)]
    events.append(owner.moved(1, "d", [("a", "exported")]))
    assert owner.moved(1, "d", [("a", "exported")]) is None  # the same status again: nothing to record
    events.append(owner.moved(1, "d", [("a", "confirmed"), ("b", "returned")]))
    with pytest.raises(InvalidArgumentError, match="confirmed; it cannot become exported"):
        owner.moved(1, "d", [("a", "exported")])
    with pytest.raises(InvalidArgumentError, match="planned no move of 'c'"):
        owner.moved(1, "d", [("c", "exported")])
    events.append(owner.plan(1, "d", [("a", 0, 1, 8), ("d", 1, 2, 4)], 7))  # re-planned: a's move had ended
    assert owner.state()["moves"] == [("a", 0, 2, 8, "confirmed"), ("b", 1, 2, 4, "returned"),
                                      ("d", 1, 2, 4, "planned")]
    assert owner.state()["hold"] == 7
    assert _replayed(events).export() == owner.export()
    restored = ResizeOwner(Clock())
    restored.restore(owner.export())
    assert restored.state() == owner.state()


@pytest.mark.parametrize("call", [
    lambda o: o.begin("", BEFORE, AFTER, 10.0),
    lambda o: o.begin("d", [], AFTER, 10.0),
    lambda o: o.begin("d", BEFORE, ["h:0", "h:0"], 10.0),
    lambda o: o.begin("d", BEFORE, AFTER, -1.0),
    lambda o: o.begin("d", BEFORE, AFTER, float("nan")),
])
def test_a_malformed_beginning_is_refused_and_changes_nothing(call):
    owner = ResizeOwner(Clock())
    with pytest.raises(InvalidArgumentError):
        call(owner)
    assert owner.state()["phase"] == "none"


@pytest.mark.parametrize("moves", [
    [("a", 0, 0, 8)],            # to the shard it is on
    [("a", 0, 3, 8)],            # past the resize's shards
    [("a", 0, 1, 8), ("a", 1, 2, 8)],
    [("", 0, 1, 8)],
])
def test_a_malformed_plan_is_refused_and_changes_nothing(moves):
    owner = ResizeOwner(Clock())
    owner.begin("d", BEFORE, AFTER, 10.0)
    with pytest.raises(InvalidArgumentError):
        owner.plan(1, "d", moves, 0)
    assert owner.state()["moves"] == []


def test_a_driver_of_no_running_resize_is_refused():
    owner = ResizeOwner(Clock())
    with pytest.raises(ResizeConflictError, match="no resize was begun"):
        owner.renew(1, "d")
    owner.begin("d", BEFORE, AFTER, 10.0)
    owner.end(1, "d", "done", "2 variables moved")
    with pytest.raises(ResizeConflictError, match="resize 1 is done"):
        owner.plan(1, "d", [], 0)


def test_the_tables_relayout_is_recorded_once_goes_to_built_only_and_a_new_resize_forgets_it():
    owner = ResizeOwner(Clock())
    events = [owner.begin("d", BEFORE, AFTER, 10.0), owner.tables(1, "d", 3, 2, False)]
    assert owner.tables(1, "d", 3, 2, False) is None  # begun again by a driver that took it over: no change
    with pytest.raises(InvalidArgumentError, match="onto 3 shards from 2; it cannot become onto 2 from 3"):
        owner.tables(1, "d", 2, 3, False)
    events.append(owner.tables(1, "d", 3, 2, True))
    assert owner.state()["tables"] == {"count": 3, "from": 2, "built": True}
    with pytest.raises(InvalidArgumentError, match=r"\(built\); it cannot become onto 3 from 2; nothing"):
        owner.tables(1, "d", 3, 2, False)
    assert _replayed(events).export() == owner.export()
    restored = ResizeOwner(Clock())
    restored.restore(owner.export())
    assert restored.state() == owner.state()
    events.append(owner.end(1, "d", "done", "tables re-laid out"))
    events.append(owner.begin("d", AFTER, BEFORE, 10.0))
    assert owner.state()["tables"] is None and _replayed(events).export() == owner.export()


@pytest.mark.parametrize("count, source", [(0, 2), (3, 0), (2, 2), (10 ** 6, 2)])
def test_a_malformed_tables_record_is_refused_and_changes_nothing(count, source):
    owner = ResizeOwner(Clock())
    owner.begin("d", BEFORE, AFTER, 10.0)
    with pytest.raises(InvalidArgumentError, match="re-layout of the tables"):
        owner.tables(1, "d", count, source, False)
    assert owner.state()["tables"] is None
