"""The `ps-server` command line, run as a real process (`python -m torchps.ps_server`).

Configuration mistakes must end the process with a non-zero code and ONE clear
line on stderr ("ps-server: error: ..."), never a traceback; a good
configuration serves on the right address, reports its port and a ready line,
and SIGTERM / SIGHUP end it promptly with code 0, SIGINT (Ctrl-C) with 130 and one line.

Tests of how the process starts, answers signals and exits run a fresh interpreter, as a user or a pod
does. Tests of what a serving shard does (its flags, calls, shutdown with calls under way, health) fork it
from the warm fork server, as LocalCluster and ps-launch start shards: the same `main`, with the same
arguments and environment, without a second of torch's import each.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from torchps.forkserver import ProcessStarter
from torchps.proto import ps_pb2, ps_pb2_grpc
from torchps.worker.local_cluster import SHARD_MODULE

from helpers import free_port, wait_until

PS_SERVER = [sys.executable, "-m", "torchps.ps_server", "--insecure"]  # test_security.py covers the rest
START_TIMEOUT = 60.0  # seconds for a shard to import torch and grpc on a loaded 2-core machine
EXIT_TIMEOUT = 10.0  # "exits within a few seconds" (STOP_GRACE_SECONDS is 2)


def environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "TORCHPS_LOG_LEVEL")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_to_exit(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*PS_SERVER, *args], env=env or environ(), capture_output=True, text=True,
                          timeout=START_TIMEOUT, stdin=subprocess.DEVNULL)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode != 0, f"expected failure, got exit 0; stderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{result.stderr}"
    (line,) = lines
    assert line.startswith("ps-server: error: "), line
    for fragment in fragments:
        assert fragment in line, f"{line!r} should mention {fragment!r}"
    return line


@contextlib.contextmanager
def ps_server(args: list[str], tmp_path: pathlib.Path, env: dict[str, str] | None = None, *, forked: bool = False):
    """A running ps-server process; its stderr goes to a file (read it with `log_of`). Killed at exit.
    `forked`: from the fork server (see the module docstring), else a fresh interpreter."""
    log_path = tmp_path / f"ps-server-{time.monotonic_ns()}.log"
    with open(log_path, "wb") as log:
        if forked:
            proc = ProcessStarter.shared().start(SHARD_MODULE, [*PS_SERVER[3:], *args], prog="ps-server",
                                                 env=env or environ(), stdout=log.fileno())
        else:
            proc = subprocess.Popen([*PS_SERVER, *args], env=env or environ(), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
    proc.log_path = log_path
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def log_of(proc) -> str:
    return proc.log_path.read_text(errors="replace")


def wait_for_log(proc, pattern: str, timeout: float = START_TIMEOUT) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        match = re.search(pattern, log_of(proc), re.MULTILINE)
        if match:
            return match
        assert proc.poll() is None, f"ps-server exited with {proc.returncode} before logging {pattern!r}:\n{log_of(proc)}"
        assert time.monotonic() < deadline, f"ps-server never logged {pattern!r}:\n{log_of(proc)}"
        time.sleep(0.05)


def serving_address(proc, port_file: pathlib.Path, timeout: float = START_TIMEOUT) -> str:
    """The shard's address once its port file exists: the shard writes it (whole, by a rename) after the lines it
    logs at start, so a test that waits for the file finds them in the log."""
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        assert proc.poll() is None, f"ps-server exited with {proc.returncode} before writing {port_file}:\n{log_of(proc)}"
        assert time.monotonic() < deadline, f"ps-server never wrote {port_file}:\n{log_of(proc)}"
        time.sleep(0.05)
    return f"127.0.0.1:{port_file.read_text()}"


def status(address: str) -> ps_pb2.StatusResponse:
    with grpc.insecure_channel(address) as channel:
        return ps_pb2_grpc.ParameterServerStub(channel).GetStatus(ps_pb2.StatusRequest(), timeout=10,
                                                                  wait_for_ready=True)


def stop_with(proc, signum: int) -> int:
    proc.send_signal(signum)
    return exit_code_within_bound(proc, signal.Signals(signum).name)


def exit_code_within_bound(proc, after: str) -> int:
    """The shard's exit code, which must come within EXIT_TIMEOUT s of `after`."""
    try:
        return proc.wait(timeout=EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to the log
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        pytest.fail(f"ps-server still running {EXIT_TIMEOUT:g} s after {after}:\n{log_of(proc)}")


def test_console_script_installed():
    script = pathlib.Path(sys.executable).parent / "ps-server"
    assert script.is_file() and os.access(script, os.X_OK), f"{script} missing: is torchps installed?"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=START_TIMEOUT,
                            env=environ())
    assert result.returncode == 0, result.stderr
    for flag in ("--index", "--cluster", "--bind", "--port-file", "--allow-nonfinite", "--max-chunk-bytes"):
        assert flag in result.stdout


