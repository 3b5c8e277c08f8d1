"""A backup's copy of its primary's journal (feed.Feed's frames, written by mirror.Mirror) recovers to the
same records and state as the primary's own journal: tensors of any length (not multiples of 8 bytes), records
cut into pieces, rotations and a later compaction's base. No gRPC, no processes."""

import socket
import threading
import time

import numpy as np
import pytest
import torch

from torchps.errors import LaneBrokenError, MalformedStreamError, ServerUnavailableError, WaitTimeoutError
from torchps.lanes import Lane
from torchps.proto import ps_pb2
from torchps.ps_server import journal_log, replication
from torchps.ps_server.mirror import Mirror
from torchps.ps_server.journal import Journal
from torchps.ps_server.feed import ACK_BYTES, IDLE_WAKE_SECONDS, NOTHING_YET, OFF_LOOP, ON_LOOP, Feed
from torchps.ps_server.replication import copy_kept, copy_name, mark_replicated

ODD = {"w": torch.arange(7, dtype=torch.float32), "b": torch.tensor([1.5], dtype=torch.float64),
       "ids": torch.arange(5, dtype=torch.int8), "empty": torch.zeros(0)}


def _feed(lane=None, acks_lane=None) -> tuple[Feed, list]:
    lost = []
    return Feed("b:1", chunk_bytes=12, ack_timeout=60, on_lost=lambda feed, why: lost.append(why),
                on_based=lambda feed: None, lane=lane, acks_lane=acks_lane), lost


def _frames(feed: Feed, layout: bytes):
    """Feed.pieces as a blocking stream, woken as replica_rpcs._pump is: where nothing is queued it waits for
    on_queued (IDLE_WAKE_SECONDS at most, then a heartbeat comes); it reads files where it is."""
    queued = threading.Event()
    feed.on_queued = queued.set
    for piece in feed.pieces(layout):
        if piece is NOTHING_YET:
            queued.wait(IDLE_WAKE_SECONDS)
            queued.clear()  # before pieces looks at the queue again
        elif piece is not OFF_LOOP and piece is not ON_LOOP:
            yield piece


def _records(journal: Journal):
    base, records = journal.recover()
    return base, [(r.kind, r.meta, {n: t.clone() for n, t in r.tensors.items()}) for r in records]


def _copy(feed: Feed, folder, lane=None, seen: list | None = None) -> list[int]:
    """Writes what `feed` has queued into a Mirror at `folder` (a backup's stream, without the stream; its lane's
    end `lane`); returns the bases' acknowledgements. `seen`: gets every frame."""
    mirror = Mirror(folder, sync=False, lane=lane)
    acked = []
    for raw in _frames(feed, b'{"index": 1, "num_ps": 2, "origin": null, "job": "j"}'):
        frame = ps_pb2.ReplicaFrame.FromString(raw)
        if seen is not None:
            seen.append(frame)
        if frame.kind == ps_pb2.ReplicaFrame.HEARTBEAT:  # nothing more queued
            break
        based = mirror.take(frame)
        if based is not None:
            acked.append(based)
    mirror.journal.wait(timeout=10)
    mirror.close()
    return acked


def _offered(feed: Feed, count: int) -> None:
    """Waits (10 s at most) until `feed` holds `count` records (and bases) not acknowledged: the journal's
    writer offers a record as it writes it."""
    deadline = time.monotonic() + 10
    while feed.lag()[1] < count:
        assert time.monotonic() < deadline, f"the journal's writer did not offer {count} records"
        time.sleep(0.001)


def _compact(journal: Journal, feed: Feed, state: dict, attach: bool = False) -> None:
    """A compaction as Recorder._compact makes it: rotation (attaching `feed`), base, the base handed over."""
    number = journal.rotate(follower=feed if attach else None)
    journal.finish_compaction(number, journal.write_base(number, state))
    feed.offer_base(number, *journal_log.encode("base", {}, journal_log.state_record(state)))()  # sent: let go


def _same(copy_folder, primary_folder) -> dict:
    (copy_base, copy_records), (base, records) = (_records(Journal(f)) for f in (copy_folder, primary_folder))
    assert copy_base["step"] == base["step"] and torch.equal(copy_base["variables"]["w"], base["variables"]["w"])
    assert [(kind, meta) for kind, meta, _ in copy_records] == [(kind, meta) for kind, meta, _ in records]
    for (_, _, mine), (_, _, theirs) in zip(copy_records, records):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
    return copy_base


def _copying(tmp_path, ends=(None, None), sync: bool = False):
    """A primary's journal with a feed attached at its base of step 1 (its lane's ends `ends`), and a Mirror that
    took that base: (primary, feed, its losses, mirror, the feed's frames)."""
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    feed, lost = _feed(ends[0])
    _compact(primary, feed, {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}, attach=True)
    mirror = Mirror(tmp_path / "copy", sync=sync, lane=ends[1])
    stream = _frames(feed, b'{"index": 1, "num_ps": 2, "origin": null, "job": "j"}')
    while mirror.take(ps_pb2.ReplicaFrame.FromString(next(stream))) is None:  # up to the base, acknowledged
        pass
    return primary, feed, lost, mirror, stream


