"""From XID lines to incidents: one fault happening once, however many lines the driver prints for it.

- Identical lines (same kind, code, GPU, fatality, recovery action and boot) close together in time are
  one incident with a `count` of lines: a flood of 800,000 XID 95 lines is one observation. Lines
  further apart than `gap_s` are separate incidents, so the same XID twice three days apart is two.
- Companion lines are part of the incident they follow, not new ones: XID 79's `GPU has fallen off
  the bus` line (it has the same key, so it merges), XID 154 (`GPU recovery action changed`) after
  another XID on that GPU, XID 45 `... caused by previous Xid N`, and an NVLink 144-150 line naming a
  link that another 144-150 line named just before. They stay observations of their own (their rules
  still fire), with `incidents: 0` and `follows: N`, so `*-repeated` rules count each fault once.
- Lines without a time are all one instant. The tracker outlives one run of the check (the daemon
  reads the log in small pieces), so an incident split across two runs still counts once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from detector.checks.xid.parser import KernelEvent
from detector.core.types import GpuRef

MAX_GROUPS = 4096          # incidents kept per run; more are counted only
_REMEMBERED = 4096         # keys and GPUs remembered across runs


@dataclass
class Incident:
    """One observation: a run of identical lines, with the times of its first and last line."""

    first: KernelEvent
    boot: str
    line: int | None
    file: str | None
    first_time: float | None
    last_time: float | None
    new: bool = True                     # False: continues an incident an earlier run reported
    follows: int | None = None           # the XID this one is a companion of
    count: int = 0
    sources: set[str] = field(default_factory=set)

    def fields(self) -> dict[str, Any]:
        e = self.first
        return {
            "kind": e.kind, "code": e.code, "pci_bus_id": e.pci_bus_id, "fatal": e.fatal,
            "recovery_action": e.recovery_action, "message": e.message, "pid": e.pid,
            "process_name": e.process_name, "count": self.count,
            "incidents": 1 if self.new and self.follows is None else 0, "follows": self.follows,
            "source": "both" if len(self.sources) > 1 else next(iter(self.sources)),
            "boot": self.boot, "line": self.line, "origin": e.origin,
            "gpu_instance": e.gpu_instance, **nvlink_decode(e),
        }


# NVLink5 unit per XID 144-150, as NVIDIA's Xid catalogue names them (NVLINK_SAW_ERROR, ...). The first
# word of such a line is the unit's subcode mnemonic (SAW_MVB, RLW_REMAP, NETIR_LINK_EVT, ...).
NVLINK_UNITS = {144: "SAW", 145: "RLW", 146: "TLW", 147: "TREX", 148: "NVLPW_CTRL", 149: "NETIR", 150: "MSE"}


def nvlink_decode(e: KernelEvent) -> dict[str, Any]:
    if e.kind != "xid" or e.code not in NVLINK_UNITS:
        return {"nvlink_unit": "", "nvlink_subcode": "", "link": None}
    first = e.message.split(None, 1)[0] if e.message else ""
    subcode = first if first.replace("_", "").isalnum() and first.isupper() else ""
    return {"nvlink_unit": NVLINK_UNITS[e.code], "nvlink_subcode": subcode, "link": e.link}


@dataclass
class _Last:
    """The latest line seen for a key or a GPU, across runs."""

    time: float | None
    incident: Incident
    run: int


def _close(a: float | None, b: float | None, gap_s: float) -> bool:
    """Lines without a time are one instant with every other line."""
    return a is None or b is None or abs(b - a) <= gap_s


@dataclass
class IncidentTracker:
    gap_s: float = 60.0
    run: int = 0
    groups: list[Incident] = field(default_factory=list)
    overflow: int = 0
    _by_key: dict[tuple, _Last] = field(default_factory=dict)
    _by_gpu: dict[str, _Last] = field(default_factory=dict)

    def start_run(self) -> None:
        self.run += 1
        self.groups = []
        self.overflow = 0

    def add(self, event: KernelEvent, boot: str, when: float | None, line: int | None, file: str | None,
            source: str) -> Incident | None:
        key = (event.kind, event.code, event.pci_bus_id, event.fatal, event.recovery_action, boot)
        last = self._by_key.get(key)
        if last is not None and last.run == self.run and _close(last.time, when, self.gap_s):
            incident = last.incident                       # the same incident goes on
        else:
            if len(self.groups) >= MAX_GROUPS:
                self.overflow += 1
                return None
            incident = Incident(event, boot, line, file, when, when, follows=self._follows(event, boot, when))
            if last is not None and _close(last.time, when, self.gap_s):
                incident.new = False                       # it went on from an earlier run
            self.groups.append(incident)
        incident.count += 1
        incident.sources.add(source)
        if when is not None:
            incident.last_time = when if incident.last_time is None else max(incident.last_time, when)
        self._remember(self._by_key, key, _Last(when, incident, self.run))
        if event.kind == "xid" and event.pci_bus_id:
            self._remember(self._by_gpu, event.pci_bus_id, _Last(when, incident, self.run))
        return incident

    def find(self, kind: str, code: int, bus: str) -> Incident | None:
        """This run's latest incident of (kind, code, bus), from any source."""
        for incident in reversed(self.groups):
            e = incident.first
            if (e.kind, e.code, e.pci_bus_id) == (kind, code, bus):
                return incident
        return None

    def _follows(self, event: KernelEvent, boot: str, when: float | None) -> int | None:
        if event.kind != "xid":
            return None
        if event.caused_by is not None:
            return event.caused_by
        last = self._by_gpu.get(event.pci_bus_id) if event.pci_bus_id else None
        if last is None or last.incident.boot != boot or not _close(last.time, when, self.gap_s):
            return None
        before = last.incident.first
        if event.code == 154 and before.code != 154:
            return before.code
        if event.code in (171, 172) and before.code == 48:
            return 48                                     # the DRAM/SRAM details of that XID 48
        if 144 <= event.code <= 150 and 144 <= before.code <= 150 and event.link is not None \
                and event.link == before.link and event.code != before.code:
            return before.code
        return None

    @staticmethod
    def _remember(table: dict, key: Any, value: _Last) -> None:
        if key not in table and len(table) >= _REMEMBERED:
            table.pop(next(iter(table)))
        table[key] = value


def gpu_for(bus_id: str, gpus_by_bus: dict[str, GpuRef], uuids: dict[str, str]) -> GpuRef:
    """The GPU a bus id names: NVML's index and UUID when NVML knows it, else the UUID the log
    mapped to it; never another GPU's index. A redacted bus id is a GPU nobody can name."""
    if not bus_id:
        return GpuRef(None)
    known = gpus_by_bus.get(bus_id)
    if known is not None:
        return GpuRef(known.index, known.uuid or uuids.get(bus_id), bus_id)
    return GpuRef(None, uuids.get(bus_id), bus_id)
