"""Recovery runs the live code (ps_server/replay.py): three journaled shards go through every kind of record a
journal holds, and fresh shards that replay their journals end in the state the live ones had: values,
versions, optimizer state, step, hyperparameters, push ledger, pending sums, tables, data queues, members,
quorum, layout, resize, the arbiters' record and the tie-breaker's. No sockets."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from helpers import wait_until
from torchps import compression
from torchps.errors import ServerUnavailableError
from torchps.proto import ps_pb2
from torchps.ps_server.coordinator import Coordinator
from torchps.ps_server.dataqueue import QueueSpec
from torchps.ps_server.journal import Journal
from torchps.ps_server.modes import SyncConfig
from torchps.ps_server.replay import changes
from torchps.ps_server.server import recover
from torchps.ps_server.store import NewVariable, VariableStore
from torchps.ps_server.tables import RowGradient

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]  # never called: the shards are driven directly
PLACEMENT = {"a": 0, "b": 1, "c": 1}
KINDS = set(changes(coordinator=None, pushes=None, step=None, book=None, queues=None, moves=None, replicas=None,
                    deposals=None, asks=None))
D = 3


def shard(directory: pathlib.Path, index: int) -> Coordinator:
    """Shard `index` of ADDRESSES' two (ps 2: their tie-breaker), recovered from (or started with) the journal in
    `directory`."""
    c = Coordinator(VariableStore(), owns_step=index == 0, index=index, addresses=ADDRESSES, start=False)
    recover(c, Journal(directory, compact_factor=0, min_compact_bytes=1 << 30), None)
    return c


def table(name: str, **fields) -> ps_pb2.TableSpec:
    return ps_pb2.TableSpec(name=name, dim=D, dtype=ps_pb2.FLOAT32, init=ps_pb2.TableInit(distribution="normal",
                            scale=1.0, seed=5), optimizer=ps_pb2.OptimizerSpec(name="adagrad",
                                                                               hyperparams={"lr": 0.5}), **fields)


def grads(seed: int, shapes: dict) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def rows(seed: int, ids: list[int]) -> RowGradient:
    return RowGradient(torch.tensor(ids), torch.randn(len(ids), D, generator=torch.Generator().manual_seed(seed)))


def observed(c: Coordinator) -> dict:
    """The shard's whole state (as a journal base or a checkpoint holds it) and what is derived from it. A
    sync push's reply (its release's) is not journaled: a retry's is computed afresh (pushes._duplicate)."""
    state = c.state(with_pending=True)
    state["ledger"] = sorted(({**entry, "result": None if entry["pending"] else entry["result"]}
                              for entry in state["ledger"]), key=lambda e: (e["worker"], e["incarnation"]))
    members = c.membership.members
    return {**state, "quorum": c.quorum, "min_clock": c.membership.min_clock(),
            "members": {w: (m.live, c.restarted(w)) for w, m in members.items()},
            "hold": (c.layout.epoch, c.layout.hold_from, c.moves.quiet())}


def assert_same(got, expected, where: str = "state") -> None:
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), (where, got.keys(), expected.keys())
        for key in expected.keys() - {"changes"}:  # a table's change-log cursor names the table object, not its rows
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), (where, got, expected)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected), where
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(got, expected), where
    else:
        assert got == expected, (where, got, expected)


def async_kinds(ps0: Coordinator, ps1: Coordinator) -> None:
    """ps 0 (async): creations, hyperparameters, tables, admitting lookups, members, pushes (dense, rows,
    compressed), a data queue; ps 1 refilled at the job's step; a variable moved, a resize, the tables re-laid
    out onto both shards."""
    ps0.create([NewVariable("a", torch.zeros(4, 3), "adam", {"lr": 0.1}),
                NewVariable("b", torch.ones(5), "sgd", {"lr": 0.5, "momentum": 0.9})])
    ps1.create([NewVariable("c", torch.zeros(2), "sgd", {"lr": 1.0})], job_step=3)  # "set_step", then "create"
    ps0.create_tables([table("t", num_embeddings=10), table("d", num_embeddings=0, min_count=1)], 0, 1)
    ps0.set_hyperparams([], {"lr": 0.05})
    for worker, incarnation in (("worker:0", 1), ("worker:1", 1), ("worker:1", 2)):  # worker:1 restarted
        ps0.join(worker, incarnation)
    ps0.lookup_rows([("d", torch.tensor([7, 9]))], admit=True)
    ps0.push("worker:0", 1, 1, 0, {**grads(1, {"a": (4, 3), "b": (5,)}), "t": rows(1, [2, 2, 5]),
                                   "d": rows(2, [7, 8])}, step_increment=1)
    policy = compression.Compression("bf16", min_bytes=0)
    (meta, payload), _ = compression.encode(policy, "a", grads(2, {"a": (4, 3)})["a"], 0, None)
    raw = payload.reshape(-1).view(torch.uint8).numpy()
    decoded = compression.decode("a", meta, raw, ps0.store.get("a").spec.meta)
    ps0.push("worker:1", 2, 1, 0, {"a": decoded}, step_increment=1, received={"a": (meta, raw)})
    ps0.queue_desk.create(QueueSpec("train", num_examples=20, shard_size=10))
    lease, _ = ps0.queue_desk.take("train", "worker:0", 1)
    header = ps_pb2.PushHeader(worker="worker:0", incarnation=1, seq=2, step=0, step_increment=1,
                               data=ps_pb2.DataProgress(queue="train", lease=lease.id, begin=lease.begin,
                                                        end=lease.begin + 4))
    ticket = ps0.queue_desk.before_push(header)
    result = ps0.push("worker:0", 1, 2, 0, grads(3, {"b": (5,)}), step_increment=1)
    ps0.queue_desk.after_push(ticket, header, result)
    ps0.leave("worker:1", 2)

    for each in (ps0, ps1):
        each.moves.set_layout(1, ADDRESSES, PLACEMENT)
    data, step = ps0.moves.export(["b"], 1, 1)
    assert ps1.moves.import_(data, 1, step) == ["b"]
    assert ps0.moves.confirm(["b"], 1) == ["b"]
    ps0.moves.resize(lambda owner: owner.begin("test", ADDRESSES[:1], ADDRESSES, 30.0))
    ps0.set_replica("in_sync", 1, ADDRESSES[1], "127.0.0.1:3")  # ps 1's backup, then its failover
    assert ps0.set_replica("promote", 1, ADDRESSES[1], "127.0.0.1:3")["primary"] == "127.0.0.1:3"
    for each in (ps0, ps1):
        each.moves.set_layout(2, ADDRESSES, PLACEMENT, table_shards=2)
    parts = [ps0.moves.export_tables(2, to)[0] for to in (0, 1)]
    for to, each in enumerate((ps0, ps1)):
        assert sorted(each.moves.import_tables(parts[to], 2, 0, ps0.store.step)) == ["d", "t"]
        each.moves.set_layout(3, ADDRESSES, PLACEMENT, table_shards=2)  # the re-layout ends


