"""Memory of a benchmark's shard processes (bench/ctr.py's runs with tables on SSD): a memory cgroup that bounds a
process (the kernel reclaims its page cache, then kills it past the limit), and resident sets sampled every second.

A bound is a new memory cgroup under this process's own (cgroup v2 where the unified hierarchy has the memory
controller, else v1), removed by close() once its processes are gone. Where none can be made (no permission,
no memory controller), MemoryBound.make returns None and says why in `MemoryBound.unavailable`.
"""

from __future__ import annotations

import os
import pathlib
import threading

__all__ = ["MemoryBound", "RssSampler", "rss", "status_bytes"]

_ROOT = pathlib.Path("/sys/fs/cgroup")


def status_bytes(pid: int | str, field: str) -> int | None:
    """A memory field of /proc/PID/status (VmRSS: the resident set now, VmHWM: its peak), in bytes; None if the
    process is gone."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss(pid: int) -> int | None:
    """A process's resident set now, in bytes; None if it is gone."""
    return status_bytes(pid, "VmRSS")


def _own_cgroup() -> tuple[str, pathlib.Path] | None:
    """("v2" or "v1", the folder of this process's memory cgroup), or None."""
    unified = _ROOT / "cgroup.controllers"
    v2 = unified.exists() and "memory" in unified.read_text().split()
    for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if v2 and number == "0":
            return "v2", _ROOT / path.lstrip("/")
        if not v2 and "memory" in controllers.split(","):
            return "v1", _ROOT / "memory" / path.lstrip("/")
    return None


class MemoryBound:
    """A memory cgroup of `limit` bytes (see the module docstring)."""

    unavailable = ""

    def __init__(self, version: str, folder: pathlib.Path, limit: int):
        self.version, self.folder, self.limit = version, folder, limit

    @classmethod
    def make(cls, name: str, limit: int) -> MemoryBound | None:
        try:
            own = _own_cgroup()
            if own is None:
                cls.unavailable = "no memory cgroup controller"
                return None
            version, parent = own
            folder = parent / name
            folder.mkdir()
            (folder / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).write_text(str(limit))
            return cls(version, folder, limit)
        except OSError as exc:
            cls.unavailable = f"cannot make a memory cgroup: {exc}"
            return None

    def add(self, pid: int) -> None:
        """Moves process `pid` into the cgroup."""
        (self.folder / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        """Processes the kernel killed for the limit so far."""
        try:
            text = (self.folder / ("memory.events" if self.version == "v2" else "memory.oom_control")).read_text()
            fields = dict(line.split() for line in text.splitlines() if line.strip())
            return int(fields.get("oom_kill", 0))
        except (OSError, ValueError):
            return 0

    def peak(self) -> int | None:
        """The cgroup's peak memory (resident sets and page cache charged to it), in bytes."""
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                return int((self.folder / name).read_text())
            except (OSError, ValueError):
                continue
        return None

    def close(self) -> None:
        """Removes the cgroup (its processes must have exited)."""
        try:
            os.rmdir(self.folder)
        except OSError:
            pass


class RssSampler:
    """Reads the resident set of each process of `pids` ({name: pid}; set() replaces one) every `every` s from
    start() to stop(), keeping each name's largest and the number of samples."""

    def __init__(self, pids: dict[str, int], every: float = 1.0):
        self._pids, self._every = dict(pids), every
        self._lock = threading.Lock()
        self.largest: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._sample()
        self._thread.start()
        return self

    def set(self, name: str, pid: int) -> None:
        with self._lock:
            self._pids[name] = pid

    def _sample(self) -> None:
        with self._lock:
            for name, pid in self._pids.items():
                got = rss(pid)
                if got is not None:
                    self.largest[name] = max(self.largest.get(name, 0), got)
            self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self._sample()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return dict(self.largest)
