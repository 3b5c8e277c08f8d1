#!/usr/bin/env python
"""Which on-disk store for an embedding table's rows: RocksDB (rocksdict, torchps's ps_server/disk_rows.py) against
LMDB (py-lmdb), on the access pattern of an SSD-backed table's cache misses.

    python bench/row_stores.py --json bench/results/row_stores.json     # 2M rows, about 2 minutes
    python bench/row_stores.py --rows 200000 --batches 50                 # a try

Each store is loaded with --rows records of --record-bytes bytes (a row, its
optimizer state and its marks: dim 16 float32 with Adagrad is 144 bytes),
keys the ids' 8 ordered bytes. Then --batches batches of --batch ids drawn
Zipf(--alpha) over the rows (the distinct ones of each batch, as a shard
sees them): each batch is read (one multi-get) and written back changed (one
write batch), as a cache spills what it evicts and reads what it misses.
The stores take turns, --rounds times, each in a process of its own (so one
store's memory does not count in the other's), and the medians are
reported: rows read and written per second (the process's CPU does both;
this machine's page cache holds either store whole, so it is the stores'
CPU path that is compared, not the disk), each process's peak anonymous
and file-backed resident memory (VmRSS split: RssAnon, RssFile), and the
bytes on disk. LMDB is opened without read-ahead and without sync, as an
SSD table would use it; RocksDB as disk_rows.py opens it (no write-ahead
log, an 8 MiB block cache).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from pullpush import environment, log  # noqa: E402

STORES = ("rocksdb", "lmdb")


def memory() -> dict[str, int]:
    """This process's RssAnon and RssFile, bytes."""
    out = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) * 1024
    return out


class LmdbRows:
    """The same calls as disk_rows.DiskRows (get, put, disk_bytes) over py-lmdb."""

    def __init__(self, path: pathlib.Path, record_bytes: int):
        import lmdb

        self.record_bytes = record_bytes
        self.env = lmdb.open(str(path), map_size=1 << 36, readahead=False, sync=False, metasync=False,
                             writemap=False)
        self.path = path

    def get(self, ids: np.ndarray):
        from torchps.ps_server.disk_rows import encode_keys

        keys = encode_keys(ids)
        out = np.zeros((len(ids), self.record_bytes), dtype=np.uint8)
        with self.env.begin() as txn:
            got = dict(txn.cursor().getmulti(keys))
        found = np.fromiter((key in got for key in keys), dtype=bool, count=len(keys))
        if found.any():
            out[found] = np.frombuffer(b"".join(got[k] for k in keys if k in got), dtype=np.uint8).reshape(
                -1, self.record_bytes)
        return found, out

    def put(self, ids: np.ndarray, records: np.ndarray) -> None:
        from torchps.ps_server.disk_rows import encode_keys

        raw, step = np.ascontiguousarray(records).tobytes(), self.record_bytes
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti([(key, raw[i * step:(i + 1) * step]) for i, key in enumerate(encode_keys(ids))])

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


def one_run(store: str, args: dict, folder: str, out) -> None:
    """Loads a store, runs the batches, puts the figures on `out` (a queue)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from torchps.ps_server.disk_rows import DiskRows

    path = pathlib.Path(folder) / store
    rows, width = args["rows"], args["record_bytes"]
    db = DiskRows(path, width, fresh=True) if store == "rocksdb" else LmdbRows(path, width)
    rng = np.random.default_rng(args["seed"])
    began = time.perf_counter()
    for start in range(0, rows, 65536):
        ids = np.arange(start, min(rows, start + 65536), dtype=np.int64)
        db.put(ids, rng.integers(0, 256, (len(ids), width), dtype=np.uint8))
    load_s = time.perf_counter() - began
    batches = []
    for _ in range(args["batches"]):
        draws = rng.zipf(args["alpha"], 4 * args["batch"])
        batches.append(np.unique(draws[draws <= rows][:args["batch"]] - 1).astype(np.int64))
    peak = memory()
    read_s = write_s = 0.0
    for ids in batches:
        t = time.perf_counter()
        found, records = db.get(ids)
        read_s += time.perf_counter() - t
        if not found.all():
            raise RuntimeError(f"{store}: {int((~found).sum())} stored rows not found")
        records[:, 0] += 1
        t = time.perf_counter()
        db.put(ids, records)
        write_s += time.perf_counter() - t
        peak = {k: max(v, memory()[k]) for k, v in peak.items()}
    n = sum(len(b) for b in batches)
    out.put({"store": store, "load_rows_per_s": rows / load_s, "read_rows_per_s": n / read_s,
             "write_rows_per_s": n / write_s, "rows_per_s": n / (read_s + write_s),
             "rss_anon_peak_mib": peak["RssAnon"] / 2**20, "rss_file_peak_mib": peak["RssFile"] / 2**20,
             "disk_mib": db.disk_bytes() / 2**20, "rows_per_batch": n / len(batches)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rows", type=int, default=2_000_000, help="records stored (default 2M)")
    parser.add_argument("--record-bytes", type=int, default=144, help="bytes a record (default 144)")
    parser.add_argument("--batch", type=int, default=4096, help="ids drawn per batch (default 4096)")
    parser.add_argument("--batches", type=int, default=300, help="batches read and written back (default 300)")
    parser.add_argument("--alpha", type=float, default=1.05, help="the ids' Zipf exponent (default 1.05)")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each store, interleaved (default 3)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    settings = {k: getattr(args, k) for k in ("rows", "record_bytes", "batch", "batches", "alpha")}
    runs: dict[str, list[dict]] = {store: [] for store in STORES}
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="torchps-row-stores-") as folder:
        for turn in range(args.rounds):
            for store in STORES:
                out = context.Queue()
                proc = context.Process(target=one_run, args=(store, {**settings, "seed": turn}, folder, out))
                proc.start()
                runs[store].append(out.get(timeout=1800))
                proc.join()
                shutil.rmtree(pathlib.Path(folder) / store, ignore_errors=True)
                log(f"round {turn + 1}: {store} {runs[store][-1]['rows_per_s']:,.0f} rows/s read and written")
    keys = ("rows_per_s", "read_rows_per_s", "write_rows_per_s", "load_rows_per_s", "rss_anon_peak_mib",
            "rss_file_peak_mib", "disk_mib")
    medians = {store: {k: statistics.median(r[k] for r in runs[store]) for k in keys} for store in STORES}
    print("| store | " + " | ".join(keys) + " |\n|" + " --- |" * (len(keys) + 1))
    for store in STORES:
        print(f"| {store} | " + " | ".join(f"{medians[store][k]:,.1f}" for k in keys) + " |")
    ratio = medians["rocksdb"]["rows_per_s"] / medians["lmdb"]["rows_per_s"]
    print(f"\nrocksdb / lmdb rows read and written per s: {ratio:.2f}")
    results = {**settings, "rounds": args.rounds, "medians": medians, "runs": runs,
               "rocksdb_over_lmdb": ratio, "environment": environment(),
               "wall_seconds": time.monotonic() - started, "command": " ".join(["python", *sys.argv])}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
