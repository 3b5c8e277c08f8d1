"""Failures in a running job, through `ps-launch` as a user runs it: a shard, a worker or the chief is
SIGKILLed mid-run, `--restart-on-failure` brings it back, and the job still completes.

Each test starts ps-launch as a subprocess and reads its (role-prefixed) stdout
lines as they come; pids come from the shards' 'serving on ... (pid N)' lines
and, for workers, from /proc (the launcher's children). Every wait is bounded,
and a test that fails stops the launcher and everything it started.

The runs: mnist5k (4000 training images), 2 workers in sync mode, batch 100:
20 global steps per epoch, EPOCHS epochs.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from test_launch import alive, command_line, descendants

from torchps.client import Optimizer, PSClient, ServerUnavailableError
from torchps.ps_server.checkpoint import latest_committed
from torchps.worker.local_cluster import LocalCluster
from torchps.worker.models import build_model
from torchps.worker.trainer import evaluate

EPOCHS = 5
STEPS = EPOCHS * 4000 // (2 * 100)  # 100 global steps: every step averages one batch from each worker
# Not 10: a checkpoint triggered at the job's last step (100 is a multiple of 10) makes the chief wait
# 300 s for a step nobody makes (see test_checkpoints.py::test_checkpointer_stop_does_not_wait_...).
# With 17 the last trigger is at step 85, 15 steps before the end.
CHECKPOINT_EVERY = 17
JOB = ["--dataset", "mnist5k", "--ps", "2", "--workers", "2", "--mode", "sync", "--epochs", str(EPOCHS),
       "--lr", "0.1", "--momentum", "0.9"]
RUN_TIMEOUT = 120.0  # one job, start to end, on a loaded 2-core machine
ACCURACY_TOLERANCE = 0.01


class Launch:
    """`ps-launch ARGS` as a subprocess, its output lines collected as they come."""

    def __init__(self, args: list[str]):
        env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "TORCHPS_LOG_LEVEL")}
        env["PYTHONUNBUFFERED"] = "1"
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "torchps.worker.launch", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                                     stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def tail(self, count: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-count:])

    def wait_for(self, pattern: str, timeout: float = RUN_TIMEOUT, accept=lambda match: True,
                 after: str | None = None) -> re.Match:
        """The first output line matching `pattern` (re.search) for which accept(match) is true; with `after`,
        among the lines that follow the first line matching that."""
        regex = re.compile(pattern)
        start = None if after is None else re.compile(after)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if start is not None:
                        start = None if start.search(line) else start
                        continue
                    match = regex.search(line)
                    if match and accept(match):
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    why = "ps-launch exited" if self._eof else f"timed out after {timeout:g} s"
                    pytest.fail(f"{why} before a line matching {pattern!r}; its last lines:\n"
                                + "\n".join(self.lines[-40:]))
                self._cond.wait(left)

    def finish(self, timeout: float = RUN_TIMEOUT) -> int:
        """Waits for ps-launch to exit; returns its exit code."""
        try:
            code = self.proc.wait(timeout=max(0.0, timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            pytest.fail(f"ps-launch still running after {timeout:g} s; its last lines:\n{self.tail()}")
        self._reader.join(10)
        return code

    def children(self) -> dict[int, str]:
        """pid -> command line of the launcher's live descendants (its children come from its fork server)."""
        return {pid: command_line(pid) for pid in descendants(self.proc.pid) if alive(pid)}

    def worker_pids(self, index: int) -> list[int]:
        """The pids of the live `worker:index` processes (one while it runs, none once it ended)."""
        return [pid for pid, cmd in self.children().items()
                if "ps-worker " in cmd and f"--task-type worker --index {index} " in cmd + " "]

    def worker_pid(self, index: int) -> int:
        """The pid of the live `worker:index` process."""
        found = self.worker_pids(index)
        assert len(found) == 1, f"expected one worker:{index} process among the launcher's children: {found}"
        return found[0]

    def stop(self) -> None:
        """Ends ps-launch and everything it started, if still running (after a failed test)."""
        if self.proc.poll() is None:
            children = list(self.children())
            self.proc.send_signal(signal.SIGTERM)  # the launcher stops its children
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                for pid in children:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        self._reader.join(10)


