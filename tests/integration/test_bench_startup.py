"""bench/startup.py's smoke run: one round of the forked setup (the fresh one costs seconds of imports per
process, which the benchmark itself measures), every key written."""

import json
import pathlib
import subprocess
import sys

import pytest

from helpers import mnist5k_installed

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="ps-launch's job runs on mnist5k")


def test_the_startup_benchmark_times_the_forked_start(tmp_path):
    out = tmp_path / "startup.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "startup.py"), "--setups", "forked", "--rounds", "1",
                          "--clusters", "2", "--json", str(out)], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    for key in ("cluster_first_seconds", "cluster_next_seconds", "launch_wall_seconds", "launch_cpu_seconds"):
        assert set(result[key]) == {"forked"} and result[key]["forked"] > 0, (key, result[key])
    # the first cluster of a process waits for the fork server's imports; the later ones are forked at once
    assert result["cluster_next_seconds"]["forked"] < result["cluster_first_seconds"]["forked"], result
    assert "LocalCluster(2) up" in run.stdout
