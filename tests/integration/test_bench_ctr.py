"""bench/ctr.py on its quick setting: DLRM on the Criteo-shaped synthetic stream, trained sync then async on the same
days by real shards and worker processes, every figure it reports in its JSON; and its reader of Criteo TSV files
on a small file written here."""

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import ctr  # noqa: E402 - bench/ctr.py


def test_the_quick_ctr_benchmark_reports_every_figure_for_sync_and_async(tmp_path):
    out = tmp_path / "ctr.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "ctr.py"), "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    data = result["data"]
    assert data["source"] == "synthetic" and data["samples_per_day"] == [6000] * 3 and len(data["id_spaces"]) == 26
    assert 0.5 < data["oracle_auc"] < 1
    steps = 2 * math.ceil(3000 / 256)  # each worker: half of each of 2 days, in batches of 256
    for mode, global_step in (("sync", steps), ("async", 2 * steps)):  # sync: one step for both workers' pushes
        got = result["modes"][mode]
        assert got["samples"] == 12000 and got["global_step"] == global_step, mode
        assert 0.6 < got["held_out_auc"] < data["oracle_auc"] and got["held_out_log_loss"] > 0, got
        cpu = got["cpu_s"]
        assert cpu["shards"] > 0 and cpu["workers"] > 0 and cpu["chief"] >= 0
        assert cpu["total"] == pytest.approx(cpu["shards"] + cpu["workers"] + cpu["chief"])
        assert got["samples_per_s_per_core"] == pytest.approx(12000 / cpu["total"])
        assert got["samples_per_s"] > 0 and got["cores_busy"] > 0
        assert len(got["shards"]) == 2 and len(got["workers"]) == 2
        for shard in got["shards"]:
            assert shard["rows_looked_up_per_s"] > 0 and shard["rows_updated_per_s"] > 0 and shard["rows_held"] > 0
            assert shard["peak_rss_bytes"] > 0 and shard["table_bytes"] > 0
            assert shard["storage_read_bytes"] >= 0 and shard["storage_write_bytes"] >= 0
        for worker in got["workers"]:
            assert worker["samples"] == 6000 and worker["peak_rss_bytes"] > 0
            assert set(worker["cpu_s_by_stage"]) == {"lookup", "compute", "exchange"}
        assert got["chief_peak_rss_bytes"] > 0 and got["push_bytes_per_sample"] > 0
        assert got["storage_read_bytes_per_sample"] >= 0 and got["storage_write_bytes_per_sample"] >= 0
        assert got["cache_hit_rate"] is None
        assert result[f"{mode}_auc"] == got["held_out_auc"]
    assert result["auc_async_minus_sync"] == result["async_auc"] - result["sync_auc"]
    assert set(result["targets"]) == {"sync samples/s per core >= 140", "async samples/s per core >= 140",
                                      "|async AUC - sync AUC| <= 0.002"}
    assert "SSD" in result["cache_hit_rate_note"] and "| samples/s per core (bar >= 140) |" in run.stdout


def test_the_quick_ctr_benchmark_compares_tables_on_ssd_announcing_each_next_batch_with_tables_in_ram(tmp_path):
    out = tmp_path / "ctr_ssd.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "ctr.py"), "--quick", "--modes", "async", "--storages",
                          "ram,ssd-next", "--max-memory", "4M", "--table-cache", "256K", "--memory-limit", "900M",
                          "--json", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    result = json.loads(out.read_text())
    ram, ssd = result["storage_runs"]
    assert (ram["storage"], ssd["storage"]) == ("ram", "ssd-next") and ram["samples"] == ssd["samples"] == 12000
    assert ram["cache_hit_rate"] is None and 0 < ssd["cache_hit_rate"] < 1
    assert ssd["store_bytes_written_per_sample"] > 0 and ssd["rss_samples"] > 0
    assert all(s["rss_max_sampled_bytes"] > 0 and s["rows_bytes"] > s["table_bytes"] / 10 for s in ssd["shards"])
    assert ssd["recovery"]["rows_equal"] and ssd["recovery"]["rows_compared"] > 0  # shard 1 SIGKILLed, back whole
    assert result["ssd_next_over_ram"]["async"]["ratios"] == [ssd["samples_per_s"] / ram["samples_per_s"]]
    assert result["ssd_over_ram"] == {} and ssd["cache_warmed_per_sample"] > 0, "the workers announced their batches"
    assert result["table_over_max_memory"] == min(s["rows_bytes"] for s in ssd["shards"]) / 4 / 2**20
    assert {"async: SSD, next batch announced samples/s >= 0.7 x RAM (median of pairs)", "each shard's table >= 10 x --max-memory",
            "every shard's sampled RSS under --memory-limit, no OOM kill",
            "a SIGKILLed shard recovers under --memory-limit, rows equal"} <= set(result["targets"])
    assert "| round | storage | mode |" in run.stdout


LINES = [  # label, 13 integers, 26 categories: empty fields, a negative integer, ids beyond the id space
    "\t".join(["1", "3", "", "-2", *["0"] * 10, "68fd1e64", "", *["00000005"] * 24]),
    "\t".join(["0", *["7"] * 13, *["ffffffff"] * 26]),
    "\t".join(["0", *[""] * 13, *[""] * 26]),
]


def test_the_criteo_tsv_reader_makes_days_of_the_layout_as_dlrm_reads_it(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("\n".join(LINES * 3) + "\n")  # 9 lines: 2 training days and the held-out one, 3 lines each
    args = ctr.parse_args(["--criteo-tsv", str(path), "--days", "2", "--cardinality-cap", "1000"])
    data = ctr.ctr_data.make_days(args, tmp_path)
    assert data["training_days"] == 2 and data["samples_per_day"] == [3, 3, 3] and data["source"] == "criteo_tsv"
    spaces = np.array(data["id_spaces"])
    assert spaces.max() == 1000 and spaces[8] == 3  # field 9 has 3 values in Criteo: no cap bites
    for day in range(3):
        got = ctr.ctr_data.load_day(tmp_path, day)
        assert got["clicks"].tolist() == [1, 0, 0]
        assert np.allclose(got["dense"][0], np.log1p([3, 0, 0, *[0] * 10]))  # empty: 0; below 0: 0; log(x + 1)
        assert np.allclose(got["dense"][1], np.log1p(7)) and not got["dense"][2].any()
        assert got["ids"][0].tolist() == [0x68FD1E64 % spaces[0], 0, *(5 % spaces[2:])]  # hex modulo the space
        assert got["ids"][1].tolist() == (0xFFFFFFFF % spaces).tolist() and not got["ids"][2].any()
    path.write_text(LINES[0] + "\n" + LINES[1][:-9] + "\n" + LINES[2] + "\n")
    with pytest.raises(ValueError, match=r"line 2: 39 fields where the Criteo layout has 40"):
        ctr.ctr_data.read_tsv(path, list(spaces))
