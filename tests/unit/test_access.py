"""The security policy (torchps/access.py), enumerated: every setup of a shard's credentials x every credential a
caller may present x every RPC of the service (taken from ps.proto's descriptor, so a new RPC is covered without
touching this file).

Setups: --insecure; one job token; a job token and an admin token; a per-task token table; a table and an admin
token; and mutual TLS alone, with a job token, with a table, with a table and an admin token, with a job token
and an admin token. Presented: no token, a wrong one, the job token, the tokens of worker:0, chief:0 and
evaluator:0, a table line of no known role, the admin token; over TLS, each with the certificate of the chief,
worker:0, evaluator:0, ps:0 and one of no known role.
"""

from __future__ import annotations

import itertools

import pytest

from torchps.access import describe, policy
from torchps.proto import ps_pb2
from torchps.security import ADMIN_METHODS, REPLICA_METHODS, ROLES, Security

METHODS = [method.name for service in ("ParameterServer", "Serving")
           for method in ps_pb2.DESCRIPTOR.services_by_name[service].methods]

JOB, ADMIN, WRONG = "job-token", "admin-token", "not-a-token"
TASK_TOKENS = {"chief:0": ("chief", "chief-token"), "worker:0": ("worker", "worker-0-token"),
               "evaluator:0": ("evaluator", "evaluator-token"), "intern:0": ("intern", "intern-token")}
TABLE = tuple((task, role, token) for task, (role, token) in TASK_TOKENS.items())
W0, CHIEF, EVAL, INTERN = (TASK_TOKENS[t][1] for t in ("worker:0", "chief:0", "evaluator:0", "intern:0"))
TOKENS = {"none": "", "wrong": WRONG, "job": JOB, "worker:0": W0, "chief:0": CHIEF, "evaluator:0": EVAL,
          "intern:0": INTERN, "admin": ADMIN}
TLS = dict(ca=b"ca", cert=b"cert", key=b"key")
SUBJECTS = {"chief": ("CN=chief:0,OU=chief", "chief:0", "chief"),
            "worker": ("CN=worker:0,OU=worker", "worker:0", "worker"),
            "evaluator": ("CN=evaluator:0,OU=evaluator", "evaluator:0", "evaluator"),
            "ps": ("CN=ps:0,OU=ps", "ps:0", "ps"),
            "unknown": ("CN=visitor:0,OU=intern", "visitor:0", "none")}

# A table's tokens: each names its task, in its line's role.
NAMED = {"worker:0": ("worker:0", "worker"), "chief:0": ("chief:0", "chief"),
         "evaluator:0": ("evaluator:0", "evaluator"), "intern:0": ("intern:0", "none")}
# Without TLS: presented token -> (name, role), or None for UNAUTHENTICATED; a token left out is UNAUTHENTICATED.
PLAIN = {
    "insecure": (Security(), {token: (None, "chief") for token in TOKENS}),
    "job token": (Security(token=JOB), {"job": (None, "chief")}),
    "job and admin token": (Security(token=JOB, admin_token=ADMIN),
                            {"job": (None, "worker"), "admin": (None, "chief")}),
    "token table": (Security(task_tokens=TABLE), NAMED),
    "token table and admin token": (Security(task_tokens=TABLE, admin_token=ADMIN),
                                    {**NAMED, "admin": (None, "chief")}),
}
# Mutual TLS: the tokens accepted; the certificate names the caller and its role, the admin token makes it the chief.
SECURE = {
    "TLS": (Security(**TLS), set(TOKENS)),
    "TLS and job token": (Security(token=JOB, **TLS), {"job"}),
    "TLS and token table": (Security(task_tokens=TABLE, **TLS), {"worker:0", "chief:0", "evaluator:0", "intern:0"}),
    "TLS, token table and admin token": (Security(task_tokens=TABLE, admin_token=ADMIN, **TLS),
                                         {"worker:0", "chief:0", "evaluator:0", "intern:0", "admin"}),
    "TLS, job and admin token": (Security(token=JOB, admin_token=ADMIN, **TLS), {"job", "admin"}),
}


