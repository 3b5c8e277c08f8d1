"""A tests-only `--entry` for ps-worker whose loss raises in one chosen task after some steps.

    TORCHPS_TEST_FAIL_TASK=worker:1 TORCHPS_TEST_FAIL_AFTER=5 PYTHONPATH=tests/integration \
        ps-launch --entry failing_entry:task ...

ps-launch gives every process the same environment, so the task tells itself
apart by the --task-type/--index that ps-launch puts on its command line (or
by TF_CONFIG's task when started that way). The model and data are ps-worker's
built-in MLP on mnist5k; the loss of the chosen task raises FAILURE_MESSAGE on
its call number TORCHPS_TEST_FAIL_AFTER + 1, so that task has pushed exactly
TORCHPS_TEST_FAIL_AFTER gradients before it dies. With TORCHPS_TEST_FAIL_AT_START
set, the chosen task fails before it creates or waits for anything; with
TORCHPS_TEST_FAIL_ONCE=FILE too, only the first time (the file marks it done).
With TORCHPS_TEST_HOLD_UNTIL=FILE, every other task's loss call number
TORCHPS_TEST_FAIL_AFTER + 1 waits until FILE exists (the test makes it once it
saw the failure handled), so the others cannot end the job first.
"""

from __future__ import annotations

import json
import os
import sys
import time

from torch import nn

from torchps.worker.models import build_model

FAILURE_MESSAGE = "injected failure for the test"
HOLD_TIMEOUT_SECONDS = 120.0


def this_task() -> str:
    argv = sys.argv
    if "--task-type" in argv:
        kind = argv[argv.index("--task-type") + 1]
        index = argv[argv.index("--index") + 1] if "--index" in argv else "0"
        return f"{kind}:{index}"
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    return f"{task.get('type')}:{task.get('index', 0)}"


def task():
    if this_task() == os.environ.get("TORCHPS_TEST_FAIL_TASK") and os.environ.get("TORCHPS_TEST_FAIL_AT_START"):
        once = os.environ.get("TORCHPS_TEST_FAIL_ONCE")
        if not once or not os.path.exists(once):
            if once:
                open(once, "w").close()
            raise RuntimeError(f"{FAILURE_MESSAGE} ({this_task()} at start)")
    job = build_model("mlp", "mnist5k", 100)
    fail_after = int(os.environ.get("TORCHPS_TEST_FAIL_AFTER", "5"))
    failing = this_task() == os.environ.get("TORCHPS_TEST_FAIL_TASK")
    hold = None if failing else os.environ.get("TORCHPS_TEST_HOLD_UNTIL")
    if not failing and not hold:
        return job.model, job.dataset, nn.functional.cross_entropy
    calls = 0

    def loss(logits, labels):
        nonlocal calls
        calls += 1
        if failing and calls > fail_after:
            raise RuntimeError(f"{FAILURE_MESSAGE} ({this_task()} after {fail_after} steps)")
        if hold and calls == fail_after + 1:
            _wait_for(hold)
        return nn.functional.cross_entropy(logits, labels)

    return job.model, job.dataset, loss


def _wait_for(path: str) -> None:
    """Until the file at `path` exists; RuntimeError after HOLD_TIMEOUT_SECONDS."""
    deadline = time.monotonic() + HOLD_TIMEOUT_SECONDS
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{this_task()}: {path} did not appear in {HOLD_TIMEOUT_SECONDS:g} s")
        time.sleep(0.01)
