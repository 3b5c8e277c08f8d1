"""The journal's record path: a record is written from the tensors' own memory a piece at a time, each piece
summed as it is written (ps_server/journal_log.py's write), and the journal lets go of that memory before the
record's wait returns, so a shard can reuse a push's receive buffers once the push is acknowledged; a
compaction's copy of the state (store.snapshot) is a copy of every variable, whatever its dtype. No sockets.
"""

from __future__ import annotations

import os
import pathlib
import weakref

import numpy as np
import pytest
import torch

from torchps.ps_server import journal_log
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.journal import Journal
from torchps.ps_server.server import recover
from torchps.ps_server.store import NewVariable, VariableStore

# floats: a gradient of several pieces whose last piece ends mid-word (bytes not a multiple of 8)
N = (2 * journal_log.PIECE + journal_log.PIECE // 2 + 4) // 4


def shard(directory: pathlib.Path, sync: bool = False) -> Coordinator:
    c = Coordinator(VariableStore(), owns_step=True, start=False)
    recover(c, Journal(directory, sync=sync, min_compact_bytes=1 << 40), None)
    return c


def grad(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def pushed_once(directory: pathlib.Path) -> pathlib.Path:
    """A shard's journal in `directory` that recorded w's creation and one push, grad(1); its log."""
    c = shard(directory)
    c.create([NewVariable("w", torch.zeros(N), "sgd", {"lr": 1.0})])
    c.push("worker:0", 1, 1, 0, {"w": grad(1)}, step_increment=1)
    c.close()
    (log,) = directory.glob("log-*.bin")
    return log


@pytest.mark.parametrize("sync", [False, True], ids=["page-cache", "synced"])
def test_an_acknowledged_push_leaves_no_reference_to_its_gradient_s_memory(tmp_path, sync):
    c = shard(tmp_path, sync)
    c.create([NewVariable("w", torch.zeros(N), "sgd", {"lr": 1.0})])
    received = np.frombuffer(grad(1).numpy().tobytes(), dtype=np.uint8).copy()  # a receive buffer
    gone = weakref.ref(received)
    c.push("worker:0", 1, 1, 0, {"w": torch.from_numpy(received).view(torch.float32)}, step_increment=1)
    del received
    assert gone() is None, "the journal still holds the gradient's memory after the push was acknowledged"
    c.close()


def test_a_record_of_several_pieces_is_read_back_whole_with_the_checks_of_its_whole_data(tmp_path):
    log = pushed_once(tmp_path)
    view, mapping = journal_log.mapped(log)
    try:
        push, end = list(journal_log.scan(view, 0))[-1]
        assert push.kind == "apply"
        head, views = journal_log.encode(push.kind, push.meta, push.tensors)
        assert bytes(view[end - journal_log.TAIL_BYTES:end]) == journal_log.tail(head, views, 0)
    finally:
        view.release()
        mapping.close()
    assert torch.equal(push.tensors["w"], grad(1))


@pytest.mark.parametrize("cut", [journal_log.PIECE // 2, journal_log.PIECE + 8, -journal_log.TAIL_BYTES - 1])
def test_a_record_torn_inside_its_pieces_is_cut_off_and_its_push_applied_again(tmp_path, cut):
    """A process killed while the second push's record was being written: the log ends `cut` bytes into its
    data (negative: from the data's end), a piece or more of it written."""
    log = pushed_once(tmp_path)
    whole = log.stat().st_size
    c = shard(tmp_path)
    c.push("worker:0", 1, 2, 0, {"w": grad(2)}, step_increment=1)
    c.close()
    data_at = log.stat().st_size - journal_log.TAIL_BYTES - 4 * N
    os.truncate(log, data_at + cut if cut > 0 else log.stat().st_size + cut)

    back = shard(tmp_path)
    assert back.store.step == 1 and torch.equal(back.store.read("w", lambda v, _: v.clone()), -grad(1))
    assert log.stat().st_size == whole, "the torn record was cut off"
    assert not back.push("worker:0", 1, 2, 0, {"w": grad(2)}, step_increment=1).duplicate
    back.close()


def test_a_damaged_byte_in_a_later_piece_fails_the_record_s_check(tmp_path):
    log = pushed_once(tmp_path)
    with open(log, "r+b") as f:  # a byte of the push's third piece
        f.seek(log.stat().st_size - journal_log.TAIL_BYTES - 4 * N + 2 * journal_log.PIECE + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    back = shard(tmp_path)
    assert back.store.step == 0, "the damaged push was not replayed"
    back.close()


@pytest.mark.parametrize("value", [torch.randn(N), torch.randn(3, 4), torch.tensor(2.5), torch.zeros(0, 5),
                                   torch.arange(9, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float16),
                                   torch.ones(2, 2, dtype=torch.float64)],
                         ids=["large", "2d", "scalar", "empty", "bfloat16", "float16", "float64"])
def test_a_snapshot_holds_each_value_as_it_was_in_memory_of_its_own(value):
    store = VariableStore()
    store.create([NewVariable("v", value, "sgd", {"lr": 1.0})])
    (entry,) = store.snapshot()
    held = store.read("v", lambda v, _: v)
    assert entry["value"].dtype == value.dtype and entry["value"].shape == value.shape
    assert torch.equal(entry["value"], held)
    held.add_(1)
    assert value.numel() == 0 or not torch.equal(entry["value"], held), "the snapshot shares the variable's memory"
