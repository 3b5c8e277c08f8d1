"""A real Prometheus server (Debian's `prometheus` package) scrapes a shard's --metrics-port and answers a
query about it through its HTTP API: the metrics are what a Prometheus installation actually reads."""

import os
import pathlib
import shutil

import pytest
import torch

from helpers import PROMETHEUS, needs_prometheus, prometheus, prometheus_query, wait_until
from torchps.client import Optimizer, PSClient

CAN_INSTALL = shutil.which("apt-get") is not None and os.geteuid() == 0
MIB = 1 << 20


@pytest.mark.skipif(not CAN_INSTALL, reason="scripts/install.sh installs prometheus as root with apt-get only")
def test_install_sh_installed_prometheus_with_its_service_left_stopped():
    """Where install.sh ran as root with apt-get (Debian and Docker images ship a /usr/sbin/policy-rc.d of
    their own), Prometheus is installed and Debian's service for it is not running."""
    assert PROMETHEUS is not None, "scripts/install.sh ran here as root with apt-get and left prometheus out"
    services = [pid for pid in os.listdir("/proc") if pid.isdigit() and _is_the_packaged_service(pid)]
    assert not services, f"Debian's prometheus service runs (pids {services}): install.sh let it start"


def _is_the_packaged_service(pid: str) -> bool:
    """True if process `pid` is prometheus run with the package's own configuration (the service's)."""
    try:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[0].endswith(b"prometheus") and not any(a.startswith(b"--config.file=") and b"/etc/" not in a
                                                       for a in argv)


@needs_prometheus
def test_prometheus_scrapes_a_shard_and_answers_a_query(local_cluster, tmp_path):
    local = local_cluster(1, server_args=["--metrics-port", "0"])
    with PSClient(local.cluster) as ps:
        ps.create_variables({"w": torch.zeros(MIB // 4)}, Optimizer("sgd", lr=0.1))
        for _ in range(2):
            ps.push({"w": torch.ones(MIB // 4)})
        target = f"127.0.0.1:{ps.status(0).metrics_port}"
    with prometheus([target], tmp_path) as web:
        result = wait_until(lambda: prometheus_query(web, 'torchps_push_received_bytes_total{job="torchps"}'), 60,
                            "prometheus to scrape the shard", interval=0.5)  # polling its API
        assert float(result[0]["value"][1]) == 2 * MIB
        assert result[0]["metric"]["instance"] == target
        (up,) = prometheus_query(web, 'up{job="torchps"}')
        assert up["value"][1] == "1"
