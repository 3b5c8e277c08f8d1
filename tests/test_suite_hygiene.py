"""The suite's own hygiene (issue #39, item 8): every test outlasts the subprocess waits it allows (else
pytest-timeout kills it first, under load, with the subprocess's output lost), and a test that mints credentials
leaves no private key behind in pytest's temporary folders (conftest.py's `_no_keys_left`)."""

import ast
import pathlib
import subprocess
import sys
import tomllib

import pytest

from torchps.certs import make_job_credentials
from torchps.cluster import Cluster

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
MARGIN_SECONDS = 20  # a test's timeout beyond its subprocess's: time to kill it and report what it printed
SUBPROCESS_WAITS = {"run", "check_output", "check_call", "call"}  # subprocess's functions that take timeout=
CLUSTER = Cluster(chief=("127.0.0.1:1",), ps=("127.0.0.1:2",))


def _number(node: ast.expr | None, constants: dict[str, float]) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_subprocess_wait(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr in SUBPROCESS_WAITS and isinstance(func.value, ast.Name)
            and func.value.id == "subprocess")


def _helper_defaults(module: ast.Module, constants: dict[str, float]) -> dict[str, float]:
    """Module-level functions that pass their own `timeout` parameter to a subprocess call: name -> its default."""
    helpers = {}
    for func in (n for n in module.body if isinstance(n, ast.FunctionDef)):
        passes = any(isinstance(n, ast.Call) and _is_subprocess_wait(n) and isinstance(_keyword(n, "timeout"), ast.Name)
                     and _keyword(n, "timeout").id == "timeout" for n in ast.walk(func))
        args = func.args.args + func.args.kwonlyargs
        defaults = [None] * (len(func.args.args) - len(func.args.defaults)) + func.args.defaults
        defaults += func.args.kw_defaults
        default = next((d for a, d in zip(args, defaults) if a.arg == "timeout"), None)
        if passes and _number(default, constants) is not None:
            helpers[func.name] = _number(default, constants)
    return helpers


def _marked_timeout(decorators: list[ast.expr], constants: dict[str, float]) -> float | None:
    for decorator in decorators:
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.mark.timeout":
            return _number(decorator.args[0], constants)
    return None


def subprocess_waits_beyond_the_tests_timeout() -> list[str]:
    """'FILE::TEST: a subprocess may run N s, the test M s' for every test whose longest subprocess timeout (a
    subprocess.run/check_output/... call, or a module helper passing its `timeout` to one) is not MARGIN_SECONDS
    below its pytest timeout (its timeout marker, else pyproject's)."""
    default = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"]
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        module = ast.parse(path.read_text())
        constants = {t.id: n.value.value for n in module.body if isinstance(n, ast.Assign)
                     for t in n.targets if isinstance(t, ast.Name) and _number(n.value, {}) is not None}
        helpers = _helper_defaults(module, constants)
        for test in (n for n in module.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
            allowed = _marked_timeout(test.decorator_list, constants) or default
            waits = []
            for call in (n for n in ast.walk(test) if isinstance(n, ast.Call)):
                if _is_subprocess_wait(call):
                    waits.append(_number(_keyword(call, "timeout"), constants))
                elif isinstance(call.func, ast.Name) and call.func.id in helpers:
                    given = _keyword(call, "timeout")
                    waits.append(helpers[call.func.id] if given is None else _number(given, constants))
            longest = max((w for w in waits if w is not None), default=0)
            if longest + MARGIN_SECONDS > allowed:
                found.append(f"{path.relative_to(ROOT)}::{test.name}: a subprocess may run {longest:g} s, the test "
                             f"{allowed:g} s")
    return found


def test_every_test_outlasts_the_subprocess_waits_it_allows():
    """tests/integration/test_gpu_check.py's run allowed its subprocess 560 s under pytest's 300 s: under load,
    pytest-timeout ended the test at 300 s, with nothing of what the device check had printed."""
    assert subprocess_waits_beyond_the_tests_timeout() == []


@pytest.fixture(scope="module")
def module_credentials(tmp_path_factory) -> pathlib.Path:
    """A job's credentials in a module-scoped temporary folder, as the security tests' shared shards have them."""
    folder = tmp_path_factory.mktemp("shared") / "job"
    make_job_credentials(folder, CLUSTER)
    return folder


def test_minting_credentials(tmp_path, module_credentials):
    """Mints a job's credentials (a CA's key among them) into tmp_path and uses the module's: the test below runs
    this one in a pytest of its own and looks for the keys afterwards."""
    make_job_credentials(tmp_path / "job", CLUSTER)
    for folder in (tmp_path / "job", module_credentials):
        assert {"ca.key", "ps-0.key", "chief-0.key"} <= {p.name for p in folder.glob("*.key")}


def test_a_test_that_minted_keys_leaves_none_in_pytests_temporary_folders(tmp_path):
    """The test above, in a pytest of its own with its temporary folders under `tmp_path`: it made keys (it
    asserts so), and none is left once it has ended; the certificates beside them stay."""
    base = tmp_path / "base"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                          f"--basetemp={base}", f"{__file__}::test_minting_credentials"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(base.rglob("*.key")) == [], "private keys left behind"
    assert list(base.rglob("ca.crt")), "only the keys go: what else a test wrote stays for a look"
