"""bench/pages.py's pages of what survives and what it costs: the chaos soak (soak.py), live resizes
(resize.py, and the soak's), a shard's memory (memory.py, against.py's comparisons), the journal (journal.py),
replicated shards (replication.py)."""

from __future__ import annotations

import functools

import pages_plot as plot
from pages_core import (MISSING, Page, Result, code, compact, earlier, machine_load, median, met, num, section,
                        sig, source, table)

RESIZE_KINDS = ["shard-added", "shard-removed", "worker-added", "worker-removed"]
MODEL_NAMES = {"small": "seed MLP", "large": "25.3M MLP"}  # replication.py's models


def _modes(r: Result) -> str:
    return ",".join(p.get("mode", "?") for p in r.get("phases") or [])


def soak_source(r: Result):
    """soak.py records its --minutes and --seed (and each phase's mode), not its command line."""
    modes = _modes(r)
    derived = (f"python bench/soak.py --minutes {r.get('minutes', default='?'):g} --seed {r.get('seed', default='?')}"
               + (f" --modes {modes}" if modes and modes != "async,sync" else "")
               + (" --replicas 2" if r.get("replicas") == 2 else "") + f" --json {r.path}")
    return source(r, derived=derived, config={"minutes": r.get("minutes"), "seed": r.get("seed"), "modes": modes})


def soak_page(results: list[Result]) -> Page:
    page = Page.start(
        "soak.md", "Chaos soak",
        "`bench/soak.py` runs real shards and workers under random faults (killed and paused workers and "
        "shards, cut connections, a full disk, a hostile evaluator, optimizer toggles) and live resizes, in an "
        "async phase then a sync phase, and audits what survived: every acknowledged push must be found exactly "
        "once, no process may hang, and each phase's final checkpoint must restore to the values served.")
    r = results[-1]
    phases = r.get("phases") or []
    faults = {kind: {f"{p.get('mode')} phase": p.get("faults_injected", {}).get(kind) for p in phases}
              for kind in sorted({k for p in phases for k in p.get("faults_injected", {})})}
    resizes = {kind: {f"{p.get('mode')} phase": p.get("resizes_by_kind", {}).get(kind) for p in phases}
               for kind in sorted({k for p in phases for k in p.get("resizes_by_kind", {})})}
    page.lines += [f"## The newest run: {code(r.name)}", ""]
    timelines = {f"{p.get('mode')} phase": p["timeline"] for p in phases if p.get("timeline")}
    if timelines:
        page.figures["soak-timeline.svg"] = functools.partial(
            plot.timeline, timelines, title=f"Faults, resizes and acknowledged pushes over time ({r.name})")
        page.lines += ["![faults, resizes and pushes acknowledged per second, per phase](soak-timeline.svg)", "",
                       "Each vertical line is a fault injected, grey spans are live resizes, red spans the time a "
                       "failed resize was left cut off until it was repaired; the line is the pushes acknowledged "
                       "each second (a dip to zero is training paused).", ""]
    else:
        page.lines += ["This run's file records no event times (newer runs of soak.py record them), so the "
                       "figures count the faults and resizes per kind and phase.", ""]
    if faults:
        page.figures["soak-faults.svg"] = functools.partial(
            plot.grouped, faults, ylabel="faults injected", fmt="{:.0f}", height=2.8,
            title=f"Faults injected per kind and phase ({r.name})")
        page.lines += ["![faults injected per kind and phase](soak-faults.svg)", ""]
    if resizes:
        page.figures["soak-resizes.svg"] = functools.partial(
            plot.grouped, resizes, ylabel="resizes", fmt="{:.0f}", height=2.8,
            title=f"Live resizes and resize faults per kind and phase ({r.name})")
        page.lines += ["![resizes per kind and phase](soak-resizes.svg)", ""]
    page.lines += table(
        ["phase", "seconds", "faults", "pushes acknowledged", "lost", "duplicated", "hangs", "wedged",
         "fail-stops", "resizes (failed / recovered)", "final checkpoint complete"],
        [[p.get("mode"), num(p.get("seconds"), 0), sum((p.get("faults_injected") or {}).values()),
          f"{p.get('pushes_acked', MISSING):,}", p.get("lost"), p.get("duplicated"), p.get("hangs"), p.get("wedged"),
          p.get("failstops"), f"{p.get('resizes', 0)} ({p.get('resizes_failed', 0)} / {p.get('resizes_recovered', 0)})",
          num(p.get("checkpoint_complete"))] for p in phases])
    page.lines += ["soak.py records `--minutes`, `--seed` and each phase's mode, not `--kinds` or `--fault-every`: "
                   "the kinds a run drew are those counted above.", "",
                   *section("How this was measured", [soak_source(r)])]
    page.headline.append((f"chaos soak, {r.get('minutes', default=0):g} minutes: acknowledged pushes lost / "
                          "duplicated, hangs",
                          f"{r.get('lost')} / {r.get('duplicated')} of {r.get('pushes_acked', default=0):,}, "
                          f"{r.get('hangs')}", r))
    page.lines += earlier(results[:-1], [
        ("minutes", lambda r: num(r.get("minutes"), 0)), ("seed", lambda r: r.get("seed")),
        ("faults", lambda r: sum((r.get("faults_injected") or {}).values())),
        ("resizes", lambda r: r.get("resizes", default=MISSING)),
        ("pushes acked", lambda r: f"{r.get('pushes_acked', default=0):,}"), ("lost", lambda r: r.get("lost")),
        ("duplicated", lambda r: r.get("duplicated")), ("hangs", lambda r: r.get("hangs")),
        ("checkpoint complete", lambda r: num(r.get("checkpoint_complete"))),
        ("resize pause p99 s", lambda r: num(r.get("resize_pause_p99_s"), 3))])
    return page


