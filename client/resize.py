"""A live resize, driven by the chief (PSClient.resize, ps-admin resize): the job's shards become `addresses`.

ps 0 owns the resize (ps_server/resizes.py): the driver begins it there,
reports its plan and each move, and holds a lease it renews every quarter
of `lease_seconds` (a thread here). A driver that dies leaves the resize cut
off once the lease runs out; `resume` (ps-admin resize --resume) takes it
over and finishes it, `abort` (--abort, and a chief that starts) takes it
over and rolls it back, or finishes it past its point of no return (step
5). A driver that fails (a shard refused an import, a sync step that would
not complete) rolls back itself before it raises, or, past that point,
leaves the resize cut off.

Shard indices stay: a resize adds shards at the end or removes the last ones
(ps 0 always stays, it counts the global step). The current shards are ps
0's layout (before any resize, the cluster spec it was started with), each
at the address that serves it now: a replicated shard's failover moved it
where its arbiter's record says (ps 0's, ps 1's for ps 0), which the
current shards may be named by too; every epoch names each shard there. The
steps:
1. checks: a resize runs alone; added shards answer, start empty and save
   checkpoints if the job does; no variable is held by two shards, or by one
   the layout does not place it on (each refused in one line naming both);
2. sync jobs pause at a step boundary, as no step's pending sums may span a
   move: two epochs before step 1 set a hold on every shard (pushes computed
   at step F or later wait, F the first step no shard counted a push for),
   with a lease the driver renews by setting the same layout again (a hold
   whose lease runs out ends by itself: layout.py), and the resize waits
   until every shard applied the steps before F (at most `quiet_seconds`);
3. exports an earlier resize left in an outbox are completed (imported and
   confirmed, or taken back by their exporter where the layout places them
   there); then the plan: every variable stays where it is, except those of
   removed shards (each to the least loaded shard that stays, largest
   first) and, when shards are added, the largest that make the load more
   even (greedy by bytes: moved until no move would lower the most loaded
   shard's bytes);
4. the variables that move go in batches of at most BATCH_BYTES (largest
   first), each under a layout epoch of its own, so a client waits for one
   batch in transit at most. Each epoch is set on every shard: the others,
   then ps 0, then the removed ones, so a client sent away by any shard finds
   the epoch on ps 0 and the new owner expecting the variable (layout.py; in
   a sync job an added shard, which took F as its own step, takes ps 0's
   workers as ps 0 counts them, so that it expects the gradients ps 0 does).
   Then each variable is relayed (`relay`: exported by its old shard,
   imported by its new one, confirmed to the old one, which drops what it
   kept), the shards' moves in parallel;
5. with embedding tables, whose rows are spread over every shard by id, ps
   0 records the tables' re-layout (the resize's point of no return: from
   then on it is finished, never rolled back, as a shard may hold its part
   of the new layout only), then an epoch with `table_shards` (the new
   count, Layout.BEGIN) freezes them on every shard; every old shard
   exports, for each shard of the new count in turn, the rows that shard
   owns now, imported there (one part per old shard in flight here at a
   time); a shard builds its tables once every old shard's part arrived,
   and they serve again; ps 0 records them built;
6. a last epoch without the removed shards, the hold and the tables' freeze
   (Layout.END);
   ps 0 records the resize done; removed shards are stopped (Shutdown) after
   `drain_seconds`, in which they answer the clients that did not yet follow
   with LayoutChangedError.
Async and ssp training goes on throughout; a client waits only for the
variables in transit (VariableMovingError, retried). A rollback (`abort`)
first sets an epoch placing every variable in transit on its old shard (so
no import of it can succeed elsewhere any more), then finds which of them
their new shard took in before that (those stay there, confirmed) and has
the old shard take the others back from its outbox; its last epoch places
every variable where it is, over the shards the job had before. A resize
past its point of no return (step 5) is finished by `abort` too, and a
driver that fails there leaves it cut off for `resume`. Every function
blocks until done.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Callable

import grpc

from ..cluster import arbiter_of
from ..errors import ClusterConfigError, PSError, ResizeConflictError, ServerUnavailableError, WaitTimeoutError
from ..proto import ps_pb2
from .errors import error_from_rpc
from .fanout import ShardFanout
from .layout import LayoutFollower

__all__ = ["ResizeReport", "run", "resume", "abort", "state", "plan", "driver_name", "DRAIN_SECONDS",
           "QUIET_SECONDS", "LEASE_SECONDS"]

_LOGGER = logging.getLogger(__name__)
DRAIN_SECONDS = 2.0  # a removed shard answers LayoutChangedError this long before it stops
BATCH_BYTES = 16 << 20  # variables moved under one layout epoch: a client waits for one batch in transit at most
QUIET_SECONDS = 60.0  # sync: how long a resize waits for the steps before its hold to be applied everywhere
QUIET_POLL_SECONDS = 0.02
LEASE_SECONDS = 30.0  # the driver's lease on ps 0, and its hold's on every shard: renewed every quarter of it
MOVE_RETRY_SECONDS = 0.2  # between attempts of a move whose exporter could not be reached
ADDED_SHARD_SECONDS = 10.0  # how long a resize waits for a shard it adds to answer
_ACTION = ps_pb2.ResizeRequest.Action
_PHASE = ps_pb2.ResizeState.Phase
_STATUS = ps_pb2.ResizeMove.Status


@dataclasses.dataclass
class ResizeReport:
    """What a resize did."""

    epoch: int              # the layout epoch it set last
    shards_before: int
    shards_after: int
    moved: int              # variables that changed shards
    moved_bytes: int
    move_seconds: float     # from the first SetLayout to the last import (sync: to the hold's end): the longest a
                            # variable was in transit, and a sync job's pause
    stopped: list[str]      # removed shards' addresses, stopped
    table_bytes: int = 0    # embedding-table rows re-laid out (bytes relayed, optimizer state and metadata included)
    resize_id: int = 0      # ps 0's number for it
    outcome: str = "done"   # "done", or "aborted" (rolled back: moved is what came back)

    def line(self) -> str:
        if self.outcome == "aborted":
            return (f"resize {self.resize_id} rolled back at layout epoch {self.epoch}: {self.shards_after} shards, "
                    f"{self.moved} variables ({self.moved_bytes:,} bytes) back on their shards in "
                    f"{self.move_seconds:.2f} s")
        return (f"layout epoch {self.epoch}: {self.shards_before} -> {self.shards_after} shards, {self.moved} "
                f"variables ({self.moved_bytes:,} bytes) moved"
                + (f", tables re-laid out ({self.table_bytes:,} bytes)" if self.table_bytes else "")
                + f" in {self.move_seconds:.2f} s"
                + (f", stopped {', '.join(self.stopped)}" if self.stopped else ""))


def driver_name(who: str) -> str:
    """A driver's name as ps 0 records it: who, host and pid."""
    return f"{who} on {socket.gethostname()} pid {os.getpid()}"


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


