"""torchps.forkserver: children forked from one warm interpreter are real processes of their own.

Shards started by LocalCluster and ps-launch come from it, so what holds for a process started with
`python -m` must hold here: its own pid, memory and exit code, death alone under SIGKILL, a restart on the
same port, the environment, folder and output it was given, and `python -m`'s exit codes.
"""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import process_state, wait_until

from torchps.client import PSClient
from torchps.forkserver import DISABLE_ENV, STARTUP_ENV, ForkedChild, ProcessStarter, _die_with_parent
from torchps.worker.local_cluster import LocalCluster

TIMEOUT = 30.0

PROBE = textwrap.dedent("""
    import os, sys

    def main(argv):
        print("cwd", os.getcwd())
        print("env", os.environ.get("PROBE_VALUE"), "FOREIGN" in os.environ)
        print("argv", argv, sys.argv[1:])
        sys.stdout.flush()
        os.write(2, b"stderr too\\n")
        if argv[0] == "raise":
            raise RuntimeError("the entry failed")
        if argv[0] == "exit":
            sys.exit(int(argv[1]))
        if argv[0] == "wait":
            sys.stdin.read()  # /dev/null: returns at once
            signal_wait()
        if argv[0] == "gc":
            import gc
            print("gc", gc.isenabled(), gc.get_freeze_count(), "torch" in sys.modules)
            return 0
        return int(argv[0])

    def signal_wait():
        import signal
        signal.pause()
""")


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "forkserver_probe.py").write_text(PROBE)
    return tmp_path


def run_probe(starter: ProcessStarter, folder, argv, env=None, **options):
    """The probe started with `env` over this process's STARTUP_ENV settings (forked unless `env` changes one)."""
    log = folder / f"out-{'-'.join(argv)}.log"
    startup = {key: os.environ[key] for key in STARTUP_ENV if key in os.environ}
    with open(log, "wb") as out:
        child = starter.start("forkserver_probe", argv, env={**startup, "PROBE_VALUE": "given", **(env or {})},
                              cwd=str(folder), stdout=out.fileno(), **options)
    return child, log


def test_a_child_gets_the_folder_environment_arguments_and_output_it_was_given(probe, monkeypatch):
    monkeypatch.setenv("FOREIGN", "this process's, not the child's")
    child, log = run_probe(ProcessStarter.shared(), probe, ["7", "x"])
    assert isinstance(child, ForkedChild)
    assert child.wait(TIMEOUT) == 7
    assert child.pid != os.getpid()
    assert log.read_text().splitlines() == [
        f"cwd {probe}", "env given False", "argv ['7', 'x'] ['7', 'x']", "stderr too"]


def test_a_forked_child_collects_its_garbage_and_leaves_the_servers_imports_frozen(probe):
    """The fork server imports with the collector off and freezes what exists before each fork (Python's gc
    documentation's advice for fork without exec): in its child the collector is on again, and torch's
    objects, imported already, lie outside each of its collections. A fresh interpreter (another GRPC_VERBOSITY)
    has its collector on after its imports too, and nothing frozen."""
    starter = ProcessStarter.shared()
    same = os.environ.get("GRPC_VERBOSITY")
    forked, forked_log = run_probe(starter, probe, ["gc", "forked"],
                                   env={} if same is None else {"GRPC_VERBOSITY": same})
    fresh, fresh_log = run_probe(starter, probe, ["gc", "fresh"],
                                 env={"GRPC_VERBOSITY": "debug" if same != "debug" else "info"})
    assert isinstance(forked, ForkedChild) and isinstance(fresh, subprocess.Popen)
    assert forked.wait(TIMEOUT) == 0 and fresh.wait(TIMEOUT) == 0
    (_, enabled, frozen, torch_imported), = [line.split() for line in forked_log.read_text().splitlines()
                                              if line.startswith("gc ")]
    assert (enabled, torch_imported) == ("True", "True") and int(frozen) > 100_000, forked_log.read_text()
    (_, enabled, frozen, _), = [line.split() for line in fresh_log.read_text().splitlines() if line.startswith("gc ")]
    assert (enabled, frozen) == ("True", "0"), fresh_log.read_text()