def expected_secure(setup: str, subject: str, token: str):
    security, accepted = SECURE[setup]
    if token not in accepted:
        return None
    _, name, role = SUBJECTS[subject]
    return name, "chief" if token == "admin" and security.admin_token else role


CASES = ([pytest.param(security, None, TOKENS[token], expected.get(token), id=f"{setup}-{token}")
          for setup, (security, expected) in PLAIN.items() for token in TOKENS]
         + [pytest.param(security, SUBJECTS[subject][0], TOKENS[token], expected_secure(setup, subject, token),
                         id=f"{setup}-{subject} certificate-{token}")
            for setup, (security, _) in SECURE.items() for subject, token in itertools.product(SUBJECTS, TOKENS)])


@pytest.mark.parametrize("security,subject,token,expected", CASES)
def test_every_credential_on_every_setup_gets_its_identity_and_the_rpcs_of_its_role(security, subject, token,
                                                                                   expected):
    for method in METHODS:
        verdict = policy(security, method, token=token, subject=subject)
        if expected is None:
            assert not verdict.authenticated and not verdict.allowed, (method, verdict)
            continue
        assert verdict.authenticated and (verdict.name, verdict.role) == expected, (method, verdict)
        assert verdict.allowed == (method in ROLES.get(verdict.role, ())), (method, verdict)
        if method in ADMIN_METHODS:
            assert verdict.allowed == (verdict.role == "chief"), (method, verdict)


def test_the_chief_may_call_every_rpc_and_the_other_roles_no_admin_rpc():
    assert set(METHODS) == ROLES["chief"], "an RPC of ps.proto no role may call, or a role naming no RPC"
    assert ADMIN_METHODS <= set(METHODS)
    for role in ("worker", "evaluator", "ps", "serving"):
        assert not ROLES[role] & ADMIN_METHODS, role
    assert ROLES["evaluator"] <= ROLES["worker"] and ROLES["ps"] == {"GetStatus", "GetLayout", "Replicate", "SetReplica"}
    assert ROLES["serving"] <= ROLES["evaluator"] and not ROLES["serving"] & {"LookupRows", "Push", "Join"}
    assert REPLICA_METHODS == {m.name for m in ps_pb2.DESCRIPTOR.services_by_name["Serving"].methods}


def test_a_token_table_without_an_admin_token_takes_roles_from_the_table():
    """Issue 37, item 5: worker:0's own token was the chief's where the shard had no admin token."""
    security = Security(task_tokens=TABLE)
    for method in ("UpdateOptimizer", "SetLayout", "ExportVariables", "Configure", "Shutdown"):
        verdict = policy(security, method, token=W0)
        assert (verdict.name, verdict.role, verdict.allowed) == ("worker:0", "worker", False), verdict
        assert policy(security, method, token=CHIEF).allowed


@pytest.mark.parametrize("security,subject,token,acts", [
    (Security(task_tokens=TABLE), None, W0, {"worker:0"}),
    (Security(task_tokens=TABLE), None, CHIEF, {"worker:0", "worker:1", "chief:0"}),
    (Security(token=JOB, admin_token=ADMIN), None, JOB, {"worker:0", "worker:1", "chief:0"}),
    (Security(task_tokens=TABLE, **TLS), SUBJECTS["worker"][0], W0, {"worker:0"}),
    (Security(task_tokens=TABLE, **TLS), SUBJECTS["worker"][0], CHIEF, {"worker:0"}),
    (Security(task_tokens=TABLE, admin_token=ADMIN, **TLS), SUBJECTS["worker"][0], ADMIN,
     {"worker:0", "worker:1", "chief:0"}),
    (Security(), None, "", {"worker:0", "worker:1", "chief:0"}),
], ids=["worker token", "chief token", "shared job token", "worker certificate", "worker certificate, chief token",
        "worker certificate, admin token", "insecure"])
def test_a_named_caller_acts_in_its_own_name_only_but_the_chief(security, subject, token, acts):
    verdict = policy(security, "Join", token=token, subject=subject)
    assert {worker for worker in ("worker:0", "worker:1", "chief:0") if verdict.may_act_for(worker)} == acts


