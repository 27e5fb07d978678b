"""From typed driver lines (detector/backends/kernlog/driverlines.py) to incidents, as `incidents` does for XIDs.

- Lines of one kind about one GPU (same severity for AER, same boot) close together in time are one
  incident with a `count` of lines; an AER incident also counts its `reports` (headline lines).
- A line that names no GPU (`NVRM: RmInitAdapter failed!` on old drivers, `The NVIDIA probe routine failed
  for 2 device(s)`, `NVRM: _kgspRpcRecvPoll: GSP RM heartbeat timed out`) belongs to the incident of its kind
  that names one, close to it in the same boot (the nearest by line, else by time); with none, it stands
  alone on a GPU nobody can name.
- A GSP timeout printed with an XID 119 or 120 (the driver prints its heartbeat and RPC-timeout lines, then
  the XID naming the bus) is one incident with that XID: it `follows` it and takes its GPU, so only the
  XID's rule acts. `NVRM: GPU6 ...` names the driver's GPU number, which the XID 119 line's text names too
  (`... RPC response from GPU6 GSP!`): that match is preferred when several GPUs printed one.
- Windows: corrected AER reports per GPU within `window_s` (`reports_in_window`), judged at the lines' own
  times, so a saved log's burst of last year is judged as the burst it was.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from detector.backends.kernlog.driverlines import CORRECTED, GSP_TIMEOUT, PCIE_AER, DriverEvent
from detector.checks.xid.incidents import Incident
from detector.checks.xid.nvlink5 import EMPTY_FIELDS

_REMEMBERED = 4096
_GSP_GPU = re.compile(r"from GPU(?P<gpu>\d+) GSP")


@dataclass
class DriverIncident:
    first: DriverEvent
    boot: str
    line: int | None
    file: str | None
    first_time: float | None
    last_time: float | None
    gpu: str | None                      # bus id of the GPU it is about (None: nobody can name it)
    count: int = 0
    headlines: int = 0                   # AER: the reports' headline lines it holds
    new: bool = True                     # False: continues an incident an earlier run reported
    follows: int | None = None           # GSP timeout: the XID 119/120 it was printed with
    in_window: int | None = None         # corrected AER: reports on its GPU within the window
    ports: set[str] = field(default_factory=set)

    @property
    def reports(self) -> int:
        """AER reports: its headline lines, or 1 when its report's headline was not among them."""
        return max(self.headlines, 1) if self.first.kind == PCIE_AER else 0

    def fields(self) -> dict[str, Any]:
        e = self.first
        return {
            "kind": e.kind, "code": None, "pci_bus_id": self.gpu or "", "fatal": None, "recovery_action": "",
            "message": e.text, "pid": None, "process_name": "", "count": self.count, "faults": self.count,
            "incidents": 1 if self.new and self.follows is None else 0, "follows": self.follows,
            "source": "kernel", "boot": self.boot, "line": self.line, "origin": e.origin, "gpu_instance": None,
            "applications": None, "detail": False, "nvlink_unit": "", "nvlink_subcode": "", "link": None,
            **EMPTY_FIELDS,
            "severity": e.severity, "port": ", ".join(sorted(self.ports)), "reports": self.reports,
            "reports_in_window": self.in_window, "driver_gpu": e.driver_gpu, "minor": e.minor,
        }


def _close(a: float | None, b: float | None, gap_s: float) -> bool:
    return a is None or b is None or abs(b - a) <= gap_s


class DriverIncidents:
    """The driver-line incidents of the check's runs (the tracker outlives a run, like IncidentTracker)."""

    def __init__(self, gap_s: float = 60.0, window_s: float = 60.0):
        self.gap_s = gap_s
        self.window_s = window_s
        self.run = 0
        self.groups: list[DriverIncident] = []
        self._last: dict[tuple, tuple[float | None, int, DriverIncident]] = {}
        self._corrected: dict[str, deque[float]] = {}        # GPU -> times of corrected AER reports

    def start_run(self) -> None:
        self.run += 1
        self.groups = []

    def add(self, event: DriverEvent, boot: str, when: float | None, line: int | None, file: str | None) -> None:
        gpu = event.about
        key = (event.kind, gpu, event.severity if event.kind == PCIE_AER else None, boot)
        last = self._last.get(key)
        if last is not None and last[1] == self.run and _close(last[0], when, self.gap_s):
            incident = last[2]
        else:
            incident = DriverIncident(event, boot, line, file, when, when, gpu)
            incident.new = last is None or not _close(last[0], when, self.gap_s)
            self.groups.append(incident)
        incident.count += 1
        if event.kind == PCIE_AER:
            incident.headlines += event.headline
            if event.port and event.pci_bus_id:
                incident.ports.add(event.pci_bus_id)
            if event.severity == CORRECTED and gpu and event.headline and when is not None \
                    and (gpu in self._corrected or len(self._corrected) < _REMEMBERED):
                self._corrected.setdefault(gpu, deque(maxlen=_REMEMBERED)).append(when)
        if when is not None:
            incident.last_time = when if incident.last_time is None else max(incident.last_time, when)
        if key not in self._last and len(self._last) >= _REMEMBERED:
            self._last.pop(next(iter(self._last)))
        self._last[key] = (when, self.run, incident)

    def finish(self, xids: Iterable[Incident]) -> None:
        """A run's end: lines naming no GPU join the incident of their kind that does; GSP timeouts join the
        XID 119/120 printed with them; corrected AER incidents learn their window's reports."""
        named = [g for g in self.groups if g.gpu]
        for anon in [g for g in self.groups if not g.gpu and g.first.kind != GSP_TIMEOUT]:
            near = [g for g in named if g.first.kind == anon.first.kind and g.boot == anon.boot
                    and _close(g.first_time, anon.first_time, self.gap_s)]
            if near:
                host = min(near, key=lambda g: abs((g.line or 0) - (anon.line or 0)))
                host.count += anon.count
                self.groups.remove(anon)
        gsp_xids = [i for i in xids if i.first.kind == "xid" and i.first.code in (119, 120)]
        for g in [g for g in self.groups if g.first.kind == GSP_TIMEOUT]:
            near = [i for i in gsp_xids if i.boot == g.boot and (g.gpu is None or i.first.pci_bus_id == g.gpu)
                    and _close(i.first_time, g.first_time, self.gap_s)]
            if g.first.driver_gpu is not None:
                same = [i for i in near if (m := _GSP_GPU.search(i.first.message)) and
                        int(m["gpu"]) == g.first.driver_gpu]
                near = same or near
            buses = {i.first.pci_bus_id for i in near}
            if near and (len(buses) == 1 or g.first.driver_gpu is not None):
                g.follows, g.gpu = near[0].first.code, g.gpu or near[0].first.pci_bus_id or None
        for g in self.groups:
            if g.first.kind == PCIE_AER and g.first.severity == CORRECTED and g.gpu:
                end = g.last_time
                times = self._corrected.get(g.gpu, ())
                g.in_window = g.reports if end is None else sum(1 for t in times if end - self.window_s < t <= end)
