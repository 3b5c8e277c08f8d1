"""The journal (ps_server/journal.py): what a shard acknowledged survives its process, exactly. No sockets.

Each test runs a Coordinator with a journal, drops it without closing anything
(a killed process leaves the same files: records are written with one system
call each on an unbuffered file), recovers a fresh Coordinator from the folder
with server.recover(), and compares everything a client can observe.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
from concurrent import futures

import pytest
import torch

from helpers import wait_until
from torchps.errors import CheckpointError, LayoutChangedError, ServerUnavailableError
from torchps.ps_server import journal_log
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.journal import MIN_COMPACT_BYTES, Journal, compaction_floor
from torchps.ps_server.modes import SyncConfig
from torchps.ps_server.server import recover
from torchps.ps_server.store import NewVariable, VariableStore

SHAPES = {"a": (6, 5), "b": (7,)}


def grads(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def shard(directory: pathlib.Path, *, owns_step: bool = True, compact_bytes: int = 1 << 30) -> Coordinator:
    """A coordinator recovered from (or started with) the journal in `directory`."""
    coordinator = Coordinator(VariableStore(), owns_step=owns_step, start=False)
    recover(coordinator, Journal(directory, compact_factor=0, min_compact_bytes=compact_bytes), None)
    return coordinator


def observed(c: Coordinator) -> dict:
    """What clients can see: values, versions, optimizer state, step, hyperparameters."""
    out = {"step": c.store.step}
    for entry in c.store.snapshot():
        out[entry["name"]] = (entry["value"], entry["version"], entry["optimizer_state"], entry["current"])
    return out


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    assert got["step"] == expected["step"]
    for name in SHAPES:
        (value, version, state, hyper), (value2, version2, state2, hyper2) = got[name], expected[name]
        assert torch.equal(value, value2) and version == version2 and hyper == hyper2, name
        for key, moments in state["state"].items():
            for slot, tensor in moments.items():
                assert torch.equal(tensor, state2["state"][key][slot]), (name, slot)


def create(c: Coordinator, optimizer: str = "adam", **hyper) -> None:
    c.create([NewVariable(name, torch.zeros(shape), optimizer, hyper or {"lr": 0.1}) for name, shape in SHAPES.items()])


def test_async_state_and_ledger_survive_a_crash(tmp_path):
    c = shard(tmp_path)
    create(c)
    for seq in range(1, 6):
        c.push("worker:0", 7, seq, 0, grads(seq), step_increment=1)
    c.set_hyperparams([], {"lr": 0.05})
    c.push("worker:0", 7, 6, 0, grads(6), step_increment=1)
    expected = observed(c)
    c.close()

    back = shard(tmp_path)
    assert_same(observed(back), expected)
    retry = back.push("worker:0", 7, 6, 0, grads(6), step_increment=1)
    assert retry.duplicate and back.store.step == 6, "the last acknowledged push is known: its retry is not applied"
    fresh = back.push("worker:0", 7, 7, 0, grads(7), step_increment=1)
    assert not fresh.duplicate and back.store.step == 7
    back.close()


@pytest.mark.parametrize("batches", [1, 2], ids=["step-records", "add-records"])
def test_sync_pending_sums_and_applied_steps_survive_a_crash(tmp_path, batches):
    """Step 0 applied, step 1 half full when the shard dies, then step 1 completed; each step averages every
    batch once. One batch per worker and step: a step's record carries its averages and names its pushes (no
    "add" records), so worker 0's push of step 1, held and never acknowledged, is not in the journal and its
    retry is summed afresh. Two batches each: worker 0's first batch of step 1 is acknowledged at once, so it
    has its own record, is known after recovery, and its retry is not counted again."""
    pool = futures.ThreadPoolExecutor(4)

    def worker(c: Coordinator, name: str, pushes: list[tuple[int, int, int]]):
        """`name`'s pushes (seq, step, seed), one after the other, as a client sends them; the last reply."""
        return [c.push(name, 1, seq, step, grads(seed), timeout=30) for seq, step, seed in pushes][-1]

    c = shard(tmp_path, owns_step=False)
    c.configure(SyncConfig(mode="sync", total_num_replicas=2, replicas_to_aggregate=2 * batches,
                           startup_grace_seconds=0, lease_seconds=60))
    create(c, "sgd", lr=1.0)
    for name in ("worker:0", "worker:1"):
        c.join(name, 1)
    step0 = {"worker:0": [1, 2][:batches], "worker:1": [3, 4][:batches]}
    done = [pool.submit(worker, c, name, [(1 + b, 0, seed) for b, seed in enumerate(seeds)])
            for name, seeds in step0.items()]
    for f in done:
        f.result()
    assert c.wait_for_step(1, timeout=10) == 1
    seq = batches + 1  # worker 0's first push of step 1
    held = pool.submit(worker, c, "worker:0", [(seq, 1, 5)])
    if batches == 2:
        held.result()  # a first batch of two is answered at once
    else:
        wait_until(lambda: c.pending.counts(1, "worker:0") == (1, 1), 10, "worker 0's push to be summed")
        assert not held.done()
    expected = observed(c)
    c.close()
    if batches == 1:
        with pytest.raises(ServerUnavailableError):
            held.result()
    kinds = [record.kind for record in Journal(tmp_path).recover()[1]]
    assert ("add" in kinds) == (batches == 2) and kinds.count("step") == 1

    back = shard(tmp_path, owns_step=False)
    assert_same(observed(back), expected)
    for name in ("worker:0", "worker:1"):
        back.join(name, 1, 1)
    first = pool.submit(worker, back, "worker:0", [(seq, 1, 5)])  # its retry
    if batches == 2:
        assert first.result().duplicate, "an acknowledged push is known after recovery"
        first = pool.submit(worker, back, "worker:0", [(seq + 1, 1, 8)])
    other = pool.submit(worker, back, "worker:1", [(batches + 1 + b, 1, 6 + b) for b in range(batches)])
    for f in (first, other):
        f.result()
    assert back.wait_for_step(2, timeout=10) == 2
    assert not first.result().duplicate, "never acknowledged before: summed afresh (one batch each)"
    w = back.store.read("b", lambda value, version: value.clone())
    average = lambda seeds: sum(grads(s)["b"] for s in seeds) / len(seeds)  # noqa: E731
    step1 = [5, 6] if batches == 1 else [5, 8, 6, 7]
    assert torch.allclose(w, -(average(step0["worker:0"] + step0["worker:1"]) + average(step1)), atol=1e-6), \
        "each step averaged each batch once"
    back.close()
    pool.shutdown()


