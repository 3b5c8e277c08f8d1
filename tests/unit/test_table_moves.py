"""Embedding tables re-laid out in a live resize, on the shards' side (moves.py, layout.py, tables.py), with
coordinators and no sockets: tables freeze at the epoch that begins it, each old shard cuts its rows for every
new shard once, a shard builds its tables when every old shard's part arrived, ids placed by the old count are
refused as moved after that, and the end is refused while a part is missing."""

from __future__ import annotations

import pytest
import torch

from torchps import rows
from torchps.client import Optimizer
from torchps.errors import LayoutChangedError, ModeConflictError, VariableMovingError
from torchps.proto import ps_pb2
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.store import VariableStore
from torchps.ps_server.tables import RowGradient

N, D = 40, 2
SPEC = ps_pb2.TableSpec(name="t", dim=D, num_embeddings=N, dtype=ps_pb2.FLOAT32,
                        init=ps_pb2.TableInit(distribution="uniform", scale=1.0, seed=2),
                        optimizer=Optimizer("sgd", lr=1.0).to_proto())
ADDRESSES = [f"127.0.0.1:{port}" for port in (1, 2, 3)]


@pytest.fixture
def shards():
    """Three coordinators: ps 0 and ps 1 hold the 2-shard layout of table "t", ps 2 holds nothing."""
    made = [Coordinator(VariableStore(), owns_step=i == 0, index=i) for i in range(3)]
    for i in range(2):
        made[i].create_tables([SPEC], i, 2)
    yield made
    for shard in made:
        shard.close()


def _rows_of(shards: list[Coordinator], count: int) -> torch.Tensor:
    """Every row of "t" read from its owner among the first `count` shards."""
    ids = torch.arange(N)
    owner = rows.shard_of(ids, count)
    out = torch.empty(N, D)
    for shard in range(count):
        mine = owner == shard
        (out[mine],) = shards[shard].lookup_rows([("t", ids[mine])], admit=False)
    return out


def _push_ones(shard: Coordinator, ids: torch.Tensor, seq: int) -> None:
    shard.push("client", 1, seq, 0, {"t": RowGradient(ids, torch.ones(len(ids), D))}, step_increment=1)


def test_rows_move_to_the_shard_the_new_count_names_and_old_placements_are_refused(shards):
    for shard in range(2):  # one push of ones to every row, by the 2-shard layout
        _push_ones(shards[shard], torch.arange(shard, N, 2), 1)
    before = _rows_of(shards, 2)
    for shard in shards:
        shard.moves.set_layout(1, ADDRESSES, {}, table_shards=3)
    with pytest.raises(VariableMovingError):  # frozen until its tables are built from every old shard's rows
        shards[0].lookup_rows([("t", torch.tensor([0]))], admit=False)
    with pytest.raises(VariableMovingError):  # a push too, before anything of it is applied
        _push_ones(shards[1], torch.tensor([1]), 2)
    parts = {(src, dst): shards[src].moves.export_tables(1, dst)[0] for src in range(2) for dst in range(3)}
    assert shards[0].moves.export_tables(1, 2)[0] == parts[(0, 2)]  # cut once: the same bytes again
    with pytest.raises(ModeConflictError):  # the end, while ps 2 has no part yet
        shards[2].moves.set_layout(2, ADDRESSES, {}, table_shards=3)
    for dst in range(3):
        assert shards[dst].moves.import_tables(parts[(0, dst)], 1, 0, 0) == []  # one of two old shards' parts
        assert shards[dst].moves.import_tables(parts[(0, dst)], 1, 0, 0) == []  # a repeat changes nothing
        assert shards[dst].moves.import_tables(parts[(1, dst)], 1, 1, 0) == ["t"]  # built
    assert torch.equal(_rows_of(shards, 3), before)  # every row at the shard id mod 3 names, as it was
    with pytest.raises(LayoutChangedError):  # id 4 is ps 1's of 3 now: a client placing by 2 is sent away
        shards[0].lookup_rows([("t", torch.tensor([4]))], admit=False)
    with pytest.raises(LayoutChangedError):
        _push_ones(shards[0], torch.tensor([0, 4]), 3)
    assert torch.equal(_rows_of(shards, 3), before)  # nothing of the refused push was applied
    for shard in shards:
        shard.moves.set_layout(2, ADDRESSES, {}, table_shards=3)  # ends it
    _push_ones(shards[1], torch.tensor([4]), 4)
    assert torch.equal(_rows_of(shards, 3)[4], before[4] - 1)


def test_another_count_waits_for_the_re_layout_under_way(shards):
    shards[0].moves.set_layout(1, ADDRESSES, {}, table_shards=3)
    with pytest.raises(ModeConflictError):
        shards[0].moves.set_layout(2, ADDRESSES, {}, table_shards=2)
    assert shards[0].layout.epoch == 1  # nothing changed
