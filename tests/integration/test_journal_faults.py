"""The journal's faults against real ps-server processes: a disk that fills, a damaged log, a volume that holds
another job's or layout's journal, and calls that must not wait on the disk while the journal's writer is stuck.

The full disk is real: the running shard gets a file-size limit (RLIMIT_FSIZE, as `prlimit --fsize` sets it;
Python ignores SIGXFSZ), so its next journal append fails with EFBIG part-way through a record.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import resource
import signal
import subprocess
import threading

import grpc
import pytest
import torch

from torchps.client import ClusterConfigError, Optimizer, PSClient
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.ps_server.__main__ import parse_args
from torchps.ps_server.daemon import open_journal
from torchps.ps_server.journal import WRITER_THREAD
from torchps.worker.local_cluster import LocalCluster

from helpers import frozen_thread, run_ps_server, thread_named, wait_until

EXIT_TIMEOUT = 60.0      # a shard noticing its failed write and exiting, on a loaded 2-core machine
START_TIMEOUT = 60.0
N = 64 * 1024            # floats per push: 256 KiB records, far below any compaction


def journal_dir(ckpt: pathlib.Path, index: int = 0) -> pathlib.Path:
    return ckpt / "journal" / f"ps-{index}"


def one_line_error(args: list[str], log: pathlib.Path) -> str:
    """ps-server --insecure `args` run to its exit: the one line its refusal is."""
    code, printed = run_ps_server(["--insecure", *args], log, START_TIMEOUT)
    assert code != 0, f"expected a refusal, got exit 0:\n{printed}"
    assert "Traceback" not in printed, printed
    lines = printed.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ps-server: error: "), printed
    return lines[0]


# -- a journal that cannot write --------------------------------------------------------------------------

def test_a_journal_that_cannot_write_stops_the_shard_unacknowledged_and_the_retry_lands_once(tmp_path):
    """3 pushes acknowledged; the shard's files may grow no further, so the 4th push's record fails part-way
    (EFBIG). The shard must stop (exit 70, one line naming the cause) without acknowledging it; restarted on
    a disk with room, it has the 3 pushes, and the client's retry of the 4th is applied exactly once. A
    second crash shows the torn record was cut, not left in the middle of the log."""
    with LocalCluster(1, server_args=["--checkpoint-dir", str(tmp_path)]) as local, \
            PSClient(local.cluster, connect_timeout=EXIT_TIMEOUT + START_TIMEOUT) as client:
        client.create_variables({"w": torch.zeros(N)}, Optimizer("sgd", lr=1.0))
        for _ in range(3):
            client.push({"w": torch.ones(N)})
        (log,) = journal_dir(tmp_path).glob("log-*.bin")
        limit = log.stat().st_size + N * 4 // 2  # the next record stops half-way
        resource.prlimit(local.procs[0].pid, resource.RLIMIT_FSIZE, (limit, limit))

        outcome: dict = {}
        pusher = threading.Thread(target=lambda: outcome.update(reply=client.push({"w": torch.ones(N)})))
        pusher.start()
        code = local.procs[0].wait(timeout=EXIT_TIMEOUT)
        assert code == 70, f"the shard stops itself with exit code 70, got {code}:\n{local.log(0)[-2000:]}"
        stops = [line for line in local.log(0).splitlines() if "stops (fail-stop" in line]
        assert len(stops) == 1 and "File too large" in stops[0] and str(log) in stops[0], local.log(0)[-2000:]
        assert pusher.is_alive(), "the push whose record failed was not acknowledged (the client retries it)"
        assert log.stat().st_size == limit, "the failed record was written part-way: a torn end"

        local.start_ps(0)  # the operator made room: no limit
        pusher.join(START_TIMEOUT)
        assert not pusher.is_alive() and "reply" in outcome, "the retry was acknowledged"
        assert torch.equal(client.pull(["w"])["w"], torch.full((N,), -4.0)), "3 pushes, then the retry once"
        assert "torn" in local.log(0), "recovery cut the torn record off the end"

        assert local.kill_ps(0) == -signal.SIGKILL
        local.start_ps(0)
        assert torch.equal(client.pull(["w"])["w"], torch.full((N,), -4.0)), "and again after another crash"


def test_a_damaged_record_before_whole_ones_is_refused_naming_the_file_and_byte(tmp_path):
    """A torn end is cut (a crash mid-write); a damaged record with whole ones after it is corruption: the
    shard refuses to start, with one line naming the log and the byte, and changes nothing. The line says what
    to do (move the journal aside: `mv`), and done, the shard starts (as one without a journal does)."""
    with LocalCluster(1, server_args=["--checkpoint-dir", str(tmp_path)]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        client.create_variables({"w": torch.zeros(N)}, Optimizer("sgd", lr=1.0))
        (log,) = journal_dir(tmp_path).glob("log-*.bin")
        first_push_at = log.stat().st_size
        for _ in range(3):
            client.push({"w": torch.ones(N)})
    data = bytearray(log.read_bytes())
    data[first_push_at + 100] ^= 0xFF  # inside the first push's record; two whole ones follow
    log.write_bytes(bytes(data))
    line = one_line_error(["--index", "0", "--bind", "127.0.0.1:0", "--checkpoint-dir", str(tmp_path)],
                          tmp_path / "refused.log")
    assert str(log) in line and f"byte {first_push_at}" in line and "corrupt" in line, line
    assert log.read_bytes() == bytes(data), "nothing was cut or rewritten"
    move = f"mv {journal_dir(tmp_path)} {journal_dir(tmp_path)}.damaged"
    assert move in line, line
    subprocess.run(move.split(), check=True)
    with LocalCluster(1, server_args=["--checkpoint-dir", str(tmp_path)]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        assert client.status(0).num_variables == 0, "no checkpoint: it starts empty, with a new journal"
    assert (journal_dir(tmp_path) / "layout.json").is_file() and log.parent.with_name("ps-0.damaged").is_dir()


# -- one layout per volume --------------------------------------------------------------------------------

def test_a_journal_of_another_layout_is_refused_and_moved_aside_only_with_restore_froms_consent(tmp_path):
    """A 2-shard job journals and checkpoints on a volume; the same volume under 3 shards must not mix the old
    journal with the new layout: ps-0 refuses with one line (--restore-from alone does not override it
    either), and with --restore-from CHECKPOINT_DIR --replace-journal it moves the journal aside (kept) and
    starts from the checkpoint, re-laid out."""
    volume = tmp_path / "volume"
    with LocalCluster(2, server_args=["--checkpoint-dir", str(volume), "--num-ps", "2"]) as local, \
            PSClient(local.cluster, connect_timeout=20) as client:
        client.create_variables({f"w{i}": torch.zeros(8) for i in range(6)}, Optimizer("sgd", lr=1.0))
        client.push({f"w{i}": torch.ones(8) for i in range(6)})
        saved = client.save_checkpoint(0)
        client.push({f"w{i}": torch.ones(8) for i in range(6)})  # only the journals have this one

    three = ["--index", "0", "--bind", "127.0.0.1:0", "--num-ps", "3", "--checkpoint-dir", str(volume)]
    line = one_line_error(three, tmp_path / "refused.log")
    assert str(journal_dir(volume)) in line and "2-shard job" in line and "--replace-journal" in line, line
    for flags, needed in (([*three, "--restore-from", str(volume)], "--replace-journal"),
                          ([*three, "--replace-journal"], "--restore-from")):
        with pytest.raises(ClusterConfigError, match=needed):  # checked before anything starts
            open_journal(parse_args(flags), None, 0, on_failure=print)

    args = ["--checkpoint-dir", str(volume), "--restore-from", str(volume), "--replace-journal", "--num-ps", "3"]
    with LocalCluster(1, server_args=args) as local, PSClient(local.cluster, connect_timeout=20) as client:
        status = client.status(0)
        assert (status.restored_step, status.step) == (saved, saved), "the checkpoint, not the old journal"
        assert status.num_variables == 2, "shard 0 of 3: its third of the 6 variables"
        assert "moved aside" in local.log(0)
    aside = [p for p in (volume / "journal").iterdir() if p.name.startswith("ps-0.aside-")]
    assert len(aside) == 1 and any(aside[0].glob("log-*.bin")), "kept, not deleted"
    assert json.loads((journal_dir(volume) / "layout.json").read_text())["num_ps"] == 3, "a new journal began"


def test_a_finished_job_run_again_in_another_mode_starts_a_new_job_from_its_state(tmp_path):
    """The chief's Shutdown ends a job: a shard started again on the same volume begins a new job from the
    journal's last state (values and step kept) without the old members or mode, so another mode is
    accepted (before, the restored members made it a ModeConflictError)."""
    ckpt = tmp_path / "ckpt"
    with LocalCluster(1, server_args=["--checkpoint-dir", str(ckpt)]) as local:
        with PSClient(local.cluster, connect_timeout=20) as client:
            client.configure(mode="sync", total_num_replicas=1)
            client.create_variables({"w": torch.zeros(4)}, Optimizer("sgd", lr=1.0))
            client.join()
            client.push({"w": torch.ones(4)})
            client.leave()
            client.shutdown_cluster("the chief finished the job")
        assert local.procs[0].wait(timeout=EXIT_TIMEOUT) == 0
        local.start_ps(0)
        with PSClient(local.cluster, connect_timeout=20) as client:
            client.create_variables({"w": torch.zeros(4)}, Optimizer("sgd", lr=1.0))
            assert torch.equal(client.pull(["w"])["w"], -torch.ones(4)) and client.status(0).step == 1
            client.configure(mode="async")
            assert client.status(0).config.mode == "async"
        assert "a new job begins" in local.log(0)


# -- nothing waits on the disk ----------------------------------------------------------------------------

CALLS = 20  # of each kind while the writer is held


def test_status_and_joins_never_wait_for_the_journal_writer(tmp_path):
    """The journal's writer thread is held still (ptrace), as a write stuck on a dead disk would hold it, while a
    push waits for its record. Meanwhile joins under new incarnations (each a membership change, queued for
    the journal) and GetStatus all answer: only the push waits, because nothing waits for a membership record
    and nothing under the coordinator's lock writes (before, a join waited for the disk holding that lock,
    and GetStatus waited behind it). Let go, the writer writes, and the push is acknowledged."""
    with LocalCluster(1, server_args=["--checkpoint-dir", str(tmp_path)]) as local, \
            PSClient(local.cluster, connect_timeout=START_TIMEOUT) as client:
        client.create_variables({"w": torch.zeros(N)}, Optimizer("sgd", lr=1.0))
        writer = thread_named(local.procs[0].pid, WRITER_THREAD)
        stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(local.cluster.ps[0]))
        pool = concurrent.futures.ThreadPoolExecutor(1)
        with frozen_thread(writer):
            pushed = pool.submit(client.push, {"w": torch.ones(N)})
            live = wait_until(lambda: (lambda s: s.step == 1 and s.live_workers + 1)(
                stub.GetStatus(ps_pb2.StatusRequest(), timeout=10)), 30,
                "the push applied in memory, its record queued for the held writer")
            for incarnation in range(1, CALLS + 1):  # worker:9 joins, then restarts again and again
                stub.Join(ps_pb2.WorkerRef(worker="worker:9", incarnation=incarnation), timeout=10)
                assert stub.GetStatus(ps_pb2.StatusRequest(), timeout=10).live_workers == live
            assert not pushed.done(), "the push was acknowledged before its record was written"
        assert pushed.result(timeout=30) is not None
        pool.shutdown()
        assert torch.equal(client.pull(["w"])["w"], -torch.ones(N))
