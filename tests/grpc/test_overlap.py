"""register_module(..., overlap=True) against real shards: gradients streamed during backward, values pulled
during forward, and exactly the training a binding without overlap does.

Ordered by events, never by sleeps: a custom autograd Function in the middle of a model runs code while
backward is under way (it waits for the shard to have taken in bytes, or kills a shard), and a shard that
must hold a pull back is SIGSTOPped (always SIGCONTed in a finally).
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from torchps import codec
from torchps.client import (Compression, MinSizePartitioner, Optimizer, PSClient, PSError, ServerUnavailableError,
                            TaskSpec)
from torchps.client import overlap as overlap_module
from torchps.proto import ps_pb2

from helpers import stopped, wait_until
from resize_training import train_through_live_resizes

TIMEOUT = 30.0
MIN = codec.MIN_CHUNK_BYTES


@pytest.fixture
def streamed_pushes(monkeypatch) -> list[int]:
    """Counts the pushes that went streamed (StreamedPush.finish), to tell them from whole pushes."""
    finished: list[int] = []
    finish = overlap_module.StreamedPush.finish

    def counting(self):
        finished.append(self.header.seq)
        return finish(self)

    monkeypatch.setattr(overlap_module.StreamedPush, "finish", counting)
    return finished


def mlp(seed: int, width: int = 96) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                               torch.nn.Tanh(), torch.nn.Linear(width, 5))


def backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, clip: bool = False,
             twice: bool = False) -> None:
    model.zero_grad()
    for _ in range(2 if twice else 1):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)


@pytest.mark.parametrize("num_ps, partitioned, compression", [
    pytest.param(1, False, None, id="1ps"),
    pytest.param(2, True, None, id="2ps-partitioned"),
    pytest.param(2, True, Compression("bf16", min_bytes=0), id="2ps-partitioned-bf16"),
    pytest.param(2, False, Compression("topk", ratio=0.1, min_bytes=0), id="2ps-topk-error-feedback"),
])
def test_overlap_trains_exactly_as_a_binding_without_it(local_cluster, streamed_pushes, num_ps, partitioned,
                                                        compression):
    """Async, one worker: the same start and data give bit-identical parameters with and without overlap, over
    push + pull and exchange steps, a partitioned layer (pieces on both shards) and compression."""
    local = local_cluster(num_ps)
    partitioner = MinSizePartitioner(min_shard_bytes=1024) if partitioned else None
    plain, overlapped = mlp(0), mlp(0)
    x, y = torch.randn(8, 20, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 5
    opt = Optimizer("adam", lr=0.01)
    with PSClient(local.cluster, partitioner=partitioner, chunk_bytes=MIN, timeout=TIMEOUT,
                  connect_timeout=10) as ps:
        ref = ps.register_module(plain, opt, prefix="plain/", create=True, compression=compression)
        binding = ps.register_module(overlapped, opt, prefix="overlap/", create=True, compression=compression,
                                     overlap=True)
        assert binding.overlap and not ref.overlap
        if partitioned:
            assert {ps.placement.shard_of(n) for n in ps.partitions.wire_names(["overlap/2.weight"])} == {0, 1}
        for step in range(4):
            for model, bound in ((plain, ref), (overlapped, binding)):
                backward(model, x, y)
                if step % 2:
                    bound.exchange()
                else:
                    bound.push()
                    bound.pull()
        binding.wait()
        for (name, got), want in zip(overlapped.named_parameters(), plain.parameters()):
            assert torch.equal(got, want), f"{name} differs by {(got - want).abs().max():.3g}"
        assert len(streamed_pushes) == 4, "every step of the overlapped binding went streamed"
        if compression is not None and compression.kind == "topk":
            residuals = ps.compression_state_dict()
            for name in ps.partitions.wire_names([n for n, _ in plain.named_parameters()]):
                torch.testing.assert_close(residuals[f"overlap/{name}"], residuals[f"plain/{name}"], rtol=0, atol=0)


def test_steps_overlap_cannot_stream_are_pushed_whole_with_the_same_result(local_cluster, streamed_pushes):
    """Gradients clipped after backward, accumulated over two backwards, or a step without backward: push()
    sends them whole, and training still equals the binding without overlap."""
    local = local_cluster(2)
    plain, overlapped = mlp(0), mlp(0)
    x, y = torch.randn(8, 20, generator=torch.Generator().manual_seed(2)), torch.arange(8) % 5
    opt = Optimizer("sgd", lr=0.1, momentum=0.9)
    with PSClient(local.cluster, chunk_bytes=MIN, timeout=TIMEOUT, connect_timeout=10) as ps:
        ref = ps.register_module(plain, opt, prefix="plain/", create=True)
        binding = ps.register_module(overlapped, opt, prefix="overlap/", create=True, overlap=True)
        for kind in ("clip", "twice", "plain", "no-backward", "plain"):
            for model, bound in ((plain, ref), (overlapped, binding)):
                if kind != "no-backward":
                    backward(model, x, y, clip=kind == "clip", twice=kind == "twice")
                bound.push()
                bound.pull()
        binding.wait()
        for (name, got), want in zip(overlapped.named_parameters(), plain.parameters()):
            assert torch.equal(got, want), f"{name} differs by {(got - want).abs().max():.3g}"
        assert len(streamed_pushes) == 2, "only the two plain steps went streamed"


def test_two_overlapped_modules_in_one_backward_push_in_either_order(local_cluster, streamed_pushes):
    """One loss through two overlapped modules: the later one streams (its hooks fire first), the other goes
    whole; pushing the other first makes the open stream give way instead of waiting for it (no deadlock).
    Training equals the same modules without overlap."""
    local = local_cluster(1)
    x, y = torch.randn(8, 20, generator=torch.Generator().manual_seed(3)), torch.arange(8) % 5
    modules = {}
    for kind in ("plain", "overlap"):
        torch.manual_seed(0)
        modules[kind] = (torch.nn.Linear(20, 16), torch.nn.Linear(16, 5))
    with PSClient(local.cluster, timeout=TIMEOUT, connect_timeout=10) as ps:
        bound = {kind: [ps.register_module(m, Optimizer("sgd", lr=0.1), prefix=f"{kind}/{i}/", create=True,
                                           overlap=kind == "overlap") for i, m in enumerate(pair)]
                 for kind, pair in modules.items()}
        for step in range(4):
            for kind, (first, second) in modules.items():
                first.zero_grad(), second.zero_grad()
                torch.nn.functional.cross_entropy(second(torch.tanh(first(x))), y).backward()
                for binding in (bound[kind] if step % 2 else bound[kind][::-1]):  # odd steps: the first module first
                    binding.push()
                for binding in bound[kind]:
                    binding.pull()
                    binding.wait()
        for (a, b) in zip(modules["plain"], modules["overlap"]):
            for want, got in zip(a.parameters(), b.parameters()):
                assert torch.equal(got, want)
        assert len(streamed_pushes) == 2, "the last module streamed when pushed first; it gave way otherwise"


class Gate(torch.autograd.Function):
    """Identity; its backward runs `action()` (between the layers after it and the layers before it)."""

    @staticmethod
    def forward(ctx, x, action):
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.action()
        return grad, None


class Gated(torch.nn.Module):
    """first -> Gate -> tanh -> last: the gate's backward runs after `last`'s gradients, before `first`'s."""

    def __init__(self, first: torch.nn.Module, last: torch.nn.Module):
        super().__init__()
        self.first, self.last = first, last
        self.action = lambda: None

    def forward(self, x):
        return self.last(torch.tanh(Gate.apply(self.first(x), self.action)))


