"""Sync mode's pending sums: one buffer per step, filled by pushes, taken whole by the applier. No gRPC.

    step s OPEN ──(pushes tagged s reach the quorum)──> APPLYING ──> applied, step = s + 1
      pushes tagged < open step: stale (dropped and counted by the coordinator)
      pushes tagged > s: summed in their own buffer until s + 1 opens

A push reserves its place in a buffer, sums its gradients under the buffer's
own lock (so a big sum never holds up status or membership calls), then
counts itself. The applier takes a buffer only when the quorum has counted in
and no sum is in progress; apply_step applies it.

Row gradients (embedding tables' ROWS tensors) join the same buffer, in a
row_sums.RowSums: per table the union of the ids pushed for the step, each
id's rows summed, averaged over the pushes that carried the table, as a dense
variable's sum is over the pushes that carried it. A buffer's dense and row
sums take a push all or nothing and leave the step together: stale pushes,
backup workers' extra pushes and retries never reach a buffer (the
coordinator drops or answers them first).

Thread-safe: PendingSteps' own lock (an "owner" in locks.LOCK_ORDER) guards
the buffers, their counts, the step being applied, the quorum and the
counters; a StepBuffer's lock ("sums") guards its sums while a push adds to them.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Mapping

import torch

from .locks import checked, guarded
from .row_sums import AveragedRows, RowSums

__all__ = ["StepBuffer", "PendingSteps", "apply_step", "apply_averages"]


class StepBuffer:
    """The sums of the gradients pushed for one step."""

    def __init__(self) -> None:
        self.lock = checked(threading.Lock(), "sums", "a step's sums")  # guards sums, counts and rows as a push adds
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self.rows = RowSums()  # embedding tables' row gradients
        self.by_worker: collections.Counter[str] = collections.Counter()  # guarded by its PendingSteps' lock
        self.pushes = 0    # pushes counted in (its PendingSteps' lock)
        self.adding = 0    # pushes reserved, still summing (its PendingSteps' lock)
        self.pushed: list[tuple[str, int, int]] = []  # (worker, incarnation, seq) of each push counted in (same)
        self.aggregated = False  # a push's "add" went unrecorded: the step's record carries the averages (same)

    def add(self, grads: Mapping[str, torch.Tensor], then: Callable[[], None] = lambda: None,
            rows: Mapping[str, object] | None = None) -> None:
        """Adds one push's dense gradients and its row gradients `rows` ({table: tables.RowGradient}, validated
        by the shard); `then()` runs under the same lock (the journal record, in order).

        Blocks only on the buffer's lock (other pushes' sums). The row sums are
        computed first, without changing anything, so if they raise the buffer
        is as it was.
        """
        with self.lock:
            staged = self.rows.staged(rows or {})
            for name, grad in grads.items():
                if name in self.sums:
                    self.sums[name].add_(grad)
                else:
                    self.sums[name] = grad.clone()
                self.counts[name] += 1
            self.rows.commit(staged)
            then()

    def averages(self) -> dict[str, torch.Tensor]:
        """Each variable's mean gradient (computed in place: call once, when the step is applied)."""
        return {name: total.div_(self.counts[name]) for name, total in self.sums.items()}

    def row_averages(self) -> dict[str, AveragedRows]:
        """Each table's mean row gradient on the union of its pushed ids (row_sums.RowSums.averages; computed
        in place: call once, when the step is applied)."""
        return self.rows.averages()

    def export(self) -> dict:
        with self.lock:
            return {"sums": {n: t.clone() for n, t in self.sums.items()}, "counts": dict(self.counts),
                    "by_worker": dict(self.by_worker), "pushes": self.pushes, "rows": self.rows.export(),
                    "pushed": [list(p) for p in self.pushed], "aggregated": self.aggregated}

    @classmethod
    def restore(cls, state: dict) -> "StepBuffer":
        buffer = cls()
        buffer.sums = dict(state["sums"])
        buffer.counts.update(state["counts"])
        buffer.by_worker.update(state["by_worker"])
        buffer.pushes = state["pushes"]
        buffer.rows = RowSums.restore(state.get("rows", {}))  # absent in states saved before tables were
        buffer.pushed = [tuple(p) for p in state.get("pushed", ())]  # absent before aggregated records were
        buffer.aggregated = state.get("aggregated", False)
        return buffer


