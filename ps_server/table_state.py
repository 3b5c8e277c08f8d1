"""Embedding tables in checkpoints and the journal: a shard's table section, the manifest's list of tables,
their checks, restores, and re-layouts onto another number of shards. No gRPC.

A shard file (checkpoint.write_shard) holds "tables", one entry per table the
shard holds, in creation order:

    {"name": str, "spec": the TableSpec's bytes (as created, defaults filled in),
     "shard_index": int, "num_shards": int, "state": EmbeddingTable.state_dict()}

The state holds the rows the shard owns by ascending id (values, lazy
optimizer state and update counts), the optimizer's step count and the
table's step, its admission and eviction counters, for a dynamic table each
row's last update step and the occurrence counters of ids not admitted yet,
and the table's change-log cursor at the copy (what a serving replica that
starts from the checkpoint reads on from). It is copied
under the apply gate with the variables (snapshots.state_of), so a table's
rows are those of the checkpoint's step exactly.

Shard 0 writes the manifest's "tables" when it commits a checkpoint, after
checking that every shard's file holds the same tables, each laid out over the
checkpoint's shards with the file's own index:

    {"name", "spec": the TableSpec as JSON (for people), "partition": "modulo" | "hash",
     "num_shards", "num_embeddings": int, or null for a dynamic table, "dim", "dtype"}

A restore takes every table the manifest lists or nothing: a shard file that
lacks one, holds another or lays one out otherwise, or an entry that does not
load (a missing or misshapen tensor, rows of another shard), is a
CheckpointError naming the file and the table, before the shard serves.

The journal (recording.py) records what changes a shard's tables: their
creation ("tables"), admitting lookups of dynamic tables ("admit": the ids, in
order with the applies), and each push's row gradients inside the push's own
"apply" record, so a push is replayed whole or not at all.
"""

from __future__ import annotations

import base64
from typing import Callable, Iterable, Mapping, Sequence

import torch
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from .. import codec, rows
from ..errors import CheckpointError, InvalidArgumentError, PSError
from ..proto import ps_pb2
from .embeddings import relayout as relayout_rows, rows_for
from .ssd_tables import TableStorage, relayout_stores
from .tables import RowGradient, TableStore, _arguments, _Held, _normalized

__all__ = ["section", "restore", "manifest_tables", "check_section", "relayout", "record_rows", "rows_of_record",
           "creation_record", "specs_of_record"]


# -- a shard's section --------------------------------------------------------------------------------

def section(store: TableStore) -> list[dict]:
    """Every table's entry (see the module docstring), in creation order; each table is copied under its own
    lock (the caller holds the apply gate for a state at one step). Blocks only behind a lookup or apply of
    the same table."""
    return [{"name": held.spec.name, "spec": held.spec.SerializeToString(deterministic=True),
             "shard_index": held.table.config()["shard_index"], "num_shards": held.num_shards,
             "state": held.table.state_dict()} for held in store.held()]


def restore(store: TableStore, entries: Iterable[Mapping], where: str) -> None:
    """Makes `entries` (a section, or relayout()'s) the store's tables, all of them or none: raises
    CheckpointError naming `where` and the table for an entry that does not load, before changing anything.
    For a shard that does not serve yet."""
    built: list[_Held] = []
    try:
        for entry in entries:
            built.append(_build(entry, where, store.storage))
    except CheckpointError:
        for held in built:
            held.table.close()
        raise
    store.install(built)


def _build(entry: Mapping, where: str, storage: TableStorage) -> _Held:
    name = entry.get("name") if isinstance(entry, Mapping) else None
    table = None
    try:
        spec = _spec(entry)
        if not isinstance(entry["state"], Mapping):
            raise TypeError(f"its state is {type(entry['state']).__name__}")
        on_disk = any(entry["state"].get(k) is not None for k in ("store", "sources"))  # restored where it was kept
        if on_disk and not storage.on_disk:
            raise CheckpointError(f"{where}: embedding table {name!r} was kept on SSD; start the shard with "
                                  f"--table-dir DIR to restore it")
        table = storage.table(spec.name, spec.dim, "ssd" if on_disk else spec.storage, initial=False,
                              **_arguments(spec, entry["shard_index"], entry["num_shards"]))
        table.load_state_dict(entry["state"])
        return _Held(_normalized(spec), entry["num_shards"], table)
    except CheckpointError as exc:
        if table is not None:
            table.close()
        raise CheckpointError(str(exc) if str(exc).startswith(where) else f"{where}: {exc}") from None
    except (PSError, KeyError, TypeError, ValueError, AttributeError, OSError) as exc:
        if table is not None:
            table.close()
        raise CheckpointError(f"{where}: embedding table {name!r} cannot be restored ({type(exc).__name__}: "
                              f"{exc}); the checkpoint is damaged or incomplete, nothing was restored") from None


