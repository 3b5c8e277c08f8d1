"""A module bound for the hybrid: dense parameters averaged by an AllreduceGroup (allreduce.py) and stepped by
a local torch.optim optimizer, embedding tables on the shards (PSClient.register_module(..., dense="allreduce")).
"""

from __future__ import annotations

import concurrent.futures
from typing import Iterable

import torch

from ..errors import ClusterConfigError, OptimizerSpecError
from ..specs import Optimizer
from .allreduce import AllreduceGroup
from .tables import take_rows, tables_in

__all__ = ["HybridBinding", "local_optimizer"]

_LOCAL_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam,
                     "adamw": torch.optim.AdamW}


def local_optimizer(spec: Optimizer, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The torch.optim optimizer a torchps Optimizer names (sgd, adagrad, adam, adamw), over `params`, for
    the dense parameters of an all-reduce binding; OptimizerSpecError for another name or a value torch.optim
    refuses."""
    cls = _LOCAL_OPTIMIZERS.get(spec.name.lower())
    if cls is None:
        raise OptimizerSpecError(f"{spec.name!r} has no local version for the dense parameters; use one of "
                                 f"{sorted(_LOCAL_OPTIMIZERS)} or pass dense_optimizer=")
    try:
        return cls(list(params), **dict(spec.hyperparams))
    except (TypeError, ValueError) as exc:
        raise OptimizerSpecError(f"{spec.name}: {exc}") from None


class HybridBinding:
    """A module bound with register_module(..., dense="allreduce"): dense parameters all-reduced in a group,
    Embedding/EmbeddingBag tables on the shards.

    Same loop as ModuleBinding: backward, then exchange() (or push()). `step`
    counts the group's synchronous steps (every member the same); the
    shards' own step counter counts the table pushes. `optimizer` is the
    local torch.optim optimizer of the dense parameters (change its lr for
    schedules). Not thread-safe (it shares the module with the training loop).
    """

    overlap = False

    def __init__(self, client, module: torch.nn.Module, group: AllreduceGroup, optimizer: torch.optim.Optimizer,
                 prefix: str = ""):
        self.client = client
        self.module = module
        self.group = group
        self.optimizer = optimizer
        self.params = {prefix + name: p for name, p in module.named_parameters() if p.requires_grad}
        self.tables = tables_in(module, prefix)
        self.step = 0
        self._pusher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchps-rows") \
            if self.tables else None

    @property
    def names(self) -> list[str]:
        """The dense parameters' names (prefix + parameter name): all-reduced, never on the shards."""
        return list(self.params)

    def exchange(self) -> int:
        """One step after backward: pushes the tables' row gradients to the shards (in the background, async)
        while the dense gradients are averaged over the group (one all_reduce per bucket), then steps the
        local optimizer; returns the next step.

        Blocks until every member has made the same step's all-reduce (at most the group's timeout) and the
        shards replied to the push (at most the client's timeout). Raises AllreduceError (a member lost: the
        dense parameters are not stepped; stop) or the push's PSError (the dense step was taken; rows not
        applied where a shard did not reply, as PSClient.push says).
        """
        rows = take_rows(self.tables)
        pushed = self._pusher.submit(self.client.push, {}, rows=rows) if rows else None
        try:
            self.group.average_gradients_(self.params.values(), what=f"step {self.step + 1}'s all-reduce")
        except BaseException:
            if pushed is not None:
                concurrent.futures.wait([pushed])
            raise
        self.optimizer.step()
        self.step += 1
        if pushed is not None:
            pushed.result()
        return self.step

    def push(self) -> int:
        """exchange() (blocks and raises as it does): the dense parameters have nothing to pull, so a push is
        the whole step."""
        return self.exchange()

    def pull(self) -> int:
        """Nothing to pull (the dense parameters are local, tables are read at forward): returns the step at
        once, never blocks."""
        return self.step

    def wait(self) -> None:
        """Nothing under way between steps: returns at once."""

    def close(self) -> None:
        """Stops the background pusher, waiting for a push under way (none is between steps); the group is the
        caller's to close. Idempotent."""
        if self._pusher is not None:
            self._pusher.shutdown(wait=True)


def _register_allreduce(client, module: torch.nn.Module, optimizer: Optimizer | None, group: AllreduceGroup, *,
                       create: bool, prefix: str, wait_timeout: float, join: bool,
                       dense_optimizer: torch.optim.Optimizer | None) -> HybridBinding:
    """PSClient.register_module(..., dense="allreduce"): see there. Blocks: the chief creates the tables, then
    every member takes part in the broadcast of the chief's dense values (so the others wait for the chief
    there, at most the group's timeout), then waits for the tables (at most `wait_timeout`) and joins. A member
    lost before or during the broadcast makes it raise AllreduceError on the others; nothing is bound then."""
    if not isinstance(group, AllreduceGroup):
        raise ClusterConfigError(f"dense='allreduce' needs process_group=AllreduceGroup.connect(...). Received: "
                                 f"{group!r}")
    if client.task is not None and client.task != group.rendezvous.task:
        raise ClusterConfigError(f"the client is {client.task} but the all-reduce group was formed as "
                                 f"{group.rendezvous.task}")
    if dense_optimizer is None and optimizer is None:
        raise ClusterConfigError("dense='allreduce' steps the dense parameters locally: pass an Optimizer (or "
                                 "dense_optimizer=)")
    tables = tables_in(module, prefix)
    table_specs = [table.table_spec(name, optimizer) for name, table in tables.items()]
    dense = [p for p in module.parameters() if p.requires_grad]
    local = dense_optimizer if dense_optimizer is not None else local_optimizer(optimizer, dense)
    if tables and create:
        client.create_tables(table_specs)
    # Every member starts from the chief's values. The broadcast is also the barrier: the chief makes it once
    # it has configured the job and created the tables, and a chief that dies first fails it at once for the
    # others (rather than leaving them waiting for tables).
    group.broadcast_([*module.parameters(), *module.buffers()], 0, what="the broadcast of the chief's values")
    if tables:
        if not create:
            client.wait_for_tables(tables, wait_timeout)
        for name, table in tables.items():
            table.check_spec(client.table_layout(name).spec)
    if join:
        client.join()
        if client.mode is not None and client.mode.mode == "sync":
            raise ClusterConfigError("dense='allreduce' trains the tables async: the job is configured sync")
    client._bind_tables(tables)
    return HybridBinding(client, module, group, local, prefix)
