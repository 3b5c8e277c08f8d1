"""A backup shard (ps-server --replica-of PRIMARY): a copy of its primary's journal, written as the primary
writes it, and the primary's place once the primary is gone.

The backup opens a Replicate stream to its primary and writes what comes
into its own journal folder (mirror.Mirror: in the primary's order and with
its log numbers). It acknowledges each record once its own journal wrote it
(into the page cache; onto the disk with --journal-sync), and the primary
acknowledges nothing before that; the acks go on a lane of their own where
the primary offers lanes and says it takes them there
(ReplicaHello.acks_lane, ReplicaFrame.acks_on_lane), else in the stream.
Where the backup opened a bulk lane (and its primary keeps no tables on
SSD), the frames themselves come there once the stream's first base came
whole (TO_LANE: ReplicaHello.frames_on_lane), each ahead of its bytes, and a
thread of the backup's takes them off the lane; the stream then carries
heartbeats only. A part the copy cannot write (a full disk) ends the
stream: the backup follows again from a new base.

When the primary sends nothing, not even its heartbeat, for `failover_after`
s while this backup runs (a stall of its own longer than half of that, paused
or starved, is not counted; a
record's or base's bytes on the bulk lane, once its frame came, are waited
for the same way: each byte that comes is progress, and a record read in
part is dropped (the copy's log ends in part of it, which recovery cuts off,
as after a crash), as the primary acknowledged it to no one),
or its stream breaks and it stays unreachable for `failover_after` s, the
backup asks the shard's arbiter (ps 0; ps 1 for ps 0: cluster.arbiter_of)
to promote it (PROMOTE). The arbiter refuses while the primary still renews
its lease there (LeaseHeldError: it runs, and only this stream went quiet),
and the backup follows it again. Granted, it
never acknowledges its old primary again (it opens no stream to it) and
serves shard N at its own address from its copy: the journal's ordinary
recovery brings back every change the primary acknowledged, the push ledger
with them, so a client's retry of a push it got no answer for is applied
once. Refused (the primary went on without it: DROP), it follows the
primary the arbiter names again, from a new base; refused because the
arbiter's layout epoch no longer has the shard (a live resize removed it),
it stops (run returns "": ps-server exits 0). A copy is replaced only
when a new stream's base arrives, which the primary sends only once the
arbiter dropped this backup, so a copy the arbiter may promote is never half
written. A backup restarted on its folder asks the same way, from that copy,
once its primary is unreachable for `failover_after` s, if the copy still
holds every record it acknowledged (replication.copy_kept: its base came
whole, and the host has not restarted since or every record was synced) and the arbiter's
record names it in sync (asked first): the primary acknowledged nothing past
the copy without dropping it, so a primary restarted on an empty folder
meanwhile, waiting for this backup, is taken over as after a live failover.
Each stream names the copy it makes (ReplicaHello.copy, a fresh random name,
kept in the folder's marker); the arbiter records it with the IN_SYNC and
promotes only a backup whose PROMOTE names it, so a backup started at the
in-sync one's address on another folder (an older copy) is refused.
A record that names this backup's address serving the shard (an earlier
run was promoted, and this one was started with its backup's command) makes
it serve as a restarted primary does, once its arbiter confirmed it and its
backup in sync was dropped: never as a promotion the record holds already.

A primary whose folder says a backup of it held its base once (`REPLICATED`:
a backup's copy says so too), or started with --replicated (its folder may be
a new disk's, empty), asks its arbiter at its start who serves its shard
(`confirm_role`), answering only status and the layout meanwhile: another
address, it becomes that one's backup (its folder is replaced by the new
primary's copy).
"""

from __future__ import annotations

import logging
import pathlib
import queue
import secrets
import threading
import time
from typing import Callable

import grpc

from ..cluster import arbiter_of
from .. import lanes
from ..errors import LaneBrokenError, LeaseHeldError, MalformedStreamError, PSError, ReplicaFencedError
from ..proto import ps_pb2
from ..security import Security
from .mirror import Mirror
from .feed import ACK_BYTES
from .replication import REPLICATED, copy_kept, copy_name

