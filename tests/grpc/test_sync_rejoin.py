"""A sync worker back after its lease ran out, on a shard a step behind shard 0 (the replicated soak found it): its
heartbeat and its stale push name a step that shard applied, so the shard leaves it out of the step it is open at,
which the worker never pushes for (shard 0 told it the next one); its heartbeats and pushes at that next step count
it back from there. Raw calls to a real ps 1, with real leases."""

from __future__ import annotations

import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from torchps.client import Optimizer, PSClient, TaskSpec
from torchps.proto import ps_pb2

from helpers import wait_until

SERVICE = "/torchps.v1.ParameterServer/"
NAME = "rejoin/b"  # the second variable created: ps 1's, placed round robin
META = ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[3])
LEASE_SECONDS = 2.0
TIMEOUT = 30.0


def _call(chan: grpc.Channel, method: str, request, reply):
    return chan.unary_unary(SERVICE + method, request_serializer=type(request).SerializeToString,
                            response_deserializer=reply.FromString)(request, timeout=TIMEOUT)


def _ref(worker: str, step: int) -> ps_pb2.WorkerRef:
    return ps_pb2.WorkerRef(worker=worker, incarnation=1, step=step)


def _push(chan: grpc.Channel, worker: str, step: int) -> ps_pb2.PushResponse:
    """`worker`'s gradient of ones for NAME, computed at `step` (its push number: step + 1)."""
    header = ps_pb2.PushHeader(worker=worker, incarnation=1, seq=step + 1, step=step, tensors=1)
    request = ps_pb2.PushRequest(header=header, chunks=[
        ps_pb2.TensorChunk(name=NAME, meta=META, offset=0, data=struct.pack("<3f", 1, 1, 1))])
    call = chan.stream_unary(SERVICE + "Push", request_serializer=ps_pb2.PushRequest.SerializeToString,
                             response_deserializer=ps_pb2.PushResponse.FromString)
    return call(iter([request]), timeout=TIMEOUT)


class _Heartbeats:
    """Renews the leases of the workers in `steps` (worker -> the step it computes at) every lease / 10."""

    def __init__(self, chan: grpc.Channel):
        self.steps: dict[str, int] = {}
        self._chan, self._stop = chan, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 10):
            for worker, step in list(self.steps.items()):
                _call(self._chan, "Heartbeat", _ref(worker, step), ps_pb2.HeartbeatResponse)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(TIMEOUT)


def _step(chan: grpc.Channel, pool: ThreadPoolExecutor, pushes: dict[str, int]) -> list[ps_pb2.PushResponse]:
    """The pushes at once (each may be held until its step is applied), their replies."""
    return [future.result(TIMEOUT) for future in [pool.submit(_push, chan, w, s) for w, s in pushes.items()]]


def test_a_sync_worker_back_after_its_lease_counts_again_from_the_step_shard_0_told_it(local_cluster):
    local = local_cluster(2)
    with PSClient(local.cluster, task=TaskSpec("chief", 0), connect_timeout=10) as chief, \
            grpc.insecure_channel(local.address(1)) as chan, ThreadPoolExecutor(3) as pool:
        chief.configure("sync", total_num_replicas=3, lease_seconds=LEASE_SECONDS, startup_grace_seconds=0.0)
        chief.create_variables({"rejoin/a": torch.zeros(3), NAME: torch.zeros(3)}, Optimizer("sgd", lr=1.0))
        assert chief.status(1).num_variables == 1
        with _Heartbeats(chan) as heartbeats:
            for worker in ("worker:0", "worker:1", "worker:2"):
                _call(chan, "Join", _ref(worker, 0), ps_pb2.JoinResponse)
            heartbeats.steps.update({"worker:0": 0, "worker:1": 0})  # worker 2 is paused: no heartbeat
            wait_until(lambda: chief.status(1).workers_expired == 1, TIMEOUT, "worker 2's lease to run out")
            assert not any(reply.stale for reply in _step(chan, pool, {"worker:0": 0, "worker:1": 0}))
            wait_until(lambda: chief.status(1).step == 1, TIMEOUT, "ps 1 to apply step 0")
            heartbeats.steps.update({"worker:0": 1, "worker:1": 1})
            status = chief.status(1)
            assert (status.step, status.quorum, status.live_workers) == (1, 2, 2), status

            # Worker 2 resumes: a heartbeat and the push it was computing, both at step 0, which ps 1 applied.
            _call(chan, "Heartbeat", _ref("worker:2", 0), ps_pb2.HeartbeatResponse)
            assert _push(chan, "worker:2", 0).stale
            status = chief.status(1)
            assert (status.step, status.quorum, status.live_workers) == (1, 2, 2), \
                f"worker 2 counted back from step 1, which it never pushes for: {status}"

            # Shard 0 told it step 2: its heartbeats name it, and ps 1's step 1 is applied without it.
            heartbeats.steps["worker:2"] = 2
            wait_until(lambda: chief.status(1).live_workers == 3, TIMEOUT, "worker 2's heartbeat at step 2")
            assert chief.status(1).quorum == 2, "step 1 still needs workers 0 and 1 only"
            assert not any(reply.stale for reply in _step(chan, pool, {"worker:0": 1, "worker:1": 1}))
            try:
                wait_until(lambda: chief.status(1).step == 2, 10 * LEASE_SECONDS, "ps 1 to apply step 1")
            except AssertionError as exc:
                raise AssertionError(f"ps 1 waits at step 1 for worker 2, which pushes at step 2: {exc}") from None
            heartbeats.steps.update({"worker:0": 2, "worker:1": 2})
            replies = _step(chan, pool, {"worker:0": 2, "worker:1": 2, "worker:2": 2})
            assert not any(reply.stale for reply in replies)
            wait_until(lambda: chief.status(1).step == 3, TIMEOUT, "ps 1 to apply step 2")
            status = chief.status(1)
            assert (status.step, status.quorum, status.live_workers, status.stale_dropped) == (3, 3, 3, 1), status
        # Steps 0 and 1 averaged over workers 0 and 1, step 2 over all three: each an average of ones.
        assert chief.pull([NAME])[NAME].tolist() == [-3.0, -3.0, -3.0]
