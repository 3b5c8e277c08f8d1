"""A backup's feed: the stream of its primary's journal, as the journal's writer and compactions offer it
(Feed). No gRPC.

What a feed is handed, and what its loss means, is replication.py's. Its
backup's acknowledgements end the journal's waits (Journal.acked); a record
the backup leaves unacknowledged for `ack_timeout` s, or the end of its
stream or of a lane, loses it.

A stream with a bulk lane (torchps/lanes.py: the backup opened it, its key
in the hello) carries each record's tensor bytes there: the journal's writer
sends them from the record's own memory right after writing it (the kernel's
copy only), as it writes them to the disk. Without one, the writer copies
them into the frames (a push's receive buffers are reused once its wait
ends, which a wait that timed out does while the frames are still queued).
A later compaction's base goes on the lane too (the compaction sends it from
its copy of the state, and keeps that until it was sent, a pause in its
bytes, not its whole time, bounded by the ack timeout); the stream's first
base, one offered before that went out, and one with store copies (records
pass its files) go in the frames, as do records offered before the first
base went out.
A backup that reads frames off its lane (ReplicaHello.frames_on_lane) of a
shard that keeps no tables on SSD gets them there too once the first base
went out: the stream says TO_LANE after everything queued before that
instant, and every later record, rotation and base goes on the lane as a
lane frame of its own (the serialized ReplicaFrame), its bytes the next
one; the stream carries heartbeats only, and a record reaches the backup
with no event loop, gRPC message or thread of gRPC's between. A record of
at most INLINE_BYTES is sent by the journal's writer itself where nothing
waits for the lane's sender (the writer's wait for a thread's wake-up is
longer than the send), a larger one by the sender while the writer writes
it to the disk.
A backup that opened a second lane, its acks lane (ReplicaHello.acks_lane),
sends its acks there, 8 bytes each, instead of in its stream, once the
stream's LAYOUT frame said this primary takes them there (acks_on_lane):
the backup's thread that wrote the record (or saw it written) sends its
ack, and a thread of the feed's reads it and ends the waits here
(Feed.take_acks), with no gRPC message and no other thread between. The
end of either lane loses the feed.
A frame's lane bytes are handed to the lane's sender as the frame is queued,
under the feed's lock: the lane's order is the frames' (a frame on the lane
with its bytes; one the writer sends itself takes the sender's lock before
the feed's is let go). A base of a shard that keeps tables on
SSD names copies of their stores (journal.py: base-N.stores/): every file of
them goes first, as FILE frames read from disk a piece at a time as the
stream takes them (never the whole store in memory), so the backup's copy
holds them before the base that names them. A backup that cannot keep them
(no --table-dir: ReplicaHello.keeps_stores) is refused by such a shard.
A table file (*.sst, never changed once made) that the last base sent on
this feed held too goes as a FILE frame naming it there (`same_as`), which the
backup links: after the first base a backup receives the files made since.
Records the backup could not acknowledge while the files streamed have their
wait counted from the files' end.
"""

from __future__ import annotations

import collections
import concurrent.futures
import pathlib
import threading
import time
from typing import Callable, Iterator, Sequence

from ..errors import LaneBrokenError
from ..proto import ps_pb2
from ..wire import _key, _varint

__all__ = ["Feed", "Shipped", "ACK_BYTES", "IDLE_WAKE_SECONDS", "MAX_LANE_FRAME", "NOTHING_YET", "OFF_LOOP",
           "ON_LOOP", "frames_of", "file_frames"]

