"""ps 2's record of the primaries of ps 0 and ps 1 that were deposed: the tie-breaker between the two arbiters.
No gRPC.

ps 0 records who serves ps 1 and ps 1 who serves ps 0 (replicas.py). Cut a
network so that ps 1 and ps 0's backup are on one side and ps 0 and ps 1's
backup on the other, and each arbiter sees the other fall silent: each
would promote the other's backup, and each shard would have two primaries.
In a job of three shards or more, an arbiter about to promote its own
arbiter's backup first asks ps 2 to record that primary deposed and the
backup put in its place (DEPOSE). From then on ps 2 refuses a DEPOSE from
any process of that shard but the one it put in place, so only one side of
a cut can promote, and a primary deposed twice while the cut lasts is still
refused. Nothing is decided before ps 2 granted it and journaled the grant.

Each shard keeps one record, its last deposal (the deposed primary's address
and failover count, the successor's address, the asker's, and the ask's
name, `grant`), with the deposal it replaced, if any. REINSTATE takes back
the DEPOSE it names, if that is still the record, when the asker did not
make the promotion (its own record refused it: the primary dropped its
backup first, or renewed its lease; or the asker could not tell whether
ps 2 granted it): the deposal before it comes back, so that primary can
again promote the other arbiter's backup. A grant named afresh at every ask
(a repeat too) means a late REINSTATE of an earlier ask never takes back a
later grant; and the names of the last asks taken back are kept, so a
DEPOSE that reaches ps 2 after its own REINSTATE is refused.

Each change is an event (a JSON-able dict) made by `apply`, live and when
ps 2's journal is replayed; `export` and `restore` carry the record in
journal bases. Thread-safe: its own lock (an "owner" in locks.LOCK_ORDER).
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
# How an arbiter asks the tie-breaker: (action, index, primary, failovers, successor, grant, timeout) -> its
# record of `index` (Deposals.deposed)
Tiebreaker = Callable[[str, int, str, int, str, str, "float | None"], dict]
_DEPOSAL = ("primary", "failovers", "successor", "asker")  # what names one deposal, whatever its asks' names
MAX_GRANT_CHARS = 64  # an ask's name
TAKEN_BACK_KEPT = 16  # the names of a shard's last asks taken back, kept


class Deposals:
    """The tie-breaker's record: {shard: its last deposal} (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._deposed: dict[int, dict] = {}
        self._taken_back: dict[int, list[str]] = {}  # shard -> the names of its last asks taken back

    def decide(self, action: str, index: int, grant: str, primary: str = "", failovers: int = 0,
               successor: str = "", asker: str = "") -> dict | None:
        """The event that makes `action` (ACTIONS) about shard `index`: DEPOSE of its primary at `primary` after
        `failovers` failovers, `successor` to serve in its place, asked by the other arbiter serving at
        `asker` under the name `grant`; REINSTATE of the DEPOSE named `grant`. None if there is nothing to
        change (a DEPOSE repeated under the same name, a REINSTATE repeated). A REINSTATE is an event even
        where its DEPOSE is not the record (it keeps the name: that DEPOSE, come late, is refused). Raises
        InvalidArgumentError for a malformed request; ReplicaFencedError for a DEPOSE whose asker is not the
        process the last deposal of its own shard put in place (the other side of a cut promoted first: it
        must not promote), of a shard recorded deposed after more failovers (an older view of it), or named
        as an ask taken back. Changes nothing: apply() the event."""
        return self._decide(action, index, grant, primary, failovers, successor, asker)

    @guarded
    def _decide(self, action: str, index: int, grant: str, primary: str, failovers: int, successor: str,
                asker: str) -> dict | None:
        if action not in ACTIONS:
            raise InvalidArgumentError(f"a tie-breaker's change is one of {', '.join(ACTIONS)}. Received: {action!r}")
        if index not in ARBITERS:
            raise InvalidArgumentError(f"the tie-breaker records the primaries of ps:0 and ps:1 only. Received: "
                                       f"ps:{index}")
        if not grant or len(grant) > MAX_GRANT_CHARS:
            raise InvalidArgumentError(f"a tie-breaker's {action} names its ask (1 to {MAX_GRANT_CHARS} "
                                       f"characters). Received: {len(grant)}")
        found = self._deposed.get(index)
        taken_back = grant in self._taken_back.get(index, ())
        if action == "reinstate":
            return None if taken_back else {"action": action, "index": index, "grant": grant}
        if taken_back:
            raise ReplicaFencedError(f"the ask {grant} to depose ps:{index}'s primary was taken back already: it "
                                     f"reached ps {TIE_BREAKER} late, and nothing was decided")
        for what, address in (("deposed primary", primary), ("successor", successor), ("asker", asker)):
            if not address or len(address) > MAX_ADDRESS_CHARS:
                raise InvalidArgumentError(f"a tie-breaker's {action} names the {what}'s address (1 to "
                                           f"{MAX_ADDRESS_CHARS} characters). Received: {address[:80]!r}")
        other = 1 - index  # the asker's shard: the arbiter of shard `index`
        own = self._deposed.get(other)
        if own is not None and own["successor"] != asker:
            raise ReplicaFencedError(f"ps:{other} at {asker} may not promote ps:{index}'s backup: ps:{index} "
                                     f"deposed ps:{other}'s primary {own['primary']} (at failover "
                                     f"{own['failovers']}) and put {own['successor']} in its place (a network "
                                     f"cut parts ps:0 from ps:1)")
        if found is not None and found["failovers"] > failovers:
            raise ReplicaFencedError(f"ps:{index} was deposed after {found['failovers']} failovers already: a "
                                     f"deposal of it after {failovers} comes from an older record")
        event = {"action": action, "index": index, "primary": primary, "failovers": failovers,
                 "successor": successor, "asker": asker, "grant": grant}
        same = found is not None and all(found[key] == event[key] for key in _DEPOSAL)
        if same and found["grant"] == grant:
            return None  # a retry of the same ask
        # (a repeat under a new name keeps what the first ask replaced)
        before = found["before"] if same else ({key: value for key, value in found.items() if key != "before"}
                                              if found is not None else None)
        return {**event, "before": before, "when": time.time()}

    def apply(self, event: Mapping) -> None:
        """Makes one decide()d event's change (live and on replay)."""
        self._apply(event)

    @guarded
    def _apply(self, event: Mapping) -> None:
        index = int(event["index"])
        if event["action"] == "depose":
            self._deposed[index] = {key: value for key, value in event.items() if key not in ("action", "index")}
            return
        self._taken_back[index] = [*self._taken_back.get(index, ()), event["grant"]][-TAKEN_BACK_KEPT:]
        found = self._deposed.get(index)
        if found is None or found["grant"] != event["grant"]:
            return  # not the record: its DEPOSE was decided no more, or has not come yet
        del self._deposed[index]
        if found["before"] is not None:
            self._deposed[index] = {**found["before"], "before": None}

    @guarded
    def deposed(self, index: int) -> dict:
        """Shard `index`'s last deposal ({"primary", "failovers", "successor", ...}), or {"primary": "",
        "failovers": 0, "successor": ""} if none."""
        found = self._deposed.get(index)
        return dict(found) if found else {"primary": "", "failovers": 0, "successor": ""}

    @guarded
    def export(self) -> dict:
        """The whole record, for a journal base (restore() takes it): {"deposed": {str(index): record},
        "taken_back": {str(index): names}}."""
        return {"deposed": {str(index): dict(entry) for index, entry in self._deposed.items()},
                "taken_back": {str(index): list(names) for index, names in self._taken_back.items()}}

    @guarded
    def restore(self, state: Mapping | None) -> None:
        """Takes export()'s record (None: empty)."""
        state = state or {}
        self._deposed = {int(index): dict(entry) for index, entry in state.get("deposed", {}).items()}
        self._taken_back = {int(index): list(names) for index, names in state.get("taken_back", {}).items()}
