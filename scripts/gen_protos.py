"""Regenerates the committed gRPC stubs from protos/ (run after editing the .proto).

Usage: python scripts/gen_protos.py [OUT_DIR]   (default: torchps/proto)

The stubs are committed so that installs need no build step;
tests/test_protos_uptodate.py regenerates them into a temporary folder and
fails if they differ from the committed ones.
"""
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = "torchps/v1/ps.proto"


def generate(out_dir: pathlib.Path) -> None:
    """Writes ps_pb2.py, ps_pb2.pyi and ps_pb2_grpc.py into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "_gen"
    tmp.mkdir(exist_ok=True)
    include = str(pathlib.Path(protoc.__file__).parent / "_proto")
    rc = protoc.main([
        "protoc", f"-I{ROOT / 'protos'}", f"-I{include}",
        f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", PROTO,
    ])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    for name in ("ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py"):
        text = (tmp / "torchps" / "v1" / name).read_text()
        # Generated code imports its sibling absolutely; we install it as a subpackage.
        text = text.replace("from torchps.v1 import ps_pb2 as", "from . import ps_pb2 as")
        (out_dir / name).write_text(text)
    for path in sorted(tmp.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    tmp.rmdir()


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "torchps" / "proto")
