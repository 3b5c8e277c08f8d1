"""Building and running one shard's gRPC server."""

from __future__ import annotations

import errno
import logging
import socket
import time
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as reflection_service

from .. import codec
from ..lanes import tls_context
from ..proto import ps_pb2
from .lanes import LaneServer
from .servicer import ParameterServerServicer, add_to_server
from .store import VariableStore
from ..security import INSECURE, Security
from .auth import TokenInterceptor
from .coordinator import Coordinator
from .failstop import FailStop
from .journal import Journal
from .membership import Membership
from .metrics import ShardMetrics
from .quotas import Quotas
from ..cluster import arbiter_of
from .replica_rpcs import RoleFence, TiebreakerLink, arbiter_for
from .backup import FAILOVER_AFTER_SECONDS
from .replication import ACK_TIMEOUT_SECONDS, Replication
from .edge import LoopServer
from .flags import DEFAULT_MAX_WAITING_CALLS, DEFAULT_THREADS
from .ssd_tables import TableStorage
from .stalls import DEFAULT_IDLE_SECONDS
from .tokens import TokenFile

__all__ = ["create_server", "recover", "threaded_waits", "serve_health", "set_health", "SERVICE_NAME",
           "DEFAULT_THREADS", "DEFAULT_MAX_WAITING_CALLS"]

_LOGGER = logging.getLogger(__name__)
SERVICE_NAME = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
HANDOVER_SECONDS = 5.0  # how long an address let go of (before_bind) may take to close: gRPC closes it on its thread
ARBITRATION_THREADS = 16  # SetReplica's threads: each call ends within its timeout, so a queue for them drains


