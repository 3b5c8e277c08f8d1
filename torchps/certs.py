"""A job's credentials, made with the `cryptography` package: a CA, one certificate per task, tokens.

    ps-certs DIR --cluster cluster.json          # files for every task of a cluster (several hosts)
    ps-certs DIR --cluster cluster.json --kubernetes-secret NAME > secrets.yaml  # one per task
    ps-certs DIR --add worker:4=HOST:PORT        # a task joining the running job: its files, a line in DIR/tokens,
                                                 # its TF_CONFIG (a worker, an evaluator or a shard: ps:N)
    ps-certs DIR --add serving:0=HOST:PORT       # a serving replica's (ps-serve): it reads the shards, nothing else
    ps-certs DIR --rotate [--grace 10m]          # a new token for every task; the old ones accepted for the grace

Each task's certificate is signed by the job's CA. Its common name is the task
("worker:1"), its organizational unit the role the shards grant it ("chief"
for the cluster's chief, else the task type), and its subject alternative
names the host of the task's address (and localhost for local jobs). Every
task but the shards gets a token of its own, bound to its task name and role
as its certificate is; the shards get the table of them, so without TLS a
token still names its holder. Tokens are random 256-bit secrets. Keys and
tokens are written with mode 0600 in a folder of mode 0700.

    DIR/ca.crt  DIR/ca.key        the CA (keep ca.key off the cluster)
    DIR/<type>-<index>.crt/.key   per task: chief-0, worker-1, ps-0, evaluator-0, serving-0
    DIR/<type>-<index>.token      per task but the servers (shards, serving replicas): its token (theirs is
                                  the table, DIR/tokens)
    DIR/tokens                    the servers': "TASK ROLE TOKEN" for every task (each calls the shards with
                                  its own line's)
    DIR/admin-token               the admin token (the chief, and the servers that check it)
    DIR/cluster.json              the cluster the folder was made for, with the tasks --add gave an address

A folder that holds a job's credentials is never written over by --cluster:
`--rotate` gives every task a new token, the old ones accepted for a grace
period (torchps.rotation). `--add` of a task with HOST:PORT at the next index
of its type adds it to cluster.json and prints the TF_CONFIG it starts with.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import ipaddress
import json
import os
import pathlib
import sys

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .cli import ArgumentParser
from .cluster import Cluster, TaskSpec
from .errors import ClusterConfigError
from .rotation import DEFAULT_GRACE, parse_grace, rotate_tokens
from .secret_files import new_token, private_dir, replace_file, write_file
from .security import Security

__all__ = ["JobCredentials", "TaskCredentials", "issue_job_credentials", "make_job_credentials",
           "read_job_credentials", "kubernetes_secrets", "role_of", "added_task", "add_to_job", "append_tokens",
           "token_line", "job_cluster", "tf_config_lines", "main"]

VALID_DAYS = 30           # a job's certificates; ps-launch's throw-away ones live for one job anyway
ADDABLE = ("worker", "evaluator", "ps", "serving")  # task types that may join a running job (a shard: by a live
# resize; a serving replica: ps-serve, not a task of the cluster)
SERVERS = ("ps", "serving")  # their token file is the table of every task's: they check their callers' tokens
CLUSTER_FILE = "cluster.json"


@dataclasses.dataclass(frozen=True)
class TaskCredentials:
    """The files of one task: its certificate and key, the CA, its token (a shard's: the table of every task's),
    and the admin token (the chief's and the shards')."""

    cert: pathlib.Path
    key: pathlib.Path
    ca: pathlib.Path
    token: pathlib.Path
    admin_token: pathlib.Path | None = None  # the chief's (it sends it) and the shards' (they check it)

    @classmethod
    def of(cls, directory: pathlib.Path, cluster: Cluster, task: TaskSpec) -> "TaskCredentials":
        """Where `task`'s files lie in a job's credentials folder (the admin token for the chief and shards)."""
        return cls.at(directory, task, role_of(cluster, task))

    @classmethod
    def at(cls, directory: pathlib.Path, task: TaskSpec, role: str) -> "TaskCredentials":
        """Where the files of `task`, of `role`, lie in a job's credentials folder."""
        stem = f"{task.type}-{task.index}"
        token = directory / ("tokens" if task.type in SERVERS else f"{stem}.token")
        return cls(directory / f"{stem}.crt", directory / f"{stem}.key", directory / "ca.crt", token,
                   directory / "admin-token" if role in ("chief", *SERVERS) else None)

    def security(self) -> Security:
        """These files as a client's Security (read now; the TORCHPS_* variables are not consulted)."""
        return Security.load(tls_cert=str(self.cert), tls_key=str(self.key), tls_ca=str(self.ca),
                             token_file=str(self.token),
                             admin_token_file=str(self.admin_token) if self.admin_token else None, environ={})

    def flags(self) -> list[str]:
        """ps-server / ps-worker flags that use these files."""
        out = ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca),
               "--token-file", str(self.token)]
        return out + (["--admin-token-file", str(self.admin_token)] if self.admin_token else [])


