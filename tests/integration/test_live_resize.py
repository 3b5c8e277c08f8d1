"""Live resize: the job goes 2 -> 4 -> 3 -> 2 shards while 8 processes push; no push is lost or applied twice."""

import multiprocessing

import pytest
import torch

from torchps.client import Optimizer, PSClient
from torchps.errors import ClusterConfigError, ModeConflictError
from torchps.worker.local_cluster import LocalCluster

PROCESSES = multiprocessing.get_context("forkserver")
PROCESSES.set_forkserver_preload(["torch", "torchps.client"])
SHAPES = {f"resize/v{i}": (4096,) for i in range(16)}  # 64k floats in 16 variables: they spread over the shards
PUSHERS = 8


def _push_ones(cluster, index, stop, counts, errors, followed):
    """Child process: pushes ones to every variable until `stop`; counts each acknowledged push, and reports
    the layout it ended at and what the resizes cost it (PSClient.layout_waits)."""
    try:
        with PSClient(cluster, connect_timeout=60, partitioner=None) as ps:
            ps.declare({name: torch.zeros(shape) for name, shape in SHAPES.items()})
            ps.wait_for_variables(SHAPES, timeout=60)
            grads = {name: torch.ones(shape) for name, shape in SHAPES.items()}
            while not stop.is_set():
                ps.push(grads)
                counts[index] += 1
            followed.put((ps.layout_epoch, *ps.layout_waits))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        errors.put(f"pusher {index}: {type(exc).__name__}: {exc}")


def _pushes_go_on(counts, at_least: int, errors) -> None:
    """Returns once every pusher acknowledged `at_least` more pushes than now (each resize is under load)."""
    target = [c + at_least for c in counts[:]]
    import time
    deadline = time.monotonic() + 120
    while any(c < t for c, t in zip(counts[:], target)):
        assert errors.empty(), errors.get()
        assert time.monotonic() < deadline, f"pushes stalled at {counts[:]}"
        time.sleep(0.01)


def test_exact_sum_across_live_resizes():
    with LocalCluster(2) as local, PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief:
        chief.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
        stop, counts, errors, followed = (PROCESSES.Event(), PROCESSES.Array("q", PUSHERS), PROCESSES.Queue(),
                                          PROCESSES.Queue())
        pushers = [PROCESSES.Process(target=_push_ones, args=(local.cluster, i, stop, counts, errors, followed))
                   for i in range(PUSHERS)]
        for pusher in pushers:
            pusher.start()
        try:
            _pushes_go_on(counts, 3, errors)
            grown = chief.resize([*local.cluster.ps, local.add_ps(), local.add_ps()])
            assert (grown.shards_before, grown.shards_after, grown.epoch) == (2, 4, 1) and grown.moved == 8
            _pushes_go_on(counts, 3, errors)
            shrunk = chief.resize([local.address(i) for i in range(3)])
            assert (shrunk.shards_after, shrunk.epoch, shrunk.stopped) == (3, 2, [local.address(3)])
            assert local.procs[3].wait(timeout=30) == 0  # stopped by the resize, after its drain
            _pushes_go_on(counts, 3, errors)
            back = chief.resize(list(local.cluster.ps))
            assert (back.shards_after, back.epoch) == (2, 3) and local.procs[2].wait(timeout=30) == 0
            _pushes_go_on(counts, 3, errors)
        finally:
            stop.set()
            for pusher in pushers:
                pusher.join(timeout=120)
        assert errors.empty(), errors.get()
        assert [p.exitcode for p in pushers] == [0] * PUSHERS
        ends = [followed.get(timeout=10) for _ in range(PUSHERS)]
        assert [epoch for epoch, _, _ in ends] == [3] * PUSHERS
        # Pushes were under way while variables moved: some were refused by a shard their variables had left
        # (sent again to the new owner), or waited for a variable in transit.
        assert sum(refused + waits for _, refused, waits in ends) > 0, ends
        print("pushers (epoch, refused, moving waits):", ends, "pushes:", sum(counts[:]))
        total = sum(counts[:])
        with PSClient(local.cluster, connect_timeout=30, partitioner=None) as reader:  # starts at epoch 0
            reader.declare({n: torch.zeros(s) for n, s in SHAPES.items()})
            values = reader.pull(SHAPES)
            assert reader.layout_epoch == 3
        for name, value in values.items():
            assert torch.equal(value, torch.full(SHAPES[name], -float(total))), (name, value[:3], total)
        held = {info.spec.name: info.version for info in chief.list_variables()}
        assert held == {name: total for name in SHAPES}  # each variable once, on one shard, every push counted


def test_resize_refusals_change_nothing(local_cluster):
    """A sync job, a reordered shard list and a stale epoch are refused; the layout stays at epoch 0."""
    local = local_cluster(2)
    with PSClient(local.cluster, connect_timeout=30) as chief:
        chief.create_variables({"refuse/w": torch.zeros(8)}, Optimizer("sgd", lr=1.0))
        with pytest.raises(ClusterConfigError, match="keeps the shards' order"):
            chief.resize([local.address(1), local.address(0)])
        with pytest.raises(ClusterConfigError, match="nothing to do"):
            chief.resize(list(local.cluster.ps))
        chief.configure("sync", replicas_to_aggregate=1, total_num_replicas=1)
        with pytest.raises(ModeConflictError, match="sync job"):
            chief.resize([local.address(0)])
        assert [chief.status(s).layout_epoch for s in range(2)] == [0, 0]
        assert {i.spec.name for i in chief.list_variables()} == {"refuse/w"}
