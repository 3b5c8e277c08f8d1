"""Asynchronous training: concurrent pushes from several processes lose nothing, pulls are atomic."""

import torch
from helpers import forkserver_context

from torchps.client import Optimizer, PSClient

# Fresh processes forked from multiprocessing's fork server (torch imported once there), never from this
# gRPC-threaded process; each has its own PSClient, as separate worker processes do.
PROCESSES = forkserver_context()
SHAPES = {"async/a": (64, 33), "async/b": (1000,)}  # round robin: a on ps:0, b on ps:1


def _push_ones(cluster, start, pushes):
    """Child process: its own PSClient; waits for every sibling, then pushes `pushes` gradients of ones."""
    with PSClient(cluster, connect_timeout=60) as ps:
        ps.declare({name: torch.zeros(shape) for name, shape in SHAPES.items()})
        ps.wait_for_variables(SHAPES, timeout=60)
        grads = {name: torch.ones(shape) for name, shape in SHAPES.items()}
        start.wait(timeout=60)
        for _ in range(pushes):
            ps.push(grads)


def test_no_lost_updates_from_concurrent_processes(shared_cluster):
    """4 processes x 50 pushes of ones with SGD lr=1: exactly -200 everywhere, global step +200."""
    processes, pushes = 4, 50
    local = shared_cluster
    with PSClient(local.cluster, connect_timeout=30) as ps:
        step_before = ps.global_step()
        created = ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
        assert created == {"async/a": True, "async/b": True}
        assert [ps.placement.shard_of(n) for n in SHAPES] == [0, 1]
        start = PROCESSES.Barrier(processes)
        children = [PROCESSES.Process(target=_push_ones, args=(local.cluster, start, pushes)) for _ in range(processes)]
        for child in children:
            child.start()
        for child in children:
            child.join(timeout=240)
        codes = [child.exitcode for child in children]
        for child in children:
            if child.is_alive():
                child.kill()
        assert codes == [0] * processes, f"pusher exit codes {codes}; see the captured stderr"
        values = ps.pull(SHAPES)
        for name, shape in SHAPES.items():
            assert torch.equal(values[name], torch.full(shape, -float(processes * pushes))), name
        assert ps.global_step() == step_before + processes * pushes
        versions = {info.spec.name: info.version for info in ps.list_variables() if info.spec.name in SHAPES}
        assert versions == {name: processes * pushes for name in SHAPES}


BIG = "atomic/big"
BIG_ELEMENTS = 4 << 20  # 16 MiB of float32: 16 chunks of 1 MiB


def _push_until_stopped(cluster, first_done, stop, count):
    """Child process: pushes gradients of ones to BIG until `stop` is set; counts them."""
    with PSClient(cluster, connect_timeout=60, partitioner=None) as ps:  # one variable, one shard: one lock
        ps.declare([(BIG, BIG_ELEMENTS * 4)])
        grad = torch.ones(BIG_ELEMENTS)
        while True:
            ps.push({BIG: grad})
            count.value += 1
            first_done.set()
            if stop.is_set():
                return


def test_pull_never_sees_half_an_update(shared_cluster):
    """Pulls racing with pushes of a 16 MiB variable always see every element at the same version."""
    local = shared_cluster
    with PSClient(local.cluster, connect_timeout=30, partitioner=None) as ps:
        ps.create_variables({BIG: torch.zeros(BIG_ELEMENTS)}, Optimizer("sgd", lr=1.0))
        first_done, stop, count = PROCESSES.Event(), PROCESSES.Event(), PROCESSES.Value("q", 0)
        child = PROCESSES.Process(target=_push_until_stopped, args=(local.cluster, first_done, stop, count))
        child.start()
        try:
            while not first_done.wait(timeout=0.5):
                assert child.is_alive(), f"the pusher died (exit code {child.exitcode}); see the captured stderr"
            seen = []
            for _ in range(20):
                value = ps.pull([BIG])[BIG]
                lo, hi = value.min().item(), value.max().item()
                seen.append((lo, hi))
                assert lo == hi, f"pull {len(seen)} saw a torn tensor: elements from {lo} to {hi}"
        finally:
            stop.set()
            child.join(timeout=120)
            if child.is_alive():
                child.kill()
        assert child.exitcode == 0
        assert all(lo <= -1 and lo == int(lo) for lo, _ in seen), seen  # every pull came after the first push
        final = ps.pull([BIG])[BIG]
        assert torch.equal(final, torch.full((BIG_ELEMENTS,), -float(count.value)))
