"""How a shard combines pushes from many workers: the one object the servicer drives. No gRPC.

The Coordinator is a composition; each piece of state has one owner with its
own lock, and the order in which locks are taken is written once, in locks.py:

    membership.py   leases, progress, incarnations     ledger.py      exactly-once pushes
    aggregation.py  sync mode's pending sums, quorum    step_clock.py  time, mode, authority over the step
    recording.py    the journal: records, compactions   bookkeeping.py the decisions across those owners
    pushes.py       the push path                       snapshots.py   whole states, checkpoints
    background.py   the lease reaper, the sync applier  replay.py      a journal replayed at recovery
    gate.py         changes vs snapshots                waits.py       the cap on waiting calls
    store.py        variables (`store`)                 tables.py      embedding tables (`tables`)
    layout.py       the layout epoch (live resize)      moves.py       variables handed over live (`moves`)

Sync mode (SyncReplicasOptimizer, with leases) is in modes.py and
aggregation.py: a step's average is applied by one applier thread; shard 0
holds each worker's push until its step is released (the "token"), so a sync
step costs no extra round trip; a worker's next pull waits (min_step) until
every shard has applied the step. In ssp mode shard 0 holds a push while its
worker is more than max_staleness pushes ahead of the slowest live worker.

Every wait ends: at the call's deadline (at most MAX_WAIT_SECONDS) with
WaitTimeoutError, at close() with ServerUnavailableError, or when the caller
went away (`cancelled()`, checked after wake()). Who may move the step of a
shard restored from an older checkpoint (`by`: CHIEF, WORKER) is
step_clock.py's "Authority over the step".
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Callable, Mapping

import torch

from ..cluster import arbiter_of
from ..errors import InvalidArgumentError, LeaseHeldError, ModeConflictError, PSError, WaitTimeoutError
from ..proto import ps_pb2
from . import table_state
from .dataqueue import DataQueues
from .deposals import ACTIONS as DEPOSAL_ACTIONS, TIE_BREAKER, Deposals
from .own_promotions import OwnPromotions
from .queue_desk import QueueDesk
from .background import apply_steps, reap, replay_step
from .bookkeeping import Bookkeeping
from .failstop import FailStop
from .gate import ApplyGate
from .layout import ShardLayout
from .membership import Membership, paces_of
from .modes import PushResult, SyncConfig
from .entries import decode_entries
from .moves import Moves
from .replicas import ReplicaRegistry
from .resizes import ResizeOwner
from .pushes import PushPath
from .recording import Recorder
from .replay import changes, replay
from .snapshots import Saves, state_of
from .step_clock import CHIEF, MAX_WAIT_SECONDS, WORKER
from .store import NewVariable, VariableStore
from .ssd_tables import TableStorage
from .tables import TableStore, split_rows
from .waits import Wait, Waiting, WaitLimit, run_blocking

__all__ = ["Coordinator", "MAX_WAIT_SECONDS", "MAX_STEP", "CHIEF", "WORKER"]

_LOGGER = logging.getLogger(__name__)
MAX_STEP = 1 << 62              # steps beyond this are nonsense, in every mode
_NEVER = lambda: False  # noqa: E731


class Coordinator:
    """Applies pushes to a VariableStore according to the shard's SyncConfig. Thread-safe.

    `owns_step` is true on shard 0: it hands out sync tokens and enforces the
    ssp bound. `clock` is injectable for tests (monotonic seconds). `journal`
    (journal.Journal or None) records every change before it is acknowledged.
    With start=False its threads wait for start() or attach_journal(), so a
    recovering shard can restore() and replay() first. Its threads (the
    lease reaper, the sync applier) run under `failstop`: an exception in
    one ends the process (failstop.FailStop; a default one if not given).
    `membership` bounds who may join (membership.Membership; unbounded if
    not given). At most `max_waiting_calls` calls wait at once, of them at
    most `threaded_waits` (None: no separate bound) of the kinds that block
    a thread (waits.WaitLimit).

    The owners are attributes, for status and tests: `membership`, `ledger`,
    `pending` (aggregation.PendingSteps), `recorder`, `gate`, `waits`,
    `store`, `tables`.
    """

    def __init__(self, store: VariableStore, *, owns_step: bool, clock: Callable[[], float] = time.monotonic,
                 max_waiting_calls: int = 96, threaded_waits: int | None = None, journal=None, start: bool = True,
                 failstop: FailStop | None = None, membership: Membership | None = None, index: int = 0,
                 addresses: list[str] | tuple[str, ...] = (), failover_after: float = 0.0,
                 table_storage: TableStorage | None = None):
        self.store = store
        self.tables = TableStore(table_storage)  # embedding tables: created here, read by the servicer, updated by pushes
        self.queues = DataQueues()  # data queues (dynamic sharding; ps 0's): served by queue_desk.py
        self.owns_step = owns_step
        self.waits = WaitLimit(max_waiting_calls, threaded_waits)
        self.gate = ApplyGate()
        self.layout = ShardLayout(index, addresses)  # the layout epoch and what left this shard (live resize)
        self.resizes = ResizeOwner() if owns_step else None  # the job's live resize: ps 0 owns it (resizes.py)
        # Who serves each replicated shard (replicas.py): ps 0 records the others, ps 1 records ps 0, each of the
        # shards its layout epoch has (the cluster spec's before any live resize); a backup is promoted only once
        # its primary renewed no lease for failover_after s.
        self.replicas = ReplicaRegistry(lambda: self.layout.layout()[1], lease_seconds=failover_after, clock=clock) \
            if index <= 1 else None
        # ps 2's record of the deposed primaries of ps 0 and ps 1, each the other's arbiter (deposals.py), and
        # their promotions of each other's backups through it (own_promotions.py)
        self.deposals = Deposals() if index == TIE_BREAKER else None
        self.own_promotions = OwnPromotions(index, self.replicas, self._log_ask) if self.replicas is not None \
            else None
        self._index, self._spec_shards = index, len(addresses)
        self.recorder = Recorder(self.gate, lambda then: state_of(book, store, self.tables, self.queues,
                                                                  with_pending=True, then=then,
                                                                  layout=self.layout, resize=self.resizes,
                                                                  replicas=self.replicas, deposals=self.deposals,
                                                                  asks=self.own_promotions))
        self._book = book = Bookkeeping(store, self.recorder, clock, membership, owns_step=owns_step)
        self.membership, self.ledger, self.pending = book.membership, book.ledger, book.pending
        self.saves = Saves(book, self.gate, self.waits, self._checkpoint_state)
        self.moves = Moves(book, store, self.tables, self.gate, self.recorder, self.layout, owns_step=owns_step,
                           owner=self.resizes, replicas=self.replicas)
        self.recorder.refuse_follower = self.moves.refuse_backup
        self._pushes = PushPath(book, self.tables, self.gate, self.waits, self.recorder, self.layout,
                                owns_step=owns_step)
        # Where workers take data shards (dynamic sharding): served by the shard that owns the step, ps 0.
        self.queue_desk = QueueDesk(book, self.queues, self.recorder, self.waits, home=owns_step)
        self._changes = changes(coordinator=self._replay, pushes=self._pushes.replay, book=book.replay,
                                step=functools.partial(replay_step, book, self.gate, self.tables),
                                queues=self.queue_desk.replay, moves=self.moves.replay,
                                replicas=self._replay_replica,
                                deposals=self._replay_deposal, asks=self._replay_ask)  # what replay() runs
        self._started = False         # threads run; before that, restore() and replay() rebuild the state
        self.failstop = failstop or FailStop()
        self._reaper = self.failstop.thread(reap, book, name="lease-reaper")
        self._hold_leases = self.failstop.thread(self.moves.run_hold_lease, name="hold-lease")
        self._lease_clock = self.failstop.thread(self.replicas.run_clock, name="lease-clock") \
            if self.replicas is not None and failover_after > 0 else None
        self._take_backs = self.failstop.thread(self.own_promotions.run_take_backs, name="take-backs") \
            if self.own_promotions is not None else None
        self._applier: threading.Thread | None = None
        if journal is not None:
            self.attach_journal(journal)
        elif start:
            self.start()

    def start(self) -> None:
        """Starts the lease reaper and (sync mode) the applier: the shard serves from now on."""
        with self._book.cond:
            if not self._started:
                self._started = True
                self._book.end_grace_if_started()
                self._reaper.start()
                self._hold_leases.start()
                if self._lease_clock is not None:
                    self._lease_clock.start()
                if self._take_backs is not None:
                    self._take_backs.start()
                self._start_applier()

    def attach_journal(self, journal) -> None:
        """Records every change from now on in `journal` (after replay()), then start()s."""
        self.moves.folders.journal = journal  # a live re-layout's table rows are kept beside it
        self.recorder.attach(journal)
        self.start()

    # -- what the status shows -----------------------------------------------------------------------

    @property
    def config(self) -> SyncConfig:
        return self._book.clock.config

    @property
    def restored_step(self) -> int:
        """The checkpoint step this shard restored, or -1."""
        return self._book.clock.restored_step

    @property
    def quorum(self) -> int:
        return self.pending.quorum

    @property
    def stale_dropped(self) -> int:
        return self.pending.stale_dropped

    @property
    def quorum_changes(self) -> int:
        return self.pending.quorum_changes

    def live_workers(self) -> int:
        return self.membership.live()

    def counters(self) -> dict[str, int]:
        """Status counters, each read from its owner alone: never waits for the bookkeeping."""
        membership, pending = self.membership, self.pending
        return {"live_workers": membership.live(), "quorum": pending.quorum,
                "stale_dropped": pending.stale_dropped, "quorum_changes": pending.quorum_changes,
                "workers_expired": membership.expired, "workers_stalled": membership.stalls,
                "duplicates": self.ledger.duplicates, "waiting_calls": self.waits.waiting()}

    def never_joined(self, names: list[str]) -> list[str]:
        """Those of `names` that never joined this job here (the membership's alone: never waits)."""
        return self.membership.never_joined(names)

    def standing(self, names: list[str]) -> list[tuple[str, str, int, int, int]]:
        """Membership.standing of `names` (the membership's alone: never waits)."""
        return self.membership.standing(names)

    def awaited(self) -> tuple[int, int, list[str]]:
        """Sync: PendingSteps.awaited at the shard's step (the pending steps' alone: never waits); else
        (0, 0, [])."""
        if self.config.mode != "sync":
            return 0, 0, []
        return self.pending.awaited(self.store.step)

    def paces(self) -> dict[str, tuple[float, float]]:
        """{worker: (push interval seconds, straggler score)}: see membership.paces_of (computed after the
        membership's lock is let go: it is held only to copy the intervals)."""
        return paces_of(self.membership.intervals())

    # -- state changes that are not pushes -----------------------------------------------------

    def configure(self, config: SyncConfig) -> bool:
        """Sets the mode; False if it was already this config. ModeConflictError once workers joined, unless
        no mode was set yet in this job (the default: a new shard, or a finished job's state taken on): a
        worker of a job run again finds its variables already there and may join before its chief sets the
        job's mode, which must then still be taken."""
        book = self._book
        with self.gate.change(), book.cond:
            current = book.clock.config
            if config == current:
                return False
            if (self.membership.joined() and current != SyncConfig()) or not self.pending.is_empty():
                journal = "" if self.recorder.journal is None else (
                    f" (as its journal {self.recorder.directory} recorded: a job on the same volume must finish, "
                    f"or start anew: {self.recorder.journal.start_over()})")
                raise ModeConflictError(
                    f"this shard already runs {current} with workers joined{journal}; it cannot switch to "
                    f"{config}. Restart the job to change the mode")
            meta = {"config": dataclasses.asdict(config)}
            self._apply("configure", meta, config=config)
            ticket = self.recorder.log("configure", meta)
        self.recorder.durable(ticket)
        _LOGGER.info("mode set: %s", config)
        return True

    def _start_applier(self) -> None:
        """Starts the sync applier once the shard serves in sync mode (holds the bookkeeping condition)."""
        if self._started and self.config.mode == "sync" and self._applier is None:
            self._applier = self.failstop.thread(apply_steps, self._book, self.saves, self.gate, self.recorder,
                                                 self.tables, name="sync-applier")
            self._applier.start()

    def create(self, requests: list[NewVariable], *, job_step: int = 0) -> list[bool]:
        """store.create, recorded in the journal. `job_step`: a refill of a shard that restarted without its
        state; if it holds no variables yet it takes that step (the job's) as its own."""
        self._check_step(job_step, "step")
        self.tables.check_free(r.name for r in requests)
        held = set(self.store.names())
        for request in requests:  # a name a live resize moved, or is moving here, is not created afresh
            if request.name not in held:
                self.layout.missing(request.name)
        recorder = self.recorder
        with self.gate.change(), recorder.ordering:  # recorded before any push to the new variables can be
            with self._book.cond:
                if job_step > self.store.step and not self.store.names():
                    _LOGGER.warning("refilled while the job is at step %d: this shard starts there", job_step)
                    meta = {"step": job_step, "clear": True}
                    self._book.set_step(meta)
                    recorder.log("set_step", meta)
            created = self._apply("create", requests=requests)  # the record names the variables it created
            # the values are the variables' own (pushes change them): the record gets a copy, written later
            ticket = recorder.log("create", {"variables": [{"name": r.name, "optimizer": r.optimizer,
                                                            "hyperparams": dict(r.hyperparams)}
                                                           for r, new in zip(requests, created) if new]},
                                  {r.name: r.value.clone() for r, new in zip(requests, created) if new}
                                  if recorder.journal is not None else None)
        recorder.durable(ticket)
        return created

    def create_tables(self, specs: list[ps_pb2.TableSpec], shard_index: int, num_shards: int, *,
                      check_memory: Callable[[dict[str, int]], None] | None = None) -> list[bool]:
        """tables.create (which see), in every mode, recorded in the journal (before any push to the new tables
        can be). Never blocks on training (with a journal, on one apply's record at most)."""
        with self.gate.change(), self.recorder.ordering:
            created = self._apply("tables", {"shard_index": shard_index, "num_shards": num_shards}, specs=specs,
                                  check_memory=check_memory)  # the record names the tables it created
            ticket = self.recorder.log("tables", table_state.creation_record(
                [s for s, new in zip(specs, created) if new], shard_index, num_shards)) if any(created) else None
        self.recorder.durable(ticket)
        return created

    def lookup_rows(self, requests: list[tuple[str, torch.Tensor]], *, admit: bool) -> list[torch.Tensor]:
        """tables.lookup (which see). With a journal, an admitting lookup of dynamic tables (which may count
        ids and create rows) is made and recorded under the apply gate and the ordering lock, so replaying
        the journal admits in the same order with the applies; it then waits for an apply in progress.
        Raises (changing and recording nothing) what tables.lookup raises."""
        if not admit or self.recorder.journal is None or all(not self.tables.get(name).table.admits
                                                             for name, _ in requests):
            return self.tables.lookup(requests, admit=admit)
        with self.gate.change(), self.recorder.ordering:
            found = self._apply("admit", requests=requests)  # the record names the dynamic tables only
            dynamic = [(name, ids) for name, ids in requests if self.tables.get(name).table.admits]
            ticket = self.recorder.log("admit", {"tables": [name for name, _ in dynamic]}, dict(dynamic))
        self.recorder.durable(ticket)
        return found

    def set_hyperparams(self, names: list[str], updates: Mapping[str, float]) -> int:
        """store.set_hyperparams, recorded in the journal."""
        meta = {"names": names, "updates": dict(updates)}
        with self.gate.change(), self.recorder.ordering:  # in the order the applies around it see it
            count = self._apply("hyperparams", meta)
            ticket = self.recorder.log("hyperparams", meta)
        self.recorder.durable(ticket)
        return count

    def _apply(self, kind: str, meta: dict | None = None, tensors: Mapping[str, torch.Tensor] | None = None, *,
               config: SyncConfig | None = None, requests: list | None = None,
               specs: list[ps_pb2.TableSpec] | None = None, check_memory: Callable | None = None):
        """The change one record of the kinds configure, create, hyperparams, tables and admit describes, live
        (the caller holding the locks its kind needs, after its checks; the keywords hand over its decoded
        arguments) and at replay (_replay: decoded here from the record). Returns what the store's or the
        tables' call returns."""
        if kind == "configure":
            self._book.set_config(config if config is not None else SyncConfig(**meta["config"]))
            self._start_applier()
            return None
        if kind == "create":
            return self.store.create(requests if requests is not None else [
                NewVariable(v["name"], tensors[v["name"]], v["optimizer"], v["hyperparams"])
                for v in meta["variables"]])
        if kind == "hyperparams":
            return self.store.set_hyperparams(meta["names"], meta["updates"])
        if kind == "tables":
            return self.tables.create(specs if specs is not None else table_state.specs_of_record(meta),
                                      meta["shard_index"], meta["num_shards"], taken=self.store.names(),
                                      check_memory=check_memory)
        if kind == "admit":
            return self.tables.lookup(requests if requests is not None else
                                      [(name, tensors[name]) for name in meta["tables"]], admit=True)
        raise ValueError(f"not a record of the coordinator: {kind}")

    def _replay(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor]) -> None:
        """Makes one of _apply's records again (recovery, before the shard serves), under the locks its live
        path holds."""
        with self.gate.change(), self._book.cond if kind == "configure" else self.recorder.ordering:
            self._apply(kind, meta, tensors)

    def forget_job(self) -> None:
        """Before start(): keeps the variables, tables and step, and drops what belonged to a finished job (its
        members, its pushes' ledger, pending sums, its mode), so a new job starts from this state. The bound on
        membership (the cluster spec's names, --elastic-workers) is this shard's, not the job's: it stays."""
        self._book.forget_job()
        self.queues.clear()

    def restore(self, state: dict, *, exact: bool = False) -> None:
        """Starts from a saved state (snapshots.state_of), before start(). `exact`: it is this shard's own
        latest state (journal), not an older checkpoint, so the shard need not catch up with the job."""
        self.store.restore(state["variables"], state["step"])
        table_state.restore(self.tables, state.get("tables") or [], state.get("source", "the journal's base"))
        with self._book.cond:
            self._book.restore(state, exact=exact)
            self.queues.restore(state.get("queues"))
            self.layout.restore(state.get("layout"), decode_entries)
            if self.resizes is not None:
                self.resizes.restore(state.get("resize"))
            if self.replicas is not None:
                self.replicas.restore(state.get("replicas"))
            if self.deposals is not None and exact:  # its own journal's: a new job's processes were never deposed
                self.deposals.restore(state.get("deposed"))
            if self.own_promotions is not None and exact:  # (nor asked for)
                self.own_promotions.restore(state.get("asks"))
            self._start_applier()

    def set_replica(self, action: str, index: int, primary: str, backup: str, timeout: float | None = None,
                    changes: int | None = None,
                    released: Callable[[bool, float | None], object] = lambda ask, timeout: None,
                    copy: str = "", *, failovers: int = 0, asker: str = "", grant: str = "") -> dict:
        """The arbiter's (cluster.arbiter_of: ps 0, or ps 1 for ps 0): a change of its record of which address
        serves replicated shard `index` (replicas.py), journaled; returns the shard's record. Blocks for the
        journal record, every step within `timeout` s of the call's start. ModeConflictError on another shard
        than the arbiter, for a PROMOTE of a one-shard job's ps 0 (by hand only), and for an IN_SYNC of a shard
        past this shard's layout epoch (asked again); ReplicaFencedError when the record names another primary
        or backup, or for a PROMOTE of a shard past the layout (a resize removed it); InvalidArgumentError for
        a malformed request. A repeat changes nothing, nor does an IN_SYNC whose `changes` is not the record's count now
        (ReplicaRegistry.decide). `copy`: the name of the backup's copy (IN_SYNC records it, PROMOTE must name
        it). A "lease" renews `primary`'s lease (ReplicaRegistry.renew: not journaled,
        never blocks); one with `changes` (any value) is a read of the record's count too: it waits until
        every change recorded so far is in the journal (written by ps 0's backup too). `released(ask)`, asked
        for a repeat only: this shard's lost backup that its own arbiter no longer records in sync, if any
        (Replication.released; blocks for a call to that arbiter, within the seconds left it is given); with
        `ask` False, the lost one unasked.

        The PROMOTE of this arbiter's own arbiter's backup (ps 0 promoting ps 1's, or ps 1 ps 0's), in a layout
        of three shards or more, is decided only once ps 2 granted the deposal of the primary it replaces
        (OwnPromotions.promote, when own_promotions has a tiebreaker: it raises what that raises). DEPOSE and
        REINSTATE (ps 2's: ModeConflictError elsewhere) change the tie-breaker's record (`backup` the successor,
        `failovers`, `asker` and `grant` as Deposals.decide takes them), answered once journaled, and return it
        (Deposals.deposed); WaitTimeoutError, deciding nothing, once `timeout` ran out before the decision."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:  # what is left of `timeout` (a lease's wait, the gate, an ask took their part)
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if action in DEPOSAL_ACTIONS:
            return self._change_deposal(action, index, primary, failovers, backup, asker, grant, left, released)
        arbiter = arbiter_of(index, self._spec_shards)
        if self.replicas is None or arbiter != self._index:
            raise ModeConflictError(f"ps:{arbiter} records which address serves ps:{index}: ask it")
        if action == "lease" and changes is None:
            return self.replicas.renew(index, primary)
        if action == "lease":  # a read of the count an IN_SYNC will name: of changes that outlive this arbiter
            with self.recorder.ordering:  # every change applied so far is logged too (both hold it)
                entry = self.replicas.renew(index, primary)
            self.recorder.durable_all(left())
            return entry
        if action == "promote" and index == self._index:
            raise ModeConflictError(f"ps:{index}'s backup takes over by hand (start ps-server --index {index} on its "
                                    f"journal folder at its address): no shard but it can grant its failover")
        if action == "promote":
            self._outlast_lease(index, primary, backup, copy, left())
        own = action == "promote" and index == arbiter_of(self._index, self._spec_shards)
        if own and self.own_promotions.tiebreaker is not None and TIE_BREAKER < len(self.layout.layout()[1]):
            event, ticket = self.own_promotions.promote(
                index, primary, backup, copy, lambda: self._change_replica(action, index, primary, backup, None, copy),
                left)
        else:
            event, ticket = self._change_replica(action, index, primary, backup, changes, copy)
        self._durable(index, event, ticket, not own, left, released)
        return self.replicas.entry(index)

    def _change(self, record, kind: str, decide: Callable[[], dict | None]) -> tuple[dict | None, object]:
        """Decides (decide()), makes (record.apply) and logs (as `kind`) one change of `record`: (its event, its
        journal ticket), (None, None) for a repeat. Raises what decide() raises, changing nothing."""
        with self.gate.change(), self.recorder.ordering:
            event = decide()
            if event is None:
                return None, None
            record.apply(event)
            return event, self.recorder.log(kind, event)

    def _change_replica(self, action: str, index: int, primary: str, backup: str, changes: int | None,
                        copy: str) -> tuple[dict | None, object]:
        """One change of the arbiter's record (_change)."""
        return self._change(self.replicas, "replica", lambda: self.replicas.decide(action, index, primary, backup,
                                                                                   changes, copy))

    def _durable(self, index: int, event: dict | None, ticket, ask: bool, left: Callable[[], float | None],
                 released: Callable[[bool, float | None], object]) -> None:
        """Returns once the change `event` of shard `index`'s record made is durable, or (None: a repeat) once
        every record so far is, past this shard's lost backup that `released(ask, ...)` names."""
        # A repeat answers what was decided before once that is as durable as its own record would be: past a
        # backup of this arbiter's that was lost, once this arbiter's own arbiter no longer records it in sync,
        # so it is never promoted without the change (ps 0 and ps 1, each the other's arbiter, both losing
        # theirs, would otherwise wait on each other's drops for good: each one's first attempt decides the
        # other's drop and waits, its retry finds its own backup dropped there and answers). The promotion of
        # this arbiter's own arbiter's backup is answered past the lost backup unasked: only that promoted one
        # could drop it (a host that ran this arbiter's backup and its arbiter is gone: see docs/roadmap.md).
        if ticket is not None:
            self.recorder.durable(ticket, left())
        else:
            lost = released(ask, left())
            self.recorder.durable_all(left(), lost)
        if event is not None:
            _LOGGER.info("ps %d records ps:%d: %s", self._index, index, event)

    def _change_deposal(self, action: str, index: int, primary: str, failovers: int, successor: str, asker: str,
                        grant: str, left: Callable[[], float | None],
                        released: Callable[[bool, float | None], object]) -> dict:
        """The tie-breaker's DEPOSE or REINSTATE (see set_replica), answered once journaled."""
        if self.deposals is None:
            raise ModeConflictError(f"ps:{TIE_BREAKER} breaks the ties between ps:0 and ps:1, not ps:{self._index}: "
                                    f"ask it")

        def decide() -> dict | None:
            if left() == 0.0:  # its asker stopped waiting: it may be taking it back
                raise WaitTimeoutError(f"the {action} of ps:{index} reached ps {self._index} past its deadline: "
                                       f"nothing was decided")
            return self.deposals.decide(action, index, grant, primary, failovers, successor, asker)

        event, ticket = self._change(self.deposals, "deposal", decide)
        self._durable(index, event, ticket, True, left, released)
        return self.deposals.deposed(index)

    def _log_ask(self, event: dict, timeout: float | None) -> None:
        """OwnPromotions' log: applies and journals one ask's event; waits `timeout` s for its record (None:
        does not wait), written by this shard's backup too unless that backup is lost: as the promotion it
        asks for (_durable), past a lost backup unasked."""
        _, ticket = self._change(self.own_promotions, "ask", lambda: event)
        if timeout is not None:
            journal = self.recorder.journal
            self.recorder.durable(ticket, timeout, journal.following() if journal is not None else None)

    def _outlast_lease(self, index: int, primary: str, backup: str, copy: str, timeout: float | None) -> None:
        """A PROMOTE asked while the primary's lease still holds waits once for what is left of it, if that ends
        well within `timeout` (the lease's last renewal may have followed the backup's last frame by a renewal's
        period: the backup need not ask again); the decision is then made anew."""
        try:
            self.replicas.decide("promote", index, primary, backup, copy=copy)
        except LeaseHeldError as exc:
            if timeout is None or exc.left < timeout / 2:
                time.sleep(exc.left)
        except PSError:
            pass  # refused for another reason: decided, and raised, as any change

    def _replay_replica(self, kind: str, meta: dict, tensors: dict) -> None:
        self.replicas.apply(meta)

    def _replay_deposal(self, kind: str, meta: dict, tensors: dict) -> None:
        if self.deposals is None:
            raise ValueError(f"a tie-breaker's record in ps {self._index}'s journal: only ps {TIE_BREAKER} keeps one "
                             f"(is this another shard's journal folder?)")
        self.deposals.apply(meta)

    def _replay_ask(self, kind: str, meta: dict, tensors: dict) -> None:
        if self.own_promotions is None:
            raise ValueError(f"an arbiter's ask of ps:{TIE_BREAKER} in ps {self._index}'s journal, which keeps no "
                             f"record of replicas (is this another shard's journal folder?)")
        self.own_promotions.apply(meta)

    def replay(self, record) -> bool:
        """Makes the change of one journal record (journal.Record) again during recovery, before start(), with
        the function that made it live (replay.py); True for the record of the job's end (finish)."""
        return replay(record, self._changes, self.store)

    def finish(self, reason: str) -> None:
        """The job is done (the chief's Shutdown): the journal records it, so a shard started on this volume
        again begins a new job from this state (server.recover) instead of resuming this one. Blocks until
        the record is written (ServerUnavailableError if the journal failed)."""
        self.recorder.durable(self.recorder.log("finish", {"reason": reason}))

    def wait_for_compaction(self, timeout: float | None = None) -> None:
        """Returns once no journal compaction is running (at most `timeout` s)."""
        self.recorder.wait_for_compaction(timeout)

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
        book = self._book
        with book.cond:
            book.check_open()
            book.catch_up(start_step, by)
            book.check_ahead(start_step, "join step")
            book.touch(worker, incarnation, start_step, progress=False)
            return self.store.step

    heartbeat = join  # a heartbeat renews the lease exactly as a join does

    def restarted(self, worker: str) -> bool:
        """Whether `worker`'s current process replaced an earlier one of its name (known here, or restored
        from a checkpoint or the journal): a restarted task, whose earlier incarnation's batches are done.
        False for a name first seen now, or unknown. Never blocks on training."""
        return self.membership.restarted(worker)

    def leave(self, worker: str, incarnation: int) -> None:
        """`worker` is done: it stops counting towards the quorum and the staleness bound at once.

        WorkerReplacedError if `incarnation` was replaced (a dying old process
        cannot evict its successor); a no-op for an unknown worker.
        """
        book = self._book
        with book.cond:
            if self.membership.leave(worker, incarnation):
                _LOGGER.info("%s left", worker)
                book.membership_changed(worker, left=True)

    def close(self) -> None:
        """Ends every wait (ServerUnavailableError), stops the reaper and the applier, and lets a journal
        compaction in progress finish."""
        self._book.close()
        self.moves.close()
        if self.replicas is not None:
            self.replicas.close()
            self.own_promotions.close()
        self.store.close()  # waits for variables end too
        self.tables.close()
        self.wait_for_compaction(MAX_WAIT_SECONDS)

    def wake(self) -> None:
        """Wakes waiters, the lease reaper too, so they re-check their condition (a call was cancelled)."""
        with self._book.cond:
            self._book.notify()

    # -- pushes and pulls ---------------------------------------------------------------------

    def repeats(self, worker: str, incarnation: int, seq: int) -> bool:
        """Whether push `seq` of this worker incarnation is a retry of one this shard received (pushes.py
        answers it from the ledger, never applying it again)."""
        return self.ledger.seen(worker, incarnation, seq) is not None

    def push(self, worker: str, incarnation: int, seq: int, step: int, grads: Mapping[str, torch.Tensor],
             step_increment: int = 0, cancelled: Callable[[], bool] = _NEVER, *, hold: bool = False,
             timeout: float | None = None, by: str = CHIEF,
             received: Mapping[str, tuple] | None = None, repeat: bool = False, layout_epoch: int = 0
             ) -> PushResult:
        """push_waiting (which see), waiting in this thread."""
        return run_blocking(self.push_waiting(worker, incarnation, seq, step, grads, step_increment, cancelled,
                                              hold=hold, timeout=timeout, by=by, received=received, repeat=repeat,
                                              layout_epoch=layout_epoch))

    def push_waiting(self, worker: str, incarnation: int, seq: int, step: int, grads: Mapping[str, torch.Tensor],
                     step_increment: int = 0, cancelled: Callable[[], bool] = _NEVER, *, hold: bool = False,
                     timeout: float | None = None, by: str = CHIEF,
                     received: Mapping[str, tuple] | None = None, repeat: bool = False, layout_epoch: int = 0
                     ) -> Waiting[PushResult]:
        """Handles one push according to the mode, at most once per (worker, incarnation, seq); a generator
        that yields a waits.Wait wherever it waits (run it with waits.run_blocking, or on an event loop).

        `grads` maps variables to dense gradients and tables to their
        tables.RowGradient (a ROWS tensor), applied together (async, ssp) or,
        in sync mode, summed together into the step's pending sums and
        averaged when the step applies (pushes.py). Raises (changing
        nothing) for invalid gradients or numbers, or a replaced incarnation.
        Waits on shard 0 (on every shard with `hold`, for PushPull, with row
        gradients, or with a journal and one batch per worker and step: its
        step's record then carries it) in sync mode until the worker may go
        on, on shard 0 in ssp mode while it is too far ahead; a retry waits
        for its original.
        `by`: who makes the call (see "Authority over the step").
        With a journal, it returns once the push's record is written (a retry's:
        every record before it); if the journal fails first it raises
        ServerUnavailableError, unacknowledged (the shard then stops).
        `received` {name: (TensorMeta, bytes)}: the compressed gradients as
        they came, which the journal records instead of their decoded form.
        `repeat`: a retry carrying gradients of variables that moved away since
        (a live resize), left out of `grads`: answered as a duplicate if its
        original was applied, else LayoutChangedError (nothing applied here).
        `layout_epoch`: the layout the client placed the push by; in sync mode a
        push at a step a live resize holds waits for the hold to end, and one
        placed before the epoch that ended it raises LayoutChangedError
        (layout.py; nothing changed).
        A call closed at a wait (its generator's close()) before its push was
        counted is forgotten, as if it had failed.
        """
        self._check_step(step, "push step")
        if step_increment not in (0, 1):
            raise InvalidArgumentError(f"step_increment must be 0 or 1. Received: {step_increment}")
        grads, table_rows = split_rows(grads)
        self.store.validate(grads)
        self.tables.validate(table_rows)
        deadline = self._book.clock.deadline(timeout)
        return (yield from self._pushes.push(worker, incarnation, seq, step, grads, table_rows, step_increment,
                                             cancelled, hold, deadline, by, received, repeat, layout_epoch))

    def wait_for_step(self, min_step: int, timeout: float | None, cancelled: Callable[[], bool] = _NEVER) -> int:
        """step_waiting (which see), waiting in this thread."""
        return run_blocking(self.step_waiting(min_step, timeout, cancelled))

    def step_waiting(self, min_step: int, timeout: float | None, cancelled: Callable[[], bool] = _NEVER
                     ) -> Waiting[int]:
        """Waits until the shard's step reaches `min_step`; returns it. WaitTimeoutError after `timeout` s.
        A read: `min_step` never moves the step, whoever asks (see "Authority over the step"). A generator,
        as push_waiting."""
        self._check_step(min_step, "min_step")
        book = self._book
        deadline = book.clock.deadline(timeout)
        with book.cond:
            book.check_open()
            reached = self.store.step >= min_step
        if not reached:
            with self.waits.slot("pull"):
                yield Wait(book.cond, lambda: self.store.step >= min_step or cancelled() or book.closed,
                           lambda: book.clock.left(deadline), level=min_step)
        with book.cond:
            book.check_open()
            if self.store.step < min_step and not cancelled():
                raise WaitTimeoutError(
                    f"waited for step {min_step}; the shard is at step {self.store.step} "
                    f"(quorum {self.pending.quorum}, {self.membership.live()} live workers)")
            return self.store.step

    def snapshot_at(self, step: int, timeout: float | None, cancelled: Callable[[], bool] = _NEVER, *,
                    now: bool = False) -> dict:
        """The shard's state for a checkpoint of step `step`; see snapshots.Saves.snapshot_at."""
        return self.saves.snapshot_at(step, self._book.clock.deadline(timeout), cancelled, now=now)

    def _checkpoint_state(self) -> dict:
        """The state a checkpoint holds (Saves takes it under the apply gate); CheckpointError while tables
        kept on SSD are re-laid out (Moves.check_saveable)."""
        self.moves.check_saveable()
        return state_of(self._book, self.store, self.tables, self.queues, with_pending=False, layout=self.layout,
                        resize=self.resizes, replicas=self.replicas, deposals=self.deposals,
                        asks=self.own_promotions)

    def state(self, *, with_pending: bool) -> dict:
        """The whole state now (takes the apply gate alone while it copies)."""
        with self.gate.snapshot():
            return state_of(self._book, self.store, self.tables, self.queues, with_pending=with_pending,
                            layout=self.layout, resize=self.resizes, replicas=self.replicas, deposals=self.deposals,
                            asks=self.own_promotions)

    @staticmethod
    def _check_step(step: int, what: str) -> None:
        if not 0 <= step <= MAX_STEP:
            raise InvalidArgumentError(f"{what} must be in [0, {MAX_STEP}]. Received: {step}")