def role_of(cluster: Cluster, task: TaskSpec) -> str:
    """The role shards grant `task`: "chief" for the cluster's chief, else its type."""
    return "chief" if task == cluster.chief_task else task.type


def _name(common: str, unit: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "torchps job"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _alt_names(*hosts: str) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(list(dict.fromkeys(names)))


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclasses.dataclass(frozen=True)
class JobCredentials:
    """A job's credentials in memory (PEM bytes): the CA's certificate, each task's certificate and key, each
    task's token but the shards' (they get the table of them), the admin token, and the CA's key only if it was
    kept (ps-certs writes it; ps-launch never keeps it, so no certificate can be added to a job it ran)."""

    cluster: Cluster
    ca_cert: bytes
    admin_token: bytes
    tasks: dict[TaskSpec, tuple[bytes, bytes]]  # task -> (certificate, key)
    tokens: dict[TaskSpec, bytes] = dataclasses.field(default_factory=dict, repr=False)  # every task's
    ca_key: bytes | None = dataclasses.field(default=None, repr=False)

    def token_table(self) -> bytes:
        """The shards' --token-file: a line "TASK ROLE TOKEN" for every task that has a token."""
        return "".join(f"{task} {role_of(self.cluster, task)} {token.decode()}\n"
                       for task, token in self.tokens.items()).encode()

    def token_of(self, task: TaskSpec) -> bytes:
        """What `task`'s token file holds: its own token, or for a server the table of every task's."""
        return self.token_table() if task.type in SERVERS else self.tokens[task]

    def with_task(self, task: TaskSpec) -> "JobCredentials":
        """These credentials and those of `task`, a task joining the running job (added_task);
        ClusterConfigError unless the CA's key was kept."""
        if self.ca_key is None:
            raise ClusterConfigError(f"cannot add {task}: this job's CA key was not kept")
        cert, key, token = added_task(self.ca_cert, self.ca_key, task)
        tokens = self.tokens if token is None else {**self.tokens, task: token}
        return dataclasses.replace(self, tasks={**self.tasks, task: (cert, key)}, tokens=tokens)

    def write(self, directory: str | os.PathLike) -> dict[TaskSpec, TaskCredentials]:
        """Every file into `directory` (made with mode 0700) as ps-certs lays them out; ca.key if kept."""
        directory = private_dir(directory)
        write_file(directory / "ca.crt", self.ca_cert, secret=False)
        if self.ca_key is not None:
            write_file(directory / "ca.key", self.ca_key, secret=True)
        write_file(directory / "admin-token", self.admin_token, secret=True)
        write_file(directory / "tokens", self.token_table(), secret=True)
        out = {}
        for task, (cert, key) in self.tasks.items():
            out[task] = files = TaskCredentials.of(directory, self.cluster, task)
            write_file(files.cert, cert, secret=False)
            write_file(files.key, key, secret=True)
            if task.type not in SERVERS:
                write_file(files.token, self.tokens[task], secret=True)
        return out

    def write_task(self, task: TaskSpec, directory: str | os.PathLike) -> TaskCredentials:
        """Only `task`'s files into `directory` (made with mode 0700), named as in its Kubernetes Secret:
        ca.crt, tls.crt, tls.key, token (its own; a shard's: the table of every task's), and admin-token
        for the chief and the shards."""
        directory = private_dir(directory)
        cert, key = self.tasks[task]
        admin = role_of(self.cluster, task) in ("chief", *SERVERS)
        files = TaskCredentials(directory / "tls.crt", directory / "tls.key", directory / "ca.crt",
                                directory / "token", directory / "admin-token" if admin else None)
        for path, data, secret in ((files.ca, self.ca_cert, False), (files.cert, cert, False), (files.key, key, True),
                                   (files.token, self.token_of(task), True),
                                   (files.admin_token, self.admin_token, True)):
            if path is not None:
                write_file(path, data, secret=secret)
        return files


def _sign(ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name, task: TaskSpec, role: str, host: str,
          days: int, *also: str) -> tuple[bytes, bytes]:
    """(certificate, key) in PEM for `task` with `role`, naming `host` (and the hosts `also`), signed by the CA,
    valid from 5 minutes ago for `days`."""
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name(str(task), role))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_alt_names(host, *also), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue_job_credentials(cluster: Cluster, *, days: int = VALID_DAYS, keep_ca_key: bool = False,
                          backups: list[str] = ()) -> JobCredentials:
    """A new CA, a certificate, key and token per task of `cluster` (the shards: the table of tokens) and the
    admin token, in memory only. The CA's key is dropped once every certificate is signed, unless
    `keep_ca_key`. `backups`: the addresses of the shards' backups, by shard index (ps-server --replica-of,
    which serves with its shard's files): shard N's certificate names its backup's host too."""
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("torchps job CA", "ca")
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    tasks, tokens = {}, {}
    for task, address in cluster.tasks():
        also = [backups[task.index].rpartition(":")[0]] if task.type == "ps" and task.index < len(backups) else []
        tasks[task] = _sign(ca_key, ca_name, task, role_of(cluster, task), address.rpartition(":")[0], days, *also)
        tokens[task] = new_token()  # a shard's is its line of the table: it calls the others with it
    return JobCredentials(cluster, ca_cert.public_bytes(serialization.Encoding.PEM),
                          new_token(), tasks, tokens,
                          _pem_key(ca_key) if keep_ca_key else None)


