"""A live resize cut off while it re-lays out the embedding tables, on real processes, whichever way: a driver
that stopped after the epoch that froze them and one part of the rows (raw calls play a driver that dies
there), or a driver that failed because the added shard refused its rows (its --max-memory). Either way ps 0
recorded the re-layout first, so the resize only goes forward from there: `ps-admin resize --resume` begins it
again (the shards that began it keep what they had: their exports are sent again, the parts they took are not
taken twice) and ends it, and `--abort` finishes it the same way. After it every row and variable equals a RAM
reference never resized, and training goes on exactly as it does there.

Ordering is by replies and ps 0's record (waited for with a deadline), never by sleeping.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from torchps.client import PSClient
from torchps.cluster import Cluster
from torchps.proto import ps_pb2
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from helpers import wait_until  # noqa: E402
from test_ssd_table_recovery import CACHE, assert_equal, everything, step, train_alike  # noqa: E402

PS_ADMIN = str(pathlib.Path(sys.executable).with_name("ps-admin"))
LEASE = 2.0  # seconds: the stopped driver's lease on ps 0
SMALL = "16K"  # ps 2's --max-memory: less than its part of the tables
WAIT = 120.0


def _admin(spec: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PS_ADMIN, "resize", "--cluster", spec, *args, "--lease-seconds", "5", "--insecure"],
                          capture_output=True, text=True, timeout=WAIT)


def _call(client: PSClient, shard: int, method: str, request):
    return client.call(shard, lambda stub, t: getattr(stub, method)(request, timeout=t))


def _die_after_one_part(shards: LocalCluster, chief: PSClient, added: str) -> None:
    """A driver's raw calls up to its death: it begins a resize onto 3 shards, records the tables' re-layout
    on ps 0, sets the epoch that begins it (ps 1 and ps 2, then ps 0), relays ps 0's rows for ps 0, and stops."""
    before, after = list(shards.cluster.ps), [*shards.cluster.ps, added]
    record = _call(chief, 0, "Resize", ps_pb2.ResizeRequest(action=ps_pb2.ResizeRequest.BEGIN, driver="dead driver",
                                                            before=before, after=after, lease_seconds=LEASE))
    _call(chief, 0, "Resize", ps_pb2.ResizeRequest(action=ps_pb2.ResizeRequest.TABLES, id=record.id,
                                                   driver="dead driver", table_shards=3, tables_from=2))
    with PSClient(Cluster(ps=tuple(after)), connect_timeout=30, partitioner=None) as raw:
        placement = {v.spec.name: s for s in range(2)
                     for v in _call(raw, s, "ListVariables", ps_pb2.ListRequest()).variables}
        epoch = _call(raw, 0, "GetLayout", ps_pb2.LayoutRequest()).epoch + 1
        layout = ps_pb2.Layout(epoch=epoch, addresses=after, placement=placement, table_shards=3,
                               table_step=ps_pb2.Layout.BEGIN)
        for shard in (1, 2, 0):
            assert _call(raw, shard, "SetLayout", layout).table_shards == 3
        request = ps_pb2.MoveRequest(epoch=epoch, to=0, tables=True)
        part = list(raw.call(0, lambda stub, t: stub.ExportVariables(request, timeout=t)))
        raw.call(0, lambda stub, t: stub.ImportVariables(iter(part), timeout=t))


def _frozen(chief: PSClient, added: str) -> None:
    """The resize is cut off (its lease ran out) with the tables frozen: ps 2 built none."""
    wait_until(lambda: chief.resize_state().lease_left_seconds == 0, WAIT, "the driver's lease to run out")
    record = chief.resize_state()
    assert record.phase == record.RUNNING and (record.table_shards, record.tables_from) == (3, 2), record
    assert not record.tables_built
    with PSClient(Cluster(ps=(*chief.cluster.ps, added)), connect_timeout=30, partitioner=None) as wide:
        assert not wide.status(2).tables


def test_a_driver_dead_after_one_part_of_the_tables_is_finished_by_resume(tmp_path):
    """Tables on SSD; ps 0 took its own part (and built nothing: ps 1's is missing)."""
    shards = LocalCluster(2, server_args=["--table-storage", "ssd", "--table-dir", str(tmp_path / "tables"),
                                          "--table-cache", CACHE, "--checkpoint-dir", str(tmp_path / "ckpt")])
    ram = LocalCluster(2, server_args=["--no-journal"])
    with shards, ram, PSClient(shards.cluster, connect_timeout=60) as chief, PSClient(ram.cluster) as reference:
        train_alike(chief, reference, 3)
        added = shards.add_ps()
        _die_after_one_part(shards, chief, added)
        _frozen(chief, added)
        assert "embedding-table rows of ps 0 imported" in shards.log(0)
        finished = _admin(json.dumps({"ps": [*shards.cluster.ps, added]}), "--resume")
        _assert_finished(finished, chief, reference, added)


def test_a_driver_refused_by_the_added_shard_leaves_the_tables_for_abort_to_finish(tmp_path):
    """Tables in memory; ps 2 starts with a --max-memory too small for its part of them, so the driver (a real
    ps-admin) fails there and, past the point of no return, leaves the resize cut off instead of rolling it
    back. ps 2, started again with room (from its journal: the re-layout begun), lets --abort finish it."""
    shards = LocalCluster(2, server_args=["--checkpoint-dir", str(tmp_path / "ckpt")])
    ram = LocalCluster(2, server_args=["--no-journal"])
    with shards, ram, PSClient(shards.cluster, connect_timeout=60) as chief, PSClient(ram.cluster) as reference:
        train_alike(chief, reference, 3)
        roomy = list(shards.server_args)
        added = shards.add_ps(args=[*roomy, "--max-memory", SMALL])
        spec = json.dumps({"ps": [*shards.cluster.ps, added]})
        failed = subprocess.run([PS_ADMIN, "resize", "--cluster", json.dumps({"ps": list(shards.cluster.ps)}), "--ps",
                                 ",".join([*shards.cluster.ps, added]), "--lease-seconds", str(LEASE), "--insecure"],
                                capture_output=True, text=True, timeout=WAIT)
        assert failed.returncode != 0 and "--max-memory" in failed.stderr, (failed.stdout, failed.stderr)
        assert "past which it only goes forward: it is left cut off" in failed.stderr, failed.stderr
        _frozen(chief, added)
        shards.kill_ps(2)
        shards.start_ps(2, roomy)
        finished = _admin(spec, "--abort")
        assert "finishing it instead of rolling it back" in finished.stderr, finished.stderr
        _assert_finished(finished, chief, reference, added)


def _assert_finished(finished: subprocess.CompletedProcess, chief: PSClient, reference: PSClient, added: str
                     ) -> None:
    assert finished.returncode == 0, (finished.stdout, finished.stderr)
    assert "2 -> 3 shards" in finished.stdout and "tables re-laid out" in finished.stdout, finished.stdout
    record = chief.resize_state()
    assert record.phase == record.DONE and record.tables_built, record
    with PSClient(Cluster(ps=(*chief.cluster.ps, added)), connect_timeout=30, partitioner=None) as wide:
        assert [len(wide.status(s).tables) for s in range(3)] == [2, 2, 2]
    assert_equal(everything(chief), everything(reference), "every row once the resize ended")
    for k in range(4, 7):
        assert_equal(step(chief, k), step(reference, k), f"step {k}'s lookup, on 3 shards")
    assert_equal(everything(chief), everything(reference), "every row after training on")
