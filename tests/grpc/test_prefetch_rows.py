"""prefetch_rows against real shards: several tables' rows in one LookupRows call per shard, and forwards that
use them equal to forwards that look up on their own.

Calls are counted by the shards themselves (GetStatus.calls_started); the
client registers without joining, so no heartbeat adds a call.
"""

from __future__ import annotations

import torch
from torch import nn

from torchps.client import EmbeddingBag, InvalidArgumentError, Optimizer, prefetch_rows

N, D = 50, 4


def _calls(client) -> list[int]:
    """Calls each shard started so far (the GetStatus that asks included)."""
    return [client.status(shard).calls_started for shard in range(client.cluster.num_ps)]


def _between(before: list[int], after: list[int]) -> list[int]:
    """Calls each shard started between two _calls, the second one's GetStatus left out."""
    return [a - b - 1 for a, b in zip(after, before)]


def _bags(client, prefix: str) -> nn.ModuleList:
    bags = nn.ModuleList([EmbeddingBag(N, D, mode="sum"), EmbeddingBag(N, D, mode="mean", padding_idx=0),
                          EmbeddingBag(N, D, mode="sum", partition="hash")])
    client.register_module(bags, Optimizer("sgd", lr=0.5), create=True, prefix=prefix, join=False)
    return bags


def _inputs(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, N, (24,), generator=g), torch.tensor([0, 6, 6, 15])) for _ in range(3)]


def test_three_tables_take_one_lookup_per_shard_and_forward_as_without(client):
    bags = _bags(client, "prefetch/")
    inputs = _inputs(0)
    before = _calls(client)
    alone = [bag(ids, offsets) for bag, (ids, offsets) in zip(bags, inputs)]
    middle = _calls(client)
    prefetch_rows({bag: ids for bag, (ids, _) in zip(bags, inputs)})
    together = [bag(ids, offsets) for bag, (ids, offsets) in zip(bags, inputs)]
    after = _calls(client)
    assert _between(before, middle) == [3, 3]  # a lookup per table and shard
    assert _between(middle, after) == [1, 1]   # one per shard for all three
    for x, y in zip(alone, together):
        assert torch.equal(x, y)
    sum(out.sum() for out in together).backward()
    assert all(bag.take_gradients() is not None for bag in bags)  # backward reached every prefetched table


def test_a_forward_on_another_input_looks_up_and_drops_the_prefetched_rows(client):
    bags = _bags(client, "prefetch-other/")
    (ids, offsets), (other, _), _ = _inputs(1)
    prefetch_rows({bags[0]: ids})
    before = _calls(client)
    got = bags[0](other, offsets)
    assert sum(_between(before, _calls(client))) >= 1  # it looked up
    assert torch.equal(got, bags[0](other, offsets))   # other's rows, not the prefetched ones
    before = _calls(client)
    bags[0](ids, offsets)
    assert sum(_between(before, _calls(client))) >= 1  # the prefetch went with the forward on `other`


def test_ids_out_of_range_are_refused_before_any_row_is_read(client):
    bags = _bags(client, "prefetch-bad/")
    before = _calls(client)
    try:
        prefetch_rows({bags[0]: torch.tensor([1, 2]), bags[1]: torch.tensor([N])})
    except InvalidArgumentError as exc:
        assert f"[0, {N})" in str(exc)
    else:
        raise AssertionError("ids out of range were accepted")
    assert _between(before, _calls(client)) == [0, 0]
