"""Worker process bodies for test_hybrid_allreduce.py (importable, so forkserver processes can run them).

Each worker is a PSClient with task worker:<index> (worker 0 is the chief: it configures async and creates
the tables) and a member of an AllreduceGroup formed from the same cluster value. It trains one model per
optimizer (prefix '<opt>/'): an EmbeddingBag on the shards whose rows never change (its row optimizer is SGD
with lr 0: the rows each worker reads do not depend on the order in which the shards apply the other
worker's pushes), then dense layers all-reduced in the group. Exceptions end the process with a non-zero
exit code and a traceback on stderr, which the test reports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchps.client import AllreduceGroup, Cluster, EmbeddingBag, Optimizer, PSClient, TaskSpec

ROWS, DIM, BAG, HIDDEN = 40, 6, 3, 5
RARE = ROWS - 1  # an id that starts only worker 0's first bag of each step
OPTIMIZERS = {
    "sgd": (Optimizer("sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
    "adam": (Optimizer("adam", lr=0.01, betas=(0.8, 0.99)), lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99))),
}


class Model(nn.Module):
    """An EmbeddingBag (table on the shards, fixed rows) under two dense layers and a buffer; `bag` is any
    module taking (ids, None) -> (bags, DIM), so the reference can put torch's own EmbeddingBag there.

    `rare` serves only bags whose first id is RARE (make_data puts them in worker 0's rows only), so worker 1
    has no gradient for it: the all-reduce must count its share as zeros, as the combined batch does.
    `unused` is in no forward: no worker has a gradient, and it must stay None (an optimizer then skips it,
    as torch's does on the combined batch)."""

    def __init__(self, seed: int, bag: nn.Module | None = None):
        super().__init__()
        torch.manual_seed(seed)  # each worker starts elsewhere: the chief's broadcast must even them out
        self.bag = bag if bag is not None else EmbeddingBag(ROWS, DIM, mode="mean", optimizer=Optimizer("sgd", lr=0.0))
        self.hidden, self.out = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, 1)
        self.rare, self.unused = nn.Linear(DIM, 1), nn.Parameter(torch.ones(2))
        self.register_buffer("scale", torch.tensor([1.0 + seed / 100]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = self.bag(ids, None)
        out = self.out(torch.tanh(self.hidden(pooled)))
        rare = ids[:, :1] == RARE
        if rare.any():
            out = out + rare * self.rare(pooled)
        return out * self.scale


def make_data(steps: int, global_batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, y): (steps, global_batch, BAG) ids and (steps, global_batch, 1) targets; RARE starts only the first
    bag of each step (worker 0's)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, RARE, (steps, global_batch, BAG), generator=gen)
    ids[:, 0, 0] = RARE
    return ids, torch.randn(steps, global_batch, 1, generator=gen)


def hybrid_worker(cluster: dict, index: int, num_workers: int, batch: int, steps: int, out: str) -> None:
    """Trains a model per optimizer for `steps` steps on rows index*b:(index+1)*b of each global batch, then
    saves {opt: {"start": state after registering, "end": final state, "step": binding.step}} and the
    group's collective count to `out`."""
    torch.set_num_threads(1)  # 2 shared cores: keep workers light
    cluster = Cluster.from_dict(cluster)
    task = TaskSpec("worker", index)
    ids, y = make_data(steps, num_workers * batch)
    mine = slice(index * batch, (index + 1) * batch)
    saved = {}
    with PSClient(cluster, task=task, connect_timeout=30.0) as client:
        if client.is_chief:
            client.configure("async")
        with AllreduceGroup.connect(cluster, task, timeout=30.0) as group:
            for name, (spec, _) in OPTIMIZERS.items():
                model = Model(seed=100 + index)
                binding = client.register_module(model, spec, dense="allreduce", process_group=group,
                                                 prefix=f"{name}/", wait_timeout=30.0)
                start = {k: v.clone() for k, v in model.state_dict().items()}
                for k in range(steps):
                    model.zero_grad(set_to_none=True)
                    F.mse_loss(model(ids[k, mine]), y[k, mine]).backward()
                    binding.exchange()
                binding.close()
                saved[name] = {"start": start, "end": model.state_dict(), "step": binding.step}
            saved["calls"] = group.calls
        torch.save(saved, out)


def uneven_member(cluster: dict, index: int, steps: int, results, done) -> None:
    """A member of a group (no shards) that all-reduces a gradient `steps` times, then leaves it; puts
    (index, "ok" or the AllreduceError's message) on `results`, then stays alive until `done` is set (at most
    60 s), so its liveness socket still answers while the others ask."""
    from torchps.client import AllreduceError

    torch.set_num_threads(1)
    cluster = Cluster.from_dict(cluster)
    param = nn.Parameter(torch.zeros(3))
    outcome = "ok"
    with AllreduceGroup.connect(cluster, TaskSpec("worker", index), timeout=30.0) as group:
        try:
            for step in range(1, steps + 1):
                param.grad = torch.ones(3)
                group.average_gradients_([param], what=f"step {step}'s all-reduce")
        except AllreduceError as exc:
            outcome = str(exc)
    results.put((index, outcome))
    done.wait(60)


def stalling_member(cluster: dict, index: int, stall_after: int | None, timeout: float, results) -> None:
    """A member of a group (no shards) that all-reduces a gradient step after step; with `stall_after`, it
    stops itself (SIGSTOP: alive, silent) after that many steps, and the test kills it. Otherwise it puts
    (steps done, the AllreduceError's message, seconds its failed step took) on `results`."""
    import os
    import signal
    import time

    from torchps.client import AllreduceError

    torch.set_num_threads(1)
    cluster = Cluster.from_dict(cluster)
    param = nn.Parameter(torch.zeros(3))
    with AllreduceGroup.connect(cluster, TaskSpec("worker", index), timeout=timeout) as group:
        for step in range(1, 1_000_000):
            if step - 1 == stall_after:
                os.kill(os.getpid(), signal.SIGSTOP)
            param.grad = torch.ones(3)
            started = time.monotonic()
            try:
                group.average_gradients_([param], what=f"step {step}'s all-reduce")
            except AllreduceError as exc:
                results.put((step - 1, str(exc), time.monotonic() - started))
                return
