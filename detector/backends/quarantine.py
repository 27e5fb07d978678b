"""Keep the evidence: a state file gpu-npd cannot read is moved aside, never overwritten or dropped.

A corrupt `problems.json` or kernel-log cursor is replaced at the next save; renaming it first keeps what
was in it (held problems an operator may still need, a cursor to compare) for a post-mortem.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def move_aside(path: Path, now: float | None = None) -> Path | None:
    """Rename `path` to `NAME.unreadable-YYYYmmddTHHMMSSZ` beside it; None when that fails too."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    target = path.with_name(f"{path.name}.unreadable-{stamp}")
    try:
        os.replace(path, target)
    except OSError:
        return None
    return target


def kept_at(path: Path) -> str:
    """The words for a report: where the unreadable file now is."""
    target = move_aside(path)
    return f"moved aside to {target}" if target else "and it could not be moved aside"
