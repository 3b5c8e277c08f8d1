"""Data queues for dynamic sharding: each epoch's examples handed out as leased data shards. No gRPC.

A queue hands out *data shards*: ranges [begin, end) of positions in an
epoch's order (the workers map positions to examples through a permutation
they draw from the queue's seed and the epoch; the shard never sees data).
A worker incarnation holds at most one shard at a time (a *lease*), and
trains it in batches; each push names the positions it trained
(PushHeader.data), which `check_push` accepts before the push is applied
(the lease is this incarnation's, the batch starts where the shard stands)
and `pushed` counts once the push is applied. A retried push names positions
already counted and is counted no more. A shard whose last position is
counted is done.

A lease whose holder is gone (the caller decides that from membership:
queue_desk.py) is *reclaimed*: what it had left, [progress, end), goes back
to the queue and is handed out before any new positions (oldest epoch
first). So every position of an epoch is counted exactly once; fast workers
take more shards than slow ones; epoch e+1's shards are handed out once every
position of epoch e is (held, or done), so no worker idles at an epoch's end
while another finishes it.

Every change is an *event* (a small JSON-able dict) that `apply` makes, so the
live path and the journal's replay (queue_desk.py records each event) make
the same changes; `export` / `restore` carry the whole state in checkpoints.
A push being applied leaves a *pending* mark on its lease (seq, end), written
to the journal before the push's own record: a shard restarted between a
push's record and its count settles it (`settle`) from the push ledger, so a
push the restored state holds is counted and one it does not hold is not.

Thread-safe: one lock guards every queue (callers may hold their own lock
around calls, never the other way round).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from typing import Callable

from ..errors import DataShardError, InvalidArgumentError, SpecConflictError, UnknownDataQueueError

__all__ = ["QueueSpec", "Lease", "PushTicket", "DataQueues", "MAX_QUEUES", "MAX_EXAMPLES", "MAX_EPOCHS",
           "MAX_NAME"]

MAX_QUEUES = 16             # queues per shard: a job needs one or two (train, maybe validation)
MAX_EXAMPLES = 1 << 62      # positions of an epoch
MAX_EPOCHS = 1_000_000
MAX_NAME = 128

Event = dict


@dataclasses.dataclass(frozen=True)
class QueueSpec:
    """What defines a queue (ps.proto's DataQueueSpec)."""

    name: str
    num_examples: int
    shard_size: int
    epochs: int = 1   # 0: no end
    seed: int = 0

    def check(self) -> "QueueSpec":
        """Itself; InvalidArgumentError naming the first field out of range."""
        problems = [
            ("name", 1 <= len(self.name) <= MAX_NAME, f"1 to {MAX_NAME} characters"),
            ("num_examples", 1 <= self.num_examples <= MAX_EXAMPLES, "in [1, 2^62]"),
            ("shard_size", 1 <= self.shard_size <= MAX_EXAMPLES, "in [1, 2^62]"),
            ("epochs", 0 <= self.epochs <= MAX_EPOCHS, f"in [0, {MAX_EPOCHS}] (0: no end)"),
            ("seed", 0 <= self.seed < 1 << 64, "in [0, 2^64)"),
        ]
        for field, ok, wanted in problems:
            if not ok:
                raise InvalidArgumentError(f"data queue {field} must be {wanted}. Received: "
                                           f"{getattr(self, field)!r}; nothing was created")
        return self


@dataclasses.dataclass
class Lease:
    """A data shard held by one worker incarnation."""

    id: int
    worker: str
    incarnation: int
    epoch: int
    begin: int
    end: int
    progress: int                           # positions [begin, progress) are counted
    pending: tuple[int, int] | None = None  # (seq, end) of a push being applied (see the module docstring)
    inflight: int = 0                       # pushes between check_push and pushed (this process only)
    revoked: bool = False                   # reclaimed while a push was in flight: goes back once it ends

    def export(self) -> dict:
        return {"lease": self.id, "worker": self.worker, "incarnation": self.incarnation, "epoch": self.epoch,
                "begin": self.begin, "end": self.end, "progress": self.progress,
                "pending": list(self.pending) if self.pending else None}


@dataclasses.dataclass(frozen=True)
class PushTicket:
    """A push accepted by check_push, to hand to pushed() once it is applied, or not."""

    queue: str
    lease: int
    end: int


class _Queue:
    """One queue's state (guarded by DataQueues' lock)."""

    def __init__(self, spec: QueueSpec):
        self.spec = spec
        self.epoch = 0        # new positions come from this epoch ...
        self.cursor = 0       # ... starting here
        self.returned: list[tuple[int, int, int]] = []  # (epoch, begin, end) given back, sorted: handed out first
        self.leases: dict[int, Lease] = {}
        self.next_lease = 1
        self.trained: list[int] = []  # per epoch begun: positions counted
        self.closed: dict[str, tuple[int, int, int, int]] = {}  # worker -> (incarnation, lease, begin, end) of its
        #                                                          latest done shard: its retried pushes are answered
        self.shards_done = 0
        self.reclaimed = 0
        self.requeued = 0
        self.duplicates = 0

    @property
    def exhausted(self) -> bool:
        """No new positions left (every epoch handed out); never with epochs 0."""
        return bool(self.spec.epochs) and self.epoch >= self.spec.epochs

    def epochs_done(self) -> int:
        return sum(1 for count in self.trained if count == self.spec.num_examples)

    @property
    def finished(self) -> bool:
        return bool(self.spec.epochs) and self.epochs_done() == self.spec.epochs

    def held_by(self, worker: str, incarnation: int) -> Lease | None:
        for lease in self.leases.values():
            if lease.worker == worker and lease.incarnation == incarnation and not lease.revoked:
                return lease
        return None

    def next_range(self) -> tuple[int, int, int, bool] | None:
        """(epoch, begin, end, from returned) of the next shard to hand out, or None."""
        if self.returned:
            return (*self.returned[0], True)
        if self.exhausted:
            return None
        end = min(self.cursor + self.spec.shard_size, self.spec.num_examples)
        return self.epoch, self.cursor, end, False

    # -- events ---------------------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        op = event["op"]
        if op == "lease":
            epoch, begin, end = event["epoch"], event["begin"], event["end"]
            if event["returned"]:
                self.returned.remove((epoch, begin, end))
            else:
                if (epoch, begin) != (self.epoch, self.cursor):
                    raise ValueError(f"queue {self.spec.name!r}: a lease of epoch {epoch} at {begin} does not follow "
                                     f"the queue's position (epoch {self.epoch} at {self.cursor})")
                self.cursor = end
                if self.cursor >= self.spec.num_examples:
                    self.epoch, self.cursor = self.epoch + 1, 0
            while len(self.trained) <= epoch:
                self.trained.append(0)
            self.leases[event["lease"]] = Lease(event["lease"], event["worker"], event["incarnation"], epoch, begin,
                                                end, begin)
            self.next_lease = max(self.next_lease, event["lease"] + 1)
        elif op == "pending":
            lease = self.leases.get(event["lease"])
            if lease is not None:
                lease.pending = (event["seq"], event["end"])
        elif op == "unpending":
            lease = self.leases.get(event["lease"])
            if lease is not None:
                lease.pending = None
        elif op == "progress":
            lease = self.leases.get(event["lease"])
            if lease is None:
                return
            lease.pending = None
            if event["end"] > lease.progress:
                self.trained[lease.epoch] += event["end"] - lease.progress
                lease.progress = event["end"]
            if lease.progress >= lease.end:
                del self.leases[lease.id]
                self.shards_done += 1
                self.closed[lease.worker] = (lease.incarnation, lease.id, lease.begin, lease.end)
        elif op == "reclaim":
            lease = self.leases.pop(event["lease"], None)
            if lease is None:
                return
            self.reclaimed += 1
            if lease.progress < lease.end:
                bisect.insort(self.returned, (lease.epoch, lease.progress, lease.end))
                self.requeued += lease.end - lease.progress
        else:
            raise ValueError(f"unknown data queue event {op!r}")

    # -- checkpoints ----------------------------------------------------------------------------

    def export(self) -> dict:
        return {"spec": dataclasses.asdict(self.spec), "epoch": self.epoch, "cursor": self.cursor,
                "returned": [list(r) for r in self.returned], "leases": [l.export() for l in self.leases.values()],
                "next_lease": self.next_lease, "trained": list(self.trained),
                "closed": {w: list(c) for w, c in self.closed.items()},
                "counters": {"shards_done": self.shards_done, "reclaimed": self.reclaimed,
                             "requeued": self.requeued, "duplicates": self.duplicates}}

    @classmethod
    def restore(cls, state: dict) -> "_Queue":
        queue = cls(QueueSpec(**state["spec"]))
        queue.epoch, queue.cursor = state["epoch"], state["cursor"]
        queue.returned = sorted(tuple(r) for r in state["returned"])
        for entry in state["leases"]:
            pending = entry.get("pending")
            queue.leases[entry["lease"]] = Lease(entry["lease"], entry["worker"], entry["incarnation"], entry["epoch"],
                                                 entry["begin"], entry["end"], entry["progress"],
                                                 tuple(pending) if pending else None)
        queue.next_lease = state["next_lease"]
        queue.trained = list(state["trained"])
        queue.closed = {w: tuple(c) for w, c in state["closed"].items()}
        counters = state.get("counters", {})
        queue.shards_done = counters.get("shards_done", 0)
        queue.reclaimed = counters.get("reclaimed", 0)
        queue.requeued = counters.get("requeued", 0)
        queue.duplicates = counters.get("duplicates", 0)
        return queue


class DataQueues:
    """The data queues of one shard (see the module docstring). Each method that changes something returns the
    events it applied, for the caller to journal in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, _Queue] = {}

    def _get(self, name: str) -> _Queue:
        queue = self._queues.get(name)
        if queue is None:
            raise UnknownDataQueueError(f"no data queue {name!r} on this shard"
                                        + (f" (it holds {sorted(self._queues)})" if self._queues else "")
                                        + ": the chief creates it (CreateDataQueue)")
        return queue

    def _apply(self, queue: _Queue, event: Event) -> Event:
        queue.apply(event)
        return event

    def __len__(self) -> int:
        with self._lock:
            return len(self._queues)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._queues)

    # -- the chief ------------------------------------------------------------------------------

    def create(self, spec: QueueSpec) -> tuple[bool, list[Event]]:
        """(created, events): False if it exists with this spec (kept as it stands). InvalidArgumentError for a
        bad spec or one queue too many, SpecConflictError for another spec under its name; nothing changes."""
        spec.check()
        with self._lock:
            held = self._queues.get(spec.name)
            if held is not None:
                if held.spec != spec:
                    raise SpecConflictError(f"data queue {spec.name!r} exists as {held.spec}; the request declared "
                                            f"{spec}. Use another name, or the same spec")
                return False, []
            if len(self._queues) >= MAX_QUEUES:
                raise InvalidArgumentError(f"this shard holds {MAX_QUEUES} data queues, its limit; {spec.name!r} "
                                           f"was not created")
            event = {"op": "create", "spec": dataclasses.asdict(spec)}
            self._replay(event)
            return True, [event]

    # -- workers --------------------------------------------------------------------------------

    def take(self, name: str, worker: str, incarnation: int) -> tuple[Lease | None, bool, list[Event]]:
        """(lease, finished, events): the lease `worker` `incarnation` holds, else a new one on the next shard
        (events: its "lease"); (None, True) once every epoch is done; (None, False) while every shard left
        is held by others. UnknownDataQueueError for an unknown queue."""
        with self._lock:
            queue = self._get(name)
            held = queue.held_by(worker, incarnation)
            if held is not None:
                return dataclasses.replace(held), False, []
            found = queue.next_range()
            if found is None:
                return None, queue.finished, []
            epoch, begin, end, returned = found
            event = {"op": "lease", "queue": name, "lease": queue.next_lease, "worker": worker,
                     "incarnation": incarnation, "epoch": epoch, "begin": begin, "end": end, "returned": returned}
            queue.apply(event)
            return dataclasses.replace(queue.leases[event["lease"]]), False, [event]

    def check_push(self, name: str, lease_id: int, begin: int, end: int, worker: str, incarnation: int,
                   seq: int) -> tuple[PushTicket | None, list[Event]]:
        """Before a push that names positions [begin, end) of lease `lease_id` is applied: (ticket, events) if
        it moves the shard on (events: its "pending" mark; hand the ticket to pushed()), (None, []) if those
        positions are counted already (a retry: apply it as its ledger says, count nothing). Raises, changing
        nothing: UnknownDataQueueError, InvalidArgumentError (numbers out of range, no seq), DataShardError
        (the lease is not this incarnation's, was given back, or the shard stands elsewhere)."""
        if not (0 <= begin < end <= MAX_EXAMPLES):
            raise InvalidArgumentError(f"a push's data positions must satisfy 0 <= begin < end <= 2^62. Received "
                                       f"[{begin}, {end}); nothing was applied")
        if not seq or not incarnation:
            raise InvalidArgumentError("a push that names data positions needs an incarnation and a seq (exactly "
                                       "once); nothing was applied")
        with self._lock:
            queue = self._get(name)
            lease = queue.leases.get(lease_id)
            if lease is None:
                closed = queue.closed.get(worker)
                if closed is not None and closed[:2] == (incarnation, lease_id):
                    if not closed[2] <= begin < end <= closed[3]:
                        raise InvalidArgumentError(f"positions [{begin}, {end}) are outside data shard {lease_id} "
                                                   f"[{closed[2]}, {closed[3]}); nothing was applied")
                    queue.duplicates += 1
                    return None, []
                raise DataShardError(f"{worker} holds no data shard {lease_id} of queue {name!r} (it was never "
                                     f"taken, or went back to the queue); nothing was applied: take a shard again")
            if (lease.worker, lease.incarnation) != (worker, incarnation):
                raise DataShardError(f"data shard {lease_id} of queue {name!r} is held by {lease.worker} "
                                     f"(incarnation {lease.incarnation:x}), not {worker} (incarnation "
                                     f"{incarnation:x}); nothing was applied: take a shard again")
            if lease.revoked:
                raise DataShardError(f"data shard {lease_id} of queue {name!r} is going back to the queue ({worker} "
                                     f"counted as gone); nothing was applied: take a shard again")
            if not lease.begin <= begin < end <= lease.end:
                raise InvalidArgumentError(f"positions [{begin}, {end}) are outside data shard {lease_id} "
                                           f"[{lease.begin}, {lease.end}); nothing was applied")
            if end <= lease.progress:
                queue.duplicates += 1
                return None, []
            if begin != lease.progress:
                raise DataShardError(f"data shard {lease_id} of queue {name!r} stands at {lease.progress}; a push "
                                     f"of positions [{begin}, {end}) does not continue it; nothing was applied: "
                                     f"take the shard again (it answers where it stands)")
            lease.inflight += 1
            event = {"op": "pending", "queue": name, "lease": lease_id, "seq": seq, "end": end}
            queue.apply(event)
            return PushTicket(name, lease_id, end), [event]

    def pushed(self, ticket: PushTicket, applied: bool) -> list[Event]:
        """After the push check_push accepted: counts its positions if it was applied; then gives the shard
        back if it was reclaimed meanwhile. Returns the events."""
        with self._lock:
            queue = self._queues.get(ticket.queue)
            lease = queue.leases.get(ticket.lease) if queue is not None else None
            if lease is None:
                return []
            lease.inflight -= 1
            events = []
            if applied and ticket.end > lease.progress:
                events.append(self._apply(queue, {"op": "progress", "queue": ticket.queue, "lease": lease.id,
                                                  "end": ticket.end}))
            elif lease.inflight == 0 and lease.pending is not None:
                events.append(self._apply(queue, {"op": "unpending", "queue": ticket.queue, "lease": lease.id}))
            if lease.revoked and lease.inflight == 0 and lease.id in queue.leases:
                events.append(self._apply(queue, {"op": "reclaim", "queue": ticket.queue, "lease": lease.id}))
            return events

    # -- leases whose holder is gone ------------------------------------------------------------------

    def holders(self) -> list[tuple[str, int, str, int]]:
        """(queue, lease, worker, incarnation) of every lease not being reclaimed."""
        with self._lock:
            return [(name, lease.id, lease.worker, lease.incarnation) for name, queue in self._queues.items()
                    for lease in queue.leases.values() if not lease.revoked]

    def reclaim(self, name: str, lease_id: int) -> list[Event]:
        """Gives lease `lease_id` back to the queue from where it stands (at once, or once the push in flight for
        it ends); its holder's pushes for it are refused from now on. Returns the events."""
        with self._lock:
            queue = self._queues.get(name)
            lease = queue.leases.get(lease_id) if queue is not None else None
            if lease is None or lease.revoked:
                return []
            if lease.inflight:
                lease.revoked = True
                return []
            return [self._apply(queue, {"op": "reclaim", "queue": name, "lease": lease_id})]

    def settle(self, applied: Callable[[str, int, int], bool]) -> list[Event]:
        """After a restore or replay: resolves each lease's pending mark, counting its positions if
        applied(worker, incarnation, seq) (the push ledger holds that push), else clearing it."""
        with self._lock:
            events = []
            for name, queue in self._queues.items():
                for lease in list(queue.leases.values()):
                    if lease.pending is None or lease.inflight:
                        continue
                    seq, end = lease.pending
                    if applied(lease.worker, lease.incarnation, seq):
                        events.append(self._apply(queue, {"op": "progress", "queue": name, "lease": lease.id,
                                                          "end": end}))
                    else:
                        events.append(self._apply(queue, {"op": "unpending", "queue": name, "lease": lease.id}))
            return events

    # -- reading ----------------------------------------------------------------------------------

    def status(self, name: str) -> dict:
        """The queue's spec, position, counts and held leases (UnknownDataQueueError if absent)."""
        with self._lock:
            queue = self._get(name)
            return {"spec": queue.spec, "epoch": queue.epoch, "trained": list(queue.trained),
                    "epochs_done": queue.epochs_done(), "finished": queue.finished, "shards_done": queue.shards_done,
                    "held": [dataclasses.replace(lease) for lease in queue.leases.values()],
                    "reclaimed": queue.reclaimed, "requeued_examples": queue.requeued,
                    "duplicates": queue.duplicates}

    def spec(self, name: str) -> QueueSpec:
        with self._lock:
            return self._get(name).spec

    # -- checkpoints and the journal -------------------------------------------------------------

    def export(self) -> list[dict]:
        """Every queue's whole state (plain values: for checkpoints and the journal's bases)."""
        with self._lock:
            return [queue.export() for queue in self._queues.values()]

    def restore(self, states: list[dict] | None) -> None:
        """Replaces every queue with `states` (export()'s; None or empty: none)."""
        with self._lock:
            self._queues = {}
            for state in states or ():
                queue = _Queue.restore(state)
                self._queues[queue.spec.name] = queue

    def clear(self) -> None:
        """Drops every queue (a new job)."""
        self.restore(None)

    def replay(self, event: Event) -> None:
        """Makes the change of one event (from the journal) again."""
        with self._lock:
            self._replay(event)

    def _replay(self, event: Event) -> None:
        if event["op"] == "create":
            spec = QueueSpec(**event["spec"])
            self._queues[spec.name] = _Queue(spec)
        else:
            self._get(event["queue"]).apply(event)
