"""ps 0's record of replicated shards (replicas.py): one of DROP and PROMOTE is granted, never both; and the
journal waits for a backup that follows it (journal.py), until ps 0 dropped it."""

import threading
import types

import pytest
import torch

from torchps.proto import ps_pb2

from torchps.errors import (InvalidArgumentError, LeaseHeldError, ModeConflictError, ReplicaFencedError,
                            WaitTimeoutError, ServerUnavailableError)
from torchps.ps_server.journal import Journal
from torchps.ps_server.replicas import ReplicaRegistry
from torchps.ps_server.feed import Feed
from torchps.ps_server.replication import Replication

from helpers import wait_until

SPEC = ["h:0", "h:1", "h:2"]


def registry_with_backup() -> ReplicaRegistry:
    registry = ReplicaRegistry(SPEC)
    registry.apply(registry.decide("in_sync", 1, "h:1", "b:1"))
    return registry


def test_a_shard_never_changed_is_served_at_its_spec_address():
    assert ReplicaRegistry(SPEC).entry(2) == {"primary": "h:2", "backup": "", "failovers": 0, "last_failover": 0.0,
                                              "changes": 0}
    assert ReplicaRegistry(SPEC).entries() == []


@pytest.mark.parametrize("first, second", [("drop", "promote"), ("promote", "drop")])
def test_drop_and_promote_exclude_each_other(first, second):
    """The primary and its backup lost each other: whichever asks first is granted, the other is fenced."""
    registry = registry_with_backup()
    asks = {"drop": ("drop", 1, "h:1", "b:1"), "promote": ("promote", 1, "h:1", "b:1")}
    registry.apply(registry.decide(*asks[first]))
    with pytest.raises(ReplicaFencedError):
        registry.decide(*asks[second])
    entry = registry.entry(1)
    assert entry["primary"] == ("b:1" if first == "promote" else "h:1") and entry["backup"] == ""
    assert entry["failovers"] == (first == "promote")


def test_repeats_change_nothing_and_a_new_primary_takes_a_backup():
    registry = registry_with_backup()
    assert registry.decide("in_sync", 1, "h:1", "b:1") is None
    registry.apply(registry.decide("promote", 1, "h:1", "b:1"))
    assert registry.decide("promote", 1, "h:1", "b:1") is None      # a retry of the granted promotion
    with pytest.raises(ReplicaFencedError, match="not by h:1"):
        registry.decide("in_sync", 1, "h:1", "c:1")                  # the old primary is out
    registry.apply(registry.decide("in_sync", 1, "b:1", "h:1"))     # it comes back as the new one's backup
    assert registry.entry(1)["backup"] == "h:1"
    assert registry.decide("drop", 1, "b:1", "other:1") is None      # another backup than the one in sync


def test_only_a_backup_in_sync_is_promoted():
    with pytest.raises(ReplicaFencedError, match="no backup in sync"):
        ReplicaRegistry(SPEC).decide("promote", 1, "h:1", "b:1")


def test_only_the_copy_recorded_in_sync_is_promoted_and_the_name_outlives_replay_and_restore():
    """IN_SYNC records the backup's copy by name: a PROMOTE from that address naming another copy (a process
    started there on an older folder), or none, is refused and changes nothing; the one named is promoted. A
    new IN_SYNC of the same address with another copy is a change. The name comes back from the journal's
    events and from export(); a record made before copies had names promotes any copy."""
    registry = ReplicaRegistry(SPEC)
    events = [registry.decide("in_sync", 1, "h:1", "b:1", copy="c1")]
    registry.apply(events[-1])
    assert registry.decide("in_sync", 1, "h:1", "b:1", copy="c1") is None  # a repeat
    events.append(registry.decide("in_sync", 1, "h:1", "b:1", copy="c2"))  # the same address, a new copy
    assert events[-1] is not None
    registry.apply(events[-1])
    before = registry.export()
    for copy in ("c1", ""):
        with pytest.raises(ReplicaFencedError, match="holds the copy c2"):
            registry.decide("promote", 1, "h:1", "b:1", copy=copy)
    assert registry.export() == before
    replayed, restored = ReplicaRegistry(SPEC), ReplicaRegistry(SPEC)
    for event in events:
        replayed.apply(event)
    restored.restore(before)
    for again in (registry, replayed, restored):
        again.apply(again.decide("promote", 1, "h:1", "b:1", copy="c2"))
        assert (again.entry(1)["primary"], again.entry(1)["backup"], again.entry(1)["copy"]) == ("b:1", "", "")
    unnamed = ReplicaRegistry(SPEC)
    unnamed.apply({"action": "in_sync", "index": 1, "backup": "b:1"})  # a journal written before copies' names
    assert unnamed.decide("promote", 1, "h:1", "b:1", copy="c3")["primary"] == "b:1"
    with pytest.raises(InvalidArgumentError, match="copy"):
        unnamed.decide("in_sync", 1, "h:1", "b:1", copy="x" * 65)


