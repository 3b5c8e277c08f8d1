"""bench/pages.py's pages of the transport and the rest: pullpush.py (and its GPU-machine runs), calls.py, the GPU
check (device.py), compression's accuracy, embeddings, sync modes, start-up, scale, the Criteo-shaped benchmark
(ctr.py), the suite's CPU (cpu_of.py), and a plain table for any results file no page knows."""

from __future__ import annotations

import functools
import shlex

import pages_plot as plot
from pages_core import (MISSING, Page, Result, code, compact, earlier, met, num, section, sig, source,
                        table)


def _inner(folder: Result) -> list[Result]:
    """A folder's JSON files as results of their own."""
    return [Result(f"{folder.name}/{name}", data, folder.order) for name, data in folder.data.items()
            if isinstance(data, dict)]


# -- pullpush.py ------------------------------------------------------------------------------------------------

def pullpush_page(results: list[Result]) -> Page:
    page = Page.start(
        "pullpush.md", "Transport: one push and pull of 101 MB",
        "`bench/pullpush.py` times one push of every gradient and one pull of every variable of the 25.3M-float "
        "MLP (101 MB each way) through PSClient and 2 shards, beside the same bytes over bare gRPC (1 MiB "
        "`BytesValue` chunks, numpy copies at both ends: the baseline) and as raw 1 MiB messages with no copies "
        "(gRPC's floor), interleaved; and training runs of the seed and the 25.3M MLP.")
    files = [r for r in results if not r.folder]
    used = []
    bandwidth = [r for r in files if r.get("pullpush_seconds") is not None]
    if bandwidth:
        r = bandwidth[-1]
        seconds = {"torchps, 2 shards": r.get("pullpush_seconds"), "torchps, 1 shard": r.get("pullpush_1ps_seconds"),
                   "torchps, 2 shards, TLS": r.get("pullpush_secure_seconds"),
                   "gRPC baseline": r.get("grpc_baseline_seconds"), "gRPC floor": r.get("grpc_raw_seconds")}
        cpu = {"torchps, 2 shards": r.get("pullpush_cpu_seconds"),
               "torchps, 2 shards, TLS": r.get("pullpush_secure_cpu_seconds"),
               "gRPC baseline": r.get("grpc_baseline_cpu_seconds"), "gRPC floor": r.get("grpc_raw_cpu_seconds")}
        page.figures["pullpush-round-trip.svg"] = functools.partial(
            plot.panels, {"wall seconds (median)": {k: {k: v} for k, v in seconds.items() if v is not None},
             "CPU seconds, client + shards (median)": {k: {k: v} for k, v in cpu.items() if v is not None}},
            ylabel="seconds per push + pull", fmt="{:.3f}",
            title=f"One push and pull of 101 MB each way ({r.name})")
        page.lines += ["## The round trip", "", "![seconds per round trip](pullpush-round-trip.svg)", "",
                       *table(["figure", "value"],
                              [["gRPC baseline seconds / torchps seconds (`ratio`, target >= 0.8)",
                                num(r.get("ratio"))],
                               ["secure / plaintext bandwidth", num(r.get("secure_bandwidth_ratio"))],
                               ["client copies per byte", num(r.get("client_copies_per_byte"))]]),
                       *section("How this was measured", [source(r)])]
        page.headline.append(("transport, 101 MB each way: gRPC baseline seconds / torchps seconds",
                              num(r.get("ratio")), r))
        used.append(r)
    training = [r for r in files if r.get("mlp_async_steps_per_s") is not None or r.get("big_async_steps_per_s")]
    if training:
        r = training[-1]
        rows = [[label, sig(r.get(key))] for label, key in [
            ("seed MLP, 1 ps + 2 async workers, steps/s", "mlp_async_steps_per_s"),
            ("seed MLP, the same with TLS", "mlp_async_secure_steps_per_s"),
            ("seed MLP, one process, no PS", "mlp_local_steps_per_s"),
            ("25.3M MLP, 1 ps + 2 async workers, steps/s", "big_async_steps_per_s"),
            ("25.3M MLP, one process, no PS", "big_local_steps_per_s"),
            ("25.3M MLP, ceiling with the baseline's transport CPU", "big_ceiling_steps_per_s")]]
        cpu = [[model, setup, *(sig(f.get(k)) for k in ("compute_ms", "update_ms", "server_ms", "total_ms")),
                num(f.get("cores_busy"))]
               for model, key in (("seed", "small_cpu_per_step"), ("25.3M", "big_cpu_per_step"))
               for setup, f in (r.get(key) or {}).items()]
        page.lines += ["## Training", "", *table(["figure", "value"], rows),
                       *table(["model", "setup", "compute ms/step", "update ms/step", "ps ms/step", "total ms/step",
                               "cores busy"], cpu),
                       *section("How this was measured", [source(r)])]
        used.append(r)
    for folder in (r for r in results if r.folder):
        inner = _inner(folder)
        page.lines += [f"## Shard torch threads: {code(folder.name)}", "",
                       *table(["results file", "shard torch threads", "round trip s", "baseline / torchps",
                               "25.3M MLP async steps/s"],
                              [[code(x.name), x.get("config", "shard_torch_threads"), num(x.get("pullpush_seconds"), 3),
                                num(x.get("ratio")), sig(x.get("big_async_steps_per_s"))] for x in inner]),
                       *section("How these were measured", [source(x) for x in inner])]
        used.append(folder)
    page.lines += earlier([r for r in results if r not in used], [
        ("sections", lambda r: ", ".join(r.get("config", "sections") or [])),
        ("baseline / torchps", lambda r: num(r.get("ratio"))),
        ("seed MLP steps/s", lambda r: sig(r.get("mlp_async_steps_per_s"))),
        ("25.3M steps/s", lambda r: sig(r.get("big_async_steps_per_s")))])
    return page


