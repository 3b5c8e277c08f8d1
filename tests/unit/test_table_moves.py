"""Embedding tables re-laid out in a live resize, on the shards' side (moves.py, layout.py, tables.py), with
coordinators and no sockets: tables freeze at the epoch that begins it, each old shard cuts its rows for every
new shard once, a shard builds its tables when every old shard's part arrived, ids placed by the old count are
refused as moved after that, and the end is refused while a part is missing."""

from __future__ import annotations

import pathlib

import pytest
import torch

from torchps import rows
from torchps.client import Optimizer
from torchps.errors import InvalidArgumentError, LayoutChangedError, ModeConflictError, VariableMovingError
from torchps.proto import ps_pb2
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.journal import Journal
from torchps.ps_server.server import recover
from torchps.ps_server.ssd_tables import TableStorage
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


# -- tables kept on SSD (table_moves.py) ----------------------------------------------------------------------

DYN = ps_pb2.TableSpec(name="d", dim=D, dtype=ps_pb2.FLOAT32,
                       init=ps_pb2.TableInit(distribution="uniform", scale=1.0, seed=3),
                       optimizer=Optimizer("adagrad", lr=0.5).to_proto())
IDS = torch.arange(-150, 150)


def _ssd_shard(root: pathlib.Path, index: int, journal: pathlib.Path | None = None) -> Coordinator:
    """A coordinator keeping dynamic tables on SSD under root/ps-INDEX (a cache of about 40 rows), with a journal
    at `journal` if given (recovered from what it holds, as ps-server does)."""
    storage = TableStorage("ssd", root, name=f"ps-{index}", cache_bytes=2048)
    shard = Coordinator(VariableStore(), owns_step=index == 0, index=index, table_storage=storage,
                        start=journal is None)
    if journal is not None:
        recover(shard, Journal(journal, compact_factor=0, min_compact_bytes=1 << 30), None)
    return shard


def _dyn_rows(shards: list[Coordinator], count: int) -> torch.Tensor:
    owner = rows.shard_of(IDS, count)
    out = torch.empty(len(IDS), D)
    for shard in range(count):
        mine = owner == shard
        (out[mine],) = shards[shard].lookup_rows([("d", IDS[mine])], admit=False)
    return out


def _train_dyn(shards: list[Coordinator], count: int, seq: int) -> None:
    """An admitting lookup of every id and a push of ones to them, on their owners among `count` shards."""
    owner = rows.shard_of(IDS, count)
    for shard in range(count):
        mine = IDS[owner == shard]
        shards[shard].lookup_rows([("d", mine)], admit=True)
        shards[shard].push("client", 1, seq, 0, {"d": RowGradient(mine, torch.ones(len(mine), D))},
                           step_increment=1)


def _part(src: Coordinator, dst: int, epoch: int = 1, max_rows: int = 16):
    """(data, step, row chunks, counts) of what `src` exports for shard `dst`."""
    data, step = src.moves.export_tables(epoch, dst)
    chunks = list(src.moves.export_table_rows(epoch, dst, max_rows))
    counts: dict[str, int] = {}
    for name, ids, _ in chunks:
        counts[name] = counts.get(name, 0) + len(ids)
    return data, step, chunks, counts


def _trained(root: pathlib.Path, journals: list[pathlib.Path] | None = None, pushes: int = 1) -> list[Coordinator]:
    """Three SSD shards under `root` (journaled at `journals` if given): ps 0 and ps 1 hold "d" over 2 shards,
    trained `pushes` times; ps 2 holds nothing."""
    shards = [_ssd_shard(root, i, journals[i] if journals else None) for i in range(3)]
    for i in range(2):
        shards[i].create_tables([DYN], i, 2)
    for seq in range(1, pushes + 1):
        _train_dyn(shards, 2, seq)
    return shards


def _freeze(shards: list[Coordinator]) -> None:
    """Layout epoch 1 on every shard: a re-layout of the tables onto 3 shards begins."""
    for shard in shards:
        shard.moves.set_layout(1, ADDRESSES, {}, table_shards=3)


@pytest.fixture
def frozen(tmp_path):
    """_trained()'s shards, frozen for a re-layout onto 3 (_freeze)."""
    shards = _trained(tmp_path)
    _freeze(shards)
    yield shards
    for shard in shards:
        shard.close()


