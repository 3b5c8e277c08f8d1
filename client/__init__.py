"""The torchps client: connect to the shards, register modules, pull and push.

    from torchps.client import Cluster, Optimizer, PSClient
"""

from ..cluster import Cluster, TaskSpec
from ..errors import (AuthenticationError, CheckpointError, ClusterConfigError, InternalServerError, InvalidArgumentError,
                      MalformedStreamError, ModeConflictError, NonFiniteGradientError, OptimizerSpecError,
                      PermissionDeniedError, PSError,
                      ResourceExhaustedError, ServerUnavailableError, ShardLostError, SpecConflictError,
                      StepPassedError, TensorMismatchError, UnknownVariableError, WaitTimeoutError,
                      WorkerReplacedError)
from ..memory import tune_malloc
from ..placement import Placement
from ..security import Security
from ..specs import Optimizer
from .client import PSClient
from .module import ModuleBinding
from .stats import WorkerStats

__all__ = [
    "AuthenticationError",
    "CheckpointError",
    "Cluster",
    "ClusterConfigError",
    "InternalServerError",
    "InvalidArgumentError",
    "MalformedStreamError",
    "ModeConflictError",
    "ModuleBinding",
    "NonFiniteGradientError",
    "Optimizer",
    "OptimizerSpecError",
    "PSClient",
    "PSError",
    "PermissionDeniedError",
    "Placement",
    "ResourceExhaustedError",
    "Security",
    "ServerUnavailableError",
    "ShardLostError",
    "SpecConflictError",
    "StepPassedError",
    "TaskSpec",
    "TensorMismatchError",
    "UnknownVariableError",
    "WaitTimeoutError",
    "WorkerReplacedError",
    "WorkerStats",
    "tune_malloc",
]
