"""The training mode of a job as a value (SyncConfig), and what one push did (PushResult). No gRPC.

    async  every push is applied as it arrives
    sync   SyncReplicasOptimizer: a step's quorum of gradients is averaged and applied once
    ssp    bounded staleness: applied as they arrive, a worker too far ahead waits

The quorum of a sync step is max(1, min(R, live * k)) with k = ceil(R / N)
batches per worker: N > R gives backup workers, a dead, departed or stalled
worker lowers the quorum instead of hanging the job. With a fraction f of the
live workers instead (replicas_fraction), it is max(1, ceil(f * live)), one
batch per worker: it follows the job up as workers join, and down as they go.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from ..errors import InvalidArgumentError

__all__ = ["MODES", "SyncConfig", "PushResult", "quorum_for"]

MODES = ("async", "sync", "ssp")
MAX_REPLICAS = 100_000            # N and R above this are a typo, not a cluster
MAX_STALENESS = 1_000_000
MAX_SECONDS = 7 * 24 * 3600.0     # longest lease, grace or progress timeout accepted


def _seconds(name: str, value: float, *, zero_ok: bool) -> None:
    low_ok = value >= 0 if zero_ok else value > 0
    if not (math.isfinite(value) and low_ok and value <= MAX_SECONDS):
        bound = ">= 0" if zero_ok else "> 0"
        raise InvalidArgumentError(f"{name} must be finite, {bound} and at most {MAX_SECONDS:g} s. Received: {value}")


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """The training mode of a job. Raises InvalidArgumentError for inconsistent or out-of-range values."""

    mode: str = "async"
    replicas_to_aggregate: int = 0  # R; 0 means total_num_replicas
    total_num_replicas: int = 0     # N
    max_staleness: int = 0          # ssp only
    lease_seconds: float = 10.0     # a worker silent this long is presumed dead
    startup_grace_seconds: float = 60.0
    # A worker that pushes nothing for max(progress_seconds, PROGRESS_MULTIPLE x the median push
    # interval) while it still heartbeats (a stuck data loader) is left out like a dead one.
    progress_seconds: float = 60.0
    replicas_fraction: float = 0.0  # f in (0, 1]: the quorum is that share of the live workers; 0: R, fixed

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgumentError(f"unknown mode {self.mode!r}; use one of {list(MODES)}")
        if self.mode != "async" and self.total_num_replicas < 1:
            raise InvalidArgumentError(f"mode {self.mode!r} needs total_num_replicas >= 1 (the number of workers)")
        for name in ("replicas_to_aggregate", "total_num_replicas"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_REPLICAS:
                raise InvalidArgumentError(f"{name} must be in [0, {MAX_REPLICAS}]. Received: {value}")
        if not 0 <= self.max_staleness <= MAX_STALENESS:
            raise InvalidArgumentError(f"max_staleness must be in [0, {MAX_STALENESS}]. Received: {self.max_staleness}")
        if not (math.isfinite(self.replicas_fraction) and 0 <= self.replicas_fraction <= 1):
            raise InvalidArgumentError(f"replicas_fraction must be in (0, 1] (0: none). Received: {self.replicas_fraction}")
        if self.replicas_fraction and self.replicas_to_aggregate:
            raise InvalidArgumentError("give replicas_to_aggregate (a number of gradients) or replicas_fraction (a "
                                       "share of the live workers), not both")
        _seconds("lease_seconds", self.lease_seconds, zero_ok=False)
        _seconds("startup_grace_seconds", self.startup_grace_seconds, zero_ok=True)
        _seconds("progress_seconds", self.progress_seconds, zero_ok=False)

    @property
    def aggregate(self) -> int:
        """R: gradients averaged per step."""
        return self.replicas_to_aggregate or self.total_num_replicas

    @property
    def batches_per_worker(self) -> int:
        """k = ceil(R / N): batches each worker contributes to one step (1 with a fraction)."""
        if self.replicas_fraction:
            return 1
        return max(1, math.ceil(self.aggregate / max(1, self.total_num_replicas)))

    def describe_quorum(self, live: int) -> str:
        """How the quorum for `live` workers is reached, for the shard's log line at each change."""
        if self.replicas_fraction:
            return f"{self.replicas_fraction:.0%} of {live} live workers"
        k = self.batches_per_worker
        return f"{live} live workers{f' x {k} batches' if k > 1 else ''}, R {self.aggregate}"


def quorum_for(config: SyncConfig, live: int) -> int:
    """Gradients a sync step needs with `live` workers counted (0 outside sync mode)."""
    if config.mode != "sync":
        return 0
    if config.replicas_fraction:  # a hair under the product first: 0.75 x 4 is 3, not ceil(3.0000000000000004)
        return max(1, math.ceil(config.replicas_fraction * live - 1e-9))
    return max(1, min(config.aggregate, live * config.batches_per_worker))


@dataclasses.dataclass(frozen=True)
class PushResult:
    """What a push did; mirrors ps.proto's PushResponse."""

    step: int
    next_step: int
    versions: Mapping[str, int] = dataclasses.field(default_factory=dict)
    stale: bool = False
    duplicate: bool = False
    wait_seconds: float = 0.0
    quorum: int = 0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "versions": dict(self.versions)}
