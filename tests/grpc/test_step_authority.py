"""Who may move a restored shard's step, over real gRPC with roles on (mutual TLS, tokens).

A shard restored from an older checkpoint (here: SIGKILLed and started again without a journal) catches up
with the job's step. Only what the chief vouches for moves it: the committed checkpoint it restored, the
chief's Join, Heartbeat and Push. A worker's number moves it no further than that; a read moves nothing,
whoever sends it (an evaluator, the chief, anyone on a shard without credentials): its
Pull(min_step=2**62) waits, and the step stays where it was.
"""

from __future__ import annotations

import grpc
import torch

from torchps.certs import make_job_credentials
from torchps.client import Optimizer, PSClient, TaskSpec
from torchps.cluster import Cluster
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.security import TOKEN_METADATA_KEY, Security

DEADLINE = 20.0
LONG = 3600.0
FAR = 1 << 62
PLACEHOLDER = Cluster(ps=("127.0.0.1:1",), chief=("127.0.0.1:2",), worker=("127.0.0.1:3",),
                      evaluator=("127.0.0.1:5",))
CHIEF, WORKER, EVALUATOR, PS = TaskSpec("chief", 0), TaskSpec("worker", 0), TaskSpec("evaluator", 0), TaskSpec("ps", 0)


class Caller:
    """Raw calls to the shard as one task (its certificate and the token its files hold)."""

    def __init__(self, address: str, files):
        credentials = grpc.ssl_channel_credentials(root_certificates=files.ca.read_bytes(),
                                                   private_key=files.key.read_bytes(),
                                                   certificate_chain=files.cert.read_bytes())
        self.channel = grpc.secure_channel(address, credentials, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)
        token = (files.admin_token or files.token).read_text().strip()
        self.metadata = ((TOKEN_METADATA_KEY, token),)

    def __call__(self, method: str, request, timeout: float = DEADLINE):
        reply = getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)
        return list(reply) if method == "Pull" else reply

    def step(self) -> int:
        return self("GetStatus", ps_pb2.StatusRequest()).step


def test_only_the_chief_moves_a_restored_shards_step(local_cluster, tmp_path):
    files = make_job_credentials(tmp_path / "job", PLACEHOLDER)
    f = files[PS]
    local = local_cluster(1, server_args=[
        "--tls-cert", str(f.cert), "--tls-key", str(f.key), "--tls-ca", str(f.ca), "--token-file", str(f.token),
        "--admin-token-file", str(files[CHIEF].admin_token), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--no-journal"])
    c = files[CHIEF]
    security = Security.load(tls_cert=str(c.cert), tls_key=str(c.key), tls_ca=str(c.ca), token_file=str(c.token),
                             admin_token_file=str(c.admin_token), environ={})
    with PSClient(local.cluster, task=CHIEF, security=security, connect_timeout=DEADLINE) as chief:
        chief.configure("async", lease_seconds=LONG, startup_grace_seconds=LONG, progress_seconds=LONG)
        chief.create_variables({"w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        for _ in range(3):
            chief.push({"w": torch.ones(2)})
        assert chief.save_checkpoint(3) == 3
        for _ in range(2):
            chief.push({"w": torch.ones(2)})  # the job goes on to step 5; the checkpoint stays at 3
    local.kill_ps(0)
    local.start_ps(0)
    address = local.cluster.ps[0]
    chief, worker, evaluator = (Caller(address, files[task]) for task in (CHIEF, WORKER, EVALUATOR))
    try:
        status = chief("GetStatus", ps_pb2.StatusRequest())
        assert (status.restored_step, status.step) == (3, 3), status

        try:  # the evaluator's far min_step waits (until its deadline) and moves nothing
            evaluator("Pull", ps_pb2.PullRequest(names=["w"], min_step=FAR), timeout=2.0)
            raise AssertionError("an evaluator's Pull(min_step=2**62) was answered: it moved the step")
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc
        assert chief.step() == 3
        try:  # the chief's own read moves nothing either: a read is no proof of the job's step
            chief("Pull", ps_pb2.PullRequest(names=["w"], min_step=FAR), timeout=1.0)
            raise AssertionError("the chief's Pull(min_step=2**62) was answered: it moved the step")
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc
        assert chief.step() == 3

        # A worker's numbers: checked against what the chief vouched for (so far the checkpoint's step 3).
        assert worker("Join", ps_pb2.WorkerRef(worker="worker:0", incarnation=11, step=FAR)).step == 3
        assert worker("Heartbeat", ps_pb2.WorkerRef(worker="worker:0", incarnation=11, step=4)).step == 3
        assert chief.step() == 3

        # The chief's heartbeat shows the job's step: the shard catches up to it, and no further for a worker.
        assert chief("Heartbeat", ps_pb2.WorkerRef(worker="chief:0", incarnation=12, step=5)).step == 5
        assert worker("Heartbeat", ps_pb2.WorkerRef(worker="worker:0", incarnation=11, step=FAR)).step == 5
        assert len(worker("Pull", ps_pb2.PullRequest(names=["w"], min_step=5))) == 1
        assert chief.step() == 5
    finally:
        for caller in (chief, worker, evaluator):
            caller.channel.close()


def test_a_read_never_moves_a_restored_shards_step_on_a_shard_without_credentials(local_cluster, tmp_path):
    """--insecure: every caller counts as the chief there, yet a Pull's min_step is a read and moves nothing
    (it waits until its deadline); the shard restored with --restore-from stays at its checkpoint's step."""
    ckpt = tmp_path / "ckpt"
    first = local_cluster(1, server_args=["--checkpoint-dir", str(ckpt), "--no-journal"])
    with PSClient(first.cluster, connect_timeout=DEADLINE) as chief:
        chief.create_variables({"w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        for _ in range(3):
            chief.push({"w": torch.ones(2)})
        assert chief.save_checkpoint(3) == 3
    first.stop()
    restored = local_cluster(1, server_args=["--restore-from", str(ckpt), "--num-ps", "1", "--no-journal",
                                             "--insecure"])
    with grpc.insecure_channel(restored.cluster.ps[0], options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        status = stub.GetStatus(ps_pb2.StatusRequest(), timeout=DEADLINE)
        assert (status.restored_step, status.step) == (3, 3), status
        try:
            list(stub.Pull(ps_pb2.PullRequest(names=["w"], min_step=FAR), timeout=1.0))
            raise AssertionError("Pull(min_step=2**62) was answered: it moved the step")
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc
        assert stub.GetStatus(ps_pb2.StatusRequest(), timeout=DEADLINE).step == 3
