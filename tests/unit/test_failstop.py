"""Fail-stop (ps_server/failstop.py): a part of a shard that fails stops the whole process, NOT_SERVING first,
with one line naming the cause. Threads, no sockets; the process exit is replaced by a recorder here (the
real exit is shown on a real process in tests/grpc/test_failstop_shard.py)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from helpers import wait_until
from torchps.errors import ServerUnavailableError
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.failstop import EXIT_CODE, FailStop
from torchps.ps_server.modes import SyncConfig
from torchps.ps_server.store import NewVariable, VariableStore

TIMEOUT = 10.0


class Stops:
    """What a FailStop did, in order: "not serving" (its on_stop) and the exit code."""

    def __init__(self):
        self.events: list = []
        self.exited = threading.Event()

    def failstop(self) -> FailStop:
        return FailStop(on_stop=lambda: self.events.append("not serving"), exit=self.exit, what="ps 0")

    def exit(self, code: int) -> None:
        self.events.append(code)
        self.exited.set()


def test_fatal_marks_not_serving_then_logs_one_line_then_exits(caplog):
    stops = Stops()
    failstop = stops.failstop()
    with caplog.at_level(logging.CRITICAL, logger="torchps.ps_server.failstop"):
        with pytest.raises(SystemExit):
            failstop.fatal(OSError(28, "No space left on device"))
    assert stops.events == ["not serving", EXIT_CODE]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "ps 0 stops" in line and "OSError: [Errno 28] No space left on device" in line and "\n" not in line


def test_a_second_fatal_waits_for_the_first_and_exits_once():
    stops = Stops()
    failstop = stops.failstop()
    gate = threading.Event()
    failstop._on_stop = lambda: (gate.wait(TIMEOUT), stops.events.append("not serving"))  # the first is slow
    first = threading.Thread(target=lambda: pytest.raises(SystemExit, failstop.fatal, "first"))
    first.start()
    wait_until(lambda: failstop.cause == "first", TIMEOUT, "the first fatal to start")
    second = threading.Thread(target=lambda: pytest.raises(SystemExit, failstop.fatal, "second"))
    second.start()
    gate.set()
    for thread in (first, second):
        thread.join(TIMEOUT)
        assert not thread.is_alive()
    assert stops.events == ["not serving", EXIT_CODE] and failstop.cause == "first"


def test_a_supervised_thread_that_raises_is_fatal_and_names_itself():
    stops = Stops()
    failstop = stops.failstop()

    def body(values):
        return values["missing"]

    failstop.thread(body, {}, name="lease-reaper").start()
    assert stops.exited.wait(TIMEOUT)
    assert failstop.cause.startswith("lease-reaper failed: KeyError: 'missing' at test_failstop.py:")


def test_a_watched_thread_that_ends_is_fatal_unless_expected():
    stops = Stops()
    failstop = stops.failstop()
    done = threading.Event()
    for name, expected in (("expected", lambda: True), ("endpoint", lambda: False)):
        thread = threading.Thread(target=done.wait, daemon=True)
        thread.start()
        failstop.watch(thread, name, expected=expected)
    done.set()
    assert stops.exited.wait(TIMEOUT)
    assert failstop.cause == "endpoint ended unexpectedly"


def test_a_sync_applier_that_raises_stops_the_shard_instead_of_wedging_it():
    """The issue's wedge: an Adam variable whose optimizer was switched to amsgrad after it stepped (the state an
    accepted UpdateOptimizer {"amsgrad": 1} once left; UpdateOptimizer refuses it now) raises KeyError in the
    applier. Without supervision the applier died with the step's `applying` mark set and the shard went on
    answering; now the process stops."""
    stops = Stops()
    c = Coordinator(VariableStore(), owns_step=True, failstop=stops.failstop())
    try:
        c.configure(SyncConfig(mode="sync", total_num_replicas=1, lease_seconds=30.0))
        c.create([NewVariable("w", torch.zeros(4), "adam", {"lr": 0.1})])
        c.join("worker:0", 1)
        assert c.push("worker:0", 1, 1, 0, {"w": torch.ones(4)}, timeout=TIMEOUT).next_step == 1
        c.store.get("w").optimizer.hyperparams["amsgrad"] = 1.0  # the old UpdateOptimizer's doing
        held = threading.Thread(target=lambda: pytest.raises(ServerUnavailableError, c.push, "worker:0", 1, 2, 1,
                                                             {"w": torch.ones(4)}, timeout=TIMEOUT), daemon=True)
        held.start()  # completes step 1's quorum: the applier applies it, and raises
        assert stops.exited.wait(TIMEOUT)
        assert stops.events == ["not serving", EXIT_CODE]
        assert c.failstop.cause.startswith("sync-applier failed: KeyError: 'max_exp_avg_sq'")
    finally:
        c.close()  # (the real process is gone by now) answers the held push UNAVAILABLE
    held.join(TIMEOUT)
    assert not held.is_alive()
