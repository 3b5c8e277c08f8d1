"""A sync job's live resize on the shard's side (moves.py, layout.py's hold, pushes.py), with threads and no
sockets: a hold lets the steps before it complete and keeps later pushes out of every sum; variables move only
while the shard is quiet; the hold's end sends the pushes it kept back to their clients, placed anew."""

from __future__ import annotations

import pytest
import torch

from helpers import wait_until
from test_coordinator import Call, g, push, sync, w
from torchps.errors import InvalidArgumentError, LayoutChangedError, ModeConflictError
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.modes import SyncConfig
from torchps.ps_server.store import NewVariable, VariableStore

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]


@pytest.fixture
def shards():
    """Factory: shard(config, index=0, holding=True) -> a Coordinator (ps `index`; ps 0 owns the step) over a
    store holding SGD variable "w" = zeros(3), lr 1 (or nothing); closed after the test."""
    made: list[Coordinator] = []

    def make(config: SyncConfig | None = None, *, index: int = 0, holding: bool = True) -> Coordinator:
        store = VariableStore()
        if holding:
            store.create([NewVariable("w", torch.zeros(3), "sgd", {"lr": 1.0})])
        shard = Coordinator(store, owns_step=index == 0, index=index)
        made.append(shard)
        if config is not None:
            shard.configure(config)
        return shard

    yield make
    for shard in made:
        shard.close()


def test_a_hold_lets_the_open_step_complete_and_keeps_later_pushes_out(shards):
    c = shards(sync(2))
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    first = Call(push, c, "worker:0", 0, g(2, 2, 2), seq=1)
    assert first.waits()  # counted for step 0, held for its release
    assert c.moves.set_layout(1, ADDRESSES, {"w": 0}, hold_from=1)
    assert c.layout.hold_from == 1 and not c.moves.quiet()  # step 0 has a push counted: it must complete
    with pytest.raises(ModeConflictError, match="quiet"):
        c.moves.export(["w"], 1, 1)
    push(c, "worker:1", 0, g(4, 4, 4), seq=1)
    assert first.result().next_step == 1 and c.store.step == 1 and c.moves.quiet()
    held = Call(push, c, "worker:0", 1, g(1, 1, 1), seq=2, layout_epoch=1)
    assert held.waits()  # waits for the hold's end, before anything of it is counted
    assert c.moves.quiet() and c.pending.idle()
    data, step = c.moves.export(["w"], 1, 1)
    assert step == 1 and c.store.names() == []
    assert c.moves.set_layout(2, ADDRESSES, {"w": 1})  # the hold ends: the held push names what left
    with pytest.raises(LayoutChangedError, match="moved from ps 0 to ps 1"):
        held.result()
    assert c.store.step == 1 and c.pending.idle() and c.stale_dropped == 0
    assert data  # the state left with the variable


def test_pushes_placed_by_the_epoch_that_ended_the_hold_are_counted(shards):
    source, target = shards(sync(1)), shards(sync(1), index=1, holding=False)
    for shard in (source, target):
        shard.join("worker:0", 1)
    push(source, "worker:0", 0, g(1, 1, 1), seq=1)
    for shard in (source, target):
        assert shard.moves.set_layout(1, ADDRESSES, {"w": 0}, hold_from=1)
    assert (source.layout.hold_from, target.layout.hold_from) == (1, 1)
    assert target.store.step == 1  # it holds nothing: it takes the hold's step as its own
    for shard in (source, target):
        assert shard.moves.set_layout(2, ADDRESSES, {"w": 1}, hold_from=1)
    assert source.moves.quiet() and target.moves.quiet()
    data, step = source.moves.export(["w"], 2, 1)
    assert target.moves.import_(data, 2, step) == ["w"]
    for shard in (source, target):
        assert shard.moves.set_layout(3, ADDRESSES, {"w": 1})
    with pytest.raises(LayoutChangedError, match="ended at epoch 3"):  # placed before the hold's end
        push(target, "worker:0", 1, g(3, 3, 3), seq=2, layout_epoch=2)
    result = push(target, "worker:0", 1, g(3, 3, 3), seq=3, layout_epoch=3)
    assert not result.stale and not result.duplicate
    wait_until(lambda: target.store.step == 2, 10, "ps 1 to apply step 1")  # its applier's, after the reply
    assert torch.equal(w(target), -torch.tensor([4.0, 4.0, 4.0]))  # step 0's on the source, step 1's here


def test_a_hold_is_for_sync_jobs_and_a_repeat_is_a_no_op(shards):
    plain = shards()
    with pytest.raises(InvalidArgumentError, match="for sync jobs"):
        plain.moves.set_layout(1, ADDRESSES, {"w": 0}, hold_from=3)
    with pytest.raises(InvalidArgumentError, match=r"\[0, 2\*\*62\)"):
        plain.moves.set_layout(1, ADDRESSES, {"w": 0}, hold_from=2 ** 62)
    assert plain.layout.epoch == 0
    c = shards(sync(1))
    assert c.moves.set_layout(1, ADDRESSES, {"w": 0}, hold_from=5)
    assert not c.moves.set_layout(1, ADDRESSES, {"w": 0}, hold_from=5)  # a retried SetLayout
    with pytest.raises(ModeConflictError, match="another layout"):
        c.moves.set_layout(1, ADDRESSES, {"w": 0}, hold_from=6)
    assert c.layout.hold_from == 5 and c.store.step == 0  # it holds "w": its step stays


