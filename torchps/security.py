"""Who may talk to a shard: mutual TLS, job tokens and roles, shared by shards and clients.

A `Security` value holds a task's credentials: its certificate and key and the
job's CA (mutual TLS: each side checks the other against the CA), its token
(a secret it sends with every call), and for the chief the admin token.
Either or both may be used; with neither the value is `INSECURE` (plaintext,
no checks) and a shard must be told so explicitly (`--insecure`).

Tokens are per task: ps-certs gives each task its own (`<type>-<index>.token`)
and the shards the table of them (`tokens`: a line "TASK ROLE TOKEN" per
task), so without TLS a token names its task as a certificate does, and a
worker acts in its own name only. A token file holding one token is still
accepted by a shard as a job token every task shares: it names nobody, so
its holders may act in any worker's name (the shard says so when it starts).

Roles, granted by shards from the caller's certificate (organizational unit,
see torchps.certs) or, without TLS, from the token it sent:

    chief      everything: the admin calls below, and what a worker does
    worker     pull, push, join, heartbeat, leave (as itself: the name in the
               request must be its certificate's or its token's), list
               variables, status
    evaluator  pull, list variables, status
    ps         status

Admin calls: Configure, CreateVariables, UpdateOptimizer, Save,
CommitCheckpoint, Shutdown.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import os
import pathlib
import socket
import ssl
import tempfile

from .errors import ClusterConfigError

__all__ = ["Security", "INSECURE", "TOKEN_METADATA_KEY", "ROLES", "ADMIN_METHODS", "allowed_methods",
           "diagnose_tls", "ENV"]

TOKEN_METADATA_KEY = "torchps-token"   # gRPC metadata carrying the job or admin token
ADMIN_METHODS = frozenset({"Configure", "CreateVariables", "UpdateOptimizer", "Save", "CommitCheckpoint", "Shutdown",
                           "CreateTables"})
_WORKER_METHODS = frozenset({"Pull", "Push", "PushPull", "Join", "Heartbeat", "Leave", "ListVariables", "GetStatus",
                             "LookupRows", "ListTables"})
ROLES = {
    "chief": ADMIN_METHODS | _WORKER_METHODS,
    "worker": _WORKER_METHODS,
    # LookupRows without admit only (the shard refuses an evaluator's admitting lookup).
    "evaluator": frozenset({"Pull", "ListVariables", "GetStatus", "LookupRows", "ListTables"}),
    "ps": frozenset({"GetStatus"}),
}
# Environment variables read when flags are not given (ps-launch passes credentials to its children this way).
ENV = {"tls_cert": "TORCHPS_TLS_CERT", "tls_key": "TORCHPS_TLS_KEY", "tls_ca": "TORCHPS_TLS_CA",
       "token_file": "TORCHPS_TOKEN_FILE", "admin_token_file": "TORCHPS_ADMIN_TOKEN_FILE"}


def allowed_methods(role: str) -> frozenset[str]:
    return ROLES.get(role, frozenset())


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        data = pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ClusterConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None
    if not data.strip():
        raise ClusterConfigError(f"the {what} {path} is empty")
    return data


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _parse_tokens(data: bytes, path: str) -> tuple[str | None, tuple[tuple[str, str, str], ...]]:
    """(one token, or None; the per-task table's (task, role, token) lines) of a token file's text."""
    lines = [line.split() for line in data.decode(errors="replace").splitlines() if line.strip()]
    if len(lines) == 1 and len(lines[0]) == 1:
        return lines[0][0], ()
    if all(len(line) == 3 for line in lines):
        return None, tuple((task, role, token) for task, role, token in lines)
    raise ClusterConfigError(f"the token file {path} holds neither one token nor lines 'TASK ROLE TOKEN' "
                             f"(ps-certs writes both kinds)")


@dataclasses.dataclass(frozen=True)
class Security:
    """One task's credentials (see the module docstring). Build with `load`.

    `token` is what a client sends (and a shard's shared job token, if it
    has one); `task_tokens`, a shard's, the (task, role, token) of every task.
    """

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    token: str | None = None
    admin_token: str | None = None
    task_tokens: tuple[tuple[str, str, str], ...] = ()

    @property
    def tls(self) -> bool:
        return self.ca is not None

    @property
    def insecure(self) -> bool:
        return not self.tls and not self.checks_tokens

    @property
    def checks_tokens(self) -> bool:
        """A shard with these credentials refuses calls without a valid token."""
        return self.token is not None or bool(self.task_tokens)

    def task_of(self, token: str) -> tuple[str, str] | None:
        """(task, role) a per-task token names, or None (looked up by its SHA-256, not compared byte by byte)."""
        return self._tasks.get(_digest(token)) if token else None

    @functools.cached_property
    def _tasks(self) -> dict[bytes, tuple[str, str]]:
        return {_digest(token): (task, role) for task, role, token in self.task_tokens}

    @classmethod
    def load(cls, *, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None,
             token_file: str | None = None, admin_token_file: str | None = None,
             environ: dict | None = None) -> "Security":
        """Reads the files named by the arguments, else by the TORCHPS_* environment variables.

        ClusterConfigError (one line) for an unreadable or empty file, or TLS
        files given only in part (certificate, key and CA go together).
        """
        environ = os.environ if environ is None else environ
        given = {"tls_cert": tls_cert, "tls_key": tls_key, "tls_ca": tls_ca, "token_file": token_file,
                 "admin_token_file": admin_token_file}
        paths = {k: v or environ.get(ENV[k]) for k, v in given.items()}
        tls = [paths[k] for k in ("tls_cert", "tls_key", "tls_ca")]
        if any(tls) and not all(tls):
            raise ClusterConfigError("TLS needs all of --tls-cert, --tls-key and --tls-ca (the job's CA); "
                                     f"given: {', '.join(k for k in ('tls_cert', 'tls_key', 'tls_ca') if paths[k])}")
        token = _read(paths["token_file"], "token file")
        one, table = _parse_tokens(token, paths["token_file"]) if token else (None, ())
        admin = _read(paths["admin_token_file"], "admin token file")
        return cls(cert=_read(paths["tls_cert"], "certificate"), key=_read(paths["tls_key"], "private key"),
                   ca=_read(paths["tls_ca"], "CA certificate"), token=one, task_tokens=table,
                   admin_token=admin.decode().strip() if admin else None)

    def env(self, paths: dict[str, str]) -> dict[str, str]:
        """Environment variables naming `paths` (keys as in load()), for a child process."""
        return {ENV[k]: v for k, v in paths.items() if v}

    def call_token(self) -> str | None:
        """The token a client sends: the admin token if it has one (the chief), else the job token."""
        return self.admin_token or self.token


INSECURE = Security()


def _expired(cert: bytes) -> str | None:
    """The date a PEM certificate's validity ended, if it has; else None."""
    from cryptography import x509  # only when diagnosing: clients without TLS never need it

    not_after = x509.load_pem_x509_certificate(cert).not_valid_after_utc
    return f"{not_after:%Y-%m-%d %H:%M} UTC" if not_after < datetime.datetime.now(datetime.timezone.utc) else None


def diagnose_tls(address: str, security: Security, timeout: float = 3.0) -> str | None:
    """Why a connection to `address` fails at the TLS level, in one phrase, or None if it does not.

    Used when a channel cannot connect, so that a plaintext client against a
    TLS shard, a certificate from another CA, or an expired one is named
    instead of reported as an unreachable shard.
    """
    if security.tls:
        ended = _expired(security.cert)
        if ended:
            return f"this client's certificate expired on {ended}"
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout)
    except OSError:
        return None  # nothing listens there: not a TLS problem
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    if security.tls:
        context.load_verify_locations(cadata=security.ca.decode())
        with tempfile.NamedTemporaryFile() as cert, tempfile.NamedTemporaryFile() as key:  # mode 0600
            cert.write(security.cert), key.write(security.key)
            cert.flush(), key.flush()
            context.load_cert_chain(cert.name, key.name)
    else:
        context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    handshaken = False
    try:
        with context.wrap_socket(raw, server_hostname=host) as tls:
            handshaken = True
            tls.settimeout(timeout)
            try:  # a gRPC server answers HTTP/2's preface; one that refused our certificate closes instead
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                if tls.recv(1) == b"" and security.tls:
                    return "the shard refused this client's certificate (signed by another CA?)"
            except (socket.timeout, ssl.SSLWantReadError):
                pass
    except ssl.SSLCertVerificationError as exc:
        reason = exc.verify_message or str(exc)
        if "expired" in reason:
            return f"the shard's certificate has expired ({reason})"
        return f"the shard's certificate does not verify against this client's --tls-ca ({reason})"
    except ssl.SSLError as exc:
        if isinstance(exc, ssl.SSLEOFError) and not handshaken:
            return None  # the connection was dropped mid-handshake (a proxy, a restart): no TLS mismatch
        reason = exc.reason or str(exc)
        if not security.tls:
            return None if "WRONG_VERSION_NUMBER" in reason else \
                "the shard requires TLS: pass the job's --tls-cert, --tls-key and --tls-ca"
        if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason:
            return "the shard does not speak TLS (started with --insecure?): drop the TLS flags or secure the shard"
        if "EXPIRED" in reason:
            return f"the shard refused this client's certificate as expired ({reason})"
        if "UNKNOWN_CA" in reason or "CERTIFICATE" in reason or "BAD_CERTIFICATE" in reason:
            return f"the shard refused this client's certificate (signed by another CA?) ({reason})"
        return f"TLS handshake failed: {reason}"
    except OSError:
        return None
    finally:
        raw.close()
    return None if security.tls else "the shard requires TLS: pass the job's --tls-cert, --tls-key and --tls-ca"
