"""ps-server's command line, without torch: the flags, their types and checks, the cluster and credentials
they name. A usage error is answered from here in a fraction of a second; only a shard that will serve
imports torch (ps_server/daemon.py)."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib

from ..cli import ArgumentParser
from ..cluster import Cluster, TaskSpec
from ..errors import ClusterConfigError
from ..memory import memory_limit
from ..security import Security, require_credentials
from ..sizes import DEFAULT_MAX_CHUNK_BYTES, parse_bytes
from .stalls import DEFAULT_IDLE_SECONDS

__all__ = ["parse_args", "resolve", "load_security", "DEFAULT_THREADS", "DEFAULT_MAX_WAITING_CALLS", "DEFAULT_ELASTIC_WORKERS"]

_LOGGER = logging.getLogger("torchps.ps_server")
# Threads that run the shard's RPC bodies (the gRPC edge is an event loop, edge.py). A sync push held for its
# release or a min_step pull waits on the loop and holds none; a save or a wait for names or data holds one (at
# most three quarters of them), so the rest always serve status, heartbeats and plain calls.
DEFAULT_THREADS = 128
# Calls waiting at once, of every kind: each costs a coroutine and a watcher of the bookkeeping, no thread.
DEFAULT_MAX_WAITING_CALLS = 4096
DEFAULT_ELASTIC_WORKERS = 8  # names beyond the cluster spec: a few restarts under new names, not an invented horde


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
    parser.add_argument("--lane-port", type=_port, default=0, help="TCP port of this shard's bulk lanes, on --bind's "
                        "host: Pull and Push bytes beside their gRPC calls, and a backup's copy of the journal, copied only by "
                        "the kernel (TLS with the shard's credentials where it serves TLS; default: 0, a free one, in "
                        "GetStatus)")
    parser.add_argument("--no-lanes", action="store_true", help="offer no bulk lanes: every byte goes over gRPC")
    parser.add_argument("--allow-nonfinite", action="store_true", help="accept NaN/Inf in gradients")
    parser.add_argument("--max-chunk-bytes", type=int, default=DEFAULT_MAX_CHUNK_BYTES,
                        help="largest chunk accepted or sent (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help="threads that run RPC bodies; calls held for a sync release or a step hold none "
                        "(default: %(default)s)")
    parser.add_argument("--torch-threads", type=_threads, default=0, help="torch's CPU threads for updates and "
                        "lookups (default: torch's own, one per core; 1 suits a shard sharing its cores with others)")
    parser.add_argument("--max-waiting-calls", type=int, default=None,
                        help="calls that may wait at once (held sync pushes, min_step pulls, saves, ...); past it a "
                        "call gets RESOURCE_EXHAUSTED at once; not tied to --threads (saves and waits for names "
                        "or data also stop at three quarters of --threads) (default: 4096)")
    parser.add_argument("--checkpoint-dir", help="save checkpoints here when the chief asks (a folder every shard "
                        "shares), and on start restore the newest committed one")
    parser.add_argument("--restore-from", help="start from the newest committed checkpoint in this folder, "
                        "re-laid out for this cluster's number of shards (when --checkpoint-dir has none): variables "
                        "cut and placed again, embedding tables' rows moved to the shard their id partition names, "
                        "with their optimizer state; a checkpoint missing any part is refused")
    parser.add_argument("--num-ps", type=int, help="shards in the cluster, for --restore-from without --cluster")
    parser.add_argument("--join", action="store_true", help="this shard joins a running job (ps-admin resize adds "
                        "it): it starts empty, whatever --checkpoint-dir holds, with its own journal there, and "
                        "the resize brings its variables (the default for a journaled shard whose index is past "
                        "the newest checkpoint's shards and that has no journal yet)")
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
    parser.add_argument("--launched-by", choices=["ps-launch"], help="the command that started this shard (ps-launch "
                        "says so): what the shard says to do about a journal it refuses names that command's flags")
    r = parser.add_argument_group("replication (docs/operations/replication.md)")
    r.add_argument("--replica-of", metavar="HOST:PORT", help="run as the backup of the shard --index serving "
                   "there: keep a copy of its journal in --journal-dir, and serve in its place at --bind once it "
                   "is gone and ps 0 agrees")
    r.add_argument("--replicated", action="store_true", help="this shard's job runs backups (--replica-of): at "
                   "every start it asks its arbiter (ps 0; ps 1 for ps 0) who serves the shard before it serves, "
                   "even on an empty journal folder (a replaced disk), and becomes the backup of another that does "
                   "(ps-launch --replicas 2 passes it)")
    r.add_argument("--advertise", metavar="HOST:PORT", help="with --replica-of: the address clients reach this "
                   "backup at once promoted, where it differs from --bind (e.g. a Service name; default: --bind)")
    r.add_argument("--failover-after", type=_seconds, default=0.5, metavar="SECONDS", help="a backup asks to take "
                   "over a primary silent or unreachable this long; as an arbiter (ps 0, ps 1), this shard grants "
                   "it once the primary renewed no lease for this long (default 0.5)")
    r.add_argument("--replica-ack-timeout", type=_seconds, default=2.0, metavar="SECONDS", help="a primary "
                   "whose backup leaves a record unacknowledged this long asks ps 0 to go on without it "
                   "(default 2)")
    t = parser.add_argument_group("embedding tables on SSD (docs/guide/embeddings.md)")
    t.add_argument("--table-storage", choices=["ram", "ssd"], default="ram", help="where dynamic tables' rows live "
                   "unless their spec says (TableSpec.storage): in memory, or on local disk under --table-dir with "
                   "the rows used last cached in memory (fixed-size tables stay in memory; default: ram)")
    t.add_argument("--table-dir", metavar="DIR", help="the folder of the stores of tables kept on SSD (DIR/ps-INDEX, "
                   "emptied at start: a restarted shard rebuilds them from its journal or checkpoint; a promoted "
                   "backup's DIR/ps-INDEX-at-PORT); needed by --table-storage ssd, by tables whose spec asks for "
                   "ssd, and by the backup of a shard that has it")
    t.add_argument("--table-cache", type=_memory, default=0, metavar="BYTES", help="with --table-dir: the memory the "
                   "SSD tables' row caches share, counted in --max-memory, e.g. 512M or 25%% (default: half of "
                   "--max-memory, else 256M)")
    q = parser.add_argument_group("limits (a call over one gets RESOURCE_EXHAUSTED and changes nothing)")
    q.add_argument("--max-memory", type=_memory, default=0, help="bytes this shard may hold: variables with their "
                   "optimizer state, embedding tables, and pushes being received, e.g. 8G, or a share of the memory "
                   "this process may use (the machine's, or its container's or pod's limit), e.g. 75%% "
                   "(default: no limit)")
    q.add_argument("--max-variable-bytes", type=_size, default=0, help="largest variable, e.g. 2G (default: none)")
    q.add_argument("--keep-receive-buffers", type=_size, default=-1, metavar="BYTES",
                   help="free receive buffers kept between pushes, so that a gradient lands in memory already "
                   "faulted in (buffers of 4 MiB and more; with --max-memory they count against it until a push "
                   "takes them); 0: none (default: as many bytes as the shard's variables, one push's worth)")
    q.add_argument("--no-pull-cache", action="store_true", help="copy (or cast) a variable for every pull: without "
                   "it a variable of 1 MiB or more is made once per version and cast and sent from those bytes "
                   "to every pull of that version (from its first pull in sync mode, else its third, or its "
                   "second cast; at most one version each, within --max-memory, given up to a push that needs "
                   "the room)")
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


def _overlap(a: str, b: str) -> bool:
    """True if folder `a` is `b`, lies inside it or holds it."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def resolve(args: argparse.Namespace) -> tuple[Cluster | None, int, str]:
    """(cluster or None, index, address to bind) from flags and TF_CONFIG; ClusterConfigError if inconsistent."""
    if (args.table_storage == "ssd" or args.table_cache) and not args.table_dir:
        raise ClusterConfigError("tables on SSD are kept under --table-dir: pass it with --table-storage ssd and "
                                 "with --table-cache")
    if args.table_cache and args.max_memory and args.table_cache >= args.max_memory:
        raise ClusterConfigError(f"--table-cache {args.table_cache} must leave room under --max-memory "
                                 f"{args.max_memory} for the variables and the tables' other records")
    if args.table_dir and any(_overlap(args.table_dir, d) for d in (args.checkpoint_dir, args.journal_dir) if d):
        raise ClusterConfigError("--table-dir is emptied at start: it must not hold or lie inside --checkpoint-dir "
                                 "or --journal-dir")
    task = None
    if args.cluster:
        cluster = Cluster.from_json(args.cluster)
    elif args.bind and args.index is not None and "TF_CONFIG" not in os.environ:
        if args.replica_of or args.replicated:
            raise ClusterConfigError(f"{'--replica-of' if args.replica_of else '--replicated'} needs the job's "
                                     "cluster (--cluster or TF_CONFIG): ps 0 decides failovers")
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
    if args.replica_of:
        if not args.journal_dir or args.no_journal:
            raise ClusterConfigError("--replica-of keeps the copy of the primary's journal in --journal-dir: pass it")
        if not args.bind or args.bind.endswith(":0"):
            raise ClusterConfigError("--replica-of serves at --bind HOST:PORT once promoted: pass a fixed port "
                                     "(clients are told this address, or --advertise's)")
    elif args.advertise:
        raise ClusterConfigError("--advertise names where a backup (--replica-of) serves once promoted: pass both")
    if args.replicated and (args.no_journal or not (args.journal_dir or args.checkpoint_dir)):
        raise ClusterConfigError("--replicated: a shard with a backup keeps a journal, which its backup copies: "
                                 "pass --checkpoint-dir or --journal-dir, without --no-journal")
    return cluster, index, address


def load_security(args: argparse.Namespace) -> Security:
    """The shard's credentials; ClusterConfigError unless it has some or was told --insecure."""
    security = require_credentials(Security.load(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                                                 token_file=args.token_file, admin_token_file=args.admin_token_file),
                                   args.insecure)
    if security.token is not None and not security.tls:
        _LOGGER.warning("the token file holds one job token, which names no task: without TLS any holder may act "
                        "in any worker's name (ps-certs makes per-task tokens: --token-file DIR/tokens)")
    return security