@pytest.mark.parametrize("action, index, primary, backup, match", [
    ("elect", 1, "h:1", "b:1", "one of"), ("in_sync", -1, "h:1", "b:1", "names a shard"),
    ("in_sync", 1, "", "b:1", "primary"), ("in_sync", 1, "h:1", "", "backup"), ("promote", 1, "", "", "backup"),
    ("drop", 1, "x" * 2000, "", "primary")])
def test_malformed_changes_are_refused_and_change_nothing(action, index, primary, backup, match):
    registry = registry_with_backup()
    before = registry.export()
    with pytest.raises(InvalidArgumentError, match=match):
        registry.decide(action, index, primary, backup)
    assert registry.export() == before


def test_an_in_sync_asked_before_a_drop_it_did_not_see_changes_nothing():
    """A primary read the record's count of changes, then lost its backup: its DROP (another thread), naming
    the count, reached the arbiter before its IN_SYNC. The DROP is counted although nothing was in sync, so the
    IN_SYNC that names the count read before it changes nothing: the lost backup is never recorded in sync (nor
    promoted). A retry of that DROP, or one naming no count, changes nothing."""
    registry = ReplicaRegistry(SPEC)
    read = registry.entry(1)["changes"]
    registry.apply(registry.decide("drop", 1, "h:1", "b:1", changes=read))
    assert registry.entry(1)["changes"] == read + 1 and registry.entry(1)["backup"] == ""
    assert registry.decide("drop", 1, "h:1", "b:1", changes=read) is None  # its retry: waits for nothing
    assert registry.decide("drop", 1, "h:1", "b:1") is None
    assert registry.decide("in_sync", 1, "h:1", "b:1", changes=read) is None
    with pytest.raises(ReplicaFencedError, match="no backup in sync"):
        registry.decide("promote", 1, "h:1", "b:1")
    registry.apply(registry.decide("in_sync", 1, "h:1", "b:1", changes=read + 1))  # read again: granted
    assert registry.entry(1)["backup"] == "b:1" and registry.entry(1)["changes"] == read + 2
    assert registry.decide("in_sync", 1, "h:1", "b:1", changes=read) is None  # a repeat: nothing more
    assert registry.decide("in_sync", 1, "h:1", "c:1", changes=read) is None  # stale: b:1 stays in sync
    assert registry.entry(1)["backup"] == "b:1"


def test_the_counts_of_records_a_resize_removed_survive_export_and_restore():
    layout = ["h:0", "h:1", "h:2"]
    registry = ReplicaRegistry(lambda: layout)
    registry.apply(registry.decide("in_sync", 2, "h:2", "b:2"))
    del layout[2]
    registry.left(2)
    again = ReplicaRegistry(lambda: layout)
    again.restore(registry.export())
    layout.append("h:2")
    assert again.entry(2)["changes"] == registry.entry(2)["changes"] == 2
    assert again.decide("in_sync", 2, "h:2", "b:2", changes=1) is None  # asked before the removal, decided late


def test_every_change_is_counted_and_the_count_survives_export_restore_and_replay():
    registry = registry_with_backup()
    events = [registry.decide("promote", 1, "h:1", "b:1")]
    registry.apply(events[-1])
    events.append(registry.decide("in_sync", 1, "b:1", "h:1"))
    registry.apply(events[-1])
    assert registry.entry(1)["changes"] == 3
    again = ReplicaRegistry(SPEC)
    again.restore(registry.export())
    assert again.entry(1) == registry.entry(1)
    replayed = ReplicaRegistry(SPEC)
    for event in [{"action": "in_sync", "index": 1, "backup": "b:1"}, *events]:  # the journal's order
        replayed.apply(event)
    assert replayed.entry(1) == registry.entry(1)
    old = {"1": {"primary": "b:1", "backup": "", "failovers": 1, "last_failover": 5.0}}  # before counts
    again.restore(old)
    assert again.entry(1)["changes"] == 0
    again.apply(again.decide("in_sync", 1, "b:1", "h:1", changes=0))
    assert again.entry(1)["changes"] == 1