@pytest.fixture
def launch():
    """Factory launch(*args) -> a running Launch; stopped (with everything it started) after the test."""
    started: list[Launch] = []

    def start(*args: str) -> Launch:
        run = Launch(list(args))
        started.append(run)
        return run

    yield start
    for run in started:
        run.stop()


def ps_pids(run: Launch, index: int) -> list[int]:
    return [int(m.group(1)) for line in run.lines
            if (m := re.search(rf"^\[ps:{index}\] .*ps {index} serving on \S+ \(pid (\d+)\)", line))]


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def summary_of(path: pathlib.Path) -> dict:
    assert path.is_file(), f"the chief wrote no summary to {path}"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the killed-shard test's job, run without failures (also exports the model)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run = Launch([*JOB, "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every-steps", str(CHECKPOINT_EVERY),
                  "--restart-on-failure", "--metrics-out", str(out / "metrics.json"),
                  "--export", str(out / "model.pt")])
    try:
        code = run.finish()
    finally:
        run.stop()
    return {"run": run, "code": code, "dir": out, "summary": summary_of(out / "metrics.json") if code == 0 else None}


# -- the job ends cleanly --------------------------------------------------------------------------------

def test_job_completes_and_every_ps_server_exits_with_the_job(uninterrupted):
    run = uninterrupted["run"]
    assert uninterrupted["code"] == 0, f"ps-launch exit code {uninterrupted['code']}:\n{run.tail()}"
    launcher = [line for line in run.lines if line.startswith("[launch]")]
    bad = [line for line in launcher if not re.match(r"\[launch\] (cluster: |job folder |test accuracy |done, exit code 0$)", line)]
    assert not bad, f"the launcher reported problems: {bad}"
    for index in (0, 1):
        (pid,) = ps_pids(run, index)
        own = [line for line in run.lines if line.startswith(f"[ps:{index}] ")]
        shutdown = [i for i, line in enumerate(own) if "shutdown requested (the chief finished the job)" in line]
        stopping = [i for i, line in enumerate(own) if f"ps {index} stopping" in line]
        assert shutdown and stopping and shutdown[0] < stopping[0], \
            f"ps {index} must stop because the chief's Shutdown asked it to (exit code 0):\n" + "\n".join(own[-5:])
        assert not any("Traceback" in line for line in own[shutdown[0]:]), "\n".join(own[shutdown[0]:])
        assert gone(pid), f"ps {index} (pid {pid}) is still running after the job"

    summary = uninterrupted["summary"]
    assert summary["global_step"] == STEPS and summary["checkpoints"][-1] == STEPS, summary
    final = uninterrupted["dir"] / "ckpt" / f"step-{STEPS:012d}"
    assert sorted(p.name for p in final.iterdir()) == ["manifest.json", "ps-0.pt", "ps-1.pt"], "the final save"

    task = build_model("mlp", "mnist5k")  # a fresh model: --export is a plain state_dict
    task.model.load_state_dict(torch.load(uninterrupted["dir"] / "model.pt", weights_only=True))
    accuracy = evaluate(task.model, task.dataset.x_test, task.dataset.y_test, "cpu")
    assert accuracy == summary["test_accuracy"], "the exported model is the one the chief evaluated"


# -- a shard dies --------------------------------------------------------------------------------------

