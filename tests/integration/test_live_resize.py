"""Live resize: the job goes 2 -> 4 -> 3 -> 2 shards while 8 processes push; no push is lost or applied twice."""

import contextlib
import json
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

from helpers import forkserver_context, wait_until
from torchps.client import Optimizer, PSClient, TaskSpec
from torchps.errors import ClusterConfigError, InvalidArgumentError, ModeConflictError, WaitTimeoutError
from torchps.proto import ps_pb2
from torchps.worker.local_cluster import LocalCluster

PROCESSES = forkserver_context()
SHAPES = {f"resize/v{i}": (4096,) for i in range(16)}  # 64k floats in 16 variables: they spread over the shards
PUSHERS = 8
PS_ADMIN = str(pathlib.Path(sys.executable).with_name("ps-admin"))  # the console script, as a user runs it


def _push_ones(cluster, index, stop, counts, errors, followed):
    """Child process: pushes ones to every variable until `stop` (every other push a push_pull, which reads the
    values in the same round trip); counts each acknowledged push, and reports
    the layout it ended at and what the resizes cost it (PSClient.layout_waits)."""
    try:
        with PSClient(cluster, connect_timeout=60, partitioner=None) as ps:
            ps.declare({name: torch.zeros(shape) for name, shape in SHAPES.items()})
            ps.wait_for_variables(SHAPES, timeout=60)
            grads = {name: torch.ones(shape) for name, shape in SHAPES.items()}
            targets = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
            while not stop.is_set():
                if counts[index] % 2:  # push then pull, or both in one round trip per shard
                    ps.push_pull(grads, targets)
                else:
                    ps.push(grads)
                counts[index] += 1
            followed.put((ps.layout_epoch, *ps.layout_waits))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        errors.put(f"pusher {index}: {type(exc).__name__}: {exc}")


def _started(body, count: int, cluster, *shared) -> list:
    """`count` child processes running body(cluster, index, *shared), started."""
    children = [PROCESSES.Process(target=body, args=(cluster, i, *shared)) for i in range(count)]
    for child in children:
        child.start()
    return children


def _pushes_go_on(counts, at_least: int, errors) -> None:
    """Returns once every pusher acknowledged `at_least` more pushes than now (each resize is under load)."""
    target = [c + at_least for c in counts[:]]

    def done() -> bool:
        assert errors.empty(), errors.get()  # a pusher's error fails the test at once, not at the deadline
        return all(c >= t for c, t in zip(counts[:], target))

    wait_until(done, 120, f"every pusher to acknowledge {at_least} more pushes (now {counts[:]})")


def test_exact_sum_across_live_resizes():
    with LocalCluster(2) as local, PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief:
        chief.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
        stop, counts, errors, followed = (PROCESSES.Event(), PROCESSES.Array("q", PUSHERS), PROCESSES.Queue(),
                                          PROCESSES.Queue())
        pushers = _started(_push_ones, PUSHERS, local.cluster, stop, counts, errors, followed)
        try:
            _pushes_go_on(counts, 3, errors)
            grown = chief.resize([*local.cluster.ps, local.add_ps(), local.add_ps()])
            assert (grown.shards_before, grown.shards_after, grown.epoch) == (2, 4, 1) and grown.moved == 8
            _pushes_go_on(counts, 3, errors)
            shrunk = chief.resize([local.address(i) for i in range(3)])
            # one epoch for the moves, one without the removed shard
            assert (shrunk.shards_after, shrunk.epoch, shrunk.stopped) == (3, 3, [local.address(3)])
            assert local.procs[3].wait(timeout=30) == 0  # stopped by the resize, after its drain
            _pushes_go_on(counts, 3, errors)
            back = chief.resize(list(local.cluster.ps))
            assert (back.shards_after, back.epoch) == (2, 5) and local.procs[2].wait(timeout=30) == 0
            _pushes_go_on(counts, 3, errors)
        finally:
            stop.set()
            for pusher in pushers:
                pusher.join(timeout=120)
        assert errors.empty(), errors.get()
        assert [p.exitcode for p in pushers] == [0] * PUSHERS
        ends = [followed.get(timeout=10) for _ in range(PUSHERS)]
        assert [epoch for epoch, _, _ in ends] == [5] * PUSHERS
        # Pushes were under way while variables moved: some were refused by a shard their variables had left
        # (sent again to the new owner), or waited for a variable in transit.
        assert sum(refused + waits for _, refused, waits in ends) > 0, ends
        print("pushers (epoch, refused, moving waits):", ends, "pushes:", sum(counts[:]))
        total = sum(counts[:])
        with PSClient(local.cluster, connect_timeout=30, partitioner=None) as reader:  # starts at epoch 0
            reader.declare({n: torch.zeros(s) for n, s in SHAPES.items()})
            values = reader.pull(SHAPES)
            assert reader.layout_epoch == 5
        for name, value in values.items():
            assert torch.equal(value, torch.full(SHAPES[name], -float(total))), (name, value[:3], total)
        held = {info.spec.name: info.version for info in chief.list_variables()}
        assert held == {name: total for name in SHAPES}  # each variable once, on one shard, every push counted


