"""Which address serves each replicated shard, as its arbiter records it: ps 0 for the others, ps 1 for ps 0.
No gRPC.

A shard with a backup (ps-server --replica-of) acknowledges a change only
once its backup wrote it too. When the two lose each other, one of them must
go on alone, and never both: the primary without its backup (DROP), or the
backup in the primary's place (PROMOTE). Both ask the shard's arbiter (ps 0,
or ps 1 for ps 0: `arbiter_of`), which grants the first
request whose view of the record is current and refuses the other
(ReplicaFencedError), so a primary cut off from its backup cannot acknowledge
a change the promoted backup never saw. The same rule as chain replication's
master: the members of a chain change only through one record.

    shard i: primary P, backup ""  --IN_SYNC(P, B)--> primary P, backup B
             primary P, backup B   --DROP(P, B)-----> primary P, backup ""
             primary P, backup B   --PROMOTE(P?, B)-> primary B, backup "", failovers + 1

A shard is in the record from its first change; one never named is served at
its cluster-spec address (`spec`). Every change is an event (a small JSON-able
dict) made by `apply`, live and when ps 0's journal is replayed; `export` and
`restore` carry the record in journal bases and checkpoints.

Thread-safe: its own lock (an "owner" in locks.LOCK_ORDER).
"""

from __future__ import annotations

import threading
import time
from typing import Mapping

from ..errors import InvalidArgumentError, ReplicaFencedError
from .layout import MAX_SHARDS
from .locks import guarded

__all__ = ["ReplicaRegistry", "ACTIONS"]

ACTIONS = ("in_sync", "drop", "promote")  # ps.proto's ReplicaChange.Action, in order
MAX_ADDRESS_CHARS = 1024



class ReplicaRegistry:
    """ps 0's record of every replicated shard (see the module docstring). `spec`: the job's shard addresses
    from its cluster spec (where a shard never in the record is served)."""

    def __init__(self, spec: list[str] | tuple[str, ...] = ()):
        self._spec = list(spec)
        self._lock = threading.Lock()
        self._shards: dict[int, dict] = {}  # index -> {"primary", "backup", "failovers", "last_failover"}

    @guarded
    def entry(self, index: int) -> dict:
        """Shard `index`'s record (its spec address and no backup if it has none)."""
        return dict(self._entry(index))

    @guarded
    def entries(self) -> list[tuple[int, dict]]:
        """(index, record) of every shard in the record, by index."""
        return [(index, dict(entry)) for index, entry in sorted(self._shards.items())]

    def _entry(self, index: int) -> dict:
        found = self._shards.get(index)
        if found is not None:
            return found
        primary = self._spec[index] if index < len(self._spec) else ""
        return {"primary": primary, "backup": "", "failovers": 0, "last_failover": 0.0}

    @guarded
    def decide(self, action: str, index: int, primary: str, backup: str) -> dict | None:
        """The event that makes `action` (ACTIONS) of shard `index`, None if the record says so already (a
        repeat). InvalidArgumentError for a malformed request; ReplicaFencedError when the record names
        another primary than `primary` (for PROMOTE, another backup than `backup`): the caller must stop
        serving shard `index`. Changes nothing: apply() the event."""
        if action not in ACTIONS:
            raise InvalidArgumentError(f"a replica change is one of {', '.join(ACTIONS)}. Received: {action!r}")
        if not 0 <= index < MAX_SHARDS:
            raise InvalidArgumentError(f"a replica change names a shard in [0, {MAX_SHARDS}). Received: {index}")
        needed = {"in_sync": ("primary", "backup"), "drop": ("primary",), "promote": ("backup",)}[action]
        for what, address in (("primary", primary), ("backup", backup)):
            if len(address) > MAX_ADDRESS_CHARS or (what in needed and not address):
                raise InvalidArgumentError(f"a replica change {action} of ps:{index} names its {what}'s address "
                                           f"(1 to {MAX_ADDRESS_CHARS} characters). Received: {address!r}")
        entry = self._entry(index)
        if action == "promote":
            if entry["primary"] == backup:
                return None  # granted already: a retry
            if entry["backup"] != backup:
                why = f"its backup in sync is {entry['backup']}" if entry["backup"] else "it has no backup in sync"
                raise ReplicaFencedError(f"ps:{index} is served by {entry['primary']} and {why}: {backup} may not "
                                         f"take it over (it holds no promise of every acknowledged change)")
            return {"action": action, "index": index, "primary": backup, "when": time.time()}
        if entry["primary"] != primary:
            raise ReplicaFencedError(f"ps:{index} is served by {entry['primary']} now (failover "
                                     f"{entry['failovers']}), not by {primary}: {primary} must stop serving it")
        if action == "in_sync":
            return None if entry["backup"] == backup else {"action": action, "index": index, "backup": backup}
        if not entry["backup"] or (backup and entry["backup"] != backup):
            return None  # dropped already, or another backup is in sync: nothing of this one to drop
        return {"action": action, "index": index}

    @guarded
    def apply(self, event: Mapping) -> None:
        """Makes one decide()d event's change (live and on replay)."""
        index = int(event["index"])
        entry = self._shards.setdefault(index, dict(self._entry(index)))
        if event["action"] == "in_sync":
            entry["backup"] = event["backup"]
        elif event["action"] == "drop":
            entry["backup"] = ""
        else:
            entry.update(primary=event["primary"], backup="", failovers=entry["failovers"] + 1,
                         last_failover=float(event["when"]))

    @guarded
    def export(self) -> dict:
        """The whole record, for a journal base or a checkpoint (restore() takes it)."""
        return {str(index): dict(entry) for index, entry in self._shards.items()}

    @guarded
    def restore(self, state: Mapping | None) -> None:
        """Takes export()'s record (None: empty)."""
        self._shards = {int(index): dict(entry) for index, entry in (state or {}).items()}
