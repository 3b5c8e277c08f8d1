"""deploy/cluster_commands.py: one TF_CONFIG and command per task."""

import base64
import json
import pathlib
import shlex
import subprocess
import sys

from torchps.client import Cluster

from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_module():
    return load_script("deploy/cluster_commands.py", "cluster_commands")


def test_every_task_gets_the_cluster_and_its_own_task():
    cluster = Cluster(ps=["h3:2222", "h4:2222"], worker=["h1:2222"], chief=["h0:2222"])
    lines = load_module().commands(cluster, ["--mode", "sync", "--checkpoint-dir", "/ckpt"])
    assert [host for host, _ in lines] == ["h0", "h1", "h3", "h4"]
    seen = []
    for _, line in lines:
        env, *argv = shlex.split(line)
        config = json.loads(env.removeprefix("TF_CONFIG="))
        assert Cluster.from_dict(config) == cluster
        seen.append((config["task"]["type"], config["task"]["index"], argv))
    assert seen == [
        ("chief", 0, ["ps-worker", "--mode", "sync", "--insecure"]),
        ("worker", 0, ["ps-worker", "--mode", "sync", "--insecure"]),
        ("ps", 0, ["ps-server", "--checkpoint-dir", "/ckpt", "--insecure"]),
        ("ps", 1, ["ps-server", "--checkpoint-dir", "/ckpt", "--insecure"]),
    ]


def test_with_credentials_every_task_names_its_own_files_and_ps_certs_comes_first():
    cluster = Cluster(ps=["h3:2222"], worker=["h1:2222", "h2:2222"])
    (first, *lines) = load_module().commands(cluster, ["--epochs", "2"], "/etc/job")
    assert shlex.split(first[1])[:2] == ["ps-certs", "/etc/job"]
    assert Cluster.from_json(shlex.split(first[1])[3]) == cluster
    flags = {json.loads(shlex.split(line)[0].removeprefix("TF_CONFIG="))["task"]["index"] if "ps-worker" in line
             else "ps": shlex.split(line)[2:] for _, line in lines}
    assert flags["ps"][flags["ps"].index("--tls-cert") + 1] == "/etc/job/ps-0.crt"
    assert flags[0][flags[0].index("--tls-key") + 1] == "/etc/job/worker-0.key"
    assert "--admin-token-file" in flags[0] and "--admin-token-file" in flags["ps"], "the chief and the shards"
    assert "--admin-token-file" not in flags[1], "worker 1 is no chief"


