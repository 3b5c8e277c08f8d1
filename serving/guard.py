"""A serving replica's loss guard (ps-serve --guard): a version is published only if the user's loss on it is
at most the current version's plus a bound, so a version that got worse on the user's held-out stream is never
served. No gRPC.

The guard is the user's function `loss(model) -> float`, named MODULE:FUNCTION
(an importable module) or PATH.py:FUNCTION (a file), called with a ModelView
(replica.py): `model.lookup(table, ids)` (rows, zeros where none is held)
and `model.dense(names)`. Before each publish the follower calls it on the
candidate (the current version with the round's changes laid over it, which
no lookup sees) and, once, on the current version for the baseline (one
that is not finite lets any finite loss pass). A candidate whose loss is
over baseline + max_increase, not finite, or whose function raised, is
refused: nothing is published, the follower's cursors do
not move (the next round reads those changes again with what came since), and
the refusal is counted and said in the replica's status. A version published
becomes the baseline. The function runs in the follower's thread: lookups
wait for the GIL meanwhile, so keep it to a few batches.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import pathlib
from typing import Callable

from ..errors import InvalidArgumentError
from .replica import ModelView

__all__ = ["LossGuard", "load_function"]

_LOGGER = logging.getLogger(__name__)


def load_function(spec: str) -> Callable[[ModelView], float]:
    """The function MODULE:FUNCTION or PATH.py:FUNCTION names; InvalidArgumentError if it cannot be loaded."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise InvalidArgumentError(f"--guard wants MODULE:FUNCTION or PATH.py:FUNCTION, got {spec!r}")
    try:
        if where.endswith(".py"):
            path = pathlib.Path(where)
            loader = importlib.util.spec_from_file_location(f"torchps_guard_{path.stem}", path)
            if loader is None or not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        function = getattr(module, name)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises on import
        raise InvalidArgumentError(f"--guard {spec}: cannot load it: {type(exc).__name__}: {exc}") from None
    if not callable(function):
        raise InvalidArgumentError(f"--guard {spec}: {name} is not a function")
    return function


class LossGuard:
    """Refuses versions whose loss grew by more than `max_increase` (see the module docstring). Used by one
    thread (the follower's)."""

    def __init__(self, loss: Callable[[ModelView], float], max_increase: float):
        if not math.isfinite(max_increase) or max_increase < 0:
            raise InvalidArgumentError(f"the guard's max increase must be finite and >= 0, got {max_increase}")
        self.loss, self.max_increase = loss, max_increase
        self.baseline: float | None = None  # the current version's loss (None: not measured yet)
        self.last = math.nan                # the last candidate's loss
        self.refused = 0                    # candidates refused

    def forget(self) -> None:
        """The current version changed without a check (a rollback, a checkpoint start): measure it again."""
        self.baseline = None

    def refusal(self, current: ModelView | None, candidate: ModelView) -> str:
        """Why `candidate` may not be published ("" if it may; then it is the baseline). `current`: the version
        it would replace (None: there is none, anything may be published)."""
        try:
            if self.baseline is None and current is not None:
                self.baseline = float(self.loss(current))
            self.last = float(self.loss(candidate))
        except Exception as exc:  # noqa: BLE001 - the user's function failed: publish nothing it did not pass
            self.refused += 1
            _LOGGER.warning("ps-serve: the guard's function failed: %s: %s", type(exc).__name__, exc)
            return f"the guard's function failed: {type(exc).__name__}: {exc}"
        worse = self.baseline is not None and math.isfinite(self.baseline) \
            and self.last > self.baseline + self.max_increase
        if worse or not math.isfinite(self.last):
            self.refused += 1
            served = "unknown" if self.baseline is None else f"{self.baseline:.6g}"
            return (f"the guard refused a version: loss {self.last:.6g} where the served version's is {served} "
                    f"(at most {self.max_increase:g} more may pass)")
        self.baseline = self.last
        return ""
