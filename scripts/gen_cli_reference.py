"""Writes docs/reference/cli.md: every torchps command's --help, as the installed commands print it.

    python scripts/gen_cli_reference.py            # after changing a command's flags
    python scripts/gen_cli_reference.py --check    # exit 1 if the page is not what the commands print

Each command runs from this interpreter's bin folder (the virtual environment's console scripts), with a fixed
terminal width so that argparse wraps the same on every machine.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "reference" / "cli.md"
COMMANDS = [
    ("ps-launch", "a whole job on this machine: shards, chief, workers, evaluator"),
    ("ps-launch scale", "add or remove workers of a running ps-launch job"),
    ("ps-server", "one shard"),
    ("ps-worker", "one worker, chief or evaluator"),
    ("ps-certs", "a job's CA, certificates and tokens"),
    ("ps-admin layout", "a running job's layout"),
    ("ps-admin resize", "change a running job's shards"),
    ("ps-admin drop-backup", "give up a replicated shard's backup lost with its copy"),
    ("ps-serve", "a serving replica that follows a training job"),
    ("ps-serve rollback", "switch a serving replica back to an earlier version"),
]
WIDTH = "100"


def help_text(command: str) -> str:
    program, *sub = command.split()
    binary = pathlib.Path(sys.executable).parent / program
    env = {**os.environ, "COLUMNS": WIDTH, "TERM": "dumb"}
    result = subprocess.run([str(binary), *sub, "--help"], capture_output=True, text=True, env=env, timeout=120,
                            check=False)
    if result.returncode != 0:
        raise SystemExit(f"{command} --help exited {result.returncode}:\n{result.stderr}")
    return result.stdout.rstrip() + "\n"


def page() -> str:
    parts = ["# Commands\n",
             "Every command's `--help`, as it prints it (made by `scripts/gen_cli_reference.py`; a test fails when "
             "this page and the commands disagree). The user guide explains them: "
             "[ps-launch](../guide/launch.md), [ps-worker](../guide/worker.md), "
             "[ps-server](../operations/ps-server.md), [ps-certs](../operations/security.md), "
             "[ps-admin](../operations/resizing.md), [ps-serve](../guide/serving.md).\n"]
    for command, what in COMMANDS:
        parts.append(f"## `{command}`\n\n{what[0].upper() + what[1:]}.\n\n```text\n{help_text(command)}```\n")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = page()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python scripts/gen_cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
