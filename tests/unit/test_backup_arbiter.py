"""Where a backup asks its arbiter (ps_server/backup.py): the primary's record of the arbiter's move, come in
the stream, and the primary's layout, asked now and then. A layout answer older than a move the backup knows of
(asked before the record came) leaves the arbiter where the record put it. No processes: the answers are given
by hand."""

from __future__ import annotations

import concurrent.futures

from torchps.proto import ps_pb2
from torchps.ps_server.backup import Backup
from torchps.security import INSECURE

SPEC = ("127.0.0.1:7000", "127.0.0.1:7001")


def _answer(primary: str, moved_at: float) -> concurrent.futures.Future:
    """A finished GetLayout of the primary (ps 0) naming ps:1, its backup's arbiter, at `primary`."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(ps_pb2.Layout(replicas=[
        ps_pb2.ShardReplicas(index=1, primary=primary, failovers=int(moved_at > 0), last_failover_unix=moved_at)]))
    return future


def test_a_layout_asked_before_the_arbiters_move_came_in_the_stream_does_not_undo_it(tmp_path):
    backup = Backup(0, "127.0.0.1:7002", SPEC[0], SPEC, str(tmp_path / "copy"), INSECURE)
    try:
        backup._follow_arbiter({"action": "promote", "index": 1, "primary": "127.0.0.1:7003", "when": 1000.0})
        assert backup._ps0.addresses[1] == "127.0.0.1:7003"
        backup._learn_arbiter(_answer(SPEC[1], 0.0))  # answered before ps 0 promoted ps:1's backup
        assert backup._ps0.addresses[1] == "127.0.0.1:7003", "a stale answer moved the arbiter back"
        backup._learn_arbiter(_answer("127.0.0.1:7004", 2000.0))  # a later move, known from the layout first
        assert backup._ps0.addresses[1] == "127.0.0.1:7004"
        backup._follow_arbiter({"action": "promote", "index": 1, "primary": "127.0.0.1:7004", "when": 2000.0})
        assert backup._ps0.addresses[1] == "127.0.0.1:7004"
    finally:
        backup._ps0.close()
