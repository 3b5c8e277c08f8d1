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
A line may end in `until=TIME` (UTC, e.g. until=2025-05-01T12:00:00Z): a
token `ps-certs --rotate` replaced, accepted until then only.

Roles, granted by shards from the caller's certificate (organizational unit,
see torchps.certs) or, without TLS, from the token it sent (the one policy
deciding it all is torchps.access.policy):

    chief      everything: the admin calls below, what a worker does, and a
               shard's replication calls
    worker     pull, push, join, heartbeat, leave (as itself: the name in the
               request must be its certificate's or its token's), list
               variables, status
    evaluator  pull, list variables, status, and what a serving role does
    serving    a serving replica (ps-serve): reads the shards (pull, list,
               status, the layout, ReadChanges) and answers lookups; a
               worker may read a replica too; a replica's ControlServing
               (hold, resume, rollback) is an admin call
    ps         status, the layout, and replication: a backup's stream from
               its primary (Replicate), a shard's word to ps 0 (SetReplica)

Admin calls: Configure, CreateVariables, CreateTables, UpdateOptimizer, Save,
CommitCheckpoint, Shutdown, CreateDataQueue, and a live resize's SetLayout,
ExportVariables, ImportVariables, ConfirmMove and Resize (GetLayout is a
worker's and an evaluator's too).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import functools
import hashlib
import os
import pathlib
import socket
import ssl
import tempfile
import time
from typing import NamedTuple

from .errors import ClusterConfigError

__all__ = ["Security", "INSECURE", "TOKEN_METADATA_KEY", "ROLES", "ADMIN_METHODS", "REPLICA_METHODS", "allowed_methods",
           "diagnose", "ENV", "require_credentials", "read_token_table", "TokenTable", "until_text"]

TOKEN_METADATA_KEY = "torchps-token"   # gRPC metadata carrying the job or admin token
ADMIN_METHODS = frozenset({"Configure", "CreateVariables", "UpdateOptimizer", "Save", "CommitCheckpoint", "Shutdown",
                           "CreateTables", "CreateDataQueue", "SetLayout", "ExportVariables", "ImportVariables",
                           "ConfirmMove", "Resize", "ControlServing"})
_WORKER_METHODS = frozenset({"Pull", "PullOne", "Push", "PushOne", "PushPull", "Join", "Heartbeat", "Leave", "ListVariables", "GetStatus",
                             "LookupRows", "ListTables", "TakeDataShard", "GetDataQueue", "GetLayout"})
_SHARD_METHODS = frozenset({"Replicate", "SetReplica"})  # a shard's calls to another (replication)
# The Serving service's RPCs, a serving replica's (ps-serve), not a shard's: its reads, and its admin call.
REPLICA_METHODS = frozenset({"Lookup", "GetDense", "GetServingStatus", "ControlServing"})
# What a serving replica reads of the shards, and what it answers: nothing else.
_SERVING_METHODS = frozenset({"Pull", "PullOne", "ListVariables", "GetStatus", "ListTables", "GetLayout",
                              "ReadChanges"}) | (REPLICA_METHODS - ADMIN_METHODS)
