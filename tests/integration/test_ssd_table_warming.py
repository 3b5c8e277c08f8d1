"""Announced lookups on tables kept on SSD (LookupRowsRequest.upcoming), against real ps-server processes: the
shards read the announced rows into their caches in the background, so the next lookup finds them there, and
the job's rows are those of a RAM cluster given the same calls without announcements; an announcement that
does not fit (an unknown table, repeated ids, a table named twice) fails its call with the right status code
before anything is read or admitted. Ordering is by replies and the shards' counters, waited for with a
deadline, never by sleeping."""

from __future__ import annotations

import pathlib
import sys

import grpc
import pytest
import torch

from torchps import rows
from torchps.client import Optimizer, PSClient
from torchps.errors import InvalidArgumentError, UnknownVariableError
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from helpers import wait_until  # noqa: E402
from table_job import at_once  # noqa: E402

D = 4
SPEC = ps_pb2.TableSpec(name="dyn", dim=D, dtype=ps_pb2.FLOAT32, optimizer=Optimizer("adagrad", lr=0.1).to_proto(),
                        init=ps_pb2.TableInit(distribution="normal", scale=1.0, seed=5))


def warm_counters(client: PSClient) -> list[tuple[int, int, int]]:
    """Per shard: (rows, rows read ahead into the cache, cache hits) of the table."""
    return [(s.rows, s.cache_warmed, s.cache_hits) for shard in range(2) for s in client.status(shard).tables]


def batch(k: int) -> torch.Tensor:
    return torch.unique(torch.randint(0, 4000, (300,), generator=torch.Generator().manual_seed(k)))


def test_announced_rows_are_read_ahead_and_the_table_trains_as_in_ram(tmp_path):
    ssd = LocalCluster(2, server_args=["--table-storage", "ssd", "--table-dir", str(tmp_path / "tables"),
                                       "--table-cache", "48K"])   # about 600 rows a shard: most rows on disk
    ram = LocalCluster(2)
    try:
        at_once("start", ssd, ram)
        with PSClient(ssd.cluster, connect_timeout=20) as a, PSClient(ram.cluster, connect_timeout=20) as r:
            for client in (a, r):
                client.create_tables([SPEC])
                for k in range(30):  # ids 0-5999 once each, in order: the caches keep the last ones
                    client.lookup_rows({"dyn": torch.arange(k * 200, (k + 1) * 200)}, admit=True)
            assert [rows for rows, _, _ in warm_counters(a)] == [3000, 3000]
            for k in range(1, 6):  # a step announces the next one's ids (batches of ids 0-3999)
                ids = batch(k)
                got = a.lookup_rows({"dyn": ids}, admit=True, upcoming={"dyn": batch(k + 1)})
                assert torch.equal(got["dyn"], r.lookup_rows({"dyn": ids}, admit=True)["dyn"])
                for client in (a, r):
                    client.push({}, step=k, rows={"dyn": (ids, torch.full((len(ids), D), 0.5))})
            assert sum(w for _, w, _ in warm_counters(a)) > 0
            # ids 4000-4299, filled long ago, are on disk only: announced alone, all 300 are read in
            warmed = sum(w for _, w, _ in warm_counters(a))
            a.lookup_rows({}, upcoming={"dyn": torch.arange(4000, 4300)})
            wait_until(lambda: sum(w for _, w, _ in warm_counters(a)) - warmed == 300, 30,
                       "the shards read the 300 announced rows into their caches")
            hits = sum(h for _, _, h in warm_counters(a))
            assert torch.equal(a.lookup_rows({"dyn": torch.arange(4000, 4300)}, admit=True)["dyn"],
                               r.lookup_rows({"dyn": torch.arange(4000, 4300)}, admit=True)["dyn"])
            assert sum(h for _, _, h in warm_counters(a)) - hits == 300, "every announced row was a hit"
            assert [rows for rows, _, _ in warm_counters(a)] == [3000, 3000], "warming created no row"
            assert torch.equal(a.lookup_rows({"dyn": torch.arange(6000)})["dyn"],
                               r.lookup_rows({"dyn": torch.arange(6000)})["dyn"]), "the rows are RAM's"
    finally:
        at_once("stop", ssd, ram)


@pytest.mark.parametrize("upcoming, code", [
    ([ps_pb2.TableIds(name="nope", ids=rows.ids_bytes(torch.tensor([0])))], grpc.StatusCode.NOT_FOUND),
    ([ps_pb2.TableIds(name="dyn", ids=rows.ids_bytes(torch.tensor([0, 0])))], grpc.StatusCode.INVALID_ARGUMENT),
    ([ps_pb2.TableIds(name="dyn", ids=rows.ids_bytes(torch.tensor([0])))] * 2, grpc.StatusCode.INVALID_ARGUMENT),
    ([ps_pb2.TableIds(name="dyn", ids=b"\x00" * 7)], grpc.StatusCode.INVALID_ARGUMENT),
], ids=["unknown table", "repeated ids", "a table twice", "not whole int64s"])
def test_an_announcement_that_does_not_fit_fails_the_call_before_anything_is_admitted(tmp_path, upcoming, code):
    with LocalCluster(1, server_args=["--table-storage", "ssd", "--table-dir", str(tmp_path / "tables")]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client, grpc.insecure_channel(local.cluster.ps[0]) as channel:
        client.create_tables([SPEC])
        request = ps_pb2.LookupRowsRequest(tables=[ps_pb2.TableIds(name="dyn", ids=rows.ids_bytes(torch.arange(5)))],
                                           admit=True, upcoming=upcoming)
        with pytest.raises(grpc.RpcError) as raised:
            list(ps_pb2_grpc.ParameterServerStub(channel).LookupRows(request, timeout=20))
        assert raised.value.code() == code, raised.value.details()
        (status,) = client.status(0).tables
        assert (status.rows, status.pending, status.cache_warmed, status.rows_read) == (0, 0, 0, 0)
        with pytest.raises((InvalidArgumentError, UnknownVariableError)):  # the client's own checks, no call made
            client.lookup_rows({"dyn": torch.arange(5)}, admit=True, upcoming={"dyn": torch.tensor([1.5])})
        with pytest.raises(UnknownVariableError):
            client.lookup_rows({"dyn": torch.arange(5)}, admit=True, upcoming={"nope": torch.tensor([1])})
        assert client.status(0).tables[0].rows == 0
