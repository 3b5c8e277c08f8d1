"""bench/replication.py --quick: the seed MLP trained with and without a backup of its shard (async and sync),
and two failovers of a killed primary whose folder is gone, audited: the JSON has every figure the docs page and
the issue's bars read, no acknowledged push is lost or applied twice, and the page is made from it."""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, str, pathlib.Path]:
    """(the JSON, stdout, its path) of one --quick run."""
    folder = tmp_path_factory.mktemp("replication")
    out = folder / "replication_quick.json"
    run = subprocess.run([sys.executable, str(BENCH / "replication.py"), "--quick", "--dir", str(folder),
                          "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=folder)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return json.loads(out.read_text()), run.stdout, out


def test_the_cost_runs_report_both_jobs_steps_and_every_process_s_cpu(quick):
    result, stdout, _ = quick
    for mode in ("async", "sync"):
        group = result["cost"]["small"][mode]
        rates = group["steps_per_s"]
        assert set(rates) == {"unreplicated", "replicated"} and all(v > 0 for v in rates.values()), group
        assert result[f"small_{mode}_ratio"] == group["ratio"] == rates["replicated"] / rates["unreplicated"]
        cpu = group["cpu_per_step"]
        # The backup's CPU is read in the kernel's 10 ms ticks: a quick run on a loaded machine may use none.
        assert cpu["unreplicated"]["backup_ms"] is None and cpu["replicated"]["backup_ms"] >= 0, cpu
        assert all(c["ps_ms"] > 0 and c["compute_ms"] > 0 and c["update_ms"] > 0 for c in cpu.values()), cpu
        assert f"| small | {mode} | replicated |" in stdout
    assert result["cost"]["small"]["sync"]["raw"]["sync_steps_per_window"] >= 2
    assert result["large_async_ratio"] is None and result["targets"]["large_async_ratio"]["met"] is None


def test_failovers_lose_no_acknowledged_push_and_apply_none_twice(quick):
    result, stdout, _ = quick
    failover = result["failover"]
    assert failover["failed_rounds"] == 0 and len(failover["rounds"]) == 2, failover["rounds"]
    assert result["failover_lost"] == 0 and result["failover_duplicated"] == 0, failover["rounds"]
    assert result["failover_inexact_rounds"] == 0, failover["rounds"]
    for kill in failover["rounds"]:
        assert kill["replica"]["primary"] == kill["promoted_address"] and kill["replica"]["failovers"] == 1, kill
        assert all(p["acked"] > 0 and p["applied_b"] == p["acked"] for p in kill["pushers"]), kill
        assert 0 < kill["failover_s"] <= kill["resumed_s"], kill
    assert 0 < result["failover_p50_s"] <= result["failover_p99_s"] <= result["failover_max_s"]
    assert set(result["targets"]) >= {"failover_p99_s", "failover_lost", "failover_duplicated"}
    assert "failover_s p50" in stdout


def test_the_docs_page_is_made_from_the_results(quick, tmp_path):
    pytest.importorskip("matplotlib", reason="bench/pages.py draws with matplotlib (the docs extra)")
    sys.path.insert(0, str(BENCH))
    import pages

    result, _, path = quick
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(path, results / path.name)
    pages.write(tmp_path / "out", results)
    page = (tmp_path / "out" / "replication.md").read_text()
    assert f"`bench/results/{path.name}`" in page
    assert "| seed MLP | async | replicated | " in page and f"| {result['small_async_ratio']:.3f} |" in page
    assert f"p99 {result['failover_p99_s']:.3f}" in page
    assert {p.name for p in (tmp_path / "out").glob("*.svg")} == {"replication-cost.svg", "replication-failover.svg"}
    assert "(replication.md)" in (tmp_path / "out" / "index.md").read_text()
