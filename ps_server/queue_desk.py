"""Where workers take data shards: a shard's data queues (dataqueue.py) bound to its membership, push
ledger, journal and waits. No gRPC.

Why on ps 0. The queue is job state that must outlive any process: ps 0
already keeps the job's durable state (journal and checkpoints, replayed
exactly on a restart), holds the authority over the step, and knows who is
live (leases, incarnations) and which pushes it applied, exactly once (the
ledger). A queue in the chief's process would die with the chief and need a
store of its own; here it restarts with the shard that counts its pushes,
and a checkpoint holds the queue's position at the same instant as the
variables it trained.

Locking and order. Every change runs under the bookkeeping condition
(bookkeeping.py's `cond`) and then the queues' own lock, and its events are
queued for the journal under `cond`, as membership's are: a compaction (which
exports the queues and rotates the log under `cond`) sees each event either
in its base or in the new log. A take and a creation wait for their record before they answer.
A push's "pending" mark is queued before the push's own record, so a push
whose record survives a crash has its mark too; its "progress" is queued
after the apply, and a restart that lost it settles the mark from the
ledger (settle(), before the shard serves).

Leases whose holder is gone are reclaimed when anyone takes a shard or reads
a queue (and whenever membership changes wake a waiting take: the reaper
notifies `cond`): a holder is gone when ps 0's membership does not know it
with that incarnation, or knows it as left, expired or stalled.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..errors import DataShardError, InvalidArgumentError, ModeConflictError
from .bookkeeping import Bookkeeping
from .dataqueue import DataQueues, Lease, PushTicket, QueueSpec
from .modes import PushResult
from .recording import Recorder
from .waits import WaitLimit

__all__ = ["QueueDesk", "MAX_QUEUE_WAIT_SECONDS"]

_LOGGER = logging.getLogger(__name__)
MAX_QUEUE_WAIT_SECONDS = 60.0  # a waiting take or read holds an RPC thread: clients repeat shorter waits
_NEVER = lambda: False  # noqa: E731


class QueueDesk:
    """A shard's data queues (`queues`) served through its bookkeeping, journal and wait slots; on ps 0 only
    (`home`: the shard that owns the step)."""

    def __init__(self, book: Bookkeeping, queues: DataQueues, recorder: Recorder, waits: WaitLimit, *,
                 home: bool):
        self._book, self._queues, self._recorder, self._waits = book, queues, recorder, waits
        self.home = home

    def _require_home(self) -> None:
        if not self.home:
            raise ModeConflictError("data queues live on ps 0, the shard that owns the step; this is another")

    def _record(self, events: list[dict]) -> int | None:
        """Queues the events for the journal (holds cond); the last one's ticket."""
        ticket = None
        for event in events:
            ticket = self._recorder.log("queue", event)
        return ticket

    # -- the chief ------------------------------------------------------------------------------

    def create(self, spec: QueueSpec) -> bool:
        """DataQueues.create, recorded in the journal (written before it returns)."""
        self._require_home()
        book = self._book
        with book.cond:
            book.check_open()
            created, events = self._queues.create(spec)
            ticket = self._record(events)
            book.cond.notify_all()
        self._recorder.durable(ticket)
        if created:
            _LOGGER.info("data queue %r created: %d examples an epoch in shards of %d, %s", spec.name,
                         spec.num_examples, spec.shard_size, f"{spec.epochs} epochs" if spec.epochs else "no end")
        return created

    # -- workers ------------------------------------------------------------------------------

    def take(self, name: str, worker: str, incarnation: int, wait: float = 0.0,
             cancelled: Callable[[], bool] = _NEVER) -> tuple[Lease | None, bool]:
        """(lease, finished): the shard `worker` holds, else the next one; waits up to `wait` s while every
        shard left is held by others. Raises (changing nothing): UnknownDataQueueError, DataShardError for a
        worker not live here with this incarnation, WorkerReplacedError, InvalidArgumentError."""
        self._require_home()
        if not incarnation:
            raise InvalidArgumentError("a data shard is leased to a worker incarnation: the request needs one")
        book = self._book
        deadline = time.monotonic() + min(wait, MAX_QUEUE_WAIT_SECONDS)
        ticket = None
        with book.cond:
            while True:
                book.check_open()
                self._check_member(worker, incarnation)
                ticket = self._reclaim_gone() or ticket
                lease, finished, events = self._queues.take(name, worker, incarnation)
                ticket = self._record(events) or ticket
                left = deadline - time.monotonic()
                if lease is not None or finished or left <= 0 or cancelled():
                    break
                with self._waits.slot("take"):
                    book.cond.wait(left)  # membership changes, pushes and shards given back notify it
        self._recorder.durable(ticket)
        if lease is not None and ticket is not None:
            _LOGGER.debug("%s took data shard %d of %r: epoch %d [%d, %d)", worker, lease.id, name, lease.epoch,
                          lease.begin, lease.end)
        return lease, finished

    def status(self, name: str, wait: float = 0.0, cancelled: Callable[[], bool] = _NEVER) -> dict:
        """DataQueues.status, after reclaiming the shards of holders gone; waits up to `wait` s for the queue
        to be created (then UnknownDataQueueError)."""
        self._require_home()
        book = self._book
        deadline = time.monotonic() + min(wait, MAX_QUEUE_WAIT_SECONDS)
        with book.cond:
            while name not in self._queues.names() and not cancelled() and time.monotonic() < deadline:
                book.check_open()
                with self._waits.slot("list"):
                    book.cond.wait(deadline - time.monotonic())
            book.check_open()
            ticket = self._reclaim_gone()
            status = self._queues.status(name)
        self._recorder.durable(ticket)
        return status

    # -- pushes -------------------------------------------------------------------------------

    def before_push(self, header) -> PushTicket | None:
        """Before a push (a PushHeader) is applied: checks its data positions (DataQueues.check_push: raises,
        changing nothing) and marks them pending. None when it names none, on other shards than ps 0, or
        when they are counted already."""
        if not self.home or not header.HasField("data"):
            return None
        data, book = header.data, self._book
        with book.cond:
            book.membership.check(header.worker, header.incarnation)  # a replaced incarnation: refused, as push does
            ticket, events = self._queues.check_push(data.queue, data.lease, data.begin, data.end, header.worker,
                                                 header.incarnation, header.seq)
            self._record(events)  # before the push's own record: see the module docstring
        return ticket

    def after_push(self, ticket: PushTicket | None, header, result: PushResult | None) -> None:
        """After the push before_push accepted: counts its positions if it was applied (`result` not stale;
        a push that raised counts if the ledger shows it applied), then gives back a shard reclaimed
        meanwhile. Never raises for the push's sake."""
        if ticket is None:
            return
        book = self._book
        with book.cond:
            if result is not None:
                applied = not result.stale
            else:
                record = book.ledger.seen(header.worker, header.incarnation, header.seq)
                applied = record is not None and record.seq == header.seq and record.applied and not record.stale
            events = self._queues.pushed(ticket, applied)
            self._record(events)
            if events:
                book.cond.notify_all()

    def replay(self, kind: str, meta: dict, tensors=None) -> None:
        """Makes one "queue" record's event again (recovery, before the shard serves) with the function that
        made it live (dataqueue.DataQueues applies every event it returns), under cond as live."""
        with self._book.cond:
            self._queues.replay(meta)

    # -- internals ----------------------------------------------------------------------------

    def _check_member(self, worker: str, incarnation: int) -> None:
        """DataShardError unless `worker` is live here with `incarnation` (WorkerReplacedError if replaced)."""
        book = self._book
        book.membership.check(worker, incarnation)
        member = book.membership.members.get(worker)
        if member is None or member.incarnation != incarnation:
            raise DataShardError(f"{worker} (incarnation {incarnation:x}) has not joined ps 0: join before taking "
                                 f"data shards (they are leased to a live worker)")
        if not member.live:
            raise DataShardError(f"{worker} is not live on ps 0 (it left, its lease ran out, or it stalled): join "
                                 f"again before taking data shards")

    def _reclaim_gone(self) -> int | None:
        """Gives back the shards of holders that are gone (holds _cond); the last event's ticket."""
        book = self._book
        ticket = None
        for name, lease_id, worker, incarnation in self._queues.holders():
            member = book.membership.members.get(worker)
            if member is not None and member.incarnation == incarnation and member.live:
                continue
            why = ("unknown here" if member is None else "replaced by a newer incarnation"
                   if member.incarnation != incarnation else "stalled" if member.stalled and not member.gone
                   else "gone (left, or its lease ran out)")
            events = self._queues.reclaim(name, lease_id)
            _LOGGER.warning("data shard %d of %r goes back to the queue from where it stands%s: %s is %s", lease_id,
                            name, "" if events else ", once its push in flight ends", worker, why)
            ticket = self._record(events) or ticket
            book.cond.notify_all()
        return ticket

    def settle(self) -> None:
        """Resolves the pending marks a restored or replayed state holds, from its push ledger (see
        dataqueue.DataQueues.settle); recorded in the journal. Call it once the state is back, before
        serving."""
        book = self._book
        with book.cond:
            def applied(worker: str, incarnation: int, seq: int) -> bool:
                record = book.ledger.seen(worker, incarnation, seq)
                return record is not None and not (record.seq == seq and record.stale)

            events = self._queues.settle(applied)
            self._record(events)
        if events:
            _LOGGER.info("data queues: %d push(es) in flight when the state was taken settled from the ledger",
                         len(events))
