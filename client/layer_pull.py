"""A layer-by-layer pull: a module's values landing in place while forward runs (overlap.py's second half).

LayerPull pulls every parameter in forward order, one Pull stream per shard
in background threads (its bytes on a bulk lane where one is lent:
DataPath._pull_stream), and signals each parameter's arrival (all its pieces,
in place) as its last chunk lands; overlap.py's forward pre-hook on every
submodule that owns parameters waits for those parameters only. A parameter
on a GPU arrives in a reused host buffer and its copy to the device is
queued then, on a side stream (device.py); the pre-hook makes the compute
stream wait for that copy's event, never the host for the device.
"""

from __future__ import annotations

import threading
from typing import Iterator, Mapping

import numpy as np
import torch

from .. import codec
from ..errors import LayoutChangedError, UnknownVariableError, WaitTimeoutError
from ..proto import ps_pb2
from .datapath import GLOBAL_STEP_SHARD, DataPath
from .transfer import IntoTargets, read_stream

__all__ = ["LayerPull"]


class _Cancelled(Exception):
    """A pull replaced by a newer one; never leaves this module."""


class LayerPull:
    """The pull of a module's parameters in place, in forward order, in background threads.

    wait_for(names) returns once those parameters (all their pieces) have
    arrived; wait() once every one has. Both raise the pull's error, or
    WaitTimeoutError after the client's timeout.
    """

    def __init__(self, client: DataPath, targets: Mapping[str, torch.Tensor], *, min_step: int, set_step: bool):
        self.client = client
        self._set_step = set_step
        self._min_step = min_step
        self._wire = client.partitions.split(targets)  # row views: pieces land in place
        self._sink = IntoTargets(self._wire, client.stats, client._device)  # made here: the training thread
        self._whole = {wire_name: client.partitions.whole_of(wire_name) for wire_name in self._wire}
        self._pieces: dict[str, list[str]] = {name: [] for name in targets}
        for wire_name, name in self._whole.items():
            self._pieces[name].append(wire_name)
        self._missing = {name: 0 for name in targets}  # pieces still to arrive, per parameter
        for name in self._whole.values():
            self._missing[name] += 1
        self._arrived: set[str] = set()  # wire variables complete (a retried stream does not write them again)
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self.finished = False
        self._cancelled = False
        self._calls: list = []
        self._future = client._fanout.submit(self._run)

    def _run(self) -> None:
        client = self.client
        try:
            names = list(self._wire)
            step = client._refill.guard(names, lambda: client._layout.each(  # follows a live resize
                client.placement.group(names), self._pull, "pull")).get(GLOBAL_STEP_SHARD, -1)
            self._sink.complete_all()  # device copies queued; the training thread's waits order its compute after them
            if self._set_step and step >= 0:
                client.step = step
        except BaseException as exc:  # noqa: BLE001 - raised by the waits
            with self._cond:
                self.error = self.error or exc
        finally:
            with self._cond:
                self.finished = True
                self._cond.notify_all()

    def _pull(self, shard: int, names: list[str], first: bool = True, again: bool = False) -> int:
        client = self.client
        nbytes = sum(self._wire[name].nbytes for name in names)

        def attempt(stub, timeout: float) -> int:
            request = ps_pb2.PullRequest(names=names, chunk_bytes=client.chunk_bytes, min_step=self._min_step,
                                         cast=client._pull_casts(names, self._sink))
            return client._pull_stream(shard, stub, request, timeout, nbytes, lambda messages: read_stream(
                messages, names, self._buffer, client._fanout.target(shard), self._landed, client.stats)[0],
                watch=self._unless_cancelled)

        try:
            return client._fanout.call(shard, attempt, client.timeout)
        except (UnknownVariableError, LayoutChangedError):
            raise  # a shard that restarted empty (the refill guard recovers it) or that they left (sent again)
        except BaseException as exc:
            with self._cond:  # the layers waiting for this shard hear it now, not when every shard is done
                self.error = self.error or exc
                self._cond.notify_all()
            raise

    def _unless_cancelled(self, call) -> Iterator:
        with self._cond:
            if self._cancelled:
                call.cancel()
                raise _Cancelled()
            self._calls.append(call)
        try:
            for message in call:
                if self._cancelled:
                    raise _Cancelled()
                yield message
        finally:
            call.cancel()  # nothing if the call is over

    def _buffer(self, name: str, meta: ps_pb2.TensorMeta) -> np.ndarray:
        """Where a variable's bytes go: its parameter, or scratch memory if a retried stream sends it again."""
        if name in self._arrived:
            return np.empty(codec.meta_nbytes(meta), dtype=np.uint8)
        return self._sink(name, meta)

    def _landed(self, wire_name: str) -> None:
        if wire_name in self._arrived:
            return
        self._sink.complete(wire_name)  # a staged copy (CUDA, a cast pull) goes into the parameter now
        with self._cond:
            self._arrived.add(wire_name)
            self._missing[self._whole[wire_name]] -= 1
            self._cond.notify_all()

    def done(self, names) -> bool:
        """True if these parameters have arrived (no lock: a stale False only means a wait)."""
        return all(self._missing[name] == 0 for name in names)

    @property
    def ok(self) -> bool:
        """True once the pull is over without an error (no lock: a stale False only means a wait)."""
        return self.finished and self.error is None

    def wait_device(self, names=None) -> None:
        """Makes the calling thread's current CUDA stream wait for the device copies of `names` (default: every
        parameter) queued so far: call it once they arrived (wait_for), before compute that reads them. Never
        blocks the host; nothing to do for CPU parameters."""
        if names is None:
            self._sink.wait_device()
        else:
            self._sink.wait_device([piece for name in names for piece in self._pieces.get(name, ())])

    def wait_for(self, names, what: str) -> None:
        """Blocks until `names` arrived on the host (their device copies queued: see wait_device); raises the
        pull's error, or WaitTimeoutError after the client's timeout."""
        names = [name for name in names if name in self._missing]
        timeout = self.client.timeout
        with self._cond:
            arrived = self._cond.wait_for(lambda: self.error is not None or self.finished or self.done(names),
                                          timeout)
            if self.error is not None:
                raise self.error
            if not arrived:
                missing = [name for name in names if self._missing[name]]
                raise WaitTimeoutError(f"overlap: {what} waited {timeout:g} s for {missing[:5]} to arrive from the "
                                       f"shards")

    def wait(self) -> None:
        """Blocks until the whole pull is over on the host (see wait_device); raises its error, or
        WaitTimeoutError after the client's timeout."""
        timeout = self.client.timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self.finished or self.error is not None, timeout):
                missing = [name for name, left in self._missing.items() if left]
                raise WaitTimeoutError(f"overlap: the pull did not end within {timeout:g} s ({len(missing)} "
                                       f"parameters still to arrive, e.g. {missing[:3]})")
            if self.error is not None:
                raise self.error

    def cancel(self) -> None:
        """Stops the pull (a newer one replaces it): its calls are cancelled; what it wrote stays. Waits at most
        the client's timeout for its threads to stop writing."""
        with self._cond:
            self._cancelled = True
            for call in self._calls:
                call.cancel()
            self._cond.wait_for(lambda: self.finished, self.client.timeout)
