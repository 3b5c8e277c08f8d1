"""Replicated shards (ps-server --replica-of): a lost primary's backup serves its shard with every acknowledged
push, and a primary cut off from its promoted backup never acknowledges again. Real processes."""

import json
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from helpers import free_ports, process_state, run_ps_server, start_backup, start_ps_server, unreachable, wait_until

from torchps import lanes
from torchps.certs import make_job_credentials
from torchps.checkpoint_folder import journal_dir
from torchps.client import Optimizer, PSClient
from torchps.client.channels import ShardChannels
from torchps.cluster import Cluster, TaskSpec
from torchps.errors import LeaseHeldError, ReplicaFencedError
from torchps.partitioning import NoPartitioner
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server.backup import FAILOVER_AFTER_SECONDS, arbiter_channels, record_of
from torchps.ps_server.failstop import EXIT_CODE
from torchps.ps_server.journal import Journal
from torchps.ps_server.replication import copy_name
from torchps.security import INSECURE, Security
from torchps.worker.local_cluster import LocalCluster

PS_ADMIN = str(pathlib.Path(sys.executable).with_name("ps-admin"))  # the console script, as a user runs it
SHAPES = {"rep/a": (64, 33), "rep/b": (1000,)}  # round robin: a on ps:0, b on ps:1 (the replicated one)


def _start(tmp_path, extra=(), backed=1, credentials=None):
    """Two shards (their cluster spec given) and a backup of ps `backed`; `credentials(task)`: a task's flags
    (TLS files, token files), else --insecure."""
    p0, p1, pb = free_ports(3)
    spec = json.dumps({"ps": [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"], "worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    secured = credentials or (lambda task: ["--insecure"])
    local = LocalCluster(2, ports=[p0, p1], server_args=["--cluster", spec, "--checkpoint-dir", str(tmp_path / "ck"),
                                                          *(secured(TaskSpec("ps", 0)) if credentials else []),
                                                          *extra], log_dir=tmp_path)
    local.start()
    backup_address = f"127.0.0.1:{pb}"
    backup = start_backup(tmp_path, backed, spec, f"127.0.0.1:{(p0, p1)[backed]}", backup_address,
                          *secured(TaskSpec("ps", backed)), *extra, log="backup.log")
    return local, backup, backup_address, Cluster.from_json(spec)


def _resume_and_stop(local, *others) -> None:
    """Stops `others` (backups, shards started by hand; None: one never started) and the job's shards, any of them
    paused (SIGSTOP) resumed first."""
    for proc in [*local.procs, *others]:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
    for proc in others:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    local.stop()


def _replicas(ps, arbiter: int = 0) -> dict:
    """The arbiter's record of the shards it arbitrates (ps 0 for the others, ps 1 for ps 0)."""
    layout = ps._fanout.call(arbiter, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t), 10)
    return {entry.index: entry for entry in layout.replicas}


def _create_in_sync(ps, backup_address: str, shard: int = 1) -> None:
    """Creates SHAPES' variables (SGD lr 1), then waits for shard `shard`'s arbiter to record its backup in sync."""
    ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
    arbiter = 1 if shard == 0 else 0
    wait_until(lambda: (_replicas(ps, arbiter).get(shard) is not None
                        and _replicas(ps, arbiter)[shard].backup == backup_address),
               30, f"ps:{arbiter} to record ps:{shard}'s backup in sync")


def _ones() -> dict:
    """A push of ones to every variable of SHAPES."""
    return {n: torch.ones(s) for n, s in SHAPES.items()}


def _assert_values(ps, value: float) -> None:
    """Every variable of SHAPES, pulled, is `value` throughout (from zeros, SGD lr 1: minus the pushes of ones)."""
    values = ps.pull(SHAPES)
    for name, shape in SHAPES.items():
        assert torch.equal(values[name], torch.full(shape, value)), name


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "no-lanes"])
def test_a_lost_primarys_backup_serves_every_acknowledged_push(tmp_path, lanes):
    """ps:1 is killed and its folder deleted (its host is gone) between two runs of pushes of ones (on bulk
    lanes, the backup's records on one and its acks on another; with --no-lanes every byte and ack in the
    gRPC calls): the pushes go on against its backup, which ps 0 names; every value is exactly minus the
    pushes made."""
    local, backup, backup_address, cluster = _start(tmp_path, extra=() if lanes else ("--no-lanes",))
    try:
        with PSClient(cluster, connect_timeout=30, lane_min_bytes=0) as ps:  # every push on a bulk lane if any
            _create_in_sync(ps, backup_address)
            assert ("its acks on a lane of their own" in local.log(1)) == lanes, local.log(1)[-3000:]
            assert [ps.placement.shard_of(n) for n in SHAPES] == [0, 1]
            grads = _ones()
            for _ in range(15):
                ps.push(grads)
            local.kill_ps(1)
            shutil.rmtree(tmp_path / "ck" / "journal" / "ps-1")
            for _ in range(15):
                ps.push(grads)
            _assert_values(ps, -30.0)
            entry = _replicas(ps)[1]
            assert (entry.primary, entry.backup, entry.failovers) == (backup_address, "", 1)
            assert ps._fanout.channels.relocated == 1
    finally:
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()
    assert "this backup serves it" in (tmp_path / "backup.log").read_text()


