"""ps-server --metrics-port: Prometheus's text format over HTTP, parsed with prometheus_client's own parser,
with figures that match what the test did to the shard."""

import subprocess
import sys
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from torchps.client import Optimizer, PSClient, UnknownVariableError

MIB = 1 << 20


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if not sample.labels or sample.name.endswith(("_count", "_sum"))}


def test_a_shard_serves_its_figures_to_prometheus(local_cluster):
    local = local_cluster(1, server_args=["--metrics-port", "0"])
    with PSClient(local.cluster) as ps:
        ps.create_variables({"w": torch.zeros(MIB // 4)}, Optimizer("adam", lr=1e-3))
        for _ in range(3):
            ps.push({"w": torch.ones(MIB // 4)})
        ps.pull(["w"])
        status = ps.status(0)
    assert status.metrics_port > 0
    metrics = scrape(status.metrics_port)
    assert metrics["torchps_push_seconds_count"] == 3 and metrics["torchps_push_seconds_sum"] > 0
    assert metrics["torchps_apply_seconds_count"] == 3
    assert metrics["torchps_push_received_bytes_total"] == 3 * MIB
    assert metrics["torchps_pull_sent_bytes_total"] >= MIB
    assert metrics["torchps_values_bytes"] == MIB and metrics["torchps_optimizer_state_bytes"] == 2 * MIB
    assert metrics["torchps_variables"] == 1 and metrics["torchps_step"] == 3
    assert metrics["torchps_resident_bytes"] > 10 * MIB
    assert metrics["torchps_push_staleness_steps_count"] == 3
    assert "torchps_checkpoint_age_seconds" not in metrics  # no checkpoint yet


def test_a_shard_without_the_flag_serves_no_metrics(client):
    assert client.status(0).metrics_port == 0


def test_a_bad_metrics_port_is_one_line_and_exit_2():
    run = subprocess.run([sys.executable, "-m", "torchps.ps_server", "--index", "0", "--bind", "127.0.0.1:0",
                          "--insecure", "--metrics-port", "70000"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().count("\n") == 0 and "--metrics-port: not a port" in run.stderr


def test_a_checkpoint_save_is_timed_and_its_age_shown(local_cluster, tmp_path):
    local = local_cluster(1, server_args=["--metrics-port", "0", "--checkpoint-dir", str(tmp_path)])
    with PSClient(local.cluster) as ps:
        ps.create_variables({"w": torch.zeros(1024)}, Optimizer("sgd", lr=0.1))
        ps.save_checkpoint(0)
        metrics = scrape(ps.status(0).metrics_port)
    assert metrics["torchps_checkpoint_save_seconds_count"] == 1
    assert 0 <= metrics["torchps_checkpoint_age_seconds"] < 600


def test_a_shard_serves_its_failed_calls_journal_waits_layout_lanes_and_process(local_cluster, tmp_path):
    """The figures the Grafana dashboard (deploy/grafana/torchps.json) shows besides the ones above: failed
    calls by method and code, the time acknowledged changes waited for the journal, the layout epoch, ps 0's
    resize state, open bulk lanes, and the process's start time and CPU."""
    local = local_cluster(1, server_args=["--metrics-port", "0", "--checkpoint-dir", str(tmp_path)])
    with PSClient(local.cluster) as ps:
        ps.create_variables({"w": torch.zeros(1024)}, Optimizer("sgd", lr=0.1))
        ps.push({"w": torch.ones(1024)})
        ps.declare({"nothing": torch.zeros(4)})  # placed by this client, never created: the shard says NOT_FOUND
        with pytest.raises(UnknownVariableError):
            ps.pull(["nothing"])
        port = ps.status(0).metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(reply.read().decode()) for s in f.samples}
    assert samples["torchps_calls_failed_total", (("code", "NOT_FOUND"), ("method", "Pull"))] == 1
    assert samples["torchps_journal_wait_seconds_count", ()] >= 2  # the creation's record and the push's
    assert samples["torchps_layout_epoch", ()] == 0 and samples["torchps_resize_running", ()] == 0
    assert samples["torchps_open_lanes", ()] >= 0
    assert samples["process_start_time_seconds", ()] > 0 and samples["process_cpu_seconds_total", ()] > 0