def state(fanout: ShardFanout) -> ps_pb2.ResizeState:
    """ps 0's record of the job's last resize (one call)."""
    return fanout.call(0, lambda stub, t: stub.Resize(ps_pb2.ResizeRequest(action=_ACTION.GET), timeout=t),
                       fanout.control_timeout)


class _Driver:
    """One resize as its driver runs it: its record on ps 0, its lease, the epochs it sets, its moves."""

    def __init__(self, fanout: ShardFanout, record: ps_pb2.ResizeState, name: str, lease: float, epoch: int):
        self.fanout = fanout
        self.id = record.id
        self.name = name
        self.lease = lease
        self.epoch = epoch
        self.before, self.after = list(record.before), list(record.after)
        self.wide = self.after if len(self.after) > len(self.before) else self.before
        self.hold = 0
        self.job: ps_pb2.Layout | None = None  # sync: ps 0's layout once held, with the workers an added shard takes
        self.started: float | None = None      # when the first epoch was set
        self._lock = threading.Lock()          # a layout's fan-out, or a renewal, at a time
        self._sent: dict[int, ps_pb2.Layout] = {}  # the layout each shard got last (sent again to renew a hold)
        self._stop = threading.Event()
        self._lost: str | None = None
        self._renewer = threading.Thread(target=self._renew, name="resize-lease", daemon=True)
        self._renewer.start()
        # The next epoch follows the highest any shard knows: a driver that died between setting an epoch on
        # the other shards and on ps 0 left ps 0 one behind, and that number is taken there already.
        fanout.channels.follow(self.wide)
        self.epoch = max(epoch, *(layout.epoch for layout in self.each(
            range(len(self.wide)), lambda shard, _: self.layout(shard)).values()))

    @classmethod
    def begin(cls, fanout: ShardFanout, name: str, before: list[str], after: list[str], lease: float,
              epoch: int) -> "_Driver":
        record = _ask(fanout, ps_pb2.ResizeRequest(action=_ACTION.BEGIN, driver=name, before=before, after=after,
                                                   lease_seconds=lease))
        _LOGGER.info("resize %d begun: %d -> %d shards (driver %s)", record.id, len(before), len(after), name)
        return cls(fanout, record, name, lease, epoch)

    @classmethod
    def take_over(cls, fanout: ShardFanout, name: str, lease: float, epoch: int) -> "_Driver":
        found = state(fanout)
        if found.phase != _PHASE.RUNNING:
            raise ResizeConflictError(f"no resize to take over: resize {found.id} is "
                                      f"{_PHASE.Name(found.phase).lower()}")
        record = _ask(fanout, ps_pb2.ResizeRequest(action=_ACTION.TAKE_OVER, id=found.id, driver=name,
                                                   lease_seconds=lease))
        _LOGGER.warning("resize %d (%d -> %d shards, driven by %s) taken over by %s", found.id,
                        len(record.before), len(record.after), found.driver, name)
        return cls(fanout, record, name, lease, epoch)

    def close(self) -> None:
        self._stop.set()
        self._renewer.join()

    # -- ps 0's record ---------------------------------------------------------------------------

    def report(self, action: int, **fields) -> ps_pb2.ResizeState:
        """One action on the record (renews the lease); ResizeConflictError once another driver took over."""
        self.check()
        return _ask(self.fanout, ps_pb2.ResizeRequest(action=action, id=self.id, driver=self.name, **fields))

    def moved(self, moves: list[tuple[str, int, int, int]], status: int) -> None:
        self.report(_ACTION.MOVED, moves=[ps_pb2.ResizeMove(name=name, status=status) for name, *_ in moves])

    def check(self) -> None:
        """ResizeConflictError if the lease was lost (another driver took the resize over)."""
        if self._lost is not None:
            raise ResizeConflictError(self._lost)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 4):
            try:
                with self._lock:
                    _ask(self.fanout, ps_pb2.ResizeRequest(action=_ACTION.RENEW, id=self.id, driver=self.name))
                    if self.hold:  # the same layout again renews each shard's hold
                        self.each(self._sent, lambda shard, layout: self.call(shard, "SetLayout", layout))
            except ResizeConflictError as exc:
                self._lost = str(exc)
                _LOGGER.error("resize %d: %s", self.id, exc)
                return
            except PSError as exc:  # a shard slow or away: the next renewal tries again
                _LOGGER.warning("resize %d: a lease renewal failed: %s", self.id, exc)

    # -- the shards ------------------------------------------------------------------------------

    def call(self, shard: int, method: str, request, timeout: float | None = None):
        return self.fanout.call(shard, lambda stub, t: getattr(stub, method)(request, timeout=t),
                                timeout or self.fanout.control_timeout)

    def each(self, shards, fn: Callable) -> dict:
        groups = shards if isinstance(shards, dict) else {s: None for s in shards}
        return self.fanout.each({s: [] for s in groups}, lambda shard, _: fn(shard, groups[shard]))

    def layout(self, shard: int = 0) -> ps_pb2.Layout:
        return self.call(shard, "GetLayout", ps_pb2.LayoutRequest())

    def held(self, shards) -> dict[int, list[tuple[str, int]]]:
        return _held(self.fanout, shards)

    def outboxes(self, shards) -> dict[int, list[ps_pb2.MoveRequest]]:
        """{shard: the exports it keeps} of `shards`."""
        return {s: list(layout.outbox) for s, layout in self.each(shards, lambda s, _: self.layout(s)).items()}

    def set_layout(self, addresses: list[str], placement: dict[str, int], hold: int, table_shards: int = 0,
                   members: ps_pb2.Layout | None = None, table_step: int = 0) -> dict[int, ps_pb2.Layout]:
        """The next epoch, on every shard of `wide`: the others, then ps 0, then those it removes (so a client
        that one of them sends away finds the epoch on ps 0); {shard: its reply}. `addresses`: a prefix of
        `wide`, each shard named where this driver calls it now (a failover since the resize began moved it).
        `members`: ps 0's layout under the hold, whose workers a shard that joins the job takes (ps.proto's
        Layout.members). `table_step`: with `table_shards`, Layout.BEGIN or END."""
        self.check()
        with self._lock:
            addresses = self.fanout.channels.addresses[:len(addresses)]
            self.epoch += 1
            self.started = self.started or time.monotonic()
            layout = ps_pb2.Layout(epoch=self.epoch, addresses=addresses, placement=placement, hold_from_step=hold,
                                   table_shards=table_shards, table_step=table_step, hold_lease_seconds=self.lease)
            if members is not None:
                layout.members.extend(members.members)
                layout.grace_left_seconds = members.grace_left_seconds
            replies: dict[int, ps_pb2.Layout] = {}
            for group in (range(1, len(addresses)), [0], range(len(addresses), len(self.wide))):
                for shard in group:
                    self._sent[shard] = layout
                replies.update(self.each(group, lambda shard, _: self.call(shard, "SetLayout", layout)))
            self.hold = hold
            return replies

    def hold_job(self, placement: dict[str, int], quiet_seconds: float) -> dict[str, int]:
        """Sync jobs: holds pushes from one step on every shard (two epochs), then waits until every shard is
        quiet under it; keeps the step and ps 0's layout then (its workers). The hold's epochs place every
        variable where it is (a kept export where `placement` has it, else on its importer) over the shards
        that hold or expect one (at least the job's before the resize): should the resize be cut off
        before its moves, the layout in force then names no added shard that has not taken the job's step
        yet. Returns that placement. ClusterConfigError if the shards disagree, WaitTimeoutError if one is
        not quiet in `quiet_seconds`."""
        where = {name: shard for shard, variables in self.held(range(len(self.wide))).items() for name, _ in variables}
        for source, kept in self.outboxes(range(len(self.wide))).items():
            where.update({name: placement.get(name, request.to) for request in kept for name in request.names})
        addresses = self.wide[:max([len(self.before) - 1, *where.values()]) + 1]
        asked = self.set_layout(addresses, where, 1)  # each shard holds from the lowest step it may
        hold = max(layout.hold_from_step for layout in asked.values())
        agreed = self.set_layout(addresses, where, hold)
        if any(layout.hold_from_step != hold for layout in agreed.values()):
            raise ClusterConfigError(f"the shards could not all hold pushes from step {hold}: "
                                     f"{ {s: layout.hold_from_step for s, layout in sorted(agreed.items())} }")
        give_up = time.monotonic() + quiet_seconds
        waiting = sorted(agreed)
        while waiting:
            layouts = self.each(waiting, lambda shard, _: self.layout(shard))
            waiting = [s for s in waiting if not layouts[s].quiet]
            if waiting and time.monotonic() > give_up:
                raise WaitTimeoutError(f"ps {waiting} did not apply every step before {hold} within "
                                       f"{quiet_seconds:g} s (a sync step short of its quorum)")
            if waiting:
                time.sleep(QUIET_POLL_SECONDS)
        self.job = self.layout(0)  # its workers, quiet
        _LOGGER.info("sync job held at step %d: every shard quiet", hold)
        return where

    def relay(self, source: int, target: int, request: ps_pb2.MoveRequest) -> int:
        """Moves what `request` names from shard `source` to `target`: exported there (a kept export is sent
        again), imported here; variables are then confirmed to `source`, which drops what it kept. `target`
        == `source`: a kept export taken back (a rolled-back move; nothing to confirm). The export's chunks go
        into the import as they come (rows of tables on SSD are never all here); an export cut by an
        unreachable `source` is sent again whole, within the fan-out's connect timeout. Returns the bytes."""
        self.check()
        deadline = None
        while True:
            try:
                nbytes = self.fanout.call(target, lambda stub, t: self._pipe(stub, t, source, request),
                                          self.fanout.timeout)
                break
            except ServerUnavailableError:
                deadline = deadline or time.monotonic() + self.fanout.channels.connect_timeout
                if time.monotonic() > deadline:
                    raise
                time.sleep(MOVE_RETRY_SECONDS)
        if not request.tables and target != source:
            self.call(source, "ConfirmMove", ps_pb2.MoveRequest(names=request.names, to=target))
        return nbytes

    def _pipe(self, stub, timeout: float, source: int, request: ps_pb2.MoveRequest) -> int:
        """One ImportVariables on `stub` of what ExportVariables(request) on `source` streams; the bytes moved.
        An error of the export is raised as its PSError (the import was cancelled with it)."""
        moved, failed, exports, ended = [0], [], [], threading.Event()

        def chunks():
            try:
                exports.append(self.fanout.call(source, lambda s, t: s.ExportVariables(request, timeout=t),
                                                self.fanout.timeout))
                for chunk in exports[0]:
                    moved[0] += len(chunk.data) + len(chunk.rows.records)
                    yield chunk
            except grpc.RpcError as exc:
                if ended.is_set():  # cancelled below: the import ended first
                    return
                failed.append(error_from_rpc(exc, self.fanout.target(source)))
                raise
            except Exception as exc:  # noqa: BLE001 - raised again, and raised for the import (not GeneratorExit)
                failed.append(exc)
                raise

        try:
            stub.ImportVariables(chunks(), timeout=timeout)
        except grpc.RpcError:
            if failed:
                raise failed[0] from None
            raise
        finally:
            ended.set()
            for export in exports:  # the import ended first (refused): the export stops too
                export.cancel()
        return moved[0]


