from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DENSE: _ClassVar[Encoding]
    SPARSE: _ClassVar[Encoding]
    ROWS: _ClassVar[Encoding]
    DELTA: _ClassVar[Encoding]

class TablePartition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARTITION_MODULO: _ClassVar[TablePartition]
    PARTITION_HASH: _ClassVar[TablePartition]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
INT32: DType
INT64: DType
DENSE: Encoding
SPARSE: Encoding
ROWS: Encoding
DELTA: Encoding
PARTITION_MODULO: TablePartition
PARTITION_HASH: TablePartition

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape", "encoding", "nnz")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    encoding: Encoding
    nnz: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., nnz: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "meta", "offset", "data", "version", "lane_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LANE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    meta: TensorMeta
    offset: int
    data: bytes
    version: int
    lane_bytes: int
    def __init__(self, name: _Optional[str] = ..., meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., version: _Optional[int] = ..., lane_bytes: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "hyperparams")
    class HyperparamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    hyperparams: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., hyperparams: _Optional[_Mapping[str, float]] = ...) -> None: ...

class VariableSpec(_message.Message):
    __slots__ = ("name", "meta", "optimizer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    name: str
    meta: TensorMeta
    optimizer: OptimizerSpec
    def __init__(self, name: _Optional[str] = ..., meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ...) -> None: ...

class CreateRequest(_message.Message):
    __slots__ = ("spec", "chunk", "count", "step")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    spec: VariableSpec
    chunk: TensorChunk
    count: int
    step: int
    def __init__(self, spec: _Optional[_Union[VariableSpec, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., count: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class CreateResponse(_message.Message):
    __slots__ = ("created", "generation")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    created: _containers.RepeatedScalarFieldContainer[bool]
    generation: int
    def __init__(self, created: _Optional[_Iterable[bool]] = ..., generation: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker", "step", "step_increment", "incarnation", "seq", "pull", "pull_cast", "streamed", "tensors", "pull_base_versions", "pull_base_generation", "data", "layout_epoch", "rows_again", "lane")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_INCREMENT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PULL_CAST_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PULL_BASE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PULL_BASE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROWS_AGAIN_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    worker: str
    step: int
    step_increment: int
    incarnation: int
    seq: int
    pull: _containers.RepeatedScalarFieldContainer[str]
    pull_cast: _containers.RepeatedScalarFieldContainer[DType]
    streamed: bool
    tensors: int
    pull_base_versions: _containers.RepeatedScalarFieldContainer[int]
    pull_base_generation: int
    data: DataProgress
    layout_epoch: int
    rows_again: bool
    lane: bytes
    def __init__(self, worker: _Optional[str] = ..., step: _Optional[int] = ..., step_increment: _Optional[int] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., pull: _Optional[_Iterable[str]] = ..., pull_cast: _Optional[_Iterable[_Union[DType, str]]] = ..., streamed: _Optional[bool] = ..., tensors: _Optional[int] = ..., pull_base_versions: _Optional[_Iterable[int]] = ..., pull_base_generation: _Optional[int] = ..., data: _Optional[_Union[DataProgress, _Mapping]] = ..., layout_epoch: _Optional[int] = ..., rows_again: _Optional[bool] = ..., lane: _Optional[bytes] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunks", "end")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    end: PushEnd
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., end: _Optional[_Union[PushEnd, _Mapping]] = ...) -> None: ...

class PushEnd(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: int
    def __init__(self, tensors: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("step", "versions", "next_step", "stale", "duplicate", "wait_seconds", "quorum", "generation", "layout_epoch", "moved")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    step: int
    versions: _containers.ScalarMap[str, int]
    next_step: int
    stale: bool
    duplicate: bool
    wait_seconds: float
    quorum: int
    generation: int
    layout_epoch: int
    moved: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., versions: _Optional[_Mapping[str, int]] = ..., next_step: _Optional[int] = ..., stale: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., wait_seconds: _Optional[float] = ..., quorum: _Optional[int] = ..., generation: _Optional[int] = ..., layout_epoch: _Optional[int] = ..., moved: _Optional[_Iterable[str]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("names", "chunk_bytes", "min_step", "cast", "base_versions", "base_generation", "lane")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    CAST_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    BASE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    chunk_bytes: int
    min_step: int
    cast: _containers.RepeatedScalarFieldContainer[DType]
    base_versions: _containers.RepeatedScalarFieldContainer[int]
    base_generation: int
    lane: bytes
    def __init__(self, names: _Optional[_Iterable[str]] = ..., chunk_bytes: _Optional[int] = ..., min_step: _Optional[int] = ..., cast: _Optional[_Iterable[_Union[DType, str]]] = ..., base_versions: _Optional[_Iterable[int]] = ..., base_generation: _Optional[int] = ..., lane: _Optional[bytes] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("chunks", "step", "result", "generation")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    step: int
    result: PushResponse
    generation: int
    def __init__(self, chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., step: _Optional[int] = ..., result: _Optional[_Union[PushResponse, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class UpdateOptimizerRequest(_message.Message):
    __slots__ = ("names", "hyperparams")
    class HyperparamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAMES_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    hyperparams: _containers.ScalarMap[str, float]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., hyperparams: _Optional[_Mapping[str, float]] = ...) -> None: ...

class UpdateOptimizerResponse(_message.Message):
    __slots__ = ("updated",)
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    updated: int
    def __init__(self, updated: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("names", "wait_seconds")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    wait_seconds: float
    def __init__(self, names: _Optional[_Iterable[str]] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class VariableInfo(_message.Message):
    __slots__ = ("spec", "version", "nbytes")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    spec: VariableSpec
    version: int
    nbytes: int
    def __init__(self, spec: _Optional[_Union[VariableSpec, _Mapping]] = ..., version: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("variables", "step", "generation")
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    variables: _containers.RepeatedCompositeFieldContainer[VariableInfo]
    step: int
    generation: int
    def __init__(self, variables: _Optional[_Iterable[_Union[VariableInfo, _Mapping]]] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("joined_of",)
    JOINED_OF_FIELD_NUMBER: _ClassVar[int]
    joined_of: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, joined_of: _Optional[_Iterable[str]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("index", "step", "num_variables", "total_bytes", "pid", "config", "live_workers", "quorum", "stale_dropped", "quorum_changes", "workers_expired", "generation", "restored_step", "checkpoints", "calls_done", "push_bytes_received", "workers_stalled", "duplicates", "waiting_calls", "calls_started", "state_bytes", "memory", "metrics_port", "paces", "tables", "layout_epoch", "not_joined", "lane_port", "awaited_step", "awaited_pushes", "awaited_pushers", "members", "replication", "tables_on_disk", "awaits_backup")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_VARIABLES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    QUORUM_CHANGES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    CALLS_DONE_FIELD_NUMBER: _ClassVar[int]
    PUSH_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_STALLED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    WAITING_CALLS_FIELD_NUMBER: _ClassVar[int]
    CALLS_STARTED_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    PACES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NOT_JOINED_FIELD_NUMBER: _ClassVar[int]
    LANE_PORT_FIELD_NUMBER: _ClassVar[int]
    AWAITED_STEP_FIELD_NUMBER: _ClassVar[int]
    AWAITED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    AWAITED_PUSHERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    TABLES_ON_DISK_FIELD_NUMBER: _ClassVar[int]
    AWAITS_BACKUP_FIELD_NUMBER: _ClassVar[int]
    index: int
    step: int
    num_variables: int
    total_bytes: int
    pid: int
    config: SyncConfig
    live_workers: int
    quorum: int
    stale_dropped: int
    quorum_changes: int
    workers_expired: int
    generation: int
    restored_step: int
    checkpoints: bool
    calls_done: int
    push_bytes_received: int
    workers_stalled: int
    duplicates: int
    waiting_calls: int
    calls_started: int
    state_bytes: int
    memory: MemoryUsage
    metrics_port: int
    paces: _containers.RepeatedCompositeFieldContainer[WorkerPace]
    tables: _containers.RepeatedCompositeFieldContainer[TableStatus]
    layout_epoch: int
    not_joined: _containers.RepeatedScalarFieldContainer[str]
    lane_port: int
    awaited_step: int
    awaited_pushes: int
    awaited_pushers: _containers.RepeatedScalarFieldContainer[str]
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    replication: ReplicationStatus
    tables_on_disk: bool
    awaits_backup: str
    def __init__(self, index: _Optional[int] = ..., step: _Optional[int] = ..., num_variables: _Optional[int] = ..., total_bytes: _Optional[int] = ..., pid: _Optional[int] = ..., config: _Optional[_Union[SyncConfig, _Mapping]] = ..., live_workers: _Optional[int] = ..., quorum: _Optional[int] = ..., stale_dropped: _Optional[int] = ..., quorum_changes: _Optional[int] = ..., workers_expired: _Optional[int] = ..., generation: _Optional[int] = ..., restored_step: _Optional[int] = ..., checkpoints: _Optional[bool] = ..., calls_done: _Optional[int] = ..., push_bytes_received: _Optional[int] = ..., workers_stalled: _Optional[int] = ..., duplicates: _Optional[int] = ..., waiting_calls: _Optional[int] = ..., calls_started: _Optional[int] = ..., state_bytes: _Optional[int] = ..., memory: _Optional[_Union[MemoryUsage, _Mapping]] = ..., metrics_port: _Optional[int] = ..., paces: _Optional[_Iterable[_Union[WorkerPace, _Mapping]]] = ..., tables: _Optional[_Iterable[_Union[TableStatus, _Mapping]]] = ..., layout_epoch: _Optional[int] = ..., not_joined: _Optional[_Iterable[str]] = ..., lane_port: _Optional[int] = ..., awaited_step: _Optional[int] = ..., awaited_pushes: _Optional[int] = ..., awaited_pushers: _Optional[_Iterable[str]] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ..., replication: _Optional[_Union[ReplicationStatus, _Mapping]] = ..., tables_on_disk: _Optional[bool] = ..., awaits_backup: _Optional[str] = ...) -> None: ...

class ReplicationStatus(_message.Message):
    __slots__ = ("backup", "in_sync", "lag_records", "lag_seconds", "feeds_opened", "feeds_lost", "store_bytes_sent", "store_files_sent", "store_files_linked")
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    LAG_RECORDS_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FEEDS_OPENED_FIELD_NUMBER: _ClassVar[int]
    FEEDS_LOST_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    STORE_FILES_SENT_FIELD_NUMBER: _ClassVar[int]
    STORE_FILES_LINKED_FIELD_NUMBER: _ClassVar[int]
    backup: str
    in_sync: bool
    lag_records: int
    lag_seconds: float
    feeds_opened: int
    feeds_lost: int
    store_bytes_sent: int
    store_files_sent: int
    store_files_linked: int
    def __init__(self, backup: _Optional[str] = ..., in_sync: _Optional[bool] = ..., lag_records: _Optional[int] = ..., lag_seconds: _Optional[float] = ..., feeds_opened: _Optional[int] = ..., feeds_lost: _Optional[int] = ..., store_bytes_sent: _Optional[int] = ..., store_files_sent: _Optional[int] = ..., store_files_linked: _Optional[int] = ...) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("worker", "state", "pushes", "last_push_step", "restarts")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    state: str
    pushes: int
    last_push_step: int
    restarts: int
    def __init__(self, worker: _Optional[str] = ..., state: _Optional[str] = ..., pushes: _Optional[int] = ..., last_push_step: _Optional[int] = ..., restarts: _Optional[int] = ...) -> None: ...

class WorkerPace(_message.Message):
    __slots__ = ("worker", "push_interval_seconds", "straggler_score")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    PUSH_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_SCORE_FIELD_NUMBER: _ClassVar[int]
    worker: str
    push_interval_seconds: float
    straggler_score: float
    def __init__(self, worker: _Optional[str] = ..., push_interval_seconds: _Optional[float] = ..., straggler_score: _Optional[float] = ...) -> None: ...

class MemoryUsage(_message.Message):
    __slots__ = ("rss_bytes", "peak_rss_bytes", "heap_in_use_bytes", "heap_free_bytes", "mapped_bytes", "kept_receive_bytes", "receive_buffers_reused", "pull_cache_bytes", "pull_cache_hits")
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEAP_IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEAP_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEPT_RECEIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_BUFFERS_REUSED_FIELD_NUMBER: _ClassVar[int]
    PULL_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULL_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    rss_bytes: int
    peak_rss_bytes: int
    heap_in_use_bytes: int
    heap_free_bytes: int
    mapped_bytes: int
    kept_receive_bytes: int
    receive_buffers_reused: int
    pull_cache_bytes: int
    pull_cache_hits: int
    def __init__(self, rss_bytes: _Optional[int] = ..., peak_rss_bytes: _Optional[int] = ..., heap_in_use_bytes: _Optional[int] = ..., heap_free_bytes: _Optional[int] = ..., mapped_bytes: _Optional[int] = ..., kept_receive_bytes: _Optional[int] = ..., receive_buffers_reused: _Optional[int] = ..., pull_cache_bytes: _Optional[int] = ..., pull_cache_hits: _Optional[int] = ...) -> None: ...

class SyncConfig(_message.Message):
    __slots__ = ("mode", "replicas_to_aggregate", "total_num_replicas", "max_staleness", "lease_seconds", "startup_grace_seconds", "progress_seconds", "replicas_fraction")
    MODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_TO_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STARTUP_GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FRACTION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    replicas_to_aggregate: int
    total_num_replicas: int
    max_staleness: int
    lease_seconds: float
    startup_grace_seconds: float
    progress_seconds: float
    replicas_fraction: float
    def __init__(self, mode: _Optional[str] = ..., replicas_to_aggregate: _Optional[int] = ..., total_num_replicas: _Optional[int] = ..., max_staleness: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., startup_grace_seconds: _Optional[float] = ..., progress_seconds: _Optional[float] = ..., replicas_fraction: _Optional[float] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    def __init__(self, changed: _Optional[bool] = ...) -> None: ...

class WorkerRef(_message.Message):
    __slots__ = ("worker", "incarnation", "step")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    worker: str
    incarnation: int
    step: int
    def __init__(self, worker: _Optional[str] = ..., incarnation: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("step", "config", "generation", "restarted", "live_workers", "layout_epoch")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    step: int
    config: SyncConfig
    generation: int
    restarted: bool
    live_workers: int
    layout_epoch: int
    def __init__(self, step: _Optional[int] = ..., config: _Optional[_Union[SyncConfig, _Mapping]] = ..., generation: _Optional[int] = ..., restarted: _Optional[bool] = ..., live_workers: _Optional[int] = ..., layout_epoch: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("step", "generation", "live_workers", "layout_epoch")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    step: int
    generation: int
    live_workers: int
    layout_epoch: int
    def __init__(self, step: _Optional[int] = ..., generation: _Optional[int] = ..., live_workers: _Optional[int] = ..., layout_epoch: _Optional[int] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("epoch", "addresses", "placement", "outbox", "hold_from_step", "quiet", "table_shards", "members", "grace_left_seconds", "hold_lease_seconds", "hold_lease_left_seconds", "table_step", "replicas")
    class TableStep(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        BY_COUNT: _ClassVar[Layout.TableStep]
        BEGIN: _ClassVar[Layout.TableStep]
        END: _ClassVar[Layout.TableStep]
    BY_COUNT: Layout.TableStep
    BEGIN: Layout.TableStep
    END: Layout.TableStep
    class PlacementEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    OUTBOX_FIELD_NUMBER: _ClassVar[int]
    HOLD_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    QUIET_FIELD_NUMBER: _ClassVar[int]
    TABLE_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    GRACE_LEFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOLD_LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOLD_LEASE_LEFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TABLE_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    placement: _containers.ScalarMap[str, int]
    outbox: _containers.RepeatedCompositeFieldContainer[MoveRequest]
    hold_from_step: int
    quiet: bool
    table_shards: int
    members: _containers.RepeatedCompositeFieldContainer[JobMember]
    grace_left_seconds: float
    hold_lease_seconds: float
    hold_lease_left_seconds: float
    table_step: Layout.TableStep
    replicas: _containers.RepeatedCompositeFieldContainer[ShardReplicas]
    def __init__(self, epoch: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ..., placement: _Optional[_Mapping[str, int]] = ..., outbox: _Optional[_Iterable[_Union[MoveRequest, _Mapping]]] = ..., hold_from_step: _Optional[int] = ..., quiet: _Optional[bool] = ..., table_shards: _Optional[int] = ..., members: _Optional[_Iterable[_Union[JobMember, _Mapping]]] = ..., grace_left_seconds: _Optional[float] = ..., hold_lease_seconds: _Optional[float] = ..., hold_lease_left_seconds: _Optional[float] = ..., table_step: _Optional[_Union[Layout.TableStep, str]] = ..., replicas: _Optional[_Iterable[_Union[ShardReplicas, _Mapping]]] = ...) -> None: ...

class ShardReplicas(_message.Message):
    __slots__ = ("index", "primary", "backup", "failovers", "last_failover_unix", "changes", "copy")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILOVER_UNIX_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    index: int
    primary: str
    backup: str
    failovers: int
    last_failover_unix: float
    changes: int
    copy: str
    def __init__(self, index: _Optional[int] = ..., primary: _Optional[str] = ..., backup: _Optional[str] = ..., failovers: _Optional[int] = ..., last_failover_unix: _Optional[float] = ..., changes: _Optional[int] = ..., copy: _Optional[str] = ...) -> None: ...

class ReplicaChange(_message.Message):
    __slots__ = ("action", "index", "primary", "backup", "changes", "copy", "failovers", "asker", "grant")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        IN_SYNC: _ClassVar[ReplicaChange.Action]
        DROP: _ClassVar[ReplicaChange.Action]
        PROMOTE: _ClassVar[ReplicaChange.Action]
        LEASE: _ClassVar[ReplicaChange.Action]
        DEPOSE: _ClassVar[ReplicaChange.Action]
        REINSTATE: _ClassVar[ReplicaChange.Action]
    IN_SYNC: ReplicaChange.Action
    DROP: ReplicaChange.Action
    PROMOTE: ReplicaChange.Action
    LEASE: ReplicaChange.Action
    DEPOSE: ReplicaChange.Action
    REINSTATE: ReplicaChange.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    ASKER_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    action: ReplicaChange.Action
    index: int
    primary: str
    backup: str
    changes: int
    copy: str
    failovers: int
    asker: str
    grant: str
    def __init__(self, action: _Optional[_Union[ReplicaChange.Action, str]] = ..., index: _Optional[int] = ..., primary: _Optional[str] = ..., backup: _Optional[str] = ..., changes: _Optional[int] = ..., copy: _Optional[str] = ..., failovers: _Optional[int] = ..., asker: _Optional[str] = ..., grant: _Optional[str] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("hello", "written")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    hello: ReplicaHello
    written: int
    def __init__(self, hello: _Optional[_Union[ReplicaHello, _Mapping]] = ..., written: _Optional[int] = ...) -> None: ...

class ReplicaHello(_message.Message):
    __slots__ = ("index", "address", "lane", "keeps_stores", "acks_lane", "frames_on_lane", "copy")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    KEEPS_STORES_FIELD_NUMBER: _ClassVar[int]
    ACKS_LANE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_ON_LANE_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    lane: bytes
    keeps_stores: bool
    acks_lane: bytes
    frames_on_lane: bool
    copy: str
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., lane: _Optional[bytes] = ..., keeps_stores: _Optional[bool] = ..., acks_lane: _Optional[bytes] = ..., frames_on_lane: _Optional[bool] = ..., copy: _Optional[str] = ...) -> None: ...

class ReplicaFrame(_message.Message):
    __slots__ = ("kind", "number", "written", "head", "data", "last", "lane_bytes", "path", "same_as", "acks_on_lane")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RECORD: _ClassVar[ReplicaFrame.Kind]
        ROTATE: _ClassVar[ReplicaFrame.Kind]
        BASE: _ClassVar[ReplicaFrame.Kind]
        LAYOUT: _ClassVar[ReplicaFrame.Kind]
        HEARTBEAT: _ClassVar[ReplicaFrame.Kind]
        FILE: _ClassVar[ReplicaFrame.Kind]
        TO_LANE: _ClassVar[ReplicaFrame.Kind]
    RECORD: ReplicaFrame.Kind
    ROTATE: ReplicaFrame.Kind
    BASE: ReplicaFrame.Kind
    LAYOUT: ReplicaFrame.Kind
    HEARTBEAT: ReplicaFrame.Kind
    FILE: ReplicaFrame.Kind
    TO_LANE: ReplicaFrame.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    LANE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SAME_AS_FIELD_NUMBER: _ClassVar[int]
    ACKS_ON_LANE_FIELD_NUMBER: _ClassVar[int]
    kind: ReplicaFrame.Kind
    number: int
    written: int
    head: bytes
    data: bytes
    last: bool
    lane_bytes: int
    path: str
    same_as: str
    acks_on_lane: bool
    def __init__(self, kind: _Optional[_Union[ReplicaFrame.Kind, str]] = ..., number: _Optional[int] = ..., written: _Optional[int] = ..., head: _Optional[bytes] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., lane_bytes: _Optional[int] = ..., path: _Optional[str] = ..., same_as: _Optional[str] = ..., acks_on_lane: _Optional[bool] = ...) -> None: ...

class JobMember(_message.Message):
    __slots__ = ("worker", "incarnation", "counts_from", "gone", "silent_seconds")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FROM_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    SILENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    incarnation: int
    counts_from: int
    gone: bool
    silent_seconds: float
    def __init__(self, worker: _Optional[str] = ..., incarnation: _Optional[int] = ..., counts_from: _Optional[int] = ..., gone: _Optional[bool] = ..., silent_seconds: _Optional[float] = ...) -> None: ...

class LayoutRequest(_message.Message):
    __slots__ = ("watch_primary", "watch_shard", "watch_seconds")
    WATCH_PRIMARY_FIELD_NUMBER: _ClassVar[int]
    WATCH_SHARD_FIELD_NUMBER: _ClassVar[int]
    WATCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    watch_primary: str
    watch_shard: int
    watch_seconds: float
    def __init__(self, watch_primary: _Optional[str] = ..., watch_shard: _Optional[int] = ..., watch_seconds: _Optional[float] = ...) -> None: ...

class MoveRequest(_message.Message):
    __slots__ = ("names", "epoch", "to", "tables")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    to: int
    tables: bool
    def __init__(self, names: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ..., to: _Optional[int] = ..., tables: _Optional[bool] = ...) -> None: ...

class MoveChunk(_message.Message):
    __slots__ = ("data", "epoch", "from_shard", "step", "total_bytes", "tables", "rows", "rows_done")
    class RowsDoneEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DATA_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FROM_SHARD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_DONE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    epoch: int
    from_shard: int
    step: int
    total_bytes: int
    tables: bool
    rows: StoredRows
    rows_done: _containers.ScalarMap[str, int]
    def __init__(self, data: _Optional[bytes] = ..., epoch: _Optional[int] = ..., from_shard: _Optional[int] = ..., step: _Optional[int] = ..., total_bytes: _Optional[int] = ..., tables: _Optional[bool] = ..., rows: _Optional[_Union[StoredRows, _Mapping]] = ..., rows_done: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StoredRows(_message.Message):
    __slots__ = ("table", "ids", "records", "record_bytes")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    records: bytes
    record_bytes: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., records: _Optional[bytes] = ..., record_bytes: _Optional[int] = ...) -> None: ...

class MoveResponse(_message.Message):
    __slots__ = ("names", "step")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    step: int
    def __init__(self, names: _Optional[_Iterable[str]] = ..., step: _Optional[int] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("step", "now", "full")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    step: int
    now: bool
    full: bool
    def __init__(self, step: _Optional[int] = ..., now: _Optional[bool] = ..., full: _Optional[bool] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("step", "path", "bytes", "index", "layout_epoch")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    bytes: int
    index: int
    layout_epoch: int
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., index: _Optional[int] = ..., layout_epoch: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("step", "manifest_json", "shards", "keep")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    manifest_json: str
    shards: _containers.RepeatedCompositeFieldContainer[SaveResponse]
    keep: int
    def __init__(self, step: _Optional[int] = ..., manifest_json: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[SaveResponse, _Mapping]]] = ..., keep: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableInit(_message.Message):
    __slots__ = ("distribution", "scale", "seed")
    DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    distribution: str
    scale: float
    seed: int
    def __init__(self, distribution: _Optional[str] = ..., scale: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "dim", "num_embeddings", "dtype", "partition", "optimizer", "init", "min_count", "max_age", "capacity", "storage")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_AGE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    num_embeddings: int
    dtype: DType
    partition: TablePartition
    optimizer: OptimizerSpec
    init: TableInit
    min_count: int
    max_age: int
    capacity: int
    storage: str
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., num_embeddings: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., partition: _Optional[_Union[TablePartition, str]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., init: _Optional[_Union[TableInit, _Mapping]] = ..., min_count: _Optional[int] = ..., max_age: _Optional[int] = ..., capacity: _Optional[int] = ..., storage: _Optional[str] = ...) -> None: ...

class CreateTablesRequest(_message.Message):
    __slots__ = ("tables", "shard_index", "num_shards")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    shard_index: int
    num_shards: int
    def __init__(self, tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class CreateTablesResponse(_message.Message):
    __slots__ = ("created", "generation")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    created: _containers.RepeatedScalarFieldContainer[bool]
    generation: int
    def __init__(self, created: _Optional[_Iterable[bool]] = ..., generation: _Optional[int] = ...) -> None: ...

class TableIds(_message.Message):
    __slots__ = ("name", "ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ids: bytes
    def __init__(self, name: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class LookupRowsRequest(_message.Message):
    __slots__ = ("tables", "chunk_bytes", "admit", "upcoming")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    UPCOMING_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableIds]
    chunk_bytes: int
    admit: bool
    upcoming: _containers.RepeatedCompositeFieldContainer[TableIds]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableIds, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ..., admit: _Optional[bool] = ..., upcoming: _Optional[_Iterable[_Union[TableIds, _Mapping]]] = ...) -> None: ...

class TableStatus(_message.Message):
    __slots__ = ("name", "rows", "pending", "admitted", "evicted", "evicted_by_age", "evicted_by_capacity", "bytes", "row_bytes", "optimizer_steps", "rows_read", "rows_pushed", "storage", "cache_rows", "cache_hits", "cache_misses", "disk_bytes_read", "disk_bytes_written", "disk_bytes", "cache_warmed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BY_AGE_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BY_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROWS_READ_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    CACHE_ROWS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_WARMED_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    pending: int
    admitted: int
    evicted: int
    evicted_by_age: int
    evicted_by_capacity: int
    bytes: int
    row_bytes: int
    optimizer_steps: int
    rows_read: int
    rows_pushed: int
    storage: str
    cache_rows: int
    cache_hits: int
    cache_misses: int
    disk_bytes_read: int
    disk_bytes_written: int
    disk_bytes: int
    cache_warmed: int
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., pending: _Optional[int] = ..., admitted: _Optional[int] = ..., evicted: _Optional[int] = ..., evicted_by_age: _Optional[int] = ..., evicted_by_capacity: _Optional[int] = ..., bytes: _Optional[int] = ..., row_bytes: _Optional[int] = ..., optimizer_steps: _Optional[int] = ..., rows_read: _Optional[int] = ..., rows_pushed: _Optional[int] = ..., storage: _Optional[str] = ..., cache_rows: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., disk_bytes_read: _Optional[int] = ..., disk_bytes_written: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., cache_warmed: _Optional[int] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("spec", "num_shards", "status")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    num_shards: int
    status: TableStatus
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., num_shards: _Optional[int] = ..., status: _Optional[_Union[TableStatus, _Mapping]] = ...) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables", "step", "generation")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    step: int
    generation: int
    def __init__(self, tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class DataQueueSpec(_message.Message):
    __slots__ = ("name", "num_examples", "shard_size", "epochs", "seed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    SHARD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_examples: int
    shard_size: int
    epochs: int
    seed: int
    def __init__(self, name: _Optional[str] = ..., num_examples: _Optional[int] = ..., shard_size: _Optional[int] = ..., epochs: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class CreateDataQueueResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class TakeDataShardRequest(_message.Message):
    __slots__ = ("queue", "worker", "incarnation", "wait_seconds")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue: str
    worker: str
    incarnation: int
    wait_seconds: float
    def __init__(self, queue: _Optional[str] = ..., worker: _Optional[str] = ..., incarnation: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class DataShard(_message.Message):
    __slots__ = ("queue", "lease", "epoch", "begin", "end", "progress")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    queue: str
    lease: int
    epoch: int
    begin: int
    end: int
    progress: int
    def __init__(self, queue: _Optional[str] = ..., lease: _Optional[int] = ..., epoch: _Optional[int] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ..., progress: _Optional[int] = ...) -> None: ...

class TakeDataShardResponse(_message.Message):
    __slots__ = ("shard", "finished")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    shard: DataShard
    finished: bool
    def __init__(self, shard: _Optional[_Union[DataShard, _Mapping]] = ..., finished: _Optional[bool] = ...) -> None: ...

class DataProgress(_message.Message):
    __slots__ = ("queue", "lease", "begin", "end")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    queue: str
    lease: int
    begin: int
    end: int
    def __init__(self, queue: _Optional[str] = ..., lease: _Optional[int] = ..., begin: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class DataQueueRequest(_message.Message):
    __slots__ = ("name", "wait_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    wait_seconds: float
    def __init__(self, name: _Optional[str] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class DataQueueStatus(_message.Message):
    __slots__ = ("spec", "epoch", "trained", "epochs_done", "finished", "shards_done", "held", "holders", "reclaimed", "requeued_examples", "duplicates")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_DONE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SHARDS_DONE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    spec: DataQueueSpec
    epoch: int
    trained: _containers.RepeatedScalarFieldContainer[int]
    epochs_done: int
    finished: bool
    shards_done: int
    held: _containers.RepeatedCompositeFieldContainer[DataShard]
    holders: _containers.RepeatedScalarFieldContainer[str]
    reclaimed: int
    requeued_examples: int
    duplicates: int
    def __init__(self, spec: _Optional[_Union[DataQueueSpec, _Mapping]] = ..., epoch: _Optional[int] = ..., trained: _Optional[_Iterable[int]] = ..., epochs_done: _Optional[int] = ..., finished: _Optional[bool] = ..., shards_done: _Optional[int] = ..., held: _Optional[_Iterable[_Union[DataShard, _Mapping]]] = ..., holders: _Optional[_Iterable[str]] = ..., reclaimed: _Optional[int] = ..., requeued_examples: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class ResizeState(_message.Message):
    __slots__ = ("id", "phase", "driver", "before", "after", "hold_from_step", "moves", "lease_seconds", "lease_left_seconds", "ended_why", "table_shards", "tables_from", "tables_built")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[ResizeState.Phase]
        RUNNING: _ClassVar[ResizeState.Phase]
        DONE: _ClassVar[ResizeState.Phase]
        ABORTED: _ClassVar[ResizeState.Phase]
    NONE: ResizeState.Phase
    RUNNING: ResizeState.Phase
    DONE: ResizeState.Phase
    ABORTED: ResizeState.Phase
    ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    HOLD_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_LEFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENDED_WHY_FIELD_NUMBER: _ClassVar[int]
    TABLE_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FROM_FIELD_NUMBER: _ClassVar[int]
    TABLES_BUILT_FIELD_NUMBER: _ClassVar[int]
    id: int
    phase: ResizeState.Phase
    driver: str
    before: _containers.RepeatedScalarFieldContainer[str]
    after: _containers.RepeatedScalarFieldContainer[str]
    hold_from_step: int
    moves: _containers.RepeatedCompositeFieldContainer[ResizeMove]
    lease_seconds: float
    lease_left_seconds: float
    ended_why: str
    table_shards: int
    tables_from: int
    tables_built: bool
    def __init__(self, id: _Optional[int] = ..., phase: _Optional[_Union[ResizeState.Phase, str]] = ..., driver: _Optional[str] = ..., before: _Optional[_Iterable[str]] = ..., after: _Optional[_Iterable[str]] = ..., hold_from_step: _Optional[int] = ..., moves: _Optional[_Iterable[_Union[ResizeMove, _Mapping]]] = ..., lease_seconds: _Optional[float] = ..., lease_left_seconds: _Optional[float] = ..., ended_why: _Optional[str] = ..., table_shards: _Optional[int] = ..., tables_from: _Optional[int] = ..., tables_built: _Optional[bool] = ...) -> None: ...

class ResizeMove(_message.Message):
    __slots__ = ("name", "from_shard", "to", "bytes", "status")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PLANNED: _ClassVar[ResizeMove.Status]
        EXPORTED: _ClassVar[ResizeMove.Status]
        IMPORTED: _ClassVar[ResizeMove.Status]
        CONFIRMED: _ClassVar[ResizeMove.Status]
        RETURNED: _ClassVar[ResizeMove.Status]
    PLANNED: ResizeMove.Status
    EXPORTED: ResizeMove.Status
    IMPORTED: ResizeMove.Status
    CONFIRMED: ResizeMove.Status
    RETURNED: ResizeMove.Status
    NAME_FIELD_NUMBER: _ClassVar[int]
    FROM_SHARD_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    from_shard: int
    to: int
    bytes: int
    status: ResizeMove.Status
    def __init__(self, name: _Optional[str] = ..., from_shard: _Optional[int] = ..., to: _Optional[int] = ..., bytes: _Optional[int] = ..., status: _Optional[_Union[ResizeMove.Status, str]] = ...) -> None: ...

class ResizeRequest(_message.Message):
    __slots__ = ("action", "id", "driver", "before", "after", "lease_seconds", "hold_from_step", "moves", "phase", "why", "table_shards", "tables_from", "tables_built")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        GET: _ClassVar[ResizeRequest.Action]
        BEGIN: _ClassVar[ResizeRequest.Action]
        RENEW: _ClassVar[ResizeRequest.Action]
        TAKE_OVER: _ClassVar[ResizeRequest.Action]
        PLAN: _ClassVar[ResizeRequest.Action]
        MOVED: _ClassVar[ResizeRequest.Action]
        END: _ClassVar[ResizeRequest.Action]
        TABLES: _ClassVar[ResizeRequest.Action]
    GET: ResizeRequest.Action
    BEGIN: ResizeRequest.Action
    RENEW: ResizeRequest.Action
    TAKE_OVER: ResizeRequest.Action
    PLAN: ResizeRequest.Action
    MOVED: ResizeRequest.Action
    END: ResizeRequest.Action
    TABLES: ResizeRequest.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOLD_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    TABLE_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FROM_FIELD_NUMBER: _ClassVar[int]
    TABLES_BUILT_FIELD_NUMBER: _ClassVar[int]
    action: ResizeRequest.Action
    id: int
    driver: str
    before: _containers.RepeatedScalarFieldContainer[str]
    after: _containers.RepeatedScalarFieldContainer[str]
    lease_seconds: float
    hold_from_step: int
    moves: _containers.RepeatedCompositeFieldContainer[ResizeMove]
    phase: ResizeState.Phase
    why: str
    table_shards: int
    tables_from: int
    tables_built: bool
    def __init__(self, action: _Optional[_Union[ResizeRequest.Action, str]] = ..., id: _Optional[int] = ..., driver: _Optional[str] = ..., before: _Optional[_Iterable[str]] = ..., after: _Optional[_Iterable[str]] = ..., lease_seconds: _Optional[float] = ..., hold_from_step: _Optional[int] = ..., moves: _Optional[_Iterable[_Union[ResizeMove, _Mapping]]] = ..., phase: _Optional[_Union[ResizeState.Phase, str]] = ..., why: _Optional[str] = ..., table_shards: _Optional[int] = ..., tables_from: _Optional[int] = ..., tables_built: _Optional[bool] = ...) -> None: ...

class TableCursor(_message.Message):
    __slots__ = ("table", "incarnation", "seq")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    table: str
    incarnation: str
    seq: int
    def __init__(self, table: _Optional[str] = ..., incarnation: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class ChangesRequest(_message.Message):
    __slots__ = ("cursors", "max_rows", "min_updates", "tables")
    CURSORS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    MIN_UPDATES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    cursors: _containers.RepeatedCompositeFieldContainer[TableCursor]
    max_rows: int
    min_updates: int
    tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cursors: _Optional[_Iterable[_Union[TableCursor, _Mapping]]] = ..., max_rows: _Optional[int] = ..., min_updates: _Optional[int] = ..., tables: _Optional[_Iterable[str]] = ...) -> None: ...

class TableChanges(_message.Message):
    __slots__ = ("table", "incarnation", "seq", "whole", "first", "last", "dim", "dtype", "ids", "rows", "held", "step", "partition", "num_shards", "shard", "num_embeddings")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    table: str
    incarnation: str
    seq: int
    whole: bool
    first: bool
    last: bool
    dim: int
    dtype: DType
    ids: bytes
    rows: bytes
    held: bytes
    step: int
    partition: TablePartition
    num_shards: int
    shard: int
    num_embeddings: int
    def __init__(self, table: _Optional[str] = ..., incarnation: _Optional[str] = ..., seq: _Optional[int] = ..., whole: _Optional[bool] = ..., first: _Optional[bool] = ..., last: _Optional[bool] = ..., dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., held: _Optional[bytes] = ..., step: _Optional[int] = ..., partition: _Optional[_Union[TablePartition, str]] = ..., num_shards: _Optional[int] = ..., shard: _Optional[int] = ..., num_embeddings: _Optional[int] = ...) -> None: ...

class ServingLookupRequest(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class ServingLookupReply(_message.Message):
    __slots__ = ("version", "step", "dim", "dtype", "rows", "held")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    dim: int
    dtype: DType
    rows: bytes
    held: bytes
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., rows: _Optional[bytes] = ..., held: _Optional[bytes] = ...) -> None: ...

class DenseRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class DenseTensor(_message.Message):
    __slots__ = ("name", "meta", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    meta: TensorMeta
    data: bytes
    def __init__(self, name: _Optional[str] = ..., meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DenseReply(_message.Message):
    __slots__ = ("version", "step", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    tensors: _containers.RepeatedCompositeFieldContainer[DenseTensor]
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[DenseTensor, _Mapping]]] = ...) -> None: ...

class ServingStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServingVersion(_message.Message):
    __slots__ = ("version", "step", "published_unix")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    published_unix: float
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., published_unix: _Optional[float] = ...) -> None: ...

class ServingStatus(_message.Message):
    __slots__ = ("current", "kept", "held", "staleness_seconds", "behind_steps", "rows", "resyncs", "error", "lookups", "lookup_p50_seconds", "lookup_p99_seconds", "rows_applied", "guard_refused", "guard_loss", "guard_baseline", "dense_read_unix")
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    STALENESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BEHIND_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    GUARD_REFUSED_FIELD_NUMBER: _ClassVar[int]
    GUARD_LOSS_FIELD_NUMBER: _ClassVar[int]
    GUARD_BASELINE_FIELD_NUMBER: _ClassVar[int]
    DENSE_READ_UNIX_FIELD_NUMBER: _ClassVar[int]
    current: ServingVersion
    kept: _containers.RepeatedCompositeFieldContainer[ServingVersion]
    held: bool
    staleness_seconds: float
    behind_steps: int
    rows: int
    resyncs: int
    error: str
    lookups: int
    lookup_p50_seconds: float
    lookup_p99_seconds: float
    rows_applied: int
    guard_refused: int
    guard_loss: float
    guard_baseline: float
    dense_read_unix: float
    def __init__(self, current: _Optional[_Union[ServingVersion, _Mapping]] = ..., kept: _Optional[_Iterable[_Union[ServingVersion, _Mapping]]] = ..., held: _Optional[bool] = ..., staleness_seconds: _Optional[float] = ..., behind_steps: _Optional[int] = ..., rows: _Optional[int] = ..., resyncs: _Optional[int] = ..., error: _Optional[str] = ..., lookups: _Optional[int] = ..., lookup_p50_seconds: _Optional[float] = ..., lookup_p99_seconds: _Optional[float] = ..., rows_applied: _Optional[int] = ..., guard_refused: _Optional[int] = ..., guard_loss: _Optional[float] = ..., guard_baseline: _Optional[float] = ..., dense_read_unix: _Optional[float] = ...) -> None: ...

class ServingControl(_message.Message):
    __slots__ = ("action", "step")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACTION_UNSPECIFIED: _ClassVar[ServingControl.Action]
        HOLD: _ClassVar[ServingControl.Action]
        RESUME: _ClassVar[ServingControl.Action]
        ROLLBACK: _ClassVar[ServingControl.Action]
    ACTION_UNSPECIFIED: ServingControl.Action
    HOLD: ServingControl.Action
    RESUME: ServingControl.Action
    ROLLBACK: ServingControl.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    action: ServingControl.Action
    step: int
    def __init__(self, action: _Optional[_Union[ServingControl.Action, str]] = ..., step: _Optional[int] = ...) -> None: ...
