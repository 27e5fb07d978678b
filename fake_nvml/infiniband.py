"""The fake node's InfiniBand/RoCE ports, for the infiniband check."""

from __future__ import annotations

from typing import Any

from fake_nvml.node import FakeNode


def fake_infiniband(node: FakeNode) -> Any:
    """A ports reader over the fake node; None until the infiniband check provides one."""
    return None
