"""bench/scale.py's smoke run: 24 sync workers (R = N = 24) in 2 processes against 2 shards that have 4
threads each, 3 steps: every step completes on both shards (more workers wait than the shards have threads),
every key written."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_scale_benchmark_completes_every_step_with_more_waiting_workers_than_threads(tmp_path):
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--workers", "24", "--steps", "3",
                          "--processes", "2", "--threads", "4", "--json", str(out)], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert result["every_step_completed"] and result["steps_completed"] == [3, 3], result
    assert result["worker_error_count"] == 0 and not result["getstatus_errors"], result
    assert result["getstatus_calls"] > 0 and result["getstatus_p99_ms"] > 0, result
    assert all(threads > 0 for threads in result["shard_threads_idle"]), result
    assert "every step completed" in run.stdout
