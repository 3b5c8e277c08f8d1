"""The committed gRPC stubs are exactly what scripts/gen_protos.py makes from protos/."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUBS = ("ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py")


def _gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", STUBS)
def test_stub_is_up_to_date(tmp_path_factory, name):
    out = tmp_path_factory.getbasetemp() / "generated_protos"
    if not (out / name).exists():
        _gen_protos().generate(out)
    generated = (out / name).read_bytes()
    committed = (ROOT / "torchps" / "proto" / name).read_bytes()
    assert generated == committed, (
        f"torchps/proto/{name} is stale: run `python scripts/gen_protos.py` after editing protos/")
