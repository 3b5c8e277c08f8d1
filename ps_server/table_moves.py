"""Tables kept on SSD in a live re-layout (moves.py): their rows leave from a frozen copy of the old shard's
store and arrive in a staged store on the new shard, a chunk at a time, never whole in memory. No gRPC.

An old shard's first export of table rows takes a copy of each SSD table's
store (hard links: ssd_tables.SsdTable.state_dict) and keeps it in a folder
of its own (`keep`); every export of the re-layout, a repeated one too,
streams the rows one new shard owns from that copy (`rows_for`). A new
shard writes the rows each old shard sends into a staged store per table
(`Staging`), flushed and kept beside the journal before the import's
journal record names it; once every old shard's part arrived, the new
tables stream their rows from the staged stores (table_state.built_from).

The folders are under `root`: the journal's folder (`<journal>/relayout`)
where the shard has a journal, so that a shard killed mid-re-layout
replays its records onto the folders they name, as it replays the rest of
its state; else the shard's table folder. They are named relative to `root`
in records and states. When the re-layout ends, `retire` removes the
folders it named (a later re-layout's, made before a replay reaches this
end, stay): at once without a journal, else once the journal has a base
written after the end (a record before it may still name them:
Journal.drop_after_next_base). A shard that starts with no re-layout under
way drops every folder there (what a crash left, such as a staging cut
off).

Thread-safe: a staging belongs to one import; `keep` and `retire` are
called under the apply gate (moves.py); the folder names are random.
"""

from __future__ import annotations

import pathlib
import secrets
import shutil
from typing import Iterable, Iterator, Mapping

import numpy as np

from ..errors import InvalidArgumentError, ModeConflictError
from ..rows import owner
from .disk_rows import DiskRows, link_tree
from .journal import Journal
from .ssd_tables import StoreCopy, TableStorage, _safe

__all__ = ["RelayoutFolders", "Staging", "ROOT", "streamed_tables"]

ROOT = "relayout"
_ROWS_PER_CHUNK = 1 << 12


