"""ps 2's record of the primaries of ps 0 and ps 1 that were deposed: the tie-breaker between the two arbiters.
No gRPC.

ps 0 records who serves ps 1 and ps 1 who serves ps 0 (replicas.py). Cut a
network so that ps 1 and ps 0's backup are on one side and ps 0 and ps 1's
backup on the other, and each arbiter sees the other fall silent: each
would promote the other's backup, and each shard would have two primaries.
In a job of three shards or more, an arbiter about to promote its own
arbiter's backup first asks ps 2 to record that primary deposed (DEPOSE);
ps 2 grants the first such ask and refuses every later one from a primary
it records deposed, so only one side of a cut can promote. Nothing is
decided before ps 2 granted it and journaled the grant.

A deposed primary is named by its shard, its address and its failover
count (ShardReplicas.failovers when it was deposed); an asker by its shard
(the other arbiter) and its address. Each shard keeps one record, replaced
by every later deposal: every failover of ps 0 or ps 1 in such a job passes
here, so a record names the shard's last deposed primary, and a process
serving later at that same address (a Kubernetes pod moved back) is
deposed again, under a higher count, before it could be asked about.
REINSTATE takes a grant back when the promotion it was asked for was then
refused by the asker's own record (the primary dropped its backup first, or
renewed its lease): without it, that primary could never promote the other
arbiter's backup.

Each change is an event (a JSON-able dict) made by `apply`, live and when
ps 2's journal is replayed; `export` and `restore` carry the record in
journal bases and checkpoints. Thread-safe: its own lock (an "owner" in
locks.LOCK_ORDER).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Mapping

from ..errors import InvalidArgumentError, ReplicaFencedError
from .locks import guarded
from .replicas import MAX_ADDRESS_CHARS

__all__ = ["ACTIONS", "ARBITERS", "Deposals", "TIE_BREAKER", "Tiebreaker"]

ACTIONS = ("depose", "reinstate")  # ps.proto's ReplicaChange.Action DEPOSE and REINSTATE, in order
ARBITERS = (0, 1)  # the shards that arbitrate each other: the only ones deposed here
TIE_BREAKER = 2  # the shard that keeps this record, in a job of three shards or more
# How an arbiter asks the tie-breaker: (action, index, primary, failovers, timeout) -> its record of `index`
Tiebreaker = Callable[[str, int, str, int, "float | None"], dict]


class Deposals:
    """The tie-breaker's record: {shard: the primary deposed last} (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._deposed: dict[int, dict] = {}

    def decide(self, action: str, index: int, primary: str, failovers: int, asker: str) -> dict | None:
        """The event that makes `action` (ACTIONS) about shard `index`'s primary at `primary` after `failovers`
        failovers, asked by the other arbiter serving at `asker`; None if there is nothing to change (a
        repeated DEPOSE, or a REINSTATE of what is not recorded). InvalidArgumentError for a malformed request;
        ReplicaFencedError for a DEPOSE whose asker is recorded deposed at its address (the other side of a
        cut deposed it first: it must not promote, and its own backup takes it over), or of a shard recorded
        deposed after more failovers (an older view of it). Changes nothing: apply() the event."""
        return self._decide(action, index, primary, failovers, asker)

    @guarded
    def _decide(self, action: str, index: int, primary: str, failovers: int, asker: str) -> dict | None:
        if action not in ACTIONS:
            raise InvalidArgumentError(f"a tie-breaker's change is one of {', '.join(ACTIONS)}. Received: {action!r}")
        if index not in ARBITERS:
            raise InvalidArgumentError(f"the tie-breaker records the primaries of ps:0 and ps:1 only. Received: "
                                       f"ps:{index}")
        for what, address in (("deposed primary", primary), ("asker", asker)):
            if not address or len(address) > MAX_ADDRESS_CHARS:
                raise InvalidArgumentError(f"a tie-breaker's {action} names the {what}'s address (1 to "
                                           f"{MAX_ADDRESS_CHARS} characters). Received: {address[:80]!r}")
        other = 1 - index  # the asker: the arbiter of shard `index`
        event = {"action": action, "index": index, "primary": primary, "failovers": failovers, "asker": asker}
        found = self._deposed.get(index)
        if action == "reinstate":
            same = found is not None and all(found[key] == event[key] for key in ("primary", "failovers", "asker"))
            return event if same else None
        own = self._deposed.get(other)
        if own is not None and own["primary"] == asker:
            raise ReplicaFencedError(f"ps:{other} at {asker} was deposed by ps:{index} (at failover "
                                     f"{own['failovers']}): it may not promote ps:{index}'s backup (ps:{index} "
                                     f"promoted ps:{other}'s backup first: a network cut parts them)")
        if found is not None and found["failovers"] > failovers:
            raise ReplicaFencedError(f"ps:{index} was deposed after {found['failovers']} failovers already: a "
                                     f"deposal of it after {failovers} comes from an older record")
        if found is not None and found["primary"] == primary and found["failovers"] == failovers:
            return None  # granted already: a retry
        return {**event, "when": time.time()}

    def apply(self, event: Mapping) -> None:
        """Makes one decide()d event's change (live and on replay)."""
        self._apply(event)

    @guarded
    def _apply(self, event: Mapping) -> None:
        index = int(event["index"])
        if event["action"] == "reinstate":
            self._deposed.pop(index, None)
        else:
            self._deposed[index] = {key: event[key] for key in ("primary", "failovers", "asker", "when")}

    @guarded
    def deposed(self, index: int) -> dict:
        """The primary of shard `index` recorded deposed ({"primary": address, "failovers": count, ...}), or
        {"primary": "", "failovers": 0} if none."""
        return dict(self._deposed.get(index) or {"primary": "", "failovers": 0})

    @guarded
    def export(self) -> dict:
        """The whole record, for a journal base or a checkpoint (restore() takes it): {str(index): record}."""
        return {str(index): dict(entry) for index, entry in self._deposed.items()}

    @guarded
    def restore(self, state: Mapping | None) -> None:
        """Takes export()'s record (None: empty)."""
        self._deposed = {int(index): dict(entry) for index, entry in (state or {}).items()}
