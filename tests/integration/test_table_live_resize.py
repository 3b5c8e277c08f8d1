"""A job with embedding tables resized live (2 -> 3 -> 2 shards) against real ps-server processes: every table
is re-laid out onto the new count (each row, its optimizer state and a dynamic table's metadata move to the
shard the id partition names), a worker still placing rows by the old count has its lookups and pushes refused
and sent again to the rows' owners, and the job trains on exactly as one that was never resized (bit for bit,
step by step: values, optimizer state, ages and evictions, admissions). Ordered by replies and layout epochs."""

from __future__ import annotations

import concurrent.futures
import pathlib
import sys
import threading

import torch

from torchps.client import Optimizer, PSClient, TaskSpec
from torchps.proto import ps_pb2
from torchps.worker.local_cluster import LocalCluster

from helpers import wait_until

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from table_job import assert_equal, everything, setup, step  # noqa: E402

TIMEOUT = 120
DRAIN_SECONDS = 10.0  # the removed shard answers LayoutChangedError this long: the worker calls it meanwhile


def test_tables_move_live_and_the_job_trains_on_as_if_never_resized():
    with LocalCluster(2) as plain, LocalCluster(2) as local, PSClient(plain.cluster) as reference, \
            PSClient(local.cluster) as chief, PSClient(local.cluster) as probe, \
            PSClient(local.cluster, task=TaskSpec("worker", 0)) as worker:
        setup(reference)
        setup(chief)
        worker.declare({"w": torch.zeros(3)})
        worker.wait_for_variables({"w": (3,)}, timeout=30)
        worker.wait_for_tables(["fix", "dyn"], timeout=30)

        def train(steps: range) -> None:
            for k in steps:
                assert_equal(step(worker, k), step(reference, k), f"the rows step {k} looked up")

        train(range(1, 5))
        grow = chief.resize([*local.cluster.ps, local.add_ps()])
        assert grow.shards_after == 3 and worker.layout_epoch == 0
        train(range(5, 8))  # the worker's first lookup and push placed rows by 2 shards: refused, sent again
        assert worker.layout_epoch == grow.epoch
        refused = worker.layout_waits[0]
        assert refused > 0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            shrinking = pool.submit(chief.resize, list(local.cluster.ps), drain_seconds=DRAIN_SECONDS)
            wait_until(lambda: len(probe.shard_addresses()) == 2 or shrinking.done(), TIMEOUT, "the shrink's layout")
            assert not shrinking.done(), "the removed shard stopped before the worker called it"
            train(range(8, 10))  # placed by 3 shards: ps 2 (draining) and the others refuse, the worker follows
            shrink = shrinking.result(timeout=TIMEOUT)
        assert (shrink.shards_after, shrink.stopped) == (2, [local.address(2)])
        assert worker.layout_epoch == shrink.epoch and worker.layout_waits[0] > refused
        train(range(10, 12))
        assert_equal(everything(worker), everything(reference), "every row and variable")

        def rows_held(client: PSClient) -> list[dict[str, int]]:
            return [{t.name: t.rows for t in client.status(s).tables} for s in range(2)]

        resized, plain_rows = rows_held(chief), rows_held(reference)
        assert all(all(n > 0 for n in shard.values()) for shard in resized), resized  # rows on both shards
        assert {t: sum(shard[t] for shard in resized) for t in ("fix", "dyn")} == \
            {t: sum(shard[t] for shard in plain_rows) for t in ("fix", "dyn")}  # each row once


ROWS, DIM, PUSHERS = 300, 2, 3


def _resize_under_pushes(local, chief: PSClient, threads: list[threading.Thread], counts: list[int],
                         errors: list[str]) -> None:
    """Starts `threads` (each counting its acknowledged pushes in `counts`), then resizes the job 2 -> 3 -> 2
    shards, each resize after every thread acknowledged 3 more pushes, and waits for 3 more after the last."""
    def go_on(more: int) -> None:
        target = [c + more for c in counts]
        wait_until(lambda: errors or all(c >= t for c, t in zip(counts, target)), TIMEOUT,
                   f"every pusher to acknowledge {more} more pushes ({counts})")
        assert not errors, errors

    for thread in threads:
        thread.start()
    go_on(3)
    assert chief.resize([*local.cluster.ps, local.add_ps()]).shards_after == 3
    go_on(3)
    assert chief.resize(list(local.cluster.ps)).shards_after == 2
    go_on(3)


