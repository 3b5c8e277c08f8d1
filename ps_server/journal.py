"""The journal: every change to a shard's state, written before it is acknowledged. No gRPC.

A shard started with a journal folder (by default `<checkpoint-dir>/journal/ps-N`)
records each change there: a push applied, gradients added to a sync step, a
step applied, variables created, optimizer changes, the mode, membership, the
job's end. After a crash the shard loads the newest base (a whole state) and
replays the records written after it, so it comes back with everything it
acknowledged and nothing twice (the push ledger is part of it).

    layout.json       the job and the shard layout the journal belongs to (Layout)
    base-000003.bin   the state when log 3 began (one record; written under another name, then renamed)
    log-000003.bin    the records since (journal_log.py)
    base-000003.stores/  the store copies of base 3's tables kept on SSD (ssd_tables.py), removed with it
    spare-000002.bin  a retired base or log, written over by the next one

Writing. `append` queues a record and returns its number at once, so it may
be called under any lock: the order of appends is the order in the log. One
writer thread writes the queue in order, batch by batch (group commit; a
backup's copy, whose stream is its one appender, writes a small record in
that thread instead, once the queue is written: `write_now`), and
`wait(number)` returns once that record is written: into the kernel's page
cache by default, which a killed process (kill -9, OOM) cannot lose; with
`sync`, onto the disk (one fdatasync per batch, bases and folders fsynced),
which a host losing power cannot lose either. A write that fails (ENOSPC,
EFBIG, EIO) fails the journal for good: every wait for a record not written
then raises ServerUnavailableError, no record is written after the failed
one (so it is the log's torn end), and `on_failure(cause)` runs once (the
shard's FailStop.fatal: it stops there, ps_server/failstop.py).

Compaction: once the log passes `compact_factor` times the newest base's
size, and a floor (`compaction_floor`: FLOOR_FACTOR times the base's size,
within MIN_COMPACT_BYTES and MAX_COMPACT_BYTES, unless `min_compact_bytes`
sets it), the shard writes its state as a new base and starts a new log
(rotate, write_base, finish_compaction), and the older files are kept as
spares for the next base and log to be written over: pages the kernel already
holds are reused instead of allocated and freed again for every record. The
folder holds about two logs at that threshold and two bases at most: a few
MiB for a small model.

Recovery (`recover`) cuts off what follows the last whole record of the last
log: a torn record (a crash mid-write; a warning says so) or bytes left from
a reused file's earlier use (routine: logged at DEBUG). It refuses a journal
with a damaged record before a whole one (corruption: CheckpointError naming
the file and the byte, and what to do: `advice`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
import secrets
import shutil
import threading
import time
from typing import Callable, Iterable, Iterator, Mapping

import setproctitle
import torch

from ..errors import CheckpointError, ClusterConfigError, ModeConflictError, ServerUnavailableError, WaitTimeoutError
from . import journal_log
from .checkpoint import fsync_dir, write_atomic
from .journal_log import Record
from .locks import check_unlocked, checked
from .disk_rows import link_tree
from .ssd_tables import place_stores, resolve_stores

__all__ = ["Journal", "Layout", "Record", "recorded_layout", "COMPACT_FACTOR", "MIN_COMPACT_BYTES",
           "MAX_COMPACT_BYTES", "compaction_floor"]

_LOGGER = logging.getLogger(__name__)
COMPACT_FACTOR = 4              # log bytes per base byte before a compaction: a base costs 1/4 of its log
FLOOR_FACTOR = 8                # a small base's log grows to this many times it: not compacted every few pushes,
MIN_COMPACT_BYTES = 4 << 20     # nor a tiny model's every push, while its journal stays a few MiB;
MAX_COMPACT_BYTES = 64 << 20    # past 16 MiB of base, COMPACT_FACTOR alone decides
# A journal refused (corrupt, or another job's or layout's), what a shard started by hand says to do.
_REPLACE = "pass --restore-from CHECKPOINT_DIR --replace-journal (the journal is moved aside, not deleted)"
SPARES = 2                      # retired files kept to be written over: a base's and a log's
LAYOUT = "layout.json"
SHIPPING = ".shipping"          # base store copies linked for a backup until sent (base_files)
_BASE = re.compile(r"^base-(\d{6})\.bin$")
_LOG = re.compile(r"^log-(\d{6})\.bin$")
_SPARE = re.compile(r"^spare-(\d{6})\.bin$")
WRITER_THREAD = "journal-writer"  # its name to the OS too (top -H, /proc/PID/task/TID/comm)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The job and the shard layout a journal belongs to: one layout per volume."""

    index: int                  # this shard's index
    num_ps: int | None          # shards in the job; None for a standalone shard
    origin: str | None = None   # the --restore-from folder the job started from, None if it did not
    job: str = dataclasses.field(default_factory=lambda: secrets.token_hex(6))  # names the job in messages

    def conflict(self, wanted: "Layout") -> str | None:
        """Why a journal of this layout must not serve a shard started as `wanted`, or None."""
        if self.index != wanted.index:
            return f"it is shard {self.index}'s and this is shard {wanted.index}"
        if None not in (self.num_ps, wanted.num_ps) and self.num_ps != wanted.num_ps:
            return f"it is of a {self.num_ps}-shard job and this job has {wanted.num_ps} shards"
        if wanted.origin is not None and wanted.origin != self.origin:
            began = f"from {self.origin}" if self.origin else "without --restore-from"
            return f"--restore-from {wanted.origin} starts a new job, and it holds job {self.job}, begun {began}"
        return None

    def describe(self) -> str:
        shards = f"shard {self.index} of {self.num_ps}" if self.num_ps else f"shard {self.index}"
        return f"job {self.job}, {shards}" + (f", from {self.origin}" if self.origin else "")


