"""The client's byte counters (WorkerStats.bytes_sent / bytes_received / bytes_copied) against real shards.

A float32 push copies each byte once into its message, a pull in place once
out of its message into the parameter; a bf16 cast adds the cast's output, a
cast pull its staging copy. The counters are what bench/pullpush.py reports
as bytes copied per step, so these tests pin them to the data path's copies.
These tensors are below PSClient's lane_min_bytes, so they travel inline; on
a bulk lane nothing is copied (tests/grpc/test_lanes.py).
"""

from __future__ import annotations

import torch

from torchps.client import Compression, Optimizer

N = 64 * 1024  # float32 elements: 256 KiB per tensor, several chunks at the client's chunk size below


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Linear(N // 64, 64, bias=False)
    model.weight.grad = torch.randn_like(model.weight)
    return model


def _counters(client) -> tuple[int, int, int]:
    d = client.stats.as_dict()
    return d["bytes_sent"], d["bytes_received"], d["bytes_copied"]


def test_a_float32_round_trip_copies_each_byte_once_each_way(client):
    model = _model(0)
    binding = client.register_module(model, Optimizer("sgd", lr=0.1), create=True, prefix="copies32/")
    nbytes = N * 4
    before = _counters(client)
    binding.push()
    binding.pull()
    sent, received, copied = (a - b for a, b in zip(_counters(client), before))
    assert (sent, received) == (nbytes, nbytes)
    assert copied == 2 * nbytes  # once into the push messages, once out of the pull's into the weight


def test_bf16_both_ways_counts_the_cast_and_the_staging_copy(client):
    model = _model(1)
    binding = client.register_module(model, Optimizer("sgd", lr=0.1), create=True, prefix="copies16/",
                                     compression=Compression("bf16", min_bytes=0))
    nbytes = N * 4
    before = _counters(client)
    binding.push()
    binding.pull()
    sent, received, copied = (a - b for a, b in zip(_counters(client), before))
    assert (sent, received) == (nbytes // 2, nbytes // 2)
    # push: the cast writes N bf16, the message copies them; pull: out of the message into staging (bf16),
    # then cast up into the float32 weight
    assert copied == nbytes // 2 + nbytes // 2 + nbytes // 2 + nbytes
    assert torch.isfinite(model.weight).all()
