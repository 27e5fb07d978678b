"""A fake node's state as a JSON file, so another process (fake nvidia-smi) sees the same truth."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from fake_nvml.node import FakeNode, NodeState

STATE_ENV = "GPU_NPD_FAKE_STATE"        # path of a state file written by save_state
SCENARIO_ENV = "GPU_NPD_FAKE_SCENARIO"  # or: a scenario name/path, built fresh


def save_state(node: FakeNode, path: Path) -> None:
    """Write atomically: a reader never sees half a file."""
    data = json.dumps(node.snapshot().to_dict(), indent=1)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(data)
    os.replace(tmp, path)


def load_state(path: Path) -> NodeState:
    return NodeState.from_dict(json.loads(path.read_text()))


def mirror_to(path: Path) -> "callable":
    """An on_change hook for FakeNode that keeps `path` current after every fault."""
    def on_change(node: FakeNode) -> None:
        save_state(node, path)
    return on_change
