#!/usr/bin/env python
"""The CPU a command and every process it starts use, by program: for figures about CPU rather than wall time.

    python bench/cpu_of.py [--json F] [--every S] [--by-test N] -- COMMAND [ARGS...]

Runs COMMAND and reads /proc every S seconds (default 0.2) until it exits: each process descended from it
(children of a fork server included: they are the fork server's children) is counted at the last CPU time
(user + system) seen for it, under the name it had then (ps-server, ps-worker, soak-worker, ...). A process
that lives less than S seconds may be missed, and one that outlives COMMAND stops being counted when it
exits. Prints a table by program and the total; with --json, writes them too. Linux only. Exit code:
COMMAND's.

--by-test N (for a pytest-xdist run, `-- .venv/bin/python -m pytest -q tests`): also the N tests and test files
that used the most CPU. What a process used between two reads goes to the test its xdist worker ran at the
second read (the worker titles itself "[pytest-xdist running] TEST"): the worker, every process it started and
their children, fork servers' included. A test shorter than S shares its CPU with the next.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of `pid`, or None if it is gone."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS


XDIST_RUNNING = "[pytest-xdist running] "


def _words(pid: str) -> list[str] | None:
    """The command line of `pid` now, or None if it is gone."""
    try:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return [w.decode(errors="replace") for w in argv if w]


def _test_of(pid: int, parents: dict[int, int], titles: dict[int, str]) -> str:
    """The test the xdist worker above `pid` (or `pid` itself) runs now: "(no test)" where there is none."""
    seen = set()  # (a pid reused while /proc was read can make a cycle)
    while pid in parents and pid not in seen:
        if titles.get(pid, "").startswith(XDIST_RUNNING):
            return titles[pid].removeprefix(XDIST_RUNNING)
        seen.add(pid)
        pid = parents[pid]
    return "(no test)"


def _program(words: list[str]) -> str:
    """A process's program: a Python's script or module (`python -c` for code), else its command's name."""
    if not words:
        return "?"
    if os.path.basename(words[0]).startswith("python"):
        rest = words[1:]
        while rest and rest[0].startswith("-") and rest[0] not in ("-c", "-m"):
            rest = rest[1:]
        if rest[:1] == ["-c"]:
            return "python -c"
        if rest[:1] == ["-m"]:
            return rest[1] if len(rest) > 1 else "python -m"
        return os.path.basename(rest[0]) if rest else "python"
    return os.path.basename(words[0].split()[0])


def measure(command: list[str], every: float,
            by_test: dict[str, float] | None = None) -> tuple[int, float, dict[int, tuple[str, float]]]:
    """Runs `command`; (exit code, wall seconds, {pid: (program, CPU seconds)} of it and its descendants). With
    `by_test`, adds to it each test's CPU seconds (see --by-test)."""
    started = time.monotonic()
    root = subprocess.Popen(command)
    seen: dict[int, tuple[str, float]] = {}
    ours = {root.pid}
    while True:
        done = root.poll() is not None
        parents: dict[int, int] = {}
        titles: dict[int, str] = {}
        grown: dict[int, float] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            info, pid = _stat(name), int(name)
            if info is None or (pid not in ours and info[0] not in ours):
                continue  # another process's: its command line is never read
            words = _words(name)
            if words is None:
                continue
            program = _program(words)
            if program == "?" and pid in seen:  # a zombie's command line is empty: keep the name it ran under
                program = seen[pid][0]
            ours.add(pid)
            parents[pid], titles[pid] = info[0], " ".join(words)
            cpu = max(info[1], seen.get(pid, ("", 0.0))[1])
            grown[pid] = cpu - seen.get(pid, ("", 0.0))[1]
            seen[pid] = (program, cpu)
        if by_test is not None:
            for pid, cpu in grown.items():
                test = _test_of(pid, parents, titles)
                by_test[test] = by_test.get(test, 0.0) + cpu
        if done:
            break
        time.sleep(every)
    return root.returncode, time.monotonic() - started, seen


def _by_test(tests: dict[str, float], count: int) -> dict[str, dict[str, float]]:
    """The `count` tests and test files with the most CPU seconds, printed and returned for the JSON."""
    files: dict[str, float] = collections.defaultdict(float)
    for test, cpu in tests.items():
        files[test.split("::")[0]] += cpu
    result = {}
    for key, table in (("by_test", tests), ("by_file", files)):
        top = sorted(table.items(), key=lambda kv: -kv[1])[:count]
        print(f"\n{'cpu_s':>9}  {key.removeprefix('by_')} (of {len(table)})", file=sys.stderr)
        for name, cpu in top:
            print(f"{cpu:>9.1f}  {name}", file=sys.stderr)
        result[key] = {name: round(cpu, 2) for name, cpu in top}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    parser.add_argument("--every", type=float, default=0.2, help="seconds between two reads of /proc")
    parser.add_argument("--by-test", type=int, default=0, metavar="N",
                        help="also the N tests and test files of a pytest-xdist run that used the most CPU")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: python bench/cpu_of.py -- COMMAND [ARGS...]")
    tests: dict[str, float] | None = {} if args.by_test else None
    code, wall, seen = measure(command, args.every, tests)
    programs: dict[str, list[float]] = collections.defaultdict(list)
    for program, cpu in seen.values():
        programs[program].append(cpu)
    total = sum(cpu for _, cpu in seen.values())
    print(f"{'program':<24} {'processes':>9} {'cpu_s':>9}", file=sys.stderr)
    for program, cpus in sorted(programs.items(), key=lambda kv: -sum(kv[1])):
        print(f"{program:<24} {len(cpus):>9} {sum(cpus):>9.1f}", file=sys.stderr)
    print(f"{'total':<24} {len(seen):>9} {total:>9.1f}   wall {wall:.1f} s, exit code {code}", file=sys.stderr)
    flags = ["--every", str(args.every), *(["--by-test", str(args.by_test)] if args.by_test else [])]
    result = {"command": command, "flags": flags, "exit_code": code, "wall_s": round(wall, 2), "cpu_s": round(total, 2),
              "by_program": {p: {"processes": len(c), "cpu_s": round(sum(c), 2)} for p, c in programs.items()}}
    if tests is not None:
        result.update(_by_test(tests, args.by_test))
    print(json.dumps(result), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
