"""Workers that come and go: a worker not in the job's starting spec joins a running job with credentials
`ps-certs --add` minted for it, the shards taking its token from their re-read token file (no restart); a
token taken out of the file is refused again; a sync quorum follows the live workers, fixed or as a
fraction of them, as workers join and leave. Real ps-server processes, real ps-certs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from torchps.certs import make_job_credentials
from torchps.client import AuthenticationError, Optimizer, PSClient, TaskSpec
from torchps.cluster import Cluster
from torchps.security import Security

from helpers import wait_until

SPEC = Cluster(ps=("127.0.0.1:1",), chief=("127.0.0.1:2",), worker=("127.0.0.1:3",))
CHIEF, PS, NEW = TaskSpec("chief", 0), TaskSpec("ps", 0), TaskSpec("worker", 5)


def ps_certs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchps.certs", *args], capture_output=True, text=True, timeout=60)


def load(folder, stem: str, *, tls: bool, token: bool, admin: bool = False) -> Security:
    return Security.load(tls_cert=str(folder / f"{stem}.crt") if tls else None,
                         tls_key=str(folder / f"{stem}.key") if tls else None,
                         tls_ca=str(folder / "ca.crt") if tls else None,
                         token_file=str(folder / f"{stem}.token") if token else None,
                         admin_token_file=str(folder / "admin-token") if admin and token else None, environ={})


@pytest.mark.parametrize("tls,token", [(True, True), (False, True), (True, False)], ids=["both", "token", "tls"])
def test_a_worker_minted_while_the_job_runs_joins_without_a_shard_restart(local_cluster, tmp_path, tls, token):
    folder = tmp_path / "job"
    make_job_credentials(folder, SPEC)
    shard = ([*("--tls-cert", str(folder / "ps-0.crt"), "--tls-key", str(folder / "ps-0.key"),
                "--tls-ca", str(folder / "ca.crt"))] if tls else []) + \
        ([*("--token-file", str(folder / "tokens"), "--admin-token-file", str(folder / "admin-token"))]
         if token else [])
    local = local_cluster(1, server_args=[*shard, "--cluster", json.dumps(SPEC.to_dict()), "--elastic-workers", "1"])
    pid = local.procs[0].pid
    with PSClient(local.cluster, task=CHIEF, security=load(folder, "chief-0", tls=tls, token=token, admin=True),
                  connect_timeout=10) as chief:
        chief.configure("async")
        chief.create_variables({"w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        made = ps_certs(str(folder), "--add", "worker:5")
        assert made.returncode == 0, made.stderr
        assert made.stdout.startswith("worker:5: --tls-cert "), made.stdout
        assert (folder / "tokens").read_text().count("worker:5 worker ") == 1
        with PSClient(local.cluster, task=NEW, security=load(folder, "worker-5", tls=tls, token=token),
                      connect_timeout=10) as worker:
            worker.declare({"w": torch.zeros(2)})
            worker.join()
            worker.push({"w": torch.ones(2)})
            assert chief.status(0).live_workers == 1 and chief.pull(["w"])["w"].tolist() == [-1.0, -1.0]
            worker.leave()
            assert chief.status(0).live_workers == 0
        assert local.procs[0].pid == pid and local.procs[0].poll() is None  # the same process all along
        if not token:
            return
        # Revoked: the table written again without worker:5's line; refused once the shard looked again.
        table = (folder / "tokens").read_text().splitlines(keepends=True)
        aside = folder / "tokens.new"
        aside.write_text("".join(line for line in table if not line.startswith("worker:5 ")))
        aside.replace(folder / "tokens")
        with PSClient(local.cluster, task=NEW, security=load(folder, "worker-5", tls=tls, token=token),
                      connect_timeout=10) as worker:
            def refused() -> bool:
                try:
                    worker.status(0)
                except AuthenticationError:
                    return True
                return False
            wait_until(refused, 10, "the shard refusing the revoked token")
            assert chief.status(0).live_workers == 0


def test_ps_certs_add_refuses_what_cannot_join_and_writes_nothing(tmp_path):
    folder = tmp_path / "job"
    make_job_credentials(folder, SPEC)
    table = (folder / "tokens").read_bytes()
    for args, says in ((["--add", "worker:0"], "already holds worker:0's files"),
                       (["--add", "chief:1"], "only worker, evaluator, ps and serving tasks join"),
                       (["--add", "worker"], "expected TYPE:INDEX")):
        run = ps_certs(str(folder), *args)
        assert run.returncode == 2 and says in run.stderr, run.stderr
    (folder / "ca.key").unlink()
    run = ps_certs(str(folder), "--add", "worker:6")
    assert run.returncode == 2 and "has no ca.key" in run.stderr, run.stderr
    assert (folder / "tokens").read_bytes() == table and not (folder / "worker-6.crt").exists()


def test_a_fractional_quorum_follows_workers_joining_and_leaving_and_the_shard_logs_each_change(local_cluster):
    local = local_cluster(1)
    clients = [PSClient(local.cluster, task=TaskSpec("worker", i), connect_timeout=10) for i in range(5)]
    try:
        clients[0].configure("sync", total_num_replicas=1, replicas_fraction=0.75, lease_seconds=30)
        quorums = []
        for c in clients:  # 1, 2, 3, 4, 5 live: ceil(0.75 x live)
            c.join()
            quorums.append(clients[0].status(0).quorum)
        assert quorums == [1, 2, 3, 3, 4]
        for c in clients[3:]:  # two leave for good: 4, then 3 live
            c.leave()
            quorums.append(clients[0].status(0).quorum)
        assert quorums[5:] == [3, 3]
        assert clients[0].status(0).quorum_changes == 4  # 1->2->3, 3->4, 4->3 (set by the first join: uncounted)
    finally:
        for c in clients:
            c.close()
    log = local.log(0)
    assert "quorum 3 -> 4 (75% of 5 live workers)" in log and "quorum 4 -> 3 (75% of 4 live workers)" in log, log


def test_live_worker_callbacks_run_before_the_next_push_once_per_change(local_cluster):
    local = local_cluster(1)
    seen = []
    with PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=10) as ps, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=10) as other:
        ps.configure("async", lease_seconds=1.5)  # heartbeats every 0.5 s
        ps.create_variables({"v": torch.zeros(1)}, Optimizer("sgd", lr=1.0))
        ps.on_live_workers_change(lambda live, previous: seen.append((live, previous, ps.step)))
        ps.join()
        wait_until(lambda: ps.live_workers == 1, 10, "shard 0 reporting one live worker")
        ps.push({"v": torch.ones(1)})
        ps.push({"v": torch.ones(1)})
        other.declare({"v": torch.zeros(1)})
        other.join()
        wait_until(lambda: ps.live_workers == 2, 10, "shard 0 reporting two live workers")
        assert len(seen) == 1  # nothing runs in the heartbeat thread
        ps.push({"v": torch.ones(1)})
        other.leave()
        wait_until(lambda: ps.live_workers == 1, 10, "shard 0 reporting one live worker again")
        ps.push({"v": torch.ones(1)})
    assert seen == [(1, None, 0), (2, 1, 2), (1, 2, 3)]
