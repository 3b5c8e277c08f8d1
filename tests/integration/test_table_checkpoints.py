"""Embedding tables in checkpoints and the journal, against real ps-server processes: a shard SIGKILLed and
restarted (from its journal, then from a checkpoint) goes on exactly as a cluster that never stopped; a
damaged table section stops ps-server with one clear line. (Re-layouts onto other shard counts:
test_table_relayout.py; export into torch's modules: tests/grpc/test_embeddings.py.)

The reference for "exactly" is a second cluster that gets the same calls and is
never killed: lookups, updates and the shards' saved table sections (rows,
Adagrad and SparseAdam state, dynamic tables' ids, ages and counters) must be
equal bit for bit. Ordering is by replies and process exits, never by sleeping.
"""

from __future__ import annotations

import pathlib
import shutil
import signal
import sys

import torch

from torchps.client import PSClient
from torchps.ps_server import checkpoint
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.store import VariableStore
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from helpers import run_ps_server  # noqa: E402
from table_job import (assert_equal, assert_same_sections, at_once, everything, saved_tables, setup,  # noqa: E402
                       step, table_specs)


def test_a_killed_shard_restored_from_its_journal_then_a_checkpoint_goes_on_as_if_never_stopped(tmp_path):
    ckpt, reference_ckpt = tmp_path / "ckpt", tmp_path / "reference"
    killed = LocalCluster(2, server_args=["--checkpoint-dir", str(ckpt)])  # journal on: the default
    reference = LocalCluster(2, server_args=["--checkpoint-dir", str(reference_ckpt), "--no-journal"])
    try:
        at_once("start", killed, reference)
        with PSClient(killed.cluster, connect_timeout=20) as a, PSClient(reference.cluster, connect_timeout=20) as r:
            for client in (a, r):
                setup(client)
            for k in range(1, 4):
                assert_equal(step(a, k), step(r, k), f"step {k}'s lookup")
            assert a.save_checkpoint(0) == 3
            for k in range(4, 6):  # acknowledged after the checkpoint: only the journal has them
                assert_equal(step(a, k), step(r, k), f"step {k}'s lookup")
            before = everything(a)
            assert_equal(before, everything(r), "before the kill")
            assert before["dyn"].abs().sum() > 0 and (before["dyn"] == 0).all(dim=1).any(), \
                "some dynamic rows exist, others were never admitted or were evicted"

            # 1. SIGKILL, restart: the shard replays its journal (the creation, admissions and every push).
            assert killed.kill_ps(1) == -signal.SIGKILL
            killed.start_ps(1)
            assert "recovered from the journal" in killed.log(1)
            assert_equal(everything(a), before, "after the journal's recovery")
            assert_equal(step(a, 6), step(r, 6), "the next lookup after the recovery")
            assert_equal(everything(a), everything(r), "after the next update")
            assert a.save_checkpoint(0) == r.save_checkpoint(0) == 6
            assert_same_sections(saved_tables(ckpt, 6), saved_tables(reference_ckpt, 6), "after the journal's recovery")

            # 2. SIGKILL without the journal: the shard restores the newest committed checkpoint (step 6).
            assert killed.kill_ps(1) == -signal.SIGKILL
            shutil.rmtree(ckpt / "journal" / "ps-1")
            killed.start_ps(1)
            assert f"restoring {checkpoint.step_dir(ckpt, 6) / 'ps-1.pt'}" in killed.log(1)
            assert a.status(1).restored_step == 6
            assert_equal(everything(a), everything(r), "after the checkpoint's restore")
            assert_equal(step(a, 7), step(r, 7), "the next lookup after the restore")
            assert_equal(everything(a), everything(r), "the next update after the restore")
            assert a.save_checkpoint(0) == r.save_checkpoint(0) == 7
            assert_same_sections(saved_tables(ckpt, 7), saved_tables(reference_ckpt, 7), "after the restore")
    finally:
        at_once("stop", killed, reference)


def test_ps_server_refuses_a_checkpoint_whose_table_section_is_incomplete(tmp_path):
    """A committed checkpoint whose ps-1.pt lost a table: ps-server --restore-from exits with code 2 and a
    line naming the file and the table, instead of serving the variables without it."""
    states = []
    for index in range(2):
        c = Coordinator(VariableStore(), owns_step=index == 0)
        c.create_tables(table_specs(), index, 2)
        states.append(c.state(with_pending=False))
        c.close()
    written = [checkpoint.write_shard(tmp_path, i, 0, state) for i, state in enumerate(states)]
    checkpoint.commit(tmp_path, 0, {"strategy": "round_robin", "num_ps": 2, "variables": []},
                      [(i, size, 0, 0) for i, (_, size) in enumerate(written)], keep=0)
    path = checkpoint.step_dir(tmp_path, 0) / "ps-1.pt"
    state = torch.load(path, weights_only=True)
    state["tables"] = state["tables"][:1]  # "dyn" gone
    torch.save(state, path)
    for num_ps in (2, 3):
        code, printed = run_ps_server(["--insecure", "--index", "1", "--bind", "127.0.0.1:0", "--restore-from",
                                       str(tmp_path), "--num-ps", str(num_ps)], tmp_path / f"{num_ps}.log", 60)
        assert code == 2, printed
        last = printed.strip().splitlines()[-1]
        assert "Traceback" not in printed and last.startswith("ps-server: error: "), printed
        assert str(path) in last and "missing ['dyn']" in last and "refusing to restore it partly" in last, last
