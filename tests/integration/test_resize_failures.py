"""A live resize that fails halfway loses nothing, on real shards: every variable ends on exactly one shard
with every acknowledged update, and the job goes on.

Each test stages one way a resize fails: a shard refuses an import (its --max-memory), the driver dies after
an export (raw calls play a driver that stops), an added shard starts with stale copies of the job's
variables, a checkpoint is taken while a variable is in transit. Leases are short (1-2 s) so the cut-off
resize and its hold end within the test.
"""

import contextlib
import json
import subprocess
import sys
import threading
import pathlib

import pytest
import torch

from helpers import free_ports, wait_until
from torchps.client import Optimizer, PSClient, TaskSpec
from torchps.cluster import Cluster
from torchps.errors import ClusterConfigError, ResizeConflictError, ResourceExhaustedError
from torchps.proto import ps_pb2

LEASE = 1.5  # seconds: the dead driver's lease on ps 0 and its hold's on every shard
PS_ADMIN = str(pathlib.Path(sys.executable).with_name("ps-admin"))


def _layout(client: PSClient, shard: int) -> ps_pb2.Layout:
    return client.call(shard, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t))


def _holders(client: PSClient, shards: int) -> dict[str, list[int]]:
    """{variable: the shards holding it} over the first `shards` shards (outboxes not included)."""
    found: dict[str, list[int]] = {}
    for shard in range(shards):
        listed = client.call(shard, lambda stub, t: stub.ListVariables(ps_pb2.ListRequest(), timeout=t))
        for info in listed.variables:
            found.setdefault(info.spec.name, []).append(shard)
    return found


class DeadDriver:
    """Raw calls of a resize driver that stops halfway (as a killed ps-admin would): it begins a resize on ps 0,
    sets epochs and exports, and then never renews anything."""

    def __init__(self, client: PSClient, before: list[str], after: list[str], lease: float = LEASE):
        self.client = client
        self.after = after
        self.lease = lease
        self.record = self._resize(ps_pb2.ResizeRequest(action=ps_pb2.ResizeRequest.BEGIN, driver="dead driver",
                                                        before=before, after=after, lease_seconds=lease))
        self.epoch = _layout(client, 0).epoch

    def _resize(self, request):
        return self.client.call(0, lambda stub, t: stub.Resize(request, timeout=t))

    def set_layout(self, placement: dict[str, int], hold: int = 0, shards=None, members=()) -> list[ps_pb2.Layout]:
        """The next epoch on `shards` (default: every shard, ps 0 last, as the resize sets it); `members`: ps
        0's workers, for a shard that joins (Layout.members)."""
        self.epoch += 1
        layout = ps_pb2.Layout(epoch=self.epoch, addresses=self.after, placement=placement, hold_from_step=hold,
                               hold_lease_seconds=self.lease, members=members)
        return [self.client.call(s, lambda stub, t: stub.SetLayout(layout, timeout=t))
                for s in (shards if shards is not None else reversed(range(len(self.after))))]

    def export(self, names: list[str], source: int, target: int) -> list[ps_pb2.MoveChunk]:
        request = ps_pb2.MoveRequest(names=names, epoch=self.epoch, to=target)
        return self.client.call(source, lambda stub, t: list(stub.ExportVariables(request, timeout=t)))


@contextlib.contextmanager
def _sync_job(local, names: dict[str, int]):
    """(chief, worker:0): sync mode, one replica (worker:0), SGD lr 1 on zeros of `names` {name: elements},
    in that order; both clients closed at the end."""
    with PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief, \
            PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=30, partitioner=None) as worker:
        chief.configure("sync", replicas_to_aggregate=1, total_num_replicas=1, lease_seconds=120)
        chief.declare([(name, 4 * n) for name, n in names.items()])
        chief.create_variables({name: torch.zeros(n) for name, n in names.items()}, Optimizer("sgd", lr=1.0))
        worker.declare({name: torch.zeros(n) for name, n in names.items()})
        worker.join()
        yield chief, worker


