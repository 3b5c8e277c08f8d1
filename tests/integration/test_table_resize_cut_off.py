"""A live resize cut off while it re-lays out the embedding tables, on real processes, whichever way: a driver
that stopped after the epoch that froze them and one part of the rows (raw calls play a driver that dies
there), or a driver that failed because the added shard refused its rows (its --max-memory). Either way ps 0
recorded the re-layout first, so the resize only goes forward from there: `ps-admin resize --resume` begins it
again (the shards that began it keep what they had: their exports are sent again, the parts they took are not
taken twice) and ends it, and `--abort` finishes it the same way. After it every row and variable equals a RAM
reference never resized, and training goes on exactly as it does there. A sync shrink cut off in its last epoch,
while the job trains on without the removed shard, is finished by setting that epoch alone.

Ordering is by replies and ps 0's record (waited for with a deadline), never by sleeping.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from torchps.client import Optimizer, PSClient, TaskSpec
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


@pytest.mark.parametrize("with_table", [True, False], ids=["tables-built", "no-tables"])
def test_a_sync_shrink_cut_off_in_its_last_epoch_is_finished_while_the_job_trains_on_2_shards(with_table):
    """3 -> 2 shards, sync (R = N = 1). The dead driver (raw calls in its order) held the job, re-laid the
    table out (with_table) and recorded it built, then set its last epoch on ps 1 alone. Once the hold's lease
    ran out the worker follows ps 1 and trains on 2 shards, so ps 2 stays behind; abort (the chief's repair
    too) sets only that last epoch: no hold ps 2 could never be quiet under, and the job trains on."""
    rows = 12
    spec = ps_pb2.TableSpec(name="t", dim=4, num_embeddings=rows, dtype=ps_pb2.FLOAT32,
                            init=ps_pb2.TableInit(distribution="uniform", scale=1.0, seed=5),
                            optimizer=Optimizer("sgd", lr=1.0).to_proto())
    with LocalCluster(3) as local, PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief, \
            PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=30, partitioner=None) as worker:
        chief.configure("sync", replicas_to_aggregate=1, total_num_replicas=1, lease_seconds=120)
        chief.create_variables({"w": torch.zeros(4)}, Optimizer("sgd", lr=1.0))
        if with_table:
            chief.create_tables([spec])
            worker.wait_for_tables(["t"], timeout=WAIT)
        worker.declare({"w": torch.zeros(4)})
        worker.join()

        def push() -> int:
            return worker.push({"w": torch.ones(4)},
                               rows={"t": (torch.arange(rows), torch.ones(rows, 4))} if with_table else None)

        push()
        start = worker.lookup_rows({"t": torch.arange(rows)})["t"] if with_table else None
        before, after = list(local.cluster.ps), list(local.cluster.ps[:2])
        record = _call(chief, 0, "Resize", ps_pb2.ResizeRequest(
            action=ps_pb2.ResizeRequest.BEGIN, driver="dead driver", before=before, after=after, lease_seconds=LEASE))
        epoch = [_call(chief, 0, "GetLayout", ps_pb2.LayoutRequest()).epoch]

        def set_layout(addresses: list[str], hold: int, shards, **tables) -> list[ps_pb2.Layout]:
            epoch[0] += 1
            layout = ps_pb2.Layout(epoch=epoch[0], addresses=addresses, placement={"w": 0}, hold_from_step=hold,
                                   hold_lease_seconds=LEASE, **tables)
            return [_call(chief, s, "SetLayout", layout) for s in shards]

        hold = max(layout.hold_from_step for layout in set_layout(before, 1, (1, 2, 0)))
        set_layout(before, hold, (1, 2, 0))
        wait_until(lambda: all(_call(chief, s, "GetLayout", ps_pb2.LayoutRequest()).quiet for s in range(3)), WAIT,
                   "every shard quiet under the hold")
        end = {}
        if with_table:
            tables = ps_pb2.ResizeRequest(action=ps_pb2.ResizeRequest.TABLES, id=record.id, driver="dead driver",
                                          table_shards=2, tables_from=3)
            _call(chief, 0, "Resize", tables)
            set_layout(before, hold, (1, 2, 0), table_shards=2, table_step=ps_pb2.Layout.BEGIN)
            for source in range(3):
                for target in range(2):
                    request = ps_pb2.MoveRequest(epoch=epoch[0], to=target, tables=True)
                    part = list(chief.call(source, lambda stub, t: stub.ExportVariables(request, timeout=t)))
                    chief.call(target, lambda stub, t: stub.ImportVariables(iter(part), timeout=t))
            tables.tables_built = True
            _call(chief, 0, "Resize", tables)
            end = {"table_shards": 2, "table_step": ps_pb2.Layout.END}
        set_layout(after, 0, (1,), **end)  # ... and the driver dies
        wait_until(lambda: chief.resize_state().lease_left_seconds == 0, WAIT, "the driver's lease to run out")
        wait_until(lambda: all(_call(chief, s, "GetLayout", ps_pb2.LayoutRequest()).hold_from_step == 0
                               for s in range(3)), WAIT, "the holds to end by their leases")
        worker.shard_addresses()  # it follows ps 0's layout, as its next heartbeat would have it do
        steps = [push(), push()]
        assert worker.shard_addresses() == after and [chief.status(s).step for s in (0, 1)] == [steps[-1]] * 2
        report = chief.abort_resize(quiet_seconds=5, lease_seconds=5, drain_seconds=0)
        assert report.outcome == "done" and report.stopped == [before[2]], report
        assert chief.resize_state().phase == ps_pb2.ResizeState.DONE
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert pool.submit(push).result(timeout=WAIT) == steps[-1] + 1
        if with_table:
            looked = worker.lookup_rows({"t": torch.arange(rows)})["t"]
            assert torch.equal(looked, start - 3), "every row took each of the 3 pushes since once"
