"""ps-worker --trace-out: the timelines of a job's tasks overlay (issue #39, item 11c): each task writes its
own pid (1 + its place among the job's training tasks) and wall-clock timestamps (microseconds since the Unix
epoch), so two workers' files opened together line up. No sockets: the worker's own observer, fed steps."""

from __future__ import annotations

import argparse
import json
import time

from torchps.cluster import Cluster, TaskSpec
from torchps.worker.__main__ import _observer

CLUSTER = Cluster(ps=("127.0.0.1:1",), chief=("127.0.0.1:2",), worker=("127.0.0.1:3", "127.0.0.1:4"))


def trace_of(task: TaskSpec, tmp_path) -> dict:
    args = argparse.Namespace(metrics_port=None, trace_out=tmp_path, trace_steps="1-2")
    observer = _observer(CLUSTER, task, args)
    for step in (1, 2):
        observer.begin(step)
        now = time.monotonic()
        observer.tracer("push_pull", 0, now, now + 0.001)
        observer.step(started=now - 0.002, computed=now, ended=now + 0.001, wait_seconds=0.0, stale=0,
                      record={"global_step": step, "loss": 1.0})
    return json.loads((tmp_path / f"{task.type}-{task.index}.trace.json").read_text())


def test_each_task_has_its_own_pid_and_wall_clock_timestamps(tmp_path):
    before = time.time() * 1e6
    traces = {task: trace_of(task, tmp_path) for task in (TaskSpec("chief", 0), TaskSpec("worker", 1))}
    after = time.time() * 1e6
    pids = {task: {e["pid"] for e in trace["traceEvents"]} for task, trace in traces.items()}
    assert pids == {TaskSpec("chief", 0): {1}, TaskSpec("worker", 1): {3}}
    for task, trace in traces.items():
        (name,) = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
        assert name == str(task)
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert {e["name"] for e in spans} == {"compute", "exchange", "push_pull"}
        assert all(before - 5e3 <= e["ts"] <= after + 5e3 for e in spans), "microseconds since the Unix epoch"
