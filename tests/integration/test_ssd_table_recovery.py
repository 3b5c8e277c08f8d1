"""Tables kept on SSD (ps-server --table-storage ssd), against real ps-server processes: a cluster whose shards
cache a small part of a dynamic table that evicts by age trains it exactly as a cluster with the table in RAM;
a shard SIGKILLed after its journal's base copied the table's store comes back from that copy and the journal,
and one whose journal is gone from the newest checkpoint's copy, both exactly; a checkpoint of 2 SSD shards
restored onto 3 and onto 1 (--restore-from --num-ps) streams its stores into the new shards' and trains on
exactly; a full checkpoint copies every table file and restores on its own; a live resize onto a shard that cannot keep them, or of a table some shards keep in RAM, is refused
before it changes anything; flags that do not fit are refused.

The reference is a RAM cluster given the same calls and never killed; rows are compared bit for bit. Ordering
is by replies, process exits and files a shard wrote (waited for with a deadline), never by sleeping.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import signal
import sys

import pytest
import torch

from torchps.client import Optimizer, PSClient
from torchps.errors import ClusterConfigError
from torchps.proto import ps_pb2
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from helpers import run_ps_server, wait_until  # noqa: E402
from table_job import at_once  # noqa: E402

D = 4
IDS = torch.arange(-2000, 2000)     # every id the dynamic table sees: records of 64 bytes on disk
DENSE = 300_000                      # floats of the dense variable: 1.2 MB a push, so the journal compacts
CACHE = "24K"                        # a shard's cache: about 240 rows, a fraction of its table
WAIT = 60.0


def specs() -> list[ps_pb2.TableSpec]:
    init = ps_pb2.TableInit(distribution="normal", scale=1.0, seed=5)
    return [ps_pb2.TableSpec(name="dyn", dim=D, dtype=ps_pb2.FLOAT32, init=init, min_count=2, max_age=4,
                             optimizer=Optimizer("sparse_adam", lr=0.05, betas=(0.8, 0.9)).to_proto()),
            ps_pb2.TableSpec(name="fix", dim=D, num_embeddings=40, dtype=ps_pb2.FLOAT32, init=init,
                             optimizer=Optimizer("adagrad", lr=0.2).to_proto())]


def setup(client: PSClient) -> None:
    client.create_variables({"w": torch.zeros(DENSE)}, Optimizer("sgd", lr=0.1))
    client.create_tables(specs())


def step(client: PSClient, k: int) -> dict[str, torch.Tensor]:
    """Step k: an admitting lookup of 1000 draws of the ids, a push of their gradients and a dense one."""
    g = torch.Generator().manual_seed(k)
    ids = {"dyn": torch.unique(IDS[torch.randint(0, len(IDS), (1000,), generator=g)]),
           "fix": torch.unique(torch.randint(0, 40, (10,), generator=g))}
    looked = client.lookup_rows(ids, admit=True)
    client.push({"w": torch.randn(DENSE, generator=g)}, step=k - 1,
                rows={name: (value, torch.randn(len(value), D, generator=g)) for name, value in ids.items()})
    return looked


def ssd_cluster(tables: pathlib.Path, *flags: str) -> LocalCluster:
    """Two shards keeping dynamic tables on SSD under `tables`, with a cache of a fraction of them, and `flags`."""
    return LocalCluster(2, server_args=[*flags, "--table-storage", "ssd", "--table-dir", str(tables),
                                        "--table-cache", CACHE])


@contextlib.contextmanager
def against_ram(tables: pathlib.Path, *flags: str, ram_flags: tuple[str, ...] = ("--no-journal",)):
    """ssd_cluster(tables, *flags) and a reference of 2 shards keeping the tables in RAM (`ram_flags`), started at
    once, with a client of each: yields (the SSD cluster, its client, the reference's); both stopped at the end."""
    ssd = ssd_cluster(tables, *flags)
    ram = LocalCluster(2, server_args=list(ram_flags))
    try:
        at_once("start", ssd, ram)
        with PSClient(ssd.cluster, connect_timeout=20) as a, PSClient(ram.cluster, connect_timeout=20) as r:
            yield ssd, a, r
    finally:
        at_once("stop", ssd, ram)


def train_alike(a: PSClient, r: PSClient, steps: int) -> None:
    """Both clients' setup, then steps 1..`steps` on each, their lookups equal."""
    for client in (a, r):
        setup(client)
    for k in range(1, steps + 1):
        assert_equal(step(a, k), step(r, k), f"step {k}'s lookup")


def everything(client: PSClient) -> dict[str, torch.Tensor]:
    return {**client.lookup_rows({"dyn": IDS, "fix": torch.arange(40)}), **client.pull(["w"])}


def assert_equal(got: dict, expected: dict, what: str) -> None:
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{what}: {name!r} differs"


def test_a_killed_ssd_shard_comes_back_from_its_journal_then_a_checkpoint_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    with against_ram(tmp_path / "tables", "--checkpoint-dir", str(ckpt),
                     ram_flags=("--checkpoint-dir", str(tmp_path / "reference"), "--no-journal")) as (ssd, a, r):
        train_alike(a, r, 6)
        (table,) = [t for t in a.status(1).tables if t.name == "dyn"]
        assert table.storage == "ssd" and table.rows > 2 * table.cache_rows > 0 and table.disk_bytes_written > 0
        assert [t.storage for t in a.status(1).tables if t.name == "fix"] == ["ram"]
        # 6 pushes of 1.2 MB passed the journal's 4 MiB floor: its newest base holds a copy of the store.
        journal = ckpt / "journal" / "ps-1"
        wait_until(lambda: any(journal.glob("base-*.stores/*/CURRENT")), WAIT, "a journal base with the stores")
        base = sorted(journal.glob("base-*.stores/*/CURRENT"))[-1].parent.parent
        for k in range(7, 9):  # after that base: only the log has them
            assert_equal(step(a, k), step(r, k), f"step {k}'s lookup")
        before = everything(r)

        # 1. SIGKILL: the store it wrote is thrown away; the base's copy and the log's records rebuild it.
        assert ssd.kill_ps(1) == -signal.SIGKILL
        ssd.start_ps(1)
        assert "recovered from the journal" in ssd.log(1)
        assert base.exists()
        assert_equal(everything(a), before, "after the journal's recovery")
        assert_equal(step(a, 9), step(r, 9), "the next step after the recovery")
        assert a.save_checkpoint(0) == r.save_checkpoint(0) == 9
        assert (ckpt / "step-000000000009" / "ps-1.stores").is_dir()

        # 2. SIGKILL without the journal: the checkpoint's copy of the store is the table.
        assert ssd.kill_ps(1) == -signal.SIGKILL
        shutil.rmtree(ckpt / "journal" / "ps-1")
        ssd.start_ps(1)
        assert a.status(1).restored_step == 9
        assert_equal(everything(a), everything(r), "after the checkpoint's restore")
        assert_equal(step(a, 10), step(r, 10), "the next step after the restore")
        assert_equal(everything(a), everything(r), "the next update after the restore")


def test_a_checkpoint_of_2_ssd_shards_restores_onto_3_and_onto_1_and_trains_on_exactly(tmp_path):
    source = tmp_path / "two-shards"
    with against_ram(tmp_path / "tables", "--checkpoint-dir", str(source)) as (_, a, r):
        train_alike(a, r, 6)
        assert a.save_checkpoint(0) == 6
        assert (source / "step-000000000006" / "ps-1.stores").is_dir()
        saved, looked = everything(r), step(r, 7)
        after = everything(r)

    clusters = {n: LocalCluster(n, server_args=["--restore-from", str(source), "--num-ps", str(n), "--table-storage",
                                                "ssd", "--table-dir", str(tmp_path / f"tables-{n}"), "--table-cache",
                                                CACHE])
                for n in (3, 1)}
    try:
        at_once("start", *clusters.values())
        for n, local in clusters.items():
            with PSClient(local.cluster, connect_timeout=20) as client:
                setup(client)  # the restored tables and variable are kept as they are
                assert [client.status(i).restored_step for i in range(n)] == [6] * n
                tables = [t for i in range(n) for t in client.status(i).tables if t.name == "dyn"]
                assert {t.storage for t in tables} == {"ssd"} and all(t.rows > 0 for t in tables)
                assert f"re-layout: checkpoint 6 from 2 shards -> shard 0 of {n}" in local.log(0)
                assert_equal(everything(client), saved, f"{n} shards: the restored rows")
                assert_equal(step(client, 7), looked, f"{n} shards: the next lookup")
                assert_equal(everything(client), after, f"{n} shards: the next update")
    finally:
        at_once("stop", *clusters.values())


@pytest.mark.parametrize("flags, message", [
    (["--table-storage", "ssd"], "--table-dir"),
    (["--table-cache", "1M"], "--table-cache"),
    (["--table-dir", "X", "--table-cache", "2M", "--max-memory", "2M"], "--table-cache 2097152 must leave room"),
], ids=["ssd without a folder", "a cache without a folder", "a cache as large as --max-memory"])
def test_ps_server_refuses_table_storage_flags_that_do_not_fit(tmp_path, flags, message):
    code, printed = run_ps_server(["--insecure", "--index", "0", "--bind", "127.0.0.1:0", *flags],
                                  tmp_path / "log", 60)
    assert code == 2, printed
    last = printed.strip().splitlines()[-1]
    assert last.startswith("ps-server: error: ") and message in last and "Traceback" not in printed, printed


def test_a_live_resize_onto_a_shard_without_a_table_dir_is_refused_and_changes_nothing(tmp_path):
    """A live resize moves SSD tables' rows (test_ssd_table_live_resize.py), but only onto shards that can
    keep them: one started without --table-dir is refused in one line before anything changes."""
    local = LocalCluster(2, server_args=["--table-storage", "ssd", "--table-dir", str(tmp_path / "tables")])
    with local, PSClient(local.cluster, connect_timeout=20) as ps:
        setup(ps)
        step(ps, 1)
        before, resize = everything(ps), ps.resize_state()
        added = local.add_ps(args=[])
        with pytest.raises(ClusterConfigError, match=r"ps 2 keeps no tables on SSD \(no --table-dir\).*nothing was "
                                                     r"changed"):
            ps.resize([*local.cluster.ps, added])
        assert ps.resize_state() == resize
        assert_equal(everything(ps), before, "after the refused resize")
        step(ps, 2)  # training goes on


def test_a_live_resize_of_a_table_kept_on_ssd_by_one_shard_and_in_ram_by_another_is_refused(tmp_path):
    """Shards started with different --table-storage keep a table differently: a live resize cannot build one
    table from both, and is refused in one line naming them before the tables freeze."""
    tables = str(tmp_path / "tables")
    local = LocalCluster(2, server_args=["--table-storage", "ssd", "--table-dir", tables])
    with local, PSClient(local.cluster, connect_timeout=20) as ps:
        local.kill_ps(1)
        local.start_ps(1, args=["--table-storage", "ram", "--table-dir", tables])
        setup(ps)
        step(ps, 1)
        assert [[t.storage for t in ps.status(s).tables if t.name == "dyn"] for s in range(2)] == [["ssd"], ["ram"]]
        before, resize = everything(ps), ps.resize_state()
        added = local.add_ps(args=["--table-storage", "ssd", "--table-dir", tables])
        with pytest.raises(ClusterConfigError, match=r"'dyn' is kept on SSD by ps \[0\] and in memory by ps \[1\]"):
            ps.resize([*local.cluster.ps, added])
        assert ps.resize_state() == resize
        assert_equal(everything(ps), before, "after the refused resize")
        step(ps, 2)


def test_a_full_checkpoint_copies_every_table_file_and_restores_on_its_own(tmp_path):
    """By default a checkpoint's table files are hard links to the files the live store (and the previous
    checkpoint) holds, which RocksDB never changes; save_checkpoint(full=True) copies every one (a file of its
    own: one link), and the shards restore from it alone, the live stores and the other checkpoints gone."""
    ckpt = tmp_path / "ckpt"
    with against_ram(tmp_path / "tables", "--checkpoint-dir", str(ckpt)) as (_, a, r):
        def table_files(at: int) -> list[pathlib.Path]:
            return sorted((ckpt / f"step-{at:012d}").glob("ps-*.stores/*/*.sst"))

        train_alike(a, r, 4)
        linked = a.save_checkpoint(0)  # its files shared with the live stores, as long as they keep them
        assert table_files(linked) and all(f.stat().st_nlink > 1 for f in table_files(linked))
        step(a, 5)
        step(r, 5)
        full = a.save_checkpoint(0, full=True)
        assert table_files(full) and all(f.stat().st_nlink == 1 for f in table_files(full))
        expected = everything(r)
    shutil.rmtree(ckpt / f"step-{linked:012d}")
    shutil.rmtree(ckpt / "journal")
    shutil.rmtree(tmp_path / "tables")
    back = ssd_cluster(tmp_path / "tables", "--checkpoint-dir", str(ckpt))
    with back, PSClient(back.cluster, connect_timeout=20) as restored:
        restored.declare({"w": torch.zeros(DENSE)})
        restored.wait_for_tables(["dyn", "fix"], timeout=WAIT)
        assert restored.status(0).restored_step == full
        assert_equal(everything(restored), expected, "restored from the full checkpoint alone")
