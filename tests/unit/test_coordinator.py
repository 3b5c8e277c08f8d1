"""Coordinator (ps_server/coordinator.py) over a VariableStore, with threads and no sockets.

Sync mode must behave like TensorFlow's SyncReplicasOptimizer (average of a
step's quorum applied once, stale gradients dropped and counted, backup
workers, R > N), with leases that lower the quorum instead of hanging; ssp
bounds how far a worker runs ahead of the slowest one; async never blocks.
Where leases matter the clock is a fake one; the lease reaper waits with a
real timeout computed from it, so tests call coordinator.wake() after moving it.

A call that must block is shown to wait by an event, never by watching it for
a while: the coordinator counts it as held (a push held for its release or by
the ssp bound) or waiting (a pull, a save, a retry), and its thread is alive.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers import wait_until
from torchps.errors import (InvalidArgumentError, ModeConflictError, ResourceExhaustedError, ServerUnavailableError,
                            StepPassedError, WaitTimeoutError, WorkerReplacedError)
from torchps.ps_server.coordinator import CHIEF, WORKER, Coordinator
from torchps.ps_server.modes import PushResult, SyncConfig, quorum_for
from torchps.ps_server.store import NewVariable, VariableStore

RELEASE_TIMEOUT = 10  # seconds a thread that must be released gets (generous on a loaded machine)


class FakeClock:
    """Monotonic seconds that move only when told to."""

    def __init__(self, start: float = 1000.0):
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def waiting(c: Coordinator) -> int:
    """Calls blocked in `c` right now: pushes it holds (release, ssp bound) and other waits (pull, save, retry)."""
    held = sum(m.held for m in list(c.membership.members.values()))
    return held + sum(c.waits.waiting(kind) for kind in ("pull", "save", "retry", "list"))


class Call:
    """Runs fn in a thread; result() joins it and returns its value or raises its exception."""

    def __init__(self, fn, *args, **kwargs):
        self._value = self._error = None
        self.coordinator = getattr(fn, "__self__", None) or next((a for a in args if isinstance(a, Coordinator)), None)
        self.thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, fn, args, kwargs):
        try:
            self._value = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            self._error = exc

    def waits(self, blocked: int = 1) -> bool:
        """True once the coordinator counts `blocked` calls blocked (this one among them) while this call is
        still running; False if the call returned instead. Fails the test if neither happens in time."""
        wait_until(lambda: waiting(self.coordinator) >= blocked or not self.thread.is_alive(), RELEASE_TIMEOUT,
                   f"{blocked} blocked call(s) in the coordinator")
        return self.thread.is_alive()

    def result(self, timeout: float = RELEASE_TIMEOUT):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the call did not return within {timeout} s"
        if self._error is not None:
            raise self._error
        return self._value


@pytest.fixture
def coordinators():
    """Factory: coordinator(config, owns_step=True, clock=None, lr=1.0) -> Coordinator over a fresh store.

    Every store holds one SGD variable "w" = zeros(3) with the given lr, so
    after an applied step w == -lr * (average gradient). Coordinators are
    closed after the test (stops the lease reapers, wakes waiters).
    """
    made: list[Coordinator] = []

    def make(config: SyncConfig | None = None, *, owns_step: bool = True, clock=None, lr: float = 1.0) -> Coordinator:
        store = VariableStore()
        store.create([NewVariable("w", torch.zeros(3), "sgd", {"lr": lr})])
        coordinator = Coordinator(store, owns_step=owns_step, **({"clock": clock} if clock else {}))
        made.append(coordinator)
        if config is not None:
            assert coordinator.configure(config) is True
        return coordinator

    yield make
    for coordinator in made:
        coordinator.close()


def sync(n: int, r: int = 0, **kwargs) -> SyncConfig:
    return SyncConfig(mode="sync", total_num_replicas=n, replicas_to_aggregate=r, **kwargs)


def g(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(values, dtype=torch.float32)}


def w(coordinator: Coordinator) -> torch.Tensor:
    return coordinator.store.read("w", lambda value, version: value.clone())


def version(coordinator: Coordinator) -> int:
    return coordinator.store.read("w", lambda value, version: version)


def push(coordinator: Coordinator, worker: str, step: int, grads, *, seq: int = 0, incarnation: int = 1,
         **kwargs) -> PushResult:
    return coordinator.push(worker, incarnation, seq, step, grads, **kwargs)


def expire_leases(coordinator: Coordinator, clock: FakeClock, seconds: float, expected_expired: int) -> None:
    """Moves the fake clock and wakes the reaper until it has expired `expected_expired` leases in all."""
    clock.advance(seconds)
    deadline = time.monotonic() + RELEASE_TIMEOUT
    while coordinator.membership.expired < expected_expired:
        assert time.monotonic() < deadline, f"the reaper expired {coordinator.membership.expired} leases, " \
                                            f"expected {expected_expired}"
        coordinator.wake()
        time.sleep(0.01)  # polling the reaper's count, with a deadline


# -- sync: SyncReplicasOptimizer semantics ---------------------------------------------------------

def test_sync_first_push_waits_for_the_second_and_the_average_is_applied_once(coordinators):
    c = coordinators(sync(2))
    for worker in ("worker:0", "worker:1"):
        assert c.join(worker, 1) == 0
    assert c.quorum == 2
    first = Call(push, c, "worker:0", 0, g(1, 2, 3))
    assert first.waits(), "the first push of a step with quorum 2 returned before the second arrived"
    assert c.store.step == 0 and version(c) == 0, "something was applied with only one of two gradients"
    second = push(c, "worker:1", 0, g(3, 4, 5))
    released = first.result()
    assert c.store.step == 1, "one aggregated update advances the step by exactly 1"
    assert version(c) == 1, "the average must be applied once, not once per gradient"
    assert torch.equal(w(c), -torch.tensor([2.0, 3.0, 4.0]))
    for result in (released, second):
        assert (result.next_step, result.step, result.stale, result.quorum) == (1, 1, False, 2)
    assert released.wait_seconds >= 0 and c.stale_dropped == 0


def test_sync_stale_gradients_are_dropped_counted_and_never_applied(coordinators):
    c = coordinators(sync(1))
    c.join("worker:0", 1)
    assert push(c, "worker:0", 0, g(1, 1, 1)).next_step == 1
    before = w(c)
    for n in (1, 2):
        result = push(c, "worker:0", 0, g(100, 100, 100))
        assert result.stale and result.next_step == 1 and result.step == 1
        assert c.stale_dropped == n
    assert torch.equal(w(c), before) and version(c) == 1 and c.store.step == 1
    # nothing stale lingers in a buffer either: the next step takes only its own gradient
    push(c, "worker:0", 1, g(1, 1, 1))
    assert torch.equal(w(c), before - 1) and c.store.step == 2


def test_sync_backup_workers_fastest_r_win_the_last_is_stale(coordinators):
    c = coordinators(sync(3, 2))
    for i in range(3):
        c.join(f"worker:{i}", 1)
    assert c.quorum == 2
    first = Call(push, c, "worker:0", 0, g(2, 2, 2))
    assert first.waits()
    second = push(c, "worker:1", 0, g(4, 4, 4))
    assert first.result().next_step == 1 and second.next_step == 1
    late = push(c, "worker:2", 0, g(1000, 1000, 1000))
    assert late.stale and late.next_step == 1, "the backup worker must be told the step it computes at next"
    assert c.stale_dropped == 1
    assert torch.equal(w(c), -torch.tensor([3.0, 3.0, 3.0])) and version(c) == 1 and c.store.step == 1


def test_sync_r_greater_than_n_each_worker_contributes_k_batches(coordinators):
    c = coordinators(sync(2, 4))  # k = 2 batches per worker and step
    for i in range(2):
        c.join(f"worker:{i}", 1)
    assert c.quorum == 4
    a1 = push(c, "worker:0", 0, g(1, 0, 0))
    assert (a1.next_step, a1.stale) == (0, False), "the first of k batches must return at once, same step"
    a2 = Call(push, c, "worker:0", 0, g(2, 0, 0))
    assert a2.waits(), "a worker that gave its k batches must wait for the step"
    b1 = push(c, "worker:1", 0, g(3, 0, 0))
    assert b1.next_step == 0 and a2.waits()
    assert c.store.step == 0 and version(c) == 0
    b2 = push(c, "worker:1", 0, g(6, 0, 0))
    assert a2.result().next_step == 1 and b2.next_step == 1
    assert c.store.step == 1 and version(c) == 1, "the 4 gradients are one update"
    assert torch.equal(w(c), -torch.tensor([3.0, 0.0, 0.0])), "average of the 4 batches: (1+2+3+6)/4"


def test_sync_pushes_ahead_of_the_step_wait_in_their_own_buffer(coordinators):
    """A non-owner shard (no tokens, never blocks) sums step s+1 apart from step s."""
    c = coordinators(sync(2), owns_step=False)
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    assert push(c, "worker:0", 0, g(2, 0, 0)).next_step == 0
    assert push(c, "worker:0", 1, g(0, 100, 0)).next_step == 1  # worker 0 is ahead (shard 0 released it)
    assert c.store.step == 0 and version(c) == 0
    push(c, "worker:1", 0, g(4, 0, 0))
    c.wait_for_step(1, RELEASE_TIMEOUT)  # the applier applies a complete step
    assert c.store.step == 1 and torch.equal(w(c), -torch.tensor([3.0, 0.0, 0.0]))
    push(c, "worker:1", 1, g(0, 200, 0))
    c.wait_for_step(2, RELEASE_TIMEOUT)
    assert c.store.step == 2 and torch.equal(w(c), -torch.tensor([3.0, 150.0, 0.0]))
    assert c.stale_dropped == 0


def test_a_push_past_steps_counted_but_not_applied_yet_is_taken():
    """A non-owner shard whose applier is behind (here: not started; under load: starved of CPU) has step 0
    counted in full but not applied; worker 0, which saw shard 0 release steps 0 and 1, pushes step 2: taken,
    and the steps apply in order once the applier runs. A push past a step not counted in full is still refused
    (bench/resize.py's sync run met the refusal once the applier lagged two steps: the workers failed): for
    retry if its worker's own push for that step is counted (ps 0 went on without the other worker:
    test_a_worker_ps_0_left_out_first_holds_back_the_others_pushes_until_its_lease_runs_out_here), as bad
    input if not."""
    store = VariableStore()
    store.create([NewVariable("w", torch.zeros(3), "sgd", {"lr": 1.0})])
    c = Coordinator(store, owns_step=False, start=False)
    try:
        assert c.configure(sync(2)) is True
        c.join("worker:0", 1)
        c.join("worker:1", 1)
        push(c, "worker:0", 0, g(2, 0, 0))
        push(c, "worker:1", 0, g(4, 0, 0))
        push(c, "worker:0", 1, g(0, 100, 0))
        push(c, "worker:0", 2, g(0, 0, 10))  # refused before: 2 steps past the store's step 0
        assert c.store.step == 0 and version(c) == 0, "nothing applied: step 0 is counted, not applied"
        with pytest.raises(ServerUnavailableError, match=r"ahead .*\(step 1 has 1 of its quorum 2 pushes \(worker:0 1\)\)"):
            push(c, "worker:0", 3, g(1, 1, 1))  # step 1 waits for worker 1: 3 is more than one past it
        with pytest.raises(InvalidArgumentError, match="ahead"):
            push(c, "worker:1", 3, g(1, 1, 1))  # worker 1 skips its own step 1
        push(c, "worker:1", 1, g(0, 200, 0))
        push(c, "worker:1", 2, g(0, 0, 30))
        c.start()
        c.wait_for_step(3, RELEASE_TIMEOUT)
        assert torch.equal(w(c), -torch.tensor([3.0, 150.0, 20.0])), "each step's average, applied once, in order"
    finally:
        c.close()


# -- leases, leaving and restarts -----------------------------------------------------------------

def test_sync_expired_lease_lowers_the_quorum_and_releases_the_waiter(coordinators):
    clock = FakeClock()
    c = coordinators(sync(2, lease_seconds=1.0), clock=clock)
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    clock.advance(0.5)
    waiting = Call(push, c, "worker:0", 0, g(2, 4, 6))  # renews worker 0's lease at t = 0.5
    assert waiting.waits()
    assert c.membership.expired == 0
    expire_leases(c, clock, 0.7, expected_expired=1)  # t = 1.2: worker 1 (seen at 0) is out, worker 0 is not
    result = waiting.result()
    assert result.next_step == 1 and result.quorum == 1 and not result.stale
    assert c.membership.expired == 1 and c.quorum_changes >= 1 and c.quorum == 1
    assert c.live_workers() == 1
    assert torch.equal(w(c), -torch.tensor([2.0, 4.0, 6.0])) and c.store.step == 1


def test_a_worker_ps_0_left_out_first_holds_back_the_others_pushes_until_its_lease_runs_out_here(coordinators):
    """Each shard runs the leases itself: ps 0 left worker 1 out (its lease ran out there first) and released
    steps 0 and 1 with worker 0's gradients alone. Here worker 1 still counts, so worker 0's push of step 2 is
    refused for retry, changing nothing, until worker 1's lease runs out here too; then the steps complete
    with worker 0's gradients and the push is taken."""
    clock = FakeClock()
    c = coordinators(sync(2, lease_seconds=1.0), owns_step=False, clock=clock)
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    push(c, "worker:0", 0, g(1, 1, 1), seq=1)
    push(c, "worker:0", 1, g(2, 2, 2), seq=2)
    with pytest.raises(ServerUnavailableError, match=r"step 0 has 1 of its quorum 2 pushes .*retry"):
        push(c, "worker:0", 2, g(4, 4, 4), seq=3)
    assert c.store.step == 0 and version(c) == 0
    clock.advance(0.9)
    c.heartbeat("worker:0", 1)  # worker 0 stays; worker 1 (seen at 0) does not
    expire_leases(c, clock, 0.3, expected_expired=1)
    result = push(c, "worker:0", 2, g(4, 4, 4), seq=3)  # the retry: taken now
    assert not result.stale and not result.duplicate
    c.wait_for_step(3, RELEASE_TIMEOUT)  # step 2 too: the quorum is 1 once worker 1 is out
    assert torch.equal(w(c), -torch.tensor([7.0, 7.0, 7.0])), "steps 0, 1 and 2 with worker 0's gradients alone"


