"""Shard checkpoints on disk: atomic writes, pruning, finding the latest, re-layout. No gRPC.

Layout under a checkpoint directory (shared by every shard of a job):

    step-000000001200/ps-0.pt      shard 0's state at step 1200
    step-000000001200/ps-1.pt
    step-000000001200/manifest.json   the client's placement (written by shard 0)

A file is written to a temporary name, fsynced, renamed, and its folder
fsynced, so a process killed during a save leaves the previous checkpoint
intact and never a partial file under the final name.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..placement import Placement

__all__ = ["FORMAT", "shard_path", "write_shard", "write_manifest", "latest_shard", "load", "relayout", "prune"]

_LOGGER = logging.getLogger(__name__)
FORMAT = "torchps-shard-v1"
_STEP_PREFIX = "step-"


def _step_dir(directory: pathlib.Path, step: int) -> pathlib.Path:
    return directory / f"{_STEP_PREFIX}{step:012d}"


def shard_path(directory: str | os.PathLike, step: int, index: int) -> pathlib.Path:
    return _step_dir(pathlib.Path(directory), step) / f"ps-{index}.pt"


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: pathlib.Path, write) -> int:
    tmp = path.with_name(path.name + ".tmp")
    for attempt in (1, 2):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            break
        except FileNotFoundError:  # another shard pruned the step folder between mkdir and open
            if attempt == 2:
                raise
    _fsync_dir(path.parent)
    return path.stat().st_size


def write_shard(directory: str | os.PathLike, index: int, state: dict[str, Any]) -> tuple[pathlib.Path, int]:
    """Writes one shard's state (from Coordinator.snapshot) atomically; returns (path, bytes)."""
    path = shard_path(directory, state["step"], index)
    size = _write_atomic(path, lambda f: torch.save({"format": FORMAT, "index": index, **state}, f))
    return path, size


def write_manifest(directory: str | os.PathLike, step: int, manifest: dict) -> None:
    """Stores the client's placement beside the shard files of `step`."""
    path = _step_dir(pathlib.Path(directory), step) / "manifest.json"
    _write_atomic(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def _steps(directory: pathlib.Path) -> list[int]:
    if not directory.is_dir():
        return []
    steps = []
    for child in directory.iterdir():
        if child.is_dir() and child.name.startswith(_STEP_PREFIX) and child.name[len(_STEP_PREFIX):].isdigit():
            steps.append(int(child.name[len(_STEP_PREFIX):]))
    return sorted(steps)


def latest_shard(directory: str | os.PathLike, index: int) -> pathlib.Path | None:
    """This shard's newest complete file, or None."""
    directory = pathlib.Path(directory)
    for step in reversed(_steps(directory)):
        path = shard_path(directory, step, index)
        if path.is_file():
            return path
    return None


def load(path: str | os.PathLike) -> dict[str, Any]:
    """A shard state written by write_shard; InvalidArgumentError if it is not one."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise InvalidArgumentError(f"{path} is not a torchps shard checkpoint ({FORMAT})")
    return state


def relayout(directory: str | os.PathLike, index: int, num_ps: int) -> dict[str, Any]:
    """The state shard `index` of `num_ps` should start from, taken from the newest checkpoint in
    `directory` that has a manifest and every old shard's file, whatever the old number of shards.

    Variables are placed as the manifest's strategy places its names (in
    creation order) over `num_ps` shards, which is what every client computes.
    """
    directory = pathlib.Path(directory)
    for step in reversed(_steps(directory)):
        manifest_path = _step_dir(directory, step) / "manifest.json"
        if not manifest_path.is_file():
            continue
        manifest = json.loads(manifest_path.read_text())
        old = [shard_path(directory, step, i) for i in range(manifest["num_ps"])]
        if not all(p.is_file() for p in old):
            continue
        placement = Placement(num_ps, manifest["strategy"])
        mine = {name for name, nbytes in manifest["variables"] if placement.add(name, nbytes) == index}
        states = [load(p) for p in old]
        by_name = {v["name"]: v for state in states for v in state["variables"]}
        variables = [by_name[name] for name, _ in manifest["variables"] if name in mine and name in by_name]
        _LOGGER.info("re-layout: step %d from %d shards -> shard %d of %d takes %d variables",
                     step, manifest["num_ps"], index, num_ps, len(variables))
        return {"step": step, "config": states[0]["config"], "variables": variables}
    raise InvalidArgumentError(f"no complete checkpoint with a manifest under {directory}")


def prune(directory: str | os.PathLike, index: int, keep: int) -> None:
    """Deletes this shard's files beyond the `keep` newest; removes step folders left empty."""
    directory = pathlib.Path(directory)
    if keep <= 0:
        return
    mine = [s for s in _steps(directory) if shard_path(directory, s, index).is_file()]
    for step in mine[:-keep]:
        shard_path(directory, step, index).unlink(missing_ok=True)
        folder = _step_dir(directory, step)
        try:
            if all(p.name == "manifest.json" for p in folder.iterdir()):  # no shard file, done or in progress
                shutil.rmtree(folder, ignore_errors=True)
        except FileNotFoundError:  # another shard pruned it first
            continue