@pytest.mark.parametrize("tls", [True, False], ids=["mutual-tls", "per-task-tokens"])
def test_a_backup_follows_and_takes_over_with_the_jobs_credentials(tmp_path, tls):
    """Under mutual TLS (a shard's certificate: the ps role), or per-task tokens without TLS (a shard's own
    line of the table): the backup follows ps:1 (its records and its acks on TLS lanes), ps 0 grants its in-sync and
    promotion, and the chief's pushes go on there exactly after ps:1 is killed."""
    holder = {}

    def credentials(task: TaskSpec) -> list[str]:
        files = holder["files"][task]
        return ([*("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca))] if tls
                else []) + (["--token-file", str(files.token), "--admin-token-file", str(files.admin_token)]
                            if not tls else [])

    holder["files"] = make_job_credentials(tmp_path / "job", Cluster(  # certificates name hosts (127.0.0.1), not ports
        ps=("127.0.0.1:1", "127.0.0.1:2"), chief=("127.0.0.1:3",), worker=("127.0.0.1:4",)))
    local, backup, backup_address, cluster = _start(tmp_path, credentials=credentials)
    chief = holder["files"][TaskSpec("chief", 0)]
    security = Security.load(tls_cert=str(chief.cert) if tls else None, tls_key=str(chief.key) if tls else None,
                             tls_ca=str(chief.ca) if tls else None, token_file=None if tls else str(chief.token),
                             admin_token_file=None if tls else str(chief.admin_token), environ={})
    try:
        with PSClient(cluster, task=TaskSpec("worker", 0), security=security, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address)
            assert "its acks on a lane of their own" in local.log(1), local.log(1)[-3000:]  # TLS lanes under TLS
            # The backup's signpost answers the job's credentials only.
            for caller, answered in ((security, True), (INSECURE, False)):
                channels = ShardChannels([backup_address], connect_timeout=10, security=caller)
                try:
                    layout = channels.stubs[0].GetLayout(ps_pb2.LayoutRequest(), timeout=10)
                    assert answered and [(e.index, e.primary) for e in layout.replicas] == [(1, cluster.ps[1])]
                except grpc.RpcError as exc:
                    refused = grpc.StatusCode.UNAVAILABLE if tls else grpc.StatusCode.UNAUTHENTICATED
                    assert not answered and exc.code() == refused, exc
                finally:
                    channels.close()
            grads = _ones()
            ps.push(grads)
            local.kill_ps(1)
            ps.push(grads)
            _assert_values(ps, -2.0)
            assert _replicas(ps)[1].primary == backup_address
    finally:
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()


def _table_without(table: pathlib.Path, folder: pathlib.Path, task: str, token: str | None) -> pathlib.Path:
    """A copy of the token `table` in `folder` whose line for `task` holds `token` instead, or is left out."""
    lines = table.read_text().splitlines(keepends=True)
    other = folder / "other-tokens"
    other.write_text("".join(line if not line.startswith(f"{task} ") else f"{task} ps {token}\n" if token else ""
                             for line in lines))
    return other


def test_a_backup_its_primary_refuses_says_so_and_keeps_trying(tmp_path):
    """Per-task tokens: ps:1's backup calls its primary with ps:1's line of its table, whose token ps:1's own table
    does not hold (another job's table, say). Refused at its first call, it says why in its log, once, and runs
    on (it tries again: an address a lost primary had may answer for another process); ps 0 records no backup
    of ps:1. A table with no line for ps:1 at all is refused as the backup starts
    (exit 2, one line naming the fix: a shard a resize adds has none until ps-certs --add gives it one)."""
    files = make_job_credentials(tmp_path / "job", Cluster(ps=("127.0.0.1:1", "127.0.0.1:2"), chief=("127.0.0.1:3",),
                                                           worker=("127.0.0.1:4",)))
    table, admin = files[TaskSpec("ps", 0)].token, files[TaskSpec("ps", 0)].admin_token
    spec = json.dumps({"ps": ["127.0.0.1:1", "127.0.0.1:2"]})
    code, printed = run_ps_server(["--index", "1", "--cluster", spec, "--replica-of", "127.0.0.1:2", "--bind",
                                   f"127.0.0.1:{free_ports(1)[0]}", "--journal-dir",
                                   str(tmp_path / "unused"), "--token-file",
                                   str(_table_without(table, tmp_path, "ps:1", None)), "--admin-token-file",
                                   str(admin)], tmp_path / "refused.log", 60)
    assert code == 2 and "no line for ps:1" in printed and "ps-certs DIR --add ps:1" in printed, printed
    other = _table_without(table, tmp_path, "ps:1", "x" * 32)  # the backup's: ps:1's line with a token of its own

    def credentials(task: TaskSpec) -> list[str]:  # ps 0's flags are the shards', ps 1's the backup's
        return ["--token-file", str(table if task.index == 0 else other), "--admin-token-file", str(admin)]

    local, backup, _, cluster = _start(tmp_path, credentials=credentials)
    chief = files[TaskSpec("chief", 0)]
    security = Security.load(token_file=str(chief.token), admin_token_file=str(chief.admin_token), environ={})
    log = tmp_path / "backup.log"
    try:
        wait_until(lambda: "refused it (UNAUTHENTICATED" in log.read_text(), 30, "the backup to say it is refused")
        channels = arbiter_channels(tuple(cluster.ps), 10, security)
        try:
            assert record_of(channels, 1) is None, "no backup of ps:1 recorded"
        finally:
            channels.close()
        assert backup.poll() is None, "it keeps trying"
        assert log.read_text().count("refused it") == 1, log.read_text()[-2000:]
    finally:
        _resume_and_stop(local, backup)


def test_ps_0s_backup_takes_over_the_step_and_its_variables(tmp_path):
    """ps 0 (the step's owner) is killed and its folder deleted: ps 1, its arbiter, promotes its backup, and the
    pushes, the global step and ps 0's variables go on there exactly."""
    local, backup, backup_address, cluster = _start(tmp_path, backed=0)
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address, shard=0)
            grads = _ones()
            for _ in range(15):
                ps.push(grads)
            step = ps.global_step()
            local.kill_ps(0)
            shutil.rmtree(tmp_path / "ck" / "journal" / "ps-0")
            for _ in range(15):
                ps.push(grads)
            assert ps.global_step() == step + 15
            _assert_values(ps, -30.0)
            entry = _replicas(ps, 1)[0]
            assert (entry.primary, entry.backup, entry.failovers) == (backup_address, "", 1)
    finally:
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()


@pytest.mark.parametrize("disk", ["kept", "new"])
def test_an_old_primary_restarted_follows_the_new_one_and_takes_over_again(tmp_path, disk):
    """ps:1's primary is killed and its backup promoted; started again with its own command, it asks ps 0 who
    serves ps:1 and becomes the new primary's backup, in sync while pushes go on; the new primary is killed in
    turn and the old one serves again, every push counted once. On its disk, its folder says it had a backup;
    on a new one (its journal folder deleted, a checkpoint it could serve beside the promoted backup),
    --replicated makes it ask."""
    local, backup, backup_address, cluster = _start(tmp_path)
    old = local.address(1)
    restarted = None
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()
            ps.push(grads)
            if disk == "new":
                ps.save_checkpoint(1)
            local.kill_ps(1)
            if disk == "new":
                shutil.rmtree(journal_dir(tmp_path / "ck", 1))
            ps.push(grads)  # served by the promoted backup
            assert _replicas(ps)[1].primary == backup_address
            restarted = _restarted_primary(tmp_path, json.dumps(cluster.to_dict()), old,
                                           ["--replicated"] if disk == "new" else [])
            wait_until(lambda: _replicas(ps)[1].backup == old, 30, "the old primary to follow the new one")
            ps.push(grads)
            backup.kill()
            backup.wait(timeout=30)
            ps.push(grads)
            entry = _replicas(ps)[1]
            assert (entry.primary, entry.failovers) == (old, 2)
            _assert_values(ps, -4.0)
    finally:
        _resume_and_stop(local, restarted, backup)
    assert "becomes its backup" in (tmp_path / "restarted.log").read_text()


def test_a_promoted_backup_and_its_backup_restarted_with_their_own_commands_serve_as_before(tmp_path):
    """ps:1's backup was promoted and the old primary follows it, in sync; both processes die and are started
    again with their own commands (the backup's --replica-of the old primary, the old primary's --replicated).
    The arbiter's record names the promoted one serving ps:1: started as a backup on its copy, it serves as a
    restarted primary does (its arbiter confirms it, the record's backup dropped first), never as a promotion
    the record already holds, which would skip that drop and leave the old primary, still named in sync, free
    to be promoted beside it. The old primary follows it again; one failover in all, every push once."""
    local, backup, backup_address, cluster = _start(tmp_path)
    old = local.address(1)
    spec = json.dumps(cluster.to_dict())
    restarted = None
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()
            ps.push(grads)
            local.kill_ps(1)
            ps.push(grads)  # served by the promoted backup
            restarted = _restarted_primary(tmp_path, spec, old, ["--replicated"])
            wait_until(lambda: _replicas(ps)[1].backup == old, 30, "the old primary to follow the new one")
            ps.push(grads)
            restarted.send_signal(signal.SIGSTOP)  # (running, it would take over)
            backup.kill()
            backup.wait(timeout=30)
            restarted.kill()
            restarted.wait(timeout=30)
            assert (_replicas(ps)[1].primary, _replicas(ps)[1].backup) == (backup_address, old)
            backup = _backup_process(tmp_path, cluster, 1, old, backup_address, "backup-1")  # its copy, as before
            wait_until(lambda: "confirms it serves ps:1" in (tmp_path / "backup-1.log").read_text(), 60,
                       "the promoted one, started with its backup's command, to serve once confirmed")
            restarted = _restarted_primary(tmp_path, spec, old, ["--replicated"])
            wait_until(lambda: _replicas(ps)[1].backup == old, 60, "the old primary to follow it again")
            ps.push(grads)
            entry = _replicas(ps)[1]
            assert (entry.primary, entry.failovers) == (backup_address, 1)
            _assert_values(ps, -4.0)
    finally:
        _resume_and_stop(local, restarted, backup)
    log = (tmp_path / "backup-1.log").read_text()
    assert "as a restarted primary" in log and "this backup serves it" not in log, log[-3000:]


def test_an_arbiter_whose_call_threads_all_wait_for_its_journal_still_answers_its_shards(tmp_path):
    """ps 0 (2 call threads) has a backup, paused: every change ps 0 records waits for it. Two CreateDataQueue
    calls hold both threads in that wait (their records unacknowledged). ps 0 still answers SetReplica, which
    runs on threads of its own: a primary's DROP of its lost backup, which that wait may itself need (ps 0 and
    ps 1 losing their backups at once), is never queued behind calls that wait for it."""
    local, backup, backup_address, cluster = _start(tmp_path, extra=["--threads", "2", "--replica-ack-timeout", "60"],
                                                    backed=0)
    creating = []
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address, shard=0)
            wait_until(lambda: ps.status(0).replication.lag_records == 0, 30, "ps 0's backup to acknowledge all")
            backup.send_signal(signal.SIGSTOP)
            stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(cluster.ps[0]))
            creating = [stub.CreateDataQueue.future(ps_pb2.DataQueueSpec(name=f"q{k}", num_examples=10, shard_size=1),
                                                    timeout=50) for k in range(2)]
            wait_until(lambda: ps.status(0).replication.lag_records >= 2, 30, "both queues' records written")
            lease = ps_pb2.ReplicaChange(action=ps_pb2.ReplicaChange.LEASE, index=1, primary=cluster.ps[1])
            stub.SetReplica(lease, timeout=20)  # answered (no backup of ps:1 recorded: the record as it stands)
            assert not any(call.done() for call in creating), "the creates still wait for ps 0's backup"
    finally:
        backup.send_signal(signal.SIGCONT)
        for call in creating:
            call.cancel()
        _resume_and_stop(local, backup)


