"""A replicated shard's figures (issue #40): GetStatus's `replication`, the Prometheus gauges and ps 0's failovers,
and `ps-admin layout`'s line per replicated shard, before and after a failover. Real processes: two shards and a
backup of ps:1 (ps-server --replica-of), as tests/grpc/test_replication.py starts them."""

import calendar
import json
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import torch
from helpers import free_ports, start_backup, wait_until
from prometheus_client.parser import text_string_to_metric_families

from torchps.client import Optimizer, PSClient
from torchps.cluster import Cluster
from torchps.proto import ps_pb2
from torchps.worker.local_cluster import LocalCluster

PS_ADMIN = str(pathlib.Path(sys.executable).with_name("ps-admin"))  # the console script, as a user runs it
SHAPES = {"rs/a": (256,), "rs/b": (1000,)}  # round robin: a on ps:0, b on ps:1 (the replicated one)
# The primary's wait for an ack: long, so a backup paused by the test is never lost however loaded the machine.
ARGS = ["--metrics-port", "0", "--replica-ack-timeout", "60"]


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def _layout(spec: str) -> list[str]:
    shown = subprocess.run([PS_ADMIN, "layout", "--cluster", spec, "--insecure"], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout.splitlines()


def _record(ps) -> ps_pb2.ShardReplicas:
    """ps 0's record of ps:1 (empty if it has none)."""
    layout = ps._fanout.call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t), 10)
    return next((entry for entry in layout.replicas if entry.index == 1), ps_pb2.ShardReplicas())


def _in_sync(ps, backup: str) -> ps_pb2.ReplicationStatus | None:
    """ps:1's ReplicationStatus once `backup` follows it in sync with nothing unacknowledged and ps 0 records it."""
    status = ps.status(1).replication
    if status.backup == backup and status.in_sync and status.lag_records == 0 and _record(ps).backup == backup:
        return status
    return None


def test_status_metrics_and_ps_admin_show_the_backup_its_lag_and_the_failover(tmp_path):
    """ps:1's GetStatus and metrics name its backup in sync with no lag once pushes are acknowledged, and a lag
    while the backup is paused (SIGSTOP) under a push; ps:1 killed, its backup promoted: ps-admin layout shows
    the backup as ps:1's primary with no backup and one failover, and ps 0 counts it."""
    p0, p1, pb = free_ports(3)
    spec = json.dumps({"ps": [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"], "worker": ["127.0.0.1:1"]})
    local = LocalCluster(2, ports=[p0, p1], server_args=["--cluster", spec, "--checkpoint-dir", str(tmp_path / "ck"),
                                                          *ARGS], log_dir=tmp_path)
    local.start()
    backup_address = f"127.0.0.1:{pb}"
    backup = start_backup(tmp_path, 1, spec, local.address(1), backup_address, "--insecure", *ARGS, log="backup.log")
    try:
        with PSClient(Cluster.from_json(spec), connect_timeout=30) as ps:
            ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
            assert ps.status(0).replication == ps_pb2.ReplicationStatus()  # ps 0 has no backup, never had one
            ps.push({n: torch.ones(s) for n, s in SHAPES.items()})
            synced = wait_until(lambda: _in_sync(ps, backup_address), 30, "ps:1's backup in sync, no lag")
            assert (synced.lag_records, synced.lag_seconds, synced.feeds_opened, synced.feeds_lost) == (0, 0.0, 1, 0)
            port0, port1 = ps.status(0).metrics_port, ps.status(1).metrics_port
            shown = _metrics(port1)
            assert (shown["torchps_replication_backup"], shown["torchps_replication_lag_records"],
                    shown["torchps_replication_lag_seconds"]) == (1, 0, 0)
            assert (_metrics(port0)["torchps_replication_backup"], _metrics(port0)["torchps_failovers_total"]) == (0, 0)

            backup.send_signal(signal.SIGSTOP)  # the next push waits for the paused backup's ack
            pushed = threading.Thread(target=ps.push, args=({"rs/b": torch.ones(1000)},))
            pushed.start()
            lagging = wait_until(lambda: (lambda r: r.lag_records and r)(ps.status(1).replication), 30,
                                 "ps:1 to wait for its paused backup")
            assert lagging.in_sync and lagging.lag_records >= 1 and lagging.lag_seconds > 0
            assert _metrics(port1)["torchps_replication_lag_records"] >= 1
            assert pushed.is_alive(), "a push is acknowledged only once the backup wrote it"
            backup.send_signal(signal.SIGCONT)
            pushed.join(30)
            assert not pushed.is_alive()

            # In sync again: the backup, paused past --failover-after, may have ended its stream and followed anew.
            wait_until(lambda: _in_sync(ps, backup_address), 30, "ps:1's backup in sync again")
            lines = _layout(spec)
            assert len(lines) == 4 and lines[3].startswith(
                f"  ps:1 replicated: primary {local.address(1)}, backup {backup_address}, lag "), lines
            assert lines[3].endswith("; failovers 0"), lines

            # Once more: a stream the pause ended just after the first look would show by now (ps 0 promotes only
            # the backup in sync).
            wait_until(lambda: _in_sync(ps, backup_address), 30, "ps:1's backup in sync before ps:1 is killed")
            local.kill_ps(1)
            wait_until(lambda: _record(ps).primary == backup_address, 30, "ps 0 to promote ps:1's backup")
            promoted = time.time()
            lines = _layout(spec)
            assert len(lines) == 4 and lines[:3] == ["layout epoch 0: 2 shards", f"  ps:0 {local.address(0)}: 1 variables, 1,024 bytes",
                                 f"  ps:1 {backup_address}: 1 variables, 4,000 bytes"], lines
            found = re.fullmatch(rf"  ps:1 replicated: primary {backup_address}, backup none, lag 0 records, 0\.00 s; "
                                 r"failovers 1, the last at (\S+ \S+) UTC", lines[3])
            assert found, lines
            when = calendar.timegm(time.strptime(found.group(1), "%Y-%m-%d %H:%M:%S"))
            assert promoted - 60 < when <= promoted, (found.group(1), promoted)
            assert _metrics(port0)["torchps_failovers_total"] == 1
            assert torch.equal(ps.pull(["rs/b"])["rs/b"], torch.full((1000,), -2.0))
    finally:
        if backup.poll() is None:
            backup.send_signal(signal.SIGCONT)
            backup.terminate()
        backup.wait(timeout=30)
        local.stop()
