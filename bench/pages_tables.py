"""The benchmark page of embedding tables kept on SSD (bench/ctr.py --storages): ctr_ssd.md."""

from __future__ import annotations

from pages_core import MISSING, Page, Result, code, earlier, met, num, section, sig, source, table

CONFIG_KEYS = ("days", "samples_per_day", "cardinality_cap", "alpha", "dim", "bottom", "top", "batch_size", "workers",
               "ps", "modes", "storages", "max_memory", "table_cache", "memory_limit", "server_arg", "seed")


def _mb(value) -> str:
    return MISSING if value is None else f"{value / 2**20:,.0f}"


def ctr_ssd_page(results: list[Result]) -> Page:
    page = Page.start(
        "ctr_ssd.md", "Tables larger than memory (Criteo-shaped, SSD)",
        "`bench/ctr.py --storages ram,ssd,...`: the Criteo-shaped DLRM job of [its page](ctr.md), run by run with "
        "the shards' tables in memory and on SSD (`ps-server --table-storage ssd`, the shard's `--max-memory` "
        "bounding the tables' caches and variables, a memory cgroup of `--memory-limit` around each shard "
        "process), interleaved so that each SSD run has a RAM run beside it on the same loaded machine; every "
        "run keeps a journal. After each SSD run's training, shard 1 is killed (SIGKILL) and started again: it "
        "recovers from its journal's base (a copy of each store) and log. A run on `ssd-next` is one on SSD whose "
        "workers announce each next batch's ids with their lookup, so that the shards read those rows into "
        "their caches while the step computes. The bars (issue 42): training "
        "samples/s on SSD >= 0.70 x in RAM with each shard's table >= 10 x its --max-memory; every shard's "
        "resident set, sampled every second, under the limit for the whole run, its recovery included, with "
        "every row read back equal.")
    r = results[-1]
    runs = r.get("storage_runs") or []
    rows = []
    for run in runs:
        ssd = run["storage"] != "ram"
        rec = run.get("recovery") or {}
        rows.append([run["round"], run["storage"], run["mode"], sig(run["samples_per_s"]),
                     sig(run["samples_per_s_per_core"]), num(run["held_out_auc"], 4),
                     num(run.get("cache_hit_rate"), 3) if ssd else MISSING,
                     (f"{sig(run['store_bytes_read_per_sample'])} / {sig(run['store_bytes_written_per_sample'])}"
                      if ssd else MISSING),
                     _mb(min(s["rows_bytes"] for s in run["shards"])),
                     _mb(max(s.get("rss_max_sampled_bytes") or 0 for s in run["shards"])) if ssd else MISSING,
                     _mb(max(s["peak_rss_bytes"] or 0 for s in run["shards"])),
                     (f"{num(rec.get('seconds'), 1)} s, {_mb(rec.get('peak_rss_bytes'))} MB, "
                      f"{'equal' if rec.get('rows_equal') else 'NOT equal'}") if ssd else MISSING])
    ratios = r.get("ssd_over_ram") or {}
    config = r.get("config") or {}
    page.lines += [*table(["round", "storage", "mode", "samples/s", "samples/s per core", "held-out AUC",
                           "cache hit rate", "store bytes read / written per sample", "table rows' MB per shard",
                           "RSS MB, largest sample", "peak RSS MB in training", "shard 1 SIGKILLed: recovery, peak RSS, rows"],
                          rows),
                   "; ".join(f"{mode}: {label} over RAM samples/s, median {num(v['median'], 3)} of the pairs "
                             f"{', '.join(num(x, 3) for x in v['ratios'])}"
                             for key, label in (("ssd_over_ram", "SSD"),
                                                ("ssd_next_over_ram", "SSD with the next batch announced (ssd-next)"))
                             for mode, v in (r.get(key) or {}).items())
                   + f". Each shard's table rows (their bytes as a table in memory holds them) over its "
                   f"--max-memory ({config.get('max_memory')}): {num(r.get('table_over_max_memory'), 1)} x; memory "
                   f"cgroup per shard: {_mb(config.get('memory_limit'))} MB.", "",
                   *table(["target", "met"], [[code(k), met(v)] for k, v in (r.get("targets") or {}).items()]),
                   *section("How this was measured", [source(r, config={k: config.get(k) for k in CONFIG_KEYS})])]
    for mode, v in ratios.items():
        page.headline.append((f"Criteo-shaped DLRM, {mode}, tables {num(r.get('table_over_max_memory'), 1)} x "
                              f"--max-memory on SSD: samples/s over in RAM (bar >= 0.70)", num(v["median"], 3), r))
    page.lines += earlier(results[:-1], [
        ("SSD over RAM", lambda e: "; ".join(f"{m}: {num(v['median'], 3)}"
                                             for m, v in (e.get("ssd_over_ram") or {}).items())),
        ("table over --max-memory", lambda e: num(e.get("table_over_max_memory"), 1))])
    return page
