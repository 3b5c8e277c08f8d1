"""A serving replica's gRPC edge: the Serving service (ps.proto) over replica.py's versions, with the shards'
security (mutual TLS, per-task tokens, roles: torchps.access.policy, the serving role reading only), the health
service and reflection. The servicer decodes, calls the replica, encodes and maps errors (PSError ->
its status code and the `torchps-error` trailing metadata), as a shard's does.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import math
import threading
import time
from typing import Callable

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .. import codec
from ..errors import ERROR_METADATA_KEY, InternalServerError, InvalidArgumentError, PSError
from ..proto import ps_pb2, ps_pb2_grpc
from ..ps_server.auth import Authority
from ..security import Security
from .follower import Follower
from .replica import Replica, Version

__all__ = ["ServingServicer", "serve", "MAX_MESSAGE_BYTES"]

_LOGGER = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 1 << 30  # a GetDense reply holds every dense variable asked for
MAX_IDS = 1 << 24            # ids in one Lookup
RECENT_LOOKUPS = 10_000      # the lookups ServingStatus's latency figures are over
SERVICE_NAME = ps_pb2.DESCRIPTOR.services_by_name["Serving"].full_name


def _edge(method: Callable) -> Callable:
    """Checks the caller's role, runs the body, maps what it raises to a status; times the call (answered())."""
    @functools.wraps(method)
    def call(self, request, context):
        began = time.perf_counter()
        try:
            self.authority.caller(method.__name__, context)
            return method(self, request, context)
        except PSError as exc:
            context.abort_with_status(_Status(getattr(grpc.StatusCode, exc.grpc_code), str(exc), type(exc).__name__))
        except Exception as exc:  # noqa: BLE001 - a replica never dies of a request
            _LOGGER.exception("%s failed unexpectedly", method.__name__)
            error = InternalServerError(f"{method.__name__} failed on the replica: {type(exc).__name__}: {exc}")
            context.abort_with_status(_Status(grpc.StatusCode.INTERNAL, str(error), type(error).__name__))
        finally:
            self.answered(method.__name__, time.perf_counter() - began)
    return call


class _Status(grpc.Status):
    """A call's end: its code, details and the error's class name in the trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, error: str):
        self.code, self.details, self.trailing_metadata = code, details, ((ERROR_METADATA_KEY, error),)


def _version(v: Version) -> ps_pb2.ServingVersion:
    return ps_pb2.ServingVersion(version=v.version, step=v.step, published_unix=v.published)


class ServingServicer(ps_pb2_grpc.ServingServicer):
    """The Serving service of one replica and its follower."""

    def __init__(self, replica: Replica, follower: Follower, authority: Authority,
                 on_lookup: Callable[[float], None] | None = None):
        self.replica, self.follower, self.authority, self._on_lookup = replica, follower, authority, on_lookup
        self._lock = threading.Lock()
        self._lookup_times: collections.deque[float] = collections.deque(maxlen=RECENT_LOOKUPS)
        self._lookups = 0

    def answered(self, method: str, seconds: float) -> None:
        """A call ended after `seconds` in this servicer: Lookups are counted (ServingStatus, on_lookup)."""
        if method != "Lookup":
            return
        with self._lock:
            self._lookup_times.append(seconds)
            self._lookups += 1
        if self._on_lookup is not None:
            self._on_lookup(seconds)

    @_edge
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

    @_edge
    def GetDense(self, request, context):
        version, tensors = self.replica.dense(list(request.names))
        return ps_pb2.DenseReply(version=version.version, step=version.step, tensors=[
            ps_pb2.DenseTensor(name=name, meta=codec.meta_of(t), data=codec.tensor_bytes(t).tobytes())
            for name, t in tensors.items()])

    @_edge
    def GetServingStatus(self, request, context):
        return self._status()

    @_edge
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
        with self._lock:
            times, lookups = sorted(self._lookup_times), self._lookups
        rank = (lambda q: times[max(0, math.ceil(q * len(times)) - 1)]) if times else (lambda q: 0.0)
        return ps_pb2.ServingStatus(
            current=_version(current), kept=[_version(v) for v in kept], held=held,
            staleness_seconds=max(0.0, time.time() - fresh) if fresh else 0.0,
            behind_steps=max(0, follower.step - current.step), rows=rows, resyncs=follower.resyncs,
            error=follower.error, lookups=lookups, lookup_p50_seconds=rank(0.5), lookup_p99_seconds=rank(0.99),
            rows_applied=follower.rows_applied)


def serve(replica: Replica, follower: Follower, security: Security, address: str, *, threads: int = 8,
          reflection_on: bool = True, on_lookup: Callable[[float], None] | None = None) -> tuple[grpc.Server, int]:
    """A started gRPC server for the replica at `address` (port 0: any free one); (server, port). `on_lookup`:
    given each Lookup's seconds (metrics). RuntimeError if the port cannot be bound."""
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="serve"),
                         options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                  ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    servicer = ServingServicer(replica, follower, Authority(security, 0, who="ps-serve"), on_lookup)
    ps_pb2_grpc.add_ServingServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if reflection_on:
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if security.tls:
        credentials = grpc.ssl_server_credentials([(security.key, security.cert)], root_certificates=security.ca,
                                                  require_client_auth=True)
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    server.start()
    return server, port
