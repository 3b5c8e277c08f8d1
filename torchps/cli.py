"""What every torchps command line shares: usage errors in one line with exit code 2, and the console
scripts' entry points, which answer a Ctrl-C during their (slow: torch, gRPC) imports with one line and 130."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys

__all__ = ["ArgumentParser", "USAGE_ERROR", "INTERRUPTED", "ps_server", "ps_worker", "ps_launch", "ps_certs"]

USAGE_ERROR = 2    # a bad flag or value, or a configuration that cannot work: nothing was started
INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line ("prog: error: ...; see prog --help"), not the usage."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def _run(prog: str, module: str) -> None:
    """Runs `module`.main and ends the process with its code as soon as it returns: a thread still in a
    call (a client closed after an interrupt leaves within 3 s, its retries may not) cannot hold it."""
    try:
        main = importlib.import_module(module).main
        code = main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        code = INTERRUPTED
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that went away
            stream.flush()
    os._exit(code or 0)


def ps_server() -> None:
    _run("ps-server", "torchps.ps_server.__main__")


def ps_worker() -> None:
    _run("ps-worker", "torchps.worker.__main__")


def ps_launch() -> None:
    _run("ps-launch", "torchps.worker.launch")


def ps_certs() -> None:
    _run("ps-certs", "torchps.certs")
