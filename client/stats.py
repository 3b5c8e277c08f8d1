"""Per-worker training counters, filled by PSClient from its pushes."""

from __future__ import annotations

import dataclasses
import threading
import time

__all__ = ["STAGES", "WorkerStats"]


STAGES = {  # stage -> what its timer covers (client/datapath.py, client/transfer.py)
    "push_call": "a shard's push attempt, from its call to its reply (the shard's receive and apply inside)",
    "push_encode": "making the push's messages (inline: copying the bytes into them)",
    "push_lane_send": "sending the push's bytes on a bulk lane",
    "pull_call": "a shard's pull attempt, from its call to its last byte in place",
    "exchange_call": "a shard's PushPull (a small model's push and pull in one call), call to values in place",
    "pull_into_place": "the pulled bytes into their tensors: read from the lane, or copied out of messages",
}


@dataclasses.dataclass
class WorkerStats:
    """What one worker saw: steps/s, time waiting for step release, stale drops, quorum changes.

    Read it any time (`client.stats`); `summary()` gives a log line.
    """

    pushes: int = 0
    stale_dropped: int = 0       # this worker's gradients the shards dropped as stale (sync)
    duplicates: int = 0          # retried pushes the shards recognised and did not re-apply
    wait_seconds: float = 0.0    # time shard 0 held pushes: step release (sync) or staleness bound (ssp)
    quorum: int = 0              # the quorum shard 0 last reported (sync)
    quorum_changes: int = 0      # times that value changed
    bytes_sent: int = 0          # tensor bytes pushed (as encoded: after compression), retries included
    bytes_received: int = 0      # tensor bytes pulled
    bytes_copied: int = 0        # bytes this process wrote to move those: into push messages, out of pull
                                 # messages into tensors, staging copies and casts (gRPC's own copies excluded)
    delta_tensors: int = 0       # tensors a delta pull received as what changed since the version held
    # Seconds spent in each stage of the data path, summed over shards (their calls run at once, so a step's
    # stages may add up to more than its wall time): see STAGES.
    stage_seconds: dict = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.monotonic)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, *, stale: bool, duplicate: bool, wait_seconds: float, quorum: int) -> None:
        with self._lock:
            self.pushes += 1
            self.stale_dropped += stale
            self.duplicates += duplicate
            self.wait_seconds += wait_seconds
            if quorum and self.quorum and quorum != self.quorum:
                self.quorum_changes += 1
            self.quorum = quorum or self.quorum

    def count_bytes(self, *, sent: int = 0, received: int = 0, copied: int = 0, delta_tensors: int = 0) -> None:
        """Adds to the byte counters and the delta tensors (client/transfer.py calls it; thread-safe)."""
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received
            self.bytes_copied += copied
            self.delta_tensors += delta_tensors

    def add_stage(self, stage: str, seconds: float) -> None:
        """Adds `seconds` to `stage` (one of STAGES; thread-safe)."""
        with self._lock:
            self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + seconds

    @property
    def steps_per_second(self) -> float:
        """Pushes per second since the client started."""
        elapsed = time.monotonic() - self.started
        return self.pushes / elapsed if elapsed > 0 else 0.0

    def as_dict(self) -> dict:
        with self._lock:
            return {"pushes": self.pushes, "steps_per_second": round(self.steps_per_second, 3),
                    "wait_seconds": round(self.wait_seconds, 3), "stale_dropped": self.stale_dropped,
                    "duplicates": self.duplicates, "quorum": self.quorum, "quorum_changes": self.quorum_changes,
                    "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                    "bytes_copied": self.bytes_copied, "delta_tensors": self.delta_tensors,
                    "stage_seconds": {k: round(v, 6) for k, v in self.stage_seconds.items()}}

    def summary(self) -> str:
        """A log line; the quorum only where there is one (sync mode: shard 0 reports it with every push)."""
        d = self.as_dict()
        quorum = f", quorum {d['quorum']} ({d['quorum_changes']} changes)" if d["quorum"] else ""
        return (f"{d['pushes']} pushes, {d['steps_per_second']:.1f} steps/s, waited {d['wait_seconds']:.2f} s for "
                f"release, {d['stale_dropped']} stale dropped{quorum}")
