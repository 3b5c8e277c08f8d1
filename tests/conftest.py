"""Shared fixtures: real ps-server processes on 127.0.0.1 (see torchps.worker.local_cluster).

tests/ is put on sys.path, so every test module can `from helpers import wait_until`.
"""

import pathlib
import sys

import pytest

from torchps.client import PSClient
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))


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
