"""A shard's push path: dedup, stale drops, async/ssp applies, sync sums and release. No gRPC.

Coordinator.push validates a push and hands it to PushPath.push. Decisions
are made holding the bookkeeping condition (bookkeeping.py), gradients are
applied or summed under the apply gate without it, and the push's journal
record is waited for holding no lock (locks.LOCK_ORDER). A push is a
generator that yields a waits.Wait where it waits for a release, the ssp
bound or its original, holding no lock, so its caller may wait in a thread
or on an event loop (waits.py). What an applied push changes (its "apply"
or "add" record) is made by _apply, which the journal's replay calls too. A
sync push on a journaled shard with one batch per worker and step has no
record of its own: it is held on every shard until its step's record, which
carries the step's averages and names it, is written (_push_sync).
An async push's reply is kept in the ledger as it is applied, so a retry
arriving before its record is written gets it (after that record is written).

Row gradients (embedding tables) follow their push in every mode: applied
with it in async and ssp modes; in sync mode summed into the step's buffer
with its dense gradients (aggregation.py, row_sums.py), dropped whole with a
stale push, answered and never re-added for a retry, and applied once per
step by the applier (aggregation.apply_step), averaged over the pushes that
carried each table. A sync push with row gradients is held on every shard
until that shard applied its step, so the worker's next lookups read the
released step's rows everywhere.

A sync push computed at a step a live resize holds from waits before its
admission (nothing of it counted or summed) until the hold ends, then is
refused if it was placed by an earlier layout than the one that ended the
hold (layout.py); a retry of a push admitted before is answered as ever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Mapping

import torch

from ..errors import LayoutChangedError, WaitTimeoutError
from . import table_state
from .aggregation import StepBuffer
from .bookkeeping import Bookkeeping
from .gate import ApplyGate
from .layout import ShardLayout
from .ledger import PushRecord
from .modes import PushResult
from .recording import Recorder
from .tables import TableStore
from .waits import Wait, Waiting, WaitLimit

__all__ = ["PushPath"]

_LOGGER = logging.getLogger(__name__)
_nothing = lambda: None  # noqa: E731


class PushPath:
    """How one validated push is handled (see the module docstring). Thread-safe.

    `owns_step` (shard 0) holds sync pushes until their step is released and
    ssp pushes past the staleness bound.
    """

    def __init__(self, book: Bookkeeping, tables: TableStore, gate: ApplyGate, waits: WaitLimit,
                 recorder: Recorder, layout: ShardLayout, *, owns_step: bool):
        self._book = book
        self._layout = layout
        self._store = book.store
        self._tables = tables
        self._gate = gate
        self._waits = waits
        self._recorder = recorder
        self._owns_step = owns_step

    def push(self, worker: str, incarnation: int, seq: int, step: int, grads: Mapping[str, torch.Tensor],
             table_rows: Mapping, step_increment: int, cancelled: Callable[[], bool], hold: bool, deadline: float,
             by: str, received: Mapping[str, tuple] | None, repeat: bool = False, layout_epoch: int = 0
             ) -> Waiting[PushResult]:
        """Handles one push (validated: see Coordinator.push for what it does and raises), placed by the
        client at `layout_epoch`; yields a Wait (waits.py) where it waits, holding no lock. Each part between
        two waits runs with the push's journal context (Recorder.pushing) in the thread that runs it."""
        slot: list[str] = []  # the waiting slot this push took, if it will be held
        call = self._push(worker, incarnation, seq, step, grads, table_rows, step_increment, cancelled, hold,
                          deadline, slot, by, repeat, layout_epoch)
        try:
            while True:
                with self._recorder.pushing(table_rows, received):  # its journal record carries them
                    try:
                        wait = next(call)
                    except StopIteration as stop:
                        return stop.value
                yield wait
        finally:
            call.close()
            if slot:
                self._waits.release(slot[0])

    def _hold_kind(self, worker: str, step: int, hold: bool) -> str | None:
        """The waiting slot a new push needs if it will be held (holds cond): a sync push that neither
        completes its step's quorum nor owes the step another batch, an ssp push past the bound; else None."""
        book = self._book
        config = book.clock.config
        if config.mode == "sync" and (self._owns_step or hold):
            counted, mine = book.pending.counts(step, worker)
            completes = step == book.pending.open_step(self._store.step) and counted + 1 >= book.pending.quorum
            return None if completes or mine + 1 < config.batches_per_worker else "release"
        if config.mode == "ssp" and self._owns_step:
            clock = book.membership.clock_of(worker)
            clock = clock + 1 if clock is not None else book.min_clock() + 1
            return "ssp" if clock - book.min_clock() > config.max_staleness else None
        return None

    def _push(self, worker: str, incarnation: int, seq: int, step: int, grads, table_rows, step_increment: int,
              cancelled, hold: bool, deadline: float, slot: list[str], by: str, repeat: bool, layout_epoch: int
              ) -> Waiting[PushResult]:
        # A sync push carrying row gradients is held on every shard, not only shard 0, until that shard has
        # applied its step (as PushPull's is): the worker's next lookups (LookupRows, which has no min_step)
        # then read the rows of the released step on every shard.
        # A sync push on a journaled shard leaves no record of its own (one per step: background.step_record)
        # and is held on every shard until its step's record is written.
        aggregate = self._aggregates()
        hold = hold or bool(table_rows) or aggregate
        book, ledger, pending = self._book, self._book.ledger, self._book.pending
        while True:
            with book.cond:
                book.check_open()
                book.membership.check(worker, incarnation)
                original = ledger.seen(worker, incarnation, seq)
                if original is None and repeat:
                    raise _refused_repeat(worker, seq)
                held = original is None and book.clock.config.mode == "sync" and self._layout.holds(step)
                if original is None and not held:
                    if book.clock.config.mode == "sync":
                        self._layout.check_push(step, layout_epoch)
                    admitted = self._admit(worker, incarnation, seq, step, hold, slot, by)
                    if isinstance(admitted, PushResult):
                        return admitted
                    record, buffer = admitted
                    break
            if held:  # a live resize moves variables: wait for the hold to end, then admit it afresh
                with self._waits.slot("release"):
                    yield from self._hold(worker, lambda: not self._layout.holds(step) or cancelled(), deadline,
                                          None, lambda: f"a live resize held pushes from step "
                                                        f"{self._layout.hold_from}; it did not end in time")
                if cancelled():
                    raise WaitTimeoutError(f"{worker} went away while a live resize held its push; nothing was "
                                           f"changed")
                for name in grads:  # still here (else the layout's error: nothing was changed)
                    self._store.get(name)
                continue
            result = yield from self._duplicate(worker, incarnation, original, seq, cancelled, hold, deadline,
                                                aggregate)
            if result is None and repeat:
                raise _refused_repeat(worker, seq)
            if result is not None:
                with book.cond:
                    ledger.count_duplicate()
                self._recorder.durable_all(book.clock.left(deadline))  # a retry is acknowledged once its
                return result                                          # original's record is written
            # else the original failed before changing anything: this one is applied
        try:
            if buffer is not None:
                return (yield from self._push_sync(worker, incarnation, seq, step, grads, table_rows, record, buffer,
                                                   cancelled, hold, deadline, aggregate))
            return (yield from self._push_async(worker, incarnation, seq, step, grads, table_rows, step_increment,
                                                record, book.clock.config.mode == "ssp", cancelled, deadline))
        except BaseException:  # GeneratorExit too: a call closed before it was applied is forgotten
            with book.cond:
                if record is None or not record.applied:
                    ledger.abort(worker, incarnation, record)
                    if buffer is not None:
                        pending.unreserve(buffer)
                book.cond.notify_all()
            raise

    def _admit(self, worker: str, incarnation: int, seq: int, step: int, hold: bool, slot: list[str], by: str
               ) -> PushResult | tuple[PushRecord | None, StepBuffer | None]:
        """A new push's admission (holds cond): its stale reply, or (its ledger record, the sync step's buffer
        it will add to or None). Takes the waiting slot it will need (ResourceExhaustedError, nothing changed)."""
        book, pending = self._book, self._book.pending
        book.catch_up(step, by, pushed=True)
        mode = book.clock.config.mode
        if mode == "sync":
            book.check_ahead(step, "push step", worker)
        if mode == "ssp" or (mode == "sync" and step >= pending.open_step(self._store.step)):
            kind = self._hold_kind(worker, step, hold)
            if kind is not None:  # refused here, before the push changes anything
                self._waits.acquire(kind)
                slot.append(kind)
        book.touch(worker, incarnation, step, progress=True)
        book.membership.pushed(worker, book.clock.now())
        if mode == "sync" and step < pending.open_step(self._store.step):
            return self._stale(worker, incarnation, seq, step)
        record = book.ledger.begin(worker, incarnation, seq, step)
        return record, pending.reserve(step) if mode == "sync" else None

    def _stale(self, worker: str, incarnation: int, seq: int, step: int) -> PushResult:
        """The reply to a sync push computed at a step already applied, which is dropped (holds cond)."""
        book = self._book
        record = book.ledger.begin(worker, incarnation, seq, step)
        book.ledger.mark_stale(record)
        book.pending.count_stale()
        book.membership.count_push(worker, step)  # its batch was trained, and dropped by design (sync)
        current = self._store.step
        _LOGGER.debug("dropped a stale gradient from %s (step %d < %d)", worker, step, current)
        result = PushResult(step=current, next_step=current, stale=True, quorum=book.pending.quorum)
        book.ledger.answer(record, result)
        return result

    def _wait(self, ready: Callable[[], bool], deadline: float, level: int | None = None) -> Wait:
        """A Wait on the bookkeeping condition until ready(), close() or `deadline` (ready() false before the
        step reaches `level`)."""
        book = self._book
        return Wait(book.cond, lambda: ready() or book.closed, lambda: book.clock.left(deadline), level)

    def _duplicate(self, worker: str, incarnation: int, record: PushRecord, seq: int, cancelled, hold: bool,
                   deadline: float, aggregate: bool) -> Waiting[PushResult | None]:
        """The reply to a repeated push of `record`; None if its original failed (or its record is no longer
        the ledger's) and it must be applied. Takes cond. `aggregate`: as _await_release's."""
        book, ledger = self._book, self._book.ledger

        def replaced() -> bool:
            return ledger.seen(worker, incarnation, seq) is not record

        with book.cond:
            if replaced():
                return None
            current = self._store.step
            if record.seq != seq or record.step < 0:  # a straggler of an older push: never applied now
                return PushResult(step=current, next_step=current, duplicate=True, quorum=book.pending.quorum)
            running = not record.stale and not ledger.settled(record)
        if running:  # a retry waiting for its original, still being handled
            with self._waits.slot("retry"):
                yield self._wait(lambda: ledger.settled(record) or replaced() or cancelled(), deadline)
            with book.cond:
                book.check_open()
                if replaced():
                    return None
                if not (ledger.settled(record) or cancelled()):
                    raise WaitTimeoutError(f"a retried push from {worker} waited for its original, still running")
        with book.cond:
            sync = book.clock.config.mode == "sync" and not record.stale
            held = sync and (self._owns_step or hold) and self._store.step <= record.step
            if not sync:
                current = self._store.step
                if record.result is None:  # cancelled before the original finished
                    return PushResult(step=current, next_step=current, duplicate=True, quorum=book.pending.quorum)
                return dataclasses.replace(record.result, duplicate=True, wait_seconds=0.0)
        with self._waits.slot("release") if held else contextlib.nullcontext():
            released = yield from self._await_release(worker, record.step, cancelled, hold, deadline, aggregate)
        return dataclasses.replace(released, duplicate=True)

    def _push_async(self, worker: str, incarnation: int, seq: int, step: int, grads, table_rows,
                    step_increment: int, record: PushRecord | None, ssp: bool, cancelled, deadline: float
                    ) -> PushResult:
        book, recorder = self._book, self._recorder
        meta = {"step_increment": step_increment, **_push_meta(worker, incarnation, seq, step)}
        tickets = []
        with self._gate.change():
            self._tables.check_applies(table_rows)  # none frozen for a live re-layout (nothing changed if so)
            result = self._apply("apply", meta, grads, table_rows, record,  # rows journaled with it (pushing())
                                 then=lambda: tickets.append(recorder.log("apply", meta, grads)))
        recorder.durable(tickets[0], book.clock.left(deadline))  # written (outside every lock) before it is
        if not (ssp and self._owns_step):                         # acknowledged
            return result
        with book.cond:
            bound = book.clock.config.max_staleness
            start = book.clock.now()

        def ahead() -> int:
            return book.membership.clock_of(worker) - book.min_clock()

        yield from self._hold(worker, lambda: ahead() <= bound or cancelled(), deadline, None,
                              lambda: f"{worker} is {ahead()} pushes ahead of the slowest live worker (bound {bound})")
        with book.cond:
            current = self._store.step
            return dataclasses.replace(result, step=current, next_step=current,
                                       wait_seconds=book.clock.now() - start)

    def _push_sync(self, worker: str, incarnation: int, seq: int, step: int, grads, table_rows,
                   record: PushRecord | None, buffer: StepBuffer, cancelled, hold: bool, deadline: float,
                   aggregate: bool) -> Waiting[PushResult]:
        """Adds a push (dense and row gradients, all or nothing) to the buffer of `step` that _push reserved,
        counts it, then waits as _await_release says. If the add raises, nothing was added (_push then
        forgets the push and unreserves the buffer). Its journal record ("add") carries the rows too
        (Recorder.pushing), and is written before the push is acknowledged (the step's record, queued after
        every add it sums, need not be: replaying the adds brings the step back). `aggregate` (a journaled
        shard, one batch per worker and step): no "add" record; the push is acknowledged once its step's
        record, which carries the averages and names every push summed, is written (so a backup receives one
        record per step, not one per push: replication after aggregation). A push that was not acknowledged
        before the shard stopped is not in its journal: its client's retry is applied afresh."""
        book, recorder = self._book, self._recorder
        meta = _push_meta(worker, incarnation, seq, step)
        tickets = []
        with self._gate.change():
            self._tables.check_applies(table_rows)
            self._apply("add", meta, grads, table_rows, record, buffer, recorded=not aggregate,
                        then=_nothing if aggregate else lambda: tickets.append(recorder.log("add", meta, grads)))
        if not aggregate:
            recorder.durable(tickets[0], book.clock.left(deadline))  # written (outside every lock) before it is
        result = yield from self._await_release(worker, step, cancelled, hold, deadline, aggregate)  # acknowledged
        with book.cond:
            book.ledger.answer(record, result)
        return result

    def _apply(self, kind: str, meta: dict, grads: Mapping[str, torch.Tensor], rows: Mapping,
               record: PushRecord | None, buffer: StepBuffer | None = None, then: Callable[[], None] = _nothing,
               recorded: bool = True) -> PushResult | None:
        """The change of one push's record, "apply" (async, ssp) or "add" (sync), live and at replay (replay()):
        its gradients `grads` and row gradients `rows` applied (under the ordering lock) or summed into
        `buffer` (under the buffer's), `then()` right after them under that lock (live: the record queued);
        then, taking cond, the ledger's `record` marked applied, an apply's reply kept and its worker's ssp
        clock moved, an add counted in its step. The caller holds the apply gate, after the push's
        admission (its ledger record begun, its step's place in `buffer` reserved). Returns an apply's
        reply. `recorded` False: an add with no record of its own (_push_sync's `aggregate`)."""
        book, worker = self._book, meta["worker"]
        if kind == "add":
            buffer.add(grads, then, rows=rows)
            with book.cond:
                book.ledger.mark_applied(record, pending=True)
                book.pending.counted(buffer, worker, (worker, meta["incarnation"], meta["seq"]), recorded)
                book.membership.count_push(worker, meta["step"])
                book.cond.notify_all()
            return None
        with self._recorder.ordering:  # with a journal, applies are queued for it in the order they happened
            step, versions = self._store.apply(grads, meta["step_increment"], validated=True)
            self._tables.apply(rows, step)
            then()
        result = PushResult(step=step, next_step=step, versions=versions)
        with book.cond:
            book.ledger.mark_applied(record)
            book.ledger.answer(record, result)
            book.membership.advance_clock(worker)
            if meta["step_increment"]:
                book.membership.count_push(worker, meta["step"])
            book.cond.notify_all()
        return result

    def replay(self, kind: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Makes one "apply" or "add" record's change again (recovery, before the shard serves; its compressed
        gradients decoded already: replay.from_received): what the push's admission did that the change
        needs, then _apply, under the locks the live path holds."""
        rows = table_state.rows_of_record(meta, tensors)  # taken out of `tensors`: the dense gradients stay
        book = self._book
        with book.cond:
            record = book.ledger.begin(meta["worker"], meta["incarnation"], meta["seq"], meta["step"])
            buffer = book.pending.reserve(meta["step"]) if kind == "add" else None
        with self._gate.change():
            self._apply(kind, meta, tensors, rows, record, buffer)

    def _aggregates(self) -> bool:
        """Whether a sync push's add goes unrecorded (its step's record carries it): a journal, sync mode, one
        batch per worker and step (a worker let go on before its step is applied has its add recorded)."""
        config = self._book.clock.config
        return self._recorder.journal is not None and config.mode == "sync" and config.batches_per_worker == 1

    def _await_release(self, worker: str, step: int, cancelled, hold: bool, deadline: float,
                       aggregate: bool = False) -> Waiting[PushResult]:
        """On shard 0 (any shard with `hold`), waits until `worker` may go on after pushing for `step`.

        Takes cond. The worker may go on once this shard has applied `step`
        (and queued its record), or while the step still wants more of its
        batches (R > N). `aggregate`: then waits (holding no lock) for every
        record queued so far to be written, the step's among them.
        """
        book = self._book
        start = book.clock.now()
        if self._owns_step or hold:
            per_worker = book.clock.config.batches_per_worker

            def may_go_on() -> bool:
                return ((self._store.step > step and not book.pending.applying(step)) or cancelled()
                        or book.pending.wants_more(step, worker, per_worker))

            yield from self._hold(worker, may_go_on, deadline, step + 1 if per_worker == 1 else None,
                                  lambda: f"step {step} was not released (shard at step {self._store.step}, quorum "
                                          f"{book.pending.quorum}, {book.membership.live()} live workers)")
        if aggregate:
            self._recorder.durable_all(book.clock.left(deadline))
        with book.cond:
            current = self._store.step
            return PushResult(step=current, next_step=max(current, step), wait_seconds=book.clock.now() - start,
                              quorum=book.pending.quorum)

    def _hold(self, worker: str, condition: Callable[[], bool], deadline: float, level: int | None,
              describe: Callable[[], str]) -> Waiting[None]:
        """Waits (with the push's waiting slot, holding no lock) until `condition()` (false before the step
        reaches `level`, None: unknown), counting as a held push of `worker` (never a stall).
        WaitTimeoutError at `deadline`, ServerUnavailableError at close."""
        book = self._book
        with book.cond:
            member = book.membership.hold(worker)
        try:
            yield self._wait(condition, deadline, level)
        finally:
            with book.cond:
                now = book.clock.now()
                if book.membership.unhold(member, now):
                    book.progress_renewed(now)  # its progress deadline counts again
        with book.cond:
            book.check_open()
            if not condition():
                raise WaitTimeoutError(describe())


def _refused_repeat(worker: str, seq: int) -> LayoutChangedError:
    """A retry whose original changed nothing here, naming variables that left since: the client sends again."""
    return LayoutChangedError(f"push {seq} of {worker} names variables that moved to another shard since it was "
                              f"first sent, and was not applied here; nothing was changed: ask for the layout")


def _push_meta(worker: str, incarnation: int, seq: int, step: int) -> dict:
    return {"worker": worker, "incarnation": incarnation, "seq": seq, "step": step}
