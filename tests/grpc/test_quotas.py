"""A shard's limits against real ps-server processes: memory for values and optimizer state, one
variable's size, calls per client. Over a limit: RESOURCE_EXHAUSTED naming it, nothing changed, and the
shard keeps serving everyone else."""

from __future__ import annotations

import threading

import pytest
import torch

from torchps.client import Optimizer, PSClient, ResourceExhaustedError

from helpers import wait_until

QUARTER = 1 << 16  # float32 elements: 256 KiB


def names_on(client: PSClient) -> list[str]:
    return [info.spec.name for info in client.list_variables()]


def test_max_memory_counts_values_and_optimizer_state_before_allocating(local_cluster):
    local = local_cluster(1, server_args=["--max-memory", "1M"])
    with PSClient(local.cluster, connect_timeout=2) as client:
        client.create_variables({"adam": torch.zeros(QUARTER)}, Optimizer("adam", lr=0.1))  # 256K + 2 x 256K
        client.create_variables({"plain": torch.zeros(QUARTER)}, Optimizer("sgd", lr=0.1))  # 256K: at the limit
        with pytest.raises(ResourceExhaustedError, match="--max-memory") as info:
            client.create_variables({"one-more": torch.zeros(1)}, Optimizer("sgd", lr=0.1))
        assert "'one-more'" in str(info.value)
        with pytest.raises(ResourceExhaustedError, match="--max-memory"):  # momentum doubles sgd's bytes
            client.create_variables({"big": torch.zeros(QUARTER * 8)}, Optimizer("sgd", lr=0.1, momentum=0.9))
        assert names_on(client) == ["adam", "plain"], "nothing was created"
        client.push({"adam": torch.ones(QUARTER), "plain": torch.ones(QUARTER)})
        assert client.status(0).step == 1, "the shard keeps serving"
        assert client.create_variables({"adam": torch.zeros(QUARTER)}, Optimizer("adam", lr=0.1)) == \
            {"adam": False}, "re-creating an existing variable needs no new memory"


def test_max_variable_bytes_refuses_one_variable_too_big(local_cluster):
    local = local_cluster(1, server_args=["--max-variable-bytes", "64K"])
    with PSClient(local.cluster, connect_timeout=2) as client:
        client.create_variables({"small": torch.zeros(100)})
        with pytest.raises(ResourceExhaustedError, match="'large' declares 65540 bytes.*--max-variable-bytes 65536"):
            client.create_variables({"large": torch.zeros(QUARTER // 4 + 1)})
        assert names_on(client) == ["small"]


def test_max_calls_per_client_refuses_the_extra_call_not_the_others(local_cluster):
    local = local_cluster(1, server_args=["--max-calls-per-client", "1"])
    with PSClient(local.cluster, connect_timeout=1) as client, PSClient(local.cluster, connect_timeout=5) as other:
        client.create_variables({"v": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        waiting = threading.Thread(target=lambda: client.pull_into({"v": torch.zeros(2)}, min_step=1), daemon=True)
        waiting.start()
        wait_until(lambda: other.status(0).waiting_calls == 1, 20, "the first client's pull to wait")
        with pytest.raises(ResourceExhaustedError, match="--max-calls-per-client"):
            client.status(0)
        other.declare({"v": torch.zeros(2)})
        other.push({"v": torch.ones(2)})  # another client is served, and releases the waiting pull
        waiting.join(20)
        assert not waiting.is_alive() and client.status(0).step == 1
