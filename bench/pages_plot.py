"""bench/pages.py's figures: a few kinds of bar chart drawn with matplotlib, saved as SVG that is the same bytes
each time for the same figures (fixed hash salt, no date, text kept as text)."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# One colour per run kind, the same on every figure; other names take the palette's next colours in turn.
COLOURS = {"tf": "#7f7f7f", "TensorFlow": "#7f7f7f", "fp32": "#1f77b4", "tls": "#d62728", "bf16": "#2ca02c",
           "topk": "#ff7f0e", "topk_delta": "#9467bd", "overlap": "#8c564b", "inline": "#e377c2",
           "journal": "#17becf", "journal_sync": "#bcbd22", "plain": "#1f77b4", "async": "#1f77b4",
           "sync": "#ff7f0e"}
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]
WIDTH = 9.0  # inches: every figure's width, about a docs page's text column


def style() -> None:
    """Matplotlib's defaults, then what makes the SVG reproducible and small."""
    matplotlib.style.use("default")
    matplotlib.rcParams.update({"svg.hashsalt": "torchps-bench-pages", "svg.fonttype": "none",
                                "font.family": "DejaVu Sans", "font.size": 9, "axes.spines.top": False,
                                "axes.spines.right": False, "figure.dpi": 100, "axes.axisbelow": True})


def save(fig: Figure, path: pathlib.Path) -> None:
    """Write `fig` as SVG without a date or a version in it, then free it."""
    fig.savefig(path, format="svg", metadata={"Date": None, "Creator": "bench/pages.py"})
    plt.close(fig)


def colours(names: list[str]) -> dict[str, str]:
    """{name: colour}: a run kind's own colour, else the palette's next one not taken by another name."""
    spare = iter(c for c in PALETTE * 3 if c not in {COLOURS.get(n) for n in names})
    return {n: COLOURS.get(n) or next(spare) for n in names}


def _series(groups: dict[str, dict[str, float | None]]) -> list[str]:
    seen: list[str] = []
    for values in groups.values():
        seen += [name for name in values if name not in seen]
    return seen


def bars(ax, groups: dict[str, dict[str, float | None]], *, fmt: str = "{:.2f}", line: float | None = None,
         series: list[str] | None = None, colour: dict[str, str] | None = None) -> None:
    """Grouped bars on `ax`: one group per key of `groups`, one bar per series name in it, each labelled with
    its value (turned upright where the bar is too narrow for it); a group's bars sit side by side, centred,
    whatever series it lacks. `line`: a dashed reference line (parity, a target)."""
    series = series or _series(groups)
    colour = colour or colours(series)
    present = [[s for s in series if values.get(s) is not None] for values in groups.values()]
    width = 0.8 / max([1, *map(len, present)])
    points = ax.get_position().width * ax.figure.get_figwidth() * 72  # the axes' width in points
    bar_points = points * width / max(1, len(groups))
    for name in series:
        xs, ys = [], []
        for g, values in enumerate(groups.values()):
            if name in present[g]:  # the group's bars side by side, centred on the group
                xs.append(g + width * (present[g].index(name) - (len(present[g]) - 1) / 2))
                ys.append(values[name])
        if xs:
            drawn = ax.bar(xs, ys, width * 0.95, label=name, color=colour[name])
            labels = [fmt.format(y) for y in ys]
            upright = max(map(len, labels)) * 4.2 > bar_points * 1.3  # wider than the bar: turn it
            ax.bar_label(drawn, labels=labels, fontsize=6 if upright else 7, padding=1, rotation=90 if upright else 0)
    _ticks(ax, list(groups))
    if line is not None:
        ax.axhline(line, color="black", linewidth=0.8, linestyle="--")
    if fmt == "{:.0f}":
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="y", linewidth=0.4, alpha=0.5)
    ax.margins(y=0.15)


def _ticks(ax, labels: list[str]) -> None:
    """Tick labels under the groups, turned when they would not fit side by side."""
    points = ax.get_position().width * ax.figure.get_figwidth() * 72
    crowded = sum(len(label) * 4.8 + 8 for label in labels) > points  # the labels' widths at 8 pt
    ax.set_xticks(range(len(labels)), labels, fontsize=8, rotation=30 if crowded else 0,
                  ha="right" if crowded else "center", rotation_mode="anchor")


def grouped(groups: dict[str, dict[str, float | None]], *, ylabel: str, title: str, fmt: str = "{:.2f}",
            line: float | None = None, height: float = 3.6) -> Figure:
    """One chart of grouped bars, its legend below it."""
    return panels({"": groups}, ylabel=ylabel, title=title, fmt=fmt, line=line, height=height)