ONE_PS = '{"ps": ["127.0.0.1:5001"]}'
TWO_PS = '{"ps": ["127.0.0.1:5001", "127.0.0.1:5002"]}'


@pytest.mark.parametrize("args, env, fragments", [
    pytest.param(["--index", "0", "--cluster", '{"ps": ["127.0.0.1:5001",'], {}, ["does not parse"],
                 id="unparsable-json"),
    pytest.param(["--index", "2", "--cluster", TWO_PS], {}, ["ps:2", "2 ps task"], id="index-out-of-range"),
    pytest.param(["--index", "-1", "--cluster", TWO_PS], {}, ["ps:-1"], id="negative-index"),
    pytest.param(["--index", "0", "--cluster", '{"ps": ["127.0.0.1:5001"], "worker": ["127.0.0.1:5001"]}'], {},
                 ["127.0.0.1:5001", "twice"], id="duplicate-address"),
    pytest.param(["--cluster", TWO_PS], {}, ["--index"], id="missing-index"),
    pytest.param([], {"TF_CONFIG": json.dumps({"cluster": {**json.loads(TWO_PS), "worker": ["127.0.0.1:5003"]},
                                              "task": {"type": "worker", "index": 0}})},
                 ["worker:0", "run ps-worker for it"], id="tf-config-task-not-ps"),
    pytest.param([], {"TF_CONFIG": '{"cluster": {"ps": ['}, ["TF_CONFIG"], id="tf-config-unparsable"),
    pytest.param([], {}, ["TF_CONFIG"], id="no-cluster-at-all"),
    pytest.param(["--index", "0", "--cluster", "/nonexistent/cluster.json"], {}, ["/nonexistent/cluster.json"],
                 id="cluster-file-missing"),
    pytest.param(["--index", "0", "--cluster", '{"ps": ["no-port-here"]}'], {}, ["'no-port-here'", "host:port"],
                 id="bad-address"),
    pytest.param(["--index", "1", "--cluster", TWO_PS, "--replicated"], {}, ["--replicated", "--checkpoint-dir",
                 "--journal-dir"], id="replicated-without-journal"),
    pytest.param(["--index", "1", "--bind", "127.0.0.1:0", "--replicated", "--journal-dir", "j"], {},
                 ["--replicated needs the job's cluster"], id="replicated-without-cluster"),
])
def test_bad_cluster_is_one_clear_line(args, env, fragments):
    assert_one_line_error(run_to_exit(args, environ(**env)), *fragments)


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 0), (signal.SIGHUP, 0), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_port_file_ready_line_and_clean_exit_on_signal(tmp_path, signum, code):
    port_file = tmp_path / "ps.port"
    with ps_server(["--index", "0", "--bind", "127.0.0.1:0", "--port-file", str(port_file)], tmp_path) as proc:
        port = int(serving_address(proc, port_file).rpartition(":")[2])
        ready = re.search(r"^.*serving.*$", log_of(proc), re.MULTILINE)
        assert ready, f"the ready line must be logged before the port file is written:\n{log_of(proc)}"
        assert 0 < port < 65536
        assert not port_file.with_suffix(".tmp").exists()
        line = ready.group(0)
        for fragment in ("ps 0", f"127.0.0.1:{port}", f"pid {proc.pid}"):
            assert fragment in line, f"ready line {line!r} should mention {fragment!r}"
        assert log_of(proc).count("serving") == 1, log_of(proc)
        reply = status(f"127.0.0.1:{port}")
        assert reply.index == 0 and reply.pid == proc.pid
        assert stop_with(proc, signum) == code, log_of(proc)
        assert "Traceback" not in log_of(proc), log_of(proc)
        if code == 130:
            assert log_of(proc).rstrip().endswith("ps-server: interrupted"), log_of(proc)