def _held(fanout: ShardFanout, shards) -> dict[int, list[tuple[str, int]]]:
    """{shard: [(name, bytes)]} of the variables each of `shards` holds."""
    listed = fanout.each({s: [] for s in shards}, lambda shard, _: fanout.call(
        shard, lambda stub, t: stub.ListVariables(ps_pb2.ListRequest(), timeout=t), fanout.control_timeout))
    return {s: [(v.spec.name, v.nbytes) for v in listed[s].variables] for s in listed}


def _ask(fanout: ShardFanout, request: ps_pb2.ResizeRequest) -> ps_pb2.ResizeState:
    return fanout.call(0, lambda stub, t: stub.Resize(request, timeout=t), fanout.control_timeout)


def _current(fanout: ShardFanout, follower: LayoutFollower) -> tuple[int, list[str], list[str]]:
    """(epoch, the job's shards as ps 0's layout names them, each at the address that serves it now). The
    layout's are, before any resize, the cluster spec ps 0 was started with (a shard started without one: this
    client's); a replicated shard's arbiter (ps 0, ps 1 for ps 0: cluster.arbiter_of) records where it is served
    after a failover. Blocks for a call to ps 0, and one to ps 1 if it is ps 0's arbiter."""
    follower.refresh()

    def layout_of(shard: int) -> ps_pb2.Layout:
        return fanout.call(shard, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t),
                           fanout.control_timeout)

    layout = layout_of(0)
    named = list(layout.addresses) or list(fanout.channels.addresses[:fanout.cluster_shards])
    served = {entry.index: entry.primary for entry in layout.replicas if entry.primary}
    if len(named) > 1 and arbiter_of(0, fanout.cluster_shards) == 1:
        served.update((entry.index, entry.primary) for entry in layout_of(1).replicas
                      if entry.index == 0 and entry.primary)
    return layout.epoch, named, [served.get(index, address) for index, address in enumerate(named)]