def _spec(entry: Mapping) -> ps_pb2.TableSpec:
    """The entry's TableSpec; CheckpointError unless it parses and names the entry's table."""
    try:
        spec = ps_pb2.TableSpec.FromString(entry["spec"])
    except (KeyError, TypeError, DecodeError) as exc:
        raise CheckpointError(f"embedding table {entry.get('name')!r} has no readable spec ({exc})") from None
    if spec.name != entry.get("name") or not spec.dim:
        raise CheckpointError(f"an embedding table entry named {entry.get('name')!r} holds the spec of "
                              f"{spec.name!r} (dim {spec.dim})")
    return spec


# -- the manifest -------------------------------------------------------------------------------------

def _described(entry: Mapping, where: str) -> dict:
    """The manifest's description of a section entry; CheckpointError for an entry that is not one."""
    if not isinstance(entry, Mapping):
        raise CheckpointError(f"{where}: its table section holds {type(entry).__name__}, not a table entry")
    try:
        spec = _spec(entry)
        num_shards, partition = int(entry["num_shards"]), rows.partition_name(spec.partition)
        dtype = str(codec.torch_dtype(spec.dtype)).removeprefix("torch.")
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except (PSError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: embedding table {entry.get('name')!r}: {type(exc).__name__}: {exc}") from None
    return {"name": spec.name, "spec": json_format.MessageToDict(spec, preserving_proto_field_name=True),
            "partition": partition, "num_shards": num_shards, "num_embeddings": spec.num_embeddings or None,
            "dim": spec.dim, "dtype": dtype}


def _layout(described: Mapping) -> tuple:
    """What a restore needs to agree on: name, partition, shards, size, width, dtype."""
    return tuple(described.get(k) for k in ("name", "partition", "num_shards", "num_embeddings", "dim", "dtype"))


def _entries(section_: object, where: str) -> list:
    if not isinstance(section_, list):
        raise CheckpointError(f"{where}: its table section is {type(section_).__name__}, not a list of tables")
    return section_


def _check_one(section_: object, index: int, num_ps: int, where: str) -> list[dict]:
    """The descriptions of one shard file's entries; CheckpointError unless each is laid out over `num_ps`
    shards as shard `index`, and no name repeats."""
    out = []
    for entry in _entries(section_, where):
        described = _described(entry, where)
        shard_index = entry.get("shard_index")
        if described["num_shards"] != num_ps or shard_index != index:
            raise CheckpointError(f"{where}: embedding table {described['name']!r} is saved as shard {shard_index} "
                                  f"of {described['num_shards']}; this file is shard {index} of {num_ps}")
        out.append(described)
    names = [d["name"] for d in out]
    if len(set(names)) != len(names):
        raise CheckpointError(f"{where}: an embedding table is saved twice: {names}")
    return out


def manifest_tables(sections: Mapping[int, object], num_ps: int, where: str) -> list[dict]:
    """The manifest's "tables" for shard files whose sections are {index: section} (every index of num_ps);
    CheckpointError (the checkpoint is not committed) unless every shard holds the same tables, in the same
    order, each laid out over num_ps shards with the file's own index."""
    described = {index: _check_one(s, index, num_ps, f"{where}: ps-{index}.pt") for index, s in sections.items()}
    first = described[min(described)]
    for index, tables in sorted(described.items()):
        if [_layout(t) for t in tables] != [_layout(t) for t in first]:
            raise CheckpointError(
                f"{where}: ps-{index}.pt holds embedding tables {[t['name'] for t in tables]} and ps-{min(described)}"
                f".pt {[t['name'] for t in first]} (or lays them out otherwise); every shard must save every table: "
                f"not committed")
    return first


def check_section(section_: object, manifest: Mapping, index: int, where: str) -> list:
    """The entries of shard `index`'s section; CheckpointError unless they are exactly the manifest's tables
    (none if it lists none), laid out as it says, for shard `index` of the manifest's shards."""
    listed = manifest.get("tables") or []
    if section_ is None:
        section_ = []
    got = _check_one(section_, index, manifest["num_ps"], where)
    if [_layout(t) for t in got] != [_layout(t) for t in listed]:
        missing = sorted({t["name"] for t in listed} - {t["name"] for t in got})
        extra = sorted({t["name"] for t in got} - {t["name"] for t in listed})
        raise CheckpointError(
            f"{where}: its embedding tables do not match the manifest's (missing {missing}, not listed {extra}, or "
            f"laid out otherwise); the checkpoint is incomplete or damaged, refusing to restore it partly")
    return _entries(section_, where)


def relayout(manifest: Mapping, sections: Sequence[tuple[object, str]], index: int, num_ps: int, where: str
             ) -> list[dict]:
    """Shard `index` of `num_ps`'s entries for every table of the manifest, from all old shards' sections
    [(section, file)] in index order: each row the partition now assigns to it, with its optimizer state,
    last update step and occurrence counters (embeddings.relayout; admission counters restart at zero).
    CheckpointError naming `where` (the checkpoint) unless every old shard holds every table, each old
    shard's rows and counters are its own, and their states fit together."""
    olds = [{entry["name"]: entry for entry in check_section(s, manifest, i, file)}
            for i, (s, file) in enumerate(sections)]
    out = []
    for table in manifest.get("tables") or []:
        name = table["name"]
        entries = [old[name] for old in olds]
        on_disk = [isinstance(e.get("state"), Mapping) and e["state"].get("store") is not None for e in entries]
        try:
            if all(on_disk):  # streamed store to store when the new shard loads it
                state = relayout_stores([entry["state"] for entry in entries], index, num_ps)
            elif any(on_disk):
                raise CheckpointError(f"shards {[i for i, d in enumerate(on_disk) if d]} kept it on SSD and the "
                                      f"others in RAM; re-lay it out from shards that keep it alike")
            else:
                for old_index, (entry, (_, file)) in enumerate(zip(entries, sections)):
                    _check_owned(entry["state"], old_index, len(entries), table["partition"], file)
                state = relayout_rows([entry["state"] for entry in entries], index, num_ps)
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: embedding table {name!r}: {exc}") from None
        except (PSError, KeyError, TypeError, IndexError, RuntimeError) as exc:
            raise CheckpointError(f"{where}: embedding table {name!r} cannot be re-laid out from {len(entries)} "
                                  f"shards onto {num_ps} ({type(exc).__name__}: {exc}); the checkpoint is damaged, "
                                  f"nothing was restored") from None
        out.append({"name": name, "spec": entries[0]["spec"], "shard_index": index, "num_shards": num_ps,
                    "state": state})
    return out


def parts_for(section_: list[dict], num_shards: int) -> dict[int, list[dict]]:
    """A live re-layout onto `num_shards` shards: {new shard: this shard's section (section()'s entries) cut to
    the rows and counters that shard owns}. A table kept on SSD is cut to its head (no row: its rows are
    streamed from its store copy, table_moves.py), marked "streamed" with its records' width."""
    return {index: [{**entry, "state": _part_of(entry["state"], index, num_shards)} for entry in section_]
            for index in range(num_shards)}


def _part_of(state: Mapping, index: int, num_shards: int) -> dict:
    if state.get("store") is None:
        return rows_for(state, index, num_shards)
    head = {k: v for k, v in state.items() if k not in ("store", "rows")}
    pending = state["pending"]
    mine = rows.shard_of(pending["ids"], num_shards, state["config"]["partition"]) == index
    head["pending"] = {k: v[mine] for k, v in pending.items()}
    head["streamed"] = state["store"].record_bytes
    return head


def built_from(parts: Mapping[int, list], index: int, num_shards: int, storage: TableStorage,
               stores: Callable[[str], str] = str) -> list[_Held]:
    """Shard `index` of `num_shards`'s tables from what every old shard sent it ({old shard: parts_for()'s
    entries}; a table kept on SSD with its staged store in "store", whose "path" `stores` resolves), marked
    as built live. InvalidArgumentError (nothing built) unless they are one set of tables laid out over
    len(parts) old shards."""
    names = [[entry.get("name") for entry in part] for _, part in sorted(parts.items())]
    if any(n != names[0] for n in names):
        raise InvalidArgumentError(f"the old shards sent rows of different tables: {names}")
    out = []
    try:
        for position, name in enumerate(names[0]):
            entries = [part[position] for _, part in sorted(parts.items())]
            states = [entry["state"] for entry in entries]
            try:
                streamed = [bool(state.get("streamed")) for state in states]
                if all(streamed):
                    state = relayout_stores([{**s, "store": {**s["store"], "path": stores(s["store"]["path"])}}
                                             for s in states], index, num_shards)
                elif any(streamed):
                    raise InvalidArgumentError("some old shards kept it on SSD and the others in RAM")
                else:
                    state = relayout_rows(states, index, num_shards)
                held = _build({"name": name, "spec": entries[0]["spec"], "shard_index": index,
                               "num_shards": num_shards, "state": state}, "a live re-layout", storage)
            except (CheckpointError, KeyError, TypeError) as exc:
                raise InvalidArgumentError(f"embedding table {name!r}: the rows sent do not fit together: "
                                           f"{exc}") from None
            held.relaid = True
            out.append(held)
    except BaseException:
        for held in out:
            held.table.close()
        raise
    return out


def _check_owned(state: Mapping, index: int, num_shards: int, partition: str, file: str) -> None:
    """CheckpointError unless every row id and pending id of an old shard's state belongs to that shard."""
    for what, ids in (("rows", state["ids"]), ("occurrence counters", (state.get("pending") or {}).get("ids"))):
        if ids is not None and not bool((rows.shard_of(ids, num_shards, partition) == index).all()):
            raise CheckpointError(f"{file} holds {what} of ids that are not shard {index}'s of {num_shards} "
                                  f"({partition} partitioning); the checkpoint is damaged, nothing was restored")


# -- the journal ----------------------------------------------------------------------------------------

def creation_record(specs: Sequence[ps_pb2.TableSpec], shard_index: int, num_shards: int) -> dict:
    """The meta of a "tables" record: the tables created (specs as sent) and their layout."""
    return {"specs": [base64.b64encode(s.SerializeToString(deterministic=True)).decode() for s in specs],
            "shard_index": shard_index, "num_shards": num_shards}


def specs_of_record(meta: Mapping) -> list[ps_pb2.TableSpec]:
    return [ps_pb2.TableSpec.FromString(base64.b64decode(s)) for s in meta["specs"]]


def record_rows(meta: dict, tensors: Mapping[str, torch.Tensor], table_rows: Mapping[str, RowGradient]
                ) -> tuple[dict, dict[str, torch.Tensor]]:
    """An "apply" record's (meta, tensors) with a push's row gradients added: meta "rows" lists the tables, and
    each one's ids and values are tensors under a prefix no variable name of the record starts with."""
    if not table_rows:
        return meta, dict(tensors)
    prefix = "\0rows:"
    while any(name.startswith(prefix) for name in tensors):
        prefix = "\0" + prefix
    out = dict(tensors)
    for i, (name, grad) in enumerate(table_rows.items()):
        out[f"{prefix}{i}:ids"], out[f"{prefix}{i}:values"] = grad.ids, grad.values
    uncounted = [name for name, grad in table_rows.items() if not grad.counts_step]
    return {**meta, "rows": list(table_rows), "rows_prefix": prefix,
            **({"rows_again": uncounted} if uncounted else {})}, out


def rows_of_record(meta: Mapping, tensors: dict[str, torch.Tensor]) -> dict[str, RowGradient]:
    """The row gradients of an "apply" record, taken out of `tensors` (which keeps the dense gradients)."""
    prefix = meta.get("rows_prefix")
    again = set(meta.get("rows_again", ()))
    return {name: RowGradient(tensors.pop(f"{prefix}{i}:ids"), tensors.pop(f"{prefix}{i}:values"),
                              counts_step=name not in again)
            for i, name in enumerate(meta.get("rows", ()))}