def test_the_record_survives_export_and_restore():
    registry = registry_with_backup()
    registry.apply(registry.decide("promote", 1, "h:1", "b:1"))
    again = ReplicaRegistry(SPEC)
    again.restore(registry.export())
    assert again.entries() == registry.entries()


def test_a_shard_a_resize_adds_is_served_at_the_layouts_address_from_the_epoch_that_names_it():
    layout = ["h:0", "h:1"]  # the arbiter's layout epoch: the spec's, then a resize's
    registry = ReplicaRegistry(lambda: layout)
    with pytest.raises(ModeConflictError, match="not in the job's layout of 2 shards") as refused:
        registry.decide("in_sync", 2, "h:2", "b:2")  # not yet added: its primary asks again
    assert not isinstance(refused.value, ReplicaFencedError)
    layout.append("h:2")
    registry.apply(registry.decide("in_sync", 2, "h:2", "b:2"))
    registry.apply(registry.decide("promote", 2, "h:2", "b:2"))
    assert registry.entry(2)["primary"] == "b:2"


def test_a_layout_epoch_never_undoes_a_failover():
    layout = ["h:0", "h:1", "h:2"]
    registry = ReplicaRegistry(lambda: layout)
    registry.apply(registry.decide("in_sync", 1, "h:1", "b:1"))
    registry.apply(registry.decide("promote", 1, "h:1", "b:1"))
    layout[1] = "stale:1"  # an epoch set by a driver that read the record before the failover
    registry.left(len(layout))
    assert registry.entry(1)["primary"] == "b:1"
    with pytest.raises(ReplicaFencedError, match="not by stale:1"):
        registry.decide("in_sync", 1, "stale:1", "c:1")


def test_a_shard_a_resize_removes_is_served_nowhere_and_comes_back_as_a_new_one():
    """Its backup's promotion is refused (it stops), its primary's drop granted; an index added again starts a
    fresh record at its new address."""
    layout = ["h:0", "h:1", "h:2"]
    registry = ReplicaRegistry(lambda: layout)
    registry.apply(registry.decide("in_sync", 2, "h:2", "b:2"))
    registry.apply(registry.decide("promote", 2, "h:2", "b:2"))
    registry.apply(registry.decide("in_sync", 2, "b:2", "c:2"))
    del layout[2]
    registry.left(len(layout))
    assert [index for index, _ in registry.entries()] == []
    with pytest.raises(ReplicaFencedError, match="not in the job's layout of 2 shards.*c:2 must stop"):
        registry.decide("promote", 2, "b:2", "c:2")
    assert registry.decide("drop", 2, "b:2", "c:2") is None
    layout.append("b:2")  # added again where its last primary served: a new shard whose count goes on
    assert registry.entry(2) == {"primary": "b:2", "backup": "", "failovers": 0, "last_failover": 0.0,
                                 "changes": 4}
    assert registry.decide("in_sync", 2, "b:2", "c:2", changes=3) is None  # its last primary's, decided late
    layout[2] = "new:2"
    assert registry.entry(2)["primary"] == "new:2"
    with pytest.raises(ReplicaFencedError, match="no backup in sync"):
        registry.decide("promote", 2, "b:2", "c:2")


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_for(registry: ReplicaRegistry, clock: _Clock, seconds: float) -> None:
    """`seconds` go by while the arbiter runs: its clock thread looks every 1/16 s (exact in binary)."""
    for _ in range(round(seconds * 16)):
        clock.now += 0.0625
        registry._tick()


def leased_registry(clock: "_Clock") -> ReplicaRegistry:
    registry = ReplicaRegistry(SPEC, lease_seconds=0.5, clock=clock)
    registry.apply(registry.decide("in_sync", 1, "h:1", "b:1"))
    return registry


def test_a_backup_is_promoted_only_once_its_primary_renewed_no_lease_for_a_window():
    """A new arbiter hears leases for a whole window first; then each renewal holds the primary's lease for one
    more window, and a promotion asked meanwhile is refused and changes nothing."""
    clock = _Clock()
    registry = leased_registry(clock)
    for _ in range(6):  # the primary renews every 1/8 s for a while: its backup is never promoted
        run_for(registry, clock, 0.125)
        assert registry.renew(1, "h:1")["primary"] == "h:1"
        with pytest.raises(LeaseHeldError, match="ps:1's primary h:1 holds its lease"):
            registry.decide("promote", 1, "h:1", "b:1")
    before = registry.export()
    run_for(registry, clock, 0.4375)
    with pytest.raises(LeaseHeldError):  # 7/16 s after its last renewal
        registry.decide("promote", 1, "h:1", "b:1")
    assert registry.export() == before
    run_for(registry, clock, 0.0625)
    registry.apply(registry.decide("promote", 1, "h:1", "b:1"))  # a whole window of silence
    assert registry.entry(1)["primary"] == "b:1"


