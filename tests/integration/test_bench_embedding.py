"""bench/embedding.py --quick: real shards and two async worker processes training a DLRM-like model on
sharded EmbeddingBag tables (fixed and dynamic), beside one plain torch process; the issue's JSON keys
written with measured, self-consistent values."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEYS = ["rows_per_s", "wire_bytes_per_step", "wire_bytes_per_step_total", "unique_row_bytes_per_step",
        "examples_per_s", "local_examples_per_s", "wire_over_floor", "examples_ratio", "breakdown_ms", "targets",
        "variants", "local", "config", "machine", "versions"]
QUICK = {"tables": 8, "rows": 20_000, "dim": 16, "batch": 256, "ids_per_bag": 8}


def test_the_quick_embedding_benchmark_measures_both_variants(tmp_path):
    out = tmp_path / "embedding.json"
    # 0.5 s windows instead of --quick's 3 s: every count below is checked against the others, whatever the window
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "embedding.py"), "--quick", "--seconds", "0.5", "--json",
                          str(out)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert not [key for key in KEYS if key not in result]
    assert {k: result["config"][k] for k in QUICK} == QUICK and result["config"]["quick"]
    assert set(result["variants"]) == {"fixed", "dynamic"} and result["headline_variant"] == "fixed"
    assert result["local_examples_per_s"] > 0 and result["local"]["steps"] > 0
    floor_per_row = QUICK["dim"] * 4 * 2 + 8
    for name, v in result["variants"].items():
        assert v["steps"] > 0 and len(v["workers"]) == 2 and all(w["steps"] > 0 for w in v["workers"]), name
        assert v["examples_per_s"] > 0 and v["examples_ratio"] == v["examples_per_s"] / result["local_examples_per_s"]
        # Rows: what the shards counted is what the workers' batches hold, one lookup and one push per distinct
        # id (the steps that ended the window past its end included).
        assert v["rows_read"] == v["rows_pushed"] == sum(w["unique_rows"] for w in v["workers"]), name
        assert v["rows_per_s"] == v["rows_moved"] / v["window_seconds"] > 0
        unique_per_step = v["unique_rows_per_step"]
        assert 0 < unique_per_step <= QUICK["tables"] * QUICK["batch"] * QUICK["ids_per_bag"]
        assert v["unique_row_bytes_per_step"] == pytest.approx(unique_per_step * floor_per_row)
        # Wire bytes come from the kernel's TCP counters: at least the rows themselves went both ways, and
        # gRPC's framing adds a few percent, not multiples.
        assert 1.0 < v["wire_over_floor"] < 1.5, (name, v["wire_over_floor"])
        assert v["wire_bytes_per_step_total"] == pytest.approx(v["wire_bytes_per_step"] + v["dense_bytes_per_step"])
        assert v["wire_sent_per_step"] > unique_per_step * QUICK["dim"] * 4  # the row gradients pushed
        assert v["wire_received_per_step"] > unique_per_step * QUICK["dim"] * 4  # the rows looked up
        b = v["breakdown_ms"]
        assert all(b[k] > 0 for k in ("lookup", "forward_backward", "exchange", "worker_cpu", "shards_cpu")), b
        assert b["step"] == pytest.approx(b["lookup"] + b["forward_backward"] + b["exchange"])
        assert set(v["targets"]) == {"wire_over_floor", "rows_per_s", "examples_ratio"}
        assert all(t["met"] in (True, False) for t in v["targets"].values())
    dynamic = result["variants"]["dynamic"]["tables"]
    assert dynamic and all(t["admitted"] == t["rows"] > 0 for t in dynamic)  # rows made by lookups, none evicted
    assert "| fixed |" in run.stdout and "| dynamic |" in run.stdout and "wire / floor" in run.stdout