def test_a_primary_never_goes_on_alone_on_an_arbiters_word_that_its_lost_backup_could_take_back(tmp_path):
    """Three shards; ps 0 (arbiter of ps 1 and ps 2) and ps 2 each have a backup. ps 1, ps 0's arbiter, is
    paused, then ps 0's backup killed, then ps 2's: ps 0 decides ps 2's DROP but cannot make it durable (its
    own backup is lost, and ps 1 cannot drop it), nor answer its retries, since ps 1 still records that backup
    in sync (promoted in ps 0's place, it would lack the DROP, and could promote ps 2's lost backup beside
    ps 2). ps 2 goes on alone only once ps 1 is resumed and drops ps 0's backup; the pushes then go on."""
    ports = free_ports(5)
    spec = json.dumps({"ps": [f"127.0.0.1:{p}" for p in ports[:3]], "worker": ["127.0.0.1:1"]})
    local = LocalCluster(3, ports=ports[:3], server_args=["--cluster", spec, "--checkpoint-dir", str(tmp_path / "ck")],
                         log_dir=tmp_path)
    local.start()
    cluster, (backup0, backup2) = Cluster.from_json(spec), (f"127.0.0.1:{p}" for p in ports[3:])
    backups = [_backup_process(tmp_path, cluster, 0, cluster.ps[0], backup0, "backup-0"),
               _backup_process(tmp_path, cluster, 2, cluster.ps[2], backup2, "backup-2")]
    shapes = {"three/a": (8,), "three/b": (8,), "three/c": (8,)}  # round robin: one on each shard
    try:
        with PSClient(cluster, connect_timeout=60) as ps:
            ps.create_variables({n: torch.zeros(s) for n, s in shapes.items()}, Optimizer("sgd", lr=1.0))
            wait_until(lambda: _backup(ps, 0) == backup0 and _backup(ps, 2) == backup2, 30, "both backups in sync")
            local.procs[1].send_signal(signal.SIGSTOP)
            for backup in backups:
                backup.kill()
                backup.wait(timeout=30)
            wait_until(lambda: local.log(2).count("its arbiter did not answer drop") >= 2
                       or "goes on without a backup" in local.log(2), 60, "ps 2's DROP and a retry of it")
            assert "goes on without a backup" not in local.log(2), "ps 2 went on alone on ps 0's word"
            local.procs[1].send_signal(signal.SIGCONT)
            wait_until(lambda: "goes on without a backup" in local.log(2), 60, "ps 2 to go on once ps 1 dropped "
                       "ps 0's backup")
            ps.push({n: torch.ones(s) for n, s in shapes.items()})
            values = ps.pull(shapes)
            assert all(torch.equal(values[n], torch.full(s, -1.0)) for n, s in shapes.items())
    finally:
        for proc in local.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        local.stop()


@pytest.mark.parametrize("backup_was", ["paused", "restarted"])
def test_a_primary_restarted_on_a_new_disk_while_its_backup_is_recorded_in_sync_waits_for_that_backup(tmp_path,
                                                                                                      backup_was):
    """ps:1 acknowledges pushes past its last checkpoint with its backup in sync; the backup is paused, ps:1
    killed (then the backup too, a whole job lost) and its journal folder deleted, so ps 0 still records ps:1
    served there with that backup in sync. Started again with --replicated on the empty folder, ps:1 neither
    serves the checkpoint (it lacks what it acknowledged since) nor drops the backup: it waits; resumed (or
    started again on its disk, from the copy there), the backup takes over, the restarted one follows it, and
    every push is there once."""
    local, backup, backup_address, cluster = _start(tmp_path)
    old = local.address(1)
    restarted = None
    try:
        with PSClient(cluster, connect_timeout=60) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()
            ps.save_checkpoint(0)
            ps.push(grads)  # past the checkpoint: on ps:1's disk and its backup's only
            backup.send_signal(signal.SIGSTOP)  # (killed now, ps:1 would drop it)
            local.kill_ps(1)
            if backup_was == "restarted":
                backup.kill()
                backup.wait(timeout=30)
            shutil.rmtree(journal_dir(tmp_path / "ck", 1))
            restarted = _restarted_primary(tmp_path, json.dumps(cluster.to_dict()), old, ["--replicated"])
            wait_until(lambda: "waits for that backup to take over" in (tmp_path / "restarted.log").read_text(), 30,
                       "the restarted ps:1 to wait for its backup")
            entry = _replicas(ps)[1]
            assert (entry.primary, entry.backup) == (old, backup_address), "nothing dropped the backup"
            if backup_was == "paused":
                backup.send_signal(signal.SIGCONT)
            else:  # on the folder its copy is in, at its address: as _start started it
                backup = _backup_process(tmp_path, cluster, 1, old, backup_address, "backup-1")
            wait_until(lambda: (_replicas(ps)[1].primary, _replicas(ps)[1].backup) == (backup_address, old), 60,
                       "the backup to take over and the restarted one to follow it")
            ps.push(grads)
            _assert_values(ps, -2.0)
    finally:
        _resume_and_stop(local, restarted, backup)
    assert "serving on" not in (tmp_path / "restarted.log").read_text()