def test_a_new_arbiter_hears_leases_for_a_window_before_it_promotes():
    clock = _Clock()
    registry = leased_registry(clock)
    with pytest.raises(LeaseHeldError):
        registry.decide("promote", 1, "h:1", "b:1")
    run_for(registry, clock, 0.5)
    registry.apply(registry.decide("promote", 1, "h:1", "b:1"))


@pytest.mark.parametrize("ticked", [True, False], ids=["its clock noticed", "asked before its clock ran"])
def test_an_arbiter_that_was_paused_hears_leases_afresh_before_it_promotes(ticked):
    """The arbiter itself did not run for a while: the renewals it could not hear do not count against the
    primary, whether its clock thread or the promotion runs first once it is back."""
    clock = _Clock()
    registry = leased_registry(clock)
    registry.renew(1, "h:1")
    clock.now += 5.0  # paused
    if ticked:
        registry._tick()
    with pytest.raises(LeaseHeldError):
        registry.decide("promote", 1, "h:1", "b:1")
    run_for(registry, clock, 0.5)
    registry.apply(registry.decide("promote", 1, "h:1", "b:1"))


def test_an_arbiter_that_was_starved_a_while_credits_the_leases_with_that_while_only():
    """A look late by 0.25 s (a starved arbiter, on a loaded host) adds 0.25 s to the lease, not a whole window:
    the backup is promoted once the primary was silent for a lease of the arbiter's running time."""
    clock = _Clock()
    registry = leased_registry(clock)
    run_for(registry, clock, 0.5)
    registry.renew(1, "h:1")
    run_for(registry, clock, 0.3125)
    clock.now += 0.3  # no look for 0.3 s: 0.25 s late
    with pytest.raises(LeaseHeldError):  # 0.6125 s since the renewal, 0.3625 of them heard
        registry.decide("promote", 1, "h:1", "b:1")
    run_for(registry, clock, 0.125)
    with pytest.raises(LeaseHeldError):
        registry.decide("promote", 1, "h:1", "b:1")
    run_for(registry, clock, 0.0625)
    registry.apply(registry.decide("promote", 1, "h:1", "b:1"))  # 0.55 s of running time since the renewal

def test_a_fenced_primary_learns_it_from_its_lease_and_a_removed_shard_renews_nothing():
    clock = _Clock()
    layout = list(SPEC)
    registry = ReplicaRegistry(lambda: layout, lease_seconds=0.5, clock=clock)
    registry.apply(registry.decide("in_sync", 1, "h:1", "b:1"))
    run_for(registry, clock, 0.5)
    registry.apply(registry.decide("promote", 1, "h:1", "b:1"))
    with pytest.raises(ReplicaFencedError, match="not by h:1: h:1 must stop"):
        registry.renew(1, "h:1")
    assert registry.renew(1, "b:1")["primary"] == "b:1"
    del layout[2]
    assert registry.renew(2, "h:2")["primary"] == ""  # a resize removed it: nothing to renew, nothing refused


@pytest.mark.parametrize("index, primary", [(-1, "h:1"), (1, ""), (1, "x" * 2000)])
def test_malformed_leases_are_refused_and_change_nothing(index, primary):
    clock = _Clock()
    registry = leased_registry(clock)
    with pytest.raises(InvalidArgumentError, match="a lease names"):
        registry.renew(index, primary)
    run_for(registry, clock, 0.5)
    registry.apply(registry.decide("promote", 1, "h:1", "b:1"))  # no renewal counted


def test_the_lease_clock_thread_ends_at_close():
    registry = ReplicaRegistry(SPEC, lease_seconds=0.5)
    thread = threading.Thread(target=registry.run_clock)
    thread.start()
    registry.close()
    thread.join(5)
    assert not thread.is_alive()


class _Follower:
    address = "b:1"
    floor = 0
    lost = None

    def offer_record(self, number, head, views):
        pass

    def offer_rotate(self, number):
        pass


