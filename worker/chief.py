"""What only the chief does: periodic step-consistent checkpoints, watching for stragglers, and the end of
the job."""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from typing import Iterable

import torch

from ..client import ModuleBinding, PSClient, PSError

__all__ = ["Checkpointer", "StragglerWatch", "finish_job", "repair_resize"]

_LOGGER = logging.getLogger(__name__)
FINAL_WAIT_SECONDS = 600.0  # how long the chief waits for the other workers before its final evaluation
WAIT_LOG_SECONDS = 10.0  # between two lines saying which workers the chief still waits for
STRAGGLER_CHECK_SECONDS = 10.0  # between two looks at the workers' paces


def repair_resize(client: PSClient) -> None:
    """A chief that starts aborts the live resize ps 0 records as cut off (its driver died: an earlier
    incarnation of this chief, or a ps-admin), so nothing stays in transit: rolled back, or finished past its
    point of no return (PSClient.abort_resize); one whose driver still renews its lease is left to it. Blocks
    meanwhile; a failure is logged (ps-admin resize --resume or --abort remains)."""
    try:
        record = client.resize_state()
        if record.phase != record.RUNNING:
            return
        if record.lease_left_seconds > 0:
            _LOGGER.info("resize %d is under way, driven by %s", record.id, record.driver)
            return
        report = client.abort_resize()
    except PSError as exc:
        _LOGGER.warning("could not abort the live resize that was cut off: %s; run ps-admin resize --resume or "
                        "--abort", exc)
        return
    _LOGGER.warning("resize %d (driven by %s, cut off): %s", record.id, record.driver, report.line())


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


class StragglerWatch:
    """Names the workers whose pushes arrive `threshold` times less often than the other workers' median,
    as shard 0 sees them (GetStatus's paces): once when a worker becomes a straggler, once when it is no
    longer one. Runs in a background thread (`start`, `stop`), or a look at a time (`check`)."""

    def __init__(self, client: PSClient, threshold: float, every: float = STRAGGLER_CHECK_SECONDS):
        self.client = client
        self.threshold = threshold
        self.every = every
        self.stragglers: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="straggler-watch", daemon=True)

    def check(self) -> set[str]:
        """One look: logs the changes and returns the stragglers now. Raises PSError if shard 0 does not answer."""
        paces = self.client.status(0).paces
        now = {p.worker for p in paces if p.straggler_score >= self.threshold}
        for pace in paces:
            if pace.worker in now - self.stragglers:
                _LOGGER.warning("%s is a straggler: a push every %.2f s, %.1f x the other workers' median",
                                pace.worker, pace.push_interval_seconds, pace.straggler_score)
        for worker in sorted(self.stragglers - now):
            _LOGGER.info("%s is no longer a straggler", worker)
        self.stragglers = now
        return now

    def start(self) -> "StragglerWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.check()
            except PSError as exc:  # shard 0 restarting: look again later
                _LOGGER.debug("straggler check skipped: %s", exc)


def fixed_tables(binding) -> list[str]:
    """The binding's fixed-size embedding tables: export_state_dict writes each as torch's whole weight."""
    return [name for name, table in binding.tables.items() if table.num_embeddings is not None]


def _wait_for_workers(client: PSClient, expected: list[str], join_wait: float) -> None:
    """Returns once no worker is live on ps 0 and every name of `expected` joined there, or the waits' bounds
    passed; logs what it waits for every WAIT_LOG_SECONDS."""
    started = time.monotonic()
    logged = started - WAIT_LOG_SECONDS  # the first wait is named at once
    while True:
        status = client.status(0, joined_of=expected)
        waited = time.monotonic() - started
        missing = list(status.not_joined)
        joins_awaited = bool(missing) and waited < join_wait
        if (status.live_workers == 0 and not joins_awaited) or waited >= FINAL_WAIT_SECONDS:
            break
        if joins_awaited and time.monotonic() - logged >= WAIT_LOG_SECONDS:
            logged = time.monotonic()
            _LOGGER.info("waiting up to %.0f s more for %s to join: not joined yet, its part of the data is not "
                         "trained", join_wait - waited, ", ".join(missing))
        time.sleep(0.5)  # end of the job: a few status calls, not on the training path
    if missing:
        _LOGGER.warning("%s never joined this job (waited %.0f s): what %s would have trained was not trained",
                        ", ".join(missing), waited, "they" if len(missing) > 1 else "it")


def finish_job(client: PSClient, binding: ModuleBinding, *, export: pathlib.Path | None,
               checkpointer: Checkpointer | None, expected: Iterable[str] = (), join_wait: float = 0.0) -> int:
    """Waits for the other workers, saves a last checkpoint, exports the model; the shards still serve (the
    caller stops them).

    The other workers: every live one, for up to FINAL_WAIT_SECONDS, and every name of `expected` (the
    cluster spec's workers) that never joined the job, for up to `join_wait` s (a worker that starts late
    still trains its part of the data; one that never comes is named in a warning). Returns the final global
    step. The module holds the final parameters afterwards.
    """
    _wait_for_workers(client, list(expected), join_wait)
    binding.pull()
    binding.wait()  # an overlapped pull runs in the background
    step = client.global_step()
    if checkpointer is not None:
        checkpointer.stop(final=True)
        if checkpointer.saved_steps and checkpointer.saved_steps[-1] != step:
            # a push landed after the step was read (a restarted worker's last one): the job ends at the
            # checkpoint's step, and the module holds its values
            step = checkpointer.saved_steps[-1]
            binding.pull()
            binding.wait()
    if export is not None:
        state = client.export_state_dict([*binding.names, *fixed_tables(binding)])
        torch.save(state, export)
        _LOGGER.info("exported %d tensors to %s (model.load_state_dict(torch.load(path)))", len(state), export)
    return step
