"""`ps-worker --dense allreduce` when a worker is lost, and the flags it refuses.

Two real ps-worker processes train in one all-reduce group against a real shard; one is SIGKILLed once it
has logged its third step (an event read from its output, never a sleep). The other must stop by itself,
well within the group's timeout (gloo sees the connection close; the lost member's liveness socket no
longer answers), with exit code 1 and exactly one line on stderr naming the member lost and why the group
cannot go on, no traceback. Killing the chief (rank 0, which also serves the rendezvous store) and killing a
worker are both covered. At the API level (forkserver processes, no shard): a member stalled (SIGSTOP:
alive, silent) is named after the group's timeout, and a member that left the group early (its loop ran
fewer steps) is named as such by the one still waiting. Usage errors are one line and exit code 2 before
anything starts.
"""

from __future__ import annotations

import json
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import forkserver_context, free_port
from test_launch import PS_LAUNCH, PS_WORKER, environ

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import hybrid_workers  # noqa: E402 - needs the path above under any import mode

CTX = forkserver_context()  # fresh processes, never forked from this gRPC-threaded one

HERE = pathlib.Path(__file__).resolve().parent
GROUP_TIMEOUT = 60.0  # the collective's own timeout: the survivor must stop long before it
STOP_BOUND = 20.0     # seconds from the kill to the survivor's exit (detection < 1 s, probes 2 s, leaving 3 s)
START_BOUND = 90.0    # two workers importing torch on a loaded 2-core machine
PROBE_SLACK = 7.0     # what a diagnosis may add to a timeout: a liveness probe (2 s), slack for a loaded machine
STEP = re.compile(r" epoch \d+ step (\d+) loss ")


class Worker:
    """A ps-worker process whose stdout and stderr are read as they come (lines kept, events signalled)."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=environ([HERE]))
        self.out: list[str] = []
        self.err: list[str] = []
        self.steps = 0
        self.stepped = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))
            match = STEP.search(line)
            if match:
                with self.stepped:
                    self.steps = max(self.steps, int(match.group(1)))
                    self.stepped.notify_all()
        with self.stepped:
            self.stepped.notify_all()

    def wait_for_step(self, step: int, timeout: float) -> None:
        with self.stepped:
            assert self.stepped.wait_for(lambda: self.steps >= step or self.proc.poll() is not None, timeout), \
                f"no step {step} logged within {timeout} s:\n" + "\n".join(self.out[-20:] + self.err[-20:])
        assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before step {step}:\n" + \
            "\n".join(self.out[-20:] + self.err[-20:])

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.mark.parametrize("victim", [1, 0], ids=["worker-lost", "chief-lost"])
def test_a_lost_worker_stops_the_other_with_one_line(local_cluster, victim):
    shard = local_cluster(1)
    cluster = json.dumps({"ps": list(shard.cluster.ps), "worker": [f"127.0.0.1:{free_port()}" for _ in range(2)]})
    workers = [Worker([*PS_WORKER, "--cluster", cluster, "--task-type", "worker", "--index", str(i),
                       "--dense", "allreduce", "--entry", "hybrid_entry:task", "--steps", "1000000",
                       "--batch-size", "8", "--log-every", "0.000001", "--allreduce-timeout", str(GROUP_TIMEOUT),
                       "--insecure"])
               for i in range(2)]
    try:
        lost, survivor = workers[victim], workers[1 - victim]
        lost.wait_for_step(3, START_BOUND)
        lost.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        lost.proc.wait()
        code = survivor.finish(STOP_BOUND)
        took = time.monotonic() - killed
    finally:
        for worker in workers:
            worker.kill()
    assert code == 1, "\n".join(survivor.out[-10:] + survivor.err)
    assert took < STOP_BOUND < GROUP_TIMEOUT
    assert len(survivor.err) == 1, "\n".join(survivor.err)
    line = survivor.err[0]
    assert not any("Traceback" in l for l in survivor.out + survivor.err)
    assert line.startswith(f"ps-worker: worker:{1 - victim}: AllreduceError: lost worker:{victim} ("), line
    assert "its process is gone" in line and "cannot go on" in line, line
    assert survivor.steps >= 3  # it trained in step with the lost one until then


def test_a_member_that_left_early_is_named_as_such():
    cluster = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(2)], "ps": ["127.0.0.1:1"]}  # no shard needed
    results, done = CTX.Queue(), CTX.Event()
    procs = [CTX.Process(target=hybrid_workers.uneven_member, args=(cluster, i, steps, results, done), daemon=True)
             for i, steps in enumerate([4, 3])]
    for proc in procs:
        proc.start()
    try:
        outcomes = dict(results.get(timeout=60) for _ in procs)
    except queue.Empty:
        outcomes = None
    finally:
        done.set()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    assert outcomes is not None, "a member reported nothing within 60 s"
    assert outcomes[1] == "ok"
    assert outcomes[0].startswith("worker:1 already left the all-reduce group, so step 4's all-reduce cannot "
                                  "complete: the members ran different numbers of steps; worker:0 stops ["), \
        outcomes[0]


def test_a_stalled_member_is_named_after_the_groups_timeout():
    """A member alive but silent (SIGSTOP) sends no error: the other's all-reduce ends at the group's timeout,
    and the member is named as not answering."""
    timeout = 3.0
    cluster = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(2)], "ps": ["127.0.0.1:1"]}
    results = CTX.Queue()
    procs = [CTX.Process(target=hybrid_workers.stalling_member, args=(cluster, i, stall, timeout, results),
                         daemon=True) for i, stall in enumerate([None, 5])]
    for proc in procs:
        proc.start()
    try:
        steps, message, took = results.get(timeout=60)
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
    assert steps == 5
    assert timeout <= took < timeout + PROBE_SLACK, took
    assert message.startswith("lost worker:1 (it did not answer within 2 s: stalled, or its host unreachable) "
                              "during step 6's all-reduce; the all-reduce group cannot go on"), message


@pytest.mark.parametrize("command, flags, refused", [
    (PS_WORKER, ["--overlap"], "--overlap"),
    (PS_LAUNCH, ["--restart-on-failure"], "--restart-on-failure"),
], ids=["worker-overlap", "launch-restart"])  # every refusal, in process: tests/unit/test_allreduce.py
def test_flags_that_cannot_work_are_one_line_and_exit_2(command, flags, refused):
    task = ["--cluster", '{"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}', "--task-type", "worker"] \
        if command is PS_WORKER else []
    run = subprocess.run([*command, *task, "--dense", "allreduce", "--entry", "hybrid_entry:task", *flags],
                         capture_output=True, text=True, env=environ([HERE]), timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--dense allreduce cannot be combined with {refused}:" in lines[0], run.stderr
