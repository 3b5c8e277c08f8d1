"""ps 2's record of deposed arbiters (deposals.py), and the arbiters' promotions of each other's backups through
it (own_promotions.py, coordinator.set_replica): under a cut that parts ps 0 from ps 1, only one of them
promotes the other's backup, and a grant whose promotion was not made is taken back."""

import itertools
import threading

import pytest

from torchps.errors import InvalidArgumentError, ReplicaFencedError, ServerUnavailableError, WaitTimeoutError
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.deposals import Deposals
from torchps.ps_server.journal import Journal
from torchps.ps_server.server import recover
from torchps.ps_server.store import VariableStore

from helpers import wait_until

SPEC = ["h:0", "h:1", "h:2"]
_names = (f"g{n}" for n in itertools.count())


def deposed(record: Deposals, index: int, primary: str, failovers: int, successor: str, asker: str,
            grant: str | None = None) -> dict | None:
    """decide() and apply() one DEPOSE (a fresh name unless `grant`); the event, None if it changed nothing."""
    event = record.decide("depose", index, grant or next(_names), primary, failovers, successor, asker)
    if event is not None:
        record.apply(event)
    return event


def test_the_first_arbiter_to_depose_the_other_wins_and_the_other_is_refused():
    record = Deposals()
    event = deposed(record, 1, "h:1", 0, "b:1", "h:0")                   # ps 0 deposes ps 1 for b:1
    assert deposed(record, 1, "h:1", 0, "b:1", "h:0", event["grant"]) is None   # its retry: nothing changed
    with pytest.raises(ReplicaFencedError, match="ps:1 at h:1 may not promote ps:0's backup: ps:0 deposed"):
        record.decide("depose", 0, "g", "h:0", 0, "b:0", "h:1")         # ps 1, behind the cut, is refused
    assert record.deposed(1)["successor"] == "b:1" and record.deposed(0)["primary"] == ""
    # ps 1's promoted backup b:1 deposes ps 0 later, and ps 0's promoted backup b:0 deposes it in turn
    assert deposed(record, 0, "h:0", 0, "b:0", "b:1") is not None
    assert deposed(record, 1, "b:1", 1, "h:1", "b:0") is not None
    assert record.deposed(1)["primary"] == "b:1"


def test_a_primary_deposed_twice_while_a_cut_lasts_is_still_refused():
    """ps 1 failed over twice on ps 0's side of a cut (h:1, then b:1 deposed): the old h:1, still running
    behind it, is no successor, and neither is b:1; the one put in place last, c:1, is."""
    record = Deposals()
    deposed(record, 1, "h:1", 0, "b:1", "h:0")
    deposed(record, 1, "b:1", 1, "c:1", "h:0")
    for old in ("h:1", "b:1"):
        with pytest.raises(ReplicaFencedError, match="put c:1 in its place"):
            record.decide("depose", 0, "g", "h:0", 0, "b:0", old)
    assert deposed(record, 0, "h:0", 0, "b:0", "c:1") is not None


def test_a_primary_back_at_a_deposed_address_as_the_successor_may_depose():
    """A Kubernetes pod moved back: ps 1 deposed at h:1 for b:1, then b:1 deposed for h:1 again."""
    record = Deposals()
    deposed(record, 1, "h:1", 0, "b:1", "h:0")
    deposed(record, 1, "b:1", 1, "h:1", "h:0")
    assert deposed(record, 0, "h:0", 0, "b:0", "h:1") is not None


def test_an_older_deposal_is_refused_and_changes_nothing():
    record = Deposals()
    deposed(record, 1, "b:1", 2, "c:1", "h:0")
    with pytest.raises(ReplicaFencedError, match="after 2 failovers already"):
        record.decide("depose", 1, "g", "h:1", 1, "b:1", "h:0")
    assert record.deposed(1)["failovers"] == 2


