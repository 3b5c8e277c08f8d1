"""ps-admin: a running job's administration from the command line, with the chief's credentials.

    ps-admin layout --cluster CLUSTER
        prints the job's layout (its epoch, its shards and how many variables and bytes each holds), each
        replicated shard's primary, backup, replication lag and failovers, and its last live resize as ps 0
        records it (phase, driver, lease, moves)
    ps-admin resize --cluster CLUSTER --ps ADDR[,ADDR...]
        makes the job's shards ADDR... while it trains (PSClient.resize, client/resize.py); added shards
        must be running (ps-server --index N --join), removed ones are stopped
    ps-admin resize --cluster CLUSTER --resume | --abort
        takes over a resize that was cut off (its driver died: ps 0 says so once its lease ran out) and
        finishes it, or rolls it back (one past its point of no return is finished)
    ps-admin drop-backup --cluster CLUSTER --shard N [--force]
        gives up shard N's backup in sync, lost for good with its copy: the shard's arbiter drops it from its
        record (SetReplica DROP), so a primary restarted on an empty folder, which waits for that backup,
        serves the newest checkpoint instead (what only that backup held is lost); refused unless that
        primary says it waits for that backup, while anything accepts a connection at the backup's address,
        and, without --force, when that address cannot be reached at all (a refused connection shows nothing
        runs there; a host that is gone, only that it cannot be told)

CLUSTER is the cluster JSON (or a file holding it) the job started with, else TF_CONFIG's: it names ps 0,
and the job's current shards are those of ps 0's layout. The calls carry the chief's credentials, given as
ps-worker's are: --tls-cert/--tls-key/--tls-ca with the chief's certificate and/or --admin-token-file (or
--token-file with the chief's token), else TORCHPS_TLS_CERT/KEY/CA, TORCHPS_TOKEN_FILE and
TORCHPS_ADMIN_TOKEN_FILE (ps-certs writes them all); --insecure for shards started --insecure.
Exit codes: 0 done, 1 a shard refused or could not be reached (the message says which; a resize that
failed was rolled back, or is left cut off for --resume or --abort; a backup still reachable is not dropped),
2 a usage error, answered before
gRPC is imported. ps-admin never imports torch: it runs the client's channels, fan-out, layout follower
and resize driver (client/fanout.py, layout.py, resize.py) without PSClient.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from .cli import USAGE_ERROR, ArgumentParser
from .cluster import Cluster
from .credential_flags import ENV_HELP, add_security_flags, resolve_security
from .errors import ClusterConfigError, PSError
from .forkserver import run_main
from .security import Security

__all__ = ["main"]

RESIZE_CALL_SECONDS = 300.0  # each attempt of a move's export or import (PSClient's default timeout)
BACKUP_LOOK_SECONDS = 3.0    # drop-backup: how long a connection to the backup's address is tried


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="ps-admin", description="Administer a running torchps job (see torchps/admin.py). "
                            "Every command takes the chief's " + ENV_HELP + ": see ps-admin COMMAND --help.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("layout", "print the job's layout"), ("resize", "change the job's shards live"),
                       ("drop-backup", "give up a shard's backup in sync, lost for good")):
        command = commands.add_parser(name, help=text, description=f"{text}, with the chief's {ENV_HELP}.")
        command.add_argument("--cluster", help="the job's cluster JSON or a file holding it (default: TF_CONFIG)")
        command.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to wait for a shard")
        if name == "drop-backup":
            command.add_argument("--shard", type=int, required=True, help="the shard whose backup is lost (its "
                                 "primary, restarted on an empty folder, then serves the newest checkpoint)")
            command.add_argument("--force", action="store_true", help="drop it although its address cannot be "
                                 "reached, so whether it runs cannot be told (its host is gone)")
        if name == "resize":
            what = command.add_mutually_exclusive_group(required=True)
            what.add_argument("--ps", help="the job's shards after the resize, comma-separated, the current ones "
                              "first in their order (added at the end, removed from the end)")
            what.add_argument("--resume", action="store_true", help="finish the resize that was cut off")
            what.add_argument("--abort", action="store_true",
                              help="roll back the resize that was cut off (one past its point of no return: its "
                                   "tables re-laid out or its last epoch set, is finished)")
            command.add_argument("--drain-seconds", type=float, help="how long removed shards answer before they "
                                 "are stopped (default: client/resize.py's DRAIN_SECONDS, 2)")
            command.add_argument("--lease-seconds", type=float, help="the resize's lease: should this process die, "
                                 "the resize is cut off, and a sync job's hold ends, this long after its last "
                                 "renewal (default: client/resize.py's LEASE_SECONDS, 30)")
        add_security_flags(command)
    return parser


class _Job:
    """The job's shards, called as the chief's client calls them (fan-out, layout follower), without torch."""

    def __init__(self, cluster: Cluster, security: Security, connect_timeout: float):
        from .client.fanout import CONTROL_TIMEOUT_SECONDS, ShardFanout
        from .client.layout import LayoutFollower
        from .placement import Placement
        from .sizes import DEFAULT_CHUNK_BYTES

        self.fanout = ShardFanout(cluster, connect_timeout=connect_timeout, security=security,
                                  timeout=RESIZE_CALL_SECONDS, control_timeout=CONTROL_TIMEOUT_SECONDS,
                                  chunk_bytes=DEFAULT_CHUNK_BYTES)
        self.follower = LayoutFollower(self.fanout, Placement(cluster.num_ps, "round_robin"))

    def __enter__(self) -> "_Job":
        return self

    def __exit__(self, *exc) -> None:
        self.fanout.close()

    def call(self, shard: int, fn):
        return self.fanout.call(shard, fn, self.fanout.control_timeout)

    def shards(self) -> tuple[list[str], list]:
        """The job's shards now, each at the address that serves it, and the record of the replicated ones
        (ShardReplicas, by index): ps 0's layout, and ps 1's where the job has it (ps 1 records ps 0's own
        failovers; a call each, one more after a live resize). A shard whose backup took over is called at
        its new primary from then on."""
        from .proto import ps_pb2

        def layout_of(shard: int) -> ps_pb2.Layout:
            return self.call(shard, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t))

        layout = layout_of(0)
        self.follower.refresh(seen=layout.epoch)
        channels = self.fanout.channels
        records = {entry.index: entry for entry in layout.replicas}
        for entry in records.values():
            if entry.index < channels.live and entry.primary not in ("", channels.addresses[entry.index]):
                channels.redirect(entry.index, entry.primary)
        if channels.live > 1:
            records.update((entry.index, entry) for entry in layout_of(1).replicas if entry.index == 0)
        return list(channels.addresses[:channels.live]), [records[index] for index in sorted(records)]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cluster = Cluster.from_json(args.cluster) if args.cluster else Cluster.from_tf_config()[0]
        if not args.connect_timeout > 0:
            raise ClusterConfigError(f"--connect-timeout must be > 0. Received: {args.connect_timeout}")
        if args.command == "drop-backup" and args.shard < 0:
            raise ClusterConfigError(f"--shard must be >= 0. Received: {args.shard}")
        if args.command == "resize" and args.lease_seconds is not None and not 0 < args.lease_seconds <= 3600:
            raise ClusterConfigError(f"--lease-seconds must be in (0, 3600]. Received: {args.lease_seconds}")
        security = resolve_security(args)
        from .client import resize as live_resize  # gRPC: only once the flags are right

        with _Job(cluster, security, args.connect_timeout) as job:
            if args.command == "resize":
                options = {key: value for key, value in (("drain_seconds", args.drain_seconds),
                                                         ("lease_seconds", args.lease_seconds)) if value is not None}
                driver = live_resize.driver_name("ps-admin")
                if args.resume:
                    report = live_resize.resume(job.fanout, job.follower, driver=driver, **options)
                elif args.abort:
                    report = live_resize.abort(job.fanout, job.follower, driver=driver, **options)
                else:
                    report = live_resize.run(job.fanout, job.follower,
                                             [a.strip() for a in args.ps.split(",") if a.strip()], driver=driver,
                                             **options)
                print(report.line())
            elif args.command == "drop-backup":
                print(_drop_backup(job, cluster, args.shard, args.force))
            else:
                print(_layout(job, lambda: live_resize.state(job.fanout)))
    except ClusterConfigError as exc:
        print(f"ps-admin: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except PSError as exc:
        print(f"ps-admin: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def _layout(job: _Job, resize_record: Callable[[], object]) -> str:
    """The layout as text: the epoch, each shard's address, variables and bytes, each replicated shard's
    primary, backup, lag (its primary's GetStatus), failovers and the backup it waits for, and ps 0's record
    of the last resize (resize_record(), read unless ps 0 waits for its backup)."""
    from .proto import ps_pb2

    addresses, replicas = job.shards()
    lines = [f"layout epoch {job.follower.epoch}: {len(addresses)} shards"]
    # GetStatus: a shard restarted with a backup answers it before its arbiter confirmed it (replica_rpcs.RoleFence)
    statuses = [job.call(shard, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t))
                for shard in range(len(addresses))]
    for shard, (address, status) in enumerate(zip(addresses, statuses)):
        lines.append(f"  ps:{shard} {address}: {status.num_variables} variables, {status.total_bytes:,} bytes")
    for entry in (entry for entry in replicas if entry.index < len(addresses)):
        status = statuses[entry.index]
        lines.append(_replica_line(entry, status.replication, status.awaits_backup))
    if statuses[0].awaits_backup:  # (its record of resizes is not read: it answers status and the layout only)
        return "\n".join([*lines, "resize: ps 0 answers only its status and the layout while it waits for its backup"])
    record = resize_record()
    if record.id:
        phase = ps_pb2.ResizeState.Phase.Name(record.phase).lower()
        if record.phase == ps_pb2.ResizeState.RUNNING:
            phase += (f", lease {record.lease_left_seconds:.1f} s left" if record.lease_left_seconds else
                      ", cut off: ps-admin resize --resume finishes it, --abort rolls it back"
                      + (" (finishes it too: its tables were being re-laid out)" if record.table_shards else ""))
        statuses = [ps_pb2.ResizeMove.Status.Name(move.status).lower() for move in record.moves]
        counts = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses)) or "no moves"
        if record.table_shards:
            counts += (f"; tables re-laid out onto {record.table_shards} shards from {record.tables_from}, "
                       + ("built" if record.tables_built else "not built everywhere yet"))
        lines.append(f"resize {record.id}: {len(record.before)} -> {len(record.after)} shards, {phase}; driver "
                     f"{record.driver}; {counts}" + (f"; {record.ended_why}" if record.ended_why else ""))
    return "\n".join(lines)


def _drop_backup(job: _Job, cluster: Cluster, shard: int, force: bool) -> str:
    """Asks shard `shard`'s arbiter to drop the backup its record names in sync, once the primary it names says
    it waits for that backup (StatusResponse.awaits_backup: restarted on an empty folder) and nothing accepts a
    connection at the backup's address (refused: nothing listens there; a timeout or an unreachable host only
    with `force`). ClusterConfigError for a shard the job does not have; ReplicaFencedError, naming why, when
    it drops nothing; PSErrors as the shards answer."""
    from .cluster import arbiter_of
    from .errors import ReplicaFencedError
    from .proto import ps_pb2
    from .security import tcp_connect

    addresses, _ = job.shards()  # (each shard's channel where it is served now, its arbiter's included)
    if shard >= len(addresses):
        raise ClusterConfigError(f"--shard must name one of the job's {len(addresses)} shards. Received: {shard}")
    arbiter = arbiter_of(shard, cluster.num_ps)
    if arbiter == shard:
        raise ReplicaFencedError(f"ps:{shard} of a one-shard job is its own arbiter: it never waits for its backup "
                                 f"(which takes over by hand only); nothing dropped")
    layout = job.call(arbiter, lambda stub, t: stub.GetLayout(ps_pb2.LayoutRequest(), timeout=t))
    entry = next((entry for entry in layout.replicas if entry.index == shard), None)
    if entry is None or not entry.backup:
        return f"ps:{shard} has no backup in sync: nothing to drop"
    try:  # (where the record says it is served: job.shards() moved the shard's channel there)
        status = job.call(shard, lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t))
    except PSError as exc:
        raise ReplicaFencedError(f"ps:{shard}'s primary {entry.primary} does not answer ({exc}): its backup "
                                 f"{entry.backup} takes over by itself; nothing dropped") from None
    if status.awaits_backup != entry.backup:
        raise ReplicaFencedError(f"ps:{shard}'s primary {entry.primary} does not wait for its backup {entry.backup} "
                                 f"(it waits only when started on an empty folder): nothing dropped")
    try:
        tcp_connect(entry.backup, BACKUP_LOOK_SECONDS).close()
    except ConnectionRefusedError:
        pass  # its host answers, and nothing listens there: no backup runs
    except (OSError, ValueError) as exc:
        if not force:
            raise ReplicaFencedError(f"ps:{shard}'s backup {entry.backup} cannot be reached ({exc}), so whether it "
                                     f"runs cannot be told: if it is lost for good with its copy, add --force; "
                                     f"nothing dropped") from None
    else:
        raise ReplicaFencedError(f"ps:{shard}'s backup {entry.backup} accepts connections: a process there (even "
                                 f"paused) may hold every change and takes over by itself; nothing dropped (stop "
                                 f"it first if its copy is lost)")
    change = ps_pb2.ReplicaChange(action=ps_pb2.ReplicaChange.DROP, index=shard, primary=entry.primary,
                                  backup=entry.backup)
    try:
        record = job.call(arbiter, lambda stub, t: stub.SetReplica(change, timeout=t))
    except ReplicaFencedError as exc:
        raise ReplicaFencedError(f"ps:{shard}'s record changed meanwhile ({exc}); nothing dropped") from None
    if record.backup == entry.backup:
        raise ReplicaFencedError(f"ps:{shard}'s record names {entry.backup} in sync again: nothing dropped")
    return (f"ps:{shard}: its arbiter ps:{arbiter} dropped the backup {entry.backup}: {record.primary} serves "
            f"ps:{shard} from the newest checkpoint (what only that backup held is lost)")


def _replica_line(entry, replication, awaits: str) -> str:
    """One replicated shard: ps 0's record of it (ShardReplicas), its primary's ReplicationStatus and the backup
    that primary waits for to take over (StatusResponse.awaits_backup; "" if none)."""
    backup = entry.backup or "none"
    if replication.backup and replication.backup != entry.backup:
        backup += f" ({replication.backup} attached, not in sync)"
    last = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(entry.last_failover_unix))
    return (f"  ps:{entry.index} replicated: primary {entry.primary}, backup {backup}, lag "
            f"{replication.lag_records} records, {replication.lag_seconds:.2f} s; failovers {entry.failovers}"
            + (f", the last at {last}" if entry.failovers else "")
            + (f"; the primary, started on an empty folder, waits for {awaits} to take over (lost with its copy: "
               f"ps-admin drop-backup --shard {entry.index})" if awaits else ""))


if __name__ == "__main__":  # as the console script: ends at once with main's code
    run_main(main, sys.argv[1:], "ps-admin")