def test_a_sync_import_refused_by_the_added_shards_memory_limit_is_rolled_back(local_cluster):
    """Defect 1: the variable exported to a shard whose --max-memory refuses it went back to its old shard,
    with every update; the job trains on and ps 0 records the resize aborted."""
    local = local_cluster(2)
    names = {"m/big": 300_000, "m/tiny": 4, "m/mid": 100_000}  # big and mid on ps 0: big moves to ps 2
    with _sync_job(local, names) as (chief, worker):
        ones = {name: torch.ones(n) for name, n in names.items()}
        for _ in range(2):
            worker.push(ones)
        small = local.add_ps(args=["--max-memory", "1000000"])
        with pytest.raises(ResourceExhaustedError, match="rolled back"):
            chief.resize([*local.cluster.ps, small], lease_seconds=5)
        assert chief.resize_state().phase == ps_pb2.ResizeState.ABORTED
        assert _holders(chief, 3) == {"m/big": [0], "m/tiny": [1], "m/mid": [0]}
        assert [list(_layout(chief, s).outbox) for s in range(2)] == [[], []]
        for _ in range(2):
            worker.push(ones)
        for name, value in chief.pull(list(names)).items():
            assert torch.equal(value, torch.full((names[name],), -4.0)), name


def test_an_orphaned_sync_hold_ends_by_itself_and_the_cut_off_resize_is_finished_by_resume(local_cluster):
    """Defects 1 and 4: the driver died after exporting "s/b" under a hold. The hold's lease runs out and
    the held push goes on (the shard says why); resume takes the resize over, imports "s/b" from the outbox
    where it waited, and every update is there once."""
    local = local_cluster(2)
    names = {"s/a": 4, "s/filler": 4, "s/b": 4}  # round robin: a, b on ps 0
    with _sync_job(local, names) as (chief, worker):
        ones = {name: torch.ones(4) for name in names}
        assert worker.push(ones) == 1
        dead = DeadDriver(chief, list(local.cluster.ps), list(local.cluster.ps))
        current = {"s/a": 0, "s/filler": 1, "s/b": 0}
        dead.set_layout(current, 1)
        dead.set_layout(current, 1)
        wait_until(lambda: all(_layout(chief, s).quiet for s in range(2)), 30, "both shards quiet under the hold")
        dead.set_layout({**current, "s/b": 1}, 1)
        dead.export(["s/b"], 0, 1)  # ... and the driver dies
        pushed = {}
        held = threading.Thread(target=lambda: pushed.update(a=worker.push({"s/a": torch.ones(4)})))
        held.start()  # held by the hold until its lease runs out, then applied
        held.join(timeout=30)
        assert pushed == {"a": 2}
        assert "ended by itself" in local.log(0) and "ps-admin resize --resume" in local.log(0)
        with pytest.raises(ResizeConflictError, match="cut off"):
            chief.resize(list(local.cluster.ps))
        report = chief.resume_resize(lease_seconds=5)
        assert report.resize_id == 1 and chief.resize_state().phase == ps_pb2.ResizeState.DONE
        assert _holders(chief, 2)["s/b"] == [1] and list(_layout(chief, 0).outbox) == []
        assert worker.push(ones) == 3
        values = chief.pull(list(names))
        assert [values[n][0].item() for n in names] == [-3.0, -2.0, -2.0]


def test_a_cut_off_async_resize_is_rolled_back_by_abort_and_a_checkpoint_meanwhile_holds_the_variable(
        local_cluster, tmp_path):
    """Defects 1 and 3: "r/b" was exported and its import never came. A checkpoint taken then holds it (from
    the outbox) and restores it onto 2 or 3 shards; abort puts it back on ps 0 with its updates."""
    ckpt = tmp_path / "ckpt"
    local = local_cluster(2, server_args=["--checkpoint-dir", str(ckpt)])
    names = ("r/a", "r/filler", "r/b")
    with PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief:
        chief.declare([(n, 8) for n in names])
        chief.create_variables({n: torch.zeros(2) for n in names}, Optimizer("sgd", lr=1.0))
        for _ in range(3):
            chief.push({n: torch.ones(2) for n in names})
        dead = DeadDriver(chief, list(local.cluster.ps), list(local.cluster.ps))
        dead.set_layout({"r/a": 0, "r/filler": 1, "r/b": 1})
        dead.export(["r/b"], 0, 1)
        step = chief.save_checkpoint(0, timeout=60)
        wait_until(lambda: chief.resize_state().lease_left_seconds == 0, 30, "the dead driver's lease to run out")
        spec = json.dumps({"ps": list(local.cluster.ps)})
        aborted = subprocess.run([PS_ADMIN, "resize", "--cluster", spec, "--abort", "--insecure"], capture_output=True,
                                 text=True, timeout=120)
        assert aborted.returncode == 0, aborted.stderr
        assert aborted.stdout.startswith("resize 1 rolled back at layout epoch 3: 2 shards, 1 variables"), \
            aborted.stdout
        assert _holders(chief, 2) == {"r/a": [0], "r/filler": [1], "r/b": [0]}
        chief.push({n: torch.ones(2) for n in names})
        assert [v[0].item() for v in chief.pull(list(names)).values()] == [-4.0] * 3
    for count in (2, 3):
        with PSClient((restored := local_cluster(count, server_args=[
                "--restore-from", str(ckpt), "--num-ps", str(count), "--no-journal"])).cluster,
                connect_timeout=30, partitioner=None) as client:
            client.declare([(n, 8) for n in names])
            values = client.pull(list(names))
            assert [v[0].item() for v in values.values()] == [-3.0] * 3, (count, step)
            assert sum(len(v) for v in _holders(client, count).values()) == 3
        restored.stop()