def added_task(ca_cert: bytes, ca_key: bytes, task: TaskSpec, *, host: str = "localhost",
               days: int = VALID_DAYS) -> tuple[bytes, bytes, bytes | None]:
    """(certificate, key, token) for `task` joining a running job: a worker or evaluator, or a shard a live
    resize adds (its token a line of the job's table, its token file). Signed by the job's CA (PEM certificate
    and key), its role its type, its certificate naming `host` (and localhost). ClusterConfigError for a chief
    (part of a job's start)."""
    _check_addable(task)
    ca_name = x509.load_pem_x509_certificate(ca_cert).subject
    cert, key = _sign(serialization.load_pem_private_key(ca_key, None), ca_name, task, task.type, host, days)
    return cert, key, new_token()


def _check_addable(task: TaskSpec) -> None:
    if task.type not in ADDABLE:
        raise ClusterConfigError(f"{task}: only worker, evaluator, ps and serving tasks join a running job (the "
                                 "chief is part of its start)")


def token_line(task: TaskSpec, token: bytes) -> str:
    """`task`'s line of the shards' token table (an added task's role is its type)."""
    return f"{task} {task.type} {token.decode()}\n"


def append_tokens(path: str | os.PathLike, lines: str) -> None:
    """Adds `lines` to the token table at `path`, replacing the file whole (written aside, then renamed over
    it: a shard re-reading it never sees half of it). Mode 0600."""
    path = pathlib.Path(path)
    replace_file(path, path.read_bytes() + lines.encode())