def _busy(record: ps_pb2.ResizeState) -> str:
    what = (f"its driver {record.driver} holds the lease for {record.lease_left_seconds:.1f} s more"
            if record.lease_left_seconds > 0 else
            f"it was cut off (its driver {record.driver} stopped renewing it): run ps-admin resize --resume to "
            f"finish it or --abort to roll it back where it can")
    return f"resize {record.id} ({len(record.before)} -> {len(record.after)} shards) is running: {what}"


def run(fanout: ShardFanout, follower: LayoutFollower, addresses: list[str], *, driver: str,
        drain_seconds: float = DRAIN_SECONDS, quiet_seconds: float = QUIET_SECONDS,
        lease_seconds: float = LEASE_SECONDS) -> ResizeReport:
    """The resize (see the module docstring); `fanout` must carry the chief's credentials. Raises
    ResizeConflictError (nothing changed) while another resize runs or was cut off; ClusterConfigError for
    addresses that do not keep the shards' order (a shard that stays may be named where ps 0's layout names it
    or where it is served now: _current; it is set where it is served); on a failure once it began, rolls it
    back and raises what failed (if the rollback fails too, or the resize was past its point of no return, it
    is left cut off for --resume or --abort)."""
    found = state(fanout)
    if found.phase == _PHASE.RUNNING:
        raise ResizeConflictError(_busy(found))
    epoch, named, old = _current(fanout, follower)
    common = min(len(old), len(addresses))
    if (not addresses or any(asked not in (old[i], named[i]) for i, asked in enumerate(addresses[:common]))
            or len(set(old[:common] + addresses[common:])) != len(addresses)):
        raise ClusterConfigError(f"a resize keeps the shards' order and adds or removes shards at the end: the job "
                                 f"has {old}" + (f" (its layout names {named})" if named != old else "") +
                                 f"; asked for {addresses}")
    addresses = old[:common] + addresses[common:]  # the shards that stay, where they are served now
    fanout.channels.follow(old)
    fanout.channels.follow(addresses if len(addresses) > len(old) else old)
    _check_added(fanout, old, addresses)
    _check_storage(fanout, range(len(old)), range(len(old), len(addresses)))
    placement = dict(fanout.call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t),
                                 fanout.control_timeout).placement)
    _check_copies(_held(fanout, range(max(len(old), len(addresses)))), placement, range(len(old), len(addresses)))
    resize = _Driver.begin(fanout, driver, old, addresses, lease_seconds, epoch)
    try:
        try:
            return _drive(resize, follower, fresh=True, drain_seconds=drain_seconds, quiet_seconds=quiet_seconds)
        except ResizeConflictError:
            raise
        except PSError as exc:
            record = _record_or_none(fanout)
            if record is not None and record.phase != _PHASE.RUNNING:
                raise  # it ended (done): what failed after that is raised as it is
            if record is not None and record.table_shards:
                raise type(exc)(f"{exc}; the resize had begun to re-lay out its embedding tables, past which it "
                                f"only goes forward: it is left cut off: mend what failed, then run ps-admin resize "
                                f"--resume once its lease ({lease_seconds:g} s) ran out") from exc
            _LOGGER.error("resize %d failed (%s): rolling it back", resize.id, exc)
            try:
                _roll_back(resize, follower, quiet_seconds=quiet_seconds, why=f"rolled back after a failure: {exc}")
            except PSError as again:
                raise type(exc)(f"{exc}; the rollback failed too ({again}): the resize is left cut off: run "
                                f"ps-admin resize --resume or --abort once its lease ({lease_seconds:g} s) ran out"
                                ) from exc
            raise type(exc)(f"{exc}; the resize was rolled back: every variable is on a shard it was on "
                            f"before") from exc
    finally:
        resize.close()


