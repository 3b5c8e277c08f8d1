"""The coordinator's two background threads: the lease reaper and the sync applier. No gRPC.

Both run with the coordinator's lock held only for bookkeeping; the applier
applies a step's average under the apply gate, like any other change. Both
run under the coordinator's FailStop (failstop.py): an exception that escapes
either ends the process, so a shard never answers with one of them dead.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .coordinator import Coordinator

__all__ = ["apply_steps", "reap"]

_LOGGER = logging.getLogger(__name__)


def apply_steps(c: "Coordinator") -> None:
    """The sync applier (thread body): applies each step once its quorum has counted in."""
    while True:
        with c._cond:
            c._cond.wait_for(lambda: c._closed or c.pending.next_ready(c.store.step, c._quorum))
            if c._closed:
                return
            kind, step = c.pending.next_ready(c.store.step, c._quorum)
            c.pending.applying = step
            buffer = c.pending.buffers[step] if kind == "apply" else None
            save_due = buffer is not None and c.saves.due(step)
        if save_due:  # a checkpoint of this step waits: take it before the step moves on
            c.saves.take(step)
        with c.gate.change():
            if buffer is not None:
                with c._ordered:  # after the hyperparameters it was applied with, in the journal too
                    c._apply_sync_step(buffer, step)  # row averages, then dense ones (pushes.py)
                    c._log("step", {"step": step})
            with c._cond:
                if kind == "jump":
                    _LOGGER.warning("step %d is complete while this shard waits at step %d: catching up",
                                    step, c.store.step)
                    c.store.set_step(step)
                    c._log("set_step", {"step": step})
                c.pending.drop_before(c.store.step)
                c.pending.applying = None
                c._update_quorum()
                c._cond.notify_all()


def reap(c: "Coordinator") -> None:
    """Expires leases and progress when they run out (thread body); wakes at the next deadline."""
    with c._cond:
        while not c._closed:
            now = c._now()
            config = c.config
            expired, stalled = c.membership.expire(now, config.lease_seconds, config.progress_seconds)
            for worker in expired:
                _LOGGER.warning("%s sent nothing for %g s: lease expired, continuing without it",
                                worker, config.lease_seconds)
            for worker in stalled:
                _LOGGER.warning("%s pushed nothing for %.3g s although it still heartbeats (progress timeout): "
                                "continuing without it until it pushes again", worker,
                                c.membership.progress_timeout(config.progress_seconds))
            grace_end = c._configured_at + config.startup_grace_seconds
            grace_ended = grace_end <= now and c._grace_seen_end != grace_end
            if grace_ended:
                c._grace_seen_end = grace_end  # unjoined workers stop counting, in every mode
            if expired or stalled or grace_ended:
                c._membership_changed(*expired, *stalled)
            deadlines = [d for d in (c.membership.next_deadline(config.lease_seconds, config.progress_seconds),
                                     grace_end if grace_end > now else None) if d is not None]
            c._reaper_wake.wait(max(0.0, min(deadlines) - now) + 0.01 if deadlines else None)