IDLE_WAKE_SECONDS = 0.1     # a feed's sender looks at its oldest unacknowledged record (or sends a heartbeat) this often
ACK_BYTES = 8               # an ack on an acks lane: the record number it stands for, little-endian
_FRAME = ps_pb2.ReplicaFrame
_HEARTBEAT = _FRAME(kind=_FRAME.HEARTBEAT).SerializeToString()
_TO_LANE = _FRAME(kind=_FRAME.TO_LANE).SerializeToString()
INLINE_BYTES = 1 << 20     # a record this small whose frame goes on the lane is sent by the journal's writer itself
MAX_LANE_FRAME = 64 << 20  # the most bytes a frame on the lane may have (its head and meta, not its tensors): more
# than a frame in the stream may hold (the shard's message limit, --max-chunk-bytes and an envelope)
NOTHING_YET = object()  # Feed.pieces: nothing is queued (wait for on_queued, or IDLE_WAKE_SECONDS)
OFF_LOOP = object()     # Feed.pieces: it reads a file next (resume it where blocking is allowed)
ON_LOOP = object()      # Feed.pieces: the file was read (it blocks no more)


def frames_of(kind: int, number: int, written: int, head: bytes, views: list, chunk_bytes: int) -> list[bytes]:
    """A record's (or base's) serialized ReplicaFrames: its head in the first, its bytes in pieces of at most
    `chunk_bytes`, each copied once, into its frame. Each tensor's bytes (a view) begin a new piece, and every
    piece but a tensor's last is a multiple of 8 bytes long: written piece by piece, the backup's record sums
    each tensor's words as the primary's did (journal_log.write)."""
    fields = _FRAME(kind=kind, number=number, written=written).SerializeToString()
    chunk_bytes = max(8, chunk_bytes // 8 * 8)
    pieces: list[memoryview] = []
    for view in views:
        view = memoryview(view).cast("B")
        pieces += [view[at:at + chunk_bytes] for at in range(0, len(view), chunk_bytes)] if len(view) else []
    out = []
    for i in range(max(1, len(pieces))):
        piece = pieces[i] if pieces else b""
        first = fields + (_key(4, 2) + _varint(len(head)) + head if i == 0 else b"")
        last = _key(6, 0) + b"\x01" if i == max(1, len(pieces)) - 1 else b""
        out.append(b"".join((first, _key(5, 2), _varint(len(piece)), piece, last)))  # the piece's one copy
    return out


def file_frames(path: str, source: pathlib.Path, chunk_bytes: int) -> Iterator[bytes]:
    """The serialized FILE frames of file `source` (its path under the journal's folder: `path`), read a piece
    of at most `chunk_bytes` at a time as they are taken, the last one marked; `source` (a link of the feed's:
    Journal.base_files) is removed once read."""
    with open(source, "rb") as f:
        piece = f.read(chunk_bytes)
        while True:
            following = f.read(chunk_bytes) if piece else b""
            if not following:
                _remove_link(source)
            yield _FRAME(kind=_FRAME.FILE, path=path, data=piece, last=not following).SerializeToString()
            if not following:
                return
            piece = following


class Shipped:
    """What a shard's feeds sent of its bases' store copies (ReplicationStatus.store_*). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = self.files = self.linked = 0

    def add(self, nbytes: int = 0, files: int = 0, linked: int = 0) -> None:
        with self._lock:
            self.bytes, self.files, self.linked = self.bytes + nbytes, self.files + files, self.linked + linked


def _identity(source: pathlib.Path) -> tuple | None:
    """What makes a table file (*.sst) the same file in two bases (hard links of one file: name, size, mtime,
    inode); None for another file (a store's manifest, which changes)."""
    if source.suffix != ".sst":
        return None
    stat = source.stat()
    return source.name, stat.st_size, stat.st_mtime_ns, stat.st_dev, stat.st_ino


def _nothing() -> None:
    pass


def _lane_frame(frame: ps_pb2.ReplicaFrame, views: list) -> tuple[list[memoryview], bytes]:
    """`views` as bytes, and `frame` (a RECORD's or BASE's fields) serialized as the one frame whose bytes, all
    of `views`, follow on the lane."""
    views = [memoryview(view).cast("B") for view in views]
    frame.last, frame.lane_bytes = True, sum(map(len, views))
    return views, frame.SerializeToString()


class Feed:
    """One backup's stream of this shard's journal (see the module docstring). Thread-safe: the journal's
    writer and compaction offer, the stream takes frames (pieces()), the backup's acks are taken (acked(), or
    take_acks() off an acks lane).

    The queue holds (kind, ...) items in offer order: ("rotate", bytes), ("frame", bytes) (a base's frames or
    named files: "base" for a BASE's last), ("record", bytes) and ("file", its frames, the file).
    While a later base's files stream, the records queued behind that base (up to the next ROTATE) go
    between the files' pieces: a record never waits for a store copy but the first base's. A record's lane
    bytes leave when its frame is queued; a record offered before the first base went out (it follows the
    base, and the base's store files) goes in its frames instead, so that no lane send waits for the backup
    to reach it for longer than the ack timeout allows. With `frames_on_lane`, the first base going out
    queues ("frame", TO_LANE) and nothing is queued after it: the frames go on the lane with their bytes.
    Such a feed is never offered store files (a shard that may keep tables on SSD keeps its frames in the
    stream)."""

    def __init__(self, address: str, chunk_bytes: int, ack_timeout: float,
                 on_lost: Callable[["Feed", str], None], on_based: Callable[["Feed"], None], lane=None,
                 shipped: Shipped | None = None, acks_lane=None, frames_on_lane: bool = False):
        self.address = address
        self.copy = ""                   # the name of the backup's copy (ReplicaHello.copy) its IN_SYNC names
        self._shipped = shipped or Shipped()  # its store files sent and linked, counted
        self._lane = lane                # a bulk lane the records' bytes follow on, or None
        # Once the first base went out, the frames go on the lane too, ahead of their bytes (TO_LANE).
        self.frames_on_lane: bool = lane is not None and frames_on_lane
        self._acks_lane = acks_lane      # the lane the backup's acks come on (take_acks), or None
        # Sends them there while the journal's writer writes them to its disk.
        self._sender = concurrent.futures.ThreadPoolExecutor(1, "replica-lane") if lane is not None else None
        self._queued_sends = 0           # handed to the sender and not sent yet (under the lock)
        self._sending = threading.Lock()  # held by whoever sends on the lane (the sender, or the writer itself)
        self.floor = 0                   # the last record the first base holds (set by Journal.rotate)
        self._chunk = chunk_bytes
        self._ack_timeout = ack_timeout
        self._on_lost, self._on_based = on_lost, on_based
        self._cond = threading.Condition(threading.Lock())
        self._frames: collections.deque[tuple] = collections.deque()  # the queue (see the class docstring)
        self._early: list[tuple] = []   # records written before the first base was offered
        self._sent: dict[tuple, str] = {}  # the last base's table files: identity -> path in the backup's copy
        self._based = False              # the first base was offered
        self._base_sent = False          # the first base went out: records use the lane, and pass later files
        # (with frames_on_lane, their frames and every later rotation's and base's too)
        self._files = 0                  # "file" items queued
        self._bases_sending = 0          # bases handed to the lane's sender and not sent yet
        self._unacked: collections.deque[tuple[int, float]] = collections.deque()  # (number, offered at)
        self._acked = 0
        self._heard = False              # an ack came
        self.lost: str | None = None     # why the feed ended, once it did
        # The arbiter's count of changes the last IN_SYNC of it names (Replication._record_in_sync), set before
        # that IN_SYNC is asked: its DROP names it (replicas.py). None: no count read yet.
        self.read_changes: int | None = None
        # True from just before the IN_SYNC's last look at the loss until that look saw it: an IN_SYNC may be
        # on its way (Replication.released). False: none was asked, or none will be.
        self.in_sync_asked = False
        # Called (outside its lock) once something was queued, or the feed lost: see pieces.
        self.on_queued: Callable[[], None] = _nothing

    # -- the journal's side -------------------------------------------------------------------

    def offer_record(self, number: int, head: bytes, views: list) -> Callable[[], None]:
        """(The journal's writer, as it writes the record.) Queues its frames; with a lane (once the first base
        went out: see the class docstring), starts sending its bytes there, from its own memory, on the lane's
        thread (with `frames_on_lane`, its frame ahead of them, and a small record sent before this returns).
        Returns what blocks until they were sent, or the feed was lost (a backup that reads nothing for the ack
        timeout loses it): the writer calls it before it lets go of the record."""
        lane = self._lane is not None and self._base_sent
        if not lane:
            frames = frames_of(_FRAME.RECORD, 0, number, head, views, self._chunk)
        else:
            views, frame = _lane_frame(_FRAME(kind=_FRAME.RECORD, written=number, head=head), views)
            frames = [frame]
        with self._cond:
            if self.lost is not None:
                return _nothing
            self._unacked.append((number, time.monotonic()))
            if self.frames_on_lane and self._base_sent:  # nothing for the stream: its loop is not woken
                if not lane:  # the first base went out meanwhile
                    views, frame = _lane_frame(_FRAME(kind=_FRAME.RECORD, written=number, head=head), views)
                if self._queued_sends or sum(map(len, views)) > INLINE_BYTES:
                    return self._submit(views, head=frame)
                self._sending.acquire()  # free: every queued send holds it until it no longer counts as queued
                inline = True
            else:
                (self._frames if self._based else self._early).extend(("record", frame) for frame in frames)
                sent = self._submit(views) if lane else _nothing
                self._cond.notify_all()
                inline = False
        if not inline:
            self.on_queued()
            return sent
        try:  # here, on the lane before anything handed to the sender from now on (it waits for the lock)
            self._send_now(views, False, frame)
        finally:
            self._sending.release()
        return _nothing

    def _submit(self, views: list, base: bool = False, head: bytes | None = None) -> Callable[[], None]:
        """(Holding the lock, with the frame that names them queued, or that frame as `head`: it goes on the lane
        first.) Hands `views` to the lane's sender; returns what blocks until they were sent or the feed was
        lost."""
        try:
            waiter = self._sender.submit(self._send, views, base, head).result
        except RuntimeError:  # lost meanwhile: the sender was shut down
            return _nothing
        self._bases_sending += base
        self._queued_sends += 1
        return waiter

    def _send(self, views: list, base: bool, head: bytes | None) -> None:
        """(The lane's sender.) Sends what _submit handed it, in turn."""
        with self._sending:
            try:
                self._send_now(views, base, head)
            finally:
                with self._cond:
                    self._queued_sends -= 1
                    self._bases_sending -= base
                    if base:  # in the same instant: pieces() never sees the base sent and the old stamps
                        self._restamp()

    def _send_now(self, views: list, base: bool, head: bytes | None) -> None:
        """(Holding _sending.) A record's bytes must all leave within the ack timeout; a base's, of any size,
        may take longer, as long as no pause in them lasts that long (the records behind it wait for it: their
        time counts from its end). A lane that breaks loses the feed."""
        try:
            self._lane.send(views, self._ack_timeout, stall=base, head=head)
        except LaneBrokenError as exc:
            self.lose(f"its lane broke ({exc})")
        except Exception as exc:  # noqa: BLE001 - the feed's end, never the journal's writer's
            self.lose(f"sending on its lane failed ({exc!r})")

    def offer_rotate(self, number: int) -> None:
        frame = _FRAME(kind=_FRAME.ROTATE, number=number).SerializeToString()
        with self._cond:
            if self.lost is not None:
                return
            if self.frames_on_lane and self._base_sent:
                self._submit([], head=frame)
                return
            self._frames.append(("rotate", frame))
            self._cond.notify_all()
        self.on_queued()

    def offer_base(self, number: int, head: bytes, views: list, files: Sequence[tuple[str, pathlib.Path]] = ()
                   ) -> Callable[[], None]:
        """Queues base `number`'s frames, after those of `files` ([(path under the journal's folder, file)]: its
        store copies, read as the stream takes them; a table file the last base sent too named there). Returns
        what blocks until its bytes were sent on the lane (a later base without files), or the feed was lost:
        the caller keeps `views` unchanged until then."""
        if self._lane is not None and not files:
            views, frame = _lane_frame(_FRAME(kind=_FRAME.BASE, number=number, head=head), views)
            with self._cond:
                if self.lost is not None:
                    return _nothing
                on_lane = self._base_sent  # else the first base is still queued: this one follows it in frames
                if on_lane:
                    self._sent = {}
                    if self.frames_on_lane:
                        return self._submit(views, base=True, head=frame)
                    self._frames.append(("base", frame))
                    sent = self._submit(views, base=True)
                    self._cond.notify_all()
            if on_lane:
                self.on_queued()
                return sent
        items, sent = [], {}
        for path, source in files:
            key = _identity(source)
            if key is not None and key in self._sent:
                items.append(("frame", _FRAME(kind=_FRAME.FILE, path=path, same_as=self._sent[key], last=True
                                              ).SerializeToString()))
                _remove_link(source)
                self._shipped.add(linked=1)
            else:
                items.append(("file", file_frames(path, source, self._chunk), source))
            if key is not None:
                sent[key] = path
        self._sent = sent
        frames = frames_of(_FRAME.BASE, number, 0 if self._based else self.floor, head, views, self._chunk)
        items += [("base" if i == len(frames) - 1 else "frame", frame) for i, frame in enumerate(frames)]
        with self._cond:
            if self.lost is not None:
                _drop(items)
                return _nothing
            if self.frames_on_lane and self._base_sent and not files:  # the first base went out meanwhile
                views, frame = _lane_frame(_FRAME(kind=_FRAME.BASE, number=number, head=head), views)
                self._sent = {}
                return self._submit(views, base=True, head=frame)
            self._frames.extend(items)
            self._files += sum(item[0] == "file" for item in items)
            if not self._based:
                self._based = True
                self._unacked.appendleft((self.floor, time.monotonic()))
                self._frames.extend(self._early)
                self._early = []
            self._cond.notify_all()
        self.on_queued()
        return _nothing

    # -- the stream's side ----------------------------------------------------------------------

    def pieces(self, layout: bytes) -> Iterator[bytes | object]:
        """The stream's serialized replies, LAYOUT first, until the feed is lost, for a stream driven from an
        event loop (replica_rpcs._pump). Where nothing is queued it yields NOTHING_YET, and the caller resumes
        it once on_queued() was called or IDLE_WAKE_SECONDS passed. Before it reads a store file from disk
        (or lets queued ones go, losing the feed) it yields OFF_LOOP, and ON_LOOP once that is over: between
        the two the caller resumes it where blocking is allowed. Never blocks otherwise. After TO_LANE (see the
        class docstring) it yields heartbeats only, IDLE_WAKE_SECONDS apart."""
        yield _FRAME(kind=_FRAME.LAYOUT, data=layout, acks_on_lane=self._acks_lane is not None).SerializeToString()
        while True:
            with self._cond:
                idle = not self._frames and self.lost is None
            if idle:
                yield NOTHING_YET
            with self._cond:
                if self.lost is not None:
                    return
                if not self._files:  # everything queued at once
                    batch, self._frames = self._frames, collections.deque()
                else:  # what is queued up to a store file, whose reading lets records pass
                    batch = collections.deque()
                    while self._frames and (not batch or batch[-1][0] != "file"):
                        batch.append(self._frames.popleft())
                    self._files -= batch[-1][0] == "file"
                overdue = (self._unacked and not self._bases_sending
                           and time.monotonic() - self._unacked[0][1] > self._ack_timeout)
            if overdue:
                if self._files or any(item[0] == "file" for item in batch):
                    yield OFF_LOOP  # their links are removed
                _drop(batch)
                self.lose(f"it left a record unacknowledged for over {self._ack_timeout:g} s")
                return
            if not batch:
                yield _HEARTBEAT
            try:
                while batch:
                    item = batch[0]
                    if item[0] == "file":  # read as the stream takes it, the records behind its base between pieces
                        yield OFF_LOOP
                        for piece in item[1]:
                            self._shipped.add(nbytes=len(piece))
                            yield piece
                            for record in self._passing():
                                yield record[1]
                            if self.lost is not None:
                                return
                        self._shipped.add(files=1)
                        with self._cond:
                            self._restamp()
                        yield ON_LOOP
                    else:
                        if item[0] == "base" and not self._base_sent:
                            with self._cond:  # what is offered from now on follows it, on the lane
                                self._base_sent = True
                                if self.frames_on_lane:  # after everything queued before (TO_LANE)
                                    self._frames.append(("frame", _TO_LANE))
                        yield item[1]
                        if item[0] == "base":  # the base's frames held the records behind it back
                            with self._cond:
                                self._restamp()
                    batch.popleft()
            finally:  # the stream ended (lost, cancelled) with these not sent: their store links go
                _drop(batch)

    def _passing(self) -> list[tuple]:
        """The records queued behind the base being sent, up to the next ROTATE, taken out of the queue (none
        before the first base went out: they follow it)."""
        with self._cond:
            if not self._base_sent:
                return []
            out, kept = [], collections.deque()
            while self._frames and self._frames[0][0] != "rotate":
                item = self._frames.popleft()
                (out if item[0] == "record" else kept).append(item)
            self._frames.extendleft(reversed(kept))
            return out

    def _restamp(self) -> None:
        """(Holding the lock.) Counts the wait of every record not acknowledged yet from now (the file or base
        just sent held the records queued behind it back)."""
        now = time.monotonic()
        self._unacked = collections.deque((number, now) for number, _ in self._unacked)

    def acked(self, number: int, journal) -> None:
        """The backup wrote every record up to `number` (the first base's: `floor`)."""
        with self._cond:
            based, self._heard = not self._heard, True  # the backup writes the base before anything it acks
            self._acked = max(self._acked, number)
            while self._unacked and self._unacked[0][0] <= number:
                self._unacked.popleft()
        journal.acked(self, number)
        if based:
            self._on_based(self)

    def take_acks(self, journal) -> None:
        """Takes the backup's acks off its acks lane (ReplicaHello.acks_lane) as they come, as acked() does,
        until the lane breaks or closes (lose() closes it): then the feed is lost. Blocks that long (the body
        of a thread of its own)."""
        ack = memoryview(bytearray(ACK_BYTES))
        try:
            while True:
                self._acks_lane.begin(ACK_BYTES, None)  # no deadline: a backup that acks nothing loses the feed
                self._acks_lane.read_into(ack)          # in pieces(), after the ack timeout
                self.acked(int.from_bytes(ack, "little"), journal)
        except LaneBrokenError as exc:
            self.lose(f"its acks' lane ended ({exc})")

    def lag(self) -> tuple[bool, int, float]:
        """(the backup wrote its base and the feed is not lost, records offered and not acknowledged yet (the
        first base counts as one until acknowledged), seconds the oldest of them has waited (0: none))."""
        with self._cond:
            waited = time.monotonic() - self._unacked[0][1] if self._unacked else 0.0
            return self._heard and self.lost is None, len(self._unacked), waited

    def lose(self, why: str) -> None:
        """Ends the feed (idempotent): its stream ends (its store files not sent are let go), and the primary
        asks its arbiter to drop the backup."""
        with self._cond:
            if self.lost is not None:
                return
            self.lost = why
            dropped = [*self._frames, *self._early]
            self._frames.clear()
            self._files = 0
            self._early = []
            self._cond.notify_all()
        self.on_queued()
        _drop(dropped)
        if self._lane is not None:
            self._lane.close()  # a send in progress fails at once
            self._sender.shutdown(wait=False)
        if self._acks_lane is not None:
            self._acks_lane.close()  # its reader ends
        self._on_lost(self, why)


def _remove_link(source: pathlib.Path) -> None:
    """Removes a store file's link of a feed's (Journal.base_files), and its folders once empty."""
    source.unlink(missing_ok=True)
    for folder in (source.parent, source.parent.parent):
        try:
            folder.rmdir()
        except OSError:
            break


def _drop(items) -> None:
    """Lets go of the store files' links of queued items a lost feed will not send."""
    for item in items:
        if item[0] == "file":
            item[1].close()
            _remove_link(item[2])
