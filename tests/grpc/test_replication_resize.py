"""Replicated shards and live resizes compose: a resize after a failover names each shard where it is served; a
shard a resize adds gets a backup ps 0 records and promotes; a resize that removes a backed-up shard stops its
backup; a checkpoint taken after a failover restores onto another shard count. Real processes."""

import json
import shutil

import pytest
import torch
from helpers import free_ports, start_backup, wait_until

from torchps.client import Optimizer, PSClient
from torchps.errors import ReplicaFencedError
from torchps.proto import ps_pb2
from torchps.ps_server.checkpoint import step_dir
from torchps.ps_server.journal import recorded_layout
from torchps.worker.local_cluster import LocalCluster

SHAPES = {f"rr/v{i}": (256,) for i in range(6)}  # round robin: v0, v2, v4 on ps 0; v1, v3, v5 on ps 1
DRAIN_SECONDS = 0.2  # a removed shard answers LayoutChangedError this long (no client here needs longer)


def _spec(ports) -> str:
    return json.dumps({"ps": [f"127.0.0.1:{p}" for p in ports], "worker": ["127.0.0.1:1"]})


def _backup(tmp_path, index: int, spec: str, primary: str, port: int, *extra: str) -> tuple:
    """ps-server --replica-of `primary` for shard `index`, serving at 127.0.0.1:`port` once promoted."""
    address = f"127.0.0.1:{port}"
    process = start_backup(tmp_path, index, spec, primary, address, "--insecure", *extra)
    return process, address


def _stopped(process) -> None:
    if process.poll() is None:
        process.terminate()
        process.wait(timeout=30)


def _layout(ps: PSClient, shard: int = 0) -> ps_pb2.Layout:
    return ps._fanout.call(shard, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t), 10)


def _record(ps: PSClient, index: int):
    """ps 0's record of shard `index` (None if it has none)."""
    return next((entry for entry in _layout(ps).replicas if entry.index == index), None)


def _in_sync(ps: PSClient, index: int, backup: str) -> None:
    wait_until(lambda: (entry := _record(ps, index)) is not None and entry.backup == backup, 30,
               f"ps 0 to record ps:{index}'s backup {backup} in sync")


def _pushes(ps: PSClient, count: int) -> None:
    grads = {name: torch.ones(shape) for name, shape in SHAPES.items()}
    for _ in range(count):
        ps.push(grads)


def _assert_values(ps: PSClient, pushes: int) -> None:
    values = ps.pull(SHAPES)
    for name, shape in SHAPES.items():
        assert torch.equal(values[name], torch.full(shape, -float(pushes))), (name, values[name][:3])


def _job(tmp_path, ports) -> LocalCluster:
    """Shards 0 and 1 of a job on `ports` (journals and checkpoints under tmp_path/ck), started."""
    local = LocalCluster(2, ports=list(ports), log_dir=tmp_path,
                         server_args=["--cluster", _spec(ports), "--checkpoint-dir", str(tmp_path / "ck")])
    local.start()
    return local


def _add_shard(local: LocalCluster, tmp_path, ports) -> str:
    """Shard 2 of the job on `ports` (ps 0, 1, 2), started empty for a resize (--join)."""
    return local.add_ps(2, port=ports[2], args=["--cluster", _spec(ports), "--checkpoint-dir", str(tmp_path / "ck"),
                                                "--join"])


def _create(ps: PSClient) -> None:
    ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))


def _lose_host(local: LocalCluster, tmp_path, index: int) -> None:
    """Kills ps:`index`'s primary and deletes its journal folder: its host is lost."""
    local.kill_ps(index)
    shutil.rmtree(tmp_path / "ck" / "journal" / f"ps-{index}")


def _fail_over_ps_1(ps: PSClient, local: LocalCluster, tmp_path, backup_address: str) -> None:
    """Creates the variables, waits for ps:1's backup to be in sync and pushes twice; kills ps:1 and deletes its
    folder (its host is lost) and pushes twice more, served by the promoted backup."""
    _create(ps)
    _in_sync(ps, 1, backup_address)
    _pushes(ps, 2)
    _lose_host(local, tmp_path, 1)
    _pushes(ps, 2)
    assert _record(ps, 1).primary == backup_address