def test_an_added_shard_with_the_jobs_checkpoint_dir_starts_empty_and_stale_copies_are_refused(
        local_cluster, tmp_path):
    """Defect 2 (and 9): started with the job's --checkpoint-dir and a 3-shard spec, the added shard starts
    empty (it would have re-laid the old checkpoint out); one given stale copies (--restore-from) is refused
    in one line; one without a checkpoint folder too. After the resize every update is there, checkpoints
    take the new shard, and an old shard restarted with the new count takes its journal back."""
    ckpt = tmp_path / "ckpt"
    args = ["--checkpoint-dir", str(ckpt), "--num-ps", "2"]
    local = local_cluster(2, server_args=args)
    names = [f"j/v{i}" for i in range(4)]
    with PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief:
        chief.declare([(n, 4000) for n in names])
        chief.create_variables({n: torch.zeros(1000) for n in names}, Optimizer("sgd", lr=1.0))
        chief.push({n: torch.ones(1000) for n in names})
        chief.save_checkpoint(0, timeout=60)
        for _ in range(4):  # updates after the checkpoint
            chief.push({n: torch.ones(1000) for n in names})
        stale = local.add_ps(args=["--checkpoint-dir", str(tmp_path / "other"), "--restore-from", str(ckpt),
                                   "--num-ps", "3", "--no-journal"])
        with pytest.raises(ResizeConflictError, match=r"held by ps \d and by ps 2|ps 2, which the resize adds"):
            chief.resize([*local.cluster.ps, stale])
        local.kill_ps(2)
        bare = local.add_ps(2, args=[])
        with pytest.raises(ClusterConfigError, match="without --checkpoint-dir"):
            chief.resize([*local.cluster.ps, bare])
        local.kill_ps(2)
        added = local.add_ps(2, args=["--checkpoint-dir", str(ckpt), "--num-ps", "3"])
        assert "starts empty" in local.log(2)
        report = chief.resize([*local.cluster.ps, added])
        assert report.moved > 0
        assert [v[0].item() for v in chief.pull(names).values()] == [-5.0] * 4
        saved = chief.save_checkpoint(0, timeout=60)
        manifest = json.loads((ckpt / f"step-{saved:012d}" / "manifest.json").read_text())
        assert [s["index"] for s in manifest["shards"]] == [0, 1, 2]
        local.kill_ps(1)
        local.start_ps(1, args=["--checkpoint-dir", str(ckpt), "--num-ps", "3"])  # the job's spec now
        assert [v[0].item() for v in chief.pull(names).values()] == [-5.0] * 4