@pytest.mark.parametrize("shard", [1, 0])
def test_a_primary_waiting_for_a_backup_lost_with_its_copy_serves_the_newest_checkpoint_once_ps_admin_drops_it(
        tmp_path, shard):
    """The shard (ps:1, whose arbiter is ps 0; or ps 0, whose arbiter is ps 1) acknowledges a push past the last
    checkpoint with its backup in sync. `ps-admin drop-backup` refuses (exit 1) while its primary serves. The
    primary is killed with its journal folder and started again with --replicated on the empty folder: it waits
    for that backup, as GetStatus and `ps-admin layout` say. The command refuses while a process, paused, is at
    the backup's address; that process killed and its copy deleted too, it has the arbiter drop the backup: the
    shard serves the newest checkpoint (the push past it, held by the lost backup alone, is given up), the other
    shard keeps every push, and pushes go on. For ps 0 the backup's address then cannot be reached (connects
    time out): the command refuses until it is given --force. A repeat drops nothing; a shard the job lacks is a
    usage error."""
    local, backup, backup_address, cluster = _start(tmp_path, backed=shard)
    old, spec = local.address(shard), json.dumps(cluster.to_dict())
    admin = [PS_ADMIN, "drop-backup", "--cluster", spec, "--insecure", "--shard"]
    mine, other = ("rep/a", "rep/b") if shard == 0 else ("rep/b", "rep/a")
    restarted = None

    def drop(index: int = shard, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*admin, str(index), *extra], capture_output=True, text=True, timeout=120)

    try:
        with PSClient(cluster, connect_timeout=60) as ps:
            _create_in_sync(ps, backup_address, shard)
            grads = _ones()
            ps.push(grads)
            ps.save_checkpoint(0)
            ps.push(grads)  # past the checkpoint: on the shard's disk and its backup's only
            serving = drop()
            assert serving.returncode == 1 and "does not wait for its backup" in serving.stderr, serving
            backup.send_signal(signal.SIGSTOP)  # (killed now, the primary would drop it)
            local.kill_ps(shard)
            shutil.rmtree(journal_dir(tmp_path / "ck", shard))
            restarted = _restarted_primary(tmp_path, spec, old, ["--replicated"], shard)
            wait_until(lambda: "waits for that backup to take over" in (tmp_path / "restarted.log").read_text(), 30,
                       "the restarted primary to wait for its backup")
            waits = f"waits for {backup_address} to take over"
            wait_until(lambda: ps.status(shard).awaits_backup == backup_address, 30, "GetStatus to say it waits")
            shown = subprocess.run([PS_ADMIN, "layout", "--cluster", spec, "--insecure"], capture_output=True,
                                   text=True, timeout=120)
            assert shown.returncode == 0 and waits in shown.stdout, shown
            paused = drop()
            assert paused.returncode == 1 and "accepts connections" in paused.stderr, paused
            backup.kill()
            backup.wait(timeout=30)
            shutil.rmtree(tmp_path / f"backup-{shard}")
            assert _backup(ps, shard) == backup_address and "serving on" not in (tmp_path / "restarted.log").read_text()
            if shard == 0:
                with unreachable(backup_address):
                    unknown = drop()
                    assert unknown.returncode == 1 and "cannot be reached" in unknown.stderr, unknown
                    assert _backup(ps, shard) == backup_address
                    dropped = drop(shard, "--force")
            else:
                dropped = drop()
            assert dropped.returncode == 0 and f"dropped the backup {backup_address}" in dropped.stdout, dropped
            assert _backup(ps, shard) == ""
            values = ps.pull(SHAPES)  # answered once the restarted primary serves
            assert torch.equal(values[mine], torch.full(SHAPES[mine], -1.0))  # the checkpoint's
            assert torch.equal(values[other], torch.full(SHAPES[other], -2.0))  # every push
            ps.push(grads)
            assert torch.equal(ps.pull(SHAPES)[mine], torch.full(SHAPES[mine], -2.0))
        again = drop()
        assert again.returncode == 0 and "no backup in sync: nothing to drop" in again.stdout, again
        for unknown in (7, -1):
            refused = drop(unknown)
            assert refused.returncode == 2 and "--shard must" in refused.stderr, refused
    finally:
        _resume_and_stop(local, restarted, backup)


def test_losing_ps_1_and_ps_0s_backup_at_once_fails_ps_1_over_and_ps_0_goes_on(tmp_path):
    """ps 0 and ps 1 each have a backup; ps 1 and ps 0's backup are killed at once (a host that ran both): ps 0
    decides the promotion of ps 1's backup but cannot make it durable (its own backup is lost, and only ps 1,
    its arbiter, could drop it). Its retry is answered without that backup, since only the promoted one can
    drop it now; the promoted one then drops it, and both shards serve every push once."""
    local, backup1, address1, cluster = _start(tmp_path)
    (port,) = free_ports(1)
    address0 = f"127.0.0.1:{port}"
    backup0 = _backup_process(tmp_path, cluster, 0, cluster.ps[0], address0, "backup-0")
    try:
        with PSClient(cluster, connect_timeout=60) as ps:
            _create_in_sync(ps, address1)
            wait_until(lambda: _backup(ps, 0) == address0, 30, "ps 1 to record ps 0's backup in sync")
            grads = _ones()
            ps.push(grads)
            backup0.kill()
            local.kill_ps(1)
            backup0.wait(timeout=30)
            ps.push(grads)  # both shards: ps 1's by its promoted backup, ps 0's once that one dropped ps 0's
            assert _replicas(ps)[1].primary == address1
            _assert_values(ps, -2.0)
    finally:
        if backup0.poll() is None:
            backup0.kill()
        backup1.terminate()
        backup1.wait(timeout=30)
        local.stop()
    assert "goes on without a backup" in local.log(0)


def test_a_client_refused_by_an_old_primary_waiting_for_its_arbiter_moves_to_the_promoted_backup(tmp_path):
    """ps:1's primary is killed and its backup promoted while the client calls nothing; the old primary is started
    again on its disk at its address with a cluster spec whose ps 0 it cannot reach, so it answers GetStatus but
    refuses every data call (UNAVAILABLE) as it waits for its arbiter. The client's next push, sent there, is
    applied once at the promoted backup, long before the client's connect_timeout: its retries are refused at
    once where GetStatus is answered, yet its failover watch asks ps 0 where ps:1 is served while the call
    lasts."""
    local, backup, backup_address, cluster = _start(tmp_path)
    old, (nowhere,) = local.address(1), free_ports(1)
    restarted = None
    try:
        with PSClient(cluster, connect_timeout=60) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()
            ps.push(grads)
            local.kill_ps(1)
            wait_until(lambda: _replicas(ps)[1].primary == backup_address, 30, "the backup's promotion")
            elsewhere = json.dumps({"ps": [f"127.0.0.1:{nowhere}", old], "worker": cluster.to_dict()["worker"]})
            restarted = _restarted_primary(tmp_path, elsewhere, old)
            probe = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(old))
            wait_until(lambda: probe.GetStatus(ps_pb2.StatusRequest(), timeout=5, wait_for_ready=True), 30,
                       "the old primary to answer behind its fence")
            assert ps._fanout.channels.addresses[1] == old and ps._fanout.channels.relocated == 0
            started = time.monotonic()
            ps.push(grads)
            assert time.monotonic() - started < 20, "the push waited at the fenced old primary"
            assert ps._fanout.channels.addresses[1] == backup_address and ps._fanout.channels.relocated == 1
            _assert_values(ps, -2.0)
            assert restarted.poll() is None, "the old primary waits for its arbiter"
    finally:
        _resume_and_stop(local, restarted, backup)


def test_a_primary_restarted_with_no_backup_in_sync_drops_none_before_serving_so_a_late_in_sync_changes_nothing(
        tmp_path):
    """ps:1's backup is stopped and dropped, then ps:1 is killed and started on its disk: before it serves it asks
    ps 0 to drop whatever backup the record names, none, which counts as a change, so an IN_SYNC it asked
    before it stopped (naming the count then), decided late, leaves the record without a backup."""
    local, backup, backup_address, cluster = _start(tmp_path)
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address)
            backup.terminate()
            backup.wait(timeout=30)
            wait_until(lambda: _replicas(ps)[1].backup == "", 30, "ps:1's lost backup dropped")
            before = _replicas(ps)[1].changes
            local.kill_ps(1)
            local.start_ps(1)
            wait_until(lambda: _replicas(ps)[1].changes == before + 1, 30, "the restarted primary's DROP")
            ps.push({n: torch.ones(s) for n, s in SHAPES.items()})
            late = ps_pb2.ReplicaChange(action=ps_pb2.ReplicaChange.IN_SYNC, index=1, primary=cluster.ps[1],
                                        backup=backup_address, changes=before)
            entry = ps._fanout.call(0, lambda stub, t: stub.SetReplica(late, timeout=t), 10)
            assert (entry.backup, entry.changes) == ("", before + 1)
    finally:
        if backup.poll() is None:
            backup.terminate()
            backup.wait(timeout=30)
        local.stop()


def test_ps0_and_ps1_losing_their_backups_at_once_each_drop_the_others_and_go_on(tmp_path):
    """ps 0 and ps 1 each have a backup, each the other's arbiter. Both backups are killed at once: each primary
    acknowledges nothing until the other drops its backup, and each one's DROP, counted, waits for a record the
    other's journal cannot write yet. The repeats that follow answer past a lost backup, so both go on alone:
    pushes to both shards are acknowledged again within seconds, and both records name no backup."""
    local, backup, backup_address, cluster = _start(tmp_path, backed=1)
    (port,) = free_ports(1)
    other = f"127.0.0.1:{port}"
    backup0 = _backup_process(tmp_path, cluster, 0, cluster.ps[0], other, "backup-0")
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address)
            wait_until(lambda: _replicas(ps, 1).get(0) is not None and _replicas(ps, 1)[0].backup == other, 30,
                       "ps 1 to record ps 0's backup in sync")
            grads = _ones()
            ps.push(grads)
            backup.kill()
            backup0.kill()
            backup.wait(timeout=30)
            backup0.wait(timeout=30)
            started = time.monotonic()
            ps.push(grads)
            assert time.monotonic() - started < 30, "the two drops waited on each other"
            assert _replicas(ps, 1)[0].backup == "" and _replicas(ps, 0)[1].backup == ""
            _assert_values(ps, -2.0)
    finally:
        for proc in (backup, backup0):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        local.stop()


