"""A shard's whole state as one value, and checkpoints taken at a given step. No gRPC.

`state_of` copies variables, optimizer state, embedding tables (rows, their
lazy optimizer state and dynamic tables' metadata: table_state.py), step, mode,
the push ledger and the membership (and, for the journal, sync mode's pending
sums); it runs under the apply gate alone, so every change is in it whole or
not at all, and a table's rows are those of the same step as the variables.
What it copied is written (a checkpoint, a journal's base) after the gate is
let go.

A checkpoint of step s is taken when the shard's step reaches s: exactly at s
in sync mode, where every shard passes through every step (the applier takes
it before applying step s if a save waits for it); at s or later in async and
ssp modes, where shards count their own pushes. A shard already past s in sync
mode fails with StepPassedError (the client asks again with a later step).
"""

from __future__ import annotations

import collections
from typing import Callable

from ..errors import StepPassedError, WaitTimeoutError
from . import table_state
from .bookkeeping import Bookkeeping
from .dataqueue import DataQueues
from .deposals import Deposals
from .own_promotions import OwnPromotions
from .gate import ApplyGate
from .layout import ShardLayout
from .replicas import ReplicaRegistry
from .resizes import ResizeOwner
from .store import VariableStore
from .tables import TableStore
from .waits import WaitLimit

__all__ = ["state_of", "Saves"]


def state_of(book: Bookkeeping, store: VariableStore, tables: TableStore, queues: DataQueues, *,
             with_pending: bool, then: Callable[[], object] | None = None,
             layout: ShardLayout | None = None, resize: ResizeOwner | None = None,
             replicas: ReplicaRegistry | None = None, deposals: Deposals | None = None,
             asks: OwnPromotions | None = None) -> dict:
    """A copy of the shard's state (call under the apply gate taken alone; the copy is the caller's, to use
    after leaving it); `then()` runs at the same instant, under the bookkeeping condition (a journal
    rotation), its value under the key "then". The data queues (dynamic sharding: queue_desk.py) are taken
    at that instant too, consistent with the push ledger. `layout`: the shard's layout epoch and exports
    (live resize), kept with the state; `resize`: ps 0's record of the job's resizes (resizes.py);
    `replicas`: ps 0's record of which address serves each replicated shard (replicas.py); `deposals`: ps 2's
    record of the deposed primaries of ps 0 and ps 1 (deposals.py); `asks`: an arbiter's asks of ps 2 not yet
    settled (own_promotions.py)."""
    variables = store.snapshot()
    table_section = table_state.section(tables)
    kept = book.export(with_pending=with_pending,
                       then=lambda: (queues.export(), then() if then is not None else None))
    queue_state, then_value = kept.pop("then")
    if then is not None:
        kept["then"] = then_value
    return {"step": kept.pop("step"), "config": kept.pop("config"), "variables": variables,
            "tables": table_section, "queues": queue_state,
            **({"layout": layout.export()} if layout is not None and layout.epoch else {}),
            **({"resize": resize.export()} if resize is not None and resize.state()["id"] else {}),
            **({"replicas": record} if replicas is not None and (record := replicas.export()) else {}),
            **({"deposed": deposed} if deposals is not None and (deposed := deposals.export()) else {}),
            **({"asks": pending} if asks is not None and (pending := asks.export()) else {}), **kept}


class Saves:
    """Checkpoints waiting for their step. Its state is guarded by the bookkeeping condition, which its waits
    use; `copy()` gives the whole state (state_of; call it under the apply gate taken alone)."""

    def __init__(self, book: Bookkeeping, gate: ApplyGate, waits: WaitLimit, copy: Callable[[], dict]):
        self._book = book
        self._gate = gate
        self._waits = waits
        self._copy = copy
        self._due: collections.Counter[int] = collections.Counter()  # step -> saves waiting for it
        self._taken: dict[int, dict] = {}                              # kept until the last of them has it

    def due(self, step: int) -> bool:
        """True if a save waits for a state at `step` and none was taken yet (holds the bookkeeping
        condition)."""
        return self._due[step] > 0 and step not in self._taken

    def take(self, step: int) -> None:
        """Copies the state for the saves waiting at `step`, if the shard is still there (the applier's call).
        Blocks on the apply gate (taken alone) while it copies."""
        book = self._book
        with self._gate.snapshot():
            with book.cond:
                if not self.due(step) or book.store.step != step:
                    return
            state = self._copy()
        with book.cond:
            self._taken[step] = state
            book.cond.notify_all()

    def now(self) -> dict:
        """The state at once, whatever the step (takes the apply gate alone while it copies)."""
        with self._gate.snapshot():
            return self._copy()

    def snapshot_at(self, step: int, deadline: float, cancelled: Callable[[], bool], *, now: bool) -> dict:
        """The state for a checkpoint of `step` (see the module docstring); `now`: at once, whatever the step.

        A job whose workers have all gone saves at once too (nobody will move
        it on). Blocks until then: WaitTimeoutError at `deadline`,
        ServerUnavailableError once the shard closes, StepPassedError as the
        module docstring says.
        """
        if now:
            return self.now()
        book = self._book
        store = book.store
        sync = book.clock.config.mode == "sync"
        with book.cond:
            book.check_open()
            if sync and store.step > step:
                raise StepPassedError(f"this shard is already at step {store.step}, past the checkpoint's "
                                      f"step {step}")
            self._due[step] += 1
            try:
                while True:
                    with self._waits.slot("save"):
                        book.cond.wait_for(lambda: step in self._taken or store.step >= step or book.idle()
                                           or cancelled() or book.closed, book.clock.left(deadline))
                    book.check_open()
                    if step in self._taken:
                        return self._taken[step]
                    if sync and store.step > step:  # jumped over it (a shard catching up)
                        raise StepPassedError(f"this shard moved from before step {step} to {store.step} "
                                              f"without stopping at it")
                    if not (store.step >= step or book.idle() or cancelled()):
                        raise WaitTimeoutError(f"the shard did not reach step {step} (at {store.step}) in time "
                                               f"to save")
                    with book.released():  # copy without the bookkeeping condition: only the gate stops changes
                        with self._gate.snapshot():
                            with book.cond:
                                exact = store.step == step or not sync or book.idle()
                            if exact:
                                return self._copy()
            finally:
                self._due[step] -= 1
                if not self._due[step]:
                    del self._due[step]
                    self._taken.pop(step, None)