def test_sync_real_short_lease_releases_the_waiter(coordinators):
    """Same with the real clock: nothing but the lease (0.5 s) ends the wait."""
    c = coordinators(sync(2, lease_seconds=0.5))
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    start = time.monotonic()
    result = Call(push, c, "worker:0", 0, g(1, 1, 1)).result(timeout=RELEASE_TIMEOUT)
    assert time.monotonic() - start >= 0.3, "released before the other worker's lease could have run out"
    # worker 0's own lease runs out at about the same time (no heartbeats here): 1 or 2 expired
    assert result.next_step == 1 and result.quorum == 1 and c.membership.expired >= 1


def test_sync_heartbeats_keep_a_lease(coordinators):
    clock = FakeClock()
    c = coordinators(sync(2, lease_seconds=1.0), clock=clock)
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    waiting = Call(push, c, "worker:0", 0, g(1, 1, 1))
    assert waiting.waits()
    for _ in range(5):  # 2.5 s of fake time, both heartbeating every 0.5 s
        clock.advance(0.5)
        c.heartbeat("worker:0", 1)
        c.heartbeat("worker:1", 1)
        c.wake()
    assert waiting.waits() and c.membership.expired == 0 and c.quorum == 2
    push(c, "worker:1", 0, g(1, 1, 1))
    assert waiting.result().next_step == 1


