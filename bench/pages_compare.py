"""bench/pages.py's pages of torchps beside TensorFlow: training over shaped links (network.py), the same models
unshaped (peers.py), the data plane alone (dataplane.py, with its stage timers and perf profiles), and the
headline figure made from the first and the last.

Each setup or link on a figure (its TensorFlow run and every torchps variant) comes whole from the newest results
file that measured it: a ratio is never taken between two runs.
"""

from __future__ import annotations

import functools
import re

import pages_plot as plot
from pages_core import (MISSING, Page, Result, code, median, met, num, section, short_commit, sig, source, table,
                        unused)

LINKS = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s", "none": "unshaped"}
VARIANTS = ["fp32", "tls", "bf16", "topk", "topk_delta", "overlap", "inline", "journal"]
_NETWORK = re.compile(r"^link_(?P<link>[a-z0-9]+)_(?P<small>small_)?ratio_(?P<variant>.+)$")
_PEERS = re.compile(r"^(?P<setup>small|big_2ps|big)_ratio_(?P<variant>.+)$")
SETUPS = {"small": "seed MLP, 1 ps", "big": "25.3M MLP, 1 ps", "big_2ps": "25.3M MLP, 2 ps"}
CPU_RULE = ("CPU per step: every process of the run (user + system time from /proc) over the steps of both "
            "workers, the median over the rounds; torchps: workers + shards, TensorFlow: workers + ps + "
            "coordinator (network.py's own rule for its PS-cost figure).")


def _order(name: str, known: list[str]) -> tuple:
    return (known.index(name) if name in known else len(known), name)


def _cpu_ms(runs: list[dict] | None, tf: bool) -> float | None:
    """The median over `runs` of the CPU ms per step of the run's processes (network.py's ps_cost() sum)."""
    def total(run: dict) -> float | None:
        cpu = run.get("cpu_seconds_per_step") if isinstance(run, dict) else None
        if not isinstance(cpu, dict):
            return None
        parts = list(cpu.values()) if tf else [cpu.get("workers"), cpu.get("ps")]
        return None if None in parts or not parts else sum(parts) * 1e3
    return median(total(run) for run in runs or [])


def _newest_units(results: list[Result], units, size: int) -> tuple[dict[tuple, tuple[Result, dict]], list]:
    """{unit: (result, its figures)} where each group of units (a unit's first `size` parts: a setup, a link)
    comes whole from the newest result that measured it; and the (result, group, its units) that a newer result
    replaced."""
    groups: dict[tuple, tuple[Result, dict]] = {}
    replaced = []
    for r in results:
        mine: dict[tuple, dict] = {}
        for unit, figures in units(r).items():
            mine.setdefault(unit[:size], {})[unit] = figures
        for group, got in mine.items():
            if group in groups:
                replaced.append((groups[group][0], group, groups[group][1]))
            groups[group] = (r, got)
    chosen = {unit: (r, figures) for r, got in groups.values() for unit, figures in got.items()}
    return chosen, replaced


def _fp32(got: dict, key: str):
    return next((f[key] for unit, f in got.items() if unit[-1] == "fp32"), None)


def _replaced(replaced: list, label, headers: list[str], cells) -> list[str]:
    """The "Earlier runs" table of the groups a newer run measured again, newest first."""
    if not replaced:
        return []
    rows = [[code(r.name), short_commit(r), label(group),
             ", ".join(sorted({u[-1] for u in got}, key=lambda v: _order(v, VARIANTS))), *cells(r, got)]
            for r, group, got in sorted(replaced, key=lambda x: x[0].order, reverse=True)]
    return ["## Earlier runs", "",
            "Setups and links measured again by a newer run, which the figures above show; newest first; commit: "
            "the one the run records (* with uncommitted changes).", "",
            *table(["results file", "commit", "setup", "variants", *headers], rows)]


def _sources(chosen: dict) -> list:
    used = []
    for r, _ in chosen.values():
        if r not in used:
            used.append(r)
    return sorted(used, key=lambda r: r.order)