__all__ = ["Backup", "serving", "needs_role_check", "confirm_role", "arbiter_layout", "record_of",
           "FAILOVER_AFTER_SECONDS", "PROGRESS_SECONDS"]

_LOGGER = logging.getLogger(__name__)
FAILOVER_AFTER_SECONDS = 0.5   # a primary unreachable this long after its stream broke is taken over
RETRY_SECONDS = 0.1            # between attempts to open a stream, or to reach the arbiter
COPY_NAME_BYTES = 8            # a copy's random name (ReplicaHello.copy): twice as many hex characters
LEASE_ASK_SECONDS = 0.05       # between asks to be promoted while the primary's lease still holds
PROGRESS_SECONDS = 5.0         # a shard waiting for its arbiter says so this often
WATCH_TICKS = 10               # a stream's silence is looked at this often per failover_after
FIRST_FRAME_SECONDS = 60.0     # a stream's first frame waits for the primary's new base to be written
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
_FRAME = ps_pb2.ReplicaFrame
class Backup:
    """The backup of shard `index` (see the module docstring). `me`: the address it serves at if promoted;
    `spec`: the job's shards as its cluster spec names them (where its arbiter is). `keeps_stores`: it was
    started with --table-dir, so a primary keeping tables on SSD takes it (it copies their stores too).
    `on_promotion(state)` runs as it asks the arbiter to promote it ("asking"), once it was not promoted
    ("following": refused, or the arbiter did not answer; it follows a primary again) and as soon as the
    arbiter granted it ("granted", before run() returns "promoted")."""

    def __init__(self, index: int, me: str, primary: str, spec: tuple[str, ...], folder: str, security: Security, *,
                 sync: bool = False, failover_after: float = FAILOVER_AFTER_SECONDS, keeps_stores: bool = False,
                 on_promotion: Callable[[str], object] = lambda state: None):
        from ..client.channels import ShardChannels  # a backup's calls are a client's

        self.index, self.me, self.primary = index, me, primary
        self._arbiter = arbiter_of(index, len(spec))
        self.folder = pathlib.Path(folder)
        self.sync, self.failover_after = sync, failover_after
        self.keeps_stores = keeps_stores  # it may be promoted with tables on SSD (--table-dir)
        self._on_promotion = on_promotion
        self._security = security
        self._ps0 = arbiter_channels(spec, failover_after, security)
        self._channels = ShardChannels
        # The folder holds a whole copy to take over from: one some stream of this run began with a base, or an
        # earlier run's that holds what that run acknowledged (copy_kept) and the arbiter names in sync (run()).
        self.holds_copy = False
        self.copy = copy_name(self.folder)  # the name of the copy in the folder (its PROMOTE names it)
        self._refused = ""  # the last refusal logged
        self._arbiter_moved = 0.0  # when the latest move of its arbiter it knows of was granted (unix s; 0: none)
        self._arbiter_lock = threading.Lock()  # the stream's thread and the watch both redirect to the arbiter
        self._asking = False  # run() asks the arbiter's record about the copy an earlier run left (until it answers)
        self.stop = threading.Event()

    def run(self) -> str:
        """Follows the primary until its arbiter promotes this backup ("promoted": serve) or stop is set (""). A
        backup started on a folder an earlier run wrote (REPLICATED) asks the arbiter's record, between its
        attempts to follow, until it answers or a new base replaces the copy: a record that names this address
        serving the shard ("serves": an earlier run was promoted, and this process was started again with its
        backup's command) has it serve as a restarted primary does, once its arbiter confirmed it (from its
        folder, or, should that lack what it acknowledged, once its backup in sync took over: daemon.serve);
        one naming this backup in sync lets it take over from the copy (if copy_kept); one naming another
        primary than --replica-of's has it follow that one. Until the record answered, the copy is not one to
        take over from. Blocks."""
        kept = copy_kept(self.folder)
        self._asking = (self.folder / REPLICATED).exists()
        asked = said = time.monotonic()
        unreachable_since: float | None = None
        while not self.stop.is_set():
            if self._asking:
                role = self._recorded_role()
                if role == "serves":
                    return role
                if role is not None:
                    self._asking, self.holds_copy = False, kept and role == "in sync"
                elif time.monotonic() - said >= PROGRESS_SECONDS:
                    said = time.monotonic()
                    _LOGGER.info("backup of ps:%d: its arbiter has not said for %.0f s whether the copy in %s is "
                                 "the one in sync: it follows %s meanwhile", self.index, said - asked, self.folder,
                                 self.primary)
            reason = self._follow_once()
            if reason in ("followed", "silent"):
                self._refused = ""  # a later refusal is news again
            if reason == "finished":
                _LOGGER.info("backup of ps:%d: the job finished (the chief's Shutdown): this backup stops", self.index)
                return ""
            if reason == "refused":  # the primary answers (it is dropping this backup first)
                unreachable_since = None
            elif reason == "followed":
                unreachable_since = time.monotonic()
            elif reason == "silent" and self.holds_copy:
                if self._promote():
                    return "promoted"
                unreachable_since = None  # its lease holds, or the arbiter did not answer: follow it again
            elif self.holds_copy:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since >= self.failover_after and self._promote():
                    return "promoted"
            left = unreachable_since + self.failover_after - time.monotonic() \
                if unreachable_since is not None and self.holds_copy else 0.0
            self.stop.wait(left if 0.0 < left < RETRY_SECONDS else RETRY_SECONDS)  # asks as the window ends
        return ""

    def _recorded_role(self) -> str | None:
        """What the arbiter's record says of this process, asked once: "serves" (it names this address serving
        the shard), "in sync" (this backup, in sync), "" (neither; the primary it names, if any, is the one to
        follow from now on); None if the arbiter did not answer."""
        try:
            record = record_of(self._ps0, self.index)
        except PSError:
            return None
        if record is not None and record[0] == self.me:
            _LOGGER.warning("ps:%d's arbiter records it served at %s, this backup's address: it serves ps:%d from its "
                            "folder once its arbiter confirms it, as a restarted primary", self.index, self.me,
                            self.index)
            return "serves"
        if record is not None and record[0] != self.primary:
            _LOGGER.info("backup of ps:%d: its arbiter records %s serving it: this backup follows that one",
                         self.index, record[0])
            self.primary = record[0]
        return "in sync" if record is not None and record[1] == self.me else ""

    def _follow_once(self) -> str:
        """One stream: "followed" (frames came, then it ended), "silent" (frames came, then none, not even a
        heartbeat, for failover_after s while this backup waited for one, or no byte of a record whose frame
        came, on the lane, for as long: the primary is stopped or cut off),
        "finished" (it ended after the job's end was written here), "refused" (the primary answered with an
        error), "unreachable"."""
        channels = self._channels([self.primary], connect_timeout=self.failover_after, security=self._security)
        try:
            lane, acks_lane = self._open_lanes(channels)
        except grpc.RpcError as exc:
            channels.close()
            if exc.code() not in UNREACHABLE:  # said; yet another process may answer at a lost primary's address:
                self._say_refused(exc)          # unreachable still, so this backup takes over once it is silent
            return "unreachable"
        acks: queue.Queue = queue.Queue()
        fresh = secrets.token_hex(COPY_NAME_BYTES)  # this stream's copy, once its first base came whole
        acks.put(ps_pb2.ReplicaAck(hello=ps_pb2.ReplicaHello(index=self.index, address=self.me,
                                                             lane=lane.key if lane is not None else b"",
                                                             acks_lane=acks_lane.key if acks_lane else b"",
                                                             frames_on_lane=lane is not None,
                                                             keeps_stores=self.keeps_stores, copy=fresh)))
        mirror = Mirror(self.folder, self.sync, lane, copy=fresh)
        call = channels.stubs[0].Replicate(iter(acks.get, None))
        last = [time.monotonic()]  # when this backup began to wait for the next frame; None while it takes one
        # (a record's bytes on the lane are waited for while it takes the record's frame: mirror.lane_since;
        # after TO_LANE the stream's frames are the heartbeats, which a primary that runs sends)
        done = threading.Event()
        framed = False
        silent = []  # [(a silence of the primary's, it came within a record's or base's bytes)] once watch() saw one
        sending = threading.Lock()  # the thread that takes frames and the acknowledger send acks on the acks lane
        on_lane = []  # [True] once the primary's LAYOUT frame said it takes the acks off the acks lane
        lane_failed: list[Exception] = []  # why the lane's frames stopped (TO_LANE: read by their own thread)

        def send_ack(number: int) -> None:  # LaneBrokenError if the acks lane broke: the stream ends
            if not on_lane:
                acks.put(ps_pb2.ReplicaAck(written=number))
                return
            with sending:
                acks_lane.send([number.to_bytes(ACK_BYTES, "little")], self.failover_after)

        def watch() -> None:  # a primary silent for failover_after s (no heartbeat) is gone: the call ends
            tick = self.failover_after / WATCH_TICKS
            ticks, asked, woke = 0, None, time.monotonic()
            heard, received = woke, 0  # silence counts from here at the earliest (a lane byte came, or this
            # backup did not run), and the lane bytes come until then
            while not done.wait(tick):
                ticks += 1
                now = time.monotonic()
                slept, woke = now - woke, now
                if slept > self.failover_after / 2:  # this backup did not run (paused, starved): that time is
                    waited = last[0] if last[0] is not None else mirror.lane_since  # not the primary's silence
                    heard = min(now, max(heard, waited or heard) + slept - tick)
                    continue
                if lane is not None and lane.received != received:
                    heard, received = now, lane.received  # a record's bytes come: progress, not silence
                if asked is not None and asked.done():
                    self._learn_arbiter(asked)
                    asked = None
                if asked is None and ticks % WATCH_TICKS == 0:  # never blocks this watch: a paused primary
                    asked = channels.stubs[0].GetLayout.future(ps_pb2.LayoutRequest(), timeout=self.failover_after)
                limit = self.failover_after if framed else FIRST_FRAME_SECONDS
                waited = last[0] if last[0] is not None else mirror.lane_since
                if self.stop.is_set() or (waited is not None and now - max(waited, heard) > limit):
                    silent.append((framed and not self.stop.is_set(), mirror.lane_since is not None))
                    call.cancel()
                    if lane is not None:
                        lane.close()  # a read of a record's bytes fails at once
                    return

        def take(frame: ps_pb2.ReplicaFrame, on_lane: bool = False) -> None:  # (the stream's thread; after
            if frame.kind == _FRAME.BASE and mirror.journal is None:            # TO_LANE, the lane's)
                self.holds_copy = self._asking = False  # the stream's first base replaces the copy: none whole
            ack = mirror.take(frame, on_lane)
            while mirror.replica_events:
                self._follow_arbiter(mirror.replica_events.pop(0))
            if ack is not None:
                self.holds_copy, self.copy = True, mirror.copy  # (its first base is written)
                send_ack(ack)

        def take_lane() -> None:  # the frames after TO_LANE, until the lane ends: then the stream ends too
            try:
                while True:
                    take(mirror.next_on_lane(), on_lane=True)
            except Exception as exc:  # noqa: BLE001 - any end of the lane ends the stream, handled there
                lane_failed.append(exc)
                call.cancel()

        def acknowledge() -> None:
            while not done.is_set():
                try:
                    written = mirror.written(RETRY_SECONDS)
                    if written is not None:
                        send_ack(written)
                except PSError as exc:  # the copy's journal failed, or the acks lane broke
                    _LOGGER.warning("backup of ps:%d: an acknowledgement to %s failed (%s): ending the stream",
                                    self.index, self.primary, exc)
                    call.cancel()
                    return

        threads = [threading.Thread(target=watch, daemon=True, name="backup-watch")]
        threads[0].start()
        try:
            try:
                for frame in call:
                    last[0] = None
                    if frame.kind == _FRAME.LAYOUT and frame.acks_on_lane and acks_lane is not None:
                        on_lane.append(True)  # (the stream's first frame: before any ack)
                    if not framed:
                        framed = True
                        threads.append(threading.Thread(target=acknowledge, daemon=True, name="backup-acks"))
                        threads[1].start()
                    if mirror.frames_on_lane:  # a heartbeat (the lane's thread takes the frames)
                        mirror.take(frame)
                    else:
                        take(frame)
                        if mirror.frames_on_lane:  # TO_LANE: the frames come on the lane from now on
                            threads.append(threading.Thread(target=take_lane, daemon=True, name="backup-lane"))
                            threads[2].start()
                    last[0] = time.monotonic()
            except grpc.RpcError:
                failed = lane_failed[0] if lane_failed else None  # the lane's thread cancelled the call for it
                if failed is not None and not silent and not isinstance(failed, LaneBrokenError):
                    raise (failed if isinstance(failed, MalformedStreamError) else
                           MalformedStreamError(f"a frame on the lane could not be taken ({failed!r})")) from None
                raise
            if len(threads) > 2:  # the primary closes the lane as the stream ends: its last frames are taken
                threads[2].join(self.failover_after)
            if lane_failed and not isinstance(lane_failed[0], LaneBrokenError):  # (not the lane's close)
                _LOGGER.error("backup of ps:%d: %s; following again from a new base", self.index, lane_failed[0])
            return "finished" if mirror.finished else "followed"
        except grpc.RpcError as exc:
            if mirror.finished:
                return "finished"
            if framed and silent and silent[0][0]:  # (the lane's frames: a record's bytes may have been due)
                return self._silent(within_record=silent[0][1])
            if framed:
                _LOGGER.warning("backup of ps:%d: the stream from %s ended (%s)", self.index, self.primary,
                                lane_failed[0] if lane_failed and not silent else exc.code().name)
                return "followed"
            if exc.code() in UNREACHABLE:
                return "unreachable"
            self._say_refused(exc)
            return "refused"
        except (MalformedStreamError, LaneBrokenError) as exc:
            if mirror.finished:  # the job's end is written here: whatever broke after it, nothing follows
                return "finished"
            if silent:  # the watch closed the lane (a half record read is dropped: it was never acknowledged)
                return self._silent(within_record=silent[0][1]) if silent[0][0] else "followed"
            _LOGGER.error("backup of ps:%d: %s; following again from a new base", self.index, exc)
            return "followed"
        finally:
            done.set()
            mirror.end()  # the acknowledger stops waiting for a record (a promotion waits for it to end)
            acks.put(None)
            call.cancel()  # never acknowledges on this stream again
            if acks_lane is not None:
                acks_lane.close()  # nor on its lane: an ack being sent there fails at once
            if lane is not None:
                lane.close()  # its frames' reader ends
            for thread in threads[1:]:
                thread.join()
            mirror.close()
            channels.close()

    def _silent(self, within_record: bool) -> str:
        within = " (the rest of a record or base whose frame came was due on the bulk lane)" if within_record else ""
        _LOGGER.warning("backup of ps:%d: %s sent nothing for %g s%s", self.index, self.primary, self.failover_after,
                        within)
        return "silent"

    def _follow_arbiter(self, event: dict) -> None:
        """A change of the primary's record (replicas.py event): this backup's arbiter promoted to another
        address is called there (its spec address no longer answers once the primary, which knew, is gone)."""
        if event.get("action") == "promote" and event.get("index") == self._arbiter and event.get("primary"):
            _LOGGER.info("backup of ps:%d: its arbiter ps:%d is served at %s now", self.index, self._arbiter,
                         event["primary"])
            with self._arbiter_lock:
                self._ps0.redirect(self._arbiter, event["primary"])
                self._arbiter_moved = max(self._arbiter_moved, float(event.get("when", 0.0)))

    def _learn_arbiter(self, asked) -> None:
        """The primary's answer `asked` (a finished GetLayout future) says where this backup's arbiter is served
        now: ps 0 and ps 1 each record the other, so the primary knows after the arbiter's own failover, which
        its spec address no longer answers. An answer older than a move this backup knows of (asked before the
        primary's record of it came in the stream) is let go."""
        try:
            layout = asked.result()
        except (grpc.RpcError, grpc.FutureCancelledError):
            return
        for entry in layout.replicas:
            with self._arbiter_lock:
                if (entry.index != self._arbiter or not entry.primary or entry.last_failover_unix < self._arbiter_moved
                        or entry.primary == self._ps0.addresses[self._arbiter]):
                    continue
                self._ps0.redirect(self._arbiter, entry.primary)
                self._arbiter_moved = entry.last_failover_unix
            _LOGGER.info("backup of ps:%d: its arbiter ps:%d is served at %s now", self.index, self._arbiter,
                         entry.primary)

    def _say_refused(self, exc: grpc.RpcError) -> None:
        """Logs that the primary's address answered this backup's status or stream with `exc` (a backup without
        --table-dir, credentials it does not take), once until another refusal or a stream that got frames."""
        if exc.details() != self._refused:
            self._refused = exc.details()
            _LOGGER.warning("backup of ps:%d: %s refused it (%s: %s): trying again", self.index, self.primary,
                            exc.code().name, exc.details())

    def _open_lanes(self, channels):
        """(a bulk lane to the primary for the records' bytes, one for this backup's acks), each None where it
        offers none or none opens: the records' bytes come in the frames, the acks go in the stream.
        grpc.RpcError if the primary does not answer its status."""
        status = channels.stubs[0].GetStatus(ps_pb2.StatusRequest(), timeout=self.failover_after)
        if not status.lane_port:
            return None, None
        records = self._lane(status.lane_port, "the records' bytes", "the frames")
        return records, self._lane(status.lane_port, "the acks", "the stream") if records is not None else None

    def _lane(self, port: int, what: str, where: str):
        """A new lane to the primary's lane `port`, or None (logged: `what` goes in `where` instead)."""
        try:
            return lanes.connect(self.primary.rpartition(":")[0].strip("[]"), port, self.failover_after,
                                 lanes.tls_context(self._security, server=False))
        except LaneBrokenError as exc:
            _LOGGER.info("backup of ps:%d: no lane to %s for %s (%s): they go in %s", self.index, self.primary,
                         what, exc, where)
            return None

    def _promote(self) -> bool:
        """Asks the arbiter to promote this backup; True if granted. While the primary's lease holds it asks
        again for up to failover_after (the lease's last renewal may follow the last frame this backup got),
        then follows the primary again; refused otherwise, it follows the primary the arbiter names."""
        request = ps_pb2.ReplicaChange(action=ps_pb2.ReplicaChange.PROMOTE, index=self.index, primary=self.primary,
                                       backup=self.me, copy=self.copy)
        patience = time.monotonic() + self.failover_after
        self._on_promotion("asking")
        try:
            while True:
                try:
                    reply = self._ps0.call(self._arbiter, lambda stub, t: stub.SetReplica(request, timeout=t),
                                           self.failover_after, retry_for=self.failover_after)
                    break
                except LeaseHeldError as exc:
                    if time.monotonic() >= patience or self.stop.wait(LEASE_ASK_SECONDS):
                        _LOGGER.warning("backup of ps:%d not promoted: %s", self.index, exc)
                        self._on_promotion("following")
                        return False
        except ReplicaFencedError as exc:
            _LOGGER.warning("backup of ps:%d not promoted: %s", self.index, exc)
            self._on_promotion("following")
            self.holds_copy = False
            if self._left():
                self.stop.set()
                return False
            self.primary = serving(self._ps0, self.index) or self.primary
            return False
        except PSError as exc:
            _LOGGER.warning("backup of ps:%d: the arbiter did not answer its promotion (%s); asking again", self.index, exc)
            self._on_promotion("following")
            return False
        self._on_promotion("granted")
        _LOGGER.warning("ps:%d's primary %s is gone: this backup serves it at %s from now on (failover %d)",
                        self.index, self.primary, reply.primary, reply.failovers)
        return True

    def _left(self) -> bool:
        """Whether the arbiter's layout epoch does not have this backup's shard (a live resize removed it: no one
        serves it, and this backup stops as after SIGTERM). False if the arbiter cannot say."""
        try:
            layout = self._ps0.call(self._arbiter, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t),
                                    self.failover_after, retry_for=self.failover_after)
        except PSError:
            return False
        if self.index < len(layout.addresses):
            return False
        _LOGGER.warning("ps:%d is not in the job's layout (epoch %d, %d shards: a live resize removed it, or has not "
                        "added it): its backup stops, following no primary", self.index, layout.epoch,
                        len(layout.addresses))
        return True

    def close(self) -> None:
        self._ps0.close()