def test_a_journal_waits_for_its_follower_until_it_is_detached(tmp_path):
    journal = Journal(tmp_path / "j")
    journal.start({"step": 0})
    follower = _Follower()
    journal.rotate(follower=follower)
    number = journal.append("member", {"worker": "w"}, {"x": torch.ones(3)})
    with pytest.raises(WaitTimeoutError, match="not written by the backup b:1"):
        journal.wait(number, timeout=0.2)
    journal.acked(follower, number)
    journal.wait(number, timeout=5)
    later = journal.append("member", {"worker": "w"}, {})
    released = threading.Event()
    waiter = threading.Thread(target=lambda: (journal.wait(later, timeout=30), released.set()))
    waiter.start()
    assert not released.wait(0.2)
    journal.detach(follower)  # ps 0 dropped it: what is written alone is acknowledged
    waiter.join(timeout=30)
    assert released.is_set()
    journal.close()


def test_a_fenced_journal_acknowledges_nothing_more(tmp_path):
    journal = Journal(tmp_path / "j")
    journal.start({"step": 0})
    follower = _Follower()
    journal.rotate(follower=follower)
    number = journal.append("member", {"worker": "w"}, {})
    journal.fail("ps 0 promoted the backup")
    with pytest.raises(ServerUnavailableError, match="promoted the backup"):
        journal.wait(number, timeout=5)
    journal.close()


def test_a_promotion_asked_as_the_lease_runs_out_waits_for_it_and_one_renewed_meanwhile_is_refused():
    """The arbiter's coordinator: a PROMOTE asked with less of the lease left than half its deadline waits that
    out and is granted, without the backup asking again; one whose primary renews during the wait is refused
    (LeaseHeldError) and changes nothing; one with more left than half its deadline is refused at once."""
    from torchps.ps_server.coordinator import Coordinator
    from torchps.ps_server.store import VariableStore

    coordinator = Coordinator(VariableStore(), owns_step=True, index=0, addresses=SPEC, failover_after=0.3)
    try:
        coordinator.set_replica("in_sync", 1, "h:1", "b:1")
        coordinator.replicas.renew(1, "h:1")
        with pytest.raises(LeaseHeldError):  # 0.3 s left, more than half of 0.2 s
            coordinator.set_replica("promote", 1, "h:1", "b:1", timeout=0.2)
        stop = threading.Event()

        def renew() -> None:  # the primary, running
            while not stop.is_set():
                coordinator.replicas.renew(1, "h:1")
                stop.wait(0.05)

        renewing = threading.Thread(target=renew)
        renewing.start()
        with pytest.raises(LeaseHeldError):  # waited once, renewed meanwhile
            coordinator.set_replica("promote", 1, "h:1", "b:1", timeout=5.0)
        stop.set()
        renewing.join(5)
        assert coordinator.replicas.entry(1)["primary"] == "h:1"
        coordinator.replicas.renew(1, "h:1")
        entry = coordinator.set_replica("promote", 1, "h:1", "b:1", timeout=5.0)  # waits the lease out
        assert (entry["primary"], entry["failovers"]) == ("b:1", 1)
    finally:
        coordinator.close()


def test_checkpoint_writes_have_one_gate_the_folder_a_promoted_shard_waits_for_and_a_lost_backup(tmp_path):
    """Replication.saving_refused, which Save and CommitCheckpoint ask (UNAVAILABLE): a promoted backup's wait for
    the checkpoint folder (hold_saving) comes first; a primary whose backup was lost writes none until its
    arbiter drops it; otherwise it may."""
    journal = Journal(tmp_path)
    journal.start({"step": 0, "variables": {"w": torch.zeros(2)}})
    replication = Replication(1, "a:1", lambda: journal, lambda feed: None, None, self_arbitrated=False,
                              chunk_bytes=1024, lease_seconds=0.5)
    assert replication.saving_refused() is None
    replication.hold_saving("the folder is held by the replaced primary")
    assert replication.saving_refused() == "the folder is held by the replaced primary"
    replication.hold_saving(None)
    assert replication.saving_refused() is None
    feed = Feed("b:1", 1024, 60, on_lost=lambda feed, why: None, on_based=lambda feed: None)
    journal.rotate(follower=feed)
    assert replication.saving_refused() is None  # in sync, its lease not recorded by an arbiter yet
    feed.lose("its stream broke")
    assert "lost its backup b:1" in replication.saving_refused()
    replication.hold_saving("the folder is held by the replaced primary")
    assert replication.saving_refused() == "the folder is held by the replaced primary"
    journal.close()


