"""The shards' security policy: one pure function decides who a caller is and what it may call. No gRPC.

`policy(security, method, token=..., subject=...)` takes the shard's
credentials (`security`: TLS or not, one job token or a table of per-task
tokens, an admin token) and what a call presented (the token in its
metadata, its TLS certificate's subject) and returns a Verdict:

    authenticated  a shard that checks tokens accepts the admin token, its job token and the tokens of its
                   table, nothing else (no token, a wrong one: UNAUTHENTICATED, before a request byte is
                   read); a token `ps-certs --rotate` replaced (its line ends in until=TIME) only before
                   that time (`now`), then it is `retired`; a shard that checks none (TLS alone, or
                   --insecure) accepts every call it gets
    name, role     with TLS: the certificate's common name and organizational unit; the admin token makes
                   its holder the chief. Without TLS: the admin token names the chief (nobody by name); a
                   token of the table names its task, in the role its line gives (the chief's own line: the
                   chief, with or without an admin token); the one job token names nobody, in the worker
                   role, or the chief's where the shard has no admin token (nothing tells the chief apart
                   then; the shard warns at start). Without credentials (--insecure): every caller is the
                   chief, by no name.
    allowed        authenticated, and the role may call `method` (torchps.security.ROLES); a role not
                   there ("none": a certificate or token line of no known role) may call nothing

`Verdict.may_act_for(worker)`: a caller its credentials name acts in its
own name only (Join, Heartbeat, Leave, Push, TakeDataShard), but the chief.
`describe(security)` says which policy is in force, in one line (ps-server
logs it at start). ps_server/auth.py applies the verdicts at the shard's
edge; tests/unit/test_access.py enumerates them.
"""

from __future__ import annotations

import dataclasses
import hmac
import re
import time

from .security import ROLES, Security, allowed_methods

__all__ = ["Verdict", "policy", "describe"]

_SUBJECT = re.compile(r"(?:^|,)(CN|OU)=((?:[^,\\]|\\.)*)")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the policy says of one call: whether its credentials are accepted, the task they name ("worker:1";
    None when they name nobody), its role (a key of ROLES, or "none") and whether it may call the method; and,
    refused, whether for a token a rotation replaced whose grace period ended."""

    authenticated: bool
    name: str | None
    role: str
    allowed: bool
    retired: bool = False

    def may_act_for(self, worker: str) -> bool:
        """Whether this caller may act in `worker`'s name: the chief in anyone's, a named caller in its own."""
        return self.role == "chief" or self.name is None or self.name == worker


def _matches(token: str, secret: str | None) -> bool:
    return secret is not None and hmac.compare_digest(token.encode(), secret.encode())


def _accepted(security: Security, token: str, now: float) -> bool:
    if not security.checks_tokens:
        return True
    if _matches(token, security.admin_token) or _matches(token, security.token):
        return True
    until = security.retires_at(token)
    return security.task_of(token) is not None and (until is None or now < until)


def _role(role: str) -> str:
    return role if role in ROLES else "none"


def _identity(security: Security, token: str, subject: str | None) -> tuple[str | None, str]:
    """(name, role) of an accepted call (see the module docstring)."""
    if security.insecure:
        return None, "chief"
    admin = _matches(token, security.admin_token)
    if security.tls:
        fields = dict(_SUBJECT.findall(subject or ""))
        return fields.get("CN") or None, "chief" if admin else _role(fields.get("OU", ""))
    if admin:
        return None, "chief"
    task = security.task_of(token)
    if task is not None:
        return task[0], _role(task[1])
    return None, "worker" if security.admin_token is not None else "chief"  # the one job token


def policy(security: Security, method: str, *, token: str = "", subject: str | None = None,
           now: float | None = None) -> Verdict:
    """The verdict on a call of `method` (its name in ps.proto, e.g. "Push") that presented `token` ("" for
    none) and, over TLS, a certificate of `subject` (RFC 2253, e.g. "CN=worker:0,OU=worker"), at Unix time
    `now` (default: the clock's; it decides only whether a retiring token is still accepted). Never raises."""
    now = time.time() if now is None else now
    if not _accepted(security, token, now):
        return Verdict(False, None, "none", False, retired=security.retires_at(token) is not None)
    name, role = _identity(security, token, subject)
    return Verdict(True, name, role, method in allowed_methods(role))


def describe(security: Security) -> str:
    """The policy `security` puts in force, in one line."""
    if security.insecure:
        return "INSECURE: no TLS, no token: every caller is the chief"
    admin = "the admin token makes the chief" if security.admin_token else "no admin token"
    if security.tls:
        tokens = ("per-task tokens" if security.task_tokens else "a job token" if security.token
                  else "no token")
        return f"mutual TLS, {tokens} checked: roles from certificates (OU), {admin}"
    if security.task_tokens:
        chief = "" if security.admin_token else ": the chief's own token line makes the chief"
        return f"plaintext, per-task tokens: each names its task and role, {admin}{chief}"
    if security.admin_token:
        return "plaintext, job token: it names nobody, in the worker role; the admin token makes the chief"
    return "plaintext, job token and no admin token: every holder is the chief"