# -- calls.py ---------------------------------------------------------------------------------------------------

def calls_page(results: list[Result]) -> Page:
    page = Page.start(
        "calls.md", "Tiny calls",
        "`bench/calls.py`: a tiny push, pull and exchange, one at a time, CPU per call of client and shard, "
        "beside a 100-byte echo on grpc.aio and on the synchronous gRPC server (gRPC's floor); and a push of a "
        "model of many small variables (`--variables`, 200 by default), what a shard spends per variable.")
    r = results[-1]
    rows = {f"torchps {call}": f for call, f in (r.get("torchps") or {}).items()}
    rows.update({"gRPC aio echo": r.get("grpc_aio_floor") or {}, "gRPC sync echo": r.get("grpc_sync_floor") or {}})
    if not any(rows.values()):
        return page
    page.figures["calls-cpu.svg"] = functools.partial(
        plot.stacked, {name: {"client CPU": f.get("client_cpu_ms", 0), "shard CPU": f.get("server_cpu_ms", 0)}
         for name, f in rows.items()}, xlabel="CPU ms per call", title=f"CPU per call, client and shard ({r.name})")
    page.lines += ["![CPU ms per call](calls-cpu.svg)", "",
                   *table(["call", "wall ms", "client CPU ms", "shard CPU ms"],
                          [[name, *(num(f.get(k), 3) for k in ("wall_ms", "client_cpu_ms", "server_cpu_ms"))]
                           for name, f in rows.items()]),
                   *table(["target", "met"], [[code(k), met(v)] for k, v in (r.get("targets") or {}).items()]),
                   *section("How this was measured",
                            [source(r, config={"calls": r.get("calls"), "variables": r.get("variables")})])]
    page.headline.append(("a tiny push: shard CPU ms per call (gRPC's echo floor)",
                          f"{num(r.get('torchps', 'push', 'server_cpu_ms'))} "
                          f"({num(r.get('grpc_aio_floor', 'server_cpu_ms'))})", r))
    page.lines += earlier(results[:-1], [("push shard CPU ms",
                                          lambda r: num(r.get("torchps", "push", "server_cpu_ms"))),
                                         ("200-variable push shard CPU ms",
                                          lambda r: num(r.get("torchps", "push_200_variables", "server_cpu_ms")))])
    return page


