"""What only the chief does: periodic step-consistent checkpoints, and the end of the job."""

from __future__ import annotations

import logging
import pathlib
import threading
import time

import torch

from ..client import ModuleBinding, PSClient, PSError

__all__ = ["Checkpointer", "finish_job"]

_LOGGER = logging.getLogger(__name__)
FINAL_WAIT_SECONDS = 600.0  # how long the chief waits for the other workers before its final evaluation


class Checkpointer:
    """Asks every shard to save the same step, every `every_steps` global steps or `every_seconds` s.

    Runs in a background thread, so training never waits for a save; a
    failed save is logged and retried at the next trigger.
    """

    def __init__(self, client: PSClient, *, every_steps: int = 0, every_seconds: float = 0.0, keep: int = 3):
        self.client = client
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep = keep
        self.saved_steps: list[int] = []
        self._last_step = 0
        self._due = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpointer", daemon=True)

    def start(self) -> "Checkpointer":
        self._thread.start()
        return self

    def note_step(self, global_step: int) -> None:
        """Called after each training step; triggers a save every `every_steps`."""
        if self.every_steps and global_step - self._last_step >= self.every_steps:
            self._last_step = global_step
            self._due.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._due.wait(self.every_seconds or None)
            self._due.clear()
            if self._stop.is_set():
                return
            self._save(None, timeout=300.0)

    def _save(self, step: int | None, timeout: float) -> None:
        try:
            saved = self.client.save_checkpoint(step, keep=self.keep, timeout=timeout)
        except PSError as exc:
            _LOGGER.warning("checkpoint failed (will retry at the next trigger): %s", exc)
            return
        self.saved_steps.append(saved)
        _LOGGER.info("checkpoint of step %d saved on every shard and committed", saved)

    def stop(self, *, final: bool) -> None:
        """Stops the thread; with final, saves once more: the state now (the job is idle, or stopping)."""
        self._stop.set()
        self._due.set()
        self._thread.join()
        if final:
            self._save(0, timeout=60.0)


def finish_job(client: PSClient, binding: ModuleBinding, *, export: pathlib.Path | None,
               checkpointer: Checkpointer | None, shutdown: bool) -> int:
    """Waits for the other workers, saves a last checkpoint, exports the model, stops the shards.

    Returns the final global step. The module holds the final parameters afterwards.
    """
    deadline = time.monotonic() + FINAL_WAIT_SECONDS
    while client.status(0).live_workers > 0 and time.monotonic() < deadline:
        time.sleep(0.5)  # end of the job: a few status calls, not on the training path
    binding.pull()
    step = client.global_step()
    if checkpointer is not None:
        checkpointer.stop(final=True)
    if export is not None:
        state = client.export_state_dict(binding.names)
        torch.save(state, export)
        _LOGGER.info("exported %d tensors to %s (model.load_state_dict(torch.load(path)))", len(state), export)
    if shutdown:
        client.shutdown_cluster("the chief finished the job")
    return step
