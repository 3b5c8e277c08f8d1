"""held_reason: what a push held on ps 0 waits for, from ps 0's status (client/held.py). No sockets."""

from torchps.client.held import held_reason
from torchps.proto import ps_pb2

NAMES = ["chief:0", "worker:0", "worker:1", "worker:2"]


def member(name: str, state: str = "live", pushes: int = 0) -> ps_pb2.MemberStatus:
    return ps_pb2.MemberStatus(worker=name, state=state, pushes=pushes, last_push_step=pushes - 1)


def sync_status(**fields) -> ps_pb2.StatusResponse:
    return ps_pb2.StatusResponse(config=ps_pb2.SyncConfig(mode="sync", total_num_replicas=4), **fields)


def test_a_sync_step_names_who_has_not_joined_and_who_has_not_pushed_for_it():
    status = sync_status(quorum=4, awaited_step=7, awaited_pushes=2, awaited_pushers=["chief:0", "worker:0"],
                         not_joined=["worker:2"],
                         members=[member("chief:0", pushes=8), member("worker:0", pushes=8),
                                  member("worker:1", pushes=7)])
    assert held_reason(status, NAMES, "chief:0", 6.4) == \
        "step 7 waits for 2 more of 4 gradients: worker:2 has not joined; worker:1 has not pushed for it (waited 6 s)"


def test_workers_that_left_or_were_lost_are_not_waited_for_and_a_full_step_is_no_news():
    status = sync_status(quorum=3, awaited_step=7, awaited_pushes=2, awaited_pushers=["chief:0", "worker:0"],
                         members=[member("chief:0"), member("worker:0"), member("worker:1", "lost"),
                                  member("worker:2", "left")])
    assert held_reason(status, NAMES, "chief:0", 5) == \
        "step 7 waits for 1 more of 3 gradients: the live workers' next batches (waited 5 s)"
    full = sync_status(quorum=2, awaited_step=7, awaited_pushes=2, awaited_pushers=["chief:0", "worker:0"])
    assert held_reason(full, NAMES, "chief:0", 5) is None, "the step has its quorum: it is being applied"


def test_an_ssp_push_names_the_slowest_live_worker():
    status = ps_pb2.StatusResponse(config=ps_pb2.SyncConfig(mode="ssp", max_staleness=2),
                                   members=[member("chief:0", pushes=10), member("worker:0", pushes=9),
                                            member("worker:1", pushes=7), member("worker:2", "lost", pushes=1)])
    assert held_reason(status, NAMES, "chief:0", 5) == \
        "a push of chief:0 waits for the slowest worker to come within 2 pushes: worker:1 is 3 pushes behind it " \
        "(waited 5 s)"
    assert held_reason(ps_pb2.StatusResponse(config=ps_pb2.SyncConfig(mode="async")), NAMES, "chief:0", 5) is None
