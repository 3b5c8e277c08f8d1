"""ps-serve: a read-only serving replica of a training job's model, and the commands that steer one.

    ps-serve --cluster SPEC --bind HOST:PORT [--checkpoint-dir DIR [--checkpoint-step STEP]] [--min-updates N]
             [--guard MODULE:FUNCTION [--guard-max-increase X]] [--poll-every S] [--dense-every S]
             [--keep-versions K]
    ps-serve status   --at HOST:PORT
    ps-serve hold     --at HOST:PORT       freeze on the current version (canary, A/B)
    ps-serve resume   --at HOST:PORT       follow training again (every table is read whole first)
    ps-serve rollback --at HOST:PORT --to STEP

The replica reads the shards of the cluster spec (follower.py) and answers
the Serving service (server.py) until SIGTERM or Ctrl-C. With
--checkpoint-dir it first serves the job's newest committed checkpoint there
(or --checkpoint-step's) and then reads only what changed since. With
--guard it publishes a version only if the user's loss function, called on it
before anyone sees it, finds it no worse than the served one (guard.py). Its credentials:
the security flags as ps-server's (the shards' token table, to check its
callers) and `--task` (its line of that table, `serving:0` by default, whose
token it calls the shards with; a job token works for both).
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import threading

from ..cli import USAGE_ERROR, ArgumentParser

__all__ = ["main", "parse_args"]

COMMANDS = ("status", "hold", "resume", "rollback")
# The follower's thread gives the GIL up this often (Python's default: 5 ms), so a lookup waits for it less.
SWITCH_SECONDS = 0.0005


def parse_args(argv: list[str]) -> argparse.Namespace:
    from ..credential_flags import add_security_flags
    from .settings import DENSE_SECONDS, KEEP_VERSIONS, POLL_SECONDS

    if argv[:1] and argv[0] in COMMANDS:
        parser = ArgumentParser(prog=f"ps-serve {argv[0]}", description=__doc__.split("\n\n")[0])
        parser.add_argument("--at", required=True, metavar="HOST:PORT", help="the replica's address")
        if argv[0] == "rollback":
            parser.add_argument("--to", type=int, required=True, metavar="STEP", help="the training step to go back to: the newest "
                                "kept version at or before it")
        parser.add_argument("--timeout", type=float, default=30.0, help="the call's deadline in s (default 30)")
        add_security_flags(parser)
        args = parser.parse_args(argv[1:])
        args.command = argv[0]
        return args
    parser = ArgumentParser(prog="ps-serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--cluster", required=True, help="the training job's cluster as inline JSON or a JSON file "
                        "path (TF_CONFIG's 'cluster' shape): its ps addresses are read")
    parser.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT to serve at (port 0: a free one; "
                        "default 127.0.0.1:0)")
    parser.add_argument("--port-file", help="write the bound port here once serving")
    parser.add_argument("--task", default="serving:0", help="this replica's line of the token table, whose token "
                        "it calls the shards with (default serving:0)")
    parser.add_argument("--poll-every", type=float, default=POLL_SECONDS,
                        help=f"s between reads of the shards' row changes (default {POLL_SECONDS:g})")
    parser.add_argument("--dense-every", type=float, default=DENSE_SECONDS,
                        help=f"s between reads of the dense variables (default {DENSE_SECONDS:g})")
    parser.add_argument("--checkpoint-dir", help="the training job's --checkpoint-dir: serve its newest committed "
                        "checkpoint at once, then read what changed since (none there yet: start from the shards)")
    parser.add_argument("--checkpoint-step", type=int, metavar="STEP", help="start from this committed checkpoint "
                        "of --checkpoint-dir instead of the newest")
    parser.add_argument("--min-updates", type=int, default=0, metavar="N", help="serve a row only once pushes "
                        "updated it N times (default 0: every row)")
    parser.add_argument("--guard", metavar="MODULE:FUNCTION", help="publish a version only if FUNCTION(model) (a "
                        "loss on your held-out data; MODULE may be PATH.py) is at most the served version's plus "
                        "--guard-max-increase")
    parser.add_argument("--guard-max-increase", type=float, default=0.0, metavar="X", help="how much higher a "
                        "version's loss than the served one's may be (default 0)")
    parser.add_argument("--keep-versions", type=int, default=KEEP_VERSIONS,
                        help=f"versions kept for a rollback (default {KEEP_VERSIONS})")
    parser.add_argument("--threads", type=int, default=8, help="threads answering GetDense and ControlServing "
                        "(lookups and status are answered on the event loop; default 8)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch's threads (default 1: lookups and "
                        "publishes are small copies)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at this port of the --bind "
                        "host (0: a free one, logged)")
    parser.add_argument("--log-level", default="INFO")
    add_security_flags(parser)
    args = parser.parse_args(argv)
    if args.poll_every <= 0 or args.dense_every <= 0 or min(args.keep_versions, args.threads, args.torch_threads) < 1:
        parser.error("--poll-every and --dense-every must be > 0, --keep-versions, --threads and --torch-threads "
                     ">= 1")
    if args.min_updates < 0:
        parser.error("--min-updates must be >= 0")
    if not args.guard_max_increase >= 0 or args.guard_max_increase == float("inf"):
        parser.error("--guard-max-increase must be finite and >= 0")
    if args.checkpoint_step is not None and not args.checkpoint_dir:
        parser.error("--checkpoint-step needs --checkpoint-dir")
    args.command = "serve"
    return args


def preflight(argv: list[str]) -> None:
    """Exits 2 with argparse's message for bad flags, before the slow imports."""
    parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from ..credential_flags import resolve_security
    from ..errors import PSError

    try:
        security = resolve_security(args)
        return _serve(args, security) if args.command == "serve" else _control(args, security)
    except PSError as exc:
        print(f"ps-serve: {exc}", file=sys.stderr)
        return 1