def test_a_torn_record_at_the_end_is_cut_off_and_appends_go_on(tmp_path):
    c = shard(tmp_path)
    create(c, "sgd", lr=1.0)
    c.push("worker:0", 1, 1, 0, {"b": torch.ones(7)}, step_increment=1)
    c.close()
    (log,) = sorted(tmp_path.glob("log-*.bin"))
    whole = log.stat().st_size
    c = shard(tmp_path)
    c.push("worker:0", 1, 2, 0, {"b": torch.ones(7)}, step_increment=1)
    c.close()
    with open(log, "r+b") as f:  # the process died in the middle of writing the second push
        f.truncate(whole + (log.stat().st_size - whole) // 2)

    back = shard(tmp_path)
    assert back.store.step == 1 and torch.equal(back.store.read("b", lambda v, _: v.clone()), -torch.ones(7))
    assert log.stat().st_size == whole, "the torn record was cut off"
    assert not back.push("worker:0", 1, 2, 0, {"b": torch.ones(7)}, step_increment=1).duplicate, \
        "the torn push was never acknowledged: its retry is applied"
    back.close()
    again = shard(tmp_path)
    assert again.store.step == 2
    again.close()


def test_a_damaged_record_stops_the_replay_there(tmp_path):
    c = shard(tmp_path)
    create(c, "sgd", lr=1.0)
    c.push("worker:0", 1, 1, 0, {"b": torch.ones(7)}, step_increment=1)
    c.close()
    (log,) = sorted(tmp_path.glob("log-*.bin"))
    data = bytearray(log.read_bytes())
    data[-12] ^= 0xFF  # a byte of the push's gradient
    log.write_bytes(bytes(data))
    back = shard(tmp_path)
    assert back.store.step == 0 and back.store.names() == list(SHAPES), "created, then the damaged push dropped"
    back.close()


def compacted_often(directory: pathlib.Path) -> dict:
    """A shard that compacted its journal every few pushes (39 of them); what clients saw at the end."""
    c = shard(directory, compact_bytes=4096)
    create(c)
    for seq in range(1, 40):
        c.push("worker:0", 3, seq, 0, grads(seq), step_increment=1)
        c.wait_for_compaction()
    expected = observed(c)
    c.close()
    return expected


def test_compaction_writes_a_new_base_retires_the_old_files_and_recovers_exactly(tmp_path):
    expected = compacted_often(tmp_path)
    bases = sorted(p.name for p in tmp_path.glob("base-*.bin"))
    logs = sorted(p.name for p in tmp_path.glob("log-*.bin"))
    spares = sorted(p.name for p in tmp_path.glob("spare-*.bin"))
    assert len(bases) <= 2 and bases[-1] != "base-000000.bin", f"compacted: {bases} {logs}"
    assert all(name >= bases[0].replace("base", "log") for name in logs), logs
    assert len(spares) <= 2, f"retired files are kept to be written over, two at most: {spares}"
    back = shard(tmp_path)
    assert_same(observed(back), expected)
    assert back.push("worker:0", 3, 39, 0, grads(39), step_increment=1).duplicate
    back.close()


def test_a_crash_between_rotation_and_the_new_base_recovers_from_the_older_base(tmp_path):
    c = shard(tmp_path)
    create(c)
    c.push("worker:0", 1, 1, 0, grads(1), step_increment=1)
    with c.gate.snapshot():  # the rotation of a compaction, whose base write never happens
        c.recorder.journal.rotate()
    c.push("worker:0", 1, 2, 0, grads(2), step_increment=1)
    expected = observed(c)
    c.close()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        ["base-000000.bin", "log-000000.bin", "log-000001.bin"]
    back = shard(tmp_path)
    assert_same(observed(back), expected)
    back.close()


def test_concurrent_async_pushes_replay_to_the_same_values(tmp_path):
    """Applies are recorded in the order they happened, so Adam's order-dependent state replays exactly."""
    c = shard(tmp_path)
    create(c)

    def pusher(worker: str, seeds: range) -> None:
        for seq, seed in enumerate(seeds, start=1):
            c.push(worker, 1, seq, 0, grads(seed), step_increment=1)

    threads = [threading.Thread(target=pusher, args=(f"worker:{i}", range(100 * i, 100 * i + 30))) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    expected = observed(c)
    c.close()
    back = shard(tmp_path)
    assert_same(observed(back), expected)
    back.close()


@pytest.mark.parametrize("kind", ["configure", "retire"])
def test_mode_and_retired_incarnations_survive_a_crash(tmp_path, kind):
    from torchps.errors import WorkerReplacedError

    c = shard(tmp_path)
    if kind == "configure":
        c.configure(SyncConfig(mode="ssp", total_num_replicas=3, max_staleness=4))
    else:
        create(c, "sgd")
        c.join("worker:1", 1)
        c.join("worker:1", 2)  # a restart: incarnation 1 is retired
        # joins do not wait for the disk; the next acknowledged change is written after them
        c.push("worker:1", 2, 1, 0, grads(1))
    c.close()
    back = shard(tmp_path)
    if kind == "configure":
        assert back.config == SyncConfig(mode="ssp", total_num_replicas=3, max_staleness=4)
    else:
        with pytest.raises(WorkerReplacedError):
            back.heartbeat("worker:1", 1)
    back.close()


class ContendedLock:
    """A lock that, when a thread named in `contended` finds it taken, sets that thread's event first."""

    def __init__(self, lock):
        self.lock, self.contended = lock, {}

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            event = self.contended.get(threading.current_thread().name)
            if event is not None:
                event.set()
            self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def test_a_push_racing_the_creation_of_its_variables_is_recorded_after_them(tmp_path):
    """Found by the chaos soak: a worker pushes the moment the chief's variables exist. The creation's record
    must come first in the journal (else the restarted shard fails replaying a push to a variable it does
    not have yet), and so must a hyperparameter change come in the order the applies saw it."""
    c = shard(tmp_path)
    real_create, real_set = c.store.create, c.store.set_hyperparams
    ordering = ContendedLock(c.recorder.ordering)
    c.recorder.ordering = ordering
    racer: list[threading.Thread] = []

    def race(then):  # the instant the change is made and not yet recorded, a push arrives from another thread
        def wrapped(*args, **kwargs):
            out = then(*args, **kwargs)
            settled = threading.Event()  # the push finished, or waits for the ordering lock

            def push():
                try:
                    c.push("worker:0", 1, len(racer), 0, grads(len(racer)), step_increment=1)
                finally:
                    settled.set()

            thread = threading.Thread(target=push, name="racer")
            racer.append(thread)
            ordering.contended[thread.name] = settled
            thread.start()
            assert settled.wait(30), "the racing push neither finished nor waited for the ordering lock"
            return out
        return wrapped

    c.store.create, c.store.set_hyperparams = race(real_create), race(real_set)
    create(c)
    c.set_hyperparams(list(SHAPES), {"lr": 0.5})
    for thread in racer:
        thread.join(10)
    expected = observed(c)
    c.close()
    kinds = [record.kind for record in Journal(tmp_path).recover()[1] if record.kind != "member"]
    assert kinds[0] == "create" and sorted(kinds[1:]) == ["apply", "apply", "hyperparams"], kinds
    assert c.store.snapshot()[0]["version"] == 2  # both racing pushes were applied
    back = shard(tmp_path)
    assert_same(observed(back), expected)
    back.close()


# -- a journal that cannot write; recovery that never skips a record ------------------------------------------

def test_a_journal_that_cannot_write_acknowledges_nothing_more_and_applies_a_retry_once(tmp_path):
    """The log is /dev/full: every write fails with ENOSPC, a real error from the kernel. The change whose
    record failed is not acknowledged (ServerUnavailableError), nor is anything after it; the failure is
    reported once (a shard stops there); a retry of the push is not applied again."""
    failures = []
    (tmp_path / "log-000000.bin").symlink_to("/dev/full")
    c = Coordinator(VariableStore(), owns_step=True, start=False)
    recover(c, Journal(tmp_path, on_failure=failures.append), None)
    with pytest.raises(ServerUnavailableError, match="No space left on device"):
        create(c, "sgd", lr=1.0)
    assert len(failures) == 1 and "log-000000.bin: a write failed: No space left on device" in failures[0]
    c.store.create([NewVariable("b", torch.zeros(7), "sgd", {"lr": 1.0})])  # as if its record had been written
    for _ in range(2):  # the push, then its retry
        with pytest.raises(ServerUnavailableError, match="cannot write its journal"):
            c.push("worker:0", 1, 1, 0, {"b": torch.ones(7)}, step_increment=1)
    assert c.store.get("b").version == 1, "applied once, acknowledged never"
    assert len(failures) == 1
    c.close()


def write_pushes(directory: pathlib.Path, count: int) -> tuple[dict, pathlib.Path]:
    """A shard that created a, b and acknowledged `count` pushes; (what clients saw, its log)."""
    c = shard(directory)
    create(c, "sgd", lr=1.0)
    for seq in range(1, count + 1):
        c.push("worker:0", 1, seq, 0, grads(seq), step_increment=1)
    expected = observed(c)
    c.close()
    (log,) = directory.glob("log-*.bin")
    return expected, log


def record_ends(log: pathlib.Path) -> list[int]:
    """Where each whole record of `log` ends (and the next begins)."""
    number = int(log.stem.split("-")[1])
    view, mapping = journal_log.mapped(log)
    try:
        return [end for _, end in journal_log.scan(view, number)]
    finally:
        view.release()
        mapping.close()


def test_a_damaged_record_with_whole_ones_after_it_is_refused_naming_the_file_and_byte(tmp_path):
    _, log = write_pushes(tmp_path, 3)
    starts = [0] + record_ends(log)[:-1]
    data = bytearray(log.read_bytes())
    data[starts[-2] + 40] ^= 0xFF  # the second to last record: one whole record follows it
    log.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{log}: the record at byte {starts[-2]} is damaged .* corrupt"):
        shard(tmp_path)
    assert log.read_bytes() == bytes(data), "nothing was cut"


def test_a_reused_file_s_old_records_are_neither_replayed_nor_taken_for_corruption(tmp_path):
    """Compaction writes new logs over retired ones: what is left of a file's earlier use (whole records of
    another log) after the new log's end is cut off at recovery, never replayed, never called corrupt."""
    expected = compacted_often(tmp_path)
    (log,) = tmp_path.glob("log-*.bin")
    ends = record_ends(log)
    assert log.stat().st_size > ends[-1], "the current log was written over a longer retired one"
    # Right after its end, a whole record of the log before it (the last push again): bytes a reused file
    # may hold there. Replaying it would apply that push twice.
    number = int(log.stem.split("-")[1])
    view, mapping = journal_log.mapped(log)
    (last, _), = [(record, end) for record, end in journal_log.scan(view, number) if end == ends[-1]]
    view.release()
    mapping.close()
    head, views = journal_log.encode(last.kind, last.meta, last.tensors)
    older = head + b"".join(bytes(v) for v in views) + journal_log.tail(head, views, number - 1)
    with open(log, "r+b") as f:
        f.seek(ends[-1])
        f.write(older)
    back = shard(tmp_path)
    assert_same(observed(back), expected)
    assert back.push("worker:0", 3, 39, 0, grads(39), step_increment=1).duplicate
    back.close()


def test_a_synced_journal_recovers_the_same(tmp_path):
    c = Coordinator(VariableStore(), owns_step=True, start=False)
    recover(c, Journal(tmp_path, sync=True), None)
    create(c)
    for seq in range(1, 4):
        c.push("worker:0", 1, seq, 0, grads(seq), step_increment=1)
    expected = observed(c)
    c.close()
    assert_same(observed(shard(tmp_path)), expected)


def test_compressed_pushes_are_recorded_as_they_came_and_replay_to_the_same_values(tmp_path):
    """A bf16 cast and a top-k gradient are journaled as received (half, and a hundredth, of the decoded
    bytes) and decoded again on replay, bit for bit as the shard decoded them."""
    from torchps import compression

    c = shard(tmp_path)
    c.create([NewVariable("w", torch.zeros(256, 64), "adam", {"lr": 0.1})])
    (log,) = tmp_path.glob("log-*.bin")
    before = log.stat().st_size
    for seq, policy in enumerate((compression.Compression("bf16", min_bytes=0),
                                  compression.Compression("topk", ratio=0.01, min_bytes=0)), start=1):
        grad = torch.randn(256, 64, generator=torch.Generator().manual_seed(seq))
        (meta, payload), _ = compression.encode(policy, "w", grad, 0, None)
        raw = payload.reshape(-1).view(torch.uint8).numpy()
        spec = c.store.get("w").spec.meta
        c.push("worker:0", 1, seq, 0, {"w": compression.decode("w", meta, raw, spec)}, step_increment=1,
               received={"w": (meta, raw)})
    expected = c.store.read("w", lambda value, _: value.clone())
    c.close()
    assert log.stat().st_size - before < 256 * 64 * 4 * 0.6, "the records hold the bytes as they came"
    back = shard(tmp_path)
    assert torch.equal(back.store.read("w", lambda value, _: value.clone()), expected)
    back.close()


def test_a_finished_job_begun_again_keeps_the_shards_bound_on_membership(tmp_path):
    """The chief's Shutdown is journaled; a shard started again on the volume forgets the old job's members
    (forget_job) but not the bound ps-server was started with (the cluster spec's names, --elastic-workers):
    a new job still cannot grow membership with invented names."""
    from torchps.errors import PermissionDeniedError
    from torchps.ps_server.membership import Membership

    def bounded() -> Coordinator:
        c = Coordinator(VariableStore(), owns_step=True, start=False,
                        membership=Membership(frozenset({"worker:0"}), elastic=1))
        recover(c, Journal(tmp_path), None)
        return c

    c = bounded()
    create(c)
    c.join("worker:0", 7)
    c.join("worker:5", 7)  # the one elastic place
    c.finish("the chief ended the job")
    c.close()

    back = bounded()
    assert not back.membership.members, "the finished job's members are gone"
    back.join("worker:0", 8)
    back.join("worker:6", 8)  # the elastic place, free again in the new job
    with pytest.raises(PermissionDeniedError, match="elastic-workers"):
        back.join("worker:7", 8)
    back.close()


def test_a_live_resize_s_hold_and_its_end_survive_a_crash(tmp_path):
    """A sync shard killed under a resize's hold comes back holding from the same step (pushes at it wait);
    an empty one that took the hold's step as its own comes back at it; the hold's end, journaled, still
    refuses a push placed before it."""
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    held, empty = tmp_path / "held", tmp_path / "empty"
    c, e = shard(held, owns_step=False), shard(empty, owns_step=False)
    for each in (c, e):
        each.configure(SyncConfig(mode="sync", total_num_replicas=1, startup_grace_seconds=0))
        each.join("worker:0", 1)
    create(c, "sgd", lr=1.0)
    c.push("worker:0", 1, 1, 0, grads(1))
    c.wait_for_step(1, timeout=10)
    for each in (c, e):
        each.moves.set_layout(1, addresses, {"a": 0, "b": 0}, hold_from=1)
    assert (c.layout.hold_from, e.store.step) == (1, 1)
    expected = observed(c)
    c.close()
    e.close()

    c, e = shard(held, owns_step=False), shard(empty, owns_step=False)
    assert_same(observed(c), expected)
    assert (c.layout.epoch, c.layout.hold_from, c.moves.quiet()) == (1, 1, True)
    assert (e.store.step, e.layout.hold_from) == (1, 1), "the empty shard's adopted step came back"
    c.moves.set_layout(2, addresses, {"a": 0, "b": 0})
    c.close()
    c = shard(held, owns_step=False)
    assert (c.layout.epoch, c.layout.hold_from) == (2, 0)
    with pytest.raises(LayoutChangedError, match="ended at epoch 2"):
        c.push("worker:0", 1, 2, 1, grads(2), layout_epoch=1)
    c.push("worker:0", 1, 3, 1, grads(2), layout_epoch=2)
    assert c.wait_for_step(2, timeout=10) == 2
    c.close()
    e.close()


# -- the journal's size and what a restart says about the end of its log ------------------------------------

def test_a_small_models_journal_is_compacted_past_a_few_mib_and_a_large_ones_floor_is_unchanged(tmp_path):
    """A 64 KiB variable pushed 256 times (16 MiB of records): the journal compacts at its floor (8 times its
    base, at least MIN_COMPACT_BYTES), so the folder holds two logs of a few MiB, not 16 MiB (before: a 64 MiB
    floor for every model)."""
    assert [compaction_floor(n) for n in (0, 1 << 20, 16 << 20, 1 << 30)] == [4 << 20, 8 << 20, 64 << 20, 64 << 20]
    c = Coordinator(VariableStore(), owns_step=True, start=False)
    recover(c, Journal(tmp_path), None)
    c.create([NewVariable("w", torch.zeros(16384), "sgd", {"lr": 0.1})])
    for seq in range(1, 257):
        c.push("worker:0", 1, seq, 0, {"w": torch.full((16384,), float(seq))}, step_increment=1)
        c.wait_for_compaction()
    c.close()
    assert max(tmp_path.glob("base-*.bin")).name != "base-000000.bin", "it compacted"
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total <= 2 * MIN_COMPACT_BYTES + (1 << 20), f"{total} bytes of journal for a 64 KiB variable"


def test_a_restart_cuts_a_reused_files_old_bytes_quietly_and_warns_only_of_a_torn_record(tmp_path, caplog):
    """Compaction writes logs over retired ones, so a log usually ends in bytes of the file's earlier use: a
    restart cuts them off with no WARNING (before: one on every ordinary restart). A record cut short by the
    shard's death is still a WARNING, naming it torn."""
    compacted_often(tmp_path)
    (log,) = tmp_path.glob("log-*.bin")
    assert log.stat().st_size > record_ends(log)[-1], "the current log was written over a longer retired one"
    with caplog.at_level(logging.DEBUG, logger="torchps.ps_server.journal"):
        back = shard(tmp_path)
        back.push("worker:0", 3, 40, 0, grads(40), step_increment=1)
        back.close()
    assert [r.levelname for r in caplog.records if "cut off" in r.getMessage()] == ["DEBUG"], caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    caplog.clear()

    ends = record_ends(log)
    os.truncate(log, ends[-2] + (ends[-1] - ends[-2]) // 2)  # the last push's record, torn
    with caplog.at_level(logging.DEBUG, logger="torchps.ps_server.journal"):
        again = shard(tmp_path)
        again.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"a torn record at byte {ends[-2]}" in warnings[0], caplog.text


def test_a_record_written_now_follows_the_queued_ones_and_a_failed_one_fails_the_journal(tmp_path):
    """Journal.write_now (a backup's stream writes a record itself) writes after what was queued before it, and
    recovery reads the records in order; a write that fails (the log is /dev/full) fails the journal as a
    failure of its writer does: ServerUnavailableError, reported once, then for every append."""
    journal = Journal(tmp_path / "ok")
    journal.start({"step": 0, "variables": {"w": torch.zeros(3)}})
    for i in range(20):
        journal.append("apply", {"i": i}, {"w": torch.full((3,), float(i))})
    number = journal.write_now(*journal_log.encode("apply", {"i": 20}, {"w": torch.full((3,), 20.0)}))
    assert number == 21
    journal.wait(number, timeout=0)  # written when it returned
    journal.close()
    _, records = Journal(tmp_path / "ok").recover()
    assert [(r.meta["i"], r.tensors["w"][0].item()) for r in records] == [(i, float(i)) for i in range(21)]

    failures = []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "log-000000.bin").symlink_to("/dev/full")
    journal = Journal(tmp_path / "full", on_failure=failures.append)
    journal.start(None)
    with pytest.raises(ServerUnavailableError, match="No space left on device"):
        journal.write_now(*journal_log.encode("apply", {}, {"w": torch.ones(3)}))
    with pytest.raises(ServerUnavailableError, match="cannot write its journal"):
        journal.append("apply", {}, {"w": torch.ones(3)})
    assert len(failures) == 1 and "a write failed: No space left on device" in failures[0]
    journal.close()


def test_a_bug_in_a_record_written_now_fails_the_journal_and_close_still_returns(tmp_path, monkeypatch):
    """An exception other than OSError while write_now writes (a bug) fails the journal as the writer's own
    would, and lets go of the log: close() returns instead of waiting for the writer for good."""
    journal = Journal(tmp_path)
    journal.start({"step": 0, "variables": {"w": torch.zeros(3)}})

    def broken(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(journal_log, "write", broken)
    with pytest.raises(ServerUnavailableError, match="writing a record failed: ValueError"):
        journal.write_now(*journal_log.encode("apply", {}, {"w": torch.ones(3)}))
    closed = threading.Thread(target=journal.close, daemon=True)
    closed.start()
    closed.join(30)
    assert not closed.is_alive()