ROLES = {
    "chief": ADMIN_METHODS | _WORKER_METHODS | _SHARD_METHODS | _SERVING_METHODS,
    "worker": _WORKER_METHODS | _SERVING_METHODS,
    # LookupRows without admit only (the shard refuses an evaluator's admitting lookup).
    "evaluator": frozenset({"Pull", "PullOne", "ListVariables", "GetStatus", "LookupRows", "ListTables",
                            "GetDataQueue", "GetLayout"}) | _SERVING_METHODS,
    "serving": _SERVING_METHODS,
    # A shard's calls to another: a backup's stream from its primary, a shard's change of ps 0's record.
    "ps": frozenset({"GetStatus", "GetLayout"}) | _SHARD_METHODS,
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


_UNTIL = "until="  # a token table line's fourth field: the time a retiring token stops being accepted


class TokenTable(NamedTuple):
    """A token file's contents: one job token (or None), the (task, role, token) lines, and the (token, Unix
    time) of the lines a rotation left retiring (`until=`)."""

    token: str | None
    lines: tuple[tuple[str, str, str], ...]
    retiring: tuple[tuple[str, float], ...]


def until_text(when: float) -> str:
    """`until=TIME` for a table line retiring at Unix time `when` (rounded up to the second, UTC)."""
    moment = datetime.datetime.fromtimestamp(math.ceil(when), datetime.timezone.utc)
    return f"{_UNTIL}{moment:%Y-%m-%dT%H:%M:%SZ}"


def _until(field: str, path: str) -> float:
    try:
        moment = datetime.datetime.fromisoformat(field.removeprefix(_UNTIL).replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise ClusterConfigError(f"the token file {path} has {field!r}: expected until=YYYY-MM-DDTHH:MM:SSZ (UTC)")
    return moment.timestamp()


def _parse_tokens(data: bytes, path: str) -> TokenTable:
    """The TokenTable of a token file's text."""
    lines = [line.split() for line in data.decode(errors="replace").splitlines() if line.strip()]
    if len(lines) == 1 and len(lines[0]) == 1:
        return TokenTable(lines[0][0], (), ())
    if not all(len(line) == 3 or (len(line) == 4 and line[3].startswith(_UNTIL)) for line in lines):
        raise ClusterConfigError(f"the token file {path} holds neither one token nor lines 'TASK ROLE TOKEN' "
                                 f"(ps-certs writes both kinds; a retiring token's line ends in until=TIME)")
    return TokenTable(None, tuple((task, role, token) for task, role, token, *_ in lines),
                      tuple((line[2], _until(line[3], path)) for line in lines if len(line) == 4))


def read_token_table(path: str) -> TokenTable:
    """The TokenTable of the token file at `path`; ClusterConfigError (one line) if it cannot be read, is empty
    or holds neither kind."""
    return _parse_tokens(_read(path, "token file"), path)


@dataclasses.dataclass(frozen=True)
class Security:
    """One task's credentials (see the module docstring). Build with `load`.

    `token` is what a client sends (and a shard's shared job token, if it
    has one); `task_tokens`, a shard's, the (task, role, token) of every task; `retiring`, the (token, Unix
    time) of those a rotation replaced, accepted until then only.
    """

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    token: str | None = None
    admin_token: str | None = None
    task_tokens: tuple[tuple[str, str, str], ...] = ()
    retiring: tuple[tuple[str, float], ...] = ()
    token_path: str | None = None  # the token file read (a shard re-reads it when it changes: ps_server/tokens.py)

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

    def retires_at(self, token: str) -> float | None:
        """The Unix time a retiring token of the table stops being accepted; None for the others."""
        return self._retiring.get(_digest(token)) if token else None

    @functools.cached_property
    def _tasks(self) -> dict[bytes, tuple[str, str]]:
        return {_digest(token): (task, role) for task, role, token in self.task_tokens}

    @functools.cached_property
    def _retiring(self) -> dict[bytes, float]:
        return {_digest(token): until for token, until in self.retiring}

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
        table = read_token_table(paths["token_file"]) if paths["token_file"] else TokenTable(None, (), ())
        admin = _read(paths["admin_token_file"], "admin token file")
        return cls(cert=_read(paths["tls_cert"], "certificate"), key=_read(paths["tls_key"], "private key"),
                   ca=_read(paths["tls_ca"], "CA certificate"), token=table.token, task_tokens=table.lines,
                   retiring=table.retiring,
                   admin_token=admin.decode().strip() if admin else None, token_path=paths["token_file"] or None)

    def env(self, paths: dict[str, str]) -> dict[str, str]:
        """Environment variables naming `paths` (keys as in load()), for a child process."""
        return {ENV[k]: v for k, v in paths.items() if v}

    def call_token(self) -> str | None:
        """The token a client sends: the admin token if it has one (the chief), else the job token."""
        return self.admin_token or self.token

    def as_shard(self, index: int) -> "Security":
        """The credentials shard `index` calls another shard with (a backup's stream, its arbiter): as_task of
        its own line (ps:INDEX; ps-certs writes one per shard), so it acts in the ps role."""
        return self.as_task(f"ps:{index}")

    def lacks_line(self, name: str) -> bool:
        """True for a server with a token table (per-task tokens) that has no line for task `name`: calls it
        makes as `name` (as_task) carry no token of that task's, and are refused."""
        return bool(self.task_tokens) and not any(task == name for task, _, _ in self.task_tokens)

    def as_task(self, name: str) -> "Security":
        """The credentials a server holding the token table calls the shards with as task `name` (a shard, a
        serving replica): its own certificate, and its line's token of the table, else the job token; no admin
        token."""
        own = [token for task, _, token in self.task_tokens if task == name][-1:]  # after a rotation: the new one
        return dataclasses.replace(self, token=own[0] if own else self.token, admin_token=None, task_tokens=(),
                                   retiring=())


INSECURE = Security()


def require_credentials(security: Security, insecure: bool) -> Security:
    """`security`, if it has credentials and --insecure was not given, or if it has none and --insecure was;
    else ClusterConfigError (one line) saying what to pass. ps-server and ps-worker alike."""
    if security.insecure and not insecure:
        raise ClusterConfigError("no credentials: pass --tls-cert/--tls-key/--tls-ca and/or --token-file (ps-certs "
                                 "makes them; ps-launch does it for you), or --insecure on a trusted network")
    if insecure and not security.insecure:
        raise ClusterConfigError("--insecure contradicts the TLS or token files given (by flags or by the TORCHPS_* "
                                 "variables: unset those for an insecure job)")
    return security


def _expired(cert: bytes) -> str | None:
    """The date a PEM certificate's validity ended, if it has; else None."""
    from cryptography import x509  # only when diagnosing: clients without TLS never need it

    not_after = x509.load_pem_x509_certificate(cert).not_valid_after_utc
    return f"{not_after:%Y-%m-%d %H:%M} UTC" if not_after < datetime.datetime.now(datetime.timezone.utc) else None


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5)  # and an empty SETTINGS frame


def diagnose(address: str, security: Security, timeout: float = 3.0) -> tuple[str, bool]:
    """What answers at `address`, in one phrase, and whether waiting cannot help (a TLS mismatch, a bad
    certificate, something that is not a gRPC server): used while a channel cannot connect, so that the
    wait says what it waits for, and a mismatch is named at once instead of reported as an unreachable
    shard. Opens one or two short connections, all within `timeout` s (each step at least STEP_LEAST_SECONDS);
    never raises."""
    if security.tls:
        ended = _expired(security.cert)
        if ended:
            return f"this client's certificate expired on {ended}", True
    host = address.rpartition(":")[0].strip("[]")
    end = time.monotonic() + timeout
    try:
        raw = tcp_connect(address, _left(end))
    except ConnectionRefusedError:
        return "nothing listens there yet (connection refused)", False
    except socket.gaierror:
        return f"the name {host} does not resolve (yet)", False
    except (OSError, ValueError) as exc:
        return f"it cannot be reached ({getattr(exc, 'strerror', None) or exc})", False
    try:
        raw.settimeout(_left(end))
        raw.sendall(_H2_PREFACE)
        reply = raw.recv(64)
    except (ConnectionResetError, BrokenPipeError):
        reply = b""  # it hung up
    except OSError:  # a timeout: it listens but says nothing yet (a shard binds its port before it serves)
        return "something listens there but does not answer yet", False
    finally:
        raw.close()
    if reply[3:4] == b"\x04":  # an HTTP/2 SETTINGS frame: a plaintext gRPC server
        if security.tls:
            return ("a plaintext gRPC server answers there, not a TLS one (a shard started with --insecure?): start "
                    "the shard with the job's TLS files too"), True
        return "a gRPC server answers there but is not serving yet", False
    if reply.startswith(b"HTTP/"):
        status = reply.splitlines()[0].decode(errors="replace")
        return f"this is not a gRPC server (it answers HTTP/1: {status!r}): is the address right?", True
    if reply:
        return f"this is not a gRPC server (it answered {reply[:16]!r}): is the address right?", True
    return _diagnose_tls(host, int(address.rpartition(":")[2]), security, end)  # it hung up: a TLS server does,
    # so does a proxy


def tcp_connect(address: str, timeout: float) -> socket.socket:
    """A TCP connection to `address` (HOST:PORT, an IPv6 host in brackets), within `timeout` s. Raises
    ConnectionRefusedError (its host answers, nothing listens there), socket.gaierror (the name does not
    resolve), another OSError (it cannot be reached: a timeout, no route) or ValueError (no port)."""
    host, _, port = address.rpartition(":")
    return socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)


