"""Checkpoints on disk: shard files, then a manifest that commits them; restore and re-layout. No gRPC.

Layout under a checkpoint directory shared by every shard of a job:

    step-000000001200/ps-0.pt          shard 0's state for the checkpoint of step 1200
    step-000000001200/ps-1.pt
    step-000000001200/manifest.json    written last, by shard 0 at commit: only now does it count

Every file is written under a unique temporary name, fsynced, renamed, and its
folder fsynced, so a process killed at any moment leaves either the whole
file or none of it, and two saves of one step never publish each other's
half-written file. A folder without a manifest is partial: never restored,
deleted once a newer checkpoint is committed.

A table kept on SSD (ssd_tables.py) keeps its rows beside its shard's file:
step-000000001200/ps-0.stores/TABLE/ is a copy of its store (hard links to
the shard's store files where the file system allows, else to the same
files of the newest committed checkpoint's copy, else copies), named in the
file.

Embedding tables (table_state.py) are in the same files: each shard file has
its tables' section, and the manifest lists every table (spec, partition,
shard count), checked against every shard's file before it is written. A
checkpoint holding tables is written as torchps-shard-v3 files and a
torchps-checkpoint-v3 manifest, which a torchps without tables in checkpoints
refuses instead of restoring the variables alone; one without tables stays v2.
A restore takes every table the manifest lists, or refuses the checkpoint
(CheckpointError).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import secrets
import shutil
from typing import Any

import torch

from ..errors import CheckpointError, InvalidArgumentError
from ..partitioning import partitioner_from_dict, piece_names, row_ranges
from ..placement import Placement
from . import table_state
from .entries import decode_entries
from .ssd_tables import place_stores, resolve_stores

__all__ = ["FORMAT", "MANIFEST_FORMAT", "FORMAT_TABLES", "MANIFEST_FORMAT_TABLES", "write_shard", "commit",
           "committed_at", "latest_committed", "load", "restore_state", "relayout", "clean_partial", "write_atomic",
           "fsync_dir"]

_LOGGER = logging.getLogger(__name__)
FORMAT = "torchps-shard-v2"
MANIFEST_FORMAT = "torchps-checkpoint-v2"
FORMAT_TABLES = "torchps-shard-v3"              # v2 and a table section
MANIFEST_FORMAT_TABLES = "torchps-checkpoint-v3"  # v2 and a list of tables
_FORMATS, _MANIFEST_FORMATS = (FORMAT, FORMAT_TABLES), (MANIFEST_FORMAT, MANIFEST_FORMAT_TABLES)
MANIFEST = "manifest.json"
_STEP_PREFIX = "step-"


FULL_MARK = "full"  # in a full checkpoint's ps-N.stores/: later checkpoints copy rather than link its files

def step_dir(directory: str | os.PathLike, step: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"{_STEP_PREFIX}{step:012d}"


def fsync_dir(path: pathlib.Path) -> None:
    """Makes a folder's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: pathlib.Path, write, *, sync: bool = True) -> int:
    """Writes `path` whole or not at all (see the module docstring); returns its size. `sync=False`: whole or
    not at all if the process dies, not if the host does (nothing is fsynced)."""
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        if sync:
            fsync_dir(path.parent.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if sync:
        fsync_dir(path.parent)
    return path.stat().st_size


def write_shard(directory: str | os.PathLike, index: int, step: int, state: dict[str, Any], *, full: bool = False
                ) -> tuple[pathlib.Path, int]:
    """Phase 1: writes shard `index`'s state into the folder of checkpoint `step`; returns (path, bytes).
    `full`: the stores of its tables on SSD are copied file by file, none linked (place_stores)."""
    path = step_dir(directory, step) / f"ps-{index}.pt"
    older = (s for s in reversed(_steps(pathlib.Path(directory))) if s < step)
    earlier = next((s for s in older if _manifest(pathlib.Path(directory), s)  # the newest committed one not full
                    and not (step_dir(directory, s) / f"ps-{index}.stores" / FULL_MARK).exists()), None)
    place_stores(state, path.parent / f"ps-{index}.stores", path.parent,
                 None if earlier is None else step_dir(directory, earlier) / f"ps-{index}.stores", full=full)
    form = FORMAT_TABLES if state.get("tables") else FORMAT
    if full and (path.parent / f"ps-{index}.stores").is_dir():  # no later checkpoint links its files
        (path.parent / f"ps-{index}.stores" / FULL_MARK).touch()
    size = write_atomic(path, lambda f: torch.save({"format": form, "index": index, **state}, f))
    return path, size


def commit(directory: str | os.PathLike, step: int, manifest: dict, shards: list[tuple[int, int, int, int]],
           keep: int) -> pathlib.Path:
    """Phase 2: checks every shard's file (index, bytes, state step, layout epoch, tables, variables), writes
    the manifest, prunes.

    Every file must be of one layout epoch (a live resize that moved
    variables between two shards' saves would leave one in two files or in
    none), and every variable the manifest names must be in exactly one file,
    among its variables or in its outbox (an export its importer had not
    confirmed: layout.py). The manifest's "tables" come from the shard files,
    which must all hold the same tables (table_state.manifest_tables). Each
    file is read memory-mapped, its tensors left on disk. CheckpointError
    names a missing or different file, or the variable: the checkpoint is then
    not committed.
    """
    folder = step_dir(directory, step)
    indices = sorted(index for index, _, _, _ in shards)
    if indices != list(range(manifest["num_ps"])):
        raise CheckpointError(f"checkpoint {step}: shard files {indices} do not cover the {manifest['num_ps']} shards")
    epochs = {index: epoch for index, _, _, epoch in shards}
    if len(set(epochs.values())) > 1:
        raise CheckpointError(f"checkpoint {step}: the shards saved at layout epochs {epochs}: a live resize moved "
                              f"variables between their saves; it is not committed (the next checkpoint will be)")
    for index, nbytes, _, _ in shards:
        path = folder / f"ps-{index}.pt"
        size = path.stat().st_size if path.is_file() else None
        if size != nbytes:
            raise CheckpointError(
                f"checkpoint {step}: {path} is {'missing' if size is None else f'{size} bytes'} where shard {index} "
                f"wrote {nbytes}; every shard must share one --checkpoint-dir")
    states = {index: load(folder / f"ps-{index}.pt", mmap=True) for index in indices}
    tables = table_state.manifest_tables({index: state.get("tables", []) for index, state in states.items()},
                                         manifest["num_ps"], f"checkpoint {step}")
    _check_each_once([name for name, _ in manifest["variables"]], states, step)
    body = {**manifest, "format": MANIFEST_FORMAT_TABLES if tables else MANIFEST_FORMAT, "step": step,
            "tables": tables,
            "shards": [{"index": i, "file": f"ps-{i}.pt", "bytes": b, "state_step": s}
                       for i, b, s, _ in sorted(shards)]}
    path = folder / MANIFEST
    write_atomic(path, lambda f: f.write(json.dumps(body, indent=1).encode()))
    _prune(pathlib.Path(directory), keep)
    return path


def held_entries(state: dict[str, Any]) -> list[dict]:
    """A shard state's variable entries: those it holds, then those its outbox keeps (layout.py), decoded
    where an older journal kept them as bytes."""
    kept = []
    for names, _, entries, *_ in (state.get("layout") or {}).get("outbox", []):
        if isinstance(entries, (bytes, bytearray)):  # a shard file of an older torchps
            entries = decode_entries(bytes(entries))
        kept += entries
    return list(state["variables"]) + kept


def _check_each_once(names: list[str], states: dict[int, dict], step: int) -> None:
    """CheckpointError naming the first of `names` not in exactly one of the shard `states`."""
    where: dict[str, list[int]] = {}
    for index, state in sorted(states.items()):
        for entry in held_entries(state):
            where.setdefault(entry["name"], []).append(index)
    for name in names:
        found = where.get(name, [])
        if len(found) != 1:
            raise CheckpointError(f"checkpoint {step}: variable {name!r} is in "
                                  f"{'no shard file' if not found else f'the files of ps {found}'}; a checkpoint "
                                  f"holds each variable exactly once (a live resize moving it?): it is not "
                                  f"committed (the next checkpoint will be)")


def _steps(directory: pathlib.Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(child.name[len(_STEP_PREFIX):]) for child in directory.iterdir()
                  if child.is_dir() and child.name.startswith(_STEP_PREFIX) and child.name[len(_STEP_PREFIX):].isdigit())


def _manifest(directory: pathlib.Path, step: int) -> dict | None:
    """The manifest of checkpoint `step` if it is committed (a manifest naming shard files), else None."""
    path = step_dir(directory, step) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") not in _MANIFEST_FORMATS:
        return None
    return manifest if manifest.get("shards") else None


def _damage(directory: pathlib.Path, step: int, manifest: dict) -> str | None:
    """How committed checkpoint `step`'s files differ from what its manifest recorded (the first file missing
    or of another size: cut short, or written over), or None. Every shard reads the same answer."""
    for shard in manifest["shards"]:
        path = step_dir(directory, step) / shard["file"]
        size = path.stat().st_size if path.is_file() else None
        if size is None or size != shard.get("bytes", size):
            return f"{path} is {'missing' if size is None else f'{size} bytes'} where {shard.get('bytes')} were written"
    return None


def _intact(directory: pathlib.Path, step: int) -> dict | None:
    """The manifest of checkpoint `step` if it is committed and its files are as it recorded them, else None."""
    manifest = _manifest(directory, step)
    return manifest if manifest is not None and _damage(directory, step, manifest) is None else None


def committed_at(directory: str | os.PathLike, step: int) -> dict | None:
    """The manifest of checkpoint `step` under `directory` if it is committed and intact, else None."""
    return _intact(pathlib.Path(directory), step)


def latest_committed(directory: str | os.PathLike) -> tuple[int, dict] | None:
    """(step, manifest) of the newest committed checkpoint whose files are intact, or None if none is
    committed. A newer committed one that is damaged (a file missing, cut short or written over) is passed
    over with a WARNING naming both, the same for every shard. If every committed one is damaged, the newest
    (a WARNING says so): restoring it refuses a file that cannot be read, naming it and why."""
    directory = pathlib.Path(directory)
    damaged: list[tuple[int, dict, str]] = []
    for step in reversed(_steps(directory)):
        manifest = _manifest(directory, step)
        if manifest is None:
            continue
        why = _damage(directory, step, manifest)
        if why is None:
            if damaged:
                _LOGGER.warning("the newest committed checkpoint in %s is damaged (%s): restoring the newest intact "
                                "one, %s", directory, "; ".join(d[2] for d in damaged), step_dir(directory, step).name)
            return step, manifest
        damaged.append((step, manifest, why))
    if damaged:
        _LOGGER.warning("every committed checkpoint in %s is damaged (%s): trying the newest", directory,
                        "; ".join(d[2] for d in damaged))
        step, manifest, _ = damaged[0]
        return step, manifest
    return None


def _prune(directory: pathlib.Path, keep: int) -> None:
    """Deletes intact committed checkpoints beyond the `keep` newest (0: keep all) and older ones that are
    partial or damaged; a damaged one newer than every intact one stays (for the user to look at)."""
    committed = [s for s in _steps(directory) if _intact(directory, s) is not None]
    if not committed:
        return
    doomed = [s for s in _steps(directory) if s < committed[-1] and s not in committed]
    if keep > 0:
        doomed += committed[:-keep]
    for step in doomed:
        shutil.rmtree(step_dir(directory, step), ignore_errors=True)
    if doomed:
        fsync_dir(directory)


def clean_partial(directory: str | os.PathLike, index: int) -> None:
    """At a shard's start: deletes the temporary files a killed predecessor with this index left, and
    (shard 0) partial checkpoints older than the newest committed one."""
    directory = pathlib.Path(directory)
    patterns = [f"{_STEP_PREFIX}*/.ps-{index}.pt.*.tmp"] + ([f"{_STEP_PREFIX}*/.{MANIFEST}.*.tmp"] if index == 0 else [])
    for pattern in patterns:
        for path in directory.glob(pattern):
            path.unlink(missing_ok=True)
    if index == 0:
        _prune(directory, 0)


def load(path: str | os.PathLike, *, mmap: bool = False) -> dict[str, Any]:
    """A shard state written by write_shard; CheckpointError if it is not one or cannot be read. `mmap`:
    tensors stay on disk, read when used."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - a damaged file, whatever torch raises
        raise CheckpointError(f"{path} cannot be read as a torchps shard checkpoint: {exc}") from None
    if not isinstance(state, dict) or state.get("format") not in _FORMATS:
        raise CheckpointError(f"{path} is not a torchps shard checkpoint ({' or '.join(_FORMATS)})")
    if (state["format"] == FORMAT_TABLES) != bool(state.get("tables")):
        raise CheckpointError(f"{path} is {state['format']} but holds {len(state.get('tables') or [])} embedding "
                              f"tables: a damaged file")
    resolve_stores(state, pathlib.Path(path).parent)
    return state


def restore_state(directory: str | os.PathLike, index: int, num_ps: int | None, *,
                  max_bytes: int = 0, new_job: bool = False, join_past: bool = False) -> dict[str, Any] | None:
    """The state shard `index` of `num_ps` starts from: the newest committed checkpoint in `directory`
    (its own file when the shard count is the same or not given, else a re-layout), or None if there is none.
    A checkpoint saved after a live resize is re-laid out for a `new_job` (--restore-from): it starts at
    layout epoch 0, placed as every client computes; a shard restarting in its job (--checkpoint-dir) takes
    its own file, its layout epoch with it. A shard past the checkpoint's shards restarting in its job starts
    empty (None: a live resize adds it) when `num_ps` is not given or with `join_past`.

    Shard files are mapped, not read whole: only what this shard takes is
    read, into memory of its own. CheckpointError if that is over `max_bytes`
    (the shard's --max-memory; 0: no limit), before it is copied."""
    found = latest_committed(directory)
    if found is None:
        return None
    step, manifest = found
    if (num_ps is None or join_past) and not new_job and index >= manifest["num_ps"]:
        _LOGGER.info("ps %d starts empty: its index is past the %d shards of the newest checkpoint (%d), so it "
                     "joins the running job and a live resize brings its variables", index, manifest["num_ps"], step)
        return None
    resized = manifest.get("layout", {}).get("epoch", 0)  # saved after a live resize: placed as its layout said
    if (num_ps is None or manifest["num_ps"] == num_ps) and not (resized and new_job):
        path = step_dir(directory, step) / f"ps-{index}.pt"
        _LOGGER.info("ps %d restoring %s (the newest intact committed checkpoint)", index, path)
        state = _load_listed(path, manifest, index)
        table_state.check_section(state.get("tables"), manifest, index, str(path))
        state = {**state, "source": str(path)}
    else:
        state = relayout(directory, index, num_ps or manifest["num_ps"], found)
    _check_size(state, max_bytes, index)
    return _owned(state)


def relayout(directory: str | os.PathLike, index: int, num_ps: int, found: tuple[int, dict] | None = None
             ) -> dict[str, Any]:
    """The state shard `index` of `num_ps` should start from, taken from the newest committed checkpoint
    in `directory` (`found`: latest_committed's answer, if asked already), whatever the old number of shards.

    Partitioned variables are cut again as the manifest's partitioner cuts
    them for `num_ps` shards (rows, values and optimizer state gathered from
    the old pieces), then variables are placed as the manifest's strategy
    places its names (in creation order), which is what every client
    computes. Every embedding table of the manifest is re-laid out too: this
    shard takes each row its partition (modulo or hash of the id) now assigns
    to it, with its optimizer state and dynamic-table metadata
    (table_state.relayout). The push ledger and membership start empty: a
    restore onto another layout starts a new job from the checkpoint's values.
    CheckpointError if a shard file is missing a table or damaged.
    """
    found = found or latest_committed(directory)
    if found is None:
        raise InvalidArgumentError(f"no committed checkpoint under {directory}")
    step, manifest = found
    names, recut = _recut(manifest, num_ps)
    placement = Placement(num_ps, manifest["strategy"])
    mine = [name for name, nbytes in names if placement.add(name, nbytes) == index]
    paths = [step_dir(directory, step) / shard["file"] for shard in manifest["shards"]]
    states = [_load_listed(path, manifest, shard["index"])  # read as used: this shard's part, not every file whole
              for path, shard in zip(paths, manifest["shards"])]
    tables = table_state.relayout(manifest, [(s.get("tables"), str(p)) for s, p in zip(states, paths)], index, num_ps,
                                  f"checkpoint {step} of {directory}")
    by_name = {v["name"]: v for state in states for v in held_entries(state)}
    variables = [_gather(name, *recut[name], by_name) if name in recut else by_name[name]
                 for name in mine if name in recut or name in by_name]
    _LOGGER.info("re-layout: checkpoint %d from %d shards -> shard %d of %d takes %d variables and its rows of %d "
                 "embedding tables", step, manifest["num_ps"], index, num_ps, len(variables), len(tables))
    return {"step": states[0]["step"], "config": states[0]["config"], "variables": variables, "tables": tables,
            "source": f"checkpoint {step} of {directory} re-laid out from {manifest['num_ps']} shards onto {num_ps}"}


def _load_listed(path: pathlib.Path, manifest: dict, index: int) -> dict[str, Any]:
    """load() of shard `index`'s file of a committed checkpoint, mapped; CheckpointError if its state's step is
    not the one the manifest recorded for it (a file of another checkpoint put in its place)."""
    state = load(path, mmap=True)
    listed = next((shard.get("state_step") for shard in manifest["shards"] if shard["index"] == index), None)
    if listed is not None and state.get("step") != listed:
        raise CheckpointError(f"{path} holds the state of step {state.get('step')}, and the manifest recorded "
                              f"{listed} for it: a file of another checkpoint; nothing was restored")
    return state


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor in a state (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _check_size(state: dict, max_bytes: int, index: int) -> None:
    """CheckpointError if the tensors of the state shard `index` restores are over `max_bytes` (0: no limit)."""
    nbytes = sum(t.nbytes for t in _tensors(state))
    if max_bytes and nbytes > max_bytes:
        raise CheckpointError(f"ps {index} would restore {nbytes} bytes ({state['source']}), over its --max-memory "
                              f"{max_bytes}: start more shards (the checkpoint is re-laid out for them) or raise "
                              f"the limit")


def _owned(value):
    """`value` with every tensor copied into memory of its own (off the mapped checkpoint files)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _owned(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_owned(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_owned(item) for item in value)
    return value


def _recut(manifest: dict, num_ps: int) -> tuple[list[tuple[str, int]], dict[str, tuple[list, int, int]]]:
    """The manifest's (name, bytes) in order with partitioned variables cut for `num_ps` shards, and for
    each new piece whose rows changed: (the old pieces [name, first row, end row], its first row, end row)."""
    partitions = manifest.get("partitions") or {"splits": {}}
    splits = partitions["splits"]
    if not splits:
        return [tuple(entry) for entry in manifest["variables"]], {}
    partitioner = partitioner_from_dict(partitions["partitioner"])
    old_piece = {piece: whole for whole, split in splits.items() for piece, _, _ in split["pieces"]}
    names, recut, done = [], {}, set()
    for name, nbytes in manifest["variables"]:
        whole = old_piece.get(name)
        if whole is None:
            names.append((name, nbytes))
            continue
        if whole in done:
            continue
        done.add(whole)
        split = splits[whole]
        shape, itemsize = tuple(split["shape"]), getattr(torch, split["dtype"]).itemsize
        n = partitioner.pieces(shape, itemsize, num_ps)
        row_bytes = math.prod(shape[1:]) * itemsize
        new = list(zip(piece_names(whole, n), row_ranges(shape[0], n))) if n > 1 else [(whole, (0, shape[0]))]
        old = [tuple(piece) for piece in split["pieces"]]
        for piece, (start, stop) in new:
            names.append((piece, (stop - start) * row_bytes))
            if (piece, start, stop) not in old:
                recut[piece] = (old, start, stop)
    return names, recut


def _gather(name: str, old: list, start: int, stop: int, by_name: dict) -> dict:
    """A variable entry for rows [start, stop) of a partitioned variable, from its old pieces' entries."""
    parts = [(by_name[piece], max(start, a) - a, min(stop, b) - a) for piece, a, b in old if a < stop and b > start]
    first = parts[0][0]
    value = torch.cat([entry["value"][lo:hi] for entry, lo, hi in parts])
    optimizer_state = first["optimizer_state"]
    if optimizer_state and optimizer_state.get("state"):
        whole = {}
        for key, item in optimizer_state["state"][0].items():
            if isinstance(item, torch.Tensor) and item.dim() > 0 and item.shape == first["value"].shape:
                whole[key] = torch.cat([entry["optimizer_state"]["state"][0][key][lo:hi] for entry, lo, hi in parts])
            else:
                whole[key] = item
        optimizer_state = {**optimizer_state, "state": {0: whole}}
    return {**first, "name": name, "shape": list(value.shape), "value": value,
            "version": max(entry["version"] for entry, _, _ in parts), "optimizer_state": optimizer_state}
