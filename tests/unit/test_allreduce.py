"""The all-reduce group's pieces without shards: the rendezvous as a function of the cluster, a group that
does not form (named, bounded, silent on stderr), bucketing on a one-member gloo group, the local optimizer,
register_module's refusals, and ps-worker's --dense flags.

A one-member group is a real torch.distributed gloo group in this process (its default process group while
open; each test closes it). The two-member behaviour (equivalence, a member lost) is in
tests/integration/test_hybrid_allreduce*.py.
"""

from __future__ import annotations

import contextlib
import pathlib
import socket
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist

from helpers import free_port
from torchps.client import (AllreduceError, AllreduceGroup, Cluster, ClusterConfigError, Optimizer,
                            OptimizerSpecError, PSClient, Rendezvous, TaskSpec, local_optimizer)
from torchps.worker import launch
from torchps.worker.__main__ import _lockstep_steps, finish_training_flags, parse_args, resolve_task


SPEC = {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"], "ps": ["h3:2222"], "evaluator": ["h5:2222"]}


def test_rendezvous_ranks_follow_the_cluster_and_meet_at_the_chief():
    cluster = Cluster.from_dict(SPEC)
    chief = Rendezvous.from_cluster(cluster, TaskSpec("chief", 0))
    last = Rendezvous.from_cluster(cluster, TaskSpec("worker", 1))
    assert chief.members == last.members == (TaskSpec("chief", 0), TaskSpec("worker", 0), TaskSpec("worker", 1))
    assert (chief.rank, last.rank, last.world_size) == (0, 2, 3)
    assert (last.host, last.port) == ("h0", 2222)  # the chief's cluster entry
    assert Rendezvous.from_cluster(cluster, TaskSpec("worker", 0), port=29500).port == 29500
    no_chief = Cluster.from_dict({"worker": ["w0:7000", "w1:7001"], "ps": ["p:1"]})
    assert (Rendezvous.from_cluster(no_chief, TaskSpec("worker", 1)).host,
            Rendezvous.from_cluster(no_chief, TaskSpec("worker", 1)).port) == ("w0", 7000)  # worker 0 is chief


@pytest.mark.parametrize("task, port, message", [
    (TaskSpec("evaluator", 0), None, "trains nothing"),
    (TaskSpec("ps", 0), None, "trains nothing"),
    (TaskSpec("worker", 5), None, "not in the cluster"),
    (TaskSpec("worker", 0), 0, "1-65535"),
    (TaskSpec("worker", 0), 70000, "1-65535"),
    (TaskSpec("worker", 0), True, "1-65535"),
])
def test_rendezvous_refuses_what_cannot_meet(task, port, message):
    with pytest.raises(ClusterConfigError, match=message):
        Rendezvous.from_cluster(Cluster.from_dict(SPEC), task, port)


def test_a_chief_entry_with_port_0_needs_a_port():
    cluster = Cluster.from_dict({"worker": ["127.0.0.1:0"], "ps": ["127.0.0.1:1"]})
    with pytest.raises(ClusterConfigError, match="--allreduce-port"):
        Rendezvous.from_cluster(cluster, TaskSpec("worker", 0))


def _two_workers() -> Cluster:
    return Cluster.from_dict({"worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"],
                              "ps": ["127.0.0.1:1"]})


@pytest.mark.parametrize("index, message", [(0, "did not form within 1 s: worker:1 never arrived"),
                                            (1, "worker:0 never listened for the all-reduce group")])
def test_a_group_that_does_not_form_names_who_is_missing_within_its_timeout(capfd, index, message):
    started = time.monotonic()
    with pytest.raises(AllreduceError, match=message):
        AllreduceGroup.connect(_two_workers(), TaskSpec("worker", index), timeout=1.0)
    assert time.monotonic() - started < 5.0
    assert not dist.is_initialized()
    assert capfd.readouterr().err == ""  # torch's C++ store retries and waits print to stderr: never reached


def test_a_taken_port_is_named():
    cluster = _two_workers()
    port = int(cluster.worker[0].rpartition(":")[2])
    with socket.create_server(("127.0.0.1", port)):
        with pytest.raises(AllreduceError, match=f"worker:0 cannot listen for the all-reduce group at "
                                                 f"127.0.0.1:{port}"):
            AllreduceGroup.connect(cluster, TaskSpec("worker", 0), timeout=2.0)
    assert not dist.is_initialized()