def resize_page(results: list[Result], soaks: list[Result]) -> Page:
    page = Page.start(
        "resize.md", "Live resizes",
        "`bench/resize.py` resizes a job 2 -> 4 -> 3 -> 2 shards while pusher processes push as fast as they "
        "can, and checks that every element ends exactly where the acknowledged pushes put it. The pause of a "
        "resize: each pusher's longest interval between two acknowledged pushes overlapping the resize, less its "
        "median interval away from every resize. Runs: `exact` (8 async pushers, 4M floats), `pause` (2 async "
        "pushers, a 100 MB model), `sync` (the same model, a sync job of 2 workers), `table` (a 100 MB embedding "
        "table re-laid out on each resize).")
    own = [r for r in results if r.get("results")]
    r = own[-1] if own else None
    if r is not None:
        runs = r.get("results")
        charts = {f"{x['run']} ({x['mode']}, {x['model_bytes'] / 1e6:.0f} MB)":
                  {f"{s['from']}->{s['to']}": {"pause p50": s.get("pause_p50_s"), "pause p99": s.get("pause_p99_s"),
                                               "move": s.get("move_seconds")} for s in x.get("resizes", [])}
                  for x in runs}
        page.figures["resize-pauses.svg"] = functools.partial(
            plot.panels, charts, ylabel="seconds", fmt="{:.2f}",
            title=f"Pause per resize and the move's seconds, per run ({r.name})")
        page.lines += ["## Pauses per run", "", "![pause p50 and p99 and move seconds per resize]"
                       "(resize-pauses.svg)", "",
                       *table(["run", "mode", "pushers", "model MB", "resize", "variables moved", "MB moved",
                               "move s", "pause p50 s", "pause p99 s", "pause max s", "exact sum"],
                              [[x["run"], x.get("mode"), x.get("pushers"), num(x.get("model_bytes", 0) / 1e6, 1),
                                f"{s['from']} -> {s['to']}", s.get("moved"), num(s.get("moved_bytes", 0) / 1e6, 1),
                                num(s.get("move_seconds")), num(s.get("pause_p50_s")), num(s.get("pause_p99_s")),
                                num(s.get("pause_max_s")), num(x.get("exact_sum"))]
                               for x in runs for s in x.get("resizes", [])]),
                       *section("How this was measured", [source(r, config={
                           "runs": ",".join(x["run"] for x in runs)})])]
        page.headline.append(("live resize under load: worst p99 pause over every run (resize.py)",
                              f"{num(r.get('resize_pause_p99_s'))} s", r))
    soak = next((s for s in reversed(soaks) if any(p.get("resize_events") for p in s.get("phases") or [])), None)
    if soak is not None:
        pauses: dict[str, list[float]] = {}
        for phase in soak.get("phases"):
            for event in phase.get("resize_events") or []:
                if event.get("pause_s") is not None:
                    pauses.setdefault(event["kind"], []).append(event["pause_s"])
        pauses = dict(sorted(pauses.items(), key=lambda kv: (kv[0] not in RESIZE_KINDS, kv[0])))
        page.figures["resize-soak-pauses.svg"] = functools.partial(
            plot.spread, pauses, {k: median(v) for k, v in pauses.items()}, ylabel="pause, seconds",
            title=f"Pause per resize in the chaos soak, by kind (dots: each resize; bar: median; {soak.name})")
        page.lines += ["## Pauses under chaos", "",
                       "The soak's resizes, among its faults: planned resizes, and resizes whose driver or "
                       "importer was killed or refused (recovered by `resume` or `abort`).", "",
                       "![pause per resize in the soak, by kind](resize-soak-pauses.svg)", "",
                       *table(["kind", "resizes", "pause median s", "pause max s"],
                              [[k, len(v), num(median(v), 3), num(max(v), 3)] for k, v in pauses.items()]),
                       *section("How this was measured", [soak_source(soak)])]
    page.lines += earlier([x for x in results if x is not r], [
        ("runs", lambda r: ", ".join(x.get("run", "?") for x in r.get("results") or [])),
        ("exact sum", lambda r: num(r.get("exact_sum"))),
        ("worst pause p99 s", lambda r: num(r.get("resize_pause_p99_s")))])
    return page


