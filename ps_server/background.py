"""The coordinator's two background threads, the lease reaper and the sync applier; a sync step's change. No
gRPC.

Both make their decisions holding the bookkeeping condition only for that;
the applier applies a step's average under the apply gate, like any other
change (locks.LOCK_ORDER). Both run under the coordinator's FailStop
(failstop.py): an exception that escapes either ends the process, so a shard
never answers with one of them dead.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from . import table_state
from .aggregation import StepBuffer, apply_averages, apply_step
from .bookkeeping import Bookkeeping
from .gate import ApplyGate
from .recording import Recorder
from .row_sums import AveragedRows
from .snapshots import Saves
from .tables import TableStore

__all__ = ["apply_steps", "reap", "take_step", "replay_step", "step_record"]

_LOGGER = logging.getLogger(__name__)


def apply_steps(book: Bookkeeping, saves: Saves, gate: ApplyGate, recorder: Recorder, tables: TableStore) -> None:
    """The sync applier (thread body): applies each step once its quorum has counted in; returns at close."""
    store, pending = book.store, book.pending
    while True:
        with book.cond:
            book.cond.wait_for(lambda: book.closed or pending.next_ready(store.step))
            if book.closed:
                return
            kind, step = pending.next_ready(store.step)
            buffer = pending.start_applying(kind, step)
            save_due = buffer is not None and saves.due(step)
        if save_due:  # a checkpoint of this step waits: take it before the step moves on
            saves.take(step)
        meta = {"step": step}
        with gate.change():
            if buffer is not None:
                take_step(book, tables, meta, buffer,
                          lambda dense, rows: recorder.log("step", *step_record(meta, buffer, dense, rows)))
            else:
                with book.cond:
                    _LOGGER.warning("step %d is complete while this shard waits at step %d: catching up", step,
                                    store.step)
                    book.set_step(meta)
                    recorder.log("set_step", meta)
                    pending.done_applying(store.step)


def take_step(book: Bookkeeping, tables: TableStore, meta: dict, buffer: StepBuffer,
              then: Callable[[dict, dict], None] = lambda dense, rows: None) -> None:
    """The change of a "step" record, the applier's and at replay (replay_step): step meta["step"] applied
    from its sums `buffer` (aggregation.apply_step) under the journal's ordering, `then(dense, rows)` right
    after it with the averages applied (the applier: its record queued); then _stepped. Call it holding the
    apply gate alone."""
    with book.recorder.ordering:  # after the hyperparameters it was applied with, in the journal too
        dense, rows = apply_step(buffer, meta["step"], book.store, tables)  # row averages, then dense ones
        then(dense, rows)
    _stepped(book)


def _stepped(book: Bookkeeping) -> None:
    """After a step: taking cond, the sums before the new step dropped, the quorum recomputed (it counts
    members from their first step) and every wait woken."""
    with book.cond:
        book.pending.done_applying(book.store.step)
        book.update_quorum()
        book.cond.notify_all()


def step_record(meta: dict, buffer: StepBuffer, dense: dict[str, torch.Tensor], rows: dict[str, AveragedRows]
                ) -> tuple[dict, dict[str, torch.Tensor]]:
    """The (meta, tensors) of step meta["step"]'s record: the step alone when every push summed in `buffer`
    has its "add" record; else (replication after aggregation) the `dense` and row averages applied and the
    (worker, incarnation, seq) of every push summed, so a replay needs no add (replay_step)."""
    if not buffer.aggregated:
        return meta, {}
    meta = {**meta, "pushes": [list(p) for p in buffer.pushed],
            "rows_received": {name: averaged.received for name, averaged in rows.items()}}
    return table_state.record_rows(meta, dense, rows)


def replay_step(book: Bookkeeping, gate: ApplyGate, tables: TableStore, kind: str, meta: dict, tensors=None
                ) -> None:
    """Makes a "step" record's change again (recovery, before the shard serves): take_step from that step's
    sums, under the apply gate as the applier does; a record that carries the step's averages (step_record)
    applies them instead, in place of any sums replayed for that step, and counts in the pushes it names
    that those sums did not have, as their adds did live."""
    step = meta["step"]
    with gate.change():
        if "pushes" not in meta:
            take_step(book, tables, meta, book.pending.buffer(step))
            return
        tensors = dict(tensors or {})
        rows = {name: AveragedRows(grad.ids, grad.values, meta["rows_received"][name], grad.counts_step)
                for name, grad in table_state.rows_of_record(meta, tensors).items()}
        with book.cond:
            summed = set(book.pending.replace(step).pushed)
            for worker, incarnation, seq in map(tuple, meta["pushes"]):
                if (worker, incarnation, seq) not in summed:
                    book.ledger.mark_applied(book.ledger.begin(worker, incarnation, seq, step), pending=True)
                    book.membership.count_push(worker, step)
        with book.recorder.ordering:
            apply_averages(tensors, rows, step, book.store, tables)
        _stepped(book)


def reap(book: Bookkeeping) -> None:
    """Expires leases and progress when they run out (thread body); wakes at the next deadline, returns at
    close."""
    membership, clock = book.membership, book.clock
    with book.cond:
        while not book.closed:
            now = clock.now()
            config = clock.config
            expired, stalled = membership.expire(now, config.lease_seconds, config.progress_seconds)
            for worker in expired:
                _LOGGER.warning("%s sent nothing for %g s: lease expired, continuing without it",
                                worker, config.lease_seconds)
            for worker in stalled:
                _LOGGER.warning("%s pushed nothing for %.3g s although it still heartbeats (progress timeout): "
                                "continuing without it until it pushes again", worker,
                                membership.progress_timeout(config.progress_seconds))
            grace_ended = clock.grace_ended(now)  # unjoined workers stop counting, in every mode
            if expired or stalled or grace_ended:
                book.membership_changed(*expired, *stalled)
            grace_end = clock.grace_end()
            deadlines = [d for d in (membership.next_deadline(config.lease_seconds, config.progress_seconds),
                                     grace_end if grace_end > now else None) if d is not None]
            book.reaper_until = min(deadlines) + 0.01 if deadlines else math.inf
            book.reaper_wake.wait(max(0.0, book.reaper_until - now) if deadlines else None)
