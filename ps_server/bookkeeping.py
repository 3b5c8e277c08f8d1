"""A shard's bookkeeping: its owners composed, the decisions that span them, and the condition every wait uses.
No gRPC.

    membership.py  Membership    leases, progress, incarnations, paces
    ledger.py      PushLedger    exactly-once pushes
    aggregation.py PendingSteps  sync mode's pending sums and the quorum
    step_clock.py  StepClock     time, the mode and its grace, authority over the step

Each owner keeps its state under its own lock and answers alone (status
counters, restarted, paces, the quorum). A decision that reads or changes
several of them (a push's admission, a worker's lease and the quorum, a shard
catching up with the job's step) is made holding `cond` ("bookkeeping" in
locks.LOCK_ORDER), and so are the decisions of the push path (pushes.py), the
saves (snapshots.py) and the background threads (background.py). Every wait
waits on `cond`, a thread in it or an event loop's watcher of it (waits.py)
(the lease reaper on `reaper_wake`, over the same lock, woken only when a
deadline may have moved earlier: membership, mode, a held push released
while it sleeps past that push's progress deadline, close), and whoever changes what a wait looks at calls notify()
or cond.notify_all() holding it. Every wait ends: at its deadline (at most
step_clock.MAX_WAIT_SECONDS) with WaitTimeoutError, at close() with
ServerUnavailableError, or when its caller went away (`cancelled()`, checked
after a wake).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Callable, Mapping

from ..errors import InvalidArgumentError, ServerUnavailableError
from .aggregation import PendingSteps
from .ledger import PushLedger
from .locks import checked
from .membership import Membership
from .modes import SyncConfig, quorum_for
from .recording import Recorder
from .step_clock import CHIEF, StepClock
from .store import VariableStore
from .waits import WatchedCondition

__all__ = ["Bookkeeping"]

_LOGGER = logging.getLogger(__name__)


class Bookkeeping:
    """The owners of a shard's bookkeeping and the decisions across them (see the module docstring).

    Methods marked "holds cond" must be called holding `cond`; they never block
    (they queue journal records through `recorder`, never wait for them).
    """

    def __init__(self, store: VariableStore, recorder: Recorder, clock: Callable[[], float],
                 membership: Membership | None = None, *, owns_step: bool = True):
        lock = checked(threading.RLock(), "bookkeeping", "the bookkeeping condition")
        self.cond = WatchedCondition(lock, lambda: store.step)  # waits of threads or of an event loop
        self.reaper_wake = threading.Condition(lock)
        self.store = store
        self.recorder = recorder
        self.clock = StepClock(clock)
        self.membership = membership if membership is not None else Membership()
        self.owns_step = owns_step  # shard 0: the step it is at is the one it tells workers to push next
        self.ledger = PushLedger()
        self.pending = PendingSteps()
        self.closed = False
        self.reaper_until: float | None = None  # when the lease reaper wakes next (None: not known yet)

    # -- waking and stopping -----------------------------------------------------------------------

    def notify(self) -> None:
        """Wakes every wait, the lease reaper too, to check its condition again (holds cond)."""
        self.cond.notify_all()
        self.reaper_wake.notify()

    def close(self) -> None:
        """Ends every wait (they raise ServerUnavailableError) and the background threads. Never blocks."""
        with self.cond:
            self.closed = True
            self.cond.notify_all(every=True)
            self.reaper_wake.notify()

    def progress_renewed(self, now: float) -> None:
        """A worker's progress deadline counts again from `now` (a held push let go): wakes the lease reaper
        only if it sleeps past the earliest that deadline can be (holds cond), so a released step costs O(1)
        here per push, not a reaper pass over every member."""
        if self.reaper_until is None or self.reaper_until > now + self.clock.config.progress_seconds:
            self.reaper_wake.notify()

    def check_open(self) -> None:
        """ServerUnavailableError once close()d."""
        if self.closed:
            raise ServerUnavailableError("this shard is stopping; retry against its replacement")

    @contextlib.contextmanager
    def released(self):
        """Lets go of `cond` (held once by this thread) for the block, and takes it again after."""
        self.cond.release()
        try:
            yield
        finally:
            self.cond.acquire()

    # -- the mode and the quorum -------------------------------------------------------------------

    def set_config(self, config: SyncConfig) -> None:
        """Runs `config` from now on: its grace starts, the quorum is computed afresh (holds cond)."""
        self.clock.set_config(config)
        self.pending.set_quorum(self._compute_quorum(), counted=False)
        self.notify()

    def end_grace_if_started(self) -> None:
        """A state taken back (restore, journal replay) in which workers had joined is a job past its start:
        its startup grace does not run again, so spec workers that never joined do not count as live, and the
        quorum is the live members' (holds cond)."""
        if self.membership.joined():
            self.clock.end_grace()
            self.pending.set_quorum(self._compute_quorum(), counted=False)
            self.notify()

    def update_quorum(self, left: bool = False) -> None:
        """Recomputes the quorum; a drop is a warning unless a worker left (its job done), a rise never is
        (holds cond)."""
        quorum = self._compute_quorum()
        sync = self.clock.config.mode == "sync"
        previous = self.pending.set_quorum(quorum, counted=sync)
        if quorum != previous and sync:
            _LOGGER.log(logging.WARNING if quorum < previous and not left else logging.INFO,
                        "quorum %d -> %d (%s) at step %d",
                        previous, quorum, self.clock.config.describe_quorum(self.membership.live()), self.store.step)

    def _compute_quorum(self) -> int:
        config = self.clock.config
        step = self.store.step
        live = self.membership.counted(step)
        if self.clock.in_grace(self.clock.now()):  # workers that have not joined yet count as live
            waiting = config.total_num_replicas - self.membership.absent() - self.membership.not_yet_counted(step)
            live = max(live, waiting)
        return quorum_for(config, live)

    def min_clock(self) -> int:
        """The ssp clock of the slowest live worker; 0 while the startup grace waits for joiners (holds cond)."""
        waiting_for_joiners = (self.clock.in_grace(self.clock.now())
                               and self.membership.joined() < self.clock.config.total_num_replicas)
        return 0 if waiting_for_joiners else self.membership.min_clock()

    # -- workers -----------------------------------------------------------------------------------

    def touch(self, worker: str, incarnation: int, start_step: int, *, progress: bool) -> None:
        """Renews `worker`'s lease (and progress if it pushed); a join, rejoin or restart is journaled and
        moves the quorum (holds cond). In sync mode, on any shard but shard 0, a gone or stalled worker is
        counted again only by a call naming a step this shard has not passed (`start_step`: a push's, a
        join's, a heartbeat's): one naming an older step (a worker resumed after its lease or progress ran
        out) leaves it as it is, since shard 0, maybe a step ahead, tells it the step it pushes next, and this
        shard would wait for a push of its own open step that never comes (Membership.touch's `rejoin`).
        Shard 0 counts it from its open step, the one it tells it. WorkerReplacedError for a retired
        incarnation, PermissionDeniedError for a name past the bound: nothing changed."""
        now = self.clock.now()
        step, sync = self.pending.open_step(self.store.step), self.clock.config.mode == "sync"
        event, _ = self.membership.touch(
            worker, incarnation, now=now, step=step, start_step=start_step, progress=progress,
            rejoin=not sync or self.owns_step or start_step >= step,
            level=self.min_clock() if not sync else 0)  # sync mode moves no clocks
        if event is not None:  # a restart's retired incarnation: its "member" record forgets its pushes
            _LOGGER.info("%s %s at step %d", worker, event, self.store.step)
            self.membership_changed(worker)

    def job_members(self) -> tuple[dict[str, dict], float]:
        """(every worker as Membership.export_leases gives it, seconds until the startup grace ends): what a
        shard that a live resize adds to the job takes from ps 0 (holds cond)."""
        now = self.clock.now()
        return self.membership.export_leases(now), self.clock.grace_left(now)

    def take_job_members(self, members: Mapping[str, dict], grace_left: float) -> None:
        """A shard added to a running job: each of ps 0's workers it does not know joins here as ps 0 counts
        it, and its startup grace ends with ps 0's; journaled, the quorum recomputed (holds cond)."""
        now = self.clock.now()
        self.clock.end_grace_by(now + grace_left)
        self.membership_changed(*self.membership.adopt(members, now))

    def membership_changed(self, *workers: str, left: bool = False) -> None:
        """Journals the members that membership.py changed, each as a "member" record of its state after the
        change, made by _members as replay makes it (holds cond: a compaction reads and rotates the journal
        under it). `left`: a worker left (its job done), so a lower quorum is no warning."""
        records = [{"worker": worker, **self.membership.export_member(worker),
                    "retired": self.membership.retired_of(worker)} for worker in workers]
        self._members(records, left)
        for meta in records:
            self.recorder.log("member", meta)

    def _members(self, records: list[dict], left: bool = False) -> None:
        """The change of "member" records (holds cond): each member takes its recorded state (Membership.take;
        live, it has it already), its retired incarnations' pushes are forgotten; then the quorum is
        recomputed and every wait woken."""
        now = self.clock.now()
        for meta in records:
            worker = meta["worker"]
            self.membership.take(worker, meta, now)
            for incarnation in meta["retired"]:
                self.ledger.forget(worker, incarnation)
        self.update_quorum(left)
        self.notify()

    def replay(self, kind: str, meta: dict, tensors=None) -> None:
        """Makes one "set_step" or "member" record's change again (recovery, before the shard serves), as the
        live path makes it. Takes cond."""
        with self.cond:
            if kind == "set_step":
                self.set_step(meta)
            elif kind == "member":
                self._members([meta])
            else:
                raise ValueError(f"not a bookkeeping record: {kind}")

    def idle(self) -> bool:
        """The job has ended: workers joined and none is live, nothing pending (holds cond)."""
        return bool(self.membership.joined()) and not self.membership.live() and self.pending.is_empty()

    # -- the step ----------------------------------------------------------------------------------

    def catch_up(self, step: int, by: str, *, pushed: bool = False) -> None:
        """A shard without the job's latest state (restored from an older checkpoint) adopts a later step a
        client's write (Join, Heartbeat, Push) shows, as far as the chief vouches for (step_clock.py; a read
        never comes here); a push at its own step shows it is not behind either (holds cond)."""
        target = self.clock.catch_up_to(step, by)
        if target is None:
            return
        if target > self.store.step:
            _LOGGER.warning("this shard is at step %d and the job at step %d (%s): catching up (updates in "
                            "between are lost)", self.store.step, target,
                            "the chief's" if by == CHIEF else "a worker's, as far as the chief vouched for")
            meta = {"step": target, "clear": True}
            self.set_step(meta)
            self.recorder.log("set_step", meta)
        if pushed:
            self.clock.pushed_at(step, self.store.step)

    def set_step(self, meta: dict) -> None:
        """The change of a "set_step" record (holds cond), live and at replay: the store's step becomes
        meta["step"]; every pending sum goes with meta "clear", else those of the steps before it; the quorum
        is recomputed (it counts members from their first step) and every wait woken."""
        step = meta["step"]
        self.store.set_step(step)
        if meta.get("clear"):
            self.pending.clear()
        else:
            self.pending.drop_before(step)
        self.update_quorum()
        self.cond.notify_all()

    def check_ahead(self, step: int, what: str, worker: str = "") -> None:
        """Sync: a step more than one past the first step this shard still waits for pushes of is never
        legitimate on a shard that has its state (InvalidArgumentError); on one catching up it may be, once
        the chief vouches for it (a retryable ServerUnavailableError until then). Steps counted in full but not
        applied yet (an applier behind on a loaded machine) are passed: a worker that saw shard 0 release them
        pushes on. So is, retryably (ServerUnavailableError), `worker` whose own push for the step waited
        for is counted here: ps 0 released that step without another worker's gradients (its lease ran out
        there first), and this shard's lease reaper leaves that worker out in turn. Holds cond."""
        if self.clock.config.mode != "sync":
            return
        current = self.store.step
        if step <= self.pending.counted_through(current) + 1:
            return
        if self.clock.behind:
            raise ServerUnavailableError(
                f"this shard restored checkpoint step {self.clock.restored_step} and is at step {current}; the "
                f"chief has not vouched for {what} {step} yet (its next heartbeat does): retry")
        if worker and self.pending.pushed_awaited(current, worker):
            raise ServerUnavailableError(
                f"{what} {step} is ahead of this shard's step {current} by more than one "
                f"({self.pending.waiting_for(current)}): ps 0 went on without a worker this shard still counts "
                f"until its lease runs out here; nothing was changed: retry")
        raise InvalidArgumentError(f"{what} {step} is ahead of this shard's step {current} by more than one "
                                   f"({self.pending.waiting_for(current)}); nothing was changed")

    # -- whole states ------------------------------------------------------------------------------

    def export(self, *, with_pending: bool, then: Callable[[], object] | None = None) -> dict:
        """The bookkeeping part of a saved state (snapshots.state_of): step, mode, ledger, membership and, for
        the journal, the pending sums; `then()` runs in the same instant, its value under "then". Takes cond."""
        with self.cond:
            step = self.store.step
            state = {"step": step, "config": dataclasses.asdict(self.clock.config),
                     "ledger": self.ledger.export(step, with_pending=with_pending),
                     "membership": self.membership.export()}
            if with_pending:
                state["pending"] = self.pending.export()
            if then is not None:
                state["then"] = then()
            return state

    def restore(self, state: dict, *, exact: bool) -> None:
        """Takes the bookkeeping of a saved state back (before the shard serves); `exact`: the shard's own
        latest state, not an older checkpoint. Takes cond."""
        with self.cond:
            self.ledger.restore(state.get("ledger", []))
            self.membership.restore(state.get("membership", {}), self.clock.now())
            self.pending.restore(state.get("pending", {}))
            self.clock.restore(state["step"], exact=exact)
            self.set_config(SyncConfig(**state["config"]))

    def forget_job(self) -> None:
        """Drops what belonged to a finished job: members, the ledger, pending sums, the mode (the bound on
        membership stays). Takes cond."""
        with self.cond:
            self.membership.reset()
            self.ledger.reset()
            self.pending.reset()
            self.set_config(SyncConfig())
