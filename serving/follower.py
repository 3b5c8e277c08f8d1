"""A serving replica's reads of the training shards: rounds of ReadChanges (every table's rows changed since the
last round) and, every `dense_every` s, the dense variables whose version moved, each round published as one
version of the replica (replica.py). Training never waits for it: the shards answer reads only.

A round asks every shard for its tables' changes (from the cursors the last
round left: a table without one, or one its shard can no longer answer from
its log, comes whole), then the dense variables if due, then ps 0 its step.
The version it publishes holds every change acknowledged before the round
began (`fresh_at`: what the replica's staleness counts from) and is labelled
with the step ps 0 had reached after the reads. A push in flight during the
round (applied by some shards, not yet counted by ps 0) may be in it in
part, under the step before its own. A round that fails (a shard unreachable, a failover under way) leaves
the current version as it was, says why in `error`, and is tried again at
the next tick; the cursors move only with a published round. While the
replica is held (hold, rollback) nothing is read; after a rollback every
table is read whole again (what it undid comes back from the shards).

A replica started from a checkpoint (start_from) serves its rows at once;
its first round asks each shard only for what changed since the checkpoint
copied the table (the cursors it saved), where the shard can still say.
`min_updates` asks the shards to leave out rows updated fewer times than that
(ReadChanges' filter): such a row comes with the update that reaches it. A
`guard` (guard.py) may refuse a round's version: nothing is published and the
cursors stay, so the next round reads those changes again.

A round follows the job's live resizes: it begins by asking ps 0 for the
layout (GetLayout), calls the shards of its epoch, and reads every table
whole and every dense variable again when the epoch changes (a resize). It
publishes nothing unless the epoch is the same after the reads as before: a
round that spans a new epoch did not read the shards that serve rows and
variables from then on. Within an epoch nothing moves but what is frozen (a
table laid out anew takes no push until the next epoch; a variable on its
way answers no pull), so a round read whole from one epoch's shards holds
every change they acknowledged before it began.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import numpy as np
import torch

from .. import codec, rows as row_ids
from ..client.channels import ShardChannels
from ..client.transfer import NewTensors, read_stream
from ..errors import InvalidArgumentError, PSError, ServingVersionError
from ..proto import ps_pb2
from ..ps_server.row_changes import MAX_UPDATES
from ..security import Security
from .checkpoint_start import CheckpointStart
from .guard import LossGuard
from .replica import Replica, TableBatch
from .settings import DENSE_SECONDS, POLL_SECONDS

__all__ = ["Follower"]

_LOGGER = logging.getLogger(__name__)


class Follower:
    """Rounds of reads of the shards at `addresses` into `replica` (see the module docstring). `timeout`: one
    call's deadline. run() blocks until stop is set. InvalidArgumentError for a `min_updates` outside
    [0, MAX_UPDATES]."""

    def __init__(self, replica: Replica, addresses: list[str], security: Security, *,
                 poll_every: float = POLL_SECONDS, dense_every: float = DENSE_SECONDS, min_updates: int = 0,
                 guard: LossGuard | None = None, timeout: float = 30.0, connect_timeout: float = 30.0):
        if not 0 <= min_updates <= MAX_UPDATES:
            raise InvalidArgumentError(f"min_updates must be in [0, {MAX_UPDATES}] (a shard counts no further), got "
                                       f"{min_updates}")
        self.replica, self.poll_every, self.dense_every, self.timeout = replica, poll_every, dense_every, timeout
        self.min_updates, self.guard = min_updates, guard
        self.refusal = ""        # why the guard refused the last round's version ("" if it did not)
        self._spec = list(addresses)
        self.channels = ShardChannels(list(addresses), connect_timeout=connect_timeout, security=security)
        self.channels.follows_failovers = True
        self._cursors: list[dict[str, tuple[str, int]]] = [{} for _ in addresses]
        self._dense_versions: dict[str, int] = {}
        self._dense_read = -math.inf
        self.fresh_at = 0.0      # every change acknowledged before this Unix time is in the current version
        self.dense_at = 0.0      # the current version holds the dense variables as read at this Unix time
        self.step = 0            # ps 0's step at the last round
        self.error = ""          # why the last round failed ("" if it did not)
        self.resyncs = 0         # tables read whole
        self.rows_applied = 0    # rows published over all rounds
        self.rounds = 0
        self._rewinds = 0  # the replica's rollbacks the cursors know of
        self.epoch: int | None = None  # the layout epoch of the shards read (None: none asked yet)
        self._start_epoch: int | None = None  # a checkpoint's epoch, whose cursors the first round keeps

    def start_from(self, start: CheckpointStart) -> None:
        """Publishes a checkpoint's rows and dense variables (checkpoint_start.py) as the replica's version and
        keeps its cursors for the first round, if that round finds the checkpoint's layout (else every table is
        read whole, as without it). Raises ServingVersionError while the replica is held."""
        self.replica.publish(start.step, start.batches, start.dense, self.replica.freezes, now=start.written)
        self._cursors, self._start_epoch = [dict(c) for c in start.cursors], start.epoch
        if self.guard is not None:
            self.guard.forget()
        self.fresh_at, self.dense_at, self.step = start.written, start.written, start.step
        self.rows_applied += sum(len(b.ids) for _, b in start.batches)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.replica.held:
                try:
                    self.round()
                    self.error = self.refusal
                except ServingVersionError:
                    pass  # held or rolled back meanwhile: the next round reads again
                except PSError as exc:
                    self.error = str(exc)
                    _LOGGER.warning("ps-serve: a read of the shards failed (the replica keeps its version): %s", exc)
            stop.wait(self.poll_every)

    def round(self) -> bool:
        """One round (see the module docstring); True if it published a version. Raises PSError if a call
        failed (nothing published)."""
        began = time.time()
        self.refusal = ""
        rewinds, freezes = self.replica.rewinds, self.replica.freezes
        if rewinds != self._rewinds:  # rolled back: what it undid is read again, every table whole
            self._cursors = [{} for _ in self._cursors]
            self._dense_versions, self._dense_read, self._rewinds = {}, -math.inf, rewinds
            if self.guard is not None:
                self.guard.forget()
        layout = self._layout()
        if layout.epoch != self.epoch:  # the first round, or a live resize: every table and variable read anew
            shards = self._shards(layout)
            self.channels.follow(shards)
            if not (self.epoch is None and self._start_epoch == layout.epoch and len(self._cursors) == len(shards)):
                self._cursors = [{} for _ in shards]  # (a checkpoint's cursors hold for its epoch's shards)
            self._dense_versions, self._dense_read = {}, -math.inf
            if self.epoch is not None:
                _LOGGER.info("ps-serve follows layout epoch %d (%d shards): every table and variable read anew",
                             layout.epoch, len(self._cursors))
            self.epoch = layout.epoch
        batches, cursors = [], []
        for shard in range(len(self._cursors)):
            found, cursor = self._changes(shard)
            batches += found
            cursors.append(cursor)
        dense_began = time.time()
        dense = self._dense() if time.monotonic() - self._dense_read >= self.dense_every else None
        status = self.channels.call(0, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t),
                                    self.timeout)  # after the reads: the version holds no change of a later step
        moved = self._moved(layout)
        if moved:
            _LOGGER.info("ps-serve: %s: nothing published, read again", moved)
            return False
        fresh = dense[0] if dense is not None else {}
        changed = any(len(b.ids) or b.whole for _, b in batches) or bool(fresh)
        if changed:
            merged = {**self.replica.dense()[1], **fresh} if fresh else None
            if self.guard is not None:
                current = self.replica.view() if self.replica.current().version else None
                self.refusal = self.guard.refusal(current, self.replica.candidate(batches, merged))
                if self.refusal:
                    self.error = self.refusal  # said at once (status), not only once the round returns
                    _LOGGER.warning("ps-serve: %s: the replica keeps its version", self.refusal)
                    return False
            self.replica.publish(status.step, batches, merged, freezes, now=time.time())
            self.rows_applied += sum(len(b.ids) for _, b in batches)
            self.resyncs += sum(b.whole for _, b in batches)
        if dense is not None:
            self._dense_versions, self._dense_read, self.dense_at = dense[1], time.monotonic(), dense_began
        self._cursors = cursors
        self.fresh_at, self.step = began, status.step
        self.rounds += 1
        return changed

    def _layout(self) -> ps_pb2.Layout:
        return self.channels.call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t), self.timeout)

    def _shards(self, layout: ps_pb2.Layout) -> list[str]:
        """The shards of `layout`'s epoch (the cluster spec's before any resize)."""
        return list(layout.addresses) or self._spec

    def _moved(self, layout: ps_pb2.Layout) -> str:
        """Why a round read under `layout` may not be published ("" if it may): the epoch moved on during it (a
        shard it did not read may have acknowledged changes its version would claim to hold)."""
        after = self._layout()
        if after.epoch != layout.epoch:
            return f"the layout moved from epoch {layout.epoch} to {after.epoch} during the round"
        return ""

    def _changes(self, shard: int) -> tuple[list[tuple[str, TableBatch]], dict[str, tuple[str, int]]]:
        """Shard `shard`'s tables' changes since its cursors: ([(table, batch)], the cursors they lead to)."""
        request = ps_pb2.ChangesRequest(cursors=[ps_pb2.TableCursor(table=name, incarnation=inc, seq=seq)
                                                 for name, (inc, seq) in self._cursors[shard].items()],
                                        min_updates=self.min_updates)
        messages = self.channels.call(shard, lambda stub, t: list(stub.ReadChanges(request, timeout=t)),
                                      self.timeout)
        parts: dict[str, list] = {}
        for message in messages:
            parts.setdefault(message.table, []).append(message)
        found, cursors = [], {}
        for name, pieces in parts.items():
            head = pieces[0]
            dtype = codec.torch_dtype(head.dtype)
            ids = np.concatenate([np.frombuffer(p.ids, dtype="<i8") for p in pieces]).astype(np.int64)
            held = np.concatenate([np.frombuffer(p.held, dtype=np.uint8) for p in pieces]).astype(bool)
            raw = b"".join(p.rows for p in pieces)
            values = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(len(ids), head.dim) if raw \
                else torch.zeros(0, head.dim, dtype=dtype)
            owner = (head.shard, head.num_shards, row_ids.partition_name(head.partition))
            found.append((name, TableBatch(head.dim, dtype, ids, values, held, head.whole, owner,
                                           head.num_embeddings)))
            cursors[name] = (head.incarnation, head.seq)
        return found, cursors

    def _dense(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """({name: tensor} of the dense variables whose version moved since the last read, {name: version} of
        every one)."""
        fresh, versions = {}, {}
        for shard in range(len(self._cursors)):
            listed = self.channels.call(shard, lambda stub, t: stub.ListVariables(ps_pb2.ListRequest(), timeout=t),
                                        self.timeout)
            names = []
            for info in listed.variables:
                versions[info.spec.name] = info.version
                if self._dense_versions.get(info.spec.name) != info.version:
                    names.append(info.spec.name)
            if names:
                sink = NewTensors()
                self.channels.call(shard, lambda stub, t: read_stream(
                    stub.Pull(ps_pb2.PullRequest(names=names), timeout=t), names, sink, self.channels.target(shard)),
                    self.timeout)
                fresh.update(sink.tensors)
        return fresh, versions

    def close(self) -> None:
        self.channels.close()