def test_a_lost_backup_is_released_once_the_arbiter_records_it_no_more(tmp_path):
    """Replication.released, which a repeat at this shard (as an arbiter) asks before it answers without that
    backup: none while the backup follows; once it is lost, whatever the arbiter's record says (a lease
    renewal) decides: still named in sync, or no answer, it is not released; named no more, it is, unless the
    feed asked IN_SYNC naming the record's count as it stands (decided late, it would name it again). A shard
    that is its own arbiter releases it at once. The ask fits in the seconds it is given (attempts of half of
    them, retried for the other half), and none is made with nothing left."""
    journal = Journal(tmp_path)
    journal.start({"step": 0, "variables": {"w": torch.zeros(2)}})
    records = [{"primary": "a:1", "backup": "b:1", "changes": 3}, ServerUnavailableError("no answer"),
               {"primary": "a:1", "backup": "", "changes": 3}, {"primary": "a:1", "backup": "", "changes": 3},
               {"primary": "a:1", "backup": "", "changes": 3}, {"primary": "a:1", "backup": "", "changes": 4}]
    asked = []

    def arbiter(action, index, primary, backup, timeout=None, changes=None):
        asked.append((action, index, primary, backup, changes, timeout))
        answer = records.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    replication = Replication(1, "a:1", lambda: journal, lambda feed: None, arbiter, self_arbitrated=False,
                              chunk_bytes=1024, lease_seconds=0.5)
    own = Replication(0, "a:0", lambda: journal, lambda feed: None, None, self_arbitrated=True, chunk_bytes=1024)
    try:
        assert replication.released() is None  # no backup
        feed = Feed("b:1", 1024, 60, on_lost=lambda feed, why: None, on_based=lambda feed: None)
        journal.rotate(follower=feed)
        assert replication.released() is None and not asked  # it follows: nothing asked
        feed.lose("its stream broke")
        journal.follower_lost(feed)
        assert [replication.released() for _ in range(3)] == [None, None, feed]
        assert replication.released(ask=False) is feed  # unasked (the promotion of this shard's own arbiter)
        feed.read_changes = 3  # the count read, but no IN_SYNC asked (the loss seen first): its DROP may name
        assert replication.released() is feed  # none, which leaves the count at 3 where no backup is in sync
        feed.in_sync_asked = True  # its IN_SYNC named count 3: at 3, the record may name it yet
        assert replication.released(timeout=1.0) is None  # (the record still at 3)
        assert replication.released(timeout=0.0) is None and len(asked) == 5, "no time left: not asked"
        assert replication.released() is feed
        assert [call[:5] for call in asked] == [("lease", 1, "a:1", "b:1", None)] * 6  # plain renewals: they never
        assert [call[5] for call in asked] == [1.0] * 4 + [0.5, 1.0]                    # wait at the arbiter
        assert own.released() is feed
    finally:
        journal.close()


def _arbiter(registry: ReplicaRegistry, staged):
    """Replication's arbiter as the coordinator makes it (decide, then apply), in process; staged(action) runs
    first in the thread asking."""
    def ask(action, index, primary, backup, timeout=None, changes=None, copy=""):
        staged(action)
        if action == "lease":
            return registry.renew(index, primary)
        event = registry.decide(action, index, primary, backup, changes, copy)
        if event is not None:
            registry.apply(event)
        return registry.entry(index)
    return ask


def _join_threads(*names: str) -> None:
    for thread in threading.enumerate():
        if thread.name in names:
            thread.join(10)
            assert not thread.is_alive(), thread.name


@pytest.mark.parametrize("staged_at", ["its first ask", "its in-sync ask", "an older feed's drop"])
def test_a_backup_lost_as_its_primary_says_it_is_in_sync_is_never_recorded_in_sync(tmp_path, staged_at):
    """A backup acknowledges its base: the primary's in-sync thread asks the arbiter. As it makes its first ask
    (the record's count read), or as it asks IN_SYNC, the feed is lost and its DROP (the drop thread) is decided
    first: the record ends with no backup in sync (one there would be promoted over every change the primary
    then acknowledged alone), and the journal waits for the feed no more. "an older feed's drop": a DROP the
    feed did not cause comes between the read and the IN_SYNC: the primary reads again and the backup it keeps
    is recorded in sync."""
    journal = Journal(tmp_path)
    journal.start({"step": 0, "variables": {"w": torch.zeros(2)}})
    registry = ReplicaRegistry(["h:0", "h:1"])
    feeds, asked, dropped = [], [], threading.Event()

    def staged(action: str) -> None:
        if threading.current_thread().name == "replica-drop":
            return
        if threading.current_thread().name == "replica-in-sync":
            asked.append(action)
        first = len(asked) == 1 if staged_at == "its first ask" else asked.count("in_sync") == 1 and action == "in_sync"
        if not first or dropped.is_set():
            return
        dropped.set()
        if staged_at == "an older feed's drop":
            registry.apply(registry.decide("drop", 1, "h:1", "b:1", changes=registry.entry(1)["changes"]))
            return
        feeds[0].lose("its stream broke")
        wait_until(lambda: journal.following() is None, 10, "the lost feed's drop")

    replication = Replication(1, "h:1", lambda: journal, lambda feed: journal.rotate(follower=feed),
                              _arbiter(registry, staged), self_arbitrated=False, chunk_bytes=1024)
    feeds.append(replication.open(ps_pb2.ReplicaHello(index=1, address="b:1")))
    feeds[0].acked(feeds[0].floor, journal)  # its base is written: the in-sync thread asks
    if staged_at == "an older feed's drop":
        wait_until(lambda: registry.entry(1)["backup"] == "b:1", 10, "the backup recorded in sync")
        assert asked.count("in_sync") == 2 and feeds[0].lost is None
        feeds[0].lose("test over")
    _join_threads("replica-in-sync", "replica-drop")
    assert dropped.is_set() and registry.entry(1)["backup"] == "" and journal.following() is None, registry.entry(1)
    with pytest.raises(ReplicaFencedError, match="no backup in sync"):
        registry.decide("promote", 1, "h:1", "b:1")
    journal.close()


