"""Collapse repeated XID lines into one observation each, so a flood of 800,000 identical lines is
one observation with count 800,000, in bounded memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from detector.checks.xid.parser import KernelEvent
from detector.core.types import GpuRef

MAX_GROUPS = 4096          # distinct (kind, code, GPU, ...) groups kept per sweep; more are counted only


@dataclass
class XidGroup:
    first: KernelEvent
    boot: str
    line: int | None
    count: int = 0
    sources: set[str] = field(default_factory=set)
    last_time: float | None = None

    def fields(self) -> dict[str, Any]:
        e = self.first
        return {
            "kind": e.kind, "code": e.code, "pci_bus_id": e.pci_bus_id, "fatal": e.fatal,
            "recovery_action": e.recovery_action, "message": e.message, "pid": e.pid,
            "process_name": e.process_name, "count": self.count,
            "source": "both" if len(self.sources) > 1 else next(iter(self.sources)),
            "boot": self.boot, "line": self.line,
        }


@dataclass
class XidAggregator:
    groups: dict[tuple, XidGroup] = field(default_factory=dict)
    overflow: int = 0

    def add(self, event: KernelEvent, boot: str, line: int | None, source: str, time: float | None) -> XidGroup | None:
        key = (event.kind, event.code, event.pci_bus_id, event.fatal, event.recovery_action, boot)
        group = self.groups.get(key)
        if group is None:
            if len(self.groups) >= MAX_GROUPS:
                self.overflow += 1
                return None
            group = self.groups[key] = XidGroup(event, boot, line)
        group.count += 1
        group.sources.add(source)
        group.last_time = time if time is not None else group.last_time
        return group

    def find(self, kind: str, code: int, bus: str) -> XidGroup | None:
        for (k, c, b, *_), group in self.groups.items():
            if (k, c, b) == (kind, code, bus):
                return group
        return None


def gpu_for(bus_id: str, gpus_by_bus: dict[str, GpuRef], uuids: dict[str, str]) -> GpuRef:
    known = gpus_by_bus.get(bus_id)
    if known is not None:
        return GpuRef(known.index, known.uuid or uuids.get(bus_id), bus_id)
    return GpuRef(None, uuids.get(bus_id), bus_id)