def test_each_setup_is_described_in_one_line_of_its_own():
    setups = [security for security, _ in PLAIN.values()] + [security for security, _ in SECURE.values()]
    lines = [describe(security) for security in setups]
    assert len(set(lines)) == len(lines) and not any("\n" in line for line in lines), lines
    assert describe(Security(task_tokens=TABLE)).startswith("plaintext, per-task tokens")
    assert "the chief's own token line makes the chief" in describe(Security(task_tokens=TABLE))
    assert describe(Security(task_tokens=TABLE, **TLS)).startswith("mutual TLS")


# After `ps-certs --rotate`: worker:0's old line retires at T (until=TIME), its new one does not.
T, OLD, NEW = 1_000_000.0, "worker-0-old-token", "worker-0-new-token"
ROTATED = (("worker:0", "worker", OLD), ("worker:0", "worker", NEW), ("chief:0", "chief", CHIEF))
RETIRING = ((OLD, T),)


@pytest.mark.parametrize("security,subject", [
    (Security(task_tokens=ROTATED, retiring=RETIRING), None),
    (Security(task_tokens=ROTATED, retiring=RETIRING, admin_token=ADMIN), None),
    (Security(task_tokens=ROTATED, retiring=RETIRING, **TLS), SUBJECTS["worker"][0]),
    (Security(task_tokens=ROTATED, retiring=RETIRING, admin_token=ADMIN, **TLS), SUBJECTS["worker"][0]),
], ids=["token table", "token table and admin token", "TLS and token table", "TLS, token table and admin token"])
@pytest.mark.parametrize("token,now,expected", [
    (OLD, T - 60, ("worker:0", "worker")),
    (OLD, T - 0.001, ("worker:0", "worker")),
    (OLD, T, None),
    (OLD, T + 3600, None),
    (NEW, T - 60, ("worker:0", "worker")),
    (NEW, T + 3600, ("worker:0", "worker")),
], ids=["old, in the grace", "old, at its end", "old, at the time", "old, after", "new, in the grace", "new, after"])
def test_a_token_a_rotation_replaced_is_accepted_until_its_time_then_refused_as_retired(security, subject, token,
                                                                                     now, expected):
    for method in METHODS:
        verdict = policy(security, method, token=token, subject=subject, now=now)
        if expected is None:
            assert (verdict.authenticated, verdict.allowed, verdict.retired) == (False, False, True), verdict
            continue
        assert verdict.authenticated and (verdict.name, verdict.role) == expected and not verdict.retired, verdict
        assert verdict.allowed == (method in ROLES["worker"]), (method, verdict)


def test_only_a_retiring_token_is_refused_as_retired():
    security = Security(task_tokens=ROTATED, retiring=RETIRING, admin_token=ADMIN)
    for token in ("", WRONG, W0):
        verdict = policy(security, "Push", token=token, now=T + 1)
        assert not verdict.authenticated and not verdict.retired, (token, verdict)
    assert policy(security, "Configure", token=ADMIN, now=T + 1).allowed  # the admin token does not retire


def test_a_shard_calls_another_in_the_ps_role_with_its_own_line_of_the_table():
    """Security.as_shard: the token of its own line (the newest, after a rotation), no admin token; the policy
    gives that token the ps role: replication calls, nothing an admin or a worker makes."""
    table = (("ps:1", "ps", "old-ps1"), ("chief:0", "chief", "chief-token"), ("ps:1", "ps", "new-ps1"),
             ("ps:0", "ps", "ps0-token"))
    shard = Security(task_tokens=table, admin_token="the-admin-token")
    caller = shard.as_shard(1)
    assert (caller.call_token(), caller.admin_token, caller.task_tokens) == ("new-ps1", None, ())
    for method, allowed in (("Replicate", True), ("SetReplica", True), ("GetLayout", True), ("Push", False),
                            ("SetLayout", False)):
        verdict = policy(shard, method, token=caller.call_token())
        assert verdict.authenticated and (verdict.name, verdict.role, verdict.allowed) == ("ps:1", "ps", allowed)
    assert Security(token="job-token").as_shard(0).call_token() == "job-token"  # one job token: it names nobody
