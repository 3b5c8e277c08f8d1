"""What every RPC body of a shard shares: the mapping of exceptions to gRPC status codes, the decorator that
counts and maps each call, and the small checks bodies make of their call. No servicer state here.

`status_of` is the one place where PSError subclasses become gRPC status codes (with the class name in the
trailing metadata key `torchps-error`) and anything unexpected becomes INTERNAL, so a bad request never takes
the server down.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError

from ..errors import ERROR_METADATA_KEY, InternalServerError, MalformedStreamError, PSError
from .auth import Caller
from .coordinator import CHIEF, WORKER
from .edge import CallContext, CallEnded

__all__ = ["MAX_LIST_WAIT_SECONDS", "answering", "decode_request", "decoded", "map_errors", "remaining",
           "require_active", "status_of", "step_authority"]

_LOGGER = logging.getLogger(__name__)
MAX_LIST_WAIT_SECONDS = 60.0  # a ListVariables or ListTables wait holds an RPC thread; clients repeat shorter waits


def status_of(method: str, exc: Exception, context: CallContext) -> tuple[grpc.StatusCode, str, tuple]:
    """The status a call that raised `exc` ends with: (code, details, trailing metadata)."""
    if context.stalled is not None:
        return grpc.StatusCode.DEADLINE_EXCEEDED, context.stalled, ()
    if isinstance(exc, PSError):
        _LOGGER.debug("%s rejected: %s", method, exc)
        return getattr(grpc.StatusCode, exc.grpc_code), str(exc), ((ERROR_METADATA_KEY, type(exc).__name__),)
    if isinstance(exc, (grpc.RpcError, CallEnded)) or not context.is_active():
        _LOGGER.info("%s: the client went away mid-call; nothing was applied", method)
        return grpc.StatusCode.CANCELLED, "the client cancelled the call", ()
    _LOGGER.exception("%s failed unexpectedly", method, exc_info=exc)
    error = InternalServerError(f"{method} failed on the shard: {type(exc).__name__}: {exc}")
    return grpc.StatusCode.INTERNAL, str(error), ((ERROR_METADATA_KEY, type(error).__name__),)


def remaining(context: CallContext) -> float | None:
    """Seconds left before the call's deadline, or None without one (gRPC then reports a huge value)."""
    left = context.time_remaining()
    return None if left is None or left > 1e7 else max(0.0, left)


def decode_request(decode, raw: bytes):
    """decode(raw), with any parse failure as MalformedStreamError (INVALID_ARGUMENT)."""
    try:
        return decode(raw)
    except DecodeError as exc:
        raise MalformedStreamError(f"malformed protobuf message: {exc}") from None


def decoded(request_iterator, decode):
    """Decodes a request stream in the handler, not in gRPC: gRPC would end a stream whose next
    message does not parse as if it had simply finished, and the handler would apply a prefix."""
    for raw in request_iterator:
        yield decode_request(decode, raw)



def require_active(context: CallContext) -> None:
    """Raises unless the call is still alive: gRPC may have cut the stream (an oversized message)."""
    if not context.is_active():
        raise MalformedStreamError("the call ended before the stream was complete; nothing was applied")


@contextlib.contextmanager
def answering(servicer, name: str, context: CallContext):
    """Held while `servicer` answers call `name`: checks the caller's role and the client's quota of calls
    (raising as those do), counts the call started and, at its end, finished."""
    servicer.calls_started.add()
    try:
        caller = servicer.authority.caller(name, context)
        with servicer.quotas.call(caller.name or context.peer()):
            yield
    finally:
        servicer.calls_done.add()
        if servicer.metrics is not None:
            servicer.metrics.answered(name)


def map_errors(method):
    """Runs a handler's body while answering() its call (edge.handler maps what it raises). A generator body
    (streaming replies, or yielding its waits) stays one."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def waiting(self, request, context):
            with answering(self, method.__name__, context):
                return (yield from method(self, request, context))
        return waiting

    @functools.wraps(method)
    def unary(self, request, context):
        with answering(self, method.__name__, context):
            return method(self, request, context)
    return unary


def step_authority(caller: Caller) -> str:
    """What the step a caller's write shows counts for on a shard catching up (step_clock.py: "Authority over
    the step"): the chief's vouches for itself, anyone else's moves the step no further than that."""
    return CHIEF if caller.role == "chief" else WORKER
