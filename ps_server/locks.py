"""The order in which a shard's threads take its locks, written once: LOCK_ORDER; and its checker. No gRPC.

A thread holding a lock of one rank takes locks of later ranks only. An
owner's lock is a leaf: held inside that owner's own methods, which call no
other owner, so no thread holds two owners' locks at once, and none takes the
bookkeeping condition or the gate while holding one.

    promotion    own_promotions.OwnPromotions's lock (ps 0 and ps 1): one promotion of the other's backup
                 at a time, held across its ask's journal record and its call to ps 2, each of which ends
                 within its timeout (the one lock held while waiting for the disk: it serializes
                 promotions and take-backs only, and no other lock is taken waiting for it)
    gate         gate.ApplyGate: shared while variables, tables or the step change; alone
                 while a whole state is copied in memory (a checkpoint, a journal compaction), and
                 while a live resize's export takes what leaves out of the store (moves.Moves.export:
                 no copy; it is encoded after the gate is let go) or cuts table rows for every new
                 shard (export_tables: torch.save into memory, never to disk)
    ordering     recording.Recorder.ordering (with a journal): a change to variables or tables and
                 the queueing of its record, so the journal replays them in the order they happened
    receiving    moves.Moves's import lock: an import checked (held already? placed here?) and made at
                 one time, so a retried import that overlaps its original finds it done
    bookkeeping  bookkeeping.Bookkeeping.cond: a decision that reads or changes several owners (a
                 push's admission, a lease and the quorum, catching up), and every wait; it also
                 guards the saves waiting for their step (snapshots.Saves)
    owner        one owner's lock, inside its methods: membership.Membership, ledger.PushLedger,
                 aggregation.PendingSteps, step_clock.StepClock, waits.WaitLimit,
                 layout.ShardLayout, store.VariableStore and tables.TableStore (with their variables' and
                 tables' locks), replicas.ReplicaRegistry, deposals.Deposals, tokens.TokenFile (the
                 token table, taken by the gRPC edge only)
    sums         aggregation.StepBuffer.lock: a push's gradients added to a sync step's sums
    compaction   recording.Recorder's lock: whether a compaction runs
    journal      journal.Journal's queue: a record is queued (never written: the journal's thread writes)

No lock of these but the promotion lock is held while the shard writes to disk: the journal's
thread writes records holding none; a caller waits for its record
(Recorder.durable) holding none; a compaction copies the state under the
gate alone and writes the base after letting go of it, as a checkpoint does.
The bookkeeping condition is held for bookkeeping only: never while a
gradient is applied or summed, a value copied or a file written, so status,
joins, heartbeats and leaves never wait behind an apply or a save.

The checker. With TORCHPS_LOCK_CHECK=1 in a process's environment when it
imports this module (the test suite sets it), the locks above are checked as
they are taken (an owner's through `guarded`; the variables' and tables' own
locks are not): taking one of an earlier rank than a lock the thread holds,
two locks of one rank at once (two owners), a non-re-entrant lock the thread
holds already, waiting on a condition while holding a later lock, or waiting
for or writing to the journal's files holding any (check_unlocked) raises
LockOrderError in that thread, naming the locks and the thread, before it
could deadlock; it is logged too, for code that catches it. Unset, nothing
is wrapped: `checked` returns the lock itself, the decorators the method
itself, and check_unlocked returns at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from typing import Callable, TypeVar

__all__ = ["LOCK_ORDER", "CHECK_ENV", "CHECKING", "LockOrderError", "guarded", "checked", "ranked",
           "check_unlocked"]

LOCK_ORDER = ("promotion", "gate", "ordering", "receiving", "bookkeeping", "owner", "sums", "compaction", "journal")
CHECK_ENV = "TORCHPS_LOCK_CHECK"
CHECKING = os.environ.get(CHECK_ENV, "") not in ("", "0")  # read once: the decorators are applied at import
_LOGGER = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable)
L = TypeVar("L")


class LockOrderError(RuntimeError):
    """A lock taken against LOCK_ORDER (TORCHPS_LOCK_CHECK): a bug that can deadlock the shard."""


def guarded(method: F) -> F:
    """An owner's method that runs holding the owner's own lock (its `_lock`: an "owner" in LOCK_ORDER)."""
    if CHECKING:
        @functools.wraps(method)
        def checked_call(self, *args, **kwargs):
            lock = self._lock
            with _Held("owner", f"{type(self).__name__}._lock", id(lock), hasattr(lock, "_is_owned")), lock:
                return method(self, *args, **kwargs)
        return checked_call  # type: ignore[return-value]

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return call  # type: ignore[return-value]


def checked(lock: L, rank: str, name: str) -> L:
    """`lock` (a Lock or RLock; a Condition may be built over what this returns), checked as a lock of `rank`
    called `name` when checking, else `lock` itself."""
    return _CheckedLock(lock, rank, name) if CHECKING else lock  # type: ignore[return-value]


def ranked(rank: str, name: str) -> Callable[[F], F]:
    """For a method returning a context manager that holds a lock of `rank` (the apply gate's change and
    snapshot): checked as taking `name` of its object when checking, else the method itself."""
    def wrap(method: F) -> F:
        if not CHECKING:
            return method

        @functools.wraps(method)
        @contextlib.contextmanager
        def call(self, *args, **kwargs):
            with _Held(rank, name, id(self), False), method(self, *args, **kwargs) as value:
                yield value
        return call  # type: ignore[return-value]
    return wrap


def check_unlocked(what: str) -> None:
    """When checking: LockOrderError if this thread holds a lock of LOCK_ORDER but the promotion lock while it
    does `what` (waits for or writes to the disk)."""
    held = [entry for entry in _stack() if entry.rank != "promotion"] if CHECKING else []
    if held:
        raise _violation(f"thread {threading.current_thread().name!r} {what} holding {_names(held)}: no "
                             f"lock of locks.LOCK_ORDER but the promotion lock is held while waiting for or "
                             f"writing to the disk")


# -- the checker ---------------------------------------------------------------------------------------------

_THREAD = threading.local()


class _Entry:
    __slots__ = ("level", "rank", "name", "key", "depth")

    def __init__(self, rank: str, name: str, key: int):
        self.level, self.rank, self.name, self.key, self.depth = LOCK_ORDER.index(rank), rank, name, key, 1


def _stack() -> list[_Entry]:
    """The checked locks this thread holds, in the order it took them."""
    stack = getattr(_THREAD, "stack", None)
    if stack is None:
        stack = _THREAD.stack = []
    return stack


def _violation(message: str) -> LockOrderError:
    """The error to raise for `message`, logged first (code that catches it still leaves a trace)."""
    _LOGGER.critical("lock order violated: %s", message)
    return LockOrderError(message)


def _names(entries: list[_Entry]) -> str:
    return ", ".join(f"{e.name} ({e.rank})" for e in entries)


def _before(rank: str, name: str, key: int, reentrant: bool) -> _Entry | None:
    """Checks that this thread may take lock `key` (LockOrderError if not); its entry if held already."""
    for entry in _stack():
        if entry.key == key:
            if reentrant:
                return entry
            raise _violation(f"thread {threading.current_thread().name!r} takes {name} ({rank}) again while "
                                 f"holding it: it would wait for itself")
    _check_order(rank, name, key, "takes")
    return None


def _check_order(rank: str, name: str, key: int, does: str) -> None:
    """LockOrderError if this thread holds a lock other than `key` of `rank` or a later one."""
    level = LOCK_ORDER.index(rank)
    later = [e for e in _stack() if e.key != key and e.level >= level]
    if later:
        raise _violation(f"thread {threading.current_thread().name!r} {does} {name} ({rank}) while holding "
                             f"{_names(later)}: locks.LOCK_ORDER is {' < '.join(LOCK_ORDER)}, and no thread "
                             f"holds two locks of one rank")


def _taken(rank: str, name: str, key: int, entry: _Entry | None) -> None:
    if entry is not None:
        entry.depth += 1
    else:
        _stack().append(_Entry(rank, name, key))


def _released(key: int, whole: bool = False) -> int:
    """Forgets one hold of lock `key` (`whole`: every re-entrant one); returns how many were forgotten."""
    stack = _stack()
    for i in range(len(stack) - 1, -1, -1):
        entry = stack[i]
        if entry.key == key:
            count = entry.depth if whole else 1
            entry.depth -= count
            if not entry.depth:
                del stack[i]
            return count
    return 0


class _Held:
    """Context manager: checks and records this thread taking a lock for the block (the lock is taken by the
    context manager entered right after it)."""

    __slots__ = ("rank", "name", "key", "reentrant")

    def __init__(self, rank: str, name: str, key: int, reentrant: bool):
        self.rank, self.name, self.key, self.reentrant = rank, name, key, reentrant

    def __enter__(self) -> None:
        _taken(self.rank, self.name, self.key, _before(self.rank, self.name, self.key, self.reentrant))

    def __exit__(self, *exc) -> None:
        _released(self.key)


class _CheckedLock:
    """A Lock or RLock whose takers are checked against LOCK_ORDER; threading.Condition works over it (a wait
    lets go of it whole and takes it again as a new acquire, checked)."""

    def __init__(self, lock, rank: str, name: str):
        self._lock, self._rank, self._name = lock, rank, name
        self._reentrant = hasattr(lock, "_is_owned")  # RLock
        self._key = id(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking:
            entry = _before(self._rank, self._name, self._key, self._reentrant)
        else:  # a try cannot deadlock
            entry = next((e for e in _stack() if e.key == self._key), None)
        taken = self._lock.acquire(blocking, timeout)
        if taken:
            _taken(self._rank, self._name, self._key, entry)
        return taken

    def release(self) -> None:
        self._lock.release()
        _released(self._key)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def locked(self) -> bool:
        return self._lock.locked()

    # threading.Condition's hooks: a wait releases the lock whole (an RLock's every level) and takes it back

    def _is_owned(self) -> bool:
        return any(entry.key == self._key for entry in _stack())

    def _release_save(self):
        _check_order(self._rank, self._name, self._key, "waits on")  # would take it back holding later ones
        inner = self._lock._release_save() if self._reentrant else self._lock.release()
        return inner, _released(self._key, whole=True)

    def _acquire_restore(self, saved) -> None:
        inner, depth = saved
        if self._reentrant:
            self._lock._acquire_restore(inner)
        else:
            self._lock.acquire()
        _taken(self._rank, self._name, self._key, None)
        _stack()[-1].depth = depth
