"""What every torchps command line shares: usage errors in one line with exit code 2, and the console
scripts' entry points, which check their flags before their slow imports (torch, gRPC), answer a Ctrl-C
during those imports with one line and 130, and keep gRPC's own logging quiet unless asked for."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Mapping

from .forkserver import INTERRUPTED, run_entry

__all__ = ["ArgumentParser", "USAGE_ERROR", "PARTIAL_JOB", "INTERRUPTED", "grpc_log_env", "ps_server", "ps_worker",
           "ps_launch", "ps_certs", "ps_admin"]

USAGE_ERROR = 2    # a bad flag or value, or a configuration that cannot work: nothing was started
PARTIAL_JOB = 3    # ps-worker's chief and ps-launch: the job ended, but part of its planned data was not trained


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line ("prog: error: ...; see prog --help"), not the usage."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def grpc_log_env(log_level: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a process needs, before it imports grpc, for gRPC's C core to stay silent (torchps
    says what went wrong in its own lines): GRPC_VERBOSITY=NONE, unless `log_level` is DEBUG or the
    environment already sets GRPC_VERBOSITY or GRPC_TRACE (someone asked for gRPC's log)."""
    if (log_level or "").upper() == "DEBUG" or "GRPC_VERBOSITY" in environ or "GRPC_TRACE" in environ:
        return {}
    return {"GRPC_VERBOSITY": "NONE"}


def _log_level(argv: list[str]) -> str | None:
    """--log-level's value in `argv`, else $TORCHPS_LOG_LEVEL."""
    for i, arg in enumerate(argv):
        if arg == "--log-level" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--log-level="):
            return arg.partition("=")[2]
    return os.environ.get("TORCHPS_LOG_LEVEL")


def _run(prog: str, module: str, preflight: str | None = None) -> None:
    """Runs `module`.main as torchps.forkserver.run_entry does (the process ends with its code at once).
    `preflight`, a module that imports nothing slow, checks the flags first (its preflight(argv) exits 2
    with one line on a usage error)."""
    os.environ.update(grpc_log_env(_log_level(sys.argv[1:]), os.environ))
    if preflight is not None:
        try:
            importlib.import_module(preflight).preflight(sys.argv[1:])
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            os._exit(INTERRUPTED)
    run_entry(module, sys.argv[1:], prog)


def ps_server() -> None:
    _run("ps-server", "torchps.ps_server.__main__")


def ps_worker() -> None:
    _run("ps-worker", "torchps.worker.__main__", preflight="torchps.worker.flags")


def ps_launch() -> None:
    _run("ps-launch", "torchps.worker.launch")


def ps_certs() -> None:
    _run("ps-certs", "torchps.certs")


def ps_admin() -> None:
    _run("ps-admin", "torchps.admin")


def ps_serve() -> None:
    _run("ps-serve", "torchps.serving.daemon", preflight="torchps.serving.daemon")