@contextlib.contextmanager
def one_member_group(**kwargs):
    cluster = Cluster.from_dict({"worker": [f"127.0.0.1:{free_port()}"], "ps": ["127.0.0.1:1"]})
    group = AllreduceGroup.connect(cluster, TaskSpec("worker", 0), timeout=20.0, **kwargs)
    try:
        yield group
    finally:
        group.close()
    assert not dist.is_initialized()


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(3))
        self.b = torch.nn.Parameter(torch.randn(2, 2))
        self.c = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.no_grad_yet = torch.nn.Parameter(torch.randn(2))
        self.frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)


def _with_grads(module: Mixed) -> dict[str, torch.Tensor]:
    for name in ("a", "b", "c"):
        getattr(module, name).grad = torch.randn_like(getattr(module, name))
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("bucket_bytes, calls", [(1 << 20, 2), (16, 4)], ids=["one-per-dtype", "small-buckets"])
def test_gradients_travel_in_buckets_per_dtype_and_none_stays_none(bucket_bytes, calls):
    module = Mixed()
    trainable = [p for p in module.parameters() if p.requires_grad]
    with one_member_group(bucket_bytes=bucket_bytes) as group:
        assert group.world_size == 1 and group.backend == "gloo"
        for _ in range(2):
            before = _with_grads(module)
            issued = group.calls
            group.average_gradients_(trainable)
            # float32 (a, b, no_grad_yet) and float64 (c) never share a buffer; 16 bytes hold one of a (12 bytes),
            # b (16) or no_grad_yet (8) at a time.
            assert group.calls - issued == calls
            for name, grad in before.items():
                assert torch.equal(getattr(module, name).grad, grad), name  # the mean over one member
            assert module.no_grad_yet.grad is None and module.frozen.grad is None


def test_broadcast_keeps_rank_0s_values_and_a_sparse_gradient_is_refused():
    module = Mixed()
    values = [t.detach().clone() for t in module.parameters()]
    with one_member_group() as group:
        group.broadcast_(module.parameters())
        assert all(torch.equal(a, b) for a, b in zip(values, module.parameters()))
        module.a.grad = torch.zeros(3).to_sparse()
        with pytest.raises(TypeError, match="sparse"):
            group.average_gradients_([module.a])
    with pytest.raises(AllreduceError, match="closed"):
        group.broadcast_(module.parameters())


def test_local_optimizer_is_torch_optims_and_refuses_the_rest():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert type(local_optimizer(Optimizer("adamw", lr=0.01, betas=(0.8, 0.9)), params)) is torch.optim.AdamW
    assert local_optimizer(Optimizer("SGD", lr=0.1, momentum=0.9), params).defaults["momentum"] == 0.9
    with pytest.raises(OptimizerSpecError, match="no local version"):
        local_optimizer(Optimizer("none"), params)
    with pytest.raises(OptimizerSpecError, match="sgd"):
        local_optimizer(Optimizer("sgd", lr=-1.0), params)


@pytest.mark.parametrize("kwargs, message", [
    ({"dense": "allreduce"}, "process_group=AllreduceGroup"),
    ({"dense": "bogus"}, "'ps' or 'allreduce'"),
    ({"dense": "allreduce", "overlap": True}, "no overlap, compression or delta pulls"),
    ({"dense": "allreduce", "delta_pulls": True}, "no overlap, compression or delta pulls"),
    ({"overlap": True, "delta_pulls": True}, "delta_pulls=True with overlap=True"),
])
def test_register_module_refuses_before_any_call(kwargs, message):
    cluster = Cluster.from_dict({"worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:1"]})  # nothing listens: no call made
    with PSClient(cluster, task=TaskSpec("worker", 0), connect_timeout=1.0) as client:
        with pytest.raises(ClusterConfigError, match=message):
            client.register_module(torch.nn.Linear(2, 2), Optimizer("sgd", lr=0.1), **kwargs)


def _flags(*extra: str):
    return parse_args(["--entry", "pkg.mod:task", *extra])


