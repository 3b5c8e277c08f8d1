"""The client edge of error mapping: grpc.RpcError never reaches users.

`error_from_rpc(exc, target)` turns a failed call into the PSError subclass
the shard raised (named in the `torchps-error` trailing metadata), or, for
failures with no such name (transport, gRPC's own limits), into the class
that matches the status code, naming the shard's address.
"""

from __future__ import annotations

import grpc

from ..errors import (ERROR_METADATA_KEY, InternalServerError, InvalidArgumentError, ModeConflictError, PSError,
                                ServerUnavailableError, SpecConflictError, UnknownVariableError, WaitTimeoutError,
                                error_class_by_name)

__all__ = ["error_from_rpc"]

_BY_CODE: dict[grpc.StatusCode, type[PSError]] = {
    grpc.StatusCode.NOT_FOUND: UnknownVariableError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.ALREADY_EXISTS: SpecConflictError,
    grpc.StatusCode.FAILED_PRECONDITION: ModeConflictError,
    grpc.StatusCode.CANCELLED: ServerUnavailableError,
}


def error_from_rpc(exc: grpc.RpcError, target: str) -> PSError:
    """The PSError that `exc` (a failed call to shard `target`) stands for."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    trailing = dict(exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else {}
    cls = error_class_by_name(trailing.get(ERROR_METADATA_KEY, ""))
    if cls is not None:
        return cls(details)
    if code is grpc.StatusCode.UNAVAILABLE:
        return ServerUnavailableError(f"shard {target} is unavailable: {details}. Is ps-server running there?")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return WaitTimeoutError(f"call to shard {target} ran past its deadline: {details}")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return InvalidArgumentError(f"shard {target} refused a message as too large: {details}. Use smaller chunk_bytes")
    return _BY_CODE.get(code, InternalServerError)(f"shard {target}: {code.name}: {details}")