SYNC_WORKERS = 4


def _sync_worker(cluster, index, stop_at, counts, errors, followed):
    """Child process: worker:<index> of a sync job (R = N = SYNC_WORKERS) pushing ones, every other step a
    push_pull, until its next step reaches `stop_at` (set by the test; 0: go on); counts its pushes."""
    try:
        with PSClient(cluster, task=TaskSpec("worker", index), connect_timeout=60, partitioner=None) as ps:
            ps.declare({name: torch.zeros(shape) for name, shape in SHAPES.items()})
            ps.wait_for_variables(SHAPES, timeout=60)
            step = ps.join()
            grads = {name: torch.ones(shape) for name, shape in SHAPES.items()}
            targets = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
            while not stop_at.value or step < stop_at.value:
                if step % 2:
                    step = ps.push_pull(grads, targets)
                else:
                    step = ps.push(grads)
                    ps.pull_into(targets, min_step=step)
                counts[index] += 1
            followed.put((ps.layout_epoch, *ps.layout_waits))
            ps.leave()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        errors.put(f"worker {index}: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _sync_workers(cluster):
    """SYNC_WORKERS _sync_worker processes: yields (stop_at, counts, errors, followed); on the way out, stops
    them (at once if the test set no stop_at) and checks that each ended cleanly, having reported no error."""
    shared = stop_at, _, errors, _ = (PROCESSES.Value("q", 0), PROCESSES.Array("q", SYNC_WORKERS),
                                      PROCESSES.Queue(), PROCESSES.Queue())
    workers = _started(_sync_worker, SYNC_WORKERS, cluster, *shared)
    try:
        yield shared
    finally:
        if not stop_at.value:  # the test failed before: the workers stop at once
            stop_at.value = 1
        for worker in workers:
            worker.join(timeout=120)
    assert errors.empty(), errors.get()
    assert [w.exitcode for w in workers] == [0] * SYNC_WORKERS


def test_a_sync_job_resizes_at_a_step_boundary():
    """A sync job (R = N = 4) goes 2 -> 3 -> 2 shards while its workers train: each resize holds the pushes of
    one step until the variables moved, every step still averages all 4 workers' gradients (none dropped as
    stale, none counted twice), and every variable ends at minus the number of steps."""
    with LocalCluster(2) as local, PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief:
        chief.configure("sync", replicas_to_aggregate=SYNC_WORKERS, total_num_replicas=SYNC_WORKERS)
        chief.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
        with _sync_workers(local.cluster) as (stop_at, counts, errors, followed):
            _pushes_go_on(counts, 3, errors)
            grown = chief.resize([*local.cluster.ps, local.add_ps()])
            # two epochs set the hold, one moves the variables, one ends the hold
            assert (grown.shards_after, grown.epoch) == (3, 4) and grown.moved > 0
            _pushes_go_on(counts, 3, errors)
            back = chief.resize(list(local.cluster.ps))
            assert (back.shards_after, back.stopped) == (2, [local.address(2)])
            assert local.procs[2].wait(timeout=30) == 0
            _pushes_go_on(counts, 3, errors)
            stop_at.value = chief.status(0).step + 3
        ends = [followed.get(timeout=10) for _ in range(SYNC_WORKERS)]
        assert {epoch for epoch, _, _ in ends} == {back.epoch}
        assert sum(refused for _, refused, _ in ends) > 0, ends  # held pushes were placed anew after a hold
        steps = stop_at.value
        assert list(counts[:]) == [steps] * SYNC_WORKERS  # one push per worker and step, each acknowledged
        statuses = [chief.status(s) for s in range(2)]
        assert [(st.step, st.stale_dropped) for st in statuses] == [(steps, 0)] * 2
        values = chief.pull(SHAPES)
        for name, value in values.items():
            assert torch.equal(value, torch.full(SHAPES[name], -float(steps))), (name, value[:3], steps)
        assert {info.spec.name: info.version for info in chief.list_variables()} == {n: steps for n in SHAPES}


def test_a_shard_added_to_a_sync_job_a_worker_left_expects_the_job_s_workers_not_the_spec_s():
    """A sync job of N = R = 5 whose worker:4 joined and left: ps 0 counts 4 workers in its startup grace (a
    long one). The shard a resize adds takes ps 0's workers, worker:4 gone among them, and ps 0's grace end: it
    expects the same 4 gradients a step. (Before, it counted the spec's 5 in a grace of its own, so the
    workers' next pushes were refused as ahead of its step, or, waiting there, the job stood still for the
    grace: the 2-minute soak met a 60 s pause.) Every step still averages the 4 workers' gradients."""
    spec = SYNC_WORKERS + 1
    with LocalCluster(2) as local, PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief:
        chief.configure("sync", replicas_to_aggregate=spec, total_num_replicas=spec, startup_grace_seconds=600)
        chief.create_variables({n: torch.zeros(s) for n, s in SHAPES.items()}, Optimizer("sgd", lr=1.0))
        with PSClient(local.cluster, task=TaskSpec("worker", SYNC_WORKERS), connect_timeout=30) as left:
            left.join()
            left.leave()
        assert chief.status(0).quorum == SYNC_WORKERS
        with _sync_workers(local.cluster) as (stop_at, counts, errors, _):
            _pushes_go_on(counts, 3, errors)
            grown = chief.resize([*local.cluster.ps, local.add_ps()])
            assert grown.shards_after == 3
            assert chief.status(2).quorum == SYNC_WORKERS, "the added shard expects the job's 4, not the spec's 5"
            _pushes_go_on(counts, 3, errors)
            stop_at.value = chief.status(0).step + 3
        steps = stop_at.value
        assert list(counts[:]) == [steps] * SYNC_WORKERS
        assert [chief.status(s).stale_dropped for s in range(3)] == [0, 0, 0]
        for name, value in chief.pull(SHAPES).items():
            assert torch.equal(value, torch.full(SHAPES[name], -float(steps))), (name, value[:3], steps)


def test_a_sync_step_that_cannot_complete_ends_the_resize_and_its_hold(local_cluster):
    """A sync step short of its quorum (worker:1 joined, never pushes, its lease long) keeps the job from
    being quiet: the resize gives up after quiet_seconds with nothing moved and rolls back (its hold ends, the
    job keeps its two shards, ps 0 records it aborted), so the step completes as soon as worker:1 pushes."""
    local = local_cluster(2)
    with PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief, \
            PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=30, partitioner=None) as first, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=30, partitioner=None) as second:
        chief.configure("sync", replicas_to_aggregate=2, total_num_replicas=2, lease_seconds=120)
        chief.create_variables({n: torch.zeros(s) for n, s in NAMES.items()}, Optimizer("sgd", lr=1.0))
        for worker in (first, second):
            worker.declare({n: torch.zeros(s) for n, s in NAMES.items()})
            worker.join()
        ones = {n: torch.ones(s) for n, s in NAMES.items()}
        pushed = {}
        waiting = threading.Thread(target=lambda: pushed.update(step=first.push(ones)))
        waiting.start()
        wait_until(lambda: chief.status(0).waiting_calls == 1, 30, "worker:0's push held for worker:1's")
        failed = {}
        resizing = threading.Thread(target=lambda: failed.update(
            error=pytest.raises(WaitTimeoutError, chief.resize, [*local.cluster.ps, local.add_ps()],
                                quiet_seconds=3.0)))
        resizing.start()
        # Under the hold the layout names the job's two shards only: should the driver die before its moves,
        # no added shard that has not taken the job's step is in the layout clients follow.
        wait_until(lambda: _hold_of(chief) > 0, 30, "the resize's hold")
        assert len(chief.call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t)).addresses) == 2
        resizing.join(timeout=60)
        assert failed["error"].match("did not apply every step before 1.*rolled back")
        layouts = [chief.call(s, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t))
                   for s in range(2)]
        assert [(layout.hold_from_step, list(layout.addresses)) for layout in layouts] == \
            [(0, list(local.cluster.ps))] * 2  # the hold ended; the job's shards are the two it had
        assert chief.resize_state().phase == ps_pb2.ResizeState.ABORTED
        assert {info.spec.name for info in chief.list_variables()} == set(NAMES)  # nothing moved
        assert second.push(ones) == 1
        waiting.join(timeout=30)
        assert pushed == {"step": 1} and [chief.status(s).step for s in range(2)] == [1, 1]


