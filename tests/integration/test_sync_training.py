"""Synchronous (and bounded-staleness) training end to end: real ps-server processes, worker processes.

Each test runs its own 2-shard LocalCluster (a shard's mode cannot change once
workers joined) and fresh worker processes (multiprocessing forkserver, see
CTX; bodies in sync_workers.py). Every wait is bounded, so a hang
fails the test instead of blocking the suite.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import signal
import sys
import time

import grpc
import pytest
import torch

from torchps.client import Optimizer, PSClient, TaskSpec
from torchps import codec
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.worker.local_cluster import LocalCluster

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import sync_workers  # noqa: E402 - needs the path above under any import mode
from helpers import forkserver_context, wait_until

# Fresh worker processes, never forked from this (gRPC-threaded) test process. 'forkserver' forks them
# from one clean helper process that imported torch once: the same isolation as 'spawn' without paying
# a torch import (several seconds on a loaded 2-core machine) per worker.
CTX = forkserver_context()
STAT_KEYS = {"pushes", "wait_seconds", "stale_dropped", "quorum"}


@pytest.fixture
def procs():
    """Factory start(target, *args, **kwargs) -> a started worker Process; survivors are SIGKILLed after the test."""
    started: list[multiprocessing.Process] = []

    def start(target, *args, **kwargs):
        proc = CTX.Process(target=target, args=args, kwargs=kwargs, daemon=True)
        proc.start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


@pytest.fixture
def cluster():
    """Factory: cluster(workers) -> a started 2-shard LocalCluster with `workers` worker entries."""
    started: list[LocalCluster] = []

    def make(workers: int) -> LocalCluster:
        local = LocalCluster(2, workers=workers)
        started.append(local)
        local.start()
        return local

    yield make
    for local in started:
        local.stop(grace=2.0)


def wait_exit(processes, timeout: float, what: str) -> None:
    """Joins every process within `timeout` s in all; asserts each exited with code 0."""
    deadline = time.monotonic() + timeout
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [p.name for p in processes if p.is_alive()]
    assert not hung, f"{what}: {hung} still running after {timeout} s (hung?)"
    failed = {p.name: p.exitcode for p in processes if p.exitcode != 0}
    assert not failed, f"{what}: worker processes failed (exit codes {failed}); their tracebacks are above"


def drain(results, count: int, timeout: float = 10.0) -> dict[int, list[dict]]:
    """`count` result dicts from the queue, by worker index."""
    out: dict[int, list[dict]] = {}
    for _ in range(count):
        item = results.get(timeout=timeout)
        out.setdefault(item["index"], []).append(item)
    return out


# -- exactness -------------------------------------------------------------------------------------------

def reference(opt: str, batch: int, num_workers: int, steps: int) -> dict[str, torch.Tensor]:
    """One process, plain PyTorch, global batch N*b: what sync training with R = N must equal."""
    name, hyper = sync_workers.OPTIMIZERS[opt]
    model = sync_workers.make_model()
    if name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), **hyper)
    else:
        optimizer = torch.optim.Adam(model.parameters(), **hyper)
    x, y = sync_workers.make_data(steps, num_workers * batch)
    for k in range(steps):
        sync_workers.backward(model, x[k], y[k])
        optimizer.step()
    return {f"{opt}/{n}": p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("exchange, overlap", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["push-then-pull", "exchange", "overlap-push-then-pull", "overlap-exchange"])
def test_sync_training_equals_single_process_large_batch(cluster, procs, exchange, overlap):
    """N=2 workers, batch b, R=N: after K steps the parameters equal 1-process training with batch N*b, with
    and without overlap (gradients streamed during backward, values pulled during forward)."""
    num_workers, batch, steps, optimizers = 2, 4, 5, ["sgd", "adam"]
    local = cluster(num_workers)
    workers = [procs(sync_workers.exact_worker, local.cluster, i, num_workers, batch, steps, optimizers, 10.0,
                     exchange, overlap) for i in range(num_workers)]
    wait_exit(workers, 90, "exactness workers")
    with PSClient(local.cluster, connect_timeout=10) as ps:
        status = ps.status(0)
        assert status.step == steps * len(optimizers), "one global step per aggregated update"
        assert status.stale_dropped == 0 and status.workers_expired == 0
        assert ps.status(1).step == steps * len(optimizers), "every shard applies every step"
        for opt in optimizers:  # place the names in the workers' order, so this client finds their shards
            ps.declare({f"{opt}/{n}": p.detach() for n, p in sync_workers.make_model().named_parameters()})
        for opt in optimizers:
            expected = reference(opt, batch, num_workers, steps)
            got = ps.pull(list(expected))
            initial = {f"{opt}/{n}": p for n, p in sync_workers.make_model().named_parameters()}
            for name, value in expected.items():
                assert not torch.allclose(value, initial[name]), f"{name}: the reference did not train"
                torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0,
                                           msg=lambda m, name=name: f"{opt}: {name} differs from the "
                                                                    f"single-process reference: {m}")
        for info in ps.list_variables():
            assert info.version == steps, f"{info.spec.name}: {info.version} updates, expected one per step"


# -- dead workers, replacements, early finishers ---------------------------------------------------------

def test_killed_worker_does_not_hang_the_others_and_a_replacement_rejoins(cluster, procs):
    """N=R=3, lease 1.5 s: SIGKILL worker 2 mid-training; 0 and 1 go on with quorum 2; a new worker 2 rejoins."""
    local = cluster(3)
    stop, results = CTX.Event(), CTX.Queue()
    common = dict(mode="sync", num_workers=3, replicas=3, lease_seconds=1.5, sleep=0.05, results=results)
    workers = [procs(sync_workers.steady_worker, local.cluster, i, max_steps=10_000, stop=stop, chief=i == 0,
                     **common) for i in range(3)]
    with PSClient(local.cluster, connect_timeout=10) as ps:
        wait_until(lambda: ps.status(0).step >= 2, 90, "the first 2 steps with 3 workers")
        os.kill(workers[2].pid, signal.SIGKILL)
        workers[2].join(10)
        killed_at = ps.status(0).step

        def lease_expired() -> bool:  # on both shards: worker 2 out, quorum 3 -> 2
            statuses = [ps.status(0), ps.status(1)]
            return all(s.workers_expired >= 1 and s.quorum == 2 and s.live_workers == 2 for s in statuses)

        wait_until(lease_expired, 30, "worker 2's lease to expire on both shards (quorum 2, 2 live workers)")
        wait_until(lambda: ps.status(0).step >= killed_at + 5, 30,
                   "workers 0 and 1 to keep making steps without worker 2")
        assert all(w.is_alive() for w in workers[:2]), "workers 0 and 1 must still be training"

        before = ps.status(0)
        replacement = procs(sync_workers.steady_worker, local.cluster, 2, max_steps=5, stop=None, chief=False,
                            **common)
        wait_exit([replacement], 60, "the replacement worker 2")
        after = ps.status(0)
        stop.set()
        wait_exit(workers[:2], 30, "workers 0 and 1 after stop")
        final = [ps.status(0), ps.status(1)]
    by_index = drain(results, 3)
    (new,) = by_index[2]
    assert new["start_step"] >= before.step, "a replacement joins at the current step"
    # its first push, at the step it joined at, may lose the race for that step (it counts from the next)
    assert new["pushes"] == 5 and new["stats"]["stale_dropped"] <= 1, \
        f"the replacement's pushes must count, not be dropped as stale: {new}"
    assert new["stats"]["quorum"] == 3, f"with the replacement back, a step needs 3 gradients again: {new}"
    assert new["end_step"] >= new["start_step"] + 4, "each of its pushes was released by an applied step"
    assert after.quorum_changes > before.quorum_changes
    for index in (0, 1):
        (result,) = by_index[index]
        assert STAT_KEYS <= set(result["stats"]), result["stats"]
        assert result["stats"]["pushes"] == result["pushes"] > killed_at
        assert result["stats"]["wait_seconds"] > 0, "sync workers wait for the step's release"
    for status in final:
        assert status.workers_expired >= 1 and status.quorum_changes >= 2  # 3 -> 2 (expiry), 2 -> 3 (rejoin)
    assert final[0].stale_dropped >= sum(r[0]["stats"]["stale_dropped"] for r in by_index.values())


def test_worker_that_leaves_early_does_not_stall_the_others(cluster, procs):
    """N=R=2, lease 30 s: worker 1 does 2 steps and leaves cleanly; worker 0 does 6 without waiting for a lease."""
    local = cluster(2)
    results = CTX.Queue()
    common = dict(mode="sync", num_workers=2, replicas=2, lease_seconds=30.0, sleep=0.0, stop=None, results=results)
    workers = [procs(sync_workers.steady_worker, local.cluster, 0, max_steps=6, chief=True, **common),
               procs(sync_workers.steady_worker, local.cluster, 1, max_steps=2, chief=False, **common)]
    wait_exit(workers, 25, "workers (a stall would last the 30 s lease)")
    by_index = drain(results, 2)
    (fast,), (early,) = by_index[0], by_index[1]
    assert early["pushes"] == 2 and fast["pushes"] == 6
    assert fast["end_step"] == 6, "2 steps with both workers, then 4 with worker 0 alone"
    assert fast["finished_at"] - early["finished_at"] < 15, "worker 0 was held back after worker 1 left"
    stats = fast["stats"]
    assert STAT_KEYS <= set(stats), stats
    assert stats["pushes"] == 6 and stats["stale_dropped"] == 0 and stats["quorum"] == 1
    assert stats["quorum_changes"] == 1 and stats["wait_seconds"] >= 0
    with PSClient(local.cluster, connect_timeout=10) as ps:
        for shard in (0, 1):
            status = ps.status(shard)
            assert status.step == 6 and status.workers_expired == 0, status
            assert status.stale_dropped == 0 and status.quorum_changes >= 1 and status.live_workers == 0, status


def test_two_modules_of_one_worker_both_train(cluster):
    """A worker with two registered modules (encoder, decoder) pushes both each step: neither is dropped.

    The step token must follow the job's step, not each binding's own: the
    second binding's push must not be tagged with a step the first one's
    push already completed.
    """
    local = cluster(1)
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=30) as ps:
        ps.configure("sync", total_num_replicas=1, lease_seconds=30.0)
        encoder, decoder = torch.nn.Linear(3, 2), torch.nn.Linear(2, 3)
        bindings = [ps.register_module(encoder, Optimizer("sgd", lr=0.1), create=True, prefix="enc/"),
                    ps.register_module(decoder, Optimizer("sgd", lr=0.1), create=True, prefix="dec/")]
        for _ in range(3):
            for param in [*encoder.parameters(), *decoder.parameters()]:
                param.grad = torch.ones_like(param)
            for binding in bindings:
                binding.push()
            for binding in bindings:
                binding.pull()
        versions = {info.spec.name: info.version for info in ps.list_variables()}
        stats = ps.stats.as_dict()
    assert stats["stale_dropped"] == 0 and all(v == 3 for v in versions.values()), \
        f"gradients dropped as stale: {stats['stale_dropped']} of {stats['pushes']} pushes; versions {versions}"


# -- idempotent retry over gRPC ------------------------------------------------------------------------------

def push_requests(header: ps_pb2.PushHeader, grads: dict[str, torch.Tensor]):
    """A Push stream built with the generated classes only: the header, then one message per chunk."""
    yield ps_pb2.PushRequest(header=header)
    for name, grad in grads.items():
        for chunk in codec.encode_chunks(name, grad):
            yield ps_pb2.PushRequest(chunks=[chunk])


def test_retried_push_is_applied_once(cluster):
    """The same Push twice through the generated stub, same (worker, incarnation, seq): applied once."""
    local = cluster(1)
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=30) as ps:
        ps.configure("sync", total_num_replicas=1, lease_seconds=30.0)
        ps.create_variables({"dup/a": torch.zeros(4), "dup/b": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        assert ps.join() == 0
        channels = [grpc.insecure_channel(address) for address in local.cluster.ps]
        stubs = [ps_pb2_grpc.ParameterServerStub(channel) for channel in channels]
        grads = {"dup/a": torch.ones(4), "dup/b": torch.ones(2)}
        shard_of = {name: ps.placement.shard_of(name) for name in grads}
        assert set(shard_of.values()) == {0, 1}, "one variable per shard"

        def send(shard: int, seq: int, step: int) -> ps_pb2.PushResponse:
            header = ps_pb2.PushHeader(worker=ps.worker, step=step, incarnation=ps.incarnation, seq=seq)
            mine = {n: g for n, g in grads.items() if shard_of[n] == shard}
            return stubs[shard].Push(push_requests(header, mine), timeout=30)

        for shard in (0, 1):
            first, again = send(shard, 1, 0), send(shard, 1, 0)
            assert not first.duplicate and again.duplicate and not again.stale, (first, again)
            if shard == 0:  # shard 0 holds the reply until the step is released; others answer at once
                assert first.next_step == again.next_step == 1
        values = {name: torch.empty_like(grad) for name, grad in grads.items()}
        ps.pull_into(values, min_step=1)  # every shard has applied step 0
        assert all(torch.equal(v, -torch.ones_like(v)) for v in values.values()), values
        assert [info.version for info in ps.list_variables()] == [1, 1]
        assert ps.status(0).step == ps.status(1).step == 1
        assert ps.status(0).stale_dropped == 0
        assert not send(0, 2, 1).duplicate and not send(1, 2, 1).duplicate, "the next seq is a new push"
        assert ps.status(0).step == 2
        for channel in channels:
            channel.close()


# -- bounded staleness ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("staleness", [1, 0])
def test_ssp_fast_worker_stays_within_the_bound(cluster, procs, staleness):
    """ssp, 2 workers, worker 1 sleeps 0.3 s per step: worker 0 is never more than s+1 pushes ahead."""
    local = cluster(2)
    results, progress = CTX.Queue(), CTX.Array("i", 2)
    steps = 6
    common = dict(mode="ssp", num_workers=2, replicas=0, lease_seconds=10.0, max_staleness=staleness,
                  max_steps=steps, stop=None, results=results, progress=progress)
    workers = [procs(sync_workers.steady_worker, local.cluster, 0, sleep=0.0, chief=True, **common),
               procs(sync_workers.steady_worker, local.cluster, 1, sleep=0.3, chief=False, **common)]
    wait_exit(workers, 60, "ssp workers")
    by_index = drain(results, 2)
    (fast,), (slow,) = by_index[0], by_index[1]
    assert fast["pushes"] == slow["pushes"] == steps
    assert fast["max_ahead"] <= staleness + 1, \
        f"max_staleness={staleness}: the fast worker got {fast['max_ahead']} pushes ahead of the slow one"
    if staleness:  # its second push is not held and the slow worker is asleep: it is ahead then
        assert fast["max_ahead"] >= 1
    # (with s = 0 each fast push is released by the slow worker's, and which of the two counts itself first
    # is a race: being held is the evidence that the bound acted)
    assert fast["stats"]["wait_seconds"] > 0.3, "the fast worker must have been held back by the bound"
    if staleness == 0:
        assert slow["max_ahead"] <= 1, "lock-step: neither worker gets more than one push ahead"
    with PSClient(local.cluster, connect_timeout=10) as ps:
        assert ps.status(0).step == 2 * steps, "ssp applies every push"
