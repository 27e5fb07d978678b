"""InfiniBand and RoCE ports as sysfs shows them (`<root>/class/infiniband/*/ports/*`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def sysfs_infiniband(sysfs_root: Path | None) -> Any:
    """The ports reader for this machine; None until the infiniband check provides one."""
    return None