def serving_page(results: list[Result]) -> Page:
    page = Page.start(
        "serving.md", "Serving replicas",
        "`bench/serving.py`: one ps-serve replica beside two shards under a stream of row updates: how long a "
        "push takes to be visible at the replica (acknowledgement to a lookup that shows it), and how long a "
        "512-id lookup of the big table takes, seen by its caller and inside the replica.")
    r = results[-1]
    figures = [("rows of the big table", num(r.get("rows"), 0)),
               ("rows pushed per s (distinct ids per push)", num(r.get("rows_pushed_per_s"), 0)),
               ("rows applied by the replica per s", num(r.get("rows_applied_per_s"), 0)),
               ("visible after, p50 / p99 s", f"{num(r.get('visible_p50_s'), 3)} / {num(r.get('visible_p99_s'), 3)}"),
               ("lookup, caller's wall, p50 / p99 ms",
                f"{num(r.get('lookup_p50_ms'), 3)} / {num(r.get('lookup_p99_ms'), 3)}"),
               ("lookup, inside the replica, p50 / p99 ms",
                f"{num(r.get('replica_lookup_p50_ms'), 3)} / {num(r.get('replica_lookup_p99_ms'), 3)}"),
               ("replica's CPU (cores busy)", num(r.get("replica_cpu_per_s"), 2)),
               ("first whole read of the tables, s", num(r.get("first_read_s"), 1)),
               ("a replica's start from a checkpoint, s", num(r.get("checkpoint_start_s"), 1)),
               ("  its tables read whole / rows the shards sent",
                f"{num(r.get('checkpoint_start_resyncs'), 0)} / {num(r.get('checkpoint_start_rows_sent'), 0)}")]
    page.lines += [*table(["figure", "value"], [list(f) for f in figures]),
                   *table(["target", "met"], [[code(k), met(v)] for k, v in (r.get("targets") or {}).items()]),
                   *section("How this was measured", [source(r, config={
                       k: r.get(k) for k in ("rows", "dim", "seconds", "pushers", "batch", "rate", "replica_pinned")})])]
    page.headline.append(("serving replica: a push visible after, p99 s (bar 5)", num(r.get("visible_p99_s"), 3), r))
    return page


def freshness_page(results: list[Result]) -> Page:
    page = Page.start(
        "freshness.md", "Freshness pays",
        "`bench/freshness.py`: a DLRM trained online on a click stream whose click probabilities drift; each hour of "
        "the second day is scored before it is trained on, with the version a ps-serve replica follows (fresh) "
        "and with one held at the end of the first day (daily), beside the ground truth's own AUC. The same run "
        "on a stationary stream is the control: the gain a fresh model owes only to its extra hours of data.")
    r = results[-1]
    lines = []
    for name in ("drifting", "stationary"):
        got = r.get(name)
        if not got:
            continue
        rows = [[h.get("hour"), h.get("fresh_step"), num(h.get("fresh_auc"), 4), h.get("daily_step"),
                 num(h.get("daily_auc"), 4), num(h.get("oracle_auc"), 4)] for h in got.get("hours", [])]
        rows.append(["mean", "", num(got.get("fresh_auc"), 4), "", num(got.get("daily_auc"), 4),
                     num(got.get("oracle_auc"), 4)])
        lines += [f"The {name} stream: fresh - daily {num(got.get('fresh_minus_daily'), 4)} AUC, "
                  f"{got.get('hours_fresh_better')} of {len(got.get('hours', []))} hours better.", "",
                  *table(["hour scored", "fresh version's step", "fresh AUC", "daily version's step", "daily AUC",
                          "oracle AUC"], rows)]
    config = r.get("config") or {}
    page.lines += [*lines,
                   *table(["target", "met"], [[code(k), met(v)] for k, v in (r.get("targets") or {}).items()]),
                   *section("How this was measured", [source(r, config={
                       k: config.get(k) for k in ("cardinalities", "dim", "hours_per_day", "samples_per_hour",
                                                  "drift_hours", "churn", "batch_size", "seed")})])]
    page.headline.append(("serving the fresh version over the daily one, next hour's AUC gain (drifting stream)",
                          num(r.get("fresh_minus_daily"), 4), r))
    return page


