"""`ps-server`: run one parameter-server shard until signalled.

    ps-server --index 0 --cluster '{"ps": ["127.0.0.1:2222"], "worker": [...]}'
    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' ps-server

The flags, the cluster and the credentials are checked before torch is imported (ps_server/flags.py): a usage
error is one line on stderr and exit code 2 at once. Then ps_server/daemon.py serves.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys

from ..cli import USAGE_ERROR
from ..errors import PSError
from ..forkserver import run_main
from .flags import load_security, parse_args, resolve

__all__ = ["main", "parse_args"]


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 PID` writes every thread's Python stack to the shard's output (its log), from its first line
    # on: what a shard that seems stuck is doing, without stopping it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cluster, index, address = resolve(args)
        security = load_security(args)
    except (PSError, RuntimeError, OSError) as exc:
        print(f"ps-server: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    from .daemon import serve  # torch, gRPC's server and the shard's core: only for a shard that will serve

    return serve(args, cluster, index, address, security)


if __name__ == "__main__":  # as the console script: ends at once with main's code
    run_main(main, sys.argv[1:], "ps-server")
