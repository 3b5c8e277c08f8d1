"""Tables kept on SSD (ps_server/ssd_tables.py): an SsdTable whose cache holds a small part of its rows trains
exactly as the same table in RAM, and its state (a store copy) restores it without reading it; the cache
stays within its budget; changes() answers a serving replica as in RAM; what is not built yet is refused."""

from __future__ import annotations

import gc
import pathlib
import threading

import numpy as np
import pytest
import torch

from torchps.errors import InvalidArgumentError
from torchps.ps_server.disk_rows import DiskMemory
from torchps.ps_server.embeddings import EmbeddingTable
from torchps.ps_server.ssd_tables import (CacheBudget, SsdTable, StoreCopy, TableStorage, place_stores, relayout_stores,
                                         resolve_stores)

DIM = 8
ARGS = dict(optimizer="adagrad", hyperparams={"lr": 0.1}, seed=3)


def ssd(tmp_path: pathlib.Path, cache_bytes: int = 40_000, **args) -> SsdTable:
    return SsdTable(DIM, folder=tmp_path / f"t{len(list(tmp_path.iterdir()))}", memory=DiskMemory(1 << 20, 1 << 20),
                    budget=CacheBudget(cache_bytes), **{**ARGS, **args})


def zipf_batches(steps: int, batch: int, ids: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        drawn = np.unique((rng.zipf(1.2, batch) - 1) % ids).astype(np.int64)
        yield step, torch.from_numpy(drawn), torch.from_numpy(rng.standard_normal((len(drawn), DIM)).astype(np.float32))


def train(table: EmbeddingTable, steps: int = 60, batch: int = 300, ids: int = 5000) -> None:
    for step, drawn, grads in zipf_batches(steps, batch, ids):
        table.lookup(drawn)
        table.apply(drawn, grads, step)


def every_row(table: EmbeddingTable, ids: int = 5000) -> torch.Tensor:
    return torch.cat([table.lookup(torch.arange(s, min(s + 1000, ids)), admit=False) for s in range(0, ids, 1000)])


def test_a_table_whose_cache_holds_a_fraction_of_it_trains_exactly_as_in_ram(tmp_path):
    ram, disk = EmbeddingTable(DIM, **ARGS), ssd(tmp_path)
    train(ram)
    train(disk)
    c = disk.counters()
    assert c["rows"] == ram.counters()["rows"] > 4 * c["cache_rows"]  # most rows are on disk only
    assert c["cache_misses"] > 0 and c["disk_bytes_written"] > 0 and c["disk_bytes_read"] > 0
    floor = ssd(tmp_path)
    floor.lookup(torch.tensor([0]))  # the least a table holds: its first slab and id arrays
    assert c["bytes"] <= 40_000 * 1.2 + floor.nbytes()
    assert torch.equal(every_row(ram), every_row(disk))


def test_min_count_admission_counts_on_ssd_as_in_ram(tmp_path):
    ram, disk = EmbeddingTable(DIM, min_count=3, **ARGS), ssd(tmp_path, min_count=3)
    train(ram, steps=20)
    train(disk, steps=20)
    assert disk.counters()["pending"] == ram.counters()["pending"] > 0
    assert torch.equal(every_row(ram), every_row(disk))


def test_a_state_restores_from_its_store_copy_and_the_copy_goes_with_the_state(tmp_path):
    table = ssd(tmp_path)
    train(table)
    expected = every_row(table)
    state = table.state_dict()
    copy = state["store"]
    assert isinstance(copy, StoreCopy) and "values" not in state and state["rows"] == table.counters()["rows"]
    train(table, steps=5)  # later changes are not in the copy
    other = ssd(tmp_path)
    other.load_state_dict(state)
    assert torch.equal(every_row(other), expected) and other.counters()["cache_rows"] < 1000
    path = copy.path
    del state, copy
    gc.collect()
    assert not path.exists()


def test_a_ram_tables_state_loads_into_an_ssd_table_and_back_out(tmp_path):
    ram = EmbeddingTable(DIM, **ARGS)
    train(ram, steps=30)
    disk = ssd(tmp_path)
    disk.load_state_dict(ram.state_dict())
    train(ram, steps=10)
    train(disk, steps=10)
    assert torch.equal(every_row(ram), every_row(disk))


def test_changes_answer_a_replica_as_the_ram_table_does(tmp_path):
    ram, disk = EmbeddingTable(DIM, **ARGS), ssd(tmp_path)
    cursors = {}
    for table in (ram, disk):
        train(table, steps=20)
        incarnation, seq, whole, ids, rows, held = table.changes(0, "")
        assert whole and held.all()
        cursors[id(table)] = (incarnation, seq, ids, rows)
        table.apply(torch.tensor([1, 2, 4999]), torch.ones(3, DIM), 21)
    (_, _, ram_ids, ram_rows), (_, _, disk_ids, disk_rows) = cursors[id(ram)], cursors[id(disk)]
    assert torch.equal(ram_ids, disk_ids) and torch.equal(ram_rows, disk_rows)
    for table in (ram, disk):
        incarnation, seq, _, _ = cursors[id(table)]
        _, _, whole, ids, rows, held = table.changes(seq, incarnation, min_updates=2)
        assert not whole and ids.tolist() == [1, 2]  # 4999 was never admitted: no row, no change
        assert held.tolist() == [True, True]


def test_threads_pushing_rows_lose_no_update(tmp_path):
    table = SsdTable(DIM, folder=tmp_path / "t", memory=DiskMemory(1 << 20, 1 << 20), budget=CacheBudget(20_000),
                     optimizer="sgd", hyperparams={"lr": 1.0}, init_scale=0.0)
    table.lookup(torch.arange(2000))

    def push(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for step in range(50):
            ids = torch.from_numpy(rng.choice(2000, 100, replace=False))
            table.apply(ids, -torch.ones(len(ids), DIM), step)

    threads = [threading.Thread(target=push, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert float(every_row(table, 2000)[:, 0].sum()) == 4 * 50 * 100


def test_caches_share_the_budget_and_each_keeps_an_equal_share():
    budget = CacheBudget(1000)
    assert budget.allowance(1, 900) == 1000   # alone: all of it
    assert budget.allowance(2, 0) == 500      # an equal share, though the first holds 900
    assert budget.allowance(2, 400) == 500
    assert budget.allowance(1, 900) == 600    # what the second leaves: it gives 300 back
    assert budget.allowance(1, 600) == 600 and budget.allowance(2, 400) == 500
    budget.leave(2)
    assert budget.allowance(1, 600) == 1000


def test_storage_keeps_fixed_tables_in_ram_and_dynamic_ones_on_ssd(tmp_path):
    (tmp_path / "ps-0" / "old").mkdir(parents=True)
    storage = TableStorage("ssd", tmp_path, cache_bytes=1 << 20)
    assert not (tmp_path / "ps-0" / "old").exists()  # a store of an earlier run is never reopened
    assert storage.table("f", DIM, num_embeddings=10).storage == "ram"
    tables = [storage.table("a/b", DIM), storage.table("e", DIM, capacity=10, max_age=3)]
    assert [t.storage for t in tables] == ["ssd", "ssd"]
    with pytest.raises(InvalidArgumentError):
        TableStorage("ssd", None)
    for table in tables:
        table.close()
    assert not any((tmp_path / "ps-0").iterdir())


@pytest.mark.parametrize("evicting", [dict(max_age=4), dict(capacity=300), dict(max_age=10, capacity=250)],
                         ids=["max_age", "capacity", "both"])
def test_eviction_on_ssd_drops_the_rows_ram_drops_and_a_restored_table_goes_on_alike(tmp_path, evicting):
    ram, disk = EmbeddingTable(DIM, min_count=2, **evicting, **ARGS), ssd(tmp_path, 8000, min_count=2, **evicting)
    cursors = {}
    for table in (ram, disk):
        for step, drawn, grads in zipf_batches(40, 300, 5000):
            table.lookup(drawn)
            table.apply(drawn, grads, step)
            table.evict(step)
        cursors[id(table)] = table.changes(0, "")[:2]
    c, expected = disk.counters(), ram.counters()
    assert c["evicted_by_age"] + c["evicted_by_capacity"] > 0 and c["rows"] > 2 * c["cache_rows"]
    assert {k: c[k] for k in expected if k != "bytes"} == {k: v for k, v in expected.items() if k != "bytes"}
    assert torch.equal(every_row(ram), every_row(disk))
    restored = ssd(tmp_path, 8000, min_count=2, **evicting)
    restored.load_state_dict(disk.state_dict())  # the index of last updates is read back from the store copy
    for table in (ram, disk, restored):
        for step, drawn, grads in zipf_batches(10, 300, 5000, seed=1):
            table.lookup(drawn)
            table.apply(drawn, grads, 40 + step)
            table.evict(40 + step)
    assert ram.counters()["rows"] == disk.counters()["rows"] == restored.counters()["rows"]
    assert torch.equal(every_row(ram), every_row(disk)) and torch.equal(every_row(ram), every_row(restored))
    for table in (ram, disk):  # a replica following the table is told of the rows eviction dropped
        incarnation, seq = cursors[id(table)]
        _, _, whole, ids, _, held = table.changes(seq, incarnation)
        cursors[id(table)] = (ids[~held].tolist(), whole)
    assert cursors[id(ram)] == cursors[id(disk)] and cursors[id(ram)][0]


@pytest.mark.parametrize("default, asked, where", [
    ("ram", "", "ram"), ("ram", "ram", "ram"), ("ram", "ssd", "ssd"),
    ("ssd", "", "ssd"), ("ssd", "ram", "ram"), ("ssd", "ssd", "ssd"),
])
def test_a_table_is_kept_where_its_spec_says_else_where_the_shard_keeps_tables(tmp_path, default, asked, where):
    storage = TableStorage(default, tmp_path, cache_bytes=1 << 20)
    table = storage.table("t", DIM, asked)
    assert table.storage == where
    assert storage.table("f", DIM, "ram" if asked == "ssd" else asked, num_embeddings=10).storage == "ram"
    table.close()


def test_a_table_asking_for_a_storage_the_shard_cannot_give_is_refused(tmp_path):
    from torchps.errors import ModeConflictError

    with pytest.raises(ModeConflictError, match="--table-dir"):
        TableStorage("ram").table("t", DIM, "ssd")   # no folder for tables on disk
    storage = TableStorage("ram", tmp_path, cache_bytes=1 << 20)
    with pytest.raises(InvalidArgumentError, match="storage must be"):
        storage.table("t", DIM, "nvme")
    assert not any((tmp_path / "ps-0").iterdir()), "nothing made on disk"


def test_placed_stores_are_named_relative_to_their_folder_and_resolved_back(tmp_path):
    table = ssd(tmp_path)
    train(table, steps=10)
    state = {"tables": [{"name": "emb/1", "state": table.state_dict()}]}
    base = tmp_path / "ckpt"
    placed = place_stores(state, base / "ps-0.stores", base)
    store = state["tables"][0]["state"]["store"]
    assert not store["path"].startswith("/") and (base / store["path"] / "CURRENT").is_file()
    assert placed == sum(f.stat().st_size for f in (base / store["path"]).iterdir())
    assert place_stores(state, base / "ps-0.stores", base) == 0  # placed already
    resolve_stores(state, base)
    other = ssd(tmp_path)
    other.load_state_dict(state["tables"][0]["state"])
    assert torch.equal(every_row(other), every_row(table))
    bad = {**state["tables"][0]["state"], "store": {"path": str(tmp_path / "nowhere"), "record_bytes": 1}}
    with pytest.raises(InvalidArgumentError, match="missing"):
        other.load_state_dict(bad)
    assert torch.equal(every_row(other), every_row(table))  # unchanged


def test_two_saves_placing_one_state_at_once_both_get_one_placed_copy(tmp_path):
    table = ssd(tmp_path)
    train(table, steps=10)
    state = {"tables": [{"name": "t", "state": table.state_dict()}]}
    errors = []

    def place() -> None:
        try:
            place_stores(state, tmp_path / "ckpt" / "ps-0.stores", tmp_path / "ckpt")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=place) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(list((tmp_path / "ckpt" / "ps-0.stores").iterdir())) == 1


def test_tables_whose_names_share_a_long_prefix_get_folders_of_their_own(tmp_path):
    prefix = "model.sparse_arch.embedding_bag_collection.embedding_bags." * 2
    tables = {name: ssd(tmp_path) for name in (prefix + "t_user_id", prefix + "t_item_id", "a/b", "a:b")}
    for k, table in enumerate(tables.values()):
        table.lookup(torch.tensor([k]))
    state = {"tables": [{"name": name, "state": t.state_dict()} for name, t in tables.items()]}
    place_stores(state, tmp_path / "c", tmp_path)
    assert len({e["state"]["store"]["path"] for e in state["tables"]}) == 4
    resolve_stores(state, tmp_path)
    for k, entry in enumerate(state["tables"]):
        back = ssd(tmp_path)
        back.load_state_dict(entry["state"])
        assert torch.equal(back.lookup(torch.tensor([k]), admit=False), tables[entry["name"]].lookup(
            torch.tensor([k]), admit=False))


def test_an_idle_or_empty_table_answers_a_replica_with_nothing(tmp_path):
    table = ssd(tmp_path)
    incarnation, seq, whole, ids, rows, held = table.changes(0, "")
    assert whole and len(ids) == len(rows) == len(held) == 0
    table.lookup(torch.tensor([1, 2]))
    incarnation, seq, *_ = table.changes(0, "")
    _, _, whole, ids, rows, held = table.changes(seq, incarnation)
    assert not whole and len(ids) == 0 and rows.shape == (0, DIM)


def test_a_store_that_fails_fails_the_call_before_it_changed_anything(tmp_path, monkeypatch):
    table, ram = ssd(tmp_path, cache_bytes=1), EmbeddingTable(DIM, **ARGS)  # every call spills what the last cached
    for t in (table, ram):
        t.lookup(torch.arange(2000))
        t.apply(torch.arange(2000), torch.ones(2000, DIM), 1)  # 2000 rows changed in the cache, to be written

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(table._disk, "put", full)
    with pytest.raises(OSError):
        table.apply(torch.arange(10), torch.ones(10, DIM), 2)
    monkeypatch.undo()
    assert torch.equal(every_row(table, 2000), every_row(ram, 2000))


def test_warming_reads_announced_rows_into_the_cache_and_changes_nothing_else(tmp_path):
    ram, disk = EmbeddingTable(DIM, **ARGS), ssd(tmp_path)
    train(ram)
    train(disk)
    before = disk.counters()
    cold = np.setdiff1d(np.arange(5000), disk._rows.cols["ids"][:disk._rows.n])[:200]  # rows on disk or in neither
    read = disk.warm(cold)
    after = disk.counters()
    assert 0 < read <= len(cold) and after["cache_warmed"] == read
    assert after["rows"] == before["rows"] and after["cache_misses"] == before["cache_misses"]  # nothing created
    assert disk.warm(cold) == 0, "cached now: nothing to read"
    held = cold[disk._rows.find(cold) >= 0]
    disk.lookup(torch.from_numpy(held))
    assert disk.counters()["cache_hits"] - after["cache_hits"] == len(held) == read, "the next lookup hits"
    assert torch.equal(every_row(ram), every_row(disk)), "warming changed no row"


def test_a_warmer_reads_each_announcement_in_its_thread_and_drops_the_oldest_past_its_bound(tmp_path):
    from torchps.ps_server.warming import MAX_PENDING, Warmer

    class Gated:
        """A table whose warm() waits for the test to open `gate`, recording the ids it was given."""
        def __init__(self):
            self.gate, self.entered, self.got = threading.Event(), threading.Event(), []

        def warm(self, ids):
            self.entered.set()
            assert self.gate.wait(30)
            self.got.append(int(ids[0]))
            if ids[0] == -1:
                raise OSError("a store that fails")

    table, warmer = Gated(), Warmer()
    warmer.offer([(table, np.array([-1])), (table, np.array([-2]))])  # one announcement of two tables
    assert table.entered.wait(30)  # the thread holds the first; the rest queue behind it
    for k in range(MAX_PENDING + 3):
        warmer.offer([(table, np.array([k])), (table, np.array([100 + k]))])
    table.gate.set()
    done = threading.Event()
    warmer.offer([(type("Last", (), {"warm": lambda self, ids: done.set()})(), np.array([0]))])
    assert done.wait(30)
    kept = [x for k in range(4, MAX_PENDING + 3) for x in (k, 100 + k)]
    assert table.got == [-1, -2, *kept], "the first failed and was logged, its second table read; 4 oldest dropped"
    assert (warmer.offered, warmer.dropped, warmer.failed) == (MAX_PENDING + 5, 4, 1)
    warmer.close()
    warmer.offer([(table, np.array([99]))])
    assert warmer.offered == MAX_PENDING + 5, "closed: nothing more is queued"


def test_a_state_that_fails_to_load_leaves_the_table_and_no_store_behind(tmp_path, monkeypatch):
    table = ssd(tmp_path, max_age=5)
    train(table, steps=10)
    expected, state = every_row(table), table.state_dict()
    other = ssd(tmp_path, max_age=5)
    train(other, steps=3)
    before = every_row(other)

    def failing(disk):
        raise OSError("the store cannot be read")

    monkeypatch.setattr(other, "_indexed_ages", failing)
    with pytest.raises(OSError):
        other.load_state_dict(state)
    assert torch.equal(every_row(other), before), "the table is as it was"
    assert [p.name for p in other._folder.iterdir() if p.name.startswith("live-")] == [], "no new store left"
    monkeypatch.undo()
    other.load_state_dict(state)
    assert torch.equal(every_row(other), expected)


def test_an_evict_whose_store_fails_changes_nothing(tmp_path, monkeypatch):
    table = ssd(tmp_path, max_age=2)
    train(table, steps=10)
    before, counters = every_row(table), table.counters()

    def failing(ids):
        raise OSError("disk full")

    monkeypatch.setattr(table._disk, "delete", failing)
    with pytest.raises(OSError):
        table.evict(100)
    monkeypatch.undo()
    # disk_bytes is the size of the store's files, which RocksDB's own background compactions change meanwhile
    # (a fresh clone's CI once saw it move); every counter of the table's own doings stays as it was.
    assert table._step == 10 and _but_files(table.counters()) == _but_files(counters)  # (before the rows are read)
    assert torch.equal(every_row(table), before)


def _but_files(counters: dict) -> dict:
    return {name: value for name, value in counters.items() if name != "disk_bytes"}


def sharded(make, num_shards: int, **args) -> list[EmbeddingTable]:
    return [make(shard_index=i, num_shards=num_shards, **args) for i in range(num_shards)]


def train_sharded(tables: list[EmbeddingTable], steps: int, first: int = 1, seed: int = 0) -> None:
    """Each shard gets the ids it owns of every batch, and evicts (by age) at every step."""
    n = len(tables)
    for step, drawn, grads in zipf_batches(steps, 300, 5000, seed):
        for i, table in enumerate(tables):
            mine = drawn % n == i
            table.lookup(drawn[mine])
            table.apply(drawn[mine], grads[mine], first + step - 1)
            table.evict(first + step - 1)


def rows_of(tables: list[EmbeddingTable]) -> torch.Tensor:
    """Every id's row (0 where a shard holds none) over a table's shards."""
    ids, n = torch.arange(5000), len(tables)
    out = torch.zeros(5000, DIM)
    for i, table in enumerate(tables):
        mine = ids[ids % n == i]
        out[mine] = table.lookup(mine, admit=False)
    return out


@pytest.mark.parametrize("num_shards", [3, 1])
def test_a_state_of_2_ssd_shards_re_laid_out_streams_store_to_store_as_ram_re_lays_out(tmp_path, num_shards):
    from torchps.ps_server.embeddings import relayout
    from torchps.ps_server.ssd_tables import relayout_stores

    args = dict(min_count=2, max_age=6)
    rams, disks = sharded(lambda **a: EmbeddingTable(DIM, **ARGS, **a), 2, **args), \
        sharded(lambda **a: ssd(tmp_path, 8000, **a), 2, **args)
    for tables in (rams, disks):
        train_sharded(tables, 30)
    states = [t.state_dict() for t in disks]
    ram_states = [t.state_dict() for t in rams]
    new_rams = sharded(lambda **a: EmbeddingTable(DIM, **ARGS, **a), num_shards, **args)
    new_disks = sharded(lambda **a: ssd(tmp_path, 8000, **a), num_shards, **args)
    for i in range(num_shards):
        new_rams[i].load_state_dict(relayout(ram_states, i, num_shards))
        state = relayout_stores(states, i, num_shards)
        assert "values" not in state and len(state["sources"]) == 2
        new_disks[i].load_state_dict(state)
        c, expected = new_disks[i].counters(), new_rams[i].counters()
        assert c["rows"] == expected["rows"] > 0 and c["pending"] == expected["pending"]
        assert c["cache_rows"] == 0  # streamed into the store, nothing cached
    assert sum(t.counters()["rows"] for t in new_disks) == sum(t.counters()["rows"] for t in disks)
    assert torch.equal(rows_of(new_disks), rows_of(new_rams)) and torch.equal(rows_of(new_rams), rows_of(rams))
    for tables in (new_rams, new_disks):  # ages, optimizer state and counters went along: training goes on alike
        train_sharded(tables, 10, first=31, seed=1)
    assert torch.equal(rows_of(new_disks), rows_of(new_rams))
    assert [t.counters()["rows"] for t in new_disks] == [t.counters()["rows"] for t in new_rams]


def test_a_re_layout_from_a_store_holding_another_shards_rows_is_refused_and_changes_nothing(tmp_path):
    from torchps.ps_server.ssd_tables import relayout_stores

    disks = sharded(lambda **a: ssd(tmp_path, **a), 2)
    train_sharded(disks, 10)
    states = [t.state_dict() for t in disks]
    states[0], states[1] = {**states[0], "store": states[1]["store"]}, {**states[1], "store": states[0]["store"]}
    table = ssd(tmp_path, shard_index=0, num_shards=3)
    table.lookup(torch.tensor([3, 6]))
    before, folders = table.lookup(torch.tensor([3, 6]), admit=False), sorted(table._folder.iterdir())
    with pytest.raises(InvalidArgumentError, match="not shard 0's of 2: it is damaged"):
        table.load_state_dict(relayout_stores(states, 0, 3))
    assert torch.equal(table.lookup(torch.tensor([3, 6]), admit=False), before)
    assert sorted(table._folder.iterdir()) == folders


def test_a_whole_read_streams_the_store_a_part_at_a_time_and_matches_ram(tmp_path):
    ram, disk = EmbeddingTable(DIM, **ARGS), ssd(tmp_path)
    train(ram)
    train(disk)
    expected = ram.changes(0, "")
    rows = disk.counters()["rows"]
    read_before = disk.counters()["disk_bytes_read"]
    parts = disk.read_changes(0, "", max_rows=500)
    first = next(parts)
    assert len(first[3]) == 500 and first[2]  # whole, one part read so far
    assert disk.counters()["disk_bytes_read"] - read_before <= 500 * (disk.row_bytes + 16)
    got = [first, *parts]
    assert len(got) == -(-rows // 500) and {p[:3] for p in got} == {first[:3]}
    for i in (3, 4, 5):
        assert torch.equal(torch.cat([p[i] for p in got]), expected[i])
    assert torch.equal(disk.changes(0, "")[4], expected[4])  # changes() puts the parts together
    in_ram = list(ram.read_changes(0, "", max_rows=500))  # a RAM table's whole read in parts too
    assert len(in_ram) == len(got) and all(len(p[3]) <= 500 for p in in_ram)
    for i in (3, 4, 5):
        assert torch.equal(torch.cat([p[i] for p in in_ram]), expected[i])


def test_rows_changed_during_a_whole_read_come_again_in_the_next_read_from_its_seq(tmp_path):
    disk = ssd(tmp_path)
    train(disk, steps=20)
    parts = disk.read_changes(0, "", max_rows=100)
    incarnation, seq = next(parts)[:2]
    changed = torch.tensor([0, 1, 2, 4999])  # rows already sent and rows not read yet
    disk.lookup(changed)
    disk.apply(changed, torch.ones(4, DIM), 21)
    list(parts)
    _, _, whole, ids, values, held = disk.changes(seq, incarnation)
    assert not whole and set(changed.tolist()) <= set(ids.tolist()) and held.all()
    assert torch.equal(values[torch.isin(ids, changed)], disk.lookup(changed, admit=False))


@pytest.mark.parametrize("where", ["ssd", "ram"])
def test_a_whole_read_of_a_table_replaced_meanwhile_fails_and_a_new_read_sees_the_new_rows(tmp_path, where):
    from torchps.errors import LayoutChangedError

    disk, other = (ssd(tmp_path), ssd(tmp_path)) if where == "ssd" else \
        (EmbeddingTable(DIM, **ARGS), EmbeddingTable(DIM, **ARGS))
    train(disk, steps=20)
    train(other, steps=5)
    parts = disk.read_changes(0, "", max_rows=100)
    next(parts)
    disk.load_state_dict(other.state_dict())
    with pytest.raises(LayoutChangedError, match="read it again"):
        list(parts)
    assert torch.equal(disk.changes(0, "")[4], other.changes(0, "")[4])


@pytest.mark.parametrize("partition", ["modulo", "hash"])
def test_a_fixed_size_table_on_ssd_has_every_row_from_the_start_and_trains_exactly_as_in_ram(tmp_path, partition):
    """A fixed-size table asking for "ssd" writes its initial rows into its store at creation, reads any owned
    id of [0, N) as in RAM (admitting or not, none counted or created), refuses the others, trains bit for bit
    as in RAM through a cache of a fraction of it, and restores from its own state, from a RAM table's, and
    from a re-layout of its stores; the shard's default keeps such tables in memory."""
    args = dict(num_embeddings=5000, shard_index=1, num_shards=2, partition=partition)
    ram, disk = EmbeddingTable(DIM, **ARGS, **args), ssd(tmp_path, **args)
    assert disk.storage == "ssd" and not disk.admits and disk.counters()["rows"] == ram.counters()["rows"]
    mine = torch.from_numpy(ram._owned) if partition == "hash" else torch.arange(1, 5000, 2)
    assert torch.equal(disk.lookup(mine[:700], admit=False), ram.lookup(mine[:700], admit=False))
    with pytest.raises(InvalidArgumentError, match=r"in \[0, 5000\)"):
        disk.lookup(torch.tensor([5001 if partition == "modulo" else 5000]))
    g = torch.Generator().manual_seed(0)
    for step in range(1, 30):
        drawn = torch.unique(mine[torch.randint(0, len(mine), (300,), generator=g)])
        grads = torch.randn(len(drawn), DIM, generator=g)
        for table in (ram, disk):
            table.lookup(drawn)
            table.apply(drawn, grads, step)
    assert disk.counters()["cache_rows"] < len(mine) // 4 and disk.counters()["rows"] == len(mine)
    assert torch.equal(disk.lookup(mine, admit=False), ram.lookup(mine, admit=False))
    for state in (disk.state_dict(), ram.state_dict()):
        back = ssd(tmp_path, initial=False, **args)
        back.load_state_dict(state)
        assert torch.equal(back.lookup(mine, admit=False), ram.lookup(mine, admit=False))
        assert back.counters()["rows"] == len(mine)
    with pytest.raises(InvalidArgumentError, match=r"in \[0, 5000\)"):
        ssd(tmp_path, initial=False, **args).load_state_dict({**ram.state_dict(), "ids": ram.state_dict()["ids"] + 10_000})
    storage = TableStorage("ssd", tmp_path / "storage", cache_bytes=1 << 20)
    assert storage.table("f", DIM, num_embeddings=10).storage == "ram"
    assert storage.table("g", DIM, "ssd", num_embeddings=10).storage == "ssd"



def test_fixed_size_tables_on_ssd_re_lay_out_store_to_store_onto_another_count(tmp_path):
    """Two shards' states of a fixed-size SSD table restore onto one shard (relayout_stores): every row, with
    its optimizer state, as the RAM tables hold them."""
    args = dict(num_embeddings=3000, num_shards=2)
    rams = [EmbeddingTable(DIM, **ARGS, **args, shard_index=i) for i in range(2)]
    disks = [ssd(tmp_path, **args, shard_index=i) for i in range(2)]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 10):
        for i in range(2):
            drawn = torch.unique(torch.randint(0, 1500, (200,), generator=g)) * 2 + i
            grads = torch.randn(len(drawn), DIM, generator=g)
            for table in (rams[i], disks[i]):
                table.apply(drawn, grads, step)
    one = ssd(tmp_path, initial=False, num_embeddings=3000, num_shards=1, shard_index=0)
    states = [d.state_dict() for d in disks]  # their store copies live as long as they do
    one.load_state_dict(relayout_stores(states, 0, 1))
    expected = torch.empty(3000, DIM)
    for i in range(2):
        expected[i::2] = rams[i].lookup(torch.arange(i, 3000, 2), admit=False)
    assert one.counters()["rows"] == 3000
    assert torch.equal(one.lookup(torch.arange(3000), admit=False), expected)
    one.apply(torch.tensor([0, 1]), torch.ones(2, DIM), 10)  # adagrad's state came along: a step as in RAM
    for i in range(2):
        rams[i].apply(torch.tensor([i]), torch.ones(1, DIM), 10)
    assert torch.equal(one.lookup(torch.tensor([0, 1]), admit=False),
                       torch.cat([rams[i].lookup(torch.tensor([i]), admit=False) for i in range(2)]))


def test_a_fixed_size_table_on_ssd_refuses_a_state_short_of_a_row_and_a_creation_cut_off_leaves_nothing(
        tmp_path, monkeypatch):
    """A state missing one of the shard's ids is refused (InvalidArgumentError), the table as it was; a
    creation whose store fails midway (a full disk) raises and leaves no folder behind."""
    args = dict(num_embeddings=100)
    ram, disk = EmbeddingTable(DIM, **ARGS, **args), ssd(tmp_path, **args)
    state = ram.state_dict()
    short = {**state, "ids": state["ids"][1:], "values": state["values"][1:],
             "state": {k: v[1:] for k, v in state["state"].items()}}
    if state.get("update_counts") is not None:
        short["update_counts"] = state["update_counts"][1:]
    with pytest.raises(InvalidArgumentError, match="every id of the shard"):
        disk.load_state_dict(short)
    assert disk.counters()["rows"] == 100 and torch.equal(disk.lookup(torch.arange(100), admit=False),
                                                          ram.lookup(torch.arange(100), admit=False))
    from torchps.ps_server import disk_rows
    put, calls = disk_rows.DiskRows.put, []

    def failing(self, ids, records):
        calls.append(len(ids))
        if len(calls) == 2:
            raise OSError(27, "File too large")
        put(self, ids, records)

    monkeypatch.setattr(disk_rows.DiskRows, "put", failing)
    folder = tmp_path / "cut"
    with pytest.raises(OSError):
        SsdTable(DIM, folder=folder, memory=DiskMemory(1 << 20, 1 << 20), budget=CacheBudget(40_000),
                 num_embeddings=300_000, **ARGS)
    assert len(calls) == 2 and not folder.exists()
