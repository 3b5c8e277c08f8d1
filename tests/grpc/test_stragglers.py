"""Workers' paces as a shard sees them, and the chief's straggler watch: a worker pushing much less often
than the others is named, in GetStatus, in the metrics and in the chief's log, and forgiven once it catches up.
The slow worker's pauses are the scenario itself (a slow worker), not a way to wait for something."""

import logging
import time
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from torchps.client import Optimizer, PSClient, TaskSpec
from torchps.worker.chief import StragglerWatch

SLOW_PAUSE = 0.4  # seconds between the slow worker's pushes; the fast one pushes back to back


def push(client, times, pause=0.0):
    for _ in range(times):
        client.push({"s/w": torch.ones(4)})
        time.sleep(pause)


def test_a_slow_worker_is_named_a_straggler_and_forgiven_when_it_catches_up(local_cluster, caplog):
    local = local_cluster(1, workers=2, server_args=["--metrics-port", "0"])
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=10) as fast, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=10) as slow:
        fast.create_variables({"s/w": torch.zeros(4)}, Optimizer("sgd", lr=0.1))
        slow.declare({"s/w": torch.zeros(4)})
        fast.join(), slow.join()
        push(fast, 10)
        push(slow, 4, SLOW_PAUSE)
        paces = {p.worker: p for p in fast.status(0).paces}
        assert set(paces) == {"worker:0", "worker:1"}
        assert paces["worker:1"].push_interval_seconds >= SLOW_PAUSE
        assert paces["worker:1"].straggler_score > 2 > paces["worker:0"].straggler_score

        port = fast.status(0).metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
        scores = {s.labels["worker"]: s.value for s in families["torchps_worker_straggler_score"].samples}
        assert scores["worker:1"] > 2 > scores["worker:0"]

        watch = StragglerWatch(fast, threshold=2.0)
        with caplog.at_level(logging.INFO, logger="torchps.worker.chief"):
            assert watch.check() == {"worker:1"}
            assert watch.check() == {"worker:1"}  # named once, not at every look
            # It catches up: both push at one pace, its moving average of intervals falls. Looked at after 40
            # rounds, then after each, at most 200: on a loaded machine a pause of this process between the two
            # pushes of a round can make either look slow for a while.
            for rounds in range(1, 201):
                push(slow, 1)
                push(fast, 1)
                if rounds >= 40 and not watch.check():
                    break
            assert watch.check() == set()
    named = [r.getMessage() for r in caplog.records if "worker:1" in r.getMessage() and "straggler" in r.getMessage()]
    assert len(named) == 2, named
    assert named[0].startswith("worker:1 is a straggler: a push every")
    assert named[1] == "worker:1 is no longer a straggler"
