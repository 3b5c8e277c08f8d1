"""Sync mode's pending sums of row gradients: per table, the union of the ids pushed for a step and each id's
summed gradient row. No gRPC.

A sync step's buffer (aggregation.StepBuffer) keeps one RowSums beside its
dense sums. Each push that carries a table's ROWS tensor (tables.RowGradient:
ids, one gradient row per id, ids possibly repeated) adds to that table's sum:
the ids become the sorted union of every id pushed so far, a repeated id's
rows are summed (torch's sparse coalesce), and the table's push count goes up
by one, whether or not the push named any of this shard's rows (clients send
every table to every shard, empty where it has none). When the step applies,
averages() divides each table's summed rows by that count, exactly as a dense
variable's sum is divided by the number of pushes that carried it: a row
touched by one worker of two gets its gradient / 2, the gradient of one
process's mean loss over both workers' batches. Rows nobody pushed are not in
the union, so the lazy row optimizer never touches them.

Adding is two phases, so a buffer can take a push's dense and row gradients
all or nothing: staged() builds the new sums without touching the old ones
(it may raise; then nothing changed), commit() swaps them in (never raises).
Not thread-safe: the owner's lock (StepBuffer.lock) guards every call.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple, Protocol

import torch

from ..errors import InvalidArgumentError, TensorMismatchError
from .row_optimizers import coalesce

__all__ = ["RowSums", "AveragedRows"]


class _Rows(Protocol):
    ids: torch.Tensor     # 1-D int64
    values: torch.Tensor  # (len(ids), dim)


class AveragedRows(NamedTuple):
    """One table's averaged row gradient for a step: values[i] is the mean gradient of row ids[i] (ids sorted,
    distinct); `received`: gradient rows the step's pushes carried, before repeats were summed."""

    ids: torch.Tensor
    values: torch.Tensor
    received: int
    counts_step: bool = True  # a step's average counts one optimizer step (as a RowGradient does)


@dataclasses.dataclass(frozen=True)
class _Sum:
    ids: torch.Tensor     # sorted, distinct
    values: torch.Tensor  # the sum of each id's rows; owned here (never a pushed tensor)
    pushes: int           # pushes that carried this table: the divisor of the average
    received: int         # gradient rows those pushes carried


class RowSums:
    """The row-gradient sums of one sync step, by table (see the module docstring)."""

    def __init__(self) -> None:
        self._sums: dict[str, _Sum] = {}

    def staged(self, table_rows: Mapping[str, _Rows]) -> dict[str, _Sum]:
        """The sums as they will be once `table_rows` ({table: ids and rows}) is added; changes nothing.

        Raises InvalidArgumentError for ids that are not 1-D int64, TensorMismatchError for rows that are
        not one per id, or not of the dtype and width of the table's earlier pushes (the shard checked them
        against the table before). Never blocks.
        """
        out = {}
        for name, grad in table_rows.items():
            ids, values = grad.ids, grad.values.detach()
            old = self._sums.get(name)
            if ids.dtype != torch.int64 or ids.dim() != 1:
                raise InvalidArgumentError(f"row gradients of {name!r}: ids must be a 1-D int64 tensor, got "
                                           f"{ids.dtype} of shape {tuple(ids.shape)}")
            if values.dim() != 2 or values.shape[0] != len(ids) or (old is not None and (
                    values.dtype != old.values.dtype or values.shape[1] != old.values.shape[1])):
                raise TensorMismatchError(f"row gradients of {name!r} are {values.dtype}{list(values.shape)} for "
                                          f"{len(ids)} ids" + ("" if old is None else f"; the step's earlier ones "
                                          f"are {old.values.dtype} rows of {old.values.shape[1]}"))
            if old is not None:
                ids, values = torch.cat([old.ids, ids]), torch.cat([old.values, values])
            ids, values = coalesce(ids, values)  # fresh tensors: never the caller's
            out[name] = _Sum(ids, values, (old.pushes if old else 0) + 1,
                             (old.received if old else 0) + len(grad.ids))
        return out

    def commit(self, staged: Mapping[str, _Sum]) -> None:
        """Makes `staged` (from staged(), with no add in between) the sums. Never raises."""
        self._sums.update(staged)

    def add(self, table_rows: Mapping[str, _Rows]) -> None:
        """staged() then commit(): raises as staged() does, and then nothing changed."""
        self.commit(self.staged(table_rows))

    def averages(self) -> dict[str, AveragedRows]:
        """Each table's summed rows divided by the pushes that carried it (computed in place: call once, when
        the step is applied)."""
        return {name: AveragedRows(s.ids, s.values.div_(s.pushes), s.received) for name, s in self._sums.items()}

    def export(self) -> dict[str, dict]:
        """Copies of the sums, {table: {"ids", "values", "pushes", "received"}} (torch.save-able), for a saved
        state with pending sums (the journal's base); restore() takes it back."""
        return {name: {"ids": s.ids.clone(), "values": s.values.clone(), "pushes": s.pushes, "received": s.received}
                for name, s in self._sums.items()}

    @classmethod
    def restore(cls, state: Mapping[str, Mapping]) -> "RowSums":
        """The sums export() described."""
        sums = cls()
        sums.commit({name: _Sum(e["ids"], e["values"], int(e["pushes"]), int(e["received"]))
                     for name, e in state.items()})
        return sums

    def pushes(self, name: str) -> int:
        """Pushes that carried table `name` so far (0 if none)."""
        held = self._sums.get(name)
        return held.pushes if held is not None else 0

    def names(self) -> list[str]:
        return list(self._sums)

    def __bool__(self) -> bool:
        return bool(self._sums)
