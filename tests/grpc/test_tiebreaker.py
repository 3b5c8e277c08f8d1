"""ps 2 breaks the tie between ps 0 and ps 1, each the other's arbiter (deposals.py): each promotes the other's
backup only once ps 2 recorded the primary it replaces deposed, and one ps 2 records deposed promotes nothing.
Real processes: a job of three shards, ps 0 and ps 1 each with a backup (one test starts ps 0's later)."""

import json
import re

import grpc
import torch
from helpers import free_ports, start_backup, stopped, wait_until

from torchps.client import Optimizer, PSClient
from torchps.cluster import Cluster
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server.backup import arbiter_channels, record_of
from torchps.security import INSECURE
from torchps.worker.local_cluster import LocalCluster

SHAPES = {"tie/a": (64, 33), "tie/b": (1000,), "tie/c": (7,)}  # round robin: one on each shard


def _start(tmp_path, backed=(0, 1)):
    """Three shards and a backup of each of ps 0 and ps 1 (those `backed`); (local, backups, their addresses,
    cluster)."""
    *ports, b0, b1 = free_ports(5)
    spec = {"ps": [f"127.0.0.1:{port}" for port in ports], "worker": ["127.0.0.1:1"]}
    local = LocalCluster(3, ports=ports, server_args=["--cluster", json.dumps(spec), "--checkpoint-dir",
                                                      str(tmp_path / "ck")], log_dir=tmp_path)
    local.start()
    cluster = Cluster.from_json(json.dumps(spec))
    addresses = [f"127.0.0.1:{b0}", f"127.0.0.1:{b1}"]
    return local, [_backup(tmp_path, cluster, addresses, index) for index in backed], addresses, cluster


def _backup(tmp_path, cluster, addresses, index: int):
    """Starts the backup of shard `index` (0 or 1), bound to addresses[index]."""
    return start_backup(tmp_path, index, json.dumps(cluster.to_dict()), cluster.ps[index], addresses[index],
                        "--insecure")


def _stop(local, backups) -> None:
    for backup in backups:
        if backup.poll() is None:
            backup.terminate()
            backup.wait(timeout=30)
    local.stop()


def _in_sync(cluster, addresses, shards=(0, 1)) -> None:
    """Waits for ps 0 to record ps 1's backup in sync, and ps 1 ps 0's (of `shards`)."""
    arbiters = arbiter_channels(tuple(cluster.ps), 10, INSECURE)
    try:
        for shard in shards:
            wait_until(lambda: record_of(arbiters, shard) == (cluster.ps[shard], addresses[shard]), 30,
                       f"ps:{shard}'s backup in sync")
    finally:
        arbiters.close()


def _pushed_once(ps, cluster, addresses) -> dict:
    """Creates SHAPES' variables (zeros, SGD lr 1), waits for both backups in sync, and pushes ones once; the
    ones, to push again."""
    ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
    _in_sync(cluster, addresses)
    grads = {n: torch.ones(s) for n, s in SHAPES.items()}
    ps.push(grads)
    return grads


def _assert_values(ps, value: float) -> None:
    """Every variable of SHAPES is `value` throughout (minus the pushes of ones counted)."""
    values = ps.pull(SHAPES)
    assert all(torch.equal(values[n], torch.full(s, value)) for n, s in SHAPES.items())


def _depose(cluster, index: int, primary: str, successor: str, asker: str, grant: str = "staged"
            ) -> ps_pb2.ShardReplicas:
    """A raw DEPOSE at ps 2 (failovers 0), as the arbiter serving at `asker` asks it under the name `grant`."""
    with grpc.insecure_channel(cluster.ps[2]) as channel:
        return ps_pb2_grpc.ParameterServerStub(channel).SetReplica(ps_pb2.ReplicaChange(
            action=ps_pb2.ReplicaChange.DEPOSE, index=index, primary=primary, failovers=0, backup=successor,
            asker=asker, grant=grant), timeout=30)


def test_ps_1_then_ps_0_fail_over_each_deposed_at_ps_2_first(tmp_path):
    """ps 1's primary killed: ps 0 has ps 2 depose it, then promotes its backup; then ps 0's: the promoted ps 1,
    at its own address, is no deposed primary, so ps 2 grants its deposal of ps 0. Every push counted once."""
    local, backups, addresses, cluster = _start(tmp_path)
    try:
        with PSClient(cluster, connect_timeout=60) as ps:
            grads = _pushed_once(ps, cluster, addresses)
            local.kill_ps(1)
            ps.push(grads)
            local.kill_ps(0)
            ps.push(grads)
            _assert_values(ps, -3.0)
    finally:
        _stop(local, backups)
    log = local.log(2)
    assert f"records ps:1: {{'action': 'depose', 'index': 1, 'primary': '{cluster.ps[1]}'" in log
    assert f"'asker': '{addresses[1]}'" in log, "the promoted ps 1 deposed ps 0"


