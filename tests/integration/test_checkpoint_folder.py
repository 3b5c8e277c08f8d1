"""One job per checkpoint folder, and what to do when its files are damaged, against real processes.

A shard holds a lock on its part of --checkpoint-dir (and ps-launch one on the folder) for as long as it runs:
a second shard of the same index, or a second ps-launch, is refused at start naming the holder, and the
kernel lets go of the lock when the holder dies (SIGKILL too), so a restarted shard takes it back. A damaged
newest checkpoint is passed over for the newest intact one, by every shard alike. A corrupt journal names
`ps-launch ... --replace-journal` to a job ps-launch started, and that works.
"""

from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys
import time

import torch
from helpers import run_ps_server
from test_recovery import Launch

from torchps.client import Optimizer, PSClient
from torchps.ps_server import journal_log
from torchps.worker.local_cluster import LocalCluster

START_TIMEOUT = 60.0
RUN_TIMEOUT = 120.0   # a short ps-launch job, start to end, on a loaded 2-core machine
REFUSAL_SECONDS = 15  # ps-launch refusing a folder in use: its flags checked, no torch imported, nothing started
JOB = ["--dataset", "mnist5k", "--ps", "2", "--workers", "1", "--mode", "async", "--batch-size", "100",
       "--checkpoint-every-steps", "5", "--insecure"]


