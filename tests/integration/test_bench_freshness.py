"""bench/freshness.py on its quick setting: a DLRM trained online on a drifting click stream, two ps-serve replicas
following it, one held at the end of day 1; each hour of day 2 scored with both. And its stream: the drift
turns the click model's effects from one draw into the other, and the churn moves the popular ids."""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("freshness_bench", ROOT / "bench" / "freshness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stream_drifts_from_one_draw_to_the_other_and_a_stationary_one_does_not():
    bench = _bench()
    stream = bench.DriftingClicks([500, 100], 1.05, 3, drift_hours=4, churn=0.1)
    start, middle, end = stream.at(0), stream.at(2), stream.at(4)
    for t in range(2):
        assert np.allclose(start.effects[t], stream.start.effects[t])
        assert np.allclose(end.effects[t], stream.end.effects[t])
        assert np.allclose(middle.effects[t], (stream.start.effects[t] + stream.end.effects[t]) / math.sqrt(2))
        assert np.array_equal(end.permutations[t], np.roll(stream.start.permutations[t], int(0.4 * (500, 100)[t])))
    still = bench.DriftingClicks([500, 100], 1.05, 3, drift_hours=math.inf, churn=0.0).at(9)
    assert all(np.array_equal(a, b) for a, b in zip(still.effects, stream.start.effects))
    assert all(np.array_equal(a, b) for a, b in zip(still.permutations, stream.start.permutations))


def test_the_quick_freshness_benchmark_scores_each_hour_with_the_fresh_and_the_held_version(tmp_path):
    out = tmp_path / "freshness.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "freshness.py"), "--quick", "--no-control",
                          "--json", str(out)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    drifting = result["drifting"]
    hours = drifting["hours"]
    assert [h["hour"] for h in hours] == [3, 4], "day 2 of two 2-hour days: each hour's next scored"
    steps_per_hour = math.ceil(3000 / 256)
    assert drifting["daily_step"] == 2 * steps_per_hour, "held at the end of day 1"
    assert all(h["daily_step"] == drifting["daily_step"] for h in hours), "the held replica kept its version"
    assert [h["fresh_step"] for h in hours] == [3 * steps_per_hour, 4 * steps_per_hour], "caught up each hour"
    for h in hours:
        assert 0.5 < h["oracle_auc"] < 1 and 0 < h["fresh_auc"] < h["oracle_auc"] and 0 < h["daily_auc"] < 1, h
    assert result["fresh_minus_daily"] == drifting["fresh_auc"] - drifting["daily_auc"]
    assert set(result["targets"]) == {"fresh_auc > daily_auc"} and "stationary" not in result
    assert "drifting stream:" in run.stdout and "target fresh_auc > daily_auc" in run.stdout