def arbiter_channels(spec: tuple[str, ...] | list[str], timeout: float, security: Security, shards: int = 2):
    """Channels to the first `shards` shards of the job's cluster spec or layout `spec` (two: the arbiters; three:
    ps 2, their tie-breaker, too), each followed to where it is served after its own failover."""
    from ..client.channels import ShardChannels

    channels = ShardChannels(list(spec[:shards]), connect_timeout=timeout, security=security)
    channels.follows_failovers = True
    return channels


def arbiter_layout(channels, index: int) -> ps_pb2.Layout:
    """The layout (GetLayout) of shard `index`'s arbiter, at the address `channels` call it, or where a backup's
    signpost there says it is served (the arbiter failed over and its old address hosts its backup now: the
    signpost's answer names the arbiter's own primary, which no arbiter records of itself); the channels call
    it there from then on. Raises PSError when the arbiter cannot be reached (one attempt of the channels'
    connect timeout per address)."""
    arbiter = arbiter_of(index, len(channels.addresses))
    for _ in range(3):  # the signpost's primary may itself have moved on since
        layout = channels.call(arbiter, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t),
                               channels.connect_timeout)
        moved = next((entry.primary for entry in layout.replicas if entry.index == arbiter and entry.primary
                      and entry.primary != channels.addresses[arbiter]), None)
        if moved is None:
            return layout
        channels.redirect(arbiter, moved)
    return layout