@pytest.mark.parametrize("argv,code", [(["0"], 0), (["exit", "3"], 3), (["raise"], 1)],
                         ids=["returns 0", "sys.exit(3)", "raises"])
def test_exit_codes_are_python_m_s(probe, argv, code):
    child, log = run_probe(ProcessStarter.shared(), probe, argv)
    assert child.wait(TIMEOUT) == code
    if code == 1:
        assert "RuntimeError: the entry failed" in log.read_text()


def test_sigkill_ends_one_child_alone_and_the_exit_code_names_the_signal(probe):
    starter = ProcessStarter.shared()
    first, _ = run_probe(starter, probe, ["wait"])
    second, _ = run_probe(starter, probe, ["wait"])
    assert first.pid != second.pid
    wait_until(lambda: _command_line(second.pid).startswith("forkserver_probe wait"), TIMEOUT,
               "the child to name itself in ps")
    first.send_signal(signal.SIGKILL)
    assert first.wait(TIMEOUT) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        second.wait(0.2)
    assert second.poll() is None
    second.terminate()
    assert second.wait(TIMEOUT) == -signal.SIGTERM


def test_a_child_stopped_on_purpose_stays_stopped_when_another_exits(probe):
    """SIGSTOP stands for a hung host in many tests. Children sharing an orphaned process group would all get
    SIGHUP and SIGCONT from the kernel when any member exits; each child has a group of its own."""
    starter = ProcessStarter.shared()
    stopped, _ = run_probe(starter, probe, ["wait"])
    other, _ = run_probe(starter, probe, ["wait"])
    wait_until(lambda: _command_line(stopped.pid).startswith("forkserver_probe"), TIMEOUT, "the child to run")
    stopped.send_signal(signal.SIGSTOP)
    wait_until(lambda: process_state(stopped.pid) == "T", TIMEOUT, "the child to stop")
    other.kill()
    assert other.wait(TIMEOUT) == -signal.SIGKILL
    try:
        assert process_state(stopped.pid) == "T" and stopped.poll() is None, "another child's exit woke or ended it"
    finally:
        stopped.kill()
        stopped.send_signal(signal.SIGCONT)
    assert stopped.wait(TIMEOUT) == -signal.SIGKILL


def test_a_shard_killed_and_restarted_serves_again_on_its_port_while_the_other_goes_on():
    with LocalCluster(2) as local, PSClient(local.cluster, connect_timeout=10.0) as ps:
        assert all(isinstance(proc, ForkedChild) for proc in local.procs)
        assert len({proc.pid for proc in local.procs} | {os.getpid()}) == 3
        port = local.ports[0]
        assert local.kill_ps(0) == -signal.SIGKILL
        assert ps.status(1).index == 1
        local.start_ps(0)
        assert local.ports[0] == port
        assert ps.status(0).index == 0


@pytest.mark.parametrize("server_args, threads", [([], 1), (["--torch-threads", "2"], 2)])
def test_local_shards_compute_on_one_torch_thread_unless_told_otherwise(server_args, threads):
    """Shards that share the machine with each other and their clients: torch's default (one thread per core in
    every process) would spend CPU spinning at the end of each parallel step."""
    with LocalCluster(1, server_args=server_args) as local:
        line = f"ps 0 uses {threads} torch thread(s) for updates and lookups"
        wait_until(lambda: line in local.log(0), TIMEOUT, f"'{line}' in the shard's log")


def test_a_child_that_needs_other_startup_settings_is_a_fresh_interpreter(probe):
    """gRPC reads GRPC_VERBOSITY when it is imported, in the fork server: a child asking for another value (a
    debug log) must start afresh to get it; one asking for the same is forked."""
    starter = ProcessStarter.shared()
    same = os.environ.get("GRPC_VERBOSITY")
    forked, _ = run_probe(starter, probe, ["0"], env={} if same is None else {"GRPC_VERBOSITY": same})
    fresh, log = run_probe(starter, probe, ["0"], env={"GRPC_VERBOSITY": "debug" if same != "debug" else "info"})
    assert isinstance(forked, ForkedChild) and isinstance(fresh, subprocess.Popen)
    assert forked.wait(TIMEOUT) == fresh.wait(TIMEOUT) == 0
    assert "env given False" in log.read_text()


