"""`ps-server`: run one parameter-server shard until signalled.

    ps-server --index 0 --cluster '{"ps": ["127.0.0.1:2222"], "worker": [...]}'
    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' ps-server
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
import threading
from typing import Callable

import torch
from grpc_health.v1 import health

from ..cli import INTERRUPTED, USAGE_ERROR, ArgumentParser
from ..cluster import Cluster, TaskSpec
from . import checkpoint
from ..errors import ClusterConfigError, PSError
from ..memory import memory_limit, tune_malloc
from ..codec import DEFAULT_MAX_CHUNK_BYTES
from .server import DEFAULT_THREADS, create_server, serve_health, set_health
from .stalls import DEFAULT_IDLE_SECONDS
from ..security import Security, require_credentials
from .failstop import FailStop
from .journal import Journal, Layout
from .metrics import ShardMetrics
from .quotas import Quotas, parse_bytes
from .store import VariableStore

_LOGGER = logging.getLogger("torchps.ps_server")
STOP_GRACE_SECONDS = 2.0  # in-flight calls get this long after SIGTERM before they are cancelled
DEFAULT_ELASTIC_WORKERS = 8  # names beyond the cluster spec: a few restarts under new names, not an invented horde
SIGNAL_CHECK_SECONDS = 0.2  # how often the main thread looks for a signal delivered to another thread


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="ps-server", description="Run one torchps parameter-server shard.")
    parser.add_argument("--index", type=int, help="this shard's index in the cluster's ps list "
                        "(default: TF_CONFIG's task index)")
    parser.add_argument("--cluster", help="cluster as inline JSON or a JSON file path "
                        "(TF_CONFIG's 'cluster' shape); default: TF_CONFIG, or none with --index and --bind")
    parser.add_argument("--bind", help="HOST:PORT to listen on instead of the cluster entry; port 0 picks a free one")
    parser.add_argument("--port-file", type=pathlib.Path, help="write the bound port to this file once serving")
    parser.add_argument("--health-port", type=int, help="also serve the gRPC health service alone, in plaintext, "
                        "on this port of the bind host (for Kubernetes gRPC probes; 0 picks a free one): NOT_SERVING "
                        "while restoring or stopping, SERVING otherwise; it reveals nothing else")
    parser.add_argument("--health-port-file", type=pathlib.Path, help="write the health port here once it serves")
    parser.add_argument("--reflection", action="store_true", help="answer gRPC reflection, so `grpcurl list` "
                        "and `grpcurl describe` work (with the job's credentials, as every call)")
    parser.add_argument("--metrics-port", type=_port, help="serve Prometheus metrics over HTTP at /metrics on this "
                        "port, on --bind's host (0: a free one, reported by GetStatus; default: none)")
    parser.add_argument("--allow-nonfinite", action="store_true", help="accept NaN/Inf in gradients")
    parser.add_argument("--max-chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES,
                        help="largest chunk accepted or sent (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help="RPC threads (default: %(default)s)")
    parser.add_argument("--torch-threads", type=_threads, default=0, help="torch's CPU threads for updates and "
                        "lookups (default: torch's own, one per core; 1 suits a shard sharing its cores with others)")
    parser.add_argument("--max-waiting-calls", type=int, default=None,
                        help="calls that may wait at once (held sync pushes, min_step pulls, saves, ...); past it a "
                        "call gets RESOURCE_EXHAUSTED at once (default: three quarters of --threads)")
    parser.add_argument("--checkpoint-dir", help="save checkpoints here when the chief asks (a folder every shard "
                        "shares), and on start restore the newest committed one")
    parser.add_argument("--restore-from", help="start from the newest committed checkpoint in this folder, "
                        "re-laid out for this cluster's number of shards (when --checkpoint-dir has none): variables "
                        "cut and placed again, embedding tables' rows moved to the shard their id partition names, "
                        "with their optimizer state; a checkpoint missing any part is refused")
    parser.add_argument("--num-ps", type=int, help="shards in the cluster, for --restore-from without --cluster")
    parser.add_argument("--journal-dir", help="record every change here before acknowledging it, and recover from it "
                        "after a crash with nothing acknowledged lost (default: CHECKPOINT_DIR/journal/ps-INDEX)")
    parser.add_argument("--no-journal", action="store_true", help="no journal: a restarted shard falls back to the "
                        "newest committed checkpoint, and what was acknowledged after it is lost")
    parser.add_argument("--journal-sync", action="store_true", help="acknowledge a change once its journal record is "
                        "on the disk (fdatasync, batched), so a power or host loss loses nothing acknowledged either; "
                        "default: once it is in the kernel's page cache, which a killed process cannot lose")
    parser.add_argument("--replace-journal", action="store_true", help="with --restore-from: a journal that belongs "
                        "to another job or layout is moved aside (renamed, kept) and the shard starts from the "
                        "checkpoint; without it such a journal is refused")
    q = parser.add_argument_group("limits (a call over one gets RESOURCE_EXHAUSTED and changes nothing)")
    q.add_argument("--max-memory", type=_memory, default=0, help="bytes this shard may hold: variables with their "
                   "optimizer state, embedding tables, and pushes being received, e.g. 8G, or a share of the memory "
                   "this process may use (the machine's, or its container's or pod's limit), e.g. 75%% "
                   "(default: no limit)")
    q.add_argument("--max-variable-bytes", type=_size, default=0, help="largest variable, e.g. 2G (default: none)")
    q.add_argument("--max-calls-per-client", type=int, default=0, help="calls one client (a certificate's task, "
                   "else a connection) may have in progress at once (default: no limit)")
    q.add_argument("--stream-idle-seconds", type=_seconds, default=DEFAULT_IDLE_SECONDS, help="a client stream "
                   "(Push, CreateVariables) that sends nothing for this long is ended with DEADLINE_EXCEEDED and "
                   "changes nothing; keep it above a backward pass of one layer for --overlap workers "
                   "(default: %(default)s)")
    q.add_argument("--elastic-workers", type=_elastic, default=DEFAULT_ELASTIC_WORKERS, help="workers the cluster "
                   "spec does not name that may join (the spec's always may; a standalone shard's spec names none): "
                   "past it a new name is refused (default: %(default)s)")
    s = parser.add_argument_group("security (see torchps.security; ps-certs makes the files)")
    s.add_argument("--tls-cert", help="this shard's certificate (PEM), signed by the job's CA ($TORCHPS_TLS_CERT)")
    s.add_argument("--tls-key", help="its private key ($TORCHPS_TLS_KEY)")
    s.add_argument("--tls-ca", help="the job's CA certificate: clients must present a certificate it signed "
                   "($TORCHPS_TLS_CA)")
    s.add_argument("--token-file", help="the tokens every call must carry one of: ps-certs' table of per-task "
                   "tokens (DIR/tokens), or one job token that names no task ($TORCHPS_TOKEN_FILE)")
    s.add_argument("--admin-token-file", help="the chief's admin token: without TLS, admin calls need it "
                   "($TORCHPS_ADMIN_TOKEN_FILE)")
    s.add_argument("--insecure", action="store_true", help="serve plaintext to anyone (a trusted network only); "
                   "needed when no TLS files and no token are given")
    parser.add_argument("--log-level", default=os.environ.get("TORCHPS_LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


def _whole(what: str, low: int, high: int, hint: str = ""):
    """An argparse type: a whole number in [low, high], else 'not a WHAT: TEXT (LOW-HIGH[; HINT])'."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"not a {what}: {text!r} ({low}-{high}{'; ' + hint if hint else ''})")
        return value
    return parse


