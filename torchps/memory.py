"""Process memory: the allocator settings torchps runs with, and where the bytes are (glibc and Linux only;
elsewhere the settings are a no-op and the figures 0).

glibc's malloc serves a block from a heap, whose freed memory it keeps for
reuse, or, from a size up, from a mapping of its own that goes back to the
kernel when freed. The two roles want different settings, chosen with
bench/memory.py and bench/pullpush.py (docs/memory.md):

- a shard (tune_malloc("shard")) must stay near what it holds: blocks of
  4 MiB and more (a gradient being received, an update's temporaries, a pulled
  remainder) are mapped on their own and given back after each push; smaller
  ones (the 1 MiB messages of a stream) come from at most two heaps, which
  keep up to 4 MiB of freed memory at their top and grow 4 MiB at a time.
  glibc's default would raise the 4 MiB threshold as big blocks are freed (up
  to 32 MiB), after which they stay in a heap for good;
- a worker (tune_malloc("worker"), the default) allocates the same gradient
  and activation blocks every step: it keeps freed memory (blocks below 1 GiB
  from the heap, never trimmed, grown 512 MiB at a time) instead of faulting
  them in afresh each step.

ps-server and ps-worker call tune_malloc at start; library users may call it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib

__all__ = ["tune_malloc", "malloc_env", "memory_usage", "memory_limit"]

_LOGGER = logging.getLogger(__name__)
# role -> (mallopt parameter from glibc's malloc.h, the same setting's environment variable, value)
_SETTINGS = {
    "shard": (
        (-3, "MALLOC_MMAP_THRESHOLD_", 4 << 20),  # blocks from 4 MiB up: mapped on their own, returned when freed
        (-1, "MALLOC_TRIM_THRESHOLD_", 4 << 20),  # return freed memory at a heap's top beyond 4 MiB
        (-2, "MALLOC_TOP_PAD_", 4 << 20),         # grow a heap 4 MiB at a time
        (-8, "MALLOC_ARENA_MAX", 2),              # at most 2 heaps: freed memory is found again by other threads
    ),
    "worker": (
        (-3, "MALLOC_MMAP_THRESHOLD_", 1 << 30),       # blocks below 1 GiB come from the heap, whose pages stay
        (-1, "MALLOC_TRIM_THRESHOLD_", (1 << 31) - 1),  # keep freed heap memory instead of returning it
        (-2, "MALLOC_TOP_PAD_", 512 << 20),             # grow the heap in big steps
    ),
}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc():
    """The symbols this process has loaded (libc's among them), or None."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def malloc_env(role: str = "worker") -> dict[str, str]:
    """A role's settings as environment variables, for processes that do not call tune_malloc."""
    return {name: str(value) for _, name, value in _SETTINGS[role]}


def tune_malloc(role: str = "worker") -> bool:
    """Applies `role`'s settings ("shard" or "worker") to this process; True if glibc accepted them all."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    results = [mallopt(param, value) == 1 for param, _, value in _SETTINGS[role]]
    _LOGGER.debug("malloc tuning %s", "applied" if all(results) else "partly refused")
    return all(results)


def memory_usage() -> dict[str, int]:
    """This process's memory now, as ps.proto's MemoryUsage fields; 0 for what the platform does not tell."""
    usage = dict(rss_bytes=0, peak_rss_bytes=0, heap_in_use_bytes=0, heap_free_bytes=0, mapped_bytes=0)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    usage["rss_bytes" if key == "VmRSS" else "peak_rss_bytes"] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    mallinfo2 = getattr(_libc(), "mallinfo2", None)  # glibc 2.33+
    if mallinfo2 is not None:
        mallinfo2.restype = _MallInfo2
        info = mallinfo2()  # sums over all of malloc's heaps (arenas)
        usage.update(heap_in_use_bytes=info.uordblks, heap_free_bytes=info.fordblks, mapped_bytes=info.hblkhd)
    return usage


def memory_limit() -> int:
    """Bytes this process may use: the machine's memory (MemTotal), or its cgroup's limit (a container's, a
    Kubernetes pod's: cgroup v2 memory.max, v1 memory.limit_in_bytes) where that is lower; 0 if unknown."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            limits += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")]
    except (OSError, ValueError, IndexError):
        pass
    for path in _cgroup_limit_files():
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
        break  # the innermost readable one is the process's own
    return min(limits, default=0)


def _cgroup_limit_files() -> list[pathlib.Path]:
    """Where this process's cgroup memory limit may be read, innermost first."""
    root = pathlib.Path("/sys/fs/cgroup")
    files = []
    try:
        lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return files
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: one hierarchy
            files += [root / path.lstrip("/") / "memory.max", root / "memory.max"]
        elif "memory" in controllers.split(","):
            files += [root / "memory" / path.lstrip("/") / "memory.limit_in_bytes", root / "memory" / "memory.limit_in_bytes"]
    return [f for f in files if f.exists()]