def sync_kinds(ps1: Coordinator) -> None:
    """ps 1 (sync, not the step's owner, two batches per worker and step: pushes are answered once summed, each
    with its "add" record): a step applied, the next one half summed, and a hold whose lease runs out. (A step
    of one batch per worker is recorded whole: test_journal, test_table_state.)"""
    ps1.configure(SyncConfig(mode="sync", total_num_replicas=2, replicas_to_aggregate=4, startup_grace_seconds=0))
    for worker in ("worker:0", "worker:1"):
        ps1.join(worker, 1)
    step = ps1.store.step
    for seq in (1, 2):
        ps1.push("worker:0", 1, seq, step, grads(3 + seq, {"b": (5,), "c": (2,)}))
        ps1.push("worker:1", 1, seq, step, grads(5 + seq, {"c": (2,)}))
    assert ps1.wait_for_step(step + 1, timeout=10) == step + 1
    ps1.push("worker:1", 1, 3, step + 1, grads(6, {"b": (5,), "c": (2,)}))
    ps1.moves.set_layout(4, ADDRESSES, PLACEMENT, hold_from=step + 1, hold_lease=0.05)
    wait_until(lambda: not ps1.layout.hold_from, 10, "the hold's lease to run out")
    assert ps1.layout.export()["released"] == [step + 2, 4]  # held after the half-summed step, then ended


def unanswered_ask(ps1: Coordinator, ps2: Coordinator) -> None:
    """ps 1 promotes ps 0's backup through ps 2 (own_promotions.py), which grants it but is not heard from
    again: ps 1 keeps the ask pending (an "ask" record), to take back."""
    def tiebreaker(action, index, primary, failovers, successor, grant, timeout):
        if action == "depose":
            ps2.set_replica(action, index, primary, successor, timeout, failovers=failovers, asker="127.0.0.1:3",
                            grant=grant)  # (the process ps 2 put in ps 1's place: ps 2 refuses ps 1's first)
        raise ServerUnavailableError("ps 2 cannot be reached")

    ps1.set_replica("in_sync", 0, ADDRESSES[0], "127.0.0.1:4")
    ps1.own_promotions.tiebreaker = tiebreaker
    with pytest.raises(ServerUnavailableError):
        ps1.own_promotions.promote(0, ADDRESSES[0], "127.0.0.1:4", "", lambda: ps1._change_replica(
            "promote", 0, ADDRESSES[0], "127.0.0.1:4", None, ""), lambda: 10.0)
    assert ps1.own_promotions.pending() and ps1.replicas.entry(0)["primary"] == ADDRESSES[0]


def test_every_kind_of_record_replays_to_the_state_the_live_shards_had(tmp_path):
    folders = [tmp_path / "ps0", tmp_path / "ps1", tmp_path / "ps2"]
    shards = [shard(folder, index) for index, folder in enumerate(folders)]
    ps0, ps1, ps2 = shards
    async_kinds(ps0, ps1)
    sync_kinds(ps1)
    ps2.set_replica("depose", 1, ADDRESSES[1], "127.0.0.1:3", 10, failovers=0, asker=ADDRESSES[0], grant="first")
    ps2.set_replica("reinstate", 0, "", "", 10, grant="late")  # a take-back ahead of its ask: noted
    unanswered_ask(ps1, ps2)
    for each in shards:  # every record queued is written (the hold's end is queued as it ends in memory,
        each.recorder.durable_all(10)  # which is all the scenario waits for; a loaded machine writes it later)
    expected = [observed(each) for each in shards]
    bases = [each.state(with_pending=True) for each in shards]  # what a compaction writes as a journal's base
    assert "replicas" in bases[0] and "asks" in bases[1] and "deposed" in bases[2]
    for each in shards:
        each.close()
    recorded = {record.kind for folder in folders for record in Journal(folder).recover()[1]}
    assert recorded == KINDS, "the scenario makes every kind of record replay.py knows"

    for index, folder in enumerate(folders):
        back = shard(folder, index)
        try:
            assert_same(observed(back), expected[index], f"ps {index}")
        finally:
            back.close()
        based = Coordinator(VariableStore(), owns_step=index == 0, index=index, addresses=ADDRESSES, start=False)
        based.restore(bases[index], exact=True)  # a journal's base: what a shard recovers before its records
        based.start()
        try:
            assert_same(observed(based), expected[index], f"ps {index} from its base")
        finally:
            based.close()
