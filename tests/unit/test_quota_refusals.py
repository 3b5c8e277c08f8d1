"""ps_server.quotas.Quotas without a server: which refusals a client may retry (ShardBusyError: the call may pass
once other calls end) and which stand (ResourceExhaustedError: until the caller changes something)."""

import pytest

from torchps.errors import ResourceExhaustedError, ShardBusyError
from torchps.ps_server.quotas import Quotas


def test_a_push_over_the_budget_because_others_are_being_received_is_busy_and_one_that_never_fits_is_not():
    quotas = Quotas(max_memory=1000)
    quotas.reserve(500, 300, "first")  # the shard holds 500; this push's 300 are being received
    with pytest.raises(ShardBusyError, match="pushes being received hold 300"):
        quotas.reserve(500, 300, "second")  # 500 + 300 fits once the first is over
    with pytest.raises(ResourceExhaustedError, match="--max-memory is 1000") as info:
        quotas.reserve(500, 600, "third")  # 500 + 600 never fits
    assert not isinstance(info.value, ShardBusyError)
    assert quotas.in_flight == 300, "a refusal reserves nothing"
    quotas.release(300)
    quotas.reserve(500, 300, "second")  # its retry
    assert quotas.in_flight == 300


def test_a_clients_calls_past_its_limit_are_busy_and_other_clients_go_on():
    quotas = Quotas(max_calls_per_client=1)
    with quotas.call("worker:0"):
        with pytest.raises(ShardBusyError, match="worker:0 already has 1 calls"):
            with quotas.call("worker:0"):
                pass
        with quotas.call("worker:1"):
            pass
    with quotas.call("worker:0"):  # its retry, once the first call ended
        pass
