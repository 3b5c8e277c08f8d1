"""One shard process from its checked flags to its exit: restore, journal, serve until signalled, stop.

ps-server's main (ps_server/__main__.py) checks the flags first (ps_server/flags.py, no torch), then calls
`serve` here; the fork server preloads this module, so a forked shard finds everything imported.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Callable

import torch
from grpc_health.v1 import health

from ..access import describe
from ..checkpoint_folder import LAUNCH_ADVICE, hold_shard, journal_dir
from ..cli import INTERRUPTED, USAGE_ERROR
from ..cluster import Cluster
from ..errors import ClusterConfigError, PSError
from ..memory import tune_malloc
from ..cluster import arbiter_of
from ..security import Security
from . import checkpoint
from .backup import PROGRESS_SECONDS, Backup, confirm_role, needs_role_check
from .failstop import FailStop
from .journal import Journal, Layout, recorded_layout
from .metrics import ShardMetrics
from .quotas import Quotas
from .replica_rpcs import RoleFence
from .replication import Replication
from .server import create_server, serve_health, set_health
from .signpost import Signpost
from .ssd_tables import TableStorage
from .store import VariableStore

__all__ = ["serve", "initial_state", "open_journal"]

_LOGGER = logging.getLogger("torchps.ps_server")
STOP_GRACE_SECONDS = 2.0  # in-flight calls get this long after SIGTERM before they are cancelled
LOCK_RETRY_SECONDS = 0.05     # a promoted backup's first pause between tries for its checkpoint folder's lock
LOCK_PROGRESS_SECONDS = 5.0   # a promoted backup without that lock says so this often
SIGNAL_CHECK_SECONDS = 0.2  # how often the main thread looks for a signal delivered to another thread


def initial_state(args: argparse.Namespace, cluster: Cluster | None, index: int, *, journaled: bool = False
                  ) -> dict | None:
    """The state to start from: none with --join (a shard a live resize adds); else the newest committed
    checkpoint under --checkpoint-dir, else one of --restore-from (re-laid out for this cluster, embedding
    tables included), else None. Without a shard count (a standalone shard) the checkpoint is taken as
    written for this layout. A `journaled` shard (its journal empty) whose index is past the newest
    checkpoint's shards starts empty too: it can only be one a live resize adds (a restart of the job on
    more shards finds the old shards' journals of fewer shards, and those refuse it). Blocks while the files
    are read; CheckpointError for a checkpoint that is damaged or incomplete (tables included), or whose part
    for this shard is over --max-memory: the shard then does not start."""
    num_ps = cluster.num_ps if cluster is not None else args.num_ps
    if args.join:
        if args.restore_from:
            raise ClusterConfigError("--join starts a shard empty, --restore-from from a checkpoint: pass one")
        _LOGGER.info("ps %d joins a running job: it starts empty, and a live resize brings its variables", index)
        return None
    if args.restore_from and not num_ps:
        raise ClusterConfigError("--restore-from needs the number of shards: pass --cluster or --num-ps")
    for directory in (args.checkpoint_dir, args.restore_from):
        if directory:
            state = checkpoint.restore_state(directory, index, num_ps, max_bytes=args.max_memory,
                                             new_job=directory != args.checkpoint_dir,
                                             join_past=journaled and directory == args.checkpoint_dir)
            if state is not None:
                return state
    if args.restore_from:
        raise ClusterConfigError(f"--restore-from {args.restore_from}: no committed checkpoint there")
    return None


def table_storage(args: argparse.Namespace, index: int, address: str, promoted: bool) -> TableStorage:
    """Where the shard keeps dynamic tables (--table-storage, --table-dir, --table-cache): the cache defaults to
    half of --max-memory, else 256 MiB. A `promoted` backup (or one serving at its own address again) keeps
    them in a folder of its own, named by the port it serves at (DIR/ps-N-at-PORT; its process id for port 0):
    its old primary may still run beside it, fenced."""
    cache = args.table_cache or (args.max_memory // 2 if args.max_memory else 256 << 20)
    port = address.rpartition(":")[2]
    name = (f"ps-{index}-at-{port}" if port != "0" else f"ps-{index}-pid-{os.getpid()}") if promoted else f"ps-{index}"
    return TableStorage(args.table_storage, args.table_dir, name=name, cache_bytes=cache)


def _spec_workers(cluster: Cluster | None) -> frozenset[str]:
    """The names the cluster spec's chief and workers join with ("worker:1")."""
    return frozenset(cluster.training_names()) if cluster else frozenset()


