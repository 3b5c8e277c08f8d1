#!/usr/bin/env python
"""Runs a benchmark against this tree and an earlier commit, alternately, and prints both side by side.

    python bench/against.py 5cb9bcd --rounds 3 --keys pullpush_seconds,pullpush_1ps_seconds -- \\
        bench/pullpush.py --only bandwidth --security plain --repeats 7
    python bench/against.py 5cb9bcd --rounds 1 --keys steady_ratio_sgd,peak_ratio -- bench/memory.py --quick
    python bench/against.py 9f01fdc --rounds 3 --keys torchps.push.server_cpu_ms -- bench/calls.py --calls 2000

The benchmark script is always this tree's; only the torchps package it
imports (and the ps-server processes it starts) differ. The commit's package
is assembled from `git archive` as pyproject.toml maps it, and run by an
interpreter that sees this environment's site-packages (torch, grpcio) but
not this tree's editable install. Each run writes its own JSON (--json is
added); the table shows the median of each key over the rounds, per side.
The machine is shared and noisy: rounds alternate (commit, this tree, ...)
so both sides see the same conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def assemble(commit: str, where: pathlib.Path) -> pathlib.Path:
    """The commit's torchps package under where/pkg, laid out as its pyproject.toml says."""
    source = where / "src"
    source.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    config = tomllib.loads((source / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = config.get("package-dir", {})
    pkg = where / "pkg"
    for package in config["packages"]:
        folder = mapping.get(package) or package.replace(".", "/")
        target = pkg / package.replace(".", "/")
        target.mkdir(parents=True, exist_ok=True)
        for file in (source / folder).iterdir():
            if file.is_file():
                (target / file.name).write_bytes(file.read_bytes())
    return pkg


def interpreter(where: pathlib.Path) -> pathlib.Path:
    """A bare venv whose only extra path is this environment's site-packages (no editable installs)."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin" / "python"


def run(python: str, env: dict, script: list[str], out: pathlib.Path, cwd: pathlib.Path) -> dict:
    started = time.monotonic()
    result = subprocess.run([python, str(ROOT / script[0]), *script[1:], "--json", str(out)], env=env, cwd=cwd,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{script[0]} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    print(f"  {time.monotonic() - started:.0f} s", file=sys.stderr)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("commit", help="the earlier commit (anything git archive takes)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, alternating (default 3)")
    parser.add_argument("--keys", required=True,
                        help="comma-separated JSON keys to compare; a.b.c for a key nested in the JSON's objects")
    parser.add_argument("--json", type=pathlib.Path, help="write every run's results and the medians here")
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        parser.error("give the benchmark and its arguments after --")
    split = argv.index("--")
    args, script = parser.parse_args(argv[:split]), argv[split + 1:]
    if not script:
        parser.error("give the benchmark after --")
    keys = args.keys.split(",")
    with tempfile.TemporaryDirectory(prefix="torchps-against-") as tmp:
        where = pathlib.Path(tmp)
        pkg = assemble(args.commit, where)
        sides = {args.commit: (str(interpreter(where)), {**os.environ, "PYTHONPATH": str(pkg)}),
                 "this tree": (sys.executable, dict(os.environ))}
        results: dict[str, list[dict]] = {side: [] for side in sides}
        for round_ in range(args.rounds):
            for side, (python, env) in sides.items():
                print(f"round {round_ + 1}/{args.rounds}: {side}", file=sys.stderr)
                # cwd: a folder without a torchps/ in it, so `python -m torchps.ps_server` imports the side's
                results[side].append(run(python, env, script, where / f"{len(results[side])}-{hash(side)}.json", where))
    figures = {side: [{k: _figure(r, k) for k in keys} for r in runs] for side, runs in results.items()}
    medians = {side: {k: statistics.median(f[k] for f in runs if f[k] is not None) for k in keys
                      if any(f[k] is not None for f in runs)} for side, runs in figures.items()}
    print(f"| key | {args.commit} | this tree | this tree / {args.commit} |\n| --- | --- | --- | --- |")
    for key in keys:
        old, new = medians[args.commit].get(key), medians["this tree"].get(key)
        ratio = f"{new / old:.3f}" if old and new is not None else "-"
        print(f"| {key} | {old if old is None else f'{old:.4g}'} | {new if new is None else f'{new:.4g}'} | {ratio} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"commit": args.commit, "script": script, "rounds": args.rounds,
                                         "medians": medians, "runs": results}, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


def _figure(result: dict, key: str):
    """The number at `key` in a run's JSON: a top-level key, or a dotted path through its objects (a key that
    holds a dot itself is taken whole first); None where there is none, or where it holds no number."""
    value = result.get(key)
    if value is None:
        value = result
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


if __name__ == "__main__":
    sys.exit(main())
