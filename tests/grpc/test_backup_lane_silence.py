"""A backup's wait for a record's bytes on the bulk lane, once the record's frame came, counts as its primary's
silence while no byte comes: a primary stopped between the two is taken over after --failover-after, as when
no frame comes (the chaos soak saw such a backup wait out the lane's 30 s instead), and the record the backup
held half of, never acknowledged, is not in its copy. Both ways a record crosses: its frame on the lane ahead
of its bytes (the default), and its frame in the stream (a shard that may keep tables on SSD, --table-dir).
Real processes: two shards and a backup of ps:1 (ps-server --replica-of)."""

import contextlib
import json
import os
import pathlib
import signal
import threading

import pytest
import torch
from helpers import free_port, free_ports, process_state, start_backup, wait_until

from torchps.client import Optimizer, PSClient
from torchps.cluster import Cluster
from torchps.partitioning import NoPartitioner
from torchps.proto import ps_pb2
from torchps.ps_server.failstop import EXIT_CODE
from torchps.worker.local_cluster import LocalCluster

SMALL, BIG = "ls/a", "ls/b"  # round robin, whole: a on ps:0, b on ps:1 (the replicated one)
ARGS = ["--replica-ack-timeout", "60"]  # the primary never drops its backup for a slow ack while the test runs
PROMOTED_SECONDS = 10.0  # the promotion's deadline: well within the lane's own 30 s, well past --failover-after
HEARTBEAT_BYTES = 16  # a ReplicaFrame heartbeat on the wire: HTTP/2 DATA header 9, gRPC prefix 5, message 2


def _socket_buffers() -> int:
    """The most bytes loopback's socket buffers hold for a reader that reads nothing: the largest receive buffer
    and the largest send buffer (net.ipv4.tcp_rmem, tcp_wmem)."""
    return sum(int(pathlib.Path(f"/proc/sys/net/ipv4/tcp_{kind}").read_text().split()[2]) for kind in ("rmem", "wmem"))


def _queued(pid: int, port: int, *, own_port: bool = False, unsent: bool = False) -> int:
    """Bytes on process `pid`'s TCP connections whose other end's port (its own, with `own_port`) is `port`
    (/proc/net/tcp): those that came and it has not read, or with `unsent` those it sent that did not come yet."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    queued = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if int(fields[1 if own_port else 2].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                    queued += int(fields[4].split(":")[0 if unsent else 1], 16)
    return queued


def _shards(tmp_path, flags: list[str]) -> tuple[LocalCluster, str]:
    """Two shards with `flags`, started with their cluster spec (returned)."""
    p0, p1 = free_ports(2)
    spec = json.dumps({"ps": [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"], "worker": ["127.0.0.1:1"]})
    local = LocalCluster(2, ports=[p0, p1], server_args=["--cluster", spec, "--checkpoint-dir", str(tmp_path / "ck"),
                                                          *ARGS, *flags], log_dir=tmp_path)
    local.start()
    return local, spec


def _start_backup(tmp_path, spec: str, primary: str, flags: list[str]):
    """A backup of ps:1 with `flags` following `primary`; (its process, its address)."""
    address = f"127.0.0.1:{free_port()}"
    return start_backup(tmp_path, 1, spec, primary, address, "--insecure", *ARGS, *flags, log="backup.log"), address


def _record(ps) -> ps_pb2.ShardReplicas:
    """ps 0's record of ps:1 (empty if it has none)."""
    layout = ps._fanout.call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t), 10)
    return next((entry for entry in layout.replicas if entry.index == 1), ps_pb2.ShardReplicas())


def _client(spec: str, numel: int, **options) -> PSClient:
    """A client of the variables (BIG of `numel`), whole: BIG's record on ps:1 holds all of it."""
    ps = PSClient(Cluster.from_json(spec), connect_timeout=30, timeout=60, partitioner=NoPartitioner(), **options)
    ps.declare([(SMALL, 16), (BIG, numel * 4)])
    assert ps.placement.shard_of(BIG) == 1
    return ps


def _create(spec: str, numel: int) -> None:
    """Creates the variables (SGD lr 1) before the backup follows, so its base holds them and ps:1 sends no other
    base while the test runs (a compaction's would come on the lane too); with a client of its own, whose
    long call to a shard without a backup keeps its failover watch from asking about that shard for seconds."""
    with _client(spec, numel) as ps:
        ps.create_variables({SMALL: torch.zeros(4), BIG: torch.zeros(numel)}, Optimizer("sgd", lr=1.0))


