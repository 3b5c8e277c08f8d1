"""ps-admin: a running job's administration from the command line, with the chief's credentials.

    ps-admin layout --cluster CLUSTER
        prints the job's layout: its epoch, its shards and how many variables and bytes each holds
    ps-admin resize --cluster CLUSTER --ps ADDR[,ADDR...]
        makes the job's shards ADDR... while it trains (PSClient.resize, client/resize.py); added shards
        must be running (ps-server --index N), removed ones are stopped

CLUSTER is the cluster JSON (or a file holding it) the job started with, else TF_CONFIG's. The calls
carry the chief's credentials: TORCHPS_TLS_CERT/KEY/CA with a chief certificate, and/or
TORCHPS_ADMIN_TOKEN_FILE (ps-certs writes both). Exit codes: 0 done, 1 a shard refused or could not be
reached (the message says which; nothing was changed, or the moves done so far are in force), 2 a usage
error, answered before torch and gRPC are imported.
"""

from __future__ import annotations

import sys

from .cli import USAGE_ERROR, ArgumentParser
from .cluster import Cluster
from .errors import ClusterConfigError, PSError
from .forkserver import run_main

__all__ = ["main"]


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="ps-admin", description="Administer a running torchps job (see client/admin.py).")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("layout", "print the job's layout"), ("resize", "change the job's shards live")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--cluster", help="the job's cluster JSON or a file holding it (default: TF_CONFIG)")
        command.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to wait for a shard")
        if name == "resize":
            command.add_argument("--ps", required=True, help="the job's shards after the resize, comma-separated, "
                                 "the current ones first in their order (added at the end, removed from the end)")
            command.add_argument("--drain-seconds", type=float, help="how long removed shards answer before they "
                                 "are stopped (default: client/resize.py's DRAIN_SECONDS, 2)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cluster = Cluster.from_json(args.cluster) if args.cluster else Cluster.from_tf_config()[0]
        if not args.connect_timeout > 0:
            raise ClusterConfigError(f"--connect-timeout must be > 0. Received: {args.connect_timeout}")
        from .client import PSClient  # torch and gRPC: only once the flags are right

        with PSClient(cluster, connect_timeout=args.connect_timeout, partitioner=None) as admin:
            if args.command == "resize":
                addresses = [a.strip() for a in args.ps.split(",") if a.strip()]
                drain = {} if args.drain_seconds is None else {"drain_seconds": args.drain_seconds}
                print(admin.resize(addresses, **drain).line())
            else:
                print(_layout(admin))
    except ClusterConfigError as exc:
        print(f"ps-admin: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except PSError as exc:
        print(f"ps-admin: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def _layout(admin) -> str:
    """The layout as text (admin: a PSClient): the epoch, then each shard's address, variables and bytes."""
    from .proto import ps_pb2

    addresses = admin.shard_addresses()  # asks ps 0 for the layout
    lines = [f"layout epoch {admin.layout_epoch}: {len(addresses)} shards"]
    for shard, address in enumerate(addresses):
        listed = admin.call(shard, lambda stub, t: stub.ListVariables(ps_pb2.ListRequest(), timeout=t))
        lines.append(f"  ps:{shard} {address}: {len(listed.variables)} variables, "
                     f"{sum(v.nbytes for v in listed.variables):,} bytes")
    return "\n".join(lines)


if __name__ == "__main__":  # as the console script: ends at once with main's code
    run_main(main, sys.argv[1:], "ps-admin")
