"""A backup's copy of its primary's journal (Mirror): what one Replicate stream brings, written into the backup's
own journal folder in the primary's order and with its log numbers. No gRPC.

The stream brings the primary's layout, a base (which replaces the folder: the
copy begins afresh, named by the stream's hello, ReplicaHello.copy, in the
folder's marker), then every record and rotation, and the base of every later
compaction, with the store files of its tables on SSD. A record whose bytes
come in its frames, or in one piece (journal_log.PIECE) on the bulk lane, is
written by the thread that takes its frame and acknowledged there at once
(Journal.write_now), unless --journal-sync leaves it to the writer's group
commit; one of more pieces on the lane is handed to the journal's writer when
its frame comes, and written a piece at a time as its bytes arrive (_Arrival).
A part the copy cannot write (a full disk) raises MalformedStreamError: the
stream ends, and the backup (backup.py) follows again from a new base.
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import re
import shutil
import threading
import time
from typing import Callable

import numpy as np
from google.protobuf.message import DecodeError

from ..errors import LaneBrokenError, MalformedStreamError, ServerUnavailableError
from ..proto import ps_pb2
from . import journal_log
from .checkpoint import fsync_dir
from .journal import Journal
from .feed import MAX_LANE_FRAME
from .replication import mark_replicated

__all__ = ["Mirror", "LANE_SECONDS"]

_LOGGER = logging.getLogger(__name__)
LANE_SECONDS = 30.0            # a pause in a record's or base's bytes on the lane, once its frame came
SPARE_BUFFERS = 2              # lane buffers kept for reuse (a record's size and a base's), the newest
_FRAME = ps_pb2.ReplicaFrame


def _store_parts(path: str) -> tuple[str, ...]:
    """The parts of a path a FILE frame names (base-N.stores/...); MalformedStreamError for one outside such a
    folder."""
    parts = pathlib.PurePosixPath(path).parts
    if len(parts) < 2 or not re.fullmatch(r"base-\d+\.stores", parts[0]) or any(p in ("", ".", "..") for p in parts):
        raise MalformedStreamError(f"the primary sent a file outside a base's store copies: {path!r}")
    return parts


def _kind(frame: ps_pb2.ReplicaFrame) -> str:
    """A frame's kind by name (a number this backup does not know as that number)."""
    return _FRAME.Kind.Name(frame.kind) if frame.kind in _FRAME.Kind.values() else f"a frame of kind {frame.kind}"