def _target(r: Result, key: str) -> str:
    target = r.get("targets", key)
    if not isinstance(target, dict) or target.get("threshold") is None:
        return MISSING
    at_most = target.get("op") == "<=" or (not target.get("op") and "<=" in str(target.get("what")))
    return f"{'<=' if at_most else '>='} {target['threshold']:g}: {met(target['met'])}"


def _training_figures(page: Page, stem: str, per: str, units: dict[tuple, dict], group) -> None:
    """Add to `page` the steps/s ratio chart and the CPU per step chart of training runs: one group of bars per
    `group(unit)` (a link, a setup), one bar per variant (a unit's last part), TensorFlow's CPU beside them."""
    ratios: dict[str, dict] = {}
    cpu: dict[str, dict] = {}
    for unit, figures in units.items():
        ratios.setdefault(group(unit), {})[unit[-1]] = figures["ratio"]
        cpu.setdefault(group(unit), {"tf": figures["tf_cpu"]})[unit[-1]] = figures["cpu"]
    page.figures[f"{stem}-ratio.svg"] = functools.partial(
        plot.grouped, ratios, ylabel="torchps / TensorFlow, steps/s", line=1.0,
        title=f"Steps/s, torchps ÷ TensorFlow, per {per} and variant (above 1: torchps faster)")
    page.figures[f"{stem}-cpu.svg"] = functools.partial(
        plot.panels, {g: {g: v} for g, v in cpu.items()}, ylabel="CPU ms per step", fmt="{:.3g}",
        title="CPU per training step, every process of the run (tf: TensorFlow)")
    page.lines += [f"## Steps/s per {per} and variant", "",
                   f"![torchps / TensorFlow steps/s per {per} and variant]({stem}-ratio.svg)", "",
                   "## CPU per step", "", f"![CPU ms per step per {per} and variant]({stem}-cpu.svg)", "",
                   CPU_RULE, ""]


# -- network.py -----------------------------------------------------------------------------------------------

def network_units(r: Result) -> dict[tuple, dict]:
    units = {}
    for key, ratio in r.data.items():
        m = _NETWORK.match(key)
        if not m or ratio is None:
            continue
        model, link, variant = ("small" if m["small"] else "big"), m["link"], m["variant"]
        pre = f"link_{link}_{m['small'] or ''}"
        raw = r.get("raw") or {}
        units[(model, link, variant)] = {
            "ratio": ratio, "tf": r.get(pre + "tf_steps_per_s"), "ours": r.get(f"{pre}{variant}_steps_per_s"),
            "tf_mb": r.get(pre + "tf_MB_per_step"), "mb": r.get(f"{pre}{variant}_MB_per_step"),
            "tf_cpu": _cpu_ms(raw.get(f"{link}/{model}/tf"), tf=True),
            "cpu": _cpu_ms(raw.get(f"{link}/{model}/{variant}"), tf=False), "target": _target(r, key)}
    return units


def _link_group(model: str, link: str) -> str:
    return LINKS.get(link, link) + (", seed MLP" if model == "small" else "")