# -- memory.py and against.py ---------------------------------------------------------------------------------

def _memory_source(r: Result):
    cfg = r.get("config") or {}
    flags = [f"--{k.replace('_', '-')} {compact(cfg[k])}" for k in ("models", "optimizers", "shards") if k in cfg]
    flags += [f"--{k.replace('_', '-')}" for k in ("no_worker", "quick") if cfg.get(k)]
    return source(r, derived=" ".join(["python bench/memory.py", *flags, f"--json {cfg.get('json', r.path)}"]))


def against_source(r: Result):
    """against.py records the earlier commit, the benchmark and its arguments, the rounds and the medians."""
    keys = ",".join(next(iter((r.get("medians") or {}).values()), {}))
    this = next(iter((r.get("runs") or {}).get("this tree") or []), {})
    git = (this.get("git") or {}) if isinstance(this, dict) else {}
    ran = git.get("commit")
    return source(
        r, derived=f"python bench/against.py {r.get('commit')} --rounds {r.get('rounds')} --keys {keys} -- "
                   + " ".join(r.get("script") or []),
        config={"earlier commit": r.get("commit"), "benchmark": " ".join(r.get("script") or []),
                "rounds": r.get("rounds")},
        commit=f"this tree ({code(ran[:7])}{' with uncommitted changes' if git.get('dirty') else ''}) against "
               f"{code(r.get('commit'))}" if ran
        else f"this tree (its commit not recorded) against {code(r.get('commit'))}",
        load=machine_load(Result(r.name, this, r.order)) if isinstance(this, dict) else "not recorded in the file")


def against_table(results: list[Result]) -> list[str]:
    rows = []
    for r in results:
        medians = r.get("medians") or {}
        old, new = medians.get(r.get("commit"), {}), medians.get("this tree", {})
        rows += [[code(r.name), key, sig(old.get(key), 4), sig(new.get(key), 4),
                  num(new[key] / old[key], 3) if old.get(key) and new.get(key) is not None else MISSING]
                 for key in new]
    return ["## Against an earlier commit", "",
            "`bench/against.py` runs a benchmark on an earlier commit's torchps and on this tree in alternating "
            "rounds; medians over the rounds.", "",
            *table(["results file", "figure", "earlier commit", "this tree", "this tree / earlier"], rows),
            *section("How these were measured", [against_source(r) for r in results])]