def test_sync_leave_lowers_the_quorum_at_once_and_releases_a_waiter(coordinators):
    """TF issue 20342: a worker that runs out of data must not hang the others."""
    c = coordinators(sync(2, lease_seconds=1000.0))  # only leave() can release the waiter
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    waiting = Call(push, c, "worker:0", 0, g(2, 2, 2))
    assert waiting.waits()
    c.leave("worker:1", 1)
    result = waiting.result()
    assert result.next_step == 1 and result.quorum == 1
    assert c.quorum == 1 and c.quorum_changes >= 1 and c.membership.expired == 0 and c.live_workers() == 1
    assert torch.equal(w(c), -torch.tensor([2.0, 2.0, 2.0]))
    c.leave("worker:1", 1)  # idempotent
    assert push(c, "worker:0", 1, g(1, 1, 1)).next_step == 2, "the one left goes on alone"


def test_sync_restarted_worker_rejoins_and_counts_again(coordinators):
    clock = FakeClock()
    c = coordinators(sync(2, lease_seconds=1.0), clock=clock)
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    old = Call(push, c, "worker:1", 0, g(0, 0, 0), seq=1)  # incarnation 1 pushed seq 1 ...
    assert old.waits()
    push(c, "worker:0", 0, g(0, 0, 0), seq=1)
    assert old.result().next_step == 1 and c.store.step == 1
    clock.advance(0.5)
    c.heartbeat("worker:0", 1)
    expire_leases(c, clock, 0.7, expected_expired=1)  # ... and died
    assert c.quorum == 1
    assert push(c, "worker:0", 1, g(1, 1, 1), seq=2).next_step == 2, "alone while worker 1 is gone"
    changes = c.quorum_changes
    assert c.join("worker:1", 2) == 2, "a restart joins at the current step"
    assert c.quorum == 2 and c.quorum_changes == changes + 1 and c.live_workers() == 2
    waiting = Call(push, c, "worker:0", 2, g(2, 2, 2), seq=3)
    assert waiting.waits(), "the restarted worker must count towards the quorum again"
    # seq 1 again, but from the new incarnation: a new push, not a retry of the old one
    fresh = push(c, "worker:1", 2, g(4, 4, 4), seq=1, incarnation=2)
    assert not fresh.duplicate and fresh.next_step == 3
    assert waiting.result().next_step == 3
    assert torch.equal(w(c), -torch.tensor([4.0, 4.0, 4.0])), "step 1 alone (1), step 2 averaged (3)"


def test_sync_a_joiner_never_counts_for_a_step_before_the_one_it_starts_at_even_in_the_startup_grace(coordinators):
    """Found by the soak: a shard restarted from its journal runs a startup grace again, and a worker added then
    was counted from this shard's open step although shard 0 (a step ahead) had told it to start at the next:
    it could never push for that step, which waited the progress timeout (10 s) for it. It counts from the
    step it starts at, in the grace too."""
    c = coordinators(sync(3, lease_seconds=600.0, progress_seconds=600.0))  # in its startup grace all along
    for worker in ("worker:0", "worker:1", "worker:2"):
        c.join(worker, 1)
    c.leave("worker:2", 1)
    assert c.quorum == 2
    held = Call(push, c, "worker:0", 0, g(1, 1, 1))
    assert held.waits()
    c.join("worker:3", 1, 1)  # added: shard 0 is at step 1 already, this shard still at 0
    assert c.quorum == 2, "not counted for step 0, which it will never push for"
    assert push(c, "worker:1", 0, g(3, 3, 3)).next_step == 1 and held.result().next_step == 1
    assert c.quorum == 3, "counted from step 1"


