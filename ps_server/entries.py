"""Variables as they move between shards and sit in outboxes: store.snapshot() entries as bytes. No gRPC.

An entry is a dict of a variable's name, spec, value, version and optimizer state (store.py); a live
resize sends a list of them as torch.save bytes, read back with weights_only (tensors, numbers, strings,
lists and dicts only), so bytes from the wire can hold nothing else.
"""

from __future__ import annotations

import io

import torch

from ..errors import InvalidArgumentError

__all__ = ["encode_entries", "decode_entries"]


def encode_entries(entries: list[dict]) -> bytes:
    """store.snapshot() entries as bytes (torch.save)."""
    buffer = io.BytesIO()
    torch.save(entries, buffer)
    return buffer.getvalue()


def decode_entries(data: bytes) -> list[dict]:
    """encode_entries' bytes back as entries; InvalidArgumentError if they are not such bytes."""
    try:
        entries = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever torch.load raises for bytes that are not its own
        raise InvalidArgumentError(f"the moved state could not be read: {exc}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                                for e in entries):
        raise InvalidArgumentError("the moved state is not a list of variable entries")
    return entries
