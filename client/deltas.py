"""Delta pulls, the client's side: which version of each variable an in-place pull's targets hold.

A shard sends a variable as the elements changed since a version the client
names (PullRequest.base_versions, ps.proto's DELTA), and the client writes
them over its copy; that is exact only if the copy still holds that version.
PullBases remembers, per wire variable name, the shard generation and
version its target was last written with by a pull, and that target's
memory. It forgets a name before each pull of it (a pull that fails midway
leaves it unknown, and the next pull is whole) and learns the new versions
once the pull has written them. Only contiguous CPU targets take deltas
(others are always pulled whole), and only pulls may write them: whoever
writes a target otherwise calls `forget` (ModuleBinding does, when a
parameter's in-place version counter moved).
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

import torch

__all__ = ["PullBases"]


def _identity(target: torch.Tensor) -> tuple:
    return target.data_ptr(), target.dtype, tuple(target.shape)


class PullBases:
    """Per wire name, the (generation, version) a pull last wrote into which target. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, int, tuple]] = {}  # name -> (generation, version, target identity)

    @staticmethod
    def accepts(target: torch.Tensor) -> bool:
        """True if a delta can be written over `target` in place: a contiguous CPU tensor."""
        return target.device.type == "cpu" and target.is_contiguous()

    def take(self, names: list[str], targets: Mapping[str, torch.Tensor]) -> tuple[int, list[int]]:
        """(base generation, base version per name; 0 where none) for a pull of `names` (one shard's) into
        `targets`, and forgets them until `learn`: a pull that fails midway leaves them unknown."""
        with self._lock:
            held = [self._held.pop(name, None) for name in names]
        generation = next((h[0] for h in held if h is not None), 0)
        versions = [h[1] if h is not None and h[0] == generation and self.accepts(targets[name])
                    and h[2] == _identity(targets[name]) else 0 for name, h in zip(names, held)]
        return generation, versions

    def learn(self, generation: int, versions: Mapping[str, int], targets: Mapping[str, torch.Tensor]) -> None:
        """Notes that a pull from a shard of `generation` wrote `versions` ({name: version}) into `targets`."""
        with self._lock:
            for name, version in versions.items():
                if version and generation and self.accepts(targets[name]):
                    self._held[name] = (generation, version, _identity(targets[name]))

    def forget(self, names: Iterable[str]) -> None:
        """The next pull of `names` is whole (their targets were written by something else than a pull)."""
        with self._lock:
            for name in names:
                self._held.pop(name, None)
