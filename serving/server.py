"""A serving replica's gRPC edge: the Serving service (ps.proto) over replica.py's versions, with the shards'
security (mutual TLS, per-task tokens, roles: torchps.access.policy, the serving role reading only), the health
service and reflection, on grpc.aio (a shard's edge: fewer thread hand-offs per call than the synchronous
server). The servicer decodes, calls the replica and encodes; the handler checks the caller and maps errors
(PSError -> its status code and the `torchps-error` trailing metadata), as a shard's does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from typing import Callable

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from google.protobuf import message_factory
from grpc_reflection.v1alpha import reflection

from .. import codec
from ..errors import ERROR_METADATA_KEY, InternalServerError, InvalidArgumentError, PSError
from ..proto import ps_pb2, ps_pb2_grpc
from ..ps_server.auth import Authority
from ..ps_server.edge import LoopServer
from ..security import Security
from .follower import Follower
from .replica import Replica, Version

__all__ = ["ServingServicer", "serve", "MAX_MESSAGE_BYTES"]

_LOGGER = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 1 << 30  # a GetDense reply holds every dense variable asked for
MAX_IDS = 1 << 24            # ids in one Lookup
RECENT_LOOKUPS = 10_000      # the lookups ServingStatus's latency figures are over
INLINE = frozenset({"Lookup", "GetServingStatus"})  # answered on the event loop: short, never waiting long
SERVICE_NAME = ps_pb2.DESCRIPTOR.services_by_name["Serving"].full_name


def _version(v: Version) -> ps_pb2.ServingVersion:
    return ps_pb2.ServingVersion(version=v.version, step=v.step, published_unix=v.published)


class ServingServicer(ps_pb2_grpc.ServingServicer):
    """The Serving service of one replica and its follower."""

    def __init__(self, replica: Replica, follower: Follower, authority: Authority,
                 on_lookup: Callable[[float], None] | None = None):
        self.replica, self.follower, self.authority, self._on_lookup = replica, follower, authority, on_lookup
        self._lock = threading.Lock()
        self._lookup_times = np.zeros(RECENT_LOOKUPS)  # a ring: lookup n's time at n % RECENT_LOOKUPS
        self._lookups = 0

    def answered(self, method: str, seconds: float) -> None:
        """A call ended after `seconds` in this servicer: Lookups are counted (ServingStatus, on_lookup)."""
        if method != "Lookup":
            return
        with self._lock:
            self._lookup_times[self._lookups % RECENT_LOOKUPS] = seconds
            self._lookups += 1
        if self._on_lookup is not None:
            self._on_lookup(seconds)

    def Lookup(self, request, context):
        if len(request.ids) % 8:
            raise InvalidArgumentError(f"Lookup's ids are int64 little-endian: {len(request.ids)} bytes is not a "
                                       f"multiple of 8")
        if len(request.ids) // 8 > MAX_IDS:
            raise InvalidArgumentError(f"Lookup takes at most {MAX_IDS} ids; received {len(request.ids) // 8}")
        ids = np.frombuffer(request.ids, dtype="<i8").astype(np.int64)
        version, rows, held, dim, dtype = self.replica.lookup(request.table, ids)
        return ps_pb2.ServingLookupReply(version=version.version, step=version.step, dim=dim,
                                         dtype=codec.wire_dtype(dtype), rows=codec.tensor_bytes(rows).tobytes(),
                                         held=held.astype(np.uint8).tobytes())

    def GetDense(self, request, context):
        version, tensors = self.replica.dense(list(request.names))
        return ps_pb2.DenseReply(version=version.version, step=version.step, tensors=[
            ps_pb2.DenseTensor(name=name, meta=codec.meta_of(t), data=codec.tensor_bytes(t).tobytes())
            for name, t in tensors.items()])

    def GetServingStatus(self, request, context):
        return self._status()

    def ControlServing(self, request, context):
        action = request.action
        if action == ps_pb2.ServingControl.HOLD:
            self.replica.hold()
        elif action == ps_pb2.ServingControl.RESUME:
            self.replica.resume()
        elif action == ps_pb2.ServingControl.ROLLBACK:
            self.replica.rollback(request.step)
        else:
            raise InvalidArgumentError(f"ControlServing's action is HOLD, RESUME or ROLLBACK. Received: {action}")
        _LOGGER.info("ps-serve: %s%s", ps_pb2.ServingControl.Action.Name(action),
                     f" to step {request.step}" if action == ps_pb2.ServingControl.ROLLBACK else "")
        return self._status()

    def _status(self) -> ps_pb2.ServingStatus:
        current, kept, held, rows = self.replica.status()
        follower = self.follower
        fresh = follower.fresh_at
        with self._lock:  # a copy only: the lookups that record their times wait for no sort
            lookups = self._lookups
            times = self._lookup_times[:min(lookups, RECENT_LOOKUPS)].copy()

        def rank(q: float) -> float:  # nearest rank, by a partial sort
            if not len(times):
                return 0.0
            at = max(0, math.ceil(q * len(times)) - 1)
            return float(np.partition(times, at)[at])

        return ps_pb2.ServingStatus(
            current=_version(current), kept=[_version(v) for v in kept], held=held,
            staleness_seconds=max(0.0, time.time() - fresh) if fresh else 0.0,
            behind_steps=max(0, follower.step - current.step), rows=rows, resyncs=follower.resyncs,
            error=follower.error, lookups=lookups, lookup_p50_seconds=rank(0.5), lookup_p99_seconds=rank(0.99),
            rows_applied=follower.rows_applied, dense_read_unix=follower.dense_at, **_guarded(follower.guard))


def _guarded(guard) -> dict:
    """ServingStatus's guard fields (zero refusals and NaN losses without a guard)."""
    if guard is None:
        return {"guard_refused": 0, "guard_loss": math.nan, "guard_baseline": math.nan}
    baseline = math.nan if guard.baseline is None else guard.baseline
    return {"guard_refused": guard.refused, "guard_loss": guard.last, "guard_baseline": baseline}