def ctr_page(results: list[Result]) -> Page:
    page = Page.start(
        "ctr.md", "Criteo-shaped click-through rate",
        "`bench/ctr.py`: DLRM (the MLPs of DLRM's Criteo Kaggle run, a dynamic table on the shards per field) on "
        "days of a click stream of the Criteo Kaggle layout (13 dense features, 26 categorical fields with "
        "Kaggle's cardinalities up to a hash size, Zipf ids, clicks from a hidden model), trained sync and then "
        "async on the same days by shard and worker processes on one machine; the next day held out, scored by "
        "the chief. CPU counts every process of the job over the training. The bars (issue 42): "
        ">= 140 samples/s per core of the whole job's CPU, and async AUC within 0.002 of sync AUC.")
    r = results[-1]
    modes = r.get("modes") or {}
    names = list(modes)

    def mb(value) -> str:
        return MISSING if value is None else f"{value / 2**20:,.0f}"

    def each(what, fn) -> list:
        return [what, *(fn(modes[m]) for m in names)]

    data = r.get("data") or {}
    rows = [each("samples trained", lambda g: f"{g['samples']:,d}"), each("wall s", lambda g: num(g["wall_s"], 1)),
            each("samples/s", lambda g: sig(g["samples_per_s"])),
            each("CPU s: shards / workers / chief", lambda g: " / ".join(
                num(g["cpu_s"][k], 1) for k in ("shards", "workers", "chief"))),
            each("cores busy", lambda g: num(g["cores_busy"])),
            each("samples/s per core", lambda g: sig(g["samples_per_s_per_core"])),
            each("held-out AUC", lambda g: num(g["held_out_auc"], 4)),
            each("held-out log loss", lambda g: num(g["held_out_log_loss"], 4)),
            each("storage bytes read / written per sample (shards)", lambda g: (
                f"{num(g['storage_read_bytes_per_sample'], 1)} / {num(g['storage_write_bytes_per_sample'], 1)}")),
            each("gradient bytes pushed per sample", lambda g: sig(g["push_bytes_per_sample"])),
            each("chief peak RSS MB", lambda g: mb(g["chief_peak_rss_bytes"]))]
    shards = [[m, s, sig(f["rows_looked_up_per_s"]), sig(f["rows_updated_per_s"]), num(f["cpu_s"], 1),
               mb(f["peak_rss_bytes"]), f"{f['rows_held']:,d}"]
              for m in names for s, f in enumerate(modes[m]["shards"])]
    workers = [[m, w, " / ".join(num(v, 1) for v in f["cpu_s_by_stage"].values()), mb(f["peak_rss_bytes"])]
               for m in names for w, f in enumerate(modes[m]["workers"])]
    config = r.get("config") or {}
    page.lines += [*table(["figure", *names], rows),
                   f"async AUC - sync AUC: {num(r.get('auc_async_minus_sync'), 4)}; the hidden model's own AUC on "
                   f"the held-out day: {num(data.get('oracle_auc'), 4)}; its click rate "
                   f"{num(data.get('held_out_click_rate'), 3)}. `cache_hit_rate`: none ({r.get('cache_hit_rate_note')}).", "",
                   *table(["mode", "shard", "rows looked up/s", "rows updated/s", "CPU s", "peak RSS MB",
                           "rows held"], shards),
                   *table(["mode", "worker", "CPU s: lookup / compute / exchange", "peak RSS MB"], workers),
                   *table(["target", "met"], [[code(k), met(v)] for k, v in (r.get("targets") or {}).items()]),
                   *section("How this was measured", [source(r, config={
                       k: config.get(k) for k in ("days", "samples_per_day", "cardinality_cap", "criteo_tsv",
                                                  "alpha", "drift_days", "churn", "dim", "bottom", "top",
                                                  "batch_size", "workers", "ps", "server_arg", "seed")})])]
    page.headline += [("Criteo-shaped DLRM, async: samples/s per core of the whole job's CPU (bar >= 140)",
                       sig(r.get("async_samples_per_s_per_core")), r),
                      ("Criteo-shaped DLRM: held-out AUC, async - sync (bar within 0.002)",
                       num(r.get("auc_async_minus_sync"), 4), r)]
    page.lines += earlier(results[:-1], [
        ("async samples/s per core", lambda e: sig(e.get("async_samples_per_s_per_core"))),
        ("async - sync AUC", lambda e: num(e.get("auc_async_minus_sync"), 4))])
    return page


