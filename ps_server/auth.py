"""A shard's door: the job token (a server interceptor) and the caller's role (at the servicer's edge).

The interceptor checks the token every call carries (metadata
`torchps-token`) against the admin token and the job token in constant time,
and against the per-task tokens by their digest, before any request byte is
read; a call without a valid one gets UNAUTHENTICATED and changes nothing.
The per-task tokens come from a TokenFile (tokens.py), which follows the
shard's token file: a task added to it is accepted from its first call.
The health service stays open (it tells nothing and probes carry no secret).

`Authority.caller(method, context)` then names the caller and its role (see
torchps.security): from its certificate with TLS (common name, organizational
unit), from its per-task token without (a shared job token names nobody);
PERMISSION_DENIED for a call the role does not allow, and for a worker acting
in another worker's name.
"""

from __future__ import annotations

import dataclasses
import hmac
import re

import grpc

from ..errors import ERROR_METADATA_KEY, AuthenticationError, PermissionDeniedError
from ..security import ROLES, TOKEN_METADATA_KEY, Security, allowed_methods
from .tokens import TokenFile

__all__ = ["Caller", "Authority", "TokenInterceptor"]

_SUBJECT = re.compile(r"(?:^|,)(CN|OU)=((?:[^,\\]|\\.)*)")


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who made a call: its name ("worker:1", or None without a certificate) and its role."""

    name: str | None
    role: str


def _token_of(metadata) -> str:
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def _matches(token: str, secret: str | None) -> bool:
    return secret is not None and hmac.compare_digest(token.encode(), secret.encode())


def _aborting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, error: str, details: str):
    """A handler (asyncio, for the shard's grpc.aio server) of the same shape as `handler` that refuses the call."""
    async def refuse(request_or_iterator, context):
        await context.abort(code, details, ((ERROR_METADATA_KEY, error),))

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kinds[(handler.request_streaming, handler.response_streaming)](refuse)


def _accepts(security: Security, token: str) -> bool:
    return _matches(token, security.token) or _matches(token, security.admin_token) or bool(security.task_of(token))


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call that does not carry the job or admin token."""

    def __init__(self, tokens: TokenFile, index: int):
        self._tokens = tokens
        self._index = index

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc.health."):
            return handler
        token = _token_of(handler_call_details.invocation_metadata)
        if _accepts(self._tokens.current(), token) or (token and self._tokens.refresh()
                                                        and _accepts(self._tokens.current(), token)):
            return handler
        why = "carries no token" if not token else "carries a wrong token"
        return _aborting(handler, grpc.StatusCode.UNAUTHENTICATED, AuthenticationError.__name__,
                         f"ps {self._index} refused the call: it {why}; pass this task's --token-file "
                         f"(ps-certs writes DIR/TYPE-INDEX.token; or TORCHPS_TOKEN_FILE)")


class Authority:
    """Names callers and checks their roles (see the module docstring). Insecure: everyone is chief."""

    def __init__(self, security: Security, index: int, tokens: TokenFile | None = None):
        self.tokens = tokens or TokenFile(security)
        self.index = index

    def caller(self, method: str, context: grpc.ServicerContext) -> Caller:
        """The caller of `method`; PermissionDeniedError if its role may not call it."""
        caller = self._identify(context)
        if method not in allowed_methods(caller.role):
            raise PermissionDeniedError(
                f"ps {self.index} refused {method} from {caller.name or 'a token holder'}: the {caller.role} role "
                f"may call only {sorted(allowed_methods(caller.role))}")
        return caller

    def check_self(self, caller: Caller, worker: str, method: str) -> None:
        """PermissionDeniedError if a named worker (its certificate's, its token's) acts in another's name."""
        if caller.name is not None and caller.role != "chief" and worker != caller.name:
            raise PermissionDeniedError(f"ps {self.index} refused {method} for {worker!r} from {caller.name}: "
                                        f"a worker acts in its own name only")

    def _identify(self, context: grpc.ServicerContext) -> Caller:
        security = self.tokens.current()
        if security.insecure:
            return Caller(None, "chief")
        admin = _matches(_token_of(context.invocation_metadata()), security.admin_token)
        if security.tls:
            subject = dict(_SUBJECT.findall((context.auth_context().get("x509_subject") or [b""])[0].decode()))
            role = subject.get("OU", "")
            name = subject.get("CN") or None
            return Caller(name, "chief" if admin else role if role in ROLES else "none")
        # Tokens without TLS: the admin token names the chief; without one configured, every token holder is.
        if admin or security.admin_token is None:
            return Caller(None, "chief")
        task = security.task_of(_token_of(context.invocation_metadata()))
        if task is not None:  # a per-task token names its task, as a certificate would
            return Caller(task[0], task[1] if task[1] in ROLES else "none")
        return Caller(None, "worker")  # a shared job token names nobody
