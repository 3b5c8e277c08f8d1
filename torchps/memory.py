"""Process-wide allocator tuning for bulk tensor traffic (glibc only; a no-op elsewhere).

glibc's malloc serves every large block with a fresh mmap and returns freed
memory to the kernel, so each 1 MiB message and each gradient buffer
page-faults anew: copies into fresh memory ran 8x slower than into touched
memory on the development machine (docs/peers.md), and the
transport benchmark moved 10-90% faster with the settings below. They keep
freed memory in the process for reuse, at the price of a larger resident
size. ps-server and ps-worker call this at start; library users may call it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["tune_malloc", "malloc_env"]

_LOGGER = logging.getLogger(__name__)
# (mallopt parameter from glibc's malloc.h, the same setting's environment variable, value)
_SETTINGS = (
    (-3, "MALLOC_MMAP_THRESHOLD_", 1 << 30),       # blocks below 1 GiB come from the heap, whose pages stay mapped
    (-1, "MALLOC_TRIM_THRESHOLD_", (1 << 31) - 1),  # keep freed heap memory instead of returning it at once
    (-2, "MALLOC_TOP_PAD_", 512 << 20),             # grow the heap in big steps
)


def malloc_env() -> dict[str, str]:
    """The same settings as environment variables, for processes that do not call tune_malloc."""
    return {name: str(value) for _, name, value in _SETTINGS}


def tune_malloc() -> bool:
    """Applies the settings above to this process; True if glibc accepted them."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    ok = all(mallopt(param, value) == 1 for param, _, value in _SETTINGS)
    _LOGGER.debug("malloc tuning %s", "applied" if ok else "refused")
    return ok
