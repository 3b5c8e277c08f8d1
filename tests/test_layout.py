"""Who imports whom: worker -> client -> torchps (the contract) and ps_server -> torchps.

Each rule is checked by what an import leaves in sys.modules of an interpreter that had imported nothing of
the project: a child forked, per check, from one interpreter that imported only torch and numpy (the
third-party weight every module shares, and no subject of any rule here).
"""

import json
import subprocess
import sys

import pytest

# Reads one statement per line (JSON); for each, forks a child that runs it and answers one line: the JSON
# list of sys.modules after it, or {"error": traceback}.
FORKING_IMPORTER = r"""
import json, os, sys, traceback
import numpy, torch
assert not [m for m in sys.modules if m.startswith(("grpc", "torchps"))], "the base imported a subject"
for line in sys.stdin:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            exec(json.loads(line), {})
            answer = json.dumps(sorted(sys.modules))
        except BaseException:
            answer = json.dumps({"error": traceback.format_exc()})
        with os.fdopen(write_end, "w") as out:
            out.write(answer)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        text = answer.read()
    os.waitpid(pid, 0)
    print(text, flush=True)
"""


@pytest.fixture(scope="module")
def importer():
    proc = subprocess.Popen([sys.executable, "-c", FORKING_IMPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.fixture
def loaded_after(importer):
    """loaded_after(statement) -> sorted sys.modules once `statement` ran in a fresh child."""
    def run(statement: str) -> list[str]:
        importer.stdin.write(json.dumps(statement) + "\n")
        importer.stdin.flush()
        answer = json.loads(importer.stdout.readline())
        assert not isinstance(answer, dict), answer["error"]
        return answer
    return run

from torchps.specs import OPTIMIZER_NAMES, ROW_OPTIMIZER_NAMES

# The shard's pure core: tested with threads, never imports grpc.
CORE = [f"torchps.ps_server.{name}" for name in (
    "store", "reads", "optimizers", "modes", "membership", "ledger", "aggregation", "gate", "waits", "snapshots",
    "coordinator", "pushes", "background", "recording", "checkpoint", "journal", "journal_log", "row_optimizers",
    "embeddings", "tables", "failstop")]


def test_client_imports_nothing_from_the_server_or_the_worker(loaded_after):
    modules = loaded_after("import torchps.client")
    assert not [m for m in modules if m.startswith(("torchps.ps_server", "torchps.worker"))]


def test_server_imports_nothing_from_the_client_or_the_worker(loaded_after):
    modules = loaded_after("import torchps.ps_server.__main__, torchps.ps_server.daemon")
    assert not [m for m in modules if m.startswith(("torchps.client", "torchps.worker"))]


def test_the_command_lines_flags_import_neither_torch_nor_grpc():
    """ps-worker's flags, ps-server's command line and all of ps-launch until their flags, cluster and
    credentials are checked: a usage error is one line at once. (A fresh interpreter: the forking importer's
    base has torch.)"""
    code = ("import json, sys, torchps.worker.flags, torchps.worker.launch, torchps.ps_server.__main__; "
            "print(json.dumps(sorted(sys.modules)))")
    modules = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                        text=True).stdout)
    assert not [m for m in modules if m.split(".")[0] in ("torch", "grpc")]


@pytest.mark.parametrize("module", CORE)
def test_core_never_imports_grpc(module, loaded_after):
    modules = loaded_after(f"import {module}")
    assert "grpc" not in modules
    assert not [m for m in modules if m.startswith("torchps.ps_server.servicer")]


def test_contract_optimizer_names_match_the_shards():
    from torchps.ps_server.optimizers import OPTIMIZERS

    assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES


def test_contract_row_optimizer_names_match_the_shards():
    from torchps.ps_server.row_optimizers import ROW_OPTIMIZERS

    assert tuple(ROW_OPTIMIZERS) == ROW_OPTIMIZER_NAMES