def test_sync_restart_without_lease_expiry_keeps_the_quorum(coordinators):
    """A new incarnation of a live worker (crash and quick restart) replaces it; the quorum stays N."""
    c = coordinators(sync(2))
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    assert c.join("worker:1", 7) == 0
    assert c.live_workers() == 2 and c.quorum == 2
    waiting = Call(push, c, "worker:0", 0, g(1, 1, 1))
    assert waiting.waits()
    push(c, "worker:1", 0, g(3, 3, 3), incarnation=7)
    assert waiting.result().next_step == 1 and torch.equal(w(c), -torch.tensor([2.0, 2.0, 2.0]))


@pytest.mark.parametrize("during_grace", [True, False], ids=["during-startup-grace", "after-startup-grace"])
def test_sync_rejoin_seen_by_shards_at_different_times_does_not_hang_a_shard(coordinators, during_grace):
    """Shard 1 sees a replacement's Join while it still finishes a step shard 0 has applied.

    Shard 0 applied step 0 with the lowered quorum, so the replacement starts
    at step 1 (shard 0's answer, which the client passes on to the other
    shards). Shard 1 must still be able to finish step 0:
    the replacement will never push a gradient tagged 0. Otherwise workers 0
    and 1, released at step 1 by shard 0, wait for shard 1 to reach step 1
    in their next pull, forever, while their heartbeats keep every lease alive.
    """
    grace = 1000.0 if during_grace else 0.5
    clock0, clock1 = FakeClock(), FakeClock()
    shard0 = coordinators(sync(3, lease_seconds=1.0, startup_grace_seconds=grace), clock=clock0)
    shard1 = coordinators(sync(3, lease_seconds=1.0, startup_grace_seconds=grace), owns_step=False, clock=clock1)
    for shard, clock in ((shard0, clock0), (shard1, clock1)):
        for i in range(3):
            shard.join(f"worker:{i}", 1)
        clock.advance(0.6)
        shard.heartbeat("worker:0", 1)
        shard.heartbeat("worker:1", 1)
        expire_leases(shard, clock, 0.6, expected_expired=1)  # worker 2 died
        assert shard.quorum == 2
    first = Call(push, shard0, "worker:0", 0, g(1, 1, 1))
    push(shard0, "worker:1", 0, g(1, 1, 1))
    assert first.result().next_step == 1
    start_step = shard0.join("worker:2", 2)  # the client joins shard 0 first: it starts at step 1 ...
    assert start_step == 1
    assert shard1.join("worker:2", 2, start_step) == 0  # ... and tells shard 1, still at step 0
    push(shard1, "worker:0", 0, g(1, 1, 1))
    push(shard1, "worker:1", 0, g(1, 1, 1))
    push(shard1, "worker:2", start_step, g(1, 1, 1), incarnation=2)  # its first push is tagged 1
    try:
        shard1.wait_for_step(1, timeout=2.0)  # workers 0 and 1 pull with min_step 1
    except WaitTimeoutError as exc:
        pytest.fail(f"shard 1 is stuck at step 0 waiting for a third gradient that will never come: {exc}")
    assert torch.equal(w(shard1), -torch.ones(3)), "shard 1's step 0 is the average of workers 0 and 1"


def test_sync_a_gone_workers_stale_push_does_not_count_it_back_from_this_shards_open_step(coordinators):
    """Found by the replicated soak: a worker paused past its lease resumes with a heartbeat and a push naming
    a step shard 1 has applied, while shard 0 is a step ahead of shard 1. Shard 1 used to count it back from its
    own open step, which the worker never pushes for (shard 0 tells it the next one): shard 1's step waited
    until a lease ran out (12 s in the soak, a failover of ps 1 in between). Calls naming an applied step leave
    it gone; its next push, of the step shard 0 told it, counts it back from that step."""
    clock = FakeClock()
    shard1 = coordinators(sync(3, lease_seconds=1.0, startup_grace_seconds=0.0), owns_step=False, clock=clock)
    for i in range(3):
        shard1.join(f"worker:{i}", 1)
    clock.advance(0.6)
    shard1.heartbeat("worker:0", 1)
    shard1.heartbeat("worker:1", 1)
    expire_leases(shard1, clock, 0.6, expected_expired=1)  # worker 2 paused past its lease
    assert shard1.quorum == 2
    push(shard1, "worker:0", 0, g(1, 1, 1))
    push(shard1, "worker:1", 0, g(1, 1, 1))
    shard1.wait_for_step(1, timeout=30.0)  # shard 0 has applied step 1 too: it is at step 2
    shard1.heartbeat("worker:2", 1, 0)  # resumed: its heartbeat names the step it was at
    assert push(shard1, "worker:2", 0, g(5, 5, 5)).stale  # and it sends the push it was computing
    assert shard1.quorum == 2 and shard1.live_workers() == 2, "still gone: it will never push for step 1"
    push(shard1, "worker:0", 1, g(1, 1, 1))
    push(shard1, "worker:2", 2, g(1, 1, 1))  # shard 0 told it step 2
    push(shard1, "worker:1", 1, g(1, 1, 1))
    try:
        shard1.wait_for_step(2, timeout=2.0)  # workers 0 and 1 pull with min_step 2
    except WaitTimeoutError as exc:
        pytest.fail(f"shard 1 waits at step 1 for a gradient worker 2 will never send: {exc}")
    assert shard1.live_workers() == 3 and shard1.quorum == 3, "back from the step of its next push"
    assert torch.equal(w(shard1), -2 * torch.ones(3)), "steps 0 and 1 averaged over workers 0 and 1"
    clock0 = FakeClock()  # shard 0 tells the worker the step it pushes next: the heartbeat counts it back at once
    shard0 = coordinators(sync(2, lease_seconds=1.0, startup_grace_seconds=0.0), clock=clock0)
    shard0.join("worker:0", 1), shard0.join("worker:1", 1)
    clock0.advance(0.6)
    shard0.heartbeat("worker:0", 1)
    expire_leases(shard0, clock0, 0.6, expected_expired=1)
    assert push(shard0, "worker:0", 0, g(1, 1, 1)).next_step == 1
    shard0.heartbeat("worker:1", 1, 0)
    assert shard0.live_workers() == 2 and shard0.quorum == 2


# -- idempotent pushes ---------------------------------------------------------------------------------

