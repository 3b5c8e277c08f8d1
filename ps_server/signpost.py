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
follows) as every call to a shard does; GetLayout is open to every role. A
signpost that cannot bind (the address taken) is not started: the backup
follows its primary without one, as before.

While the backup asks its arbiter to promote it (asking), GetLayout names no
primary: a client that heard of the promotion from the arbiter before the
backup did must not be sent back to the old primary. Once its arbiter granted
the promotion (hold), the signpost names the backup's own address as the
primary, and every other call waits, rather than send a client that heard of
the promotion back to ask where the shard is. The
promoted backup brings its state back from its copy meanwhile; then it takes
the address over (let_go: the signpost stops listening, the calls it holds
stay), binds it, and ends the signpost (stop): the held calls answer
UNAVAILABLE and their clients, calling again, connect to the shard served
there. A client's connection attempt thus never finds the address closed
during the promotion, which would put it in gRPC's reconnect backoff.
"""

from __future__ import annotations

import functools
import logging
import threading
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
HOLD_SECONDS = 10.0  # a call held while the promoted backup starts serving answers UNAVAILABLE after this at most
THREADS = 8  # calls held at once (more wait their turn); GetLayout answers at once on a free one
_KINDS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
          (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


class Signpost(grpc.GenericRpcHandler):
    """Shard `index`'s backup at `address`, answering as the module docstring says; `primary()` is the address
    of the primary it follows now. start() binds and serves (False if it cannot bind); hold(), let_go() and
    stop() hand the address over to the promoted backup as the module docstring says. Thread-safe (gRPC's
    threads call it; `primary` must be)."""

    def __init__(self, index: int, address: str, security: Security, primary: Callable[[], str]):
        self.index, self.address, self._security, self._primary = index, address, security, primary
        self._tokens = TokenFile(security)
        self._server: grpc.Server | None = None
        self._served_at = ""  # the promoted backup's address, once held
        self._asking = False  # the backup asks its arbiter to promote it: the primary is being decided
        self._ended = threading.Event()  # set by stop(): held calls answer
        self._stopped: threading.Event | None = None  # let_go()'s: set once every held call answered
        self._lock = threading.Lock()
        self.holding = 0  # calls held now

    def start(self) -> bool:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=THREADS,
                                                        thread_name_prefix=f"ps{self.index}-signpost"),
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

    def asking(self, asking: bool) -> None:
        """The backup asks its arbiter to promote it (True: meanwhile GetLayout names no primary), or was not
        promoted (False: refused, or its arbiter did not answer). Does not block."""
        self._asking = asking

    def hold(self, served_at: str) -> None:
        """The backup is promoted and will serve its shard at `served_at`: GetLayout names it the primary, and
        every other call waits until stop() (at most its deadline, or HOLD_SECONDS). Does not block."""
        self._served_at = served_at

    def let_go(self) -> None:
        """Stops listening, so that the promoted backup can bind the address; the calls held go on until stop().
        Does not block: gRPC closes the listener on its own thread, soon after."""
        if self._server is not None and self._stopped is None:
            self._stopped = self._server.stop(HOLD_SECONDS)

    def stop(self) -> None:
        """Ends the signpost: held calls answer UNAVAILABLE, then its server stops. Blocks until it has (at most
        HOLD_SECONDS with calls held). Idempotent."""
        self._ended.set()
        if self.holding:
            _LOGGER.info("ps %d: %d call(s) held while its backup was promoted are answered: they call again, at %s",
                         self.index, self.holding, self.address)
        if self._server is not None:
            (self._stopped or self._server.stop(None)).wait()
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
        return kind(functools.partial(self._elsewhere, name))

    def _check(self, context: grpc.ServicerContext, method: str) -> None:
        token = token_of(context.invocation_metadata())
        subject = (context.auth_context().get("x509_subject") or [b""])[0].decode(errors="replace")
        if not checked_token(self._tokens, method, token, subject).authenticated:
            context.set_trailing_metadata(((ERROR_METADATA_KEY, AuthenticationError.__name__),))
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"ps {self.index}'s backup refused the call: its token is not accepted")

    def _layout(self, request, context) -> ps_pb2.Layout:
        self._check(context, "GetLayout")
        if self._served_at:
            return ps_pb2.Layout(replicas=[ps_pb2.ShardReplicas(index=self.index, primary=self._served_at)])
        if self._asking:
            return ps_pb2.Layout(replicas=[ps_pb2.ShardReplicas(index=self.index, backup=self.address)])
        return ps_pb2.Layout(replicas=[ps_pb2.ShardReplicas(index=self.index, primary=self._primary(),
                                                            backup=self.address)])

    def _elsewhere(self, method: str, request, context):
        if self._served_at:  # (held: only the job's callers)
            self._check(context, method)
        context.set_trailing_metadata(((ERROR_METADATA_KEY, ServerUnavailableError.__name__),))
        if self._served_at:
            remaining = context.time_remaining()
            with self._lock:
                self.holding += 1
            try:
                self._ended.wait(HOLD_SECONDS if remaining is None else max(0.0, min(remaining, HOLD_SECONDS)))
            finally:
                with self._lock:
                    self.holding -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, f"ps:{self.index}'s backup at {self.address} was promoted "
                                                       f"and serves it here from now on: call again")
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.address} is ps:{self.index}'s backup, not serving it: "
                                                   f"ps:{self.index} is served at {self._primary()}")
