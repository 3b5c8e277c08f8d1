"""bench/dataplane.py --smoke: torchps's no-compute workers (exchange() alone) on the seed MLP inside a network
namespace of its own whose loopback is shaped to 1 Gbit/s, every process's CPU and the wire's bytes per step in
the JSON. Skipped, saying why, where the machine does not permit the namespace or the shaping."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from network import probe  # noqa: E402 - bench/ is not a package


def test_dataplane_smoke_times_the_exchange_alone_behind_a_shaped_loopback(tmp_path):
    problem = probe()
    if problem:
        pytest.skip(problem)
    out = tmp_path / "dataplane.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "dataplane.py"), "--smoke", "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    (record,) = result["rounds"]
    assert record["setup"] == "1ps" and "1Gbit" in record["result"]["qdisc"]
    assert record["result"]["compute"] is False and record["result"]["last_loss"] != record["result"]["last_loss"]
    run_medians = result["medians"]["1ps/1gbit/fp32"]
    assert run_medians["steps_per_s"] > 0
    assert set(run_medians["cpu_ms_per_step_each"]) == {"ps-0", "worker-0", "worker-1"}
    assert run_medians["cpu_ms_per_step"] == pytest.approx(sum(run_medians["cpu_ms_per_step_each"].values()))
    assert run_medians["wire_over_2x_model"] > 0.9, "each step moved the seed MLP each way"
    assert result["1ps_1gbit_ratio_fp32"] is None and result["targets"]["1ps_none_ratio_fp32"]["met"] is None
    assert "| 1ps | 1gbit | torchps fp32 |" in run.stdout
