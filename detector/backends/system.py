"""The driver's plumbing on this machine: kernel modules, device files, services."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class SystemInfo:
    """What the driver's plumbing looks like now. A field that is None could not be read here
    (a container without the host's /proc or /run), which is not the same as absent."""

    fabric_manager_running: bool | None = None     # NVIDIA Fabric Manager's daemon (nv-fabricmanager)


class SystemReader(Protocol):
    def read(self) -> SystemInfo: ...


def host_system(sysfs_root: Path | None) -> Any:
    """The plumbing reader for this machine; None until the driver check provides one."""
    return None
