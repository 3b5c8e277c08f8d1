"""ps_server/buffers.py: receive buffers kept between pushes, only when nothing else holds them, within bounds."""

import torch

from torchps.ps_server.buffers import MIN_KEPT_BYTES, ReceiveBuffers
from torchps.ps_server.quotas import Quotas

SIZE = MIN_KEPT_BYTES


def make(limit: int = 4 * SIZE, max_memory: int = 0, held: int = 0) -> tuple[ReceiveBuffers, Quotas]:
    quotas = Quotas(max_memory=max_memory)
    return ReceiveBuffers(quotas, lambda: held, lambda: limit), quotas


def test_a_buffer_given_back_is_taken_again_for_the_same_size():
    buffers, _ = make()
    taken = [buffers.take(SIZE)]
    address = taken[0].ctypes.data
    buffers.give_back(taken.pop())  # the last reference, as the servicer passes it
    assert buffers.free_bytes == SIZE
    again = buffers.take(SIZE)
    assert again.ctypes.data == address and buffers.reused == 1 and buffers.free_bytes == 0
    assert buffers.take(2 * SIZE).ctypes.data != address  # another size: a new buffer


def test_a_buffer_something_still_views_is_not_kept():
    buffers, _ = make()
    held = buffers.take(SIZE)
    view = torch.frombuffer(held, dtype=torch.float32)[:10]  # e.g. a journal record still writing it
    buffers.give_back(held)
    assert buffers.free_bytes == 0
    assert view.numel() == 10


def test_small_buffers_and_buffers_past_the_limit_are_let_go():
    buffers, _ = make(limit=SIZE)
    buffers.give_back(buffers.take(SIZE // 2))
    assert buffers.free_bytes == 0
    buffers.give_back(buffers.take(SIZE))
    buffers.give_back(buffers.take(2 * SIZE))  # past the limit alone
    assert buffers.free_bytes == SIZE


def test_under_max_memory_kept_bytes_count_as_held_until_taken_or_dropped():
    buffers, quotas = make(max_memory=2 * SIZE + SIZE // 2, held=SIZE)
    taken = [buffers.take(SIZE), buffers.take(SIZE)]
    buffers.give_back(taken.pop())
    buffers.give_back(taken.pop())  # 1 held + 2 kept would be past the 2.5 allowed: let go
    assert buffers.free_bytes == SIZE
    try:
        quotas.reserve(SIZE, SIZE, "a push")  # 1 held + 1 kept + 1 reserved > 2.5
    except Exception as exc:  # noqa: BLE001 - the kept buffer's room is what refuses it
        assert "kept receive buffers" in str(exc)
    else:
        raise AssertionError("a reservation ignored the kept buffer's room")
    assert buffers.drop() == SIZE and buffers.free_bytes == 0
    quotas.reserve(SIZE, SIZE, "a push")  # fits once the kept buffer is dropped