def memory_page(results: list[Result]) -> Page:
    page = Page.start(
        "memory.md", "A shard's memory",
        "`bench/memory.py` measures what a shard keeps resident per byte it holds: RSS summed over the shards "
        "at each stage (empty, variables created, steady training, the peak of a push of every gradient and a "
        "pull of every variable at once), over the bytes held (values + optimizer state). Models: `seed` (the "
        "784-100-10 MLP), `big` (the 25.3M MLP), `1gib` (one 1 GiB variable); SGD without momentum and Adam; "
        "1 and 2 shards.")
    own = [r for r in results if isinstance(r.get("runs"), list)]
    against = [r for r in results if r.get("script")]
    r = own[-1] if own else None
    if r is not None:
        runs = r.get("runs")
        label = {id(x): f"{x['model']} {x['optimizer']} {x['num_ps']}ps" for x in runs}
        ratios = [x for x in runs if x.get("steady_ratio") is not None]
        targets = r.get("targets") or {}
        page.figures["memory-ratios.svg"] = functools.partial(
            plot.panels,
            {"steady: RSS above empty / bytes held": {label[id(x)]: {"steady": x["steady_ratio"]} for x in ratios},
             "peak: RSS above empty / bytes held": {label[id(x)]: {"peak": x.get("peak_ratio")} for x in ratios}},
            ylabel="RSS above empty / bytes held", line=[targets.get("steady_ratio"), targets.get("peak_ratio")],
            title=f"RSS per byte held, per model, optimizer and shard count (dashed: targets; {r.name})")
        page.lines += ["## RSS per byte held", "", "![steady and peak RSS per byte held](memory-ratios.svg)", "",
                       "The seed MLP holds too few bytes for a ratio to mean anything; its RSS is in the table.",
                       "", *table(["model", "optimizer", "shards", "held MB", "RSS empty MB", "RSS created MB",
                                   "RSS steady MB", "RSS peak MB", "steady ratio", "peak ratio"],
                                  [[x["model"], x["optimizer"], x["num_ps"], num(x["held_bytes"] / 1e6, 1),
                                    *(num(x[k] / 1e6, 0) for k in ("rss_empty", "rss_created", "rss_steady",
                                                                  "rss_peak")),
                                    num(x.get("steady_ratio"), 3), num(x.get("peak_ratio"), 3)] for x in runs]),
                       *table(["target", "threshold", "worst", "met"],
                              [[f"steady ({opt})", f"<= {targets.get('steady_ratio')}",
                                num(r.get(f"steady_ratio_{opt}"), 3),
                                met(r.get(f"steady_ratio_{opt}") <= targets["steady_ratio"])
                                if r.get(f"steady_ratio_{opt}") is not None and targets.get("steady_ratio")
                                else MISSING] for opt in ("sgd", "adam")])]
        worker = r.get("worker") or {}
        if worker:
            page.lines += ["## A worker", "", "A worker-like process on the 25.3M MLP: its RSS, and how many "
                           "copies of the parameters' bytes its parameters, gradients and client take.", "",
                           *table(["figure", "value"], [[k, num(v / 1e6, 1) + " MB" if k.startswith(("rss", "param_b"))
                                                         else num(v, 3)] for k, v in worker.items()])]
        page.lines += section("How this was measured", [_memory_source(r)])
        page.headline.append(("shard memory: worst steady RSS above empty / bytes held, SGD; Adam",
                               f"{num(r.get('steady_ratio_sgd'))}; {num(r.get('steady_ratio_adam'))}", r))
    if against:
        page.lines += against_table(against)
    page.lines += earlier(own[:-1], [("models", lambda r: ", ".join(r.get("config", "models") or [])),
                                     ("steady SGD", lambda r: num(r.get("steady_ratio_sgd"), 3)),
                                     ("steady Adam", lambda r: num(r.get("steady_ratio_adam"), 3))])
    return page


