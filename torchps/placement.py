"""Which shard holds which variable: a pure, deterministic function of names in order.

Every process that sees the same names in the same order (and sizes, for
greedy) computes the same map, so no coordination is needed:
* "round_robin" (default): the i-th variable created goes to shard i mod P,
  as TensorFlow's replica_device_setter places Variable ops;
* "greedy": each variable goes to the shard with the fewest bytes so far
  (ties to the lowest index), as TensorFlow's GreedyLoadBalancingStrategy with
  byte_size_load_fn.
"""

from __future__ import annotations

from .errors import ClusterConfigError, UnknownVariableError

__all__ = ["Placement", "STRATEGIES"]

STRATEGIES = ("round_robin", "greedy")


class Placement:
    """An incremental name -> shard map. Not thread-safe; the client serializes `add`."""

    def __init__(self, num_shards: int, strategy: str = "round_robin"):
        if num_shards < 1:
            raise ClusterConfigError(f"placement needs at least one shard, got {num_shards}")
        if strategy not in STRATEGIES:
            raise ClusterConfigError(f"unknown placement strategy {strategy!r}; use one of {list(STRATEGIES)}")
        self.num_shards = num_shards
        self.strategy = strategy
        self._shard: dict[str, int] = {}
        self._nbytes: dict[str, int] = {}
        self._load = [0] * num_shards
        self._layout: dict[str, int] = {}  # the job's layout after a live resize (follow)

    def add(self, name: str, nbytes: int) -> int:
        """Places `name` (idempotent: a known name keeps its shard); returns the shard index."""
        if name in self._shard:
            return self._shard[name]
        if name in self._layout:
            shard = self._layout[name]
        elif self.strategy == "round_robin":
            shard = len(self._shard) % self.num_shards
        else:
            shard = min(range(self.num_shards), key=lambda i: (self._load[i], i))
        self._shard[name] = shard
        self._nbytes[name] = nbytes
        self._load[shard] += nbytes
        return shard

    def follow(self, num_shards: int, placement: dict[str, int]) -> None:
        """The job's layout after a live resize: `num_shards` shards, `placement` {name: shard} for every
        variable placed then (names placed here that it does not list keep their shard). Names it lists
        that are placed later go where it says, others as the strategy says over the new shards."""
        if num_shards < 1:
            raise ClusterConfigError(f"placement needs at least one shard, got {num_shards}")
        self.num_shards = num_shards
        self._layout = dict(placement)
        for name, shard in placement.items():
            if name in self._shard:
                self._shard[name] = shard
        self._load = [0] * num_shards
        for name, shard in self._shard.items():
            if shard < num_shards:
                self._load[shard] += self._nbytes[name]

    def shard_of(self, name: str) -> int:
        """The shard holding `name`; UnknownVariableError if it was never placed."""
        try:
            return self._shard[name]
        except KeyError:
            raise UnknownVariableError(
                f"variable {name!r} is not placed on any shard by this client; register it first "
                f"(register_module, create_variables or declare)") from None

    def __contains__(self, name: str) -> bool:
        return name in self._shard

    def names(self) -> list[str]:
        """Placed names, in placement order."""
        return list(self._shard)

    def group(self, names) -> dict[int, list[str]]:
        """{shard: [names on it, in the given order]}."""
        out: dict[int, list[str]] = {}
        for name in names:
            out.setdefault(self.shard_of(name), []).append(name)
        return out

    def nbytes(self) -> list[int]:
        """Bytes of each placed name, in placement order."""
        return [self._nbytes[n] for n in self._shard]

    def bytes_per_shard(self) -> list[int]:
        return list(self._load)

    def report(self, addresses: list[str] | None = None) -> str:
        """A human-readable table: variable -> shard, then bytes and variables per shard."""
        lines = [f"placement ({self.strategy}, {self.num_shards} shards):"]
        width = max((len(n) for n in self._shard), default=4)
        for name, shard in self._shard.items():
            lines.append(f"  {name:<{width}}  ps:{shard}  {self._nbytes[name]:>12,d} B")
        for shard in range(self.num_shards):
            count = sum(1 for s in self._shard.values() if s == shard)
            where = f" ({addresses[shard]})" if addresses else ""
            lines.append(f"  ps:{shard}{where}: {count} variables, {self._load[shard]:,d} B")
        return "\n".join(lines)
