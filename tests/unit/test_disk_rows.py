"""The on-disk row store of SSD-backed tables (ps_server/disk_rows.py): records by id, found or not, ids in
numeric order across the sign, snapshots that later writes do not reach, and a store opened fresh or again."""

from __future__ import annotations

import numpy as np
import pytest

from torchps.ps_server.disk_rows import DiskRows, decode_keys, encode_keys, link_tree

W = 24


def records(ids: np.ndarray, fill: int = 0) -> np.ndarray:
    return ((ids[:, None] + fill + np.arange(W)[None, :]) % 251).astype(np.uint8)


def test_keys_keep_the_ids_order_across_the_sign():
    ids = np.array([5, -(1 << 63), -1, 0, (1 << 63) - 1, 3], dtype=np.int64)
    assert decode_keys(encode_keys(ids)).tolist() == ids.tolist()
    assert sorted(encode_keys(ids)) == encode_keys(np.sort(ids))


def test_records_are_found_by_id_replaced_deleted_and_listed_by_id(tmp_path):
    store = DiskRows(tmp_path / "t", W)
    ids = np.array([9, -4, 100, 7], dtype=np.int64)
    store.put(ids, records(ids))
    found, got = store.get(np.array([7, 8, -4], dtype=np.int64))
    assert found.tolist() == [True, False, True]
    assert (got[0] == records(np.array([7]))[0]).all() and not got[1].any() and (got[2] == records(np.array([-4]))[0]).all()
    store.put(np.array([7]), records(np.array([7]), fill=1))
    store.delete(np.array([100, 12345]))
    listed = list(store.items(chunk=2))
    assert [part[0].tolist() for part in listed] == [[-4, 7], [9]]
    assert (listed[0][1][1] == records(np.array([7]), fill=1)[0]).all()
    assert (store.reads, store.writes) == (3, 5) and store.bytes_written == 5 * W
    with pytest.raises(ValueError, match="uint8"):
        store.put(ids, np.zeros((len(ids), W + 1), dtype=np.uint8))
    store.close()


def test_a_scan_reads_a_part_above_an_id_and_goes_on_where_it_ended(tmp_path):
    store = DiskRows(tmp_path / "t", W)
    top = (1 << 63) - 1
    ids = np.array([top, -(1 << 63), -3, 0, 2, 40], dtype=np.int64)
    store.put(ids, records(ids))
    parts, after = [], None
    while True:
        got, recs = store.scan(after, 2)
        parts.append(got.tolist())
        assert (recs == records(got)).all()
        if len(got) < 2:
            break
        after = int(got[-1])
    assert parts == [[-(1 << 63), -3], [0, 2], [40, top], []]
    assert store.scan(top, 5)[0].tolist() == [] and store.scan(-4, 1)[0].tolist() == [-3]
    assert store.bytes_read == len(ids) * W + W  # a part reads its rows only
    store.close()


def test_a_snapshot_holds_the_store_as_it_was_and_a_store_opens_again_or_fresh(tmp_path):
    store = DiskRows(tmp_path / "live", W)
    ids = np.arange(1000, dtype=np.int64)
    store.put(ids, records(ids))
    store.snapshot_to(tmp_path / "snap")
    store.put(ids[:10], records(ids[:10], fill=7))
    store.close()
    copy = DiskRows(tmp_path / "snap", W)
    found, got = copy.get(ids[:10])
    assert found.all() and (got == records(ids[:10])).all(), "the snapshot is not reached by later writes"
    copy.close()
    again = DiskRows(tmp_path / "live", W)
    assert (again.get(ids[:10])[1] == records(ids[:10], fill=7)).all()
    again.close()
    fresh = DiskRows(tmp_path / "live", W, fresh=True)
    assert not fresh.get(ids[:10])[0].any()
    fresh.close()


def test_a_copy_links_the_table_files_and_copies_the_rest(tmp_path):
    store = DiskRows(tmp_path / "t", W)
    ids = np.arange(5000, dtype=np.int64)
    store.put(ids, records(ids))
    store.snapshot_to(tmp_path / "snap")
    copied = link_tree(tmp_path / "snap", tmp_path / "copy", sync=True)
    tables = [f for f in (tmp_path / "copy").iterdir() if f.suffix == ".sst"]
    assert tables and all(f.stat().st_ino == (tmp_path / "snap" / f.name).stat().st_ino for f in tables)
    assert copied == sum(f.stat().st_size for f in (tmp_path / "copy").iterdir() if f.suffix != ".sst")
    again = DiskRows(tmp_path / "copy", W)
    assert again.get(ids[:3])[0].all()
    store.close()
    again.close()


def test_across_file_systems_a_copy_links_the_table_files_an_earlier_copy_holds(tmp_path, monkeypatch):
    """The store on another file system than the copies (os.link from it fails, as across devices): the first
    copy copies every file; the next links the table files the first holds and copies only the new one."""
    import os

    real_link = os.link

    def link(source, target):
        if str(source).startswith(str(tmp_path / "snap")):
            raise OSError(18, "Invalid cross-device link")
        real_link(source, target)

    monkeypatch.setattr(os, "link", link)
    store = DiskRows(tmp_path / "t", W)
    ids = np.arange(5000, dtype=np.int64)
    store.put(ids, records(ids))
    store.snapshot_to(tmp_path / "snap1")
    first = link_tree(tmp_path / "snap1", tmp_path / "copy1")
    assert first == sum(f.stat().st_size for f in (tmp_path / "copy1").iterdir())  # all copied
    store.put(ids[:100], records(ids[:100], fill=3))  # a new table file at the next snapshot
    store.snapshot_to(tmp_path / "snap2")
    second = link_tree(tmp_path / "snap2", tmp_path / "copy2", reuse=tmp_path / "copy1")
    tables = {f.name for f in (tmp_path / "copy2").glob("*.sst")}
    shared = tables & {f.name for f in (tmp_path / "copy1").glob("*.sst")}
    assert shared and tables - shared
    assert all((tmp_path / "copy2" / n).stat().st_ino == (tmp_path / "copy1" / n).stat().st_ino for n in shared)
    new = sum((tmp_path / "copy2" / n).stat().st_size for n in tables - shared)
    rest = sum(f.stat().st_size for f in (tmp_path / "copy2").iterdir() if f.suffix != ".sst")
    assert second == new + rest < first
    again = DiskRows(tmp_path / "copy2", W)
    assert (again.get(ids[:100])[1] == records(ids[:100], fill=3)).all() and again.get(ids[4990:])[0].all()
    again.close()
    store.close()
