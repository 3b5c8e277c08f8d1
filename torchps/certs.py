"""A job's credentials, made with the `cryptography` package: a CA, one certificate per task, tokens.

    ps-certs DIR --cluster cluster.json          # files for every task of a cluster (several hosts)
    ps-certs DIR --cluster cluster.json --kubernetes-secret NAME > secrets.yaml  # one per task

Each task's certificate is signed by the job's CA. Its common name is the task
("worker:1"), its organizational unit the role the shards grant it ("chief"
for the cluster's chief, else the task type), and its subject alternative
names the host of the task's address (and localhost for local jobs). Every
task but the shards gets a token of its own, bound to its task name and role
as its certificate is; the shards get the table of them, so without TLS a
token still names its holder. Tokens are random 256-bit secrets. Keys and
tokens are written with mode 0600 in a folder of mode 0700.

    DIR/ca.crt  DIR/ca.key        the CA (keep ca.key off the cluster)
    DIR/<type>-<index>.crt/.key   per task: chief-0, worker-1, ps-0, evaluator-0
    DIR/<type>-<index>.token      per task but the shards: its token (the shards' --token-file is DIR/tokens)
    DIR/tokens                    the shards': "TASK ROLE TOKEN" for every other task
    DIR/admin-token               the admin token (the chief, and the shards that check it)
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import ipaddress
import os
import pathlib
import secrets
import sys

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .cli import ArgumentParser
from .cluster import Cluster, TaskSpec
from .errors import ClusterConfigError
from .security import Security

__all__ = ["JobCredentials", "TaskCredentials", "issue_job_credentials", "make_job_credentials",
           "read_job_credentials", "kubernetes_secrets", "role_of", "main"]

VALID_DAYS = 30           # a job's certificates; ps-launch's throw-away ones live for one job anyway
TOKEN_BYTES = 32


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
        stem = f"{task.type}-{task.index}"
        knows_admin = role_of(cluster, task) in ("chief", "ps")
        token = directory / ("tokens" if task.type == "ps" else f"{stem}.token")
        return cls(directory / f"{stem}.crt", directory / f"{stem}.key", directory / "ca.crt", token,
                   directory / "admin-token" if knows_admin else None)

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


def _alt_names(host: str) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(list(dict.fromkeys(names)))


def _write(path: pathlib.Path, data: bytes, secret: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


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
    tokens: dict[TaskSpec, bytes] = dataclasses.field(default_factory=dict, repr=False)  # every task but the shards
    ca_key: bytes | None = dataclasses.field(default=None, repr=False)

    def token_table(self) -> bytes:
        """The shards' --token-file: a line "TASK ROLE TOKEN" for every task that has a token."""
        return "".join(f"{task} {role_of(self.cluster, task)} {token.decode()}\n"
                       for task, token in self.tokens.items()).encode()

    def token_of(self, task: TaskSpec) -> bytes:
        """What `task`'s token file holds: its own token, or for a shard the table of every other task's."""
        return self.token_table() if task.type == "ps" else self.tokens[task]

    def write(self, directory: str | os.PathLike) -> dict[TaskSpec, TaskCredentials]:
        """Every file into `directory` (made with mode 0700) as ps-certs lays them out; ca.key if kept."""
        directory = _private_dir(directory)
        _write(directory / "ca.crt", self.ca_cert, secret=False)
        if self.ca_key is not None:
            _write(directory / "ca.key", self.ca_key, secret=True)
        _write(directory / "admin-token", self.admin_token, secret=True)
        _write(directory / "tokens", self.token_table(), secret=True)
        out = {}
        for task, (cert, key) in self.tasks.items():
            out[task] = files = TaskCredentials.of(directory, self.cluster, task)
            _write(files.cert, cert, secret=False)
            _write(files.key, key, secret=True)
            if task.type != "ps":
                _write(files.token, self.tokens[task], secret=True)
        return out

    def write_task(self, task: TaskSpec, directory: str | os.PathLike) -> TaskCredentials:
        """Only `task`'s files into `directory` (made with mode 0700), named as in its Kubernetes Secret:
        ca.crt, tls.crt, tls.key, token (its own; a shard's: the table of every other task's), and admin-token
        for the chief and the shards."""
        directory = _private_dir(directory)
        cert, key = self.tasks[task]
        files = TaskCredentials(directory / "tls.crt", directory / "tls.key", directory / "ca.crt",
                                directory / "token",
                                directory / "admin-token" if role_of(self.cluster, task) in ("chief", "ps") else None)
        for path, data, secret in ((files.ca, self.ca_cert, False), (files.cert, cert, False), (files.key, key, True),
                                   (files.token, self.token_of(task), True),
                                   (files.admin_token, self.admin_token, True)):
            if path is not None:
                _write(path, data, secret=secret)
        return files


def _private_dir(directory: str | os.PathLike) -> pathlib.Path:
    directory = pathlib.Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    return directory


def issue_job_credentials(cluster: Cluster, *, days: int = VALID_DAYS, keep_ca_key: bool = False) -> JobCredentials:
    """A new CA, a certificate, key and token per task of `cluster` (the shards: the table of tokens) and the
    admin token, in memory only. The CA's key is dropped once every certificate is signed, unless
    `keep_ca_key`."""
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
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(str(task), role_of(cluster, task)))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(_alt_names(address.rpartition(":")[0]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        tasks[task] = (cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))
        if task.type != "ps":
            tokens[task] = secrets.token_urlsafe(TOKEN_BYTES).encode()
    return JobCredentials(cluster, ca_cert.public_bytes(serialization.Encoding.PEM),
                          secrets.token_urlsafe(TOKEN_BYTES).encode(), tasks, tokens,
                          _pem_key(ca_key) if keep_ca_key else None)


def make_job_credentials(directory: str | os.PathLike, cluster: Cluster, *, days: int = VALID_DAYS
                         ) -> dict[TaskSpec, TaskCredentials]:
    """Writes a CA (its key included), a certificate and a token per task, the shards' table of tokens and the
    admin token into `directory` (made with mode 0700), as ps-certs does."""
    return issue_job_credentials(cluster, days=days, keep_ca_key=True).write(directory)


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
    needs: the CA certificate, its token (a shard's: the table of every other task's), its own certificate and
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
    parser.add_argument("directory", help="the folder to write (created with mode 0700)")
    parser.add_argument("--cluster", required=True, help="cluster JSON or file (TF_CONFIG's 'cluster' shape)")
    parser.add_argument("--days", type=int, default=VALID_DAYS, help="validity (default: %(default)s)")
    parser.add_argument("--kubernetes-secret", metavar="NAME", help="print Kubernetes Secrets instead of flags: "
                        "NAME-TYPE-INDEX per task, each with only that task's files (mount one per pod)")
    args = parser.parse_args(argv)
    try:
        cluster = Cluster.from_json(args.cluster)
        if args.days < 1:
            raise ClusterConfigError(f"--days must be >= 1. Received: {args.days}")
        made = make_job_credentials(args.directory, cluster, days=args.days)
    except (ClusterConfigError, OSError) as exc:
        print(f"ps-certs: error: {exc}", file=sys.stderr)
        return 2
    if args.kubernetes_secret:
        print(kubernetes_secrets(made, args.kubernetes_secret), end="")
    else:
        for task, files in made.items():
            print(f"{task}: {' '.join(files.flags())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
