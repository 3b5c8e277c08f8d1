"""How a shard combines pushes from many workers: the one object the servicer drives. No gRPC.

    membership.py   leases, progress, incarnations     ledger.py      exactly-once pushes
    aggregation.py  sync mode's pending sums            gate.py        changes vs snapshots
    snapshots.py    states for checkpoints and journal  waits.py       the cap on waiting calls
    background.py   the lease reaper, the sync applier  recording.py   journal records and replay
    pushes.py       the push path (a mixin)             tables.py      embedding tables (`tables`)

Locks. `_cond` guards the bookkeeping (membership, ledger, pending steps,
counters) and is held only for that: never while a gradient is applied or
summed, a value copied, or a file written. Applies take their variables' locks
under the apply gate (shared); snapshots take the gate alone. So status,
joins, heartbeats and leaves never wait behind an apply or a save.

Sync mode (SyncReplicasOptimizer, with leases) is in modes.py and
aggregation.py: a step's average is applied by one applier thread; shard 0
holds each worker's push until its step is released (the "token"), so a sync
step costs no extra round trip; a worker's next pull waits (min_step) until
every shard has applied the step. In ssp mode shard 0 holds a push while its
worker is more than max_staleness pushes ahead of the slowest live worker.

Every wait ends: at the call's deadline (at most MAX_WAIT_SECONDS) with
WaitTimeoutError, at close() with ServerUnavailableError, or when the caller
went away (`cancelled()`, checked after wake()).

Authority over the step. A shard restored from an older checkpoint catches
up with the job's step, but only as far as the chief vouches for: the step of
the committed checkpoint it restored, then any step the chief's own calls
show (`by=CHIEF`: its Join, Heartbeat, Push, Pull). A worker's number
(`by=WORKER`) moves it up to that and no further; a read-only caller
(`by=READER`: an evaluator) moves nothing. Without roles (an insecure
shard) every caller is the chief.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable, Mapping

import torch

from ..errors import InvalidArgumentError, ModeConflictError, ServerUnavailableError, WaitTimeoutError
from ..proto import ps_pb2
from .aggregation import PendingSteps
from .dataqueue import DataQueues
from .background import apply_steps, reap
from .failstop import FailStop
from .gate import ApplyGate
from .ledger import PushLedger
from .membership import Membership, paces_of
from .modes import PushResult, SyncConfig, quorum_for
from .pushes import PushPath
from .recording import Recorder, as_received, replay
from .snapshots import Saves, state_of
from .store import NewVariable, VariableStore
from . import table_state
from .tables import TableStore, split_rows
from .waits import WaitLimit

__all__ = ["Coordinator", "MAX_WAIT_SECONDS", "MAX_STEP", "CHIEF", "WORKER", "READER"]

_LOGGER = logging.getLogger(__name__)
MAX_WAIT_SECONDS = 3600.0       # the longest any call waits when it brings no deadline
MAX_STEP = 1 << 62              # steps beyond this are nonsense, in every mode
_NEVER = lambda: False  # noqa: E731
CHIEF, WORKER, READER = "chief", "worker", "reader"  # who shows a step (see "Authority over the step")


class Coordinator(PushPath):
    """Applies pushes to a VariableStore according to the shard's SyncConfig. Thread-safe.

    `owns_step` is true on shard 0: it hands out sync tokens and enforces the
    ssp bound. `clock` is injectable for tests (monotonic seconds). `journal`
    (journal.Journal or None) records every change before it is acknowledged.
    With start=False its threads wait for start() or attach_journal(), so a
    recovering shard can restore() and replay() first. Its threads (the
    lease reaper, the sync applier) run under `failstop`: an exception in
    one ends the process (failstop.FailStop; a default one if not given).
    `membership` bounds who may join (membership.Membership; unbounded if
    not given).
    """

    def __init__(self, store: VariableStore, *, owns_step: bool, clock: Callable[[], float] = time.monotonic,
                 max_waiting_calls: int = 96, journal=None, start: bool = True, failstop: FailStop | None = None,
                 membership: Membership | None = None):
        self.store = store
        self.tables = TableStore()  # embedding tables: created here, read by the servicer, updated by pushes
        self.queues = DataQueues()  # data queues (dynamic sharding; ps 0's): served by queue_desk.py
        self.owns_step = owns_step
        self.recorder: Recorder | None = None
        self.waits = WaitLimit(max_waiting_calls)
        self.gate = ApplyGate()
        self._now = clock
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # The lease reaper waits on its own condition over the same lock, woken only when a deadline may
        # have moved earlier (membership, mode, a held push released, close), not by every notify of _cond.
        self._reaper_wake = threading.Condition(lock)
        self.config = SyncConfig()
        self._configured_at = clock()
        self.membership = membership or Membership()
        self.ledger = PushLedger()
        self.pending = PendingSteps()
        self.saves = Saves(self)
        self._quorum = 0
        self.stale_dropped = 0
        self.quorum_changes = 0
        self.duplicates = 0
        self.restored_step = -1       # the checkpoint step this shard restored, or -1
        self._behind = False          # restored from an older checkpoint: catch up with the job's step
        self._vouched = -1            # the highest step the chief vouched for since (the checkpoint's first)
        self._closed = False
        self._grace_seen_end = 0.0    # the startup grace end the reaper has acted on
        self._ordered: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._pushing = threading.local()  # .rows: the row gradients of the push this thread makes (journal)
        self._started = False         # threads run; before that, restore() and replay() rebuild the state
        self.failstop = failstop or FailStop()
        self._reaper = self.failstop.thread(reap, self, name="lease-reaper")
        self._applier: threading.Thread | None = None
        if journal is not None:
            self.attach_journal(journal)
        elif start:
            self.start()

    def start(self) -> None:
        """Starts the lease reaper and (sync mode) the applier: the shard serves from now on."""
        with self._cond:
            if not self._started:
                self._started = True
                self._reaper.start()
                self._start_applier()

    def attach_journal(self, journal) -> None:
        """Records every change from now on in `journal` (after replay()), then start()s."""
        self.recorder = Recorder(self, journal)
        # With a journal, every change to variables (creations, applies, steps, hyperparameters) is made and
        # queued for the journal under this lock, so the journal replays them in the order they happened. It
        # is never held while a record is written (recording.py).
        self._ordered = threading.Lock()
        self.start()

    # -- state changes that are not pushes -----------------------------------------------------

    def configure(self, config: SyncConfig) -> bool:
        """Sets the mode; False if it was already this config. ModeConflictError once workers joined."""
        with self.gate.change(), self._cond:
            if config == self.config:
                return False
            if self.membership.members or self.pending.buffers:
                journal = "" if self.recorder is None else (
                    f" (as its journal {self.recorder.directory} recorded: a job on the same volume must finish, "
                    f"or start anew with --restore-from CHECKPOINT_DIR --replace-journal)")
                raise ModeConflictError(
                    f"this shard already runs {self.config} with workers joined{journal}; it cannot switch to "
                    f"{config}. Restart the job to change the mode")
            self._set_config(config)
            ticket = self._log("configure", {"config": dataclasses.asdict(config)})
        self._durable(ticket)
        _LOGGER.info("mode set: %s", config)
        return True

    def _set_config(self, config: SyncConfig) -> None:
        self.config = config
        self._configured_at = self._now()
        self._quorum = self._compute_quorum()
        if self._started:
            self._start_applier()
        self._cond.notify_all()
        self._reaper_wake.notify()

    def _start_applier(self) -> None:
        if self.config.mode == "sync" and self._applier is None:
            self._applier = self.failstop.thread(apply_steps, self, name="sync-applier")
            self._applier.start()

    def create(self, requests: list[NewVariable], *, job_step: int = 0) -> list[bool]:
        """store.create, recorded in the journal. `job_step`: a refill of a shard that restarted without its
        state; if it holds no variables yet it takes that step (the job's) as its own."""
        self._check_step(job_step, "step")
        self.tables.check_free(r.name for r in requests)
        with self.gate.change(), self._ordered:  # recorded before any push to the new variables can be
            with self._cond:
                if job_step > self.store.step and not self.store.names():
                    _LOGGER.warning("refilled while the job is at step %d: this shard starts there", job_step)
                    self.store.set_step(job_step)
                    self._log("set_step", {"step": job_step, "clear": True})
            created = self.store.create(requests)
            # the values are the variables' own (pushes change them): the record gets a copy, written later
            ticket = self._log("create", {"variables": [{"name": r.name, "optimizer": r.optimizer,
                                                         "hyperparams": dict(r.hyperparams)}
                                                        for r, new in zip(requests, created) if new]},
                               {r.name: r.value.clone() for r, new in zip(requests, created) if new}
                               if self.recorder is not None else None)
        self._durable(ticket)
        return created

    def create_tables(self, specs: list[ps_pb2.TableSpec], shard_index: int, num_shards: int, *,
                      check_memory: Callable[[dict[str, int]], None] | None = None) -> list[bool]:
        """tables.create (which see), in every mode, recorded in the journal (before any push to the new tables
        can be). Never blocks on training (with a journal, on one apply's record at most)."""
        with self.gate.change(), self._ordered:
            created = self.tables.create(specs, shard_index, num_shards, taken=self.store.names(),
                                         check_memory=check_memory)
            ticket = self._log("tables", table_state.creation_record(
                [s for s, new in zip(specs, created) if new], shard_index, num_shards)) if any(created) else None
        self._durable(ticket)
        return created

    def lookup_rows(self, requests: list[tuple[str, torch.Tensor]], *, admit: bool) -> list[torch.Tensor]:
        """tables.lookup (which see). With a journal, an admitting lookup of dynamic tables (which may count
        ids and create rows) is made and recorded under the apply gate and the ordering lock, so replaying
        the journal admits in the same order with the applies; it then waits for an apply in progress.
        Raises (changing and recording nothing) what tables.lookup raises."""
        if not admit or self.recorder is None or all(self.tables.get(name).table.fixed for name, _ in requests):
            return self.tables.lookup(requests, admit=admit)
        with self.gate.change(), self._ordered:
            found = self.tables.lookup(requests, admit=True)
            dynamic = [(name, ids) for name, ids in requests if not self.tables.get(name).table.fixed]
            ticket = self._log("admit", {"tables": [name for name, _ in dynamic]}, dict(dynamic))
        self._durable(ticket)
        return found

    def set_hyperparams(self, names: list[str], updates: Mapping[str, float]) -> int:
        """store.set_hyperparams, recorded in the journal."""
        with self.gate.change(), self._ordered:  # in the order the applies around it see it
            count = self.store.set_hyperparams(names, updates)
            ticket = self._log("hyperparams", {"names": names, "updates": dict(updates)})
        self._durable(ticket)
        return count

    def forget_job(self) -> None:
        """Before start(): keeps the variables, tables and step, and drops what belonged to a finished job (its
        members, its pushes' ledger, pending sums, its mode), so a new job starts from this state. The bound on
        membership (the cluster spec's names, --elastic-workers) is this shard's, not the job's: it stays."""
        with self._cond:
            self.membership = Membership(self.membership.known, self.membership.elastic)
            self.ledger = PushLedger()
            self.pending = PendingSteps()
            self.queues.clear()
            self._set_config(SyncConfig())

    def restore(self, state: dict, *, exact: bool = False) -> None:
        """Starts from a saved state (snapshots.state_of), before start(). `exact`: it is this shard's own
        latest state (journal), not an older checkpoint, so the shard need not catch up with the job."""
        self.store.restore(state["variables"], state["step"])
        table_state.restore(self.tables, state.get("tables") or [], state.get("source", "the journal's base"))
        with self._cond:
            self.ledger.restore(state.get("ledger", []))
            self.membership.restore(state.get("membership", {}), self._now())
            self.pending.restore(state.get("pending", {}))
            self.queues.restore(state.get("queues"))
            self.restored_step = state["step"]
            self._behind = not exact
            self._vouched = state["step"]  # a committed checkpoint: the chief committed it
            self._set_config(SyncConfig(**state["config"]))

    # -- membership ---------------------------------------------------------------------------

    def join(self, worker: str, incarnation: int, start_step: int = 0, *, by: str = CHIEF) -> int:
        """Takes or renews `worker`'s lease; returns the shard's step. Never blocks on training.

        `start_step` is the step the worker starts at, as shard 0 told it (the
        client joins shard 0 first): a worker arriving after the startup grace,
        or back after its lease expired, counts towards this shard's quorum from
        that step on. WorkerReplacedError if a newer incarnation took over.
        `by`: who makes the call (see "Authority over the step").
        """
        self._check_step(start_step, "join step")
        with self._cond:
            self._check_open()
            self._catch_up(start_step, by)
            self._check_ahead(start_step, "join step")
            self._touch(worker, incarnation, start_step, progress=False)
            return self.store.step

    heartbeat = join  # a heartbeat renews the lease exactly as a join does

    def restarted(self, worker: str) -> bool:
        """Whether `worker`'s current process replaced an earlier one of its name (known here, or restored
        from a checkpoint or the journal): a restarted task, whose earlier incarnation's batches are done.
        False for a name first seen now, or unknown. Never blocks on training."""
        with self._cond:
            return self.membership.restarted(worker)

    def leave(self, worker: str, incarnation: int) -> None:
        """`worker` is done: it stops counting towards the quorum and the staleness bound at once.

        WorkerReplacedError if `incarnation` was replaced (a dying old process
        cannot evict its successor); a no-op for an unknown worker.
        """
        with self._cond:
            if self.membership.leave(worker, incarnation):
                _LOGGER.info("%s left", worker)
                self._membership_changed(worker, left=True)

    def live_workers(self) -> int:
        with self._cond:
            return self.membership.live()

    @property
    def quorum(self) -> int:
        with self._cond:
            return self._quorum

    def counters(self) -> dict[str, int]:
        """Status counters, read under the bookkeeping lock only."""
        with self._cond:
            return {"live_workers": self.membership.live(), "quorum": self._quorum,
                    "stale_dropped": self.stale_dropped, "quorum_changes": self.quorum_changes,
                    "workers_expired": self.membership.expired, "workers_stalled": self.membership.stalls,
                    "duplicates": self.duplicates, "waiting_calls": self.waits.waiting()}

    def paces(self) -> dict[str, tuple[float, float]]:
        """{worker: (push interval seconds, straggler score)}: see membership.paces_of (computed after the
        bookkeeping lock is let go: the lock is held only to copy the intervals)."""
        with self._cond:
            intervals = self.membership.intervals()
        return paces_of(intervals)

    def close(self) -> None:
        """Ends every wait (ServerUnavailableError), stops the reaper and the applier, and lets a journal
        compaction in progress finish."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._reaper_wake.notify()
        self.store.close()  # waits for variables end too
        self.tables.close()
        self.wait_for_compaction(MAX_WAIT_SECONDS)

    def wake(self) -> None:
        """Wakes waiters, the lease reaper too, so they re-check their condition (a call was cancelled)."""
        with self._cond:
            self._cond.notify_all()
            self._reaper_wake.notify()

    # -- pushes and pulls ---------------------------------------------------------------------

    def push(self, worker: str, incarnation: int, seq: int, step: int, grads: Mapping[str, torch.Tensor],
             step_increment: int = 0, cancelled: Callable[[], bool] = _NEVER, *, hold: bool = False,
             timeout: float | None = None, by: str = CHIEF,
             received: Mapping[str, tuple] | None = None) -> PushResult:
        """Handles one push according to the mode, at most once per (worker, incarnation, seq).

        `grads` maps variables to dense gradients and tables to their
        tables.RowGradient (a ROWS tensor), applied together (async, ssp) or,
        in sync mode, summed together into the step's pending sums and
        averaged when the step applies (pushes.py). Raises (changing
        nothing) for invalid gradients or numbers, or a replaced incarnation.
        Blocks on shard 0 (on every shard with `hold`, for PushPull, or with
        row gradients) in sync mode until the worker may go on, on shard 0 in
        ssp mode while it is too far ahead; a retry waits for its original.
        `by`: who makes the call (see "Authority over the step").
        With a journal, it returns once the push's record is written (a retry's:
        every record before it); if the journal fails first it raises
        ServerUnavailableError, unacknowledged (the shard then stops).
        `received` {name: (TensorMeta, bytes)}: the compressed gradients as
        they came, which the journal records instead of their decoded form.
        """
        self._check_step(step, "push step")
        if step_increment not in (0, 1):
            raise InvalidArgumentError(f"step_increment must be 0 or 1. Received: {step_increment}")
        grads, table_rows = split_rows(grads)
        self.store.validate(grads)
        self.tables.validate(table_rows)
        deadline = self._deadline(timeout)
        slot: list[str] = []  # the waiting slot this push took, if it will be held
        self._pushing.rows = table_rows  # the journal's record of this push carries them (_log)
        self._pushing.received = received
        try:
            return self._push(worker, incarnation, seq, step, grads, table_rows, step_increment, cancelled, hold,
                              deadline, slot, by)
        finally:
            self._pushing.rows = self._pushing.received = None
            if slot:
                self.waits.release(slot[0])

    def wait_for_step(self, min_step: int, timeout: float | None, cancelled: Callable[[], bool] = _NEVER, *,
                      by: str = CHIEF) -> int:
        """Blocks until the shard's step reaches `min_step`; returns it. WaitTimeoutError after `timeout` s.
        `by`: who makes the call (see "Authority over the step")."""
        self._check_step(min_step, "min_step")
        deadline = self._deadline(timeout)
        with self._cond:
            self._check_open()
            self._catch_up(min_step, by)
            if self.store.step < min_step:
                with self.waits.slot("pull"):
                    self._cond.wait_for(lambda: self.store.step >= min_step or cancelled() or self._closed,
                                        self._left(deadline))
            self._check_open()
            if self.store.step < min_step and not cancelled():
                raise WaitTimeoutError(
                    f"waited for step {min_step}; the shard is at step {self.store.step} "
                    f"(quorum {self._quorum}, {self.membership.live()} live workers)")
            return self.store.step

    def snapshot_at(self, step: int, timeout: float | None, cancelled: Callable[[], bool] = _NEVER, *,
                    now: bool = False) -> dict:
        """The shard's state for a checkpoint of step `step`; see snapshots.Saves.snapshot_at."""
        return self.saves.snapshot_at(step, self._deadline(timeout), cancelled, now=now)

    def state(self, *, with_pending: bool) -> dict:
        """The whole state now (takes the apply gate alone while it copies)."""
        with self.gate.snapshot():
            return state_of(self, with_pending=with_pending)

    # -- internals ------------------------------------------------------------------------------

    def _deadline(self, timeout: float | None) -> float:
        return self._now() + min(MAX_WAIT_SECONDS, MAX_WAIT_SECONDS if timeout is None else timeout)

    def _left(self, deadline: float) -> float:
        return max(0.0, deadline - self._now())

    def _check_open(self) -> None:
        if self._closed:
            raise ServerUnavailableError("this shard is stopping; retry against its replacement")

    @staticmethod
    def _check_step(step: int, what: str) -> None:
        if not 0 <= step <= MAX_STEP:
            raise InvalidArgumentError(f"{what} must be in [0, {MAX_STEP}]. Received: {step}")

    def _check_ahead(self, step: int, what: str) -> None:
        """Sync: a step more than one past the open step is never legitimate on a shard that has its state
        (InvalidArgumentError); on one catching up it may be, once the chief vouches for it (a retryable
        ServerUnavailableError until then)."""
        limit = self.pending.open_step(self.store.step) + 1
        if self.config.mode == "sync" and step > limit and self._behind:
            raise ServerUnavailableError(
                f"this shard restored checkpoint step {self.restored_step} and is at step {self.store.step}; the "
                f"chief has not vouched for {what} {step} yet (its next heartbeat does): retry")
        if self.config.mode == "sync" and step > limit:
            raise InvalidArgumentError(
                f"{what} {step} is ahead of this shard's step {self.store.step} by more than one; "
                f"nothing was changed")

    @staticmethod
    def _push_meta(worker: str, incarnation: int, seq: int, step: int) -> dict:
        return {"worker": worker, "incarnation": incarnation, "seq": seq, "step": step}

    def _log(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor] | None = None) -> int | None:
        """Queues a journal record, if the shard keeps a journal (see recording.py for the locking rules);
        returns its ticket for _durable(). A push's record ("apply", "add") carries the push's row gradients
        too (table_state.record_rows), so the push is replayed whole, and its compressed gradients as they
        came (recording.as_received)."""
        if self.recorder is None:
            return None
        if kind in ("apply", "add"):
            if getattr(self._pushing, "rows", None):
                meta, tensors = table_state.record_rows(meta, tensors or {}, self._pushing.rows)
            if getattr(self._pushing, "received", None):
                meta, tensors = as_received(meta, tensors or {}, self._pushing.received)
        return self.recorder.log(kind, meta, tensors or {})

    def _durable(self, ticket: int | None, deadline: float | None = None) -> None:
        """Waits (holding no lock) until the journal record `ticket` is written; None: nothing to wait for.
        ServerUnavailableError if the journal failed first, WaitTimeoutError at `deadline`."""
        if ticket is not None:
            self.recorder.wait(ticket, None if deadline is None else self._left(deadline))

    def _durable_all(self, deadline: float) -> None:
        """Waits (holding no lock) until every journal record queued so far is written (a retry's reply)."""
        if self.recorder is not None:
            self.recorder.wait(None, self._left(deadline))

    def finish(self, reason: str) -> None:
        """The job is done (the chief's Shutdown): the journal records it, so a shard started on this volume
        again begins a new job from this state (server.recover) instead of resuming this one."""
        self._durable(self._log("finish", {"reason": reason}))

    def wait_for_compaction(self, timeout: float | None = None) -> None:
        """Returns once no journal compaction is running (at most `timeout` s)."""
        if self.recorder is not None:
            self.recorder.wait_for_compaction(timeout)

    def replay(self, record) -> bool:
        """Re-applies one journal record (journal.Record) during recovery, before start(); True for the record
        of the job's end (finish)."""
        return replay(self, record)


    def _catch_up(self, step: int, by: str, *, pushed: bool = False) -> None:
        """A shard without the job's latest state (restored from an older checkpoint) adopts a later step a
        client shows, as far as the chief vouches for (see "Authority over the step"); a push at its own
        step shows it is not behind either. Holds _cond."""
        if not self._behind or by == READER:
            return
        if by == CHIEF:
            self._vouched = max(self._vouched, step)
        target = min(step, self._vouched)
        if target > self.store.step:
            _LOGGER.warning("this shard is at step %d and the job at step %d (%s): catching up (updates in "
                            "between are lost)", self.store.step, target,
                            "the chief's" if by == CHIEF else "a worker's, as far as the chief vouched for")
            self.store.set_step(target)
            self.pending.clear()
            self._log("set_step", {"step": target, "clear": True})
            self._cond.notify_all()
        if pushed and step == self.store.step:
            self._behind = False

    def _touch(self, worker: str, incarnation: int, start_step: int, *, progress: bool) -> None:
        now = self._now()
        event, retired = self.membership.touch(
            worker, incarnation, now=now, step=self.pending.open_step(self.store.step), start_step=start_step,
            in_grace=self._in_grace(now), level=self._min_clock(), progress=progress)
        if retired is not None:
            self.ledger.forget(worker, retired)
        if event is not None:
            _LOGGER.info("%s %s at step %d", worker, event, self.store.step)
            self._membership_changed(worker)

    def _in_grace(self, now: float) -> bool:
        return now < self._configured_at + self.config.startup_grace_seconds

    def _compute_quorum(self) -> int:
        step = self.store.step
        live = self.membership.counted(step)
        if self._in_grace(self._now()):  # workers that have not joined yet count as live
            waiting = self.config.total_num_replicas - self.membership.absent() - self.membership.not_yet_counted(step)
            live = max(live, waiting)
        return quorum_for(self.config, live)

    def _update_quorum(self, left: bool = False) -> None:
        """Recomputes the quorum; a drop is a warning unless a worker left (its job done), a rise never is."""
        quorum = self._compute_quorum()
        if quorum != self._quorum and self.config.mode == "sync":
            self.quorum_changes += 1
            _LOGGER.log(logging.WARNING if quorum < self._quorum and not left else logging.INFO,
                        "quorum %d -> %d (%d live workers) at step %d",
                        self._quorum, quorum, self.membership.live(), self.store.step)
        self._quorum = quorum

    def _membership_changed(self, *workers: str, left: bool = False) -> None:
        """Recomputes the quorum; journals the members that changed (holds _cond: bookkeeping only, which a
        compaction reads and rotates under this same lock)."""
        for worker in workers:
            self._log("member", {"worker": worker, **self.membership.export_member(worker),
                                 "retired": list(self.membership.retired.get(worker, ()))})
        self._update_quorum(left)
        self._cond.notify_all()
        self._reaper_wake.notify()

    def _min_clock(self) -> int:
        waiting_for_joiners = (self._in_grace(self._now())
                               and len(self.membership.members) < self.config.total_num_replicas)
        return 0 if waiting_for_joiners else self.membership.min_clock()
