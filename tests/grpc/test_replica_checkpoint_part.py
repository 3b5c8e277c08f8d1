"""A shard of a replicated job (--replicated) that its arbiter confirmed, on real processes: its part of the
checkpoint folder held by another process, or failing, it serves at once, refuses to save until it holds that
part, and saves once it does."""

import fcntl
import json
import os

import grpc
import pytest
import torch
from helpers import free_ports

from torchps.client import Optimizer, PSClient
from torchps.cluster import Cluster
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server import checkpoint
from torchps.worker.local_cluster import LocalCluster

SHAPES = {"part/a": (8,), "part/b": (300,)}  # round robin: b on ps:1


@pytest.mark.parametrize("blocked", ["held", "failing"])
def test_a_confirmed_primary_serves_at_once_and_saves_once_it_holds_its_part_of_the_checkpoint_folder(
        tmp_path, blocked):
    """ps:1's lock file in the checkpoint folder is held by another process (a replaced process of its shard
    that has not stopped), or cannot be opened (a directory stands there: a shared folder failing). ps:1 serves
    pushes once ps 0 confirmed it (before, it served nothing for 30 s while held, and stopped for good on the
    failure); a Save there is refused UNAVAILABLE, naming why. Once the lock is free, a checkpoint is saved
    that holds the pushes."""
    ports = free_ports(2)
    spec = json.dumps({"ps": [f"127.0.0.1:{port}" for port in ports], "worker": ["127.0.0.1:1"]})
    folder = tmp_path / "ck"
    folder.mkdir()
    lock = folder / "ps-1.lock"
    holder = None
    if blocked == "held":
        holder = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        lock.mkdir()
    local = LocalCluster(2, ports=ports, server_args=["--cluster", spec, "--checkpoint-dir", str(folder),
                                                      "--replicated"], log_dir=tmp_path)
    local.start()
    channel = grpc.insecure_channel(local.address(1))
    try:
        with PSClient(Cluster.from_json(spec), connect_timeout=30, timeout=20) as ps:
            ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
            ps.push({n: torch.ones(s) for n, s in SHAPES.items()})
            assert "its arbiter confirms it serves ps:1" in local.log(1), local.log(1)[-3000:]
            with pytest.raises(grpc.RpcError) as refused:
                ps_pb2_grpc.ParameterServerStub(channel).Save(ps_pb2.SaveRequest(now=True), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            why = ("still holds its part of the checkpoint folder" if blocked == "held" else
                   "cannot hold its part of the checkpoint folder yet")
            assert why in refused.value.details(), refused.value.details()
            assert checkpoint.latest_committed(folder) is None
            if holder is not None:
                os.close(holder)
                holder = None
            else:
                lock.rmdir()
            step = ps.save_checkpoint(0, timeout=60)  # Save retried while refused: taken within a second or so
        assert checkpoint.latest_committed(folder)[0] == step
        saved = dict((entry["name"], entry["value"]) for entry in checkpoint.restore_state(folder, 1, 2)["variables"])
        assert torch.equal(saved["part/b"], torch.full((300,), -1.0))
        assert local.procs[1].poll() is None
        assert "holds its part of the checkpoint folder" in local.log(1)
    finally:
        channel.close()
        if holder is not None:
            os.close(holder)
        local.stop()
