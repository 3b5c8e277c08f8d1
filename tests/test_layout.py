"""Who imports whom: worker -> client -> torchps (the contract) and ps_server -> torchps.

Each rule is checked in a fresh interpreter, by what an import leaves in sys.modules.
"""

import json
import subprocess
import sys

import pytest

from torchps.specs import OPTIMIZER_NAMES, ROW_OPTIMIZER_NAMES

# The shard's pure core: tested with threads, never imports grpc.
CORE = [f"torchps.ps_server.{name}" for name in (
    "store", "reads", "optimizers", "modes", "membership", "ledger", "aggregation", "gate", "waits", "snapshots",
    "coordinator", "pushes", "background", "recording", "checkpoint", "journal", "journal_log", "row_optimizers",
    "embeddings",
    "tables")]


def loaded_after(statement: str) -> list[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def test_client_imports_nothing_from_the_server_or_the_worker():
    modules = loaded_after("import torchps.client")
    assert not [m for m in modules if m.startswith(("torchps.ps_server", "torchps.worker"))]


def test_server_imports_nothing_from_the_client_or_the_worker():
    modules = loaded_after("import torchps.ps_server.__main__")
    assert not [m for m in modules if m.startswith(("torchps.client", "torchps.worker"))]


@pytest.mark.parametrize("module", CORE)
def test_core_never_imports_grpc(module):
    modules = loaded_after(f"import {module}")
    assert "grpc" not in modules
    assert not [m for m in modules if m.startswith("torchps.ps_server.servicer")]


def test_contract_optimizer_names_match_the_shards():
    from torchps.ps_server.optimizers import OPTIMIZERS

    assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES


def test_contract_row_optimizer_names_match_the_shards():
    from torchps.ps_server.row_optimizers import ROW_OPTIMIZERS

    assert tuple(ROW_OPTIMIZERS) == ROW_OPTIMIZER_NAMES
