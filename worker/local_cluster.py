"""Real ps-server processes on 127.0.0.1 with free ports, for tests, benchmarks and ps-launch.

    with LocalCluster(num_ps=2) as local:
        with PSClient(local.cluster) as ps: ...
        local.kill_ps(1); local.start_ps(1)   # same index, same port
        ps.resize([*local.cluster.ps, local.add_ps()])  # a third shard, live

Each shard binds port 0 and reports the port it got through --port-file, so
no port is ever guessed. Shards are forked from a warm fork server
(torchps.forkserver) unless TORCHPS_NO_FORK_SERVER=1: each is still a
process of its own, started in a fraction of a second after the first. Stopping sends SIGTERM, then SIGKILL after a grace
period; no process is left behind, even when the block raises.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

from ..cluster import Cluster
from ..errors import ServerUnavailableError
from ..forkserver import ForkedChild, ProcessStarter

__all__ = ["LocalCluster", "local_shard_threads", "ps_server_command"]

STACKS_SECONDS = 5.0  # a shard that did not start: how long its stacks (SIGUSR1) are waited for
START_TIMEOUT_SECONDS = 30.0  # a fresh shard imports torch and grpc: seconds on a loaded 2-core machine
SHARD_MODULE = "torchps.ps_server.__main__"


def local_shard_threads(server_args: list[str]) -> list[str]:
    """`--torch-threads 1` unless `server_args` set it: a shard started beside others and their workers on one
    machine computes on one thread (torch's default, one per core in every process, oversubscribes the cores
    and spends CPU waiting at its parallel regions' ends)."""
    return [] if any(a.startswith("--torch-threads") for a in server_args) else ["--torch-threads", "1"]


def ps_server_command() -> list[str]:
    """The command that runs ps-server with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "torchps.ps_server"]


class LocalCluster:
    """`num_ps` ps-server processes on 127.0.0.1, plus the Cluster value naming them.

    `ports`: the shards' ports (default: any free one each). Worker and chief addresses are not served by
    anything here; `workers`
    only fills the cluster's worker list (placeholders on unused ports) so
    clients can derive roles from it. Shards run `--insecure` (loopback, tests
    and benchmarks) unless `server_args` give TLS files or a token, and with
    `--torch-threads 1` unless they give another count: they share the
    machine's cores with each other and with the clients.
    """

    def __init__(self, num_ps: int = 1, *, workers: int = 0, chief: bool = False,
                 server_args: list[str] | None = None, log_dir: str | os.PathLike | None = None,
                 starter: ProcessStarter | None = None, ports: list[int] | None = None):
        self.num_ps = num_ps
        self.server_args = list(server_args or ())
        self._tmp = tempfile.TemporaryDirectory(prefix="torchps-local-")
        self.log_dir = pathlib.Path(log_dir or self._tmp.name)
        self.starter = starter or ProcessStarter.shared()
        self.procs: list[subprocess.Popen | ForkedChild | None] = [None] * num_ps
        self.ports: list[int] = list(ports) if ports is not None else [0] * num_ps  # 0: any free port
        self._args: dict[int, list[str]] = {}  # a shard's own arguments, where not server_args
        self._extra = {"worker": workers, "chief": 1 if chief else 0}
        self.cluster: Cluster | None = None

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Cluster:
        """Starts every shard and waits until each serves; returns the cluster."""
        for index in range(self.num_ps):
            self._spawn(index, self.ports[index])
        for index in range(self.num_ps):
            self._wait_port(index)
        placeholders = iter(range(1, 1 << 16))
        used = set(self.ports)

        def fake(count: int) -> list[str]:  # distinct, unserved loopback addresses
            out = []
            while len(out) < count:
                port = next(placeholders)
                if port not in used:
                    out.append(f"127.0.0.1:{port}")
                    used.add(port)
            return out

        self.cluster = Cluster(ps=tuple(f"127.0.0.1:{p}" for p in self.ports),
                               worker=tuple(fake(self._extra["worker"])), chief=tuple(fake(self._extra["chief"])))
        return self.cluster

    def _spawn(self, index: int, port: int = 0, args: list[str] | None = None) -> None:
        port_file = pathlib.Path(self._tmp.name) / f"ps{index}.port"
        port_file.unlink(missing_ok=True)
        log = open(self.log_dir / f"ps{index}.log", "ab")
        if args is not None:
            self._args[index] = list(args)
        server_args = self._args.get(index, self.server_args)
        secured = any(a.startswith(("--tls-", "--token-file")) for a in server_args)
        try:
            self.procs[index] = self.starter.start(
                SHARD_MODULE, prog="ps-server", argv=["--index", str(index), "--bind", f"127.0.0.1:{port}", "--port-file", str(port_file),
                               *([] if secured else ["--insecure"]), *local_shard_threads(server_args),
                               *server_args],
                env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log.fileno(),
                parent_death_signal=signal.SIGTERM)  # should this process die without stopping it
        finally:
            log.close()

    def _wait_port(self, index: int, timeout: float = START_TIMEOUT_SECONDS) -> None:
        port_file = pathlib.Path(self._tmp.name) / f"ps{index}.port"
        began = time.monotonic()
        while not port_file.exists():
            code = self.procs[index].poll()
            if code is not None or time.monotonic() > began + timeout:
                how = _how_ended(self.procs[index], code)
                if code is None:  # ps-server writes its threads' stacks to its log on SIGUSR1: wait for them
                    self.procs[index].send_signal(signal.SIGUSR1)
                    shown = time.monotonic() + STACKS_SECONDS
                    while "Current thread" not in self.log(index) and time.monotonic() < shown:
                        time.sleep(0.05)
                raise ServerUnavailableError(f"ps {index} did not start: {how} after {time.monotonic() - began:.1f} s;"
                                             f" its log:\n{self.log(index)[-6000:]}")
            time.sleep(0.02)
        self.ports[index] = int(port_file.read_text())

    def log(self, index: int) -> str:
        """Everything shard `index` has printed so far."""
        path = self.log_dir / f"ps{index}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill_ps(self, index: int, sig: int = signal.SIGKILL) -> int:
        """Sends `sig` to shard `index` and waits for it to exit; returns its exit code."""
        proc = self.procs[index]
        proc.send_signal(sig)
        return proc.wait(timeout=30)

    def start_ps(self, index: int, args: list[str] | None = None, *, timeout: float = START_TIMEOUT_SECONDS,
                 spawned: Callable[[int], None] | None = None) -> None:
        """Starts shard `index` again on its previous port (after kill_ps), with `args` (default: those it had),
        and waits up to `timeout` s until it serves (a shard recovering from a long journal takes longer than
        a fresh one). `spawned(pid)` runs as soon as the process exists (to put it in a memory cgroup)."""
        self._spawn(index, self.ports[index], args)
        if spawned is not None:
            spawned(self.procs[index].pid)
        self._wait_port(index, timeout)

    def add_ps(self, index: int | None = None, *, args: list[str] | None = None, port: int = 0) -> str:
        """Starts a shard for a live resize (PSClient.resize) and returns its address: at `index` (default: the
        next one), on `port` (0: a new one), with `args` (default: the others'); a shard there must have ended
        (one a resize removed). `cluster` still names the shards the job started with."""
        index = len(self.procs) if index is None else index
        if index < len(self.procs) and self.procs[index] is not None and self.procs[index].poll() is None:
            raise ValueError(f"ps {index} is running")
        if index >= len(self.procs):
            self.procs.extend([None] * (index + 1 - len(self.procs)))
            self.ports.extend([0] * (index + 1 - len(self.ports)))
        self._spawn(index, port, args)
        self._wait_port(index)
        return self.address(index)

    def address(self, index: int) -> str:
        """Shard `index`'s address."""
        return f"127.0.0.1:{self.ports[index]}"

    def stop(self, grace: float = 5.0) -> list[int | None]:
        """SIGTERM to every shard, SIGKILL after `grace` s; returns their exit codes."""
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        codes = []
        for proc in self.procs:
            if proc is None:
                codes.append(None)
                continue
            try:
                codes.append(proc.wait(timeout=grace))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        self._tmp.cleanup()
        return codes


def _how_ended(proc, code: int | None) -> str:
    """How a shard process that did not start stands: its exit (a signal named), or its state if it runs."""
    if code is not None:
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    try:
        status = dict(line.split(":\t", 1) for line in pathlib.Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                      if ":\t" in line)
        wchan = pathlib.Path(f"/proc/{proc.pid}/wchan").read_text()
    except (OSError, ValueError):
        return "still running"
    return f"still running (state {status.get('State', '?')}, {status.get('Threads', '?')} threads, waiting in {wchan or '?'})"