def record_of(channels, index: int) -> tuple[str, str] | None:
    """(primary, backup in sync or "") the arbiter of shard `index` records (arbiter_layout), None if it records
    none. Raises PSError when the arbiter cannot be reached."""
    return next(((entry.primary, entry.backup) for entry in arbiter_layout(channels, index).replicas
                 if entry.index == index and entry.primary), None)


def serving(channels, index: int) -> str | None:
    """The address the arbiter of shard `index` records it served at, None if it records none (record_of)."""
    record = record_of(channels, index)
    return record[0] if record else None


def needs_role_check(index: int, spec: tuple[str, ...], folder: pathlib.Path, replicated: bool = False) -> bool:
    """Whether a shard starting on its journal folder must ask its arbiter who serves its shard before it
    serves: it is not its own arbiter, and its job runs backups (`replicated`: --replicated) or the folder says
    the shard had one (REPLICATED)."""
    return arbiter_of(index, len(spec)) != index and (replicated or (folder / REPLICATED).exists())


def confirm_role(index: int, me: str, spec: tuple[str, ...], security: Security, stop: threading.Event,
                 attempt_seconds: float) -> tuple[str, str] | None:
    """Asks shard `index`'s arbiter who serves it until it answers or `stop` is set (blocks, logging every
    PROGRESS_SECONDS): (the address it records serving it, `me` if none; its backup in sync, "" if none), None
    once stopped."""
    channels = arbiter_channels(spec, attempt_seconds, security)
    started = last_log = time.monotonic()
    try:
        while not stop.is_set():
            try:
                current = record_of(channels, index)
            except PSError as exc:
                if time.monotonic() - last_log >= PROGRESS_SECONDS:
                    last_log = time.monotonic()
                    _LOGGER.info("ps %d waits for its arbiter ps:%d to say who serves it (%.0f s: %s)", index,
                                 arbiter_of(index, len(spec)), last_log - started, exc)
                stop.wait(RETRY_SECONDS)
                continue
            return (current[0] or me, current[1]) if current else (me, "")
        return None
    finally:
        channels.close()
