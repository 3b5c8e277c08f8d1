"""A call waiting to try a shard that did not answer again is sent to the shard's new address as soon as the
client redirects the shard (a failover found by its failover watch or a relocate on another thread), not once
the backoff pause it was in ends (pauses double up to seconds). Real processes: a ps-server killed under a
client, and another at a new address."""

import threading

from helpers import wait_until

from torchps.client import channels
from torchps.client.channels import ShardChannels
from torchps.proto import ps_pb2
from torchps.worker.local_cluster import LocalCluster


def _status(stub, timeout: float) -> ps_pb2.StatusResponse:
    return stub.GetStatus(ps_pb2.StatusRequest(), timeout=timeout)


def test_a_call_pausing_before_its_next_attempt_goes_to_the_new_address_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(channels, "BACKOFF_FIRST_SECONDS", 600.0)  # the pause after the first failure: 300-900 s
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    with LocalCluster(1, log_dir=tmp_path / "first") as first, LocalCluster(1, log_dir=tmp_path / "second") as second:
        shards = ShardChannels([first.address(0)], connect_timeout=3600)
        try:
            shards.call(0, _status, 30)  # connected
            first.kill_ps(0)
            answered = []
            call = threading.Thread(target=lambda: answered.append(shards.call(0, _status, 30)), daemon=True)
            call.start()
            wait_until(lambda: not shards._ready[0], 30, "the call's attempt at the killed shard to fail")
            assert shards.redirect(0, second.address(0))
            call.join(60)  # far less than its pause
            assert not call.is_alive(), "the call waited out its pause before it tried the new address"
            assert answered[0].pid == second.procs[0].pid
        finally:
            shards.close()
