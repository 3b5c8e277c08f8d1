"""Replicated shards (ps-server --replica-of): a lost primary's backup serves its shard with every acknowledged
push, and a primary cut off from its promoted backup never acknowledges again. Real processes."""

import json
import shutil
import signal
import subprocess
import sys

import grpc
import torch
from helpers import free_ports, wait_until

from torchps.client import Optimizer, PSClient
from torchps.cluster import Cluster
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server.failstop import EXIT_CODE
from torchps.worker.local_cluster import LocalCluster

SHAPES = {"rep/a": (64, 33), "rep/b": (1000,)}  # round robin: a on ps:0, b on ps:1 (the replicated one)


def _start(tmp_path, extra=()):
    p0, p1, pb = free_ports(3)
    spec = json.dumps({"ps": [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"], "worker": ["127.0.0.1:1"]})
    local = LocalCluster(2, ports=[p0, p1], server_args=["--cluster", spec, "--checkpoint-dir", str(tmp_path / "ck"),
                                                          *extra], log_dir=tmp_path)
    local.start()
    backup_address = f"127.0.0.1:{pb}"
    with open(tmp_path / "backup.log", "wb") as log:
        backup = subprocess.Popen([sys.executable, "-m", "torchps.ps_server", "--index", "1", "--cluster", spec,
                                   "--replica-of", f"127.0.0.1:{p1}", "--bind", backup_address, "--journal-dir",
                                   str(tmp_path / "backup-1"), "--insecure", "--torch-threads", "1", *extra],
                                  stdout=log, stderr=subprocess.STDOUT)
    return local, backup, backup_address, Cluster.from_json(spec)


def _replicas(ps) -> dict:
    layout = ps._fanout.call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t), 10)
    return {entry.index: entry for entry in layout.replicas}


def test_a_lost_primarys_backup_serves_every_acknowledged_push(tmp_path):
    """ps:1 is killed and its folder deleted (its host is gone) between two runs of pushes of ones: the pushes
    go on against its backup, which ps 0 names; every value is exactly minus the pushes made."""
    local, backup, backup_address, cluster = _start(tmp_path)
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
            assert [ps.placement.shard_of(n) for n in SHAPES] == [0, 1]
            wait_until(lambda: _replicas(ps).get(1) is not None and _replicas(ps)[1].backup == backup_address,
                       30, "ps 0 to record ps:1's backup in sync")
            grads = {n: torch.ones(s) for n, s in SHAPES.items()}
            for _ in range(15):
                ps.push(grads)
            local.kill_ps(1)
            shutil.rmtree(tmp_path / "ck" / "journal" / "ps-1")
            for _ in range(15):
                ps.push(grads)
            values = ps.pull(SHAPES)
            for name, shape in SHAPES.items():
                assert torch.equal(values[name], torch.full(shape, -30.0)), name
            entry = _replicas(ps)[1]
            assert (entry.primary, entry.backup, entry.failovers) == (backup_address, "", 1)
            assert ps._layout.relocated == 1
    finally:
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()
    assert "this backup serves it" in (tmp_path / "backup.log").read_text()


def test_a_primary_cut_off_from_its_promoted_backup_never_acknowledges_again(tmp_path):
    """ps:1 is paused (SIGSTOP) until its backup, hearing nothing, is promoted; then ps 0 is paused and ps:1
    resumed: alive, cut off from both, it cannot acknowledge the push a client sends it directly (it waits for
    a backup that is gone and for ps 0's word). ps 0 resumed refuses to drop the backup it promoted: ps:1
    stops, and the promoted backup holds the one push acknowledged, not the refused one."""
    local, backup, backup_address, cluster = _start(tmp_path)
    old = local.address(1)
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
            wait_until(lambda: _replicas(ps).get(1) is not None and _replicas(ps)[1].backup == backup_address,
                       30, "ps 0 to record ps:1's backup in sync")
            ps.push({n: torch.ones(s) for n, s in SHAPES.items()})
            local.procs[1].send_signal(signal.SIGSTOP)
            wait_until(lambda: _replicas(ps)[1].primary == backup_address, 30, "ps 0 to promote ps:1's backup")
            local.procs[0].send_signal(signal.SIGSTOP)
            local.procs[1].send_signal(signal.SIGCONT)
            with grpc.insecure_channel(old) as channel:  # a client that never heard of the failover
                header = ps_pb2.PushHeader(worker="worker:0", incarnation=99, seq=1, step=0, step_increment=1,
                                           tensors=1)
                chunk = ps_pb2.TensorChunk(name="rep/b", meta=ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[1000]),
                                           offset=0, data=torch.ones(1000).numpy().tobytes())
                try:
                    ps_pb2_grpc.ParameterServerStub(channel).PushOne(
                        ps_pb2.PushRequest(header=header, chunks=[chunk]), timeout=3)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    code = exc.code()
            assert local.procs[1].poll() is None, "ps:1 must be alive, cut off, when the push comes"
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED, code
            local.procs[0].send_signal(signal.SIGCONT)
            assert local.procs[1].wait(timeout=30) == EXIT_CODE
            values = ps.pull(["rep/b"])
            assert torch.equal(values["rep/b"], torch.full((1000,), -1.0))
    finally:
        for proc in local.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()
    assert "is fenced" in local_log(tmp_path)


def local_log(tmp_path) -> str:
    return (tmp_path / "ps1.log").read_text(errors="replace")
