"""bench/cpu_of.py counts the CPU of a command and of the processes it starts, and passes its exit code on."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A parent that starts a child burning CPU for half a second, waits, then exits with code 3.
BURN = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
        "'import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass']); sys.exit(3)")


def test_cpu_of_counts_a_child_process_and_returns_the_commands_exit_code(tmp_path):
    out = tmp_path / "cpu.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_of.py"), "--json", str(out), "--every", "0.05",
                          "--", sys.executable, "-c", BURN], capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    result = json.loads(out.read_text())
    assert result["exit_code"] == 3 and result["wall_s"] >= 0.5
    # the parent and its child (a process read between its fork and its exec has the forking program's name)
    assert sum(program["processes"] for program in result["by_program"].values()) >= 2, result
    assert result["by_program"]["python -c"]["cpu_s"] >= 0.4 and result["cpu_s"] >= 0.4, result  # the child's
    assert "total" in run.stderr


def test_by_test_gives_a_child_s_cpu_to_the_test_its_xdist_worker_runs(tmp_path):
    """A parent titled as an xdist worker running a test (as pytest-xdist titles its workers) starts the burning
    child: the child's CPU is that test's, and its file's."""
    worker = ("import setproctitle; setproctitle.setproctitle('[pytest-xdist running] tests/x.py::test_burn'); "
              + BURN)
    out = tmp_path / "cpu.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_of.py"), "--json", str(out), "--every", "0.05",
                          "--by-test", "5", "--", sys.executable, "-c", worker],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr
    result = json.loads(out.read_text())
    assert result["by_test"]["tests/x.py::test_burn"] >= 0.4, result
    assert result["by_file"]["tests/x.py"] >= 0.4, result
    assert "tests/x.py::test_burn" in run.stderr
