"""From XID lines to incidents: one fault happening once, however many lines the driver prints for it.

- Identical lines (same kind, code, GPU, fatality, recovery action and boot) close together in time are
  one incident with a `count` of lines: a flood of 800,000 XID 95 lines is one observation. Lines
  further apart than `gap_s` are separate incidents, so the same XID twice three days apart is two.
- Companion lines are part of the incident they follow, not new ones: XID 79's `GPU has fallen off
  the bus` line (it has the same key, so it merges), XID 154 (`GPU recovery action changed`) after
  another XID on that GPU, XID 45 `... caused by previous Xid N`, and an NVLink 144-150 line naming a
  link that another 144-150 line named just before. They stay observations of their own (their rules
  still fire), with `incidents: 0` and `follows: N`, so `*-repeated` rules count each fault once.
- Application faults are about processes. An application-class XID (`APPLICATION_XIDS`) is one
  incident per fault of one process: the driver may print the pid on any of a fault's lines (driver
  580 prints XID 13's SM warp exception and ESR lines without it, then a line with `pid=`/`name=`), so
  the incident takes the pid and name from whichever line has them; a line naming another pid, or a
  pid-less line after the line that completed a fault, starts a new incident, however close in time.
- An NVSwitch SXid `Severity`/`Data` detail line belongs to its headline only when the SXid line just
  before it was that headline's (same switch, same code); an orphan detail line is an incident of its own.
- The same XID through NVML's event API (code and GPU only) is matched to one kernel incident of that
  code and GPU seen within `match_window_s`, and vice versa, so a fault counts once whichever source
  saw it first; two faults are two NVML events and match two incidents.
- Lines without a time are all one instant. The tracker outlives one run of the check (the daemon
  reads the log in small pieces), so an incident split across two runs still counts once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from detector.checks.xid.nvlink5 import EMPTY_FIELDS, decode_line
from detector.checks.xid.parser import KernelEvent
from detector.core.types import GpuRef

MAX_GROUPS = 4096          # incidents kept per run; more are counted only
_REMEMBERED = 4096         # keys and GPUs remembered across runs

# XIDs NVIDIA's catalogue puts in the RESTART_APP bucket, and the IGNORE-bucket codes that name the
# process whose channel faulted (43, 44, 45): each is about one process. Left out: 94 (a contained ECC
# error: one memory error prints a line for every process it touched, and is one incident).
APPLICATION_XIDS = frozenset({8, 11, 13, 25, 31, 32, 39, 40, 41, 43, 44, 45, 60, 68, 69, 70, 71, 72, 75, 76,
                              77, 80, 82, 83, 84, 85, 86, 88, 89, *range(96, 106), *range(126, 136), 139})


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
    pid_lines: int = 0                   # its lines that named a process: one per fault of an application
    sources: set[str] = field(default_factory=set)
    opened_without_pid: bool = False     # its first line named no process (driver 580's XID 13)
    process_said: bool = False           # one of its lines had the driver's pid=/name=, known or not
    nvml_matched: bool = False           # an NVML event was matched to it
    applications: int | None = None      # set by the check: distinct applications faulting on its GPU

    def __post_init__(self) -> None:
        self.opened_without_pid = self.first.pid is None
        self.process_said = self.first.names_process

    def fields(self) -> dict[str, Any]:
        e = self.first
        return {
            "kind": e.kind, "code": e.code, "pci_bus_id": e.pci_bus_id, "fatal": e.fatal,
            "recovery_action": e.recovery_action, "message": e.message, "pid": e.pid,
            "process_name": e.process_name, "count": self.count,
            "faults": self.pid_lines if self.pid_lines and e.kind == "xid" and e.code in APPLICATION_XIDS
            else self.count,
            "incidents": 1 if self.new and self.follows is None else 0, "follows": self.follows,
            "source": "both" if len(self.sources) > 1 else next(iter(self.sources)),
            "boot": self.boot, "line": self.line, "origin": e.origin,
            "gpu_instance": e.gpu_instance, "applications": self.applications, "detail": e.detail,
            **nvlink_decode(e),
        }

    def same_fault(self, event: KernelEvent) -> bool:
        """Whether `event` (same code, GPU and boot, close in time) is another line of this fault."""
        if event.kind != "xid" or event.code not in APPLICATION_XIDS:
            return True
        if event.pid is not None:
            return self.first.pid in (None, event.pid)
        return not (self.opened_without_pid and self.first.pid is not None)   # that fault was complete

    def awaits_process(self) -> bool:
        """An application fault read from the kernel log none of whose lines had the process fields yet:
        that line may be next."""
        e = self.first
        return e.kind == "xid" and e.code in APPLICATION_XIDS and not self.process_said and "kernel" in self.sources

    def match_nvml(self) -> None:
        """NVML's event API reported this fault too: one incident, `source: both`."""
        self.nvml_matched = True
        self.sources.add("nvml")

    def explained_by(self, event: KernelEvent, line: int | None, file: str | None, when: float | None,
                     follows: int | None) -> None:
        """NVML saw this fault first (its code and GPU only): the kernel's first line of it says the rest,
        and its lines are counted from this one."""
        self.first, self.line, self.file = event, line, file
        self.first_time = self.last_time = when
        self.opened_without_pid = event.pid is None
        self.process_said = event.names_process
        self.count = 0
        self.follows = follows

    def take_process(self, event: KernelEvent) -> None:
        """The pid and name from whichever line of the fault has them."""
        if self.first.pid is None and event.pid is not None:
            self.first = replace(self.first, pid=event.pid,
                                 process_name=self.first.process_name or event.process_name)
        elif not self.first.process_name and event.process_name and event.pid in (None, self.first.pid):
            self.first = replace(self.first, process_name=event.process_name)


