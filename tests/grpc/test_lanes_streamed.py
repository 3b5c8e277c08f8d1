"""Overlap's streamed pushes on bulk lanes, against real shards: the bytes leave on a lane while backward runs,
a lane cut mid-stream applies nothing and the push's retry applies it once, and a push under lane_min_bytes
stays inline.

A hook on the first layer's output runs while backward is between the layers (the last layer's gradients
streamed, the first layer's not made yet): it waits for the shard to have taken in the last layer's bytes,
then looks or cuts the lane. Ordered by those events, never by sleeps.
"""

from __future__ import annotations

import socket
from typing import Callable

import pytest
import torch
from helpers import wait_until

from torchps.client import Optimizer, PSClient

TIMEOUT = 30.0
LAST_BYTES = 512 * 1024 * 4  # the big model's last weight: 2 MiB, two frames of the default 1 MiB chunks


def mlp(hidden: int, out: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.Linear(hidden, out))


def backward(net: torch.nn.Sequential, between: Callable[[], None] = lambda: None) -> None:
    """A loss through `net`, backward; `between()` runs once the last layer's gradients are in, before the first
    layer's are made."""
    hidden = net[0](torch.randn(8, 64))
    hidden.register_hook(lambda grad: between())
    net[1](torch.tanh(hidden)).square().sum().backward()


def push_streamed(binding) -> dict[str, torch.Tensor]:
    """Ends the step's streamed push (open, not given up: it is what push() finishes); the gradients it carried."""
    streamed = binding._overlap.streamed
    assert streamed is not None and not streamed.aborted, "the step's push went streamed"
    grads = {name: p.grad.clone() for name, p in binding.params.items()}
    assert binding.push() == 1
    return grads


def applied_once(ps: PSClient, binding, initial: dict, grads: dict) -> None:
    values = ps.pull(binding.names)
    for name in binding.names:
        assert torch.equal(values[name], initial[name] - grads[name]), f"{name}: applied once"
    assert ps.status(0).step == 1


def test_a_streamed_push_sends_its_bytes_on_a_lane_while_backward_runs(local_cluster):
    local = local_cluster(1)
    net = mlp(512, 1024)
    with PSClient(local.cluster, timeout=TIMEOUT, connect_timeout=10) as ps:
        binding = ps.register_module(net, Optimizer("sgd", lr=1.0), create=True, overlap=True)
        initial = {name: p.detach().clone() for name, p in binding.params.items()}
        before, copied = ps.status(0).push_bytes_received, ps.stats.bytes_copied
        opened = ps._lanes.opened  # the pull's (a second if its first broke under load and it was sent again)
        assert opened >= 1 and "push_lane_send" not in ps.stats.stage_seconds
        seen = {}

        def between() -> None:
            wait_until(lambda: ps.status(0).push_bytes_received >= before + LAST_BYTES, TIMEOUT,
                       "the shard to take in the last layer's gradient while backward runs")
            seen["on a lane"] = "push_lane_send" in ps.stats.stage_seconds

        backward(net, between)
        grads = push_streamed(binding)
        copied = ps.stats.bytes_copied - copied
        assert seen["on a lane"], "the last layer's bytes went on a lane during backward"
        assert copied < LAST_BYTES / 10, f"{copied} bytes copied: the gradients went inline"
        assert ps._lanes.opened == opened  # the push took the lane register_module's pull left idle
        applied_once(ps, binding, initial, grads)


def test_a_lane_cut_mid_stream_applies_nothing_and_the_retry_applies_the_push_once(local_cluster, monkeypatch):
    """The lane is cut once the last layer's two frames are in: the frame of the message carrying the push's end
    never arrives, so the shard applies nothing; the retry (same number) replays the stream on a new lane and is
    applied once (not a duplicate)."""
    local = local_cluster(1)
    net = mlp(512, 1024)
    with PSClient(local.cluster, timeout=TIMEOUT, connect_timeout=10) as ps:
        binding = ps.register_module(net, Optimizer("sgd", lr=1.0), create=True, overlap=True)
        initial = {name: p.detach().clone() for name, p in binding.params.items()}
        before = ps.status(0).push_bytes_received
        lent, borrow = [], ps._lanes.borrow

        def borrowing(shard: int, nbytes: int, timeout: float):
            lane = borrow(shard, nbytes, timeout)
            lent.append(lane)
            return lane

        monkeypatch.setattr(ps._lanes, "borrow", borrowing)

        def cut() -> None:
            wait_until(lambda: ps.status(0).push_bytes_received >= before + LAST_BYTES, TIMEOUT,
                       "the shard to take in the last layer's frames")
            assert len(lent) == 1 and lent[0] is not None, "the stream's attempt was lent a lane"
            lent[0].sock.shutdown(socket.SHUT_RDWR)

        backward(net, cut)
        grads = push_streamed(binding)
        assert len(lent) == 2 and lent[0].closed and lent[1] is not None, lent
        assert ps.stats.duplicates == 0, "the cut attempt applied nothing: its retry was the first to apply"
        applied_once(ps, binding, initial, grads)


@pytest.mark.parametrize("over", [0, 1], ids=["at-lane_min_bytes", "under-it"])
def test_a_streamed_push_goes_on_a_lane_only_from_lane_min_bytes(local_cluster, over):
    local = local_cluster(1)
    net = mlp(32, 16)
    nbytes = sum(p.nbytes for p in net.parameters())
    with PSClient(local.cluster, timeout=TIMEOUT, connect_timeout=10, lane_min_bytes=nbytes + over) as ps:
        binding = ps.register_module(net, Optimizer("sgd", lr=1.0), create=True, overlap=True)
        initial = {name: p.detach().clone() for name, p in binding.params.items()}
        copied = ps.stats.bytes_copied
        backward(net)
        grads = push_streamed(binding)
        copied = ps.stats.bytes_copied - copied
        assert ("push_lane_send" in ps.stats.stage_seconds) == (not over)
        assert (copied >= nbytes) == bool(over), f"{copied} of {nbytes} bytes copied"
        applied_once(ps, binding, initial, grads)
