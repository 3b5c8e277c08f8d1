"""A live resize, run by the chief (PSClient.resize, ps-admin resize): the job's shards become `addresses`.

Shard indices stay: a resize adds shards at the end or removes the last ones
(ps 0 always stays, it counts the global step). The steps:
1. the plan: every variable stays where it is, except those of removed
   shards (each to the least loaded shard that stays, largest first) and,
   when shards are added, the largest that make the load more even (greedy
   by bytes: moved until no move would lower the most loaded shard's bytes);
2. the new layout epoch is set on every shard: the added ones (configured in
   the job's mode first) and those that stay, then ps 0, then the removed
   ones, so a client sent away by any shard finds the new layout on ps 0 and
   the new owner expecting the variable (layout.py);
3. each variable that moves is exported by its old shard and imported by its
   new one, relayed here, the shards' moves in parallel;
4. removed shards are stopped (Shutdown) after `drain_seconds`, in which they
   answer the clients that did not yet follow with LayoutChangedError.
Training goes on throughout; a client waits only for the variables in
transit (VariableMovingError, retried). Blocks until done; raises PSError
(a refused layout, a shard unreachable) with the moves done so far in force:
variables exported but not imported stay in their exporter's outbox (see
layout.py) until a later epoch is set.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from ..errors import ClusterConfigError
from ..proto import ps_pb2
from .fanout import ShardFanout
from .layout import LayoutFollower

__all__ = ["ResizeReport", "run", "plan", "DRAIN_SECONDS"]

_LOGGER = logging.getLogger(__name__)
DRAIN_SECONDS = 2.0  # a removed shard answers LayoutChangedError this long before it stops


@dataclasses.dataclass
class ResizeReport:
    """What a resize did."""

    epoch: int              # the layout epoch it set
    shards_before: int
    shards_after: int
    moved: int              # variables that changed shards
    moved_bytes: int
    move_seconds: float     # from the first SetLayout to the last import: the longest a variable was in transit
    stopped: list[str]      # removed shards' addresses, stopped

    def line(self) -> str:
        return (f"layout epoch {self.epoch}: {self.shards_before} -> {self.shards_after} shards, {self.moved} "
                f"variables ({self.moved_bytes:,} bytes) moved in {self.move_seconds:.2f} s"
                + (f", stopped {', '.join(self.stopped)}" if self.stopped else ""))


def plan(held: dict[int, list[tuple[str, int]]], shards: int) -> dict[str, int]:
    """The placement on `shards` shards (0..shards-1) of the variables `held` {shard: [(name, bytes)]} (see the
    module docstring); deterministic."""
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
    for _ in range(len(size)):
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


def run(fanout: ShardFanout, follower: LayoutFollower, addresses: list[str], *,
        drain_seconds: float = DRAIN_SECONDS) -> ResizeReport:
    """The resize (see the module docstring); `fanout` must carry the chief's credentials."""
    follower.refresh()
    before = follower.shards
    old = list(fanout.channels.addresses[:before])
    common = min(len(old), len(addresses))
    if not addresses or addresses[:common] != old[:common] or len(set(addresses)) != len(addresses):
        raise ClusterConfigError(f"a resize keeps the shards' order and adds or removes shards at the end: the job "
                                 f"has {old}; asked for {addresses}")
    if len(addresses) == before:
        raise ClusterConfigError(f"the job has these {before} shards already; nothing to do")
    if len(addresses) > before:
        fanout.channels.follow(addresses)  # channels to the added shards (this client's own)
    everyone = range(max(before, len(addresses)))
    control = fanout.control_timeout

    def call(shard: int, fn):
        return fanout.call(shard, fn, control)

    listed = fanout.each({s: [] for s in everyone}, lambda shard, _: call(
        shard, lambda stub, t: stub.ListVariables(ps_pb2.ListRequest(), timeout=t)))
    held = {s: [(v.spec.name, v.nbytes) for v in listed[s].variables] for s in everyone}
    placement = plan(held, len(addresses))
    source = {name: shard for shard, variables in held.items() for name, _ in variables}
    moves: dict[tuple[int, int], list[str]] = {}
    for name, shard in placement.items():
        if source[name] != shard:
            moves.setdefault((source[name], shard), []).append(name)
    sizes = {name: nbytes for variables in held.values() for name, nbytes in variables}
    epoch = follower.epoch + 1
    layout = ps_pb2.Layout(epoch=epoch, addresses=addresses, placement=placement)
    config = call(0, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t)).config
    added = {s: [] for s in range(before, len(addresses))}
    fanout.each(added, lambda shard, _: call(shard, lambda stub, t: stub.Configure(config, timeout=t)))
    started = time.monotonic()
    for group in ([s for s in range(1, len(addresses))], [0], [s for s in range(len(addresses), before)]):
        fanout.each({s: [] for s in group}, lambda shard, _: call(shard, lambda stub, t: stub.SetLayout(
            layout, timeout=t)))

    def move_from(shard: int, _) -> None:
        for (src, dst), names in sorted(moves.items()):
            if src != shard:
                continue
            request = ps_pb2.MoveRequest(names=names, epoch=epoch, to=dst)
            chunks = fanout.call(src, lambda stub, t: list(stub.ExportVariables(request, timeout=t)),
                                 fanout.timeout)
            fanout.call(dst, lambda stub, t: stub.ImportVariables(iter(chunks), timeout=t), fanout.timeout)

    fanout.each({src: [] for src in sorted({src for src, _ in moves})}, move_from)
    seconds = time.monotonic() - started
    stopped = []
    if len(addresses) < before:
        time.sleep(drain_seconds)  # the removed shards keep answering LayoutChangedError meanwhile
        gone = {s: [] for s in range(len(addresses), before)}
        fanout.each(gone, lambda shard, _: call(shard, lambda stub, t: stub.Shutdown(
            ps_pb2.ShutdownRequest(reason=f"removed from the job at layout epoch {epoch}"), timeout=t)))
        stopped = old[len(addresses):]
    follower.refresh()
    report = ResizeReport(epoch, before, len(addresses), sum(len(n) for n in moves.values()),
                          sum(sizes[n] for names in moves.values() for n in names), seconds, stopped)
    _LOGGER.info("%s", report.line())
    return report
