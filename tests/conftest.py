"""Shared fixtures: real ps-server processes on 127.0.0.1 (see torchps.worker.local_cluster).

tests/ is put on sys.path, so every test module can `from helpers import wait_until`.
"""

import json
import os
import pathlib
import sys

import pytest
import torch

# Before torchps is imported here or in a shard this suite starts: every shard lock is checked against
# ps_server/locks.py's LOCK_ORDER, in this process's core tests and in the ps-server processes (they inherit it).
os.environ.setdefault("TORCHPS_LOCK_CHECK", "1")
# The suite starts hundreds of interpreters (the xdist workers, ps-launch, ps-worker, benchmarks, examples): they
# keep the bytecode they compile, as .ci/run has them do, even where the environment turns that off
# (PYTHONDONTWRITEBYTECODE=1): else each compiles every module of the tree that changed since the last install.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

from torchps.client import PSClient  # noqa: E402 - after the checker is turned on
from torchps.worker.local_cluster import LocalCluster  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
# The tests' own tensor work on one thread: the xdist workers share the cores with the shards they start, and
# torch's default (a thread per core in every process) spends CPU in OpenMP's idle threads spinning.
torch.set_num_threads(1)

LONG_TESTS = pathlib.Path(__file__).with_name("long_tests.json")  # seconds of the longest tests in a full run


LOG_TAIL = 3000  # characters of each log a failed test's report shows
LOGS_SHOWN = 12


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed and used tmp_path gets the tails of the logs its processes wrote there (ps-server,
    backups, workers) in its report: CI keeps nothing else of a run that failed once."""
    outcome = yield
    report = outcome.get_result()
    folder = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when != "call" or not report.failed or folder is None:
        return
    logs = [log for log in sorted(pathlib.Path(folder).rglob("*.log")) if not log.stem.isdigit()]  # not RocksDB's
    for log in logs[:LOGS_SHOWN]:
        try:
            report.sections.append((f"log {log.relative_to(folder)}", log.read_text(errors="replace")[-LOG_TAIL:]))
        except OSError:
            continue


def pytest_collection_modifyitems(config, items):
    """Under xdist (-n N, --dist worksteal) the longest tests start first, spread over the workers: worksteal
    hands each worker a contiguous slice of the collected order (sized as it cuts them) and idle workers steal
    from the slices' ends, so each slice begins with its share of the long tests (longest first, each to the
    slice with the fewest seconds so far) and goes on in file order. A long test and the tests of its file that
    share one of its module-scoped fixtures (a played job, a reference run) go to one slice together, one after
    the other: on two workers the fixture would run twice. Only the order changes: every test still runs, alone
    and in any order. Without xdist the order stays the files'."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if not workers or workers < 2 or not LONG_TESTS.is_file():
        return
    seconds = json.loads(LONG_TESTS.read_text())["seconds"]
    sizes, left = [], len(items)
    for i in range(workers):  # as worksteal cuts the first slices: what is left over the workers left
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    slices: list[list] = [[] for _ in sizes]
    totals = [0.0] * workers
    for group in _long_groups(items, seconds):
        weight = max(seconds.get(item.nodeid, 0.0) for item in group)
        while group:
            open_slices = [i for i in range(workers) if len(slices[i]) < sizes[i]]
            target = min(open_slices, key=lambda i: (len(slices[i]) + len(group) > sizes[i], totals[i], i))
            taken = group[:sizes[target] - len(slices[target])]  # the whole group wherever it fits
            slices[target].extend(taken)
            totals[target] += weight
            group = group[len(taken):]
    placed = {id(item) for part in slices for item in part}
    rest = iter(item for item in items if id(item) not in placed)
    for i, size in enumerate(sizes):
        slices[i].extend(next(rest) for _ in range(size - len(slices[i])))
    items[:] = [item for part in slices for item in part]


def _long_groups(items, seconds: dict) -> list[list]:
    """The long tests (in `seconds`), each with the tests of its file that share a module-scoped fixture with
    it, in file order; groups longest first."""
    def shared(item) -> set:
        # pytest keeps the fixtures' definitions per test here (no public accessor): the suite's own (a baseid
        # in tests/, not a plugin's such as tmp_path_factory) that are set up once a module or more.
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        return {(str(item.path), name) for name, chain in defs.items()
                if chain and chain[-1].baseid and chain[-1].scope in ("module", "package", "session")}

    fixtures = {id(item): shared(item) for item in items}
    groups: list[list] = []
    grouped: set[int] = set()
    for item in sorted((item for item in items if item.nodeid in seconds), key=lambda it: -seconds[it.nodeid]):
        if id(item) in grouped:
            continue
        keys = fixtures[id(item)]
        group = [other for other in items if other is item or (keys & fixtures[id(other)] and id(other) not in grouped)]
        grouped.update(id(other) for other in group)
        groups.append(group)
    return groups


PRIVATE_KEY = ".key"  # how ps-certs, make_job_credentials and the job folders name a private key


def _remove_keys(folder: pathlib.Path) -> None:
    """Every private key below `folder`; a folder that went meanwhile (or cannot be read) is passed over."""
    for parent, _, names in os.walk(folder):
        for name in names:
            if name.endswith(PRIVATE_KEY):
                pathlib.Path(parent, name).unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _no_keys_left(request):
    """Once a test has ended, passed or failed, the private keys it wrote into its tmp_path are removed (the rest
    stays for a look; pyproject's tmp_path_retention_policy keeps only failed tests' folders)."""
    yield
    if (path := request.node.funcargs.get("tmp_path")) is not None and path.is_dir():
        _remove_keys(path)


@pytest.fixture(scope="session", autouse=True)
def _no_keys_left_in_the_session(tmp_path_factory):
    """At the end of the session, the private keys in every temporary folder it made (module-scoped ones too)."""
    yield
    _remove_keys(tmp_path_factory.getbasetemp())


@pytest.fixture
def local_cluster():
    """Factory: local_cluster(num_ps=1, **kwargs) -> a started LocalCluster, stopped after the test."""
    started = []

    def make(num_ps: int = 1, **kwargs) -> LocalCluster:
        local = LocalCluster(num_ps, **kwargs)
        started.append(local)
        local.start()
        return local

    yield make
    for local in started:
        local.stop()


@pytest.fixture(scope="module")
def shared_cluster():
    """Two shards shared by every test of a module (tests must use distinct variable names)."""
    with LocalCluster(2) as local:
        yield local


@pytest.fixture
def client(shared_cluster):
    """A PSClient on the module's shared 2-shard cluster, with a short connect timeout."""
    with PSClient(shared_cluster.cluster, connect_timeout=10.0) as ps:
        yield ps