def _control(args: argparse.Namespace, security) -> int:
    from ..proto import ps_pb2
    from .client import ServingClient

    with ServingClient(args.at, security=security, timeout=args.timeout) as client:
        if args.command == "hold":
            status = client.control(ps_pb2.ServingControl.HOLD)
        elif args.command == "resume":
            status = client.control(ps_pb2.ServingControl.RESUME)
        elif args.command == "rollback":
            status = client.control(ps_pb2.ServingControl.ROLLBACK, args.to)
        else:
            status = client.status()
    print(f"version {status.current.version} (step {status.current.step}){' held' if status.held else ''}; "
          f"staleness {status.staleness_seconds:.2f} s, {status.behind_steps} steps behind; {status.rows} rows; "
          f"kept steps {[v.step for v in status.kept]}" + _guard_line(status)
          + (f"; last read failed: {status.error}" if status.error else ""))
    return 0


def _guard_line(status) -> str:
    """The loss guard's part of a status line ("" without a guard: its losses are NaN)."""
    if math.isnan(status.guard_loss) and math.isnan(status.guard_baseline):
        return ""
    return (f"; guard: {status.guard_refused} refused, last loss {status.guard_loss:.6g}, served "
            f"{status.guard_baseline:.6g}")


def _serve(args: argparse.Namespace, security) -> int:
    if security.lacks_line(args.task):
        print(f"ps-serve: error: the token table (--token-file) has no line for {args.task}, whose token this "
              f"replica reads the shards with: give it one (ps-certs DIR --add {args.task}=HOST:PORT) and start it "
              f"again", file=sys.stderr)
        return USAGE_ERROR
    import torch

    from ..cluster import Cluster
    from .follower import Follower
    from .replica import Replica
    from .server import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(SWITCH_SECONDS)
    torch.set_num_threads(args.torch_threads)
    cluster = Cluster.from_json(args.cluster)
    replica = Replica(args.keep_versions)
    guard = None
    if args.guard:
        from .guard import LossGuard, load_function

        guard = LossGuard(load_function(args.guard), args.guard_max_increase)
    follower = Follower(replica, list(cluster.ps), security.as_task(args.task), poll_every=args.poll_every,
                        dense_every=args.dense_every, min_updates=args.min_updates, guard=guard)
    if args.checkpoint_dir:
        _start(follower, args)
    metrics = None
    if args.metrics_port is not None:
        from ..metrics_http import serve_metrics
        from .metrics import ServingMetrics

        metrics = ServingMetrics(replica, follower)
        at = serve_metrics(metrics.registry, args.bind.rpartition(":")[0], args.metrics_port)
        logging.getLogger("torchps.serving").info("ps-serve metrics at http://%s:%d/metrics",
                                                  args.bind.rpartition(":")[0], at)
    server, port = serve(replica, follower, security, args.bind, threads=args.threads,
                         on_lookup=metrics.observe_lookup if metrics is not None else None)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.port_file:
        with open(args.port_file, "w") as out:
            out.write(f"{port}\n")
    logging.getLogger("torchps.serving").info("ps-serve follows %s, serving at %s:%d", ",".join(cluster.ps),
                                              args.bind.rpartition(":")[0], port)
    reader = threading.Thread(target=follower.run, args=(stop,), name="serve-follower", daemon=True)
    reader.start()
    while not stop.wait(1.0):
        pass
    follower.close()  # a read under way ends now, even one waiting for a shard that is gone
    reader.join(timeout=10)
    server.stop(grace=2.0).wait()
    return 0


def _start(follower, args: argparse.Namespace) -> None:
    """Publishes the checkpoint --checkpoint-dir names as the replica's first version (CheckpointError if a
    named one is not there or does not read)."""
    from .checkpoint_start import read_checkpoint

    log = logging.getLogger("torchps.serving")
    start = read_checkpoint(args.checkpoint_dir, args.checkpoint_step, args.min_updates)
    if start is None:
        log.info("ps-serve: no committed checkpoint under %s yet: reading every table from the shards",
                 args.checkpoint_dir)
        return
    follower.start_from(start)
    log.info("ps-serve serves checkpoint %s (step %d: %d rows, %d dense variables); what changed since comes from "
             "the shards", start.where, start.step, sum(len(b.ids) for _, b in start.batches), len(start.dense))


if __name__ == "__main__":
    sys.exit(main())