def test_a_reinstatement_takes_back_only_the_ask_it_names_and_brings_back_the_deposal_before():
    record = Deposals()
    deposed(record, 1, "h:1", 0, "b:1", "h:0", "first")
    deposed(record, 1, "b:1", 1, "c:1", "h:0", "second")
    deposed(record, 1, "b:1", 1, "c:1", "h:0", "again")                  # a repeat under a new name
    record.apply(record.decide("reinstate", 1, "second"))                # a late take-back of an earlier ask
    assert record.deposed(1)["successor"] == "c:1"
    record.apply(record.decide("reinstate", 1, "again"))
    assert (record.deposed(1)["primary"], record.deposed(1)["successor"]) == ("h:1", "b:1")
    record.apply(record.decide("reinstate", 1, "first"))
    assert record.deposed(1)["primary"] == "" and record.decide("reinstate", 1, "first") is None  # a repeat
    assert deposed(record, 0, "h:0", 0, "b:0", "h:1") is not None        # ps 1 may depose ps 0 again


def test_a_deposal_that_reaches_ps_2_after_its_take_back_is_refused():
    record = Deposals()
    record.apply(record.decide("reinstate", 1, "late"))                  # nothing to take back yet: noted
    with pytest.raises(ReplicaFencedError, match="taken back already"):
        record.decide("depose", 1, "late", "h:1", 0, "b:1", "h:0")
    assert record.deposed(1)["primary"] == ""


@pytest.mark.parametrize("action, index, grant, primary, successor, asker, match", [
    ("promote", 1, "g", "h:1", "b:1", "h:0", "one of depose, reinstate"),
    ("depose", 2, "g", "h:2", "b:2", "h:0", "ps:0 and ps:1 only"),
    ("depose", 1, "", "h:1", "b:1", "h:0", "names its ask"),
    ("reinstate", 1, "x" * 65, "", "", "", "names its ask"),
    ("depose", 1, "g", "", "b:1", "h:0", "deposed primary's address"),
    ("depose", 1, "g", "h:1", "", "h:0", "successor's address"),
    ("depose", 0, "g", "h:0", "b:0", "x" * 1025, "asker's address"),
])
def test_malformed_asks_are_refused_and_change_nothing(action, index, grant, primary, successor, asker, match):
    record = Deposals()
    with pytest.raises(InvalidArgumentError, match=match):
        record.decide(action, index, grant, primary, 0, successor, asker)
    assert record.export() == Deposals().export()


def test_the_record_survives_export_restore_and_replay():
    record, events = Deposals(), []
    for ask in ((1, "h:1", 0, "b:1", "h:0"), (0, "h:0", 0, "b:0", "b:1"), (1, "b:1", 1, "c:1", "b:0")):
        events.append(deposed(record, *ask))
    events.append(record.decide("reinstate", 1, events[-1]["grant"]))
    record.apply(events[-1])
    restored, replayed = Deposals(), Deposals()
    restored.restore(record.export())
    for event in events:
        replayed.apply(event)
    assert restored.export() == replayed.export() == record.export()
    assert set(record.export()["deposed"]) == {"0", "1"}
    assert record.export()["taken_back"] == {"1": [events[-1]["grant"]]}


def journaled(folder, index: int) -> Coordinator:
    """Shard `index` of SPEC, recovered from (or started with) the journal in `folder`."""
    shard = Coordinator(VariableStore(), owns_step=index == 0, index=index, addresses=SPEC, start=False)
    recover(shard, Journal(folder, compact_factor=0, min_compact_bytes=1 << 30), None)
    return shard


class Job:
    """ps 0, ps 1 and ps 2's coordinators (no journals, but ps 0's in `folder` if given), ps 0 and ps 1 each
    with a backup in sync recorded by the other, the arbiters reaching ps 2 through `answer` (ps 2 itself,
    unless a test stands in for it)."""

    def __init__(self, folder=None):
        self.shards = [journaled(folder, 0) if folder is not None and index == 0 else
                       Coordinator(VariableStore(), owns_step=index == 0, index=index, addresses=SPEC)
                       for index in range(3)]
        self.shards[0].set_replica("in_sync", 1, "h:1", "b:1")
        self.shards[1].set_replica("in_sync", 0, "h:0", "b:0")
        self.before_answer = lambda asker, action: None  # runs as ps 2 is asked, before it answers
        for arbiter in (0, 1):
            self.shards[arbiter].own_promotions.tiebreaker = self._link(f"h:{arbiter}")

    def _link(self, me: str):
        def ask(action, index, primary, failovers, successor, grant, timeout):
            self.before_answer(me, action)
            return self.shards[2].set_replica(action, index, primary, successor, timeout, failovers=failovers,
                                              asker=me, grant=grant)
        return ask

    def promote(self, arbiter: int, timeout: float = 5.0) -> dict:
        """ps `arbiter` promotes the other arbiter's backup, as that backup asks it to."""
        other = 1 - arbiter
        return self.shards[arbiter].set_replica("promote", other, f"h:{other}", f"b:{other}", timeout)

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
    job.before_answer = lambda asker, action: both_asked.wait() if action == "depose" else None
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
    assert (job.shards[loser].replicas.entry(winner)["primary"], job.shards[loser].replicas.entry(winner)[
        "failovers"]) == (f"h:{winner}", 0)
    assert "may not promote" in str(outcomes[loser])


