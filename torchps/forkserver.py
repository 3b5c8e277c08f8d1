"""Shards and workers forked from one warm interpreter instead of each importing torch and gRPC again.

    starter = ProcessStarter()       # the fork server starts importing in the background
    child = starter.start("torchps.ps_server.__main__", ["--index", "0", ...], prog="ps-server", stdout=log_fd)
    child.poll(); child.send_signal(signal.SIGKILL); child.wait(timeout=30)
    starter.close()

The fork server is a process of its own (`python -m torchps.forkserver
--serve`) that imports torch, numpy, grpc and the project's entry modules
once, before any gRPC channel, server or thread pool exists in it (gRPC's
and OpenMP's fork rules), then forks one child per request. Each child is
a real process: it dies alone under SIGKILL, holds its own memory, gets
the environment, working folder and output descriptor given to `start`,
and runs the entry module's `main(argv)` (see run_entry); ps and top show
it by its program name and arguments. The fork server
leaves the terminal's session (a Ctrl-C or hang-up reaches the process that
started it, which stops its children in order), reports each child's exit
code, and exits when that process goes away, however it ends; children
asked to die with their parent then get their signal. Should the fork server
die first (an OOM killer may pick it), those children die with it, and the
next start starts a new one (see ProcessStarter).

Requests and replies travel over a Unix socketpair, one JSON datagram
each (the fork server's first says its imports are done); a child's output
descriptor rides along (SCM_RIGHTS).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import io
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
from typing import Mapping

import setproctitle

__all__ = ["DISABLE_ENV", "ENTRY_MODULES", "INTERRUPTED", "ForkedChild", "ProcessStarter", "fork_server_enabled",
           "run_entry", "run_main"]

# What the fork server imports before forking: the shard's and the worker's entry modules pull in torch,
# numpy, grpc and the rest of the project. None of them starts a thread. (Not torch._dynamo: a shard steps
# torch.optim's functional forms, which never import it; see ps_server/optimizers.py.)
ENTRY_MODULES = ("torchps.ps_server.__main__", "torchps.ps_server.daemon", "torchps.worker.__main__")
DISABLE_ENV = "TORCHPS_NO_FORK_SERVER"  # set to 1: every process starts a fresh interpreter instead
# Read once, when an interpreter starts or imports gRPC, torch or their libraries: a child that needs other
# values than the fork server started with is started as a fresh interpreter instead.
STARTUP_ENV = ("GRPC_VERBOSITY", "GRPC_TRACE", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONMALLOC", "LD_PRELOAD",
               "LD_LIBRARY_PATH", "MALLOC_ARENA_MAX", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "TORCHPS_LOCK_CHECK")  # ps_server/locks.py's checker, chosen at import
INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
START_TIMEOUT_SECONDS = 120.0  # the fork server's imports plus one fork, on a loaded machine
MAX_MESSAGE_BYTES = 1 << 20
ORPHAN_POLL_SECONDS = 0.05  # once the fork server is gone, how often a wait looks whether a child still exists
EXIT_STATUS_SECONDS = 5.0  # from a fork server's socket closing to its exit status, on a loaded machine
_PR_SET_PDEATHSIG = 1
_LOGGER = logging.getLogger(__name__)


def _load_prctl():
    """libc's prctl, loaded before any fork (a child between fork and exec must not load libraries)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: no parent-death signal


_PRCTL = _load_prctl()


def fork_server_enabled() -> bool:
    """False where the fork server cannot be used (no fork: not POSIX) or the environment turns it off."""
    return hasattr(os, "fork") and hasattr(socket, "send_fds") and os.environ.get(DISABLE_ENV, "") in ("", "0")


def run_entry(module: str, argv: list[str], prog: str | None = None) -> typing.NoReturn:
    """Runs `module`.main(argv) as run_main does; a Ctrl-C during the (slow: torch, gRPC) imports is
    answered as one during main."""
    def main(args: list[str]) -> int | None:
        import importlib

        with _collector_paused():
            entry = importlib.import_module(module)
        return entry.main(args)

    run_main(main, argv, prog or module)


