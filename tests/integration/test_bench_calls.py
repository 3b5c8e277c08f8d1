"""bench/calls.py's smoke run: a few hundred tiny calls of each kind, torchps's and gRPC's floor, every figure
written."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_calls_benchmark_times_tiny_calls_beside_grpc_s_floor(tmp_path):
    out = tmp_path / "calls.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "calls.py"), "--calls", "100", "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    for figures in [*result["torchps"].values(), result["grpc_aio_floor"], result["grpc_sync_floor"]]:
        assert set(figures) == {"wall_ms", "client_cpu_ms", "server_cpu_ms"}
        assert figures["wall_ms"] > 0 and figures["server_cpu_ms"] > 0, figures
    assert set(result["torchps"]) == {"push", "pull", "exchange", "push_200_variables"}
    assert "| torchps push |" in run.stdout and "target push_shard_cpu_ms <= 0.3" in run.stdout