def test_a_read_of_the_count_waits_until_every_change_it_counts_is_durable(tmp_path):
    """The arbiter's coordinator, its journal followed by a backup that has not acknowledged: a DROP is
    counted at once but waits for its record; a plain lease answers at once, a read of the count (a lease
    naming `changes`) only once the change it counts is durable (an arbiter that takes over from this one has
    it too), so an IN_SYNC never names a count the next arbiter could reach again with another change. A
    repeated DROP waits as its original does, but not for a backup of the arbiter's that was lost and that the
    arbiter's own arbiter no longer records in sync (released)."""
    from torchps.ps_server.coordinator import Coordinator
    from torchps.ps_server.store import VariableStore

    coordinator = Coordinator(VariableStore(), owns_step=True, index=0, addresses=SPEC, failover_after=0.3)
    journal = Journal(tmp_path / "j")
    journal.start({"step": 0})
    coordinator.attach_journal(journal)
    follower = _Follower()
    journal.rotate(follower=follower)
    try:
        dropped = threading.Thread(target=coordinator.set_replica, args=("drop", 1, "h:1", "b:1", 30.0, 0))
        dropped.start()
        wait_until(lambda: coordinator.replicas.entry(1)["changes"] == 1, 10, "the DROP counted")
        assert coordinator.set_replica("lease", 1, "h:1", "")["changes"] == 1  # a renewal: never waits
        with pytest.raises(WaitTimeoutError, match="not written by the backup b:1"):
            coordinator.set_replica("lease", 1, "h:1", "", timeout=0.2, changes=0)
        read = []
        reading = threading.Thread(target=lambda: read.append(
            coordinator.set_replica("lease", 1, "h:1", "", timeout=30, changes=0)))
        reading.start()
        assert dropped.is_alive() and reading.is_alive()
        journal.detach(follower)  # ps 0's backup dropped: its journal's own write is durable enough
        dropped.join(10)
        reading.join(10)
        assert not dropped.is_alive() and read[0]["changes"] == 1
        again = _Follower()
        journal.rotate(follower=again)  # followed again, never acknowledged
        with pytest.raises(WaitTimeoutError):  # counted (an IN_SYNC naming 1 may be on its way): it waits
            coordinator.set_replica("drop", 1, "h:1", "b:1", timeout=0.2, changes=1)
        with pytest.raises(WaitTimeoutError):  # its retry, a repeat, answers once the drop is as durable
            coordinator.set_replica("drop", 1, "h:1", "b:1", timeout=0.2, changes=1)
        again.lost = "its stream broke"  # this arbiter's own backup lost
        journal.follower_lost(again)
        with pytest.raises(WaitTimeoutError):  # its own arbiter still records it in sync: promoted, it would
            coordinator.set_replica("drop", 1, "h:1", "b:1", timeout=0.2, changes=1,  # lack the drop
                                    released=lambda ask, timeout: None)
        entry = coordinator.set_replica("drop", 1, "h:1", "b:1", timeout=0.2, changes=1,  # dropped there: at once
                                        released=lambda ask, timeout: again)
        assert entry["changes"] == 2  # (ps 0 and ps 1, each the other's arbiter, both losing their backups,
        with pytest.raises(WaitTimeoutError):  # would otherwise wait on each other's drops for good)
            coordinator.set_replica("drop", 1, "h:1", "", timeout=0.2, changes=2,  # counted: waits as before
                                    released=lambda ask, timeout: again)
    finally:
        coordinator.close()
        journal.close()


