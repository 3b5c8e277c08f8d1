"""The torchps client: connect to the shards, register modules, pull and push.

    from torchps.client import Cluster, Optimizer, PSClient
"""

from ..cluster import Cluster, TaskSpec
from ..errors import (CheckpointError, ClusterConfigError, InternalServerError, InvalidArgumentError,
                      MalformedStreamError, ModeConflictError, NonFiniteGradientError, OptimizerSpecError, PSError,
                      ResourceExhaustedError, ServerUnavailableError, ShardLostError, SpecConflictError,
                      StepPassedError, TensorMismatchError, UnknownVariableError, WaitTimeoutError,
                      WorkerReplacedError)
from ..memory import tune_malloc
from ..placement import Placement
from ..specs import Optimizer
from .client import PSClient
from .module import ModuleBinding
from .stats import WorkerStats

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
    "ResourceExhaustedError",
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
