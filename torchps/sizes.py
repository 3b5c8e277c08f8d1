"""Sizes shared by the wire and the command lines, without torch: the chunk limits and "8G"-style sizes.

codec re-exports the chunk constants; ps-server's flags read them here, so a usage error is answered before
torch is imported.
"""

from __future__ import annotations

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_MAX_CHUNK_BYTES", "ENVELOPE_BYTES", "MIN_CHUNK_BYTES", "parse_bytes"]

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: the fastest pull chunk measured on loopback
DEFAULT_MAX_CHUNK_BYTES = 16 << 20  # largest chunk a shard accepts by default (ps-server --max-chunk-bytes)
ENVELOPE_BYTES = 64 << 10  # room for names, meta and framing around a chunk's data in one message
# Every chunk but a tensor's last carries at least this much: a stream of 1-byte chunks would cost a
# shard one message, a lock and a copy per byte.
MIN_CHUNK_BYTES = 64 << 10

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """'4G', '512M', '1048576' -> bytes (binary units); ValueError for anything else."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS and text[-1:] else ""
    number = float(text[:-1] if unit else text)
    if not number >= 0:
        raise ValueError(f"a size must be >= 0: {text!r}")
    return int(number * _UNITS[unit])
