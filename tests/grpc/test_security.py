"""Secure shards: mutual TLS, job tokens and roles, against real ps-server processes on 127.0.0.1.

Credentials come from torchps.certs (what ps-certs and ps-launch make): a CA, one certificate per task
whose organizational unit is its role, a job token and an admin token.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import threading

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from torchps.certs import make_job_credentials
from torchps.client import (AuthenticationError, Optimizer, PermissionDeniedError, PSClient, ServerUnavailableError,
                            ShardBusyError, TaskSpec)
from torchps.cluster import Cluster
from torchps.security import Security

from helpers import wait_until

PLACEHOLDER = Cluster(ps=("127.0.0.1:1",), chief=("127.0.0.1:2",), worker=("127.0.0.1:3", "127.0.0.1:4"),
                      evaluator=("127.0.0.1:5",))
CHIEF, WORKER, OTHER, EVALUATOR, PS = (TaskSpec("chief", 0), TaskSpec("worker", 0), TaskSpec("worker", 1),
                                       TaskSpec("evaluator", 0), TaskSpec("ps", 0))


@pytest.fixture
def job(tmp_path):
    """(credentials by task, a function making a task's Security with TLS and/or tokens)."""
    files = make_job_credentials(tmp_path / "job", PLACEHOLDER)

    def security(task: TaskSpec, *, tls: bool = True, token: bool = True) -> Security:
        f = files[task]
        return Security.load(tls_cert=str(f.cert) if tls else None, tls_key=str(f.key) if tls else None,
                             tls_ca=str(f.ca) if tls else None, token_file=str(f.token) if token else None,
                             admin_token_file=str(f.admin_token) if token and f.admin_token else None, environ={})

    return files, security


def shard_flags(files, *, tls: bool = True, token: bool = True) -> list[str]:
    f = files[PS]
    return ([*("--tls-cert", str(f.cert), "--tls-key", str(f.key), "--tls-ca", str(f.ca))] if tls else []) + \
        ([*("--token-file", str(f.token), "--admin-token-file", str(files[CHIEF].admin_token))] if token else [])


def client(local, task: TaskSpec, security: Security, **kwargs) -> PSClient:
    return PSClient(local.cluster, task=task, security=security, connect_timeout=kwargs.pop("connect_timeout", 10),
                    **kwargs)


def start_job(local, security):
    """The chief configures and creates w (2 floats, sgd lr 1); returns the chief's client."""
    chief = client(local, CHIEF, security(CHIEF))
    chief.configure("async")
    chief.create_variables({"w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
    return chief


@pytest.mark.parametrize("tls,token", [(True, False), (False, True), (True, True)], ids=["tls", "token", "both"])
def test_every_role_does_its_job(local_cluster, job, tls, token):
    files, security = job
    local = local_cluster(1, server_args=shard_flags(files, tls=tls, token=token))
    make = lambda task: security(task, tls=tls, token=token)  # noqa: E731
    with client(local, CHIEF, make(CHIEF)) as chief, client(local, WORKER, make(WORKER)) as worker, \
            client(local, EVALUATOR, make(EVALUATOR)) as evaluator:
        chief.configure("async")
        chief.create_variables({"w": torch.zeros(2)}, Optimizer("sgd", lr=1.0))
        worker.declare({"w": torch.zeros(2)}), evaluator.declare({"w": torch.zeros(2)})
        worker.join()
        worker.push({"w": torch.ones(2)})
        assert torch.equal(evaluator.pull(["w"])["w"], -torch.ones(2))
        assert evaluator.status(0).step == 1
        assert ("mutual TLS" if tls else "plaintext, per-task tokens") in local.log(0)


def test_calls_without_the_token_or_with_a_wrong_one_are_unauthenticated_and_change_nothing(local_cluster, job,
                                                                                             tmp_path):
    files, security = job
    local = local_cluster(1, server_args=shard_flags(files, tls=False))
    with start_job(local, lambda task: security(task, tls=False)) as chief:
        wrong = tmp_path / "wrong-token"
        wrong.write_text("not the job's token")
        for bad in (Security(), Security(token=wrong.read_text())):
            with client(local, WORKER, bad) as intruder:
                intruder.declare({"w": torch.zeros(2)})
                for call in (lambda: intruder.push({"w": torch.ones(2)}), lambda: intruder.pull(["w"]),
                             lambda: intruder.status(0), lambda: intruder.shutdown_cluster() or intruder.status(0)):
                    with pytest.raises(AuthenticationError, match="token"):
                        call()
        assert torch.equal(chief.pull(["w"])["w"], torch.zeros(2)) and chief.status(0).step == 0
        assert local.procs[0].poll() is None, "the shard did not shut down for a caller without the token"


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "token-only"])
def test_admin_calls_are_the_chiefs_only(local_cluster, job, tls):
    files, security = job
    local = local_cluster(1, server_args=shard_flags(files, tls=tls, token=True))
    with start_job(local, lambda task: security(task, tls=tls)) as chief, \
            client(local, WORKER, security(WORKER, tls=tls)) as worker:
        worker.declare({"w": torch.zeros(2)})
        refused = {
            "Configure": lambda: worker.configure("sync", total_num_replicas=1),
            "CreateVariables": lambda: worker.create_variables({"x": torch.zeros(1)}),
            "UpdateOptimizer": lambda: worker.set_hyperparams(lr=5.0),
            "Save": lambda: worker.save_checkpoint(0),
        }
        for method, call in refused.items():
            with pytest.raises(PermissionDeniedError, match=method):
                call()
        worker.shutdown_cluster()  # best effort: logs the refusal
        assert local.procs[0].poll() is None and chief.status(0).index == 0, "a worker cannot stop the job"
        assert chief.set_hyperparams(lr=0.5) == 1


def test_an_evaluator_may_only_read(local_cluster, job):
    files, security = job
    local = local_cluster(1, server_args=shard_flags(files))
    with start_job(local, security) as chief, client(local, EVALUATOR, security(EVALUATOR)) as evaluator:
        evaluator.declare({"w": torch.zeros(2)})
        assert torch.equal(evaluator.pull(["w"])["w"], torch.zeros(2))
        for call in (lambda: evaluator.push({"w": torch.ones(2)}), evaluator.join):
            with pytest.raises(PermissionDeniedError):
                call()
        assert chief.status(0).step == 0


def test_a_worker_acts_in_its_own_name_only(local_cluster, job):
    files, security = job
    local = local_cluster(1, server_args=shard_flags(files))
    with start_job(local, security) as chief, client(local, WORKER, security(WORKER)) as worker:
        worker.declare({"w": torch.zeros(2)})
        worker.worker = "worker:1"  # what a forged request says
        for call in (worker.join, lambda: worker.push({"w": torch.ones(2)}), worker.leave):
            with pytest.raises(PermissionDeniedError, match="own name"):
                call()
        assert chief.status(0).step == 0 and chief.status(0).live_workers == 0


def test_without_tls_a_per_task_token_names_its_holder(local_cluster, job):
    """Tokens only: worker:1's token cannot Join, Push or Leave as worker:0 (it would retire worker:0's
    incarnation and shut it out), nor an evaluator's token push; the job token of old (one for every task)
    is not what ps-certs makes any more."""
    files, security = job
    local = local_cluster(1, server_args=shard_flags(files, tls=False))
    make = lambda task: security(task, tls=False)  # noqa: E731
    assert files[WORKER].token.read_text() != files[OTHER].token.read_text()
    with start_job(local, make) as chief, client(local, WORKER, make(WORKER)) as worker, \
            client(local, WORKER, make(OTHER)) as impostor, client(local, EVALUATOR, make(EVALUATOR)) as evaluator:
        for c in (worker, impostor, evaluator):
            c.declare({"w": torch.zeros(2)})
        worker.join()
        worker.push({"w": torch.ones(2)})
        for call in (impostor.join, lambda: impostor.push({"w": torch.ones(2)}), impostor.leave):
            with pytest.raises(PermissionDeniedError, match="own name"):
                call()
        with pytest.raises(PermissionDeniedError, match="evaluator role"):
            evaluator.push({"w": torch.ones(2)})
        worker.push({"w": torch.ones(2)})  # still worker:0's incarnation: nobody shut it out
        assert torch.equal(chief.pull(["w"])["w"], -2 * torch.ones(2))
        assert chief.status(0).live_workers == 1
        assert "plaintext, per-task tokens" in local.log(0)


def test_membership_is_bounded_by_the_cluster_spec_and_the_elastic_places(local_cluster, job):
    """The cluster spec's workers always join; at most --elastic-workers other names do, the next is refused
    (PERMISSION_DENIED, nothing changed); a name already in stays welcome."""
    files, security = job
    local = local_cluster(1, server_args=[*shard_flags(files), "--cluster", json.dumps(PLACEHOLDER.to_dict()),
                                          "--elastic-workers", "1"])
    with start_job(local, security) as chief:
        joined = []
        for name in ("worker:0", "worker:1", "chief:0", "worker:7", "worker:8"):  # the spec's three, then two more
            chief.worker = name  # the chief may act in any name
            try:
                chief.join()
                joined.append(name)
            except PermissionDeniedError as exc:
                assert name == "worker:8" and "--elastic-workers" in str(exc), exc
        assert joined == ["worker:0", "worker:1", "chief:0", "worker:7"]
        assert chief.status(0).live_workers == 4
        chief.worker = "worker:7"
        chief.join()  # a member that comes back is no new name


def test_max_calls_per_client_counts_a_certificate_across_its_connections(local_cluster, job):
    """Under TLS the quota is per certificate: a second connection with worker:0's key shares worker:0's
    calls and is refused while its first waits; worker:1 is served, and its push releases the wait."""
    files, security = job
    local = local_cluster(1, server_args=[*shard_flags(files), "--max-calls-per-client", "1"])
    with start_job(local, security) as chief, client(local, WORKER, security(WORKER)) as first, \
            client(local, WORKER, security(WORKER), connect_timeout=1) as second, \
            client(local, OTHER, security(OTHER)) as other:
        for c in (first, second, other):
            c.declare({"w": torch.zeros(2)})
        waiting = threading.Thread(target=lambda: first.pull_into({"w": torch.zeros(2)}, min_step=1), daemon=True)
        waiting.start()
        wait_until(lambda: chief.status(0).waiting_calls == 1, 20, "worker:0's pull to wait")
        with pytest.raises(ShardBusyError, match="worker:0 already has 1 calls"):
            second.pull(["w"])  # another connection, the same certificate: retried for 1 s, then raised
        other.push({"w": torch.ones(2)})  # worker:1's own quota
        waiting.join(20)
        assert not waiting.is_alive() and chief.status(0).step == 1


def test_tls_mismatches_fail_fast_with_one_line_naming_the_cause(local_cluster, job, tmp_path):
    files, security = job
    local = local_cluster(1, server_args=shard_flags(files))
    other_ca = make_job_credentials(tmp_path / "other", PLACEHOLDER)
    foreign = Security.load(tls_cert=str(other_ca[WORKER].cert), tls_key=str(other_ca[WORKER].key),
                            tls_ca=str(files[WORKER].ca), token_file=str(files[WORKER].token), environ={})
    cases = {
        "plaintext client": (Security(token=security(WORKER).token), "requires TLS"),
        "certificate of another CA": (foreign, "refused this client's certificate"),
        "expired certificate": (expired(files, tmp_path), "expired"),
        "shard not trusted": (Security.load(tls_cert=str(files[WORKER].cert), tls_key=str(files[WORKER].key),
                                            tls_ca=str(other_ca[WORKER].ca), environ={}),
                              "does not verify against this client's --tls-ca"),
    }
    for what, (bad, cause) in cases.items():
        with client(local, WORKER, bad, connect_timeout=60) as c:
            with pytest.raises(ServerUnavailableError, match=cause) as info:
                c.status(0)
            assert "\n" not in str(info.value), f"{what}: one line"


def expired(files, tmp_path: pathlib.Path) -> Security:
    """The worker's certificate re-issued by the job's CA with a validity that ended yesterday."""
    ca_key = serialization.load_pem_private_key(files[WORKER].ca.with_name("ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate(files[WORKER].ca.read_bytes())
    cert = x509.load_pem_x509_certificate(files[WORKER].cert.read_bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    old = (x509.CertificateBuilder().subject_name(cert.subject).issuer_name(ca.subject).public_key(cert.public_key())
           .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=3))
           .not_valid_after(now - datetime.timedelta(days=1)).sign(ca_key, hashes.SHA256()))
    path = tmp_path / "expired.crt"
    path.write_bytes(old.public_bytes(serialization.Encoding.PEM))
    return Security.load(tls_cert=str(path), tls_key=str(files[WORKER].key), tls_ca=str(files[WORKER].ca),
                         token_file=str(files[WORKER].token), environ={})


def test_a_connection_dropped_mid_handshake_is_not_called_a_tls_mismatch(job):
    """A proxy or a restarting shard that accepts and closes at once: no TLS problem is named (the client
    reports the shard unreachable instead), with or without TLS on the client."""
    import socket
    import threading

    from torchps.security import INSECURE, diagnose

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def close_each():
        for _ in range(4):  # two connections per diagnose(): HTTP/2, then TLS
            conn, _ = listener.accept()
            conn.close()

    closer = threading.Thread(target=close_each, daemon=True)
    closer.start()
    try:
        for security in (INSECURE, job[1](WORKER)):
            found, hopeless = diagnose(f"127.0.0.1:{port}", security)
            assert not hopeless and "closes every connection" in found, found
    finally:
        closer.join(10)
        listener.close()