def _handler(servicer: ServingServicer, name: str, pool: concurrent.futures.Executor, inline: bool):
    """An aio handler for servicer.`name`: checks the caller's role, runs the body (on the event loop itself if
    `inline`: it never waits for more than a publish's write, else on `pool`), maps what it raises to a status
    (PSError: its code, the torchps-error trailing metadata), times the call (servicer.answered)."""
    body = getattr(servicer, name)

    async def handle(request, context):
        began = time.perf_counter()
        try:
            servicer.authority.caller(name, context)
            if inline:
                return body(request, context)
            return await asyncio.get_running_loop().run_in_executor(pool, body, request, context)
        except PSError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.grpc_code), str(exc),
                                trailing_metadata=((ERROR_METADATA_KEY, type(exc).__name__),))
        except Exception as exc:  # noqa: BLE001 - a replica never dies of a request
            _LOGGER.exception("%s failed unexpectedly", name)
            error = InternalServerError(f"{name} failed on the replica: {type(exc).__name__}: {exc}")
            await context.abort(grpc.StatusCode.INTERNAL, str(error),
                                trailing_metadata=((ERROR_METADATA_KEY, type(error).__name__),))
        finally:
            servicer.answered(name, time.perf_counter() - began)
    return handle


def serve(replica: Replica, follower: Follower, security: Security, address: str, *, threads: int = 8,
          reflection_on: bool = True, on_lookup: Callable[[float], None] | None = None) -> tuple[LoopServer, int]:
    """A started grpc.aio server for the replica at `address` (port 0: any free one), on its own event loop
    thread; (server, port). Lookups and status are answered on the loop itself, GetDense and ControlServing
    (which may copy a model or wait for a publish) on `threads` threads. `on_lookup`: given each Lookup's
    seconds (metrics). RuntimeError if the port cannot be bound."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="serve")
    server = LoopServer(lambda: grpc.aio.server(migration_thread_pool=pool, options=[
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0)]), name="serve-loop")
    servicer = ServingServicer(replica, follower, Authority(security, 0, who="ps-serve"), on_lookup)
    service = ps_pb2.DESCRIPTOR.services_by_name["Serving"]
    handlers = {}
    for method in service.methods:
        request = message_factory.GetMessageClass(method.input_type)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _handler(servicer, method.name, pool, inline=method.name in INLINE),
            request_deserializer=request.FromString, response_serializer=lambda reply: reply.SerializeToString())
    server.call(server.server.add_generic_rpc_handlers,
                (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    server.call(health_pb2_grpc.add_HealthServicer_to_server, health_servicer, server.server)
    if reflection_on:
        server.call(reflection.enable_server_reflection,
                    (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server.server)
    if security.tls:
        credentials = grpc.ssl_server_credentials([(security.key, security.cert)], root_certificates=security.ca,
                                                  require_client_auth=True)
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if not port:
        raise RuntimeError(f"ps-serve cannot serve at {address}: is the port free?")
    server.start()
    return server, port
