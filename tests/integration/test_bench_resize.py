"""bench/resize.py --quick --only table sync: real shards and pusher processes through 2 -> 4 -> 3 -> 2 shards
live, an embedding table re-laid out and a sync job held at step boundaries; every sum exact, each resize's
figures written. A removed shard is stopped 0.5 s after the resize instead of client/resize.py's 2 s: the pushers,
which push throughout, one every few milliseconds, have followed the new layout well before, and a longer drain
only adds pushes."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_quick_resize_benchmark_runs_the_table_and_sync_runs_exactly(tmp_path):
    out = tmp_path / "resize.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "resize.py"), "--quick", "--only", "table", "sync",
                          "--drain-seconds", "0.5", "--json", str(out)], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert result["exact_sum"] and [r["run"] for r in result["results"]] == ["sync", "table"]
    for res in result["results"]:
        assert res["exact_sum"] and res["pushes"] > 0, res["run"]
        assert [(r["from"], r["to"]) for r in res["resizes"]] == [(2, 4), (4, 3), (3, 2)], res["run"]
        assert all(0 <= r["pause_p50_s"] <= r["pause_p99_s"] <= r["pause_max_s"] for r in res["resizes"])
    table = next(r for r in result["results"] if r["run"] == "table")
    assert all(r["table_bytes"] > 0 for r in table["resizes"]), "every resize re-laid the table out"
    assert result["command"] == ("python bench/resize.py --quick --only table sync --drain-seconds 0.5 --json "
                                 + str(out))
