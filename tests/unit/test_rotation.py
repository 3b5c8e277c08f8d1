"""ps-certs --rotate on a folder (torchps/rotation.py), at a given time: each task's new token in its file and
the table, its old line retiring at now + the grace; an earlier rotation's lines cut to the newest grace, dropped
once past; --grace's durations."""

from __future__ import annotations

import pytest

from torchps.certs import make_job_credentials
from torchps.cluster import Cluster
from torchps.errors import ClusterConfigError
from torchps.rotation import parse_grace, rotate_tokens
from torchps.security import read_token_table

SPEC = Cluster(ps=("127.0.0.1:1",), chief=("127.0.0.1:2",), worker=("127.0.0.1:3",))
T = 1_900_000_000.0


def _newest(folder) -> dict[str, str]:
    """Each task's token in the table that no rotation retires; a task's own token file holds the same (a
    shard's token file is the table)."""
    table = read_token_table(str(folder / "tokens"))
    retiring = {token for token, _ in table.retiring}
    newest = {name: token for name, _, token in table.lines if token not in retiring}
    for name, token in newest.items():
        if not name.startswith("ps:"):
            assert (folder / f"{name.replace(':', '-')}.token").read_text() == token, name
    assert not (folder / "ps-0.token").exists()
    return newest


def test_each_rotation_retires_the_tokens_before_it_by_its_own_grace_at_the_latest(tmp_path):
    folder = tmp_path / "job"
    make_job_credentials(folder, SPEC)
    first = _newest(folder)
    roles, _ = rotate_tokens(folder, grace=600, now=T)
    assert {str(task): role for task, role in roles.items()} == {"chief:0": "chief", "ps:0": "ps", "worker:0": "worker"}
    table = read_token_table(str(folder / "tokens"))
    second = _newest(folder)
    assert dict(table.retiring) == {token: T + 600 for token in first.values()}
    assert {token for _, _, token in table.lines} == set(first.values()) | set(second.values())

    rotate_tokens(folder, grace=60, now=T + 10)  # the first tokens now retire at T + 70, the second at T + 70
    table = read_token_table(str(folder / "tokens"))
    assert dict(table.retiring) == {token: T + 70 for token in [*first.values(), *second.values()]}
    assert len(table.lines) == 9

    rotate_tokens(folder, grace=0, now=T + 20)  # refused at once: every old line goes
    table = read_token_table(str(folder / "tokens"))
    third = _newest(folder)
    assert table.retiring == () and {(name, token) for name, _, token in table.lines} == set(third.items())


def test_a_folder_without_a_table_of_task_tokens_is_refused_and_left_as_it_is(tmp_path):
    with pytest.raises(ClusterConfigError, match="has no ca.crt: --rotate needs the folder ps-certs made"):
        rotate_tokens(tmp_path, grace=60)
    (tmp_path / "ca.crt").write_text("x")
    (tmp_path / "tokens").write_text("one-job-token\n")
    with pytest.raises(ClusterConfigError, match="holds one job token"):
        rotate_tokens(tmp_path, grace=60)
    assert (tmp_path / "tokens").read_text() == "one-job-token\n"


@pytest.mark.parametrize("text,seconds", [("0", 0), ("45", 45), ("90s", 90), ("10m", 600), ("1.5h", 5400)])
def test_grace_durations(text, seconds):
    assert parse_grace(text) == seconds


@pytest.mark.parametrize("text", ["", "-5m", "10x", "m", "10 minutes"])
def test_grace_that_is_no_duration_is_refused(text):
    with pytest.raises(ClusterConfigError, match="--grace must be a duration"):
        parse_grace(text)
