"""A shard's whole state as one value, and checkpoints taken at a given step. No gRPC.

`state_of` copies variables, optimizer state, embedding tables (rows, their
lazy optimizer state and dynamic tables' metadata: table_state.py), step, mode,
the push ledger and the membership (and, for the journal, sync mode's pending
sums); it runs under the apply gate alone, so every change is in it whole or
not at all, and a table's rows are those of the same step as the variables.

A checkpoint of step s is taken when the shard's step reaches s: exactly at s
in sync mode, where every shard passes through every step (the applier takes
it before applying step s if a save waits for it); at s or later in async and
ssp modes, where shards count their own pushes. A shard already past s in sync
mode fails with StepPassedError (the client asks again with a later step).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Callable

from ..errors import StepPassedError, WaitTimeoutError
from . import table_state

if TYPE_CHECKING:
    from .coordinator import Coordinator

__all__ = ["state_of", "Saves"]


def state_of(coordinator: "Coordinator", *, with_pending: bool, then: Callable[[], object] | None = None,
             copy: bool = True) -> dict:
    """The shard's state (call under coordinator.gate.snapshot()); `then()` runs at the same instant, under
    the bookkeeping lock (a journal rotation), its value under the key "then". `copy=False`: the variables'
    values are their own tensors, not copies (use them before leaving the gate)."""
    variables = coordinator.store.snapshot(copy=copy)
    tables = table_state.section(coordinator.tables)
    with coordinator._cond:
        step = coordinator.store.step
        state = {"step": step, "config": dataclasses.asdict(coordinator.config), "variables": variables,
                 "tables": tables,
                 "ledger": coordinator.ledger.export(step, with_pending=with_pending),
                 "membership": coordinator.membership.export()}
        state["queues"] = coordinator.queues.export()  # data queues (dynamic sharding): queue_desk.py
        if with_pending:
            state["pending"] = coordinator.pending.export()
        if then is not None:
            state["then"] = then()
    return state


class Saves:
    """Checkpoints waiting for their step. The coordinator's lock guards it."""

    def __init__(self, coordinator: "Coordinator"):
        self._c = coordinator
        self._due: collections.Counter[int] = collections.Counter()  # step -> saves waiting for it
        self._taken: dict[int, dict] = {}                              # kept until the last of them has it

    def due(self, step: int) -> bool:
        """True if a save waits for a state at `step` and none was taken yet (holds the lock)."""
        return self._due[step] > 0 and step not in self._taken

    def take(self, step: int) -> None:
        """Copies the state for the saves waiting at `step`, if the shard is still there (the applier's call)."""
        c = self._c
        with c.gate.snapshot():
            with c._cond:
                if not self.due(step) or c.store.step != step:
                    return
            state = state_of(c, with_pending=False)
        with c._cond:
            self._taken[step] = state
            c._cond.notify_all()

    def snapshot_at(self, step: int, deadline: float, cancelled: Callable[[], bool], *, now: bool) -> dict:
        """The state for a checkpoint of `step` (see the module docstring); `now`: at once, whatever the step.

        A job whose workers have all gone saves at once too (nobody will move
        it on). Blocks until then: WaitTimeoutError at `deadline`.
        """
        c = self._c
        if now:
            return c.state(with_pending=False)
        sync = c.config.mode == "sync"
        with c._cond:
            c._check_open()
            if sync and c.store.step > step:
                raise StepPassedError(f"this shard is already at step {c.store.step}, past the checkpoint's "
                                        f"step {step}")
            self._due[step] += 1
            try:
                while True:
                    with c.waits.slot("save"):
                        c._cond.wait_for(lambda: step in self._taken or c.store.step >= step or self._idle()
                                         or cancelled() or c._closed, c._left(deadline))
                    c._check_open()
                    if step in self._taken:
                        return self._taken[step]
                    if sync and c.store.step > step:  # jumped over it (a shard catching up)
                        raise StepPassedError(f"this shard moved from before step {step} to {c.store.step} "
                                                f"without stopping at it")
                    if not (c.store.step >= step or self._idle() or cancelled()):
                        raise WaitTimeoutError(f"the shard did not reach step {step} (at {c.store.step}) in time "
                                               f"to save")
                    c._cond.release()  # copy without the bookkeeping lock: only the gate stops changes
                    try:
                        with c.gate.snapshot():
                            with c._cond:
                                exact = c.store.step == step or not sync or self._idle()
                            if exact:
                                return state_of(c, with_pending=False)
                    finally:
                        c._cond.acquire()
            finally:
                self._due[step] -= 1
                if not self._due[step]:
                    del self._due[step]
                    self._taken.pop(step, None)

    def _idle(self) -> bool:
        """The job has ended: workers joined and none is live, nothing pending."""
        m = self._c.membership
        return bool(m.members) and not m.live() and not self._c.pending.buffers