@pytest.mark.parametrize("on_a_lane", [False, True])
def test_a_copy_recovers_the_primarys_records_of_any_length(tmp_path, on_a_lane):
    """The records' bytes in the frames, or on a bulk lane (a socket pair here) once the backup took the base:
    records written before that go in the frames."""
    ends = [Lane(sock, b"k" * 16) for sock in socket.socketpair()] if on_a_lane else [None, None]
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    feed, lost = _feed(ends[0])
    _compact(primary, feed, {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}, attach=True)
    primary.append("apply", {"i": -1}, ODD)  # before the base went out: in the frames
    _offered(feed, 2)  # the base and that record
    mirror = Mirror(tmp_path / "copy", sync=False, lane=ends[1])
    stream = _frames(feed, b'{"index": 1, "num_ps": 2, "origin": null, "job": "j"}')
    taken = []
    while True:  # the base, and the record queued behind it
        frame = ps_pb2.ReplicaFrame.FromString(next(stream))
        taken.append(frame)
        if mirror.take(frame) is not None:
            break
    for i in range(3):  # after it: on the lane, if there is one
        primary.append("apply", {"i": i}, {name: t + i for name, t in ODD.items()})
    primary.acked(feed, 10**9)
    primary.wait(timeout=10)  # all three offered (the writer offers a record before it counts it written)
    while (frame := ps_pb2.ReplicaFrame.FromString(next(stream))).kind != ps_pb2.ReplicaFrame.HEARTBEAT:
        taken.append(frame)
        mirror.take(frame)
    mirror.journal.wait(timeout=10)
    mirror.close()
    assert not lost
    records = [f for f in taken if f.kind == ps_pb2.ReplicaFrame.RECORD and f.last]
    assert len(records) == 4 and not records[0].lane_bytes
    assert all(bool(f.lane_bytes) == on_a_lane for f in records[1:])
    primary.close()
    assert _same(tmp_path / "copy", tmp_path / "primary")["step"] == 1


def test_a_copy_follows_rotations_and_later_bases(tmp_path):
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    feed, lost = _feed()
    _compact(primary, feed, {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}, attach=True)
    primary.append("apply", {"i": 0}, ODD)
    _compact(primary, feed, {"step": 5, "variables": {"w": torch.full((3,), 9.0)}})
    primary.append("member", {"worker": "w"}, {})
    primary.append("apply", {"i": 9}, {"w": torch.arange(3, dtype=torch.float32)})
    primary.acked(feed, 10**9)
    primary.wait(timeout=10)
    _copy(feed, tmp_path / "copy")
    primary.close()
    assert not lost and _same(tmp_path / "copy", tmp_path / "primary")["step"] == 5


def test_a_copy_is_kept_for_a_restart_within_the_boot_it_was_written_in_or_synced(tmp_path, monkeypatch):
    """replication.copy_kept, which lets a backup restarted on its folder ask to take over from the copy there:
    its base came whole (the marker, written after it, says it is a copy and names the boot), and either the
    host has not restarted since (the page cache still holds what was acknowledged) or the copy's writer synced
    every record first (--journal-sync then, whatever the reader's flags). A primary's journal folder, and a
    folder without a copy, are not kept."""
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    feed, _ = _feed()
    _compact(primary, feed, {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}, attach=True)
    primary.close()
    assert not copy_kept(tmp_path / "copy"), "no copy yet"
    _copy(feed, tmp_path / "copy")  # written without --journal-sync
    assert copy_kept(tmp_path / "copy")
    mark_replicated(tmp_path / "primary", sync=True, copy=False)  # a primary's, about to have a backup in sync
    assert not copy_kept(tmp_path / "primary"), "a primary's journal is no backup's copy"
    (tmp_path / "synced").mkdir()
    mark_replicated(tmp_path / "synced", sync=True, copy=True, name="c0ffee")
    assert copy_name(tmp_path / "synced") == "c0ffee" and copy_name(tmp_path / "primary") == ""
    assert copy_name(tmp_path / "none") == ""
    monkeypatch.setattr(replication, "boot_id", lambda: "another boot")  # the host restarted since
    assert not copy_kept(tmp_path / "copy"), "its unsynced records may be gone with the page cache"
    assert copy_kept(tmp_path / "synced")
    monkeypatch.setattr(replication, "boot_id", lambda: "")  # a kernel that names no boot: its line is empty
    mark_replicated(tmp_path / "synced", sync=True, copy=True, name="feed")
    assert copy_kept(tmp_path / "synced") and copy_name(tmp_path / "synced") == "feed"


def test_compactions_go_on_after_a_backup_was_attached_from_a_thread_that_lives_on(tmp_path):
    """Recorder.compact_for runs on the caller's thread (a shard's pool thread, which lives on): once it returns,
    the journal compacts again as its log grows."""
    from torchps.ps_server.coordinator import Coordinator
    from torchps.ps_server.server import recover
    from torchps.ps_server.store import VariableStore

    coordinator = Coordinator(VariableStore(), owns_step=True, start=False)
    journal = Journal(tmp_path / "j", compact_factor=0, min_compact_bytes=1)
    recover(coordinator, journal, None)
    feed, _ = _feed()
    coordinator.recorder.compact_for(feed)  # on this thread, alive after it
    journal.detach(feed)
    number = journal._number
    coordinator.recorder.log("member", {"worker": "w", "incarnation": 1, "join": True}, {})
    coordinator.recorder.wait_for_compaction(timeout=30)
    assert journal._number > number, "a compaction after the backup's"
    journal.close()


def _ssd_table(tmp_path):
    from torchps.ps_server.disk_rows import DiskMemory
    from torchps.ps_server.ssd_tables import CacheBudget, SsdTable

    return SsdTable(4, folder=tmp_path / "table", memory=DiskMemory(1 << 20, 1 << 20), budget=CacheBudget(4096),
                    optimizer="sgd", hyperparams={"lr": 1.0})


