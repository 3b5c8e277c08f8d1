"""What a worker shows of its steps: Prometheus metrics (ps-worker --metrics-port) and a timeline
(ps-worker --trace-out), a Chrome-trace JSON of chosen steps' phases as BytePS's timeline has them;
and an evaluator's metrics (its evaluations, accuracy and step).

The trainer reports each step's compute and exchange times (`StepObserver.step`); the client reports
every shard's push, pull and push_pull call (`StepObserver.tracer`, set as PSClient.tracer). The
timeline shows, per step: compute (forward and backward) and exchange on the worker's track, each
shard's calls on a track of its own, and the time shard 0 held the push (a sync release, the ssp bound)
as `wait` at the end of its call. Open the file in Perfetto (ui.perfetto.dev) or chrome://tracing.
The files of a job's tasks can be opened together: each task is a process of its own (its pid, the
task's place among the job's training tasks from 1), and timestamps are wall-clock microseconds since
the Unix epoch (hosts' clocks as NTP keeps them).
"""

from __future__ import annotations

import json
import logging
import pathlib
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

__all__ = ["StepObserver", "WorkerMetrics", "EvaluatorMetrics", "Timeline", "parse_step_range"]

_LOGGER = logging.getLogger(__name__)


def parse_step_range(text: str) -> tuple[int, int]:
    """'10-20' -> (10, 20): this worker's own steps, both included; ValueError otherwise."""
    first, sep, last = text.partition("-")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a, b = -1, -1
    if not sep or not 1 <= a <= b:
        raise ValueError(f"not a step range: {text!r} (FIRST-LAST, 1 <= FIRST <= LAST)")
    return a, b


class EvaluatorMetrics:
    """An evaluator's Prometheus metrics, in a registry of its own (with the standard process_* figures)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.evaluations = Counter("torchps_evaluator_evaluations", "Evaluations made", registry=self.registry)
        self.accuracy = Gauge("torchps_evaluator_accuracy", "Test accuracy at the last evaluation",
                              registry=self.registry)
        self.global_step = Gauge("torchps_evaluator_global_step", "The global step the last evaluation was of",
                                 registry=self.registry)

    def evaluated(self, step: int, accuracy: float) -> None:
        self.evaluations.inc()
        self.accuracy.set(accuracy)
        self.global_step.set(step)


class WorkerMetrics:
    """One worker's Prometheus metrics, in a registry of its own (with the standard process_* figures)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.steps = Counter("torchps_worker_steps", "Training steps this worker made", registry=r)
        self.step_seconds = Histogram("torchps_worker_step_seconds", "A training step: compute, then exchange",
                                      registry=r)
        self.compute_seconds = Histogram("torchps_worker_compute_seconds", "Forward and backward of a step",
                                         registry=r)
        self.exchange_seconds = Histogram("torchps_worker_exchange_seconds",
                                          "Push and pull of a step, waits for a release included", registry=r)
        self.wait_seconds = Counter("torchps_worker_wait_seconds",
                                    "Time shard 0 held this worker's pushes (sync release, ssp bound)", registry=r)
        self.stale = Counter("torchps_worker_stale_gradients", "This worker's gradients dropped as stale",
                             registry=r)
        self.global_step = Gauge("torchps_worker_global_step", "The global step after this worker's last push",
                                 registry=r)
        self.loss = Gauge("torchps_worker_loss", "The training loss of this worker's last step", registry=r)

class Timeline:
    """Chrome-trace events of this worker's steps `first`..`last`, written to `path` by `write`, as process
    `pid` (unique in the job, so several tasks' files overlay) at wall-clock timestamps."""

    def __init__(self, path: pathlib.Path, task: str, first: int, last: int, pid: int):
        self.path, self.task, self.first, self.last, self.pid = path, task, first, last, pid
        self.wall_offset = time.time() - time.monotonic()  # monotonic seconds -> Unix time, read once
        self.events: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": task}},
                                   {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "step"}}]
        self._shards: set[int] = set()
        self._lock = threading.Lock()  # shards' spans arrive from the client's threads

    def wants(self, local_step: int) -> bool:
        return self.first <= local_step <= self.last

    def span(self, name: str, tid: int, start: float, end: float, step: int) -> None:
        with self._lock:
            self.events.append({"ph": "X", "name": name, "pid": self.pid, "tid": tid,
                                "ts": (start + self.wall_offset) * 1e6, "dur": max(0.0, end - start) * 1e6,
                                "args": {"step": step}})

    def shard_span(self, name: str, shard: int, start: float, end: float, step: int) -> None:
        with self._lock:
            if shard not in self._shards:
                self._shards.add(shard)
                self.events.append({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": 1 + shard,
                                    "args": {"name": f"ps:{shard}"}})
        self.span(name, 1 + shard, start, end, step)

    def write(self) -> None:
        with self._lock:
            document = {"traceEvents": list(self.events), "displayTimeUnit": "ms",
                        "otherData": {"task": self.task, "steps": [self.first, self.last]}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(document))
        _LOGGER.info("%s: timeline of steps %d-%d written to %s (open it in ui.perfetto.dev)", self.task,
                     self.first, self.last, self.path)


class StepObserver:
    """Feeds a worker's steps to its metrics and its timeline (either may be None)."""

    def __init__(self, metrics: WorkerMetrics | None = None, timeline: Timeline | None = None):
        self.metrics = metrics
        self.timeline = timeline
        self.local_step = 0  # the step in progress (1-based), for the client's spans
        self._lead_push: tuple[float, float] | None = None  # shard 0's push call in this step

    def tracer(self, phase: str, shard: int, start: float, end: float) -> None:
        """PSClient.tracer: one shard's data-path call."""
        if self.timeline is not None and self.timeline.wants(self.local_step):
            self.timeline.shard_span(phase, shard, start, end, self.local_step)
            if shard == 0 and phase in ("push", "push_pull"):
                self._lead_push = (start, end)

    def begin(self, local_step: int) -> None:
        self.local_step = local_step
        self._lead_push = None

    def step(self, *, started: float, computed: float, ended: float, wait_seconds: float, stale: int,
             record: dict) -> None:
        """One finished step: compute from `started` to `computed`, exchange from there to `ended`."""
        if self.metrics is not None:
            m = self.metrics
            m.steps.inc()
            m.step_seconds.observe(ended - started)
            m.compute_seconds.observe(computed - started)
            m.exchange_seconds.observe(ended - computed)
            m.wait_seconds.inc(wait_seconds)
            m.stale.inc(stale)
            m.global_step.set(record["global_step"])
            m.loss.set(record["loss"])
        timeline = self.timeline
        if timeline is not None and timeline.wants(self.local_step):
            timeline.span("compute", 0, started, computed, self.local_step)
            timeline.span("exchange", 0, computed, ended, self.local_step)
            if wait_seconds > 0 and self._lead_push is not None:
                _, end = self._lead_push
                timeline.shard_span("wait", 0, max(self._lead_push[0], end - wait_seconds), end, self.local_step)
            if self.local_step == timeline.last:
                timeline.write()

    def close(self) -> None:
        """Writes the timeline if its last step was never reached (a short run)."""
        if self.timeline is not None and self.timeline.first <= self.local_step < self.timeline.last:
            self.timeline.write()