# NVLink5 unit per XID 144-150, as NVIDIA's Xid catalogue names them (NVLINK_SAW_ERROR, ...). The first
# word of such a line is the unit's subcode mnemonic (SAW_MVB, RLW_REMAP, NETIR_LINK_EVT, ...); its interrupt
# info and error status are decoded against the catalogue's table (nvlink5.py).
NVLINK_UNITS = {144: "SAW", 145: "RLW", 146: "TLW", 147: "TREX", 148: "NVLPW_CTRL", 149: "NETIR", 150: "MSE"}


def nvlink_decode(e: KernelEvent) -> dict[str, Any]:
    """The 144-150 fields of an event: unit, the line's unit word, link, and the catalogue's decode."""
    if e.kind != "xid" or e.code not in NVLINK_UNITS:
        return {"nvlink_unit": "", "nvlink_subcode": "", "link": None, **EMPTY_FIELDS}
    first = e.message.split(None, 1)[0] if e.message else ""
    subcode = first if first.replace("_", "").isalnum() and first.isupper() else ""
    return {"nvlink_unit": NVLINK_UNITS[e.code], "nvlink_subcode": subcode, "link": e.link,
            **decode_line(e.code, e.message, subcode).fields()}


def _nvlink_identity(event: KernelEvent) -> tuple:
    """Lines of one XID 144-150 on one GPU are one incident only when the catalogue reads them alike: a
    145 RLW_SRC_TRACK (XID_154_EVAL) right after a 145 RLW_RXPIPE (IGNORE) is a fault of its own. The
    same decode on other links (a flood over links 00-17) stays one incident."""
    if event.kind != "xid" or event.code not in NVLINK_UNITS:
        return ()
    d = nvlink_decode(event)
    return d["nvlink_subcode"], d["xid_decoded"], d["nvlink_resolution"], d["error_status"]


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
class _Seen:
    """An incident one source reported, for matching the other source's report of the same fault."""

    taken: float                         # wall clock when the check read it
    incident: Incident
    run: int


