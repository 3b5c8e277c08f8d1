"""ModuleBinding: a torch.nn.Module's parameters bound to shard variables."""

from __future__ import annotations

import torch

__all__ = ["ModuleBinding"]


class ModuleBinding:
    """Pulls into and pushes from one module's parameters. Made by PSClient.register_module.

    Variable names are prefix + the parameter's name in module.named_parameters().
    Not thread-safe (it shares the module with the training loop).
    """

    def __init__(self, client, module: torch.nn.Module, prefix: str = ""):
        self.client = client
        self.module = module
        self.params = {prefix + name: p for name, p in module.named_parameters()}

    @property
    def step(self) -> int:
        """The step this worker computes at (kept by the client, shared by all its modules)."""
        return self.client.step

    @property
    def names(self) -> list[str]:
        return list(self.params)

    def cpu_values(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu() for name, p in self.params.items()}

    def pull(self) -> int:
        """Copies the current variables into the parameters in place; returns the step to compute at.

        In sync mode each shard first waits until it has applied the steps
        before the one this worker was released at. Blocks until every shard
        has streamed its part. On error the parameters may be partly
        overwritten; pull again.
        """
        sync = self.client.mode is not None and self.client.mode.mode == "sync"
        step = self.client.pull_into({name: p.data for name, p in self.params.items()},
                                     min_step=self.step if sync else 0)
        if step >= 0 and not sync:
            self.client.step = step
        return self.step

    def exchange(self) -> int:
        """push() then pull(), in one round trip per shard for small models (PSClient.push_pull).

        The usual step of a training loop, after backward(). Returns the next step.
        """
        grads = {name: p.grad for name, p in self.params.items() if p.grad is not None}
        return self.client.push_pull(grads, {name: p.data for name, p in self.params.items()})

    def push(self) -> int:
        """Pushes every parameter's .grad (parameters without one are skipped); returns the next step.

        See PSClient.push: in sync mode this is where the worker waits for the step's release.
        """
        grads = {name: p.grad for name, p in self.params.items() if p.grad is not None}
        return self.client.push(grads)
