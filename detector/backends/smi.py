"""Running nvidia-smi without ever letting it stall the caller."""

from __future__ import annotations

import os
from typing import Protocol

from detector.backends.children import ToolOutcome, run_tool

SmiOutcome = ToolOutcome
# nvidia-smi -q -x of an 8-GPU node is well under 1 MiB; 16 MiB is room for any node, and what is beyond it
# is not nvidia-smi's report.
OUTPUT_CAP = 16 << 20


class NvidiaSmi(Protocol):
    def run(self, args: list[str], timeout_s: float) -> SmiOutcome: ...


class SubprocessSmi:
    """The real binary (or any stand-in, such as fake-nvidia-smi), run with an argument list: no shell."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None):
        self.command = command
        self.env = env

    def run(self, args: list[str], timeout_s: float) -> SmiOutcome:
        env = {**os.environ, **self.env} if self.env else None
        return run_tool([*self.command, *args], timeout_s, OUTPUT_CAP, env)
