"""The client's failover watch (client/failover_watch.py): which shards' arbiters are asked, and when a shard
goes quiet. The thread's rounds are run by hand (check()) on a clock the test moves."""

from __future__ import annotations

import threading

from torchps.client.failover_watch import QUIET_SECONDS, WATCH_SECONDS, FailoverWatch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch_of(replicated: set[int], moved: set[int]):
    asked: list[int] = []
    clock = Clock()
    stopped = threading.Event()
    stopped.set()  # no watcher rounds of its own: the test runs them
    watch = FailoverWatch(lambda shard: asked.append(shard) or shard in moved, lambda shard: shard in replicated,
                          stopped, clock)
    return watch, clock, asked


def test_only_calls_in_flight_for_the_watch_interval_have_their_shard_asked_about():
    watch, clock, asked = watch_of(replicated={1}, moved=set())
    first = watch.enter(1)
    watch.enter(2)
    clock.now += WATCH_SECONDS / 2
    watch.check()
    assert asked == [], "nothing in flight long enough yet"
    clock.now += WATCH_SECONDS
    watch.check()
    assert asked == [1, 2] and watch.asked == 2
    watch.leave(first)
    watch.check()
    assert asked == [1, 2], "ps:1's call ended; ps:2 (no backup) is quiet"


def test_a_shard_its_arbiter_records_no_backup_for_goes_quiet_a_replicated_one_never():
    watch, clock, asked = watch_of(replicated={1}, moved=set())
    watch.enter(1)
    watch.enter(2)
    clock.now += WATCH_SECONDS
    watch.check()
    watch.check()
    assert asked == [1, 2, 1], "ps:2 has no backup: asked once, then quiet"
    clock.now += QUIET_SECONDS
    watch.check()
    assert asked == [1, 2, 1, 1, 2], "asked again once the quiet time is over"


def test_a_shard_served_elsewhere_stays_watched_until_its_calls_end():
    watch, clock, asked = watch_of(replicated=set(), moved={3})
    number = watch.enter(3)
    clock.now += WATCH_SECONDS
    watch.check()
    watch.check()
    assert asked == [3, 3], "relocated: its calls are sent again, not quiet"
    watch.leave(number)
    watch.check()
    assert asked == [3, 3]
