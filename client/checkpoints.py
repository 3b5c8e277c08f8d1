"""Checkpoints from the client's side: every shard saves (phase 1), then shard 0 commits (phase 2).

A checkpoint counts only once committed: shard 0 writes its manifest after
checking every shard's file, so a shard killed mid-save, or a save that failed
anywhere, leaves the previous committed checkpoint the newest one, and that is
what every restore takes.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ..errors import StepPassedError
from ..proto import ps_pb2

if TYPE_CHECKING:
    from .client import PSClient

__all__ = ["save"]

_LOGGER = logging.getLogger(__name__)
ATTEMPTS = 5  # a sync shard may pass the step asked for before the save reaches it: ask again, later


def save(client: "PSClient", step: int | None, *, keep: int, timeout: float) -> int:
    """PSClient.save_checkpoint (see there); returns the committed checkpoint's step."""
    placement = client.placement
    manifest = json.dumps({"strategy": placement.strategy, "num_ps": client.cluster.num_ps,
                           "variables": [[n, b] for n, b in zip(placement.names(), placement.nbytes())],
                           "partitions": client.partitions.manifest()})
    shards = {s: [] for s in range(client.cluster.num_ps)}
    for _ in range(ATTEMPTS):
        steps = client._each_shard(shards, lambda shard, _: client.status(shard).step)
        target = step if step else max(steps.values()) + (1 if step is None else 0)
        request = ps_pb2.SaveRequest(step=target, now=step == 0)
        try:
            replies = client._each_shard(shards, lambda shard, _: client._channels.call(
                shard, lambda stub, t: stub.Save(request, timeout=t), timeout))
        except StepPassedError:
            if step is not None:
                raise
            continue
        commit = ps_pb2.CommitRequest(step=target, manifest_json=manifest, keep=keep,
                                      shards=[replies[s] for s in sorted(replies)])
        client._channels.call(0, lambda stub, t: stub.CommitCheckpoint(commit, timeout=t), timeout)
        return target
    raise StepPassedError(f"the shards went past the checkpoint step asked for {ATTEMPTS} times in a row; "
                          f"no checkpoint was taken this time")