def test_the_push_streams_while_backward_still_runs(local_cluster, streamed_pushes):
    """The last layer's gradient (4 chunks) reaches the shard before the first layer's gradient even exists."""
    local = local_cluster(1)
    torch.manual_seed(0)
    model = Gated(torch.nn.Linear(16, 256), torch.nn.Linear(256, 256, bias=False))  # last.weight: 256 KiB
    last_bytes = 256 * 256 * 4
    with PSClient(local.cluster, chunk_bytes=MIN, timeout=TIMEOUT, connect_timeout=10) as ps:
        binding = ps.register_module(model, Optimizer("sgd", lr=0.1), create=True, overlap=True)
        before = ps.status(0).push_bytes_received
        seen: dict[str, object] = {}

        def gate() -> None:  # backward is here: last.weight's gradient is done, first's is not computed yet
            seen["first grad"] = model.first.weight.grad
            wait_until(lambda: ps.status(0).push_bytes_received >= before + last_bytes, TIMEOUT,
                       "the shard to take in the last layer's gradient while backward runs")
            seen["received"] = ps.status(0).push_bytes_received - before

        model.action = gate
        model(torch.randn(4, 16)).square().sum().backward()
        assert seen["first grad"] is None and seen["received"] >= last_bytes
        step = binding.push()
        assert step == 1 and streamed_pushes == [1]
        assert ps.status(0).push_bytes_received - before == last_bytes + (16 * 256 + 256) * 4


