"""ps 0's record of a replicated shard through SetReplica, on real processes: every change is counted, an
IN_SYNC that names a count the record has moved past changes nothing, and the count comes back with ps 0's
journal after a SIGKILL."""

import json

from helpers import free_ports

from torchps.client import PSClient
from torchps.cluster import Cluster
from torchps.proto import ps_pb2
from torchps.worker.local_cluster import LocalCluster

_CHANGE = ps_pb2.ReplicaChange


def test_an_in_sync_asked_before_a_drop_it_did_not_see_changes_nothing_and_the_count_outlives_ps0(tmp_path):
    """ps:1's primary read the count, lost its backup and asked DROP naming it, which ps 0 decided before the
    IN_SYNC asked earlier: that IN_SYNC leaves the backup off the record (it could otherwise be promoted over
    the pushes ps:1 then acknowledged alone); the DROP's retry, and a DROP naming no count, change nothing. One
    naming the count now is granted; one naming none is checked as before; ps 0, killed and started on its
    journal, has the same count."""
    ports = free_ports(2)
    spec = json.dumps({"ps": [f"127.0.0.1:{port}" for port in ports], "worker": ["127.0.0.1:1"]})
    cluster, backup = Cluster.from_json(spec), "127.0.0.1:9"
    local = LocalCluster(2, ports=ports, server_args=["--cluster", spec, "--checkpoint-dir", str(tmp_path / "ck")],
                         log_dir=tmp_path)
    local.start()
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            def ask(action, changes=None) -> ps_pb2.ShardReplicas:
                change = _CHANGE(action=action, index=1, primary=cluster.ps[1], backup=backup, changes=changes)
                return ps._fanout.call(0, lambda stub, t: stub.SetReplica(change, timeout=t), 10)

            read = ask(_CHANGE.LEASE, changes=0).changes  # a read of the count
            assert read == 0
            assert ask(_CHANGE.DROP).changes == 0  # nothing to drop, no count named: a repeat
            dropped = ask(_CHANGE.DROP, changes=read)  # the count it read: counted, an IN_SYNC naming it refused
            assert (dropped.backup, dropped.changes) == ("", 1)
            assert ask(_CHANGE.DROP, changes=read).changes == 1  # its retry waits for nothing
            stale = ask(_CHANGE.IN_SYNC, changes=read)
            assert (stale.backup, stale.changes) == ("", 1)
            granted = ask(_CHANGE.IN_SYNC, changes=1)
            assert (granted.backup, granted.changes) == (backup, 2)
            assert ask(_CHANGE.IN_SYNC, changes=read).backup == backup  # a stale repeat: nothing changes
            assert ask(_CHANGE.DROP).changes == 3
            assert (ask(_CHANGE.IN_SYNC).backup, ask(_CHANGE.DROP).changes) == (backup, 5)  # unchecked
        local.kill_ps(0)
        local.start_ps(0)
        with PSClient(cluster, connect_timeout=30) as ps:
            entry = ps._fanout.call(0, lambda stub, t: stub.SetReplica(
                _CHANGE(action=_CHANGE.LEASE, index=1, primary=cluster.ps[1]), timeout=t), 10)
            assert (entry.primary, entry.backup, entry.changes) == (cluster.ps[1], "", 5)
    finally:
        local.stop()