def test_a_copy_holds_each_bases_store_copies_beside_it_and_drops_older_ones(tmp_path):
    """A base of a shard keeping a table on SSD: its store copy's files come first (FILE frames, in pieces of
    12 bytes here) and the copy's base names them under its own folder, byte for byte the primary's; a later
    base's replace them, the table files it shares with the last one linked there, not sent again. The first
    base's files are read after the second compaction retired them: the feed's links keep them."""
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    feed, lost = _feed()
    table = _ssd_table(tmp_path)
    for step, attach in ((1, True), (2, False)):
        ids = torch.arange(50 * step)
        table.lookup(ids)
        table.apply(ids, torch.full((len(ids), 4), float(step)), step)
        state = {"step": step, "variables": {"w": torch.full((3,), float(step))},
                 "tables": [{"name": "dyn", "state": table.state_dict()}]}
        number = primary.rotate(follower=feed if attach else None)
        primary.finish_compaction(number, primary.write_base(number, state))
        feed.offer_base(number, *journal_log.encode("base", {}, journal_log.state_record(state)),
                        files=primary.base_files(number))
        primary.append("apply", {"i": step}, ODD)
    table.close()
    primary.acked(feed, 10**9)
    primary.wait(timeout=10)
    frames: list = []
    _copy(feed, tmp_path / "copy", seen=frames)
    primary.close()
    assert not lost and _same(tmp_path / "copy", tmp_path / "primary")["step"] == 2
    base, _ = Journal(tmp_path / "copy").recover()
    store = base["tables"][0]["state"]["store"]["path"]
    assert store.startswith(str(tmp_path / "copy" / "base-")) and (tmp_path / "copy" / store).is_dir()
    theirs = {f.relative_to(tmp_path / "primary"): f.read_bytes()
              for f in (tmp_path / "primary").glob("base-*.stores/**/*") if f.is_file()}
    mine = {f.relative_to(tmp_path / "copy"): f.read_bytes()
            for f in (tmp_path / "copy").glob("base-*.stores/**/*") if f.is_file()}
    assert theirs and mine == theirs  # the older base's copies are gone on both sides
    assert len({p.parts[0] for p in mine}) == 1
    assert not [f for f in (tmp_path / "primary" / ".shipping").rglob("*") if f.is_file()]  # each removed once sent
    files = [f for f in frames if f.kind == ps_pb2.ReplicaFrame.FILE]
    linked = {f.path for f in files if f.same_as}
    sent = {f.path for f in files if not f.same_as}
    assert linked and all(p.endswith(".sst") and p.startswith("base-000002") for p in linked)
    assert {p for p in sent if p.endswith(".sst") and p.startswith("base-000002")}, "its new table file was sent"


@pytest.mark.parametrize("path", ["../escape", "base-1.stores/../../x", "other/file", "base-1.stores"])
def test_a_file_outside_a_bases_store_copies_is_refused(tmp_path, path):
    mirror = Mirror(tmp_path / "copy", sync=False)
    frame = ps_pb2.ReplicaFrame(kind=ps_pb2.ReplicaFrame.FILE, path=path, data=b"x", last=True)
    with pytest.raises(MalformedStreamError, match="outside a base's store copies"):
        mirror.take(frame)
    mirror.close()
    assert not any(tmp_path.rglob("x")) and not (tmp_path / "escape").exists()


def test_records_pass_a_later_bases_store_files_and_never_the_first_base(tmp_path):
    """A record written while a later base's store file streams (in pieces of 12 bytes here) goes between the
    file's pieces, before that base; one written before the first base went out follows it."""
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    feed, lost = _feed()
    _compact(primary, feed, {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}, attach=True)
    primary.append("apply", {"i": 0}, ODD)
    stream = _frames(feed, b'{"index": 1, "num_ps": 2, "origin": null, "job": "j"}')
    mirror = Mirror(tmp_path / "copy", sync=False)
    kinds = []

    def pump(until) -> None:
        while True:
            frame = ps_pb2.ReplicaFrame.FromString(next(stream))
            kinds.append(frame.kind)
            mirror.take(frame)
            if until(frame):
                return

    pump(lambda f: f.kind == ps_pb2.ReplicaFrame.RECORD and f.last)  # the first base, then that record
    assert kinds.index(ps_pb2.ReplicaFrame.BASE) < kinds.index(ps_pb2.ReplicaFrame.RECORD)
    number = primary.rotate()
    state = {"step": 5, "variables": {"w": torch.full((3,), 9.0)}}
    primary.finish_compaction(number, primary.write_base(number, state))
    table_file = tmp_path / "primary" / ".shipping" / f"base-{number:06d}.stores" / "t-0" / "000009.sst"
    table_file.parent.mkdir(parents=True)
    table_file.write_bytes(bytes(range(256)) * 8)  # 171 pieces
    feed.offer_base(number, *journal_log.encode("base", {}, journal_log.state_record(state)),
                    files=[(f"base-{number:06d}.stores/t-0/000009.sst", table_file)])
    pump(lambda f: f.kind == ps_pb2.ReplicaFrame.FILE)  # the file's first piece went out
    offered = feed.lag()[1]
    primary.append("apply", {"i": 1}, {"w": torch.arange(3, dtype=torch.float32)})
    _offered(feed, offered + 1)
    primary.acked(feed, 10**9)
    pump(lambda f: f.kind == ps_pb2.ReplicaFrame.BASE and f.last)
    later = kinds[kinds.index(ps_pb2.ReplicaFrame.FILE):]
    passed = later.index(ps_pb2.ReplicaFrame.RECORD)
    assert ps_pb2.ReplicaFrame.FILE in later[passed:], "the record went between the file's pieces"
    primary.wait(timeout=10)
    mirror.journal.wait(timeout=10)
    mirror.close()
    primary.close()
    assert not lost and _same(tmp_path / "copy", tmp_path / "primary")["step"] == 5
    assert (tmp_path / "copy" / f"base-{number:06d}.stores" / "t-0" / "000009.sst").read_bytes() == \
        bytes(range(256)) * 8
    assert not table_file.exists() and not table_file.parent.exists()  # the feed's link and folder, once sent


def test_a_stream_ended_mid_file_lets_the_files_links_go(tmp_path):
    """The stream is abandoned (a cancelled call) while a base's store file streams: that file's link and the
    links of the files behind it are removed, and the feed, once lost, holds none."""
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    feed, _ = _feed()
    number = primary.rotate(follower=feed)
    state = {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}
    primary.finish_compaction(number, primary.write_base(number, state))
    shipping = tmp_path / "primary" / ".shipping" / f"base-{number:06d}.stores" / "t-0"
    shipping.mkdir(parents=True)
    files = []
    for name in ("000001.sst", "000002.sst", "MANIFEST-000003"):
        (shipping / name).write_bytes(b"x" * 100)
        files.append((f"base-{number:06d}.stores/t-0/{name}", shipping / name))
    feed.offer_base(number, *journal_log.encode("base", {}, journal_log.state_record(state)), files=files)
    stream = _frames(feed, b"{}")
    next(stream)  # LAYOUT
    assert ps_pb2.ReplicaFrame.FromString(next(stream)).kind == ps_pb2.ReplicaFrame.FILE
    stream.close()  # as gRPC leaves a cancelled call's generator
    feed.lose("its stream ended")
    primary.close()
    assert not (tmp_path / "primary" / ".shipping" / f"base-{number:06d}.stores").exists()