class RelayoutFolders:
    """The folders of one shard's SSD table rows in live re-layouts (see the module docstring). `journal`: the
    shard's, set before its records are replayed (None: it has none)."""

    def __init__(self, storage: TableStorage):
        self._storage = storage
        self.journal: Journal | None = None

    @property
    def root(self) -> pathlib.Path:
        journal = self.journal
        if journal is not None:
            return journal.directory / ROOT
        if self._storage.root is None:
            raise ModeConflictError("this shard keeps no tables on disk (no --table-dir): it has no SSD table rows "
                                    "to re-lay out")
        return self._storage.root / ROOT

    @property
    def sync(self) -> bool:
        """Whether kept folders are fsynced (the journal's --journal-sync)."""
        return self.journal is not None and self.journal.sync

    def check_unreplicated(self) -> None:
        """ModeConflictError while a backup follows this shard: its copies of the journal would name folders
        it does not have (replicated shards re-lay out SSD tables by a checkpoint and a restart)."""
        if self.journal is not None and self.journal.following() is not None:
            raise ModeConflictError("a backup follows this shard: its tables kept on SSD cannot be re-laid out "
                                    "live yet; nothing was changed (re-lay them out by a checkpoint and a restart "
                                    "onto the new number of shards)")

    def keep(self, name: str, copy: StoreCopy, config: Mapping) -> dict:
        """Keeps table `name`'s store copy (its old shard's config) for the re-layout's exports: linked into a
        folder of its own under `root` (synced with a synced journal). Returns what names it ("path" relative
        to root, "record_bytes", and the old shard's "shard_index", "num_shards" and "partition")."""
        folder = f"out-{_safe(name)}-{secrets.token_hex(4)}"
        link_tree(copy.path, self.root / folder, sync=self.sync)
        return {"path": folder, "record_bytes": copy.record_bytes, "shard_index": int(config["shard_index"]),
                "num_shards": int(config["num_shards"]), "partition": str(config["partition"])}

    def rows_for(self, kept: Mapping, to: int, count: int, max_rows: int = _ROWS_PER_CHUNK
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) chunks of at most `max_rows` rows of a kept copy (keep()'s) that shard `to` of `count`
        owns, by ascending id. ModeConflictError if the copy is gone (a checkpoint restored mid-re-layout)."""
        path = self.root / kept["path"]
        if not (path / "CURRENT").is_file():
            raise ModeConflictError(f"the copy of the table rows this shard exports ({path}) is gone; the re-layout "
                                    f"cannot go on from here")
        disk = DiskRows(path, int(kept["record_bytes"]), read_only=True)
        try:
            for ids, records in disk.items(max_rows):
                mine = owner(ids, count, kept["partition"]) == to
                if mine.any():
                    yield ids[mine], records[mine]
        finally:
            disk.close()

    def path(self, relative: str) -> pathlib.Path:
        return self.root / relative

    def staging(self, source: int, tables: Mapping[str, Mapping]) -> "Staging":
        """A staging of old shard `source`'s rows of `tables` ({name: head state}, each table kept on SSD)."""
        return Staging(self, source, tables)

    def retire(self, names: Iterable[str] | None = None) -> None:
        """Drops the folders `names` (relative to root: those an ended re-layout named), or with None every
        folder under root (a start with no re-layout under way: what a crash left); see the module docstring
        for when they go."""
        if self.journal is None and self._storage.root is None:
            return
        root = self.root
        if not root.is_dir():
            return
        folders = sorted(root.iterdir()) if names is None else [root / name for name in names]
        journal = self.journal
        if journal is None:
            for folder in folders:
                shutil.rmtree(folder, ignore_errors=True)
        else:
            journal.drop_after_next_base(folders)


class Staging:
    """Old shard `source`'s rows of the SSD tables `tables` ({name: its head state, with "streamed": record
    bytes}) as they arrive (`put`), in a store per table in a folder of its own under root; `finish` checks
    the counts and keeps each store under a name a record may give, `discard` drops them. For one import (one
    thread)."""

    def __init__(self, folders: RelayoutFolders, source: int, tables: Mapping[str, Mapping]):
        self._folders, self._source = folders, source
        self._tables = dict(tables)
        self._disks: dict[str, DiskRows] = {}
        self._counts = {name: 0 for name in tables}
        self._work = folders.root / f"staging-{secrets.token_hex(4)}"
        self._kept: list[pathlib.Path] = []

    def put(self, name: str, ids: np.ndarray, records: np.ndarray, *, to: int, count: int) -> None:
        """Stages rows of table `name`. InvalidArgumentError (the import is refused) for a table not announced,
        records of another width, ids the old shard did not own or that shard `to` of `count` does not own."""
        head = self._tables.get(name)
        if head is None:
            raise InvalidArgumentError(f"rows of {name!r}, which the part sent names as no table kept on SSD")
        record_bytes = int(head["streamed"])
        if records.ndim != 2 or records.shape != (len(ids), record_bytes):
            raise InvalidArgumentError(f"rows of {name!r} must come as {len(ids)} records of {record_bytes} bytes, "
                                       f"got {records.shape}")
        config = head["config"]
        old = owner(ids, int(config["num_shards"]), config["partition"]) == int(config["shard_index"])
        new = owner(ids, count, config["partition"]) == to
        if not (old.all() and new.all()):
            raise InvalidArgumentError(f"rows of {name!r} sent by ps {self._source} hold ids that are not its own or "
                                       f"not ps {to}'s of {count}")
        disk = self._disks.get(name)
        if disk is None:
            disk = self._disks[name] = DiskRows(self._work / _safe(name), record_bytes, fresh=True)
        disk.put(ids, records)
        self._counts[name] += len(ids)

    def finish(self, sent: Mapping[str, int]) -> dict[str, dict]:
        """Checks that every announced table's rows arrived as `sent` says ({name: rows}), and keeps each staged
        store under root (synced with a synced journal); returns {name: {"path", "record_bytes"}}.
        InvalidArgumentError (nothing kept) if the counts differ: the stream was cut or forged."""
        if dict(sent) != self._counts:
            raise InvalidArgumentError(f"the table rows sent by ps {self._source} ended at {self._counts} rows, "
                                       f"and it declared {dict(sent)}; nothing was imported")
        out = {}
        for name, head in self._tables.items():
            disk = self._disks.pop(name, None)
            if disk is None:  # no row of that table is this shard's: an empty store
                disk = DiskRows(self._work / _safe(name), int(head["streamed"]), fresh=True)
            source = disk.path
            disk.flush()
            disk.close()
            folder = f"in-{self._source}-{_safe(name)}-{secrets.token_hex(4)}"
            link_tree(source, self._folders.root / folder, sync=self._folders.sync)
            self._kept.append(self._folders.root / folder)
            out[name] = {"path": folder, "record_bytes": int(head["streamed"])}
        shutil.rmtree(self._work, ignore_errors=True)
        return out

    def discard(self) -> None:
        """Drops what was staged and kept (an import refused, or a repeat)."""
        for disk in self._disks.values():
            disk.close()
        self._disks.clear()
        shutil.rmtree(self._work, ignore_errors=True)
        for folder in self._kept:
            shutil.rmtree(folder, ignore_errors=True)


def streamed_tables(entries: Iterable[Mapping]) -> dict[str, Mapping]:
    """{name: head state} of a part's entries whose rows are streamed (tables kept on SSD)."""
    return {entry["name"]: entry["state"] for entry in entries
            if isinstance(entry.get("state"), Mapping) and entry["state"].get("streamed")}