def test_with_the_fork_server_off_children_are_fresh_interpreters(probe, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.setenv("PYTHONPATH", str(probe))  # a fresh interpreter finds the probe through it
    child, log = run_probe(ProcessStarter(), probe, ["0"], env={"PYTHONPATH": str(probe)})
    assert isinstance(child, subprocess.Popen)
    assert child.wait(TIMEOUT) == 0
    assert "env given False" in log.read_text()


def test_a_child_asked_to_die_with_its_parent_dies_when_the_parent_is_killed(probe):
    # The parent: a process that starts the probe through its own fork server and reports the probe's pid.
    script = textwrap.dedent(f"""
        import os, signal, sys
        from torchps.forkserver import ProcessStarter
        child = ProcessStarter().start("forkserver_probe", ["wait"], cwd={str(probe)!r},
                                       stdout=os.open(os.devnull, os.O_WRONLY), parent_death_signal=signal.SIGKILL)
        print(child.pid, flush=True)
        sys.stdin.read()
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        os.kill(pid, 0)  # alive
        parent.kill()
        parent.wait(TIMEOUT)
        wait_until(lambda: not _alive(pid), TIMEOUT, f"the child {pid} to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_killed_fork_server_is_replaced_and_takes_only_the_children_asked_to_die_with_it(probe, caplog):
    """What an OOM killer may do (the fork server holds torch): SIGKILL it. A child asked to die with its parent
    dies with it and names it as the cause; one not asked runs on (only its parent could read its exit code: once
    gone it reads as killed); the next start forks from a new fork server, one log line saying so."""
    starter = ProcessStarter(preload=())  # a fork server of its own, quick to start: the probe needs no torch
    tied = untied = None
    try:
        tied, _ = run_probe(starter, probe, ["wait", "tied"], parent_death_signal=signal.SIGKILL)
        untied, _ = run_probe(starter, probe, ["wait", "untied"])
        server = parent_of(tied.pid)
        assert server == parent_of(untied.pid) != os.getpid()
        os.kill(server, signal.SIGKILL)
        assert tied.wait(TIMEOUT) == -signal.SIGKILL
        with caplog.at_level(logging.WARNING, logger="torchps.forkserver"):
            again, log = run_probe(starter, probe, ["7", "again"])
            assert isinstance(again, ForkedChild) and again.wait(TIMEOUT) == 7
        assert "argv ['7', 'again'] ['7', 'again']" in log.read_text()
        [started] = [r.getMessage() for r in caplog.records if r.name == "torchps.forkserver"]
        assert re.fullmatch(rf"the fork server, pid {server}, was killed by signal 9: started a new fork server, "
                            r"pid \d+", started), started
        assert tied.server_death == f"the fork server, pid {server}, was killed by signal 9"
        assert untied.poll() is None and untied.server_death is None
        untied.kill()
        assert untied.wait(TIMEOUT) == -signal.SIGKILL and untied.server_death is None
    finally:
        starter.close()
        for child in (tied, untied):
            if child is not None:
                child.kill()  # a test that failed midway leaves none behind


def test_a_fork_server_that_dies_before_it_starts_anything_leaves_every_child_to_a_fresh_interpreter(
        probe, caplog, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(probe))  # a fresh interpreter finds the probe through it
    starter = ProcessStarter(preload=("no_such_module",))  # its imports fail: it exits at once
    try:
        with caplog.at_level(logging.WARNING, logger="torchps.forkserver"):
            first, _ = run_probe(starter, probe, ["7"])
            second, _ = run_probe(starter, probe, ["0"])
        assert isinstance(first, subprocess.Popen) and isinstance(second, subprocess.Popen)
        assert first.wait(TIMEOUT) == 7 and second.wait(TIMEOUT) == 0
        [fallen_back] = [r.getMessage() for r in caplog.records if r.name == "torchps.forkserver"]
        assert re.fullmatch(r"the fork server, pid \d+, exited with code 1 before its imports were done: every "
                            r"process starts as a fresh interpreter from now on", fallen_back), fallen_back
    finally:
        starter.close()


@pytest.mark.parametrize("parent_gone", [False, True])
def test_a_child_whose_parent_died_before_it_asked_to_die_with_it_dies_at_once(parent_gone):
    """The fork server's child asks for its parent-death signal just after the fork: a parent that died in between
    is never signalled for, so the child must see it gone and die then (the test above met that race once, on a
    loaded machine: the child lived on). Here the parent it expects is another process than its own."""
    pid = os.fork()
    if pid == 0:
        try:
            expected = os.getpid() if parent_gone else os.getppid()  # itself: never its own parent
            _die_with_parent(expected, signal.SIGKILL)
            os._exit(0)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == (-signal.SIGKILL if parent_gone else 0)


def _command_line(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return cmdline.read().replace(b"\0", b" ").decode()


def parent_of(pid: int) -> int:
    """Its parent's pid, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    return process_state(pid) not in ("", "Z")


# Run in a pid namespace of its own, where nothing else forks: on the shared machine other processes and threads take
# pids all the time, and the path from the write of ns_last_pid (the pid the kernel gave last: the next fork gets the
# one after) through the fork server to its fork is long enough for one of them to take the pid first.
PID_REUSE = textwrap.dedent("""
    import json, os, signal, sys, time
    from torchps.forkserver import STARTUP_ENV, ForkedChild, ProcessStarter

    folder, timeout = sys.argv[1], float(sys.argv[2])
    starter = ProcessStarter.shared()

    def start(argv):
        with open(os.path.join(folder, "out-" + "-".join(argv) + ".log"), "wb") as out:
            startup = {key: os.environ[key] for key in STARTUP_ENV if key in os.environ}
            return starter.start("forkserver_probe", argv, env={**startup, "PROBE_VALUE": "given"}, cwd=folder,
                                 stdout=out.fileno())

    def command_line(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\\0", b" ").decode()

    first = start(["exit", "0"])
    seen = {"first_exit": first.wait(timeout)}
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(first.pid - 1))
    second = start(["wait"])
    seen["same_pid"] = second.pid == first.pid
    seen["forked"] = isinstance(first, ForkedChild) and isinstance(second, ForkedChild)
    seen["second_running"], seen["first_after"] = second.poll(), first.poll()
    deadline = time.monotonic() + timeout
    while not command_line(second.pid).startswith("forkserver_probe wait") and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["command_line"] = command_line(second.pid)
    seen["second_still_running"] = second.poll()
    second.terminate()
    seen["second_exit"], seen["first_at_end"] = second.wait(timeout), first.poll()
    print(json.dumps(seen))
""")


def test_a_child_given_the_pid_of_a_child_that_exited_runs_on(probe):
    """The kernel gives an exited child's pid to a later fork (made to happen here through ns_last_pid; over a
    long run it happens by itself once pid_max wraps): the later child runs on, and its own exit is its own.
    Before children were told apart by birth, it read as exited with the earlier child's code at once."""
    unshare = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        subprocess.run([*unshare, "true"], check=True, capture_output=True, timeout=TIMEOUT)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"no pid namespace of its own here ({error}): a pid cannot be given again on purpose")
    (probe / "pid_reuse.py").write_text(PID_REUSE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([*unshare, sys.executable, str(probe / "pid_reuse.py"), str(probe), str(TIMEOUT)],
                          env=env, capture_output=True, text=True, timeout=4 * TIMEOUT)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["first_exit"] == 0 and seen["same_pid"] and seen["forked"]
    assert seen["second_running"] is None and seen["first_after"] == 0
    assert seen["command_line"].startswith("forkserver_probe wait") and seen["second_still_running"] is None
    assert seen["second_exit"] == -signal.SIGTERM and seen["first_at_end"] == 0
