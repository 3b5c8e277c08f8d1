"""The one exception hierarchy of torchps, shared by shards and clients.

    PSError                        base of everything torchps raises
    ├── ClusterConfigError         bad cluster / TF_CONFIG / flags (local, never on the wire)
    ├── UnknownVariableError       NOT_FOUND: no variable of that name on the shard
    ├── UnknownDataQueueError      NOT_FOUND: no data queue of that name (dynamic sharding)
    ├── InvalidArgumentError       INVALID_ARGUMENT: the request is wrong; nothing changed
    │   ├── TensorMismatchError    wrong dtype or shape for the variable
    │   ├── NonFiniteGradientError NaN or Inf in a gradient
    │   ├── MalformedStreamError   chunks missing, out of order, duplicated, oversized
    │   └── OptimizerSpecError     unknown optimizer or hyperparameter
    ├── SpecConflictError          ALREADY_EXISTS: variable exists with another spec
    ├── ModeConflictError          FAILED_PRECONDITION: reconfiguring a running job
    │   ├── StepPassedError        a checkpoint's step the shard already went past
    │   ├── ResizeConflictError    another live resize runs, or this one was cut off or taken over: the
    │                              message says whether to wait, --resume or --abort
    │   ├── ReplicaFencedError     ps 0's record of a replicated shard names another primary or backup
    │   │                          (a failover): the caller must not serve that shard
    │   └── LeaseHeldError         a backup asked to take over a primary that still renews its lease at
    │                              its arbiter: it follows that primary again
    ├── CheckpointError            FAILED_PRECONDITION: a checkpoint could not be written or read
    ├── WorkerReplacedError        FAILED_PRECONDITION: a newer process of the same task took over
    ├── ServingVersionError        FAILED_PRECONDITION: a serving replica held on its version, or no version
    │                              it keeps is at or before the step a rollback asks for
    ├── LayoutChangedError         ABORTED: a variable named moved to another shard (a live resize); nothing
    │                              changed: GetLayout, then call its new owner
    ├── DataShardError             FAILED_PRECONDITION: a data shard the worker does not hold (any more),
    │                              or a push that does not continue it where it stands: take again
    ├── AuthenticationError        UNAUTHENTICATED: no token, or a wrong one
    ├── PermissionDeniedError      PERMISSION_DENIED: the caller's role may not make this call
    ├── WaitTimeoutError           DEADLINE_EXCEEDED: waited too long (names what for)
    ├── ResourceExhaustedError     RESOURCE_EXHAUSTED: a shard limit was reached (names it); nothing changed
    │   └── ShardBusyError         a limit on work in progress (waiting calls, a client's calls, bytes being
    │                              received): a retry may pass, and the client retries it
    ├── ServerUnavailableError     UNAVAILABLE: a shard could not be reached in time, or is stopping
    │   ├── ShardLostError         a shard restarted empty and nobody refilled it (client side only)
    │   └── VariableMovingError    a variable named is on its way to this shard (a live resize): retry
    └── InternalServerError        INTERNAL / anything unexpected: a bug, please report

Each class names its gRPC status code (`grpc_code`, a `grpc.StatusCode` member
name) so the server edge (ps_server/servicer.py) and the client edge
(client/errors.py) map in one place. This module imports no gRPC.
"""

from __future__ import annotations

__all__ = [
    "PSError",
    "ClusterConfigError",
    "UnknownVariableError",
    "UnknownDataQueueError",
    "InvalidArgumentError",
    "TensorMismatchError",
    "NonFiniteGradientError",
    "MalformedStreamError",
    "OptimizerSpecError",
    "SpecConflictError",
    "ModeConflictError",
    "StepPassedError",
    "ResizeConflictError",
    "ReplicaFencedError",
    "LeaseHeldError",
    "CheckpointError",
    "WorkerReplacedError",
    "ServingVersionError",
    "DataShardError",
    "LayoutChangedError",
    "AuthenticationError",
    "PermissionDeniedError",
    "WaitTimeoutError",
    "ResourceExhaustedError",
    "ShardBusyError",
    "ServerUnavailableError",
    "ShardLostError",
    "VariableMovingError",
    "InternalServerError",
    "LaneBrokenError",
    "error_class_by_name",
    "ERROR_METADATA_KEY",
]

# Trailing metadata key naming the PSError subclass a shard raised, so the client raises the same one.
ERROR_METADATA_KEY = "torchps-error"


class PSError(Exception):
    """Base class of every error torchps raises."""

    grpc_code = "UNKNOWN"


class ClusterConfigError(PSError, ValueError):
    """The cluster description, TF_CONFIG or command-line flags are invalid."""

    grpc_code = "INVALID_ARGUMENT"


class UnknownVariableError(PSError, KeyError):
    """A request named a variable the shard does not hold."""

    grpc_code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownDataQueueError(PSError, KeyError):
    """A request named a data queue (dynamic sharding) that shard 0 does not hold: the chief creates it."""

    grpc_code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(PSError, ValueError):
    """The request is invalid; the shard changed nothing."""

    grpc_code = "INVALID_ARGUMENT"


