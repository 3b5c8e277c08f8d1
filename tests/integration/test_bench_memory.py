"""The memory benchmarks on their smallest settings: bench/against.py runs bench/memory.py against a commit and
this tree, and this tree's run is bench/memory.py's own, measuring real shards from /proc and from what they
report of their allocator. One against run serves both tests (a module fixture): its "this tree" side is the
memory benchmark a separate run would repeat."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--models", "seed", "--optimizers", "adam", "--shards", "1", "--no-worker"]
AGAINST_TIMEOUT = 600  # seconds: two memory.py runs and a venv


@pytest.fixture(scope="module")
def against(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """`bench/against.py HEAD --rounds 1 ... -- bench/memory.py SMALL`: its output and its JSON."""
    tmp_path = tmp_path_factory.mktemp("against")
    out = tmp_path / "against.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "against.py"), "HEAD", "--rounds", "1", "--keys",
                          "wall_seconds", "--json", str(out), "--", "bench/memory.py", *SMALL],
                         capture_output=True, text=True, timeout=AGAINST_TIMEOUT, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run, json.loads(out.read_text())


def load_memory_bench():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "bench" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(660)  # the fixture's against run may take AGAINST_TIMEOUT s
def test_the_memory_benchmark_measures_every_stage_of_a_shard(against):
    """bench/memory.py SMALL on this tree (against.py's "this tree" run: this interpreter, this checkout)."""
    _, result = against
    (tree,) = result["runs"]["this tree"]
    assert tree["config"]["models"] == ["seed"] and tree["config"]["no_worker"] is True
    (run,) = tree["runs"]
    assert "| seed | adam | 1 |" in load_memory_bench().table(tree), "the table memory.py prints"
    assert list(run["stages"]) == ["empty", "created", "pushed", "pulled", "steady"]
    for stage in run["stages"].values():  # the shard's own figures, through GetStatus
        assert stage["rss_bytes"] > 100 << 20 and stage["heap_in_use_bytes"] > 0
    assert run["held_bytes"] == 3 * 79_510 * 4  # values + Adam's two moments
    assert run["rss_peak"] >= run["rss_steady"] > run["rss_empty"] > 0


@pytest.mark.timeout(660)  # the fixture's against run may take AGAINST_TIMEOUT s
def test_against_runs_a_benchmark_on_a_commit_and_on_this_tree(against):
    run, result = against
    assert "| wall_seconds | " in run.stdout
    assert set(result["runs"]) == {"HEAD", "this tree"}
    assert all(len(runs) == 1 and runs[0]["runs"][0]["model"] == "seed" for runs in result["runs"].values())
