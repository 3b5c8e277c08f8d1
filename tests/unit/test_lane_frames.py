"""torchps/lanes.py's frames over a socket pair: bytes land in place, anything out of step breaks the lane,
and every read and send ends by its deadline."""

import socket
import threading

import numpy as np
import pytest

from torchps.errors import LaneBrokenError, MalformedStreamError
from torchps.lanes import Lane, LaneBytes, bind
from torchps.wire import decode_push_request, encode_push_request


def pair() -> tuple[Lane, Lane]:
    a, b = socket.socketpair()
    return Lane(a, b"k" * 16), Lane(b, b"k" * 16)


def test_a_frame_lands_piece_by_piece_in_place():
    sender, receiver = pair()
    first, second = np.arange(1000, dtype=np.float32), np.arange(10, dtype=np.float64)
    threading.Thread(target=sender.send, args=([first, memoryview(second)], 5.0)).start()
    out1, out2 = np.zeros_like(first), np.zeros_like(second)
    receiver.begin(first.nbytes + second.nbytes, 5.0)
    receiver.read_into(memoryview(out1).cast("B"))
    assert not receiver.finished()
    receiver.read_into(memoryview(out2).cast("B"))
    assert receiver.finished()
    np.testing.assert_array_equal(out1, first)
    np.testing.assert_array_equal(out2, second)


def test_a_frame_of_another_length_or_number_breaks_the_lane():
    sender, receiver = pair()
    sender.send([b"abcd"], 5.0)
    with pytest.raises(LaneBrokenError, match="#0 of 4 bytes where #0 of 8"):
        receiver.begin(8, 5.0)
    assert receiver.closed
    sender2, receiver2 = pair()
    sender2.send([b"xy"], 5.0)
    sender2._sent = 5  # a frame out of order
    sender2.send([b"zz"], 5.0)
    receiver2.begin(2, 5.0)
    receiver2.read_into(memoryview(bytearray(2)))
    with pytest.raises(LaneBrokenError, match="#5 of 2 bytes where #1"):
        receiver2.begin(2, 5.0)


def test_a_head_frame_goes_ahead_of_its_bytes_and_a_reader_takes_it_at_any_length_up_to_its_limit():
    """send(head=...): the head as a frame of its own, then the buffers' frame (none where they hold no bytes);
    begin_any reads a frame of any length up to its limit, and one over it breaks the lane."""
    sender, receiver = pair()
    sender.send([np.arange(3, dtype=np.int32)], 5.0, head=b"frame-1")
    sender.send([], 5.0, head=b"rotate")  # a head alone
    sender.send([b""], 5.0, head=b"")     # an empty head: its header alone
    got = bytearray(receiver.begin_any(5.0, 64))
    receiver.read_into(memoryview(got))
    out = np.zeros(3, dtype=np.int32)
    receiver.begin(out.nbytes, 5.0)
    receiver.read_into(memoryview(out).cast("B"))
    second = bytearray(receiver.begin_any(5.0, 64))
    receiver.read_into(memoryview(second))
    assert (bytes(got), bytes(second), receiver.begin_any(5.0, 64)) == (b"frame-1", b"rotate", 0)
    np.testing.assert_array_equal(out, np.arange(3, dtype=np.int32))
    assert receiver.finished()
    sender.send([], 5.0, head=b"x" * 65)
    with pytest.raises(LaneBrokenError, match="a frame of 65 bytes where at most 64"):
        receiver.begin_any(5.0, 64)
    assert receiver.closed


def test_reading_past_the_frame_or_a_closed_peer_breaks_the_lane():
    sender, receiver = pair()
    sender.send([b"abcd"], 5.0)
    receiver.begin(4, 5.0)
    with pytest.raises(LaneBrokenError, match="past its frame's end"):
        receiver.read_into(memoryview(bytearray(5)))
    sender, receiver = pair()
    sender.sock.sendall(b"TPSL")  # half a header, then gone
    sender.close()
    with pytest.raises(LaneBrokenError, match="closed"):
        receiver.begin(4, 5.0)


def test_a_stalled_peer_ends_the_read_at_the_deadline():
    _, receiver = pair()
    with pytest.raises(LaneBrokenError, match="timed out|deadline"):
        receiver.begin(4, 0.2)
    assert receiver.closed


def test_close_from_another_thread_ends_a_blocked_read():
    _, receiver = pair()
    failed = []

    def read():
        try:
            receiver.begin(4, 30.0)
        except LaneBrokenError as exc:
            failed.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    receiver.close()
    reader.join(10)
    assert not reader.is_alive() and failed


def test_lane_chunks_round_trip_through_the_wire_and_need_a_lane():
    raw = encode_push_request(None, [("w", None, 0, memoryview(bytes(100)), 0)], lane=True)
    _, chunks, _ = decode_push_request(raw)
    assert isinstance(chunks[0].data, LaneBytes) and len(chunks[0].data) == 100
    with pytest.raises(MalformedStreamError, match="names none"):
        bind(chunks, None, 1.0)
    inline = encode_push_request(None, [("w", None, 0, memoryview(bytes(100)), 0)])
    assert len(raw) < 20 < len(inline)
