"""bench/pages.py's results as values: each results file (or folder) read once, ordered oldest first, and what it
records of how it was made (command, commit, machine load, configuration), plus the Markdown it is written with.

Nothing here invents a figure: a value missing from a file is shown as missing ("-", "not recorded").
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import shlex
import statistics
import subprocess
from typing import Any, Callable, Iterable

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MISSING = "-"
_COMMIT_TOKEN = re.compile(r"^(?=.*\d)[0-9a-f]{7,40}$")  # a name's part that is a commit: e836cbf, 4c9e1d1


@dataclasses.dataclass(frozen=True, eq=False)
class Result:
    """One results file, or one folder of them (a GPU check's output): `data` is the file's JSON, or for a
    folder {file name: JSON} of its .json files plus "commit.txt" when there is one."""

    name: str
    data: dict
    order: tuple

    @property
    def path(self) -> str:
        return f"bench/results/{self.name}" + ("/" if self.folder else "")

    @property
    def folder(self) -> bool:
        return not self.name.endswith(".json")

    @property
    def stem(self) -> str:
        return self.name.removesuffix(".json")

    def get(self, *keys: str, default: Any = None) -> Any:
        """The value under nested `keys`, or `default` where any is missing."""
        value: Any = self.data
        for key in keys:
            if not isinstance(value, dict) or key not in value:
                return default
            value = value[key]
        return value


def load(folder: pathlib.Path) -> list[Result]:
    """Every results file and folder in `folder`, oldest first: by the time of the git commit that last changed
    it (not yet committed: newest), then by the time of the commit the run records, then by name. Without git,
    by name only."""
    changed, dirty = _git_times(folder)
    entries = []
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            data = {p.name: _read(p) for p in sorted(path.glob("*.json"))}
            if not data:
                continue
            if (path / "commit.txt").is_file():
                data["commit.txt"] = (path / "commit.txt").read_text().strip()
        elif path.suffix == ".json":
            data = _read(path)
            if not isinstance(data, dict):
                data = {"value": data}
        else:
            continue
        entries.append((path.name, data))
    commit_times = _commit_times({c for name, data in entries if (c := _run_commit(name, data)[0])}, folder)
    results = []
    for name, data in entries:
        when = math.inf if name in dirty or name not in changed else changed[name]
        run = commit_times.get(_run_commit(name, data)[0] or "", 0.0)
        results.append(Result(name, data, (0.0 if not changed and not dirty else when, run, name)))
    return sorted(results, key=lambda r: r.order)


def _read(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise SystemExit(f"{path}: not JSON ({exc})") from None


def _git(folder: pathlib.Path, *args: str) -> str | None:
    try:
        run = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout if run.returncode == 0 else None


def _git_times(folder: pathlib.Path) -> tuple[dict[str, float], set[str]]:
    """{entry name: commit time of the last commit that changed it}, and the entries with changes not committed."""
    log = _git(folder, "log", "--format=%x00%ct", "--name-only", "--relative", "--", ".")
    if log is None:
        return {}, set()
    changed: dict[str, float] = {}
    when = 0.0
    for line in log.splitlines():
        if line.startswith("\0"):
            when = float(line[1:])
        elif line:
            changed.setdefault(line.split("/")[0], when)
    pending = (_git(folder, "diff", "--name-only", "--relative", "HEAD", "--", ".") or "") + \
        (_git(folder, "ls-files", "--others", "--exclude-standard", "--", ".") or "")
    return changed, {line.split("/")[0] for line in pending.splitlines() if line}


def _commit_times(commits: set[str], folder: pathlib.Path) -> dict[str, float]:
    times = {}
    for commit in sorted(commits):
        out = _git(folder, "show", "-s", "--format=%ct", commit + "^{commit}")
        if out and out.strip().isdigit():
            times[commit] = float(out.strip())
    return times


def _run_commit(name: str, data: dict) -> tuple[str | None, str]:
    """The commit the run records, and where it was read from."""
    for where in (data.get("git"), (data.get("environment") or {}).get("git")):
        if isinstance(where, dict) and where.get("commit"):
            return where["commit"], " (with uncommitted changes)" if where.get("dirty") else ""
    if isinstance(data.get("commit.txt"), str):
        return data["commit.txt"], " (commit.txt)"
    if isinstance(data.get("commit"), str) and "script" not in data:  # against.py's "commit" is the other side
        return data["commit"], ""
    for part in reversed(re.split(r"[_\-.]", name.removesuffix(".json"))):
        if _COMMIT_TOKEN.match(part):
            return part, " (from the file name)"
    return None, ""


# -- what a run records of how it was made -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Source:
    """How one results file was made, as a page states it beside a figure or table."""

    result: Result
    command: str
    commit: str
    load: str
    config: str


def source(r: Result, *, derived: str | None = None, config: dict | None = None, load: str | None = None,
           commit: str | None = None, command: str | None = None) -> Source:
    """`r`'s provenance: the command it records (else `derived`, built from the benchmark's own recording code,
    and said to be derived; `command`: the words to use instead), its commit, the machine's load and its
    configuration (`config`, else its "config")."""
    recorded = r.get("command") or r.get("environment", "command")
    if isinstance(recorded, list):
        recorded = shlex.join(str(part) for part in recorded)
    if command is None:
        command = (code(recorded) if recorded else "not recorded in the file" if not derived else
                   f"not recorded in the file; derived from what the script records and its code: {code(derived)}")
    if commit is None:
        found, how = _run_commit(r.name, r.data)
        commit = f"{code(found[:7])}{how}" if found else "not recorded in the file"
    cfg = config if config is not None else r.get("config")
    return Source(r, command, commit, load if load is not None else machine_load(r),
                  " ".join(code(f"{k}={compact(v)}") for k, v in cfg.items()) if cfg else "not recorded in the file")


def machine_load(r: Result) -> str:
    """The load the run recorded, in words; "not recorded" where it has none."""
    machine = r.get("machine") or r.get("environment", "machine")
    if isinstance(machine, dict) and machine.get("loadavg_start"):
        text = f"1-minute load average {machine['loadavg_start'][0]:.2f} at the start"
        if machine.get("loadavg_end"):
            text += f", {machine['loadavg_end'][0]:.2f} at the end"
        return text + f"; {machine.get('nproc', '?')} CPUs ({machine.get('cpu', '?')})"
    if r.get("load_average_before"):
        return (f"load average (1, 5, 15 min) {compact(r.get('load_average_before'))} before, "
                f"{compact(r.get('load_average_after'))} after; {r.get('cpus', default='?')} CPUs")
    if r.get("load_average"):
        return (f"load average (1, 5, 15 min) {compact([round(x, 2) for x in r.get('load_average')])} when the "
                f"results were written; {r.get('nproc', default='?')} CPUs")
    return "not recorded in the file"


def section(title: str, sources: Iterable[Source], level: int = 3) -> list[str]:
    """The lines stating how a figure or table was made, one block per results file it draws on."""
    sources = list(sources)
    lines = [f"{'#' * level} {title}", ""]
    if len(sources) > 3:
        return lines + table(["results file", "command", "commit", "machine load", "configuration"],
                             [[code(s.result.name), s.command, s.commit, s.load, s.config] for s in sources])
    for s in sources:
        lines += [f"- Results: `{s.result.path}`", f"    - Command: {s.command}", f"    - Commit: {s.commit}",
                  f"    - Machine load: {s.load}", f"    - Configuration: {s.config}"]
    return lines + [""]


# -- Markdown and numbers -----------------------------------------------------------------------------------

def code(text: str) -> str:
    """`text` as inline code, whatever backticks it holds."""
    text = str(text)
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}" if fence == "`" else f"{fence} {text} {fence}"


def compact(value: Any) -> str:
    if isinstance(value, (list, tuple)) and all(not isinstance(v, (dict, list)) for v in value):
        return ",".join(str(v) for v in value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), sort_keys=False)
    return str(value)


def num(value: Any, digits: int = 2) -> str:
    """A figure with `digits` decimals ("-" where missing or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return MISSING if not isinstance(value, bool) else ("yes" if value else "no")
    return f"{value:,.{digits}f}"


def sig(value: Any, digits: int = 3) -> str:
    """A figure to `digits` significant digits, without an exponent for everyday sizes."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return num(value)
    if value == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def met(value: Any) -> str:
    return {True: "met", False: "NOT met"}.get(value, MISSING)


def table(headers: list[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    """A Markdown table; a cell's "|" is escaped."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines + [""]


def median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return statistics.median(got) if got else None


@dataclasses.dataclass
class Page:
    """A page: its file name, title, Markdown lines, figures ({file name: what draws it, a matplotlib Figure})
    and `headline`: (what, value, the result it is from) rows for the overview's table."""

    file: str
    title: str
    lines: list[str]
    figures: dict = dataclasses.field(default_factory=dict)
    headline: list[tuple[str, str, Result]] = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, file: str, title: str, intro: str) -> Page:
        """A page holding its title and its first paragraph."""
        return cls(file, title, [f"# {title}", "", intro, ""])


def short_commit(r: Result) -> str:
    found, how = _run_commit(r.name, r.data)
    return code(found[:7]) + ("*" if "uncommitted" in how else "") if found else MISSING


def earlier(results: list[Result], columns: list[tuple[str, Callable[[Result], Any]]]) -> list[str]:
    """The "Earlier runs" table: `results` newest first, one row each with its file, commit and `columns`."""
    if not results:
        return []
    rows = [[code(r.name), short_commit(r), *(fn(r) for _, fn in columns)] for r in reversed(results)]
    return ["## Earlier runs", "",
            "Older results of this benchmark, which the figures above do not draw on, newest first; commit: the one "
            "the run records (* with uncommitted changes).", "",
            *table(["results file", "commit", *(h for h, _ in columns)], rows)]


def unused(results: list[Result], used: Iterable[Result]) -> list[str]:
    """A line naming the results files nothing on the page was drawn from."""
    left = [r for r in results if not any(r is u for u in used)]
    return ["Other results files of this benchmark, with nothing drawn from them here: "
            + ", ".join(code(r.name) for r in reversed(left)) + ".", ""] if left else []