_port = _whole("port", 0, 65535, "0 picks a free one")
_elastic = _whole("number of workers", 0, 1_000_000)
_threads = _whole("thread count", 1, 1024)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r} (above 0, at most 86400)")
    return value


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8G, 512M or a number of bytes)") from None


def _memory(text: str) -> int:
    """A size, or "P%": P percent of the memory this process may use (memory.memory_limit)."""
    if not text.strip().endswith("%"):
        return _size(text)
    try:
        percent = float(text.strip()[:-1])
    except ValueError:
        percent = -1.0
    if not 0 < percent <= 100:
        raise argparse.ArgumentTypeError(f"not a share of memory: {text!r} (use e.g. 75%, in (0, 100])")
    limit = memory_limit()
    if not limit:
        raise argparse.ArgumentTypeError(f"{text!r}: this system does not say how much memory there is; give a size")
    return int(limit * percent / 100)


def resolve(args: argparse.Namespace) -> tuple[Cluster | None, int, str]:
    """(cluster or None, index, address to bind) from flags and TF_CONFIG; ClusterConfigError if inconsistent."""
    task = None
    if args.cluster:
        cluster = Cluster.from_json(args.cluster)
    elif args.bind and args.index is not None and "TF_CONFIG" not in os.environ:
        return None, args.index, args.bind  # a standalone shard: --index N --bind HOST:PORT
    else:
        cluster, task = Cluster.from_tf_config()
    if task is not None and task.type != "ps":
        raise ClusterConfigError(f"TF_CONFIG's task is {task}: run ps-worker for it, not ps-server")
    if args.index is not None:
        index = args.index
    elif task is not None:
        index = task.index
    else:
        raise ClusterConfigError("no shard index: pass --index N (or set TF_CONFIG's task to type 'ps')")
    address = cluster.address(TaskSpec("ps", index))
    if args.bind:
        address = args.bind
    return cluster, index, address


