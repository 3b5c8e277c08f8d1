"""A shard's backup as its primary sees it: when its journal's feed (feed.py) is attached, and the arbiter's
word on going on without it. No gRPC.

A backup (ps-server --replica-of, backup.py) opens a Replicate stream. The
primary compacts its journal with the backup's Feed attached in the same
instant (Recorder.compact_for, Journal.rotate): the feed is handed the new
base first, then every record and rotation the journal's writer writes, in
its order, and every later compaction's base. From that instant on the
journal acknowledges a change only once the backup wrote its record too
(Journal.wait), so every change acknowledged since is on both hosts, and the
base holds every one acknowledged before. Once the backup wrote the base,
the primary tells its arbiter (ps 0; ps 1 for ps 0: cluster.arbiter_of) it
is in sync (IN_SYNC): from then on the arbiter may promote it, once this
primary stopped renewing its lease there (LEASE every LEASE_EVERY_SECONDS,
for as long as the feed is attached): a backup cut off from a primary that
still runs follows it again (replicas.py).

A feed is lost when its stream ends or the backup leaves a record
unacknowledged for `ack_timeout` s. The primary then asks its arbiter to go
on without it (DROP), and until the arbiter answers nothing more is
acknowledged. The arbiter grants it (the journal stops waiting for the
backup) or refuses because it promoted the backup (ReplicaFencedError): the
journal fails, so the shard stops without acknowledging anything the new
primary never saw (fail-stop). While the arbiter cannot be reached the
primary asks again: it never decides alone. A shard that is its own arbiter
(a one-shard job's ps 0: its backup is promoted by hand only) drops a lost
backup at once.

How the journal's records reach the backup (frames, lanes, store files): feed.py.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from typing import Callable

from ..errors import InvalidArgumentError, ModeConflictError, PSError, ReplicaFencedError
from ..proto import ps_pb2
from .checkpoint import write_atomic
from .feed import Feed, Shipped
from .replicas import MAX_COPY_CHARS

__all__ = ["Replication", "Arbiter", "ACK_TIMEOUT_SECONDS", "REPLICATED", "boot_id", "copy_kept", "copy_name",
           "mark_replicated"]

_LOGGER = logging.getLogger(__name__)
ACK_TIMEOUT_SECONDS = 2.0   # a record the backup leaves unacknowledged this long loses it
REPLICATED = "replicated"   # a journal folder's marker: a backup held its base once (it names the host's boot then)
ASK_AGAIN_SECONDS = 0.2     # between asks of the arbiter that could not reach it
LEASE_EVERY_SECONDS = 0.05  # a primary with a backup in sync renews its lease at its arbiter this often
LEASE_CALL_SECONDS = 0.2    # one renewal's deadline (a late one is not asked again: the next is due)
RELEASE_ASK_SECONDS = 2.0   # released(): its ask of the arbiter's record waits at most this
LATE_RENEWAL_SECONDS = 0.3  # renewals heard this far apart are logged (the shard or its arbiter did not run)
Arbiter = Callable[..., dict]  # (action, index, primary, backup[, timeout, changes, copy]) -> the arbiter's record


def boot_id() -> str:
    """This boot of the host's kernel ("" where the kernel does not say)."""
    try:
        return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def mark_replicated(folder: pathlib.Path, sync: bool, copy: bool, name: str = "") -> None:
    """Writes `folder`'s REPLICATED marker: a primary's journal whose backup is about to be in sync, or (`copy`) a
    backup's copy whose base came whole, named `name` (ReplicaHello.copy). It names this boot and whether every
    record is synced before it counts (`sync`: --journal-sync), which copy_kept reads; written whole (a new file
    renamed over the old), synced."""
    text = f"{boot_id()}\n{'synced' if sync else 'cached'}\n{'copy' if copy else 'journal'}\n{name}\n"
    write_atomic(folder / REPLICATED, lambda f: f.write(text.encode()))


def copy_name(folder: pathlib.Path) -> str:
    """The name of the backup's copy in `folder` (its REPLICATED marker's), "" if none is named."""
    try:
        return ((folder / REPLICATED).read_text().splitlines() + ["", "", "", ""])[3]
    except OSError:
        return ""


