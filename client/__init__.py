"""The torchps client: connect to the shards, register modules, pull and push.

    from torchps.client import Cluster, Optimizer, PSClient
"""

from ..ps_server.cluster import Cluster, TaskSpec
from ..ps_server.errors import (CheckpointError, ClusterConfigError, InternalServerError, InvalidArgumentError, MalformedStreamError,
                                ModeConflictError, NonFiniteGradientError, OptimizerSpecError, PSError, ServerUnavailableError,
                                SpecConflictError, TensorMismatchError, UnknownVariableError, WaitTimeoutError)
from .client import Optimizer, PSClient
from .module import ModuleBinding
from .stats import WorkerStats
from ..ps_server.memory import tune_malloc
from ..ps_server.placement import Placement

__all__ = [
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
    "Placement",
    "ServerUnavailableError",
    "SpecConflictError",
    "TaskSpec",
    "TensorMismatchError",
    "UnknownVariableError",
    "WaitTimeoutError",
    "WorkerStats",
    "tune_malloc",
]
