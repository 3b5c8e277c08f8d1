"""`ps-launch`: a whole torchps cluster on this machine, one command.

    ps-launch                                   # the README demo: 2 ps, 2 workers, MLP, Fashion-MNIST
    ps-launch --ps 1 --workers 3 --mode sync --epochs 5 --metrics-out out.json

Starts `--ps` ps-servers on 127.0.0.1 with free ports, then the chief
(worker 0, or a separate chief with --chief), the other workers and, with
--evaluator, an evaluator, each a separate process whose log lines are
prefixed with its role. Every flag it does not know is passed to ps-worker.
A worker that dies does not stop the others; when training ends, or on
Ctrl-C, everything is stopped. The exit code is non-zero if any process
failed (its last lines are shown).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ..ps_server.cluster import Cluster, TaskSpec
from .local_cluster import ps_server_command

__all__ = ["main", "Launcher"]

DEMO_FLAGS = ["--model", "mlp", "--epochs", "5", "--lr", "0.1", "--momentum", "0.9"]
START_TIMEOUT_SECONDS = 60.0
STOP_GRACE_SECONDS = 10.0
TAIL_LINES = 15


@dataclasses.dataclass
class Proc:
    """One child process, its role, and the last lines it printed."""

    task: TaskSpec
    popen: subprocess.Popen
    tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        return str(self.task)


class Launcher:
    """Starts, watches and stops the processes of a local cluster."""

    def __init__(self, *, num_ps: int, workers: int, chief: bool, evaluator: bool, worker_args: list[str],
                 metrics_out: pathlib.Path | None, out=sys.stdout):
        self.num_ps, self.workers, self.chief, self.evaluator = num_ps, workers, chief, evaluator
        self.worker_args = worker_args
        self.metrics_out = metrics_out
        self.out = out
        self.procs: dict[TaskSpec, Proc] = {}
        self._print_lock = threading.Lock()
        self._tmp = tempfile.TemporaryDirectory(prefix="ps-launch-")
        self.cluster: Cluster | None = None
        self.summary: dict | None = None  # the chief's final summary line, parsed

    def say(self, line: str) -> None:
        with self._print_lock:
            print(line, file=self.out, flush=True)

    def _spawn(self, task: TaskSpec, argv: list[str]) -> Proc:
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        proc = Proc(task, popen)
        proc.reader = threading.Thread(target=self._relay, args=(proc,), daemon=True)
        proc.reader.start()
        self.procs[task] = proc
        return proc

    def _relay(self, proc: Proc) -> None:
        for line in proc.popen.stdout:
            line = line.rstrip("\n")
            proc.tail.append(line)
            if line.startswith("summary {") and proc.task == self.cluster.chief_task:
                self.summary = json.loads(line.removeprefix("summary "))
            self.say(f"[{proc.name}] {line}")

    def start_ps(self) -> Cluster:
        """Starts the ps-servers on free ports and builds the cluster naming them."""
        ports = []
        for index in range(self.num_ps):
            port_file = pathlib.Path(self._tmp.name) / f"ps{index}.port"
            self._spawn(TaskSpec("ps", index), [*ps_server_command(), "--index", str(index),
                                                "--bind", "127.0.0.1:0", "--port-file", str(port_file)])
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        for index in range(self.num_ps):
            port_file = pathlib.Path(self._tmp.name) / f"ps{index}.port"
            while not port_file.exists():
                proc = self.procs[TaskSpec("ps", index)]
                if proc.popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ps:{index} did not start:\n" + "\n".join(proc.tail))
                time.sleep(0.05)
            ports.append(int(port_file.read_text()))
        # Workers serve nothing; TF_CONFIG still names an address for each, so give distinct unused ones.
        spare = (p for p in range(20000, 65535) if p not in ports)
        self.cluster = Cluster(ps=tuple(f"127.0.0.1:{p}" for p in ports),
                               chief=tuple(f"127.0.0.1:{next(spare)}" for _ in range(int(self.chief))),
                               worker=tuple(f"127.0.0.1:{next(spare)}" for _ in range(self.workers)),
                               evaluator=tuple(f"127.0.0.1:{next(spare)}" for _ in range(int(self.evaluator))))
        return self.cluster

    def training_tasks(self) -> list[TaskSpec]:
        tasks = [TaskSpec("chief", 0)] if self.chief else []
        return tasks + [TaskSpec("worker", i) for i in range(self.workers)]

    def start_task(self, task: TaskSpec) -> Proc:
        argv = [sys.executable, "-m", "torchps.worker", "--cluster", json.dumps(self.cluster.to_dict()),
                "--task-type", task.type, "--index", str(task.index), *self.worker_args]
        if task == self.cluster.chief_task and self.metrics_out:
            argv += ["--metrics-out", str(self.metrics_out)]
        return self._spawn(task, argv)

    def run(self) -> int:
        """Runs the job to the end; returns the exit code. Always stops every process."""
        try:
            self.start_ps()
            self.say(f"[launch] cluster: {json.dumps(self.cluster.to_dict())}")
            for task in self.training_tasks():
                self.start_task(task)
            if self.evaluator:
                self.start_task(TaskSpec("evaluator", 0))
            return self._watch()
        except KeyboardInterrupt:
            self.say("[launch] interrupted: stopping every process")
            return 130
        finally:
            self.stop()

    def _watch(self) -> int:
        training = self.training_tasks()
        reported = set()
        while True:
            for task, proc in self.procs.items():
                code = proc.popen.poll()
                if code not in (None, 0) and task not in reported:
                    reported.add(task)
                    self.say(f"[launch] {task} exited with code {code}; the others go on")
                elif code is None and task.type == "ps":
                    continue
            if all(self.procs[t].popen.poll() is not None for t in training):
                break
            time.sleep(0.2)
        if self.evaluator:
            self._wait(self.procs[TaskSpec("evaluator", 0)], STOP_GRACE_SECONDS * 3)
        failed = [p for p in self.procs.values() if p.task.type != "ps" and p.popen.poll() not in (None, 0)]
        for proc in failed:
            self.say(f"[launch] {proc.name} failed (exit {proc.popen.returncode}); its last lines:")
            for line in proc.tail:
                self.say(f"[launch]   | {line}")
        return 1 if failed else 0

    @staticmethod
    def _wait(proc: Proc, timeout: float) -> None:
        try:
            proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        """SIGTERM to every live process, SIGKILL after a grace period; no process is left behind."""
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for proc in self.procs.values():
            self._wait(proc, max(0.0, deadline - time.monotonic()))
            if proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()
            if proc.reader is not None:
                proc.reader.join(timeout=5)
        self._tmp.cleanup()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="ps-launch", description="Run a whole torchps cluster on 127.0.0.1. Unknown flags go to ps-worker "
        "(see ps-worker --help). With no arguments: the README demo.")
    parser.add_argument("--ps", type=int, default=2, help="ps-servers (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="training workers (default: %(default)s)")
    parser.add_argument("--chief", action="store_true", help="add a separate chief task (else worker 0 is chief)")
    parser.add_argument("--evaluator", action="store_true", help="add an evaluator task")
    parser.add_argument("--metrics-out", type=pathlib.Path, help="the chief's summary JSON goes here")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, worker_args = parse_args(argv)
    if not argv:
        worker_args = DEMO_FLAGS
        print(f"[launch] demo: {args.ps} ps, {args.workers} workers, ps-worker {' '.join(worker_args)}", flush=True)
    if args.ps < 1 or args.workers + int(args.chief) < 1:
        print("ps-launch: error: need --ps >= 1 and at least one training task", file=sys.stderr)
        return 2
    launcher = Launcher(num_ps=args.ps, workers=args.workers, chief=args.chief, evaluator=args.evaluator,
                        worker_args=worker_args, metrics_out=args.metrics_out)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    code = launcher.run()
    if launcher.summary:
        s = launcher.summary
        print(f"[launch] test accuracy {s['test_accuracy']:.4f} on {s['dataset']} after {s['global_step']} global steps "
              f"in {s['wall_seconds']:.1f} s ({s['steps_per_second']:.0f} steps/s, {s['mode']})", flush=True)
    print(f"[launch] done, exit code {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