def test_sync_duplicate_push_is_not_applied_twice(coordinators):
    c = coordinators(sync(2))
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    first = Call(push, c, "worker:0", 0, g(2, 2, 2), seq=1)
    assert first.waits()
    second = push(c, "worker:1", 0, g(4, 4, 4), seq=1)
    original = first.result()
    assert not original.duplicate and not second.duplicate
    retry = push(c, "worker:0", 0, g(2, 2, 2), seq=1)
    assert retry.duplicate and retry.next_step == original.next_step == 1 and not retry.stale
    assert retry.wait_seconds < 1.0
    assert push(c, "worker:1", 0, g(4, 4, 4), seq=1).duplicate
    assert c.store.step == 1 and version(c) == 1 and c.stale_dropped == 0, "a retry is neither applied nor stale"
    assert torch.equal(w(c), -torch.tensor([3.0, 3.0, 3.0]))


def test_async_duplicate_push_is_not_applied_twice(coordinators):
    c = coordinators()
    for _ in range(2):
        result = push(c, "worker:0", 0, g(1, 1, 1), seq=5, step_increment=1)
    assert result.duplicate and result.versions == {"w": 1} and result.step == 1
    assert push(c, "worker:0", 0, g(1, 1, 1), seq=4, step_increment=1).duplicate, "an older seq is a retry too"
    assert version(c) == 1 and c.store.step == 1
    push(c, "worker:0", 0, g(1, 1, 1), seq=0, step_increment=1)
    push(c, "worker:0", 0, g(1, 1, 1), seq=0, step_increment=1)
    assert version(c) == 3, "seq 0 means no dedup"


def test_sync_retry_of_a_push_still_waiting_is_not_counted_twice(coordinators):
    """A retry that arrives while the original push is still held (its reply lost on the way) is the same push.

    With R = N = 2 it must not complete the step on its own: the step needs
    worker 1's gradient, and the average must be (worker 0 + worker 1) / 2.
    """
    c = coordinators(sync(2))
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    original = Call(push, c, "worker:0", 0, g(2, 2, 2), seq=1)
    assert original.waits()
    retry = Call(push, c, "worker:0", 0, g(2, 2, 2), seq=1)
    assert retry.waits(2), "the retry of a held push waits for the same release"
    assert c.store.step == 0, "the retry of a held push was counted as a second gradient and completed the step"
    push(c, "worker:1", 0, g(4, 4, 4), seq=1)
    original.result(), retry.result()
    assert torch.equal(w(c), -torch.tensor([3.0, 3.0, 3.0]))


def test_sync_retry_after_a_cancelled_wait_still_waits_for_the_release(coordinators):
    """The client's call was cancelled while held (connection lost); its retry must wait like the original.

    Answering the retry at once with the cached next_step (the step not yet
    applied) tells the worker to compute at step 0 again, so its next
    gradient is counted as a second one of the same worker for step 0.
    """
    c = coordinators(sync(2))
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    cancelled = threading.Event()
    held = Call(push, c, "worker:0", 0, g(2, 2, 2), seq=1, cancelled=cancelled.is_set)
    assert held.waits()
    cancelled.set()
    c.wake()  # what the servicer's context callback does
    held.result()
    retry = Call(push, c, "worker:0", 0, g(2, 2, 2), seq=1)
    assert retry.waits(), "a retry answered at once would make the worker compute at step 0 again"
    push(c, "worker:1", 0, g(4, 4, 4), seq=1)
    assert retry.result().next_step == 1
    assert torch.equal(w(c), -torch.tensor([3.0, 3.0, 3.0]))


# -- ssp and async -----------------------------------------------------------------------------------------

def ssp(n: int, s: int, **kwargs) -> SyncConfig:
    return SyncConfig(mode="ssp", total_num_replicas=n, max_staleness=s, **kwargs)


def test_ssp_worker_too_far_ahead_waits_for_the_slowest(coordinators):
    c = coordinators(ssp(2, 1))
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    assert push(c, "worker:0", 0, g(1, 1, 1), step_increment=1).wait_seconds < 0.1, "within the bound: no wait"
    assert c.store.step == 1, "ssp applies pushes at once"
    ahead = Call(push, c, "worker:0", 0, g(1, 1, 1), step_increment=1)
    assert ahead.waits(), "2 pushes ahead of a worker with 0 and max_staleness 1: must wait"
    assert c.store.step == 2 and version(c) == 2, "the push is applied; only the reply waits"
    assert push(c, "worker:1", 0, g(1, 1, 1), step_increment=1).step == 3
    ahead.result()
    # now 2 vs 1: one more push by worker 0 is within the bound of 1? 3 - 1 = 2 > 1: waits again
    again = Call(push, c, "worker:0", 0, g(1, 1, 1), step_increment=1)
    assert again.waits()
    push(c, "worker:1", 0, g(1, 1, 1), step_increment=1)
    again.result()
    assert c.store.step == 5 and version(c) == 5


def test_ssp_zero_staleness_is_lock_step(coordinators):
    c = coordinators(ssp(2, 0))
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    for round_ in range(3):
        fast = Call(push, c, "worker:0", 0, g(1, 1, 1), step_increment=1)
        assert fast.waits(), f"round {round_}: with s=0 a push waits for the other worker's"
        push(c, "worker:1", 0, g(1, 1, 1), step_increment=1)
        fast.result()
    assert c.store.step == 6


def test_ssp_bound_ignores_a_worker_that_left(coordinators):
    c = coordinators(ssp(2, 0))
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    ahead = Call(push, c, "worker:0", 0, g(1, 1, 1), step_increment=1)
    assert ahead.waits()
    c.leave("worker:1", 1)
    ahead.result()
    for _ in range(3):
        push(c, "worker:0", 0, g(1, 1, 1), step_increment=1)


def test_async_never_blocks(coordinators):
    c = coordinators()  # never configured: async
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    calls = [Call(push, c, "worker:0", 0, g(1, 1, 1), step_increment=1) for _ in range(5)]
    for call in calls:
        result = call.result(timeout=RELEASE_TIMEOUT)
        assert result.wait_seconds == 0.0 and not result.stale
    assert c.store.step == 5 and version(c) == 5 and c.quorum == 0
    c2 = coordinators(SyncConfig(mode="async", total_num_replicas=2))
    for i in range(4):
        assert push(c2, "worker:0", 0, g(1, 1, 1), step_increment=1).step == i + 1


# -- configuration -------------------------------------------------------------------------------------------

def test_configure_is_idempotent_and_refuses_a_change_once_workers_joined(coordinators):
    c = coordinators()
    assert c.configure(SyncConfig()) is False, "an unconfigured shard already runs the default (async)"
    config = sync(2, lease_seconds=2.0)
    assert c.configure(config) is True
    assert c.configure(sync(2, lease_seconds=2.0)) is False, "the same config again changes nothing"
    assert c.configure(sync(3)) is True, "changing before any worker joined is allowed"
    c.join("worker:0", 1)
    assert c.configure(sync(3)) is False, "same config is fine even with workers joined"
    for other in (sync(2), SyncConfig(), ssp(3, 1), sync(3, lease_seconds=2.0)):
        with pytest.raises(ModeConflictError):
            c.configure(other)
    assert c.config == sync(3)