def test_a_primary_restarted_before_its_backup_took_over_drops_it_before_serving(tmp_path):
    """ps:1's backup paused, ps:1's primary killed and restarted on its disk at once: its arbiter still lists the
    paused backup in sync, so the primary has ps 0 drop it before it acknowledges a push (else the backup, later
    promoted, would lack that push); resumed, the backup follows again from a new base, and promoted after the
    primary's death it serves both pushes."""
    local, backup, backup_address, cluster = _start(tmp_path)
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()
            ps.push(grads)
            backup.send_signal(signal.SIGSTOP)
            local.kill_ps(1)
            local.start_ps(1)  # on its disk, its backup still recorded in sync
            wait_until(lambda: "serving on" in local.log(1).rpartition("answers status")[2], 30,
                       "the restarted ps:1 to serve")
            assert _replicas(ps)[1].backup == "", "dropped before the restarted primary served"
            ps.push(grads)
            backup.send_signal(signal.SIGCONT)
            wait_until(lambda: _replicas(ps)[1].backup == backup_address, 30, "the backup to follow again")
            local.kill_ps(1)
            _assert_values(ps, -2.0)
            assert _replicas(ps)[1].primary == backup_address
    finally:
        backup.send_signal(signal.SIGCONT)
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()


def test_a_restarted_primary_that_cannot_clean_its_checkpoint_part_once_confirmed_stops_instead_of_staying_fenced(
        tmp_path):
    """As the previous test, but a partial checkpoint file of ps:1 that cannot be deleted (a folder by that name):
    confirmed by its arbiter, the restarted primary cleans its part of the checkpoint folder before it serves, and
    a clean that fails stops it (fail-stop, naming why), as at any shard's start; before, the thread that asked
    died and the shard answered nothing but status and the layout for good."""
    local, backup, backup_address, cluster = _start(tmp_path)
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address)
            backup.send_signal(signal.SIGSTOP)  # not promoted meanwhile: the restarted primary is confirmed
            local.kill_ps(1)
            (tmp_path / "ck" / "step-00000007" / ".ps-1.pt.0.tmp").mkdir(parents=True)
            local.start_ps(1)
            assert local.procs[1].wait(timeout=60) == EXIT_CODE, local.log(1)[-3000:]
            assert "cannot clean its part of the checkpoint folder" in local.log(1), local.log(1)[-3000:]
    finally:
        _resume_and_stop(local, backup)


def test_a_backup_whose_disk_fills_follows_again_from_a_new_base_and_its_primary_loses_nothing(tmp_path):
    """ps:1's backup may grow its files no further (RLIMIT_FSIZE, as `prlimit --fsize` sets it): the record its
    stream writes fails (EFBIG), it follows again from a new base, and the primary acknowledges every push
    meanwhile; with room again it is in sync, and promoted once the primary is killed it serves every push."""
    local, backup, backup_address, cluster = _start(tmp_path)
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()
            log = tmp_path / "backup.log"
            limit = log.stat().st_size + (64 << 10)  # room for its own lines, not for 20 records of 4 KB
            hard = resource.prlimit(backup.pid, resource.RLIMIT_FSIZE)[1]
            resource.prlimit(backup.pid, resource.RLIMIT_FSIZE, (limit, hard))  # the soft limit: lifted later
            pushes = 0
            while "a write failed: File too large" not in log.read_text():
                assert pushes < 200, log.read_text()[-3000:]
                ps.push(grads)
                pushes += 1
            wait_until(lambda: "following again from a new base" in log.read_text(), 30, "the backup to follow anew")
            resource.prlimit(backup.pid, resource.RLIMIT_FSIZE, (hard, hard))
            for _ in range(3):
                ps.push(grads)
            pushes += 3
            wait_until(lambda: _replicas(ps)[1].backup == backup_address and _replicas(ps)[1].primary != backup_address,
                       30, "the backup in sync again")
            local.kill_ps(1)
            _assert_values(ps, -float(pushes))
            assert _replicas(ps)[1].primary == backup_address
    finally:
        _resume_and_stop(local, backup)

def _backup_process(tmp_path, cluster, index: int, primary: str, bind: str, name: str):
    """A backup of shard `index` following `primary`, bound at `bind`, its journal and log named `name`."""
    return start_backup(tmp_path, index, json.dumps(cluster.to_dict()), primary, bind, "--insecure", name=name)


def test_a_backup_started_again_at_the_in_sync_address_on_an_older_folder_is_never_promoted(tmp_path):
    """ps:1's backup is stopped (ps 0 drops it), and another is started at its address on a new folder: in sync,
    it writes four more pushes. ps:1's primary (paused first, so it drops nothing) and that backup are then lost
    together. A backup started at that address on the first, older folder holds a copy the record does not
    name: its PROMOTE is refused (before, the record trusted the address, and it served without the later
    pushes). Started there on the newer folder, the backup is promoted, and every push is there exactly."""
    local, backup, backup_address, cluster = _start(tmp_path)
    backups = [backup]
    try:
        with PSClient(cluster, connect_timeout=60) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()
            for _ in range(3):
                ps.push(grads)
            backup.terminate()
            backup.wait(timeout=30)
            wait_until(lambda: _replicas(ps)[1].backup == "", 30, "ps 0 to drop the stopped backup")
            backups.append(_backup_process(tmp_path, cluster, 1, cluster.ps[1], backup_address, "newer"))
            wait_until(lambda: _replicas(ps)[1].backup == backup_address, 30, "the newer copy in sync")
            for _ in range(4):
                ps.push(grads)
            local.procs[1].send_signal(signal.SIGSTOP)
            wait_until(lambda: process_state(local.procs[1].pid) in ("T", "t"), 30, "ps:1 to stop")
            backups[-1].kill()
            backups[-1].wait(timeout=30)
            local.kill_ps(1)
            assert (_replicas(ps)[1].primary, _replicas(ps)[1].backup) == (cluster.ps[1], backup_address)
            backups.append(_backup_process(tmp_path, cluster, 1, cluster.ps[1], backup_address, "backup-1"))
            wait_until(lambda: "holds the copy" in (tmp_path / "backup-1.log").read_text(), 30,
                       "the older copy's promotion to be refused")
            assert _replicas(ps)[1].primary == cluster.ps[1], "the older copy serves"
            backups[-1].terminate()
            backups[-1].wait(timeout=30)
            backups.append(_backup_process(tmp_path, cluster, 1, cluster.ps[1], backup_address, "newer"))
            _assert_values(ps, -7.0)
            assert _replicas(ps)[1].primary == backup_address
            ps.push(grads)
            _assert_values(ps, -8.0)
    finally:
        for process in backups:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
        local.stop()


def _restarted_primary(tmp_path, spec: str, old: str, extra=(), index: int = 1):
    """ps `index`'s old primary started again on its disk (the job's checkpoint folder) at its address `old`, with
    the cluster spec `spec` and `extra` flags; its log is restarted.log."""
    return start_ps_server(["--index", str(index), "--cluster", spec, "--bind", old, "--checkpoint-dir",
                            str(tmp_path / "ck"), "--insecure", "--torch-threads", "1", *extra],
                           tmp_path / "restarted.log")


def _backup(ps, shard: int) -> str:
    """The backup in sync its arbiter records for `shard` ("" if none)."""
    entry = _replicas(ps, 1 if shard == 0 else 0).get(shard)
    return entry.backup if entry is not None else ""


# Seconds a client waits for a shard after both primaries died: ps 0's backup is promoted only once ps 1's is
# (each is the other's arbiter), detections and promotions one after the other (under a loaded suite 30 s ran out).
DOUBLE_FAILOVER = 60


