"""One push per host: a task's processes on one host (one per GPU) reduce their gradients locally, local rank 0
pushes and pulls for the host, then broadcasts the values (ps-worker --nproc-per-host K).

    group = AllreduceGroup.connect_local(task, local_rank, nproc, port)     # every process of the host
    if local_rank == 0:
        binding = HostBinding(ps.register_module(model, Optimizer("sgd", lr=0.1)), group)
    else:
        binding = LocalReplica(model, group)
    for x, y in batches:                        # each process its own part of the host's batch
        model.zero_grad(); F.cross_entropy(model(x), y).backward()
        if not binding.exchange():              # LocalReplica: False once local rank 0 ended the host's training
            break
    binding.close()                             # local rank 0: tells the others to stop

The shards see one worker per host: local rank 0's client, pushing the mean
of the K processes' gradients and pulling the values once for all of them,
so the wire carries one worker's bytes per host step (TensorFlow's and
BytePS's local reduce). With a mean loss and equal batches the mean of the K
gradients is the gradient of the host's K x batch, so in sync mode a host is
one replica with K times the batch. Each step is three collectives in the
host's AllreduceGroup (allreduce.py): local rank 0's go-on flag, the gradient
average (buckets, as the hybrid's), and after the exchange the broadcast of
every parameter and buffer. A process lost fails the collective under way on
the others (AllreduceError naming it): the host's worker stops as one.
"""

from __future__ import annotations

import torch

from .allreduce import AllreduceGroup

__all__ = ["HostBinding", "LocalReplica"]

_GO_ON, _STOP = 0, 1


def _state(module: torch.nn.Module) -> list[torch.Tensor]:
    """What local rank 0 broadcasts: every parameter and buffer, in module order."""
    return [*module.parameters(), *module.buffers()]


class HostBinding:
    """Local rank 0's binding: a ModuleBinding (its PSClient's, the host's only one) whose every step first
    averages the host's gradients and then hands the values pulled to the other processes.

    Made after register_module: broadcasts the module's values (pulled) to the host's other processes, which
    wait for them in LocalReplica(). Not thread-safe (it shares the module with the training loop). Blocks
    and raises as the ModuleBinding does, and as the group's collectives do (AllreduceError: a process of the
    host lost; the host cannot go on).
    """

    overlap = False

    def __init__(self, binding, group: AllreduceGroup):
        if group.rank != 0:
            raise ValueError(f"HostBinding is local rank 0's; this process is {group.rendezvous.task}")
        self.binding = binding
        self.group = group
        self.client = binding.client
        self.module = binding.module
        self.tables = binding.tables
        self._closed = False
        group.broadcast_(_state(self.module), 0, what="the broadcast of the host's first values")

    @property
    def step(self) -> int:
        return self.binding.step

    @property
    def names(self) -> list[str]:
        return self.binding.names

    def share(self, value: int) -> int:
        """Gives the host's other processes an int (LocalReplica.share receives it): one small broadcast."""
        return self.group.broadcast_int(value, what="a value for the host's processes")

    def exchange(self) -> int:
        """One host step after backward: the host's gradients averaged, pushed, the new values pulled (the
        ModuleBinding's exchange) and broadcast to the others; returns the next step. Blocks until every
        process of the host took part (at most the group's timeout) and the shards replied."""
        what = f"step {self.step}'s local reduce"
        self.group.broadcast_int(_GO_ON, what=what)
        self.group.average_gradients_(self.module.parameters(), what=what)
        step = self.binding.exchange()
        self.binding.wait()
        self.group.broadcast_(_state(self.module), 0, what=f"step {step}'s broadcast")
        return step

    def push(self) -> int:
        """The go-on flag, then the host's gradients averaged into this process's .grads and pushed (the
        ModuleBinding's push); returns the next step."""
        what = f"step {self.step}'s local reduce"
        self.group.broadcast_int(_GO_ON, what=what)
        self.group.average_gradients_(self.module.parameters(), what=what)
        return self.binding.push()

    def pull(self) -> int:
        """The values pulled (the ModuleBinding's pull, waited for), then broadcast to the host's other
        processes; returns the step."""
        step = self.binding.pull()
        self.binding.wait()
        self.group.broadcast_(_state(self.module), 0, what=f"step {step}'s broadcast")
        return step

    def wait(self) -> None:
        """Nothing under way between steps (pull() waits for its values): returns at once."""

    def close(self) -> None:
        """Tells the host's other processes that training is over (their exchange() returns False); the group
        is the caller's to close. Call it only after a step that ended well: after an error, stop the process
        instead (the others then fail too). Idempotent."""
        if not self._closed:
            self._closed = True
            self.group.broadcast_int(_STOP, what="the end of the host's training")


class LocalReplica:
    """The binding of the host's other processes: gradients go to local rank 0's average, values come from its
    broadcasts. Made while local rank 0 makes its HostBinding: receives the first values (blocks, at most the
    group's timeout). Not thread-safe."""

    def __init__(self, module: torch.nn.Module, group: AllreduceGroup):
        if group.rank == 0:
            raise ValueError("LocalReplica is for the host's processes other than local rank 0")
        self.module = module
        self.group = group
        self.step = 0  # host steps taken by this process
        group.broadcast_(_state(module), 0, what="the broadcast of the host's first values")

    def share(self, value: int = 0) -> int:
        """The int local rank 0 shares (HostBinding.share); `value` is ignored."""
        return self.group.broadcast_int(value, what="a value from local rank 0")

    def exchange(self) -> bool:
        """One host step after backward: False at once if local rank 0 ended the host's training (this
        backward is not used); else this process's gradients join the average and the new values arrive
        (True). Blocks until local rank 0 took part; AllreduceError if a process of the host is lost."""
        what = f"step {self.step + 1}'s local reduce"
        if self.group.broadcast_int(_GO_ON, what=what) == _STOP:
            return False
        self.group.average_gradients_(self.module.parameters(), what=what)
        self.group.broadcast_(_state(self.module), 0, what=f"step {self.step + 1}'s broadcast")
        self.step += 1
        return True
