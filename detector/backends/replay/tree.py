"""The one shape both forms of `nvidia-smi -q` are read into: a tree of named sections and values.

Names are normalised so that the text labels and the XML tags of a field meet where nvidia-smi spells
them alike ("Product Name" and <product_name> are both `product_name`); where they differ, the field
tables in fields.py list each spelling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator

_NOT_WORD = re.compile(r"[^a-z0-9]+")
# What nvidia-smi prints for a value it does not have. "Unknown Error" is NVML failing for that field.
ABSENT = frozenset({"", "n/a", "[n/a]", "not supported", "[not supported]", "unknown error", "[unknown error]",
                    "requested functionality has been deprecated", "not available", "none available"})


def norm(name: str) -> str:
    """`GPU T.Limit Temp` -> `gpu_tlimit_temp`, `SRAM Uncorrectable SEC-DED` -> `sram_uncorrectable_secded`."""
    squeezed = name.strip().lower().replace(".", "").replace("-", "")
    return _NOT_WORD.sub("_", squeezed).strip("_")


@dataclass
class Node:
    """A section (with children), a value, or both: the text form nests reasons under a valued line
    ("HW Slowdown : Not Active" holds "HW Thermal Slowdown")."""

    name: str
    value: str | None = None
    children: list["Node"] = field(default_factory=list)

    def child(self, name: str) -> "Node | None":
        return next((c for c in self.children if c.name == name), None)

    def find(self, *path: str) -> "Node | None":
        node: Node | None = self
        for part in path:
            node = node.child(part) if node is not None else None
        return node

    def get(self, *paths: str) -> str | None:
        """The first present value among `paths` ("a/b" walks into sections); None when every one is
        absent or says N/A."""
        for path in paths:
            node = self.find(*path.split("/"))
            if node is not None and node.value is not None and node.value.strip().lower() not in ABSENT:
                return node.value.strip()
        return None

    def section(self, *names: str) -> "Node | None":
        for name in names:
            node = self.find(*name.split("/"))
            if node is not None:
                return node
        return None

    def walk(self) -> Iterator["Node"]:
        for c in self.children:
            yield c
            yield from c.walk()