def _hold_of(client: PSClient) -> int:
    return client.call(0, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t)).hold_from_step


def test_resize_refusals_change_nothing(local_cluster):
    """A reordered shard list, a hold outside sync mode and a sync export without a hold are refused; the
    layout stays at epoch 0."""
    local = local_cluster(2)
    with PSClient(local.cluster, connect_timeout=30) as chief:
        chief.create_variables({"refuse/w": torch.zeros(8)}, Optimizer("sgd", lr=1.0))
        with pytest.raises(ClusterConfigError, match="keeps the shards' order"):
            chief.resize([local.address(1), local.address(0)])
        same = chief.resize(list(local.cluster.ps))  # the same shards: a rebalance, with nothing to move here
        assert (same.epoch, same.moved) == (0, 0)
        owner = next(s for s in range(2) if chief.status(s).num_variables)
        held = ps_pb2.Layout(epoch=1, addresses=list(local.cluster.ps), placement={"refuse/w": owner},
                             hold_from_step=1)
        with pytest.raises(InvalidArgumentError, match="for sync jobs"):
            chief.call(owner, lambda stub, t: stub.SetLayout(held, timeout=t))
        chief.configure("sync", replicas_to_aggregate=1, total_num_replicas=1)
        plain = ps_pb2.Layout(epoch=1, addresses=list(local.cluster.ps), placement={"refuse/w": 1 - owner})
        assert chief.call(owner, lambda stub, t: stub.SetLayout(plain, timeout=t)).hold_from_step == 0
        move = ps_pb2.MoveRequest(names=["refuse/w"], epoch=1, to=1 - owner)
        with pytest.raises(ModeConflictError, match="waits for a hold"):
            chief.call(owner, lambda stub, t: list(stub.ExportVariables(move, timeout=t)))
        assert [chief.status(s).layout_epoch for s in range(2)] == [int(s == owner) for s in range(2)]
        assert {i.spec.name for i in chief.list_variables()} == {"refuse/w"}