def test_a_signal_the_kernel_hands_to_another_thread_still_stops_the_shard(tmp_path):
    """A signal sent to the process may be delivered to any of its threads (gRPC's, torch's): the shard must
    stop as promptly as when the main thread gets it. Here it is sent to one other thread on purpose."""
    tgkill = ctypes.CDLL(None, use_errno=True).tgkill
    with ps_server(["--index", "0", "--bind", "127.0.0.1:0"], tmp_path) as proc:
        wait_for_log(proc, r"^.*serving.*$")
        others = [int(tid) for tid in os.listdir(f"/proc/{proc.pid}/task") if int(tid) != proc.pid]
        assert others, "the shard runs threads besides its main one"
        assert tgkill(proc.pid, others[-1], signal.SIGTERM) == 0, os.strerror(ctypes.get_errno())
        assert exit_code_within_bound(proc, "SIGTERM to another thread") == 0, log_of(proc)
        assert "ps 0 stopping" in log_of(proc)


def test_torch_threads_are_set_and_logged_before_the_ready_line(tmp_path):
    with ps_server(["--index", "0", "--bind", "127.0.0.1:0", "--torch-threads", "1"], tmp_path, forked=True) as proc:
        wait_for_log(proc, r"^.*serving.*$")
        assert "ps 0 uses 1 torch thread(s) for updates and lookups" in log_of(proc), log_of(proc)
        assert stop_with(proc, signal.SIGTERM) == 0, log_of(proc)


def test_metrics_port_0_logs_the_port_it_bound(tmp_path):
    """The port the kernel picked is in the log, and /metrics answers there."""
    import urllib.request

    with ps_server(["--index", "0", "--bind", "127.0.0.1:0", "--metrics-port", "0"], tmp_path, forked=True) as proc:
        port = int(wait_for_log(proc, r"ps 0 metrics on http://127\.0\.0\.1:(\d+)/metrics$")[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b"torchps_calls_started_total" in reply.read()
        assert stop_with(proc, signal.SIGTERM) == 0, log_of(proc)


@pytest.mark.parametrize("value", ["0", "-2", "many", "5000"])
def test_a_bad_torch_thread_count_is_one_line_and_exit_2(value):
    run = subprocess.run([sys.executable, "-m", "torchps.ps_server", "--index", "0", "--bind", "127.0.0.1:0",
                          "--insecure", "--torch-threads", value], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().count("\n") == 0 and "--torch-threads: not a thread count" in run.stderr


def test_sigterm_with_a_call_waiting(tmp_path):
    """A worker blocked in a long ListVariables wait must not keep the shard from stopping."""
    port_file = tmp_path / "ps.port"
    with ps_server(["--index", "0", "--bind", "127.0.0.1:0", "--port-file", str(port_file)], tmp_path,
                   forked=True) as proc:
        address = serving_address(proc, port_file)
        with grpc.insecure_channel(address) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            waiting = stub.ListVariables.future(ps_pb2.ListRequest(names=["never"], wait_seconds=120), timeout=150)
            deadline = time.monotonic() + START_TIMEOUT
            while status(address).waiting_calls < 1:  # the shard holds the call: the scenario is set up
                assert time.monotonic() < deadline and not waiting.done(), "the ListVariables call never waited"
            assert not waiting.done()
            assert stop_with(proc, signal.SIGTERM) == 0, log_of(proc)
            with pytest.raises(grpc.RpcError):
                waiting.result(timeout=30)


def test_sigterm_after_garbage_input(tmp_path):
    """Streams whose bytes are not protobuf (gRPC fails to deserialize them) must not keep the shard from stopping."""
    port_file = tmp_path / "ps.port"
    junk = b"\xff" * 12 + b"not a protobuf"
    header = ps_pb2.PushRequest(header=ps_pb2.PushHeader(worker="w")).SerializeToString()
    with ps_server(["--index", "0", "--bind", "127.0.0.1:0", "--port-file", str(port_file)], tmp_path,
                   forked=True) as proc:
        address = serving_address(proc, port_file)
        with grpc.insecure_channel(address) as channel:
            for method, messages in (("CreateVariables", [junk]), ("Push", [header, junk])):
                call = channel.stream_unary(f"/torchps.v1.ParameterServer/{method}", request_serializer=lambda b: b,
                                            response_deserializer=lambda b: b)
                for _ in range(10):  # each such call leaves the shard unable to stop with some probability
                    with pytest.raises(grpc.RpcError):
                        call(iter(messages), timeout=10)
            assert status(address).pid == proc.pid  # still serving
        assert stop_with(proc, signal.SIGTERM) == 0, log_of(proc)


def test_tf_config_serves_on_own_entry(tmp_path):
    ports = [free_port(), free_port()]
    while ports[0] == ports[1]:
        ports[1] = free_port()
    cluster = {"ps": [f"127.0.0.1:{p}" for p in ports], "worker": ["127.0.0.1:1"]}
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 1}})
    with ps_server([], tmp_path, env=environ(TF_CONFIG=tf_config), forked=True) as proc:
        line = wait_for_log(proc, r"^.*serving.*$").group(0)
        assert "ps 1" in line and f"127.0.0.1:{ports[1]}" in line, line
        reply = status(cluster["ps"][1])
        assert reply.index == 1 and reply.pid == proc.pid
        with grpc.insecure_channel(cluster["ps"][0]) as other:  # ps 0's entry is not ours to serve
            with pytest.raises(grpc.FutureTimeoutError):
                grpc.channel_ready_future(other).result(timeout=0.5)
        assert stop_with(proc, signal.SIGTERM) == 0, log_of(proc)


