"""Checkpoints from the client's side: every shard saves (phase 1), then shard 0 commits (phase 2).

A checkpoint counts only once committed: shard 0 writes its manifest after
checking every shard's file, so a shard killed mid-save, or a save that failed
anywhere, leaves the previous committed checkpoint the newest one, and that is
what every restore takes.
"""

from __future__ import annotations

import json
import logging

from ..errors import StepPassedError
from ..partitioning import Partitions
from ..placement import Placement
from ..proto import ps_pb2
from .datapath import GLOBAL_STEP_SHARD
from .fanout import ShardFanout

__all__ = ["save"]

_LOGGER = logging.getLogger(__name__)
ATTEMPTS = 5  # a sync shard may pass the step asked for before the save reaches it: ask again, later


def save(fanout: ShardFanout, placement: Placement, partitions: Partitions, step: int | None, *, keep: int,
         timeout: float, layout_epoch: int = 0, full: bool = False) -> int:
    """PSClient.save_checkpoint (see there) of the variables `placement` and `partitions` lay out; returns the
    committed checkpoint's step. After a live resize (`layout_epoch` > 0) the manifest records the layout."""
    names = placement.names()
    manifest = json.dumps({"strategy": placement.strategy, "num_ps": fanout.num_shards,
                           "variables": [[n, b] for n, b in zip(names, placement.nbytes())],
                           "partitions": partitions.manifest(),
                           **({"layout": {"epoch": layout_epoch, "placement": {n: placement.shard_of(n) for n in names}}}
                              if layout_epoch else {})})
    shards = fanout.all_shards()
    now = step == 0
    for _ in range(ATTEMPTS):
        steps = fanout.every(lambda stub, t: stub.GetStatus(ps_pb2.StatusRequest(), timeout=t))
        # numbered by the global step (ps 0's count): a shard that a later resize removes may count ahead
        target = steps[GLOBAL_STEP_SHARD].step if now else step or steps[GLOBAL_STEP_SHARD].step + 1
        request = ps_pb2.SaveRequest(step=target, now=now, full=full)
        try:
            replies = fanout.each(shards, lambda shard, _: fanout.call(
                shard, lambda stub, t: stub.Save(request, timeout=t), timeout))
        except StepPassedError:
            if step is not None:
                raise
            continue
        if replies[GLOBAL_STEP_SHARD].step < target:
            # the shards saved before the step came: every worker had left, so nothing would make it. Their
            # files stay uncommitted (pruned by the next commit); the state now is saved under its own step.
            _LOGGER.info("the job went idle at step %d before checkpoint %d's step: saving the state now",
                         replies[GLOBAL_STEP_SHARD].step, target)
            now = True
            continue
        commit = ps_pb2.CommitRequest(step=target, manifest_json=manifest, keep=keep,
                                      shards=[replies[s] for s in sorted(replies)])
        fanout.call(0, lambda stub, t: stub.CommitCheckpoint(commit, timeout=t), timeout)
        return target
    raise StepPassedError(f"the shards went past the checkpoint step asked for {ATTEMPTS} times in a row; "
                          f"no checkpoint was taken this time")
