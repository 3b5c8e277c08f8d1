"""The README's memory commands on their smallest settings: bench/memory.py measures real shards from /proc
and from what they report of their allocator, and bench/against.py runs it against a commit and this tree."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--models", "seed", "--optimizers", "adam", "--shards", "1", "--no-worker"]


def _run(args, tmp_path, timeout=240):
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


def test_the_memory_benchmark_measures_every_stage_of_a_shard(tmp_path):
    out = tmp_path / "memory.json"
    run = _run([str(ROOT / "bench" / "memory.py"), *SMALL, "--json", str(out)], tmp_path)
    (result,) = json.loads(out.read_text())["runs"]
    assert "| seed | adam | 1 |" in run.stdout
    assert list(result["stages"]) == ["empty", "created", "pushed", "pulled", "steady"]
    for stage in result["stages"].values():  # the shard's own figures, through GetStatus
        assert stage["rss_bytes"] > 100 << 20 and stage["heap_in_use_bytes"] > 0
    assert result["held_bytes"] == 3 * 79_510 * 4  # values + Adam's two moments
    assert result["rss_peak"] >= result["rss_steady"] > result["rss_empty"] > 0


@pytest.mark.timeout(660)  # its subprocess may run 600 s
def test_against_runs_a_benchmark_on_a_commit_and_on_this_tree(tmp_path):
    out = tmp_path / "against.json"
    run = _run([str(ROOT / "bench" / "against.py"), "HEAD", "--rounds", "1", "--keys", "wall_seconds",
                "--json", str(out), "--", "bench/memory.py", *SMALL], tmp_path, timeout=600)
    assert "| wall_seconds | " in run.stdout
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"HEAD", "this tree"}
    assert all(len(runs) == 1 and runs[0]["runs"][0]["model"] == "seed" for runs in result["runs"].values())
