"""Process bodies for test_host_workers.py (importable, so forkserver processes can run them).

A "host" is task worker:0 trained by 2 processes (local ranks 0 and 1, gloo):
local rank 0 owns the task's PSClient (a HostBinding), local rank 1 has none
(a LocalReplica). The other tasks are single-process workers. Every process
puts {who, params, stats} on `results` at the end; exceptions end it with a
non-zero exit code and a traceback on stderr.
"""

from __future__ import annotations

import torch

from torchps.client import AllreduceGroup, HostBinding, LocalReplica, Optimizer, PSClient, TaskSpec

import sync_workers

LR = 0.1


def _stats_delta(before: dict, after: dict) -> dict:
    return {key: after[key] - before[key] for key in ("pushes", "bytes_sent", "bytes_received")}


def host_process(cluster, local_rank: int, port: int, rows: slice, steps: int, num_tasks: int, results) -> None:
    """Local rank `local_rank` of worker:0's 2 processes: trains rows `rows` of each global batch."""
    torch.set_num_threads(1)
    x, y = sync_workers.make_data(steps, num_tasks * 2 * (rows.stop - rows.start))
    model = sync_workers.make_model()
    task = TaskSpec("worker", 0)
    with AllreduceGroup.connect_local(task, local_rank, 2, port, timeout=60.0) as group:
        if local_rank:
            replica = LocalReplica(model, group)
            for k in range(steps):
                sync_workers.backward(model, x[k, rows], y[k, rows])
                assert replica.exchange()
            sync_workers.backward(model, x[0, rows], y[0, rows])
            assert not replica.exchange(), "local rank 0 ended the host's training"
            results.put({"who": "host-1", "params": _params(model), "stats": None})
            return
        with PSClient(cluster, task=task, connect_timeout=60.0) as client:
            client.configure("sync", total_num_replicas=num_tasks, replicas_to_aggregate=num_tasks,
                             lease_seconds=10.0)
            binding = HostBinding(client.register_module(model, Optimizer("sgd", lr=LR), create=True,
                                                         wait_timeout=60.0), group)
            before = client.stats.as_dict()
            for k in range(steps):
                sync_workers.backward(model, x[k, rows], y[k, rows])
                binding.exchange()
            binding.close()
            results.put({"who": "host-0", "params": _params(model),
                         "stats": _stats_delta(before, client.stats.as_dict())})


def single_worker(cluster, index: int, rows: slice, steps: int, num_tasks: int, results) -> None:
    """Task worker:`index`, one process: trains rows `rows` of each global batch."""
    torch.set_num_threads(1)
    x, y = sync_workers.make_data(steps, num_tasks * (rows.stop - rows.start))
    model = sync_workers.make_model()
    with PSClient(cluster, task=TaskSpec("worker", index), connect_timeout=60.0) as client:
        binding = client.register_module(model, Optimizer("sgd", lr=LR), create=False, wait_timeout=60.0)
        before = client.stats.as_dict()
        for k in range(steps):
            sync_workers.backward(model, x[k, rows], y[k, rows])
            binding.exchange()
        results.put({"who": f"worker-{index}", "params": _params(model),
                     "stats": _stats_delta(before, client.stats.as_dict())})


def _params(model: torch.nn.Module) -> dict:
    """As numpy arrays: a tensor on a queue would be shared memory, gone with this process."""
    return {name: p.detach().cpu().numpy().copy() for name, p in model.named_parameters()}