def recorded_layout(directory: str | os.PathLike) -> Layout | None:
    """The layout the journal in `directory` was begun with (the shard count as its last live resize set it:
    note_shards), None if it has none (an older journal, or none). CheckpointError if it cannot be read."""
    path = pathlib.Path(directory) / LAYOUT
    if not path.exists():
        return None
    try:
        return Layout(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"journal {directory}: {LAYOUT} cannot be read ({exc})") from None


def compaction_floor(base_bytes: int) -> int:
    """The least log, in bytes, that is compacted with a base of `base_bytes`: FLOOR_FACTOR times it, within
    MIN_COMPACT_BYTES and MAX_COMPACT_BYTES."""
    return min(MAX_COMPACT_BYTES, max(MIN_COMPACT_BYTES, FLOOR_FACTOR * base_bytes))


class Journal:
    """A shard's journal folder (see the module docstring). append() and wait() are thread-safe."""

    def __init__(self, directory: str | os.PathLike, *, layout: Layout | None = None, sync: bool = False,
                 compact_factor: float = COMPACT_FACTOR, min_compact_bytes: int | None = None,
                 on_failure: Callable[[str], None] | None = None, advice: str | None = None):
        """`layout`: the shard this journal serves (check_layout; a new journal records it). `min_compact_bytes`:
        the least log compacted (default: compaction_floor of the base). `advice`: what a refusal of the
        journal tells the user to do to start from a checkpoint instead (default: ps-server's flags)."""
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.wanted = layout
        self.sync = sync
        self.compact_factor = compact_factor
        self.min_compact_bytes = min_compact_bytes
        self.advice = advice
        self._on_failure = on_failure
        # guards everything below but the writer's own
        self._cond = threading.Condition(checked(threading.Lock(), "journal", "the journal's queue"))
        self._queue: list[tuple] = []   # ("record", number, head, views, ready or None) and ("rotate", log number)
        self._appended = 0              # records numbered so far
        self._written = 0               # records written (synced, with `sync`) so far, in order
        self._number = -1               # the log appends go to
        self._writing = -1              # the log the writer has open
        self._log_bytes = 0             # bytes appended to log `_number`
        self._base_bytes = 0            # the size of the newest base
        self._spares = self._numbers(_SPARE)  # spare files (numbers) to write over
        self._dropped: list[tuple[int, pathlib.Path]] = []  # (log then, folder): drop_after_next_base
        self._next_spare = max(self._spares, default=-1) + 1
        self._failed: str | None = None
        self._closing = False
        self._fd: int | None = None     # the writer's: the log it writes, and where
        self._offset = 0
        self._writer: threading.Thread | None = None
        self._busy = False              # the writer, or write_now()'s caller, writes to the log
        self._follower = None           # a backup's feed (feed.Feed) every wait also waits for
        self._acked = 0                 # records the follower wrote, in order
        self._shipping = None           # the writer's: the feed it hands what it writes to (since its rotate)

    # -- recovery ---------------------------------------------------------------------------------

    def _numbers(self, pattern: re.Pattern) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := pattern.match(p.name)))

    def holds_state(self) -> bool:
        """True if the folder holds a journal to recover from."""
        return bool(self._numbers(_BASE) or self._numbers(_LOG))

    def recorded_layout(self) -> Layout | None:
        """The layout the journal in the folder was begun with, None if it has none (an older journal)."""
        return recorded_layout(self.directory)

    def check_layout(self) -> None:
        """ClusterConfigError (one line) unless the journal in the folder may serve the shard this Journal was
        made for (`layout`): same shard, same number of shards, and no --restore-from of another job."""
        found = self.recorded_layout()
        why = "it records no layout (an older torchps wrote it)" if found is None else found.conflict(self.wanted)
        if why is not None:
            raise ClusterConfigError(
                f"journal {self.directory} does not belong to this shard ({self.wanted.describe()}): {why}. Its "
                f"state is not mixed with another layout: to start from a checkpoint instead {self.start_over()}")

    def start_over(self) -> str:
        """What to do to start from a checkpoint instead of this journal (moved aside, kept), for the way the
        shard was started: `advice`, else ps-server's flags."""
        return self.advice or _REPLACE

    def note_shards(self, num_ps: int) -> None:
        """A live resize's layout epoch made the job `num_ps` shards: layout.json says so from now on (the same
        job), so this shard restarted with the job's new cluster spec takes its journal back, and with the old
        one refuses it. Writes the file (atomically) only when the count changes; call it holding no lock."""
        found = self.recorded_layout()
        if found is not None and found.num_ps not in (None, num_ps):
            text = json.dumps(dataclasses.asdict(dataclasses.replace(found, num_ps=num_ps))).encode()
            write_atomic(self.directory / LAYOUT, lambda f: f.write(text), sync=self.sync)

    def move_aside(self) -> pathlib.Path:
        """Renames the folder to FOLDER.aside-TIME (kept, never deleted) and starts an empty one; returns
        the new name of the old folder."""
        aside = self.directory.with_name(f"{self.directory.name}.aside-{time.strftime('%Y%m%dT%H%M%S')}")
        while aside.exists():
            aside = aside.with_name(aside.name + "x")
        self.directory.rename(aside)
        self.directory.mkdir()
        fsync_dir(self.directory.parent)
        self._spares = []
        return aside

    def recover(self) -> tuple[dict | None, Iterator[Record]] | None:
        """(base state or None, the records after it) to replay, or None if the folder holds no journal.

        The records are read as they are replayed: CheckpointError (from the iterator) for a damaged record
        with a whole one after it; a torn record at the end is cut off, so appends go on after the last whole
        one.
        """
        if not self.holds_state():
            return None
        bases, logs = self._numbers(_BASE), self._numbers(_LOG)
        base, state = -1, None
        for number in reversed(bases):
            state = self._read_base(number)
            if state is not None:
                base = number
                break
            _LOGGER.warning("journal %s is not a whole base; trying an older one", self._base_path(number))
        replay = [n for n in logs if n >= base]
        if base < 0 and logs and logs[0] != 0:
            raise CheckpointError(f"journal {self.directory}: no readable base before log {logs[0]}")
        self._number = max([base, *replay])
        return state, self._replay(replay)

    def _read_base(self, number: int) -> dict | None:
        path = self._base_path(number)
        view, mapping = journal_log.mapped(path)
        try:
            record = journal_log.first(view, number)
        finally:
            view.release()
            if mapping is not None:
                mapping.close()
        if record is None or record.kind != "base":
            return None
        stores = self._stores_path(number)
        self._base_bytes = path.stat().st_size + sum(f.stat().st_size for f in stores.rglob("*") if f.is_file())
        state = journal_log.state_of_record(record)
        resolve_stores(state, self.directory)
        return state

    def _replay(self, numbers: list[int]) -> Iterator[Record]:
        for i, number in enumerate(numbers):
            path = self._log_path(number)
            view, mapping = journal_log.mapped(path)
            good = 0
            try:
                for record, good in journal_log.scan(view, number):
                    yield record
                if good < len(view):
                    self._check_tail(path, view, number, good, [(self._log_path(n), n) for n in numbers[i + 1:]])
            finally:
                view.release()
                if mapping is not None:
                    mapping.close()
            if good < path.stat().st_size:
                os.truncate(path, good)
            if number == self._number:
                self._log_bytes = good

    def _check_tail(self, path: pathlib.Path, view: memoryview, number: int, good: int,
                    later: list[tuple[pathlib.Path, int]]) -> None:
        """What follows the whole records of log `number` from byte `good` on, to be cut off: a torn record
        (a warning) or bytes of the file's earlier use (DEBUG); CheckpointError, with what to do, for a damaged
        record with a whole one after it."""
        try:
            journal_log.check_tail(path, view, number, good, later)
        except CheckpointError as exc:
            if self.advice:
                what = f"To go on from the newest committed checkpoint, {self.advice}"
            else:
                what = (f"Move it aside (mv {self.directory} {self.directory}.damaged) and start the shard again: "
                        f"it starts as a shard without a journal does (from the newest committed checkpoint in "
                        f"--checkpoint-dir)")
            raise CheckpointError(f"{exc}. {what}; or restore the disk") from None
        if journal_log.torn(view, number, good):
            _LOGGER.warning("journal %s: a torn record at byte %d (a write cut short when the shard stopped: it was "
                            "never acknowledged): %d bytes cut off", path, good, len(view) - good)
        else:
            _LOGGER.debug("journal %s: the %d bytes after its last record (byte %d) are left from the file's "
                          "earlier use: cut off", path, len(view) - good, good)

    # -- writing ----------------------------------------------------------------------------------

    def start(self, state: dict | None) -> None:
        """Opens the log for appends and starts the writer: the current log after recover(), else (a new
        journal) the layout and base 0 with `state` are written first."""
        shutil.rmtree(self.directory / SHIPPING, ignore_errors=True)  # what a feed of an earlier process left
        if self._number < 0:
            self._number = 0
            self._write_layout()
            if state is not None:
                self.finish_compaction(0, self.write_base(0, state))
        self._open(self._number)
        self._writer = threading.Thread(target=self._write_loop, name=WRITER_THREAD, daemon=True)
        self._writer.start()

    def start_mirror(self, layout: bytes, number: int, head: bytes, views: list[memoryview]) -> None:
        """Instead of start() in an empty folder: a backup's copy of its primary's journal begins, with the
        primary's layout.json (the same job and shard) and base `number` (encoded), and goes on with log
        `number`."""
        write_atomic(self.directory / LAYOUT, lambda f: f.write(layout), sync=self.sync)
        self._number = number
        self.finish_compaction(number, self.write_encoded_base(number, head, views))
        self._log_bytes = 0
        self.start(None)

    def begin_again(self, state: dict) -> None:
        """Before start(), after recover(): the journal goes on as a new job's, from `state` (a new base), with
        a new job identity; the older files are retired once both are written."""
        self._number += 1
        self._write_layout()
        self.finish_compaction(self._number, self.write_base(self._number, state))
        self._log_bytes = 0

    def append(self, kind: str, meta: dict, tensors: Mapping[str, torch.Tensor]) -> int:
        """Queues one record (in the order of the calls); returns its number for wait(). Never blocks on I/O.
        The tensors must not change until it is written; once wait() returns for it the journal holds no
        reference to them. ServerUnavailableError once the journal failed."""
        return self.append_encoded(*journal_log.encode(kind, meta, tensors))

    def append_encoded(self, head: bytes, views: list[memoryview],
                       ready: Callable[[int], None] | None = None) -> int:
        """append() of a record encoded already (journal_log.encode: a backup's copy of its primary's). With
        `ready`, the views' bytes are still coming: the writer waits for each piece (journal_log.write); if
        it raises journal_log.Abandoned the journal fails, its log ending in part of the record."""
        with self._cond:
            number = self._number_record(head, views)
            self._queue.append(("record", number, head, views, ready))
            self._cond.notify_all()
            return number

    def _number_record(self, head: bytes, views: list) -> int:
        """(Holding the lock.) The next record's number, its bytes counted in the log's; ServerUnavailableError if
        the journal failed or is closing."""
        self._check()
        self._appended += 1
        self._log_bytes += len(head) + sum(len(v) for v in views) + journal_log.TAIL_BYTES
        return self._appended

    def write_now(self, head: bytes, views: list[memoryview]) -> int:
        """append_encoded() written in the caller's thread, for a journal with one appender, no follower and no
        `sync` (a backup's copy, written by its stream: no trip to the writer): blocks until the writer wrote
        what was queued before it, then writes it; returns its number, written. ServerUnavailableError if the
        journal failed or is closing, or fails now (a write failed, as the writer's do: the log ends in part of
        the record, and it is acknowledged to no one)."""
        assert not self.sync and self._follower is None, "write_now neither syncs nor ships its record"
        with self._cond:
            self._cond.wait_for(lambda: not (self._queue or self._busy) or self._failed is not None)
            number, self._busy = self._number_record(head, views), True
        try:
            self._offset = journal_log.write(self._fd, self._offset, head, views, self._writing)
        except OSError as exc:
            self._fail(f"journal {self._log_path(self._writing)}: a write failed: {exc.strerror or exc}")
        except Exception as exc:  # noqa: BLE001 - a bug, as in the writer: nothing more can be written
            self._fail(f"journal {self.directory}: writing a record failed: {exc!r}")
        finally:
            with self._cond:
                self._busy = False
                if self._failed is None:
                    self._written = number
                self._cond.notify_all()
        with self._cond:
            self._check()
        return number

    def wait(self, number: int | None = None, timeout: float | None = None, released=None) -> None:
        """Blocks until record `number` (None: every record appended so far) is written (synced, with `sync`),
        and, while a backup follows (attach), written by it too, unless that backup is `released`: a follower
        that was lost (its `lost` set, follower_lost() called), not detached yet, that the shard's arbiter no
        longer records in sync (Replication.released). ServerUnavailableError if the journal failed first,
        WaitTimeoutError after `timeout` s."""
        with self._cond:
            number = self._appended if number is None else number
            self._cond.wait_for(lambda: self._holds(number, released) or self._failed is not None, timeout)
            if self._holds(number, released):
                return
            self._check()
            if self._written >= number:
                raise WaitTimeoutError(f"journal {self.directory}: record {number} was not written by the backup "
                                       f"{self._follower.address} within {timeout} s")
            raise WaitTimeoutError(f"journal {self.directory}: record {number} was not written within {timeout} s")

    def _holds(self, number: int, released=None) -> bool:
        return self._written >= number and (self._follower is None or self._acked >= number or (
            self._follower is released and released.lost is not None))

    def wants_compaction(self) -> bool:
        with self._cond:
            floor = compaction_floor(self._base_bytes) if self.min_compact_bytes is None else self.min_compact_bytes
            return self._log_bytes > max(floor, self.compact_factor * self._base_bytes)

    def rotate(self, follower=None) -> int:
        """Starts a new log for the records appended from now on; returns its number. Call with the state
        taken at the same moment, then write_base() and finish_compaction(). With `follower` (a backup's
        feed.Feed, none attached: ModeConflictError otherwise), it is attached in the same instant:
        it is handed every record and rotation written after this one, and from now on every wait() waits
        until it acknowledged its record (Feed.floor: the last record the state holds)."""
        with self._cond:
            self._check()
            if follower is not None:
                if self._follower is not None:
                    raise ModeConflictError(f"the backup {self._follower.address} follows this shard: one at a time")
                self._follower, self._acked, follower.floor = follower, 0, self._appended
                shutil.rmtree(self.directory / SHIPPING, ignore_errors=True)  # a lost feed's files not sent
            self._number += 1
            self._queue.append(("rotate", self._number, follower))
            self._log_bytes = 0
            self._cond.notify_all()
            return self._number

    def write_base(self, number: int, state: dict) -> pathlib.Path:
        """Writes `state` (the state when log `number` began) as one record into a spare file, into the page
        cache only (its tensors as they are: they must not change until it returns); returns that file for
        finish_compaction(). Call it holding no lock of the shard."""
        check_unlocked("writes a journal base")
        older = [n for n in self._numbers(_BASE) if n < number]  # its table files are linked from there, if need be
        stores = place_stores(state, self._stores_path(number), self.directory,
                              self._stores_path(older[-1]) if older else None)
        written = self.write_encoded_base(number, *journal_log.encode("base", {}, journal_log.state_record(state)))
        with self._cond:
            self._base_bytes += stores  # the log is replayed onto them: they weigh as rows in a base do
        return written

    def write_encoded_base(self, number: int, head: bytes, views: list[memoryview]) -> pathlib.Path:
        """write_base() of a base record encoded already (a backup's copy of its primary's)."""
        path = self._take_spare(largest=False)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            offset = journal_log.write(fd, 0, head, views, number)
        finally:
            os.close(fd)
        with self._cond:
            self._base_bytes = offset
        return path

    def finish_compaction(self, number: int, written: pathlib.Path) -> None:
        """Makes `written` (write_base) base `number` (synced first, with `sync`); once every record before
        log `number` is written, retires the older bases and logs as spares. Call it holding no lock of the
        shard."""
        check_unlocked("finishes a journal compaction")
        if self.sync:
            fd = os.open(written, os.O_WRONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        os.replace(written, self._base_path(number))
        if self.sync:
            fsync_dir(self.directory)
        with self._cond:
            self._cond.wait_for(lambda: self._writing >= number or self._failed is not None or self._closing
                                or self._writer is None)
            if self._writing < number and self._writer is not None:
                return
        for older in self._numbers(_BASE) + self._numbers(_LOG):
            if older < number:
                for path in (self._base_path(older), self._log_path(older)):
                    if path.exists():
                        self._retire(path)
                shutil.rmtree(self._stores_path(older), ignore_errors=True)
        with self._cond:
            gone = [folder for then, folder in self._dropped if then < number]
            self._dropped = [(then, folder) for then, folder in self._dropped if then >= number]
        for folder in gone:
            shutil.rmtree(folder, ignore_errors=True)
        if self.sync:
            fsync_dir(self.directory)

    def drop_after_next_base(self, folders: Iterable[pathlib.Path]) -> None:
        """Removes `folders` once a base written after every record appended so far is in place (the records
        that name them are never replayed again). Never blocks; a shard that stops first leaves them."""
        with self._cond:
            self._dropped += [(self._number, pathlib.Path(folder)) for folder in folders]

    def acked(self, follower, number: int) -> None:
        """`follower` wrote every record up to `number` (and the state of its first base, Feed.floor)."""
        with self._cond:
            if self._follower is follower:
                self._acked = max(self._acked, number)
                self._cond.notify_all()

    def follower_lost(self, follower) -> None:
        """`follower` was lost (its `lost` is set): the waits that go past a lost follower end."""
        with self._cond:
            if self._follower is follower:
                self._cond.notify_all()

    def detach(self, follower) -> None:
        """Waits no longer for `follower` (ps 0 dropped it): what is written alone is acknowledged."""
        with self._cond:
            if self._follower is follower:
                self._follower = None
                self._cond.notify_all()

    def following(self):
        """The attached backup's feed, or None."""
        with self._cond:
            return self._follower

    def fail(self, cause: str) -> None:
        """Fails the journal for good (as a failed write does): nothing more is acknowledged."""
        self._fail(cause)

    def close(self) -> None:
        """Writes what is queued, syncs the log and stops the writer."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join()
        if self._fd is not None:
            try:
                if self._failed is None:
                    os.fsync(self._fd)  # OSError as it raises it (a failing disk): the file is closed all the same
            finally:
                os.close(self._fd)
                self._fd = None

    # -- the writer -------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        setproctitle.setthreadtitle(WRITER_THREAD)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._busy and (self._queue or self._closing))
                if not self._queue:
                    return
                batch, self._queue, self._busy = self._queue, [], True
            batch.reverse()  # taken from its end, in order
            try:
                last = 0
                while batch:
                    number = self._write(batch.pop())
                    last = number or last
                    if number and not self.sync:
                        self._done(number)
                if self.sync:  # one fdatasync for the batch: the records queued while the last one ran
                    os.fdatasync(self._fd)
                    self._done(last)
                with self._cond:
                    self._busy = False  # write_now() may write
                    self._cond.notify_all()
            except OSError as exc:
                self._fail(f"journal {self._log_path(self._writing)}: a write failed: {exc.strerror or exc}")
                return
            except journal_log.Abandoned as exc:
                self._fail(f"journal {self._log_path(self._writing)}: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - a bug: nothing more can be written, so the shard stops
                self._fail(f"journal {self.directory}: the writer failed: {exc!r}")
                return

    def _write(self, item: tuple) -> int:
        """Writes one queued item, a record (its number is returned) or a rotation to a new log (0). Nothing of
        a record is held here once it returns, so once its wait() returns the journal holds none of its
        tensors' memory (a shard reuses a push's receive buffers)."""
        shipping = self._shipping if self._shipping is not None and self._shipping is self._follower else None
        if item[0] == "rotate":
            if item[2] is not None:
                self._shipping = item[2]  # attached here: it begins with the base of this log
            elif shipping is not None:
                shipping.offer_rotate(item[1])
            self._open(item[1])
            return 0
        _, number, head, views, ready = item
        sent = shipping.offer_record(number, head, views) if shipping is not None else None  # sends meanwhile
        self._offset = journal_log.write(self._fd, self._offset, head, views, self._writing, ready)
        if sent is not None:
            sent()  # its bytes left for the backup (or the backup was lost): nothing of it is held after this
        return number

    def _done(self, number: int) -> None:
        with self._cond:
            self._written = max(self._written, number)
            self._cond.notify_all()

    def _open(self, number: int) -> None:
        """Makes log `number` the one records are written to, after its whole records (the writer's, or
        start()'s before it runs): an existing log, else a spare written over from its start."""
        path = self._log_path(number)
        if not path.exists():
            os.replace(self._take_spare(largest=True), path)
            if self.sync:
                fsync_dir(self.directory)
        if self._fd is not None:  # the log ends at its last record: no bytes of its file's earlier use after it
            os.ftruncate(self._fd, self._offset)  # (a later log's records would make them read as a damaged one)
            if self.sync:
                os.fdatasync(self._fd)
            os.close(self._fd)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._offset = self._log_bytes if number == self._number and self._writer is None else 0
        with self._cond:
            self._writing = number
            self._cond.notify_all()

    def _fail(self, cause: str) -> None:
        with self._cond:
            self._failed = cause
            self._cond.notify_all()
        if self._on_failure is not None:
            self._on_failure(cause)
        else:
            _LOGGER.error("%s: nothing more is acknowledged", cause)

    @property
    def failure(self) -> str | None:
        """Why this journal failed (a write, its writer), None while it works."""
        with self._cond:
            return self._failed

    def _check(self) -> None:
        if self._failed is not None:
            raise ServerUnavailableError(f"this shard cannot write its journal ({self._failed}): it stops; retry "
                                         f"against its replacement")
        if self._closing:
            raise ServerUnavailableError("this shard is stopping; retry against its replacement")

    # -- files ------------------------------------------------------------------------------------

    def _base_path(self, number: int) -> pathlib.Path:
        return self.directory / f"base-{number:06d}.bin"

    def _log_path(self, number: int) -> pathlib.Path:
        return self.directory / f"log-{number:06d}.bin"

    def _spare_path(self, number: int) -> pathlib.Path:
        return self.directory / f"spare-{number:06d}.bin"

    def base_files(self, number: int) -> list[tuple[str, pathlib.Path]]:
        """[(path under this folder, file)] of every file of base `number`'s store copies (none without tables
        on SSD), for a backup's copy (feed.py): hard links to them in a folder of the feed's
        (SHIPPING/), so that a later compaction retiring the base leaves them to be read until sent; each is
        removed as it is sent, and what a lost feed left when the next one attaches (rotate)."""
        stores = self._stores_path(number)
        if not stores.is_dir():
            return []
        shipping = self.directory / SHIPPING / stores.name
        shutil.rmtree(shipping, ignore_errors=True)
        for table in sorted(stores.iterdir()):
            link_tree(table, shipping / table.name)
        return [(str(f.relative_to(shipping.parent)), f) for f in sorted(shipping.rglob("*")) if f.is_file()]

    def _stores_path(self, number: int) -> pathlib.Path:
        """The folder of the SSD tables' store copies of base `number` (ssd_tables.place_stores)."""
        return self.directory / f"base-{number:06d}.stores"

    def _take_spare(self, *, largest: bool) -> pathlib.Path:
        """A spare file to write over from its start, the largest (for a log) or the smallest (for a base), or
        a new empty one if none is left."""
        with self._cond:
            if self._spares:
                sizes = {n: self._spare_path(n).stat().st_size for n in self._spares}
                number = (max if largest else min)(self._spares, key=sizes.__getitem__)
                self._spares.remove(number)
                return self._spare_path(number)
            number, self._next_spare = self._next_spare, self._next_spare + 1
            path = self._spare_path(number)
            path.touch()
            return path

    def _retire(self, path: pathlib.Path) -> None:
        """Keeps `path` as a spare, or deletes it if SPARES are kept already."""
        with self._cond:
            if len(self._spares) >= SPARES:
                path.unlink()
                return
            number, self._next_spare = self._next_spare, self._next_spare + 1
            os.replace(path, self._spare_path(number))
            self._spares.append(number)

    def _write_layout(self) -> None:
        """Records the wanted layout as a new job's (a new identity each time)."""
        if self.wanted is not None:
            self.wanted = dataclasses.replace(self.wanted, job=secrets.token_hex(6))
            text = json.dumps(dataclasses.asdict(self.wanted)).encode()
            write_atomic(self.directory / LAYOUT, lambda f: f.write(text), sync=self.sync)
