"""A replicated shard that keeps an embedding table on SSD, against real ps-server processes: its backup copies
every journal base's store copies (the stores' files, streamed before the base), so when the primary is SIGKILLed
and its folders deleted (its host is gone) the backup, promoted, serves every acknowledged update, bit for bit
against a cluster that held the table in RAM and never failed; a backup that cannot keep stores (no --table-dir)
is refused with a line that says why. Ordered by replies, files and log lines, never by sleeping.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

from torchps.client import PSClient
from torchps.proto import ps_pb2
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from helpers import free_ports, start_ps_server, wait_until  # noqa: E402
from table_job import at_once  # noqa: E402
from test_ssd_table_recovery import CACHE, assert_equal, everything, setup, step  # noqa: E402

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
            for k in range(4, 16):
                assert_equal(step(a, k), step(r, k), f"step {k}'s lookup")
            # 12 pushes of 1.2 MB passed 8 times the attach's base: a later base and its stores were copied too.
            wait_until(lambda: {p.parent.parent.name for p in copy.glob("base-*.stores/*/CURRENT")} - first, WAIT,
                       "a later base's store copies in the backup's copy")
            assert_equal(step(a, 16), step(r, 16), "step 16's lookup")
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
        assert backup.poll() is None  # it asks again, as for any refusal
    finally:
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()
