"""client/lanes.py's ClientLanes against two LaneServers on 127.0.0.1: what it keeps of a shard (its lanes,
its lane port, a spell of inline calls) belongs to the address the shard is served at, and is let go when the
shard is served elsewhere (its backup was promoted)."""

import socket
import threading

import pytest

from helpers import wait_until
from torchps.client.lanes import ClientLanes
from torchps.ps_server.lanes import LaneServer

MIB = 1 << 20


@pytest.fixture
def servers():
    both = [LaneServer("127.0.0.1", 0), LaneServer("127.0.0.1", 0)]
    yield both
    for server in both:
        server.close()


def test_lanes_kept_for_a_shard_are_let_go_once_it_is_served_elsewhere(servers):
    old, new = servers
    where = {"address": "127.0.0.1:1001"}
    ports = {"127.0.0.1:1001": old.port, "127.0.0.1:1002": new.port}
    lanes = ClientLanes(lambda shard: where["address"], lambda shard: ports[where["address"]])
    kept, late = lanes.borrow(0, MIB, 10), lanes.borrow(0, MIB, 10)
    lanes.give_back(0, kept, ok=True)
    assert lanes.borrow(0, MIB, 10) is kept  # kept for the next call where it was opened
    lanes.give_back(0, kept, ok=True)
    wait_until(lambda: old.open_lanes == 2, 10, "the old address's two lanes")
    where["address"] = "127.0.0.1:1002"  # the shard's backup was promoted
    moved = lanes.borrow(0, MIB, 10)
    assert moved is not kept and kept.closed and lanes.opened == 3
    wait_until(lambda: new.open_lanes == 1, 10, "a lane at the new address")
    lanes.give_back(0, late, ok=True)  # borrowed before the move: closed, never lent again
    assert late.closed
    wait_until(lambda: old.open_lanes == 0, 10, "the old address's lanes to close")
    lanes.give_back(0, moved, ok=True)
    assert lanes.borrow(0, MIB, 10) is moved
    lanes.close()


def test_a_shard_sent_inline_where_its_lanes_failed_gets_lanes_again_at_its_new_address(servers):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed = unused.getsockname()[1]  # nothing listens there once closed
    where = {"address": "127.0.0.1:1001"}
    ports = {"127.0.0.1:1001": closed, "127.0.0.1:1002": servers[1].port}
    lanes = ClientLanes(lambda shard: where["address"], lambda shard: ports[where["address"]])
    assert lanes.borrow(0, MIB, 10) is None and lanes.borrow(0, MIB, 10) is None  # inline: NO_LANE_SECONDS
    where["address"] = "127.0.0.1:1002"
    lane = lanes.borrow(0, MIB, 10)
    assert lane is not None and lanes.opened == 1
    lanes.give_back(0, lane, ok=True)
    lanes.close()


def test_a_lane_asked_at_the_old_address_as_the_shard_moves_sends_nothing_at_the_new_one_inline(servers):
    """A call asks the shard's lane port at its old address; meanwhile the shard is served elsewhere and another
    call opens a lane there. What the first learns (a port, a failure to connect) belongs to the old address:
    the next call still gets the new address's lane, never an inline spell."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed = unused.getsockname()[1]
    where, asked, release, first = {"address": "127.0.0.1:1001"}, threading.Event(), threading.Event(), []

    def lane_port(shard: int) -> int:
        if where["address"] == "127.0.0.1:1001":
            asked.set()
            release.wait(10)
            return closed
        return servers[1].port

    lanes = ClientLanes(lambda shard: where["address"], lane_port)
    asking = threading.Thread(target=lambda: first.append(lanes.borrow(0, MIB, 10)))
    asking.start()
    assert asked.wait(10)
    where["address"] = "127.0.0.1:1002"  # the shard's backup was promoted
    moved = lanes.borrow(0, MIB, 10)
    release.set()
    asking.join(10)
    assert first == [None] and moved is not None
    lanes.give_back(0, moved, ok=True)
    assert lanes.borrow(0, MIB, 10) is moved
    lanes.close()
