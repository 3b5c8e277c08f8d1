"""A shard that came back without its state (it ran without --checkpoint-dir): noticed, then refilled.

A client learns that a shard lost its variables when a call it makes fails
with UnknownVariableError for a name it placed there, and that shard answers
with another generation than the one the client saw before (a new process)
and without some of the client's names:
* the client that created them (the chief) refills the shard from its own
  copy: the mode it configured, then the variables with their current values
  (the shards' optimizer state for them starts afresh, which is logged);
* any other client waits up to `refill_timeout` for that, then raises
  ShardLostError naming the shard: one clear line instead of every worker
  dying of UnknownVariableError.
Either way the failed call is then made again (a push with the same number,
so shards that already applied it do not apply it twice).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, TypeVar

import torch

from ..errors import ShardLostError, UnknownVariableError, WaitTimeoutError
from ..placement import Placement
from ..proto import ps_pb2
from .fanout import ShardFanout

__all__ = ["ShardRefill"]

_LOGGER = logging.getLogger(__name__)
T = TypeVar("T")


class ShardRefill:
    """What a client needs to refill shards that restarted empty, and the retry around its calls.

    Calls the shards through `fanout`; `placement` says which shard holds each variable; `step()` is the
    step the client computes at (a refilled shard with no variables takes it as its own).
    """

    def __init__(self, fanout: ShardFanout, placement: Placement, timeout: float, *, step: Callable[[], int]):
        self._fanout = fanout
        self._placement = placement
        self._step = step
        self.timeout = timeout
        self.config: ps_pb2.SyncConfig | None = None  # the mode this client configured
        self._owned: dict[str, tuple[Callable[[], torch.Tensor], ps_pb2.OptimizerSpec]] = {}
        self._lock = threading.Lock()  # one recovery at a time per client
        self.refills = 0

    def own(self, name: str, value: Callable[[], torch.Tensor], optimizer: ps_pb2.OptimizerSpec) -> None:
        """Records that this client created `name`; value() gives its current value for a refill."""
        self._owned[name] = (value, optimizer)

    def guard(self, names: Iterable[str], call: Callable[[], T]) -> T:
        """call(), made again once if it failed because a shard holding `names` restarted empty."""
        names = list(names)
        try:
            return call()
        except UnknownVariableError:
            if not self._recover(names):
                raise
        return call()

    def _recover(self, names: list[str]) -> bool:
        """Refills or waits for every shard missing some of `names`; False if none is missing any."""
        with self._lock:
            lost = {shard: missing for shard, missing in
                    self._fanout.each(self._placement.group(names), self._missing).items() if missing}
            for shard, missing in lost.items():
                if all(name in self._owned for name in missing):
                    self._refill(shard)
                else:
                    self._wait(shard, missing)
        return bool(lost)

    def _missing(self, shard: int, names: list[str]) -> list[str]:
        """`names` a restarted `shard` lost ([] if it did not restart: never created ones stay unknown)."""
        fanout = self._fanout
        known = fanout.generations.get(shard)
        request = ps_pb2.ListRequest(names=names)
        reply = fanout.call(shard, lambda stub, t: stub.ListVariables(request, timeout=t), fanout.control_timeout)
        if known is None or reply.generation == known:
            return []
        fanout.note_generation(shard, reply.generation)
        present = {info.spec.name for info in reply.variables}
        return [name for name in names if name not in present]

    def _refill(self, shard: int) -> None:
        fanout, placement = self._fanout, self._placement
        names = [n for n in placement.names() if placement.shard_of(n) == shard and n in self._owned]
        if self.config is not None:
            fanout.call(shard, lambda stub, t: stub.Configure(self.config, timeout=t), fanout.control_timeout)
        by_optimizer: dict[bytes, list[str]] = {}
        for name in names:
            by_optimizer.setdefault(self._owned[name][1].SerializeToString(deterministic=True), []).append(name)
        for key, group in by_optimizer.items():
            spec = ps_pb2.OptimizerSpec.FromString(key)
            fanout.create_on(shard, {name: self._owned[name][0]() for name in group}, spec, job_step=self._step())
        self.refills += 1
        _LOGGER.warning("%s restarted without its state: refilled its %d variables from this client's copy (their "
                        "optimizer state starts afresh)", fanout.target(shard), len(names))

    def _wait(self, shard: int, missing: list[str]) -> None:
        target = self._fanout.target(shard)
        _LOGGER.warning("%s restarted without its state; waiting up to %g s for the chief to refill it",
                        target, self.timeout)
        try:
            self._fanout.wait_listed(self._placement.group(missing), "ListVariables", self.timeout)
        except WaitTimeoutError:
            raise ShardLostError(
                f"{target} restarted without its variables (no --checkpoint-dir) and the chief did not refill it "
                f"within {self.timeout:g} s; restart the job from a checkpoint") from None
