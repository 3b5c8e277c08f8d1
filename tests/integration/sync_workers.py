"""Worker process bodies for test_sync_training.py (importable, so spawn/forkserver processes can run them).

Every worker is a PSClient with task worker:<index>; worker 0 is the chief:
it configures the mode, then creates the variables (register_module(create=True));
the others wait for them (create=False). Exceptions end the process with a
non-zero exit code and a traceback on stderr, which the test reports.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from torchps.client import Optimizer, PSClient, TaskSpec

IN, HIDDEN, OUT = 10, 5, 3
OPTIMIZERS = {"sgd": ("sgd", {"lr": 0.1}), "adam": ("adam", {"lr": 0.01})}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def make_data(steps: int, global_batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of shape (steps, global_batch, IN) and (steps, global_batch, OUT)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(steps, global_batch, IN, generator=generator),
            torch.randn(steps, global_batch, OUT, generator=generator))


def backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad()
    F.mse_loss(model(x), y).backward()  # mean over the batch


def _client(cluster, index: int) -> PSClient:
    torch.set_num_threads(1)  # 2 shared cores: keep workers light
    return PSClient(cluster, task=TaskSpec("worker", index), connect_timeout=60.0)


def exact_worker(cluster, index: int, num_workers: int, batch: int, steps: int, optimizers: list[str],
                 lease_seconds: float, exchange: bool = False, overlap: bool = False) -> None:
    """Sync R = N: trains one fresh model per optimizer (prefix '<opt>/') for `steps` steps.

    Worker i takes rows i*b:(i+1)*b of each global batch of N*b rows. With
    `exchange`, each step is ModuleBinding.exchange (PushPull held on every
    shard, or with overlap push then a background pull) instead of push then
    pull. With `overlap`, gradients stream during backward and each layer's
    forward waits for its own values; the last pull is waited for.
    """
    x, y = make_data(steps, num_workers * batch)
    rows = slice(index * batch, (index + 1) * batch)
    with _client(cluster, index) as client:
        if index == 0:
            client.configure("sync", total_num_replicas=num_workers, replicas_to_aggregate=num_workers,
                             lease_seconds=lease_seconds)
        for opt in optimizers:
            name, hyper = OPTIMIZERS[opt]
            model = make_model()
            binding = client.register_module(model, Optimizer(name, **hyper), create=index == 0, prefix=f"{opt}/",
                                             wait_timeout=60.0, overlap=overlap)
            for k in range(steps):
                backward(model, x[k, rows], y[k, rows])
                if exchange:
                    binding.exchange()
                else:
                    binding.push()
                    binding.pull()
            binding.wait()


def steady_worker(cluster, index: int, *, mode: str, num_workers: int, replicas: int, lease_seconds: float,
                  max_steps: int, sleep: float, stop, results, chief: bool, max_staleness: int = 0,
                  progress=None) -> None:
    """Trains until `stop` is set or after `max_steps` pushes, sleeping `sleep` s per step; then leaves.

    Puts {index, start_step, end_step, pushes, finished_at, stats, max_ahead} on `results`
    before leaving. With `progress` (a shared array of push counts, one per
    worker) it records after each push how far ahead of the other worker it is.
    """
    x, y = make_data(1, 8)
    with _client(cluster, index) as client:
        if chief:
            client.configure(mode, total_num_replicas=num_workers, replicas_to_aggregate=replicas,
                             lease_seconds=lease_seconds, max_staleness=max_staleness)
        model = make_model()
        binding = client.register_module(model, Optimizer("sgd", lr=0.01), create=chief, wait_timeout=60.0)
        start_step = binding.step
        pushes, max_ahead = 0, 0
        while pushes < max_steps and not (stop is not None and stop.is_set()):
            backward(model, x[0], y[0])
            binding.push()
            pushes += 1
            if progress is not None:
                with progress.get_lock():
                    progress[index] += 1
                    max_ahead = max(max_ahead, progress[index] - min(progress[i] for i in range(len(progress))
                                                                     if i != index))
            binding.pull()
            if sleep:
                time.sleep(sleep)
        results.put({"index": index, "start_step": start_step, "end_step": binding.step, "pushes": pushes,
                     "finished_at": time.time(), "stats": client.stats.as_dict(), "max_ahead": max_ahead})