def test_each_layers_forward_waits_only_for_its_own_parameters(local_cluster):
    """Layer 0 (on ps 0) runs its forward while layer 1's values (on ps 1, stopped) are still pending; layer 1
    waits for them, then the forward ends with exactly the shards' values."""
    local = local_cluster(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    with PSClient(local.cluster, timeout=TIMEOUT, connect_timeout=10, partitioner=None) as ps:
        binding = ps.register_module(model, Optimizer("sgd", lr=0.5), create=True, overlap=True)
        assert [ps.placement.shard_of(n) for n in binding.names] == [0, 1]
        model(torch.randn(2, 8)).sum().backward()
        binding.push()  # the values on the shards move on; the local ones are now stale
        started = {0: threading.Event(), 1: threading.Event()}
        arrived_at_start = {}

        def recorder(index):
            def hook(module, args):  # registered after the binding's own pre-hook: runs once it let the layer go
                arrived_at_start[index] = [binding._overlap.pull.done([n]) for n in binding.names]
                started[index].set()
            return hook

        for index in (0, 1):
            model[index].register_forward_pre_hook(recorder(index))
        x = torch.randn(2, 8)
        out: list = []
        with stopped(local.procs[1]):
            assert binding.pull() == 1  # returns at once, ps 1 answering nothing
            forward = threading.Thread(target=lambda: out.append(model(x)), daemon=True)
            forward.start()
            assert started[0].wait(TIMEOUT), "layer 0's forward did not start while ps 1 was stopped"
            assert arrived_at_start[0] == [True, False], "layer 0 ran with its own values, layer 1's pending"
            assert not started[1].is_set(), "layer 1's forward must wait for its values"
            assert forward.is_alive()
        forward.join(TIMEOUT)
        assert not forward.is_alive() and arrived_at_start[1] == [True, True]
        values = ps.pull(binding.names)
        for name, param in binding.params.items():
            assert torch.equal(param.detach(), values[name]), name
        assert torch.equal(out[0], model(x))


def test_a_pull_that_fails_raises_from_the_forward_that_waits_and_from_wait(local_cluster):
    """ps 1 killed before the pull: layer 1's forward raises the pull's error (no hang), so does wait()."""
    local = local_cluster(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    with PSClient(local.cluster, timeout=TIMEOUT, connect_timeout=1, partitioner=None) as ps:
        binding = ps.register_module(model, Optimizer("sgd", lr=0.5), create=True, overlap=True)
        local.kill_ps(1)
        binding.pull()
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError):
            model(torch.randn(2, 8))
        with pytest.raises(ServerUnavailableError):
            binding.wait()
        assert time.monotonic() - started < TIMEOUT


def test_a_shard_killed_mid_stream_fails_the_push_and_the_other_shard_applies_its_part_whole(local_cluster):
    """ps 1 is SIGKILLed while backward streams: push() raises a PSError within the retry window (no hang);
    ps 0, which replied, applied every one of its gradients once."""
    local = local_cluster(2)
    torch.manual_seed(0)
    first = torch.nn.Linear(16, 64)
    last = torch.nn.Linear(64, 64)
    model = Gated(first, last)
    with PSClient(local.cluster, chunk_bytes=MIN, timeout=TIMEOUT, connect_timeout=1, partitioner=None) as ps, \
            PSClient(local.cluster, timeout=TIMEOUT, connect_timeout=10, partitioner=None) as observer:
        binding = ps.register_module(model, Optimizer("sgd", lr=1.0), create=True, overlap=True)
        observer.declare(ps.pull(binding.names))
        initial = observer.pull(binding.names)
        on_ps0 = [n for n in binding.names if ps.placement.shard_of(n) == 0]
        assert on_ps0 and len(on_ps0) < len(binding.names)

        def kill() -> None:
            assert local.kill_ps(1) == -signal.SIGKILL

        model.action = kill
        model(torch.randn(4, 16)).square().sum().backward()
        grads = {name: p.grad.clone() for name, p in binding.params.items()}
        started = time.monotonic()
        with pytest.raises(PSError):
            binding.push()
        assert time.monotonic() - started < TIMEOUT
        after = observer.pull(on_ps0)
        for name in on_ps0:
            assert torch.equal(after[name], initial[name] - grads[name]), f"{name}: applied whole, once"
        versions = {info.spec.name: info.version for info in observer._fanout.channels.call(
            0, lambda stub, t: stub.ListVariables(ps_pb2.ListRequest(), timeout=t), 10).variables}
        assert all(versions[name] == 1 for name in on_ps0), versions


def test_a_shard_restarted_empty_mid_stream_is_refilled_and_gets_the_stream_replayed(local_cluster):
    """ps 1 restarts without its state while backward streams: the stream is retried (replayed from its
    header), the shard is refilled from this client's copy, then the whole stream goes again with the same
    number. Both shards end up applying the push once."""
    local = local_cluster(2)
    torch.manual_seed(0)
    model = Gated(torch.nn.Linear(16, 64), torch.nn.Linear(64, 64))
    with PSClient(local.cluster, chunk_bytes=MIN, timeout=TIMEOUT, connect_timeout=10, partitioner=None) as ps:
        binding = ps.register_module(model, Optimizer("sgd", lr=1.0), create=True, overlap=True)
        initial = {name: p.detach().clone() for name, p in binding.params.items()}
        on_ps1 = [n for n in binding.names if ps.placement.shard_of(n) == 1]

        def restart() -> None:
            local.kill_ps(1)
            local.start_ps(1)

        model.action = restart
        model(torch.randn(4, 16)).square().sum().backward()
        grads = {name: p.grad.clone() for name, p in binding.params.items()}
        assert binding.push() == 1
        assert ps._refill.refills == 1 and ps.restarts_seen == 1
        values = ps.pull(binding.names)
        for name in binding.names:
            assert torch.equal(values[name], initial[name] - grads[name]), f"{name}: applied once"
        assert ps.status(1).step == ps.status(0).step == 1 and on_ps1


def test_a_worker_joined_in_sync_mode_pushes_streamed_and_waits_for_its_release(local_cluster, streamed_pushes):
    """Sync, one worker: every streamed push is one step, and the pull waits for it (min_step)."""
    local = local_cluster(2, workers=1)
    model = mlp(0)
    with PSClient(local.cluster, task=TaskSpec("worker", 0), timeout=TIMEOUT, connect_timeout=10) as ps:
        ps.configure("sync", total_num_replicas=1)
        binding = ps.register_module(model, Optimizer("sgd", lr=0.1), overlap=True)
        x, y = torch.randn(8, 20), torch.arange(8) % 5
        for step in range(3):
            backward(model, x, y)
            assert binding.exchange() == step + 1
        binding.wait()
        assert ps.status(0).step == ps.status(1).step == 3
        assert len(streamed_pushes) == 3
        values = ps.pull(binding.names)
        assert all(torch.equal(p.detach(), values[n]) for n, p in binding.params.items())


def test_an_overlapped_module_trains_through_live_resizes(local_cluster):
    """Streamed pushes and layer-by-layer pulls follow a live resize (2 -> 3 -> 2 shards) mid-training: a part
    refused by a shard its variables left, or placed on a shard added after the push opened, is sent again to its
    owner, and the module ends where one trained without overlap or resizes ends (resize_training.py)."""
    train_through_live_resizes(local_cluster(2, workers=1), "cpu")
