"""Overlap: a module's gradients pushed while backward still runs, its values pulled while forward runs.

ModuleBinding(overlap=True) (PSClient.register_module(..., overlap=True)) sets
the hooks of Overlap, which drive the two halves: StreamedPush
(streamed_push.py), a push per step opened at its first gradient and closed
by push(), and LayerPull (layer_pull.py), the pull of every parameter in
forward order that each submodule's forward waits on for its own parameters.
Both extend the client's data path (datapath.DataPath: its refill, encoder,
push lock and device staging) and call the shards through its fan-out
(fanout.py).

Every wait is bounded by the client's `timeout`; errors (a shard gone, a
deadline) are raised from push(), wait(), the next forward pre-hook or the
next push's first hook, never dropped. On a GPU (device.py) the hooks never
make the host wait for the device: gradients leave by non-blocking copies
encoded by a thread of their own, and each layer's forward waits on its
own values' copy events.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Callable, Mapping

import torch

from .datapath import DataPath
from .layer_pull import LayerPull
from .streamed_push import OVERLAP_INFLIGHT_BYTES, PushLock, StreamedPush

__all__ = ["OVERLAP_INFLIGHT_BYTES", "Overlap", "PushLock", "StreamedPush", "LayerPull"]

_LOGGER = logging.getLogger(__name__)


class Overlap:
    """The hooks that make a ModuleBinding overlap communication with compute, and their state.

    Hooks run one at a time (autograd's), from the thread that runs backward; push_step and start_pull
    from the training thread.
    """

    def __init__(self, client: DataPath, module: torch.nn.Module, params: Mapping[str, torch.nn.Parameter],
                 inflight_bytes: int = OVERLAP_INFLIGHT_BYTES):
        self.client = client
        self.params = dict(params)
        self.inflight_bytes = inflight_bytes
        self.streamed: StreamedPush | None = None  # this step's push, open since its first gradient
        self.fallback = False  # this step's gradients go by a normal push (see push_step)
        self.pull: LayerPull | None = None
        # One thread encoding gradients beside backward, made at the first gradient on a GPU (StreamedPush);
        # CPU gradients are encoded in the hook.
        self.encoder: futures.ThreadPoolExecutor | None = None
        self._warned = False
        self._handles = []
        by_id = {id(p): name for name, p in self.params.items()}
        for name, param in self.params.items():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._on_gradient(name)))
        for submodule in module.modules():  # each module once, even if it appears twice
            own = [by_id[id(p)] for p in submodule.parameters(recurse=False) if id(p) in by_id]
            if own:
                self._handles.append(submodule.register_forward_pre_hook(self._before_forward(own)))

    def remove(self) -> None:
        """Takes the hooks off the module and its parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.encoder is not None:
            self.encoder.shutdown(wait=False)

    # -- hooks --------------------------------------------------------------------------------------

    def _before_forward(self, names: list[str]) -> Callable:
        def hook(module, args) -> None:
            pull = self.pull
            if pull is None:
                return
            if not pull.ok:
                if pull.error is not None:
                    raise pull.error
                if not pull.done(names):
                    pull.wait_for(names, f"the forward of {type(module).__name__}")
            pull.wait_device(names)  # CUDA: this layer's kernels run after its own copies, nothing else waits
        return hook

    def _on_gradient(self, name: str) -> Callable:
        def hook(param: torch.Tensor) -> None:
            if self.fallback:
                return
            if self.streamed is not None and self.streamed.gave_way:
                self.streamed = None  # another push came first (PushLock): this step goes whole, by push()
                self.fallback = True
                return
            if self.streamed is None:
                self.wait_pull(device=False)  # the shards see this push after the pull; the device needs nothing
                client = self.client
                if client._heartbeats.fenced is not None or not client._push_lock.acquire(blocking=False):
                    # fenced (push() raises it), or a push under way elsewhere on this client (another module
                    # streaming in the same backward, another thread): this step goes whole, by push()
                    self.fallback = True
                    return
                if self.encoder is None and param.grad is not None and param.grad.device.type == "cuda":
                    self.encoder = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchps-grads")
                try:
                    self.streamed = StreamedPush(client, self.inflight_bytes, self.encoder, self.params)
                except BaseException:
                    client._push_lock.release()
                    raise
            elif name in self.streamed.grads:  # accumulated again (a second backward): sent bytes stay sent
                self._note("a gradient was accumulated twice before push() (several backwards per step)")
                self._give_up()
                return
            try:
                self.streamed.add(name, param.grad)
            except BaseException:
                self._give_up()
                raise
        return hook

    def _give_up(self) -> None:
        """This step's streamed push is abandoned (nothing of it is applied); push() sends the gradients whole."""
        if self.streamed is not None:
            self.streamed.abort()
            self.streamed = None
        self.fallback = True

    def _note(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            _LOGGER.warning("overlap: %s; such steps are pushed whole by push(), without overlap", why)

    # -- the binding's calls -----------------------------------------------------------------------

    def wait_pull(self, device: bool = True) -> None:
        """Blocks until the pull under way (if any) is over; raises its error. With `device`, the current CUDA
        stream then waits for its copies to the device (the host does not)."""
        pull = self.pull
        if pull is None:
            return
        if not pull.ok:
            pull.wait()
        if device:
            pull.wait_device()

    def push_step(self, grads: Mapping[str, torch.Tensor]) -> int:
        """Ends this step's push: the streamed one if it carried exactly `grads`, else a normal push of them."""
        streamed, self.streamed, self.fallback = self.streamed, None, False
        if streamed is not None:
            if streamed.matches(grads) and not streamed.gave_way:
                return streamed.finish()  # raises the bound's timeout if its wait ran out
            if not streamed.aborted:
                self._note("the gradients changed after backward (clipped, unscaled, set by hand?)")
            streamed.abort()
        self.wait_pull(device=False)
        return self.client.push(grads)

    def start_pull(self, targets: Mapping[str, torch.Tensor], *, min_step: int, set_step: bool) -> None:
        """Starts pulling `targets` in the background (a pull still under way is cancelled first)."""
        previous = self.pull
        if previous is not None and not previous.finished:
            previous.cancel()
        self.pull = LayerPull(self.client, targets, min_step=min_step, set_step=set_step)