def test_ps_killed_mid_run_is_restarted_recovers_and_the_job_matches_an_uninterrupted_run(launch, uninterrupted,
                                                                                       tmp_path):
    assert uninterrupted["code"] == 0, "the reference run failed (see test_job_completes_...)"
    ckpt = tmp_path / "ckpt"
    run = launch(*JOB, "--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", str(CHECKPOINT_EVERY),
                 "--restart-on-failure", "--metrics-out", str(tmp_path / "metrics.json"),
                 "--export", str(tmp_path / "model.pt"))
    pid = int(run.wait_for(r"^\[ps:1\] .*ps 1 serving on \S+ \(pid (\d+)\)").group(1))
    saved = int(run.wait_for(r"^\[worker:0\] .*checkpoint of step (\d+) saved on every shard",
                             accept=lambda m: int(m.group(1)) >= 0.3 * STEPS).group(1))
    os.kill(pid, signal.SIGKILL)

    run.wait_for(r"^\[launch\] ps:1 exited with code -9; restarting it", timeout=30)
    restored = run.wait_for(r"^\[ps:1\] .*recovered from the journal in \S+: .* step (\d+)$", timeout=60)
    assert int(restored.group(1)) >= saved, "ps 1 recovers everything it acknowledged, beyond its last checkpoint"
    assert run.finish() == 0, run.tail()
    (_, new_pid) = ps_pids(run, 1)
    assert gone(new_pid), "the restarted ps 1 ends with the job"

    summary = summary_of(tmp_path / "metrics.json")
    reference = uninterrupted["summary"]
    assert summary["global_step"] == STEPS, "the restored shard adopted the job's step; no step was repeated"
    assert saved < STEPS and int(restored.group(1)) < STEPS, "the kill happened mid-run"
    assert abs(summary["test_accuracy"] - reference["test_accuracy"]) <= ACCURACY_TOLERANCE, \
        f"final accuracy {summary['test_accuracy']:.4f} vs {reference['test_accuracy']:.4f} uninterrupted"

    # The job's last checkpoint is complete (every shard, one step, committed) and --restore-from brings back
    # exactly the model the chief exported, onto another number of shards too.
    step, manifest = latest_committed(ckpt)
    assert step == STEPS and [s["state_step"] for s in manifest["shards"]] == [STEPS, STEPS], manifest["shards"]
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    for num_ps in (2, 1):
        with LocalCluster(num_ps, server_args=["--restore-from", str(ckpt), "--num-ps", str(num_ps)]) as local, \
                PSClient(local.cluster, connect_timeout=20) as client:
            client.declare([(name, nbytes) for name, nbytes in manifest["variables"]])
            restored = client.pull([name for name, _ in manifest["variables"]])
            assert restored.keys() == exported.keys()
            assert all(torch.equal(restored[name], exported[name]) for name in exported), \
                f"--restore-from onto {num_ps} shards must give the exported values exactly"
            assert client.global_step() == STEPS


# -- a worker dies -------------------------------------------------------------------------------------

def kill_worker_mid_run(run: Launch, index: int) -> int:
    """Waits until worker `index` logged a step >= 30 % of the job, SIGKILLs it; returns that step."""
    step = int(run.wait_for(rf"^\[worker:{index}\] .*worker:{index} epoch \d+ step (\d+) loss",
                            accept=lambda m: int(m.group(1)) >= 0.3 * STEPS).group(1))
    pid = run.worker_pid(index)
    os.kill(pid, signal.SIGKILL)
    run.wait_for(rf"^\[launch\] worker:{index} exited with code -9; restarting it", timeout=30)
    return step


def test_killed_worker_is_restarted_and_rejoins_the_job(launch, tmp_path):
    run = launch(*JOB, "--restart-on-failure", "--log-every", "0.2", "--metrics-out", str(tmp_path / "metrics.json"))
    killed_at = kill_worker_mid_run(run, 1)
    back = run.wait_for(r"^\[ps:0\] .*worker:1 (?:restarted|rejoined|joined) at step (\d+)",
                        accept=lambda m: int(m.group(1)) > 0, timeout=60)
    resumed = int(back.group(1))
    assert resumed >= killed_at, "the new worker:1 joins at the job's step"
    went_on = run.wait_for(r"^\[worker:1\] .*worker:1 goes on from epoch (\d+), batch (\d+): its earlier processes "
                           r"pushed its (\d+) batches before")
    pushed = int(went_on.group(3))
    assert int(went_on.group(1)) * 20 + int(went_on.group(2)) == pushed, "it skips the batches it pushed"
    assert killed_at <= pushed <= resumed
    assert run.finish() == 0, run.tail()
    summary = summary_of(tmp_path / "metrics.json")
    assert not summary["partial"] and summary["batches_trained"] == summary["batches_planned"] == 2 * STEPS, summary
    # the new worker:1 goes on from where the job is instead of redoing its epochs (which took the job
    # past STEPS + resumed global steps before)
    assert STEPS <= summary["global_step"] < STEPS + (resumed - killed_at) + 20, summary


