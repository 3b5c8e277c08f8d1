"""The shard's token table follows its file (ps_server/tokens.py): looked at on demand or once per recheck
interval, re-read whole when it changed, kept as it was when the new file cannot be read."""

from __future__ import annotations

import logging
import os

from torchps.ps_server.tokens import TokenFile
from torchps.security import Security


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write(path, text: str) -> None:
    aside = path.with_name(path.name + ".new")
    aside.write_text(text)
    os.replace(aside, path)


def test_a_changed_file_is_taken_at_the_next_look_and_a_bad_one_keeps_the_table(tmp_path):
    path = tmp_path / "tokens"
    write(path, "worker:0 worker aaa\n")
    clock = Clock()
    tokens = TokenFile(Security.load(token_file=str(path), environ={}), recheck=1.0, clock=clock)
    assert tokens.current().task_of("aaa") == ("worker:0", "worker")

    write(path, "worker:0 worker aaa\nworker:4 worker bbb\n")
    assert tokens.current().task_of("bbb") is None  # not looked at yet: the recheck interval has not passed
    clock.now = 1.0
    assert tokens.current().task_of("bbb") == ("worker:4", "worker") and tokens.reloads == 1

    write(path, "worker:4 worker bbb\n")  # worker:0 revoked
    assert tokens.refresh() and tokens.current().task_of("aaa") is None

    write(path, "worker:4 worker bbb extra words\n")  # neither kind of token file: the table in force stays
    assert not tokens.refresh() and tokens.current().task_of("bbb") == ("worker:4", "worker")
    path.unlink()  # gone (a Secret being swapped): the same
    assert not tokens.refresh() and tokens.reloads == 2


def test_a_table_made_after_the_file_changed_holds_the_file_of_its_making(tmp_path):
    """A backup promoted long after it read its credentials serves with the file as it is then: a worker added
    meanwhile is known at once (the replicated soak saw it refused as 'wrong token' for good)."""
    path = tmp_path / "tokens"
    write(path, "worker:0 worker aaa\n")
    security = Security.load(token_file=str(path), environ={})
    write(path, "worker:0 worker aaa\nworker:5 worker ccc\n")
    tokens = TokenFile(security, recheck=1.0, clock=Clock())
    assert tokens.current().task_of("ccc") == ("worker:5", "worker") and tokens.reloads == 1
    write(path, "worker:0 worker aaa\nworker:5 worker ccc\n")  # rewritten, the same tokens: nothing replaced
    assert not tokens.refresh() and tokens.reloads == 1


def test_credentials_without_a_token_file_never_look_at_the_disk():
    tokens = TokenFile(Security(), recheck=0.0)
    assert not tokens.refresh() and tokens.current() == Security()


def test_a_re_read_that_changes_the_policy_in_force_says_so(tmp_path, caplog):
    path = tmp_path / "tokens"
    write(path, "one-job-token\n")
    tokens = TokenFile(Security.load(token_file=str(path), environ={}), recheck=0.0)
    with caplog.at_level(logging.INFO, logger="torchps.ps_server.tokens"):
        write(path, "chief:0 chief aaa\nworker:0 worker bbb\n")
        assert tokens.refresh()
        write(path, "chief:0 chief aaa\n")  # a token revoked: the same policy, no new line about it
        assert tokens.refresh()
    policies = [r.getMessage() for r in caplog.records if r.getMessage().startswith("security policy")]
    assert policies == ["security policy now: plaintext, per-task tokens: each names its task and role, no admin "
                        "token: the chief's own token line makes the chief"], policies


def test_a_rotated_table_names_its_retiring_tokens_and_a_bad_time_keeps_the_table(tmp_path):
    path = tmp_path / "tokens"
    write(path, "worker:0 worker aaa\n")
    tokens = TokenFile(Security.load(token_file=str(path), environ={}), recheck=1.0, clock=Clock())
    write(path, "worker:0 worker aaa until=2030-01-02T03:04:05Z\nworker:0 worker bbb\n")
    assert tokens.refresh()
    security = tokens.current()
    assert security.retires_at("aaa") == 1893553445.0 and security.retires_at("bbb") is None
    assert security.task_of("aaa") == security.task_of("bbb") == ("worker:0", "worker")
    write(path, "worker:0 worker aaa until=next-tuesday\nworker:0 worker bbb\n")
    assert not tokens.refresh() and tokens.current() is security


def test_insecure_beside_credentials_from_the_environment_names_the_variables(tmp_path):
    """ps-admin --insecure in a shell with TORCHPS_TOKEN_FILE set: the refusal says where the credentials came
    from, since no flag gave them."""
    import pytest

    from torchps.errors import ClusterConfigError
    from torchps.security import require_credentials

    path = tmp_path / "token"
    path.write_text("s3cret\n")
    security = Security.load(environ={"TORCHPS_TOKEN_FILE": str(path)})
    with pytest.raises(ClusterConfigError, match=r"by the TORCHPS_\* variables: unset those"):
        require_credentials(security, insecure=True)