# -- journal.py -----------------------------------------------------------------------------------------------

def journal_page(results: list[Result]) -> Page:
    page = Page.start(
        "journal.md", "The journal",
        "`bench/journal.py` prices the shard's journal: 1 ps and 2 async workers train the 25.3M MLP with no "
        "journal (`plain`), with the journal (records in the page cache: the default) and with "
        "`--journal-sync`, interleaved; `--stores` compares what appending one 101 MB record costs the "
        "journal's log, SQLite and LMDB; `--calls` times control calls while gradients are pushed.")
    used = []
    training = [r for r in results if isinstance(r.get("rates"), dict)]
    if training:
        r = training[-1]
        rates = r.get("rates")
        page.figures["journal-steps.svg"] = functools.partial(
            plot.spread, rates, r.get("steps_per_s") or {}, ylabel="steps/s (both workers)",
            title=f"Training steps/s per setup (dots: each repeat; bar: median; {r.name})")
        cpu = r.get("cpu_per_step") or {}
        page.lines += ["## Steps/s with and without the journal", "", "![steps/s per setup](journal-steps.svg)", "",
                       *table(["setup", "ps-server flags", "steps/s (median)", "over plain", "compute ms/step",
                               "exchange ms/step", "ps ms/step", "cores busy"],
                              [[s, code(r.get("flags", s) or MISSING), sig(v),
                                num(r.get(f"{s}_over_plain")) if s != "plain" else MISSING,
                                *(sig(cpu.get(s, {}).get(k)) for k in ("compute_ms", "update_ms", "server_ms")),
                                num(cpu.get(s, {}).get("cores_busy"))]
                               for s, v in (r.get("steps_per_s") or {}).items()]),
                       f"Over plain: ratio of the medians (target >= {r.get('target')}); paired, the median of "
                       f"the per-repeat ratios: journal {num(r.get('journal_over_plain_paired'))}, journal_sync "
                       f"{num(r.get('journal_sync_over_plain_paired'))}.", "",
                       *section("How this was measured", [source(r)])]
        page.headline.append(("journal on: training steps/s over journal off", num(r.get("journal_over_plain")), r))
        used.append(r)
    stores = [r for r in results if isinstance(r.get("stores"), dict)]
    if stores:
        r = stores[-1]
        page.lines += ["## What one 101 MB record costs each store", "",
                       *table(["store", "CPU ms per record (median, steady state)"],
                              [[name, sig(ms)] for name, ms in r.get("stores").items()]),
                       *section("How this was measured", [source(r)])]
        used.append(r)
    calls = [r for r in results if isinstance(r.get("calls"), dict)]
    if calls:
        r = calls[-1]
        rows = [[shard, call, f.get("calls"), num(f.get("p50_ms"), 1), num(f.get("p99_ms"), 1), num(f.get("max_ms"), 1),
                 figures.get("pushes"), figures.get("compactions")]
                for shard, figures in r.get("calls").items() for call, f in figures.items() if isinstance(f, dict)]
        page.lines += ["## Control calls while gradients are pushed", "",
                       *table(["shard", "call", "calls", "p50 ms", "p99 ms", "max ms", "pushes", "compactions"], rows),
                       f"Target: the journaled shard's p99 under {num(r.get('target_ms'), 0)} ms for both calls: "
                       f"{met(r.get('met'))}.", "", *section("How this was measured", [source(r)])]
        used.append(r)
    against = [r for r in results if r.get("script")]
    if against:
        page.lines += against_table(against)
        used += against
    page.lines += earlier([r for r in results if r not in used], [
        ("journal over plain", lambda r: num(r.get("journal_over_plain")))])
    return page


