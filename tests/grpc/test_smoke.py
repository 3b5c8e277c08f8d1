import torch

from torchps.client import Optimizer


def test_register_push_pull_roundtrip(client):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    binding = client.register_module(model, Optimizer("sgd", lr=1.0), create=True, prefix="smoke/")
    before = {n: p.detach().clone() for n, p in binding.params.items()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    binding.push()
    binding.pull()
    for name, p in binding.params.items():
        assert torch.equal(p.detach(), before[name] - 1)
