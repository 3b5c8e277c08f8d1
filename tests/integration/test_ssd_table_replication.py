"""A replicated shard that keeps an embedding table on SSD, against real ps-server processes: its backup copies
every journal base's store copies (the stores' files, streamed before the base), so when the primary is SIGKILLed
and its folders deleted (its host is gone) the backup, promoted, serves every acknowledged update, bit for bit
against a cluster that held the table in RAM and never failed, a push in flight at the kill included, none applied
twice; a backup that cannot keep stores (no --table-dir) is refused with a line that says why. Ordered by replies, files and log lines, never by sleeping.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import threading

import torch

from torchps.client import PSClient
from torchps.proto import ps_pb2
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from helpers import free_ports, start_ps_server, wait_until  # noqa: E402
from table_job import at_once  # noqa: E402
from test_ssd_table_recovery import CACHE, D, assert_equal, everything, setup, step  # noqa: E402

WAIT = 60.0


TABLES = ["--table-storage", "ssd", "--table-cache", CACHE]


def _shards(tmp_path) -> LocalCluster:
    """Two shards keeping dynamic tables on SSD (not started), their cluster spec given."""
    p0, p1 = free_ports(2)
    spec = json.dumps({"ps": [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"]})
    return LocalCluster(2, ports=[p0, p1], log_dir=tmp_path,
                        server_args=["--cluster", spec, "--checkpoint-dir", str(tmp_path / "ck"), "--table-dir",
                                     str(tmp_path / "tables"), *TABLES])


def _backup(tmp_path, local: LocalCluster, flags: list[str]):
    """(process, address) of a backup of ps 1 with `flags`."""
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    process = start_ps_server(["--index", "1", "--cluster", json.dumps({"ps": local.cluster.ps}), "--replica-of",
                               local.cluster.ps[1], "--bind", address, "--journal-dir", str(tmp_path / "backup-1"),
                               "--torch-threads", "1", "--insecure", *flags], tmp_path / "backup.log")
    return process, address


def _backup_of_1(client: PSClient) -> str:
    layout = client._fanout.call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t), 10)
    return next((entry.backup for entry in layout.replicas if entry.index == 1), "")


def test_a_promoted_backup_of_an_ssd_shard_serves_every_acknowledged_update(tmp_path):
    local, ram, backup = _shards(tmp_path), LocalCluster(2, server_args=["--no-journal"]), None
    try:
        at_once("start", local, ram)
        with PSClient(local.cluster, connect_timeout=WAIT) as a, PSClient(ram.cluster, connect_timeout=20) as r:
            for client in (a, r):
                setup(client)
            for k in range(1, 4):
                assert_equal(step(a, k), step(r, k), f"step {k}'s lookup")
            # The backup attaches to a shard whose table is on disk: its first base comes with the store's files.
            backup, backup_address = _backup(tmp_path, local, ["--table-dir", str(tmp_path / "tables"), *TABLES])
            wait_until(lambda: _backup_of_1(a) == backup_address, WAIT, "ps 0 to record ps 1's backup in sync")
            copy = tmp_path / "backup-1"
            first = {p.parent.parent.name for p in copy.glob("base-*.stores/*/CURRENT")}
            assert first, "the first base's store copies are in the backup's copy"
            attached = a.status(1).replication
            assert attached.store_files_sent > 0 and attached.store_bytes_sent > 0
            for k in range(4, 16):
                assert_equal(step(a, k), step(r, k), f"step {k}'s lookup")
            # 12 pushes of 1.2 MB passed 8 times the attach's base: a later base and its stores were copied too.
            wait_until(lambda: {p.parent.parent.name for p in copy.glob("base-*.stores/*/CURRENT")} - first, WAIT,
                       "a later base's store copies in the backup's copy")
            assert_equal(step(a, 16), step(r, 16), "step 16's lookup")
            later = a.status(1).replication
            assert later.store_files_linked > 0, "the later base named table files the backup had"
            store = sum(f.stat().st_size for f in (tmp_path / "tables" / "ps-1").rglob("*.sst"))
            assert later.store_bytes_sent - attached.store_bytes_sent < store, "not the whole store again"
            before = everything(r)

            local.kill_ps(1)  # its host is gone: its journal and its stores with it
            shutil.rmtree(tmp_path / "ck" / "journal" / "ps-1")
            shutil.rmtree(tmp_path / "tables" / "ps-1")
            assert_equal(everything(a), before, "after the failover")
            assert _backup_of_1(a) == "" and a._fanout.channels.relocated == 1
            (table,) = [t for t in a.status(1).tables if t.name == "dyn"]
            assert table.storage == "ssd" and table.rows > 0 and table.disk_bytes > 0, table
            assert (tmp_path / "tables" / f"ps-1-at-{backup_address.rpartition(':')[2]}").is_dir()  # its own folder
            for k in range(17, 19):
                assert_equal(step(a, k), step(r, k), f"step {k}'s lookup after the failover")
            assert_equal(everything(a), everything(r), "the updates after the failover")
    finally:
        if backup is not None:
            backup.terminate()
            backup.wait(timeout=30)
        at_once("stop", local, ram)
    assert "this backup serves it" in (tmp_path / "backup.log").read_text()


def test_a_backup_without_a_table_dir_is_refused_by_a_shard_that_keeps_tables_on_ssd(tmp_path):
    local = _shards(tmp_path)
    local.start()
    backup, _ = _backup(tmp_path, local, [])
    try:
        log = tmp_path / "backup.log"
        wait_until(lambda: "needs --table-dir too" in log.read_text(), WAIT, "the refusal in the backup's log")
        with PSClient(local.cluster, connect_timeout=WAIT) as a:
            setup(a)
            step(a, 1)
            assert _backup_of_1(a) == "" and a.status(1).replication.feeds_opened == 0
        assert backup.poll() is None  # it asks again, as for any refusal, and says so once
        assert log.read_text().count("needs --table-dir too") == 1
    finally:
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()


def test_pushes_in_flight_when_an_ssd_primary_dies_are_applied_once_by_its_promoted_backup(tmp_path):
    """One client pushes row gradients to the SSD table without pause; once 20 were acknowledged, another thread
    SIGKILLs ps 1 and deletes its folders, whatever push is in flight. Every push returns (the client rides the
    failover), and the table then equals a RAM cluster given the same pushes in the same order: none lost,
    none applied twice."""
    local, ram, backup = _shards(tmp_path), LocalCluster(2, server_args=["--no-journal"]), None
    pushed, killed = threading.Event(), threading.Event()
    try:
        at_once("start", local, ram)
        with PSClient(local.cluster, connect_timeout=WAIT) as a, PSClient(ram.cluster, connect_timeout=20) as r:
            for client in (a, r):
                setup(client)
            step(a, 1)
            step(r, 1)
            backup, backup_address = _backup(tmp_path, local, ["--table-dir", str(tmp_path / "tables"), *TABLES])
            wait_until(lambda: _backup_of_1(a) == backup_address, WAIT, "ps 0 to record ps 1's backup in sync")

            def kill() -> None:
                pushed.wait(WAIT)
                local.kill_ps(1)
                shutil.rmtree(tmp_path / "ck" / "journal" / "ps-1")
                shutil.rmtree(tmp_path / "tables" / "ps-1")
                killed.set()

            killer = threading.Thread(target=kill)
            killer.start()
            odd = torch.arange(1, 81, 2)  # 40 of ps 1's ids, each drawn about every other push: none ages out
            rows = []
            for k in range(60):
                g = torch.Generator().manual_seed(100 + k)
                ids = torch.unique(odd[torch.randint(0, len(odd), (30,), generator=g)])
                rows.append({"dyn": (ids, torch.ones(len(ids), D))})
                a.lookup_rows({"dyn": ids}, admit=True)  # admitted at the second sight (min_count 2)
                a.push({}, rows=rows[-1])
                if k == 19:
                    pushed.set()
                if k == 40:
                    assert killed.wait(WAIT), "ps 1 was killed while the pushes went on"
            killer.join()
            assert _backup_of_1(a) == "" and a._fanout.channels.relocated == 1
            for part in rows:
                r.lookup_rows({"dyn": part["dyn"][0]}, admit=True)
                r.push({}, rows=part)
            assert_equal(everything(a), everything(r), "every acknowledged push once")
            held = r.lookup_rows({"dyn": odd})["dyn"]
            assert int((held != 0).all(dim=1).sum()) >= 30, "the pushes' rows are held, not aged out"
    finally:
        if backup is not None:
            backup.terminate()
            backup.wait(timeout=30)
        at_once("stop", local, ram)