def add_to_job(directory: str | os.PathLike, tasks: list[TaskSpec], *, days: int = VALID_DAYS,
               addresses: dict[TaskSpec, str] | None = None) -> dict[TaskSpec, TaskCredentials]:
    """Credentials for `tasks` (workers, evaluators, shards) joining the running job whose folder ps-certs
    made: each task's certificate (signed by DIR/ca.key, naming the host of its address in `addresses`, else
    localhost only) and key, a worker's or evaluator's token with its line added to DIR/tokens (the shards
    re-read it: ps_server/tokens.py); a shard's token file is DIR/tokens. A task given an address at the next
    index of its type is added to DIR/cluster.json (job_cluster). ClusterConfigError (one line, nothing
    written) for a folder without the CA's key or the table, a task whose files exist, a chief, an address
    the cluster already lists, or one that does not fit DIR/cluster.json (past its next index, or another
    address for a task it lists)."""
    directory, addresses = pathlib.Path(directory), addresses or {}
    for name in ("ca.crt", "ca.key", "tokens"):
        if not (directory / name).is_file():
            raise ClusterConfigError(f"{directory} has no {name}: --add needs the folder ps-certs made for the job "
                                     "(with its CA key)")
    for task in tasks:
        if (directory / f"{task.type}-{task.index}.crt").exists():
            raise ClusterConfigError(f"{directory} already holds {task}'s files: pick an index no task has (a shard "
                                     "a resize removed starts again with its own files)")
        _check_addable(task)
    cluster = _extended(directory, {task: address for task, address in addresses.items() if task.type != "serving"})
    ca_cert, ca_key = (directory / "ca.crt").read_bytes(), (directory / "ca.key").read_bytes()
    made, lines = {}, ""
    for task in tasks:
        cert, key, token = added_task(ca_cert, ca_key, task, host=_host(addresses.get(task)), days=days)
        made[task] = files = TaskCredentials.at(directory, task, task.type)
        write_file(files.cert, cert, secret=False)
        write_file(files.key, key, secret=True)
        if token is not None:
            if task.type not in SERVERS:  # a server's token file is the table, which gets its line
                write_file(files.token, token, secret=True)
            lines += token_line(task, token)
    if lines:
        append_tokens(directory / "tokens", lines)
    if cluster is not None:
        write_file(directory / CLUSTER_FILE, json.dumps(cluster.to_dict(), indent=1).encode(), secret=False)
    return made


def _host(address: str | None) -> str:
    return address.rpartition(":")[0].strip("[]") if address else "localhost"


def job_cluster(directory: str | os.PathLike) -> Cluster | None:
    """The cluster DIR/cluster.json records (the one ps-certs --cluster was given, and the tasks --add gave an
    address), or None for a folder without one; ClusterConfigError if it does not parse."""
    path = pathlib.Path(directory) / CLUSTER_FILE
    return Cluster.from_json(str(path)) if path.is_file() else None


def _extended(directory: pathlib.Path, addresses: dict[TaskSpec, str]) -> Cluster | None:
    """DIR/cluster.json's cluster with the tasks of `addresses` that come next in their type's list (a
    cluster lists no gaps), or None if it has none of them (or the folder records no cluster)."""
    cluster = job_cluster(directory)
    if cluster is None:
        return None
    spec, grown = cluster.to_dict(), False
    for task, address in sorted(addresses.items(), key=lambda item: (item[0].type, item[0].index)):
        listed = spec.setdefault(task.type, [])
        if task.index > len(listed):
            raise ClusterConfigError(f"--add {task}={address}: the job's cluster lists {len(listed)} {task.type} "
                                     f"task(s), so the next is {task.type}:{len(listed)} (a cluster lists no gaps)")
        if task.index < len(listed) and listed[task.index] != address:
            raise ClusterConfigError(f"--add {task}={address}: the job's cluster lists {task} at "
                                     f"{listed[task.index]}")
        if task.index == len(listed):
            listed.append(address)
            grown = True
    return Cluster.from_dict(spec) if grown else None  # raises for an address listed already