def test_a_promotion_the_record_refuses_after_the_grant_is_taken_back(job):
    """ps 1 drops its backup while ps 2 grants ps 0's deposal of it: ps 0's record refuses the promotion, and
    the deposal is taken back, so ps 1 can still promote ps 0's backup."""
    def drop_first(asker: str, action: str) -> None:
        if action == "depose":
            job.before_answer = lambda asker, action: None
            job.shards[0].set_replica("drop", 1, "h:1", "b:1")

    job.before_answer = drop_first
    with pytest.raises(ReplicaFencedError, match="has no backup in sync"):
        job.promote(0)
    assert job.shards[2].deposals.deposed(1)["primary"] == "" and job.shards[0].own_promotions.pending() == {}
    assert job.promote(1)["primary"] == "b:0"
    assert job.shards[2].deposals.deposed(0)["asker"] == "h:1"


def test_a_grant_whose_answer_was_lost_is_taken_back_once_ps_2_answers_again(job):
    """ps 2 granted ps 0's deposal of ps 1 but its answer was lost, and ps 2 cannot be reached from then on:
    nothing is promoted and the ask stays pending; once ps 2 answers, ps 0's own thread takes the grant back,
    and ps 1 can promote ps 0's backup."""
    ps2, reachable = job.shards[2], threading.Event()

    def tiebreaker(action, index, primary, failovers, successor, grant, timeout):
        if action == "depose" and not reachable.is_set():  # granted, its answer lost
            ps2.set_replica(action, index, primary, successor, timeout, failovers=failovers, asker="h:0", grant=grant)
        if not reachable.is_set():
            raise ServerUnavailableError("ps 2 did not answer")
        return ps2.set_replica(action, index, primary, successor, timeout, failovers=failovers, asker="h:0",
                               grant=grant)

    job.shards[0].own_promotions.tiebreaker = tiebreaker
    with pytest.raises(ServerUnavailableError):
        job.promote(0)
    granted = ps2.deposals.deposed(1)
    assert granted["successor"] == "b:1" and job.shards[0].own_promotions.pending() == {1: granted["grant"]}
    assert job.shards[0].replicas.entry(1)["primary"] == "h:1"
    reachable.set()
    wait_until(lambda: job.shards[0].own_promotions.pending() == {}, 10, "ps 0 to take its grant back")
    assert ps2.deposals.deposed(1)["primary"] == ""
    assert job.promote(1)["primary"] == "b:0"


def test_a_new_promotion_takes_back_the_ask_left_pending_before_it_deposes(job):
    """ps 0's ask went unanswered (ps 2 granted it) and could not be taken back: before ps 0 asks again, it
    takes that grant back, so ps 2 keeps no deposal behind the new one."""
    ps2, answering = job.shards[2], threading.Event()
    job.shards[0].own_promotions.close()  # no take-back from its thread: the next promotion's own
    real = job.shards[0].own_promotions.tiebreaker

    def tiebreaker(action, index, primary, failovers, successor, grant, timeout):
        if action == "reinstate" and not answering.is_set():
            raise ServerUnavailableError("ps 2 cannot be reached")
        answer = real(action, index, primary, failovers, successor, grant, timeout)
        if not answering.is_set():
            raise ServerUnavailableError("ps 2's answer was lost")
        return answer

    job.shards[0].own_promotions.tiebreaker = tiebreaker
    with pytest.raises(ServerUnavailableError):
        job.promote(0)
    (first,) = job.shards[0].own_promotions.pending().values()
    assert ps2.deposals.deposed(1)["grant"] == first
    answering.set()
    assert job.promote(0)["primary"] == "b:1"
    record = ps2.deposals.export()
    assert record["taken_back"] == {"1": [first]} and record["deposed"]["1"]["before"] is None
    assert job.shards[0].own_promotions.pending() == {}