def test_an_arbiter_ps_2_records_deposed_promotes_nothing(tmp_path):
    """ps 1 deposed ps 0 at ps 2 first (the other side of a cut that parts ps 0 from ps 1): ps 1's primary
    killed, ps 0 asks ps 2 to depose it and is refused, so ps 1's backup is not promoted (it goes on following
    ps 1, which behind a cut still runs) and ps 0's record still names the old primary."""
    local, backups, addresses, cluster = _start(tmp_path)
    try:
        with PSClient(cluster, connect_timeout=60) as ps:
            ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
            _in_sync(cluster, addresses)
            staged = _depose(cluster, 0, cluster.ps[0], addresses[0], cluster.ps[1])
            assert (staged.primary, staged.failovers, staged.backup) == (cluster.ps[0], 0, addresses[0])
            local.kill_ps(1)
            wait_until(lambda: "may not promote ps:1's backup" in (tmp_path / "backup-1.log").read_text(), 60,
                       "ps 1's backup to be refused its promotion (ps 0 deposed)")
            arbiters = arbiter_channels(tuple(cluster.ps), 10, INSECURE)
            try:
                assert record_of(arbiters, 1) == (cluster.ps[1], addresses[1]), "no promotion was recorded"
            finally:
                arbiters.close()
    finally:
        _stop(local, backups)
    assert "'action': 'promote'" not in local.log(0)


def test_losing_ps_1_and_ps_0s_backup_at_once_fails_ps_1_over_through_ps_2(tmp_path):
    """A host that ran ps 1 and ps 0's backup lost: ps 0 journals its ask of ps 2 and decides the promotion of ps
    1's backup, neither written by its own lost backup (only ps 1, its arbiter, could drop it): both go on past
    it, as in a two-shard job, and every push counts once."""
    local, backups, addresses, cluster = _start(tmp_path)
    try:
        with PSClient(cluster, connect_timeout=60) as ps:
            grads = _pushed_once(ps, cluster, addresses)
            backups[0].kill()
            local.kill_ps(1)
            backups[0].wait(timeout=30)
            ps.push(grads)
            _assert_values(ps, -2.0)
    finally:
        _stop(local, backups)
    assert f"records ps:1: {{'action': 'depose', 'index': 1, 'primary': '{cluster.ps[1]}'" in local.log(2)


def test_an_arbiter_killed_with_a_grant_pending_takes_it_back_once_restarted_so_its_own_backup_can_take_over(
        tmp_path):
    """ps 2 is down when ps 0 asks it to depose ps 1's paused primary: ps 0 cannot tell whether ps 2 granted
    it, cannot take it back either, and is killed with the ask pending in its journal. ps 2, started again,
    then holds the grant (ps 0's DEPOSE, delivered late, as when only its answer was lost), which names ps 1,
    serving again, deposed. ps 0, started again on its folder, takes the grant back, so ps 1 promotes ps 0's
    backup through ps 2 once ps 0 is killed again; every push counts once."""
    local, backups, addresses, cluster = _start(tmp_path, backed=(1,))
    try:
        with PSClient(cluster, connect_timeout=60) as ps:
            ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
            _in_sync(cluster, addresses, shards=(1,))
            grads = {n: torch.ones(s) for n, s in SHAPES.items()}
            ps.push(grads)
            local.kill_ps(2)
            with stopped(local.procs[1]):  # ps 1's backup asks ps 0 for its promotion
                pending = r"ps 0 could not take back at ps:2 its deposal of ps:1's primary \S+ \(ask (\w+)\)"
                wait_until(lambda: re.search(pending, local.log(0)), 60, "ps 0 to hold an ask it cannot take back")
                grant = re.search(pending, local.log(0))[1]
                local.kill_ps(0)
            local.start_ps(2)
            late = _depose(cluster, 1, cluster.ps[1], addresses[1], cluster.ps[0], grant)
            assert (late.primary, late.backup) == (cluster.ps[1], addresses[1]), "ps 2 holds the grant"
            local.start_ps(0)
            wait_until(lambda: f"'action': 'reinstate', 'index': 1, 'grant': '{grant}'" in local.log(2), 60,
                       "ps 0, started again, to take its grant back")
            backups.append(_backup(tmp_path, cluster, addresses, 0))
            _in_sync(cluster, addresses, shards=(0,))
            local.kill_ps(0)
            ps.push(grads)
            _assert_values(ps, -2.0)
    finally:
        _stop(local, backups)
    assert f"records ps:0: {{'action': 'depose', 'index': 0, 'primary': '{cluster.ps[0]}'" in local.log(2)