def files_of(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_shard_of_the_same_index_is_refused_naming_the_holder_and_a_sigkilled_ones_successor_starts(
        tmp_path):
    """ps 0 runs on a folder; a second ps 0 there is refused with exit code 2 and one line naming the holder's
    pid and command line, and changes no file. SIGKILLed, the first lets go of its lock with its death: its
    successor (ps-launch --restart-on-failure does the same) starts there and has its state back."""
    ckpt = tmp_path / "ckpt"
    with LocalCluster(1, server_args=["--checkpoint-dir", str(ckpt)]) as local, \
            PSClient(local.cluster, connect_timeout=START_TIMEOUT) as client:
        client.create_variables({"w": torch.zeros(4)}, Optimizer("sgd", lr=1.0))
        client.push({"w": torch.ones(4)})
        before = files_of(ckpt)

        code, printed = run_ps_server(["--insecure", "--index", "0", "--bind", "127.0.0.1:0", "--checkpoint-dir",
                                       str(ckpt)], tmp_path / "second.log", START_TIMEOUT)
        assert code == 2, f"exit {code}:\n{printed}"
        lines = printed.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in printed, printed
        pid = local.procs[0].pid
        assert lines[0].startswith(f"ps-server: error: checkpoint folder {ckpt} is in use by pid {pid} (ps-server "
                                   f"--index 0 "), lines[0]
        assert lines[0].endswith("another job writes it; give this job its own --checkpoint-dir"), lines[0]
        after = files_of(ckpt)  # the running shard only appends to its log meanwhile (a lease's end, say)
        assert after.keys() == before.keys() and all(
            after[name] == data or (name.endswith(".bin") and after[name].startswith(data))
            for name, data in before.items()), "the refused shard changed nothing"

        assert local.kill_ps(0) == -signal.SIGKILL
        local.start_ps(0)
        assert torch.equal(client.pull(["w"])["w"], -torch.ones(4)), "its successor recovered its journal"


def test_a_second_ps_launch_on_a_folder_in_use_is_refused_before_it_starts_anything(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = Launch([*JOB, "--steps", "100000", "--checkpoint-dir", str(ckpt)])
    try:
        first.wait_for(r"^\[launch\] cluster: ", timeout=RUN_TIMEOUT)
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "torchps.worker.launch", *JOB, "--steps", "10",
                                 "--checkpoint-dir", str(ckpt)], capture_output=True, text=True,
                                timeout=REFUSAL_SECONDS * 4, stdin=subprocess.DEVNULL)
        assert second.returncode == 2, f"exit {second.returncode}:\n{second.stdout}\n{second.stderr}"
        assert time.monotonic() - started < REFUSAL_SECONDS, "refused at once"
        assert second.stdout.strip() == "", f"nothing was started:\n{second.stdout}"
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith(f"ps-launch: error: checkpoint folder {ckpt} is in use by pid {first.proc.pid} ("), line
        assert "torchps.worker.launch" in line and "--steps 100000" in line, "the holder's command line"
        assert "give this job its own --checkpoint-dir" in line, line
        assert first.proc.poll() is None, "the first job runs on"
    finally:
        first.stop()


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_newest_intact_one_by_every_shard(tmp_path):
    """Two committed checkpoints (steps 1 and 2); ps 1's file of step 2 is cut short. Both shards restore step 1
    (not one step 2 and the other step 1, nor a refusal), each logging one WARNING naming both."""
    ckpt = tmp_path / "ckpt"
    args = ["--checkpoint-dir", str(ckpt), "--no-journal", "--num-ps", "2"]
    with LocalCluster(2, server_args=args) as local:
        with PSClient(local.cluster, connect_timeout=START_TIMEOUT) as client:
            client.create_variables({f"w{i}": torch.zeros(4) for i in range(4)}, Optimizer("sgd", lr=1.0))
            for step in (1, 2):
                client.push({f"w{i}": torch.ones(4) for i in range(4)})
                assert client.save_checkpoint(0) == step
        damaged = ckpt / f"step-{2:012d}" / "ps-1.pt"
        size = damaged.stat().st_size
        with open(damaged, "r+b") as f:
            f.truncate(size // 2)
        for index in (0, 1):
            assert local.kill_ps(index, signal.SIGTERM) == 0
        for index in (0, 1):
            local.start_ps(index)
        with PSClient(local.cluster, connect_timeout=START_TIMEOUT) as client:
            assert [client.status(i).restored_step for i in (0, 1)] == [1, 1], "both the intact step 1"
            client.create_variables({f"w{i}": torch.zeros(4) for i in range(4)}, Optimizer("sgd", lr=1.0))
            values = client.pull([f"w{i}" for i in range(4)]).values()
            assert all(torch.equal(value, -torch.ones(4)) for value in values), "step 1's values"
        for index in (0, 1):
            warnings = [line for line in local.log(index).splitlines() if " WARNING " in line and "damaged" in line]
            assert len(warnings) == 1, local.log(index)[-3000:]
            assert str(damaged) in warnings[0] and f"{size // 2} bytes" in warnings[0], warnings[0]
            assert f"step-{1:012d}" in warnings[0], warnings[0]


def _damage_first_of_two_records(folder: pathlib.Path) -> pathlib.Path:
    """Flips a byte inside the first of the last two whole records of the newest log in journal `folder`: a
    damaged record with a whole one after it (corruption, not a torn end). Returns the log."""
    log = max(folder.glob("log-*.bin"))
    number = int(log.stem.split("-")[1])
    view, mapping = journal_log.mapped(log)
    try:
        ends = [end for _, end in journal_log.scan(view, number)]
    finally:
        view.release()
        if mapping is not None:
            mapping.close()
    assert len(ends) >= 2, f"{log} holds {len(ends)} whole records"
    at = (ends[-3] if len(ends) > 2 else 0) + 40
    data = bytearray(log.read_bytes())
    data[at] ^= 0xFF
    log.write_bytes(bytes(data))
    return log


def test_a_corrupt_journal_names_ps_launch_replace_journal_and_that_starts_the_job_from_its_checkpoint(tmp_path):
    """A job ps-launch ran to step 10 (checkpoints at 5 and 10); one record of ps 0's journal is damaged. Run on
    to step 20, ps 0 refuses with one line naming `ps-launch ... --replace-journal` (exit 2); with that flag
    every shard's journal is moved aside (kept) and the job goes on from step 10's checkpoint to step 20."""
    ckpt = tmp_path / "ckpt"
    first = Launch([*JOB, "--steps", "10", "--checkpoint-dir", str(ckpt)])
    try:
        assert first.finish(RUN_TIMEOUT) == 0, first.tail()
    finally:
        first.stop()
    log = _damage_first_of_two_records(ckpt / "journal" / "ps-0")

    refused = Launch([*JOB, "--steps", "20", "--checkpoint-dir", str(ckpt)])
    try:
        assert refused.finish(RUN_TIMEOUT) == 2, refused.tail()
    finally:
        refused.stop()
    line = next(line for line in refused.lines if "ps-server: error: " in line)
    assert str(log) in line and "corrupt" in line, line
    assert "run ps-launch again with --replace-journal added" in line, line

    again = Launch([*JOB, "--steps", "20", "--checkpoint-dir", str(ckpt), "--replace-journal"])
    try:
        assert again.finish(RUN_TIMEOUT) == 0, again.tail()
    finally:
        again.stop()
    moved = [line for line in again.lines if re.match(r"^\[launch\] the journals in .* moved aside to ", line)]
    assert len(moved) == 1, again.tail()
    (aside,) = ckpt.glob("journal.aside-*")
    assert (aside / "ps-0" / log.name).read_bytes() != b"", "kept, not deleted"
    for index in (0, 1):
        assert any(re.search(rf"^\[ps:{index}\] .*ps {index} restoring .*step-{10:012d}", line)
                   for line in again.lines), again.tail(80)
    assert re.search(r"after 20 global steps", again.tail()), again.tail()
