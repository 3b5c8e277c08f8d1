"""The torchps client: connect to the shards, register modules, pull and push.

    from torchps.client import Cluster, Embedding, EmbeddingBag, Optimizer, PSClient
"""

import importlib

from ..cluster import Cluster, TaskSpec
from ..errors import (AuthenticationError, CheckpointError, ClusterConfigError, DataShardError, InternalServerError,
                      InvalidArgumentError, LaneBrokenError, LayoutChangedError, MalformedStreamError, ModeConflictError, NonFiniteGradientError,
                      OptimizerSpecError, PermissionDeniedError, PSError,
                      LeaseHeldError, ReplicaFencedError, ResizeConflictError, ResourceExhaustedError, ServerUnavailableError, ServingVersionError, ShardBusyError, ShardLostError, SpecConflictError,
                      StepPassedError, TensorMismatchError, UnknownDataQueueError, UnknownVariableError,
                      VariableMovingError, WaitTimeoutError, WorkerReplacedError)
from ..memory import tune_malloc
from ..placement import Placement
from ..security import Security
from ..specs import Optimizer

# What needs torch is imported on first use (module __getattr__), so that the client's torch-free part (its
# channels, fan-out, layout and resize driver: what ps-admin runs) imports without torch.
_LAZY = {
    "..compression": ["Compression"],
    "..partitioning": ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"],
    ".allreduce": ["AllreduceError", "AllreduceGroup", "LocalRank", "Rendezvous"],
    ".host": ["HostBinding", "LocalReplica"],
    ".hybrid": ["HybridBinding", "local_optimizer"],
    ".client": ["PSClient"],
    ".dataqueue": ["DataQueue", "DataShard"],
    ".deltas": ["PullBases"],
    ".embedding": ["Embedding", "EmbeddingBag", "ShardedTable", "prefetch_rows"],
    ".module": ["ModuleBinding"],
    ".resize": ["ResizeReport"],
    ".stats": ["WorkerStats"],
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
    "LeaseHeldError",
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
    "ReplicaFencedError",
    "ResizeConflictError",
    "ResizeReport",
    "ResourceExhaustedError",
    "Security",
    "ServerUnavailableError",
    "ServingVersionError",
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
