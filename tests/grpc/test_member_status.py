"""GetStatus's account of the workers (members: state, pushes, last push step, restarts) and of a held sync
step (awaited_step, awaited_pushes, awaited_pushers), against a real ps-server: what the chief's end-of-job
account, a restarted worker's skip and a held push's warning read."""

from __future__ import annotations

import signal
import threading

import torch

from helpers import wait_until
from torchps.client import Optimizer, PSClient, TaskSpec

NAMES = ["worker:0", "worker:1", "worker:2"]


def standing(client: PSClient) -> dict[str, tuple]:
    status = client.status(0, joined_of=NAMES)
    return {"not_joined": list(status.not_joined),
            **{m.worker: (m.state, m.pushes, m.last_push_step, m.restarts) for m in status.members}}


def test_each_workers_pushes_and_state_are_counted_and_survive_the_shards_restart(local_cluster, tmp_path):
    local = local_cluster(1, workers=3, server_args=["--checkpoint-dir", str(tmp_path / "ckpt")])
    value = {"m/w": torch.zeros(4)}
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=20) as chief, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=20) as other:
        chief.create_variables(value, Optimizer("sgd", lr=1.0))
        other.declare(value)
        chief.join()
        other.join()
        for _ in range(3):
            chief.push({"m/w": torch.ones(4)})
        other.push({"m/w": torch.ones(4)})
        chief.push({"m/w": torch.ones(4)}, advance_step=False)  # counts no step: not a batch
        other.leave()
        assert standing(chief) == {"not_joined": ["worker:2"], "worker:0": ("live", 3, 2, 0),
                                   "worker:1": ("left", 1, 0, 0)}
        chief.save_checkpoint(0)
        chief.push({"m/w": torch.ones(4)})  # after the checkpoint: in the journal only
        assert local.kill_ps(0) == -signal.SIGKILL
        local.start_ps(0)
        assert standing(chief) == {"not_joined": ["worker:2"], "worker:0": ("live", 4, 4, 0),
                                   "worker:1": ("left", 1, 0, 0)}, "the counts come back from checkpoint + journal"
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=20) as again:
        again.join()  # a new process of worker:0
        assert standing(again)["worker:0"] == ("live", 4, 4, 1), "its earlier process's pushes are still its own"


def test_a_held_sync_step_shows_what_it_has_and_who_pushed(local_cluster):
    local = local_cluster(1, workers=2)
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=20) as chief, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=20) as other:
        chief.configure("sync", total_num_replicas=2)
        chief.create_variables({"s/w": torch.zeros(4)}, Optimizer("sgd", lr=1.0))
        other.declare({"s/w": torch.zeros(4)})
        chief.join()
        other.join()
        held = threading.Thread(target=chief.push, args=({"s/w": torch.ones(4)},), daemon=True)
        held.start()
        status = wait_until(lambda: (s := chief.status(0)).awaited_pushes == 1 and s, 30, "worker:0's push counted")
        assert (status.quorum, status.awaited_step, list(status.awaited_pushers)) == (2, 0, ["worker:0"])
        other.push({"s/w": torch.ones(4)})
        held.join(30)
        assert not held.is_alive()
        status = chief.status(0)
        assert (status.step, status.awaited_step, status.awaited_pushes, list(status.awaited_pushers)) == (1, 1, 0, [])