def tf_config_lines(directory: str | os.PathLike, tasks: list[TaskSpec], addresses: dict[TaskSpec, str]
                    ) -> tuple[list[str], list[str]]:
    """After add_to_job: (a line "TASK: TF_CONFIG='...'" for each task DIR/cluster.json lists, a note saying
    why for each it does not)."""
    cluster, lines, notes = job_cluster(directory), [], []
    for task in tasks:
        if task.type == "serving":
            continue  # ps-serve is no task of the cluster: it takes the shards' --cluster
        if cluster is not None and task.index < len(getattr(cluster, task.type)) and \
                cluster.address(task) == addresses.get(task):
            lines.append(f"{task}: TF_CONFIG='{cluster.tf_config(task)}'")
        elif task not in addresses:
            notes.append(f"{task} needs the job's cluster with its address as {task.type} {task.index} (TF_CONFIG "
                         f"or --cluster): pass --add {task}=HOST:PORT and ps-certs prints it"
                         + ("; its certificate names only localhost and 127.0.0.1 (a shard on another host needs "
                            "its host there)" if task.type == "ps" else ""))
        else:  # no cluster.json (add_to_job refuses an address that does not fit one)
            notes.append(f"no TF_CONFIG for {task}: {directory} has no {CLUSTER_FILE} (made by an older ps-certs): "
                         f"add {addresses[task]} as {task.type} {task.index} to the job's cluster")
    return lines, notes


def shard_files(directory: str | os.PathLike) -> dict[TaskSpec, TaskCredentials]:
    """The shards' files in a folder ps-certs made, by the ps-N.crt found there (their Secrets hold the token
    table, which --add changes)."""
    directory = pathlib.Path(directory)
    indices = sorted(int(p.stem.removeprefix("ps-")) for p in directory.glob("ps-*.crt")
                     if p.stem.removeprefix("ps-").isdigit())
    return {TaskSpec("ps", i): TaskCredentials(directory / f"ps-{i}.crt", directory / f"ps-{i}.key",
                                               directory / "ca.crt", directory / "tokens", directory / "admin-token")
            for i in indices}


def make_job_credentials(directory: str | os.PathLike, cluster: Cluster, *, days: int = VALID_DAYS,
                         backups: list[str] = ()) -> dict[TaskSpec, TaskCredentials]:
    """Writes a CA (its key included), a certificate and a token per task, the shards' table of tokens, the
    admin token and cluster.json into `directory` (made with mode 0700), as ps-certs does. ClusterConfigError
    (one line, nothing written) if `directory` holds any of those files already: a running job may use them."""
    directory = pathlib.Path(directory)
    names = ["ca.crt", "ca.key", "tokens", "admin-token", CLUSTER_FILE]
    for task, _ in cluster.tasks():
        names += [f"{task.type}-{task.index}{suffix}" for suffix in (".crt", ".key", ".token")]
    found = [name for name in names if (directory / name).exists()]
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise ClusterConfigError(f"{directory} already holds a job's credentials ({shown}), which a running job may "
                                 f"use: `ps-certs {directory} --rotate` gives every task a new token (the old ones "
                                 f"accepted for --grace, {DEFAULT_GRACE} by default); for a new job, pick a new folder")
    made = issue_job_credentials(cluster, days=days, keep_ca_key=True, backups=backups).write(directory)
    write_file(directory / CLUSTER_FILE, json.dumps(cluster.to_dict(), indent=1).encode(), secret=False)
    return made