def _ps_1_then_ps_0_fail_over(ps, local, address0: str, address1: str) -> dict:
    """Creates SHAPES' variables (SGD lr 1), waits for both backups in sync, then pushes ones, kills ps 1's
    primary, pushes, kills ps 0's, pushes; the gradients pushed."""
    ps.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
    wait_until(lambda: (_backup(ps, 1), _backup(ps, 0)) == (address1, address0), 30, "both backups in sync")
    grads = _ones()
    ps.push(grads)
    local.kill_ps(1)
    ps.push(grads)
    local.kill_ps(0)
    ps.push(grads)
    return grads


def test_ps_1_then_ps_0_fail_over_each_backup_finding_its_arbiter_where_it_moved(tmp_path):
    """Both shards backed up: ps 1's primary is killed (ps 0 promotes its backup), then ps 0's: its backup finds
    ps 1, its arbiter, at the address ps 0's journal recorded for it (the spec's answers no more), is promoted,
    and the pushes go on exactly; a fresh backup of the promoted ps 0 is recorded in sync by ps 1, which ps 0
    finds where its own record says (the spec's address, and ps 0's own, answer no more)."""
    local, backup1, address1, cluster = _start(tmp_path)
    address0, fresh0 = (f"127.0.0.1:{port}" for port in free_ports(2))
    backups = [backup1, _backup_process(tmp_path, cluster, 0, cluster.ps[0], address0, "backup-0")]
    arbiters = arbiter_channels(tuple(cluster.ps), 10, INSECURE)
    try:
        with PSClient(cluster, connect_timeout=DOUBLE_FAILOVER) as ps:
            wait_until(lambda: record_of(arbiters, 1) == (cluster.ps[1], address1), 30, "ps 0 to record ps:1's backup")
            grads = _ps_1_then_ps_0_fail_over(ps, local, address0, address1)
            _assert_values(ps, -3.0)
            assert (_replicas(ps, 1)[0].primary, _replicas(ps)[1].primary) == (address0, address1)
            backups.append(_backup_process(tmp_path, cluster, 0, address0, fresh0, "fresh-0"))
            wait_until(lambda: _backup(ps, 0) == fresh0, 30, "ps 1 to record ps 0's fresh backup in sync")
            ps.push(grads)
            _assert_values(ps, -4.0)
    finally:
        for backup in backups:
            backup.terminate()
            backup.wait(timeout=30)
        local.stop()


def test_a_client_started_once_ps_0_and_ps_1_both_moved_finds_them_through_the_backups_at_their_addresses(tmp_path):
    """ps 1's primary and then ps 0's are killed (each other's arbiters: both backups promoted), and fresh backups
    are started at the spec's addresses (hosts replaced). A client started then knows only the spec: each
    backup's signpost names its primary, and the client finds both shards, reads and pushes exactly."""
    local, backup1, address1, cluster = _start(tmp_path)
    address0 = f"127.0.0.1:{free_ports(1)[0]}"
    backups = [backup1, _backup_process(tmp_path, cluster, 0, cluster.ps[0], address0, "backup-0")]
    arbiters = arbiter_channels(tuple(cluster.ps), 10, INSECURE)
    try:
        with PSClient(cluster, connect_timeout=DOUBLE_FAILOVER) as ps:
            wait_until(lambda: record_of(arbiters, 1) == (cluster.ps[1], address1), 30, "ps 0 to record ps:1's backup")
            grads = _ps_1_then_ps_0_fail_over(ps, local, address0, address1)
            backups += [_backup_process(tmp_path, cluster, 1, address1, cluster.ps[1], "fresh-1"),
                        _backup_process(tmp_path, cluster, 0, address0, cluster.ps[0], "fresh-0")]
            wait_until(lambda: (_backup(ps, 1), _backup(ps, 0)) == (cluster.ps[1], cluster.ps[0]), 30,
                       "the fresh backups at the spec's addresses in sync")
        # Asked again at the spec's addresses (channels that called them before the failovers, their connections
        # now the fresh backups'), the records come from where the arbiters are served: each signpost names its
        # arbiter's primary, and the ask follows it (without, the signpost's one entry hid the other's record).
        assert record_of(arbiters, 1) == (address1, cluster.ps[1])
        assert record_of(arbiters, 0) == (address0, cluster.ps[0])
        assert arbiters.addresses[:2] == [address0, address1]
        with PSClient(cluster, connect_timeout=30) as late:
            late.declare({n: torch.zeros(s) for n, s in SHAPES.items()})
            late.push(grads)
            values = late.pull(SHAPES)
            assert all(torch.equal(values[n], torch.full(s, -4.0)) for n, s in SHAPES.items())
            assert late._fanout.channels.addresses[:2] == [address0, address1]
    finally:
        arbiters.close()
        for backup in backups:
            backup.terminate()
            backup.wait(timeout=30)
        local.stop()
    assert "answers where ps:0 is served" in (tmp_path / "fresh-0.log").read_text()


def _grad(worker: int, step: int, shape) -> torch.Tensor:
    return torch.sin(torch.arange(float(torch.Size(shape).numel())).reshape(shape) * (worker + 1) + step)


def test_a_sync_job_through_ps_0s_failover_matches_one_torch_process(tmp_path):
    """Two workers in sync mode, SGD with momentum; ps 0 (its backup in sync) is killed and its folder deleted
    after step 4 of 8: the values equal one torch optimizer's over the averaged gradients."""
    local, backup, backup_address, cluster = _start(tmp_path, backed=0)
    clients = [PSClient(cluster, task=TaskSpec("worker", i), connect_timeout=30) for i in range(2)]
    steps, kill_after = 8, 4
    try:
        clients[0].configure("sync", total_num_replicas=2)
        start = {n: torch.zeros(s) for n, s in SHAPES.items()}
        clients[0].create_variables(start, Optimizer("sgd", lr=0.1, momentum=0.9))
        clients[1].declare(start)
        wait_until(lambda: _replicas(clients[0], 1).get(0) is not None
                   and _replicas(clients[0], 1)[0].backup == backup_address, 30, "ps 1 to record ps 0's backup")

        def run(worker: int, first: int, last: int) -> None:
            for step in range(first, last):
                clients[worker].push({n: _grad(worker, step, s) for n, s in SHAPES.items()})

        for first, last in ((0, kill_after), (kill_after, steps)):
            other = threading.Thread(target=run, args=(1, first, last))
            other.start()
            run(0, first, last)
            other.join(60)
            assert not other.is_alive()
            if first == 0:
                local.kill_ps(0)
                shutil.rmtree(tmp_path / "ck" / "journal" / "ps-0")
        assert clients[0].global_step() == steps
        reference = {n: torch.zeros(s, requires_grad=True) for n, s in SHAPES.items()}
        optimizer = torch.optim.SGD(reference.values(), lr=0.1, momentum=0.9)
        for step in range(steps):
            for name, value in reference.items():
                value.grad = (_grad(0, step, value.shape) + _grad(1, step, value.shape)) / 2
            optimizer.step()
        values = clients[0].pull(SHAPES)
        for name, value in reference.items():
            assert torch.allclose(values[name], value.detach(), atol=1e-5), name
        assert _replicas(clients[0], 1)[0].primary == backup_address
    finally:
        for client in clients:
            client.close()
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()
    # Replication after aggregation: one record per step, in the backup's copy of ps 0's journal (and in its own,
    # promoted), none per push.
    kinds = [record.kind for record in Journal(tmp_path / "backup-0").recover()[1]]
    assert "add" not in kinds and kinds.count("step") >= steps - kill_after, kinds


