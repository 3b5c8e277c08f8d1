"""A journal compaction holds the apply gate only while it copies the state, never while it writes the base
(ps_server/recording.py): pushes go on meanwhile, their records go to the new log, and a crash at any moment of
the write recovers exactly what was acknowledged. No sockets.

The disk is made slow on purpose: the journal's base write waits for the test (HeldBase), as a write to a busy
disk would take its time.
"""

from __future__ import annotations

import pathlib
import shutil
import threading

import torch

from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.journal import Journal
from torchps.ps_server.server import recover
from torchps.ps_server.store import NewVariable, VariableStore

TIMEOUT = 30.0
N = 4096  # floats: each record (16 KiB, a creation or a push) passes MIN_BYTES and asks for a compaction
MIN_BYTES = 8192


class HeldBase(Journal):
    """A journal whose compactions' base writes wait for `go`, telling `writing` when one begins."""

    def __init__(self, directory: pathlib.Path):
        super().__init__(directory, compact_factor=0, min_compact_bytes=MIN_BYTES)
        self.writing, self.go = threading.Event(), threading.Event()

    def write_base(self, number: int, state: dict) -> pathlib.Path:
        if number > 0:  # base 0 is the new journal's own, written before the shard serves
            self.writing.set()
            assert self.go.wait(TIMEOUT), "the test never let the base write go on"
        return super().write_base(number, state)


def shard(directory: pathlib.Path, journal: Journal | None = None) -> Coordinator:
    coordinator = Coordinator(VariableStore(), owns_step=True, start=False)
    recover(coordinator, journal or Journal(directory, min_compact_bytes=1 << 30), None)
    return coordinator


def grad(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(N, generator=torch.Generator().manual_seed(seed))}


def observed(c: Coordinator) -> dict:
    entry = c.store.snapshot()[0]
    return {"step": c.store.step, "value": entry["value"], "version": entry["version"],
            "state": entry["optimizer_state"]["state"][0]}


def assert_same(got: dict, expected: dict) -> None:
    assert got["step"] == expected["step"] and got["version"] == expected["version"], (got, expected)
    assert torch.equal(got["value"], expected["value"])
    assert all(torch.equal(got["state"][k], expected["state"][k]) for k in expected["state"])


def test_pushes_are_applied_and_acknowledged_while_a_compaction_writes_its_base(tmp_path):
    journal = HeldBase(tmp_path / "journal")
    c = shard(tmp_path / "journal", journal)
    c.create([NewVariable("w", torch.zeros(N), "adam", {"lr": 0.1})])  # its record passes MIN_BYTES
    assert journal.writing.wait(TIMEOUT), "no compaction began"
    pushed = threading.Thread(target=c.push, args=("worker:0", 1, 1, 0, grad(1)), kwargs={"step_increment": 1},
                              daemon=True)
    pushed.start()
    pushed.join(TIMEOUT / 3)
    held = pushed.is_alive()
    if held:
        journal.go.set()  # let the test end
    assert not held, "a push waited for the compaction's base to be written to disk (the gate was held)"
    during = observed(c)
    assert during["step"] == 1

    crashed = tmp_path / "crashed"  # what a process killed now leaves: the new base not whole yet
    shutil.copytree(tmp_path / "journal", crashed)
    journal.go.set()
    c.wait_for_compaction(TIMEOUT)
    c.push("worker:0", 1, 2, 0, grad(2), step_increment=1)  # and another compaction, not held
    c.wait_for_compaction(TIMEOUT)
    after = observed(c)
    c.close()

    back = shard(crashed)
    assert_same(observed(back), during)
    assert back.push("worker:0", 1, 1, 0, grad(1), step_increment=1).duplicate, "push 1 was in the new log"
    back.close()
    back = shard(tmp_path / "journal")
    assert_same(observed(back), after)
    back.close()


def test_a_journal_stopped_between_a_rotation_and_its_base_recovers(tmp_path):
    """Log 3 written over a longer retired file, then log 4 begun, its base not written yet (a shard killed
    mid-compaction, or a backup's copy between its primary's rotation and base): the rotation cut log 3 at its
    last record, so the journal recovers instead of reading the file's older bytes as a damaged record."""
    journal = Journal(tmp_path / "j", min_compact_bytes=1)
    journal.start(None)

    def compact() -> None:
        number = journal.rotate()
        journal.finish_compaction(number, journal.write_base(number, {}))

    for size in (4000, 3000):  # log 1 longer than log 2: log 3 is written over log 1's file
        compact()
        journal.wait(journal.append("apply", {}, {"g": torch.ones(size)}))
    compact()
    journal.wait(journal.append("apply", {"i": 3}, {"g": torch.ones(100)}))
    journal.rotate()  # log 4, no base 4
    journal.wait(journal.append("apply", {"i": 4}, {"g": torch.ones(10)}))
    journal.close()
    _, records = Journal(tmp_path / "j").recover()
    assert [record.meta["i"] for record in records] == [3, 4]
