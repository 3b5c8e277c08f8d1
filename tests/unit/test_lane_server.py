"""ps_server/lanes.py's LaneServer on 127.0.0.1, alone: lanes welcomed, claimed one call at a time, closed when
their client goes or when no call claims them for its idle limit."""

import socket

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
        server.claim(lane.key)  # in another call
    server.release(claimed, ok=True)
    assert server.claim(lane.key) is claimed  # idle again, in step
    server.release(claimed, ok=False)  # a call that failed: closed
    assert server.open_lanes == 0 and claimed.closed
    with pytest.raises(LaneBrokenError):
        server.claim(lane.key)


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
