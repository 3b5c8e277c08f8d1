"""A worker's error-feedback residuals across restarts of its task (ps-worker --compression --state-dir).

Top-k and random-k leave most of each gradient unsent; the worker keeps that
remainder (PSClient.compression_state_dict) and adds it to the next gradient.
`ResidualFile` writes it to DIR/<type>-<index>-residuals.pt every N of the
task's steps and when the task stops (done, failed, SIGTERM), whole or not at
all (a temporary file, fsync, rename, fsync of the folder), and a restarted
process of the same task loads it before its first push. A process killed
outright loses what it left unsent since its last write.
"""

from __future__ import annotations

import logging
import os
import pathlib
import pickle
import secrets

import torch

from ..client import CheckpointError, ClusterConfigError, PSClient, TaskSpec

__all__ = ["FORMAT", "ResidualFile"]

_LOGGER = logging.getLogger(__name__)
FORMAT = "torchps-residuals-v1"


class ResidualFile:
    """One task's residuals file under `directory`, written every `every_steps` steps (see the module)."""

    def __init__(self, directory: pathlib.Path, task: TaskSpec, every_steps: int):
        self.path = pathlib.Path(directory) / f"{task.type}-{task.index}-residuals.pt"
        self.every_steps = every_steps
        self._steps = 0

    def restore(self, client: PSClient) -> int:
        """Loads the file into `client` if it exists; returns how many residuals it held. Blocks on the
        read only; ClusterConfigError (nothing loaded) for a file that is not one of these."""
        if not self.path.exists():
            return 0
        try:
            saved = torch.load(self.path, map_location="cpu", weights_only=True)
            if not isinstance(saved, dict) or saved.get("format") != FORMAT:
                raise ValueError(f"its format is not {FORMAT}")
            client.load_compression_state_dict(saved["residuals"])
        except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as exc:
            raise ClusterConfigError(f"{self.path} is not a residuals file ps-worker can read ({exc}); move it away "
                                     f"to start without residuals") from None
        _LOGGER.info("restored the residuals of %d variables from %s (written at step %s)",
                     len(saved["residuals"]), self.path, saved.get("step"))
        return len(saved["residuals"])

    def stepped(self, client: PSClient) -> None:
        """Counts one of the task's steps; writes the file every `every_steps` (blocks for the write)."""
        self._steps += 1
        if self._steps % self.every_steps == 0:
            self.save(client)

    def save(self, client: PSClient) -> None:
        """Writes the file now, replacing the previous one whole; CheckpointError (the previous one kept)
        if it cannot be written."""
        state = {"format": FORMAT, "step": client.step, "residuals": client.compression_state_dict()}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            folder = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
        except OSError as exc:
            raise CheckpointError(f"could not write the residuals to {self.path}: {exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