@dataclass
class IncidentTracker:
    gap_s: float = 60.0
    match_window_s: float = 60.0
    run: int = 0
    groups: list[Incident] = field(default_factory=list)
    overflow: int = 0
    _by_key: dict[tuple, _Last] = field(default_factory=dict)
    _by_gpu: dict[str, _Last] = field(default_factory=dict)
    _last_sxid: _Last | None = None
    _kernel_seen: deque[_Seen] = field(default_factory=lambda: deque(maxlen=_REMEMBERED))
    _nvml_pending: deque[_Seen] = field(default_factory=lambda: deque(maxlen=_REMEMBERED))

    def start_run(self) -> None:
        self.run += 1
        self.groups = []
        self.overflow = 0

    def forget_sources(self) -> None:
        """A new boot: nothing seen by one source before it is a duplicate of what the other sees now."""
        self._kernel_seen.clear()
        self._nvml_pending.clear()

    def add_kernel(self, event: KernelEvent, boot: str, when: float | None, line: int | None, file: str | None,
                   taken: float | None = None) -> Incident | None:
        """A kernel-log line: it continues an incident, folds into one, explains one NVML reported, or
        opens one. `taken`: the wall clock when it was read, which NVML's events are matched by."""
        if event.kind == "sxid" and event.detail:
            folded = self._fold_detail(event, boot, when)
            if folded is not None:
                return folded
        key = (event.kind, event.code, event.pci_bus_id, event.fatal, event.recovery_action, boot, event.detail,
               _nvlink_identity(event))
        last = self._by_key.get(key) if not event.detail else None     # an orphan detail line stands alone
        same = last is not None and _close(last.time, when, self.gap_s) and last.incident.same_fault(event)
        if same and last is not None and last.run == self.run:
            incident = last.incident                       # the same incident goes on
            incident.take_process(event)
        else:
            incident = self._from_nvml(event, taken) if not same else None
            if incident is not None:                       # NVML reported this fault first, this run
                incident.explained_by(event, line, file, when, self._follows(event, boot, when))
            else:
                if len(self.groups) >= MAX_GROUPS:
                    self.overflow += 1
                    return None
                first = event
                if same and last is not None:              # it went on from an earlier run
                    first = replace(last.incident.first, pid=last.incident.first.pid or event.pid,
                                    process_name=last.incident.first.process_name or event.process_name)
                incident = Incident(first, boot, line, file, when, when, follows=self._follows(event, boot, when))
                incident.new = not same
                if same and last is not None:
                    incident.opened_without_pid = last.incident.opened_without_pid
                    incident.nvml_matched = last.incident.nvml_matched
                if not same and taken is not None and self._nvml_earlier(event, taken):
                    incident.match_nvml()                  # NVML's event of an earlier run reported it:
                                                           # followed (its later lines join it), not reported
                else:
                    self.groups.append(incident)
            if taken is not None:
                self._kernel_seen.append(_Seen(taken, incident, self.run))
        incident.count += 1
        incident.pid_lines += event.pid is not None
        incident.process_said |= event.names_process
        incident.sources.add("kernel")
        if when is not None:
            incident.last_time = when if incident.last_time is None else max(incident.last_time, when)
        remembered = _Last(when, incident, self.run)
        self._remember(self._by_key, key, remembered)
        if event.kind == "xid" and event.pci_bus_id:
            self._remember(self._by_gpu, event.pci_bus_id, remembered)
        if event.kind == "sxid":
            self._last_sxid = remembered
        return incident

    def add_nvml(self, event: KernelEvent, boot: str, taken: float) -> Incident | None:
        """An XID from NVML's event API: one kernel incident of that code and GPU not yet matched takes
        it; else it is an incident of its own, until a kernel line of the same fault arrives."""
        for seen in reversed(self._kernel_seen):
            if taken - seen.taken > self.match_window_s:
                break
            e = seen.incident.first
            if not seen.incident.nvml_matched and (e.kind, e.code, e.pci_bus_id) == ("xid", event.code,
                                                                                     event.pci_bus_id):
                seen.incident.match_nvml()
                return None
        if len(self.groups) >= MAX_GROUPS:
            self.overflow += 1
            return None
        incident = Incident(event, boot, None, None, taken, taken, count=1, sources={"nvml"})
        incident.nvml_matched = True
        self.groups.append(incident)
        self._nvml_pending.append(_Seen(taken, incident, self.run))
        return incident

    def _from_nvml(self, event: KernelEvent, taken: float | None) -> Incident | None:
        """This run's NVML-only incident of the same code and GPU, which this kernel line now explains."""
        for i, seen in enumerate(self._nvml_pending):
            e = seen.incident.first
            if seen.run == self.run and (e.kind, e.code, e.pci_bus_id) == (event.kind, event.code,
                                                                            event.pci_bus_id) \
                    and (taken is None or abs(taken - seen.taken) <= self.match_window_s):
                del self._nvml_pending[i]
                return seen.incident
        return None

    def _nvml_earlier(self, event: KernelEvent, taken: float) -> bool:
        """An earlier run's NVML-only incident of this code and GPU: reported already, so this kernel
        line continues it (it says more: the message and the process) rather than counting again."""
        for i, seen in enumerate(self._nvml_pending):
            e = seen.incident.first
            if (e.kind, e.code, e.pci_bus_id) == (event.kind, event.code, event.pci_bus_id) \
                    and abs(taken - seen.taken) <= self.match_window_s:
                del self._nvml_pending[i]
                return True
        return False

    def _fold_detail(self, event: KernelEvent, boot: str, when: float | None) -> Incident | None:
        """An SXid detail line whose headline (same switch, same code) was the SXid line just before it."""
        last = self._last_sxid
        if last is None or last.run != self.run or not _close(last.time, when, self.gap_s):
            return None
        head = last.incident.first
        if (head.code, head.pci_bus_id, last.incident.boot) != (event.code, event.pci_bus_id, boot):
            return None
        last.incident.count += 1
        if when is not None:
            last.incident.last_time = when if last.incident.last_time is None else max(last.incident.last_time, when)
        self._last_sxid = _Last(when, last.incident, self.run)
        return last.incident

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