@contextlib.contextmanager
def _collector_paused():
    """Imports (torch's above all) allocate many objects and make few cycles: the cyclic garbage collector,
    which would run every few hundred allocations, is off while they run, and on again after (if it was)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def run_main(main: typing.Callable[[list[str]], int | None], argv: list[str], prog: str) -> typing.NoReturn:
    """Runs main(argv) and ends the process with its code at once, its output flushed: a thread still in a
    call (a client closed after an interrupt leaves within 3 s, its retries may not) cannot hold it, nor
    can the interpreter's teardown of torch and of a gRPC server's event loop (seconds on a loaded machine).
    A Ctrl-C is one line "PROG: interrupted" and code 130; an exception is its traceback and code 1, as
    `python -m` prints it."""
    sys.argv = [prog, *argv]
    code = 1
    try:
        code = main(argv) or 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        code = INTERRUPTED
    except SystemExit as exc:  # argparse's usage errors, sys.exit(n)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as `python -m` prints an uncaught exception
        import traceback

        traceback.print_exc()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that went away
            stream.flush()
    os._exit(code)


class ForkedChild:
    """A child of a fork server, with subprocess.Popen's calls for waiting and signalling (pid, args,
    returncode, poll, wait, send_signal, terminate, kill). Its exit code arrives from the fork server; should
    the fork server itself be gone, a child that is gone too reads as killed (-SIGKILL). `birth`: which of the
    fork server's children with this pid it is (the kernel gives an exited child's pid to a later one)."""

    def __init__(self, pid: int, birth: int, args: list[str], server: "_ForkServer", dies_with_server: bool):
        self.pid = pid
        self.args = args
        self._birth = birth
        self._server = server
        self._dies_with_server = dies_with_server

    @property
    def returncode(self) -> int | None:
        return self._server.exits.code(self.pid, self._birth)

    @property
    def server_death(self) -> str | None:
        """How its fork server ended ("the fork server, pid N, was killed by signal 9") if that ended this
        child: it was asked to die with its parent and is gone, its exit unreported. Else None."""
        if not self._dies_with_server or self.poll() is None or self._server.exits.reported(self.pid, self._birth):
            return None
        return self._server.death

    def poll(self) -> int | None:
        """Its exit code (negative: the signal that ended it), or None while it runs. Never blocks."""
        return self._server.exits.code(self.pid, self._birth)

    def wait(self, timeout: float | None = None) -> int:
        """Blocks until it exits, at most `timeout` s (then subprocess.TimeoutExpired)."""
        code = self._server.exits.wait(self.pid, self._birth, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        """Sends `sig` unless it has exited (its pid is not reused before the fork server reaps it)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Exits:
    """Exit codes the fork server reported, by (pid, birth): a pid the kernel gives to a later child is that
    child's next birth, so an earlier child's exit is never read as its own. Owns its lock. Once the fork
    server is gone, a child that no longer runs counts as killed."""

    def __init__(self):
        self._changed = threading.Condition()
        self._codes: dict[tuple[int, int], int] = {}
        self._births: dict[int, int] = {}  # pid -> the birth of the newest child with it
        self._server_gone = False

    def born(self, pid: int) -> int:
        """A child with `pid` was forked (its reply read, in order with the exits): returns its birth."""
        with self._changed:
            self._births[pid] = self._births.get(pid, 0) + 1
            return self._births[pid]

    def record(self, pid: int, code: int) -> None:
        with self._changed:
            self._codes[pid, self._births.get(pid, 0)] = code
            self._changed.notify_all()

    def server_gone(self) -> None:
        with self._changed:
            self._server_gone = True
            self._changed.notify_all()

    def reported(self, pid: int, birth: int) -> bool:
        with self._changed:
            return (pid, birth) in self._codes

    def code(self, pid: int, birth: int) -> int | None:
        with self._changed:
            return self._code(pid, birth)

    def wait(self, pid: int, birth: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while self._code(pid, birth) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                if self._server_gone:  # nobody reports exits any more: look at the pid now and then
                    left = ORPHAN_POLL_SECONDS if left is None else min(left, ORPHAN_POLL_SECONDS)
                self._changed.wait(left)
            return self._code(pid, birth)

    def _code(self, pid: int, birth: int) -> int | None:
        if (pid, birth) in self._codes:
            return self._codes[pid, birth]
        if self._server_gone and (self._births.get(pid, 0) > birth or not _runs(pid)):
            return -signal.SIGKILL
        return None


def _runs(pid: int) -> bool:
    """False once `pid` is gone or a zombie: an orphan waits as one until its new parent reaps it, and some
    containers' first process never does."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:  # gone since, or no /proc: it ran a moment ago
        return True


class _ForkServer:
    """One fork server process and the socketpair to it; owns the thread that reads its replies and the
    exits it reports. `death` says how it ended, once its socket has closed."""

    def __init__(self, preload: tuple[str, ...], env: Mapping[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", __name__, "--serve", str(theirs.fileno()), *preload],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        self.pid = self.popen.pid
        self.exits = _Exits()
        self.ready = False  # its imports are done: it reads requests from now on
        self.death: str | None = None
        self._sock = ours
        self._replies: list[dict] = []
        self._replied = threading.Condition()
        threading.Thread(target=self._read, name="fork-server-replies", daemon=True).start()

    def request(self, data: bytes, stdout: int | None, *, dies_with_it: bool) -> dict | None:
        """Its reply to one start request; blocks until it answers, at most START_TIMEOUT_SECONDS (then
        OSError). None if it ended first and no child of the request can be running: the request never
        reached it (or it died before it read any), or the child was asked to die with it (`dies_with_it`).
        OSError if it ended after it may have read the request, and a child may run. One caller at a time."""
        try:
            socket.send_fds(self._sock, [data], [] if stdout is None else [stdout])
        except ConnectionError:  # its end is closed: it is gone, or going
            delivered = False
        else:
            delivered = True
        with self._replied:
            if not self._replied.wait_for(lambda: self._replies or self.death, START_TIMEOUT_SECONDS):
                raise OSError(f"the fork server, pid {self.pid}, did not answer within {START_TIMEOUT_SECONDS:.0f} s")
            if self._replies:
                return self._replies.pop(0)
        if delivered and self.ready and not dies_with_it:
            raise OSError(f"{self.death} after it was asked to start a process, which may run")
        return None

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = self._sock.recv(MAX_MESSAGE_BYTES)
                if not data:
                    break
                message = json.loads(data)
                if "exit" in message:
                    self.exits.record(message["exit"], message["code"])
                elif "ready" in message:
                    self.ready = True
                else:
                    if "pid" in message:  # after the exit of any earlier child with its pid, before its own
                        message["birth"] = self.exits.born(message["pid"])
                    with self._replied:
                        self._replies.append(message)
                        self._replied.notify_all()
        try:  # its socket closes as it exits: its exit status follows at once
            code = self.popen.wait(timeout=EXIT_STATUS_SECONDS)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        with self._replied:
            self.death = f"the fork server, pid {self.pid}, {how}"  # before its children read as gone
            self._replied.notify_all()
        self.exits.server_gone()

    def close(self) -> None:
        """Ends it and waits for it (its children run on; those asked to die with their parent die)."""
        with contextlib.suppress(OSError):
            self.popen.kill()
        self.popen.wait()


class ProcessStarter:
    """Starts entry modules as children of a warm fork server, or as fresh interpreters when it is off
    (fork_server_enabled). Creating one starts the fork server's imports in the background, in `env` (default:
    this process's environment), which decides its STARTUP_ENV settings; `start` blocks
    until the child exists (the first, until the imports are done), and is safe from several threads.
    `close` ends the fork server (children keep running; those asked to die with their parent die).

    A fork server that dies (any signal: an OOM killer may pick it, it holds torch) takes with it the
    children asked to die with their parent (ForkedChild.server_death names it); the others run on. The
    next `start` starts a new fork server, logs one line, and waits for its imports: one import and then a
    fork each brings several children back sooner than as many interpreters importing torch side by side,
    and forked children share the imported memory, which counts after an out-of-memory kill. A fork server
    that dies before its imports are done cannot start: from then on every child is a fresh interpreter."""

    _shared: tuple[int, "ProcessStarter"] | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> "ProcessStarter":
        """This process's common starter (one fork server per process, made on first use), for callers
        that are not handed one: a fork server is a process-wide resource, like a connection pool."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared[0] != os.getpid():
                cls._shared = (os.getpid(), cls())
                atexit.register(cls._shared[1].close)  # reaped here, so its CPU time counts as this process's
            return cls._shared[1]

    def __init__(self, preload: tuple[str, ...] = ENTRY_MODULES, env: Mapping[str, str] | None = None):
        self._lock = threading.Lock()  # one request at a time; held while a new fork server starts
        self._preload = preload
        self._env = dict(os.environ if env is None else env)
        self._server_env = {key: self._env.get(key) for key in STARTUP_ENV}
        self._server = _ForkServer(preload, self._env) if fork_server_enabled() else None

    def start(self, module: str, argv: list[str], *, prog: str | None = None, env: dict[str, str] | None = None,
              cwd: str | None = None, stdout: int | None = None, new_session: bool = False,
              parent_death_signal: int = 0) -> ForkedChild | subprocess.Popen:
        """Runs `module`.main(argv) as a child (see run_entry; `prog` names it in its messages): forked, or a
        fresh interpreter where `env` gives a STARTUP_ENV variable another value than this process had when
        it made the starter. `stdout`: a
        descriptor for its output and errors (else this process's); `new_session`: its own session, away
        from the terminal's signals; `parent_death_signal`: sent to it when the process that started it
        dies (through the fork server, which ends with that process). Returns a Popen or its look-alike;
        raises OSError if the child cannot be started (or, its fork server killed while forking it, may
        run without a parent death signal to end it)."""
        env = dict(os.environ if env is None else env)
        cwd = cwd or os.getcwd()
        request = {"module": module, "prog": prog or module, "argv": list(argv), "env": env, "cwd": cwd,
                   "new_session": new_session, "parent_death_signal": int(parent_death_signal)}
        if self._server is None or any(env.get(key) != value for key, value in self._server_env.items()):
            return self._spawn(request, stdout)
        data = json.dumps(request).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise OSError(f"a start request of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
        with self._lock:
            for _ in range(2):  # again only if the fork server died first, and with it any child of this request
                server = self._live_server()
                if server is None:
                    break
                reply = server.request(data, stdout, dies_with_it=bool(parent_death_signal))
                if reply is None:
                    continue
                if "error" in reply:
                    raise OSError(f"the fork server could not start {module}: {reply['error']}")
                return ForkedChild(reply["pid"], reply["birth"], [sys.executable, "-m", module, *argv], server,
                                   bool(parent_death_signal))
        return self._spawn(request, stdout)

    def _live_server(self) -> _ForkServer | None:
        """The fork server to ask (the lock held): a new one if the last died after its imports, None (fresh
        interpreters from now on) if it died before they were done."""
        server = self._server
        if server is None or server.death is None:
            return server
        if not server.ready:
            _LOGGER.warning("%s before its imports were done: every process starts as a fresh interpreter from "
                            "now on", server.death)
            self._server = None
            return None
        self._server = _ForkServer(self._preload, self._env)
        _LOGGER.warning("%s: started a new fork server, pid %d", server.death, self._server.pid)
        return self._server

    def close(self) -> None:
        """Ends the fork server and waits for it (children it started run on; those asked to die with their
        parent die); later `start` calls start fresh interpreters."""
        server, self._server = self._server, None
        if server is not None:
            server.close()

    @staticmethod
    def _spawn(request: dict, stdout: int | None) -> subprocess.Popen:
        parent, signum = os.getpid(), request["parent_death_signal"]

        def before_exec() -> None:
            if signum and _PRCTL is not None:
                _die_with_parent(parent, signum)

        return subprocess.Popen(
            [sys.executable, "-m", __name__, request["module"], request["prog"], *request["argv"]],
            env=request["env"], cwd=request["cwd"], stdout=stdout, stderr=None if stdout is None else subprocess.STDOUT,
            start_new_session=request["new_session"], preexec_fn=before_exec if signum else None)


def _die_with_parent(parent: int, signum: int) -> None:
    """In a new child of `parent`: the kernel sends it `signum` when its parent dies. A parent that died
    already (between the fork and this call) would never be signalled for: the child dies of `signum` now."""
    _PRCTL(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # signum was ignored or handled here


# -- the fork server's side ------------------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    """The fork server's loop: a child per request, an exit message per child reaped; returns at EOF."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup descriptor hears of it
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ, "request")
        selector.register(wake_r, selectors.EVENT_READ, "child")
        while True:
            for key, _ in selector.select():
                if key.data == "child":
                    os.read(wake_r, 4096)
                    _report_exits(sock)
                    continue
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 1)
                if not data:
                    return
                _answer(sock, json.loads(data), fds[0] if fds else None, (wake_r, wake_w, selector.fileno()))


def _answer(sock: socket.socket, request: dict, out: int | None, own: tuple[int, ...]) -> None:
    server = os.getpid()
    gc.freeze()
    try:
        pid = os.fork()
    except OSError as exc:
        sock.send(json.dumps({"error": str(exc)}).encode())
        return
    if pid == 0:
        with contextlib.suppress(BaseException):
            signal.set_wakeup_fd(-1)
            for fd in own:
                os.close(fd)
            sock.close()
            _become(request, out, server)
        os._exit(1)
    if out is not None:
        os.close(out)
    sock.send(json.dumps({"pid": pid}).encode())


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become(request: dict, out: int | None, server: int) -> typing.NoReturn:
    """In the child forked by the fork server `server`: become the process `python -m torchps.forkserver
    MODULE` would be, and run it."""
    if request["parent_death_signal"] and _PRCTL is not None:
        _die_with_parent(server, request["parent_death_signal"])
    gc.enable()
    # A process group of its own at least: in the fork server's (orphaned: its parent is in another session),
    # any member's exit would send SIGHUP and SIGCONT to every member, waking one stopped on purpose.
    if request["new_session"]:
        os.setsid()
    else:
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    if out is not None:
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
    # What ps and top show; before the environment changes (setproctitle makes its room in the first one).
    setproctitle.setproctitle(" ".join([request["prog"], *request["argv"]]))
    env = request["env"]
    sys.stdout = _text_stream(1, write_through=bool(env.get("PYTHONUNBUFFERED")))
    sys.stderr = _text_stream(2, write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` puts the folder it was started in first
    run_entry(request["module"], request["argv"], request["prog"])


def _text_stream(fd: int, *, write_through: bool) -> io.TextIOWrapper:
    """A line-buffered text stream on `fd`, as a fresh interpreter makes for its standard streams."""
    return io.TextIOWrapper(open(fd, "wb", buffering=0 if write_through else -1, closefd=False),  # noqa: SIM115
                            encoding="utf-8", errors="backslashreplace", line_buffering=True,
                            write_through=write_through)


def _server_main(fd: int, preload: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the process that started it
    # As Python's gc documentation advises for a process that forks without exec: the collector off here, what
    # exists frozen before each fork (no child's collection walks it, nor writes to its pages: they stay
    # shared), and on again in each child (_become).
    gc.disable()
    for module in preload:
        __import__(module)
    with socket.socket(fileno=fd) as sock:
        sock.send(json.dumps({"ready": os.getpid()}).encode())
        _serve(sock)
    os._exit(0)  # at once: children asked to die with it are waiting for that


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:  # the fork server: python -m torchps.forkserver --serve FD MODULE...
        _server_main(int(sys.argv[2]), sys.argv[3:])
    else:  # the fork server off: python -m torchps.forkserver MODULE PROG ARGS...
        run_entry(sys.argv[1], sys.argv[3:], sys.argv[2])
