"""ModuleBinding: a torch.nn.Module's parameters bound to shard variables."""

from __future__ import annotations

import torch

from .deltas import PullBases
from .overlap import OVERLAP_INFLIGHT_BYTES, Overlap
from .tables import take_rows, tables_in

__all__ = ["ModuleBinding"]


class ModuleBinding:
    """Pulls into and pushes from one module's parameters. Made by PSClient.register_module.

    Variable names are prefix + the parameter's name in module.named_parameters();
    an Embedding or EmbeddingBag submodule's table is prefix + its path +
    ".weight" (`tables`). Not thread-safe (it shares the module with the
    training loop).

    With overlap (register_module(..., overlap=True)), communication runs
    beside compute: each gradient is streamed to its shards as backward
    produces it (last layer first, at most `inflight_bytes` per shard encoded
    ahead of the network), and pull() returns at once while the values
    stream in, in forward order, each submodule's forward waiting only for
    its own parameters. Sync, async and ssp semantics are unchanged. A step
    whose gradients change after backward (clipping, unscaling, set by hand),
    or are accumulated over several backwards, is pushed whole by push(), as
    without overlap. A parameter used outside its own module's forward (read
    by another module) is not waited for: call wait() first.

    With delta pulls (register_module(..., delta_pulls=True)), each pull asks
    only for what changed since the values the parameters hold
    (PSClient.pull_into's `bases`); a parameter written by anything else
    since its last pull (its in-place version counter moved: an optimizer
    step, load_state_dict, an in-place op) is pulled whole next time.
    Writes through `.data` are not seen: do not make them.
    """

    def __init__(self, client, module: torch.nn.Module, prefix: str = "", *, overlap: bool = False,
                 inflight_bytes: int = OVERLAP_INFLIGHT_BYTES, delta_pulls: bool = False):
        self.client = client
        self.module = module
        self.params = {prefix + name: p for name, p in module.named_parameters()}
        self.tables = tables_in(module, prefix)  # Embedding, EmbeddingBag: row gradients ride in each push
        self._overlap = Overlap(client, module, self.params, inflight_bytes) if overlap else None
        self._bases = PullBases() if delta_pulls else None
        self._pulled_versions: dict[str, int] = {}  # each parameter's _version after the last pull

    @property
    def overlap(self) -> bool:
        """True if this binding overlaps pushes with backward and pulls with forward."""
        return self._overlap is not None

    @property
    def step(self) -> int:
        """The step this worker computes at (kept by the client, shared by all its modules)."""
        return self.client.step

    @property
    def names(self) -> list[str]:
        return list(self.params)

    def cpu_values(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu() for name, p in self.params.items()}

    def _targets(self) -> dict[str, torch.Tensor]:
        return {name: p.data for name, p in self.params.items()}

    def _sync(self) -> bool:
        return self.client.mode is not None and self.client.mode.mode == "sync"

    def _delta_bases(self) -> PullBases | None:
        """The binding's PullBases, with every parameter written since its last pull forgotten; None without
        delta pulls."""
        if self._bases is not None:
            moved = [name for name, p in self.params.items() if self._pulled_versions.get(name) != p._version]
            self._bases.forget(self.client.partitions.wire_names(moved))
        return self._bases

    def _pulled(self) -> None:
        if self._bases is not None:
            self._pulled_versions = {name: p._version for name, p in self.params.items()}

    def pull(self) -> int:
        """Copies the current variables into the parameters in place; returns the step to compute at.

        In sync mode each shard first waits until it has applied the steps
        before the one this worker was released at. Without overlap it blocks
        until every shard has streamed its part; on error the parameters may
        be partly overwritten: pull again.

        With overlap it returns at once (the step as the last push left it; an
        async pull moves it on once it is over): the pull runs in the
        background, one stream per shard in forward order, and each
        submodule's forward waits (at most the client's timeout) until its own
        parameters have arrived. Its error (a shard gone, a deadline) is
        raised by the next forward that waits, wait(), or the next push; the
        parameters may then be partly overwritten: pull again (a pull still
        under way is cancelled first).
        """
        sync = self._sync()
        if self._overlap is not None:
            self._overlap.start_pull(self._targets(), min_step=self.step if sync else 0, set_step=not sync)
            return self.step
        step = self.client.pull_into(self._targets(), min_step=self.step if sync else 0, bases=self._delta_bases())
        self._pulled()
        if step >= 0 and not sync:
            self.client.step = step
        return self.step

    def wait(self) -> None:
        """Blocks until the pull under way (overlap) has written every parameter; at once without one.

        Raises the pull's error, or WaitTimeoutError after the client's
        timeout (the parameters may then be partly overwritten: pull again).
        """
        if self._overlap is not None:
            self._overlap.wait_pull()

    def exchange(self) -> int:
        """push() then pull(): the usual step of a training loop, after backward(). Returns the next step.

        Without overlap, one round trip per shard for small models
        (PSClient.push_pull). With overlap, push() ends the push streamed
        during backward and pull() starts the next values streaming, so the
        next forward overlaps them. Blocks as push() does; if the push raises,
        nothing is pulled.
        """
        if self._overlap is not None:
            self.push()
            self.pull()
            return self.step
        grads = {name: p.grad for name, p in self.params.items() if p.grad is not None}
        step = self.client.push_pull(grads, self._targets(), rows=take_rows(self.tables), bases=self._delta_bases())
        self._pulled()
        return step

    def push(self) -> int:
        """Pushes every parameter's .grad (parameters without one are skipped), and the row gradients
        of its embedding tables since the last push (taken by this push whatever its outcome), in one push;
        returns the next step.

        See PSClient.push: blocks until every shard has replied (in sync mode
        this is where the worker waits for the step's release); if it raises,
        shards that replied applied the gradients and the others did not, and
        a retry inside it (a lost connection, a refilled shard) keeps the
        push's number, so no shard applies it twice.

        With overlap, the gradients were streamed during backward: this closes
        each shard's stream with its tensor count and waits for the replies,
        with the same guarantees; a shard whose stream ends any other way (a
        shard killed, this process gone) applies none of it. A pull still
        under way is waited for first and its error raised.
        """
        grads = {name: p.grad for name, p in self.params.items() if p.grad is not None}
        if self._overlap is not None:
            self.client.dispatch_live_workers()  # what PSClient.push does first (on_live_workers_change)
            return self._overlap.push_step(grads)
        return self.client.push(grads, rows=take_rows(self.tables))