def _push_rows(cluster, index: int, stop: threading.Event, counts: list[int], errors: list[str]) -> None:
    """Pushes a gradient of ones for every row of table "ones" and for variable "v", every other push a
    push_pull, until `stop`; counts each acknowledged push."""
    try:
        with PSClient(cluster, task=TaskSpec("worker", index)) as ps:
            ps.declare({"v": torch.zeros(4)})
            ps.wait_for_variables({"v": (4,)}, timeout=60)
            ps.wait_for_tables(["ones"], timeout=60)
            ids, target = torch.arange(ROWS), {"v": torch.zeros(4)}
            while not stop.is_set():
                rows = {"ones": (ids, torch.ones(ROWS, DIM))}
                if counts[index] % 2:
                    ps.push_pull({"v": torch.ones(4)}, target, rows=rows)
                else:
                    ps.push({"v": torch.ones(4)}, rows=rows)
                counts[index] += 1
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        errors.append(f"pusher {index}: {type(exc).__name__}: {exc}")


def test_row_gradients_in_flight_across_live_resizes_are_applied_exactly_once():
    """3 pushers push ones into every row of a table while the job goes 2 -> 3 -> 2 shards: every row ends at
    exactly its initial value minus the acknowledged pushes (SGD, lr 1), as the dense variable does."""
    spec = ps_pb2.TableSpec(name="ones", dim=DIM, num_embeddings=ROWS, dtype=ps_pb2.FLOAT32,
                            init=ps_pb2.TableInit(distribution="uniform", scale=1.0, seed=5),
                            optimizer=Optimizer("sgd", lr=1.0).to_proto())
    with LocalCluster(2) as local, PSClient(local.cluster) as chief:
        chief.create_variables({"v": torch.zeros(4)}, Optimizer("sgd", lr=1.0))
        chief.create_tables([spec])
        start = chief.lookup_rows({"ones": torch.arange(ROWS)})["ones"]
        stop, counts, errors = threading.Event(), [0] * PUSHERS, []

        pushers = [threading.Thread(target=_push_rows, args=(local.cluster, i, stop, counts, errors))
                   for i in range(PUSHERS)]
        try:
            _resize_under_pushes(local, chief, pushers, counts, errors)
        finally:
            stop.set()
            for pusher in pushers:
                pusher.join(timeout=TIMEOUT)
        assert not errors, errors
        total = sum(counts)
        torch.testing.assert_close(chief.lookup_rows({"ones": torch.arange(ROWS)})["ones"], start - total,
                                   rtol=0, atol=1e-4 * total)
        assert torch.equal(chief.pull(["v"])["v"], torch.full((4,), -float(total)))


def test_shards_that_re_laid_out_their_tables_recover_from_their_journals_and_the_checkpoint_restores(tmp_path):
    """After a live re-layout onto 3 shards, ps 0 (exported and built its tables) and ps 2 (built them from
    the others' rows) are killed and come back from their journals with the same rows; a checkpoint taken
    after it restores onto 2 and onto 3 shards; all as the job that was never resized holds them."""
    checkpoints = tmp_path / "checkpoints"
    with LocalCluster(2) as plain, PSClient(plain.cluster) as reference, \
            LocalCluster(2, server_args=["--checkpoint-dir", str(checkpoints)]) as local, \
            PSClient(local.cluster, connect_timeout=30) as chief:
        setup(reference)
        setup(chief)
        for k in range(1, 4):
            assert_equal(step(chief, k), step(reference, k), f"step {k}")
        chief.save_checkpoint(0)  # of 2 shards, now: the shard added next has no part in it
        assert chief.resize([*local.cluster.ps, local.add_ps()]).shards_after == 3
        for k in range(4, 6):
            assert_equal(step(chief, k), step(reference, k), f"step {k}")
        for index in (0, 2):
            local.kill_ps(index)
            local.start_ps(index)
        assert_equal(everything(chief), everything(reference), "after the restarts")
        assert_equal(step(chief, 6), step(reference, 6), "step 6")
        chief.save_checkpoint(0)
        expected = everything(reference)
    for count in (2, 3):
        with LocalCluster(count, server_args=["--restore-from", str(checkpoints), "--num-ps", str(count)]) as back, \
                PSClient(back.cluster, connect_timeout=30) as restored:
            restored.declare({"w": torch.zeros(3)})
            restored.wait_for_tables(["fix", "dyn"], timeout=30)
            assert_equal(everything(restored), expected, f"restored onto {count} shards")


