"""Sync mode's pending sums: one buffer per step, filled by pushes, taken whole by the applier. No gRPC.

    step s OPEN ──(pushes tagged s reach the quorum)──> APPLYING ──> applied, step = s + 1
      pushes tagged < open step: stale (dropped and counted by the coordinator)
      pushes tagged > s: summed in their own buffer until s + 1 opens

A push reserves its place in a buffer under the coordinator's lock, sums its
gradients under the buffer's own lock (so a big sum never holds up status or
membership calls), then counts itself under the coordinator's lock again.
The applier takes a buffer only when the quorum has counted in and no sum is
in progress.

Row gradients (embedding tables' ROWS tensors) join the same buffer, in a
row_sums.RowSums: per table the union of the ids pushed for the step, each
id's rows summed, averaged over the pushes that carried the table, as a dense
variable's sum is over the pushes that carried it. A buffer's dense and row
sums take a push all or nothing and leave the step together: stale pushes,
backup workers' extra pushes and retries never reach a buffer (the
coordinator drops or answers them first).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Mapping

import torch

from .row_sums import AveragedRows, RowSums

__all__ = ["StepBuffer", "PendingSteps"]


class StepBuffer:
    """The sums of the gradients pushed for one step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards sums, counts and rows while a push adds to them
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self.rows = RowSums()  # embedding tables' row gradients
        self.by_worker: collections.Counter[str] = collections.Counter()  # guarded by the coordinator's lock
        self.pushes = 0    # pushes counted in (coordinator's lock)
        self.adding = 0    # pushes reserved, still summing (coordinator's lock)

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
                    "by_worker": dict(self.by_worker), "pushes": self.pushes, "rows": self.rows.export()}

    @classmethod
    def restore(cls, state: dict) -> "StepBuffer":
        buffer = cls()
        buffer.sums = dict(state["sums"])
        buffer.counts.update(state["counts"])
        buffer.by_worker.update(state["by_worker"])
        buffer.pushes = state["pushes"]
        buffer.rows = RowSums.restore(state.get("rows", {}))  # absent in states saved before tables were
        return buffer


class PendingSteps:
    """The buffers of the steps not yet applied. The coordinator's lock guards this object."""

    def __init__(self) -> None:
        self.buffers: dict[int, StepBuffer] = {}
        self.applying: int | None = None  # the step the applier is applying now

    def open_step(self, store_step: int) -> int:
        """The lowest step a push may still be counted in."""
        return store_step + 1 if self.applying is not None else store_step

    def reserve(self, step: int) -> StepBuffer:
        buffer = self.buffers.setdefault(step, StepBuffer())
        buffer.adding += 1
        return buffer

    @staticmethod
    def counted(buffer: StepBuffer, worker: str) -> None:
        buffer.adding -= 1
        buffer.pushes += 1
        buffer.by_worker[worker] += 1

    @staticmethod
    def unreserve(buffer: StepBuffer) -> None:
        buffer.adding -= 1

    def next_ready(self, store_step: int, quorum: int) -> tuple[str, int] | None:
        """("apply", s) when step s (the store's step) can be applied; ("jump", s) when a later step s is
        complete while nothing at all was counted for the store's step (a shard that lost its place: nobody
        will push for it); else None. A gradient counted for the store's step is never jumped over."""
        if self.applying is not None:
            return None
        buffer = self.buffers.get(store_step)
        if buffer is not None and buffer.pushes >= quorum and not buffer.adding:
            return "apply", store_step
        if buffer is not None and (buffer.pushes or buffer.adding):
            return None
        later = [s for s, b in self.buffers.items() if s > store_step and b.pushes >= quorum and not b.adding]
        return ("jump", min(later)) if later else None

    def drop_before(self, step: int) -> None:
        for old in [s for s in self.buffers if s < step]:
            del self.buffers[old]

    def clear(self) -> None:
        self.buffers.clear()

    def export(self) -> dict:
        return {step: buffer.export() for step, buffer in self.buffers.items()}

    def restore(self, state: dict) -> None:
        self.buffers = {int(step): StepBuffer.restore(entry) for step, entry in state.items()}
