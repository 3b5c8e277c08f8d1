"""The chief's end-of-job account (worker/account.py): the plan against what ps 0 counted. No sockets."""

from torchps.worker.account import TaskAccount, _queue_account, _task_account, planned_batches


def task(name: str, planned, pushed: int, state: str = "left", last: int = -1, restarts: int = 0) -> TaskAccount:
    return TaskAccount(name, planned, pushed, state, last, restarts)


def test_the_plan_is_each_slices_batches_per_epoch():
    assert [planned_batches(4000, 2, r, 100, 10, 1) for r in (0, 1)] == [200, 200]
    assert [planned_batches(1001, 2, r, 100, 1, 1) for r in (0, 1)] == [6, 5]  # 501 and 500 examples
    assert planned_batches(4000, 2, 0, 100, 1, 2) == 10  # --nproc-per-host 2: local rank 0's 1000 examples


def test_a_task_short_of_its_plan_makes_the_job_partial_and_is_named():
    account = _task_account([task("worker:0", 200, 200), task("worker:1", 200, 31, "lost", 30, 2),
                             task("worker:2", 200, 0, "never joined")], None, False, 231)
    assert account.partial and (account.planned, account.trained) == (600, 231)
    assert account.line == ("trained 231 of 600 planned batches: worker:1 (restarted 2 times) pushed 31 of its 200 "
                            "batches, the last at step 30; then its lease ran out and it did not come back; "
                            "worker:2 never joined: its 200 batches were not trained")
    assert account.summary() == {"partial": True, "data_account": account.line, "batches_planned": 600,
                                 "batches_trained": 231}


def test_steps_reached_first_or_alone_meet_the_plan():
    first = _task_account([task("worker:0", 200, 50), task("worker:1", 200, 20, "lost", 19)], 50, True, 50)
    assert not first.partial and first.line == ("trained 50 of 50 planned global steps (70 of 400 planned batches); "
                                                "worker:1 pushed 20 of its 200 batches, the last at step 19; then "
                                                "its lease ran out and it did not come back")
    alone = _task_account([task("worker:0", None, 50), task("worker:1", None, 0, "never joined")], 50, True, 50)
    assert not alone.partial and alone.planned is None
    assert alone.line == "trained 50 of 50 planned global steps (50 batches pushed); worker:1 never joined"
    whole = _task_account([task("worker:0", 20, 20), task("worker:1", 20, 20)], None, False, 20)
    assert not whole.partial and whole.line == "trained every planned batch: 40 of 40 (worker:0 20, worker:1 20)"


def test_with_dynamic_sharding_the_queue_decides():
    queue = {"data_examples_per_epoch": 4000, "data_trained": [4000, 1200], "data_epochs_done": 1}
    account = _queue_account(queue, 2, False)
    assert account.partial and account.line == ("trained 5200 of 8000 planned examples from the data queue (1 of "
                                                "2 epochs done)")
    assert account.summary()["examples_planned"] == 8000 and not _queue_account(queue, 2, True).partial
