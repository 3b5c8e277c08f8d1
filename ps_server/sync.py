"""How a shard combines gradients from many workers: async, sync, or bounded staleness (ssp).

Pure core (no gRPC), driven by the servicer; every wait is a condition
variable woken by the event it waits for (an applied step, a lease running
out, a worker leaving, a cancelled call), never a sleep loop.

Sync mode follows TensorFlow's SyncReplicasOptimizer, with leases added:

    step s OPEN ──(pushes tagged s reach the quorum)──> average applied once, step = s + 1
      pushes tagged < s: dropped as stale and counted
      pushes tagged > s: summed in their own buffer until s + 1 opens

    quorum = max(1, min(R, live * k)), k = ceil(R / N) batches per worker and step

With R <= N that is min(R, live): N > R gives backup workers (the fastest R
win), a dead or departed worker lowers the quorum instead of hanging the job.
With R > N each worker contributes k batches per step. A worker is live while
its lease holds (renewed by pushes and heartbeats); workers that have not
joined yet count as live during the startup grace, so slow starters are
waited for.

Shard 0 owns the global step and hands out the "tokens": its reply to a push
waits until the worker may go on (its step applied, or another batch wanted),
so a sync step costs a worker no extra round trip. Every shard aggregates its
own variables with its own quorum, as TensorFlow's per-variable accumulators
do; a worker's next pull waits (min_step) until every shard has applied the
step.

In ssp mode pushes are applied at once; on shard 0 a worker whose push count
is more than max_staleness ahead of the slowest live worker waits for it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import Counter
from typing import Callable, Mapping

import torch

from ..errors import InvalidArgumentError, ModeConflictError, WaitTimeoutError
from .store import VariableStore

__all__ = ["MODES", "SyncConfig", "PushResult", "Coordinator"]

_LOGGER = logging.getLogger(__name__)
MODES = ("async", "sync", "ssp")


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """The training mode of a job (see the module docstring). Raises InvalidArgumentError if inconsistent."""

    mode: str = "async"
    replicas_to_aggregate: int = 0  # R; 0 means total_num_replicas
    total_num_replicas: int = 0     # N
    max_staleness: int = 0          # ssp only
    lease_seconds: float = 10.0
    startup_grace_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgumentError(f"unknown mode {self.mode!r}; use one of {list(MODES)}")
        if self.mode != "async" and self.total_num_replicas < 1:
            raise InvalidArgumentError(f"mode {self.mode!r} needs total_num_replicas >= 1 (the number of workers)")
        if self.replicas_to_aggregate < 0 or self.max_staleness < 0:
            raise InvalidArgumentError("replicas_to_aggregate and max_staleness must be >= 0")
        if self.lease_seconds <= 0 or self.startup_grace_seconds < 0:
            raise InvalidArgumentError("lease_seconds must be > 0 and startup_grace_seconds >= 0")

    @property
    def aggregate(self) -> int:
        """R: gradients averaged per step."""
        return self.replicas_to_aggregate or self.total_num_replicas

    @property
    def batches_per_worker(self) -> int:
        """k = ceil(R / N): batches each worker contributes to one step."""
        return max(1, math.ceil(self.aggregate / max(1, self.total_num_replicas)))


@dataclasses.dataclass(frozen=True)
class PushResult:
    """What a push did; mirrors ps.proto's PushResponse."""

    step: int
    next_step: int
    versions: Mapping[str, int] = dataclasses.field(default_factory=dict)
    stale: bool = False
    duplicate: bool = False
    wait_seconds: float = 0.0
    quorum: int = 0


@dataclasses.dataclass
class _Member:
    incarnation: int
    last_seen: float
    counts_from: int = 0  # first step whose quorum counts this worker (a late or returning worker
                          # counts from the step it starts at, not for one this shard is finishing)
    clock: int = 0      # pushes applied (ssp)
    gone: bool = False  # left, or lease expired


@dataclasses.dataclass
class _PushRecord:
    """A worker's last push, for dedup of retries (same incarnation and seq)."""

    seq: int
    step: int
    stale: bool = False
    result: PushResult | None = None  # None while the push is still being handled