def _in_sync(ps, backup_address: str) -> None:
    """Waits for ps:1's backup in sync (it wrote its base) with nothing unacknowledged, as ps 0 records it."""
    def in_sync() -> bool:
        status = ps.status(1).replication
        return status.in_sync and status.lag_records == 0 and _record(ps).backup == backup_address

    wait_until(in_sync, 30, "ps:1's backup in sync with nothing unacknowledged")


def _stop(proc) -> None:
    """SIGSTOPs `proc`, returning once the kernel shows it stopped."""
    proc.send_signal(signal.SIGSTOP)
    wait_until(lambda: process_state(proc.pid) in ("T", "t"), 30, f"process {proc.pid} to stop")


@pytest.mark.parametrize("frames", ["on-lane", "in-stream"])
def test_a_primary_stopped_between_a_records_frame_and_its_lane_bytes_is_taken_over(tmp_path, frames):
    """The backup is paused; a push to ps:1 of more than loopback's buffers hold is written there, its frame
    reaches the paused backup's socket and its bytes fill the lane's buffers; then ps:1 is paused and the
    backup resumed: it takes the frame, reads the bytes that came, hears nothing more for --failover-after and
    is promoted. The push, sent again there by the client, is applied once; ps:1 resumed is fenced and stops."""
    numel = _socket_buffers() // 4 + (1 << 20)  # float32: 4 MiB more than the buffers hold
    flags = [] if frames == "on-lane" else ["--table-dir", str(tmp_path / "tables")]
    local, spec = _shards(tmp_path, flags)
    primary, primary_port, backup = local.procs[1], int(local.address(1).rpartition(":")[2]), None
    try:
        _create(spec, numel)
        backup, backup_address = _start_backup(tmp_path, spec, local.address(1), flags)
        with _client(spec, numel, lanes=False) as ps:  # its pushes inline: sent again at once to a new primary
            _in_sync(ps, backup_address)
            ones = {BIG: torch.ones(numel)}
            ps.push(ones)  # the client joins ps:1 with it: the next push waits for nothing the backup did not ack
            _in_sync(ps, backup_address)
            lane_port = ps.status(1).lane_port
            assert lane_port, "ps:1 offers no bulk lane"
            _stop(backup)
            pushed = threading.Thread(target=ps.push, args=(ones,), daemon=True)
            pushed.start()
            # The record's bytes come on the lane (the backup had read every earlier record's): its frame was
            # queued before them, there (on-lane) or in the stream.
            wait_until(lambda: _queued(backup.pid, lane_port) > 0, 30, "the record's bytes on the lane")
            # Then more than two heartbeats' bytes on the stream: the primary sends at most one heartbeat (taken
            # before the record was queued) ahead of a record's frame there, so the frame is there now.
            heard = _queued(backup.pid, primary_port)
            wait_until(lambda: _queued(backup.pid, primary_port) > heard + 2 * HEARTBEAT_BYTES, 30,
                       "the record's frame")
            _stop(primary)
            sent = _queued(backup.pid, lane_port) + _queued(primary.pid, lane_port, own_port=True, unsent=True)
            assert sent < numel * 4, f"the record's {numel * 4} bytes all left ps:1 before it stopped: {sent}"
            backup.send_signal(signal.SIGCONT)
            wait_until(lambda: _record(ps).primary == backup_address, PROMOTED_SECONDS,
                       "ps 0 to promote the backup that waits for a stopped primary's lane bytes")
            pushed.join(60)
            assert not pushed.is_alive(), "the push was not answered by the promoted backup"
            assert torch.equal(ps.pull([BIG])[BIG], torch.full((numel,), -2.0)), "the push was not applied once"
            primary.send_signal(signal.SIGCONT)
            assert primary.wait(timeout=30) == EXIT_CODE, "resumed, the old primary is fenced and stops"
    finally:
        for proc in (primary, backup):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        if backup is not None:
            backup.terminate()
            backup.wait(timeout=30)
        local.stop()
    log = (tmp_path / "backup.log").read_text(errors="replace")
    assert "was due on the bulk lane" in log, log
    on_lane = "the records wholly on the lane" in (tmp_path / "ps1.log").read_text(errors="replace")
    assert on_lane == (frames == "on-lane")
