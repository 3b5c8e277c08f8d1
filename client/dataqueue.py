"""Dynamic sharding: take data shards from a queue on shard 0 instead of a fixed slice of the data.

    queue = DataQueue(ps, "train")
    if ps.is_chief:
        queue.create(len(y), shard_size=500, epochs=10, seed=0)   # idempotent: a restarted chief goes on
    else:
        queue.wait_created()
    for shard in queue.shards():                       # blocks for the next shard; ends when every epoch is done
        order = queue.order(shard.epoch)               # the epoch's permutation of example indices
        for begin, end in shard.batches(100):          # from where the shard stands
            with queue.pushing(shard, begin, end):     # this batch's push carries positions [begin, end)
                loss = loss_fn(model(x[order[begin:end]]), y[order[begin:end]])
                loss.backward()
                binding.exchange()

Shard 0 counts a batch's examples once its push is applied there (exactly
once: a retried push counts no more), and a shard when its last batch is.
If this process dies, or its lease runs out, or a new incarnation of its
task replaces it, the shard it held goes back to the queue from where it
stands, for another worker: every example of an epoch is counted once.
See ps.proto's "Data queues".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from ..errors import ClusterConfigError, DataShardError, UnknownDataQueueError, WaitTimeoutError
from ..proto import ps_pb2
from .datapath import GLOBAL_STEP_SHARD

if TYPE_CHECKING:
    from .client import PSClient

__all__ = ["DataQueue", "DataShard"]

_LOGGER = logging.getLogger(__name__)
WAIT_SLICE_SECONDS = 5.0  # longest single server-side wait; the client asks again until its own deadline


@dataclasses.dataclass
class DataShard:
    """A data shard this worker holds: positions [begin, end) of epoch `epoch`'s order, trained up to
    `progress` (shard 0's count, moved on by each push through DataQueue.pushing). `lost`: shard 0 refused
    a push for it (it went back to the queue, or stands elsewhere): take again."""

    queue: str
    lease: int
    epoch: int
    begin: int
    end: int
    progress: int
    lost: bool = False
    _pushes: int = dataclasses.field(default=0, repr=False)

    @property
    def size(self) -> int:
        return self.end - self.begin

    def batches(self, batch_size: int) -> Iterator[tuple[int, int]]:
        """(begin, end) positions of each batch from where the shard stands, until it is done or lost. A batch
        whose push was not counted (sync mode's stale drop) comes again. Train each inside
        DataQueue.pushing(); ClusterConfigError if one was not."""
        if batch_size < 1:
            raise ClusterConfigError(f"batch_size must be >= 1. Received: {batch_size}")
        while not self.lost and self.progress < self.end:
            pushes = self._pushes
            yield self.progress, min(self.progress + batch_size, self.end)
            if self._pushes == pushes:
                raise ClusterConfigError("each batch of DataShard.batches() is trained inside DataQueue.pushing(): "
                                         "its push carries the positions, and moves the shard on")


class DataQueue:
    """One data queue on shard 0 (see the module docstring), used by one PSClient's process.

    Calls go to shard 0 (retried there, as every call of the client is, up
    to its connect_timeout). Thread-safety: one training thread per queue.
    """

    def __init__(self, client: "PSClient", name: str = "train"):
        self.client = client
        self.name = name
        self.shards_taken = 0
        self.examples_pushed = 0  # positions this process's counted pushes carried
        self._order: tuple[int, torch.Tensor] | None = None
        self._spec: ps_pb2.DataQueueSpec | None = None

    def _call(self, method: str, request, timeout: float):
        return self.client.call(GLOBAL_STEP_SHARD, lambda stub, t: getattr(stub, method)(request, timeout=t),
                                timeout)

    # -- the chief ----------------------------------------------------------------------------

    def create(self, num_examples: int, shard_size: int, *, epochs: int = 1, seed: int = 0) -> bool:
        """Creates the queue on shard 0 (the chief's call); False if it exists with this spec (it is kept as it
        stands: a restarted chief goes on mid-epoch). `epochs` 0: no end. Blocks for one call (and its
        journal record). SpecConflictError if it exists with another spec; InvalidArgumentError for numbers
        out of range; nothing changes then."""
        spec = ps_pb2.DataQueueSpec(name=self.name, num_examples=num_examples, shard_size=shard_size, epochs=epochs,
                                    seed=seed)
        created = self._call("CreateDataQueue", spec, self.client.control_timeout).created
        self._spec = spec
        return created

    # -- every worker -------------------------------------------------------------------------

    def wait_created(self, timeout: float = 600.0) -> ps_pb2.DataQueueStatus:
        """Blocks until the chief created the queue; its status. WaitTimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            request = ps_pb2.DataQueueRequest(name=self.name, wait_seconds=max(0.0, min(WAIT_SLICE_SECONDS, left)))
            try:
                status = self._call("GetDataQueue", request, request.wait_seconds + self.client.control_timeout)
            except UnknownDataQueueError:
                if time.monotonic() >= deadline:
                    raise WaitTimeoutError(f"waited {timeout:g} s for data queue {self.name!r} on ps 0: is the chief "
                                           f"running and creating it?") from None
                continue
            self._spec = status.spec
            return status

    def status(self) -> ps_pb2.DataQueueStatus:
        """The queue's state on shard 0 (epochs, examples counted per epoch, shards held). One call; it never
        waits for training. UnknownDataQueueError if it does not exist."""
        status = self._call("GetDataQueue", ps_pb2.DataQueueRequest(name=self.name), self.client.control_timeout)
        self._spec = status.spec
        return status

    def order(self, epoch: int) -> torch.Tensor:
        """The example indices of epoch `epoch` in the order its positions name them: a permutation of
        range(num_examples) drawn from (the queue's seed, epoch), the same in every process."""
        if self._order is None or self._order[0] != epoch:
            spec = self._spec or self.status().spec
            permutation = np.random.default_rng([spec.seed, epoch]).permutation(spec.num_examples)
            self._order = (epoch, torch.from_numpy(permutation))
        return self._order[1]

    def take(self, timeout: float = 600.0) -> DataShard | None:
        """The shard this worker holds (where it stands), else the next one; None once every epoch is done.
        Blocks while every shard left is held by other workers (one may come back), up to `timeout` s
        (WaitTimeoutError). The client must have joined (join(), or register_module). If it raises, nothing
        was taken for this worker that a later take would not hand it again. DataShardError if shard 0 does
        not count this worker as live (it left, or its lease ran out: join again)."""
        client = self.client
        deadline = time.monotonic() + timeout
        while True:
            client.check_fenced()
            left = deadline - time.monotonic()
            request = ps_pb2.TakeDataShardRequest(queue=self.name, worker=client.worker,
                                                  incarnation=client.incarnation,
                                                  wait_seconds=max(0.0, min(WAIT_SLICE_SECONDS, left)))
            reply = self._call("TakeDataShard", request, request.wait_seconds + client.control_timeout)
            if reply.finished:
                return None
            if reply.HasField("shard"):
                s = reply.shard
                shard = DataShard(s.queue, s.lease, s.epoch, s.begin, s.end, s.progress)
                self.shards_taken += 1
                return shard
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(f"waited {timeout:g} s for a data shard of {self.name!r}: every shard left is "
                                       f"held by other workers")

    def shards(self, timeout: float = 600.0) -> Iterator[DataShard]:
        """take() again and again until every epoch is done (each wait up to `timeout` s). A shard that comes
        back lost, or not trained to its end, is asked for again: shard 0 answers where it stands."""
        while True:
            shard = self.take(timeout)
            if shard is None:
                return
            yield shard

    @contextlib.contextmanager
    def pushing(self, shard: DataShard, begin: int, end: int):
        """The client's pushes inside the block carry positions [begin, end) of `shard` (train the batch and
        exchange() in it; one push). Afterwards the shard stands at `end`, unless shard 0 dropped the push as
        stale (sync mode: the batch comes again). A DataShardError from the push (shard 0 applied nothing: the
        shard went back to the queue, or stands elsewhere) is not raised: the shard is marked lost, and the
        next take says where to go on; other shards may have applied their part of that push. Any other error
        is raised, and the shard stands where shard 0 counted it."""
        client = self.client
        shard._pushes += 1
        client.data_progress = ps_pb2.DataProgress(queue=shard.queue, lease=shard.lease, begin=begin, end=end)
        try:
            yield
        except DataShardError as exc:
            shard.lost = True
            _LOGGER.warning("%s: data shard %d of %r is no longer this worker's to train (%s); taking again",
                            client.worker, shard.lease, shard.queue, exc)
            return
        finally:
            client.data_progress = None
        reply = client.last_replies.get(GLOBAL_STEP_SHARD)
        if reply is not None and reply.stale:
            return
        shard.progress = max(shard.progress, end)
        self.examples_pushed += end - begin
