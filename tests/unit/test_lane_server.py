"""ps_server/lanes.py's LaneServer on 127.0.0.1, alone: lanes welcomed, claimed one call at a time, closed when
their client goes or when no call claims them for its idle limit; its listener never waits on a lane."""

import socket
import threading

import pytest

from helpers import wait_until
from torchps.errors import LaneBrokenError
from torchps.lanes import connect
from torchps.ps_server.lanes import LaneServer


@pytest.fixture
def server():
    lanes = LaneServer("127.0.0.1", 0, idle_seconds=0.5)
    yield lanes
    lanes.close()


def test_a_lane_is_lent_to_one_call_at_a_time_and_kept_in_step(server):
    lane = connect("127.0.0.1", server.port, 10.0)
    wait_until(lambda: server.open_lanes == 1, 10, "the lane to be welcomed")
    claimed = server.claim(lane.key)
    with pytest.raises(LaneBrokenError, match="not open on this shard"):
        server.claim(lane.key, wait=0)  # in another call
    server.release(claimed, ok=True)
    assert server.claim(lane.key) is claimed  # idle again, in step
    server.release(claimed, ok=False)  # a call that failed: closed
    assert server.open_lanes == 0 and claimed.closed
    with pytest.raises(LaneBrokenError):
        server.claim(lane.key)


def test_a_call_naming_a_lane_its_last_call_still_holds_gets_it_once_that_call_gives_it_back(server):
    """A client lends a lane to its next call once the last one answered; a streamed answer (Pull) reaches it
    before that call's body on the shard has given the lane back. The next call's claim waits for the give-back
    instead of failing (a failure costs the client a retry on a new lane: tests/grpc/test_lanes_streamed.py
    saw two lanes opened where one was kept)."""
    lane = connect("127.0.0.1", server.port, 10.0)
    wait_until(lambda: server.open_lanes == 1, 10, "the lane to be welcomed")
    last_call = server.claim(lane.key)
    got = {}
    next_call = threading.Thread(target=lambda: got.setdefault("lane", server.claim(lane.key, wait=30)))
    next_call.start()
    wait_until(lambda: server.claims_waited == 1, 10, "the next call's claim to wait for the lane")
    server.release(last_call, ok=True)
    next_call.join(30)
    assert got["lane"] is last_call and server.open_lanes == 1


def test_an_idle_lane_is_closed_at_its_limit_and_one_its_client_closed_at_once(server):
    idle = connect("127.0.0.1", server.port, 10.0)
    idle.sock.settimeout(10.0)
    assert idle.sock.recv(1) == b""  # the server closed it: no call claimed it for 0.5 s
    patient = LaneServer("127.0.0.1", 0)  # the default limit: only its client's close ends this lane
    try:
        gone = connect("127.0.0.1", patient.port, 10.0)
        wait_until(lambda: patient.open_lanes == 1, 10, "the lane to be welcomed")
        gone.sock.shutdown(socket.SHUT_RDWR)
        gone.close()
        wait_until(lambda: patient.open_lanes == 0, 10, "the lane its client closed to be dropped")
    finally:
        patient.close()


def test_the_listener_checks_a_lane_a_call_took_since_its_poll_without_waiting():
    """The listener's poll saw an idle lane readable (a push's frame, sent as its call started); the call then
    claimed the lane, read the frame within its deadline and gave the lane back before the listener looked.
    That look returns at once and keeps the lane. It used to peek at the lane in the listener's thread with
    the socket's timeout the call left, and so waited for that lane's next frame, up to the deadline, welcoming
    no new lane meanwhile: the 2-minute soak at f81ee7b stood still 10 s (the progress timeout) after a shard
    was removed, a worker's new lane to a shard unwelcomed while the others waited for its push there."""
    server = LaneServer("127.0.0.1", 0)
    try:
        lane = connect("127.0.0.1", server.port, 10.0)
        wait_until(lambda: server.open_lanes == 1, 10, "the lane to be welcomed")
        lane.send([b"frame"], 10.0)
        claimed = server.claim(lane.key)
        claimed.begin(len(b"frame"), 60.0)  # the call's deadline: the socket keeps what is left of it
        claimed.read_into(memoryview(bytearray(len(b"frame"))))
        server.release(claimed, ok=True)
        look = threading.Thread(target=server._check_idle, args=(claimed,), daemon=True)  # the listener's look
        look.start()
        look.join(timeout=5.0)
        assert not look.is_alive(), "the listener's look at an idle lane waited for its next frame"
        assert server.claim(lane.key) is claimed  # still open, in step, for the client's next call
    finally:
        server.close()