NAMES = {f"kept/v{i}": (1000,) for i in range(6)}


def _values(cluster, **kwargs) -> tuple[dict[str, torch.Tensor], int]:
    """A fresh client's pull of NAMES (it starts at layout epoch 0 and follows), and the epoch it followed."""
    with PSClient(cluster, connect_timeout=30, partitioner=None, **kwargs) as reader:
        reader.declare({n: torch.zeros(s) for n, s in NAMES.items()})
        return reader.pull(NAMES), reader.layout_epoch


def test_a_resized_job_recovers_from_its_journal_and_restores_onto_any_count(tmp_path):
    """Shards that exported and imported variables, killed, come back from their journals at the same layout
    epoch holding the same variables; a checkpoint taken after the resize restores onto 2 or 3 shards."""
    checkpoints = tmp_path / "checkpoints"
    with LocalCluster(2, server_args=["--checkpoint-dir", str(checkpoints)]) as local:
        with PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief:
            chief.create_variables({n: torch.zeros(s) for n, s in NAMES.items()}, Optimizer("sgd", lr=1.0))
            ones = {n: torch.ones(s) for n, s in NAMES.items()}
            for _ in range(5):
                chief.push(ones)
            chief.save_checkpoint(0)  # of 2 shards, now: the shard added next has no part in it and starts empty
            report = chief.resize([*local.cluster.ps, local.add_ps()])
            assert (report.epoch, report.moved) == (1, 2)  # one variable from each old shard to the new one
            for _ in range(5):
                chief.push(ones)
            for index in (0, 2):  # ps 0 exported a variable, ps 2 imported two: both recover from their journals
                local.kill_ps(index)
                local.start_ps(index)
            assert [chief.status(s).layout_epoch for s in range(3)] == [1, 1, 1]
            held = [info.spec.name for info in chief.list_variables()]
            assert sorted(held) == sorted(NAMES)  # each variable on exactly one shard
            values, epoch = _values(local.cluster)
            assert epoch == 1 and all(torch.equal(v, torch.full((1000,), -10.0)) for v in values.values())
            chief.push(ones)
            chief.save_checkpoint(0)
    for count in (2, 3):
        with LocalCluster(count, server_args=["--restore-from", str(checkpoints), "--num-ps", str(count),
                                              "--checkpoint-dir", str(tmp_path / f"after-{count}")]) as restored:
            values, epoch = _values(restored.cluster)
            assert epoch == 0, "a restored job starts at the placement every client computes"
            assert all(torch.equal(v, torch.full((1000,), -11.0)) for v in values.values()), count