def test_a_backup_that_was_paused_itself_does_not_take_over_its_live_primary(tmp_path):
    """The backup is paused (SIGSTOP) for three times --failover-after while its primary goes on; resumed, it
    finds no frame since its pause: that silence was its own, so it follows on and the primary keeps its shard
    (the chaos soak saw such a backup promote itself over a live primary).
    Pushes go on through a window as long as the backup's detection and promotion, all acknowledged by the same
    primary with the backup in sync, and the backup never even suspects its primary."""
    local, backup, backup_address, cluster = _start(tmp_path)
    try:
        with PSClient(cluster, connect_timeout=30, timeout=60) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()
            ps.push(grads)
            backup.send_signal(signal.SIGSTOP)
            time.sleep(3 * FAILOVER_AFTER_SECONDS)  # the fault: the backup does not run this long
            backup.send_signal(signal.SIGCONT)
            resumed, pushed = time.monotonic(), 1
            while time.monotonic() - resumed < 4 * FAILOVER_AFTER_SECONDS:  # its detection and promotion, twice over
                ps.push(grads)
                pushed += 1
            entry = _replicas(ps)[1]
            assert (entry.primary, entry.backup, entry.failovers) == (cluster.ps[1], backup_address, 0), entry
            assert local.procs[1].poll() is None and ps._fanout.channels.relocated == 0
            log = (tmp_path / "backup.log").read_text()
            assert "sent nothing" not in log, f"the backup took its own pause for its primary's silence:\n{log}"
            _assert_values(ps, -float(pushed))
    finally:
        if backup.poll() is None:
            backup.send_signal(signal.SIGCONT)
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()


def test_a_backup_is_never_promoted_over_a_primary_that_renews_its_lease(tmp_path):
    """While ps:1's primary runs with its backup in sync, promotions asked of ps 0 in its backup's name for three
    windows of --failover-after are all refused (LeaseHeldError: the primary renews its lease every 0.1 s; past
    the arbiter's first window, one renewal missing would grant one), pushes go on at the primary, and ps 0's
    record is unchanged; a lease in another primary's name is refused and changes nothing either."""
    local, backup, backup_address, cluster = _start(tmp_path)
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()

            copy = copy_name(tmp_path / "backup-1")  # the backup's copy, as the record names it

            def ask(action, primary: str, backup: str):
                change = ps_pb2.ReplicaChange(action=action, index=1, primary=primary, backup=backup, copy=copy)
                return ps._fanout.call(0, lambda stub, t: stub.SetReplica(change, timeout=t), 10)

            started, refused, pushed = time.monotonic(), 0, 0
            while time.monotonic() - started < 3 * FAILOVER_AFTER_SECONDS:
                with pytest.raises(LeaseHeldError, match="holds its lease"):
                    ask(ps_pb2.ReplicaChange.PROMOTE, cluster.ps[1], backup_address)
                refused += 1
                ps.push(grads)
                pushed += 1
            with pytest.raises(ReplicaFencedError, match=f"not by {backup_address}"):
                ask(ps_pb2.ReplicaChange.LEASE, backup_address, "")
            entry = _replicas(ps)[1]
            assert (entry.primary, entry.backup, entry.failovers) == (cluster.ps[1], backup_address, 0), entry
            assert refused >= 3 and ps._fanout.channels.relocated == 0
            _assert_values(ps, -float(pushed))
    finally:
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()


def test_a_push_stuck_at_a_paused_primary_is_answered_by_its_promoted_backup_long_before_its_deadline(tmp_path):
    """ps:1's primary is paused (SIGSTOP: its connections stay open, nothing answers) under a push whose deadline
    is 300 s: the client's failover watch asks ps 0 where ps:1 is served while the call hangs, moves it to the
    promoted backup and sends it there; it is answered while the old primary is still paused, applied once.
    A long poll of ps 0's record (GetLayout watching ps:1) waits past later plain answers and is answered by
    the promotion, before its watch ends."""
    local, backup, backup_address, cluster = _start(tmp_path)
    channel = grpc.insecure_channel(cluster.ps[0])
    try:
        with PSClient(cluster, connect_timeout=30, timeout=300) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()
            ps.push(grads)
            wait_until(lambda: _replicas(ps)[1].backup == backup_address, 30,
                       "the backup in sync again")  # (a loaded machine may have ended its stream meanwhile)
            asked = time.monotonic()
            polled = ps_pb2_grpc.ParameterServerStub(channel).GetLayout.future(ps_pb2.LayoutRequest(
                watch_primary=cluster.ps[1], watch_shard=1, watch_seconds=10.0), timeout=30)
            assert _replicas(ps)[1].primary == cluster.ps[1] and not polled.done(), "the long poll did not wait"
            local.procs[1].send_signal(signal.SIGSTOP)
            pushed = threading.Thread(target=ps.push, args=(grads,))
            pushed.start()
            pushed.join(60)
            assert not pushed.is_alive(), "the push waits for its deadline at the paused primary"
            assert local.procs[1].poll() is None and _replicas(ps)[1].primary == backup_address
            watch = ps._fanout.channels.watch
            assert ps._fanout.channels.relocated == 1 and watch.asked >= 1
            record = {entry.index: entry.primary for entry in polled.result(timeout=30).replicas}
            assert record[1] == backup_address and time.monotonic() - asked < 10.0, "answered at its watch's end"
            _assert_values(ps, -2.0)
            local.procs[1].send_signal(signal.SIGCONT)
            assert local.procs[1].wait(timeout=30) == EXIT_CODE, "resumed, the old primary is fenced and stops"
    finally:
        channel.close()
        _resume_and_stop(local, backup)


def _checkpoint_values(folder, step: int) -> dict:
    """Every variable's value in the newest committed checkpoint under `folder`, which must be `step`'s."""
    from torchps.ps_server import checkpoint

    assert checkpoint.latest_committed(folder)[0] == step
    values = {}
    for index in range(2):
        values.update((entry["name"], entry["value"]) for entry in checkpoint.restore_state(folder, index, 2)["variables"])
    return values