def test_a_retried_promotion_asks_the_tie_breaker_nothing_more(job):
    asked = []
    job.before_answer = lambda asker, action: asked.append((asker, action))
    assert job.promote(0)["failovers"] == 1 and job.promote(0)["failovers"] == 1
    assert asked == [("h:0", "depose")]


def test_an_arbiter_that_stops_with_an_ask_pending_takes_it_back_once_it_serves_again(tmp_path):
    """ps 2 granted ps 0's deposal of ps 1's primary, its answer was lost, and ps 0 stopped before it could take
    the grant back. ps 0 recovered from its journal (as its backup, promoted, does from its copy) finds the ask
    and takes the grant back, so ps 1 can promote ps 0's backup (without the ask's record, never)."""
    job = Job(tmp_path / "ps0")
    try:
        ps2 = job.shards[2]

        def unanswered(action, index, primary, failovers, successor, grant, timeout):
            if action == "depose":  # granted, its answer lost
                ps2.set_replica(action, index, primary, successor, timeout, failovers=failovers, asker="h:0",
                                grant=grant)
            raise ServerUnavailableError("ps 2 cannot be reached")

        job.shards[0].own_promotions.tiebreaker = unanswered
        with pytest.raises(ServerUnavailableError):
            job.promote(0)
        (grant,) = job.shards[0].own_promotions.pending().values()
        assert ps2.deposals.deposed(1)["grant"] == grant
        job.shards[0].close()  # stops with its ask pending
        job.shards[0] = back = journaled(tmp_path / "ps0", 0)
        assert back.own_promotions.pending() == {1: grant} and back.replicas.entry(1)["primary"] == "h:1"
        back.own_promotions.tiebreaker = job._link("h:0")
        wait_until(lambda: back.own_promotions.pending() == {}, 10, "the recovered ps 0 to take its grant back")
        assert ps2.deposals.deposed(1)["primary"] == "" and ps2.deposals.export()["taken_back"] == {"1": [grant]}
        assert job.promote(1)["primary"] == "b:0"
    finally:
        job.close()


def test_a_promotion_made_clears_its_ask_in_the_journal_too(tmp_path):
    job = Job(tmp_path / "ps0")
    try:
        assert job.promote(0)["primary"] == "b:1"
        job.shards[0].recorder.durable_all(10)
        job.shards[0].close()
        asks = [record.meta for record in Journal(tmp_path / "ps0").recover()[1] if record.kind == "ask"]
        assert [sorted(ask) for ask in asks] == [["grant", "replaced", "shard"], ["grant", "shard"]]
        job.shards[0] = back = journaled(tmp_path / "ps0", 0)
        assert back.own_promotions.pending() == {} and back.replicas.entry(1)["primary"] == "b:1"
    finally:
        job.close()


@pytest.mark.parametrize("failing", ["log", "durable"])
def test_an_ask_the_arbiter_could_not_journal_is_never_sent_nor_left_pending(job, failing):
    """ps 0's journal fails the ask's record (log: it cannot be queued; durable: queued, not written in time):
    ps 2 is never asked, nothing stays pending, and the promotion is refused with the journal's error."""
    asked, recorder = [], job.shards[0].recorder
    job.before_answer = lambda asker, action: asked.append(action)
    error = ServerUnavailableError("the journal failed") if failing == "log" else WaitTimeoutError("not written")
    setattr(recorder, failing, lambda *args, **kwargs: (_ for _ in ()).throw(error))  # (this coordinator's only)
    with pytest.raises(type(error), match=str(error)):
        job.promote(0)
    assert asked == [] and job.shards[0].own_promotions.pending() == {}
    assert job.shards[0].replicas.entry(1)["primary"] == "h:1"
