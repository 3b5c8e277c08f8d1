"""ps-worker's and ps-launch's --dynamic-sharding: checked with the other flags, before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from torchps.errors import ClusterConfigError
from torchps.worker.flags import finish_training_flags, parse_args


def _flags(*extra: str):
    return parse_args(["--entry", "pkg.mod:task", *extra])


@pytest.mark.parametrize("extra, message", [
    (["--dynamic-sharding", "0"], "--dynamic-sharding must be >= 1"),
    (["--dynamic-sharding", "500", "--mode", "sync"], "--dynamic-sharding cannot be combined with --mode sync"),
    (["--dynamic-sharding", "500", "--mode", "ssp"], "--dynamic-sharding cannot be combined with --mode ssp"),
    (["--dynamic-sharding", "500", "--dense", "allreduce"], "cannot be combined with --dense allreduce"),
    (["--dynamic-sharding", "500", "--nproc-per-host", "2"], "cannot be combined with --nproc-per-host"),
])
def test_flags_it_cannot_honour_are_refused(extra, message):
    with pytest.raises(ClusterConfigError, match=message):
        finish_training_flags(_flags(*extra))


def test_off_by_default_and_taken_in_async_mode():
    assert finish_training_flags(_flags()).dynamic_sharding is None
    assert finish_training_flags(_flags("--dynamic-sharding", "500")).dynamic_sharding == 500


def test_ps_launch_refuses_a_bad_value_in_one_line_before_starting_anything():
    result = subprocess.run([sys.executable, "-m", "torchps.worker.launch", "--dynamic-sharding", "500", "--mode",
                             "sync", "--insecure"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    assert "--dynamic-sharding cannot be combined with --mode sync" in result.stderr, result.stderr
    assert result.stdout == "", result.stdout