@pytest.mark.parametrize("how", ["bind", "cluster"])
def test_port_in_use_is_one_clear_line(how):
    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        address = f"127.0.0.1:{occupant.getsockname()[1]}"
        if how == "bind":
            args = ["--index", "0", "--bind", address]
        else:
            args = ["--index", "0", "--cluster", json.dumps({"ps": [address]})]
        assert_one_line_error(run_to_exit(args), "cannot bind", address, "in use")


def test_a_shard_without_credentials_refuses_to_start_unless_told_insecure():
    result = subprocess.run([sys.executable, "-m", "torchps.ps_server", "--index", "0", "--bind", "127.0.0.1:0"],
                            env=environ(), capture_output=True, text=True, timeout=START_TIMEOUT,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert_one_line_error(result, "no credentials", "--tls-cert", "--token-file", "--insecure")


def health_of(address: str) -> tuple[int, int]:
    """The plaintext health port's statuses for the whole server ("") and the ParameterServer service (set one
    after the other: a check between the two sees them differ)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return tuple(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10, wait_for_ready=True).status
                     for service in ("", ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name))


def test_health_port_is_not_serving_while_restoring_and_reveals_nothing_else(tmp_path):
    """--health-port serves the health service alone in plaintext: NOT_SERVING while the shard restores
    a checkpoint (held here by a manifest that is a FIFO nobody has written yet), then SERVING; its port
    answers no ParameterServer call."""
    from torchps.client import Optimizer, PSClient
    from torchps.cluster import Cluster

    saved, port_file = tmp_path / "saved", tmp_path / "ps.port"
    with ps_server(["--index", "0", "--bind", "127.0.0.1:0", "--port-file", str(port_file),
                    "--checkpoint-dir", str(saved)], tmp_path, forked=True) as proc:
        with PSClient(Cluster(ps=(serving_address(proc, port_file),)), connect_timeout=10) as chief:
            chief.create_variables({"w": torch.arange(3.0)}, Optimizer("sgd", lr=1.0))
            step = chief.save_checkpoint(0)
        stop_with(proc, signal.SIGTERM)
    (step_folder,) = saved.glob("step-*")
    manifest = (step_folder / "manifest.json").read_bytes()
    (step_folder / "manifest.json").unlink()
    os.mkfifo(step_folder / "manifest.json")
    port_file.unlink()
    health_file = tmp_path / "health.port"
    with ps_server(["--index", "0", "--bind", "127.0.0.1:0", "--num-ps", "1", "--restore-from", str(saved),
                    "--port-file", str(port_file), "--health-port", "0", "--health-port-file", str(health_file)],
                   tmp_path, forked=True) as proc:
        wait_until(health_file.exists, START_TIMEOUT, "the health port file")
        health = f"127.0.0.1:{health_file.read_text()}"
        assert health_of(health) == (health_pb2.HealthCheckResponse.NOT_SERVING,) * 2
        assert not port_file.exists(), "the shard must not serve before its checkpoint is read"
        with grpc.insecure_channel(health) as channel, pytest.raises(grpc.RpcError) as info:
            ps_pb2_grpc.ParameterServerStub(channel).GetStatus(ps_pb2.StatusRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, "the health port serves nothing else"
        with open(step_folder / "manifest.json", "wb") as fifo:  # the restore goes on
            fifo.write(manifest)
        wait_until(lambda: health_of(health) == (health_pb2.HealthCheckResponse.SERVING,) * 2, START_TIMEOUT,
                   "SERVING")
        assert port_file.exists() and status(f"127.0.0.1:{port_file.read_text()}").step == step
        assert stop_with(proc, signal.SIGTERM) == 0, log_of(proc)