def panels(charts: dict[str, dict[str, dict[str, float | None]]], *, ylabel: str | list[str], title: str,
           fmt: str = "{:.2f}", line: float | list[float | None] | None = None, height: float = 3.6) -> Figure:
    """Grouped bars side by side, one chart per key of `charts`, each on its own scale; `ylabel` and `line`
    per chart or one for all. The series share their colours and one legend."""
    fig, axes = plt.subplots(1, len(charts), figsize=(WIDTH, height), squeeze=False, layout="constrained")
    series = _series({(c, g): v for c, chart in charts.items() for g, v in chart.items()})
    colour = colours(series)
    for i, (ax, (name, groups)) in enumerate(zip(axes[0], charts.items())):
        bars(ax, groups, fmt=fmt, line=line[i] if isinstance(line, list) else line,
             series=[s for s in series if any(s in v for v in groups.values())], colour=colour)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel(ylabel[i] if isinstance(ylabel, list) else ylabel if i == 0 else "")
    if len(series) > 1:
        handles = [plt.Rectangle((0, 0), 1, 1, color=colour[s]) for s in series]
        fig.legend(handles, series, loc="outside lower center", ncols=min(len(series), 7), fontsize=7,
                   frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig


def stacked(rows: dict[str, dict[str, float]], *, xlabel: str, title: str) -> Figure:
    """Horizontal stacked bars, one row per key of `rows` (top first), one segment per part."""
    parts = _series(rows)
    colour = colours(parts)
    fig, ax = plt.subplots(figsize=(WIDTH, 1.3 + 0.38 * len(rows)), layout="constrained")
    labels = list(rows)[::-1]
    left = [0.0] * len(labels)
    for part in parts:
        widths = [rows[label].get(part, 0.0) for label in labels]
        ax.barh(labels, widths, left=left, color=colour[part], label=part, height=0.7)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", linewidth=0.4, alpha=0.5)
    fig.legend(fontsize=7, frameon=False, ncols=4, loc="outside lower center")
    return fig


def spread(groups: dict[str, list[float]], middle: dict[str, float | None], *, ylabel: str, title: str,
           fmt: str = "{:.2f}", ylim: tuple[float, float] | None = None) -> Figure:
    """One bar per group at `middle` (a median), every single figure of the group as a dot over it."""
    fig, ax = plt.subplots(figsize=(WIDTH, 3.4), layout="constrained")
    colour = colours(list(groups))
    for x, (name, values) in enumerate(groups.items()):
        if middle.get(name) is not None:
            drawn = ax.bar([x], [middle[name]], 0.6, color=colour[name], alpha=0.75)
            ax.bar_label(drawn, labels=[fmt.format(middle[name])], fontsize=7, padding=1)
        ax.plot([x] * len(values), values, "o", color="black", markersize=3)
    _ticks(ax, list(groups))
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", linewidth=0.4, alpha=0.5)
    return fig


def timeline(phases: dict[str, dict], *, title: str) -> Figure:
    """One panel per phase of a soak: pushes acknowledged per second, each fault a vertical line coloured by
    its kind, each live resize a grey span and each failed resize's time cut off a red one."""
    kinds = sorted({kind for phase in phases.values() for _, kind in phase.get("faults", [])})
    colour = colours(kinds)
    fig, axes = plt.subplots(len(phases), 1, figsize=(WIDTH, 2.4 * len(phases) + 0.9), squeeze=False)
    for ax, (name, phase) in zip(axes[:, 0], phases.items()):
        acked = phase.get("acked_per_second", [])
        ax.step(range(len(acked)), acked, where="post", color="#333333", linewidth=0.9, label="pushes acknowledged")
        for began, ended, _ in phase.get("resizes", []):
            ax.axvspan(began, max(ended, began + 0.2), color="#bbbbbb", alpha=0.5, linewidth=0)
        for began, ended, _ in phase.get("cut_off", []):
            ax.axvspan(began, max(ended, began + 0.2), color="#d62728", alpha=0.25, linewidth=0)
        for moment, kind in phase.get("faults", []):
            ax.axvline(moment, color=colour[kind], linewidth=1.2)
        ax.set_title(name, loc="left")
        ax.set_ylabel("pushes / s")
        ax.set_xlim(0, max(len(acked), 1))
    axes[-1, 0].set_xlabel("seconds since the phase began")
    handles = [plt.Line2D([], [], color="#333333", linewidth=0.9, label="pushes acknowledged per second"),
               plt.Rectangle((0, 0), 1, 1, color="#bbbbbb", alpha=0.5, label="live resize"),
               plt.Rectangle((0, 0), 1, 1, color="#d62728", alpha=0.25, label="failed resize, cut off"),
               *[plt.Line2D([], [], color=colour[k], linewidth=1.2, label=k) for k in kinds]]
    fig.legend(handles=handles, loc="lower center", ncol=4, frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig

