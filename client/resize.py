"""A live resize, run by the chief (PSClient.resize, ps-admin resize): the job's shards become `addresses`.

Shard indices stay: a resize adds shards at the end or removes the last ones
(ps 0 always stays, it counts the global step). The steps:
1. the plan: every variable stays where it is, except those of removed
   shards (each to the least loaded shard that stays, largest first) and,
   when shards are added, the largest that make the load more even (greedy
   by bytes: moved until no move would lower the most loaded shard's bytes);
2. the variables that move go in batches of at most BATCH_BYTES (largest
   first), each under a layout epoch of its own, so a client waits for one
   batch in transit at most. Each epoch is set on every shard: the added
   ones (configured in the job's mode first) and those that stay, then ps 0,
   then the removed ones, so a client sent away by any shard finds the epoch
   on ps 0 and the new owner expecting the variable (layout.py);
3. then each variable of the batch is exported by its old shard and imported
   by its new one, relayed here, the shards' moves in parallel;
4. with embedding tables, whose rows are spread over every shard by id, an
   epoch with `table_shards` (the new count) freezes them on every shard;
   then every old shard exports, for each shard of the new count in turn,
   the rows that shard owns now, imported there (one part per old shard in
   flight here at a time); a shard builds its tables once every old
   shard's part arrived, and they serve again. Clients that placed rows by
   the old count are refused and send them to their owners (datapath.py);
5. with shards removed, or a hold, or tables, a last epoch without them,
   ending the hold and the tables' re-layout; removed shards are stopped
   (Shutdown) after `drain_seconds`, in which they answer the clients that
   did not yet follow with LayoutChangedError.
Async and ssp training goes on throughout; a client waits only for the
variables in transit (VariableMovingError, retried). A sync job instead
pauses at a step boundary, as no step's pending sums may span a move: two
epochs before step 1 set a hold on every shard (pushes computed at step F
or later wait, F the first step no shard counted a push for), the resize
waits until every shard applied the steps before F (at most
`quiet_seconds`), the variables move (each epoch of theirs gives an added
shard, which took F as its own step, ps 0's workers as ps 0 counts them,
so that it expects the gradients ps 0 does), and the last epoch ends the
hold; the held pushes then go again, placed anew (layout.py). The pause is the
time from the hold to its end. Blocks until done; raises PSError
(a refused layout, a shard unreachable) with the moves done so far in force:
variables exported but not imported stay in their exporter's outbox (see
layout.py), and the next resize (to the same shards or others) imports them
before anything else. The same shards again: a rebalance (step 1's moves
for added shards, if any).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from ..errors import ClusterConfigError, PSError, ServerUnavailableError, WaitTimeoutError
from ..proto import ps_pb2
from .fanout import ShardFanout
from .layout import LayoutFollower

__all__ = ["ResizeReport", "run", "plan", "DRAIN_SECONDS", "QUIET_SECONDS"]

_LOGGER = logging.getLogger(__name__)
DRAIN_SECONDS = 2.0  # a removed shard answers LayoutChangedError this long before it stops
OUTBOX_RETRY_SECONDS = 3.0  # how long a resize waits for a shard it asks for exports cut off earlier
BATCH_BYTES = 16 << 20  # variables moved under one layout epoch: a client waits for one batch in transit at most
QUIET_SECONDS = 60.0  # sync: how long a resize waits for the steps before its hold to be applied everywhere
QUIET_POLL_SECONDS = 0.02


@dataclasses.dataclass
class ResizeReport:
    """What a resize did."""

    epoch: int              # the layout epoch it set
    shards_before: int
    shards_after: int
    moved: int              # variables that changed shards
    moved_bytes: int
    move_seconds: float     # from the first SetLayout to the last import (sync: to the hold's end): the longest a
                            # variable was in transit, and a sync job's pause
    stopped: list[str]      # removed shards' addresses, stopped
    table_bytes: int = 0    # embedding-table rows re-laid out (bytes relayed, optimizer state and metadata included)

    def line(self) -> str:
        return (f"layout epoch {self.epoch}: {self.shards_before} -> {self.shards_after} shards, {self.moved} "
                f"variables ({self.moved_bytes:,} bytes) moved"
                + (f", tables re-laid out ({self.table_bytes:,} bytes)" if self.table_bytes else "")
                + f" in {self.move_seconds:.2f} s"
                + (f", stopped {', '.join(self.stopped)}" if self.stopped else ""))


def plan(held: dict[int, list[tuple[str, int]]], shards: int, *, balance: bool) -> dict[str, int]:
    """The placement on `shards` shards (0..shards-1) of the variables `held` {shard: [(name, bytes)]} (see the
    module docstring): those of shards past `shards` to the least loaded, then, with `balance` (shards were
    added), the moves that make the load more even; deterministic."""
    placement: dict[str, int] = {}
    size: dict[str, int] = {}
    load = [0] * shards
    for shard, variables in sorted(held.items()):
        for name, nbytes in variables:
            size[name] = nbytes
            if shard < shards:
                placement[name] = shard
                load[shard] += nbytes
    orphans = sorted((name for name in size if name not in placement), key=lambda n: (-size[n], n))
    for name in orphans:
        target = min(range(shards), key=lambda s: (load[s], s))
        placement[name] = target
        load[target] += size[name]
    for _ in range(len(size) if balance else 0):
        heavy = max(range(shards), key=lambda s: (load[s], -s))
        light = min(range(shards), key=lambda s: (load[s], s))
        movable = [n for n, s in placement.items() if s == heavy and 0 < size[n] < load[heavy] - load[light]]
        if not movable:
            break
        name = max(movable, key=lambda n: (size[n], n))
        placement[name] = light
        load[heavy] -= size[name]
        load[light] += size[name]
    return placement


def _complete_exports(fanout: ShardFanout, shards: int) -> None:
    """Imports again what a resize cut off after an export left in the outbox of its exporter, one of the
    job's first `shards` (GetLayout), so no variable stays in transit; a shard that does not answer within a
    few seconds is passed over."""
    for shard in range(shards):
        try:
            layout = fanout.call(shard, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t),
                                 fanout.control_timeout, retry_for=OUTBOX_RETRY_SECONDS)
        except ServerUnavailableError:
            continue  # stopped (a removed shard): it exports nothing any more
        for request in layout.outbox:
            held = fanout.call(request.to, lambda stub, t: stub.ListVariables(ps_pb2.ListRequest(), timeout=t),
                               fanout.control_timeout)
            if set(request.names) <= {info.spec.name for info in held.variables}:
                continue  # imported: the resize that exported them finished
            chunks = fanout.call(shard, lambda stub, t: list(stub.ExportVariables(request, timeout=t)), fanout.timeout)
            fanout.call(request.to, lambda stub, t: stub.ImportVariables(iter(chunks), timeout=t), fanout.timeout)
            _LOGGER.info("completed an export cut off earlier: %d variables from ps %d to ps %d",
                         len(request.names), shard, request.to)


def _batches(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """`names` in order, cut into batches of at most `limit` bytes (a larger variable alone)."""
    batches: list[list[str]] = []
    total = limit
    for name in names:
        if total + sizes[name] > limit:
            batches.append([])
            total = 0
        batches[-1].append(name)
        total += sizes[name]
    return batches


def _hold(fanout: ShardFanout, set_layout, current: dict[str, int], quiet_seconds: float) -> int:
    """Sync jobs: holds pushes from one step on every shard (two epochs, set_layout(placement, hold) each),
    then waits until every shard is quiet under it; returns the step. ClusterConfigError if the shards
    disagree, WaitTimeoutError if one is not quiet in `quiet_seconds` (the hold is left to the caller)."""
    asked = set_layout(current, 1)  # each shard holds from the lowest step it may
    hold = max(layout.hold_from_step for layout in asked.values())
    agreed = set_layout(current, hold)
    if any(layout.hold_from_step != hold for layout in agreed.values()):
        raise ClusterConfigError(f"the shards could not all hold pushes from step {hold}: "
                                 f"{ {s: layout.hold_from_step for s, layout in sorted(agreed.items())} }")
    give_up = time.monotonic() + quiet_seconds
    waiting = sorted(agreed)
    while waiting:
        layouts = fanout.each({s: [] for s in waiting}, lambda shard, _: fanout.call(
            shard, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t), fanout.control_timeout))
        waiting = [s for s in waiting if not layouts[s].quiet]
        if waiting and time.monotonic() > give_up:
            raise WaitTimeoutError(f"ps {waiting} did not apply every step before {hold} within {quiet_seconds:g} "
                                   f"s (a sync step short of its quorum); no variable moved")
        if waiting:
            time.sleep(QUIET_POLL_SECONDS)
    _LOGGER.info("sync job held at step %d: every shard quiet", hold)
    return hold


def run(fanout: ShardFanout, follower: LayoutFollower, addresses: list[str], *,
        drain_seconds: float = DRAIN_SECONDS, quiet_seconds: float = QUIET_SECONDS) -> ResizeReport:
    """The resize (see the module docstring); `fanout` must carry the chief's credentials."""
    follower.refresh()
    before = follower.shards
    old = list(fanout.channels.addresses[:before])
    common = min(len(old), len(addresses))
    if not addresses or addresses[:common] != old[:common] or len(set(addresses)) != len(addresses):
        raise ClusterConfigError(f"a resize keeps the shards' order and adds or removes shards at the end: the job "
                                 f"has {old}; asked for {addresses}")
    control = fanout.control_timeout

    def call(shard: int, fn):
        return fanout.call(shard, fn, control)

    config = call(0, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t)).config
    sync = config.mode == "sync"
    if len(addresses) > before:
        fanout.channels.follow(addresses)  # channels to the added shards (this client's own)
    everyone = range(max(before, len(addresses)))
    added = {s: [] for s in range(before, len(addresses))}
    fanout.each(added, lambda shard, _: call(shard, lambda stub, t: stub.Configure(config, timeout=t)))
    wide = addresses if len(addresses) > before else old  # every shard that holds or takes variables meanwhile
    epoch = follower.epoch
    hold = 0
    job = None  # sync: ps 0's layout once the job is held, with the workers an added shard takes
    holding = False  # a hold may be set on some shard: end it before returning or raising
    started: float | None = None  # when the first epoch was set
    table_bytes = 0

    def set_layout(addresses_then: list[str], placement: dict[str, int], hold_from: int, table_shards: int = 0,
                   job: ps_pb2.Layout | None = None) -> dict[int, ps_pb2.Layout]:
        """The next epoch, on every shard: the others, then ps 0, then those it removes (so a client that one
        of them sends away finds the epoch on ps 0); {shard: its reply}. `job`: ps 0's layout under the hold,
        whose workers a shard that joins the job takes (ps.proto's Layout.members)."""
        nonlocal epoch, started
        epoch += 1
        started = started or time.monotonic()
        layout = ps_pb2.Layout(epoch=epoch, addresses=addresses_then, placement=placement, hold_from_step=hold_from,
                               table_shards=table_shards)
        if job is not None:
            layout.members.extend(job.members)
            layout.grace_left_seconds = job.grace_left_seconds
        replies: dict[int, ps_pb2.Layout] = {}
        for group in (range(1, len(addresses_then)), [0], range(len(addresses_then), len(wide))):
            replies.update(fanout.each({s: [] for s in group}, lambda shard, _: call(
                shard, lambda stub, t: stub.SetLayout(layout, timeout=t))))
        return replies

    try:
        if sync:
            current = dict(call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t)).placement)
            current.update({name: s for s, held in _held(fanout, range(before)).items() for name, _ in held})
            holding = True
            hold = _hold(fanout, lambda placement, step: set_layout(wide, placement, step), current, quiet_seconds)
            job = call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t))  # its workers, quiet
        _complete_exports(fanout, before)
        held = _held(fanout, everyone)
        placement = plan(held, len(addresses), balance=len(addresses) >= before)
        source = {name: shard for shard, variables in held.items() for name, _ in variables}
        sizes = {name: nbytes for variables in held.values() for name, nbytes in variables}
        moving = sorted((name for name in placement if source[name] != placement[name]),
                        key=lambda n: (-sizes[n], n))
        now = dict(source)
        for batch in _batches(moving, sizes, BATCH_BYTES) or ([[]] if len(addresses) != before else []):
            for name in batch:
                now[name] = placement[name]
            set_layout(wide, now, hold, job=job)
            pairs: dict[tuple[int, int], list[str]] = {}
            for name in batch:
                pairs.setdefault((source[name], placement[name]), []).append(name)

            def move_from(shard: int, _, pairs=pairs, epoch=epoch) -> None:
                for (src, dst), names in sorted(pairs.items()):
                    if src == shard:
                        request = ps_pb2.MoveRequest(names=names, epoch=epoch, to=dst)
                        chunks = fanout.call(src, lambda stub, t: list(stub.ExportVariables(request, timeout=t)),
                                             fanout.timeout)
                        fanout.call(dst, lambda stub, t: stub.ImportVariables(iter(chunks), timeout=t),
                                    fanout.timeout)

            fanout.each({src: [] for src in sorted({src for src, _ in pairs})}, move_from)
        tables = _table_sources(fanout, range(max(len(wide), len(addresses))), len(addresses))
        if tables is not None:  # the embedding tables' rows, re-laid out onto the new count
            set_layout(wide, now, hold, len(addresses))
            def rows_from(src: int, _, epoch=epoch) -> int:  # the old shards at once, each to one shard at a time
                moved = 0
                for dst in range(len(addresses)):
                    request = ps_pb2.MoveRequest(epoch=epoch, to=dst, tables=True)
                    chunks = fanout.call(src, lambda stub, t: list(stub.ExportVariables(request, timeout=t)),
                                         fanout.timeout)
                    fanout.call(dst, lambda stub, t: stub.ImportVariables(iter(chunks), timeout=t), fanout.timeout)
                    moved += sum(len(chunk.data) for chunk in chunks)
                return moved

            table_bytes = sum(fanout.each({src: [] for src in range(tables)}, rows_from).values())
        if len(addresses) < before or holding or tables is not None:  # an epoch without the removed shards,
            set_layout(addresses if len(addresses) < before else wide, now, 0,  # the hold, the tables' freeze
                       len(addresses) if tables is not None else 0)
            holding = False
    finally:
        if holding:  # cut off: training goes on (a variable in transit waits for the resize to be run again)
            try:
                set_layout(wide, dict(call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(),
                                                                             timeout=t)).placement), 0)
            except PSError as exc:
                _LOGGER.warning("could not end the hold (step %d) after a failed resize: %s", hold, exc)
    seconds = time.monotonic() - started if started else 0.0
    stopped = []
    if len(addresses) < before:
        time.sleep(drain_seconds)  # the removed shards keep answering LayoutChangedError meanwhile
        gone = {s: [] for s in range(len(addresses), before)}
        fanout.each(gone, lambda shard, _: call(shard, lambda stub, t: stub.Shutdown(
            ps_pb2.ShutdownRequest(reason=f"removed from the job at layout epoch {epoch}"), timeout=t)))
        stopped = old[len(addresses):]
    follower.refresh()
    report = ResizeReport(epoch, before, len(addresses), len(moving), sum(sizes[n] for n in moving), seconds,
                          stopped, table_bytes)
    _LOGGER.info("%s", report.line())
    return report


