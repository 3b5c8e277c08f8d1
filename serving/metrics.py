"""A serving replica's Prometheus metrics (ps-serve --metrics-port): its version, staleness, rows, the rows it
applies, its lookups' latency and its loss guard's refusals, read from the replica and its follower when scraped."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServingMetrics"]

LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class ServingMetrics:
    """The registry ps-serve serves at /metrics; observe_lookup(seconds) times each Lookup."""

    def __init__(self, replica, follower):
        self.registry = CollectorRegistry()
        self._replica, self._follower = replica, follower
        self._lookups = Histogram("torchps_serving_lookup_seconds", "Lookup calls: arrival to reply, in the replica",
                                  buckets=LOOKUP_BUCKETS, registry=self.registry)
        self.registry.register(self)

    def observe_lookup(self, seconds: float) -> None:
        self._lookups.observe(seconds)

    def collect(self):
        current, kept, held, rows = self._replica.status()
        follower = self._follower
        for name, what, value in (
                ("torchps_serving_version", "the version answered now", current.version),
                ("torchps_serving_step", "the training step the version answered reflects", current.step),
                ("torchps_serving_staleness_seconds", "since the newest read that found the replica current",
                 max(0.0, time.time() - follower.fresh_at) if follower.fresh_at else 0.0),
                ("torchps_serving_behind_steps", "ps 0's step at the last read minus the version's",
                 max(0, follower.step - current.step)),
                ("torchps_serving_rows", "rows held over all tables", rows),
                ("torchps_serving_kept_versions", "versions a rollback may go back to", len(kept)),
                ("torchps_serving_held", "1 while held on its version (hold or rollback)", int(held)),
                ("torchps_serving_read_failing", "1 while the last read of the shards failed",
                 int(bool(follower.error) and not follower.refusal)),
                ("torchps_serving_guard_loss", "the loss guard's last candidate loss (NaN: no guard)",
                 follower.guard.last if follower.guard is not None else float("nan"))):
            yield GaugeMetricFamily(name, what, value=value)
        for name, what, value in (("torchps_serving_rows_applied", "rows of changes published", follower.rows_applied),
                                  ("torchps_serving_resyncs", "tables read whole", follower.resyncs),
                                  ("torchps_serving_rounds", "reads of the shards", follower.rounds),
                                  ("torchps_serving_guard_refused", "versions the loss guard refused",
                                   follower.guard.refused if follower.guard is not None else 0)):
            yield CounterMetricFamily(name, what, value=value)