def test_a_sync_job_with_tables_resizes_at_a_step_boundary():
    """A sync job (R = N = 1) with tables goes 2 -> 3 -> 2 shards between its steps: the hold, the tables'
    re-layout and the variables' moves happen at one step boundary, and it trains on as the job never resized."""
    with LocalCluster(2) as plain, PSClient(plain.cluster, task=TaskSpec("worker", 0)) as reference, \
            LocalCluster(2) as local, PSClient(local.cluster, task=TaskSpec("worker", 0)) as chief:
        for client in (reference, chief):
            setup(client)
            client.configure("sync", total_num_replicas=1)
            client.join()
        for k in range(1, 4):
            assert_equal(step(chief, k), step(reference, k), f"step {k}")
        assert chief.resize([*local.cluster.ps, local.add_ps()]).shards_after == 3
        for k in range(4, 6):
            assert_equal(step(chief, k), step(reference, k), f"step {k}")
        assert chief.resize(list(local.cluster.ps)).shards_after == 2
        for k in range(6, 8):
            assert_equal(step(chief, k), step(reference, k), f"step {k}")
        assert_equal(everything(chief), everything(reference), "every row and variable")
        assert [chief.status(s).step for s in range(2)] == [7, 7]


def _sync_rows(cluster, index: int, stop_at: list[int], counts: list[int], errors: list[str]) -> None:
    """worker:<index> of a sync job (R = N = 2): pushes ones to every row of "ones" and to "v" each step until
    its next step reaches stop_at[0] (0: go on), then leaves."""
    try:
        with PSClient(cluster, task=TaskSpec("worker", index)) as ps:
            ps.declare({"v": torch.zeros(4)})
            ps.wait_for_variables({"v": (4,)}, timeout=60)
            ps.wait_for_tables(["ones"], timeout=60)
            step_ = ps.join()
            while not stop_at[0] or step_ < stop_at[0]:
                step_ = ps.push({"v": torch.ones(4)}, rows={"ones": (torch.arange(ROWS), torch.ones(ROWS, DIM))})
                counts[index] += 1
            ps.leave()
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        errors.append(f"worker {index}: {type(exc).__name__}: {exc}")


def test_a_sync_job_pushing_rows_resizes_live_and_every_step_averages_every_worker():
    """2 sync workers (R = N = 2) push ones into every row while the job goes 2 -> 3 -> 2 shards: every step
    averages both workers' rows once on every shard, none dropped as stale (a shard holding table rows but no
    variable completes the steps before the hold as the others do), so every row ends at exactly its start
    minus the steps."""
    spec = ps_pb2.TableSpec(name="ones", dim=DIM, num_embeddings=ROWS, dtype=ps_pb2.FLOAT32,
                            init=ps_pb2.TableInit(distribution="uniform", scale=1.0, seed=5),
                            optimizer=Optimizer("sgd", lr=1.0).to_proto())
    with LocalCluster(2) as local, PSClient(local.cluster) as chief:
        chief.configure("sync", replicas_to_aggregate=2, total_num_replicas=2)
        chief.create_variables({"v": torch.zeros(4)}, Optimizer("sgd", lr=1.0))  # on ps 0: ps 1 holds rows only
        chief.create_tables([spec])
        start = chief.lookup_rows({"ones": torch.arange(ROWS)})["ones"]
        stop_at, counts, errors = [0], [0, 0], []

        workers = [threading.Thread(target=_sync_rows, args=(local.cluster, i, stop_at, counts, errors))
                   for i in range(2)]
        try:
            _resize_under_pushes(local, chief, workers, counts, errors)
            stop_at[0] = chief.status(0).step + 3
        finally:
            stop_at[0] = stop_at[0] or 1
            for worker in workers:
                worker.join(timeout=TIMEOUT)
        assert not errors, errors
        steps = stop_at[0]
        assert counts == [steps, steps]
        assert [(chief.status(s).step, chief.status(s).stale_dropped) for s in range(2)] == [(steps, 0)] * 2
        expected = start.clone()
        for _ in range(steps):
            expected -= 1.0
        assert torch.equal(chief.lookup_rows({"ones": torch.arange(ROWS)})["ones"], expected)
        assert torch.equal(chief.pull(["v"])["v"], torch.full((4,), -float(steps)))
