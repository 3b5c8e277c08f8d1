"""The shard's replication RPCs, a part of its servicer (servicer.ParameterServerServicer mixes it in): a
backup's Replicate stream and ps 0's SetReplica; and the arbiter a shard asks ps 0 through. Each body is
blocking code on the shard's pool (edge.py); the feeds are replication.Replication's, ps 0's record
replicas.ReplicaRegistry's (through Coordinator.set_replica). The mixin reads the servicer's coordinator and
`replication`.
"""

from __future__ import annotations

import threading

import grpc

from ..cluster import arbiter_of
from ..errors import MalformedStreamError, ServerUnavailableError
from ..proto import ps_pb2
from ..security import Security
from .auth import aborting
from .coordinator import Coordinator
from .replicas import ACTIONS
from .replication import Arbiter
from .rpc_support import map_errors

__all__ = ["ReplicaRPCs", "RoleFence", "arbiter_for", "replicas_of", "WIRE_ACTIONS"]

ARBITER_TIMEOUT_SECONDS = 5.0  # one ask of ps 0 (replication.Replication asks again while it cannot reach it)
WIRE_ACTIONS = (*ACTIONS, "lease")  # ReplicaChange.Action, in order


def replicas_of(index: int, entry: dict) -> ps_pb2.ShardReplicas:
    """ReplicaRegistry's record of shard `index` as its message."""
    return ps_pb2.ShardReplicas(index=index, primary=entry["primary"], backup=entry["backup"],
                                failovers=entry["failovers"], last_failover_unix=entry["last_failover"])


class RoleFence(grpc.aio.ServerInterceptor):
    """Until open(), refuses every call but GetStatus and GetLayout with UNAVAILABLE (retried by clients): a
    restarted shard that had a backup serves nothing until its arbiter confirmed it still serves its shard,
    yet answers the layout meanwhile, which is how ps 0 and ps 1, each the other's arbiter, confirm each
    other when a whole job starts again."""

    OPEN_METHODS = frozenset({"GetStatus", "GetLayout"})

    def __init__(self, why: str):
        self._why: str | None = why
        self._open_methods = self.OPEN_METHODS

    def confirmed(self) -> None:
        """The arbiter confirmed this shard: its own record of the shards it arbitrates is the job's, so it
        answers SetReplica too (ps 0 and ps 1 then drop each other's stale backups) before it opens."""
        self._open_methods = self.OPEN_METHODS | {"SetReplica"}

    def open(self) -> None:
        self._why = None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        why = self._why
        if why is None or handler is None or handler_call_details.method.rpartition("/")[2] in self._open_methods \
                or handler_call_details.method.startswith("/grpc.health."):
            return handler
        return aborting(handler, grpc.StatusCode.UNAVAILABLE, ServerUnavailableError.__name__, why)


class ReplicaRPCs:
    """Replication RPCs of ParameterServerServicer."""

    @map_errors
    def Replicate(self, request_iterator, context):
        acks = iter(request_iterator)
        try:
            hello = ps_pb2.ReplicaAck.FromString(next(acks)).hello
        except StopIteration:
            raise MalformedStreamError("a Replicate stream begins with the backup's hello: it sent nothing") from None
        feed = self.replication.open(hello, self._claim_lane(hello.lane, context))  # the call's end closes it
        context.add_callback(lambda: feed.lose("its stream ended"))
        threading.Thread(target=self.replication.read_acks, args=(feed, acks), name="replica-acks",
                         daemon=True).start()
        yield from feed.frames(self.replication.layout())

    @map_errors
    def SetReplica(self, request, context):
        entry = self.coordinator.set_replica(WIRE_ACTIONS[request.action] if request.action < len(WIRE_ACTIONS)
                                             else str(request.action), request.index, request.primary,
                                             request.backup, timeout=context.time_remaining())
        return replicas_of(request.index, entry)


def arbiter_for(coordinator: Coordinator, index: int, addresses: tuple[str, ...], security: Security
                ) -> Arbiter | None:
    """How shard `index` asks its arbiter (cluster.arbiter_of) for a change of its record: through its own
    coordinator where it is its own arbiter (a one-shard job's ps 0, or a standalone ps 0), else by a SetReplica
    call with its own credentials to the arbiter of the job's cluster spec `addresses`, followed to wherever it is
    served after its own failover, or where this shard's own record of it says (ps 0 and ps 1 arbitrate each
    other; attempts of `timeout` s, retried for as long: ARBITER_TIMEOUT_SECONDS by default; PSErrors as the
    client edge maps them). `action` is one of WIRE_ACTIONS. None for a shard started without the cluster spec,
    other than ps 0: it cannot reach an arbiter."""
    arbiter = arbiter_of(index, len(addresses))
    if arbiter == index:
        return lambda action, shard, primary, backup, timeout=ARBITER_TIMEOUT_SECONDS: coordinator.set_replica(
            action, shard, primary, backup, timeout)
    if not addresses:
        return None
    channels = []  # made at the first ask: a shard that never has a backup never calls its arbiter

    def ask(action: str, shard: int, primary: str, backup: str, timeout: float = ARBITER_TIMEOUT_SECONDS) -> dict:
        if not channels:
            from ..client.channels import ShardChannels  # a shard's calls to its arbiter are a client's

            channels.append(ShardChannels(list(addresses[:2]), connect_timeout=ARBITER_TIMEOUT_SECONDS,
                                          security=security))
            channels[0].follows_failovers = True
        if coordinator.replicas is not None:  # ps 0 and ps 1 record each other: the arbiter is where this one's
            served = coordinator.replicas.entry(arbiter)["primary"]  # record says (ps 0 moved, the spec's address
            if served:                                               # of ps 0 cannot say where ps 1 went)
                channels[0].redirect(arbiter, served)
        request = ps_pb2.ReplicaChange(action=WIRE_ACTIONS.index(action), index=shard, primary=primary,
                                       backup=backup)
        reply = channels[0].call(arbiter, lambda stub, t: stub.SetReplica(request, timeout=t), timeout,
                                 retry_for=timeout)
        return {"primary": reply.primary, "backup": reply.backup, "failovers": reply.failovers,
                "last_failover": reply.last_failover_unix}
    return ask
