"""Embedding tables in the journal and in checkpoints (ps_server/table_state.py, journal, checkpoint), without
sockets.

A journaled shard that dies comes back with every table exactly as it was
(rows, lazy optimizer state, dynamic tables' ids, ages, admission counters),
compacted or not, and knows its last push; a checkpoint's table sections
restore exactly, and re-lay out onto another shard count by the id partition;
shard 0 commits no checkpoint whose shard files disagree on the tables; a
damaged or incomplete table section is refused, never restored partly.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from torchps import rows
from torchps.errors import CheckpointError
from torchps.proto import ps_pb2
from torchps.ps_server import checkpoint, table_state
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.journal import Journal
from torchps.ps_server.server import recover
from torchps.ps_server.store import NewVariable, VariableStore
from torchps.ps_server.tables import RowGradient

D = 3
N = 40  # rows of the fixed-size table
WORKER, INCARNATION = "worker:0", 7


def specs() -> list[ps_pb2.TableSpec]:
    """A fixed-size table (Adagrad, hash partition) and a dynamic one (SparseAdam, min_count 2, max_age 4)."""
    init = ps_pb2.TableInit(distribution="normal", scale=1.0, seed=11)
    fixed = ps_pb2.TableSpec(name="fix", dim=D, num_embeddings=N, dtype=ps_pb2.FLOAT32,
                             partition=ps_pb2.PARTITION_HASH, init=init,
                             optimizer=ps_pb2.OptimizerSpec(name="adagrad", hyperparams={"lr": 0.3, "lr_decay": 0.01}))
    dynamic = ps_pb2.TableSpec(name="dyn", dim=D, dtype=ps_pb2.FLOAT32, init=init, min_count=2, max_age=4,
                               optimizer=ps_pb2.OptimizerSpec(name="sparse_adam", hyperparams={"lr": 0.05}))
    return [fixed, dynamic]


def mine(ids: torch.Tensor, shard: int, num_shards: int, partition: str) -> torch.Tensor:
    return ids[rows.shard_of(ids, num_shards, partition) == shard]


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step k's ids: of the fixed table, and of the dynamic one (any int64, repeats across steps)."""
    g = torch.Generator().manual_seed(k)
    return torch.unique(torch.randint(0, N, (12,), generator=g)), torch.unique(torch.randint(-9, 9, (8,), generator=g))


def train(c: Coordinator, k: int, seq: int, shard: int = 0, num_shards: int = 1, dense: bool = True) -> None:
    """One training step on shard `shard`: an admitting lookup of its ids, then a push of their row gradients
    (and a dense gradient) at the shard's step."""
    look(c, k, shard, num_shards)
    push(c, k, seq, shard, num_shards, dense)


def look(c: Coordinator, k: int, shard: int = 0, num_shards: int = 1) -> None:
    fixed, dynamic = batch(k)
    fixed, dynamic = mine(fixed, shard, num_shards, "hash"), mine(dynamic, shard, num_shards, "modulo")
    c.lookup_rows([("fix", fixed), ("dyn", dynamic)], admit=True)


def push(c: Coordinator, k: int, seq: int, shard: int = 0, num_shards: int = 1, dense: bool = True) -> None:
    fixed, dynamic = batch(k)
    fixed, dynamic = mine(fixed, shard, num_shards, "hash"), mine(dynamic, shard, num_shards, "modulo")
    g = torch.Generator().manual_seed(100 + k)
    grads = {"fix": RowGradient(fixed, torch.randn(len(fixed), D, generator=g)),
             "dyn": RowGradient(dynamic, torch.randn(len(dynamic), D, generator=g))}
    if dense:
        grads["w"] = torch.randn(2, generator=g)
    c.push(WORKER, INCARNATION, seq, c.store.step, grads, step_increment=1)


def shard(directory: pathlib.Path, compact_bytes: int = 1 << 30) -> Coordinator:
    c = Coordinator(VariableStore(), owns_step=True, start=False)
    recover(c, Journal(directory, compact_factor=0, min_compact_bytes=compact_bytes), None)
    return c


def assert_same_tables(got: list[dict], expected: list[dict], what: str) -> None:
    """Bit for bit: every table's spec, layout, rows, optimizer state, step counts, events, ages, counters."""
    assert [e["name"] for e in got] == [e["name"] for e in expected], what
    for a, b in zip(got, expected):
        assert (a["spec"], a["shard_index"], a["num_shards"]) == (b["spec"], b["shard_index"], b["num_shards"]), what
        assert_same_state(a["state"], b["state"], f"{what}: table {a['name']!r}")