@pytest.mark.parametrize("extra, message", [
    (["--allreduce-port", "5000"], "--allreduce-port is for --dense allreduce"),
    (["--dense", "allreduce", "--allreduce-port", "0"], "--allreduce-port must be in 1-65535"),
    (["--dense", "allreduce", "--allreduce-timeout", "0"], "--allreduce-timeout must be > 0"),
    (["--dense", "allreduce", "--mode", "ssp"], "cannot be combined with --mode ssp"),
    (["--dense", "allreduce", "--checkpoint-every-steps", "10"], "cannot be combined with --checkpoint-every"),
    (["--dense", "allreduce", "--compression", "bf16", "--state-dir", "/tmp"], "cannot be combined with --compression"),
    (["--dense", "allreduce", "--overlap"], "cannot be combined with --overlap"),
    (["--dense", "allreduce", "--mode", "sync"], "cannot be combined with --mode sync"),
    (["--dense", "allreduce", "--delta-pulls"], "cannot be combined with --delta-pulls"),
    (["--delta-pulls", "--overlap"], "--delta-pulls cannot be combined with --overlap"),
])
def test_ps_worker_refuses_dense_flags_that_cannot_work(extra, message):
    with pytest.raises(ClusterConfigError, match=message):
        finish_training_flags(_flags(*extra))


def test_ps_worker_refuses_an_allreduce_evaluator():
    args = finish_training_flags(_flags("--dense", "allreduce", "--task-type", "evaluator",
                                        "--cluster", '{"worker": ["h:1"], "ps": ["h:2"], "evaluator": ["h:3"]}'))
    with pytest.raises(ClusterConfigError, match="an evaluator cannot see the dense parameters"):
        resolve_task(args)


@pytest.mark.parametrize("extra, examples, replicas, steps", [
    (["--epochs", "2", "--batch-size", "10"], 95, 2, 10),   # shards of 48 and 47: 5 batches each, 2 epochs
    (["--epochs", "1", "--batch-size", "16"], 50, 3, 1),    # shards of 17, 17, 16: 2, 2 and 1 batches
    (["--steps", "7", "--batch-size", "10"], 95, 2, 7),
    (["--steps", "70", "--epochs", "1", "--batch-size", "10"], 95, 2, 5),
])
def test_every_allreduce_worker_takes_the_same_number_of_steps(extra, examples, replicas, steps):
    assert _lockstep_steps(finish_training_flags(_flags("--dense", "allreduce", *extra)), examples, replicas) == steps


@pytest.mark.parametrize("flags, refused", [
    (["--restart-on-failure"], "--restart-on-failure: a restarted worker cannot rejoin"),
    (["--evaluator"], "--evaluator: an evaluator cannot see the dense parameters"),
    (["--checkpoint-dir", "/tmp"], "--checkpoint-dir: the shards' checkpoints would not hold"),
    (["--restore-from", "/tmp"], "--restore-from: the shards' checkpoints hold no dense parameters"),
])
def test_ps_launch_refuses_what_an_allreduce_job_cannot_do_in_one_line(capsys, flags, refused):
    with pytest.raises(SystemExit) as exit_:
        launch.parse_args(["--dense", "allreduce", "--entry", "pkg.mod:task", *flags])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"--dense allreduce cannot be combined with {refused}" in lines[0], lines


def test_ps_launch_gives_the_chief_a_free_port_for_the_group_unless_told_one(monkeypatch):
    monkeypatch.chdir(pathlib.Path(__file__).parents[2])  # ps-launch finds --entry where its workers will
    entry = "examples.custom_entry:task"
    args, passed = launch.parse_args(["--dense", "allreduce", "--entry", entry])
    assert args.rendezvous_port and passed == ["--dense", "allreduce", "--entry", entry]
    assert not launch.parse_args(["--dense", "allreduce", "--allreduce-port", "29500", "--entry", entry])[0] \
        .rendezvous_port
    assert not launch.parse_args(["--entry", entry])[0].rendezvous_port


def test_a_probe_that_meets_a_reset_asks_again_and_names_a_process_that_is_gone():
    """A member being SIGKILLed resets the connection its listening socket had accepted, then refuses: the
    probe must say its process is gone, not that it could not be reached."""
    from torchps.client.allreduce import _probe

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    accepted = []

    def reset_then_close() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        listener.close()  # nothing listens any more: the next connect is refused
        conn.close()
        accepted.append(True)

    thread = threading.Thread(target=reset_then_close)
    thread.start()
    alive, found = _probe(address, 2.0)
    thread.join(5)
    assert accepted and not alive
    assert found == f"its process is gone: nothing listens at {address} any more", found
