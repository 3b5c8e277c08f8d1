"""Who imports whom: worker -> client -> torchps (the contract) and ps_server -> torchps; no import cycles;
the shard's modules never reach into each other's private fields.

Each import rule is checked by what an import leaves in sys.modules of an interpreter that had imported
nothing of the project: a child forked, per check, from one interpreter that imported only torch and numpy
(the third-party weight every module shares, and no subject of any rule here). Cycles and private fields are
read from the sources (ast).
"""

import ast
import json
import pathlib
import subprocess
import sys
import tomllib

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
    "coordinator", "pushes", "background", "recording", "replay", "bookkeeping", "step_clock", "locks",
    "checkpoint", "journal", "journal_log", "row_optimizers", "embeddings", "tables", "failstop", "dataqueue",
    "queue_desk", "layout", "moves")]


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


# -- import cycles and private fields, read from the sources -------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Private fields reached on purpose, by file: {(file, expression): why}.
FOREIGN_PRIVATE_FIELDS: dict[tuple[str, str], str] = {
    # The lock-order checker wraps a threading.RLock; a threading.Condition waiting on it calls these hooks,
    # which must hand the wait over to the RLock's own (its every level released, then taken back).
    ("locks.py", "self._lock._release_save"): "threading.Condition's protocol with the RLock it waits on",
    ("locks.py", "self._lock._acquire_restore"): "threading.Condition's protocol with the RLock it waits on",
}


def project_modules() -> dict[str, pathlib.Path]:
    """{dotted module name: its file} for every module of every package pyproject.toml maps to a folder."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, folder in package_dirs.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imported_modules(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file: at module level, in functions and classes, and
    under `if TYPE_CHECKING:` too (a module that names another's types for its signatures depends on it as
    much as one that calls it; the cycles #22 found closed through such imports and imports in functions)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (the strongly connected
    components of more than one module), each sorted, in order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(groups)


def shortest_cycle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """The shortest cycle through group[0] inside `group` (breadth first): modules each importing the next,
    the last the first."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for other in sorted(graph[module] & members):
                if other == start:
                    return paths[module]
                if other not in paths:
                    paths[other] = paths[module] + [other]
                    following.append(other)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {group}")


def test_the_cycle_finder_names_a_cycle_and_passes_a_chain():
    graph = {"a": {"b", "c"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert shortest_cycle(graph, ["a", "b", "c"]) == ["a", "c"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_among_the_projects_modules():
    """Every import counts, wherever it stands in a module (see imported_modules)."""
    modules = project_modules()
    assert {"torchps.codec", "torchps.client.client", "torchps.ps_server.coordinator",
            "torchps.worker.trainer"} <= set(modules)
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    groups = import_cycles(graph)
    assert not groups, "modules that import each other:\n" + "\n".join(
        f"{', '.join(group)} (e.g. {' -> '.join(shortest_cycle(graph, group) + group[:1])})" for group in groups)


def test_no_ps_server_module_reaches_into_another_objects_private_fields():
    """Between the shard's modules an object's state is reached through its interface only: no `x._name`
    where x is neither self, cls nor super() (the object's own, as a subclass extends it), nor a module the
    file imports whole, as in os._exit."""
    reached = []
    for path in sorted((ROOT / "ps_server").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        modules = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, ast.Import) for alias in node.names}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"} | modules:
                continue
            if isinstance(node.value, ast.Call) and ast.unparse(node.value) == "super()":
                continue
            if (path.name, ast.unparse(node)) not in FOREIGN_PRIVATE_FIELDS:
                reached.append((path.name, node.lineno, ast.unparse(node)))
    assert not reached, "private fields of other objects:\n" + "\n".join(
        f"ps_server/{name}:{line}: {expression}" for name, line, expression in sorted(reached))