def assert_same_state(a: dict, b: dict, what: str) -> None:
    for key in ("config", "optimizer_steps", "step", "events"):
        assert a[key] == b[key], f"{what}: {key} {a[key]} != {b[key]}"
    for key in ("ids", "values", "last_update"):
        if key in b:
            assert torch.equal(a[key], b[key]), f"{what}: {key} differ"
    assert a.keys() == b.keys() and a["state"].keys() == b["state"].keys(), what
    for key in b["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), f"{what}: optimizer state {key!r} differs"
    for key in b.get("pending", {}):
        assert torch.equal(a["pending"][key], b["pending"][key]), f"{what}: pending {key} differ"


# -- the journal ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compact_bytes", [1 << 30, 6000], ids=["one-log", "compacted"])
def test_a_journaled_shard_comes_back_with_every_table_exactly(tmp_path, compact_bytes):
    c = shard(tmp_path, compact_bytes)
    c.create([NewVariable("w", torch.zeros(2), "sgd", {"lr": 0.1})])
    c.create_tables(specs(), 0, 1)
    for k in range(1, 12):
        train(c, k, seq=k)
    c.lookup_rows([("dyn", torch.tensor([77, 78]))], admit=True)  # counted once, never pushed: pending
    c.wait_for_compaction()
    expected, step = table_state.section(c.tables), c.store.step
    dyn = expected[1]["state"]
    assert len(dyn["pending"]["ids"]) >= 2 and dyn["events"]["admitted"] > 0, "the test exercises admission"
    assert dyn["events"]["evicted_by_age"] > 0, "and eviction by age"
    c.close()
    if compact_bytes < 1 << 30:
        assert not (tmp_path / "base-000000.bin").exists(), "compacted at least once"

    back = shard(tmp_path, compact_bytes)
    assert back.store.step == step
    assert_same_tables(table_state.section(back.tables), expected, "after recovery")
    fixed, dynamic = batch(11)
    retry = {"fix": RowGradient(fixed, torch.ones(len(fixed), D)),
             "dyn": RowGradient(dynamic, torch.ones(len(dynamic), D))}
    assert back.push(WORKER, INCARNATION, 11, step - 1, retry, step_increment=1).duplicate, \
        "the last push is known: its retry is not applied again"
    assert_same_tables(table_state.section(back.tables), expected, "after the retried push")
    back.close()


def test_a_push_whose_record_never_landed_is_not_replayed_half(tmp_path):
    """The journal's record of a push carries its dense and row gradients together: cut off, neither is
    replayed (the push was never acknowledged), and the shard takes its retry once."""
    c = shard(tmp_path)
    c.create([NewVariable("w", torch.zeros(2), "sgd", {"lr": 0.1})])
    c.create_tables(specs(), 0, 1)
    train(c, 1, seq=1)
    look(c, 2)
    before, step = table_state.section(c.tables), c.store.step
    log = tmp_path / "log-000000.bin"
    size = log.stat().st_size
    push(c, 2, seq=2)
    after = table_state.section(c.tables)
    c.close()
    with open(log, "r+b") as f:  # the last record (the push of seq 2) torn mid-write, as by a crash
        f.truncate(size + (log.stat().st_size - size) // 2)
    back = shard(tmp_path)
    assert back.store.step == step
    assert_same_tables(table_state.section(back.tables), before, "without the torn push")
    push(back, 2, seq=2)  # the client's retry: applied now, once
    assert_same_tables(table_state.section(back.tables), after, "after the retry")
    back.close()


# -- checkpoints ------------------------------------------------------------------------------------------

MANIFEST = {"strategy": "round_robin", "num_ps": 2, "variables": [["w", 8]], "partitions": {"splits": {}}}


def two_shard_checkpoint(directory: pathlib.Path, steps: int = 6) -> list[list[dict]]:
    """A committed checkpoint of two in-process shards that trained `steps` steps; their table sections."""
    shards = []
    for index in range(2):
        c = Coordinator(VariableStore(), owns_step=index == 0)
        if index == 0:
            c.create([NewVariable("w", torch.zeros(2), "sgd", {"lr": 0.1})])
        c.create_tables(specs(), index, 2)
        for k in range(1, steps + 1):
            train(c, k, seq=k, shard=index, num_shards=2, dense=index == 0)
        shards.append(c)
    written = [checkpoint.write_shard(directory, i, steps, c.state(with_pending=False)) for i, c in enumerate(shards)]
    checkpoint.commit(directory, steps, MANIFEST, [(i, size, steps, 0) for i, (_, size) in enumerate(written)], keep=0)
    sections = [table_state.section(c.tables) for c in shards]
    for c in shards:
        c.close()
    return sections


def restored(directory: pathlib.Path, index: int, num_ps: int) -> Coordinator:
    c = Coordinator(VariableStore(), owns_step=index == 0, start=False)
    c.restore(checkpoint.restore_state(directory, index, num_ps))
    return c


def test_a_checkpoint_lists_its_tables_and_restores_each_shards_rows_exactly(tmp_path):
    sections = two_shard_checkpoint(tmp_path)
    manifest = json.loads((checkpoint.step_dir(tmp_path, 6) / "manifest.json").read_text())
    assert manifest["format"] == "torchps-checkpoint-v3"
    assert [(t["name"], t["partition"], t["num_shards"], t["num_embeddings"], t["dim"], t["dtype"])
            for t in manifest["tables"]] == [("fix", "hash", 2, N, D, "float32"),
                                             ("dyn", "modulo", 2, None, D, "float32")]
    assert manifest["tables"][0]["spec"]["optimizer"]["name"] == "adagrad"
    for index in range(2):
        c = restored(tmp_path, index, 2)
        assert_same_tables(table_state.section(c.tables), sections[index], f"ps {index}")
        c.close()


def by_id(entries: list[dict]) -> dict[str, dict[int, tuple]]:
    """{table: {id: (value row, optimizer state rows, last update)}} over the shards' sections."""
    out: dict[str, dict[int, tuple]] = {}
    for entry in entries:
        s = entry["state"]
        table = out.setdefault(entry["name"], {})
        for i, key in enumerate(s["ids"].tolist()):
            assert key not in table, f"id {key} of {entry['name']!r} on two shards"
            table[key] = (s["values"][i], {k: v[i] for k, v in s["state"].items()},
                          int(s["last_update"][i]) if "last_update" in s else None)
    return out


def pending(entries: list[dict]) -> dict[int, tuple[int, int]]:
    out = {}
    for entry in entries:
        if entry["name"] == "dyn":
            p = entry["state"]["pending"]
            out.update({int(i): (int(c), int(s)) for i, c, s in zip(p["ids"], p["counts"], p["last_seen"])})
    return out


@pytest.mark.parametrize("num_ps", [3, 1])
def test_a_relayout_puts_every_row_with_its_state_where_the_partition_says(tmp_path, num_ps):
    sections = two_shard_checkpoint(tmp_path)
    old = [entry for section in sections for entry in section]
    new = []
    for index in range(num_ps):
        c = restored(tmp_path, index, num_ps)
        section = table_state.section(c.tables)
        for entry, spec in zip(section, specs()):
            assert (entry["shard_index"], entry["num_shards"]) == (index, num_ps)
            owner = rows.shard_of(entry["state"]["ids"], num_ps, rows.partition_name(spec.partition))
            assert bool((owner == index).all()), f"{entry['name']}: rows of another shard on ps {index} of {num_ps}"
            assert entry["state"]["optimizer_steps"] == 6
        p = section[1]["state"]["pending"]["ids"]
        assert bool((rows.shard_of(p, num_ps, "modulo") == index).all()), "occurrence counters move with their ids"
        if spec.num_embeddings:
            assert len(section[0]["state"]["ids"]) == len(mine(torch.arange(N), index, num_ps, "hash"))
        new += section
        c.close()
    want, got = by_id(old), by_id(new)
    assert got.keys() == want.keys() and all(got[t].keys() == want[t].keys() for t in want), "every row, once"
    for table in want:
        for key, (value, state, age) in want[table].items():
            value2, state2, age2 = got[table][key]
            assert torch.equal(value, value2) and age == age2, (table, key)
            assert all(torch.equal(state[k], state2[k]) for k in state), (table, key)
    assert pending(new) == pending(old)


def test_shard_files_that_disagree_on_tables_are_not_committed(tmp_path):
    c = Coordinator(VariableStore(), owns_step=True)
    c.create_tables(specs(), 0, 2)
    other = Coordinator(VariableStore(), owns_step=False)
    other.create_tables(specs()[:1], 1, 2)  # ps 1 lost the dynamic table
    written = [checkpoint.write_shard(tmp_path, i, 0, s.state(with_pending=False)) for i, s in enumerate([c, other])]
    with pytest.raises(CheckpointError, match=r"ps-1.pt holds embedding tables \['fix'\] and ps-0.pt \['fix', 'dyn'\]"):
        checkpoint.commit(tmp_path, 0, MANIFEST, [(i, size, 0, 0) for i, (_, size) in enumerate(written)], keep=0)
    assert checkpoint.latest_committed(tmp_path) is None, "nothing committed"
    c.close()
    other.close()


def _drop_table(state):
    state["tables"] = state["tables"][:1]


def _drop_values(state):
    del state["tables"][1]["state"]["values"]


def _short_values(state):
    state["tables"][0]["state"]["values"] = state["tables"][0]["state"]["values"][:-1]


def _bad_spec(state):
    state["tables"][0]["spec"] = b"\xff\xff not a spec"


def _wrong_shard(state):
    state["tables"][1]["shard_index"] = 0


def _foreign_rows(state):
    ids = state["tables"][1]["state"]["ids"]
    state["tables"][1]["state"]["ids"] = ids - 1  # every id of the other shard (modulo 2)


DAMAGES = {  # damage: (the change to ps-1.pt, what restoring its own file says, what a re-layout says)
    "a table missing": (_drop_table, r"ps-1.pt: .* do not match the manifest's \(missing \['dyn'\]", None),
    "no values": (_drop_values, r"ps-1.pt: embedding table 'dyn' cannot be restored .*'values'",
                  r"checkpoint 3 of .*: embedding table 'dyn' cannot be re-laid out .*'values'"),
    "a row short": (_short_values, r"ps-1.pt: embedding table 'fix' cannot be restored .*do not fit",
                    r"checkpoint 3 of .*: embedding table 'fix' cannot be re-laid out"),
    "a bad spec": (_bad_spec, r"ps-1.pt: embedding table 'fix' has no readable spec", None),
    "another shard's layout": (_wrong_shard, r"ps-1.pt: embedding table 'dyn' is saved as shard 0 of 2; this file "
                                             r"is shard 1 of 2", None),
    "rows of another shard": (_foreign_rows, r"ps-1.pt: embedding table 'dyn' cannot be restored .*not on shard 1",
                              r"embedding table 'dyn': .*ps-1.pt holds rows of ids that are not shard 1's of 2"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_or_incomplete_table_section_is_refused_not_restored_partly(tmp_path, damage):
    two_shard_checkpoint(tmp_path, steps=3)
    path = checkpoint.step_dir(tmp_path, 3) / "ps-1.pt"
    state = torch.load(path, weights_only=True)
    change, own, relaid = DAMAGES[damage]
    change(state)
    torch.save(state, path)
    assert restored(tmp_path, 0, 2).tables.names() == ["fix", "dyn"], "ps 0's own file is whole"
    with pytest.raises(CheckpointError, match=own):
        restored(tmp_path, 1, 2)
    for index in range(3):  # a re-layout reads every shard's file
        with pytest.raises(CheckpointError, match=relaid or own):
            restored(tmp_path, index, 3)


@pytest.mark.parametrize("compact_bytes", [1 << 30, 3000], ids=["one-log", "compacted"])
def test_sync_row_sums_and_applied_steps_survive_a_crash_as_a_shard_that_never_stopped(tmp_path, compact_bytes):
    """Sync mode: two workers' row gradients summed per step, applied with the step; a step half full when the
    shard dies is completed after recovery exactly as on a twin shard that never stopped (the push held in it
    was never acknowledged, so it is not in the journal, whose step records carry the averages: the worker's
    retry is summed afresh). (A sync push with rows is held until its step applies: each worker pushes from
    its own thread.)"""
    from concurrent import futures

    from torchps.errors import ServerUnavailableError
    from torchps.ps_server.modes import SyncConfig

    def start(journal: pathlib.Path | None) -> Coordinator:
        c = Coordinator(VariableStore(), owns_step=False, start=False)
        recover(c, Journal(journal, compact_factor=0, min_compact_bytes=compact_bytes) if journal else None, None)
        return c

    def sync_push(c: Coordinator, worker: str, seq: int, step: int, k: int):
        fixed, dynamic = batch(k)
        g = torch.Generator().manual_seed(200 + k)
        return c.push(worker, 1, seq, step, {"fix": RowGradient(fixed, torch.randn(len(fixed), D, generator=g)),
                                             "dyn": RowGradient(dynamic, torch.randn(len(dynamic), D, generator=g)),
                                             "w": torch.randn(2, generator=g)}, timeout=30)

    pool = futures.ThreadPoolExecutor(4)
    killed, twin = start(tmp_path / "journal"), start(None)
    held = {}
    for c in (killed, twin):
        c.configure(SyncConfig(mode="sync", total_num_replicas=2, startup_grace_seconds=0, lease_seconds=60))
        c.create([NewVariable("w", torch.zeros(2), "sgd", {"lr": 0.1})])
        c.create_tables(specs(), 0, 1)
        for worker in ("worker:0", "worker:1"):
            c.join(worker, 1)
        for step in range(4):
            look(c, step)
            pushes = [pool.submit(sync_push, c, f"worker:{w}", step + 1, step, 2 * step + w) for w in (0, 1)]
            assert [f.result().step for f in pushes] == [step + 1] * 2
        held[c] = pool.submit(sync_push, c, "worker:0", 5, 4, 8)  # step 4 half full: its push waits
    killed.wait_for_compaction()
    for c in (killed, twin):
        assert c.store.step == 4 and not held[c].done()
    expected = table_state.section(killed.tables)
    assert_same_tables(expected, table_state.section(twin.tables), "the twins before the crash")
    killed.close()
    with pytest.raises(ServerUnavailableError):
        held[killed].result()
    if compact_bytes < 1 << 30:
        assert not (tmp_path / "journal" / "base-000000.bin").exists(), "compacted at least once"

    back = start(tmp_path / "journal")
    assert back.store.step == 4
    assert_same_tables(table_state.section(back.tables), expected, "after recovery")
    for c in (back, twin):
        for worker in ("worker:0", "worker:1"):
            c.join(worker, 1, 4)
    retry = pool.submit(sync_push, back, "worker:0", 5, 4, 8)  # never acknowledged: not in the journal
    assert sync_push(back, "worker:1", 5, 4, 9).step == 5 and retry.result().step == 5
    assert not retry.result().duplicate, "summed afresh after recovery"
    assert sync_push(twin, "worker:1", 5, 4, 9).step == 5, "completes step 4 with the push counted before"
    assert held[twin].result().step == 5
    assert_same_tables(table_state.section(back.tables), table_state.section(twin.tables),
                       "step 4 completed after recovery, as on the twin")
    back.close()
    twin.close()
    pool.shutdown()


def test_a_checkpoint_after_a_full_one_never_links_the_full_ones_table_files(tmp_path, monkeypatch):
    """A table store on another file system than the checkpoints is linked from the newest committed
    checkpoint's copy where a file is the same (ssd_tables.place_stores' `earlier`); a full checkpoint marks
    its copy, so the next one links from an older one instead, and the full one shares no file."""
    from torchps.ps_server.ssd_tables import TableStorage

    shard = Coordinator(VariableStore(), owns_step=True, table_storage=TableStorage("ssd", tmp_path / "tables"))
    spec = ps_pb2.TableSpec(name="d", dim=2, dtype=ps_pb2.FLOAT32, init=ps_pb2.TableInit(distribution="normal"),
                            optimizer=ps_pb2.OptimizerSpec(name="sgd", hyperparams={"lr": 0.1}))
    shard.create_tables([spec], 0, 1)
    shard.lookup_rows([("d", torch.arange(10))], admit=True)
    earlier = []
    place = checkpoint.place_stores
    monkeypatch.setattr(checkpoint, "place_stores", lambda *a, **k: earlier.append(a[3]) or place(*a, **k))
    manifest = {"strategy": "round_robin", "num_ps": 1, "variables": [], "partitions": {"splits": {}}}
    for step, full in ((3, False), (6, True), (9, False)):
        state = shard.state(with_pending=False)
        _, size = checkpoint.write_shard(tmp_path / "ckpt", 0, step, state, full=full)
        checkpoint.commit(tmp_path / "ckpt", step, manifest, [(0, size, state["step"], 0)], keep=0)
    third = checkpoint.step_dir(tmp_path / "ckpt", 3) / "ps-0.stores"
    assert earlier == [None, third, third]  # checkpoint 9 links from 3's copy, not from the full 6
    assert (checkpoint.step_dir(tmp_path / "ckpt", 6) / "ps-0.stores" / checkpoint.FULL_MARK).exists()
    shard.close()
