"""A shard's limits: memory for values and optimizer state, the size of one variable, calls per client.

Sizes are checked against what a CreateVariables stream declares (each spec's
dtype and shape), before any of its bytes are received or allocated; a call
over a limit gets RESOURCE_EXHAUSTED naming the limit, nothing is created, and
the shard keeps serving everyone else: ShardBusyError where the call may pass
once others end (a client's calls in progress, pushes being received), which
clients retry, else ResourceExhaustedError, which they raise. --max-memory
counts what the shard holds (variables with their optimizer state, embedding
tables) and, while a push is being received, its buffers: each tensor of a push
is reserved (`reserve`) before its buffer is allocated. No gRPC.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Callable

from .. import codec
from ..errors import ResourceExhaustedError, ShardBusyError
from ..proto import ps_pb2

__all__ = ["Quotas", "Reservation", "state_bytes", "optimizer_slots"]

def optimizer_slots(name: str, hyperparams) -> int:
    """Tensors of a variable's size that optimizer `name` keeps per variable."""
    hyper = dict(hyperparams)
    return {"sgd": 1 if hyper.get("momentum", 0.0) else 0, "adagrad": 1,
            "adam": 3 if hyper.get("amsgrad", 0.0) else 2, "adamw": 3 if hyper.get("amsgrad", 0.0) else 2
            }.get(name.lower(), 0)


def state_bytes(spec: ps_pb2.VariableSpec) -> int:
    """Bytes a variable takes on a shard: its value and its optimizer's per-element state."""
    return codec.meta_nbytes(spec.meta) * (1 + optimizer_slots(spec.optimizer.name, spec.optimizer.hyperparams))


