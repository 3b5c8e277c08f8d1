"""A module trained with overlap while its job is resized live (test_overlap.py on the CPU, test_cuda.py on a GPU)."""

import concurrent.futures
import threading

import torch
import torch.nn.functional as F

from torchps.client import Optimizer, PSClient
from torchps.security import INSECURE

STEPS = 24


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Sigmoid(), torch.nn.Linear(300, 10))


def train_through_live_resizes(local, device: str) -> None:
    """On `local` (a started LocalCluster of 2 shards, async): trains a CPU module without overlap, then a module
    on `device` with overlap while the job goes 2 -> 3 -> 2 shards, each resize starting after that module's
    step 4 (12) and returning before its step 8 (20). Its pushes streamed during backward and its layer-by-layer
    pulls meet shards their variables left (refused, sent again to the new owners) and a shard added after the
    push opened. Asserts that it ends where the CPU module ends, each variable updated once per step."""
    generator = torch.Generator().manual_seed(2)
    xs = torch.randn(STEPS, 32, 64, generator=generator)
    ys = torch.randint(0, 10, (STEPS, 32), generator=generator)
    grown, shrunk, started = threading.Event(), threading.Event(), (threading.Event(), threading.Event())
    with PSClient(local.cluster, security=INSECURE, partitioner=None) as ps:

        def run(on: str, prefix: str, resized: bool) -> torch.nn.Module:
            net = _model().to(on)
            binding = ps.register_module(net, Optimizer("sgd", lr=0.1, momentum=0.9), create=True, prefix=prefix,
                                         overlap=resized)
            for k in range(STEPS):
                if resized:
                    {4: started[0], 12: started[1]}.get(k, threading.Event()).set()
                    resize = {8: grown, 20: shrunk}.get(k)
                    assert resize is None or resize.wait(timeout=120), f"no resize by step {k}"
                net.zero_grad(set_to_none=True)
                F.cross_entropy(net(xs[k].to(on)), ys[k].to(on)).backward()
                binding.exchange()
            binding.wait()
            return net

        want = run("cpu", "reference/", False)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            training = pool.submit(run, device, "resized/", True)
            assert started[0].wait(timeout=120) or training.result(timeout=1)
            assert ps.resize([*local.cluster.ps, local.add_ps()]).shards_after == 3
            grown.set()
            assert started[1].wait(timeout=120) or training.result(timeout=1)
            shrink = ps.resize(list(local.cluster.ps))
            assert shrink.shards_after == 2
            shrunk.set()
            got = training.result(timeout=300)
        assert ps.layout_epoch == shrink.epoch
        for (name, expected), value in zip(want.named_parameters(), got.parameters()):
            assert value.device.type == torch.device(device).type
            torch.testing.assert_close(value.detach().cpu(), expected.detach(), atol=1e-5, rtol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
        versions = {info.spec.name: info.version for info in ps.list_variables()
                    if info.spec.name.startswith("resized/")}
        assert versions == {f"resized/{name}": STEPS for name, _ in want.named_parameters()}