def initial_state(args: argparse.Namespace, cluster: Cluster | None, index: int) -> dict | None:
    """The state to start from: the newest committed checkpoint under --checkpoint-dir, else one of
    --restore-from (re-laid out for this cluster, embedding tables included), else None. Without a shard
    count (a standalone shard) the checkpoint is taken as written for this layout. Blocks while the files
    are read; CheckpointError for a checkpoint that is damaged or incomplete (tables included), or whose part
    for this shard is over --max-memory: the shard then does not start."""
    num_ps = cluster.num_ps if cluster is not None else args.num_ps
    if args.restore_from and not num_ps:
        raise ClusterConfigError("--restore-from needs the number of shards: pass --cluster or --num-ps")
    for directory in (args.checkpoint_dir, args.restore_from):
        if directory:
            state = checkpoint.restore_state(directory, index, num_ps, max_bytes=args.max_memory)
            if state is not None:
                return state
    if args.restore_from:
        raise ClusterConfigError(f"--restore-from {args.restore_from}: no committed checkpoint there")
    return None


def _spec_workers(cluster: Cluster | None) -> frozenset[str]:
    """The names the cluster spec's chief and workers join with ("worker:1")."""
    return frozenset(str(task) for task, _ in cluster.tasks() if task.type in ("chief", "worker")) if cluster else \
        frozenset()


def load_security(args: argparse.Namespace) -> Security:
    """The shard's credentials; ClusterConfigError unless it has some or was told --insecure."""
    security = require_credentials(Security.load(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                                                 token_file=args.token_file, admin_token_file=args.admin_token_file),
                                   args.insecure)
    if security.token is not None and not security.tls:
        _LOGGER.warning("the token file holds one job token, which names no task: without TLS any holder may act "
                        "in any worker's name (ps-certs makes per-task tokens: --token-file DIR/tokens)")
    return security


def open_journal(args: argparse.Namespace, cluster: Cluster | None, index: int,
                 on_failure: Callable[[str], None]) -> Journal | None:
    """The shard's journal: --journal-dir, else CHECKPOINT_DIR/journal/ps-INDEX, unless --no-journal. One that
    holds another job's or layout's state is refused (ClusterConfigError), or with --replace-journal moved
    aside for --restore-from's checkpoint."""
    if args.replace_journal and not args.restore_from:
        raise ClusterConfigError("--replace-journal moves a journal aside for --restore-from's checkpoint: pass "
                                 "--restore-from too")
    if args.no_journal:
        return None
    directory = args.journal_dir or (args.checkpoint_dir and os.path.join(args.checkpoint_dir, "journal", f"ps-{index}"))
    if not directory:
        return None
    layout = Layout(index, cluster.num_ps if cluster is not None else args.num_ps,
                    os.path.abspath(args.restore_from) if args.restore_from else None)
    journal = Journal(directory, layout=layout, sync=args.journal_sync, on_failure=on_failure)
    if journal.holds_state():
        try:
            journal.check_layout()
        except ClusterConfigError:
            if not args.replace_journal:
                raise
            _LOGGER.warning("journal %s moved aside to %s: this shard starts from %s", directory,
                            journal.move_aside(), args.restore_from)
    return journal