def resume(fanout: ShardFanout, follower: LayoutFollower, *, driver: str, drain_seconds: float = DRAIN_SECONDS,
           quiet_seconds: float = QUIET_SECONDS, lease_seconds: float = LEASE_SECONDS) -> ResizeReport:
    """Takes over the resize that was cut off (its lease ran out) and finishes it. ResizeConflictError if none
    is, or its driver still renews it; raises as `run` does once taken over (without rolling back)."""
    epoch, _, _ = _current(fanout, follower)
    resize = _Driver.take_over(fanout, driver, lease_seconds, epoch)
    try:
        return _drive(resize, follower, fresh=False, drain_seconds=drain_seconds, quiet_seconds=quiet_seconds)
    finally:
        resize.close()


def abort(fanout: ShardFanout, follower: LayoutFollower, *, driver: str, drain_seconds: float = DRAIN_SECONDS,
          quiet_seconds: float = QUIET_SECONDS, lease_seconds: float = LEASE_SECONDS) -> ResizeReport:
    """Takes over the resize that was cut off and rolls it back (see the module docstring); one that had begun
    to re-lay out its embedding tables, or had set its last epoch on some shard, is finished instead (past
    that point a shard may hold its part of the new layout only, or train without the removed shards: the
    report's outcome is "done"; removed shards stopped after `drain_seconds`). ResizeConflictError if none is
    cut off, or its driver still renews it; PSError if a shard cannot be reached (it stays cut off)."""
    epoch, _, _ = _current(fanout, follower)
    resize = _Driver.take_over(fanout, driver, lease_seconds, epoch)
    try:
        record = state(fanout)
        if record.table_shards:
            _LOGGER.warning("resize %d had begun to re-lay out its embedding tables, past which it only goes "
                            "forward: finishing it instead of rolling it back", resize.id)
        elif _only_the_end_left(resize, record):
            _LOGGER.warning("resize %d had set its last epoch on some shards: finishing it instead of rolling it "
                            "back", resize.id)
        else:
            return _roll_back(resize, follower, quiet_seconds=quiet_seconds, why=f"aborted by {driver}")
        return _drive(resize, follower, fresh=False, drain_seconds=drain_seconds, quiet_seconds=quiet_seconds)
    finally:
        resize.close()


