"""The torchps client: connect to the shards, register modules, pull and push.

    from torchps.client import Cluster, Embedding, EmbeddingBag, Optimizer, PSClient
"""

from ..cluster import Cluster, TaskSpec
from ..compression import Compression
from ..errors import (AuthenticationError, CheckpointError, ClusterConfigError, DataShardError, InternalServerError,
                      InvalidArgumentError, LaneBrokenError, LayoutChangedError, MalformedStreamError, ModeConflictError, NonFiniteGradientError,
                      OptimizerSpecError, PermissionDeniedError, PSError,
                      ResizeConflictError, ResourceExhaustedError, ServerUnavailableError, ShardBusyError, ShardLostError, SpecConflictError,
                      StepPassedError, TensorMismatchError, UnknownDataQueueError, UnknownVariableError,
                      VariableMovingError, WaitTimeoutError, WorkerReplacedError)
from ..memory import tune_malloc
from ..partitioning import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner, Partitioner
from ..placement import Placement
from ..security import Security
from ..specs import Optimizer
from .allreduce import AllreduceError, AllreduceGroup, LocalRank, Rendezvous
from .host import HostBinding, LocalReplica
from .hybrid import HybridBinding, local_optimizer
from .client import PSClient
from .dataqueue import DataQueue, DataShard
from .deltas import PullBases
from .embedding import Embedding, EmbeddingBag, ShardedTable, prefetch_rows
from .module import ModuleBinding
from .resize import ResizeReport
from .stats import WorkerStats

__all__ = [
    "AllreduceError",
    "AllreduceGroup",
    "AuthenticationError",
    "CheckpointError",
    "Cluster",
    "ClusterConfigError",
    "Compression",
    "DataQueue",
    "DataShard",
    "DataShardError",
    "Embedding",
    "EmbeddingBag",
    "FixedShardsPartitioner",
    "HostBinding",
    "HybridBinding",
    "InternalServerError",
    "InvalidArgumentError",
    "LaneBrokenError",
    "LayoutChangedError",
    "LocalRank",
    "LocalReplica",
    "MalformedStreamError",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "ModeConflictError",
    "ModuleBinding",
    "NonFiniteGradientError",
    "Optimizer",
    "OptimizerSpecError",
    "PSClient",
    "PSError",
    "Partitioner",
    "PermissionDeniedError",
    "Placement",
    "PullBases",
    "Rendezvous",
    "ResizeConflictError",
    "ResizeReport",
    "ResourceExhaustedError",
    "Security",
    "ServerUnavailableError",
    "ShardBusyError",
    "ShardLostError",
    "ShardedTable",
    "SpecConflictError",
    "StepPassedError",
    "TaskSpec",
    "TensorMismatchError",
    "UnknownDataQueueError",
    "UnknownVariableError",
    "VariableMovingError",
    "WaitTimeoutError",
    "WorkerReplacedError",
    "WorkerStats",
    "local_optimizer",
    "prefetch_rows",
    "tune_malloc",
]