def network_page(results: list[Result]) -> Page:
    chosen, replaced = _newest_units(results, network_units, 2)
    units = sorted(chosen, key=lambda u: (u[0] == "small", _order(u[1], list(LINKS)), _order(u[2], VARIANTS)))
    page = Page.start(
        "network.md", "Training over a link: torchps beside TensorFlow",
        "`bench/network.py` trains the same models with TensorFlow's ParameterServerStrategy and with torchps "
        "(1 ps, 2 asynchronous workers, SGD on the ps), each run in a network namespace of its own whose "
        "loopback is shaped to the link's rate (`tc ... tbf`; unshaped: no limit). torchps's variants: "
        "`fp32` (defaults), `tls` (mutual TLS + job token), `bf16` (compression both ways), `topk` (1% with "
        "error feedback), `topk_delta` (the same with delta pulls), `overlap`. The 25.3M-parameter MLP "
        "(784-8192-2304-10) unless named; the seed MLP is 784-100-10.")
    sources = _sources(chosen)
    if units:
        _training_figures(page, "network", "link", {u: chosen[u][1] for u in units}, lambda u: _link_group(*u[:2]))
        page.lines += ["## The figures", "",
                       *table(["model", "link", "variant", "TensorFlow steps/s", "torchps steps/s",
                               "torchps / TF", "target", "TF CPU ms/step", "torchps CPU ms/step",
                               "TF MB/step", "torchps MB/step", "results file"],
                              [[SETUPS["small" if m == "small" else "big"].split(",")[0], LINKS.get(l, l), v,
                                sig(f["tf"]), sig(f["ours"]), num(f["ratio"]), f["target"], sig(f["tf_cpu"]),
                                sig(f["cpu"]), sig(f["tf_mb"]), sig(f["mb"]), code(chosen[(m, l, v)][0].name)]
                               for (m, l, v) in units for f in [chosen[(m, l, v)][1]]]),
                       *section("How these were measured", [source(r) for r in sources])]
        for link in LINKS:
            if ("big", link, "fp32") in chosen:
                page.headline.append((f"training, 25.3M MLP, {LINKS[link]}: steps/s, torchps fp32 / TensorFlow",
                                      num(chosen[("big", link, "fp32")][1]["ratio"]), chosen[("big", link, "fp32")][0]))
    cost = [r for r in results if r.get("ps_cost_ratio") is not None]
    if cost:
        r = cost[-1]
        page.lines += ["## The PS's own CPU per step", "",
                       "Unshaped, 25.3M MLP, fp32: the run's CPU per step less the same framework's forward + "
                       "backward alone in one process, medians (`ps_cost_*` in the results file).", "",
                       *table(["", "torchps", "TensorFlow"],
                              [["the run's CPU ms per step", sig(r.get("step_cpu_ms_torchps")),
                                sig(r.get("step_cpu_ms_tf"))],
                               ["forward + backward alone, ms", sig(r.get("local_cpu_ms_torchps")),
                                sig(r.get("local_cpu_ms_tf"))],
                               ["the PS's own, ms", sig(r.get("ps_cost_ms_torchps")), sig(r.get("ps_cost_ms_tf"))],
                               ["torchps / TensorFlow", num(r.get("ps_cost_ratio")), _target(r, "ps_cost_ratio")]]),
                       *section("How this was measured", [source(r)])]
        sources.append(r)
    page.lines += _replaced(replaced, lambda g: _link_group(*g), ["fp32 / TF", "rounds"],
                            lambda r, got: [num(_fp32(got, "ratio")), r.get("config", "rounds")])
    page.lines += unused(results, [*sources, *(x[0] for x in replaced)])
    return page


# -- peers.py -------------------------------------------------------------------------------------------------

def peers_units(r: Result) -> dict[tuple, dict]:
    units = {}
    rounds = r.get("rounds") or []
    for key, ratio in r.data.items():
        m = _PEERS.match(key)
        if not m or ratio is None:
            continue
        setup, variant = m["setup"], m["variant"]

        def runs(entry: str) -> list:
            return [x.get("result") for x in rounds if x.get("setup") == setup and x.get("entry") == entry]
        units[(setup, variant)] = {
            "ratio": ratio, "paired": r.get("paired_ratios", key), "tf": r.get(f"tf_{setup}_steps_per_s"),
            "ours": r.get(f"{setup}_{variant}_steps_per_s"),
            "target": _target(r, "small_ratio" if key == "small_ratio_fp32" and "small_ratio_fp32" not in
                              (r.get("targets") or {}) else key),
            "tf_cpu": _cpu_ms(runs("tf"), tf=True), "cpu": _cpu_ms(runs(variant), tf=False)}
    return units