def copy_kept(folder: pathlib.Path) -> bool:
    """Whether `folder` holds a backup's copy that still has every record that backup acknowledged: its REPLICATED
    marker says a copy's base came whole, written with every record synced before it was acknowledged, or in
    this boot (the page cache still holds what was not on the disk). A primary's journal folder (its marker
    says so) is never such a copy."""
    try:
        boot, synced, kind = ((folder / REPLICATED).read_text().splitlines() + ["", "", ""])[:3]  # (a boot may be "")
    except OSError:
        return False
    return kind == "copy" and (synced == "synced" or (boot != "" and boot == boot_id()))


class Replication:
    """A shard's side of its backups' streams. `journal()` gives the shard's journal (None without one);
    `compact_for(feed)` attaches a feed at a new base (Recorder.compact_for); `arbiter` asks the shard's arbiter for
    a change of its record (the shard's own coordinator where it is its own arbiter; None: it has none to ask,
    and refuses backups); `self_arbitrated`: it is; `me` is the address this shard serves at, as the arbiter
    records it; `lease_seconds`: how long the arbiter holds a lease it heard (saving_refused; 0: no check)."""

    def __init__(self, index: int, me: str, journal: Callable[[], object], compact_for: Callable[[Feed], None],
                 arbiter: Arbiter | None, *, self_arbitrated: bool, chunk_bytes: int,
                 ack_timeout: float = ACK_TIMEOUT_SECONDS, stores: bool = False, lease_seconds: float = 0.0):
        self.index, self.me = index, me
        self._journal, self._compact_for, self._arbiter = journal, compact_for, arbiter
        self._self_arbitrated = self_arbitrated
        self._chunk, self._ack_timeout = chunk_bytes, ack_timeout
        self._stores = stores  # this shard may keep tables on SSD: its backups must keep store copies
        self._lease_seconds = lease_seconds  # the arbiter's window (the job's --failover-after)
        # The feed whose backup the arbiter recorded in sync, and when the last renewal of this shard's lease it
        # heard was sent (monotonic; None: none yet): until then + lease_seconds the backup is not promoted.
        self._lease: tuple[Feed, float | None] | None = None
        self._folder_wait: str | None = None  # why the checkpoint folder is not this shard's yet (hold_saving)
        self.feeds_opened = 0
        # The backup this shard, started on an empty folder, waits for to take over (daemon._await_takeover: the
        # record names it in sync, and it holds what this shard acknowledged); "" if none (GetStatus says it).
        self.awaited_backup = ""
        self.feeds_lost = 0
        self.shipped = Shipped()

    def open(self, hello: ps_pb2.ReplicaHello, lane=None, acks_lane=None) -> Feed:
        """A feed for the backup `hello` names, attached at a new base, its records' bytes on `lane` (the bulk
        lane the hello names, claimed) if given, its acks off `acks_lane` (hello.acks_lane, claimed: taken on
        a thread of the feed's, take_acks) if given. Blocks while the base is written.
        InvalidArgumentError for another shard's backup; ModeConflictError without a journal, with tables on
        SSD (`stores`) for a backup that cannot keep their stores (hello.keeps_stores), or while
        another backup's feed is attached (a lost one is attached until its arbiter dropped it), or without an arbiter to ask."""
        if hello.index != self.index or not hello.address or len(hello.copy) > MAX_COPY_CHARS:
            raise InvalidArgumentError(f"this is ps:{self.index}: a backup of it names index {self.index}, its own "
                                       f"address and its copy (at most {MAX_COPY_CHARS} characters). Received: "
                                       f"index {hello.index}, {hello.address!r}, {hello.copy[:80]!r}")
        if self._stores and not hello.keeps_stores:
            raise ModeConflictError(f"ps:{self.index} may keep embedding tables on SSD (--table-dir): a backup of it "
                                    f"needs --table-dir too, to keep their stores")
        journal = self._journal()
        if journal is None:
            raise ModeConflictError(f"ps:{self.index} keeps no journal (--no-journal): it has nothing to replicate")
        if self._arbiter is None:
            raise ModeConflictError(f"ps:{self.index} was started without the job's cluster (--cluster or "
                                    f"TF_CONFIG): it cannot reach the shard that decides its failovers")
        feed = Feed(hello.address, self._chunk, self._ack_timeout, self._lost, self._based, lane, self.shipped,
                    acks_lane, frames_on_lane=hello.frames_on_lane and not self._stores)
        feed.copy = hello.copy
        try:
            self._compact_for(feed)
        except Exception as exc:
            if journal.following() is feed:  # attached, its base not written: detached as a lost one is
                feed.lose(f"its base could not be written ({exc})")
            raise
        if acks_lane is not None:  # (an ack comes once the base went out, after this returns; a feed never
            # attached is never lost, so its lanes just close with its call)
            threading.Thread(target=feed.take_acks, args=(journal,), name="replica-acks", daemon=True).start()
        self.feeds_opened += 1
        _LOGGER.info("ps %d: backup %s follows from log record %d on%s%s", self.index, hello.address, feed.floor,
                     ", the records wholly on the lane" if feed.frames_on_lane else "",
                     ", its acks on a lane of their own" if acks_lane is not None else "")
        return feed

    def status(self) -> ps_pb2.ReplicationStatus:
        """The attached backup's feed as GetStatus reports it (empty but the counts if none is attached). Does
        not block on the journal's writer."""
        journal = self._journal()
        feed = journal.following() if journal is not None else None
        status = ps_pb2.ReplicationStatus(feeds_opened=self.feeds_opened, feeds_lost=self.feeds_lost,
                                          store_bytes_sent=self.shipped.bytes, store_files_sent=self.shipped.files,
                                          store_files_linked=self.shipped.linked)
        if feed is not None:
            status.backup = feed.address
            status.in_sync, status.lag_records, status.lag_seconds = feed.lag()
        return status

    def hold_saving(self, why: str | None) -> None:
        """Refuses checkpoint writes for `why` (saving_refused) until called with None: a promoted backup whose
        replaced primary still holds its part of the checkpoint folder (daemon._checkpoints_later)."""
        self._folder_wait = why

    def saving_refused(self) -> str | None:
        """Why this shard may not write a checkpoint now, None if it may: not while hold_saving holds it; with a
        backup its arbiter recorded in sync, only while it holds its lease (a renewal the arbiter heard, sent
        within the arbiter's window), and not once that backup was lost until the arbiter dropped it.
        Otherwise the backup may have been promoted meanwhile, and a state this shard saved would miss what the
        new primary acknowledged."""
        if self._folder_wait is not None:
            return self._folder_wait
        journal = self._journal()
        feed = journal.following() if journal is not None else None
        if feed is None or self._self_arbitrated or not self._lease_seconds:
            return None
        if feed.lost is not None:
            return (f"ps {self.index} lost its backup {feed.address} and its arbiter has not let it go on alone yet: "
                    f"it writes no checkpoint until then")
        lease = self._lease
        if lease is not None and lease[0] is feed and (lease[1] is None or
                                                       time.monotonic() - lease[1] >= self._lease_seconds):
            return (f"ps {self.index}'s arbiter has not heard its lease for {self._lease_seconds:g} s, so its backup "
                    f"may serve it now: it writes no checkpoint until the arbiter hears it again")
        return None

    def layout(self) -> bytes:
        """The journal's layout.json, the first frame of a feed."""
        return (self._journal().directory / "layout.json").read_bytes()

    def acked(self, feed: Feed, raw: bytes) -> None:
        """Takes one of the backup's acks (a serialized ReplicaAck). Raises for one that does not parse (the
        stream is broken: the caller loses the feed)."""
        feed.acked(ps_pb2.ReplicaAck.FromString(raw).written, self._journal())

    def _based(self, feed: Feed) -> None:
        threading.Thread(target=self._tell_in_sync, args=(feed,), name="replica-in-sync", daemon=True).start()

    def _tell_in_sync(self, feed: Feed) -> None:
        """(A thread's body, once `feed`'s backup wrote its base.) Has the arbiter record the backup in sync
        (_record_in_sync), then renews this shard's lease while the feed is followed (_renew_lease); should
        the record lose the backup meanwhile (a DROP its last feed asked, decided late), records it again."""
        _LOGGER.info("ps %d: backup %s holds the base: telling its arbiter it is in sync", self.index, feed.address)
        while self._record_in_sync(feed) and not self._self_arbitrated:  # (its own backup: promoted by hand)
            self._lease = (feed, None)
            if not self._renew_lease(feed):
                return
            _LOGGER.warning("ps %d: its arbiter's record lost backup %s, which follows it: telling it again",
                            self.index, feed.address)

    def _record_in_sync(self, feed: Feed) -> bool:
        """Asks IN_SYNC naming the record's count of changes, read once every change it counts is durable and
        before the feed was lost (replicas.py): a DROP asked once it was lost (_drop, another thread) changes
        the count if the arbiter decides it first, so the IN_SYNC then changes nothing. Asks again while
        another change came between the read and the ask and the feed holds. True once recorded."""
        gone = lambda: feed.lost is not None  # noqa: E731
        while True:
            read = self._ask("lease", feed.address, gone, changes=0)  # (a read: `changes` set)
            if read is None:
                return False
            # Set before gone() is looked at: a drop thread that does not see it sees the loss here. From now on a
            # restart drops whatever the record names first (the IN_SYNC asked next may be decided late).
            feed.read_changes = read["changes"]
            feed.in_sync_asked = True  # before gone(): released() either sees it or this sees the loss
            try:
                mark_replicated(self._journal().directory, self._journal().sync, copy=False)
            except OSError as exc:  # (a full disk): no backup in sync, so none is promoted without it
                feed.lose(f"this shard cannot write its {REPLICATED} marker ({exc})")
                feed.in_sync_asked = False
                return False
            if gone():  # (a DROP decided before the read was asked after the loss: it is seen)
                feed.in_sync_asked = False
                return False
            record = self._ask("in_sync", feed.address, gone, changes=read["changes"], copy=feed.copy)
            if record is None:
                return False
            if record["backup"] == feed.address and record.get("copy", "") in ("", feed.copy):  # ("": an arbiter
                return True                                                                  # that names none)
            time.sleep(ASK_AGAIN_SECONDS)

    def _renew_lease(self, feed: Feed) -> bool:
        """Renews this shard's lease at its arbiter every LEASE_EVERY_SECONDS while `feed` is attached (until the
        arbiter dropped it): its backup is promoted only once renewals stopped for the arbiter's window. A
        renewal that fails is not asked again (the next one is due); a refusal (the record names another
        primary) fails the journal: this shard stops, as when a DROP is refused. True if a renewal found the
        record naming no backup, or another, while the feed is followed and not lost (it is recorded again)."""
        due = heard = time.monotonic()
        while True:
            journal = self._journal()
            if journal is None or journal.following() is not feed:
                return False
            sent = time.monotonic()
            try:
                record = self._arbiter("lease", self.index, self.me, feed.address, timeout=LEASE_CALL_SECONDS)
                if record["primary"] == self.me and record["backup"] != feed.address and feed.lost is None \
                        and journal.following() is feed:  # (no primary: a resize removed this shard)
                    return True
                self._lease = (feed, sent)
                now = time.monotonic()
                if now - heard > LATE_RENEWAL_SECONDS:
                    _LOGGER.warning("ps %d: %.2f s between two lease renewals its arbiter heard (this one answered "
                                    "%.2f s after it was due)", self.index, now - heard, now - due)
                heard = now
            except ReplicaFencedError as exc:
                _LOGGER.error("ps %d is fenced: %s", self.index, exc)
                journal.fail(f"the arbiter says this shard no longer serves ps:{self.index}: {exc}")
                return False
            except PSError:
                pass  # the arbiter did not hear it: the next renewal is due
            due = max(due + LEASE_EVERY_SECONDS, time.monotonic())
            time.sleep(max(0.0, due - time.monotonic()))

    def released(self, ask: bool = True, timeout: float | None = None) -> Feed | None:
        """This shard's backup that was lost and is not detached yet, once its arbiter's record, asked now (a
        lease renewal: the record as the arbiter holds it, which promotes no backup it does not name), does
        not name it in sync and never will: its count of changes is past the one the feed's IN_SYNC named, if
        one may be on its way (that IN_SYNC, decided late, then changes nothing). None of this shard's changes
        then waits on it, as none would outlive this shard without it. Any lost one where this shard is its own
        arbiter, or with `ask` False (the arbiter is not asked). None if none is lost, if the record names it or
        may yet, or if the arbiter cannot say. Blocks for that call (RELEASE_ASK_SECONDS at most, and at most
        `timeout`: none is made with nothing left)."""
        journal = self._journal()
        feed = journal.following() if journal is not None else None
        if feed is None or feed.lost is None:
            return None
        if self._self_arbitrated or not ask:
            return feed
        limit = RELEASE_ASK_SECONDS if timeout is None else min(RELEASE_ASK_SECONDS, timeout)
        if limit <= 0:
            return None
        try:  # (attempts of half the limit, retried for the other half: all of it within the limit)
            record = self._arbiter("lease", self.index, self.me, feed.address, timeout=limit / 2)
        except PSError:
            return None
        # (Read after the loss: an IN_SYNC not on its way by now never will be.)
        return feed if record["primary"] == self.me and record["backup"] != feed.address and (
            not feed.in_sync_asked or record["changes"] != feed.read_changes) else None

    def _lost(self, feed: Feed, why: str) -> None:
        journal = self._journal()
        if journal is not None:
            journal.follower_lost(feed)
        self.feeds_lost += 1
        _LOGGER.warning("ps %d: backup %s lost: %s; nothing is acknowledged until its arbiter drops it", self.index,
                        feed.address, why)
        threading.Thread(target=self._drop, args=(feed,), name="replica-drop", daemon=True).start()

    def _drop(self, feed: Feed) -> None:
        journal = self._journal()
        if self._self_arbitrated:  # it decides for itself (a one-shard job's ps 0): promoted by hand only
            journal.detach(feed)
        if self._ask("drop", feed.address, changes=feed.read_changes) is not None:
            journal.detach(feed)
            _LOGGER.warning("ps %d goes on without a backup (its arbiter dropped %s)", self.index, feed.address)

    def drop_stale(self, backup: str) -> bool:
        """(At start, once the arbiter confirmed this shard serves its shard.) No backup follows this shard (it
        restarted): asks the arbiter to drop `backup`, the one its record lists in sync ("": none), before
        anything is acknowledged, as a lost feed's drop does; it names the count read first, so it counts as a
        change even with none in sync and an IN_SYNC the shard asked before it stopped, decided late, changes
        nothing. Blocks until it
        answers; True when granted, False when refused: the backup was promoted meanwhile, and this shard's
        journal failed (it stops)."""
        read = self._ask("lease", backup, changes=0)
        return read is not None and self._ask("drop", backup, changes=read["changes"]) is not None

    def _ask(self, action: str, backup: str, gone: Callable[[], bool] = lambda: False, changes: int | None = None,
             copy: str = "") -> dict | None:
        """Asks the arbiter for `action` about `backup` until it answers (its record of this shard, once it
        decided), or, on no answer, until gone() (None); a refusal fails the journal (this shard is fenced: it
        stops; None)."""
        while True:
            try:
                return self._arbiter(action, self.index, self.me, backup, changes=changes, copy=copy)
            except ReplicaFencedError as exc:
                _LOGGER.error("ps %d is fenced: %s", self.index, exc)
                self._journal().fail(f"the arbiter says this shard no longer serves ps:{self.index}: {exc}")
                return None
            except PSError as exc:
                if gone():
                    return None  # lost meanwhile: its drop settles it
                _LOGGER.warning("ps %d: its arbiter did not answer %s of backup %s (%s); asking again", self.index,
                                action, backup, exc)
                time.sleep(ASK_AGAIN_SECONDS)