def _primary_replication(tmp_path):
    """(a primary's journal, started; its Replication of ps:1, whose arbiter only notes what it is asked; that
    list of (action, backup))."""
    from torchps.ps_server.replication import Replication

    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    asked = []
    replication = Replication(1, "p:1", lambda: primary, lambda feed: primary.rotate(follower=feed),
                              lambda action, index, me, backup, **_: asked.append((action, backup)) or {},
                              self_arbitrated=False, chunk_bytes=1 << 20)
    return primary, replication, asked


def test_a_backup_refused_while_another_follows_is_not_counted_lost_nor_dropped(tmp_path):
    """Replication.open while another backup's feed is attached: refused (ModeConflictError), and the refused
    one is neither counted lost nor asked to be dropped at the arbiter (which would drop it later, once it
    followed)."""
    from torchps.errors import ModeConflictError

    primary, replication, asked = _primary_replication(tmp_path)
    first = replication.open(ps_pb2.ReplicaHello(index=1, address="b:1"))
    with pytest.raises(ModeConflictError, match="one at a time"):
        replication.open(ps_pb2.ReplicaHello(index=1, address="b:2"))
    assert replication.feeds_lost == 0 and primary.following() is first and asked == []
    first.lose("test over")
    primary.close()


def test_a_hello_naming_a_copy_too_long_is_refused_and_attaches_nothing(tmp_path):
    """Replication.open of a hello whose copy's name is over MAX_COPY_CHARS: InvalidArgumentError, nothing
    attached, no arbiter asked; the same hello with a name of that length attaches, the feed carrying it."""
    from torchps.errors import InvalidArgumentError
    from torchps.ps_server.replicas import MAX_COPY_CHARS

    primary, replication, asked = _primary_replication(tmp_path)
    with pytest.raises(InvalidArgumentError, match="copy"):
        replication.open(ps_pb2.ReplicaHello(index=1, address="b:1", copy="c" * (MAX_COPY_CHARS + 1)))
    assert primary.following() is None and asked == []
    feed = replication.open(ps_pb2.ReplicaHello(index=1, address="b:1", copy="c" * MAX_COPY_CHARS))
    assert primary.following() is feed and feed.copy == "c" * MAX_COPY_CHARS
    feed.lose("test over")
    primary.close()


def test_pieces_say_where_nothing_is_queued_and_before_a_file_and_the_feed_calls_on_queued(tmp_path):
    """Feed.pieces, the stream as the event loop drives it (replica_rpcs._pump): NOTHING_YET where nothing is
    queued, after which a record offered meanwhile comes; OFF_LOOP before a store file is read, ON_LOOP after
    it; on_queued is called for a record, a base and the feed's loss."""
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    feed, _ = _feed()
    woken = []
    feed.on_queued = lambda: woken.append(feed.lag()[1])
    number = primary.rotate(follower=feed)
    state = {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}
    primary.finish_compaction(number, primary.write_base(number, state))
    feed.offer_base(number, *journal_log.encode("base", {}, journal_log.state_record(state)))
    assert woken, "a base offered did not call on_queued"
    pieces = feed.pieces(b"{}")
    kinds = [ps_pb2.ReplicaFrame.FromString(next(pieces)).kind]
    while (piece := next(pieces)) is not NOTHING_YET:
        kinds.append(ps_pb2.ReplicaFrame.FromString(piece).kind)
    assert kinds[0] == ps_pb2.ReplicaFrame.LAYOUT and kinds[-1] == ps_pb2.ReplicaFrame.BASE
    calls = len(woken)
    primary.append("push", {"seq": 1}, {"w": torch.ones(3)})
    _offered(feed, 2)  # the base, unacknowledged, and the record
    assert len(woken) > calls, "a record offered did not call on_queued"
    record = []
    while (piece := next(pieces)) is not NOTHING_YET:  # the record's frames (12 bytes each at most)
        record.append(ps_pb2.ReplicaFrame.FromString(piece))
    assert record and {frame.kind for frame in record} == {ps_pb2.ReplicaFrame.RECORD} and record[-1].last
    shipping = tmp_path / "primary" / ".shipping" / "base-000009.stores" / "t-0"
    shipping.mkdir(parents=True)
    (shipping / "000001.sst").write_bytes(b"x" * 30)
    calls = len(woken)
    feed.offer_base(9, *journal_log.encode("base", {}, journal_log.state_record(state)),
                    files=[("base-000009.stores/t-0/000001.sst", shipping / "000001.sst")])
    assert len(woken) > calls
    assert next(pieces) is OFF_LOOP
    file = []
    while (piece := next(pieces)) is not ON_LOOP:  # the file's pieces (12 bytes each at most)
        file.append(ps_pb2.ReplicaFrame.FromString(piece))
    assert [frame.kind for frame in file] == [ps_pb2.ReplicaFrame.FILE] * 3 and file[-1].last
    calls = len(woken)
    feed.lose("its stream ended")
    assert len(woken) > calls, "the feed's loss did not call on_queued"
    assert list(pieces) == []
    primary.close()