def test_a_failover_then_a_live_resize_names_each_shard_where_it_is_served(tmp_path):
    """ps:1's primary is lost and its backup takes over; the job then grows from 2 to 3 shards, asked for by the
    cluster spec's addresses: every epoch names ps:1 at its backup's address, variables move off it, and a
    client that starts from the spec follows; every value is exactly minus the pushes made."""
    p0, p1, p2, pb = free_ports(4)
    local = _job(tmp_path, (p0, p1))
    backup, backup_address = _backup(tmp_path, 1, _spec((p0, p1)), local.address(1), pb)
    try:
        with PSClient(local.cluster, connect_timeout=30, partitioner=None) as ps:
            _fail_over_ps_1(ps, local, tmp_path, backup_address)
            added = _add_shard(local, tmp_path, (p0, p1, p2))
            report = ps.resize([*local.cluster.ps, added])
            assert (report.shards_before, report.shards_after, report.moved) == (2, 3, 2), report
            assert ps.shard_addresses() == [local.address(0), backup_address, added]
            assert [list(_layout(ps, shard).addresses) for shard in range(3)] == \
                [[local.address(0), backup_address, added]] * 3
            _pushes(ps, 2)
            _assert_values(ps, 6)
            assert {info.spec.name: info.version for info in ps.list_variables()} == {n: 6 for n in SHAPES}
        with PSClient(local.cluster, connect_timeout=30, partitioner=None) as reader:  # ps:1 at its old address
            assert reader.shard_addresses() == [local.address(0), backup_address, added]  # follows the layout first
            reader.declare({n: torch.zeros(s) for n, s in SHAPES.items()})
            _assert_values(reader, 6)
    finally:
        _stopped(backup)
        local.stop()


def _grown(tmp_path, ports) -> tuple:
    """A job on ports[0:2], and its shard 2 (on ports[2]) with a backup (on ports[3]), started for a resize that
    adds it."""
    local = _job(tmp_path, ports[:2])
    spec = _spec(ports[:3])
    added = _add_shard(local, tmp_path, ports[:3])
    backup, backup_address = _backup(tmp_path, 2, spec, added, ports[3])
    return local, backup, backup_address


def test_a_shard_a_resize_adds_gets_a_backup_that_takes_over(tmp_path):
    """ps:2 and its backup start before the resize that adds ps:2: ps 0 records the backup in sync once its
    layout epoch names ps:2 (an IN_SYNC before it is asked again); ps:2's primary is lost after the resize, and
    its backup serves every push acknowledged."""
    ports = free_ports(4)
    local, backup, backup_address = _grown(tmp_path, ports)
    try:
        with PSClient(local.cluster, connect_timeout=30, partitioner=None) as ps:
            _create(ps)
            _pushes(ps, 2)
            report = ps.resize([*local.cluster.ps, local.address(2)])
            assert report.shards_after == 3 and report.moved == 2
            _in_sync(ps, 2, backup_address)
            _pushes(ps, 2)
            _lose_host(local, tmp_path, 2)
            _pushes(ps, 2)
            _assert_values(ps, 6)
            entry = _record(ps, 2)
            assert (entry.primary, entry.backup, entry.failovers) == (backup_address, "", 1)
            assert ps.shard_addresses()[2] == backup_address
    finally:
        _stopped(backup)
        local.stop()
    assert "this backup serves it" in (tmp_path / "backup-2.log").read_text()


def test_a_backup_given_the_spec_before_a_resize_takes_over_after_it(tmp_path):
    """A live resize adds ps:2; then ps:1's backup starts with the job's spec from before it (2 shards: a pod
    started again with the spec it was first given), and its copy, from a base of its primary's, is of the
    3-shard job. ps:1's primary is lost: the promoted backup serves from that copy, whatever its own spec says (a
    shard started by hand must be given the job's new spec; a backup promoted cannot be), and no acknowledged
    push is lost."""
    ports = free_ports(4)
    local = _job(tmp_path, ports[:2])
    backup = None
    try:
        added = _add_shard(local, tmp_path, ports[:3])
        with PSClient(local.cluster, connect_timeout=30, partitioner=None) as ps:
            _create(ps)
            _pushes(ps, 2)
            ps.resize([*local.cluster.ps, added])
            backup, backup_address = _backup(tmp_path, 1, _spec(ports[:2]), local.address(1), ports[3])
            _in_sync(ps, 1, backup_address)
            _pushes(ps, 2)
            _lose_host(local, tmp_path, 1)
            _pushes(ps, 2)
            _assert_values(ps, 6)
            assert _record(ps, 1).primary == backup_address and ps.shard_addresses()[1] == backup_address
    finally:
        if backup is not None:
            _stopped(backup)
        local.stop()
    assert "this backup serves it" in (tmp_path / "backup-1.log").read_text()