def _record_or_none(fanout: ShardFanout) -> ps_pb2.ResizeState | None:
    """ps 0's record of the resize, None if ps 0 does not answer (a rollback then fails at its first call
    there, changing nothing)."""
    try:
        return state(fanout)
    except PSError:
        return None


def _check_storage(fanout: ShardFanout, old: range, added: range) -> None:
    """ClusterConfigError (one line, nothing changed) if a shard keeps embedding tables on SSD while a backup
    follows it (its backup would not have their rows' folders), a table is kept on SSD by some shards and in
    memory by others, or an added shard could not keep them (no --table-dir)."""
    ssd, kept = False, {}
    for shard in old:
        listed = fanout.call(shard, lambda stub, t: stub.ListTables(ps_pb2.ListRequest(), timeout=t),
                             fanout.control_timeout)
        for info in listed.tables:
            kept.setdefault(info.spec.name, {}).setdefault(info.status.storage, []).append(shard)
        tables = [info.spec.name for info in listed.tables if info.status.storage == "ssd"]
        ssd = ssd or bool(tables)
        if tables and _status(fanout, shard).replication.backup:
            raise ClusterConfigError(f"ps {shard} keeps embedding tables {tables} on SSD and a backup follows it: "
                                     f"a live resize cannot move their rows between replicated shards yet; nothing "
                                     f"was changed. Resize by a checkpoint and a restart onto the new number of "
                                     f"shards (ps-server --restore-from DIR --num-ps N)")
    for name, storages in kept.items():
        if len(storages) > 1:
            raise ClusterConfigError(f"embedding table {name!r} is kept on SSD by ps {storages.get('ssd')} and in "
                                     f"memory by ps {storages.get('ram')}: start the shards with one "
                                     f"--table-storage; nothing was changed")
    for shard in added if ssd else ():
        if not _status(fanout, shard).tables_on_disk:
            raise ClusterConfigError(f"ps {shard} keeps no tables on SSD (no --table-dir) and the job's embedding "
                                     f"tables are kept there: start it with --table-dir DIR; nothing was changed")


def _status(fanout: ShardFanout, shard: int) -> ps_pb2.StatusResponse:
    return fanout.call(shard, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t),
                       fanout.control_timeout)


def _check_added(fanout: ShardFanout, old: list[str], addresses: list[str]) -> None:
    """ClusterConfigError (one line) unless every shard `addresses` adds answers within ADDED_SHARD_SECONDS (or
    the client's connect timeout if shorter) and saves checkpoints if ps 0 does."""
    added = range(len(old), len(addresses))
    if not added:
        return
    wait = min(ADDED_SHARD_SECONDS, fanout.channels.connect_timeout)
    saves = fanout.call(0, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t),
                        fanout.control_timeout).checkpoints
    for shard in added:
        try:
            status = fanout.call(shard, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t),
                                 min(fanout.control_timeout, wait), retry_for=wait)
        except ServerUnavailableError as exc:
            raise ClusterConfigError(f"ps {shard} at {addresses[shard]} does not answer: start it first "
                                     f"(ps-server --index {shard} --join ...; {exc})") from None
        if saves and not status.checkpoints:
            raise ClusterConfigError(f"ps {shard} at {addresses[shard]} runs without --checkpoint-dir while the "
                                     f"job's shards save checkpoints: start it with the job's --checkpoint-dir "
                                     f"(it starts empty, its own journal there)")


def _check_copies(held: dict[int, list[tuple[str, int]]], placement: dict[str, int], added: range) -> None:
    """ResizeConflictError (one line naming both) for a variable held by two shards, held by a shard the layout
    places it elsewhere, or held by a shard the resize adds (they start empty)."""
    where: dict[str, int] = {}
    for shard, variables in sorted(held.items()):
        for name, _ in variables:
            if name in where:
                raise ResizeConflictError(f"variable {name!r} is held by ps {where[name]} and by ps {shard}: a "
                                          f"resize never trusts two copies; stop the shard that should not hold it "
                                          f"(one started with another job's state?) and start it empty (--join)")
            where[name] = shard
            if shard in added:
                raise ResizeConflictError(f"ps {shard}, which the resize adds, holds {name!r} already: an added "
                                          f"shard must start empty (ps-server --join)")
            if placement.get(name, shard) != shard:
                raise ResizeConflictError(f"variable {name!r} is held by ps {shard}, but the layout places it on "
                                          f"ps {placement[name]}: a resize never trusts such a copy")


def _complete_outboxes(resize: _Driver, placement: dict[str, int]) -> None:
    """Finishes what an earlier resize left in an outbox: confirmed where its importer holds it, taken back
    where the layout places it on its exporter, else imported by its importer."""
    for source, kept in resize.outboxes(range(len(resize.wide))).items():
        for request in kept:
            names, target = list(request.names), request.to
            if set(names) <= {name for name, _ in resize.held([target])[target]}:
                resize.call(source, "ConfirmMove", ps_pb2.MoveRequest(names=names, to=target))
                what = "confirmed"
            elif all(placement.get(name) == source for name in names):
                resize.relay(source, source, ps_pb2.MoveRequest(names=names, to=target))
                what = "taken back"
            else:
                resize.relay(source, target, ps_pb2.MoveRequest(names=names, to=target))
                what = "imported"
            _LOGGER.info("an export cut off earlier (%d variables of ps %d for ps %d) %s", len(names), source,
                         target, what)


