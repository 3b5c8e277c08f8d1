"""A backup's signpost: while it follows its primary, its own address says where its shard is served.

A client knows a shard at the cluster spec's address. Once the shard's
primary there was lost and its backup promoted, that address may be the
replaced primary's again, restarted as the new primary's backup, or a fresh
backup on the lost host's address; and a client started after ps 0 and ps 1
both moved cannot ask either where the other is (each is the other's
arbiter). So a backup (ps-server --replica-of) answers at the address it
binds, until it is promoted:

- GetLayout: a Layout of no epoch whose `replicas` has one entry, this
  shard's: the primary it follows (client/channels.py relocate follows it);
- every other call: UNAVAILABLE naming that primary (nothing is served
  here; the client's retries go on while it looks for the shard).

Calls pass the shard's security policy (mutual TLS, the token table it
follows) as every call to a shard does; GetLayout is open to every role. The
promoted backup stops the signpost before it serves on the same address. A
signpost that cannot bind (the address taken) is not started: the backup
follows its primary without one, as before.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Callable

import grpc

from ..errors import ERROR_METADATA_KEY, AuthenticationError, ServerUnavailableError
from ..proto import ps_pb2
from ..security import Security
from .auth import checked_token, token_of
from .tokens import TokenFile

__all__ = ["Signpost"]

_LOGGER = logging.getLogger(__name__)
_SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
          (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


class Signpost(grpc.GenericRpcHandler):
    """Shard `index`'s backup at `address`, answering as the module docstring says; `primary()` is the address
    of the primary it follows now. start() binds and serves (False if it cannot bind); stop() ends it (blocks
    until the port is free). Thread-safe (gRPC's threads call it; `primary` must be)."""

    def __init__(self, index: int, address: str, security: Security, primary: Callable[[], str]):
        self.index, self.address, self._security, self._primary = index, address, security, primary
        self._tokens = TokenFile(security)
        self._server: grpc.Server | None = None

    def start(self) -> bool:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"ps{self.index}-signpost"),
                             handlers=[self], options=[("grpc.so_reuseport", 0)])
        security = self._security
        try:
            if security.tls:
                credentials = grpc.ssl_server_credentials([(security.key, security.cert)],
                                                          root_certificates=security.ca, require_client_auth=True)
                port = server.add_secure_port(self.address, credentials)
            else:
                port = server.add_insecure_port(self.address)
        except RuntimeError:
            port = 0
        if not port:
            _LOGGER.warning("ps %d backup: no signpost at %s (it cannot be bound); clients find this shard through "
                            "its arbiter only", self.index, self.address)
            return False
        server.start()
        self._server = server
        _LOGGER.info("ps %d backup: %s answers where ps:%d is served until this backup is promoted", self.index,
                     self.address, self.index)
        return True

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None).wait()
            self._server = None

    def service(self, handler_call_details):
        method = handler_call_details.method
        service, _, name = method.rpartition("/")
        if service != f"/{_SERVICE.full_name}" or name not in _SERVICE.methods_by_name:
            return None
        described = _SERVICE.methods_by_name[name]
        kind = _KINDS[(described.client_streaming, described.server_streaming)]
        if name == "GetLayout":
            return kind(self._layout, request_deserializer=ps_pb2.LayoutRequest.FromString,
                        response_serializer=ps_pb2.Layout.SerializeToString)
        return kind(self._elsewhere)

    def _check(self, context: grpc.ServicerContext, method: str) -> None:
        token = token_of(context.invocation_metadata())
        subject = (context.auth_context().get("x509_subject") or [b""])[0].decode(errors="replace")
        if not checked_token(self._tokens, method, token, subject).authenticated:
            context.set_trailing_metadata(((ERROR_METADATA_KEY, AuthenticationError.__name__),))
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"ps {self.index}'s backup refused the call: its token is not accepted")

    def _layout(self, request, context) -> ps_pb2.Layout:
        self._check(context, "GetLayout")
        return ps_pb2.Layout(replicas=[ps_pb2.ShardReplicas(index=self.index, primary=self._primary(),
                                                            backup=self.address)])

    def _elsewhere(self, request, context):
        context.set_trailing_metadata(((ERROR_METADATA_KEY, ServerUnavailableError.__name__),))
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.address} is ps:{self.index}'s backup, not serving it: "
                                                   f"ps:{self.index} is served at {self._primary()}")
