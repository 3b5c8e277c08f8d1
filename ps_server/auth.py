"""A shard's door: the token check (a server interceptor) and the caller's role (at the servicer's edge).

Both ask the one security policy (torchps.access.policy) about the
credentials in force: the interceptor, before any request byte is read,
whether the token every call carries (metadata `torchps-token`) is accepted
(a call without a valid one gets UNAUTHENTICATED and changes nothing);
`Authority.caller(method, context)` then who the caller is and whether its
role may make the call (PERMISSION_DENIED if not), and `check_self` whether
it acts in its own name. The credentials come from a TokenFile (tokens.py),
which follows the shard's token file: a task added to it is accepted from
its first call. The health service stays open (it tells nothing and probes
carry no secret).
"""

from __future__ import annotations

import grpc

from ..access import Verdict, policy
from ..errors import ERROR_METADATA_KEY, AuthenticationError, PermissionDeniedError
from ..security import TOKEN_METADATA_KEY, Security, allowed_methods
from .tokens import TokenFile

__all__ = ["Caller", "Authority", "TokenInterceptor", "aborting", "checked_token", "token_of"]


Caller = Verdict  # who made a call: the policy's verdict on it (name, role) once accepted and allowed


def token_of(metadata) -> str:
    """The token a call's metadata carries ("" for none)."""
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def _unauthenticated(who: str, token: str, retired: bool) -> str:
    if retired:
        return (f"{who} refused the call: its token was replaced by ps-certs --rotate and its grace period "
                f"has ended; restart this task with its token file, which holds the new token "
                f"(DIR/TYPE-INDEX.token; or TORCHPS_TOKEN_FILE)")
    why = "carries no token" if not token else "carries a wrong token"
    return (f"{who} refused the call: it {why}; pass this task's --token-file "
            f"(ps-certs writes DIR/TYPE-INDEX.token; or TORCHPS_TOKEN_FILE)")


def aborting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, error: str, details: str):
    """A handler (asyncio, for the shard's grpc.aio server) of the same shape as `handler` that refuses the call."""
    async def refuse(request_or_iterator, context):
        await context.abort(code, details, ((ERROR_METADATA_KEY, error),))

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kinds[(handler.request_streaming, handler.response_streaming)](refuse)


def checked_token(tokens: TokenFile, method: str, token: str, subject: str | None = None) -> Verdict:
    """The policy's verdict on `token` (and a certificate's `subject`) calling `method`, the token file read
    again first if the token is not known yet (a task added since: accepted from its first call)."""
    verdict = policy(tokens.current(), method, token=token, subject=subject)
    if not verdict.authenticated and token and tokens.refresh():
        verdict = policy(tokens.current(), method, token=token, subject=subject)
    return verdict


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call whose token the policy does not accept."""

    def __init__(self, tokens: TokenFile, index: int):
        self._tokens = tokens
        self._index = index

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc.health."):
            return handler
        method = handler_call_details.method.rpartition("/")[2]
        token = token_of(handler_call_details.invocation_metadata)
        verdict = checked_token(self._tokens, method, token)
        if verdict.authenticated:
            return handler
        return aborting(handler, grpc.StatusCode.UNAUTHENTICATED, AuthenticationError.__name__,
                         _unauthenticated(f"ps {self._index}", token, verdict.retired))


class Authority:
    """Names callers and checks their roles by the policy (see the module docstring)."""

    def __init__(self, security: Security, index: int, tokens: TokenFile | None = None, who: str | None = None):
        self.tokens = tokens or TokenFile(security)
        self.index = index
        self.who = who or f"ps {index}"  # how refusals name this server

    def caller(self, method: str, context: grpc.ServicerContext) -> Caller:
        """The caller of `method`; AuthenticationError if its token is not (or no longer) accepted,
        PermissionDeniedError if its role may not call it."""
        token = token_of(context.invocation_metadata())
        subject = (context.auth_context().get("x509_subject") or [b""])[0].decode(errors="replace")
        verdict = policy(self.tokens.current(), method, token=token, subject=subject)
        if not verdict.authenticated:
            raise AuthenticationError(_unauthenticated(self.who, token, verdict.retired))
        if not verdict.allowed:
            raise PermissionDeniedError(
                f"{self.who} refused {method} from {verdict.name or 'a token holder'}: the {verdict.role} role "
                f"may call only {sorted(allowed_methods(verdict.role))}")
        return verdict

    def check_self(self, caller: Caller, worker: str, method: str) -> None:
        """PermissionDeniedError if a named worker (its certificate's, its token's) acts in another's name."""
        if not caller.may_act_for(worker):
            raise PermissionDeniedError(f"ps {self.index} refused {method} for {worker!r} from {caller.name}: "
                                        f"a worker acts in its own name only")