def _drive(resize: _Driver, follower: LayoutFollower, *, fresh: bool, drain_seconds: float,
           quiet_seconds: float) -> ResizeReport:
    """The resize's steps from the hold on (see the module docstring); ends it done. Taken over with only its
    last epoch left to set (_only_the_end_left), sets that alone: no hold, which shards a shrink removed and
    that count no more steps could never be quiet under."""
    before, after, wide = resize.before, resize.after, resize.wide
    if not fresh:
        record = state(resize.fanout)
        if _only_the_end_left(resize, record):
            held = resize.held(range(len(after)))
            now = {name: shard for shard, variables in held.items() for name, _ in variables}
            moved = [(m.name, m.bytes) for m in record.moves if m.status == _STATUS.CONFIRMED]
            return _end(resize, follower, now, moved, 0 if record.table_shards else None, drain_seconds)
    config = resize.call(0, "GetStatus", ps_pb2.StatusRequest()).config
    added = range(len(before), len(after))
    held = resize.held(range(len(wide)))
    current = dict(resize.layout(0).placement)
    if not fresh:  # (`run` checked before it began); mid-resize a layout may place a variable ahead of its move
        _check_copies(held, {}, range(0))
    resize.each(added, lambda shard, _: resize.call(shard, "Configure", config))
    current.update({name: shard for shard, variables in held.items() for name, _ in variables})
    if config.mode == "sync":
        current = resize.hold_job(current, quiet_seconds)
        resize.report(_ACTION.PLAN, hold_from_step=resize.hold)
    _complete_outboxes(resize, current)
    held = resize.held(range(len(wide)))
    placement = plan(held, len(after), balance=len(after) >= len(before))
    source = {name: shard for shard, variables in held.items() for name, _ in variables}
    sizes = {name: nbytes for variables in held.values() for name, nbytes in variables}
    moving = sorted((name for name in placement if source[name] != placement[name]), key=lambda n: (-sizes[n], n))
    resize.report(_ACTION.PLAN, hold_from_step=resize.hold, moves=[
        ps_pb2.ResizeMove(name=name, from_shard=source[name], to=placement[name], bytes=sizes[name])
        for name in moving])
    now = dict(source)
    for batch in _batches(moving, sizes, BATCH_BYTES) or ([[]] if len(after) != len(before) else []):
        for name in batch:
            now[name] = placement[name]
        resize.set_layout(wide, now, resize.hold, members=resize.job)
        pairs: dict[tuple[int, int], list[str]] = {}
        for name in batch:
            pairs.setdefault((source[name], placement[name]), []).append(name)

        def move_from(shard: int, _, pairs=pairs) -> None:
            for (src, dst), names in sorted(pairs.items()):
                if src == shard:
                    resize.relay(src, dst, ps_pb2.MoveRequest(names=names, epoch=resize.epoch, to=dst))

        resize.each({src: None for src, _ in pairs}, move_from)
        if batch:
            resize.report(_ACTION.MOVED, moves=[ps_pb2.ResizeMove(name=name, status=_STATUS.CONFIRMED)
                                                for name in batch])
    table_bytes = _relayout_tables(resize, now, len(after))
    return _end(resize, follower, now, [(name, sizes[name]) for name in moving], table_bytes, drain_seconds)


def _only_the_end_left(resize: _Driver, record: ps_pb2.ResizeState) -> bool:
    """Whether a resize taken over has only its last epoch left to set: every new shard built its tables, or
    (a shrink) a shard that stays took that epoch already (it alone names fewer shards than the job had)."""
    if record.tables_built:
        return True
    if len(resize.after) >= len(resize.before):
        return False
    layouts = resize.each(range(len(resize.after)), lambda shard, _: resize.layout(shard))
    return any(len(layout.addresses) == len(resize.after) for layout in layouts.values())


def _end(resize: _Driver, follower: LayoutFollower, now: dict[str, int], moved: list[tuple[str, int]],
         table_bytes: int | None, drain_seconds: float) -> ResizeReport:
    """The resize's last epoch (without the removed shards, the hold, the tables' freeze: Layout.END), its
    record done, and the removed shards stopped after `drain_seconds` (one that cannot be reached is left to
    its operator: logged)."""
    before, after, wide = resize.before, resize.after, resize.wide
    if len(after) < len(before) or resize.hold or table_bytes is not None:
        resize.set_layout(after if len(after) < len(before) else wide, now, 0,
                          len(after) if table_bytes is not None else 0,
                          table_step=ps_pb2.Layout.END if table_bytes is not None else 0)
    seconds = time.monotonic() - resize.started if resize.started else 0.0
    resize.report(_ACTION.END, phase=_PHASE.DONE, why=f"{len(moved)} variables moved")
    resize.close()  # done: its lease is renewed no more
    stopped = []
    if len(after) < len(before):
        time.sleep(drain_seconds)  # the removed shards keep answering LayoutChangedError meanwhile

        def stop(shard: int, _) -> None:
            try:
                resize.call(shard, "Shutdown", ps_pb2.ShutdownRequest(
                    reason=f"removed from the job at layout epoch {resize.epoch}"))
                stopped.append(before[shard])
            except PSError as exc:
                _LOGGER.warning("resize %d is done, but ps %d, which it removed, could not be stopped (%s): stop it "
                                "(it answers every push and pull with LayoutChangedError)", resize.id, shard, exc)

        resize.each(range(len(after), len(before)), stop)
        stopped.sort(key=before.index)
    follower.refresh()
    report = ResizeReport(resize.epoch, len(before), len(after), len(moved), sum(n for _, n in moved), seconds,
                          stopped, table_bytes or 0, resize.id)
    _LOGGER.info("%s", report.line())
    return report