def host_shards_page(results: list[Result]) -> Page:
    page = Page.start(
        "host-shards.md", "Shard processes per host",
        "`bench/host_shards.py`: the model cut over k shard processes of one host, one client pushing and pulling "
        "all of it (lanes on); GB/s each way, the scaling against one shard and the efficiency (scaling / k; the "
        "issue's bar: 0.8, with a core per shard and one for the client).")
    r = results[-1]
    summary = r.get("summary") or {}
    page.lines += [*table(["shard processes", "GB/s each way", "scaling", "efficiency", "client CPU s/GB",
                           "shards CPU s/GB"],
                          [[k, num(f.get("gb_per_s_each_way")), num(f.get("scaling")), num(f.get("efficiency")),
                            num(f.get("client_cpu_s_per_gb"), 3), num(f.get("shards_cpu_s_per_gb"), 3)]
                           for k, f in summary.items()]),
                   *section("How this was measured", [source(r)])]
    largest = max(summary, key=int, default=None)
    if largest is not None and largest != "1":
        page.headline.append((f"{largest} shard processes on a host: scaling over one",
                              num(summary[largest].get("scaling")), r))
    return page


# -- the GPU check ----------------------------------------------------------------------------------------------

def _summary(r: Result) -> dict:
    return r.get("summary.json") or {}


def _gpu_source(r: Result):
    summary = _summary(r)
    env = summary.get("environment") or r.get("environment.json") or {}
    quick = " --quick" if summary.get("quick") else ""
    return source(r, derived=f"bash scripts/gpu_check.sh OUT{quick} (its device-bench check: bench/device.py "
                             f"--device {env.get('device', 'cuda')}{quick} --json OUT/device-bench.figures.json)",
                  config={k: env.get(k) for k in ("gpu", "cuda", "torch", "python", "cpus", "date") if k in env}
                  | {"quick": summary.get("quick")},
                  load=f"not recorded in the file; {env.get('cpus', '?')} CPUs, {env.get('gpus', '?')} x "
                       f"{env.get('gpu', '?')}")


def device_page(results: list[Result]) -> Page:
    page = Page.start(
        "device.md", "With the model on a GPU",
        "`scripts/gpu_check.sh` runs the GPU checks on a GPU machine; one of them, `bench/device.py`, times pull "
        "and push with the 25.3M MLP on the device and 2 CPU shards: pinned against pageable staging buffers, "
        "overlap off against on, and from CUDA events how much of a step's host<->device copy time runs beside "
        "compute or the wire.")
    with_bench = [r for r in results if _summary(r).get("checks", {}).get("device-bench", {}).get("setups")]
    if not with_bench:
        return page
    r = with_bench[-1]
    checks = _summary(r)["checks"]
    setups = checks["device-bench"]["setups"]
    page.figures["device-step.svg"] = functools.partial(
        plot.grouped, {name: {"step": f.get("step_seconds", 0) * 1e3, "wire": f.get("wire_ms_per_step"),
                "copies": f.get("copy_ms_per_step"), "compute": f.get("compute_ms_per_step")}
         for name, f in setups.items()}, ylabel="ms per step", fmt="{:.1f}",
        title=f"Where a step's time goes, per staging buffer / overlap ({r.name})")
    page.lines += ["## Where a step's time goes", "", "![ms per step: the step, the wire, the copies, compute]"
                   "(device-step.svg)", "",
                   "Copies: host<->device copy time per step from CUDA events; hidden: the share of it that ran "
                   "beside compute or the wire. With overlap on, the parts overlap and do not add up to the step.",
                   "", *table(["setup (buffers/overlap)", "steps/s", "step ms", "wire ms", "copies ms", "H2D ms",
                               "D2H ms", "compute ms", "hidden"],
                              [[name, sig(f.get("steps_per_second")), num(f.get("step_seconds", 0) * 1e3, 1),
                                num(f.get("wire_ms_per_step"), 1), num(f.get("copy_ms_per_step"), 1),
                                num(f.get("h2d_ms_per_step"), 1), num(f.get("d2h_ms_per_step"), 1),
                                num(f.get("compute_ms_per_step"), 1), num(f.get("hidden_fraction"), 3)]
                               for name, f in setups.items()]),
                   "## Every check of that run", "",
                   *table(["check", "status", "seconds", "test accuracy", "steps/s"],
                          [[name, c.get("status"), num(c.get("seconds"), 1), num(c.get("test_accuracy"), 4),
                            sig(c.get("steps_per_second"))] for name, c in checks.items()]),
                   *table(["bar", "figures", "met"], [[name, compact({k: v for k, v in b.items() if k != "met"}),
                                                       met(b.get("met"))]
                                                      for name, b in (_summary(r).get("bars") or {}).items()]),
                   *section("How this was measured", [_gpu_source(r)])]
    hidden = setups.get("pinned/on", {}).get("hidden_fraction")
    page.headline.append((f"model on a GPU ({checks['device-bench'].get('gpu', 'GPU')}): share of the copy time "
                          "hidden, pinned buffers, overlap on", num(hidden, 3), r))
    page.lines += earlier([x for x in results if x is not r], [
        ("date", lambda x: (_summary(x).get("environment") or {}).get("date", MISSING)),
        ("failed checks", lambda x: ", ".join(_summary(x).get("failed") or []) or "none"),
        ("pinned/off step ms", lambda x: num(_summary(x).get("checks", {}).get("device-bench", {}).get(
            "setups", {}).get("pinned/off", {}).get("step_seconds", 0) * 1e3, 1))])
    return page