def test_a_repeat_waits_for_its_change_only_what_is_left_of_its_deadline_once_its_arbiter_was_asked(monkeypatch):
    """A repeat asks this arbiter's own arbiter whether its lost backup is released (a call of up to 2 s) before
    it waits for the change to be durable: the ask is given the caller's deadline, and the wait what is left of
    it, never all of it again (the call's clock is the coordinator's, moved here by the ask)."""
    from torchps.ps_server import coordinator as coordinator_module
    from torchps.ps_server.coordinator import Coordinator
    from torchps.ps_server.store import VariableStore

    coordinator = Coordinator(VariableStore(), owns_step=True, index=0, addresses=SPEC, failover_after=0.3)
    try:
        coordinator.set_replica("drop", 1, "h:1", "", timeout=5.0, changes=0)  # counted: the next is a repeat
        clock, waits, given = [100.0], [], []
        monkeypatch.setattr(coordinator_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
        monkeypatch.setattr(coordinator.recorder, "durable_all", lambda timeout, released=None: waits.append(
            (timeout, released)))

        def released(ask: bool, timeout: float | None) -> None:
            given.append(timeout)
            clock[0] += 1.5  # the ask took 1.5 s of the caller's 5
            return None

        coordinator.set_replica("drop", 1, "h:1", "", timeout=5.0, changes=0, released=released)
        coordinator.set_replica("drop", 1, "h:1", "", timeout=1.0, changes=0, released=released)
        coordinator.set_replica("drop", 1, "h:1", "", timeout=None, changes=0, released=released)
        assert given == [5.0, 1.0, None] and waits == [(pytest.approx(3.5), None), (0.0, None), (None, None)]
    finally:
        coordinator.close()


def test_a_promotion_that_outlasted_the_primarys_lease_waits_for_its_record_only_what_is_left(monkeypatch):
    """A PROMOTE asked while the primary's lease holds (a new arbiter hears leases for a whole window first)
    waits that out, then is granted: its record's durable wait (no journal here: every record so far) gets what
    is left of the caller's deadline, not all of it again."""
    from torchps.ps_server.coordinator import Coordinator
    from torchps.ps_server.store import VariableStore

    coordinator = Coordinator(VariableStore(), owns_step=True, index=0, addresses=SPEC, failover_after=0.3)
    waits = []
    try:
        coordinator.set_replica("in_sync", 1, "h:1", "b:1", timeout=5.0)
        monkeypatch.setattr(coordinator.recorder, "durable_all", lambda timeout, released=None: waits.append(timeout))
        entry = coordinator.set_replica("promote", 1, "h:1", "b:1", timeout=5.0)
        assert entry["primary"] == "b:1"
        assert len(waits) == 1 and waits[0] <= 5.0 - 0.2, "the lease's wait (what was left of 0.3 s) is counted"
    finally:
        coordinator.close()


def test_a_backup_the_record_lost_while_its_primary_follows_is_recorded_in_sync_again(tmp_path):
    """A DROP of the same backup that an earlier feed asked, decided only after this feed's IN_SYNC, leaves the
    record without the backup the primary follows (no failover could promote it): the primary's next lease
    renewal sees it and records the backup in sync again."""
    journal = Journal(tmp_path)
    journal.start({"step": 0, "variables": {"w": torch.zeros(2)}})
    registry = ReplicaRegistry(["h:0", "h:1"])
    replication = Replication(1, "h:1", lambda: journal, lambda feed: journal.rotate(follower=feed),
                              _arbiter(registry, lambda action: None), self_arbitrated=False, chunk_bytes=1024)
    feed = replication.open(ps_pb2.ReplicaHello(index=1, address="b:1"))
    feed.acked(feed.floor, journal)
    wait_until(lambda: registry.entry(1)["backup"] == "b:1", 10, "the backup recorded in sync")
    registry.apply(registry.decide("drop", 1, "h:1", "b:1"))  # an earlier feed's DROP, decided late
    wait_until(lambda: registry.entry(1)["backup"] == "b:1" and registry.entry(1)["changes"] == 3, 10,
               "the backup recorded in sync again")
    feed.lose("test over")
    _join_threads("replica-in-sync", "replica-drop")
    assert registry.entry(1)["backup"] == "" and registry.entry(1)["changes"] == 4
    journal.close()