def open_journal(args: argparse.Namespace, cluster: Cluster | None, index: int,
                 on_failure: Callable[[str], None], promoted: bool = False) -> Journal | None:
    """The shard's journal: --journal-dir, else CHECKPOINT_DIR/journal/ps-INDEX, unless --no-journal. One that
    holds another job's or layout's state is refused (ClusterConfigError), or with --replace-journal moved
    aside for --restore-from's checkpoint. Its messages name ps-launch's --replace-journal to a shard
    ps-launch started (--launched-by), ps-server's flags otherwise. `promoted`: a backup's copy, which its
    primary's stream wrote: the job's shard count is the copy's (a live resize after the backup started leaves
    its cluster spec behind)."""
    if args.replace_journal and not args.restore_from:
        raise ClusterConfigError("--replace-journal moves a journal aside for --restore-from's checkpoint: pass "
                                 "--restore-from too")
    if args.no_journal:
        return None
    directory = args.journal_dir or (args.checkpoint_dir and journal_dir(args.checkpoint_dir, index))
    if not directory:
        return None
    num_ps = cluster.num_ps if cluster is not None else args.num_ps
    copied = recorded_layout(directory) if promoted else None
    layout = Layout(index, copied.num_ps if copied is not None and copied.index == index else num_ps,
                    os.path.abspath(args.restore_from) if args.restore_from else None)
    journal = Journal(directory, layout=layout, sync=args.journal_sync, on_failure=on_failure,
                      advice=LAUNCH_ADVICE if args.launched_by == "ps-launch" else None)
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


