"""Prometheus metrics of one shard, served over HTTP at /metrics by `ps-server --metrics-port`.

Names follow Prometheus's conventions: a `torchps_` prefix, base units
(`_seconds`, `_bytes`), `_total` on counters, and no per-variable labels (the
scrape target names the shard); only the workers' pace carries a `worker`
label, one series per worker of the job, and the failed calls a `method` and
`code` label. Counters and gauges are read from the shard's own figures when
scraped (the ones GetStatus reports); histograms and the failed calls are
observed as they happen. prometheus_client's process collector adds the
standard `process_*` figures (CPU seconds, start time: a restart). Each shard
has its own registry: nothing here is process-global.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..metrics_http import serve_metrics

__all__ = ["ShardMetrics"]

STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


class ShardMetrics:
    """The metrics of one shard; `watch(servicer)` connects the scrape-time figures, `serve` the endpoint."""

    def __init__(self, port: int = 0) -> None:
        self.port = port  # where `serve` listens (0: a free port)
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.push_seconds = Histogram(
            "torchps_push_seconds", "Push calls, from the handler's start to its reply (waits included)",
            registry=self.registry)
        self.apply_seconds = Histogram(
            "torchps_apply_seconds", "Time a push spent being counted and applied: its call less its wait",
            registry=self.registry)
        self.wait_seconds = Histogram(
            "torchps_push_wait_seconds", "Time a push was held: a sync step's release, the ssp bound",
            registry=self.registry)
        self.staleness = Histogram(
            "torchps_push_staleness_steps", "Steps between the step a gradient was computed at and the shard's",
            buckets=STALENESS_BUCKETS, registry=self.registry)
        self.checkpoint_seconds = Histogram(
            "torchps_checkpoint_save_seconds", "Time to snapshot and write this shard's part of a checkpoint",
            registry=self.registry)
        self.journal_wait_seconds = Histogram(
            "torchps_journal_wait_seconds", "Time a change waited for its journal record to be written before "
            "it was acknowledged", registry=self.registry)
        self.calls = Counter("torchps_calls", "RPC calls answered, by method (failed ones too)", ["method"],
                             registry=self.registry)
        self.failed_calls = Counter(
            "torchps_calls_failed", "RPC calls that ended with an error status, by method and status code",
            ["method", "code"], registry=self.registry)
        self.last_checkpoint: float | None = None  # wall clock of the last successful save

    def pushed(self, seconds: float, wait_seconds: float, staleness: int, duplicate: bool) -> None:
        """One push answered (a duplicate is timed, but its staleness and apply are the original's)."""
        self.push_seconds.observe(seconds)
        if not duplicate:
            self.wait_seconds.observe(wait_seconds)
            self.apply_seconds.observe(max(0.0, seconds - wait_seconds))
            self.staleness.observe(max(0, staleness))

    def saved(self, seconds: float) -> None:
        self.checkpoint_seconds.observe(seconds)
        self.last_checkpoint = time.time()

    def answered(self, method: str) -> None:
        """One call of `method` ended, whatever its status."""
        self.calls.labels(method).inc()

    def failed(self, method: str, code: str) -> None:
        """One call of `method` ended with status `code` (a grpc.StatusCode's name, not OK)."""
        self.failed_calls.labels(method, code).inc()

    def watch(self, servicer) -> None:
        """Adds the scrape-time figures of `servicer` (a ParameterServerServicer) to the registry, and times
        its waits for the journal."""
        self.registry.register(_ShardCollector(servicer, self))
        servicer.coordinator.recorder.on_wait = self.journal_wait_seconds.observe

    def serve(self, host: str, failstop=None) -> int:
        """Starts the /metrics endpoint (a daemon thread) on host, at `port`; returns the port it got. With
        `failstop` (failstop.FailStop), the process stops if that thread ever ends."""
        watch = None if failstop is None else lambda thread: failstop.watch(thread, "the metrics endpoint")
        self.port = serve_metrics(self.registry, host, self.port, watch)
        return self.port


class _ShardCollector:
    """Reads the shard's counters, sizes and memory at scrape time."""

    def __init__(self, servicer, metrics: ShardMetrics):
        self.servicer = servicer
        self.metrics = metrics

    def describe(self):
        return []  # figures are read when scraped; nothing to check at registration

    def collect(self):
        s = self.servicer
        values, state = s.held_bytes()
        counters = s.coordinator.counters()
        memory = s.memory.get()
        for name, doc, value in (
                ("torchps_push_received_bytes", "Gradient bytes taken in by Push and PushPull", s.push_bytes.value),
                ("torchps_pull_sent_bytes", "Value bytes encoded into Pull and PushPull replies", s.pull_bytes.value),
                ("torchps_calls_started", "RPC handlers entered", s.calls_started.value),
                ("torchps_calls_finished", "RPC handlers returned, whatever the outcome", s.calls_done.value),
                ("torchps_stale_gradients_dropped", "Sync gradients dropped as stale", counters["stale_dropped"]),
                ("torchps_duplicate_pushes", "Retried pushes recognised and not applied again",
                 counters["duplicates"]),
                ("torchps_workers_expired", "Worker leases that ran out", counters["workers_expired"]),
                ("torchps_workers_stalled", "Workers left out for making no progress", counters["workers_stalled"]),
                ("torchps_quorum_changes", "Times the sync quorum changed", counters["quorum_changes"]),
                ("torchps_pull_cache_hits", "Pulls of a variable sent from bytes another pull made",
                 s.pull_cache.hits)):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, value in (
                ("torchps_step", "The shard's step counter", s.store.step),
                ("torchps_variables", "Variables held", len(s.store.names())),
                ("torchps_values_bytes", "Bytes of variable values held", values),
                ("torchps_optimizer_state_bytes", "Bytes of optimizer state held", state),
                ("torchps_resident_bytes", "The process's resident set size", memory["rss_bytes"]),
                ("torchps_live_workers", "Workers holding a lease", counters["live_workers"]),
                ("torchps_quorum", "Gradients a sync step needs now", counters["quorum"]),
                ("torchps_waiting_calls", "Calls waiting now (held pushes, min_step pulls, saves)",
                 counters["waiting_calls"]),
                ("torchps_push_receiving_bytes", "Bytes reserved for pushes being received (within --max-memory)",
                 s.quotas.in_flight),
                ("torchps_pull_cache_bytes", "Bytes the pull cache holds (within --max-memory)", s.pull_cache.nbytes),
                ("torchps_layout_epoch", "The job's layout epoch this shard knows (each live resize adds one)",
                 s.coordinator.layout.epoch)):
            yield GaugeMetricFamily(name, doc, value=value)
        if s.coordinator.resizes is not None:  # ps 0 owns the job's live resize
            yield GaugeMetricFamily("torchps_resize_running", "1 while a live resize runs (ps 0), else 0",
                                    value=int(s.coordinator.resizes.running))
        if s.replication is not None:
            replication = s.replication.status()
            for name, doc, value in (
                    ("torchps_replication_backup", "1 while a backup in sync follows this shard, else 0",
                     int(replication.in_sync)),
                    ("torchps_replication_lag_records", "Records handed to the backup and not acknowledged yet",
                     replication.lag_records),
                    ("torchps_replication_lag_seconds", "Seconds the oldest record the backup has not acknowledged "
                     "has waited", replication.lag_seconds)):
                yield GaugeMetricFamily(name, doc, value=value)
            yield CounterMetricFamily("torchps_replication_store_bytes", "Bytes of SSD tables' store files sent to "
                                      "backups with journal bases", value=replication.store_bytes_sent)
        if s.coordinator.replicas is not None:  # the record of who serves each replicated shard (ps 0)
            failovers = sum(entry["failovers"] for _, entry in s.coordinator.replicas.entries())
            yield CounterMetricFamily("torchps_failovers", "Backups promoted in their primary's place, as this "
                                      "shard's record of the replicated shards holds them", value=failovers)
        if s.lanes is not None:
            yield GaugeMetricFamily("torchps_open_lanes", "Bulk lanes clients hold open to this shard",
                                    value=s.lanes.open_lanes)
        paces = s.coordinator.paces()
        interval = GaugeMetricFamily("torchps_worker_push_interval_seconds",
                                     "A live worker's pace: moving average of its push intervals", labels=["worker"])
        score = GaugeMetricFamily("torchps_worker_straggler_score",
                                  "A live worker's push interval over the median of the others'", labels=["worker"])
        for worker, (seconds, ratio) in paces.items():
            interval.add_metric([worker], seconds)
            score.add_metric([worker], ratio)
        yield interval
        yield score
        if self.metrics.last_checkpoint is not None:
            yield GaugeMetricFamily("torchps_checkpoint_age_seconds", "Seconds since this shard's last save",
                                    value=time.time() - self.metrics.last_checkpoint)