def test_a_backup_that_followed_across_a_resize_is_started_again_with_the_new_spec(tmp_path):
    """ps:1's backup follows through a live resize that adds ps:2: its copy is then of the 3-shard job, as its
    primary's journal is (the copy's layout.json). ps:1's primary is lost and the backup promoted; stopped and
    started again with its command and the job's new spec, as an operator would after the resize, it serves
    ps:1 from its copy once its arbiter confirms it, and no acknowledged push is lost."""
    ports = free_ports(4)
    local = _job(tmp_path, ports[:2])
    backup, backup_address = _backup(tmp_path, 1, _spec(ports[:2]), local.address(1), ports[3])
    try:
        added = _add_shard(local, tmp_path, ports[:3])
        with PSClient(local.cluster, connect_timeout=30, partitioner=None) as ps:
            _create(ps)
            _in_sync(ps, 1, backup_address)
            _pushes(ps, 2)
            ps.resize([*local.cluster.ps, added])
            wait_until(lambda: recorded_layout(tmp_path / "backup-1").num_ps == 3, 30,
                       "the copy to be of the 3-shard job")
            _pushes(ps, 2)
            _lose_host(local, tmp_path, 1)
            _pushes(ps, 2)
            assert _record(ps, 1).primary == backup_address
            _stopped(backup)
            backup, _ = _backup(tmp_path, 1, _spec(ports[:3]), local.address(1), ports[3])  # the new spec
            _pushes(ps, 2)
            _assert_values(ps, 8)
            assert backup.poll() is None and _record(ps, 1).primary == backup_address
    finally:
        _stopped(backup)
        local.stop()


def test_a_resize_that_removes_a_backed_up_shard_stops_its_backup(tmp_path):
    """The job shrinks from 3 shards to 2, removing ps:2 while its backup is in sync: the resize stops ps:2, the
    backup exits 0 saying why, and ps 0 forgets ps:2's record and refuses its promotion; no push is lost."""
    ports = free_ports(4)
    local, backup, backup_address = _grown(tmp_path, ports)
    try:
        with PSClient(local.cluster, connect_timeout=30, partitioner=None) as ps:
            _create(ps)
            ps.resize([*local.cluster.ps, local.address(2)])
            _in_sync(ps, 2, backup_address)
            _pushes(ps, 2)
            report = ps.resize(list(local.cluster.ps), drain_seconds=DRAIN_SECONDS)
            assert report.stopped == [local.address(2)]
            assert local.procs[2].wait(timeout=30) == 0
            assert backup.wait(timeout=30) == 0
            assert _record(ps, 2) is None
            promote = ps_pb2.ReplicaChange(action=ps_pb2.ReplicaChange.PROMOTE, index=2, primary=local.address(2),
                                           backup=backup_address)
            with pytest.raises(ReplicaFencedError, match="not in the job's layout of 2 shards"):
                ps._fanout.call(0, lambda stub, t: stub.SetReplica(promote, timeout=t), 10)
            _pushes(ps, 2)
            _assert_values(ps, 4)
    finally:
        _stopped(backup)
        local.stop()
    log = (tmp_path / "backup-2.log").read_text()
    assert "backup stops" in log, log[-2000:]


def test_a_checkpoint_after_a_failover_restores_onto_three_shards(tmp_path):
    """ps:1's backup, started with the job's --checkpoint-dir, takes over; a checkpoint taken then is committed
    with both shards' parts (the promoted backup writes ps-1's) and a job of 3 shards restores it exactly."""
    p0, p1, pb = free_ports(3)
    source = tmp_path / "ck"
    local = _job(tmp_path, (p0, p1))
    backup, backup_address = _backup(tmp_path, 1, _spec((p0, p1)), local.address(1), pb, "--checkpoint-dir",
                                     str(source))
    try:
        with PSClient(local.cluster, connect_timeout=30, partitioner=None) as ps:
            _fail_over_ps_1(ps, local, tmp_path, backup_address)
            step = ps.save_checkpoint(0)
    finally:
        _stopped(backup)
        local.stop()
    manifest = json.loads((step_dir(source, step) / "manifest.json").read_text())
    assert manifest["num_ps"] == 2 and sorted(shard["file"] for shard in manifest["shards"]) == ["ps-0.pt", "ps-1.pt"]
    restored = tmp_path / "three"
    restored.mkdir()
    args = ["--restore-from", str(source), "--num-ps", "3", "--checkpoint-dir", str(restored)]
    with LocalCluster(3, server_args=args) as three, \
            PSClient(three.cluster, connect_timeout=30, partitioner=None) as ps:
        ps.declare({n: torch.zeros(s) for n, s in SHAPES.items()})
        _assert_values(ps, 4)
        assert [ps.status(i).restored_step for i in range(3)] == [step] * 3
        assert sum(ps.status(i).num_variables for i in range(3)) == len(SHAPES)