def _table_sources(fanout: ShardFanout, shards, count: int) -> int | None:
    """How many old shards' embedding-table rows a re-layout onto `count` shards takes (ListTables on
    `shards`): the count the tables are spread over where a shard still holds them so, if not `count`; None if
    the job has no tables, or every one of the `count` shards holds them spread over `count`; else 0 (a
    re-layout cut off before its end epoch: only that epoch is set again)."""
    listed = fanout.each({s: [] for s in shards}, lambda shard, _: fanout.call(
        shard, lambda stub, t: stub.ListTables(ps_pb2.ListRequest(), timeout=t), fanout.control_timeout))
    counts = {s: {info.num_shards for info in reply.tables} for s, reply in listed.items()}
    if not any(counts.values()):
        return None
    old = {c for cs in counts.values() for c in cs} - {count}
    if len(old) > 1:
        raise ClusterConfigError(f"the shards' embedding tables are spread over {sorted(old)} shards: no one layout "
                                 f"to re-lay out from")
    if old:
        return old.pop()
    return 0 if any(not counts.get(s) for s in range(count)) else None


def _held(fanout: ShardFanout, shards) -> dict[int, list[tuple[str, int]]]:
    """{shard: [(name, bytes)]} of the variables each of `shards` holds."""
    listed = fanout.each({s: [] for s in shards}, lambda shard, _: fanout.call(
        shard, lambda stub, t: stub.ListVariables(ps_pb2.ListRequest(), timeout=t), fanout.control_timeout))
    return {s: [(v.spec.name, v.nbytes) for v in listed[s].variables] for s in shards}