def test_the_first_mode_of_a_job_is_taken_even_after_a_worker_joined(coordinators):
    """A job run again over a finished one's state: its variables are there, so a worker joins before the chief
    sets the mode (seen in test_launch_lifecycle: the chief then failed with ModeConflictError). The first
    mode is taken; a change after it is still refused."""
    c = coordinators()
    c.join("worker:1", 1)
    assert c.configure(sync(2)) is True
    assert c.config == sync(2)
    with pytest.raises(ModeConflictError):
        c.configure(sync(3))


@pytest.mark.parametrize("kwargs", [
    dict(mode="bogus"),
    dict(mode="sync"),                                  # no N
    dict(mode="ssp", total_num_replicas=0),
    dict(mode="sync", total_num_replicas=2, replicas_to_aggregate=-1),
    dict(mode="ssp", total_num_replicas=2, max_staleness=-1),
    dict(mode="sync", total_num_replicas=2, lease_seconds=0),
    dict(mode="sync", total_num_replicas=2, lease_seconds=-1.0),
    dict(mode="sync", total_num_replicas=2, startup_grace_seconds=-1.0),
    dict(mode="sync", total_num_replicas=2, replicas_fraction=1.5),
    dict(mode="sync", total_num_replicas=2, replicas_fraction=float("nan")),
    dict(mode="sync", total_num_replicas=2, replicas_fraction=0.5, replicas_to_aggregate=2),  # one or the other
])
def test_invalid_sync_config_is_rejected(kwargs):
    with pytest.raises(InvalidArgumentError):
        SyncConfig(**kwargs)


def test_quorum_formula():
    """quorum = max(1, min(R, live * k)), k = ceil(R / N); unjoined workers count during the startup grace.

    After the grace, a worker that joins counts from the step it starts at (shard 0's answer,
    passed to every shard), never for a step a shard is still finishing without it.
    """
    assert SyncConfig(mode="sync", total_num_replicas=2, replicas_to_aggregate=5).batches_per_worker == 3
    assert SyncConfig(mode="sync", total_num_replicas=3).aggregate == 3
    c = Coordinator(VariableStore(), owns_step=True)
    try:
        c.configure(sync(4))
        assert c.quorum == 4, "during the startup grace workers not joined yet count as live"
    finally:
        c.close()
    store = VariableStore()
    store.create([NewVariable("w", torch.zeros(3), "sgd", {"lr": 1.0})])
    c = Coordinator(store, owns_step=True)
    try:
        c.configure(sync(2, 5, startup_grace_seconds=0.0))
        assert c.quorum == 1, "nobody live, grace over: 1, never 0"
        c.join("worker:0", 1)
        assert c.quorum == 3, "a worker joining after the grace counts from the step it starts at: 1 live * k = 3"
        for batch in range(3):
            result = push(c, "worker:0", 0, g(1, 1, 1))
        assert result.next_step == 1 and c.store.step == 1
        c.join("worker:1", 1, 2)
        assert c.quorum == 3, "a worker starting at step 2 does not count for step 1"
        for batch in range(3):
            result = push(c, "worker:0", 1, g(1, 1, 1))
        assert result.next_step == 2 and c.store.step == 2
        assert c.quorum == 5, "min(R = 5, 2 live * 3)"
    finally:
        c.close()


# -- found in review: waits that must be woken, saves of a moving shard -------------------------------

def test_ssp_waiter_is_released_when_the_startup_grace_ends(coordinators):
    """An expected worker that never joins stops holding back the others once the grace is over."""
    c = coordinators(ssp(2, 0, lease_seconds=30.0, startup_grace_seconds=0.5))
    c.join("worker:0", 1)
    held = Call(push, c, "worker:0", 0, g(1, 1, 1), step_increment=1)
    assert held.waits(), "during the grace, worker 1 counts at clock 0"
    assert held.result(5.0).wait_seconds > 0, "the reaper wakes it when the grace ends, no other event needed"


def test_ssp_returning_worker_starts_level_with_the_slowest(coordinators):
    """A worker back after its lease expired does not hold the others back until it catches up."""
    clock = FakeClock()
    c = coordinators(ssp(2, 1, lease_seconds=1.0, startup_grace_seconds=0.0), clock=clock)
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    push(c, "worker:1", 0, g(1, 1, 1), step_increment=1)
    for _ in range(2):
        push(c, "worker:0", 0, g(1, 1, 1), step_increment=1)
    clock.advance(0.6)
    c.heartbeat("worker:0", 1)
    expire_leases(c, clock, 0.6, expected_expired=1)
    for _ in range(5):
        push(c, "worker:0", 0, g(1, 1, 1), step_increment=1)  # alone, unbounded
    c.join("worker:1", 2)  # back, with a new incarnation
    assert Call(push, c, "worker:0", 0, g(1, 1, 1), step_increment=1).result(RELEASE_TIMEOUT).wait_seconds < 1, \
        "worker 1 came back at the slowest live clock, not at its old one"


def test_a_save_for_a_step_the_shard_jumps_over_fails_as_past(coordinators):
    """A restored shard catching up skips steps; a save waiting for one of them says so at once."""
    state = coordinators(sync(1, lease_seconds=30.0)).snapshot_at(0, 1.0)  # a checkpoint at step 0
    c = Coordinator(VariableStore(), owns_step=True)
    try:
        c.restore(state)
        save = Call(c.snapshot_at, 3, 5.0)
        assert save.waits()
        c.join("worker:0", 1)
        push(c, "worker:0", 10, g(1, 1, 1), seq=1)  # the job is at step 10: the shard jumps 0 -> 10, applies -> 11
        assert c.store.step == 11
        with pytest.raises(StepPassedError, match="without stopping at it"):
            save.result(2.0)
    finally:
        c.close()