# -- one table each ---------------------------------------------------------------------------------------------

def compression_page(results: list[Result]) -> Page:
    page = Page.start(
        "compression.md", "Compression's accuracy",
        "`bench/compression_accuracy.py` runs the README demo (`ps-launch`, 2 ps + 2 async workers, "
        "Fashion-MNIST) once per `--compression` policy, in interleaved rounds: the chief's final test accuracy "
        "and wall time.")
    r = results[-1]
    rows = r.get("table") or {}
    if not rows:
        return page
    runs = r.get("runs") or []
    accuracies = [x["test_accuracy"] for x in runs if x.get("test_accuracy") is not None]
    page.figures["compression-accuracy.svg"] = functools.partial(
        plot.spread, {p: [x["test_accuracy"] for x in runs if x.get("policy") == p] for p in rows},
        {p: f.get("test_accuracy") for p, f in rows.items()}, ylabel="test accuracy", fmt="{:.4f}",
        ylim=(min(accuracies, default=0.8) - 0.02, max(accuracies, default=1.0) + 0.01),
        title=f"Final test accuracy per compression policy (dots: each run; bar: median; {r.name})")
    loads = [x["loadavg"] for x in runs if x.get("loadavg") is not None]
    page.lines += ["![test accuracy per policy](compression-accuracy.svg)", "",
                   *table(["policy", "test accuracy (median)", "runs", "points vs none", "wall s (median)"],
                          [[code(p), num(f.get("test_accuracy"), 4),
                            ", ".join(num(a, 4) for a in f.get("accuracies", [])), num(f.get("points_vs_none")),
                            num(f.get("wall_seconds"), 1)] for p, f in rows.items()]),
                   *section("How this was measured", [source(
                       r, config={"policies": ",".join(rows), "rounds": len({x.get("round") for x in runs}),
                                  "dataset": ",".join(sorted({str(x.get("dataset")) for x in runs})),
                                  "nproc": r.get("nproc")},
                       load=f"1-minute load average after each run {num(min(loads))} to {num(max(loads))}; "
                            f"{r.get('nproc')} CPUs" if loads else "not recorded in the file")])]
    if "bf16" in rows:
        page.headline.append(("compression: bf16's test accuracy against float32's, points",
                              num(rows["bf16"].get("points_vs_none")), r))
    page.lines += earlier(results[:-1], [("policies", lambda r: ", ".join(r.get("table") or {}))])
    return page


def embedding_page(results: list[Result]) -> Page:
    page = Page.start(
        "embedding.md", "Embedding tables",
        "`bench/embedding.py`: a DLRM-like model whose embedding tables live on the "
        "shards (rows pulled and pushed per step), beside one plain torch process holding everything.")
    r = results[-1]
    page.lines += [*table(["variant", "what", "examples/s", "steps/s", "rows/s", "wire / unique-row floor"],
                          [[name, v.get("what"), sig(v.get("examples_per_s")), sig(v.get("steps_per_s")),
                            sig(v.get("rows_per_s")), num(v.get("wire_over_floor"), 3)]
                           for name, v in (r.get("variants") or {}).items()]),
                   *table(["one plain torch process", "value"],
                          [["torch threads (best)", r.get("local", "threads")],
                           ["examples/s", sig(r.get("local_examples_per_s"))]]),
                   f"Where a step's time goes ({r.get('headline_variant')}, ms per step):", "",
                   *table(["part", "ms"], [[k, num(v, 1)] for k, v in (r.get("breakdown_ms") or {}).items()]),
                   *table(["target", "threshold", "value", "met"],
                          [[t.get("what"), f"{t.get('op', '')} {t.get('threshold'):g}", sig(t.get("value")),
                            met(t.get("met"))] for t in (r.get("targets") or {}).values()]),
                   *section("How this was measured", [source(r)])]
    page.headline.append(("embedding tables: rows pulled + pushed per second", sig(r.get("rows_per_s")), r))
    page.lines += earlier(results[:-1], [("rows/s", lambda r: sig(r.get("rows_per_s")))])
    return page