def test_killed_chief_is_restarted_and_resumes_from_the_shards_step(launch, tmp_path):
    run = launch(*JOB, "--restart-on-failure", "--log-every", "0.2", "--metrics-out", str(tmp_path / "metrics.json"))
    killed_at = kill_worker_mid_run(run, 0)
    back = run.wait_for(r"^\[ps:0\] .*worker:0 (?:restarted|rejoined|joined) at step (\d+)",
                        accept=lambda m: int(m.group(1)) > 0, timeout=60)
    resumed = int(back.group(1))
    assert resumed >= killed_at, "the restarted chief starts at the shards' step, not 0"
    goes_on = r"^\[worker:0\] .*worker:0 goes on from epoch \d+, batch \d+: its earlier processes pushed its"
    first = run.wait_for(r"^\[worker:0\] .*worker:0 epoch \d+ step (\d+) loss", after=goes_on)  # the new process's
    assert int(first.group(1)) > resumed
    assert run.finish() == 0, run.tail()
    pushed = int(run.wait_for(r"^\[worker:0\] .*worker:0 goes on from epoch \d+, batch \d+: its earlier processes "
                              r"pushed its (\d+) batches before").group(1))
    summary = summary_of(tmp_path / "metrics.json")
    assert summary["role"] == "worker:0" and summary["start_step"] == resumed, summary
    assert summary["local_steps"] == STEPS - pushed, "the restarted chief does only the batches it had not pushed"
    assert not summary["partial"] and summary["batches_trained"] == summary["batches_planned"] == 2 * STEPS, summary
    assert summary["global_step"] >= resumed + summary["local_steps"] - 1, \
        f"the restarted chief's steps continue the shards' count from {resumed}: {summary}"
    assert summary["steps_per_second"] == pytest.approx((summary["global_step"] - resumed) / summary["wall_seconds"]), \
        "steps/s counts the steps this incarnation saw, not the restored ones"


# -- a shard that never comes back ------------------------------------------------------------------------

def test_calls_to_a_shard_that_never_comes_back_fail_within_connect_timeout():
    """Without --restart-on-failure a dead shard stays dead: a worker must then fail with ServerUnavailableError
    after its connect_timeout (PSClient's contract), so ps-launch ends, instead of waiting forever."""
    connect_timeout = 3.0
    with LocalCluster(2) as local, PSClient(local.cluster, connect_timeout=connect_timeout) as client:
        client.create_variables({"gone/a": torch.zeros(2), "gone/b": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        client.push({"gone/a": torch.ones(2), "gone/b": torch.ones(2)})  # connected to both shards
        assert local.kill_ps(1) == -signal.SIGKILL
        calls = {"push": lambda: client.push({"gone/a": torch.ones(2), "gone/b": torch.ones(2)}),
                 "pull": lambda: client.pull(["gone/b"]),
                 "status": lambda: client.status(1)}
        outcomes: dict[str, object] = {}

        def call(name: str) -> None:
            started = time.monotonic()
            try:
                calls[name]()
                outcomes[name] = "returned"
            except Exception as exc:  # noqa: BLE001 - checked below
                outcomes[name] = (exc, time.monotonic() - started)

        threads = [threading.Thread(target=call, args=(name,), daemon=True) for name in calls]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + connect_timeout + 7.0
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = sorted(name for name in calls if name not in outcomes)
        if hung:
            local.start_ps(1)  # let the blocked calls end before the client closes
            for thread in threads:
                thread.join(30)
        assert not hung, f"{hung} still blocked {connect_timeout + 7:g} s after ps 1 died (connect_timeout " \
                         f"{connect_timeout:g} s)"
        for name, outcome in outcomes.items():
            assert isinstance(outcome, tuple) and isinstance(outcome[0], ServerUnavailableError), (name, outcome)
            assert local.cluster.ps[1] in str(outcome[0]), f"{name}: the error names the shard: {outcome[0]}"
