"""The torchps client: connect to the shards, register modules, pull and push.

    from torchps.client import Cluster, Optimizer, PSClient
"""

from ..cluster import Cluster, TaskSpec
from ..errors import (CheckpointError, ClusterConfigError, InternalServerError, InvalidArgumentError, MalformedStreamError,
                                ModeConflictError, NonFiniteGradientError, OptimizerSpecError, PSError, ServerUnavailableError,
                                SpecConflictError, TensorMismatchError, UnknownVariableError, WaitTimeoutError)
from .client import PSClient
from ..specs import Optimizer
from .module import ModuleBinding
from .stats import WorkerStats
from ..memory import tune_malloc
from ..placement import Placement

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