def modes_page(results: list[Result]) -> Page:
    page = Page.start(
        "modes.md", "Async, sync and bounded staleness",
        "`bench/modes.py`: the same training in each mode, and what "
        "sync costs per step beyond a round trip.")
    r = results[-1]
    rows = [[model, mode, sig(f.get("steps_per_s")), num(f.get("step_ms"), 2), num(f.get("round_trip_ms"), 3),
             num(f.get("wait_seconds"), 3)]
            for model in ("small", "big") for mode, f in (r.get(model, "medians") or {}).items()]
    page.lines += [*table(["model", "mode", "steps/s", "step ms", "round trip ms", "wait s"], rows),
                   *table(["model", "sync overhead ms per step", "in round trips"],
                          [[m, num(r.get(m, "sync_overhead_ms")), num(r.get(m, "overhead_in_round_trips"))]
                           for m in ("small", "big") if r.get(m)]),
                   *section("How this was measured", [source(r, config={})])]
    page.lines += earlier(results[:-1], [])
    return page


def startup_page(results: list[Result]) -> Page:
    page = Page.start(
        "startup.md", "Start-up",
        "`bench/startup.py`: how long a LocalCluster and a whole `ps-launch` job take to start, "
        "with processes forked from a fork server against fresh interpreters; medians over interleaved rounds.")
    r = results[-1]
    keys = ["cluster_first_seconds", "cluster_next_seconds", "launch_wall_seconds", "launch_cpu_seconds"]
    page.lines += [*table(["figure", "forked", "fresh", "forked / fresh"],
                          [[k, num(r.get(k, "forked")), num(r.get(k, "fresh")),
                            num(r.get(k, "forked") / r.get(k, "fresh")) if r.get(k, "fresh") else MISSING]
                           for k in keys if r.get(k)]),
                   *section("How this was measured", [source(r, config={
                       k: r.get(k) for k in ("rounds", "clusters_per_process", "launch_args", "nproc", "torch")})])]
    page.headline.append(("start-up: a ps-launch job's wall time, forked / fresh interpreters",
                          num(r.get("launch_wall_ratio")), r))
    page.lines += earlier(results[:-1], [])
    return page


def scale_page(results: list[Result]) -> Page:
    page = Page.start(
        "scale.md", "Sync with hundreds of workers",
        "`bench/scale.py`: lightweight workers against 2 shards in sync mode, every worker counted each step "
        "(replicas_to_aggregate = workers), while a poller times GetStatus on both shards.")
    r = results[-1]
    keys = ["every_step_completed", "worker_error_count", "wall_seconds", "step_seconds_median", "getstatus_calls",
            "getstatus_p50_ms", "getstatus_p99_ms", "getstatus_max_ms", "max_waiting_calls_seen",
            "shard_threads_max_while_waiting", "shard_cpu_seconds"]
    page.lines += [*table(["figure", "value"], [[k, compact(r.get(k)) if isinstance(r.get(k), list) else
                                                 num(r.get(k)) if isinstance(r.get(k), float) else r.get(k)]
                                                for k in keys if k in r.data]),
                   *section("How this was measured", [source(r, config={
                       k: r.get(k) for k in ("workers", "replicas_to_aggregate", "shards", "steps", "processes",
                                             "floats_per_shard", "shard_threads_flag") if k in r.data})])]
    page.headline.append((f"sync with {r.get('workers')} workers: GetStatus p99 ms while they wait",
                          num(r.get("getstatus_p99_ms")), r))
    page.lines += earlier(results[:-1], [("workers", lambda r: r.get("workers"))])
    return page


