"""A running job's credentials folder changed under it (issue 39, items 2, 6 and 7), with real ps-server processes
over mutual TLS and per-task tokens, real ps-certs and ps-admin: ps-certs never writes over a folder that holds a
job's credentials; `--rotate` gives every task a new token while the old ones keep working for the grace, then
are refused (UNAUTHENTICATED); `--add ps:N` mints a shard that ps-admin resizes the running job onto, with the
chief's credentials passed as ps-worker's flags, without importing torch; `--add TASK=HOST:PORT` prints the
TF_CONFIG the new task starts with.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from helpers import wait_until
from torchps.certs import make_job_credentials
from torchps.client import AuthenticationError, Optimizer, PSClient, TaskSpec
from torchps.cluster import Cluster

SPEC = Cluster(ps=("127.0.0.1:1",), chief=("127.0.0.1:2",), worker=("127.0.0.1:3", "127.0.0.1:4"))
CHIEF, PS0, W0, W1 = TaskSpec("chief", 0), TaskSpec("ps", 0), TaskSpec("worker", 0), TaskSpec("worker", 1)
BIN = pathlib.Path(sys.executable).parent
NAMES = {f"cred/v{i}": (64,) for i in range(4)}


def ps_certs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ps-certs"), *map(str, args)], capture_output=True, text=True, timeout=60)


def ps_admin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ps-admin"), *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def tls_job(local_cluster, tmp_path):
    """A folder ps-certs made for SPEC, one shard serving with its files (TLS, the token table, the admin token)
    and the chief connected with its own, the variables NAMES created: (folder, its files, shards, chief)."""
    folder = tmp_path / "job"
    files = make_job_credentials(folder, SPEC)
    local = local_cluster(1, server_args=files[PS0].flags())
    with PSClient(local.cluster, task=CHIEF, security=files[CHIEF].security(), connect_timeout=10,
                  partitioner=None) as chief:
        chief.configure("async")
        chief.create_variables({n: torch.zeros(s) for n, s in NAMES.items()}, Optimizer("sgd", lr=1.0))
        yield folder, files, local, chief


def worker(local, files, task: TaskSpec) -> PSClient:
    """A worker of the job with the credentials its files hold now (read once, as ps-worker reads them)."""
    client = PSClient(local.cluster, task=task, security=files.security(), connect_timeout=10, partitioner=None)
    client.declare({n: torch.zeros(s) for n, s in NAMES.items()})
    client.join()
    return client


def push(client: PSClient) -> int:
    return client.push({n: torch.ones(s) for n, s in NAMES.items()})


def refused(client: PSClient) -> str | None:
    """The message of the AuthenticationError a push gets, or None if it is accepted."""
    try:
        push(client)
    except AuthenticationError as exc:
        return str(exc)
    return None


def test_ps_certs_refuses_a_folder_that_holds_a_jobs_credentials_and_writes_nothing(tmp_path):
    """Issue 39, item 2: run again over the folder of a running job, ps-certs replaced its CA, keys and tokens."""
    folder = tmp_path / "job"
    make_job_credentials(folder, SPEC)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    again = ps_certs(folder, "--cluster", json.dumps(SPEC.to_dict()))
    assert again.returncode == 2 and len(again.stderr.splitlines()) == 1, again.stderr
    assert f"{folder} already holds a job's credentials" in again.stderr and "--rotate" in again.stderr
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_rotated_tokens_keep_a_running_tls_job_training_until_the_grace_ends(tls_job):
    """Issue 39, item 2: after `ps-certs DIR --rotate` the shard takes the new tokens (a worker started with its
    new token joins) and still accepts the old ones (the worker running since before trains on); once the grace
    ends, the old token is refused with UNAUTHENTICATED, naming the rotation, and the worker restarted with its
    token file trains. The CA, keys and admin token stay: the chief is never refused."""
    folder, files, local, chief = tls_job
    old = worker(local, files[W0], W0)
    try:
        push(old)
        rotated = ps_certs(folder, "--rotate")  # the default grace: 10 minutes
        assert rotated.returncode == 0 and "the old ones are accepted until" in rotated.stdout, rotated.stderr
        with worker(local, files[W1], W1) as new:  # started now: worker-1.token holds its new token
            push(new)  # the shard knows the new token: it re-read its table
            for _ in range(3):
                assert refused(old) is None, "the old token within its grace"
            # A second rotation with a short grace cuts every older token's grace to it.
            again = ps_certs(folder, "--rotate", "--grace", "2s")
            assert again.returncode == 0, again.stderr
            message = wait_until(lambda: refused(old), 30, "the shard refusing the old token after the grace")
            assert message.startswith("ps 0 refused the call: its token was replaced by ps-certs --rotate"), message
            assert "grace period has ended" in message
        with worker(local, files[W0], W0) as restarted:  # reads its newest token
            push(restarted)
        assert chief.status(0).num_variables == len(NAMES)
    finally:
        old.close()
    tokens = (folder / "tokens").read_text().splitlines()
    assert len([line for line in tokens if line.startswith("worker:0 ") and "until=" not in line]) == 1


def test_a_shard_minted_with_add_joins_a_running_tls_job_by_ps_admin_resize(tls_job, tmp_path):
    """Issue 39, items 6 and 7: `ps-certs DIR --add ps:1` mints the shard's files; it starts with them and
    `ps-admin resize`, given the chief's files by ps-worker's flags, moves the job onto it while it runs;
    ps-admin imports no torch, and without credentials says in one line what to pass."""
    folder, files, local, chief = tls_job
    minted = ps_certs(folder, "--add", "ps:1")
    assert minted.returncode == 0, minted.stderr
    flags = minted.stdout.splitlines()[0]
    assert flags.startswith("ps:1: --tls-cert ") and f"--token-file {folder}/tokens" in flags, minted.stdout
    added = local.add_ps(args=[*flags.removeprefix("ps:1: ").split(), "--join"])
    spec = json.dumps({"ps": list(local.cluster.ps)})
    chief_flags = files[CHIEF].flags()
    bare = ps_admin("layout", "--cluster", spec)
    assert bare.returncode == 2 and len(bare.stderr.splitlines()) == 1, bare.stderr
    assert "--tls-cert" in bare.stderr and "--insecure" in bare.stderr
    done = ps_admin("resize", "--cluster", spec, "--ps", f"{local.address(0)},{added}", *chief_flags)
    assert done.returncode == 0 and "1 -> 2 shards" in done.stdout, done.stderr
    # ps-admin layout in an interpreter of its own: the answer, and no torch imported for it.
    script = ("import sys; from torchps.admin import main; code = main(sys.argv[1:]); "
              "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    shown = subprocess.run([sys.executable, "-c", script, "layout", "--cluster", spec, *chief_flags],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "layout epoch 1: 2 shards" and lines[-1] == "no torch", shown.stdout
    assert lines[2].startswith(f"  ps:1 {added}: 2 variables"), shown.stdout
    push(chief)  # the chief follows the new layout onto the added shard
    assert chief.layout_epoch == 1 and chief.status(1).num_variables == 2
    assert all(torch.equal(v, torch.full((64,), -1.0)) for v in chief.pull(list(NAMES)).values())


def test_ps_certs_add_prints_the_tf_config_of_a_task_given_its_address(tmp_path):
    """Issue 39, item 7: a task added at the next index of its type with HOST:PORT gets the TF_CONFIG of the
    cluster extended by it (kept in DIR/cluster.json for the next); otherwise a note says what is missing."""
    folder = tmp_path / "job"
    make_job_credentials(folder, SPEC)
    added = ps_certs(folder, "--add", "worker:2=127.0.0.1:7", "--add", "ps:1=127.0.0.1:8", "--add", "worker:5")
    assert added.returncode == 0, added.stderr
    configs = dict(line.split(": TF_CONFIG=", 1) for line in added.stdout.splitlines() if ": TF_CONFIG=" in line)
    assert sorted(configs) == ["ps:1", "worker:2"], added.stdout
    cluster, task = Cluster.from_tf_config({"TF_CONFIG": configs["worker:2"].strip("'")})
    assert task == TaskSpec("worker", 2) and cluster.worker == ("127.0.0.1:3", "127.0.0.1:4", "127.0.0.1:7")
    assert cluster.ps == ("127.0.0.1:1", "127.0.0.1:8")
    assert Cluster.from_json(str(folder / "cluster.json")) == cluster
    assert added.stderr.splitlines() == [
        "ps-certs: worker:5 needs the job's cluster with its address as worker 5 (TF_CONFIG or --cluster): pass "
        "--add worker:5=HOST:PORT and ps-certs prints it"], added.stderr


@pytest.mark.parametrize("add,why", [("worker:7=127.0.0.1:9", "so the next is worker:2 (a cluster lists no gaps)"),
                                     ("worker:1=127.0.0.1:9", "lists worker:1 at 127.0.0.1:4")])
def test_ps_certs_add_refuses_an_address_that_does_not_fit_the_cluster_and_writes_nothing(tmp_path, add, why):
    """An address past the recorded cluster's next index, or another one for a task it lists (here worker:1,
    whose files were deleted once it left), would give a task files but no cluster to start in: one line, exit
    code 2, nothing written."""
    folder = tmp_path / "job"
    make_job_credentials(folder, SPEC)
    for old in folder.glob("worker-1.*"):
        old.unlink()
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    added = ps_certs(folder, "--add", add)
    assert added.returncode == 2 and why in added.stderr and added.stderr.count("\n") == 1, added.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_ps_admin_help_names_the_credential_flags_and_variables():
    """Issue 39, item 6: ps-admin's error told to pass --tls-cert, which it did not take."""
    for args in (["--help"], ["layout", "--help"], ["resize", "--help"]):
        shown = ps_admin(*args)
        assert shown.returncode == 0, shown.stderr
        text = " ".join(shown.stdout.split())
        for variable in ("$TORCHPS_TLS_CERT", "$TORCHPS_TLS_KEY", "$TORCHPS_TLS_CA", "$TORCHPS_TOKEN_FILE",
                         "$TORCHPS_ADMIN_TOKEN_FILE"):
            assert variable in text, (args, variable)
        if args != ["--help"]:
            assert all(flag in text for flag in ("--tls-cert", "--token-file", "--admin-token-file", "--insecure"))