def test_a_restored_shard_catches_up_only_as_far_as_the_chief_vouches(coordinators):
    """Sync mode, a shard restored from the checkpoint of step 0 while the job is at step 10: a worker's step
    beyond what the chief vouched for (the checkpoint's) moves nothing and is answered UNAVAILABLE (retried by
    clients, not a wrong request); a wait for a step (a read) moves nothing; the chief's heartbeat vouches for
    step 10 and the worker's join and push then go through."""
    state = coordinators(sync(1, lease_seconds=30.0)).snapshot_at(0, 1.0)
    c = Coordinator(VariableStore(), owns_step=False)
    try:
        c.restore(state)
        with pytest.raises(ServerUnavailableError, match="not vouched"):
            c.join("worker:0", 1, 10, by=WORKER)
        with pytest.raises(ServerUnavailableError, match="not vouched"):
            push(c, "worker:0", 10, g(1, 1, 1), seq=1, by=WORKER)
        with pytest.raises(WaitTimeoutError):
            c.wait_for_step(10, 0.0)
        assert c.store.step == 0
        assert c.heartbeat("chief:0", 2, 10, by=CHIEF) == 10
        assert c.join("worker:0", 1, 10, by=WORKER) == 10
        assert not push(c, "worker:0", 10, g(1, 1, 1), seq=2, by=WORKER).stale
        assert c.wait_for_step(11, RELEASE_TIMEOUT) == 11, "the step was applied"
    finally:
        c.close()


def test_two_saves_of_the_same_step_both_get_the_snapshot(coordinators):
    c = coordinators(sync(1, lease_seconds=30.0))
    c.join("worker:0", 1)
    saves = [Call(c.snapshot_at, 1, 5.0) for _ in range(2)]
    assert saves[0].waits(2) and saves[1].waits(2)
    push(c, "worker:0", 0, g(1, 1, 1))
    assert [save.result()["step"] for save in saves] == [1, 1]


def test_sync_quick_restart_after_a_half_done_push_does_not_hang_the_lagging_shard(coordinators):
    """Worker 1 died after its step-0 push reached shard 0 but not shard 1, and restarted before its lease ran out.

    Its new incarnation starts at step 1 (shard 0's answer, passed to shard 1 by the client's join), so
    shard 1 must finish step 0 without it instead of waiting forever for a gradient nobody will send.
    """
    shard0, shard1 = coordinators(sync(2, lease_seconds=30.0)), coordinators(sync(2, lease_seconds=30.0), owns_step=False)
    for shard in (shard0, shard1):
        shard.join("worker:0", 1)
        shard.join("worker:1", 1)
    held = Call(push, shard0, "worker:0", 0, g(1, 1, 1))
    push(shard0, "worker:1", 0, g(1, 1, 1))  # ... and worker 1 is killed before its push reaches shard 1
    assert held.result().next_step == 1
    push(shard1, "worker:0", 0, g(1, 1, 1))
    start = shard0.join("worker:1", 2)  # the restarted worker: shard 0 first, then the others with its answer
    assert start == 1
    shard1.join("worker:1", 2, start)
    try:
        shard1.wait_for_step(1, timeout=2.0)
    except WaitTimeoutError as exc:
        pytest.fail(f"shard 1 waits for the dead incarnation's step-0 gradient: {exc}")


# -- exactly once, fencing, validation, locks, limits (issue #9) -----------------------------------------

@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_retry_after_lease_expiry_and_rejoin_is_still_a_duplicate(coordinators, mode):
    """Cut off longer than its lease, a worker's heartbeat gets through before its retried push: it rejoins
    with the same incarnation, and the retry (same seq) is not applied again."""
    clock = FakeClock()
    config = sync(2, lease_seconds=1.0, startup_grace_seconds=0.0) if mode == "sync" else \
        SyncConfig(lease_seconds=1.0, startup_grace_seconds=0.0)
    c = coordinators(config, clock=clock)
    c.join("worker:0", 1), c.join("worker:1", 1)
    if mode == "sync":
        held = Call(push, c, "worker:0", 0, g(2, 2, 2), seq=1)
        assert held.waits()
        push(c, "worker:1", 0, g(4, 4, 4), seq=1)
        assert held.result().next_step == 1
    else:
        push(c, "worker:0", 0, g(1, 1, 1), seq=1, step_increment=1)
    before = (w(c), c.store.step, version(c))
    clock.advance(0.5)
    c.heartbeat("worker:1", 1)
    expire_leases(c, clock, 0.7, expected_expired=1)  # worker 0's lease ran out
    c.heartbeat("worker:0", 1)  # back: rejoins with the same incarnation
    retry = push(c, "worker:0", 0, g(2, 2, 2) if mode == "sync" else g(1, 1, 1), seq=1, step_increment=1)
    assert retry.duplicate and not retry.stale
    assert torch.equal(w(c), before[0]) and (c.store.step, version(c)) == before[1:], "applied once"
    assert c.stale_dropped == 0


def test_an_old_incarnation_can_neither_push_nor_heartbeat_nor_leave_for_its_successor(coordinators):
    c = coordinators(sync(2, lease_seconds=30.0))
    c.join("worker:0", 1), c.join("worker:1", 1)
    c.join("worker:1", 2)  # worker 1 restarted
    for call in (lambda: c.heartbeat("worker:1", 1), lambda: c.leave("worker:1", 1),
                 lambda: push(c, "worker:1", 0, g(1, 1, 1), seq=9, incarnation=1)):
        with pytest.raises(WorkerReplacedError, match="replaced by a newer process"):
            call()
    assert c.live_workers() == 2 and c.quorum == 2 and c.store.step == 0 and version(c) == 0
    held = Call(push, c, "worker:0", 0, g(1, 1, 1))
    assert held.waits(), "the new incarnation still counts"
    push(c, "worker:1", 0, g(3, 3, 3), incarnation=2)
    assert held.result().next_step == 1


@pytest.mark.parametrize("bad", [
    dict(step=-1), dict(step=1 << 63), dict(step_increment=2), dict(step_increment=-1000),
    dict(step=10 ** 12, worker="made-up:1"),
])
def test_client_numbers_out_of_range_are_refused_and_change_nothing(coordinators, bad):
    c = coordinators(sync(1, lease_seconds=30.0))
    c.join("worker:0", 1)
    kwargs = {"worker": "worker:0", "step": 0, "step_increment": 1, **bad}
    with pytest.raises(InvalidArgumentError):
        c.push(kwargs["worker"], 1, 1, kwargs["step"], g(1, 1, 1), kwargs["step_increment"])
    assert (c.store.step, version(c), dict(c.pending.buffers), c.live_workers()) == (0, 0, {}, 1)
    with pytest.raises(InvalidArgumentError):
        c.wait_for_step(-1, 1.0)
    assert push(c, "worker:0", 0, g(1, 1, 1), seq=1).next_step == 1, "the real worker goes on"


