"""A serving replica's start from a committed checkpoint of its training job (ps-serve --checkpoint-dir): every
table's rows and every dense variable as the checkpoint holds them, published as the replica's first version
(labelled with the checkpoint's step), and each table's change-log cursor at the moment its rows were copied
(EmbeddingTable.state_dict's "changes"), so that the follower then reads only what changed since. A shard that
can no longer say (it restarted since, or a live resize laid the table out anew) sends that table whole, as it
would to a replica that starts from nothing. No gRPC.

The shard files are mapped, not read whole: each table's rows are copied
into the replica as it is published, and the optimizer state the files also
hold is never read.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
import torch

from ..errors import CheckpointError
from ..ps_server import checkpoint, table_state
from ..ps_server.row_changes import RowMarks
from ..ps_server.ssd_tables import stored_rows
from .replica import TableBatch

__all__ = ["CheckpointStart", "read_checkpoint"]


@dataclasses.dataclass
class CheckpointStart:
    step: int                                    # the checkpoint's training step
    epoch: int                                   # the layout epoch its shards saved at
    written: float                               # Unix time its manifest was committed
    batches: list[tuple[str, TableBatch]]        # every table of every shard file, whole
    dense: dict[str, torch.Tensor]               # every dense variable (partitioned ones by piece)
    cursors: list[dict[str, tuple[str, int]]]    # by shard index: {table: (incarnation, seq)} where saved
    where: str                                   # the checkpoint's folder, for logs


def read_checkpoint(directory: str | os.PathLike, step: int | None = None, min_updates: int = 0) -> CheckpointStart | None:
    """The newest committed checkpoint under `directory`, or the one of `step`; None if there is no committed
    one at all (and no `step` was asked for). `min_updates`: rows updated fewer times are left out (a checkpoint
    of an older torchps, without update counts, leaves none out). CheckpointError for a named step that is not
    committed, or a file that does not match its manifest."""
    if step is None:
        found = checkpoint.latest_committed(directory)
        if found is None:
            return None
        step, manifest = found
    else:
        manifest = checkpoint.committed_at(directory, step)
        if manifest is None:
            raise CheckpointError(f"no intact committed checkpoint of step {step} under {directory}")
    folder = checkpoint.step_dir(directory, step)
    tables = {t["name"]: t for t in manifest.get("tables") or []}
    batches, dense, cursors = [], {}, []
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        state = checkpoint.load(path, mmap=True)
        entries = table_state.check_section(state.get("tables"), manifest, shard["index"], str(path))
        saved = {}
        for entry in entries:
            batches.append((entry["name"], _batch(entry["state"], tables[entry["name"]], shard["index"],
                                                  min_updates)))
            if isinstance(entry["state"].get("changes"), dict):
                saved[entry["name"]] = (str(entry["state"]["changes"]["incarnation"]),
                                        int(entry["state"]["changes"]["seq"]))
        cursors.append(saved)
        dense.update({entry["name"]: entry["value"].clone() for entry in checkpoint.held_entries(state)})
    return CheckpointStart(step, manifest.get("layout", {}).get("epoch", 0),
                           (pathlib.Path(folder) / checkpoint.MANIFEST).stat().st_mtime, batches, dense, cursors,
                           str(folder))


def _batch(state: dict, listed: dict, index: int, min_updates: int) -> TableBatch:
    """One shard file's rows of a table as a whole read of that shard would send them."""
    if state.get("store") is not None:
        ids, values, marks = stored_rows(state["store"], getattr(torch, listed["dtype"]), listed["dim"])
        counts = torch.from_numpy(RowMarks.updates(marks))
    else:
        ids, values, counts = state["ids"].numpy(), state["values"], state.get("update_counts")
    if min_updates and counts is not None:
        kept = np.flatnonzero(counts.numpy() >= min_updates)
        ids, values = ids[kept], values[torch.from_numpy(kept)]
    return TableBatch(listed["dim"], getattr(torch, listed["dtype"]), np.array(ids, dtype=np.int64), values,
                      np.ones(len(ids), dtype=bool), True, (index, listed["num_shards"], listed["partition"]),
                      listed["num_embeddings"] or 0)
