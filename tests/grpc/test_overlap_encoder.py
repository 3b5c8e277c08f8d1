"""Overlap's encoder thread (what CUDA gradients use, client/streamed_push.py): gradients queued by the hooks and
encoded in order by a thread of their own give exactly the training of a binding without overlap. On a host
without CUDA the hooks encode CPU gradients themselves, so the test gives the binding the thread a CUDA
gradient would have made."""

from concurrent import futures

import torch

from torchps import codec
from torchps.client import Compression, MinSizePartitioner, Optimizer, PSClient


class Counting(futures.ThreadPoolExecutor):
    """A one-thread executor that counts what it was given."""

    queued = 0

    def submit(self, fn, /, *args, **kwargs):
        self.queued += 1
        return super().submit(fn, *args, **kwargs)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96), torch.nn.Tanh(),
                               torch.nn.Linear(96, 5))


def test_gradients_encoded_by_the_encoder_thread_train_exactly_as_without_overlap(local_cluster):
    local = local_cluster(2)
    plain, overlapped = mlp(), mlp()
    x, y = torch.randn(8, 20, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 5
    opt = Optimizer("adam", lr=0.01)
    with PSClient(local.cluster, partitioner=MinSizePartitioner(min_shard_bytes=1024),
                  chunk_bytes=codec.MIN_CHUNK_BYTES, timeout=30.0, connect_timeout=10) as ps:
        policy = {"4.": Compression("bf16", min_bytes=0)}  # one layer compressed: queued behind the others
        ref = ps.register_module(plain, opt, prefix="plain/", create=True, compression=policy)
        binding = ps.register_module(overlapped, opt, prefix="overlap/", create=True, compression=policy,
                                     overlap=True)
        binding._overlap.encoder = encoder = Counting(1, thread_name_prefix="test-grads")
        for step in range(4):
            for model, bound in ((plain, ref), (overlapped, binding)):
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                bound.exchange() if step % 2 else (bound.push(), bound.pull())
        binding.wait()
        assert encoder.queued == 4 * len(list(overlapped.parameters())), "every gradient went by the thread"
        for (name, got), want in zip(overlapped.named_parameters(), plain.parameters()):
            assert torch.equal(got, want), f"{name} differs by {(got - want).abs().max():.3g}"
        assert ps.stats.duplicates == 0
