"""bench/peers.py on its smallest setting, without TensorFlow (CI does not install it): real shards and two
async worker processes on the seed MLP, the issue's JSON keys written (null where not measured)."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEYS = ["tf_big_steps_per_s", "big_fp32_steps_per_s", "big_bf16_steps_per_s", "big_topk_steps_per_s",
        "big_ratio_fp32", "big_ratio_bf16", "big_ratio_topk",
        "tf_big_2ps_steps_per_s", "big_2ps_fp32_steps_per_s", "big_2ps_bf16_steps_per_s",
        "big_2ps_topk_steps_per_s", "big_2ps_ratio_fp32", "big_2ps_ratio_bf16", "big_2ps_ratio_topk",
        "big_2ps_over_1ps", "small_ratio", "tf_small_steps_per_s", "small_fp32_steps_per_s",
        "targets", "MB_copied_per_step", "raw", "rounds", "versions", "git", "machine"]


def test_peers_runs_torchps_on_the_seed_mlp_and_writes_every_key(tmp_path):
    out = tmp_path / "peers.json"
    # A 1 s window instead of --quick's 3 s: the keys, the steps and the bytes per step need no more.
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--quick", "--only", "small",
                          "--variants", "fp32", "--no-tf", "--seconds", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert not [key for key in KEYS if key not in result]
    assert result["small_fp32_steps_per_s"] > 0
    assert result["raw"]["small"]["fp32"] == [result["small_fp32_steps_per_s"]]
    assert result["tf_small_steps_per_s"] is None and result["small_ratio"] is None  # --no-tf
    assert result["targets"]["small_ratio"]["met"] is None
    assert result["status"]["small"]["fp32"] == "ok"
    (record,) = result["rounds"]
    assert record["result"]["steps"] > 0 and len(record["result"]["workers"]) == 2
    small_bytes = (784 * 100 + 100 + 100 * 10 + 10) * 4  # the seed MLP, float32: once into a push, once out
    assert result["MB_copied_per_step"]["small"]["fp32"] == pytest.approx(2 * small_bytes / 1e6, rel=1e-6)
    assert "| small | torchps fp32 |" in run.stdout and "not measured" in run.stdout
