"""Embedding tables against a shard's --max-memory, on real ps-server processes: a fixed table too big for one
shard's budget is refused there and trains spread over two; a dynamic table stops admitting rows once its
shard is at its budget (RESOURCE_EXHAUSTED naming it, nothing admitted) while reads go on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchps.client import Embedding, Optimizer, PSClient, ResourceExhaustedError, ShardBusyError

ROWS, DIM = 20_000, 16  # 1.28 MB of float32 rows: over a 1 MiB budget, half of it under


def _model() -> nn.Module:
    return nn.ModuleDict({"emb": Embedding(ROWS, DIM, optimizer=Optimizer("sgd", lr=0.5))})


def handlers_entered(ps: PSClient, call) -> int:
    """Handlers the shard entered for call() (which must raise ResourceExhaustedError, not ShardBusyError) and
    for the status read after it: a budget is not retried, so each call of it is made once."""
    before = ps.status(0).calls_started
    with pytest.raises(ResourceExhaustedError, match="--max-memory") as info:
        call()
    assert not isinstance(info.value, ShardBusyError), info.value
    return ps.status(0).calls_started - before


def test_a_table_over_one_shards_budget_is_refused_there_and_nothing_is_created(local_cluster):
    """Refused at once: a client retries a shard's limits on work in progress (ShardBusyError), never its
    budget, which stands until the caller changes something (before, each refusal was retried for
    connect_timeout, seconds to minutes, and only then raised)."""
    local = local_cluster(1, server_args=["--max-memory", "1M"])
    with PSClient(local.cluster, connect_timeout=600) as ps:
        made = handlers_entered(ps, lambda: ps.register_module(_model(), Optimizer("sgd", lr=0.5), create=True,
                                                                join=False))
        assert made <= 4, f"{made} handlers: GetLayout twice, CreateTables, GetStatus"
        assert not list(ps.status(0).tables)


def test_the_same_table_over_two_shards_fits_each_budget_and_trains(local_cluster):
    local = local_cluster(2, server_args=["--max-memory", "1M"])
    with PSClient(local.cluster, connect_timeout=10) as ps:
        model = _model()
        binding = ps.register_module(model, Optimizer("sgd", lr=0.5), create=True, join=False)
        name = model["emb"].table_name
        ids = torch.arange(0, ROWS, 97)
        before = ps.lookup_rows({name: ids})[name]
        model["emb"](ids).sum().backward()
        binding.push()
        after = ps.lookup_rows({name: ids})[name]
        assert torch.allclose(after, before - 0.5)  # d(sum)/d(row) = 1 for each distinct id, lr 0.5
        held = [next(t for t in ps.status(s).tables if t.name == name).bytes for s in range(2)]
        assert all(0 < b < 1 << 20 for b in held) and sum(held) >= ROWS * DIM * 4


def test_a_dynamic_table_stops_admitting_at_the_budget_and_reads_go_on(local_cluster):
    local = local_cluster(1, server_args=["--max-memory", "256K"])
    with PSClient(local.cluster, connect_timeout=600) as ps:
        model = nn.ModuleDict({"emb": Embedding(None, DIM, optimizer=Optimizer("sgd", lr=0.5))})
        ps.register_module(model, Optimizer("sgd", lr=0.5), create=True, join=False)
        name = model["emb"].table_name
        admitted, batch = 0, 1024
        with pytest.raises(ResourceExhaustedError, match="--max-memory") as info:
            for start in range(0, 1 << 20, batch):  # far more rows than 256 KiB can hold
                ps.lookup_rows({name: torch.arange(start, start + batch)}, admit=True)
                admitted += batch
        assert "capacity=" in str(info.value)
        table = next(t for t in ps.status(0).tables if t.name == name)
        assert table.admitted == admitted and table.rows == admitted  # the refused lookup admitted nothing
        assert table.bytes >= 256 << 10
        rows = ps.lookup_rows({name: torch.arange(0, 8)}, admit=False)[name]  # reading still works
        assert rows.shape == (8, DIM)


def test_variables_are_created_within_what_the_tables_leave_of_the_budget(local_cluster):
    """CreateVariables counts the embedding tables a shard holds against its --max-memory, as CreateTables
    counts its variables: one budget for both."""
    local = local_cluster(1, server_args=["--max-memory", "1M"])
    with PSClient(local.cluster, connect_timeout=600) as ps:
        model = nn.ModuleDict({"emb": Embedding(ROWS // 2, DIM, optimizer=Optimizer("sgd", lr=0.5))})  # 640 KB
        ps.register_module(model, Optimizer("sgd", lr=0.5), create=True, join=False)
        made = handlers_entered(ps, lambda: ps.create_variables({"dense/big": torch.zeros(1 << 17)},
                                                                 Optimizer("sgd", lr=0.1)))  # + 512 KiB
        assert made <= 3, f"{made} handlers: GetLayout, CreateVariables, GetStatus"
        assert ps.create_variables({"dense/small": torch.zeros(1 << 16)}, Optimizer("sgd", lr=0.1)) == \
            {"dense/small": True}  # + 256 KiB fits


def test_a_fixed_hash_table_never_makes_its_whole_id_range_on_a_shard(local_cluster):
    """A "hash" table of 32M ids over 1024 shards: this shard's part is 32K rows (and the index of their ids,
    counted in its budget); the ids it owns are found a chunk at a time, not by hashing an array of all
    32M ids (256 MB, and as much again for each temporary of the hash)."""
    import grpc

    from torchps.proto import ps_pb2, ps_pb2_grpc

    local = local_cluster(1, server_args=["--max-memory", "64M"])
    status = "/proc/{}/status".format(local.procs[0].pid)

    def vm_peak_kib() -> int:
        return next(int(line.split()[1]) for line in open(status) if line.startswith("VmPeak:"))

    def create(name: str, num_embeddings: int) -> None:
        spec = ps_pb2.TableSpec(name=name, dim=4, num_embeddings=num_embeddings, dtype=ps_pb2.FLOAT32,
                                partition=ps_pb2.PARTITION_HASH, optimizer=ps_pb2.OptimizerSpec(name="sgd"),
                                init=ps_pb2.TableInit(distribution="normal", scale=1.0))
        reply = stub.CreateTables(ps_pb2.CreateTablesRequest(tables=[spec], shard_index=0, num_shards=1024),
                                  timeout=120)
        assert list(reply.created) == [True]

    with grpc.insecure_channel(local.cluster.ps[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        create("narrow", 1 << 16)  # the first creation's threads and heaps, before measuring
        before = vm_peak_kib()
        create("wide", 1 << 25)
        grown = vm_peak_kib() - before
        table = next(t for t in stub.GetStatus(ps_pb2.StatusRequest(), timeout=30).tables if t.name == "wide")
    assert 31_000 < table.rows < 34_000
    assert grown < 64 << 10, f"the shard's peak grew by {grown} KiB making a part of {table.bytes} bytes"
