"""Shared fixtures: real ps-server processes on 127.0.0.1 (see torchps.worker.local_cluster).

tests/ is put on sys.path, so every test module can `from helpers import wait_until`.
"""

import json
import pathlib
import sys

import pytest
import torch

from torchps.client import PSClient
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
# The tests' own tensor work on one thread: the xdist workers share the cores with the shards they start, and
# torch's default (a thread per core in every process) spends CPU in OpenMP's idle threads spinning.
torch.set_num_threads(1)

LONG_TESTS = pathlib.Path(__file__).with_name("long_tests.json")  # seconds of the longest tests in a full run


def pytest_collection_modifyitems(config, items):
    """Under xdist (-n N, --dist worksteal) the longest tests start first, spread over the workers: worksteal
    hands each worker a contiguous slice of the collected order (sized as it cuts them) and idle workers steal
    from the slices' ends, so each slice begins with its share of the long tests (longest first, each to the
    slice with the fewest seconds so far) and goes on in file order. Only the order changes: every test still
    runs, alone and in any order. Without xdist the order stays the files'."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if not workers or workers < 2 or not LONG_TESTS.is_file():
        return
    seconds = json.loads(LONG_TESTS.read_text())["seconds"]
    sizes, left = [], len(items)
    for i in range(workers):  # as worksteal cuts the first slices: what is left over the workers left
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    slices: list[list] = [[] for _ in sizes]
    totals = [0.0] * workers
    for item in sorted((item for item in items if item.nodeid in seconds), key=lambda it: -seconds[it.nodeid]):
        open_slices = [i for i in range(workers) if len(slices[i]) < sizes[i]]
        target = min(open_slices, key=lambda i: (totals[i], i))
        slices[target].append(item)
        totals[target] += seconds[item.nodeid]
    rest = iter(item for item in items if item.nodeid not in seconds)
    for i, size in enumerate(sizes):
        slices[i].extend(next(rest) for _ in range(size - len(slices[i])))
    items[:] = [item for part in slices for item in part]


@pytest.fixture
def local_cluster():
    """Factory: local_cluster(num_ps=1, **kwargs) -> a started LocalCluster, stopped after the test."""
    started = []

    def make(num_ps: int = 1, **kwargs) -> LocalCluster:
        local = LocalCluster(num_ps, **kwargs)
        started.append(local)
        local.start()
        return local

    yield make
    for local in started:
        local.stop()


@pytest.fixture(scope="module")
def shared_cluster():
    """Two shards shared by every test of a module (tests must use distinct variable names)."""
    with LocalCluster(2) as local:
        yield local


@pytest.fixture
def client(shared_cluster):
    """A PSClient on the module's shared 2-shard cluster, with a short connect timeout."""
    with PSClient(shared_cluster.cluster, connect_timeout=10.0) as ps:
        yield ps
