"""ps 2's record of deposed arbiters (deposals.py), and the arbiters' promotions of each other's backups through
it (coordinator.set_replica): under a cut that parts ps 0 from ps 1, only one of them promotes the other's
backup."""

import threading

import pytest

from torchps.errors import InvalidArgumentError, ReplicaFencedError
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.deposals import Deposals
from torchps.ps_server.store import VariableStore

SPEC = ["h:0", "h:1", "h:2"]


def deposed(record: Deposals, action: str, index: int, primary: str, failovers: int, asker: str) -> dict | None:
    """decide() and apply() one change; the event, None if it changed nothing."""
    event = record.decide(action, index, primary, failovers, asker)
    if event is not None:
        record.apply(event)
    return event


def test_the_first_arbiter_to_depose_the_other_wins_and_the_other_is_refused():
    record = Deposals()
    assert deposed(record, "depose", 1, "h:1", 0, "h:0") is not None    # ps 0 deposes ps 1
    assert deposed(record, "depose", 1, "h:1", 0, "h:0") is None        # its retry: granted, nothing changed
    with pytest.raises(ReplicaFencedError, match="ps:1 at h:1 was deposed by ps:0"):
        record.decide("depose", 0, "h:0", 0, "h:1")                     # ps 1, behind the cut, is refused
    assert record.deposed(1)["primary"] == "h:1" and record.deposed(0) == {"primary": "", "failovers": 0}
    # ps 1's promoted backup serves at b:1: it deposes ps 0 later, and the new ps 0 deposes it in turn
    assert deposed(record, "depose", 0, "h:0", 0, "b:1") is not None
    assert deposed(record, "depose", 1, "b:1", 1, "b:0") is not None
    assert record.deposed(1)["primary"] == "b:1"


def test_a_primary_back_at_a_deposed_address_after_a_later_deposal_may_depose():
    """A Kubernetes pod moved back: ps 1 deposed at h:1, then at b:1 (its promoted backup), and served at h:1
    again. The record names the last deposal only, so h:1 may depose ps 0 now."""
    record = Deposals()
    deposed(record, "depose", 1, "h:1", 0, "h:0")
    deposed(record, "depose", 1, "b:1", 1, "h:0")
    assert deposed(record, "depose", 0, "h:0", 0, "h:1") is not None


def test_an_older_deposal_is_refused_and_changes_nothing():
    record = Deposals()
    deposed(record, "depose", 1, "b:1", 2, "h:0")
    with pytest.raises(ReplicaFencedError, match="after 2 failovers already"):
        record.decide("depose", 1, "h:1", 1, "h:0")
    assert record.deposed(1)["failovers"] == 2


def test_a_reinstatement_takes_back_only_the_deposal_it_names():
    record = Deposals()
    deposed(record, "depose", 1, "h:1", 0, "h:0")
    assert deposed(record, "reinstate", 1, "h:1", 1, "h:0") is None     # another count
    assert deposed(record, "reinstate", 1, "h:1", 0, "x:0") is None     # another asker
    assert deposed(record, "reinstate", 1, "h:1", 0, "h:0") is not None
    assert record.deposed(1)["primary"] == "" and deposed(record, "reinstate", 1, "h:1", 0, "h:0") is None
    assert deposed(record, "depose", 0, "h:0", 0, "h:1") is not None    # ps 1 may depose ps 0 again


@pytest.mark.parametrize("action, index, primary, asker, match", [
    ("promote", 1, "h:1", "h:0", "one of depose, reinstate"),
    ("depose", 2, "h:2", "h:0", "ps:0 and ps:1 only"),
    ("depose", 1, "", "h:0", "deposed primary's address"),
    ("depose", 1, "h:1", "", "asker's address"),
    ("reinstate", 0, "h:0", "x" * 1025, "asker's address"),
])
def test_malformed_asks_are_refused_and_change_nothing(action, index, primary, asker, match):
    record = Deposals()
    with pytest.raises(InvalidArgumentError, match=match):
        record.decide(action, index, primary, 0, asker)
    assert record.export() == {}