STEP_LEAST_SECONDS = 0.01  # a step of diagnose() (a connect, a handshake, a read) may take this long at least


def _left(end: float) -> float:
    """What a step of diagnose() may take: the time left until `end` (monotonic), at least STEP_LEAST_SECONDS."""
    return max(STEP_LEAST_SECONDS, end - time.monotonic())


def _diagnose_tls(host: str, port: int, security: Security, end: float) -> tuple[str, bool]:
    """diagnose() for a listener that hangs up on plaintext HTTP/2: a TLS handshake tells a TLS server (and
    what it thinks of this client's certificate) from one that drops every connection; by `end` (monotonic)."""
    try:
        raw = socket.create_connection((host, port), timeout=_left(end))
    except OSError as exc:
        return f"it cannot be reached ({exc.strerror or exc})", False
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
    raw.settimeout(_left(end))  # the handshake's
    try:
        with context.wrap_socket(raw, server_hostname=host) as tls:
            handshaken = True
            tls.settimeout(_left(end))
            try:  # a gRPC server answers HTTP/2's preface; one that refused our certificate closes instead
                tls.sendall(_H2_PREFACE)
                if tls.recv(1) == b"" and security.tls:
                    return "the shard refused this client's certificate (signed by another CA?)", True
            except (socket.timeout, ssl.SSLWantReadError):
                pass
    except ssl.SSLCertVerificationError as exc:
        reason = exc.verify_message or str(exc)
        if "expired" in reason:
            return f"the shard's certificate has expired ({reason})", True
        return f"the shard's certificate does not verify against this client's --tls-ca ({reason})", True
    except ssl.SSLError as exc:
        if isinstance(exc, ssl.SSLEOFError) and not handshaken:
            return "it closes every connection at once (a shard restarting, or a proxy with nothing behind it)", False
        reason = exc.reason or str(exc)
        if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason:
            return "this is not a gRPC server (it hangs up on HTTP/2 and speaks no TLS): is the address right?", True
        if not security.tls:
            return "the shard requires TLS: pass the job's --tls-cert, --tls-key and --tls-ca", True
        if "EXPIRED" in reason:
            return f"the shard refused this client's certificate as expired ({reason})", True
        if "UNKNOWN_CA" in reason or "CERTIFICATE" in reason or "BAD_CERTIFICATE" in reason:
            return f"the shard refused this client's certificate (signed by another CA?) ({reason})", True
        return f"TLS handshake failed: {reason}", True
    except OSError:
        return "it closes every connection at once (a shard restarting, or a proxy with nothing behind it)", False
    finally:
        raw.close()
    if not security.tls:
        return "the shard requires TLS: pass the job's --tls-cert, --tls-key and --tls-ca", True
    return "a TLS gRPC server answers there but is not serving yet", False