class TensorMismatchError(InvalidArgumentError):
    """A tensor's dtype or shape does not match the variable's."""


class NonFiniteGradientError(InvalidArgumentError):
    """A gradient holds NaN or Inf (shards reject these unless --allow-nonfinite)."""


class MalformedStreamError(InvalidArgumentError):
    """A chunk stream is incomplete, out of order, duplicated or oversized."""


class OptimizerSpecError(InvalidArgumentError):
    """Unknown optimizer name or hyperparameter."""


class SpecConflictError(PSError):
    """A variable already exists with a different spec."""

    grpc_code = "ALREADY_EXISTS"


class ModeConflictError(PSError):
    """The shard runs with another training mode (sync config) than requested."""

    grpc_code = "FAILED_PRECONDITION"


class StepPassedError(ModeConflictError):
    """A checkpoint asked for a step the shard already went past: ask again with a later one."""


class ResizeConflictError(ModeConflictError):
    """A live resize cannot go on as asked: another one runs (its driver holds the lease), one was cut off
    (run `ps-admin resize --resume` or `--abort`), or this driver's resize was taken over by another."""


class ReplicaFencedError(ModeConflictError):
    """ps 0's record of a replicated shard names another primary (its backup was promoted) or another backup
    than the caller: the caller is out of the job's layout and must not serve that shard."""


class LeaseHeldError(ModeConflictError):
    """A backup asked its arbiter to promote it while its primary still renews its lease there (it runs; only
    the backup's stream went quiet): nothing changed, and the backup follows that primary again. `left`: the
    seconds the lease holds without another renewal (0 where unknown: on the client side)."""

    def __init__(self, message: str = "", left: float = 0.0):
        super().__init__(message)
        self.left = left


class CheckpointError(PSError):
    """A checkpoint could not be written or read (disk full, permissions, a damaged file)."""

    grpc_code = "FAILED_PRECONDITION"


class WorkerReplacedError(PSError):
    """A newer process of the same task (a new incarnation) joined: this one is fenced off and must stop."""

    grpc_code = "FAILED_PRECONDITION"


class ServingVersionError(PSError):
    """A serving replica (ps-serve) cannot do this at its version: it is held (a hold or a rollback: new versions
    wait for a resume), or a rollback asked for a step older than every version it keeps. Nothing changed."""

    grpc_code = "FAILED_PRECONDITION"


class DataShardError(PSError):
    """A data shard's lease is not this worker incarnation's (never taken, given back when its lease ran out,
    replaced, or rolled back with a restored shard), or a push's examples do not continue it where it stands.
    Nothing was applied: take a shard again (TakeDataShard answers where the held one stands)."""

    grpc_code = "FAILED_PRECONDITION"


class LayoutChangedError(PSError):
    """A variable the call named left this shard in a live resize; nothing was changed here. Ask for the job's
    layout (GetLayout) and call the variable's new owner."""

    grpc_code = "ABORTED"


class AuthenticationError(PSError):
    """The call carried no job token, or a wrong one; the shard changed nothing."""

    grpc_code = "UNAUTHENTICATED"


class PermissionDeniedError(PSError):
    """The caller's role (from its certificate or token) may not make this call; nothing changed."""

    grpc_code = "PERMISSION_DENIED"


class WaitTimeoutError(PSError, TimeoutError):
    """A wait (for variables, for a shard) ran past its deadline."""

    grpc_code = "DEADLINE_EXCEEDED"


class ResourceExhaustedError(PSError):
    """A shard refused a call at one of its limits (named in the message); nothing changed."""

    grpc_code = "RESOURCE_EXHAUSTED"


class ShardBusyError(ResourceExhaustedError):
    """A shard refused a call at a limit on work in progress (its waiting calls, a client's calls in progress,
    bytes of pushes being received); nothing changed, and the same call may pass once other calls end. The
    other ResourceExhaustedErrors (memory, a variable's size) stand until the caller changes something."""


class ServerUnavailableError(PSError, ConnectionError):
    """A shard could not be reached before the deadline, or answered that it is stopping."""

    grpc_code = "UNAVAILABLE"


class ShardLostError(ServerUnavailableError):
    """A shard restarted without its state (no checkpoint directory) and was not refilled in time."""


class VariableMovingError(ServerUnavailableError):
    """A variable the call named is on its way to this shard in a live resize; nothing was changed: retry."""


class LaneBrokenError(ServerUnavailableError):
    """A bulk lane (torchps/lanes.py) broke, stalled past the deadline or went out of step during a call; the
    call applied nothing and is retried (on another lane, or inline)."""


class InternalServerError(PSError):
    """The shard failed unexpectedly: a bug in torchps."""

    grpc_code = "INTERNAL"


def error_class_by_name(name: str) -> type[PSError] | None:
    """The PSError subclass called `name`, or None (used by the client edge)."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, PSError):
        return cls
    return None