class PendingSteps:
    """The buffers of the steps not yet applied, the quorum a step needs, and what was counted of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.buffers: dict[int, StepBuffer] = {}
        self._applying: int | None = None  # the step the applier is applying now
        self._quorum = 0
        self._quorum_changes = 0
        self._stale_dropped = 0

    @guarded
    def reset(self) -> None:
        """Drops every buffer (a new job); the quorum and counters stay until the mode is set again."""
        self.buffers = {}
        self._applying = None

    # -- pushes ----------------------------------------------------------------------------------

    @guarded
    def open_step(self, store_step: int) -> int:
        """The lowest step a push may still be counted in."""
        return self._open(store_step)

    def _open(self, store_step: int) -> int:
        return store_step + 1 if self._applying is not None else store_step

    @guarded
    def counted_through(self, store_step: int) -> int:
        """The open step, past every step after it whose quorum is counted already (to be applied next, in
        order): the first step this shard still waits for pushes of."""
        return self._counted_through(store_step)

    def _counted_through(self, store_step: int) -> int:
        step = self._open(store_step)
        while (buffer := self.buffers.get(step)) is not None and buffer.pushes >= self._quorum and not buffer.adding:
            step += 1
        return step

    @guarded
    def pushed_awaited(self, store_step: int, worker: str) -> bool:
        """Whether `worker` has a push counted in the first step this shard still waits for pushes of."""
        buffer = self.buffers.get(self._counted_through(store_step))
        return buffer is not None and buffer.by_worker[worker] > 0

    @guarded
    def awaited(self, store_step: int) -> tuple[int, int, list[str]]:
        """(the first step this shard still waits for pushes of, the pushes counted in it, the workers that
        pushed them, sorted): what a push held for its release waits for (GetStatus)."""
        step = self._counted_through(store_step)
        buffer = self.buffers.get(step)
        if buffer is None:
            return step, 0, []
        return step, buffer.pushes, sorted(w for w, n in buffer.by_worker.items() if n)

    @guarded
    def waiting_for(self, store_step: int) -> str:
        """What the first step this shard still waits for pushes of has (for refusals that name it)."""
        step = self._counted_through(store_step)
        buffer = self.buffers.get(step) or StepBuffer()
        by = ", ".join(f"{w} {n}" for w, n in sorted(buffer.by_worker.items()) if n)
        return (f"step {step} has {buffer.pushes} of its quorum {self._quorum} pushes"
                + (f" ({by})" if by else "") + (f", {buffer.adding} adding" if buffer.adding else ""))

    @guarded
    def hold_floor(self, store_step: int) -> int:
        """The lowest step pushes may be held from (layout.py's hold): the open step, past every step a push
        was counted or is adding in (that step must complete)."""
        busy = [s for s, b in self.buffers.items() if b.pushes or b.adding]
        return max([self._open(store_step), *(s + 1 for s in busy)])

    @guarded
    def idle(self) -> bool:
        """No push counted or adding in any step (nothing summed that a move could split)."""
        return self._applying is None and not any(b.pushes or b.adding for b in self.buffers.values())

    @guarded
    def reserve(self, step: int) -> StepBuffer:
        """A place in the buffer of `step` for a push about to add its gradients (counted() or unreserve()
        ends it)."""
        buffer = self.buffers.setdefault(step, StepBuffer())
        buffer.adding += 1
        return buffer

    @guarded
    def counted(self, buffer: StepBuffer, worker: str, push: tuple[str, int, int], recorded: bool = True) -> None:
        """The push `push` (worker, incarnation, seq) that reserved a place in `buffer` added its gradients: it
        counts for `worker`. `recorded` False: its "add" has no journal record (the step's record carries it)."""
        buffer.adding -= 1
        buffer.pushes += 1
        buffer.by_worker[worker] += 1
        buffer.pushed.append(push)
        buffer.aggregated = buffer.aggregated or not recorded

    @guarded
    def unreserve(self, buffer: StepBuffer) -> None:
        """The push that reserved a place in `buffer` failed before it added anything."""
        buffer.adding -= 1

    @guarded
    def counts(self, step: int, worker: str) -> tuple[int, int]:
        """(pushes counted or adding for `step`, those of `worker`)."""
        buffer = self.buffers.get(step)
        return (buffer.pushes + buffer.adding, buffer.by_worker[worker]) if buffer else (0, 0)

    @guarded
    def wants_more(self, step: int, worker: str, per_worker: int) -> bool:
        """Whether `step` is still open to more of `worker`'s batches (fewer than `per_worker` counted, and
        not being applied)."""
        buffer = self.buffers.get(step)
        return buffer is not None and self._applying != step and buffer.by_worker[worker] < per_worker

    @guarded
    def count_stale(self) -> None:
        """Counts a push dropped as stale (computed at a step already applied)."""
        self._stale_dropped += 1

    @property
    @guarded
    def stale_dropped(self) -> int:
        return self._stale_dropped

    # -- the quorum --------------------------------------------------------------------------------

    @property
    @guarded
    def quorum(self) -> int:
        """Pushes a sync step needs (modes.quorum_for; 0 outside sync mode)."""
        return self._quorum

    @guarded
    def set_quorum(self, quorum: int, *, counted: bool) -> int:
        """Sets the quorum; returns the one before. `counted`: a change counts in quorum_changes."""
        previous, self._quorum = self._quorum, quorum
        if counted and quorum != previous:
            self._quorum_changes += 1
        return previous

    @property
    @guarded
    def quorum_changes(self) -> int:
        return self._quorum_changes

    # -- the applier -------------------------------------------------------------------------------

    @guarded
    def next_ready(self, store_step: int) -> tuple[str, int] | None:
        """("apply", s) when step s (the store's step) can be applied; ("jump", s) when a later step s is
        complete while nothing at all was counted for the store's step (a shard that lost its place: nobody
        will push for it); else None. A gradient counted for the store's step is never jumped over."""
        if self._applying is not None:
            return None
        quorum = self._quorum
        buffer = self.buffers.get(store_step)
        if buffer is not None and buffer.pushes >= quorum and not buffer.adding:
            return "apply", store_step
        if buffer is not None and (buffer.pushes or buffer.adding):
            return None
        later = [s for s, b in self.buffers.items() if s > store_step and b.pushes >= quorum and not b.adding]
        return ("jump", min(later)) if later else None

    @guarded
    def start_applying(self, kind: str, step: int) -> StepBuffer | None:
        """The applier takes step `step` (next_ready's): its buffer for "apply", None for "jump"."""
        self._applying = step
        return self.buffers[step] if kind == "apply" else None

    @guarded
    def applying(self, step: int) -> bool:
        """Whether the applier is applying `step` now (its record not yet queued)."""
        return self._applying == step

    @guarded
    def replace(self, step: int) -> StepBuffer:
        """A new empty buffer for `step` in place of the one it had (replay of a record carrying the step's
        averages); the buffer it replaces (or an empty one)."""
        old = self.buffers.get(step) or StepBuffer()
        self.buffers[step] = StepBuffer()
        return old

    @guarded
    def done_applying(self, store_step: int) -> None:
        """The applier is done: buffers before `store_step` go."""
        self._drop_before(store_step)
        self._applying = None

    # -- the rest ----------------------------------------------------------------------------------

    @guarded
    def drop_before(self, step: int) -> None:
        self._drop_before(step)

    def _drop_before(self, step: int) -> None:
        for old in [s for s in self.buffers if s < step]:
            del self.buffers[old]

    @guarded
    def buffer(self, step: int) -> StepBuffer:
        """The buffer of `step` (KeyError if there is none)."""
        return self.buffers[step]

    @guarded
    def clear(self) -> None:
        self.buffers.clear()

    @guarded
    def is_empty(self) -> bool:
        return not self.buffers

    @guarded
    def export(self) -> dict:
        return {step: buffer.export() for step, buffer in self.buffers.items()}

    @guarded
    def restore(self, state: dict) -> None:
        self.buffers = {int(step): StepBuffer.restore(entry) for step, entry in state.items()}


def apply_step(buffer: StepBuffer, step: int, store, tables) -> tuple[dict[str, torch.Tensor], dict[str, AveragedRows]]:
    """Applies sync step `step` (`store`'s step) from its buffer (apply_averages); returns the (dense, row)
    averages it applied (a step record that carries them: background.step_record)."""
    averaged = buffer.row_averages()
    dense = buffer.averages()
    apply_averages(dense, averaged, step, store, tables)
    return dense, averaged


def apply_averages(dense: Mapping[str, torch.Tensor], averaged: Mapping[str, AveragedRows], step: int, store,
                   tables) -> None:
    """Applies sync step `step` (`store`'s step): first every table's averaged row gradients `averaged`, one
    lazy optimizer step each on the union of the ids pushed (tables.apply at step + 1, then eviction, as an
    async push at that step), then the dense averages `dense`, which advance the store's step. So a call
    that sees the new step (a released push, a min_step pull) sees the rows applied too. The applier's call
    (and the journal's replay), under the apply gate and the journal's ordering, not the bookkeeping
    condition; blocks on the tables' and variables' locks only. The rows were validated when pushed, so it
    raises only if a table vanished or on a bug: then the tables before it are updated and the store's step
    has not moved."""
    if averaged:
        tables.apply(averaged, step + 1, received={name: rows.received for name, rows in averaged.items()})
    store.apply(dense, step_increment=1, validated=True)
