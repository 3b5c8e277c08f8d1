"""The cluster value: who is who, in TF_CONFIG's shape, validated once.

A `Cluster` is a frozen value passed everywhere (no globals). It reads the
same JSON TensorFlow uses, so a Kubeflow TFJob's TF_CONFIG works unchanged:

    {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222"], "ps": ["h2:2222"]},
     "task": {"type": "worker", "index": 0}}
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Mapping

from .errors import ClusterConfigError

__all__ = ["Cluster", "TaskSpec", "TASK_TYPES", "arbiter_of"]

TASK_TYPES = ("chief", "worker", "ps", "evaluator")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task of the cluster: its type (chief, worker, ps, evaluator) and index."""

    type: str
    index: int

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Addresses ("host:port") of every task, by type; validated on creation.

    Raises ClusterConfigError for unknown task types, malformed or duplicate
    addresses, more than one chief or evaluator, or no ps task.
    """

    ps: tuple[str, ...]
    worker: tuple[str, ...] = ()
    chief: tuple[str, ...] = ()
    evaluator: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for kind in TASK_TYPES:
            value = getattr(self, kind)
            if isinstance(value, str) or not all(isinstance(a, str) for a in value):
                raise ClusterConfigError(f"cluster[{kind!r}] must be a list of 'host:port' strings, got {value!r}")
            object.__setattr__(self, kind, tuple(value))
            for address in value:
                _check_address(kind, address)
        if not self.ps:
            raise ClusterConfigError("the cluster has no 'ps' tasks; list at least one 'host:port' under 'ps'")
        for kind in ("chief", "evaluator"):
            if len(getattr(self, kind)) > 1:
                raise ClusterConfigError(f"a cluster has at most one {kind}, got {list(getattr(self, kind))}")
        seen: dict[str, str] = {}
        for task, address in self.tasks():
            if address in seen:
                raise ClusterConfigError(f"address {address} is listed twice: for {seen[address]} and {task}")
            seen[address] = str(task)

    @classmethod
    def from_dict(cls, spec: Mapping) -> "Cluster":
        """Builds a cluster from {"ps": [...], ...} or a whole TF_CONFIG dict."""
        if not isinstance(spec, Mapping):
            raise ClusterConfigError(f"a cluster must be a JSON object, got {type(spec).__name__}")
        if "cluster" in spec:
            spec = spec["cluster"]
        unknown = sorted(set(spec) - set(TASK_TYPES))
        if unknown:
            raise ClusterConfigError(f"unknown task type(s) {unknown} in cluster; allowed: {list(TASK_TYPES)}")
        return cls(**{kind: spec.get(kind, ()) for kind in TASK_TYPES})

    @classmethod
    def from_json(cls, text_or_path: str) -> "Cluster":
        """Parses inline JSON, or reads it from a file path."""
        text = text_or_path
        if not text.lstrip().startswith("{"):
            path = pathlib.Path(text)
            if not path.is_file():
                raise ClusterConfigError(f"--cluster is neither inline JSON nor a readable file: {text!r}")
            text = path.read_text()
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ClusterConfigError(f"cluster JSON does not parse: {exc}") from None
        return cls.from_dict(spec)

    @classmethod
    def from_tf_config(cls, environ: Mapping[str, str] | None = None) -> tuple["Cluster", TaskSpec | None]:
        """Reads TF_CONFIG from `environ` (default os.environ): (cluster, task or None)."""
        raw = (os.environ if environ is None else environ).get("TF_CONFIG")
        if not raw:
            raise ClusterConfigError("TF_CONFIG is not set; pass --cluster or set TF_CONFIG")
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ClusterConfigError(f"TF_CONFIG does not parse as JSON: {exc}") from None
        if not isinstance(config, Mapping) or "cluster" not in config:
            raise ClusterConfigError("TF_CONFIG has no 'cluster' key")
        cluster = cls.from_dict(config["cluster"])
        task = config.get("task")
        if not task:
            return cluster, None
        try:
            spec = TaskSpec(str(task["type"]), int(task.get("index", 0)))
        except (KeyError, TypeError, ValueError):
            raise ClusterConfigError(f"TF_CONFIG's task must be {{'type': ..., 'index': N}}, got {task!r}") from None
        cluster.address(spec)  # validates
        return cluster, spec

    def tasks(self) -> list[tuple[TaskSpec, str]]:
        """Every (task, address), in TASK_TYPES order then by index."""
        return [(TaskSpec(kind, i), a) for kind in TASK_TYPES for i, a in enumerate(getattr(self, kind))]

    def training_names(self) -> list[str]:
        """The names the chief and the workers join a job with ("worker:1"), in spec order."""
        return [str(task) for task, _ in self.tasks() if task.type in ("chief", "worker")]

    def address(self, task: TaskSpec) -> str:
        """The address of `task`; ClusterConfigError if the cluster lacks it."""
        if task.type not in TASK_TYPES:
            raise ClusterConfigError(f"unknown task type {task.type!r}; allowed: {list(TASK_TYPES)}")
        addresses = getattr(self, task.type)
        if not 0 <= task.index < len(addresses):
            raise ClusterConfigError(
                f"task {task} is not in the cluster: it has {len(addresses)} {task.type} task(s)")
        return addresses[task.index]

    @property
    def num_ps(self) -> int:
        return len(self.ps)

    @property
    def chief_task(self) -> TaskSpec | None:
        """The chief: the 'chief' task, else worker 0, else None."""
        if self.chief:
            return TaskSpec("chief", 0)
        return TaskSpec("worker", 0) if self.worker else None

    def to_dict(self) -> dict:
        """The cluster as TF_CONFIG's 'cluster' object (empty types left out)."""
        return {kind: list(getattr(self, kind)) for kind in TASK_TYPES if getattr(self, kind)}

    def tf_config(self, task: TaskSpec) -> str:
        """The TF_CONFIG JSON for `task` in this cluster."""
        self.address(task)
        return json.dumps({"cluster": self.to_dict(), "task": {"type": task.type, "index": task.index}})


def arbiter_of(index: int, num_shards: int) -> int:
    """The shard whose record (ps_server/replicas.py) decides who serves shard `index` of a job of `num_shards`: ps 0 for every other
    shard, and ps 1 for ps 0 (ps 0 cannot grant its own failover); ps 0 itself in a one-shard job, whose backup
    then takes over by hand only."""
    return 1 if index == 0 and num_shards > 1 else 0


def _check_address(kind: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ClusterConfigError(f"cluster[{kind!r}] entry {address!r} is not 'host:port'")