def test_status_and_membership_never_wait_behind_an_apply_or_a_snapshot(coordinators):
    c = coordinators()
    entered, release = threading.Event(), threading.Event()
    apply = c.store.apply

    def slow_apply(*args, **kwargs):
        entered.set()
        assert release.wait(RELEASE_TIMEOUT)
        return apply(*args, **kwargs)

    c.store.apply = slow_apply  # an apply that takes as long as the test wants (a 40 MB Adam step, say)
    pushing = Call(push, c, "worker:0", 0, g(1, 1, 1), step_increment=1)
    assert entered.wait(RELEASE_TIMEOUT)
    quick = Call(lambda: (c.join("worker:1", 1), c.heartbeat("worker:1", 1), c.counters(), c.live_workers(),
                          c.leave("worker:1", 1)))
    quick.result(RELEASE_TIMEOUT)
    assert pushing.thread.is_alive(), "the apply was still running the whole time"
    release.set()
    assert pushing.result().step == 1
    with c.gate.snapshot():  # a checkpoint copying the state
        Call(lambda: (c.heartbeat("worker:0", 1), c.counters())).result(RELEASE_TIMEOUT)


def test_the_waiting_call_limit_refuses_a_held_push_before_counting_it(coordinators):
    store = VariableStore()
    store.create([NewVariable("w", torch.zeros(3), "sgd", {"lr": 1.0})])
    c = Coordinator(store, owns_step=True, max_waiting_calls=1)
    try:
        c.configure(sync(3, lease_seconds=30.0))
        for i in range(3):
            c.join(f"worker:{i}", 1)
        held = Call(push, c, "worker:0", 0, g(1, 1, 1), seq=1)
        assert held.waits()
        with pytest.raises(ResourceExhaustedError, match="max-waiting-calls 1"):
            push(c, "worker:1", 0, g(5, 5, 5), seq=1)
        assert c.pending.buffers[0].pushes == 1, "the refused push was not counted"
        c.leave("worker:2", 1)
        c.close()
        with pytest.raises(ServerUnavailableError, match="stopping"):
            held.result()
    finally:
        c.close()


def test_a_state_taken_while_pushes_run_holds_each_push_once_after_a_restore(coordinators):
    """Three workers push while a checkpoint's state is taken; restored into a new shard, every push sent
    again (as clients retry after a restart) is applied exactly once over the two shards' lifetimes."""
    c = coordinators()
    halfway, taken, states = threading.Event(), threading.Event(), []

    def pusher(worker: str) -> None:
        for seq in range(1, 31):
            push(c, worker, 0, g(1, 1, 1), seq=seq, step_increment=1)
            if worker == "worker:0" and seq == 15:  # the others push on while the state is taken;
                halfway.set()                       # worker:0's last 15 come after it, whatever the pace
                assert taken.wait(RELEASE_TIMEOUT)

    threads = [threading.Thread(target=pusher, args=(f"worker:{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    assert halfway.wait(RELEASE_TIMEOUT)
    states.append(c.state(with_pending=False))
    taken.set()
    for thread in threads:
        thread.join(RELEASE_TIMEOUT)
    assert torch.equal(w(c), -90 * torch.ones(3))
    restored = Coordinator(VariableStore(), owns_step=True, start=False)
    try:
        restored.restore(states[0], exact=True)
        restored.start()
        at_restore = -w(restored)[0].item()
        assert 0 < at_restore < 90 and restored.store.step == at_restore
        for i in range(3):
            for seq in range(1, 31):
                push(restored, f"worker:{i}", 0, g(1, 1, 1), seq=seq, step_increment=1)
        assert torch.equal(w(restored), -90 * torch.ones(3)), "each of the 90 pushes applied exactly once"
    finally:
        restored.close()


def test_a_shard_taken_back_after_its_job_started_runs_no_startup_grace_again(coordinators):
    """A job of N = 3 that only ever ran 2 workers: once its grace is over, a step needs their 2 gradients. A
    shard restarted from its journal (or restored) in that job must not wait for the third again for a whole
    grace; a state in which no worker had joined yet keeps its grace."""
    clock = FakeClock()
    c = coordinators(sync(3, lease_seconds=600.0, progress_seconds=600.0), clock=clock)
    started = c.state(with_pending=False)  # configured, nobody joined yet
    c.join("worker:0", 1)
    c.join("worker:1", 1)
    assert c.quorum == 3, "in the grace, the worker that has not joined counts"
    clock.advance(61.0)
    wait_until(lambda: c.wake() or c.quorum == 2, RELEASE_TIMEOUT, "the grace's end noticed by the reaper")
    for state, quorum in ((c.state(with_pending=False), 2), (started, 3)):
        restored = Coordinator(VariableStore(), owns_step=True, start=False, clock=clock)
        try:
            restored.restore(state, exact=True)
            restored.start()
            assert restored.quorum == quorum
        finally:
            restored.close()


def test_only_a_process_that_replaced_an_earlier_one_of_its_name_is_restarted_even_across_a_restore(coordinators):
    """A name joining late for the first time has trained nothing (it must skip no batch); a new incarnation
    of a known name is a restarted task, and stays one for its retries and after the shard's restore."""
    c = coordinators()
    c.join("worker:0", 1)
    for seq in range(1, 6):
        push(c, "worker:0", 0, g(1, 1, 1), seq=seq, step_increment=1)
    c.join("worker:1", 1, start_step=5)
    assert not c.restarted("worker:0") and not c.restarted("worker:1") and not c.restarted("worker:7")
    c.join("worker:0", 2)
    assert c.restarted("worker:0") and not c.restarted("worker:1")
    c.join("worker:0", 2)  # a retry of the same join
    assert c.restarted("worker:0")
    restored = Coordinator(VariableStore(), owns_step=True, start=False)
    try:
        restored.restore(c.state(with_pending=False), exact=True)
        restored.start()
        restored.join("worker:1", 3, start_step=5)
        restored.join("worker:2", 1, start_step=5)
        assert restored.restarted("worker:1") and not restored.restarted("worker:2")
    finally:
        restored.close()


def test_a_fractional_quorum_is_that_share_of_the_live_workers_rounded_up_and_never_zero():
    config = SyncConfig(mode="sync", total_num_replicas=4, replicas_fraction=0.75)
    assert [quorum_for(config, live) for live in range(7)] == [1, 1, 2, 3, 3, 4, 5]
    assert config.batches_per_worker == 1
    fixed = SyncConfig(mode="sync", total_num_replicas=4, replicas_to_aggregate=4)
    assert [quorum_for(fixed, live) for live in (2, 4, 8)] == [2, 4, 4]  # R fixed: joiners are backups