def test_ps_certs_kubernetes_secrets_give_each_task_only_its_own_files(tmp_path):
    cluster = Cluster(ps=["h3:2222"], chief=["h0:2222"], worker=["h1:2222"])
    result = subprocess.run([sys.executable, "-m", "torchps.certs", str(tmp_path / "job"), "--cluster",
                             json.dumps(cluster.to_dict()), "--kubernetes-secret", "mnist"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    secrets = {}
    for document in result.stdout.split("---\n"):
        lines = document.splitlines()
        assert lines[:2] == ["apiVersion: v1", "kind: Secret"], document
        name = next(line.split(": ")[1] for line in lines if line.startswith("  name: "))
        data = lines[lines.index("data:") + 1:]
        secrets[name] = {key.strip(): base64.b64decode(value) for key, value in (line.split(": ") for line in data)}
    assert sorted(secrets) == ["mnist-chief-0", "mnist-ps-0", "mnist-worker-0"]
    job = tmp_path / "job"
    for task, name in (("chief-0", "mnist-chief-0"), ("worker-0", "mnist-worker-0"), ("ps-0", "mnist-ps-0")):
        files = secrets[name]
        assert files["tls.crt"] == (job / f"{task}.crt").read_bytes()
        assert files["tls.key"] == (job / f"{task}.key").read_bytes()
        token = job / ("tokens" if task == "ps-0" else f"{task}.token")  # a shard holds every task's, by name
        assert files["ca.crt"] == (job / "ca.crt").read_bytes() and files["token"] == token.read_bytes()
    assert secrets["mnist-chief-0"]["token"] != secrets["mnist-worker-0"]["token"], "a token of its own per task"
    assert "admin-token" in secrets["mnist-chief-0"] and "admin-token" in secrets["mnist-ps-0"]
    assert "admin-token" not in secrets["mnist-worker-0"], "a worker must not hold the admin token"
    ca_key = (job / "ca.key").read_bytes()
    assert all(ca_key not in value for files in secrets.values() for value in files.values())


def _containers(node):
    """Every container spec (a mapping with an image) anywhere in a parsed manifest."""
    if isinstance(node, dict):
        if "image" in node and ("args" in node or "command" in node):
            yield node
        for value in node.values():
            yield from _containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _containers(value)


def test_every_shipped_shard_sets_its_memory_quota_from_the_pods_memory():
    """Quotas are on wherever a shard is shipped: each manifest's ps-server gets --max-memory as a share of its
    pod's memory limit, which it reads from its cgroup."""
    import yaml

    shards = []
    for path in sorted((ROOT / "deploy").rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            for container in _containers(document):
                args = [str(a) for a in container.get("args") or []]
                if "ps-server" in args:
                    shards.append((path.relative_to(ROOT), args))
    assert {str(path) for path, _ in shards} == {"deploy/kubeflow/tfjob.yaml", "deploy/kubernetes/base/ps.yaml",
                                                 "deploy/kubernetes/overlays/replicas/ps-backup.yaml"}
    for path, args in shards:
        assert "--max-memory" in args, f"{path}: ps-server without --max-memory"
        assert args[args.index("--max-memory") + 1].endswith("%"), f"{path}: a share of the pod's memory"


def test_a_tasks_own_folder_holds_its_own_token_and_a_shard_the_table_of_them(tmp_path):
    """ps-launch's per-task folders (issue_job_credentials + write_task, the CA key in memory only) use the
    per-task tokens ps-certs writes: each task its own token, a shard the table naming every task and role (its
    own line: the token it calls other shards with); ps-certs' folder (write) holds the same tokens under its
    own names."""
    from torchps.certs import issue_job_credentials
    from torchps.cluster import TaskSpec
    from torchps.security import Security

    cluster = Cluster(ps=["127.0.0.1:1"], worker=["127.0.0.1:2", "127.0.0.1:3"], chief=["127.0.0.1:4"])
    issued = issue_job_credentials(cluster, days=1)
    assert issued.ca_key is None
    chief, worker, shard = TaskSpec("chief", 0), TaskSpec("worker", 1), TaskSpec("ps", 0)
    files = {task: issued.write_task(task, tmp_path / f"{task.type}-{task.index}") for task in (chief, worker, shard)}
    for task, given in files.items():
        assert given.token.parent == tmp_path / f"{task.type}-{task.index}" and given.token.name == "token"
        assert not list(tmp_path.rglob("ca.key"))
    own = {task: files[task].token.read_text() for task in (chief, worker)}
    assert own[chief] != own[worker]
    table = Security.load(token_file=str(files[shard].token), environ={}).task_tokens
    other = issued.tokens[TaskSpec("worker", 0)].decode()
    assert sorted(table) == [("chief:0", "chief", own[chief]), ("ps:0", "ps", issued.tokens[shard].decode()),
                             ("worker:0", "worker", other), ("worker:1", "worker", own[worker])]
    assert Security.load(token_file=str(files[worker].token), environ={}).token == own[worker]
    written = issued.write(tmp_path / "certs")
    assert written[worker].token.read_text() == own[worker] and written[shard].token.name == "tokens"
    assert written[shard].token.read_bytes() == files[shard].token.read_bytes()
    assert not (tmp_path / "certs" / "ca.key").exists() and not (tmp_path / "certs" / "token").exists()


def test_ps_certs_backups_name_each_backups_host_in_its_shards_certificate_and_bad_ones_are_one_line(tmp_path):
    """`ps-certs --backups` (the replicas overlay's backups.json): shard N's certificate also names the host of
    backup N, which serves with shard N's files; no other task's changes. A list that is not one of HOST:PORT,
    or --backups without --cluster, is one line and exit code 2, nothing written."""
    from cryptography import x509

    cluster = json.dumps(Cluster(ps=["h3:2222", "h4:2222"], worker=["h1:2222"]).to_dict())

    def certs(folder: str, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torchps.certs", str(tmp_path / folder), *flags],
                              capture_output=True, text=True, timeout=120)

    def names(path: pathlib.Path) -> set[str]:
        certificate = x509.load_pem_x509_certificate(path.read_bytes())
        return set(certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                   .get_values_for_type(x509.DNSName))

    assert certs("job", "--cluster", cluster, "--backups", '["b3:2222", "b4:2222"]').returncode == 0
    assert names(tmp_path / "job" / "ps-0.crt") == {"localhost", "h3", "b3"}
    assert names(tmp_path / "job" / "ps-1.crt") == {"localhost", "h4", "b4"}
    assert names(tmp_path / "job" / "worker-0.crt") == {"localhost", "h1"}
    for flags, error in ((["--cluster", cluster, "--backups", "[1]"], "expected a JSON list of HOST:PORT"),
                         (["--rotate", "--backups", '["b3:2222"]'], "it goes with --cluster")):
        result = certs("refused", *flags)
        assert result.returncode == 2 and error in result.stderr.splitlines()[-1], result.stderr
        assert not (tmp_path / "refused").exists()