def peers_page(results: list[Result]) -> Page:
    chosen, replaced = _newest_units(results, peers_units, 1)
    units = sorted(chosen, key=lambda u: (_order(u[0], list(SETUPS)), _order(u[1], VARIANTS)))
    page = Page.start(
        "peers.md", "Unshaped training: torchps beside TensorFlow",
        "`bench/peers.py` runs TensorFlow's ParameterServerStrategy and torchps on the same models, data shapes "
        "and machine, interleaved round by round: the seed MLP (784-100-10) with 1 ps, the 25.3M-parameter MLP "
        "with 1 ps and with 2 ps (partitioned on both sides), 2 asynchronous workers, SGD on the ps. No link "
        "shaping (see [the link benchmark](network.md) for that).")
    sources = _sources(chosen)
    if units:
        _training_figures(page, "peers", "setup", {u: chosen[u][1] for u in units}, lambda u: SETUPS.get(u[0], u[0]))
        page.lines += ["## The figures", "",
                       "Ratio: of the medians over the rounds; paired: the median of the per-round ratios.", "",
                       *table(["setup", "variant", "TensorFlow steps/s", "torchps steps/s", "torchps / TF",
                               "paired", "target", "TF CPU ms/step", "torchps CPU ms/step", "results file"],
                              [[SETUPS.get(s, s), v, sig(f["tf"]), sig(f["ours"]), num(f["ratio"]),
                                num(f["paired"]), f["target"], sig(f["tf_cpu"]), sig(f["cpu"]),
                                code(chosen[(s, v)][0].name)]
                               for (s, v) in units for f in [chosen[(s, v)][1]]]),
                       *section("How these were measured", [source(r) for r in sources])]
        for setup in ("small", "big"):
            if (setup, "fp32") in chosen:
                page.headline.append((f"training, {SETUPS[setup]}, unshaped: steps/s, torchps fp32 / TensorFlow",
                                      num(chosen[(setup, "fp32")][1]["ratio"]), chosen[(setup, "fp32")][0]))
    page.lines += _replaced(replaced, lambda g: SETUPS.get(g[0], g[0]), ["fp32 / TF", "rounds"],
                            lambda r, got: [num(_fp32(got, "ratio")), r.get("config", "rounds")])
    page.lines += unused(results, [*sources, *(x[0] for x in replaced)])
    return page


# -- dataplane.py ---------------------------------------------------------------------------------------------

def dataplane_units(r: Result) -> dict[tuple, dict]:
    """The (setup, link, variant) figures of a run that was not profiled (perf's own cost is in a profiled
    run's figures)."""
    if r.get("config", "profile"):
        return {}
    medians = r.get("medians") or {}
    units = {}
    for key, figures in medians.items():
        setup, link, variant = (key.split("/") + ["", ""])[:3]
        tf = medians.get(f"{setup}/{link}/tf")
        ratio = r.get(f"{setup}_{link}_ratio_{variant}")
        if variant == "tf" or not tf or ratio is None:
            continue
        units[(setup, link, variant)] = {
            "ratio": ratio, "cpu_ratio": r.get(f"{setup}_{link}_cpu_ratio_{variant}"),
            "tf": tf.get("steps_per_s"), "ours": figures.get("steps_per_s"), "tf_cpu": tf.get("cpu_ms_per_step"),
            "cpu": figures.get("cpu_ms_per_step"), "stages": figures.get("stage_ms_per_step") or {},
            "target": _target(r, f"{setup}_{link}_ratio_{variant}"),
            "cpu_target": _target(r, f"{setup}_{link}_cpu_ratio_{variant}")}
    return units


def _dp_group(setup: str, link: str) -> str:
    return f"{setup}, {LINKS.get(link, link)}"