class _StepBuffer:
    """Sums of the gradients pushed for one step."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: Counter[str] = Counter()
        self.by_worker: Counter[str] = Counter()
        self.pushes = 0

    def add(self, worker: str, grads: Mapping[str, torch.Tensor]) -> None:
        for name, grad in grads.items():
            if name in self.sums:
                self.sums[name].add_(grad)
            else:
                self.sums[name] = grad.clone()
            self.counts[name] += 1
        self.by_worker[worker] += 1
        self.pushes += 1

    def averages(self) -> dict[str, torch.Tensor]:
        return {name: total.div_(self.counts[name]) for name, total in self.sums.items()}


class Coordinator:
    """Applies pushes to a VariableStore according to the shard's SyncConfig. Thread-safe.

    `owns_step` is true on shard 0: it hands out sync tokens and enforces the
    ssp bound. `clock` is injectable for tests (monotonic seconds).
    """

    def __init__(self, store: VariableStore, *, owns_step: bool, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.owns_step = owns_step
        self._now = clock
        self._cond = threading.Condition()
        self.config = SyncConfig()
        self._configured_at = clock()
        self._members: dict[str, _Member] = {}
        self._pending: dict[int, _StepBuffer] = {}
        self._last_push: dict[tuple[str, int], _PushRecord] = {}
        self._quorum = 0
        self.stale_dropped = 0
        self.quorum_changes = 0
        self.workers_expired = 0
        self._reaper: threading.Thread | None = None
        self._closed = False
        self._grace_seen_end = 0.0         # the startup grace end the reaper has acted on
        self.restored_step = -1            # the checkpoint step this shard restored, or -1
        self._behind = False               # restored: adopt the job's step from the first client that shows it
        self._saves_due: Counter[int] = Counter()  # step -> saves waiting for a snapshot taken at it
        self._snapshots: dict[int, dict] = {}       # kept until the last of those saves has it

    # -- configuration and membership -------------------------------------------------------

    def configure(self, config: SyncConfig) -> bool:
        """Sets the mode; False if it was already this config. ModeConflictError once workers joined."""
        with self._cond:
            if config == self.config:
                return False
            if self._members or self._pending:
                raise ModeConflictError(
                    f"this shard already runs {self.config} with workers joined; it cannot switch to {config}. "
                    f"Restart the job to change the mode")
            self.config = config
            self._configured_at = self._now()
            self._quorum = self._compute_quorum(self._configured_at)
            self._ensure_reaper()
            self._cond.notify_all()
        _LOGGER.info("mode set: %s", config)
        return True

    def restore(self, state: dict) -> None:
        """Starts from a checkpoint state (checkpoint.load / relayout): variables, step and mode."""
        self.store.restore(state["variables"], state["step"])
        with self._cond:
            self.restored_step = state["step"]
            self._behind = True
        self.configure(SyncConfig(**state["config"]))

    def snapshot_at(self, step: int, timeout: float | None, cancelled: Callable[[], bool] = lambda: False) -> dict:
        """The shard's state (variables, optimizer state, step, mode) taken right when its step reaches `step`.

        0 takes it now, and so does a job whose workers have all gone (nobody
        would take the shard to `step`). Blocks until then (WaitTimeoutError
        after `timeout` s); ModeConflictError if the shard is already past `step`.
        """
        with self._cond:
            current = self.store.step
            if step == 0 or step == current:
                return self._snapshot()
            if current > step:
                raise ModeConflictError(f"this shard is already at step {current}, past the requested {step}; "
                                        f"ask for a later step")
            self._saves_due[step] += 1

            def idle() -> bool:  # the job has ended: no worker will take the shard to `step`
                return self._members and not self.live_workers_locked() and not self._pending

            try:
                done = self._cond.wait_for(lambda: step in self._snapshots or self.store.step > step or idle()
                                           or cancelled() or self._closed, timeout)
                if step in self._snapshots:
                    return self._snapshots[step]
                if self.store.step > step:  # jumped over it (a restored shard catching up)
                    raise ModeConflictError(f"this shard moved from before step {step} to {self.store.step} "
                                            f"without stopping at it; ask for a later step")
                if done and idle():
                    return self._snapshot()
                raise WaitTimeoutError(f"the shard did not reach step {step} (at {self.store.step}) in time to save")
            finally:
                self._saves_due[step] -= 1
                if not self._saves_due[step]:
                    del self._saves_due[step]
                    self._snapshots.pop(step, None)

    def _snapshot(self) -> dict:
        return {"step": self.store.step, "config": dataclasses.asdict(self.config), "variables": self.store.snapshot()}

    def _after_apply(self) -> None:
        """Takes a snapshot a pending save waits for (holds self._cond, right after an apply)."""
        step = self.store.step
        if step in self._saves_due and step not in self._snapshots:
            self._snapshots[step] = self._snapshot()
        self._cond.notify_all()

    def _catch_up(self, step: int) -> None:
        """A restored shard adopts the job's step the first time a client shows a later one."""
        if self._behind and step > self.store.step:
            _LOGGER.warning("restored at step %d; the job is at step %d: catching up (updates in between are lost)",
                            self.store.step, step)
            self.store.set_step(step)
            self._pending.clear()
        self._behind = False

    def join(self, worker: str, incarnation: int, start_step: int = 0) -> int:
        """Takes or renews `worker`'s lease; returns the shard's step.

        `start_step` is the step the worker starts at, as shard 0 told it (the
        client joins shard 0 first): a worker arriving after the startup grace,
        or back after its lease expired, counts towards this shard's quorum from
        that step on, not for a step this shard is still finishing without it.
        """
        with self._cond:
            self._touch(worker, incarnation, start_step)
            return self.store.step

    def heartbeat(self, worker: str, incarnation: int, step: int = 0) -> int:
        """Renews `worker`'s lease (it is at `step`); returns the shard's step."""
        return self.join(worker, incarnation, step)

    def leave(self, worker: str) -> None:
        """`worker` is done: it stops counting towards the quorum and the staleness bound at once."""
        with self._cond:
            member = self._members.get(worker)
            if member is None or member.gone:
                return
            member.gone = True
            _LOGGER.info("%s left", worker)
            self._membership_changed()

    def live_workers(self) -> int:
        with self._cond:
            return sum(1 for m in self._members.values() if not m.gone)

    @property
    def quorum(self) -> int:
        with self._cond:
            return self._quorum

    def close(self) -> None:
        """Stops the lease reaper and wakes every waiter."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Wakes waiters so they re-check their condition (a call was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    # -- pushes and pulls ---------------------------------------------------------------------

    def push(self, worker: str, incarnation: int, seq: int, step: int, grads: Mapping[str, torch.Tensor],
             step_increment: int = 0, cancelled: Callable[[], bool] = lambda: False, *,
             hold: bool = False) -> PushResult:
        """Handles one validated-or-not push according to the mode; see the module docstring.

        Raises (changing nothing) if a gradient is invalid. Blocks on shard 0
        (on every shard with `hold`, for PushPull) in sync mode until the
        worker may go on, on shard 0 in ssp mode while it is too far ahead,
        or until `cancelled()` turns true after a wake().
        """
        self.store.validate(grads)
        key = (worker, incarnation)
        with self._cond:
            record = self._last_push.get(key) if seq else None
            if record is not None and record.seq >= seq:
                return self._duplicate(record, seq, worker, cancelled, hold)
            self._touch(worker, incarnation, step)
            mode = self.config.mode
            if seq:
                record = self._last_push[key] = _PushRecord(seq, step)
        if mode == "sync":
            result = self._push_sync(worker, step, grads, cancelled, record, hold)
        else:
            result = self._push_async(worker, step, grads, step_increment, ssp=mode == "ssp", cancelled=cancelled)
        if record is not None:
            with self._cond:
                record.result = result
                self._cond.notify_all()
        return result

    def _duplicate(self, record: "_PushRecord", seq: int, worker: str, cancelled, hold: bool) -> PushResult:
        """The reply to a retried push (holds self._cond): never applied twice, released as the original."""
        if record.seq == seq and self.config.mode == "sync" and not record.stale:
            return dataclasses.replace(self._await_release(worker, record.step, cancelled, hold), duplicate=True)
        if record.seq == seq:
            self._cond.wait_for(lambda: record.result is not None or cancelled() or self._closed)
        if record.seq != seq or record.result is None:
            current = self.store.step
            return PushResult(step=current, next_step=current, duplicate=True, quorum=self._quorum)
        return dataclasses.replace(record.result, duplicate=True, wait_seconds=0.0)

    def _push_async(self, worker: str, step: int, grads, step_increment: int, *, ssp: bool, cancelled
                    ) -> PushResult:
        waited = 0.0
        with self._cond:
            self._catch_up(step)
            _, versions = self.store.apply(grads, step_increment, validated=True)
            self._after_apply()
            member = self._members[worker]
            member.clock += 1
            if ssp and self.owns_step:
                bound = self.config.max_staleness
                start = self._now()
                self._cond.wait_for(lambda: member.clock - self._min_clock() <= bound or cancelled() or self._closed)
                waited = self._now() - start
            current = self.store.step
        return PushResult(step=current, next_step=current, versions=versions, wait_seconds=waited)

    def _push_sync(self, worker: str, step: int, grads, cancelled, record: "_PushRecord | None",
                   hold: bool) -> PushResult:
        with self._cond:
            self._catch_up(step)
            if step < self.store.step:
                self.stale_dropped += 1
                if record is not None:
                    record.stale = True
                _LOGGER.debug("dropped a stale gradient from %s (step %d < %d)", worker, step, self.store.step)
                current = self.store.step
                return PushResult(step=current, next_step=current, stale=True, quorum=self._quorum)
            self._pending.setdefault(step, _StepBuffer()).add(worker, grads)
            self._apply_ready()
            return self._await_release(worker, step, cancelled, hold)

    def _await_release(self, worker: str, step: int, cancelled, hold: bool = False) -> PushResult:
        """On shard 0 (any shard with `hold`), waits until `worker` may go on after pushing for `step`.

        Holds self._cond. The worker may go on once this shard has applied
        `step`, or while the step still wants more of its batches (R > N).
        """
        start = self._now()
        if self.owns_step or hold:
            per_worker = self.config.batches_per_worker

            def may_go_on() -> bool:
                if self.store.step > step or cancelled() or self._closed:
                    return True
                buffer = self._pending.get(step)
                return buffer is not None and buffer.by_worker[worker] < per_worker

            self._cond.wait_for(may_go_on)
        current = self.store.step
        return PushResult(step=current, next_step=max(current, step), wait_seconds=self._now() - start,
                          quorum=self._quorum)

    def wait_for_step(self, min_step: int, timeout: float | None, cancelled: Callable[[], bool] = lambda: False) -> int:
        """Blocks until the shard's step reaches `min_step`; returns it. WaitTimeoutError after `timeout` s."""
        with self._cond:
            self._catch_up(min_step)
            done = self._cond.wait_for(lambda: self.store.step >= min_step or cancelled() or self._closed, timeout)
            if not done:
                raise WaitTimeoutError(
                    f"waited {timeout:g} s for step {min_step}; the shard is at step {self.store.step} "
                    f"(quorum {self._quorum}, {self.live_workers_locked()} live workers)")
            return self.store.step

    def live_workers_locked(self) -> int:
        return sum(1 for m in self._members.values() if not m.gone)

    # -- internals (hold self._cond) -------------------------------------------------------------

    def _ensure_reaper(self) -> None:
        """Starts the lease reaper (holds self._cond): leases hold in every mode, so that async jobs
        too notice a dead worker (the chief waits for live workers before it ends the job)."""
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="lease-reaper", daemon=True)
            self._reaper.start()

    def _touch(self, worker: str, incarnation: int, start_step: int = 0) -> None:
        self._ensure_reaper()
        now = self._now()
        member = self._members.get(worker)
        in_grace = now < self._configured_at + self.config.startup_grace_seconds
        if member is None:
            counts_from = self.store.step if in_grace else max(self.store.step, start_step)
            level = self._min_clock()  # an ssp newcomer starts level with the slowest, not behind them all
            self._members[worker] = _Member(incarnation, now, clock=level, counts_from=counts_from)
            _LOGGER.info("%s joined at step %d", worker, self.store.step)
            self._membership_changed()
        elif member.gone:
            self._last_push.pop((worker, member.incarnation), None)
            member.clock = max(member.clock, self._min_clock())
            member.gone, member.incarnation, member.last_seen = False, incarnation, now
            member.counts_from = max(self.store.step, start_step)
            _LOGGER.info("%s rejoined at step %d", worker, self.store.step)
            self._membership_changed()
        elif member.incarnation != incarnation:  # a quick restart, before its lease ran out
            self._last_push.pop((worker, member.incarnation), None)
            member.incarnation, member.last_seen = incarnation, now
            # The old incarnation may have died half-way through a push, leaving this shard a step
            # behind shard 0 with a gradient that will never come: count the new one from its start.
            member.counts_from = max(self.store.step, start_step)
            _LOGGER.info("%s restarted at step %d", worker, self.store.step)
            self._membership_changed()
        else:
            member.last_seen = now

    def _compute_quorum(self, now: float) -> int:
        config = self.config
        if config.mode != "sync":
            return 0
        step = self.store.step
        active = sum(1 for m in self._members.values() if not m.gone and m.counts_from <= step)
        live = active
        if now < self._configured_at + config.startup_grace_seconds:
            gone = sum(1 for m in self._members.values() if m.gone)
            not_yet = sum(1 for m in self._members.values() if not m.gone and m.counts_from > step)
            live = max(active, config.total_num_replicas - gone - not_yet)
        return max(1, min(config.aggregate, live * config.batches_per_worker))

    def _update_quorum(self) -> None:
        quorum = self._compute_quorum(self._now())
        if quorum != self._quorum and self.config.mode == "sync":
            self.quorum_changes += 1
            _LOGGER.warning("quorum %d -> %d (%d live workers) at step %d",
                            self._quorum, quorum, self.live_workers_locked(), self.store.step)
        self._quorum = quorum

    def _membership_changed(self) -> None:
        self._update_quorum()
        self._apply_ready()
        self._cond.notify_all()

    def _apply_ready(self) -> None:
        while self.config.mode == "sync":
            step = self.store.step
            buffer = self._pending.get(step)
            if buffer is None or buffer.pushes < self._quorum:
                # Healthy shards never see a later step complete first (tokens come from shard 0
                # only after every shard has the current step's pushes); a restored shard does.
                later = [s for s, b in self._pending.items() if s > step and b.pushes >= self._quorum]
                if not later:
                    return
                _LOGGER.warning("step %d is complete while this shard waits at step %d: catching up", min(later), step)
                for old in [s for s in self._pending if s < min(later)]:
                    del self._pending[old]
                self.store.set_step(min(later))
                self._update_quorum()
                continue
            del self._pending[step]
            self.store.apply(buffer.averages(), step_increment=1, validated=True)
            self._after_apply()
            self._update_quorum()

    def _min_clock(self) -> int:
        clocks = [m.clock for m in self._members.values() if not m.gone]
        waiting_for_joiners = (self._now() < self._configured_at + self.config.startup_grace_seconds
                               and len(self._members) < self.config.total_num_replicas)
        return 0 if waiting_for_joiners or not clocks else min(clocks)

    def _reap(self) -> None:
        """Expires leases when they run out (thread body); wakes exactly at the next deadline."""
        with self._cond:
            while not self._closed:
                now = self._now()
                lease = self.config.lease_seconds
                expired = [w for w, m in self._members.items() if not m.gone and now - m.last_seen > lease]
                for worker in expired:
                    self._members[worker].gone = True
                    self.workers_expired += 1
                    _LOGGER.warning("%s sent nothing for %g s: lease expired, continuing without it", worker, lease)
                grace_end = self._configured_at + self.config.startup_grace_seconds
                grace_ended = grace_end <= now and self._grace_seen_end != grace_end
                if grace_ended:
                    self._grace_seen_end = grace_end  # unjoined workers stop counting, in every mode
                if expired or grace_ended:
                    self._membership_changed()
                deadlines = [m.last_seen + lease for m in self._members.values() if not m.gone]
                if grace_end > now:
                    deadlines.append(grace_end)
                timeout = max(0.0, min(deadlines) - now) + 0.01 if deadlines else None
                self._cond.wait(timeout)