def test_the_record_survives_export_restore_and_replay():
    record, events = Deposals(), []
    for ask in (("depose", 1, "h:1", 0, "h:0"), ("depose", 0, "h:0", 0, "b:1")):
        events.append(deposed(record, *ask))
    restored, replayed = Deposals(), Deposals()
    restored.restore(record.export())
    for event in events:
        replayed.apply(event)
    assert restored.export() == replayed.export() == record.export() and set(record.export()) == {"0", "1"}


class Job:
    """ps 0, ps 1 and ps 2's coordinators (no journals), ps 0 and ps 1 each with a backup in sync recorded by
    the other, the arbiters reaching ps 2 through `tiebreaker`."""

    def __init__(self):
        self.shards = [Coordinator(VariableStore(), owns_step=index == 0, index=index, addresses=SPEC)
                       for index in range(3)]
        self.shards[0].set_replica("in_sync", 1, "h:1", "b:1")
        self.shards[1].set_replica("in_sync", 0, "h:0", "b:0")
        self.before_answer = lambda asker: None  # runs as ps 2 is asked, before it answers

    def tiebreaker(self, me: str):
        def ask(action: str, index: int, primary: str, failovers: int, timeout: float | None) -> dict:
            self.before_answer(me)
            return self.shards[2].set_replica(action, index, primary, "", timeout, failovers=failovers, asker=me)
        return ask

    def promote(self, arbiter: int, timeout: float = 5.0) -> dict:
        """ps `arbiter` promotes the other arbiter's backup, as that backup asks it to."""
        other = 1 - arbiter
        return self.shards[arbiter].set_replica("promote", other, f"h:{other}", f"b:{other}", timeout,
                                                tiebreaker=self.tiebreaker(f"h:{arbiter}"))

    def close(self):
        for shard in self.shards:
            shard.close()


@pytest.fixture
def job():
    made = Job()
    yield made
    made.close()


def test_under_a_cut_only_one_arbiter_promotes_the_others_backup(job):
    """Both arbiters ask at once (each one's ask reaches ps 2 only once the other's did too): one promotes, the
    other is refused and its record stays as it was."""
    both_asked = threading.Barrier(2, timeout=10)
    job.before_answer = lambda asker: both_asked.wait()
    outcomes: dict[int, object] = {}

    def promote(arbiter: int) -> None:
        try:
            outcomes[arbiter] = job.promote(arbiter)
        except ReplicaFencedError as exc:
            outcomes[arbiter] = exc

    threads = [threading.Thread(target=promote, args=(arbiter,)) for arbiter in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    winners = [arbiter for arbiter, outcome in outcomes.items() if isinstance(outcome, dict)]
    assert len(outcomes) == 2 and len(winners) == 1, outcomes
    winner, loser = winners[0], 1 - winners[0]
    assert job.shards[winner].replicas.entry(loser)["primary"] == f"b:{loser}"
    assert job.shards[loser].replicas.entry(winner) == {**job.shards[loser].replicas.entry(winner),
                                                        "primary": f"h:{winner}", "failovers": 0}
    assert "was deposed" in str(outcomes[loser])


def test_a_promotion_the_record_refuses_after_the_grant_is_taken_back(job):
    """ps 1 drops its backup while ps 2 grants ps 0's deposal of it: ps 0's record refuses the promotion, and
    the deposal is taken back, so ps 1 can still promote ps 0's backup."""
    def drop_first(asker: str) -> None:
        if asker == "h:0":
            job.before_answer = lambda asker: None
            job.shards[0].set_replica("drop", 1, "h:1", "b:1")

    job.before_answer = drop_first
    with pytest.raises(ReplicaFencedError, match="has no backup in sync"):
        job.promote(0)
    assert job.shards[2].deposals.deposed(1)["primary"] == ""
    assert job.promote(1)["primary"] == "b:0"
    assert job.shards[2].deposals.deposed(0)["asker"] == "h:1"


def test_a_retried_promotion_asks_the_tie_breaker_nothing_more(job):
    asked = []
    job.before_answer = asked.append
    assert job.promote(0)["failovers"] == 1 and job.promote(0)["failovers"] == 1
    assert asked == ["h:0"]