def read_job_credentials(directory: str | os.PathLike, cluster: Cluster) -> dict[TaskSpec, TaskCredentials]:
    """The files ps-certs wrote into `directory`, for every task of `cluster`.

    ClusterConfigError (one line) naming the first file missing, or a
    certificate whose role is not the one `cluster` gives its task (a folder
    made for a cluster with a separate chief, used for one whose chief is
    worker 0, say): found before anything starts, not as PERMISSION_DENIED.
    """
    directory = pathlib.Path(directory)
    out = {}
    for task, _ in cluster.tasks():
        role, files = role_of(cluster, task), TaskCredentials.of(directory, cluster, task)
        for path in (files.cert, files.key, files.ca, files.token, files.admin_token):
            if path is not None and not path.is_file():
                raise ClusterConfigError(f"{directory} has no {path.name} for {task}: make it with ps-certs "
                                         "--cluster naming every task of this job")
        try:
            subject = x509.load_pem_x509_certificate(files.cert.read_bytes()).subject
        except (OSError, ValueError) as exc:
            raise ClusterConfigError(f"{files.cert}: not a PEM certificate ({exc})") from None
        units = [a.value for a in subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
        if units != [role]:
            raise ClusterConfigError(f"{files.cert} gives {task} the role {units[0] if units else 'none'!r}, this "
                                     f"job needs {role!r}: make the folder for this job's tasks")
        out[task] = files
    return out


def kubernetes_secrets(made: dict[TaskSpec, TaskCredentials], name: str) -> str:
    """Kubernetes Secrets (one YAML document per task, named NAME-TYPE-INDEX) holding only what that task
    needs: the CA certificate, its token (a shard's: the table of every task's), its own certificate and
    key as tls.crt/tls.key, and the admin token for the chief and the shards. The CA's key is in none of them."""
    documents = []
    for task, files in made.items():
        entries = {"ca.crt": files.ca, "token": files.token, "tls.crt": files.cert, "tls.key": files.key}
        if files.admin_token is not None:
            entries["admin-token"] = files.admin_token
        lines = ["apiVersion: v1", "kind: Secret", "metadata:", f"  name: {name}-{task.type}-{task.index}",
                 "  labels:", f"    torchps/job: {name}", f"    torchps/task: {task.type}-{task.index}",
                 "type: Opaque", "data:"]
        lines += [f"  {key}: {base64.b64encode(path.read_bytes()).decode()}" for key, path in entries.items()]
        documents.append("\n".join(lines) + "\n")
    return "---\n".join(documents)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="ps-certs", description="Make a job's CA, per-task certificates and "
                                     "tokens (see torchps.certs).")
    parser.add_argument("directory", help="the folder to write (created with mode 0700; one that holds a job's "
                        "credentials is refused: see --rotate)")
    parser.add_argument("--cluster", help="cluster JSON or file (TF_CONFIG's 'cluster' shape)")
    parser.add_argument("--backups", metavar="JSON", help="with --cluster: the addresses of the shards' backups "
                        "(ps-server --replica-of), a JSON list by shard index or a file holding one: each shard's "
                        "certificate names its backup's host too, as the backup serves with the shard's files")
    parser.add_argument("--add", metavar="TYPE:INDEX[=HOST:PORT]", action="append", default=[],
                        help="instead of --cluster: credentials for a worker, evaluator, shard (ps, for ps-admin "
                        "resize) or serving replica (serving, for ps-serve) joining the running job of DIR (signed "
                        "by DIR/ca.key, naming HOST; a worker's, evaluator's or replica's token added to DIR/tokens, "
                        "which the shards re-read); with HOST:PORT at the next index of a cluster's task type, its "
                        "TF_CONFIG is printed too; repeat for several")
    parser.add_argument("--rotate", action="store_true", help="instead of --cluster: a new token for every task "
                        "of DIR/tokens (TYPE-INDEX.token rewritten); the shards accept the old ones too until "
                        "--grace ends, so restart each task before then. The CA, keys, certificates and admin "
                        "token stay (replacing those needs a new folder and a restart of the job)")
    parser.add_argument("--grace", help=f"with --rotate: how long the old tokens stay valid, e.g. 90s, 10m, 1h "
                        f"(0: refused at once; default: {DEFAULT_GRACE})")
    parser.add_argument("--days", type=int, help=f"validity of the certificates made (default: {VALID_DAYS})")
    parser.add_argument("--kubernetes-secret", metavar="NAME", help="print Kubernetes Secrets instead of flags: "
                        "NAME-TYPE-INDEX per task, each with only that task's files (mount one per pod); with "
                        "--add, the added tasks' and every shard's (their token table changed); with --rotate, "
                        "every task's")
    args = parser.parse_args(argv)
    if args.backups and not args.cluster:
        parser.error("--backups names the hosts of a new job's certificates: it goes with --cluster")
    if [bool(args.cluster), bool(args.add), args.rotate].count(True) != 1:
        parser.error("give --cluster (a new job), --add TYPE:INDEX (a task joining a running job) or --rotate "
                     "(new tokens for a running job)")
    try:
        if args.rotate:
            return _rotate(args)
        if args.grace is not None:
            raise ClusterConfigError("--grace is for --rotate")
        days = VALID_DAYS if args.days is None else args.days
        if days < 1:
            raise ClusterConfigError(f"--days must be >= 1. Received: {days}")
        if args.add:
            return _add(args, days)
        made = make_job_credentials(args.directory, Cluster.from_json(args.cluster), days=days,
                                    backups=_backups(args.backups) if args.backups else [])
    except (ClusterConfigError, OSError) as exc:
        print(f"ps-certs: error: {exc}", file=sys.stderr)
        return 2
    _print(made, made, args.kubernetes_secret)
    return 0


