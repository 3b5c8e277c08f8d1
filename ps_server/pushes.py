"""The push path of a shard's Coordinator: dedup, stale drops, async/ssp applies, sync sums and release.

A mixin of Coordinator (see coordinator.py for the locks and the state it
uses); Coordinator.push validates a push and calls _push. No gRPC.

Row gradients (embedding tables) follow their push in every mode: applied
with it in async and ssp modes; in sync mode summed into the step's buffer
with its dense gradients (aggregation.py, row_sums.py), dropped whole with a
stale push, answered and never re-added for a retry, and applied once per
step by the applier (_apply_sync_step), averaged over the pushes that
carried each table. A sync push with row gradients is held on every shard
until that shard applied its step, so the worker's next lookups read the
released step's rows everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable

from ..errors import WaitTimeoutError
from .ledger import PushRecord
from .modes import PushResult

__all__ = ["PushPath"]

_LOGGER = logging.getLogger(__name__)


class PushPath:
    """How one push is handled once validated (Coordinator inherits this; every method holds or takes its
    _cond as its docstring says)."""

    def _hold_kind(self, worker: str, step: int, hold: bool) -> str | None:
        """The waiting slot a new push needs if it will be held (holds _cond): a sync push that neither
        completes its step's quorum nor owes the step another batch, an ssp push past the bound; else None."""
        mode = self.config.mode
        if mode == "sync" and (self.owns_step or hold):
            buffer = self.pending.buffers.get(step)
            counted = buffer.pushes + buffer.adding if buffer else 0
            mine = buffer.by_worker[worker] if buffer else 0
            completes = step == self.pending.open_step(self.store.step) and counted + 1 >= self._quorum
            return None if completes or mine + 1 < self.config.batches_per_worker else "release"
        if mode == "ssp" and self.owns_step:
            member = self.membership.members.get(worker)
            clock = member.clock + 1 if member is not None else self._min_clock() + 1
            return "ssp" if clock - self._min_clock() > self.config.max_staleness else None
        return None

    def _push(self, worker: str, incarnation: int, seq: int, step: int, grads, table_rows, step_increment: int,
              cancelled, hold: bool, deadline: float, slot: list[str], by: str) -> PushResult:
        # A sync push carrying row gradients is held on every shard, not only shard 0, until that shard has
        # applied its step (as PushPull's is): the worker's next lookups (LookupRows, which has no min_step)
        # then read the rows of the released step on every shard.
        hold = hold or bool(table_rows)
        while True:
            with self._cond:
                self._check_open()
                self.membership.check(worker, incarnation)
                record = self.ledger.seen(worker, incarnation, seq)
                if record is not None:
                    result = self._duplicate(worker, incarnation, record, seq, cancelled, hold, deadline)
                    if result is None:
                        continue  # the original failed before changing anything: apply this one
                    self.duplicates += 1
                    break
                self._catch_up(step, by, pushed=True)
                mode = self.config.mode
                if mode == "sync":
                    self._check_ahead(step, "push step")
                if mode == "ssp" or (mode == "sync" and step >= self.pending.open_step(self.store.step)):
                    kind = self._hold_kind(worker, step, hold)
                    if kind is not None:  # refused here, before the push changes anything
                        self.waits.acquire(kind)
                        slot.append(kind)
                self._touch(worker, incarnation, step, progress=True)
                self.membership.pushed(worker, self._now())
                if mode == "sync" and step < self.pending.open_step(self.store.step):
                    return self._stale(worker, incarnation, seq, step)
                record = self.ledger.begin(worker, incarnation, seq, step)
                buffer = self.pending.reserve(step) if mode == "sync" else None
            try:
                if buffer is not None:
                    return self._push_sync(worker, incarnation, seq, step, grads, table_rows, record, buffer,
                                           cancelled, hold, deadline)
                return self._push_async(worker, incarnation, seq, step, grads, table_rows, step_increment, record,
                                        mode == "ssp", cancelled, deadline)
            except BaseException:
                with self._cond:
                    if record is None or not record.applied:
                        self.ledger.abort(worker, incarnation, record)
                        if buffer is not None:
                            self.pending.unreserve(buffer)
                    self._cond.notify_all()
                raise
        self._durable_all(deadline)  # a retry is acknowledged once its original's record is written
        return result

    def _stale(self, worker: str, incarnation: int, seq: int, step: int) -> PushResult:
        record = self.ledger.begin(worker, incarnation, seq, step)
        if record is not None:
            record.stale = True
        self.stale_dropped += 1
        current = self.store.step
        _LOGGER.debug("dropped a stale gradient from %s (step %d < %d)", worker, step, current)
        result = PushResult(step=current, next_step=current, stale=True, quorum=self._quorum)
        if record is not None:
            record.result = result
        return result

    def _duplicate(self, worker: str, incarnation: int, record: PushRecord, seq: int, cancelled, hold: bool,
                   deadline: float) -> PushResult | None:
        """The reply to a repeated push (holds _cond); None if its original failed and it must be applied."""
        current = self.store.step
        if record.seq != seq or record.step < 0:  # a straggler of an older push: never applied now
            return PushResult(step=current, next_step=current, duplicate=True, quorum=self._quorum)
        if not record.stale and not (record.applied or record.result is not None):
            with self.waits.slot("retry"):  # a retry waiting for its original, still being handled
                done = self._cond.wait_for(lambda: record.applied or record.result is not None or self._closed
                                           or self.ledger.seen(worker, incarnation, seq) is not record
                                           or cancelled(), self._left(deadline))
            self._check_open()
            if self.ledger.seen(worker, incarnation, seq) is not record:
                return None
            if not done:
                raise WaitTimeoutError(f"a retried push from {worker} waited for its original, still running")
        if self.config.mode == "sync" and not record.stale:
            held = (self.owns_step or hold) and self.store.step <= record.step
            with self.waits.slot("release") if held else contextlib.nullcontext():
                released = self._await_release(worker, record.step, cancelled, hold, deadline)
            return dataclasses.replace(released, duplicate=True)
        if record.result is None:  # cancelled before the original finished
            return PushResult(step=current, next_step=current, duplicate=True, quorum=self._quorum)
        return dataclasses.replace(record.result, duplicate=True, wait_seconds=0.0)

    def _push_async(self, worker: str, incarnation: int, seq: int, step: int, grads, table_rows,
                    step_increment: int, record: PushRecord | None, ssp: bool, cancelled, deadline: float
                    ) -> PushResult:
        with self.gate.change():
            with self._ordered:  # with a journal, applies are queued for it in the order they happened
                step_after, versions = self.store.apply(grads, step_increment, validated=True)
                self.tables.apply(table_rows, step_after)  # journaled with the dense gradients (_log)
                ticket = self._log("apply", {"step_increment": step_increment,
                                             **self._push_meta(worker, incarnation, seq, step)}, grads)
            with self._cond:
                if record is not None:
                    record.applied = True
        self._durable(ticket, deadline)  # written (outside every lock) before it is acknowledged
        with self._cond:
            member = self.membership.members[worker]
            member.clock += 1
            result = PushResult(step=step_after, next_step=step_after, versions=versions)
            if record is not None:
                record.result = result
            self._cond.notify_all()
            if not (ssp and self.owns_step):
                return result
            bound = self.config.max_staleness
            start = self._now()
            self._hold(worker, lambda: member.clock - self._min_clock() <= bound or cancelled(), deadline,
                       lambda: f"{worker} is {member.clock - self._min_clock()} pushes ahead of the slowest live "
                               f"worker (bound {bound})")
            current = self.store.step
            return dataclasses.replace(result, step=current, next_step=current, wait_seconds=self._now() - start)

    def _push_sync(self, worker: str, incarnation: int, seq: int, step: int, grads, table_rows,
                   record: PushRecord | None, buffer, cancelled, hold: bool, deadline: float) -> PushResult:
        """Adds a push (dense and row gradients, all or nothing) to the buffer of `step` that _push reserved,
        counts it, then waits as _await_release says. If the add raises, nothing was added (_push then
        forgets the push and unreserves the buffer). Its journal record ("add") carries the rows too
        (Coordinator._log), and is written before the push is acknowledged (the step's record, queued after
        every add it sums, need not be: replaying the adds brings the step back)."""
        tickets = []
        with self.gate.change():
            buffer.add(grads, lambda: tickets.append(self._log("add", self._push_meta(worker, incarnation, seq, step),
                                                               grads)), rows=table_rows)
            with self._cond:
                if record is not None:
                    record.applied = record.pending = True
                self.pending.counted(buffer, worker)
                self._cond.notify_all()
        self._durable(tickets[0], deadline)  # written (outside every lock) before it is acknowledged
        with self._cond:
            result = self._await_release(worker, step, cancelled, hold, deadline)
            if record is not None:
                record.result = result
            return result

    def _apply_sync_step(self, buffer, step: int) -> None:
        """Applies sync step `step` (the store's step) from its buffer: first every table's averaged row
        gradients, one lazy optimizer step each on the union of the ids pushed (tables.apply at step + 1,
        then eviction, as an async push at that step), then the dense averages, which advance the store's
        step. So a call that sees the new step (a released push, a min_step pull) sees the rows applied
        too. The applier's call (and the journal's replay), under the apply gate and _ordered, not _cond;
        blocks on the tables' and variables' locks only. The rows were validated when pushed, so it raises
        only if a table vanished or on a bug: then the tables before it in the buffer are updated and the
        store's step has not moved."""
        averaged = buffer.row_averages()
        if averaged:
            self.tables.apply(averaged, step + 1, received={name: rows.received for name, rows in averaged.items()})
        self.store.apply(buffer.averages(), step_increment=1, validated=True)

    def _await_release(self, worker: str, step: int, cancelled, hold: bool, deadline: float) -> PushResult:
        """On shard 0 (any shard with `hold`), waits until `worker` may go on after pushing for `step`.

        Holds _cond. The worker may go on once this shard has applied `step`,
        or while the step still wants more of its batches (R > N).
        """
        start = self._now()
        if self.owns_step or hold:
            per_worker = self.config.batches_per_worker

            def may_go_on() -> bool:
                if self.store.step > step or cancelled():
                    return True
                buffer = self.pending.buffers.get(step)
                return buffer is not None and self.pending.applying != step and buffer.by_worker[worker] < per_worker

            self._hold(worker, may_go_on, deadline,
                       lambda: f"step {step} was not released (shard at step {self.store.step}, quorum "
                               f"{self._quorum}, {self.membership.live()} live workers)")
        current = self.store.step
        return PushResult(step=current, next_step=max(current, step), wait_seconds=self._now() - start,
                          quorum=self._quorum)

    def _hold(self, worker: str, condition: Callable[[], bool], deadline: float, describe: Callable[[], str]) -> None:
        """Waits (holds _cond, and the push's waiting slot) until `condition()`, counting as a held push of
        `worker` (never a stall)."""
        member = self.membership.members.get(worker)
        if member is not None:
            member.held += 1
        try:
            done = self._cond.wait_for(lambda: condition() or self._closed, self._left(deadline))
        finally:
            if member is not None:
                member.held -= 1
                member.last_progress = self._now()
                if not member.held:
                    self._reaper_wake.notify()  # its progress deadline counts again
        self._check_open()
        if not done:
            raise WaitTimeoutError(describe())
