"""Progress leases in ps_server/membership.py: the timeout is max(floor, PROGRESS_MULTIPLE x the median push
interval), a heartbeating worker that stops pushing past it is stalled, a held push never stalls its worker.
Time is given explicitly (the `now` arguments), so nothing here sleeps."""

from torchps.ps_server.membership import PROGRESS_MULTIPLE, Membership

LEASE = 1e9  # leases never run out here: only progress is under test


def touch(members: Membership, worker: str, now: float, *, progress: bool) -> None:
    members.touch(worker, 1, now=now, step=0, start_step=0, level=0, progress=progress)


def pushing(members: Membership, worker: str, start: float, interval: float, pushes: int) -> float:
    """`worker` pushes every `interval` s from `start`; returns the time of its last push."""
    now = start
    for _ in range(pushes):
        touch(members, worker, now, progress=True)
        members.pushed(worker, now)
        now += interval
    return now - interval


def test_the_timeout_follows_the_median_push_interval_above_the_floor():
    members = Membership()
    assert members.progress_timeout(5.0) == 5.0  # no pushes yet: the floor
    pushing(members, "worker:0", 0.0, 1.0, 40)
    pushing(members, "worker:1", 0.5, 1.0, 40)
    assert members.progress_timeout(5.0) == PROGRESS_MULTIPLE * 1.0
    assert members.progress_timeout(60.0) == 60.0  # a floor above it wins


def test_a_heartbeating_worker_stalls_only_past_the_timeout_and_resumes_when_it_pushes():
    members = Membership()
    last = max(pushing(members, "worker:0", 0.0, 0.5, 40), pushing(members, "worker:1", 0.25, 0.5, 40))
    timeout = members.progress_timeout(1.0)
    assert timeout == PROGRESS_MULTIPLE * 0.5
    stuck_since = members.members["worker:1"].last_progress
    now = last
    while now < stuck_since + timeout - 0.5:  # worker:1 only heartbeats; worker:0 keeps pushing
        now += 0.5
        touch(members, "worker:1", now, progress=False)
        touch(members, "worker:0", now, progress=True)
        members.pushed("worker:0", now)
        assert members.expire(now, LEASE, 1.0) == ([], []), f"stalled too early, {now - stuck_since:.1f} s"
    now = stuck_since + timeout + 0.1
    touch(members, "worker:0", now, progress=True)
    assert members.expire(now, LEASE, 1.0) == ([], ["worker:1"])
    assert members.members["worker:1"].stalled and members.stalls == 1
    assert members.members["worker:0"].live and not members.members["worker:0"].stalled
    event, _ = members.touch("worker:1", 1, now=now + 1, step=0, start_step=0, level=0,
                             progress=True)
    assert event == "resumed" and not members.members["worker:1"].stalled


def test_a_call_that_may_not_rejoin_leaves_a_gone_or_stalled_worker_as_it_is():
    """rejoin False (a sync shard behind shard 0, called with a step it has passed): a gone worker stays gone
    and unrenewed, a stalled one stays stalled with its lease renewed; the next call that may counts it from
    the step it names."""
    for state in ("gone", "stalled"):
        members = Membership()
        touch(members, "worker:0", 0.0, progress=True)
        if state == "gone":
            assert members.expire(2.0, 1.0, 1e9) == (["worker:0"], [])
        else:
            touch(members, "worker:0", 1.5, progress=False)
            assert members.expire(2.0, LEASE, 1.0) == ([], ["worker:0"])
        member = members.members["worker:0"]
        seen = member.last_seen
        assert members.touch("worker:0", 1, now=3.0, step=7, start_step=6, level=0, progress=True,
                             rejoin=False) == (None, None)
        assert not member.live and getattr(member, state), state
        assert member.last_seen == (seen if state == "gone" else 3.0), state
        event, _ = members.touch("worker:0", 1, now=4.0, step=7, start_step=8, level=0, progress=True)
        assert event == ("rejoined" if state == "gone" else "resumed") and member.live, state
        assert member.counts_from == 8, state