def dataplane_page(results: list[Result]) -> Page:
    chosen, replaced = _newest_units(results, dataplane_units, 2)
    units = sorted(chosen, key=lambda u: (u[0], _order(u[1], list(LINKS)), _order(u[2], VARIANTS)))
    steps: dict[str, dict] = {}
    cpu: dict[str, dict] = {}
    stages: dict[str, dict] = {}
    for setup, link, variant in units:
        figures = chosen[(setup, link, variant)][1]
        group = _dp_group(setup, link)
        steps.setdefault(group, {})[variant] = figures["ratio"]
        cpu.setdefault(group, {})[variant] = figures["cpu_ratio"]
        for stage, ms in sorted(figures["stages"].items()):
            stages.setdefault(group, {}).setdefault(stage, {})[variant] = ms
    page = Page.start(
        "dataplane.md", "The data plane alone: torchps beside TensorFlow",
        "`bench/dataplane.py`: workers that compute nothing, so that only the PS, the transport and the "
        "serialization are timed. Each step a worker pulls the whole 25.3M-parameter MLP (101 MB) and pushes a "
        "gradient of the same size; SGD on the ps. Setups: `1ps` (1 ps + 2 workers), `2ps` (2 ps + 4 "
        "workers); links as in [the link benchmark](network.md). Variants: `fp32`, `inline` (no bulk lanes: "
        "every byte over gRPC), `bf16`, `tls`, `journal` (the shards' journal on).")
    sources = _sources(chosen)
    if units:
        page.figures["dataplane-ratio.svg"] = functools.partial(
            plot.panels, {"steps/s, torchps ÷ TensorFlow (above 1: faster)": steps,
             "CPU per step, torchps ÷ TensorFlow (below 1: cheaper)": cpu},
            ylabel="torchps / TensorFlow", line=1.0, title="The data plane per setup, link and variant")
        page.lines += ["## Steps/s and CPU per step", "", "![torchps / TensorFlow steps/s and CPU per step, per "
                       "setup, link and variant](dataplane-ratio.svg)", "",
                       "CPU per step: every process of the run, TensorFlow's coordinator too, over the steps "
                       "(`cpu_ms_per_step`, medians over the rounds).", "",
                       *table(["setup", "link", "variant", "TensorFlow steps/s", "torchps steps/s", "torchps / TF",
                               "target", "TF CPU ms/step", "torchps CPU ms/step", "CPU torchps / TF",
                               "CPU target", "results file"],
                              [[s, LINKS.get(l, l), v, sig(f["tf"]), sig(f["ours"]), num(f["ratio"]), f["target"],
                                sig(f["tf_cpu"]), sig(f["cpu"]), num(f["cpu_ratio"]), f["cpu_target"],
                                code(chosen[(s, l, v)][0].name)]
                               for (s, l, v) in units for f in [chosen[(s, l, v)][1]]])]
        for link in LINKS:
            if ("1ps", link, "fp32") in chosen:
                f = chosen[("1ps", link, "fp32")][1]
                page.headline.append((f"data plane (no compute), 1 ps, {LINKS[link]}: steps/s, torchps fp32 / "
                                      f"TensorFlow; CPU per step, torchps / TensorFlow",
                                      f"{num(f['ratio'])}; {num(f['cpu_ratio'])}", chosen[("1ps", link, "fp32")][0]))
    if stages:
        page.figures["dataplane-stages.svg"] = functools.partial(
            plot.panels, stages, ylabel="ms per step (workers' average)", fmt="{:.0f}", height=4.0,
            title="Where a worker's step goes: the client's stage timers (WorkerStats.stage_seconds)")
        page.lines += ["## Where a step's time goes", "",
                       "![each stage's milliseconds per step, per variant](dataplane-stages.svg)", "",
                       "The workers' stage timers (`stage_ms_per_step`: wall time of each stage over the steps, "
                       "the workers' average, median over the rounds), from the runs in the table above. A call's "
                       "stage holds the stages inside it (`push_call` includes `push_encode` and "
                       "`push_lane_send`; `pull_call` includes `pull_into_place`), and the pull and push of a "
                       "step overlap, so the stages do not add up to the step.", ""]
    profiled = [r for r in results if any(isinstance(x.get("result"), dict) and x["result"].get("profile")
                                          for x in r.get("rounds") or [])]
    if profiled:
        r = profiled[-1]
        rows: dict[str, dict] = {}
        for run in r.get("rounds"):
            for process, p in sorted((run["result"].get("profile") or {}).items()):
                label = f"{run.get('entry')}: {process} (round {run.get('round')})"
                rows[label] = {g: p.get("cores", 0) * pct / 100 for g, pct in (p.get("groups") or {}).items()}
        page.figures["dataplane-profile.svg"] = functools.partial(
            plot.stacked, rows, xlabel="cores busy, split by what perf sampled (cores x share of samples)",
            title=f"CPU by kind of work, per process (perf record -a -g, {r.name})")
        page.lines += ["## Where the CPU goes: perf", "", "![cores busy per process, by kind of work]"
                       "(dataplane-profile.svg)", "",
                       "`--profile`: `perf record -a -g` for a few seconds inside the timed window, each "
                       "process's self time grouped by kind (`bench/perf_profile.py`), times the cores it kept "
                       "busy. A profiled run's steps/s include perf's own cost, so it is not drawn above.", "",
                       *table(["run: process", "cores", "kernel %", "top symbol"],
                              [[f"{run.get('entry')}: {process}", num(p.get("cores")), num(p.get("kernel_percent"), 1),
                                code((p.get("top") or [{}])[0].get("symbol", MISSING)[:80])]
                               for run in r.get("rounds")
                               for process, p in sorted((run["result"].get("profile") or {}).items())])]
        sources.append(r)
    page.lines += section("How these were measured", [source(r) for r in sources], level=2)
    page.lines += _replaced(replaced, lambda g: _dp_group(*g), ["fp32 / TF", "CPU fp32 / TF", "rounds"],
                            lambda r, got: [num(_fp32(got, "ratio")), num(_fp32(got, "cpu_ratio")),
                                            r.get("config", "rounds")])
    page.lines += unused(results, [*sources, *(x[0] for x in replaced)])
    return page