def test_rows_of_a_table_on_ssd_stream_from_a_kept_copy_into_staged_stores_and_build_the_new_tables(tmp_path):
    """2 -> 3 shards: each old shard's part for a new one is its table's head and the rows that shard owns,
    streamed from a copy of its store (chunks of at most 16 rows here); the new shard stages them and builds
    its table on SSD from every old shard's; every row, with its optimizer state, is where id mod 3 names;
    the re-layout's folders are gone once it ended (no journal: at once)."""
    shards = _trained(tmp_path, pushes=2)
    try:
        before = _dyn_rows(shards, 2)
        _freeze(shards)
        for dst in range(3):
            for src in range(2):
                data, step, chunks, counts = _part(shards[src], dst)
                assert chunks and all(len(ids) <= 16 for _, ids, _ in chunks)
                assert all(bool((rows.shard_of(torch.from_numpy(ids), 3) == dst).all()) for _, ids, _ in chunks)
                built = shards[dst].moves.import_tables(data, 1, src, step, iter(chunks), lambda c=counts: c)
                assert built == (["d"] if src == 1 else [])
        assert [s.tables.status()[0].storage for s in shards] == ["ssd"] * 3
        assert sum(s.tables.status()[0].rows for s in shards) == len(IDS)
        assert torch.equal(_dyn_rows(shards, 3), before)
        assert any((tmp_path / f"ps-{i}" / "relayout").iterdir() for i in range(3)), "kept copies, staged parts"
        for shard in shards:
            shard.moves.set_layout(2, ADDRESSES, {}, table_shards=3)  # ends it
        assert not any(f for i in range(3) for f in (tmp_path / f"ps-{i}" / "relayout").glob("*"))
        _train_dyn(shards, 3, 3)  # adagrad's state moved with the rows: the same step as on 2 shards
        assert torch.equal(_dyn_rows(shards, 3), before - 0.5 * 1 / torch.sqrt(torch.full((1,), 3.0)))
    finally:
        for shard in shards:
            shard.close()


@pytest.mark.parametrize("forged", ["a row short", "a row more", "ids not its own", "a table not announced",
                                    "records too narrow"])
def test_an_import_of_rows_that_do_not_fit_what_was_sent_is_refused_and_changes_nothing(frozen, tmp_path, forged):
    """A cut or forged stream of rows is InvalidArgumentError: nothing is taken, nothing staged is left, and the
    whole part imported after it is taken."""
    shards = frozen
    data, step, chunks, counts = _part(shards[0], 2)
    name, ids, records = chunks[0]
    bad, sent = list(chunks), dict(counts)
    if forged == "a row short":
        sent["d"] += 1
    elif forged == "a row more":
        sent["d"] -= 1
    elif forged == "ids not its own":
        bad[0] = (name, ids + 1, records)  # ids of ps 1 (old), or not ps 2's (new)
    elif forged == "a table not announced":
        bad[0] = ("other", ids, records)
    else:
        bad[0] = (name, ids, records[:, :-8])
    with pytest.raises(InvalidArgumentError):
        shards[2].moves.import_tables(data, 1, 0, step, iter(bad), lambda: sent)
    assert not shards[2].layout.received(0)
    assert [f.name for f in (tmp_path / "ps-2" / "relayout").glob("*")] == []
    assert shards[2].moves.import_tables(data, 1, 0, step, iter(chunks), lambda: counts) == []
    assert shards[2].layout.received(0)


def test_a_journaled_shard_killed_mid_re_layout_replays_its_staged_rows_and_the_kept_copy(tmp_path):
    """ps 2 takes ps 0's part, then stops (a kill: its journal is all that is left) and comes back from its
    journal, the staged rows' folder named there; ps 0, also journaled, comes back with its kept copy and
    exports the same part again. ps 1's part then completes ps 2's tables, exactly. The re-layout's folders
    beside the journals go with the first base written after its end."""
    journals = [tmp_path / f"journal-{i}" for i in range(3)]
    shards = _trained(tmp_path / "tables", journals)
    try:
        before = _dyn_rows(shards, 2)
        _freeze(shards)
        first = _part(shards[0], 2)
        assert shards[2].moves.import_tables(first[0], 1, 0, first[1], iter(first[2]), lambda: first[3]) == []
        for i in (0, 2):  # both come back from their journals alone
            shards[i].close()
            shards[i] = _ssd_shard(tmp_path / "tables", i, journals[i])
        assert shards[2].layout.received(0) and shards[0].layout.table_stores()
        again = _part(shards[0], 2)
        assert again[0] == first[0] and again[3] == first[3], "the same part, from the kept copy"
        for dst in range(3):
            for src in range(2):
                if (src, dst) != (0, 2):
                    data, step, chunks, counts = _part(shards[src], dst)
                    shards[dst].moves.import_tables(data, 1, src, step, iter(chunks), lambda c=counts: c)
        assert torch.equal(_dyn_rows(shards, 3), before)
        for shard in shards:
            shard.moves.set_layout(2, ADDRESSES, {}, table_shards=3)
        for i in range(3):
            assert list((journals[i] / "relayout").iterdir()), "kept until the next base"
            shards[i].recorder.compact_for(None)
            assert not list((journals[i] / "relayout").iterdir()), f"ps {i}: gone with the base after the end"
        shards[2].close()
        shards[2] = _ssd_shard(tmp_path / "tables", 2, journals[2])  # from that base: the built table's copy
        assert torch.equal(_dyn_rows(shards, 3), before)
    finally:
        for shard in shards:
            shard.close()