def test_a_worker_whose_push_is_held_never_stalls():
    members = Membership()
    pushing(members, "worker:0", 0.0, 1.0, 20)
    members.members["worker:0"].held = 1  # shard 0 holds its push (a sync step not yet released)
    assert members.expire(1e6, LEASE, 1.0) == ([], [])
    members.members["worker:0"].held = 0
    assert members.expire(1e6, LEASE, 1.0) == ([], ["worker:0"])


def test_each_worker_s_pace_and_straggler_score_against_the_others():
    members = Membership()
    assert members.paces() == {}
    pushing(members, "worker:0", 0.0, 1.0, 30)
    pushing(members, "worker:1", 0.0, 1.0, 30)
    pushing(members, "worker:2", 0.0, 3.0, 30)
    paces = {w: (round(i, 9), round(score, 9)) for w, (i, score) in members.paces().items()}
    assert paces["worker:0"] == (1.0, 0.5)  # against the median of 1.0 and 3.0
    assert paces["worker:2"] == (3.0, 3.0)  # three times slower than the others
    members.members["worker:2"].gone = True  # only live workers count
    assert set(members.paces()) == {"worker:0", "worker:1"}
    assert [round(score, 9) for _, score in members.paces().values()] == [1.0, 1.0]


def test_a_pace_is_a_moving_average_that_follows_a_worker_slowing_down():
    members = Membership()
    last = pushing(members, "worker:0", 0.0, 1.0, 10)
    pushing(members, "worker:0", last + 4.0, 4.0, 30)
    interval, _ = members.paces()["worker:0"]
    assert 3.9 < interval <= 4.0


def test_paces_are_each_workers_interval_over_the_median_of_the_others():
    """paces_of finds every worker's median of the others in one selection (not a median per worker); it
    gives what a median per worker gives, ties and one, two and three workers included."""
    import random
    import statistics

    from torchps.ps_server.membership import paces_of

    rng = random.Random(7)
    for n in [1, 2, 3, 4, 5, 8, 33] * 20:
        intervals = {f"worker:{i}": float(rng.choice([0.5, 1.0, 1.0, 2.0, rng.uniform(0.1, 5)])) for i in range(n)}
        expected = {}
        for worker, v in intervals.items():
            others = [i for w, i in intervals.items() if w != worker]
            median = statistics.median(others) if others else v
            expected[worker] = (v, v / median if median > 0 else 1.0)
        got = paces_of(intervals)
        assert list(got) == sorted(intervals)
        assert {w: (i, round(s, 12)) for w, (i, s) in got.items()} == \
            {w: (i, round(s, 12)) for w, (i, s) in expected.items()}, intervals


def test_a_shard_that_adopts_another_shards_workers_runs_their_leases_as_that_shard_does():
    """export_leases() on ps 0 gives each worker with the seconds since it was last heard from; adopt() on a
    shard added to the job takes the workers it does not know with those ages, so a lease about to run out on
    ps 0 runs out here at the same moment, not a whole lease later, and a worker it knows already stays as
    it is."""
    ps0, added = Membership(), Membership()
    touch(ps0, "worker:0", 100.0, progress=True)
    touch(ps0, "worker:1", 108.0, progress=True)
    touch(added, "worker:1", 109.0, progress=False)  # its heartbeat reached the added shard already
    leases = ps0.export_leases(109.0)
    assert (leases["worker:0"]["silent"], leases["worker:1"]["silent"]) == (9.0, 1.0)
    assert added.adopt(leases, 109.5) == ["worker:0"]
    assert added.expire(110.4, 10.0, 1e9) == ([], [])
    assert added.expire(110.6, 10.0, 1e9) == (["worker:0"], []), "heard from last at 100 on ps 0: out at 110"
    assert added.live() == 1