# -- the headline -----------------------------------------------------------------------------------------------

def headline(network: list[Result], dataplane: list[Result]):
    """What draws the README's figure (None without figures), and the results it uses: per link, torchps fp32
    over TensorFlow in steps/s and in CPU per step, training the 25.3M MLP (network.py) and moving it with no
    compute (dataplane.py, 1 ps), each link from its newest run."""
    train = _newest_units(network, network_units, 2)[0]
    plane = _newest_units(dataplane, dataplane_units, 2)[0]
    steps: dict[str, dict] = {}
    cpu: dict[str, dict] = {}
    for link, name in LINKS.items():
        if ("big", link, "fp32") in train:
            f = train[("big", link, "fp32")][1]
            steps.setdefault(name, {})["training (network.py)"] = f["ratio"]
            cpu.setdefault(name, {})["training (network.py)"] = \
                f["cpu"] / f["tf_cpu"] if f["cpu"] and f["tf_cpu"] else None
        if ("1ps", link, "fp32") in plane:
            f = plane[("1ps", link, "fp32")][1]
            steps.setdefault(name, {})["no compute (dataplane.py)"] = f["ratio"]
            cpu.setdefault(name, {})["no compute (dataplane.py)"] = f["cpu_ratio"]
    if not steps:
        return None, []
    draw = functools.partial(
        plot.panels, {"steps/s, torchps ÷ TensorFlow (above 1: faster)": steps,
                      "CPU per step, torchps ÷ TensorFlow (below 1: cheaper)": cpu},
        ylabel="torchps fp32 / TensorFlow", line=1.0,
        title="torchps beside TensorFlow's ParameterServerStrategy, 25.3M-parameter MLP, 1 ps")
    used = [r for r, _ in [*(train[u] for u in train if u[0] == "big" and u[2] == "fp32"),
                           *(plane[u] for u in plane if u[0] == "1ps" and u[2] == "fp32")]]
    return draw, sorted(set(used), key=lambda r: r.order)
