"""The client's failover watch (client/failover_watch.py): which shards' arbiters are asked, and when a shard
goes quiet. The thread's rounds are run by hand (check()) on a clock the test moves, but in the last test: each slow shard has
its own poller thread, so one arbiter's long poll never delays another shard's."""

from __future__ import annotations

import threading

from torchps.client.failover_watch import POLL_SECONDS, QUIET_SECONDS, WATCH_SECONDS, FailoverWatch


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
    watch = FailoverWatch(lambda shard, wait: asked.append(shard) or shard in moved, lambda shard: shard in replicated,
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


def test_each_slow_shard_has_its_own_poller_so_one_long_poll_never_delays_another_shard():
    """ps:1's arbiter holds its long poll (as it does until a promotion); ps:0's arbiter is asked meanwhile and
    names a new address: ps:0 moves while ps:1's poll still waits. Polls ask with the long poll's wait."""
    asked: dict[int, threading.Event] = {0: threading.Event(), 1: threading.Event()}
    release = threading.Event()
    waits: list[float] = []
    closed = threading.Event()

    def relocate(shard: int, wait: float) -> bool:
        waits.append(wait)
        asked[shard].set()
        if shard == 1:
            release.wait(30)  # the arbiter's long poll: no promotion yet
            return False
        return True  # ps:0 served elsewhere

    watch = FailoverWatch(relocate, lambda shard: True, closed)
    try:
        held = watch.enter(1)
        assert asked[1].wait(30), "ps:1's slow call was never asked about"
        moved = watch.enter(0)
        assert asked[0].wait(30), "ps:0 was not asked about while ps:1's long poll waited"
        assert not release.is_set() and set(waits) == {POLL_SECONDS}
        watch.leave(moved)
        watch.leave(held)
    finally:
        release.set()
        closed.set()