def test_a_later_base_and_records_of_many_pieces_go_on_the_lane_and_the_copy_recovers_them(tmp_path):
    """Once the first base went out (in the frames), a later compaction's base goes on the lane too, and a
    record's bytes are written into the copy's log as they come, a PIECE at a time (a tensor of 3 pieces and
    a few bytes here)."""
    ends = [Lane(sock, b"k" * 16) for sock in socket.socketpair()]
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    feed, lost = _feed(ends[0])
    _compact(primary, feed, {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}, attach=True)
    stream = _frames(feed, b'{"index": 1, "num_ps": 2, "origin": null, "job": "j"}')
    mirror = Mirror(tmp_path / "copy", sync=False, lane=ends[1])
    taken, done = [], threading.Event()

    def read() -> None:  # the backup's stream thread: the lane's bytes come while the primary sends them
        for raw in stream:
            frame = ps_pb2.ReplicaFrame.FromString(raw)
            if done.is_set():
                return
            if frame.kind != ps_pb2.ReplicaFrame.HEARTBEAT:
                taken.append(frame)
                mirror.take(frame)

    reader = threading.Thread(target=read, daemon=True)
    big = {"big": torch.arange(3 * journal_log.PIECE // 4 + 3, dtype=torch.float32), "b": ODD["b"]}
    reader.start()
    _wait_for(lambda: any(f.kind == ps_pb2.ReplicaFrame.BASE for f in taken), "the first base")
    primary.append("apply", {"i": 0}, big)
    _compact(primary, feed, {"step": 7, "variables": {"w": torch.full((3,), 9.0)}})
    primary.append("apply", {"i": 1}, {name: t + 1 for name, t in big.items()})
    primary.acked(feed, 10**9)
    primary.wait(timeout=10)
    _wait_for(lambda: sum(f.kind == ps_pb2.ReplicaFrame.RECORD for f in taken) == 2, "both records")
    mirror.journal.wait(timeout=10)
    done.set()
    reader.join(timeout=10)
    mirror.close()
    primary.close()
    bases = [f for f in taken if f.kind == ps_pb2.ReplicaFrame.BASE and f.last]  # the first in pieces of 12 bytes
    records = [f for f in taken if f.kind == ps_pb2.ReplicaFrame.RECORD]
    assert len(bases) == 2 and not bases[0].lane_bytes and bases[1].lane_bytes and bases[1].last
    assert [r.lane_bytes for r in records] == [big["big"].nbytes + 8] * 2
    assert not lost and _same(tmp_path / "copy", tmp_path / "primary")["step"] == 7


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not come"
        time.sleep(0.001)


def test_a_record_whose_lane_bytes_stop_coming_is_not_in_the_copy_and_the_records_before_it_are(tmp_path):
    """The lane breaks within a record's bytes (after more than a PIECE of them): take() raises, the copy's
    journal fails (the writer had begun the record), and the copy recovers to the base and the records
    before it, as a log cut short by a crash."""
    from torchps.errors import LaneBrokenError, ServerUnavailableError
    from torchps.lanes import FRAME_MAGIC, _FRAME as LANE_FRAME

    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    feed, _ = _feed()
    _compact(primary, feed, {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}, attach=True)
    primary.append("apply", {"i": 0}, ODD)  # in the frames: no lane on this feed
    _offered(feed, 2)
    primary.close()
    sender, receiver = socket.socketpair()
    mirror = Mirror(tmp_path / "copy", sync=False, lane=Lane(receiver, b"k" * 16))
    for raw in _frames(feed, b'{"index": 1, "num_ps": 2, "origin": null, "job": "j"}'):
        frame = ps_pb2.ReplicaFrame.FromString(raw)
        if frame.kind == ps_pb2.ReplicaFrame.HEARTBEAT:
            break
        mirror.take(frame)
    head, views = journal_log.encode("apply", {"i": 1}, {"w": torch.ones(3 * journal_log.PIECE // 4)})
    nbytes = sum(len(memoryview(v).cast("B")) for v in views)
    part = journal_log.PIECE + journal_log.PIECE // 2
    cut = threading.Thread(target=lambda: (sender.sendall(LANE_FRAME.pack(FRAME_MAGIC, 0, nbytes)),
                                           sender.sendall(memoryview(views[0]).cast("B")[:part]), sender.close()))
    cut.start()
    with pytest.raises(LaneBrokenError, match="closed"):
        mirror.take(ps_pb2.ReplicaFrame(kind=ps_pb2.ReplicaFrame.RECORD, written=3, head=head, last=True,
                                        lane_bytes=nbytes))
    cut.join(timeout=10)
    with pytest.raises(ServerUnavailableError, match="stopped coming on the bulk lane after"):
        mirror.journal.wait(timeout=10)
    mirror.close()
    base, records = _records(Journal(tmp_path / "copy"))
    assert base["step"] == 1 and [(kind, meta) for kind, meta, _ in records] == [("apply", {"i": 0})]


def test_a_later_base_slower_than_the_ack_timeout_on_the_lane_keeps_the_feed(tmp_path):
    """A base's lane bytes may take longer than the ack timeout (1 s here) as long as they keep coming (a
    backup reading them a MiB every 0.1 s), and the record queued behind them counts its wait from their end;
    the feed is not lost, and the copy recovers both."""
    import queue as queues

    ends = [Lane(sock, b"k" * 16) for sock in socket.socketpair()]
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    lost = []
    feed = Feed("b:1", chunk_bytes=1 << 20, ack_timeout=1.0, on_lost=lambda feed, why: lost.append(why),
                on_based=lambda feed: None, lane=ends[0])
    _compact(primary, feed, {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}, attach=True)
    frames: queues.Queue = queues.Queue()
    done = threading.Event()

    def primary_loop() -> None:  # the primary's side of the stream: pieces, with its overdue check
        for raw in _frames(feed, b'{"index": 1, "num_ps": 2, "origin": null, "job": "j"}'):
            if done.is_set():
                return
            frames.put(ps_pb2.ReplicaFrame.FromString(raw))

    def next_frame() -> ps_pb2.ReplicaFrame:
        while (frame := frames.get(timeout=10)).kind == ps_pb2.ReplicaFrame.HEARTBEAT:
            pass
        return frame

    threading.Thread(target=primary_loop, daemon=True).start()
    mirror = Mirror(tmp_path / "copy", sync=False, lane=ends[1])
    while mirror.take(next_frame()) is None:  # the first base, in frames
        pass
    feed.acked(feed.floor, primary)  # the first base is written
    state = {"step": 7, "variables": {"w": torch.arange(4 << 20, dtype=torch.float32)}}  # 16 MiB
    compaction = threading.Thread(target=_compact, args=(primary, feed, state))
    compaction.start()
    while (base := next_frame()).kind != ps_pb2.ReplicaFrame.BASE:
        mirror.take(base)  # the new log's ROTATE
    assert base.lane_bytes > 16 << 20
    primary.append("apply", {"i": 1}, ODD)  # its bytes wait behind the base's on the lane
    started = time.monotonic()
    buffer = np.empty(base.lane_bytes, dtype=np.uint8)
    ends[1].begin(base.lane_bytes, 30)
    for at in range(0, len(buffer), 1 << 20):  # a slow link: the sender waits on a full socket between reads
        ends[1].read_into(memoryview(buffer)[at:at + (1 << 20)])
        time.sleep(0.1)
    assert time.monotonic() - started > 1.0 and not lost
    mirror.journal.finish_compaction(base.number, mirror.journal.write_encoded_base(
        base.number, base.head, journal_log.split(base.head, buffer)))  # as Mirror.take writes it
    record = next_frame()
    assert record.kind == ps_pb2.ReplicaFrame.RECORD and record.lane_bytes
    mirror.take(record)
    compaction.join(timeout=10)
    mirror.journal.wait(timeout=10)
    feed.acked(record.written, primary)
    primary.wait(timeout=10)
    done.set()
    assert not lost
    mirror.close()
    primary.close()
    assert _same(tmp_path / "copy", tmp_path / "primary")["step"] == 7


def test_a_stream_that_ends_wakes_the_acknowledger_waiting_for_a_record(tmp_path):
    """Backup._follow_once joins its acknowledger before a promotion: end() releases a written() that waits for
    a record (it waited out its whole timeout before, 0.1 s of every failover), and every written() after it."""
    mirror = Mirror(tmp_path / "copy", sync=False)
    waiting, got = threading.Event(), []

    def acknowledger() -> None:
        waiting.set()
        got.append(mirror.written(timeout=600))

    thread = threading.Thread(target=acknowledger, daemon=True)
    thread.start()
    waiting.wait(10)
    mirror.end()
    thread.join(60)  # far less than its timeout: it was woken
    assert not thread.is_alive() and got == [None]
    assert mirror.written(timeout=600) is None
    mirror.close()


@pytest.mark.parametrize("sync", [False, True])
def test_a_record_of_one_piece_is_written_by_the_stream_and_acknowledged_at_once_unless_synced(tmp_path, sync):
    """Mirror.take writes a record whose bytes come in one piece (journal_log.PIECE) on the stream's thread and
    returns the primary's number for it, written: no trip to the journal's writer and on to the acknowledger. A
    record of more pieces on the lane is written by the writer as its bytes come, and a synced copy leaves
    every record to the writer's group commit: take returns None for those, and written() acknowledges them."""
    primary, feed, lost, mirror, stream = _copying(
        tmp_path, [Lane(sock, b"k" * 16) for sock in socket.socketpair()], sync=sync)
    big = torch.arange(journal_log.PIECE // 4 + 3, dtype=torch.float32)
    for i, tensors in enumerate(({"w": torch.full((3,), 5.0)}, {"big": big}, ODD)):
        primary.append("apply", {"i": i}, tensors)
    answers = []  # the writer offers the third record once the second's bytes were read off the lane
    while len(answers) < 3:
        frame = ps_pb2.ReplicaFrame.FromString(next(stream))
        answer = mirror.take(frame)
        if frame.kind == ps_pb2.ReplicaFrame.RECORD and frame.last:
            one_piece = frame.lane_bytes <= journal_log.PIECE
            answers.append((frame.written, answer, one_piece))
            if answer is not None:
                mirror.journal.wait(timeout=0)  # written before take returned: nothing is left to wait for
    assert [one_piece for _, _, one_piece in answers] == [True, False, True]
    if sync:
        assert all(answer is None for _, answer, _ in answers)
        assert mirror.written(timeout=10) == answers[-1][0]
    else:
        assert [answer for _, answer, _ in answers] == [answers[0][0], None, answers[2][0]]
    mirror.journal.wait(timeout=10)
    mirror.close()
    primary.acked(feed, 10**9)
    primary.wait(timeout=10)
    primary.close()
    assert not lost and _same(tmp_path / "copy", tmp_path / "primary")["step"] == 1


def test_a_record_the_copy_cannot_write_ends_its_stream_unacknowledged(tmp_path):
    """A backup whose disk is full (the copy's next log is /dev/full): the record its stream writes fails, and
    take raises MalformedStreamError, as a failure of the journal's writer ends the stream (the backup follows
    again from a new base); the record is acknowledged to no one."""
    primary, feed, lost, mirror, stream = _copying(tmp_path)
    (log,) = (tmp_path / "copy").glob("log-*.bin")
    (tmp_path / "copy" / f"log-{int(log.stem.split('-')[1]) + 1:06d}.bin").symlink_to("/dev/full")
    _compact(primary, feed, {"step": 2, "variables": {"w": torch.full((3,), 3.0)}})  # the copy's next log
    primary.append("apply", {"i": 0}, ODD)
    taken = []  # the kinds of the frames taken: a heartbeat may come first on a loaded machine, not after the record
    with pytest.raises(MalformedStreamError, match="No space left on device") as info:
        while True:
            frame = ps_pb2.ReplicaFrame.FromString(next(stream))
            assert not (frame.kind == ps_pb2.ReplicaFrame.HEARTBEAT and ps_pb2.ReplicaFrame.RECORD in taken), \
                "the record was written"
            taken.append(frame.kind)
            assert mirror.take(frame) is None
    assert "retry" not in str(info.value), "what failed, not the journal's advice to a client"
    assert mirror.written(timeout=0) is None
    mirror.close()
    primary.close()
    assert not lost


def test_a_copy_whose_writer_failed_ends_its_stream_naming_the_write_not_advice_to_clients(tmp_path):
    """A record of more than one piece is written by the copy's journal writer: on a full disk the writer fails,
    and the next record's take raises MalformedStreamError naming that write (the journal's own raise tells a
    client to retry elsewhere, which the backup's log should not say)."""
    ends = [Lane(sock, b"k" * 16) for sock in socket.socketpair()]
    primary, feed, lost, mirror, stream = _copying(tmp_path, ends)
    (log,) = (tmp_path / "copy").glob("log-*.bin")
    (tmp_path / "copy" / f"log-{int(log.stem.split('-')[1]) + 1:06d}.bin").symlink_to("/dev/full")
    _compact(primary, feed, {"step": 2, "variables": {"w": torch.full((3,), 3.0)}})  # the copy's next log
    primary.append("apply", {"i": 0}, {"w": torch.ones(journal_log.PIECE // 4 + 1)})  # its writer's
    deadline = time.monotonic() + 10
    while mirror.journal.failure is None:  # the record's frames, then heartbeats until the copy's writer failed
        assert time.monotonic() < deadline, "the copy's writer never failed"
        assert mirror.take(ps_pb2.ReplicaFrame.FromString(next(stream))) is None
    primary.append("apply", {"i": 1}, ODD)
    with pytest.raises(MalformedStreamError, match="No space left on device") as info:
        while True:
            assert mirror.take(ps_pb2.ReplicaFrame.FromString(next(stream))) is None
    assert "retry" not in str(info.value), str(info.value)
    with pytest.raises(ServerUnavailableError):  # the big record is acknowledged to no one (the stream ends)
        mirror.written(timeout=0)
    mirror.close()
    primary.close()
    assert not lost


def test_a_base_the_copy_cannot_write_ends_its_stream_not_the_backup(tmp_path):
    """A later base the copy cannot write (the new spare files it would take are /dev/full): take raises
    MalformedStreamError, so the stream ends and the backup follows again from a new base; an OSError there
    ended the backup's process before (the soak's backup-disk-full found it)."""
    primary, feed, lost, mirror, stream = _copying(tmp_path)
    assert not list((tmp_path / "copy").glob("spare-*.bin"))  # spares 0 and 1 became the base and the log
    for number in (2, 3):  # the next log's file and the next base's: new spares, as none is left
        (tmp_path / "copy" / f"spare-{number:06d}.bin").symlink_to("/dev/full")
    _compact(primary, feed, {"step": 2, "variables": {"w": torch.full((3,), 3.0)}})
    with pytest.raises(MalformedStreamError, match="No space left on device"):
        while True:
            frame = ps_pb2.ReplicaFrame.FromString(next(stream))
            assert frame.kind != ps_pb2.ReplicaFrame.HEARTBEAT, "the base was written"
            assert mirror.take(frame) is None
    mirror.close()
    primary.close()
    assert not lost


def _acking(tmp_path):
    """A primary's journal with a feed attached whose acks come on an acks lane (a socket pair), read by
    take_acks on its thread: (primary, feed, its losses, the backup's end of the lane, that thread)."""
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    ours, theirs = (Lane(sock, b"a" * 16) for sock in socket.socketpair())
    feed, lost = _feed(acks_lane=ours)
    _compact(primary, feed, {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}, attach=True)
    reader = threading.Thread(target=feed.take_acks, args=(primary,), daemon=True)
    reader.start()
    return primary, feed, lost, theirs, reader


def test_acks_on_the_acks_lane_end_the_primarys_waits_and_its_end_loses_the_feed(tmp_path):
    """A backup's acks on its acks lane (ReplicaHello.acks_lane: 8 bytes, little-endian, per lane frame) are
    taken as its stream's are: the primary's wait for a record returns once the ack of it (or of a later one)
    came, not before; the backup's end of the lane closing loses the feed, and the reader ends."""
    primary, feed, lost, backup_end, reader = _acking(tmp_path)
    layout = ps_pb2.ReplicaFrame.FromString(next(_frames(feed, b"{}")))
    assert layout.kind == ps_pb2.ReplicaFrame.LAYOUT and layout.acks_on_lane, "the backup is told to ack there"
    assert not ps_pb2.ReplicaFrame.FromString(next(_frames(_feed()[0], b"{}"))).acks_on_lane  # none: in the stream
    first = primary.append("apply", {"i": 0}, ODD)
    second = primary.append("apply", {"i": 1}, ODD)
    _offered(feed, 3)  # the base and both records
    backup_end.send([feed.floor.to_bytes(ACK_BYTES, "little")], timeout=10)  # the base's
    with pytest.raises(WaitTimeoutError):
        primary.wait(first, timeout=0.2)
    backup_end.send([second.to_bytes(ACK_BYTES, "little")], timeout=10)
    primary.wait(first, timeout=10)
    primary.wait(second, timeout=10)
    assert feed.lag() == (True, 0, 0.0) and not lost
    backup_end.close()
    reader.join(timeout=10)
    assert not reader.is_alive() and lost and "acks' lane ended" in lost[0], lost
    primary.close()


@pytest.mark.parametrize("sent", [b"\x01" * 3, b"\x01" * 12], ids=["short", "long"])
def test_an_ack_of_another_length_breaks_the_acks_lane_and_loses_the_feed_acknowledging_nothing(tmp_path, sent):
    """A lane frame on the acks lane that is not 8 bytes is out of step: the lane breaks, the feed is lost, and
    the record waited for is not acknowledged by it."""
    primary, feed, lost, backup_end, reader = _acking(tmp_path)
    number = primary.append("apply", {"i": 0}, ODD)
    _offered(feed, 2)
    backup_end.send([sent], timeout=10)
    reader.join(timeout=10)
    assert not reader.is_alive() and lost and "acks' lane ended" in lost[0], lost
    assert feed.lag()[1] == 2, "nothing was acknowledged"
    with pytest.raises(WaitTimeoutError):
        primary.wait(number, timeout=0.1)
    primary.close()


def test_a_lost_feed_closes_its_acks_lane_so_its_reader_ends(tmp_path):
    """Losing the feed another way (its stream ended) closes the acks lane: the reader, blocked in a read with
    no deadline, ends at once, and the backup's end sees the lane closed."""
    primary, feed, lost, backup_end, reader = _acking(tmp_path)
    feed.lose("its stream ended")
    reader.join(timeout=10)
    assert not reader.is_alive() and lost == ["its stream ended"]
    with pytest.raises(LaneBrokenError):
        backup_end.begin(ACK_BYTES, timeout=10)
    primary.close()


def test_frames_go_on_the_lane_after_the_first_base_and_the_copy_recovers_them(tmp_path):
    """With frames_on_lane: a record offered before the first base went out comes in the stream, then TO_LANE;
    every later record (one small enough for the journal's writer to send itself, one of many pieces sent by
    the lane's sender), rotation and base comes on the lane, each frame ahead of its bytes, while the stream
    carries heartbeats only; the copy recovers the primary's records."""
    ends = [Lane(sock, b"k" * 16) for sock in socket.socketpair()]
    primary = Journal(tmp_path / "primary")
    primary.start({"step": 0, "variables": {"w": torch.ones(3)}})
    lost = []
    feed = Feed("b:1", chunk_bytes=12, ack_timeout=60, on_lost=lambda feed, why: lost.append(why),
                on_based=lambda feed: None, lane=ends[0], frames_on_lane=True)
    _compact(primary, feed, {"step": 1, "variables": {"w": torch.full((3,), 2.0)}}, attach=True)
    primary.append("apply", {"i": -1}, ODD)  # before the base went out: in the stream
    _offered(feed, 2)
    mirror = Mirror(tmp_path / "copy", sync=False, lane=ends[1])
    stream = _frames(feed, b'{"index": 1, "num_ps": 2, "origin": null, "job": "j"}')
    streamed = []
    while not mirror.frames_on_lane:
        streamed.append(ps_pb2.ReplicaFrame.FromString(next(stream)))
        mirror.take(streamed[-1])
    kinds = [frame.kind for frame in streamed]
    assert kinds[0] == ps_pb2.ReplicaFrame.LAYOUT and kinds[-1] == ps_pb2.ReplicaFrame.TO_LANE
    assert ps_pb2.ReplicaFrame.BASE in kinds and kinds[-2] == ps_pb2.ReplicaFrame.RECORD
    on_lane, done = [], threading.Event()

    def read() -> None:  # the backup's lane thread
        try:
            while True:
                on_lane.append(mirror.next_on_lane())
                mirror.take(on_lane[-1], on_lane=True)
        except LaneBrokenError:
            assert done.is_set(), "the lane broke before the test ended it"

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    big = {"big": torch.arange(3 * journal_log.PIECE // 4 + 3, dtype=torch.float32), "b": ODD["b"]}
    primary.append("apply", {"i": 0}, ODD)
    primary.append("apply", {"i": 1}, big)
    _compact(primary, feed, {"step": 7, "variables": {"w": torch.full((3,), 9.0)}})
    primary.append("member", {"worker": "w"}, {})  # no bytes: its frame alone
    primary.acked(feed, 10**9)
    primary.wait(timeout=10)
    _wait_for(lambda: sum(f.kind == ps_pb2.ReplicaFrame.RECORD for f in on_lane) == 3, "the three records")
    assert [ps_pb2.ReplicaFrame.FromString(next(stream)).kind for _ in range(2)] == [ps_pb2.ReplicaFrame.HEARTBEAT] * 2
    mirror.journal.wait(timeout=10)
    done.set()
    ends[0].close()
    reader.join(timeout=10)
    mirror.close()
    primary.close()
    assert [f.kind for f in on_lane] == [ps_pb2.ReplicaFrame.RECORD] * 2 + [ps_pb2.ReplicaFrame.ROTATE,
                                                                            ps_pb2.ReplicaFrame.BASE,
                                                                            ps_pb2.ReplicaFrame.RECORD]
    assert on_lane[1].lane_bytes == big["big"].nbytes + 8 and on_lane[3].lane_bytes and not on_lane[4].lane_bytes
    assert not lost and _same(tmp_path / "copy", tmp_path / "primary")["step"] == 7


@pytest.mark.parametrize("case", ["record-in-stream", "heartbeat-on-lane", "no-lane"])
def test_a_frame_on_the_wrong_side_of_to_lane_is_refused(tmp_path, case):
    """After TO_LANE only heartbeats come in the stream, and what belongs in the stream never comes on the lane;
    TO_LANE on a stream without a lane is refused too: MalformedStreamError, and the copy is unchanged."""
    ends = [Lane(sock, b"k" * 16) for sock in socket.socketpair()] if case != "no-lane" else (None, None)
    primary, feed, lost, mirror, _ = _copying(tmp_path, ends)
    to_lane = ps_pb2.ReplicaFrame(kind=ps_pb2.ReplicaFrame.TO_LANE)
    head, _ = journal_log.encode("member", {"worker": "w"}, {})
    record = ps_pb2.ReplicaFrame(kind=ps_pb2.ReplicaFrame.RECORD, written=5, head=head, last=True)
    if case == "no-lane":
        with pytest.raises(MalformedStreamError, match="TO_LANE on a stream without a lane"):
            mirror.take(to_lane)
    else:
        mirror.take(to_lane)
        with pytest.raises(MalformedStreamError, match="RECORD in the stream after TO_LANE" if case ==
                           "record-in-stream" else "HEARTBEAT on the lane"):
            if case == "record-in-stream":
                mirror.take(record)
            else:
                mirror.take(ps_pb2.ReplicaFrame(kind=ps_pb2.ReplicaFrame.HEARTBEAT), on_lane=True)
    mirror.close()
    primary.close()
    base, records = _records(Journal(tmp_path / "copy"))
    assert base["step"] == 1 and records == []