def test_a_backup_promoted_over_a_paused_primary_that_shares_its_checkpoint_folder_serves_before_that_one_stops(
        tmp_path):
    """As ps-launch --replicas 2 runs them, the backup shares the checkpoint folder, whose part for ps:1 the
    primary holds (a file lock) as long as it runs. ps:1's primary is paused: its backup, promoted, serves the
    pushes at once, and refuses to save a checkpoint (UNAVAILABLE, naming the reason) while the paused one still
    holds the folder (before, it served nothing until the old primary stopped, and gave up after 30 s). Resumed,
    the old primary finds itself fenced and stops; the promoted backup then takes the folder, and a checkpoint
    saved holds the pushes."""
    local, backup, backup_address, cluster = _start(tmp_path, extra=("--checkpoint-dir", str(tmp_path / "ck")))
    channel = grpc.insecure_channel(backup_address)
    try:
        with PSClient(cluster, connect_timeout=30, timeout=60) as ps:
            _create_in_sync(ps, backup_address)
            grads = _ones()
            ps.push(grads)
            local.procs[1].send_signal(signal.SIGSTOP)
            ps.push(grads)  # answered by the promoted backup (the failover watch moves it there)
            assert _replicas(ps)[1].primary == backup_address and local.procs[1].poll() is None
            with pytest.raises(grpc.RpcError) as refused:
                ps_pb2_grpc.ParameterServerStub(channel).Save(ps_pb2.SaveRequest(now=True), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            assert "still holds its part of the checkpoint folder" in refused.value.details(), refused.value.details()
            local.procs[1].send_signal(signal.SIGCONT)
            assert local.procs[1].wait(timeout=30) == EXIT_CODE, "resumed, the old primary is fenced and stops"
            step = ps.save_checkpoint(0)
        values = _checkpoint_values(tmp_path / "ck", step)
        for name, shape in SHAPES.items():
            assert torch.equal(values[name], torch.full(shape, -2.0)), name
    finally:
        channel.close()
        _resume_and_stop(local, backup)
    assert "writes checkpoints" in (tmp_path / "backup.log").read_text()


def test_a_primary_whose_arbiter_does_not_hear_its_lease_writes_no_checkpoint(tmp_path):
    """ps 0, ps:1's arbiter, is paused: ps:1's lease renewals go unheard, so its backup could be promoted there
    without ps:1 knowing, and a state ps:1 saved could miss what the promoted one acknowledged. Asked to save,
    ps:1 refuses (UNAVAILABLE, naming its lease) once its last heard renewal is older than --failover-after, and
    saves again once ps 0 runs and hears it."""
    local, backup, backup_address, cluster = _start(tmp_path)
    channel = grpc.insecure_channel(cluster.ps[1])
    stub = ps_pb2_grpc.ParameterServerStub(channel)

    def refusal() -> grpc.RpcError | None:
        try:
            stub.Save(ps_pb2.SaveRequest(now=True), timeout=30)
        except grpc.RpcError as exc:
            return exc
        return None

    try:
        with PSClient(cluster, connect_timeout=30, timeout=60) as ps:
            _create_in_sync(ps, backup_address)
        assert refusal() is None, "ps:1 holding its lease did not save"
        local.procs[0].send_signal(signal.SIGSTOP)
        refused = wait_until(refusal, 30, "ps:1 to refuse a save while its arbiter hears no lease")
        assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
        assert "has not heard its lease" in refused.details(), refused.details()
        local.procs[0].send_signal(signal.SIGCONT)
        wait_until(lambda: refusal() is None, 30, "ps:1 to save once its arbiter hears its lease again")
    finally:
        channel.close()
        _resume_and_stop(local, backup)


def test_a_primary_cut_off_from_its_promoted_backup_never_acknowledges_again(tmp_path):
    """ps:1 is paused (SIGSTOP) until its backup, hearing nothing, is promoted; then ps 0 is paused and ps:1
    resumed: alive, cut off from both, it cannot acknowledge the push a client sends it directly (it waits for
    a backup that is gone and for ps 0's word). ps 0 resumed refuses to drop the backup it promoted: ps:1
    stops, and the promoted backup holds the one push acknowledged, not the refused one."""
    local, backup, backup_address, cluster = _start(tmp_path)
    old = local.address(1)
    try:
        with PSClient(cluster, connect_timeout=30) as ps:
            _create_in_sync(ps, backup_address)
            ps.push({n: torch.ones(s) for n, s in SHAPES.items()})
            local.procs[1].send_signal(signal.SIGSTOP)
            wait_until(lambda: _replicas(ps)[1].primary == backup_address, 30, "ps 0 to promote ps:1's backup")
            local.procs[0].send_signal(signal.SIGSTOP)  # stopped before ps:1 runs again: ps:1 finds the lanes
            wait_until(lambda: process_state(local.procs[0].pid) in ("T", "t"), 30, "ps 0 to stop")  # of its
            local.procs[1].send_signal(signal.SIGCONT)  # backup closed at once, and asks ps 0 to drop it
            with grpc.insecure_channel(old) as channel:  # a client that never heard of the failover
                header = ps_pb2.PushHeader(worker="worker:0", incarnation=99, seq=1, step=0, step_increment=1,
                                           tensors=1)
                chunk = ps_pb2.TensorChunk(name="rep/b", meta=ps_pb2.TensorMeta(dtype=ps_pb2.FLOAT32, shape=[1000]),
                                           offset=0, data=torch.ones(1000).numpy().tobytes())
                try:
                    ps_pb2_grpc.ParameterServerStub(channel).PushOne(
                        ps_pb2.PushRequest(header=header, chunks=[chunk]), timeout=3)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    code = exc.code()
            assert local.procs[1].poll() is None, "ps:1 must be alive, cut off, when the push comes"
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED, code
            local.procs[0].send_signal(signal.SIGCONT)
            assert local.procs[1].wait(timeout=30) == EXIT_CODE
            values = ps.pull(["rep/b"])
            assert torch.equal(values["rep/b"], torch.full((1000,), -1.0))
    finally:
        for proc in local.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        backup.terminate()
        backup.wait(timeout=30)
        local.stop()
    assert "is fenced" in local_log(tmp_path)


def local_log(tmp_path) -> str:
    return (tmp_path / "ps1.log").read_text(errors="replace")


def test_a_backup_gone_while_its_base_is_written_leaves_no_feed_the_primary_waits_for(tmp_path):
    """A backup's Replicate call is cancelled while the primary writes the base it attached that backup at (64
    MB of variables: the new log is there, the base not yet): the feed is lost at once, so the primary's next
    push is acknowledged without a backup."""
    p0, p1 = free_ports(2)
    spec = json.dumps({"ps": [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"], "worker": ["127.0.0.1:1"]})
    with LocalCluster(2, ports=[p0, p1], server_args=["--cluster", spec, "--checkpoint-dir", str(tmp_path / "ck")],
                      log_dir=tmp_path) as local:
        with PSClient(Cluster.from_json(spec), connect_timeout=30, timeout=20, partitioner=NoPartitioner()) as ps:
            shapes = {name: (8 << 20,) for name in ("a0", "b0", "a1", "b1")}  # 32 MB each, b0 and b1 on ps:1
            ps.create_variables({name: torch.zeros(shape) for name, shape in shapes.items()}, Optimizer("sgd", lr=1.0))
            assert [ps.placement.shard_of(name) for name in shapes] == [0, 1, 0, 1]
            channel = grpc.insecure_channel(local.address(1))
            stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(local.address(1)))
            hello = ps_pb2.ReplicaAck(hello=ps_pb2.ReplicaHello(index=1, address="127.0.0.1:9"))
            call = ps_pb2_grpc.ParameterServerStub(channel).Replicate(iter([hello]), timeout=60)
            # Attached at the new log (a compaction of the creation's record may have made one before: not it).
            wait_until(lambda: stub.GetStatus(ps_pb2.StatusRequest(), timeout=10).replication.backup == "127.0.0.1:9",
                       30, "ps:1 to attach the backup at a new log", interval=0.001)
            call.cancel()  # while the base is written
            channel.close()
            wait_until(lambda: stub.GetStatus(ps_pb2.StatusRequest(), timeout=10).replication.feeds_lost == 1, 30,
                       "ps:1 to count the backup's feed lost")
            ps.push({"b0": torch.ones(8 << 20)})  # acknowledged without a backup, within the client's 20 s
            status = stub.GetStatus(ps_pb2.StatusRequest(), timeout=10).replication
            assert status.backup == ""


def _open_lanes(port: int) -> float:
    """A shard's torchps_open_lanes, scraped from its metrics port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return next(sample.value for family in text_string_to_metric_families(reply.read().decode())
                    for sample in family.samples if sample.name == "torchps_open_lanes")


def test_a_backups_lanes_are_let_go_when_its_stream_ends_and_a_refused_one_loses_no_feed(tmp_path):
    """A backup's stream holds two lanes of its primary's (its records', its acks'): a second backup's hello
    naming two more is refused while the first follows (one at a time), and its lanes are let go with its call,
    no feed lost, the first backup still in sync; the first backup killed, its feed is lost and its lanes are
    let go too (they stayed claimed before, a few per attempt, until the shard refused every new lane)."""
    local, backup, backup_address, cluster = _start(tmp_path, extra=("--metrics-port", "0"))
    try:
        with PSClient(cluster, connect_timeout=30, lanes=False) as ps:  # no lane of the client's on ps:1
            _create_in_sync(ps, backup_address)
            status = ps.status(1)
            assert _open_lanes(status.metrics_port) == 2
            others = [lanes.connect("127.0.0.1", status.lane_port, 10) for _ in range(2)]
            hello = ps_pb2.ReplicaAck(hello=ps_pb2.ReplicaHello(index=1, address="127.0.0.1:9", lane=others[0].key,
                                                                acks_lane=others[1].key))
            with grpc.insecure_channel(cluster.ps[1]) as channel, pytest.raises(grpc.RpcError) as info:
                list(ps_pb2_grpc.ParameterServerStub(channel).Replicate(iter([hello]), timeout=30))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "one at a time" in info.value.details()
            wait_until(lambda: _open_lanes(status.metrics_port) == 2, 30, "the refused call's lanes to be let go")
            assert ps.status(1).replication.feeds_lost == 0 and _replicas(ps)[1].backup == backup_address
            ps.push({"rep/b": torch.ones(1000)})  # acknowledged by both
            backup.kill()
            backup.wait(timeout=30)
            wait_until(lambda: ps.status(1).replication.feeds_lost == 1 and _open_lanes(status.metrics_port) == 0,
                       30, "the killed backup's feed to be lost and its lanes let go")
            for other in others:
                other.close()
    finally:
        backup.kill()
        backup.wait(timeout=30)
        local.stop()
