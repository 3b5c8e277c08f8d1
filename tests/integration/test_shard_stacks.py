"""A shard that seems stuck can be asked what it does: SIGUSR1 makes a real ps-server write every thread's
Python stack to its log and go on serving; LocalCluster, waiting for a shard that does not start, shows
whether it exited or still runs, and its stacks. Ordering is by the log's contents and replies, never by
sleeping."""

from __future__ import annotations

import pathlib
import signal
import sys

import pytest

from torchps.client import PSClient
from torchps.errors import ServerUnavailableError
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from helpers import wait_until  # noqa: E402


def test_sigusr1_writes_a_shards_stacks_to_its_log_and_it_serves_on():
    with LocalCluster(1) as local, PSClient(local.cluster, connect_timeout=20) as client:
        local.procs[0].send_signal(signal.SIGUSR1)
        wait_until(lambda: "ps_server/daemon.py" in local.log(0), 20, "the shard's stacks in its log, its main "
                   "thread waiting in serve()")
        assert "most recent call first" in local.log(0)
        assert client.status(0).index == 0 and local.procs[0].poll() is None


def test_a_shard_waited_for_in_vain_is_described_with_its_stacks():
    with LocalCluster(1) as local:
        (pathlib.Path(local._tmp.name) / "ps0.port").unlink()  # as if it had never written it
        with pytest.raises(ServerUnavailableError) as raised:
            local._wait_port(0, timeout=0.2)
        message = str(raised.value)
        assert "ps 0 did not start: still running (state " in message and "most recent call first" in message
        local.procs[0].kill()
        local.procs[0].wait(timeout=30)
        with pytest.raises(ServerUnavailableError, match="ps 0 did not start: killed by SIGKILL after"):
            local._wait_port(0, timeout=5)
