"""Message sizes as nccl-tests spells them: 8G, 512M, 1048576 (binary multiples, like its -b/-e flags)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a size: use bytes or a number with K, M, G or T (8G = 8 GiB)")
    size = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if size < 4 or size % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes (float32 elements)")
    return size


def show_size(size_bytes: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if size_bytes >= _UNITS[unit] and size_bytes % _UNITS[unit] == 0:
            return f"{size_bytes // _UNITS[unit]} {unit}iB"
    return f"{size_bytes} B"