def _write_port(path: pathlib.Path, port: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(port))
    tmp.replace(path)


def _stop(health_server) -> None:
    if health_server is not None:
        health_server.stop(None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_malloc("shard")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    health_servicer, health_server = health.HealthServicer(), None
    set_health(health_servicer, serving=False)
    try:
        cluster, index, address = resolve(args)
        # A part of the shard that fails (a background thread, the journal) stops the whole process.
        failstop = FailStop(on_stop=lambda: set_health(health_servicer, serving=False), what=f"ps {index}")
        security = load_security(args)
        if args.health_port is not None:
            health_server, health_port = serve_health(health_servicer, f"{address.rpartition(':')[0]}:{args.health_port}")
            if args.health_port_file:
                _write_port(args.health_port_file, health_port)
        store = VariableStore(allow_nonfinite=args.allow_nonfinite)
        journal = open_journal(args, cluster, index, failstop.fatal)
        if args.checkpoint_dir:
            checkpoint.clean_partial(args.checkpoint_dir, index)
        restore = initial_state(args, cluster, index) if journal is None or not journal.holds_state() else None
        stop = threading.Event()
        metrics = ShardMetrics(args.metrics_port) if args.metrics_port is not None else None
        server, port, coordinator = create_server(
            store, index, address, max_chunk_bytes=args.max_chunk_bytes, threads=args.threads,
            max_waiting_calls=args.max_waiting_calls, checkpoint_dir=args.checkpoint_dir, restore=restore,
            journal=journal, on_shutdown=lambda reason: stop.set(), security=security,
            quotas=Quotas(max_memory=args.max_memory, max_variable_bytes=args.max_variable_bytes,
                          max_calls_per_client=args.max_calls_per_client), health_servicer=health_servicer,
            metrics=metrics, reflection=args.reflection, failstop=failstop, workers=_spec_workers(cluster),
            elastic_workers=args.elastic_workers, stream_idle_seconds=args.stream_idle_seconds)
    except (PSError, RuntimeError, OSError) as exc:
        _stop(health_server)
        print(f"ps-server: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        _stop(health_server)
        print("ps-server: interrupted", file=sys.stderr)
        return INTERRUPTED
    interrupted = []

    def on_signal(signum, _frame) -> None:  # SIGTERM, SIGHUP: a clean stop (0); SIGINT (Ctrl-C): 130
        interrupted.append(signum == signal.SIGINT)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    server.start()
    set_health(health_servicer, serving=True)
    if args.port_file:
        _write_port(args.port_file, port)
    host = address.rpartition(":")[0]
    mode = ("mutual TLS" if security.tls else "plaintext") + (
        ", per-task tokens" if security.task_tokens else ", job token" if security.token else "")
    _LOGGER.info("ps %d uses %d torch thread(s) for updates and lookups", index, torch.get_num_threads())
    if args.max_memory:
        _LOGGER.info("ps %d holds at most %d bytes (--max-memory)", index, args.max_memory)
    _LOGGER.info("ps %d serving on %s:%d (pid %d): %s", index, host, port, os.getpid(),
                 "INSECURE: no TLS, no token" if security.insecure else mode)
    if metrics is not None:
        _LOGGER.info("ps %d metrics on http://%s:%d/metrics", index, host, metrics.port)
    # Waits in short slices: a signal the kernel hands to one of gRPC's threads only sets a flag, which the
    # main thread acts on when it next runs Python code (a wait with no timeout might never return).
    while not stop.wait(SIGNAL_CHECK_SECONDS):
        pass
    _LOGGER.info("ps %d stopping", index)
    set_health(health_servicer, serving=False)
    coordinator.close()  # answers held sync pushes and min_step pulls UNAVAILABLE at once
    stopped = server.stop(STOP_GRACE_SECONDS).wait(STOP_GRACE_SECONDS + 5)
    if journal is not None:
        journal.close()
    _stop(health_server)
    if not stopped:
        _LOGGER.warning("ps %d: calls still running after the grace period; exiting anyway", index)
        logging.shutdown()
        os._exit(0)  # handler threads that never return must not keep a stopped shard alive
    if interrupted and interrupted[0]:
        print("ps-server: interrupted", file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
