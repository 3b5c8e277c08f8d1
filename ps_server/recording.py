"""The journal's owner on a shard: records queued as changes happen, waits for them, compactions. No gRPC.

Appending a record only queues it (journal.Journal.append never touches the
disk), so it is done under whichever lock makes the change; the caller waits
for the record to be written (Recorder.durable) after letting go of every
lock, before it acknowledges the change. So membership, heartbeats and status
never wait on the disk, and neither does any apply.

Which lock a record is queued under (locks.LOCK_ORDER) keeps a compaction's
base and the new log in agreement, and the log in the order things happened:
a record of a change to variables or the step is queued under the apply gate
(shared) together with the change, and, for creations, applies, sync steps
and hyperparameters, under `ordering` too, so no push to a variable is
recorded before its creation and no apply on the wrong side of an lr change;
a record of bookkeeping only (membership, a step adopted while catching up)
under the bookkeeping condition. Embedding tables (table_state.py) are
recorded the same way: their creation ("tables") and admitting lookups of
dynamic tables ("admit") under the gate and `ordering`, and a push's row
gradients inside its own "apply" (or sync "add") record (see pushing()), so a
push is replayed whole or not at all; a sync step whose pushes have no "add"
record carries their averaged rows in its own (background.step_record). A compressed gradient is recorded as it
came (as_received) and decoded again on replay (replay.py).

A record's change is made by one function, live and on replay (replay.py
lists them by kind): the live path checks and decides, makes the change with
it and queues the record; recovery calls the same function with the record.

A compaction copies the whole state under the gate alone, rotating the log
under the bookkeeping condition in the same instant (snapshots.state_of(then=)):
every record queued before the copy is in the old log, every one after it in
the new. It lets go of the gate before it writes the copy to disk as the new
log's base, so changes go on meanwhile (their records go to the new log). A
crash before the base is whole leaves the older base and both logs, which
replay to the same state. The price is memory: the shard holds a second copy
of its variables' values (the optimizer state and tables are copied anyway)
until the base is written, and, with a backup that follows on a bulk lane,
sent to it.

Membership records are queued in order too but nobody waits for them: a
process killed at once may lose the last joins and lease renewals not followed
by a push it acknowledged (the workers join the restarted shard again).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from typing import Callable, Mapping

import numpy as np
import torch

from ..errors import ModeConflictError
from . import journal_log, table_state
from .gate import ApplyGate
from .journal import Journal
from .locks import check_unlocked, checked

__all__ = ["Recorder", "as_received"]

_LOGGER = logging.getLogger(__name__)


class Recorder:
    """Queues a shard's changes into its journal, once attach()ed (before that, log() records nothing), and
    compacts the journal when it grows.

    `state(then)` gives a copy of the shard's whole state (snapshots.state_of with then=`then`); the
    compaction calls it holding `gate` alone.
    """

    def __init__(self, gate: ApplyGate, state: Callable[[Callable[[], int]], dict]):
        self.journal: Journal | None = None
        # With a journal, every change to variables (creations, applies, steps, hyperparameters) is made and
        # queued for the journal under this lock ("ordering" in locks.LOCK_ORDER), so the journal replays them
        # in the order they happened. It is never held while a record is written.
        self.ordering: contextlib.AbstractContextManager = contextlib.nullcontext()
        self._gate = gate
        self._state = state
        self._pushing = threading.local()  # .rows, .received: of the push this thread makes (pushing())
        self._lock = checked(threading.Lock(), "compaction", "the recorder's compaction lock")  # guards _compactor
        self._compactor: threading.Thread | None = None
        self.on_wait: Callable[[float], None] | None = None  # given the seconds of each wait for the journal
        # Why no backup may attach now (None: it may), asked holding the gate at the attach
        self.refuse_follower: Callable[[], str | None] = lambda: None

    def attach(self, journal: Journal) -> None:
        """Records every change from now on in `journal`. Call it before the shard serves."""
        self.journal = journal
        self.ordering = checked(threading.Lock(), "ordering", "the journal's ordering")

    @property
    def directory(self):
        """The journal's folder (for messages); None without a journal."""
        return None if self.journal is None else self.journal.directory

    @contextlib.contextmanager
    def pushing(self, rows: Mapping | None, received: Mapping[str, tuple] | None):
        """While this thread handles one push: its "apply" or "add" record carries the push's row gradients
        `rows` (table_state.record_rows) and its compressed gradients as they came, `received` (as_received)."""
        self._pushing.rows, self._pushing.received = rows, received
        try:
            yield
        finally:
            self._pushing.rows = self._pushing.received = None

    def log(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor] | None = None) -> int | None:
        """Queues one record (see the module docstring for the lock the caller holds); returns its ticket for
        durable(), None without a journal. Never blocks on the disk."""
        if self.journal is None:
            return None
        if kind in ("apply", "add"):
            if getattr(self._pushing, "rows", None):
                meta, tensors = table_state.record_rows(meta, tensors or {}, self._pushing.rows)
            if getattr(self._pushing, "received", None):
                meta, tensors = as_received(meta, tensors or {}, self._pushing.received)
        ticket = self.journal.append(kind, meta, tensors or {})
        with self._lock:
            if self.journal.wants_compaction() and (self._compactor is None or not self._compactor.is_alive()):
                self._compactor = threading.Thread(target=self._compact, name="journal-compaction", daemon=True)
                self._compactor.start()
        return ticket

    def durable(self, ticket: int | None, timeout: float | None = None, released=None) -> None:
        """Blocks (call it holding no lock) until record `ticket` is written; None: nothing to wait for.
        `released`: a backup not waited for once it is lost (Journal.wait). ServerUnavailableError if the
        journal failed first, WaitTimeoutError after `timeout` s."""
        if ticket is not None:
            check_unlocked("waits for its journal record")
            self._wait(ticket, timeout, released)

    def durable_all(self, timeout: float | None, released=None) -> None:
        """Blocks (holding no lock) until every record queued so far is written (a retry's reply; `released`:
        a lost backup not waited for, Journal.wait); raises as durable() does. Nothing to wait for without a
        journal."""
        if self.journal is not None:
            check_unlocked("waits for the journal's records")
            self._wait(None, timeout, released)

    def _wait(self, ticket: int | None, timeout: float | None, released=None) -> None:
        """journal.wait, its seconds given to on_wait when it returns."""
        started = time.monotonic()
        self.journal.wait(ticket, timeout, released)
        if self.on_wait is not None:
            self.on_wait(time.monotonic() - started)

    def wait_for_compaction(self, timeout: float | None = None) -> None:
        """Returns once no compaction is running (at most `timeout` s)."""
        with self._lock:
            compactor = self._compactor
        if compactor is not None:
            compactor.join(timeout)

    def compact_for(self, follower) -> None:
        """Compacts now, attaching `follower` (a backup's feed.Feed) at the new log, whose base it is
        handed first (Journal.rotate). Blocks while a compaction runs, then for this one; raises what it
        raised (ModeConflictError: another backup follows; nothing was attached)."""
        while True:
            with self._lock:
                running = self._compactor
                if running is None or not running.is_alive():
                    self._compactor = threading.current_thread()  # no compaction starts meanwhile
                    break
            running.join()
        try:
            self._compact(follower)
        finally:
            with self._lock:  # this (pooled) thread lives on: no later compaction may wait for it
                self._compactor = None

    def _compact(self, follower=None) -> None:
        """Writes the whole state as the journal's new base, so its log starts afresh (thread body), and hands
        it to the backup that follows, if one does. Holds the gate alone while it copies the state only."""
        journal = self.journal
        try:
            with self._gate.snapshot():  # a copy at one instant, with the log rotated in the same one
                refused = self.refuse_follower() if follower is not None else None
                if refused:
                    raise ModeConflictError(refused)
                state = self._state(functools.partial(journal.rotate, follower=follower))
            number = state.pop("then")
            journal.finish_compaction(number, journal.write_base(number, state))
            shipping = journal.following()
            if shipping is not None:  # the state is kept until its bytes left on the lane
                shipping.offer_base(number, *journal_log.encode("base", {}, journal_log.state_record(state)),
                                    files=journal.base_files(number))()
        except Exception:  # noqa: BLE001 - the log keeps growing; recovery still works from the old base
            if follower is not None:
                raise
            _LOGGER.exception("journal compaction failed")


def as_received(meta: dict, tensors: Mapping[str, torch.Tensor], received: Mapping[str, tuple]
                ) -> tuple[dict, dict[str, torch.Tensor]]:
    """A push record's (meta, tensors) with the gradients named in `received` ({name: (TensorMeta, bytes)})
    as they came over the wire (a bf16 cast, top-k's indices and values) instead of decoded: meta "received"
    maps each to its TensorMeta, replay decodes them again (replay.from_received)."""
    out = dict(tensors)
    wire = {}
    for name, (tensor_meta, raw) in received.items():
        out[name] = torch.from_numpy(np.asarray(raw, dtype=np.uint8))
        wire[name] = tensor_meta.SerializeToString(deterministic=True).hex()
    return {**meta, "received": wire}, out
