"""What every torchps command line shares: usage errors in one line, with the documented exit code 2."""

from __future__ import annotations

import argparse
import sys

__all__ = ["ArgumentParser", "USAGE_ERROR", "INTERRUPTED"]

USAGE_ERROR = 2    # a bad flag or value, or a configuration that cannot work: nothing was started
INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line ("prog: error: ...; see prog --help"), not the usage."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)
