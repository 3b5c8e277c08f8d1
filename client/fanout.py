"""The fan-out to a cluster's shards: one call per shard, all at once, each reply's generation noted.

ShardFanout owns what every call to the shards goes through: the channels
(channels.py: deadlines, retries with backoff), the threads that run one
shard's call each (the caller's thread takes one shard), the deadlines and
the chunk size calls use, the tracer of the data path's calls, and the
generation each shard last answered with (a change is a restarted shard:
`restarts_seen`). It also makes the calls that PSClient and its helpers
share: CreateVariables on one shard (a creation, or a refill by recovery.py)
and the List calls a worker repeats while it waits for the chief.

PSClient (client.py), its data path (datapath.py, tables.py, layer_pull.py,
streamed_push.py), refills (recovery.py) and checkpoints (checkpoints.py) all
call the shards through it; none of them imports client.py.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING, Callable, Mapping, TypeVar

from ..cluster import Cluster
from ..errors import WaitTimeoutError
from ..proto import ps_pb2
from ..security import Security
from .channels import ShardChannels

if TYPE_CHECKING:
    import torch

__all__ = ["ShardFanout", "WAIT_SLICE_SECONDS", "CONTROL_TIMEOUT_SECONDS"]

_LOGGER = logging.getLogger(__name__)
T = TypeVar("T")
CONTROL_TIMEOUT_SECONDS = 30.0  # deadline of calls that never wait for training (status, join, configure, ...)
WAIT_SLICE_SECONDS = 5.0  # longest single server-side wait for variables; the client repeats until its deadline


class ShardFanout:
    """Calls to every shard of `cluster` (see the module docstring). Thread-safe.

    `timeout` is every attempt's deadline for calls that may wait for
    training, `control_timeout` for the others; `chunk_bytes` the size of
    the chunks values travel in. Errors are PSError subclasses, never
    grpc.RpcError.
    """

    def __init__(self, cluster: Cluster, *, connect_timeout: float, security: Security, timeout: float,
                 control_timeout: float, chunk_bytes: int):
        self.channels = ShardChannels(list(cluster.ps), connect_timeout=connect_timeout, security=security)
        self.cluster_shards = cluster.num_ps  # the job's shards before any live resize, as this client knows them
        self.timeout = timeout
        self.control_timeout = control_timeout
        self.chunk_bytes = chunk_bytes
        self._chief = cluster.chief_task
        # Shards of one call run here (the caller's thread takes one of them). Threads are made as
        # needed, up to the limit, so a call that waits long never holds up another thread's call.
        self._pool = futures.ThreadPoolExecutor(max_workers=8 * cluster.num_ps + 8, thread_name_prefix="torchps")
        # tracer(phase, shard, start, end) (monotonic seconds) for every shard's push, pull, push_pull and lookup
        # call, when set (ps-worker --trace-out); called from the threads making the calls.
        self.tracer: Callable[[str, int, float, float], None] | None = None
        self._lock = threading.Lock()  # guards generations and restarts_seen
        self.generations: dict[int, int] = {}  # shard -> generation last seen; a change means a restart
        self.restarts_seen = 0

    @property
    def num_shards(self) -> int:
        """The shards of the job now (the cluster's, until a live resize: layout.LayoutFollower)."""
        return self.channels.live

    def close(self) -> None:
        """Stops taking calls and closes every channel (calls under way fail). Never blocks."""
        self._pool.shutdown(wait=False)
        self.channels.close()

    # -- one shard -----------------------------------------------------------------------------------

    def call(self, shard: int, fn: Callable[[object, float], T], timeout: float, retry_for: float | None = None
             ) -> T:
        """fn(stub, deadline seconds) against `shard`, retried as channels.ShardChannels.call says."""
        return self.channels.call(shard, fn, timeout, retry_for)

    def target(self, shard: int) -> str:
        """The shard's name and address, for messages ("ps:1 at host:port")."""
        return self.channels.target(shard)

    def submit(self, fn: Callable[..., T], *args) -> futures.Future:
        """fn(*args) on one of the fan-out's threads (a call made beside the caller's)."""
        return self._pool.submit(fn, *args)

    def note_generation(self, shard: int, generation: int) -> None:
        """Keeps the generation `shard` answered with; another than the last one is a restart, counted and
        logged."""
        with self._lock:
            known = self.generations.get(shard)
            self.generations[shard] = generation
            restarted = known is not None and known != generation
            if restarted:
                self.restarts_seen += 1
        if restarted:
            _LOGGER.warning("ps:%d restarted (generation %x -> %x); the next pull re-reads its variables",
                            shard, known, generation)

    def create_on(self, shard: int, tensors: Mapping[str, torch.Tensor], spec: ps_pb2.OptimizerSpec,
                  job_step: int = 0) -> list[bool]:
        """CreateVariables of `tensors` on one shard; the per-variable `created` flags. `job_step`: a refill.
        Blocks for one round trip (at most `timeout` per attempt)."""
        from .. import codec  # torch: the fan-out itself runs without it (ps-admin)

        def requests():
            for i, (name, tensor) in enumerate(tensors.items()):
                value = tensor.detach().cpu()
                first = {"count": len(tensors), "step": job_step} if i == 0 else {}
                yield ps_pb2.CreateRequest(spec=ps_pb2.VariableSpec(name=name, meta=codec.meta_of(value), optimizer=spec),
                                           **first)
                for chunk in codec.encode_chunks(name, value, self.chunk_bytes):
                    yield ps_pb2.CreateRequest(chunk=chunk)

        reply = self.call(shard, lambda stub, t: stub.CreateVariables(requests(), timeout=t), self.timeout)
        self.note_generation(shard, reply.generation)
        return list(reply.created)

    # -- every shard at once -------------------------------------------------------------------------

    def all_shards(self) -> dict[int, list[str]]:
        """{shard: []} for every shard: each()'s groups for a call every shard gets."""
        return {shard: [] for shard in range(self.num_shards)}

    def every(self, fn: Callable) -> dict:
        """fn(stub, timeout) on every shard at once, with the control deadline; {shard: its reply}."""
        return self.each(self.all_shards(), lambda shard, _: self.call(shard, fn, self.control_timeout))

    def each(self, groups: Mapping[int, list[str]], fn: Callable[[int, list[str]], T],
             phase: str | None = None) -> dict[int, T]:
        """Runs fn(shard, names) for every shard concurrently; the first error is raised after all finish.
        With a `tracer` set, each shard's call of a data-path `phase` (push, pull, push_pull, lookup) is reported to
        it."""
        items = list(groups.items())
        if not items:
            return {}
        tracer = self.tracer
        if tracer is not None and phase is not None:
            untraced = fn

            def fn(shard: int, names: list[str]) -> T:
                started = time.monotonic()
                try:
                    return untraced(shard, names)
                finally:
                    tracer(phase, shard, started, time.monotonic())
        pending = {shard: self._pool.submit(fn, shard, names) for shard, names in items[1:]}
        first_shard, first_names = items[0]
        results: dict[int, T] = {}
        error: BaseException | None = None
        try:
            results[first_shard] = fn(first_shard, first_names)
        except Exception as exc:  # noqa: BLE001 - raised once the others are done
            error = exc
        except BaseException:  # an interrupt (Ctrl-C, SIGTERM): no waiting for the other shards' calls
            for future in pending.values():
                future.cancel()
            raise
        for shard, future in pending.items():
            try:
                results[shard] = future.result()
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error
        return results

    def wait_listed(self, groups: Mapping[int, list[str]], method: str, timeout: float) -> None:
        """Blocks until each shard's `method` (ListVariables, ListTables) finds every name of its group, asking
        with short server-side waits; WaitTimeoutError naming the missing ones after `timeout` s."""
        started = time.monotonic()
        deadline = started + timeout
        what = "variables" if method == "ListVariables" else "tables"

        def wait(shard: int, shard_names: list[str]) -> None:
            while True:  # short server-side waits, so waiting workers never hold a shard's threads for long
                remaining = deadline - time.monotonic()
                request = ps_pb2.ListRequest(names=shard_names, wait_seconds=max(0.001, min(WAIT_SLICE_SECONDS, remaining)))
                try:
                    reply = self.call(shard, lambda stub, t: getattr(stub, method)(request, timeout=t),
                                      WAIT_SLICE_SECONDS + self.control_timeout)
                    self.note_generation(shard, reply.generation)
                    return
                except WaitTimeoutError as exc:
                    if time.monotonic() >= deadline:
                        raise WaitTimeoutError(str(exc).replace(f"waited {request.wait_seconds:g} s",
                                                                f"waited {timeout:g} s")) from None
                    _LOGGER.info("waiting for the chief (%s) to create %d %s on %s (%.0f s of %.0f s)",
                                 self._chief, len(shard_names), what, self.target(shard),
                                 time.monotonic() - started, timeout)

        self.each(groups, wait)