class Quotas:
    """The limits of one shard (0: none) and the bookkeeping they need. Thread-safe."""

    def __init__(self, *, max_memory: int = 0, max_variable_bytes: int = 0, max_calls_per_client: int = 0):
        self.max_memory = max_memory
        self.max_variable_bytes = max_variable_bytes
        self.max_calls_per_client = max_calls_per_client
        self._lock = threading.Lock()
        self._calls: collections.Counter[str] = collections.Counter()
        self._in_flight = 0  # bytes reserved by pushes being received
        self._kept = 0  # bytes kept for later calls: free receive buffers (buffers.py), cached pulls (pull_cache.py)

    def reservation(self, held: Callable[[], int]) -> "Reservation":
        """A push's reservation; `held()` is what the shard holds (read once, at its first tensor)."""
        return Reservation(self, held)

    def reserve(self, held: int, nbytes: int, what: str) -> None:
        """Counts `nbytes` of a push's buffer (for `what`) as in flight until release(); reserving nothing, if
        that with `held` and what other pushes reserved is over --max-memory: ShardBusyError where it would fit
        without the others, else ResourceExhaustedError."""
        with self._lock:
            if self.max_memory and held + self._in_flight + self._kept + nbytes > self.max_memory:
                busy = held + nbytes <= self.max_memory
                raise (ShardBusyError if busy else ResourceExhaustedError)(
                    f"{what} needs {nbytes} bytes to be received; this shard holds {held}, pushes being received "
                    f"hold {self._in_flight}, kept receive buffers and cached pulls {self._kept}, and its "
                    f"--max-memory is {self.max_memory}; nothing was applied "
                    f"({'it fits once they are in: retry' if busy else 'raise the limit, or push less at once'})")
            self._in_flight += nbytes

    def keep(self, held: Callable[[], int], nbytes: int) -> bool:
        """Counts a free receive buffer or a cached pull of `nbytes` as held until release_kept(); False (nothing
        counted) if that would take what is held (`held()`) and reserved past --max-memory. Without --max-memory
        True."""
        if not self.max_memory:
            with self._lock:
                self._kept += nbytes
            return True
        held_now = held()
        with self._lock:
            if held_now + self._in_flight + self._kept + nbytes > self.max_memory:
                return False
            self._kept += nbytes
            return True

    def release_kept(self, nbytes: int) -> None:
        """Ends keep()'s count of `nbytes` (a buffer taken by a push or let go, a cached pull let go)."""
        with self._lock:
            self._kept -= nbytes

    def release(self, nbytes: int) -> None:
        """Ends a reservation's `nbytes` (the push was applied, refused or abandoned)."""
        with self._lock:
            self._in_flight -= nbytes

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def check_variable(self, spec: ps_pb2.VariableSpec, held: int, incoming: int) -> int:
        """The bytes `spec` would take; ResourceExhaustedError if it is over a limit with `held` bytes already
        on the shard and `incoming` declared earlier in the same stream."""
        nbytes = codec.meta_nbytes(spec.meta)
        if self.max_variable_bytes and nbytes > self.max_variable_bytes:
            raise ResourceExhaustedError(
                f"variable {spec.name!r} declares {nbytes} bytes, over this shard's --max-variable-bytes "
                f"{self.max_variable_bytes}; nothing was created")
        total = state_bytes(spec)
        if self.max_memory and held + incoming + total > self.max_memory:
            raise ResourceExhaustedError(
                f"variable {spec.name!r} with its optimizer state needs {total} bytes; this shard holds {held} "
                f"and its --max-memory is {self.max_memory}; nothing was created (add shards, or raise the limit)")
        return total

    def check_total(self, held: int, adding: dict[str, int], *, what: str = "") -> None:
        """The last check before variables are created or grow (one call at a time): ResourceExhaustedError
        if `adding` (bytes by name) on top of `held` is over --max-memory, as when streams ran at once.
        `what` names what grows ("optimizer state"), else new variables with their state."""
        if self.max_memory and held + sum(adding.values()) > self.max_memory:
            needs = f"the {what} of variables {sorted(adding)}" if what else \
                f"variables {sorted(adding)} with their optimizer state"
            raise ResourceExhaustedError(
                f"{needs} need {sum(adding.values())} more bytes; this shard now holds {held} and its --max-memory "
                f"is {self.max_memory}; nothing was {'changed' if what else 'created'}")

    def check_admission(self, held: int, tables: list[str]) -> None:
        """Before an admitting lookup of dynamic `tables`: ResourceExhaustedError once the shard holds its
        --max-memory or more (a lookup's new rows may take it past by their bytes; the next is refused)."""
        if self.max_memory and held >= self.max_memory:
            raise ResourceExhaustedError(
                f"this shard holds {held} bytes, its --max-memory is {self.max_memory}: dynamic tables {tables} "
                f"admit no more rows (give them capacity= or max_age= so that they evict); nothing was admitted")

    @contextlib.contextmanager
    def call(self, client: str):
        """Held while `client` has a call in progress; ShardBusyError past --max-calls-per-client."""
        if not self.max_calls_per_client:
            yield
            return
        with self._lock:
            if self._calls[client] >= self.max_calls_per_client:
                raise ShardBusyError(
                    f"{client} already has {self._calls[client]} calls in progress on this shard, its "
                    f"--max-calls-per-client; this one was refused and changed nothing")
            self._calls[client] += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls[client] -= 1


class Reservation:
    """The bytes one push being received holds against --max-memory (Quotas.reservation); not thread-safe: one
    per push, released when the push is over."""

    def __init__(self, quotas: Quotas, held: Callable[[], int]):
        self._quotas, self._held = quotas, held
        self._held_then: int | None = None
        self.nbytes = 0

    def add(self, nbytes: int, what: str) -> None:
        """Reserves `nbytes` for `what` (nothing without --max-memory); ResourceExhaustedError over the limit."""
        if not self._quotas.max_memory:
            return
        if self._held_then is None:
            self._held_then = self._held()
        self._quotas.reserve(self._held_then, nbytes, what)
        self.nbytes += nbytes

    def release(self) -> None:
        if self.nbytes:
            self._quotas.release(self.nbytes)
            self.nbytes = 0
