"""A worker's place in the job: join, heartbeats to every shard at once, leave.

Heartbeats run in a background thread every lease / 3 and go to all shards
concurrently, each with a deadline of one interval, so a slow or dead shard
never delays the others' leases. A shard that answers WorkerReplacedError (a
newer process of this task joined) fences this client: its next call raises
that error.

Shard 0's replies to joins and heartbeats carry the number of live workers
(LiveWorkers): a client follows the job's size from them, and runs the
callbacks registered for a change in its training thread, before its next
push (as Horovod's elastic reset callbacks run at a reset), never in the
heartbeat thread, whose beats must not wait for them.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from ..errors import PSError, WorkerReplacedError
from ..proto import ps_pb2
from .channels import ShardChannels
from .errors import error_from_rpc

__all__ = ["Heartbeats", "LiveWorkers"]

_LOGGER = logging.getLogger(__name__)


class Heartbeats:
    """The background thread that keeps a worker's leases alive on every shard."""

    def __init__(self, channels: ShardChannels, ref: Callable[[], ps_pb2.WorkerRef],
                 on_reply: Callable[[int, ps_pb2.HeartbeatResponse], None]):
        self._channels = channels
        self._ref = ref
        self._on_reply = on_reply
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fenced: WorkerReplacedError | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, interval: float) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, args=(interval,), name="torchps-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def beat(self, timeout: float) -> None:
        """One heartbeat to every shard at once; waits at most `timeout` for the replies."""
        ref = self._ref()
        calls = {}
        for shard, stub in enumerate(self._channels.stubs[:self._channels.live]):
            try:
                calls[shard] = stub.Heartbeat.future(ref, timeout=timeout)
            except ValueError:  # its channel closed under it (a redirect, the client's close): the next beat's
                _LOGGER.debug("heartbeat to ps:%d: its channel was closed", shard)  # stub is the new one
        for shard, call in calls.items():
            try:
                self._on_reply(shard, call.result())
            except grpc.RpcError as exc:
                error = error_from_rpc(exc, self._channels.target(shard))
                if isinstance(error, WorkerReplacedError):
                    self.fenced = error
                    _LOGGER.error("%s", error)
                else:  # a missed beat is logged; the lease decides
                    _LOGGER.debug("heartbeat to %s failed: %s", self._channels.target(shard), error)
            except PSError as exc:
                _LOGGER.debug("heartbeat to ps:%d: %s", shard, exc)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.beat(interval)


class LiveWorkers:
    """The live workers shard 0 last reported, and the callbacks to run when that number changes.

    `note(n)` (join, the heartbeat thread) records a count; `dispatch()` (a pushing
    thread, before its push) runs every callback `fn(live, previous)` once per
    change, in registration order, with the latest count: a callback may call
    the client (set_hyperparams, status), but not push. Thread-safe; one thread
    dispatches at a time. A callback that raises propagates to the push, which
    then sends nothing; the change counts as handled.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()        # the count and the callbacks
        self._dispatching = threading.Lock()  # one dispatching thread at a time
        self.count: int | None = None        # None until shard 0 answered a join
        self._handled: int | None = None     # the count the callbacks last saw
        self._callbacks: list[Callable[[int, int | None], None]] = []

    def add(self, fn: Callable[[int, int | None], None]) -> None:
        with self._lock:
            self._callbacks.append(fn)

    def note(self, count: int) -> None:
        with self._lock:
            self.count = count

    def dispatch(self) -> None:
        """Runs the callbacks if the count changed since they last ran (see the class docstring)."""
        if not self._callbacks or self.count == self._handled:
            return
        with self._dispatching:
            with self._lock:
                live, previous, callbacks = self.count, self._handled, list(self._callbacks)
                if live == previous or live is None:
                    return
                self._handled = live
            if previous is not None or live != 0:
                _LOGGER.info("live workers %s -> %d", "?" if previous is None else previous, live)
            for fn in callbacks:
                fn(live, previous)