def serve_backup(args: argparse.Namespace, cluster: Cluster, index: int, address: str, security: Security,
                 primary: str, me: str) -> int:
    """Runs the backup of shard `index` at `primary` (ps-server --replica-of; backup.py) until SIGTERM/SIGHUP
    (0) or SIGINT (130), or the job's end; once its arbiter promotes it, serves the shard bound to `address`
    from its copy, known to the job as `me` (serve); started on a copy whose arbiter records `me` serving the
    shard already (Backup.run's "serves"), serves it as a restarted primary does, once its arbiter confirmed it."""
    if security.lacks_line(f"ps:{index}"):
        print(f"ps-server: error: the token table (--token-file) has no line for ps:{index}, whose token this backup "
              f"calls its primary and arbiter with: give the shard one (ps-certs DIR --add ps:{index}, as for a shard "
              f"a resize adds) and start the backup again", file=sys.stderr)
        return USAGE_ERROR
    try:
        held = hold_shard(None, args.journal_dir, index)
    except PSError as exc:
        print(f"ps-server: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    # The signpost says where ps N is served until the promoted backup serves it there (signpost.py).
    signpost = Signpost(index, address, security, lambda: backup.primary)
    backup = Backup(index, me, primary, tuple(cluster.ps), args.journal_dir, security.as_shard(index),
                    sync=args.journal_sync, failover_after=args.failover_after,
                    keeps_stores=args.table_dir is not None, on_promotion=lambda state: signpost.hold(me)
                    if state == "granted" else signpost.asking(state == "asking"))
    interrupted = []

    def on_signal(signum, _frame) -> None:
        interrupted.append(signum == signal.SIGINT)
        backup.stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    _LOGGER.info("ps %d backup of %s (pid %d): its copy in %s; serves at %s if promoted", index, primary,
                 os.getpid(), args.journal_dir, me)
    signpost.start()
    try:
        try:
            role = backup.run()
        finally:
            backup.close()
            held.release()
        if not role:
            return INTERRUPTED if interrupted and interrupted[0] else 0
        args.replica_of, args.restore_from = None, None
        # "serves": the record names this address serving the shard already (an earlier run of it was promoted):
        # it serves as a restarted primary, once its arbiter confirmed it, its backup in sync dropped first.
        args.replicated = args.replicated or role == "serves"
        return serve(args, cluster, index, address, security, me=me, promoted=role == "promoted", signpost=signpost)
    finally:
        signpost.stop()


def _await_takeover(index: int, me: str, backup: str, cluster: Cluster, security: Security, stop: threading.Event,
                    failover_after: float) -> tuple[str, str] | None:
    """(A primary started on an empty journal folder whose arbiter records `backup` in sync.) That backup holds
    the changes this shard acknowledged since the last checkpoint, which this process lacks: it neither serves
    nor drops it, and renews no lease, so the backup is promoted once it asks. Waits (saying so every
    PROGRESS_SECONDS) until the arbiter's record names another primary, or no backup in sync; that record, or
    None at `stop`."""
    _LOGGER.warning("ps %d starts on an empty journal folder while its arbiter records its backup %s in sync, which "
                    "holds what this shard acknowledged since the last checkpoint: it waits for that backup to take "
                    "over, and then follows it", index, backup)
    said = time.monotonic()
    while True:
        if stop.wait(failover_after):
            return None
        record = confirm_role(index, me, tuple(cluster.ps), security.as_shard(index), stop, failover_after * 4)
        if record is None or record[0] != me or not record[1]:
            return record
        if time.monotonic() - said >= PROGRESS_SECONDS:
            said = time.monotonic()
            _LOGGER.warning("ps %d still waits for its backup %s to take over (start it, or let it reach its "
                            "arbiter; lost with its copy, give it up: ps-admin drop-backup --shard %d, and this "
                            "shard serves the newest checkpoint)", index, record[1], index)


def _try_checkpoint_part(checkpoint_dir: str | None, index: int, late: list, who: str) -> str | None:
    """Takes shard `index`'s part of `checkpoint_dir` (into `late`) if it is free now: None if it did (or there
    is no folder), else why the shard writes no checkpoint yet (for Replication.hold_saving; `who` begins it:
    what this shard is). Never blocks. A promoted backup and a confirmed primary serve at once either way, and
    take the part later (_checkpoints_later)."""
    if not checkpoint_dir:
        return None
    try:
        late.append(hold_shard(checkpoint_dir, None, index))
        return None
    except ClusterConfigError as exc:  # a process it replaced, or one replaced and not stopped yet
        return (f"{who}, and another process of its shard still holds its part of the checkpoint folder ({exc}): "
                f"it writes checkpoints once that one stopped; retry")
    except OSError as exc:  # a shared folder that failed for a moment
        return (f"{who}, and cannot hold its part of the checkpoint folder yet ({exc}): it writes checkpoints "
                f"once it does; retry")


def _checkpoints_later(checkpoint_dir: str, index: int, stop: threading.Event, late: list, replication: Replication,
                       failstop: FailStop) -> None:
    """(A thread of a promoted backup, or of a confirmed primary whose folder a replaced process of its shard
    still holds.) Takes shard `index`'s part of `checkpoint_dir` (into `late`) once the process it replaced let
    go of it (that one stops once it hears it was replaced; one cut off may hold it for long), trying again and again (pauses doubling from LOCK_RETRY_SECONDS), then cleans its partial
    checkpoint and lets `replication` save (hold_saving: Save, CommitCheckpoint); a clean that fails stops the
    shard (`failstop`), as at a start. Says every LOCK_PROGRESS_SECONDS what it waits for; ends at `stop`."""
    began = said = time.monotonic()
    pause = LOCK_RETRY_SECONDS
    while not stop.is_set():
        try:
            held = hold_shard(checkpoint_dir, None, index)
        except (ClusterConfigError, OSError) as exc:  # OSError: a shared folder that failed for a moment
            if time.monotonic() - said >= LOCK_PROGRESS_SECONDS:
                said = time.monotonic()
                _LOGGER.warning("ps %d writes no checkpoint yet: it cannot hold its part of the checkpoint folder "
                                "after %.0f s (%s)", index, said - began, exc)
            stop.wait(pause)
            pause = min(2 * pause, LOCK_PROGRESS_SECONDS / 5)
            continue
        late.append(held)
        _clean_checkpoint_part(checkpoint_dir, index, failstop)
        _LOGGER.info("ps %d holds its part of the checkpoint folder %s: it writes checkpoints", index, checkpoint_dir)
        replication.hold_saving(None)  # (after the line: whoever saw a save succeed finds it in the log)
        return


def _clean_checkpoint_part(checkpoint_dir: str | None, index: int, failstop: FailStop) -> None:
    """(A shard that took its part of the checkpoint folder after its start, before it writes there.) Deletes what
    a killed predecessor left there (checkpoint.clean_partial); a clean that fails stops the shard (`failstop`:
    never returns), as a failure at a start does."""
    if checkpoint_dir:
        try:
            checkpoint.clean_partial(checkpoint_dir, index)
        except OSError as exc:
            failstop.fatal(f"ps {index} serves its shard, yet cannot clean its part of the checkpoint folder: {exc}")


def serve(args: argparse.Namespace, cluster: Cluster | None, index: int, address: str, security: Security,
          me: str = "", promoted: bool = False, signpost: Signpost | None = None) -> int:
    """Runs the shard the checked flags describe until SIGTERM/SIGHUP (0), SIGINT (130) or a Shutdown call
    (0); a shard that cannot start (its journal, checkpoint, port) prints one line and returns 2. Blocks.
    `me`: the address the arbiter records this shard at (a promoted backup's; default: the cluster spec's). A
    shard whose journal says it had a backup serves status and the layout only until its arbiter confirmed it
    still serves its shard (backup.confirm_role); another address serving it, it becomes that one's backup
    (serve_backup). `signpost`: the backup's, on `address`, which lets go of it as the shard binds it, and
    ends once it is bound (or the shard cannot start)."""
    if args.replica_of:
        return serve_backup(args, cluster, index, address, security, args.replica_of, args.advertise or address)
    folder = args.journal_dir or (args.checkpoint_dir and journal_dir(args.checkpoint_dir, index))
    me = me or (cluster.ps[index] if cluster is not None else address)
    fence = None
    # (Just promoted: its arbiter knows.)
    if not promoted and cluster is not None and folder and not args.no_journal and \
            needs_role_check(index, tuple(cluster.ps), pathlib.Path(folder), args.replicated):
        fence = RoleFence(f"ps {index} has or had a backup: it serves once its arbiter, "
                          f"ps:{arbiter_of(index, cluster.num_ps)}, confirmed it still serves ps:{index}; retry")
    tune_malloc("shard")
    faulthandler.enable()  # a crash in native code (SIGSEGV, SIGABRT) leaves every thread's Python stack in its log
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    health_servicer, health_server = health.HealthServicer(), None
    set_health(health_servicer, serving=False)
    try:
        # Its files are this process's alone until it exits (the kernel lets go of the locks then, however it ends).
        # A shard not yet confirmed serves no checkpoint: it takes that folder's lock once confirmed. A promoted
        # backup serves at once: a checkpoint folder the primary it replaced still holds (stopped or cut off, not
        # dead) it takes later (_checkpoints_later), refusing Save and CommitCheckpoint meanwhile.
        held = hold_shard(None if fence or promoted else args.checkpoint_dir, args.journal_dir, index)
        late = []  # the checkpoint folder's lock, taken once the arbiter confirmed this shard, or once promoted
        # Why a promoted shard writes no checkpoint yet (Replication.hold_saving)
        folder_wait = _try_checkpoint_part(args.checkpoint_dir, index, late, f"ps {index} was promoted just now") \
            if promoted else None
        # A part of the shard that fails (a background thread, the journal) stops the whole process.
        failstop = FailStop(on_stop=lambda: set_health(health_servicer, serving=False), what=f"ps {index}")
        if args.health_port is not None:
            health_server, health_port = serve_health(health_servicer, f"{address.rpartition(':')[0]}:{args.health_port}")
            if args.health_port_file:
                _write_port(args.health_port_file, health_port)
        store = VariableStore(allow_nonfinite=args.allow_nonfinite)
        journal = open_journal(args, cluster, index, failstop.fatal, promoted)
        empty = journal is not None and not journal.holds_state()  # a new disk's folder: no change it acknowledged
        if args.checkpoint_dir and fence is None and folder_wait is None:  # else cleaned once it holds the folder
            checkpoint.clean_partial(args.checkpoint_dir, index)
        restore = initial_state(args, cluster, index, journaled=journal is not None) \
            if journal is None or not journal.holds_state() else None
        stop = threading.Event()
        metrics = ShardMetrics(args.metrics_port) if args.metrics_port is not None else None
        server, port, coordinator = create_server(
            store, index, address, max_chunk_bytes=args.max_chunk_bytes, threads=args.threads,
            max_waiting_calls=args.max_waiting_calls, checkpoint_dir=args.checkpoint_dir, restore=restore,
            journal=journal, on_shutdown=lambda reason: stop.set(), security=security,
            quotas=Quotas(max_memory=args.max_memory, max_variable_bytes=args.max_variable_bytes,
                          max_calls_per_client=args.max_calls_per_client), health_servicer=health_servicer,
            metrics=metrics, reflection=args.reflection, failstop=failstop, workers=_spec_workers(cluster),
            elastic_workers=args.elastic_workers, stream_idle_seconds=args.stream_idle_seconds,
            addresses=tuple(cluster.ps) if cluster is not None else (),
            keep_receive_bytes=args.keep_receive_buffers, lane_port=None if args.no_lanes else args.lane_port,
            pull_cache=not args.no_pull_cache, me=me, replica_ack_timeout=args.replica_ack_timeout,
            failover_after=args.failover_after, fence=fence,
            table_storage=table_storage(args, index, address,
                                        promoted or (cluster is not None and me != cluster.ps[index])),
            before_bind=signpost.let_go if signpost is not None else None)
        server.replication.hold_saving(folder_wait)
    except (PSError, RuntimeError, OSError) as exc:
        _stop(health_server)
        print(f"ps-server: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        _stop(health_server)
        print("ps-server: interrupted", file=sys.stderr)
        return INTERRUPTED
    finally:
        if signpost is not None:  # the calls it held call again: the address is this shard's now
            signpost.stop()
    interrupted = []

    def on_signal(signum, _frame) -> None:  # SIGTERM, SIGHUP: a clean stop (0); SIGINT (Ctrl-C): 130
        interrupted.append(signum == signal.SIGINT)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    # What exists now (torch's, gRPC's and the project's modules, the restored state) lives as long as the shard:
    # out of the collector's full passes, which would otherwise walk it all, holding the GIL, the event loop
    # included, for ~0.1 s every few seconds of a busy shard.
    gc.freeze()
    server.start()
    host = address.rpartition(":")[0]
    mode = ("mutual TLS" if security.tls else "plaintext") + (
        ", per-task tokens" if security.task_tokens else ", job token" if security.token else "")
    _LOGGER.info("ps %d uses %d torch thread(s) for updates and lookups", index, torch.get_num_threads())
    if args.max_memory:
        _LOGGER.info("ps %d holds at most %d bytes (--max-memory)", index, args.max_memory)
    serving = ("ps %d serving on %s:%d (pid %d): %s", index, host, port, os.getpid(),
               "INSECURE: no TLS, no token" if security.insecure else mode)
    if fence is None:
        _LOGGER.info(*serving)
    else:
        _LOGGER.info("ps %d answers status and the layout only, on %s:%d (pid %d), until its arbiter confirms it still "
                     "serves ps:%d", index, host, port, os.getpid(), index)
    _LOGGER.info("ps %d security policy: %s", index, describe(security))
    if metrics is not None:
        _LOGGER.info("ps %d metrics on http://%s:%d/metrics", index, host, metrics.port)
    if args.port_file:  # after what the shard says at start: whoever waits for the file finds it in the log
        _write_port(args.port_file, port)
    set_health(health_servicer, serving=True)  # last: whoever sees SERVING finds the port file and the log written
    demoted: list[str] = []  # the address that serves this shard now, if not this process (a failover)
    if folder_wait is not None:
        failstop.thread(_checkpoints_later, args.checkpoint_dir, index, stop, late, server.replication, failstop,
                        name="checkpoint-folder").start()
    elif fence is not None:
        def confirm() -> None:
            record = confirm_role(index, me, tuple(cluster.ps), security.as_shard(index), stop,
                                  args.failover_after * 4)
            if record is not None and empty and record[0] == me and record[1]:
                server.replication.awaited_backup = record[1]  # (GetStatus says so meanwhile)
                try:
                    record = _await_takeover(index, me, record[1], cluster, security, stop, args.failover_after)
                finally:
                    server.replication.awaited_backup = ""
            if record is None:
                return
            if record[0] != me:
                _LOGGER.warning("ps %d: its arbiter says %s serves it now (a failover): this shard becomes its backup",
                                index, record[0])
                demoted.append(record[0])
                stop.set()
                return
            # Its backup in sync before it stopped holds no change it acknowledges from now on: dropped first, or
            # (promoted meanwhile) this shard is fenced and stops. Dropped with none in sync too: an IN_SYNC it
            # asked before it stopped, should the arbiter decide it late, then changes nothing (replicas.py).
            fence.confirmed()
            if not server.replication.drop_stale(record[1]):
                return
            if not stop.is_set():
                _LOGGER.info("ps %d: its arbiter confirms it serves ps:%d", index, index)
                waiting = _try_checkpoint_part(args.checkpoint_dir, index, late, f"ps {index} serves its shard")
                if waiting is None:
                    _clean_checkpoint_part(args.checkpoint_dir, index, failstop)
                else:  # saving refused before the fence opens: no Save comes between
                    server.replication.hold_saving(waiting)
                    failstop.thread(_checkpoints_later, args.checkpoint_dir, index, stop, late, server.replication,
                                    failstop, name="checkpoint-folder").start()
                fence.open()
                _LOGGER.info(*serving)

        # Whatever fails in it stops the shard (fail-stop), rather than leave it fenced for good.
        failstop.thread(confirm, name="role-check").start()
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
    held.release()
    for lock in late:
        lock.release()
    _stop(health_server)
    if not stopped:
        _LOGGER.warning("ps %d: calls still running after the grace period; exiting anyway", index)
        logging.shutdown()
        os._exit(0)  # handler threads that never return must not keep a stopped shard alive
    if demoted and not interrupted:
        args.journal_dir = str(folder)
        return serve_backup(args, cluster, index, address, security, demoted[0], me)
    if interrupted and interrupted[0]:
        print("ps-server: interrupted", file=sys.stderr)
        return INTERRUPTED
    return 0

