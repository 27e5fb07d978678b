"""The driver's plumbing on this machine: kernel modules, device files, services."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def host_system(sysfs_root: Path | None) -> Any:
    """The plumbing reader for this machine; None until the driver check provides one."""
    return None