def create_server(
    store: VariableStore,
    index: int,
    address: str,
    *,
    max_chunk_bytes: int = codec.DEFAULT_MAX_CHUNK_BYTES,
    threads: int = DEFAULT_THREADS,
    max_waiting_calls: int | None = None,
    checkpoint_dir: str | None = None,
    restore: dict | None = None,
    journal: Journal | None = None,
    on_shutdown: Callable[[str], None] | None = None,
    security: Security = INSECURE,
    quotas: Quotas | None = None,
    health_servicer: health.HealthServicer | None = None,
    metrics: ShardMetrics | None = None,
    reflection: bool = False,
    failstop: FailStop | None = None,
    workers: frozenset[str] = frozenset(),
    elastic_workers: int | None = None,
    stream_idle_seconds: float = DEFAULT_IDLE_SECONDS,
    addresses: tuple[str, ...] = (),
    keep_receive_bytes: int = -1,
    lane_port: int | None = 0,
    pull_cache: bool = True,
    me: str = "",
    replica_ack_timeout: float = ACK_TIMEOUT_SECONDS,
    failover_after: float = FAILOVER_AFTER_SECONDS,
    fence: RoleFence | None = None,
    table_storage: TableStorage | None = None,
    before_bind: Callable[[], None] | None = None,
) -> tuple[LoopServer, int, Coordinator]:
    """A bound, not yet started, server for `store` bound to `address`; returns (server, port, coordinator).
    The server is a grpc.aio server on its own event loop thread (edge.LoopServer, with a grpc.Server's
    blocking start and stop): call bodies run on a pool of `threads`, held sync pushes and min_step pulls wait
    on the loop holding none; at most `max_waiting_calls` calls wait at once (default
    flags.DEFAULT_MAX_WAITING_CALLS), of them at most threaded_waits(threads) holding a thread.

    Port 0 picks a free port. Raises RuntimeError if the address cannot be
    bound (in use, or not a local address). Messages above max_chunk_bytes plus
    a small envelope are refused by gRPC with RESOURCE_EXHAUSTED. The shard
    starts from its journal if that holds a state, else from `restore` (a
    checkpoint state), else empty; `on_shutdown(reason)` runs after a Shutdown
    call has been answered. With `security` it serves mutual TLS and checks
    tokens and roles (ps_server/auth.py). The gRPC health service answers from `health_servicer` (whose
    status the caller sets, see set_health), else SERVING. With `metrics` (metrics.ShardMetrics) the
    shard's Prometheus figures are served over HTTP on the address's host, at metrics.port. With
    `reflection` the server answers gRPC reflection (`grpcurl list`), under the same credentials as the
    rest of the service. The shard's background threads (lease reaper, sync applier, metrics endpoint) run
    under `failstop` (failstop.FailStop): one that fails marks the shard NOT_SERVING and ends the process;
    without one, a FailStop marking the health service NOT_SERVING is made here. The worker names in
    `workers` (the cluster spec's) may always join, and at most `elastic_workers` others (None: any). A
    client stream (Push, CreateVariables) with no message for `stream_idle_seconds` is ended (stalls.py).
    `addresses`: the job's shards as the cluster spec names them (GetLayout's before any live resize).
    `pull_cache` False: every pull copies its variables itself (ps_server/pull_cache.py). `me`: the address
    ps 0 records this shard at (default: `addresses[index]`, else `address`); a backup (Replicate) that
    leaves a record unacknowledged for `replica_ack_timeout` s is lost (replication.py); as an arbiter, the
    shard promotes a backup only once its primary renewed no lease for `failover_after` s (replicas.py);
    `fence` (replica_rpcs.RoleFence) refuses calls until the caller opens it. `table_storage`: where
    dynamic tables' rows live (ssd_tables.TableStorage; default: memory). `before_bind()` frees `address`,
    which another server of this process holds (a promoted backup's signpost) until the state is back; the
    address is bound once it is free (HANDOVER_SECONDS at most).
    """
    if before_bind is None:
        _check_free(address)
    limit = max_chunk_bytes + codec.ENVELOPE_BYTES
    if threads < 2:
        raise RuntimeError(f"--threads must be at least 2 (one always free for calls that never wait). "
                           f"Received: {threads}")
    if max_waiting_calls is None:
        max_waiting_calls = DEFAULT_MAX_WAITING_CALLS
    if max_waiting_calls < 1:
        raise RuntimeError(f"--max-waiting-calls must be at least 1. Received: {max_waiting_calls}")
    tokens = TokenFile(security)  # the interceptor and the roles follow the token file as it changes
    pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"ps{index}")
    # SetReplica's own: each of its calls ends within its timeout, while calls on `pool` may wait, with no
    # deadline, for this shard's journal, which may wait for a DROP decided here (ps 0 and ps 1 arbitrate each other).
    arbitration = futures.ThreadPoolExecutor(max_workers=ARBITRATION_THREADS, thread_name_prefix=f"ps{index}-arbiter")
    server = LoopServer(lambda: grpc.aio.server(
        migration_thread_pool=pool,  # the health and reflection services' handlers
        interceptors=[*([TokenInterceptor(tokens, index)] if security.checks_tokens else []),
                      *([fence] if fence is not None else [])] or None,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
            # Accept the clients' keepalive pings (every 10 s) during long waits with no data.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    ), name=f"ps{index}-loop")
    if health_servicer is None:
        health_servicer = health.HealthServicer()
        set_health(health_servicer, serving=True)
    if failstop is None:
        failstop = FailStop(on_stop=lambda: set_health(health_servicer, serving=False), what=f"ps {index}")
    coordinator = Coordinator(store, owns_step=index == 0, index=index, max_waiting_calls=max_waiting_calls,
                              threaded_waits=threaded_waits(threads), start=False, failstop=failstop,
                              membership=Membership(workers, elastic_workers), addresses=addresses,
                              failover_after=failover_after, table_storage=table_storage)
    recover(coordinator, journal, restore)
    # Bulk lanes (torchps/lanes.py): TLS with the shard's own credentials where it serves TLS.
    lanes = LaneServer(address.rpartition(":")[0], lane_port, failstop, tls_context(security, server=True)) \
        if lane_port is not None else None
    if lanes is not None:
        server.closers.append(lanes.close)
    me = me or (addresses[index] if index < len(addresses) else address)
    replication = Replication(index, me, lambda: coordinator.recorder.journal, coordinator.recorder.compact_for,
                              arbiter_for(coordinator, index, tuple(addresses), security.as_shard(index)),
                              self_arbitrated=arbiter_of(index, len(addresses)) == index,
                              chunk_bytes=max_chunk_bytes, ack_timeout=replica_ack_timeout,
                              stores=coordinator.tables.storage.on_disk, lease_seconds=failover_after)
    server.replication = replication  # its backups' feeds; the daemon settles a stale backup at start with it
    servicer = ParameterServerServicer(store, coordinator, index, max_chunk_bytes=max_chunk_bytes,
                                       checkpoint_dir=checkpoint_dir, on_shutdown=on_shutdown,
                                       security=security, tokens=tokens, quotas=quotas, metrics=metrics,
                                       stream_idle_seconds=stream_idle_seconds,
                                       keep_receive_bytes=keep_receive_bytes, lanes=lanes, pull_cache=pull_cache,
                                       replication=replication)
    if coordinator.own_promotions is not None:  # ps 0 and ps 1 ask ps 2 before they promote each other's backup
        coordinator.own_promotions.tiebreaker = link = TiebreakerLink(coordinator, me, security.as_shard(index))
        server.closers.append(link.close)
    server.call(add_to_server, servicer, server.server, pool, arbitration)
    server.call(health_pb2_grpc.add_HealthServicer_to_server, health_servicer, server.server)
    if reflection:
        server.call(reflection_service.enable_server_reflection,
                    (SERVICE_NAME, health.SERVICE_NAME, reflection_service.SERVICE_NAME), server.server)
    credentials = grpc.ssl_server_credentials([(security.key, security.cert)], root_certificates=security.ca,
                                              require_client_auth=True) if security.tls else None
    if before_bind is not None:
        before_bind()
        _wait_free(address, HANDOVER_SECONDS)
    port = _add_port(server, address, credentials, address)
    _LOGGER.debug("shard %d bound to %s (port %d), message limit %d bytes", index, address, port, limit)
    if metrics is not None:
        servicer.metrics_port = metrics.serve(address.rpartition(":")[0], failstop)
    return server, port, coordinator


def recover(coordinator: Coordinator, journal: Journal | None, restore: dict | None) -> None:
    """Brings a new shard's state back: its journal's (exactly what it had acknowledged), else `restore`'s;
    then starts the coordinator (recording into the journal from now on). A journal whose job finished (the
    chief's Shutdown: Coordinator.finish) goes on as a new job's, from that job's last state. Raises
    (CheckpointError) for a journal that is corrupt: the shard then does not start."""
    coordinator.moves.folders.journal = journal  # a live re-layout's table rows are kept beside it
    recovered = journal.recover() if journal is not None else None
    if recovered is not None:
        base, records = recovered
        if base is not None:
            coordinator.restore(base, exact=True)
        count, finished = 0, False
        for record in records:
            finished = coordinator.replay(record) or finished
            count += 1
        _LOGGER.info("recovered from the journal in %s: %s, %d records replayed, step %d", journal.directory,
                     "a base state" if base is not None else "no base", count, coordinator.store.step)
        if finished:
            _LOGGER.info("the journal's job had finished (the chief's Shutdown): a new job begins from its "
                            "state at step %d, without its members or mode", coordinator.store.step)
            coordinator.forget_job()
            journal.begin_again(coordinator.state(with_pending=True))
    elif restore is not None:
        coordinator.restore(restore)
    if journal is None:
        coordinator.start()
        coordinator.queue_desk.settle()
        return
    journal.start(None if recovered is not None else coordinator.state(with_pending=True))
    if not coordinator.layout.table_shards:  # table rows a re-layout left there: gone with the next base
        coordinator.moves.folders.retire()
    coordinator.attach_journal(journal)
    coordinator.queue_desk.settle()  # data queues' pushes in flight, from the ledger: recorded, before serving


def set_health(health_servicer: health.HealthServicer, *, serving: bool) -> None:
    """SERVING or NOT_SERVING for the whole server ("") and the ParameterServer service."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, status)


def serve_health(health_servicer: health.HealthServicer, address: str) -> tuple[grpc.Server, int]:
    """A started plaintext server at `address` with nothing but the health service (for Kubernetes gRPC
    probes, which speak neither TLS nor tokens); returns (server, port). It reveals only SERVING or
    NOT_SERVING. RuntimeError if the address cannot be bound."""
    _check_free(address)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"),
                         options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 4096)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _add_port(server, address, None, f"the health port {address}")
    server.start()
    return server, port


def threaded_waits(threads: int) -> int:
    """Calls that may wait holding an RPC thread (waits.THREADED): three quarters of the threads; the rest serve
    calls that never wait."""
    return max(1, threads - max(1, threads // 4))


def _add_port(server: grpc.Server | LoopServer, address: str, credentials, what: str) -> int:
    """The port `server` bound at `address` (TLS with `credentials`); RuntimeError naming `what` if none."""
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {what}: {exc}") from None
    if port == 0:
        raise RuntimeError(f"cannot bind {what}: the port is in use or the host is not local")
    return port


def _wait_free(address: str, timeout: float) -> None:
    """Returns once `address` can be bound; RuntimeError with the reason if it cannot within `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _check_free(address)
        except RuntimeError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.002)


def _check_free(address: str) -> None:
    """RuntimeError with the reason if `address` cannot be bound (gRPC only says that it failed)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, ValueError) as exc:
        raise RuntimeError(f"cannot bind {address}: {exc}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            hint = " (is another ps-server running there?)" if exc.errno == errno.EADDRINUSE else ""
            raise RuntimeError(f"cannot bind {address}: {exc.strerror}{hint}") from None