def test_ps_admin_resizes_a_running_job(local_cluster):
    """ps-admin layout and ps-admin resize, as the README shows them, on a running job."""
    local = local_cluster(1)
    spec = json.dumps({"ps": list(local.cluster.ps)})
    with PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief:
        chief.create_variables({f"admin/v{i}": torch.zeros(256) for i in range(4)}, Optimizer("sgd", lr=1.0))
        added = local.add_ps()
        done = subprocess.run([PS_ADMIN, "resize", "--cluster", spec, "--ps", f"{local.address(0)},{added}",
                               "--insecure"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("layout epoch 1: 1 -> 2 shards, 2 variables (2,048 bytes) moved"), done.stdout
        shown = subprocess.run([PS_ADMIN, "layout", "--cluster", spec, "--insecure"], capture_output=True, text=True,
                               timeout=60)
        assert shown.returncode == 0 and shown.stdout.splitlines()[0] == "layout epoch 1: 2 shards", shown.stderr
        assert shown.stdout.splitlines()[1:3] == [f"  ps:0 {local.address(0)}: 2 variables, 2,048 bytes",
                                                  f"  ps:1 {added}: 2 variables, 2,048 bytes"], shown.stdout
        assert shown.stdout.splitlines()[3].startswith("resize 1: 1 -> 2 shards, done; driver "), shown.stdout
        chief.push({f"admin/v{i}": torch.ones(256) for i in range(4)})  # the chief follows the new layout
        assert chief.layout_epoch == 1
        values = chief.pull([f"admin/v{i}" for i in range(4)])
        assert all(torch.equal(v, torch.full((256,), -1.0)) for v in values.values())
        wrong = subprocess.run([PS_ADMIN, "resize", "--cluster", spec], capture_output=True, text=True, timeout=60)
        assert wrong.returncode == 2 and len(wrong.stderr.splitlines()) == 1 and "--ps" in wrong.stderr


def test_a_client_behind_a_resize_sets_hyperparameters_at_the_new_owners(local_cluster):
    """set_hyperparams(names) from a client still at epoch 0 reaches every named variable after a resize moved
    some of them: a shard they left refuses (LayoutChangedError, nothing changed), the client follows."""
    local = local_cluster(2)
    shapes = {f"hp{i}": (1000 * (i + 1),) for i in range(6)}
    with PSClient(local.cluster, partitioner=None) as chief, PSClient(local.cluster, partitioner=None) as other:
        chief.create_variables({n: torch.zeros(s) for n, s in shapes.items()}, Optimizer("sgd", lr=1.0))
        other.declare({n: torch.zeros(s) for n, s in shapes.items()})
        other.wait_for_variables(shapes, timeout=30)
        assert chief.resize([*local.cluster.ps, local.add_ps()]).moved > 0
        assert other.layout_epoch == 0
        assert other.set_hyperparams(list(shapes), lr=0.5) == len(shapes)
        assert other.layout_epoch == 1
        assert other.push({n: torch.ones(s) for n, s in shapes.items()}) > 0
        assert all(torch.equal(v, torch.full_like(v, -0.5)) for v in chief.pull(list(shapes)).values())
