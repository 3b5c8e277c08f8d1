"""A sync push that ps 0 holds longer than usual says, in a WARNING of the torchps logger, what its step
waits for: the README's custom loop run as one process of a 2-worker sync job (issue #39, item 10)."""

from __future__ import annotations

import logging
import re
import threading

import torch
import torch.nn.functional as F

from helpers import wait_until
from torchps.client import Optimizer, PSClient, TaskSpec
from torchps.client import held
from torchps.client.held import NOTICE_SECONDS

NOTICE = re.compile(r"^step 0 waits for 1 more of 2 gradients: worker:1 has not joined \(waited (\d+) s\)$")


def step(ps: PSClient, net: torch.nn.Module, create: bool) -> None:
    model = ps.register_module(net, Optimizer("sgd", lr=0.1), create=create, wait_timeout=30)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    loss = F.cross_entropy(net(x), y)
    net.zero_grad()
    loss.backward()
    model.exchange()


def test_a_held_first_step_names_the_worker_it_waits_for(local_cluster, caplog, monkeypatch):
    monkeypatch.setattr(held, "REPEAT_SECONDS", 1.0)  # the warning again every second (default: 15), not at 5 s
    local = local_cluster(1, workers=2)
    caplog.set_level(logging.WARNING, logger="torchps")
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=10) as chief:
        chief.configure("sync", total_num_replicas=2)  # the startup grace (60 s) waits for worker:1
        first = threading.Thread(target=step, args=(chief, net, True), daemon=True)
        first.start()

        def notices() -> list[str]:
            return [r.getMessage() for r in caplog.records
                    if r.name.startswith("torchps") and "waits for" in r.getMessage()]

        line = wait_until(notices, 3 * NOTICE_SECONDS, "a warning naming what the held step waits for")[0]
        assert NOTICE.match(line), line
        assert NOTICE_SECONDS <= int(NOTICE.match(line)[1]) < 3 * NOTICE_SECONDS, line
        again = wait_until(lambda: notices()[1:], 10, "the warning again while the step is still held")[0]
        assert NOTICE.match(again) and int(NOTICE.match(again)[1]) > int(NOTICE.match(line)[1]), again
        assert first.is_alive(), "the step is still held"
        with PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=10) as other:
            step(other, torch.nn.Linear(4, 2), False)  # worker:1's gradient completes step 0: both go on
        first.join(30)
        assert not first.is_alive(), "worker:0's step was released once worker:1 pushed"
        assert chief.step == 1