def test_ps_admin_takes_the_current_shards_from_ps_0_not_from_the_cluster_it_is_given(local_cluster):
    """Defect 10: given the job's spec extended by two addresses, ps-admin resizes from ps 0's 2 shards, and
    refuses at once a shard that is not running."""
    ports = free_ports(4)
    spec = Cluster(ps=tuple(f"127.0.0.1:{p}" for p in ports[:2]))
    local = local_cluster(2, ports=ports[:2], server_args=["--cluster", json.dumps({"ps": list(spec.ps)})])
    third = local.add_ps(2, args=["--join"], port=ports[2])
    extended = json.dumps({"ps": [f"127.0.0.1:{p}" for p in ports]})
    with PSClient(spec, connect_timeout=30, partitioner=None) as chief:
        chief.create_variables({f"x/{i}": torch.zeros(100) for i in range(4)}, Optimizer("sgd", lr=1.0))
    missing = subprocess.run([PS_ADMIN, "resize", "--cluster", extended, "--insecure", "--connect-timeout", "2",
                              "--ps", ",".join(f"127.0.0.1:{p}" for p in ports)], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "ps 3 at 127.0.0.1:" in missing.stderr, missing.stderr
    done = subprocess.run([PS_ADMIN, "resize", "--cluster", extended, "--insecure", "--ps",
                           ",".join([*spec.ps, third])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "2 -> 3 shards" in done.stdout, done.stderr
    with PSClient(Cluster.from_json(extended), connect_timeout=30, partitioner=None) as chief:  # every move
        # confirmed: nothing kept
        assert [list(_layout(chief, s).outbox) for s in range(3)] == [[], [], []]
    shown = subprocess.run([PS_ADMIN, "layout", "--cluster", extended, "--insecure"], capture_output=True, text=True,
                           timeout=120)
    assert "resize 1: 2 -> 3 shards, done" in shown.stdout, shown.stderr


def test_a_driver_that_died_between_shards_and_before_its_exports_is_resumed_and_pulls_follow_meanwhile(
        local_cluster):
    """The dead driver set epoch 1 on ps 2 and ps 1 but not on ps 0 (SetLayout goes to the others first), and
    placed "c" on ps 2 without exporting it: resume numbers its epochs past the highest any shard knows,
    and trusts the placement ahead of its move (only two copies are refused). Then a client still placing by
    epoch 0 pulls only what moved: its old shard refuses the part, and it is not sent there again empty
    (which would mean every variable there)."""
    local = local_cluster(2)
    names = ["a", "b", "c", "d"]  # round robin: a, c on ps 0
    with PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief, \
            PSClient(local.cluster, connect_timeout=30, partitioner=None) as worker:
        chief.create_variables({n: torch.zeros(4) for n in names}, Optimizer("sgd", lr=1.0))
        chief.push({n: torch.ones(4) for n in names})
        worker.declare({n: torch.zeros(4) for n in names})
        third = local.add_ps(args=["--join"])
        dead = DeadDriver(chief, list(local.cluster.ps), [*local.cluster.ps, third])
        layout = ps_pb2.Layout(epoch=1, addresses=dead.after, placement={"a": 0, "b": 1, "c": 2, "d": 1})
        with PSClient(Cluster(ps=tuple(dead.after)), connect_timeout=30, partitioner=None) as raw:
            for shard in (2, 1):  # ... and it dies before ps 0's
                raw.call(shard, lambda stub, t: stub.SetLayout(layout, timeout=t))
            assert [_layout(raw, s).epoch for s in range(3)] == [0, 1, 1]
        wait_until(lambda: chief.resize_state().lease_left_seconds == 0, 30, "the dead driver's lease to run out")
        report = chief.resume_resize(lease_seconds=5)
        assert report.epoch >= 2 and chief.resize_state().phase == ps_pb2.ResizeState.DONE
        assert len({_layout(chief, s).epoch for s in range(3)}) == 1
        holders = _holders(chief, 3)
        assert sorted(holders) == names and all(len(shards) == 1 for shards in holders.values()), holders
        moved = {n: torch.zeros(4) for n, shards in holders.items() if shards == [2]}
        assert moved and worker.layout_epoch == 0
        worker.pull_into(moved)
        assert all(torch.equal(value, -torch.ones(4)) for value in moved.values())
        worker.push({n: torch.ones(4) for n in names})
        assert [v[0].item() for v in chief.pull(names).values()] == [-2.0] * 4


def test_a_sync_hold_ended_by_its_lease_on_shards_of_different_epochs_lets_pushes_follow_the_latest(local_cluster):
    """The dead driver set the hold's second epoch on ps 1 only (it died before ps 0's), so the hold ends by
    itself at epoch 1 on ps 0 and at epoch 2 on ps 1, each refusing pushes placed by an earlier epoch than
    its own: a client whose ps 0 knows only epoch 1 follows ps 1's layout, and the push is taken."""
    local = local_cluster(2)
    names = {"e/a": 4, "e/f": 4}  # a on ps 0, f on ps 1
    with _sync_job(local, names) as (chief, worker):
        ones = {name: torch.ones(4) for name in names}
        assert worker.push(ones) == 1
        dead = DeadDriver(chief, list(local.cluster.ps), list(local.cluster.ps))
        current = {"e/a": 0, "e/f": 1}
        hold = max(layout.hold_from_step for layout in dead.set_layout(current, 1))
        dead.set_layout(current, hold, shards=[1])  # ... and it dies before ps 0's
        wait_until(lambda: "ended by itself" in local.log(0) and "ended by itself" in local.log(1), 30,
                   "both holds to end by their lease")
        assert [_layout(chief, s).epoch for s in range(2)] == [1, 2]
        assert worker.push(ones) == 2
        assert worker.layout_epoch == 2
        chief.resume_resize(lease_seconds=5)
        assert worker.push(ones) == 3
        assert [v[0].item() for v in chief.pull(list(names)).values()] == [-3.0, -3.0]


def test_a_sync_push_held_through_a_grow_reaches_the_added_shard_too(local_cluster):
    """Sent by the two-shard layout before a grow, worker:0's push of the hold's step touches no variable
    that moves: held, then refused by the epoch that ended the hold, it is placed anew and must reach every
    shard of the new layout, the added one too (which took the hold's step as its own and waits for every
    worker's push of it). The epochs are set by hand as a driver sets them (hold, move "d", end)."""
    local = local_cluster(2)
    names = {"a": 4, "b": 4, "c": 4, "d": 4}  # a, c on ps 0; b, d on ps 1; d moves to ps 2
    with PSClient(local.cluster, connect_timeout=30, partitioner=None) as chief, \
            PSClient(local.cluster, task=TaskSpec("worker", 0), connect_timeout=30, partitioner=None) as w0, \
            PSClient(local.cluster, task=TaskSpec("worker", 1), connect_timeout=30, partitioner=None) as w1:
        chief.configure("sync", replicas_to_aggregate=2, total_num_replicas=2, lease_seconds=120)
        chief.create_variables({n: torch.zeros(k) for n, k in names.items()}, Optimizer("sgd", lr=1.0))
        for w in (w0, w1):
            w.declare({n: torch.zeros(k) for n, k in names.items()})
            w.join()

        def both(grads: dict) -> dict:
            pushed, threads = {}, [threading.Thread(target=lambda w=w: pushed.update({w: w.push(grads[w])}))
                                   for w in grads]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            return pushed

        ones = {n: torch.ones(k) for n, k in names.items()}
        for _ in range(3):
            both({w0: ones, w1: ones})
        after = [*local.cluster.ps, local.add_ps()]
        with PSClient(Cluster(ps=tuple(after)), connect_timeout=30, partitioner=None) as raw:
            driver = DeadDriver(raw, list(local.cluster.ps), after, lease=60)
            raw.call(2, lambda stub, t: stub.Configure(chief.status(0).config, timeout=t))
            placement = dict(_layout(raw, 0).placement)  # epoch 0: none
            hold = max(layout.hold_from_step for layout in driver.set_layout(placement, 1))
            driver.set_layout(placement, hold, members=_layout(raw, 0).members)  # ps 2 takes ps 0's workers
            mine = {w0: {"a": ones["a"]}, w1: {"a": ones["a"], "d": ones["d"]}}  # w0's moves nothing
            held = threading.Thread(target=both, args=(mine,))
            held.start()  # both clients still place by the two-shard layout
            wait_until(lambda: chief.status(0).waiting_calls == 2, 30, "both pushes held")
            moved = {**placement, "d": 2}
            driver.set_layout(moved, hold)
            chunks = driver.export(["d"], 1, 2)
            raw.call(2, lambda stub, t: stub.ImportVariables(iter(chunks), timeout=t))
            raw.call(1, lambda stub, t: stub.ConfirmMove(ps_pb2.MoveRequest(names=["d"], to=2), timeout=t))
            driver.set_layout(moved, 0)  # the hold ends
            held.join(timeout=60)
            assert both(mine) == {w0: 5, w1: 5}
            wait_until(lambda: [raw.status(s).step for s in range(3)] == [5, 5, 5], 30, "every shard at step 5")
