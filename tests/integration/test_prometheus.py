"""A real Prometheus server (Debian's `prometheus` package) scrapes a shard's --metrics-port and answers a
query about it through its HTTP API: the metrics are what a Prometheus installation actually reads."""

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest
import torch

from torchps.client import Optimizer, PSClient

PROMETHEUS = shutil.which("prometheus")
CAN_INSTALL = shutil.which("apt-get") is not None and os.geteuid() == 0
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is not installed "
                                      "(scripts/install.sh installs it where it runs as root with apt-get, and "
                                      "says why not elsewhere)")
MIB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(port: int, expression: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=10) as reply:
        answer = json.loads(reply.read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


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
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: torchps\n"
                      f"    static_configs:\n      - targets: ['{target}']\n")
    web = _free_port()
    server = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                               f"--web.listen-address=127.0.0.1:{web}"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in server.stdout:  # its log: ready once it says so
            lines.append(line)
            if re.search(r"Server is ready to receive web requests", line):
                break
        else:
            pytest.fail("prometheus ended before it was ready:\n" + "".join(lines[-30:]))
        threading.Thread(target=server.stdout.read, daemon=True).start()  # its later log must not fill the pipe
        deadline = time.monotonic() + 60
        while not (result := _query(web, 'torchps_push_received_bytes_total{job="torchps"}')):
            assert time.monotonic() < deadline, "prometheus never scraped the shard"
            time.sleep(0.5)  # polling its API until the first scrape has landed
        assert float(result[0]["value"][1]) == 2 * MIB
        assert result[0]["metric"]["instance"] == target
        (up,) = _query(web, 'up{job="torchps"}')
        assert up["value"][1] == "1"
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