def test_an_import_moves_the_step_up_except_on_the_shard_that_counts_the_global_step(shards):
    """Async: every shard counts the pushes it applied, and ps 0's count is the global step. A shard ahead of
    ps 0 by the pushes in flight exports to it (a shrink): ps 0 keeps its own count (those pushes count once
    there, when they arrive); any other shard moves up to the exporter's."""
    owner, ahead, other = shards(), shards(index=1, holding=False), shards(index=2, holding=False)
    ahead.store.create([NewVariable("v", torch.zeros(2), "sgd", {"lr": 1.0})])
    for _ in range(3):
        push(ahead, "worker:0", 0, {"v": torch.ones(2)}, step_increment=1)
    addresses = [*ADDRESSES, "127.0.0.1:3"]
    for shard in (owner, ahead, other):
        shard.moves.set_layout(1, addresses, {"w": 0, "v": 0})
    data, step = ahead.moves.export(["v"], 1, 0)
    assert step == 3 and owner.moves.import_(data, 1, step) == ["v"]
    assert owner.store.step == 0, "ps 0's step is the global step: its own count"
    for shard in (owner, ahead, other):
        shard.moves.set_layout(2, addresses, {"w": 0, "v": 2})
    data, step = owner.moves.export(["v"], 2, 2)
    assert other.moves.import_(data, 2, 3) == ["v"] and other.store.step == 3


def test_a_shard_that_joins_a_running_sync_job_takes_ps_0s_workers_and_its_grace_end(shards):
    """N = 3 in a long startup grace; worker:2 joined and left, so ps 0 counts 2. A shard the resize adds
    (holding nothing, it takes the hold step as its own) counts the spec's 3 in a grace of its own until the
    resize gives it ps 0's workers (moves.job_members, sent in Layout.members): then it counts ps 0's 2 and its
    grace ends with ps 0's. Malformed members change nothing; a shard that did not join at this hold ignores
    them."""
    config = sync(3, startup_grace_seconds=600)
    owner, added, kept = shards(config), shards(config, index=1, holding=False), shards(config, index=2)
    for worker in ("worker:0", "worker:1", "worker:2"):
        owner.join(worker, 1)
    owner.leave("worker:2", 1)
    assert owner.quorum == 2
    for shard in (owner, added, kept):
        assert shard.moves.set_layout(1, ADDRESSES, {"w": 0}, hold_from=1)
    assert added.store.step == 1 and added.quorum == 3 and kept.quorum == 3
    members, grace_left = owner.moves.job_members()
    assert sorted(members) == ["worker:0", "worker:1", "worker:2"] and members["worker:2"]["gone"]
    assert 590 < grace_left <= 600
    for bad in ({"": members["worker:0"]}, {"worker:9": {**members["worker:0"], "counts_from": -1}},
                {"worker:9": {**members["worker:0"], "silent": -1.0}}):
        with pytest.raises(InvalidArgumentError, match="member"):
            added.moves.set_layout(2, ADDRESSES, {"w": 0}, hold_from=1, members=bad, grace_left=grace_left)
    with pytest.raises(InvalidArgumentError, match="grace_left_seconds"):
        added.moves.set_layout(2, ADDRESSES, {"w": 0}, hold_from=1, members=members, grace_left=float("nan"))
    assert added.layout.epoch == 1 and added.quorum == 3  # nothing changed
    for shard in (added, kept):
        assert shard.moves.set_layout(2, ADDRESSES, {"w": 0}, hold_from=1, members=members, grace_left=grace_left)
    assert added.quorum == 2, "ps 0's workers: worker:2 is absent"
    assert kept.quorum == 3 and kept.membership.joined() == 0, "it holds variables: it did not join at this hold"
    assert owner.moves.set_layout(2, ADDRESSES, {"w": 0})  # the hold's end
    assert owner.moves.job_members() == ({}, 0.0), "only under a hold"


def test_imports_that_overlap_adopt_once_and_a_repeat_keeps_what_was_pushed_since(shards):
    """A retried ImportVariables that overlaps its original (the first's reply lost): the two are checked
    and made one at a time, so the variable is adopted once; the later repeat changes nothing, not even
    a push applied to the first copy meanwhile."""
    import threading

    source = shards(index=0)
    source.moves.set_layout(1, ADDRESSES, {"w": 1})
    data, step = source.moves.export(["w"], 1, 1)
    for _ in range(20):
        target = shards(index=1, holding=False)
        target.moves.set_layout(1, ADDRESSES, {"w": 1})
        start, results = threading.Barrier(2), []

        def importing() -> None:
            start.wait()
            try:
                results.append(target.moves.import_(data, 1, step))
            except Exception as exc:  # noqa: BLE001 - a failure is what the test looks for
                results.append(exc)

        threads = [threading.Thread(target=importing) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert results == [["w"], ["w"]]
        push(target, "worker:0", 0, g(1, 1, 1))
        assert target.moves.import_(data, 1, step) == ["w"]  # a third, after the push
        assert torch.equal(w(target), -torch.ones(3))
