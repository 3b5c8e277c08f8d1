"""The README's journal benchmarks on their smallest settings: bench/journal.py trains with and without the journal
(and with --journal-sync), interleaved, and reports the ratios the README quotes; with --calls it times GetStatus
and Join while processes push into shards with and without the journal."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_journal_benchmark_reports_its_ratios_over_the_plain_shard(tmp_path):
    out = tmp_path / "journal.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "journal.py"), "--dims", "784,16,10", "--workers", "1",
                          "--seconds", "0.3", "--repeats", "1", "--warmup", "1", "--dir", str(tmp_path),
                          "--json", str(out)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert set(result["steps_per_s"]) == {"plain", "journal", "journal_sync"}
    assert all(rate > 0 for rate in result["steps_per_s"].values())
    for setup in ("journal", "journal_sync"):
        assert result[f"{setup}_over_plain"] == result["steps_per_s"][setup] / result["steps_per_s"]["plain"]
    assert "| journal_sync | --checkpoint-dir DIR/journal_sync --journal-sync |" in run.stdout
    assert "journal_over_plain" in run.stdout


def test_the_journal_benchmark_times_status_and_joins_while_processes_push(tmp_path):
    out = tmp_path / "calls.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "journal.py"), "--calls", "--dims", "784,16,10",
                          "--workers", "1", "--seconds", "0.3", "--dir", str(tmp_path), "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    for setup in ("plain", "journal"):
        shard = result["calls"][setup]
        assert shard["pushes"] > 0, result
        for call in ("GetStatus", "Join"):
            r = shard[call]
            assert r["calls"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"], (setup, call, r)
    assert result["met"] == all(result["calls"]["journal"][c]["p99_ms"] < 50 for c in ("GetStatus", "Join"))
    assert "| journal | Join |" in run.stdout


def test_the_journal_benchmark_without_compute_reports_its_ratio_and_the_shard_s_cpu(tmp_path):
    out = tmp_path / "no_compute.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "journal.py"), "--no-compute", "--dims", "784,16,10",
                          "--workers", "1", "--seconds", "0.3", "--repeats", "2", "--warmup", "1", "--dir",
                          str(tmp_path), "--json", str(out)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert set(result["steps_per_s"]) == {"plain", "journal"} and all(len(r) == 2 for r in result["rates"].values())
    assert result["journal_over_plain"] == result["steps_per_s"]["journal"] / result["steps_per_s"]["plain"]
    assert all(cpu["server_ms"] > 0 for cpu in result["cpu_per_step"].values()), result["cpu_per_step"]
    assert "| journal | --checkpoint-dir DIR/journal |" in run.stdout
