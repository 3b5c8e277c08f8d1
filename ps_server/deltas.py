"""What changed in a variable since an earlier version: the record behind delta pulls. No gRPC here.

A client that pulls a variable in place can name the version it holds
(PullRequest.base_versions); the shard then sends only the elements changed
since, if it knows them. It knows them from a ChangeLog, which a variable
gets the first time someone asks for a delta of it (that pull is whole):
after each update the store records the flat indices the update may have
changed. An optimizer that leaves an element whose gradient is +0.0
untouched, bit for bit (`keeps_zeros`: sgd without momentum, weight decay or
maximize; adagrad without weight decay or maximize, with eps > 0), changes
at most the gradient's nonzero elements (any bit set, so -0.0 counts);
every other update is recorded as "every element". A delta since version v
is the union of what the updates after v changed; it is unknown (a whole
pull) when v is older than what the log keeps, or when an update since then
changed every element: momentum and Adam do, every step.

The log keeps at most an eighth of the variable's elements in indices over
all the versions it holds (int32 for fewer than 2^31 elements: an eighth of
a float32 variable's bytes), dropping the oldest versions first; beyond that
a delta would cost about as much as the whole.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..compression import SUPPORT_ATTRIBUTE, index_dtype

__all__ = ["ChangeLog", "keeps_zeros", "changed_elements", "delta_pays", "MAX_LOG_FRACTION"]

MAX_LOG_FRACTION = 8  # the log keeps at most numel // MAX_LOG_FRACTION indices over all its versions
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def keeps_zeros(optimizer: str, hyperparams: Mapping[str, float]) -> bool:
    """True if a step of `optimizer` with these (current) hyperparameters leaves every element whose gradient
    is +0.0 exactly as it was (its optimizer state included)."""
    if optimizer == "sgd":
        return not (hyperparams.get("momentum") or hyperparams.get("weight_decay") or hyperparams.get("maximize"))
    if optimizer == "adagrad":
        return not (hyperparams.get("weight_decay") or hyperparams.get("maximize")) and hyperparams.get("eps", 0) > 0
    return False


def changed_elements(grad: torch.Tensor, limit: int) -> torch.Tensor | None:
    """The sorted flat indices (int64) of `grad`'s elements with any bit set, or None if there are more than
    `limit`. A gradient decoded from a SPARSE push (compression.decode) brings its indices along."""
    support = getattr(grad, SUPPORT_ATTRIBUTE, None)
    if support is not None:
        return support if support.numel() <= limit else None
    bits = grad.detach().reshape(-1).view(_BITS[grad.element_size()])
    if int(bits.count_nonzero()) > limit:
        return None
    return torch.nonzero(bits).view(-1)


class ChangeLog:
    """One variable's record of what each update since `floor` changed. Not thread-safe: the variable's lock
    guards it (store.py)."""

    def __init__(self, version: int, numel: int):
        self.floor = version  # versions from here on are known
        self.numel = numel
        self.limit = numel // MAX_LOG_FRACTION
        self._dtype = index_dtype(numel)
        self._entries: list[tuple[int, torch.Tensor | None]] = []  # (version, indices changed by its update)
        self._kept = 0

    def record(self, version: int, changed: torch.Tensor | None) -> None:
        """Notes that the update to `version` changed `changed` (flat indices) or, None, every element."""
        if changed is None:  # nothing before this version can be sent as a delta any more
            self._entries, self._kept, self.floor = [], 0, version
            return
        changed = changed.to(self._dtype)
        self._entries.append((version, changed))
        self._kept += changed.numel()
        while self._kept > self.limit:
            old_version, dropped = self._entries.pop(0)
            self._kept -= dropped.numel()
            self.floor = old_version

    def since(self, base: int, version: int) -> torch.Tensor | None:
        """The sorted flat indices (index_dtype) changed from `base` to `version` (the variable's current
        version), or None if the log does not know them."""
        if not self.floor <= base <= version:
            return None
        parts = [changed for at, changed in self._entries if at > base]
        if not parts:
            return torch.empty(0, dtype=self._dtype)
        if len(parts) == 1:
            return parts[0]
        return torch.unique(torch.cat(parts))

    @property
    def nbytes(self) -> int:
        """Bytes of indices kept."""
        return self._kept * self._dtype.itemsize


def delta_pays(count: int, numel: int, itemsize: int) -> bool:
    """True if `count` changed elements of `itemsize` bytes travel in fewer bytes as a DELTA than whole."""
    return count * (index_dtype(numel).itemsize + itemsize) < numel * itemsize
