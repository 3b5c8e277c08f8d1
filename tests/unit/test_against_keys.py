"""bench/against.py's keys: a top-level key of a run's JSON, or a dotted path through its objects."""

from helpers import load_script


def test_a_key_is_found_at_the_top_or_through_nested_objects_and_is_a_number():
    figure = load_script("bench/against.py", "bench_against")._figure
    result = {"wall_seconds": 3.5, "torchps": {"push": {"server_cpu_ms": 1.2, "note": "x"}}, "a.b": 7,
              "runs": [{"x": 1}]}
    assert figure(result, "wall_seconds") == 3.5
    assert figure(result, "torchps.push.server_cpu_ms") == 1.2
    assert figure(result, "a.b") == 7, "a key holding a dot is taken whole first"
    for missing in ("torchps.pull.server_cpu_ms", "torchps.push.note", "torchps.push", "torchps", "runs.x",
                    "nothing"):
        assert figure(result, missing) is None, missing
