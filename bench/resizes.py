"""The soak's resize events (bench/soak.py): the job's size changes under chaos, and the pause each change
caused.

A resize kind is an entry of RESIZES: a function `kind(phase)` that changes the size of the running job of a
soak Phase and returns a Resize (when it began and ended, what it did), or None when it cannot happen now
(it is tried again later in the round). The soak's chaos loop draws resize kinds with the fault kinds, each
once per round. Kinds today:

  worker-added    a worker starts under a name the job has no process of: one of the names past the starting
                  spec (credentials minted for it then with `ps-certs --add`, which the shards take from their
                  re-read token file), or one removed before; it ends when the new worker's first push is
                  acknowledged (it joined and trains)
  worker-removed  a live worker other than the chief is asked to leave for good (its leave file): it stops
                  pushing, calls Leave and exits 0; it must be gone within the soak's EXIT_SECONDS
  shard-added     a shard starts (the next index) and the chief resizes the job onto it live
                  (PSClient.resize, what ps-admin resize runs): variables move to it while the workers push;
                  it ends when every variable is at its new shard; at most MAX_SHARDS
  shard-removed   the chief resizes the job off its last shard (never below the starting two): its variables
                  move to the others, then it is stopped
Every kind happens in both phases: a sync job's shard resizes pause it at a step boundary (client/resize.py).

A resize begins once every running worker has had a push acknowledged since the chaos loop turned to it
(at most the soak's STALL_SECONDS): a fault injected before it has settled, and the job trains.

The pause a resize caused (`resize_pause_s`): the longest stretch between two consecutive acknowledged pushes
of the job (every worker's, merged by the time each acknowledgement was logged, CLOCK_MONOTONIC) that overlaps
the resize's span [began, ended + SETTLE_SECONDS]. `resize_pause_p99_s` is the 99th percentile (nearest rank)
of those over a run's resizes. No fault is injected in that span (the chaos loop waits --fault-every between
events, and SETTLE_SECONDS is below its default low end).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from typing import Callable

__all__ = ["Resize", "RESIZES", "SETTLE_SECONDS", "pause_around", "percentile"]

SETTLE_SECONDS = 1.0  # after a resize's end, the span its pause is looked for in
MIN_WORKERS = 2       # worker-removed leaves at least this many (the chief included)
MIN_SHARDS, MAX_SHARDS = 2, 4  # shard-removed and shard-added keep the job between these


@dataclasses.dataclass
class Resize:
    kind: str
    what: str         # e.g. "worker 4"
    began: float      # time.monotonic() when the soak began it
    ended: float      # ... and when it was done (the new worker's first push acknowledged, the removed one gone)
    pause_s: float | None = None  # set by the audit (pause_around)


def worker_added(phase) -> Resize | None:
    """Starts a worker under a name with no process (never used first, then a removed one's)."""
    free = [i for i in range(phase.max_workers) if i not in phase.active]
    if not free:
        return None
    unused = [i for i in free if not phase.log_path(i).exists()]
    index = (unused or free)[0]
    began = time.monotonic()
    phase.ensure_credentials(index)  # minted now for a name past the starting spec: the shards re-read tokens
    phase.start_worker(index)
    phase.await_ack(index, began)
    return Resize("worker-added", f"worker {index}", began, time.monotonic())


def worker_removed(phase) -> Resize | None:
    """Asks a live worker other than the chief to leave for good, and waits for it to exit."""
    removable = sorted(i for i in phase.active if i != 0)
    if len(phase.active) <= MIN_WORKERS or not removable:
        return None
    index = phase.rng.choice(removable)
    began = time.monotonic()
    phase.retire_worker(index)
    return Resize("worker-removed", f"worker {index}", began, time.monotonic())


def shard_added(phase) -> Resize | None:
    """Starts the next shard and resizes the job onto it (the variables that even the load move to it)."""
    shards = phase.live_shards
    if len(shards) >= MAX_SHARDS:
        return None
    began = time.monotonic()
    phase.resize_shards([*shards, phase.add_shard(len(shards))])
    return Resize("shard-added", f"ps {len(shards)}", began, time.monotonic())


def shard_removed(phase) -> Resize | None:
    """Resizes the job off its last shard (its variables move to the others; it is stopped)."""
    shards = phase.live_shards
    if len(shards) <= MIN_SHARDS:
        return None
    began = time.monotonic()
    phase.resize_shards(shards[:-1])
    return Resize("shard-removed", f"ps {len(shards) - 1}", began, time.monotonic())


RESIZES: dict[str, Callable[[object], Resize | None]] = {
    "worker-added": worker_added,
    "worker-removed": worker_removed,
    "shard-added": shard_added,
    "shard-removed": shard_removed,
}


def pause_around(acks: list[float], resize: Resize) -> float:
    """The longest gap between consecutive times in `acks` (sorted) that overlaps [began, ended + SETTLE]; a
    span with no acknowledgement after it counts until the span's end."""
    low, high = resize.began, resize.ended + SETTLE_SECONDS
    first = max(0, bisect.bisect_left(acks, low) - 1)  # the last acknowledgement before the resize began
    last = bisect.bisect_right(acks, high)              # the first one after the span
    times = acks[first:last + 1]
    if not times or times[0] > low:
        times = [low, *times]
    if times[-1] < high:
        times = [*times, high]
    return max(b - a for a, b in zip(times, times[1:]))


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile of `values` by nearest rank, or None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
