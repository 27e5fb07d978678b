"""The fake node's driver plumbing (kernel modules, device files, services), for the driver check."""

from __future__ import annotations

from typing import Any

from fake_nvml.node import FakeNode


def fake_system(node: FakeNode) -> Any:
    """A plumbing reader over the fake node; None until the driver check provides one."""
    return None