def _add(args, days: int) -> int:
    """ps-certs DIR --add ...: the added tasks' flags and TF_CONFIGs (or Secrets, the shards' with them)."""
    added = dict(_task_arg(text) for text in args.add)
    addresses = {task: address for task, address in added.items() if address}
    made = add_to_job(args.directory, list(added), days=days, addresses=addresses)
    _print(made, {**shard_files(args.directory), **made}, args.kubernetes_secret)
    if not args.kubernetes_secret:  # a pod's TF_CONFIG comes from its manifest
        lines, notes = tf_config_lines(args.directory, list(added), addresses)
        print("".join(f"{line}\n" for line in lines), end="")
        print("".join(f"ps-certs: {note}\n" for note in notes), end="", file=sys.stderr)
    return 0


def _rotate(args) -> int:
    """ps-certs DIR --rotate [--grace D]: one line saying until when the old tokens hold (or every Secret)."""
    if args.days is not None:
        raise ClusterConfigError("--days is for the certificates --cluster and --add make: --rotate makes none")
    grace = parse_grace(DEFAULT_GRACE if args.grace is None else args.grace)
    roles, line = rotate_tokens(args.directory, grace=grace)
    made = {task: TaskCredentials.at(pathlib.Path(args.directory), task, role) for task, role in roles.items()}
    if args.kubernetes_secret:
        _print(made, {**shard_files(args.directory), **made}, args.kubernetes_secret)
    else:
        print(line)
    return 0


def _print(made: dict[TaskSpec, TaskCredentials], secrets_of: dict[TaskSpec, TaskCredentials],
           kubernetes_secret: str | None) -> None:
    """Each task's flags, or with `kubernetes_secret` the Secrets of `secrets_of`."""
    if kubernetes_secret:
        print(kubernetes_secrets(secrets_of, kubernetes_secret), end="")
    else:
        for task, files in made.items():
            own = ["--task", str(task)] if task.type == "serving" else []  # its line of the table (ps-serve)
            print(f"{task}: {' '.join([*files.flags(), *own])}")


def _backups(text: str) -> list[str]:
    """--backups' JSON list of HOST:PORT (inline or a file); ClusterConfigError (one line) otherwise."""
    try:
        backups = json.loads(text if text.lstrip().startswith("[") else pathlib.Path(text).read_text())
    except (OSError, ValueError) as exc:
        raise ClusterConfigError(f"--backups {text!r}: not a JSON list of HOST:PORT, nor a file holding one ({exc})"
                                 ) from None
    if not isinstance(backups, list) or not all(isinstance(a, str) and a.rpartition(":")[0] for a in backups):
        raise ClusterConfigError(f"--backups {text!r}: expected a JSON list of HOST:PORT, one per shard")
    return backups


def _task_arg(text: str) -> tuple[TaskSpec, str | None]:
    """TYPE:INDEX[=HOST:PORT] as (TaskSpec, address or None); ClusterConfigError (one line) otherwise."""
    name, _, address = text.partition("=")
    kind, _, index = name.partition(":")
    if not index.isdigit():
        raise ClusterConfigError(f"--add {text!r}: expected TYPE:INDEX, e.g. worker:4, or TYPE:INDEX=HOST:PORT")
    host, colon, port = address.rpartition(":")
    if address and not (host and colon and port.isdigit()):
        raise ClusterConfigError(f"--add {text!r}: expected HOST:PORT after '=', e.g. {name}=10.0.0.7:2222")
    return TaskSpec(kind, int(index)), address or None


if __name__ == "__main__":
    sys.exit(main())
