"""Storage per table (TableSpec.storage, the modules' storage=), against real ps-server processes: on a shard
given --table-dir whose default stays in RAM, a table asking for "ssd" is kept on disk beside one in memory,
both train as in a RAM cluster and come back from a SIGKILL (journal, then checkpoint) where they were kept;
a fixed-size table asking for "ssd" is kept there too (every row written at its creation); a table the shard
cannot keep where it asks (no --table-dir, an unknown storage)
and a spec that differs in its storage alone are refused with their status codes, and nothing is created.
Ordering is by replies and process exits, never by sleeping."""

from __future__ import annotations

import pathlib
import shutil
import signal
import sys

import grpc
import pytest
import torch

from torchps.client import Embedding, Optimizer, PSClient, TaskSpec
from torchps.errors import InvalidArgumentError, ModeConflictError, SpecConflictError
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from table_job import at_once  # noqa: E402

D = 4
IDS = torch.arange(3000)
CHIEF = TaskSpec("worker", 0)  # worker 0 of a cluster without a chief: it creates the tables


class Model(torch.nn.Module):
    """Two dynamic tables, "disk" kept where `storage` says and "mem" where the shard keeps tables, and a
    fixed-size one, "sized", kept where `storage` says (the shard's default keeps it in memory)."""

    def __init__(self, storage: str | None):
        super().__init__()
        self.disk = Embedding(None, D, optimizer=Optimizer("adagrad", lr=0.1), storage=storage, seed=1)
        self.mem = Embedding(None, D, optimizer=Optimizer("adagrad", lr=0.1), seed=2)
        self.sized = Embedding(len(IDS), D, optimizer=Optimizer("adagrad", lr=0.1), storage=storage, seed=3)

    def forward(self, ids):
        return self.disk(ids).sum() + 2 * self.mem(ids).sum() + 3 * self.sized(ids).sum()


def train(binding, model, steps: range) -> None:
    for k in steps:
        ids = torch.unique(IDS[torch.randint(0, len(IDS), (400,), generator=torch.Generator().manual_seed(k))])
        model(ids).backward()
        binding.exchange()


def rows(client: PSClient) -> dict[str, torch.Tensor]:
    return client.lookup_rows({"disk.weight": IDS, "mem.weight": IDS, "sized.weight": IDS})


def test_a_table_asking_for_ssd_is_kept_on_disk_beside_one_in_ram_and_both_recover(tmp_path):
    ckpt = tmp_path / "ckpt"
    mixed = LocalCluster(1, workers=1, server_args=["--table-dir", str(tmp_path / "tables"), "--table-cache", "32K",
                                         "--checkpoint-dir", str(ckpt)])
    ram = LocalCluster(1, workers=1, server_args=["--no-journal"])
    try:
        at_once("start", mixed, ram)
        with PSClient(mixed.cluster, task=CHIEF, connect_timeout=20) as a, \
                PSClient(ram.cluster, task=CHIEF, connect_timeout=20) as r:
            models = [Model("ssd"), Model(None)]  # the reference keeps both in RAM
            bindings = [c.register_module(m, Optimizer("sgd", lr=0.1)) for c, m in zip((a, r), models)]
            for binding, model in zip(bindings, models):
                train(binding, model, range(1, 9))
            tables = {t.name: t for t in a.status(0).tables}
            assert (tables["disk.weight"].storage, tables["mem.weight"].storage) == ("ssd", "ram")
            assert tables["disk.weight"].rows > 2 * tables["disk.weight"].cache_rows > 0, "most of it on disk only"
            assert tables["mem.weight"].cache_rows == 0
            expected = rows(r)
            assert all(torch.equal(rows(a)[k], v) for k, v in expected.items())
            with pytest.raises(SpecConflictError):  # the same table but for where it is kept
                spec = models[0].disk.table_spec("disk.weight")
                spec.storage = "ram"
                a.create_tables([spec])

            assert mixed.kill_ps(0) == -signal.SIGKILL  # 1. back from the journal, each table where it was
            mixed.start_ps(0)
            assert {t.name: t.storage for t in a.status(0).tables} == {"disk.weight": "ssd", "mem.weight": "ram", "sized.weight": "ssd"}
            assert all(torch.equal(rows(a)[k], v) for k, v in expected.items())
            assert a.save_checkpoint(0) == 8
            assert mixed.kill_ps(0) == -signal.SIGKILL  # 2. back from the checkpoint alone
            shutil.rmtree(ckpt / "journal" / "ps-0")
            mixed.start_ps(0)
            assert {t.name: t.storage for t in a.status(0).tables} == {"disk.weight": "ssd", "mem.weight": "ram", "sized.weight": "ssd"}
            assert all(torch.equal(rows(a)[k], v) for k, v in expected.items())
            train(bindings[0], models[0], range(9, 11))
            train(bindings[1], models[1], range(9, 11))
            assert all(torch.equal(rows(a)[k], v) for k, v in rows(r).items())
    finally:
        at_once("stop", mixed, ram)


def test_a_table_the_shard_cannot_keep_where_it_asks_is_refused_and_nothing_is_created(tmp_path):
    with pytest.raises(InvalidArgumentError, match="storage must be"):
        Embedding(None, D, storage="disk")
    init = ps_pb2.TableInit(distribution="normal", scale=1.0, seed=5)
    spec = ps_pb2.TableSpec(name="t", dim=D, dtype=ps_pb2.FLOAT32, storage="ssd", init=init,
                            optimizer=Optimizer("sgd", lr=0.1).to_proto())
    fixed = ps_pb2.TableSpec(name="f", dim=D, dtype=ps_pb2.FLOAT32, num_embeddings=10, storage="ssd", init=init,
                             optimizer=Optimizer("sgd", lr=0.1).to_proto())
    odd = ps_pb2.TableSpec(name="o", dim=D, dtype=ps_pb2.FLOAT32, storage="nvme", init=init,
                           optimizer=Optimizer("sgd", lr=0.1).to_proto())
    with LocalCluster(1) as local, PSClient(local.cluster, connect_timeout=20) as client, \
            grpc.insecure_channel(local.cluster.ps[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        for specs, code, error in [([spec], grpc.StatusCode.FAILED_PRECONDITION, ModeConflictError),
                                   ([fixed], grpc.StatusCode.FAILED_PRECONDITION, ModeConflictError),
                                   ([odd], grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError)]:
            with pytest.raises(grpc.RpcError) as raised:
                stub.CreateTables(ps_pb2.CreateTablesRequest(tables=specs, shard_index=0, num_shards=1), timeout=20)
            assert raised.value.code() == code, raised.value.details()
            with pytest.raises(error):
                client.create_tables(specs)
        with pytest.raises(ModeConflictError, match="--table-dir"):  # all or nothing: the RAM table is not made
            client.create_tables([ps_pb2.TableSpec(name="ok", dim=D, dtype=ps_pb2.FLOAT32, init=init,
                                                   optimizer=Optimizer("sgd", lr=0.1).to_proto()), spec])
        assert list(client.status(0).tables) == []
