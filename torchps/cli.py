"""What every torchps command line shares: usage errors in one line with exit code 2, and the console
scripts' entry points, which answer a Ctrl-C during their (slow: torch, gRPC) imports with one line and 130."""

from __future__ import annotations

import argparse
import sys

from .forkserver import INTERRUPTED, run_entry

__all__ = ["ArgumentParser", "USAGE_ERROR", "INTERRUPTED", "ps_server", "ps_worker", "ps_launch", "ps_certs"]

USAGE_ERROR = 2    # a bad flag or value, or a configuration that cannot work: nothing was started


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line ("prog: error: ...; see prog --help"), not the usage."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _run(prog: str, module: str) -> None:
    run_entry(module, sys.argv[1:], prog)


def ps_server() -> None:
    _run("ps-server", "torchps.ps_server.__main__")


def ps_worker() -> None:
    _run("ps-worker", "torchps.worker.__main__")


def ps_launch() -> None:
    _run("ps-launch", "torchps.worker.launch")


def ps_certs() -> None:
    _run("ps-certs", "torchps.certs")