def test_replaying_the_end_of_a_re_layout_keeps_the_folders_of_the_next_one(tmp_path):
    """One log holds a re-layout 2 -> 3 with its end and the start of 3 -> 2 (ps 0 kept its copy). ps 0 comes
    back from its journal: replaying the first end drops only that re-layout's folders, so after a
    compaction the second one's export is sent again from its kept copy."""
    journals = [tmp_path / f"journal-{i}" for i in range(3)]
    shards = _trained(tmp_path / "tables", journals)
    try:
        _freeze(shards)
        for dst in range(3):
            for src in range(2):
                data, step, chunks, counts = _part(shards[src], dst)
                shards[dst].moves.import_tables(data, 1, src, step, iter(chunks), lambda c=counts: c)
        for shard in shards:
            shard.moves.set_layout(2, ADDRESSES, {}, table_shards=3)  # the first ends, no base after it
        for shard in shards:
            shard.moves.set_layout(3, ADDRESSES, {}, table_shards=2)  # the second begins
        first = _part(shards[0], 1, epoch=3)
        shards[0].close()
        shards[0] = _ssd_shard(tmp_path / "tables", 0, journals[0])
        shards[0].recorder.compact_for(None)
        again = _part(shards[0], 1, epoch=3)
        assert again[0] == first[0] and again[3] == first[3]
        assert [p.name for p in (journals[0] / "relayout").iterdir()] == \
            [shards[0].layout.table_stores()["d"]["path"]], "the first re-layout's folders went with the base"
    finally:
        for shard in shards:
            shard.close()


@pytest.mark.parametrize("next_begins", [False, True], ids=["ended", "next-begun"])
def test_an_import_whose_re_layout_ended_while_it_staged_is_refused_and_leaves_nothing(frozen, tmp_path,
                                                                                        next_begins):
    """An import stages its rows and builds the tables outside the gate; meanwhile a retry of the same part
    completes, the re-layout ends (and the next one begins). The first is refused under the gate (its epoch
    is not the one in force): nothing is taken into the next re-layout's inbox, and the tables it built are
    closed, their folders gone."""
    shards = frozen
    parts = {(s, d): _part(shards[s], d) for s in range(2) for d in range(3)}
    for (s, d), (data, step, chunks, counts) in parts.items():
        if (s, d) != (1, 1):
            shards[d].moves.import_tables(data, 1, s, step, iter(chunks), lambda c=counts: c)
    moves, built = shards[1].moves, []
    original = moves._built_if_last
    data, step, chunks, counts = parts[(1, 1)]

    def racing(source, sources, part):
        built.extend(original(source, sources, part))
        moves._built_if_last = original
        assert moves.import_tables(data, 1, 1, step, iter(chunks), lambda: counts) == ["d"]  # the retry
        for shard in shards:
            shard.moves.set_layout(2, ADDRESSES, {}, table_shards=3)
        if next_begins:
            for shard in shards:
                shard.moves.set_layout(3, ADDRESSES, {}, table_shards=2)
        return built

    moves._built_if_last = racing
    with pytest.raises((ModeConflictError, LayoutChangedError)):
        moves.import_tables(data, 1, 1, step, iter(chunks), lambda: counts)
    assert built and all(held.table._closed for held in built)
    assert len(list((tmp_path / "ps-1").glob("d-*"))) == 1, "only the installed table's store"
    if next_begins:
        assert shards[1].layout.inbox() == {}
        part = _part(shards[0], 1, epoch=3)
        shards[1].moves.import_tables(part[0], 3, 0, part[1], iter(part[2]), lambda: part[3])
        assert shards[1].layout.received(0)
