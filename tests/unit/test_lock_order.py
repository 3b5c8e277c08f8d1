"""The lock-order checker (ps_server/locks.py, TORCHPS_LOCK_CHECK=1, which tests/conftest.py sets for the suite):
a shard's own locks taken against LOCK_ORDER raise LockOrderError, naming both locks and the thread, in the
thread that would deadlock. Threads only, no sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from torchps.ps_server import locks
from torchps.ps_server.aggregation import StepBuffer
from torchps.ps_server.gate import ApplyGate
from torchps.ps_server.journal import Journal
from torchps.ps_server.recording import Recorder

checking = pytest.mark.skipif(not locks.CHECKING, reason="runs with TORCHPS_LOCK_CHECK=1 (tests/conftest.py)")
TIMEOUT = 10.0


class Owner:
    """An owner as the shard's are: its state under its own lock, taken by its guarded methods."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    @locks.guarded
    def call(self, inside):
        return inside()


def in_thread(body, name: str) -> BaseException | None:
    """What body() raised in a thread called `name` (None if nothing)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(TIMEOUT)
    assert not thread.is_alive(), f"{name} is stuck"
    return raised[0] if raised else None


@pytest.fixture
def recorder(tmp_path):
    gate = ApplyGate()
    recorder = Recorder(gate, lambda then: {"then": then()})
    journal = Journal(tmp_path)
    journal.start(None)
    recorder.attach(journal)
    yield recorder
    journal.close()


@checking
def test_the_gate_taken_under_the_journal_s_ordering_raises_naming_both_and_the_thread(recorder):
    gate = recorder._gate

    def inverted() -> None:
        with recorder.ordering:
            with gate.change():
                pass

    error = in_thread(inverted, "inverted-taker")
    assert isinstance(error, locks.LockOrderError), error
    message = str(error)
    assert "'inverted-taker'" in message and "the apply gate (gate)" in message, message
    assert "the journal's ordering (ordering)" in message, message
    assert not recorder.ordering.locked(), "the lock held when it raised was let go"
    with gate.snapshot():  # and the gate was never taken
        pass


@checking
def test_the_shard_s_order_is_accepted_and_each_inversion_is_refused(recorder):
    gate, sums, owner = recorder._gate, StepBuffer().lock, Owner()
    cond = threading.Condition(locks.checked(threading.RLock(), "bookkeeping", "the bookkeeping condition"))
    journal = recorder.journal

    def in_order() -> None:
        with gate.change(), recorder.ordering, cond, cond:
            owner.call(lambda: None)
            with sums:
                recorder.log("step", {"step": 0})  # the journal's queue, under the compaction lock too

    assert in_thread(in_order, "in-order") is None
    def sums_under_the_journal_s_queue() -> None:
        with journal._cond, sums:
            pass

    def snapshot_inside_a_change() -> None:
        with gate.change(), gate.snapshot():
            pass

    inversions = {
        "the bookkeeping condition under an owner": lambda: owner.call(lambda: cond.acquire()),
        "two owners at once": lambda: owner.call(lambda: Owner().call(lambda: None)),
        "an owner's own lock again": lambda: owner.call(lambda: owner.call(lambda: None)),
        "a step's sums under the journal's queue": sums_under_the_journal_s_queue,
        "a snapshot inside a change": snapshot_inside_a_change,
    }
    for what, body in inversions.items():
        error = in_thread(body, what)
        assert isinstance(error, locks.LockOrderError), (what, error)
        assert f"thread {what!r} " in str(error), str(error)


@checking
def test_a_wait_on_the_bookkeeping_condition_holding_an_owner_raises(recorder):
    cond = threading.Condition(locks.checked(threading.RLock(), "bookkeeping", "the bookkeeping condition"))
    owner = Owner()

    def waits() -> None:
        with cond:
            owner.call(lambda: cond.wait(0.01))

    error = in_thread(waits, "waiter")
    assert isinstance(error, locks.LockOrderError) and "waits on the bookkeeping condition" in str(error), error


@checking
def test_a_checked_re_entrant_condition_still_lets_go_whole_while_it_waits():
    cond = threading.Condition(locks.checked(threading.RLock(), "bookkeeping", "the bookkeeping condition"))
    waiting, woken = threading.Event(), threading.Event()

    def waiter() -> None:
        with cond, cond:  # held twice: the wait lets go of both
            waiting.set()
            if cond.wait(TIMEOUT):
                woken.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(TIMEOUT)
    assert cond.acquire(timeout=TIMEOUT), "the waiting thread kept the condition's lock"
    cond.notify_all()
    cond.release()
    thread.join(TIMEOUT)
    assert woken.is_set()


@checking
def test_waiting_for_a_journal_record_holding_a_lock_raises(recorder):
    ticket = recorder.log("step", {"step": 1})

    def waits() -> None:
        with recorder.ordering:
            recorder.durable(ticket)

    error = in_thread(waits, "durable-under-ordering")
    assert isinstance(error, locks.LockOrderError) and "the journal's ordering" in str(error), error
    recorder.durable(ticket)  # holding nothing: fine


def test_unset_the_locks_are_the_plain_ones():
    env = {k: v for k, v in os.environ.items() if k != locks.CHECK_ENV}
    code = ("import threading\n"
            "from torchps.ps_server import locks\n"
            "from torchps.ps_server.gate import ApplyGate\n"
            "lock = threading.Lock()\n"
            "f = lambda self: None\n"
            "assert not locks.CHECKING and locks.checked(lock, 'sums', 'x') is lock\n"
            "assert locks.ranked('gate', 'x')(f) is f\n"
            "assert locks.guarded(f).__code__.co_name == 'call'\n"
            "assert ApplyGate.change.__wrapped__.__code__.co_name == 'change'\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
