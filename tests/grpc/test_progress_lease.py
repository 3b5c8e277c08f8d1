"""Progress leases against a real shard: a worker that keeps heartbeating but stops pushing (a stuck data
loader, TensorFlow's tf#5022 hang) leaves the sync quorum after the progress timeout, and comes back
when it pushes again."""

from __future__ import annotations

import threading

import torch

from torchps.client import Optimizer, PSClient, TaskSpec

from helpers import wait_until

PROGRESS_SECONDS = 2.0


def test_a_heartbeating_worker_that_stops_pushing_leaves_the_quorum_and_rejoins_when_it_pushes(local_cluster):
    local = local_cluster(1, workers=2)
    grad = {"pl/w": torch.ones(3)}
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=10) as a, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=10) as b:
        a.configure("sync", total_num_replicas=2, lease_seconds=10.0, startup_grace_seconds=0.0,
                    progress_seconds=PROGRESS_SECONDS)
        a.create_variables({"pl/w": torch.zeros(3)}, Optimizer("sgd", lr=1.0))
        b.declare(grad)
        a.join(), b.join()
        pushes = [threading.Thread(target=client.push, args=(grad,)) for client in (a, b)]
        for thread in pushes:
            thread.start()
        for thread in pushes:
            thread.join(20)
        assert a.step == b.step == 1 and a.status(0).quorum == 2

        # b stalls: its heartbeats keep its lease, but it pushes nothing. a's push is held, then released.
        held = threading.Thread(target=a.push, args=(grad,))
        held.start()
        wait_until(lambda: a.status(0).waiting_calls == 1, 10, "a's push to be held for the release")
        held.join(PROGRESS_SECONDS * 10)
        assert not held.is_alive(), "a was held for ever behind a worker that heartbeats but never pushes"
        status = a.status(0)
        assert (status.workers_stalled, status.live_workers, status.workers_expired) == (1, 1, 0), status
        assert a.step == 2 and status.step == 2
        assert "worker:1 pushed nothing for" in local.log(0), "the stalled worker is named in the shard's log"

        # b comes back: its push for step 1 is stale (step 1 was applied without it); it counts again from step 2.
        assert b.push(grad) == 2 and b.stats.stale_dropped == 1
        assert a.status(0).quorum == 2, "b counts towards the quorum again"
        pushes = [threading.Thread(target=client.push, args=(grad,)) for client in (a, b)]
        for thread in pushes:
            thread.start()
        for thread in pushes:
            thread.join(20)
        assert a.step == b.step == 3
        assert torch.equal(a.pull(["pl/w"])["pl/w"], -3 * torch.ones(3)), "three steps, each the average of ones"
