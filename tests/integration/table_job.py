"""A job with embedding tables for the table checkpoint tests (test_table_checkpoints.py, test_table_relayout.py):
its tables, its training steps through a PSClient, what to compare, and clusters started and stopped at once.

Every step is deterministic (its ids and gradients come from the step's number), so two clusters given the
same calls hold the same rows bit for bit, which is what the tests compare.
"""

from __future__ import annotations

import pathlib
import threading

import torch

from torchps.client import Optimizer, PSClient
from torchps.proto import ps_pb2
from torchps.ps_server import checkpoint
from torchps.worker.local_cluster import LocalCluster

D = 4
N = 50                       # rows of the fixed-size table
DYNAMIC_IDS = torch.arange(-12, 12)  # every id the dynamic table ever sees


def table_specs() -> list[ps_pb2.TableSpec]:
    """A fixed-size table (Adagrad with lr_decay, hash partition) and a dynamic one (SparseAdam, min_count 2,
    max_age 3: rows are admitted late and evicted)."""
    init = ps_pb2.TableInit(distribution="normal", scale=1.0, seed=3)
    return [ps_pb2.TableSpec(name="fix", dim=D, num_embeddings=N, dtype=ps_pb2.FLOAT32,
                             partition=ps_pb2.PARTITION_HASH, init=init,
                             optimizer=Optimizer("adagrad", lr=0.2, lr_decay=0.01).to_proto()),
            ps_pb2.TableSpec(name="dyn", dim=D, dtype=ps_pb2.FLOAT32, init=init, min_count=2, max_age=3,
                             optimizer=Optimizer("sparse_adam", lr=0.05, betas=(0.8, 0.9)).to_proto())]


def setup(client: PSClient) -> None:
    client.create_variables({"w": torch.zeros(3)}, Optimizer("adam", lr=0.1))
    client.create_tables(table_specs())


def step(client: PSClient, k: int) -> dict[str, torch.Tensor]:
    """Training step k at global step k - 1: an admitting lookup of the batch's distinct ids, then one push of
    their row gradients and a dense gradient. Returns the rows the lookup read."""
    g = torch.Generator().manual_seed(k)
    ids = {"fix": torch.unique(torch.randint(0, N, (15,), generator=g)),
           "dyn": torch.unique(DYNAMIC_IDS[torch.randint(0, len(DYNAMIC_IDS), (10,), generator=g)])}
    looked = client.lookup_rows(ids, admit=True)
    client.push({"w": torch.randn(3, generator=g)}, step=k - 1,
                rows={name: (value, torch.randn(len(value), D, generator=g)) for name, value in ids.items()})
    return looked


def everything(client: PSClient) -> dict[str, torch.Tensor]:
    """Every row (read without admitting: absent dynamic rows read as zeros) and the dense variable."""
    return {**client.lookup_rows({"fix": torch.arange(N), "dyn": DYNAMIC_IDS}), **client.pull(["w"])}


def assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name in expected:
        assert torch.equal(got[name], expected[name]), \
            f"{what}: {name!r} differs (max abs diff {(got[name] - expected[name]).abs().max().item():.3g})"


def saved_tables(directory: pathlib.Path, step_: int, num_ps: int = 2) -> list[list[dict]]:
    """Each shard file's table section of checkpoint `step_`."""
    return [torch.load(checkpoint.step_dir(directory, step_) / f"ps-{i}.pt", weights_only=True)["tables"]
            for i in range(num_ps)]


def assert_same_sections(got: list[list[dict]], expected: list[list[dict]], what: str) -> None:
    """Bit for bit: every table's spec and layout, rows, optimizer state and step counts, ages, counters."""
    for index, (mine, theirs) in enumerate(zip(got, expected)):
        assert [e["name"] for e in mine] == [e["name"] for e in theirs] == ["fix", "dyn"], what
        for a, b in zip(mine, theirs):
            where = f"{what}, ps {index}, table {a['name']!r}"
            assert (a["spec"], a["shard_index"], a["num_shards"]) == (b["spec"], b["shard_index"], b["num_shards"])
            sa, sb = a["state"], b["state"]
            for key in ("config", "optimizer_steps", "step", "events"):
                assert sa[key] == sb[key], f"{where}: {key} {sa[key]} != {sb[key]}"
            tensors = [("ids",), ("values",), ("last_update",), *[("state", k) for k in sb["state"]],
                       *[("pending", k) for k in sb.get("pending", {})]]
            for path in tensors:
                x, y = sa, sb
                for key in path:
                    x, y = x.get(key), y.get(key)
                assert (x is None) == (y is None) and (y is None or torch.equal(x, y)), f"{where}: {path} differ"
            assert sa["state"].keys() == sb["state"].keys() and len(sb["ids"]) > 0, where


def at_once(method: str, *clusters: LocalCluster) -> None:
    """Starts (or stops) the clusters at once: each shard imports torch, then each takes a moment to stop."""
    errors = []

    def call(local: LocalCluster) -> None:
        try:
            getattr(local, method)()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(c,)) for c in clusters]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