def replication_page(results: list[Result]) -> Page:
    page = Page.start(
        "replication.md", "Replicated shards",
        "`bench/replication.py` prices a shard's backup and times its failover (issue #40). Cost: 1 ps + 2 "
        "workers train an MLP in two jobs started side by side, both with the journal on, one with a backup of "
        "its shard (`ps-server --replica-of`), in turns; the ratio is the replicated job's steps/s over the "
        "other's. Failover: ps 1's primary of a 2-shard job is SIGKILLed and its journal folder deleted (kill), "
        "or SIGSTOPped, cut off from everyone until its backup served, then resumed to find itself fenced "
        "(partition), while processes push gradients of ones; the backup's first acknowledged push is timed "
        "from the signal, and the values pulled at the end audited against the pushes acknowledged.")
    used = []
    costs = [r for r in results if r.get("cost")]
    if costs:
        r = costs[-1]
        cost = r.get("cost")
        charts = {mode: {MODEL_NAMES.get(model, model): {"ratio of the medians": g.get("ratio"),
                                                          "paired": g.get("ratio_paired")}
                         for model, by_mode in cost.items() for m, g in by_mode.items() if m == mode}
                  for mode in ("async", "sync") if any(mode in by_mode for by_mode in cost.values())}
        page.figures["replication-cost.svg"] = functools.partial(
            plot.panels, charts, ylabel="replicated / unreplicated steps/s",
            line=[r.get("targets", f"small_{mode}_ratio", "threshold") for mode in charts],
            title=f"Steps/s with a backup over without, per training mode (dashed: the bar; {r.name})")
        rows = []
        for model, by_mode in cost.items():
            for mode, g in by_mode.items():
                if "error" in g:
                    rows.append([MODEL_NAMES.get(model, model), mode, "failed: " + g["error"].splitlines()[0][:120],
                                 *[MISSING] * 8])
                for arm, cpu in (g.get("cpu_per_step") or {}).items():
                    rows.append([MODEL_NAMES.get(model, model), mode, arm, sig((g.get("steps_per_s") or {}).get(arm)),
                                 num(g.get("ratio"), 3) if arm == "replicated" else MISSING,
                                 *(sig(cpu.get(k)) for k in ("ps_ms", "backup_ms", "compute_ms", "update_ms",
                                                             "total_ms")), num(cpu.get("cores_busy"))])
        page.lines += ["## What a backup costs", "", "![replicated over unreplicated](replication-cost.svg)", "",
                       *table(["model", "training", "job", "steps/s (median)", "over unreplicated", "ps CPU ms/step",
                               "backup CPU ms/step", "compute ms/step", "exchange ms/step", "all CPU ms/step",
                               "cores busy"], rows),
                       "CPU per step: the ps and the backup from /proc over each window, the workers' own "
                       "(forward/backward, exchange()); all: their sum.", "",
                       *section("How this was measured", [source(r)])]
        page.headline += [(f"replicated over unreplicated steps/s, {MODEL_NAMES.get(model, model)}, {mode}",
                           num(g.get("ratio")), r)
                          for model, by_mode in cost.items() for mode, g in by_mode.items()]
        used.append(r)
    failovers = [r for r in results if isinstance(r.get("failover"), dict)]
    if failovers:
        r = failovers[-1]
        f = r.get("failover")
        times = f.get("failover_s") or []
        spreads = {"the first pusher's": times, "every pusher's": f.get("resumed_s") or []}
        page.figures["replication-failover.svg"] = functools.partial(
            plot.spread, spreads, {k: median(v) for k, v in spreads.items()}, fmt="{:.3f}",
            ylabel="s from the strike", title=f"Strike to the first push the promoted backup acknowledged (dots: "
            f"each round; bar: median; {r.name})")
        rows = [[k, x.get("strike", "kill"), "failed: " + x["error"].splitlines()[0][:120]] + [MISSING] * 5
                if "error" in x else
                [k, x.get("strike", "kill"), num(x.get("failover_s"), 3), num(x.get("resumed_s"), 3),
                 sum(p.get("acked", 0) for p in x.get("pushers", [])), x.get("lost"), x.get("duplicated"),
                 "yes" if x.get("exact") else "no"] for k, x in enumerate(f.get("rounds") or [], 1)]
        page.lines += ["## Failover", "", "![failover times](replication-failover.svg)", "",
                       *table(["round", "strike", "failover s", "every pusher s", "pushes acknowledged", "lost",
                               "duplicated", "values exact"], rows),
                       f"failover_s over {len(times)} rounds: p50 {num(f.get('failover_p50_s'), 3)}, p99 "
                       f"{num(f.get('failover_p99_s'), 3)}, max {num(f.get('failover_max_s'), 3)}; rounds that "
                       f"failed: {f.get('failed_rounds')}.", "", *section("How this was measured", [source(r)])]
        page.headline.append(("failover, strike to the backup's first acknowledged push, p99 s",
                              num(f.get("failover_p99_s"), 3), r))
        used.append(r)
    soaks = [r for r in results if r.get("replicas") == 2 and isinstance(r.get("failovers"), list)]
    if soaks:  # the newest full run (both modes, 10 minutes); a shorter one run to trace something is listed below
        r = next((s for s in reversed(soaks) if (s.get("minutes") or 0) >= 10), soaks[-1])
        by_kind: dict[str, list] = {}
        granted: dict[str, list] = {}  # the part up to the arbiter's grant (runs since promoted_s was recorded)
        for f in r.get("failovers"):
            by_kind.setdefault(f.get("kind"), []).append(f.get("failover_s"))
            granted.setdefault(f.get("kind"), []).append(f.get("promoted_s"))
        rows = [[kind, len(times), num(min((t for t in times if t is not None), default=None), 3),
                 num(max((t for t in times if t is not None), default=None), 3),
                 num(max((t for t in granted[kind] if t is not None), default=None), 3), sum(t is None for t in times)]
                for kind, times in sorted(by_kind.items())]
        page.lines += ["## Under chaos", "",
                       "The chaos soak with a backup beside each of its two shards ([the soak](../internals/soak.md)): "
                       "each strike of a primary timed from the signal to the first push its successor acknowledged, "
                       "and the slowest part of one up to its arbiter's grant of the promotion.",
                       "", *table(["strike", "failovers", "fastest s", "slowest s", "slowest to the grant s",
                                   "never served"], rows),
                       f"{r.get('pushes_acked', default=0):,} pushes acknowledged, lost {r.get('lost')}, duplicated "
                       f"{r.get('duplicated')}, hangs {r.get('hangs')}, wedged {r.get('wedged')}, final checkpoints "
                       f"complete: {num(r.get('checkpoint_complete'))}; partitioned primaries fenced "
                       f"{r.get('fenced')}; failover p99 {num(r.get('failover_p99_s'), 3)} s.", "",
                       *section("How this was measured", [soak_source(r)])]
        page.headline.append((f"replicated chaos soak, {r.get('minutes', default=0):g} minutes: lost / duplicated, "
                              "hangs, failover p99 s",
                              f"{r.get('lost')} / {r.get('duplicated')} of {r.get('pushes_acked', default=0):,}, "
                              f"{r.get('hangs')}, {num(r.get('failover_p99_s'), 3)}", r))
        used.append(r)
    targets = {k: t for r in used for k, t in (r.get("targets") or {}).items() if t.get("value") is not None}
    if targets:
        page.lines += ["## The bars", "", *table(["bar", "figure", ""], [
            [f"{t['what']} ({code(k)})", num(t["value"], 0 if isinstance(t["value"], int) else 3), met(t.get("met"))]
            for k, t in targets.items()])]
    page.lines += earlier([r for r in results if not any(r is u for u in used)], [
        *((f"{label} {training}", lambda r, key=f"{model}_{training}_ratio": num(r.get(key), 3))
          for model, label in (("small", "seed MLP"), ("large", "25.3M MLP")) for training in ("async", "sync")),
        ("failover p99 s", lambda r: num(r.get("failover_p99_s"), 3))])
    return page
