"""waits.WatchedCondition: watchers called back when their predicate holds, a watcher with a level checked
only once the level is reached (a notify costs nothing per held push of a later step), every watcher at close."""

import threading

from torchps.ps_server.waits import WatchedCondition


class Shard:
    def __init__(self):
        self.step = 0
        self.closed = False
        self.cond = WatchedCondition(threading.RLock(), lambda: self.step)
        self.checks = 0
        self.woken: list[str] = []

    def watch(self, name: str, step: int, level: int | None):
        def ready() -> bool:
            self.checks += 1
            return self.step >= step or self.closed
        return self.cond.watch(ready, lambda: self.woken.append(name), level)

    def advance(self) -> None:
        with self.cond:
            self.step += 1
            self.cond.notify_all()


def test_a_watcher_with_a_level_is_not_checked_before_the_step_reaches_it():
    shard = Shard()
    keys = [shard.watch(f"held{i}", 2, level=2) for i in range(100)]
    assert shard.checks == 100 and all(key is not None for key in keys)  # each checked once, when it was watched
    for _ in range(50):  # notifies of step 0's pushes: no held push is looked at
        with shard.cond:
            shard.cond.notify_all()
    shard.advance()  # step 1: still below the level
    assert shard.checks == 100 and shard.woken == []
    shard.advance()  # step 2: each is checked once, and called back once
    assert shard.checks == 200 and sorted(shard.woken) == sorted(f"held{i}" for i in range(100))
    shard.advance()
    assert shard.checks == 200 and len(shard.woken) == 100


def test_a_watcher_without_a_level_is_checked_at_every_notify_and_forgotten_once_unwatched():
    shard = Shard()
    key = shard.watch("any", 2, level=None)
    shard.advance()
    assert shard.checks == 2 and shard.woken == []
    shard.cond.unwatch(key)
    shard.advance()
    assert shard.checks == 2 and shard.woken == []


def test_a_ready_predicate_calls_back_at_once_and_close_reaches_every_watcher():
    shard = Shard()
    assert shard.watch("now", 0, level=0) is None and shard.woken == ["now"]
    shard.watch("later", 10, level=10)
    with shard.cond:
        shard.closed = True
        shard.cond.notify_all(every=True)
    assert shard.woken == ["now", "later"]
