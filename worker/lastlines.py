"""What ps-launch shows of a process that died: the lines of its log that explain the death, not merely its last.

    lines = LastLines()
    for line in output:                 # the process's log, as it comes (one reader thread)
        lines.append(line)
    for line in lines.shown():          # after it died: an excerpt of the log, in order
        print(line)
    death(-9)                           # 'killed by SIGKILL'

A process's last lines are often ordinary INFO lines printed after what went
wrong (or nothing at all went wrong in its log: it was killed). So `shown()`
keeps, in the log's order, its last traceback (whole, up to TRACEBACK_LINES),
its last NOTABLE_LINES warnings and errors (the torchps commands' WARNING,
ERROR and CRITICAL lines, and a command's one-line "PROG: error: ..."), and
its final FINAL_LINES lines, with one line saying how many were left out
wherever lines were skipped. Memory is bounded whatever the log's length.
"""

from __future__ import annotations

import collections
import re
import signal

__all__ = ["LastLines", "death"]

FINAL_LINES = 5        # the log's last lines, shown whatever they say
NOTABLE_LINES = 8      # the last warnings and errors kept
TRACEBACK_LINES = 40   # a longer traceback keeps its first line and its last TRACEBACK_LINES - 1
TRACEBACK = "Traceback (most recent call last):"
# "2025-01-02 03:04:05,678 WARNING ..." (the torchps commands' log format), or "ps-server: error: ..." (a usage error)
NOTABLE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (WARNING|ERROR|CRITICAL) |^[\w.-]+: error: ")


class LastLines:
    """A process's log lines, kept as `shown()` needs them. Not thread-safe: one thread appends, and `shown()`
    is read once that thread is done (or while it runs, for a process that failed to start)."""

    def __init__(self) -> None:
        self._count = 0
        self._final: collections.deque[tuple[int, str]] = collections.deque(maxlen=FINAL_LINES)
        self._notable: collections.deque[tuple[int, str]] = collections.deque(maxlen=NOTABLE_LINES)
        self._traceback: list[tuple[int, str]] = []  # the last traceback read to its end (its exception line)
        self._reading: tuple[tuple[int, str], collections.deque] | None = None  # a traceback being read

    def append(self, line: str) -> None:
        numbered = (self._count, line)
        self._count += 1
        self._final.append(numbered)
        if NOTABLE.match(line):
            self._notable.append(numbered)
        if line == TRACEBACK:
            self._reading = (numbered, collections.deque(maxlen=TRACEBACK_LINES - 1))
        elif self._reading is not None:
            self._reading[1].append(numbered)
            if line and not line[0].isspace():  # "SomeError: message", after the indented frames
                self._traceback = [self._reading[0], *self._reading[1]]
                self._reading = None

    def shown(self) -> list[str]:
        """The lines kept (see the module docstring), in the log's order, and "[... N lines ...]" for each run of
        lines left out."""
        kept = sorted(set(self._final) | set(self._notable) | set(self._traceback))
        shown, expected = [], 0
        for number, line in kept:
            if number > expected:
                shown.append(f"[... {number - expected} line{'s' * (number - expected > 1)} ...]")
            shown.append(line)
            expected = number + 1
        return shown


def death(returncode: int | None) -> str:
    """'killed by SIGKILL' for a process a signal ended (a negative return code), else ''."""
    if returncode is None or returncode >= 0:
        return ""
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"
