"""PSClient's data path: pull, pull_into, push and push_pull (exchange), one stream per shard, all at once.

A mixin of PSClient: it uses the client's fan-out to the shards (fanout.py),
placement, refill, push lock and device staging (see PSClient.__init__), and for
embedding tables' row gradients TablePath._summed_rows and _cut_rows (tables.py). The
overlapped push and pull (streamed_push.py, layer_pull.py) extend it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Iterator, Mapping

import grpc
import torch

from ..compression import Encoded
from ..errors import LaneBrokenError, LayoutChangedError
from ..lanes import Lane
from ..proto import ps_pb2
from ..rows import encode_rows, shard_of as row_owner
from .deltas import PullBases
from .device import Staged
from .layout import MAX_ROUNDS
from .transfer import IntoTargets, NewTensors, lane_messages, push_requests, read_stream

__all__ = ["DataPath", "GLOBAL_STEP_SHARD", "with_lane"]

GLOBAL_STEP_SHARD = 0  # shard 0 counts the global step, as TensorFlow keeps global_step on ps 0
LANE_CHUNK_BYTES = 8 << 20  # a chunk on a bulk lane: its message is a few bytes, its frame one sendmsg


def with_lane(header: ps_pb2.PushHeader, lane: Lane | None) -> ps_pb2.PushHeader:
    """`header`, or with a bulk `lane` a copy of it that names the lane (PushHeader.lane)."""
    if lane is None:
        return header
    named = ps_pb2.PushHeader()
    named.CopyFrom(header)
    named.lane = lane.key
    return named


def _wire_nbytes(grad) -> int:
    """The bytes a gradient (a tensor, or compression.Encoded) puts on the wire."""
    return (grad.payload if isinstance(grad, Encoded) else grad).nbytes


class _RowsSent:
    """A push's row gradients: summed per table, cut by the table layout they were placed by (`parts`), and
    the rows that shards refused as placed by an older one (DataPath._rows_again sends them again)."""

    def __init__(self, client: "DataPath", rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]]):
        self._client = client
        self.summed = client._summed_rows(rows)
        self._counts = {name: client.table_layout(name).num_shards for name in self.summed}
        self.parts = client._cut_rows(self.summed)
        self._lock = threading.Lock()
        self._refused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.counted: set[int] = set()  # shards that counted this push's optimizer step of the tables

    def accepted(self, shard: int, tables: Mapping) -> None:
        """A shard applied (or summed) its part with `tables` in it: it counted their step."""
        if tables:
            with self._lock:
                self.counted.add(shard)

    def placed_by(self) -> dict[str, int]:
        """{table: the shards it was spread over when this push's rows were last cut}."""
        return dict(self._counts)

    def placed(self, counts: Mapping[str, int]) -> None:
        """Its rows were sent again, cut by `counts`."""
        self._counts = dict(counts)

    def refused(self, shard: int, tables: Mapping) -> None:
        """A shard refused its part (LayoutChangedError) with its rows of `tables` in it."""
        if tables:
            self._client._layout.count_refused()
            self._keep(self._client._rows_placed_by({n: self.summed[n] for n in tables}, self._counts, {shard}))

    def refused_again(self, sent: Mapping[str, tuple[torch.Tensor, torch.Tensor]], counts: Mapping[str, int],
                      shard: int) -> None:
        """A shard refused the rows of `sent` it was sent again, placed by `counts`."""
        self._keep(self._client._rows_placed_by(sent, counts, {shard}))

    def _keep(self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        with self._lock:
            for name, (ids, grads) in rows.items():
                if name in self._refused:
                    kept_ids, kept = self._refused[name]
                    ids, grads = torch.cat([kept_ids, ids]), torch.cat([kept, grads])
                self._refused[name] = (ids, grads)

    def take_refused_for(self, shard: int) -> tuple[dict[str, Encoded], bool, dict]:
        """(ROWS tensors, whether they count the tables' step there, the rows taken): the refused rows `shard`
        owns in the table layout followed now, taken out of the refused ones (put_back() if refused again);
        every table of the push (empty where it owns none), counting, if the shard has not counted the push's
        optimizer step of the tables yet."""
        client = self._client
        mine = {}
        with self._lock:
            for name, (ids, grads) in list(self._refused.items()):
                layout = client.table_layout(name)
                ours = row_owner(ids, layout.num_shards, layout.partition) == shard
                if bool(ours.any()):
                    mine[name] = (ids[ours], grads[ours])
                self._refused[name] = (ids[~ours], grads[~ours])
            counted = shard in self.counted
        if counted:
            return {name: encode_rows(ids, grads) for name, (ids, grads) in mine.items()}, False, mine
        empty = {name: (ids[:0], grads[:0]) for name, (ids, grads) in self.summed.items()}
        return {name: encode_rows(*mine.get(name, empty[name])) for name in self.summed}, True, mine

    def put_back(self, taken: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Rows take_refused_for() gave that were refused again."""
        self._client._layout.count_refused()
        self._keep(taken)

    def take_refused(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        with self._lock:
            out, self._refused = {n: r for n, r in self._refused.items() if len(r[0])}, {}
            return out


class DataPath:
    """pull, pull_into, push, push_pull: the calls of a training step (PSClient inherits them)."""

    # Dynamic sharding (client/dataqueue.py): the data positions the next push trained (PushHeader.data), set by
    # DataQueue.pushing() for the pushes it wraps.
    data_progress: ps_pb2.DataProgress | None = None

    def pull(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Fetches variables into new CPU tensors: {name: tensor}.

        Each tensor is one consistent version. Blocks until all arrive (at
        most `timeout` per attempt); on error nothing is returned.
        """
        names = list(names)
        wire_names = self.partitions.wire_names(names)
        sink = NewTensors()
        self._refill.guard(wire_names, lambda: self._pull(wire_names, sink))
        return self.partitions.join(sink.tensors, names)

    def pull_into(self, targets: Mapping[str, torch.Tensor], *, min_step: int = 0,
                  bases: PullBases | None = None) -> int:
        """Overwrites each target tensor in place with its variable; returns shard 0's step counter
        (-1 if shard 0 holds none of the targets).

        With min_step, each shard first waits until it has applied that many
        steps (sync mode: the step this worker was released at). Targets may
        live on CPU or CUDA (CUDA goes through pinned staging memory). Dtype
        and shape must match (TensorMismatchError). Blocks for at most
        `timeout` per attempt. If it raises midway, targets may be partly
        overwritten: pull again.

        With `bases` (a PullBases kept with these targets), a delta pull: a
        variable whose target still holds the version last pulled into it
        comes as what changed since, where its shard knows that and it pays
        (ps.proto's PullRequest.base_versions), else whole; either way the
        targets end equal to the variables, bit for bit, as long as nothing
        but these pulls writes them (else `bases.forget` them first).
        """
        targets = self.partitions.split(targets)  # row views: pieces land in place
        sink = IntoTargets(targets, self.stats, self._device)
        step = self._refill.guard(targets, lambda: self._pull(list(targets), sink, min_step, bases))
        sink.finish()
        return step

    def _pull(self, names: list[str], sink, min_step: int = 0, bases: PullBases | None = None) -> int:
        """Streams `names` from their shards into sink; shard 0's step, or -1 if shard 0 was not read. With
        `bases` (sink an IntoTargets), each attempt names the versions its targets hold (PullBases.take)."""
        def pull(shard: int, shard_names: list[str], first: bool, again: bool) -> int:
            def attempt(stub, timeout: float) -> int:
                request = ps_pb2.PullRequest(names=shard_names, chunk_bytes=self.chunk_bytes, min_step=min_step,
                                             cast=self._pull_casts(shard_names, sink))
                if bases is not None:
                    request.base_generation, versions = bases.take(shard_names, sink.targets)
                    request.base_versions.extend(versions)
                targets = getattr(sink, "targets", None)  # a pull into known targets: its size is known
                nbytes = 0 if targets is None else sum(targets[n].nbytes for n in shard_names)
                return self._pull_stream(shard, stub, request, timeout, nbytes, lambda messages: read_stream(
                    messages, shard_names, sink, self._fanout.target(shard), stats=self.stats, bases=bases)[0])

            return self._fanout.call(shard, attempt, self.timeout)

        return self._layout.each(self.placement.group(names), pull, "pull").get(GLOBAL_STEP_SHARD, -1)

    def _pull_stream(self, shard: int, stub, request: ps_pb2.PullRequest, timeout: float, nbytes: int,
                     read: Callable[[Iterator], int], watch: Callable[[object], Iterator] = iter) -> int:
        """read(messages) of `request`'s Pull stream from `shard` (`watch(call)` iterates the call), its bytes
        on a bulk lane if one is lent for the `nbytes` to come (client/lanes.py): the lane is given back in
        step, or closed if the stream failed (LaneBrokenError is retried by the caller's fanout call). Known
        bytes that fit in one message (`nbytes`, read without a `watch`) come as one PullOne call."""
        started = time.perf_counter()
        if 0 < nbytes <= self.chunk_bytes and watch is iter:
            step = read([stub.PullOne(request, timeout=timeout)])
            self.stats.add_stage("pull_call", time.perf_counter() - started)
            return step
        lane = self._lanes.borrow(shard, nbytes, timeout)
        if lane is not None:
            request.lane, request.chunk_bytes = lane.key, LANE_CHUNK_BYTES
        call, ok = stub.Pull(request, timeout=timeout), False
        try:
            step = read(lane_messages(watch(call), lane, timeout))
            ok = True
            self.stats.add_stage("pull_call", time.perf_counter() - started)
            return step
        finally:
            if not ok:
                call.cancel()
            self._lanes.give_back(shard, lane, ok)

    def push(self, grads: Mapping[str, torch.Tensor], *, step: int | None = None, advance_step: bool = True,
             rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
        """Sends gradients; each shard applies (async, ssp) or aggregates (sync) its part.

        `rows` adds embedding tables' row gradients, {table: (ids, (len(ids),
        dim) gradients)} (repeated ids are summed here), to the same push: each
        shard gets its rows of every table (none, where it holds none of the
        ids) with its dense gradients, and applies them all or none
        (tables.py; in sync mode they join the step's average like dense ones).

        `step` is the step the gradients were computed at (default: self.step,
        what the last push or join returned). Returns the step to compute at
        next, and keeps it in self.step: in sync mode shard 0 replies only once
        this worker may go on (its step was applied, or another batch is
        wanted); in async mode it is the global step after this push. Blocks
        until every shard has replied (at most `timeout` per attempt).

        Every shard gets the push, empty if it holds none of these variables:
        each counts pushes (its step counter, and its quorum in sync mode).
        With advance_step (default) the push counts as one step; shard 0's
        count is the global step.

        Exactly once: the push carries this client's incarnation and a number,
        and every retry (lost connection, restarted shard) repeats them, so a
        shard applies it at most once. If it raises, shards that replied have
        the gradients and the others do not; NaN/Inf and shape errors change
        nothing anywhere.
        """
        self.dispatch_live_workers()  # callbacks on a change of the live workers' count
        grads = self.partitions.split(grads)
        with self._push_lock:
            self.check_fenced()
            groups = self.placement.group(grads)
            groups = {shard: groups.get(shard, []) for shard in range(self._layout.shards)}
            table_rows = _RowsSent(self, rows or {})
            header = self._header(step, advance_step)
            staged = self._stage_out(grads)  # CUDA gradients: host copies, kept for retries until the push is over
            sent, left = self._encode(staged.tensors, header.step)  # once: a retry resends the same bytes
            push = self._part_sender(header, sent, left, table_rows)
            try:
                with self._watch_held():
                    replies = self._refill.guard(grads, lambda: self._layout.each(groups, push, "push"))
                replies.update({shard: reply for shard, reply in self._rows_again(table_rows, replies, header).items()
                                if shard not in replies})
                return self._finish_push(replies)
            finally:
                staged.release()

    def _part_sender(self, header: ps_pb2.PushHeader, sent: Mapping, left: Mapping,
                     table_rows: "_RowsSent | None"):
        """push(shard, names, first, again): one shard's part of the push `header` starts, as a Push stream;
        the gradients `sent` as encoded, rows `table_rows.parts` by shard. A part sent `again` after a live
        resize moved its names (layout.LayoutFollower) is a push of its own (the next number; the first
        attempt's keeps its number through every retry), counting no step where the push already counted one
        (`first` False); the rows of a refused part go by _rows_again."""
        def push(shard: int, names: list[str], first: bool, again: bool = False) -> ps_pb2.PushResponse:
            tables, counts_step, taken = {}, True, None
            if table_rows is not None:  # sent again: the refused rows this shard owns now, in the same part
                if again:
                    tables, counts_step, taken = table_rows.take_refused_for(shard)
                else:
                    tables = table_rows.parts.get(shard, {})
            shard_header = self._shard_header(header, len(names) + len(tables), again=again,
                                              step_increment=header.step_increment if first else 0,
                                              rows_again=bool(tables) and not counts_step)
            def attempt(stub, timeout: float) -> ps_pb2.PushResponse:
                grads = {**sent, **tables}
                nbytes = sum(_wire_nbytes(grads[n]) for n in names)
                lane = self._lanes.borrow(shard, nbytes, timeout)
                header, ok = with_lane(shard_header, lane), False
                started = time.perf_counter()
                try:
                    reply = _push_call(stub, push_requests(header, grads, [*names, *tables],
                                                           LANE_CHUNK_BYTES if lane else self.chunk_bytes,
                                                           self.stats, lane, timeout),
                                       lane is None and nbytes <= self.chunk_bytes, timeout)
                    ok = True
                    self.stats.add_stage("push_call", time.perf_counter() - started)
                    return reply
                except grpc.RpcError:
                    if lane is not None and lane.closed:  # the lane broke while gRPC read the requests
                        raise self._lane_broke(shard) from None
                    raise
                finally:
                    self._lanes.give_back(shard, lane, ok)

            try:
                reply = self._fanout.call(shard, attempt, self.timeout)
            except LayoutChangedError:
                if taken is not None:
                    table_rows.put_back(taken)
                elif tables:
                    table_rows.refused(shard, tables)
                raise
            if tables:
                table_rows.accepted(shard, tables)
            self._encoder.commit(left, names)  # applied there: their residuals move on
            return reply

        return push

    def _lane_broke(self, shard: int) -> LaneBrokenError:
        """What a push attempt to `shard` raises when gRPC failed because its bulk lane broke (retried: nothing
        was applied)."""
        return LaneBrokenError(f"the bulk lane to {self._fanout.target(shard)} broke during a push; nothing was "
                               f"applied")

    def _rows_again(self, table_rows: "_RowsSent", replies: Mapping[int, ps_pb2.PushResponse],
                    header: ps_pb2.PushHeader) -> dict[int, ps_pb2.PushResponse]:
        """After a push placed by an older table layout than a live resize made (its `replies` carry a later
        epoch, or a shard refused rows): the refused rows go to their owners now, and every shard of the new
        count that counted no optimizer step of the push's tables counts it (its rows, or none), the others
        take their rows without counting one (PushHeader.rows_again). Rounds of that until every row was taken
        or MAX_ROUNDS layouts were followed; no global step is counted again. {shard: its first reply}."""
        if not table_rows.summed:
            return {}
        if replies:
            self._layout.refresh(seen=max(reply.layout_epoch for reply in replies.values()))
        out: dict[int, ps_pb2.PushResponse] = {}
        for _ in range(MAX_ROUNDS):
            again = table_rows.take_refused()
            if again:
                self._layout.refresh()
            counts = {name: self.table_layout(name).num_shards for name in table_rows.summed}
            if not again and counts == table_rows.placed_by():
                return out
            parts = self._cut_rows(again, every_shard=False)
            empty = self._cut_rows({name: (ids[:0], grads[:0]) for name, (ids, grads) in table_rows.summed.items()})
            targets = set(parts) | {s for s in range(max(counts.values())) if s not in table_rows.counted}

            def send(shard: int, _) -> ps_pb2.PushResponse | None:
                counts_step = shard not in table_rows.counted
                tables = {**(empty.get(shard, {}) if counts_step else {}), **parts.get(shard, {})}
                shard_header = self._shard_header(header, len(tables), again=True, rows_again=not counts_step)
                try:
                    reply = self._fanout.call(shard, lambda stub, t: _push_call(stub, push_requests(
                        shard_header, tables, list(tables), self.chunk_bytes, self.stats),
                        sum(map(_wire_nbytes, tables.values())) <= self.chunk_bytes, t), self.timeout)
                except LayoutChangedError:
                    return None
                table_rows.accepted(shard, tables)
                return reply

            for shard, reply in self._fanout.each({s: [] for s in sorted(targets)}, send, "push").items():
                if reply is None:
                    self._layout.count_refused()
                    table_rows.refused_again(again, counts, shard)
                else:
                    out.setdefault(shard, reply)
            table_rows.placed(counts)
        raise LayoutChangedError(f"row gradients were refused as moved after {MAX_ROUNDS} table layouts")

    def push_pull(self, grads: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], *,
                  step: int | None = None, advance_step: bool = True,
                  rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                  bases: PullBases | None = None) -> int:
        """push(grads, rows=rows) then pull_into(targets, bases=bases), in one round trip per shard (PushPull)
        in every mode.

        Used when each shard's gradients (row gradients included) and variables
        fit in one chunk_bytes message; otherwise this is push() then
        pull_into(). In sync mode every shard holds its reply until this worker
        may go on, and a shard whose values predate the step shard 0 released
        is read again (min_step), so the guarantees are those of push then
        pull_into. Returns the next step.
        """
        self.dispatch_live_workers()
        grads, targets = self.partitions.split(grads), self.partitions.split(targets)
        groups = self.placement.group(grads)
        pulls = self.placement.group(targets)
        sync = self.mode is not None and self.mode.mode == "sync"
        table_rows = _RowsSent(self, rows or {})
        table_sent = table_rows.parts

        def nbytes(tensors: Mapping[str, torch.Tensor], names: list[str]) -> int:
            return sum(tensors[n].numel() * tensors[n].element_size() for n in names)

        if any(nbytes(grads, groups.get(s, [])) + sum(e.payload.numel() for e in table_sent.get(s, {}).values())
               > self.chunk_bytes or nbytes(targets, pulls.get(s, [])) > self.chunk_bytes
               for s in range(self._layout.shards)):
            self.push(grads, step=step, advance_step=advance_step, rows=rows)
            self.pull_into(targets, min_step=self.step if sync else 0, bases=bases)
            return self.step
        with self._push_lock:
            self.check_fenced()
            sink = IntoTargets(targets, self.stats, self._device)
            header = self._header(step, advance_step)
            staged = self._stage_out(grads)  # CUDA gradients: host copies, kept for retries until the push is over
            try:
                sent, left = self._encode(staged.tensors, header.step)  # once: a retry resends the same bytes
            except BaseException:
                staged.release()
                raise

            resend = self._part_sender(header, sent, left, table_rows)

            def exchange(shard: int, names: list[str], first: bool, again: bool) -> tuple[int, ps_pb2.PushResponse]:
                if again:  # sent again after a live resize: a push alone (the values are read below)
                    return -1, resend(shard, names, first, again)
                tables = table_sent.get(shard, {})  # a shard a live resize added holds no table
                pull = pulls.get(shard, [])
                pull_cast = self._pull_casts(pull, sink)
                # a retry of this one message is answered before anything is written
                generation, versions = bases.take(pull, targets) if bases is not None else (0, [])
                shard_header = self._shard_header(header, len(names) + len(tables), pull=pull, pull_cast=pull_cast,
                                                  pull_base_generation=generation, pull_base_versions=versions)
                (request,) = push_requests(shard_header, {**sent, **tables}, [*names, *tables], self.chunk_bytes,
                                             self.stats)
                started = time.perf_counter()
                try:
                    reply = self._fanout.call(shard, lambda stub, t: read_stream(
                        [stub.PushPull(request, timeout=t)], list(shard_header.pull), sink,
                        self._fanout.target(shard), stats=self.stats, bases=bases), self.timeout)
                    self.stats.add_stage("exchange_call", time.perf_counter() - started)
                except LayoutChangedError:
                    table_rows.refused(shard, tables)
                    raise
                table_rows.accepted(shard, tables)
                self._encoder.commit(left, names)  # applied there: their residuals move on
                return reply

            try:
                epoch = self._layout.epoch
                with self._watch_held():
                    replies = self._refill.guard({**grads, **targets}, lambda: self._layout.each(
                        {s: groups.get(s, []) for s in range(self._layout.shards)}, exchange, "push_pull"))
                replies.update({shard: (-1, reply) for shard, reply in self._rows_again(
                    table_rows, {shard: reply for shard, (_, reply) in replies.items()}, header).items()
                                if shard not in replies})
            finally:
                staged.release()
            next_step = self._finish_push({shard: result for shard, (_, result) in replies.items()})
            if self._layout.epoch != epoch:  # variables moved meanwhile: their values come from their new owners
                self._pull(list(targets), sink, min_step=next_step if sync else 0, bases=bases)
                sink.finish()
                return next_step
            behind = [name for shard, (read_at, _) in replies.items() if sync and read_at < next_step
                      for name in pulls.get(shard, [])]
            if behind:
                self._pull(behind, sink, min_step=next_step, bases=bases)
            sink.finish()
            return next_step

    def _header(self, step: int | None, advance_step: bool) -> ps_pb2.PushHeader:
        """The header of a new push: this client's incarnation and the push's number (kept by retries), and the
        data positions it trained (data_progress) if set. Each shard's message gets _shard_header's."""
        return ps_pb2.PushHeader(worker=self.worker, step=self.step if step is None else step,
                                 step_increment=int(advance_step), incarnation=self.incarnation, seq=next(self._seq),
                                 data=self.data_progress, layout_epoch=self._layout.epoch)

    def _shard_header(self, header: ps_pb2.PushHeader, tensors: int, *, again: bool = False,
                      step_increment: int = 0, rows_again: bool = False, **fields) -> ps_pb2.PushHeader:
        """The header of one shard's part of the push `header` (_header's; sent unstreamed): `tensors` tensors,
        and `fields` (PushPull's pulls). `again`: a part sent again after a live resize moved it, a push of
        its own: the next number, the layout it was placed by this time, `step_increment`, and `rows_again`
        (its rows count no optimizer step there: PushHeader.rows_again)."""
        shard_header = ps_pb2.PushHeader(tensors=tensors, **fields)
        shard_header.MergeFrom(header)
        shard_header.streamed = False
        if again:
            shard_header.seq = next(self._seq)
            shard_header.step_increment = step_increment
            shard_header.layout_epoch = self._layout.epoch
            shard_header.rows_again = rows_again
        return shard_header

    def _stage_out(self, grads: Mapping[str, torch.Tensor]) -> Staged:
        """The gradients on the host: CUDA ones that travel uncompressed copied into reused pinned buffers
        (device.py; counted as copied), the rest as they are (compression encodes on their device). Blocks
        until those copies are done. release() the result once the push is over."""
        staged = self._device.stage_out({name: grad for name, grad in grads.items()
                                         if name not in self._encoder.policies})
        self.stats.count_bytes(copied=staged.nbytes)
        staged.tensors = {**grads, **staged.tensors}
        return staged

    def _encode(self, grads: Mapping[str, torch.Tensor], step: int) -> tuple[dict, dict]:
        """The compression encoder's encode_all (torchps/compression.py), its output bytes counted as copied."""
        sent, left = self._encoder.encode_all(grads, step)
        self.stats.count_bytes(copied=sum(g.payload.numel() * g.payload.element_size() for g in sent.values()
                                         if isinstance(g, Encoded)))
        return sent, left

    def _pull_casts(self, names: list[str], sink) -> list[int]:
        """PullRequest.cast for `names` by the compression policies: pulls in place only (pull() is exact)."""
        if not isinstance(sink, IntoTargets):
            return []
        return self._encoder.pull_casts({name: sink.targets[name] for name in names}, self.step)

    def _finish_push(self, replies: Mapping[int, ps_pb2.PushResponse]) -> int:
        self.last_replies = dict(replies)
        for shard, reply in replies.items():
            self._fanout.note_generation(shard, reply.generation)
        self._layout.refresh(seen=max(reply.layout_epoch for reply in replies.values()))
        lead = replies[GLOBAL_STEP_SHARD]
        self.stats.record(stale=lead.stale, duplicate=lead.duplicate, wait_seconds=lead.wait_seconds,
                          quorum=lead.quorum)
        self.step = lead.next_step
        return lead.next_step


def _push_call(stub, requests: Iterator[bytes], small: bool, timeout: float) -> ps_pb2.PushResponse:
    """One shard's push of serialized `requests`: a PushOne call where they are one message (`small`: the
    push's bytes fit in one), else a Push stream."""
    if small:
        messages = list(requests)
        if len(messages) == 1:
            return stub.PushOne(messages[0], timeout=timeout)
        requests = iter(messages)
    return stub.Push(requests, timeout=timeout)