def _relayout_tables(resize: _Driver, now: dict[str, int], count: int) -> int | None:
    """Re-lays the embedding tables out onto `count` shards (module docstring, step 5); the bytes relayed,
    None if the job has none to re-lay out. Recorded on ps 0 before the epoch that freezes them (from then on
    the resize only goes forward), and once built; a re-layout recorded already (a driver taken over) is begun
    again (its exports are kept, its imports taken once), or, built, only ended."""
    record = state(resize.fanout)
    if record.table_shards:
        if record.table_shards != count:
            raise ClusterConfigError(f"resize {record.id} re-lays its tables out onto {record.table_shards} "
                                     f"shards, not {count}")
        if record.tables_built:
            return 0
        tables = record.tables_from
    else:
        tables = _table_sources(resize, range(max(len(resize.wide), count)), count)
        if tables is None:
            return None
    resize.report(_ACTION.TABLES, table_shards=count, tables_from=tables)
    resize.set_layout(resize.wide, now, resize.hold, count, table_step=ps_pb2.Layout.BEGIN)

    def rows_from(src: int, _) -> int:  # the old shards at once, each to one shard at a time
        return sum(resize.relay(src, dst, ps_pb2.MoveRequest(epoch=resize.epoch, to=dst, tables=True))
                   for dst in range(count))

    relayed = sum(resize.each(range(tables), rows_from).values())
    resize.report(_ACTION.TABLES, table_shards=count, tables_from=tables, tables_built=True)
    return relayed


def _roll_back(resize: _Driver, follower: LayoutFollower, *, quiet_seconds: float, why: str) -> ResizeReport:
    """Rolls the resize back (see the module docstring) and records it aborted."""
    before, wide = resize.before, resize.wide
    shards = range(len(wide))
    current = dict(resize.layout(0).placement)
    current.update({name: shard for shard, variables in resize.held(shards).items() for name, _ in variables})
    kept = {source: entries for source, entries in resize.outboxes(shards).items() if entries}
    if kept and resize.call(0, "GetStatus", ps_pb2.StatusRequest()).config.mode == "sync":
        current = resize.hold_job(current, quiet_seconds)  # a shard takes a variable back only quiet, held
    fenced = dict(current)
    for source, entries in kept.items():
        for request in entries:
            fenced.update({name: source for name in request.names})
    if kept:  # from here no shard takes a variable in transit in but its old one
        resize.set_layout(wide, fenced, resize.hold)
    held = resize.held(shards)
    returned: list[tuple[str, int]] = []
    for source, entries in kept.items():
        for request in entries:
            names, target = list(request.names), request.to
            if set(names) <= {name for name, _ in held.get(target, [])}:  # taken in before the fence: it stays
                resize.call(source, "ConfirmMove", ps_pb2.MoveRequest(names=names, to=target))
                _report_moved(resize, names, _STATUS.CONFIRMED)
            else:
                nbytes = resize.relay(source, source, ps_pb2.MoveRequest(names=names, to=target))
                returned += [(name, nbytes) for name in names]
                _report_moved(resize, names, _STATUS.RETURNED)
    held = resize.held(shards)
    where = {name: shard for shard, variables in held.items() for name, _ in variables}
    used = max([len(before) - 1, *where.values()]) + 1
    resize.set_layout(wide[:used], where, 0)  # every variable where it is, the hold ended
    seconds = time.monotonic() - resize.started if resize.started else 0.0
    resize.report(_ACTION.END, phase=_PHASE.ABORTED, why=why[:1000])
    follower.refresh()
    report = ResizeReport(resize.epoch, len(before), used, len(returned), sum(n for _, n in returned), seconds, [],
                          resize_id=resize.id, outcome="aborted")
    _LOGGER.warning("%s (%s)", report.line(), why)
    return report


def _report_moved(resize: _Driver, names: list[str], status: int) -> None:
    """Records `names` at `status`, those of them the resize planned (not an earlier resize's leftovers)."""
    planned = {move.name for move in state(resize.fanout).moves}
    moves = [ps_pb2.ResizeMove(name=name, status=status) for name in names if name in planned]
    if moves:
        resize.report(_ACTION.MOVED, moves=moves)


def _table_sources(resize: _Driver, shards, count: int) -> int | None:
    """How many old shards' embedding-table rows a re-layout onto `count` shards takes (ListTables on
    `shards`): the count the tables are spread over where a shard holds them so, if not `count`; None if the
    job has no tables, or they are spread over `count` already."""
    listed = resize.each(shards, lambda shard, _: resize.call(shard, "ListTables", ps_pb2.ListRequest()))
    old = {info.num_shards for reply in listed.values() for info in reply.tables} - {count}
    if len(old) > 1:
        raise ClusterConfigError(f"the shards' embedding tables are spread over {sorted(old)} shards: no one layout "
                                 f"to re-lay out from")
    return old.pop() if old else None
