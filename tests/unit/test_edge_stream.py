"""The gRPC edge's request streams (ps_server/edge.py's _RequestStream): read on the event loop one message ahead
of the body, which takes them from its own thread. Driven here by an async generator on a real loop thread."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from helpers import wait_until
from torchps.ps_server.edge import CallEnded, _RequestStream


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def on_loop(loop, function):
    async def run():
        return function()
    return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=10)


def waiting(thread: threading.Thread) -> bool:
    """Whether `thread` is inside a threading.Condition's wait."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename == threading.__file__:
            return True
        frame = frame.f_back
    return False


def settle(loop) -> None:
    """Lets the loop run whatever is ready, a few turns."""
    for _ in range(5):
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=10)


def test_messages_arrive_in_order_read_at_most_one_ahead_then_stop(loop):
    pulled = []

    async def source():
        for i in range(5):
            pulled.append(i)
            yield i

    stream = on_loop(loop, lambda: _RequestStream(source(), loop))
    settle(loop)
    assert pulled == [], "nothing is read before the body asks: gRPC refuses an oversized message as it is read"
    taken = [next(stream)]
    wait_until(lambda: len(pulled) >= 2, 10, "the second message read ahead")  # the third may follow
    for expected in range(1, 5):
        settle(loop)
        assert len(pulled) <= len(taken) + 2, (pulled, taken)  # one waits for the body, one for room
        taken.append(next(stream))
        assert taken[-1] == expected
    with pytest.raises(StopIteration):
        next(stream)
    with pytest.raises(StopIteration):
        next(stream)


def test_a_call_ended_before_its_body_asked_reads_nothing(loop):
    pulled = []

    async def source():
        pulled.append("first")
        yield "first"

    stream = on_loop(loop, lambda: _RequestStream(source(), loop))
    stream.close()
    with pytest.raises(CallEnded):
        next(stream)
    settle(loop)
    assert pulled == []


def test_close_ends_a_body_waiting_for_a_message_and_stops_reading(loop):
    finished = threading.Event()

    async def source():
        try:
            yield "first"
            await asyncio.Event().wait()  # the client sends nothing more
            yield "never"
        finally:
            finished.set()

    stream = on_loop(loop, lambda: _RequestStream(source(), loop))
    assert next(stream) == "first"
    raised = []

    def body():
        try:
            next(stream)
        except CallEnded as exc:
            raised.append(exc)

    reader = threading.Thread(target=body)
    reader.start()
    wait_until(lambda: waiting(reader), 10, "the body to wait for a message")
    stream.close()
    reader.join(timeout=10)
    assert not reader.is_alive() and raised, "the body must be told the call ended"
    assert finished.wait(10), "the stream must no longer be read"
    with pytest.raises(CallEnded):
        next(stream)


def test_a_message_waiting_when_the_call_ends_is_not_handed_out(loop):
    pulled = []

    async def source():
        for message in ("first", "second"):
            pulled.append(message)
            yield message

    stream = on_loop(loop, lambda: _RequestStream(source(), loop))
    assert next(stream) == "first"
    wait_until(lambda: len(pulled) >= 2, 10, "the second message read ahead")
    stream.close()
    with pytest.raises(CallEnded):
        next(stream)


def test_what_reading_raised_reaches_the_body_after_the_messages_before_it(loop):
    async def source():
        yield "first"
        raise ValueError("the stream broke")

    stream = on_loop(loop, lambda: _RequestStream(source(), loop))
    assert next(stream) == "first"
    with pytest.raises(ValueError, match="the stream broke"):
        next(stream)
