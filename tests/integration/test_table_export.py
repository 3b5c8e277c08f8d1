"""PSClient.export_rows against real ps-server processes: every row of a dynamic table kept on SSD, and of a
fixed-size one, streamed from each shard a part at a time, each id once, equal to what a cluster holding the
same table in RAM exports and to what lookups read; ReadChanges' table filter refuses bad requests with their
status codes; a live resize during an export makes it fail (LayoutChangedError), not return a mixed table.
Ordering is by replies only.
"""

from __future__ import annotations

import pathlib
import sys

import grpc
import pytest
import torch

from torchps.client import PSClient
from torchps.errors import InvalidArgumentError, LayoutChangedError, UnknownVariableError
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from table_job import at_once  # noqa: E402
from test_ssd_table_recovery import CACHE, D, IDS, setup, step, train_alike  # noqa: E402

PART = 100  # rows of a part


def exported(client: PSClient, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids ascending, their rows, parts) of export_rows(name)."""
    parts = list(client.export_rows(name, rows_per_part=PART))
    assert all(len(i) <= PART for i, _ in parts)
    ids = torch.cat([i for i, _ in parts])
    values = torch.cat([v for _, v in parts])
    assert len(torch.unique(ids)) == len(ids), f"{name}: an id exported twice"
    order = torch.argsort(ids)
    return ids[order], values[order], len(parts)


def test_export_rows_streams_every_row_of_an_ssd_table_as_a_ram_cluster_exports_it(tmp_path):
    ssd = LocalCluster(2, server_args=["--table-storage", "ssd", "--table-dir", str(tmp_path / "tables"),
                                       "--table-cache", CACHE])
    ram = LocalCluster(2, server_args=["--no-journal"])
    try:
        at_once("start", ssd, ram)
        with PSClient(ssd.cluster, connect_timeout=20) as a, PSClient(ram.cluster, connect_timeout=20) as r:
            train_alike(a, r, 6)
            rows = sum(t.rows for i in range(2) for t in a.status(i).tables if t.name == "dyn")
            ids, values, parts = exported(a, "dyn")
            ram_ids, ram_values, _ = exported(r, "dyn")
            assert len(ids) == rows > 0 and parts > 2 * 2, (rows, parts)  # several parts from each shard
            assert torch.equal(ids, ram_ids) and torch.equal(values, ram_values)
            assert values.shape == (rows, D) and bool(torch.isin(ids, IDS).all())
            assert torch.equal(values, a.lookup_rows({"dyn": ids})["dyn"])
            fix_ids, fix_values, _ = exported(a, "fix")
            assert torch.equal(fix_ids, torch.arange(40))
            assert torch.equal(fix_values, a.lookup_rows({"fix": fix_ids})["fix"])

            with PSClient(ssd.cluster, connect_timeout=20) as fresh:  # a client that did not make the table
                assert torch.equal(exported(fresh, "dyn")[1], values)
                with pytest.raises(UnknownVariableError):
                    fresh.export_rows("nope")  # before any part is asked for
                with pytest.raises(InvalidArgumentError, match="rows_per_part"):
                    fresh.export_rows("dyn", rows_per_part=-1)
            with pytest.raises(InvalidArgumentError, match="export_rows"):
                a.export_state_dict(["dyn"])
    finally:
        at_once("stop", ssd, ram)


@pytest.mark.parametrize("request_, code, message", [
    (ps_pb2.ChangesRequest(tables=["nope"]), grpc.StatusCode.NOT_FOUND, "nope"),
    (ps_pb2.ChangesRequest(tables=["fix", "fix"]), grpc.StatusCode.INVALID_ARGUMENT, "more than once"),
    (ps_pb2.ChangesRequest(tables=["fix"], cursors=[ps_pb2.TableCursor(table="dyn")]),
     grpc.StatusCode.INVALID_ARGUMENT, "leaves out"),
], ids=["an unknown table", "a table twice", "a cursor of a table left out"])
def test_read_changes_refuses_a_bad_table_filter_with_its_code(tmp_path, request_, code, message):
    with LocalCluster(1, server_args=["--table-storage", "ssd", "--table-dir", str(tmp_path / "t")]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client, \
            grpc.insecure_channel(local.cluster.ps[0]) as channel:
        setup(client)
        with pytest.raises(grpc.RpcError) as raised:
            list(ps_pb2_grpc.ParameterServerStub(channel).ReadChanges(request_, timeout=30))
        assert raised.value.code() == code and message in raised.value.details(), raised.value.details()


def test_a_live_resize_during_an_export_fails_it_instead_of_mixing_two_layouts():
    with LocalCluster(2, server_args=["--no-journal"]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client, \
            PSClient(local.cluster, connect_timeout=20) as admin:
        setup(client)
        for k in range(1, 4):
            step(client, k)
        parts = client.export_rows("dyn", rows_per_part=PART)
        next(parts)  # shard 0's first part read under the old layout
        admin.resize([*local.cluster.ps, local.add_ps()])
        with pytest.raises(LayoutChangedError, match="export it again"):
            list(parts)
        assert len(exported(client, "dyn")[0]) > 0  # the new layout exports whole
