"""bench/against.py's keys: a top-level key of a run's JSON, or a dotted path through its objects."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_against():
    spec = importlib.util.spec_from_file_location("bench_against", ROOT / "bench" / "against.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_key_is_found_at_the_top_or_through_nested_objects_and_is_a_number():
    figure = load_against()._figure
    result = {"wall_seconds": 3.5, "torchps": {"push": {"server_cpu_ms": 1.2, "note": "x"}}, "a.b": 7,
              "runs": [{"x": 1}]}
    assert figure(result, "wall_seconds") == 3.5
    assert figure(result, "torchps.push.server_cpu_ms") == 1.2
    assert figure(result, "a.b") == 7, "a key holding a dot is taken whole first"
    for missing in ("torchps.pull.server_cpu_ms", "torchps.push.note", "torchps.push", "torchps", "runs.x",
                    "nothing"):
        assert figure(result, missing) is None, missing
