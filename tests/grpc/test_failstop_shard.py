"""Fail-stop on a real ps-server process: a background part of the shard that fails stops the process, with one
line naming the cause and a non-zero exit code, instead of leaving a shard that answers while a part of it is
dead; started again, it recovers every acknowledged push from its journal.

The fault is real: the disk fills (the shard's file-size limit is lowered under the journal's size, as
`prlimit --fsize` does, so every journal append fails with EFBIG) while no call is in progress; the next
journal record is the lease reaper's, when a worker's lease runs out.
"""

from __future__ import annotations

import resource

import grpc
import torch

from torchps import codec
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server.failstop import EXIT_CODE

TIMEOUT = 30.0
N = 1 << 20            # 4 MiB of float32: the journal's log outgrows the shard's own log by far
LEASE_SECONDS = 3.0    # the lease runs out after the disk fills (the test checks it did not before)


def _create(stub, name: str) -> None:
    value = torch.zeros(N)
    spec = ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value),
                               optimizer=ps_pb2.OptimizerSpec(name="sgd", hyperparams={"lr": 1.0}))
    requests = [ps_pb2.CreateRequest(spec=spec)] + [ps_pb2.CreateRequest(chunk=c)
                                                   for c in codec.encode_chunks(name, value)]
    assert list(stub.CreateVariables(iter(requests), timeout=TIMEOUT).created) == [True]


def _push(stub, name: str, worker: str) -> ps_pb2.PushResponse:
    header = ps_pb2.PushHeader(worker=worker, incarnation=7, seq=1, step_increment=1, tensors=1)
    requests = [ps_pb2.PushRequest(header=header)] + [ps_pb2.PushRequest(chunks=[c])
                                                     for c in codec.encode_chunks(name, torch.ones(N))]
    return stub.Push(iter(requests), timeout=TIMEOUT)


def _value(stub, name: str) -> torch.Tensor:
    data = b"".join(c.data for m in stub.Pull(ps_pb2.PullRequest(names=[name]), timeout=TIMEOUT) for c in m.chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.float32).clone()


def test_a_lease_reaper_that_cannot_journal_stops_the_shard_and_the_restart_recovers(local_cluster, tmp_path):
    local = local_cluster(1, server_args=["--checkpoint-dir", str(tmp_path / "ckpt")])
    name, worker = "failstop/w", "worker:0"
    with grpc.insecure_channel(local.cluster.ps[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        stub.Configure(ps_pb2.SyncConfig(mode="async", lease_seconds=LEASE_SECONDS, progress_seconds=600),
                       timeout=TIMEOUT)
        _create(stub, name)
        stub.Join(ps_pb2.WorkerRef(worker=worker, incarnation=7), timeout=TIMEOUT)
        assert _push(stub, name, worker).versions[name] == 1  # acknowledged: in the journal
    journal = max((tmp_path / "ckpt" / "journal" / "ps-0").glob("log-*.bin"))
    shard_log = local.log_dir / "ps0.log"
    limit = shard_log.stat().st_size + (256 << 10)  # room for the shard's own last lines, not for a record
    assert journal.stat().st_size > limit
    resource.prlimit(local.procs[0].pid, resource.RLIMIT_FSIZE, (limit, limit))  # the disk is full now
    assert "lease expired" not in local.log(0), "the lease ran out before the disk filled: no fault was injected"
    code = local.procs[0].wait(timeout=TIMEOUT + LEASE_SECONDS)
    log = local.log(0)
    assert code == EXIT_CODE, log[-2000:]
    stops = [line for line in log.splitlines() if "stops (fail-stop" in line]
    # The reaper's record is written by the journal's writer thread: the line names that write and its error.
    assert len(stops) == 1 and f"journal {journal.parent}/log-" in stops[0] \
        and ".bin: a write failed: File too large" in stops[0], log[-2000:]
    assert "lease expired" in log  # the record that could not be written was the reaper's
    local.start_ps(0)  # what a launcher or Kubernetes does: the journal brings back what was acknowledged
    with grpc.insecure_channel(local.cluster.ps[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        assert torch.equal(_value(stub, name), -torch.ones(N))
        assert stub.GetStatus(ps_pb2.StatusRequest(), timeout=TIMEOUT).step == 1