def _cpu_of_source(r: Result):
    """cpu_of.py records the command it measured, not its own."""
    measured = shlex.join(str(part) for part in r.get("command") or [])
    flags = "".join(f"{part} " for part in r.get("flags") or [])
    run = code(f"python bench/cpu_of.py {flags}--json {r.path} -- {measured}")
    return source(r, command=f"{run} (derived: cpu_of.py records the command it measured)", config={},
                  load=r.get("run") or "not recorded in the file")


def _by_test_tables(r: Result) -> list[str]:
    """The test files and tests that took the most CPU in a run measured with --by-test (none without)."""
    lines = []
    for key, what, count in (("by_file", "test file", 15), ("by_test", "test", 15)):
        top = list((r.get(key) or {}).items())[:count]
        if top:
            lines += [f"The {count} {what}s that took the most CPU in {code(r.name)} (each process's CPU goes to "
                      "the test its xdist worker ran):", "",
                      *table([what, "CPU s"], [[code(name), num(cpu, 1)] for name, cpu in top])]
    return lines


def cpu_page(results: list[Result]) -> Page:
    page = Page.start(
        "suite-cpu.md", "The suite's CPU",
        "`bench/cpu_of.py` runs a command and adds up the CPU time of every process it "
        "started, by program: the test suite as CI runs it (`bash .ci/run` on a fresh clone) and the soak.")
    suites = [r for r in results if r.name.startswith("ci_cpu")]
    others = [r for r in results if r not in suites]
    if suites:
        page.figures["suite-cpu.svg"] = functools.partial(
            plot.grouped,
            {r.stem.removeprefix("ci_cpu_"): {"wall s": r.get("wall_s"), "CPU s": r.get("cpu_s")} for r in suites},
            ylabel="seconds", fmt="{:.0f}", height=4.2,
            title="The suite's wall time and CPU time per run, oldest first (name: commit and run)")
        newest = suites[-1]
        top = sorted((newest.get("by_program") or {}).items(), key=lambda kv: -kv[1].get("cpu_s", 0))[:12]
        page.lines += ["## The suite", "", "![wall and CPU seconds per suite run](suite-cpu.svg)", "",
                       *table(["results file", "pytest", "exit code", "wall s", "CPU s", "CPU / wall"],
                              [[code(r.name), r.get("pytest_summary", default=MISSING), r.get("exit_code"),
                                num(r.get("wall_s"), 0), num(r.get("cpu_s"), 0),
                                num(r.get("cpu_s") / r.get("wall_s")) if r.get("wall_s") else MISSING]
                               for r in reversed(suites)]),
                       f"The programs that took the most CPU in the newest run ({code(newest.name)}):", "",
                       *table(["program", "processes", "CPU s"],
                              [[code(p), f.get("processes"), num(f.get("cpu_s"), 1)] for p, f in top]),
                       *_by_test_tables(newest),
                       *section("How these were measured", [_cpu_of_source(r) for r in reversed(suites)])]
        page.headline.append(("the test suite (bash .ci/run, or its pytest line alone): wall s, CPU s",
                              f"{num(newest.get('wall_s'), 0)}, {num(newest.get('cpu_s'), 0)}", newest))
    if others:
        page.lines += ["## Other commands", "",
                       *table(["results file", "exit code", "wall s", "CPU s", "by program (CPU s)"],
                              [[code(r.name), r.get("exit_code"), num(r.get("wall_s"), 1), num(r.get("cpu_s"), 1),
                                ", ".join(f"{p} {num(f.get('cpu_s'), 1)}"
                                          for p, f in (r.get("by_program") or {}).items())]
                               for r in reversed(others)]),
                       *section("How these were measured", [_cpu_of_source(r) for r in reversed(others)])]
    return page


def other_page(results: list[Result]) -> Page:
    """Results files of no family this script knows: their top-level figures as they are."""
    page = Page.start(
        "other.md", "Other results",
        "Results files of benchmarks with no page of their own; their top-level figures as recorded.")
    for r in reversed(results):
        scalars = {k: v for k, v in r.data.items() if not isinstance(v, (dict, list))}
        page.lines += [f"## {code(r.name)}", "", *table(["key", "value"],
                                                       [[code(k), sig(v, 4) if isinstance(v, float) else v]
                                                        for k, v in scalars.items()]),
                       *section("How this was measured", [source(r)])]
    return page

