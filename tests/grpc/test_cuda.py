"""A module on a CUDA device through the whole client (client/device.py): registered, pulled, pushed, exported and
checkpointed as on the CPU, with and without overlap, through staging buffers reused from step to step. Needs a
GPU (the `gpu` marker; scripts/gpu_check.sh runs these on one); skipped elsewhere."""

import pytest
import torch
import torch.nn.functional as F

from torchps.client import Optimizer, PSClient
from torchps.security import INSECURE

from resize_training import train_through_live_resizes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
STEPS = 4


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Sigmoid(), torch.nn.Linear(300, 10))


def data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 32, 64, generator=generator), torch.randint(0, 10, (STEPS, 32), generator=generator)


def train(ps: PSClient, device: str, prefix: str, *, overlap: bool = False, exchange: bool = True):
    net = model().to(device)
    binding = ps.register_module(net, Optimizer("sgd", lr=0.1, momentum=0.9), create=True, prefix=prefix,
                                 overlap=overlap)
    x, y = data()
    for k in range(STEPS):
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x[k].to(device)), y[k].to(device)).backward()
        if exchange:
            binding.exchange()
        else:
            binding.push()
            binding.pull()
    binding.wait()
    return net, binding


def test_a_cuda_module_trains_exports_and_checkpoints_as_on_the_cpu(local_cluster, tmp_path):
    local = local_cluster(2, workers=1, server_args=["--checkpoint-dir", str(tmp_path)])
    with PSClient(local.cluster, security=INSECURE) as ps:
        cpu, _ = train(ps, "cpu", "cpu/")
        for overlap, exchange in [(False, True), (False, False), (True, True)]:
            prefix = f"cuda-{overlap}-{exchange}/"
            gpu, _ = train(ps, "cuda", prefix, overlap=overlap, exchange=exchange)
            assert all(p.device.type == "cuda" for p in gpu.parameters())
            for (name, want), got in zip(cpu.named_parameters(), gpu.parameters()):
                torch.testing.assert_close(got.detach().cpu(), want.detach(), atol=1e-5, rtol=1e-5,
                                           msg=lambda m, name=name: f"{prefix}{name}: {m}")
            exported = ps.export_state_dict([f"{prefix}{n}" for n, _ in gpu.named_parameters()], strip_prefix=prefix)
            torch.testing.assert_close(exported, {n: p.detach().cpu() for n, p in gpu.named_parameters()})
        assert ps.save_checkpoint(0) == ps.global_step() > 0  # the shards save what a CUDA module trained


def test_staging_buffers_are_pinned_allocated_once_and_reused(local_cluster):
    local = local_cluster(1, workers=1)
    with PSClient(local.cluster, security=INSECURE, partitioner=None) as ps:
        train(ps, "cuda", "a/", exchange=False)
        first = {slot: [buffer.data_ptr() for buffer, _ in entries] for slot, entries in ps._device._free.items()}
        assert {slot[0].split("/")[0] for slot in first} == {"pull", "push"}
        assert all(buffer.is_pinned() for entries in ps._device._free.values() for buffer, _ in entries)
        net, binding = train(ps, "cuda", "b/", exchange=False)
        for _ in range(3):
            net.zero_grad()
            F.cross_entropy(net(torch.randn(8, 64, device="cuda")), torch.zeros(8, dtype=torch.long,
                                                                                device="cuda")).backward()
            binding.push()
            binding.pull()
        again = {slot: [buffer.data_ptr() for buffer, _ in entries] for slot, entries in ps._device._free.items()}
        assert {slot: ptrs for slot, ptrs in again.items() if slot[0].startswith(("pull/a/", "push/a/"))} == first
        assert all(len(ptrs) == 1 for ptrs in again.values()), "one buffer per variable and direction"


def test_pageable_staging_gives_the_same_values(local_cluster):
    local = local_cluster(1, workers=1)
    with PSClient(local.cluster, security=INSECURE, pin_memory=False) as ps:
        assert ps._device.pinned is False
        gpu, _ = train(ps, "cuda", "pageable/")
        cpu, _ = train(ps, "cpu", "cpu/")
        for got, want in zip(gpu.parameters(), cpu.parameters()):
            torch.testing.assert_close(got.detach().cpu(), want.detach(), atol=1e-5, rtol=1e-5)



def test_a_cuda_module_trains_through_live_resizes_with_every_push_applied_once(local_cluster):
    """A cuda module with overlap trains while the job goes 2 -> 3 -> 2 shards: its gradients are staged from the
    GPU, a part refused by a shard its variables left is sent again, and the module ends where a CPU module
    trained on the same batches without a resize ends (resize_training.py)."""
    train_through_live_resizes(local_cluster(2, workers=1), "cuda")