class Mirror:
    """One stream's copy of the primary's journal, into `folder` (replaced at its base), named `copy` (its
    hello's ReplicaHello.copy, written in the folder's marker with the base); its records' bytes read from `lane`
    where the stream has one (ReplicaFrame.lane_bytes)."""

    def __init__(self, folder: pathlib.Path, sync: bool, lane=None, copy: str = ""):
        self.folder, self.sync, self.lane, self.copy = folder, sync, lane, copy
        # A base's store copies (FILE frames) are written here first and moved beside the base as it comes.
        self.incoming = folder.parent / f".{folder.name}.incoming"
        shutil.rmtree(self.incoming, ignore_errors=True)
        self._file = None  # (path, open file) of a FILE in pieces
        self.finished = False  # the job's end (the chief's Shutdown) came: its primary stops
        self.replica_events: list[dict] = []  # the primary's record of the shards it arbitrates, as it changes
        self.journal: Journal | None = None
        self._layout = b""
        self._piece: list | None = None  # [frame kind, number, written, head, pieces] of a record in pieces
        # (local record, the primary's number for it, the lane buffer it was read into or None), not acknowledged
        self._pairs: collections.deque[tuple[int, int, object]] = collections.deque()
        self._spare: dict[int, np.ndarray] = {}  # lane buffers by size, free again once written (SPARE_BUFFERS)
        self.lane_since: float | None = None  # when it began to wait for a frame's bytes on the lane, None if not
        self._cond = threading.Condition(threading.Lock())
        self._ended = False  # end(): written() waits no more
        self.frames_on_lane = False  # TO_LANE came: the frames come on the lane (next_on_lane), heartbeats here

    def take(self, frame: ps_pb2.ReplicaFrame, on_lane: bool = False) -> int | None:
        """Writes one frame's part (one that came `on_lane`: next_on_lane); returns the primary's number to
        acknowledge at once (the stream's first base, or a record written here), else None (the records the
        journal's writer writes are acknowledged by written()). Once TO_LANE came, a thread of its own takes
        the lane's frames, and the stream's (heartbeats only) may be taken meanwhile.
        MalformedStreamError for a stream out of order (a frame but a heartbeat in the stream after TO_LANE,
        one on the lane that belongs in the stream), and for a part this copy cannot write (a full disk, its
        journal failed): the stream ends, and the backup follows again from a new base. LaneBrokenError as
        _read_lane raises it."""
        if on_lane and frame.kind in (_FRAME.LAYOUT, _FRAME.HEARTBEAT, _FRAME.TO_LANE, _FRAME.FILE):
            raise MalformedStreamError(f"the primary sent {_kind(frame)} on the lane")
        if self.frames_on_lane and not on_lane and frame.kind != _FRAME.HEARTBEAT:
            raise MalformedStreamError(f"the primary sent {_kind(frame)} in the stream after TO_LANE")
        try:
            return self._take(frame)
        except LaneBrokenError:
            raise
        except (OSError, ServerUnavailableError) as exc:  # ServerUnavailableError: the journal's writer failed
            failure = self.journal.failure if self.journal is not None else None  # (its raise speaks to clients)
            raise MalformedStreamError(f"this copy cannot be written in {self.folder} ({failure or exc})") from None

    def _take(self, frame: ps_pb2.ReplicaFrame) -> int | None:
        if frame.kind == _FRAME.HEARTBEAT:
            return None
        if frame.kind == _FRAME.LAYOUT:
            self._layout = frame.data
            return None
        if frame.kind == _FRAME.TO_LANE:
            if self.lane is None or self.journal is None or self._piece is not None:
                raise MalformedStreamError("the primary sent TO_LANE " + ("on a stream without a lane"
                                           if self.lane is None else "before its first base had come whole"))
            self.frames_on_lane = True
            return None
        if frame.kind == _FRAME.FILE:
            self._take_file(frame)
            return None
        if frame.kind == _FRAME.ROTATE:
            self._need_journal()
            number = self.journal.rotate()
            if number != frame.number:
                raise MalformedStreamError(f"the primary began log {frame.number}, this copy log {number}")
            return None
        if self._piece is None:
            self._piece = [frame.kind, frame.number, frame.written, frame.head, []]
        self._piece[4].append(frame.data)
        if not frame.last:
            return None
        kind, number, written, head, pieces = self._piece
        self._piece = None
        buffer = None
        if kind == _FRAME.RECORD:
            self._need_journal()
            now = None  # the primary's number, where this thread writes the record itself (acknowledged at once)
            if frame.lane_bytes > journal_log.PIECE:  # the writer writes it as its bytes come
                buffer = self._spare_buffer(frame.lane_bytes)
                arrival = _Arrival()
                local = self.journal.append_encoded(head, journal_log.split(head, buffer), arrival.wait)
                try:
                    self._read_lane(buffer, arrival.came)
                finally:
                    arrival.stop()
            else:
                if frame.lane_bytes:
                    buffer = self._spare_buffer(frame.lane_bytes)
                    self._read_lane(buffer)
                    data = journal_log.split(head, buffer)
                else:  # written piece by piece: no copy to join them
                    data = [memoryview(piece) for piece in pieces]
                if self.sync:  # the writer's group commit: one fdatasync for the records queued meanwhile
                    local = self.journal.append_encoded(head, data)
                else:
                    self.journal.write_now(head, data)
                    now = written
            kind = journal_log.kind_of(head)  # set before it can be acknowledged (written() may, at once): the
            self.finished = self.finished or kind == "finish"  # stream's end that follows is the job's
            if kind == "replica":  # the primary arbitrates a shard (ps 0 and ps 1 arbitrate each other)
                self.replica_events.append(journal_log.meta_of(head))
            elif kind == "layout":  # a live resize's epoch: the copy is of the job's shard count now (moves.py)
                self.journal.note_shards(len(journal_log.meta_of(head)["addresses"]))
            if now is None:
                with self._cond:
                    self._pairs.append((local, written, buffer))
                    self._cond.notify_all()
            elif buffer is not None:
                self._keep(buffer)
            return now
        if frame.lane_bytes:
            buffer = self._spare_buffer(frame.lane_bytes)
            self._read_lane(buffer)
            data = journal_log.split(head, buffer)
        else:
            data = [memoryview(piece) for piece in pieces]
        if self._file is not None:
            raise MalformedStreamError(f"the primary sent a base before the end of the file {self._file[0]}")
        if self.journal is None:  # the stream's first base: the copy begins again from it
            self._replace(number, head, data)
            return written
        self._place_files()
        self.journal.finish_compaction(number, self.journal.write_encoded_base(number, head, data))
        if buffer is not None:  # written: the next base's bytes are read into it
            self._keep(buffer)
        return None

    def _take_file(self, frame: ps_pb2.ReplicaFrame) -> None:
        """Writes a piece of a base's store copy into `incoming`, at its path (base-N.stores/...); the last
        piece closes it (synced with `sync`). One naming a file of the last base's copies (`same_as`) links
        that. MalformedStreamError for a path outside such a folder, or a `same_as` this copy lacks."""
        if self._file is None:
            target = self.incoming.joinpath(*_store_parts(frame.path))
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                if not frame.same_as:
                    self._file = (frame.path, open(target, "wb"))
            except OSError as exc:
                raise MalformedStreamError(f"the store file {frame.path} cannot be made here ({exc})") from None
            if frame.same_as:
                source = self.folder.joinpath(*_store_parts(frame.same_as))
                try:
                    os.link(source, target)
                except OSError as exc:
                    raise MalformedStreamError(f"the primary named {frame.same_as!r} of the last base for "
                                               f"{frame.path!r}, and this copy cannot link it ({exc})") from None
                return
        elif frame.path != self._file[0]:
            raise MalformedStreamError(f"the primary sent {frame.path!r} within {self._file[0]!r}")
        path, f = self._file
        try:
            f.write(frame.data)
            if frame.last:
                if self.sync:
                    f.flush()
                    os.fsync(f.fileno())
                f.close()
                self._file = None
        except OSError as exc:  # a full disk: this copy follows again from a new base (its old base stands)
            raise MalformedStreamError(f"the store file {path} cannot be written here ({exc})") from None

    def _place_files(self) -> None:
        """Moves the store copies taken since the last base (incoming) into the copy's folder, beside the base
        that names them."""
        if not self.incoming.is_dir():
            return
        for stores in sorted(self.incoming.iterdir()):
            if self.sync:  # the files were synced as they came: their folders' entries too
                for table in stores.iterdir():
                    fsync_dir(table)
                fsync_dir(stores)
            target = self.folder / stores.name
            if target.exists():
                shutil.rmtree(target)
            os.replace(stores, target)
        shutil.rmtree(self.incoming, ignore_errors=True)
        if self.sync:
            fsync_dir(self.folder)

    def next_on_lane(self) -> ps_pb2.ReplicaFrame:
        """(After TO_LANE.) The lane's next frame, for take(frame, on_lane=True) (which reads its bytes). Blocks
        for as long as the primary sends nothing (its silence is the stream's watch to see: it closes the
        lane). LaneBrokenError if the lane breaks or closes; MalformedStreamError for a frame that does not
        parse."""
        raw = bytearray(self.lane.begin_any(None, MAX_LANE_FRAME))
        self.lane.read_into(memoryview(raw))
        try:
            return ps_pb2.ReplicaFrame.FromString(bytes(raw))
        except DecodeError:
            raise MalformedStreamError(f"a frame of {len(raw)} bytes on the lane does not parse") from None

    def _spare_buffer(self, nbytes: int) -> np.ndarray:
        """A buffer of `nbytes` for a lane frame: a spare one of that size (its pages mapped already), or a
        new one (not zeroed)."""
        with self._cond:
            buffer = self._spare.pop(nbytes, None)
        return np.empty(nbytes, dtype=np.uint8) if buffer is None else buffer

    def _keep(self, buffer: np.ndarray) -> None:
        """Keeps a written lane buffer for the next frame of its size (the SPARE_BUFFERS newest sizes)."""
        with self._cond:
            self._spare.pop(len(buffer), None)
            self._spare[len(buffer)] = buffer
            while len(self._spare) > SPARE_BUFFERS:
                del self._spare[next(iter(self._spare))]

    def _read_lane(self, buffer: np.ndarray, came: Callable[[int], None] | None = None) -> None:
        """Reads the lane's next frame, a record's or a base's tensors, into `buffer` (its length), a PIECE at a
        time, each told to `came` (the bytes read so far); lane_since is set while it waits for them.
        MalformedStreamError without a lane; LaneBrokenError if it breaks, is closed, or pauses (LANE_SECONDS)."""
        if self.lane is None:
            raise MalformedStreamError("the primary sent a record's bytes on a lane this stream does not have")
        view = memoryview(buffer)
        self.lane_since = time.monotonic()
        try:
            self.lane.begin(len(view), LANE_SECONDS)
            for at in range(0, len(view), journal_log.PIECE):
                self.lane.read_into(view[at:at + journal_log.PIECE])
                self.lane.rearm(LANE_SECONDS)
                if came is not None:
                    came(min(len(view), at + journal_log.PIECE))
        finally:
            self.lane_since = None

    def _need_journal(self) -> None:
        if self.journal is None:
            raise MalformedStreamError("the primary sent records before a base")

    def _replace(self, number: int, head: bytes, data: list) -> None:
        if self.folder.exists():
            shutil.rmtree(self.folder)
        self.journal = Journal(self.folder, sync=self.sync)
        self._place_files()
        self.journal.start_mirror(self._layout, number, head, data)
        # Started on it, a process asks the arbiter who serves the shard; a backup restarted on it trusts the copy
        # within this boot, or always if every record was synced (copy_kept).
        mark_replicated(self.folder, self.sync, copy=True, name=self.copy)
        _LOGGER.info("backup copy in %s begins at log %d", self.folder, number)

    def written(self, timeout: float) -> int | None:
        """Blocks until the newest record taken is written; returns the primary's number for it (None: none
        taken within `timeout` s, or end() was called)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pairs or self._ended, timeout) or self._ended:
                return None
            pairs = list(self._pairs)
            self._pairs.clear()
        local, primary, _ = pairs[-1]
        self.journal.wait(local)
        for _, _, buffer in pairs:
            if buffer is not None:
                self._keep(buffer)
        return primary

    def end(self) -> None:
        """Its stream ended: a written() waiting returns None now, and every later one at once."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def close(self) -> None:
        """Closes the copy's files (its journal's log synced). A disk that fails the sync is logged, not raised:
        what was acknowledged is in the page cache, and the backup follows again from a new base."""
        if self._file is not None:
            self._file[1].close()
        shutil.rmtree(self.incoming, ignore_errors=True)
        if self.journal is not None:
            try:
                self.journal.close()
            except OSError as exc:
                _LOGGER.error("backup copy in %s: its log could not be synced as it closed (%s)", self.folder, exc)


class _Arrival:
    """A record's bytes coming off the lane while the journal's writer writes them: the thread taking its frame
    says how many came (came) and, once it reads no more, stop(); the writer waits for each piece (wait)."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._came, self._stopped = 0, False

    def came(self, nbytes: int) -> None:
        with self._cond:
            self._came = nbytes
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def wait(self, nbytes: int) -> None:
        """Blocks until `nbytes` came; journal_log.Abandoned if the reading stopped first."""
        with self._cond:
            self._cond.wait_for(lambda: self._came >= nbytes or self._stopped)
            if self._came < nbytes:
                raise journal_log.Abandoned(f"a record's bytes stopped coming on the bulk lane after {self._came} "
                                            f"of them")
