"""GPU driver and PCIe lines that say a GPU failed or is failing, without an `NVRM: Xid` line (issue 31).

The kernel reports some GPU failures in words of their own. Each becomes a typed DriverEvent, whatever
wrapper a log tool put around it (`wrappers.peel`); the corpus of real lines these patterns are held
to, with their sources and look-alikes, is tests/fixtures/driver_lines/.

    rm_init_failed   NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x22:0x56:667)
                     NVRM: GPU 0000:3b:00.0: rm_init_adapter failed, device minor number 5
                     NVRM: rm_init_adapter(0) failed / ... failed for device bearing minor number 0 (old)
                     NVRM: RmInitAdapter: Cannot initialize GSP firmware RM / ... bailing out of RmInitAdapter
                     nvidia: probe of 0000:14:00.0 failed with error -1
                     nvidia 0000:01:00.0: probe with driver nvidia failed with error -1   (newer kernels)
                     NVRM: The NVIDIA probe routine failed for 2 device(s). / None of the NVIDIA devices ...
    fallen_off_bus   NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.  /  NVRM: GPU at 0000:01:00.0 has ...
                     NVRM: fallen off the bus and is not responding to commands.   (a split message's end)
    gsp_timeout      NVRM: GPU6 _kgspIsHeartbeatTimedOut: Heartbeat timed out, ...
                     NVRM: _kgspRpcRecvPoll: GSP RM heartbeat timed out / LibOS heartbeat timed out
                     NVRM: GPU6 _kgspLogRpcTimeout: **** GSP Timeout **** / Timeout waiting for RPC from GSP
    pcie_aer         pcieport 0000:00:03.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=...
                     nvidia 0000:03:00.0: AER: can't recover (no error_detected callback)
                     pcieport 0000:00:02.0: AER: Corrected error received: id=0010, and a report's other lines
    peermem_failed   nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -22)
                     nvidia_peermem: disagrees about version of symbol ... / could not insert 'nvidia_peermem'
    driver_assert    NVRM: GPU0 nvAssertFailedNoLog: Assertion failed: ... / nvCheckOkFailedNoLog: Check failed
    crash_dump       NVRM: A GPU crash dump has been created. If possible, please run  (and its 2 records)

A line names a GPU by bus id when it can; `NVRM: GPU6 ...` names the driver's own GPU number
(`driver_gpu`), which is not NVML's index. PCIe AER lines are about a GPU only when a GPU is the endpoint
(`nvidia 0000:...`, vendor `10de`) or the port above one: `AerReports` decides that and gives the lines
of a report that do not repeat the severity (`device [...] error status/mask`, `[ 5] SDES`, `can't
recover`) the severity of the report they belong to.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable, Iterable

from detector.backends.kernlog.wrappers import KERNEL, peel
from detector.backends.pciaddr import normalize_bus_id

RM_INIT_FAILED, FALLEN_OFF_BUS, GSP_TIMEOUT, PCIE_AER = "rm_init_failed", "fallen_off_bus", "gsp_timeout", "pcie_aer"
PEERMEM_FAILED, DRIVER_ASSERT, CRASH_DUMP = "peermem_failed", "driver_assert", "crash_dump"
KINDS = (RM_INIT_FAILED, FALLEN_OFF_BUS, GSP_TIMEOUT, PCIE_AER, PEERMEM_FAILED, DRIVER_ASSERT, CRASH_DUMP)
FATAL, UNCORRECTED, CORRECTED = "fatal", "uncorrected", "corrected"
NVIDIA_VENDOR = 0x10DE

# The saved-log scanner finds these lines with NEEDLES (beside the XID scanner's `NVRM`), chosen for
# speed: every literal costs the SIMD pass over the whole log, and a short one that common lines share
# (`nvidia-uvm`, `nvidia-modeset`) costs most. `dia 00` is an endpoint's `nvidia 0000:...` (domains
# 0000-00ff). Some lines are read only around a line that needs them (see detector/checks/xid/scan.py):
# a port's PCIe AER lines around a GPU's AER line (BURST_NEEDLES: a root port's corrected errors are common
# noise), and `nvidia: probe of 0000:14:00.0 failed` before the `NVRM: The NVIDIA probe routine failed for
# N device(s)` the driver prints after them (PROBE_NEEDLES).
NEEDLES = (b"dia 00", b"peer_mem", b"peermem")
BURST_NEEDLES = (b"AER", b"PCIe Bus Error", b"pcieport ", b"error status/mask")
PROBE_NEEDLES = (b"probe of ",)

_BUS = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]|[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
_NVRM = re.compile(rf"^NVRM:? (?:GPU (?:at )?(?:PCI:)?(?P<bus>{_BUS}):? |GPU(?P<gpu>\d+):? )?(?P<body>.*)$", re.S)
_RM_INIT = re.compile(r"RmInitAdapter failed|rm_init_adapter(?:\(\d+\))? failed|RmInitAdapter: .*(?:fail|[Cc]annot|"
                      r"bailing)|probe routine failed for|None of the NVIDIA devices were initialized")
_MINOR = re.compile(r"minor number (?P<minor>\d+)|rm_init_adapter\((?P<paren>\d+)\)")
_GSP = re.compile(r"_kgspIsHeartbeatTimedOut|(?:GSP RM|LibOS) heartbeat timed out|_kgspLogRpcTimeout|"
                  r"Timeout waiting for RPC from GSP|waiting for RPC response from GPU\d* GSP")
_ASSERT = re.compile(r"\bnv(?:Assert|Check)\w*Failed\w*:")
_CRASH = re.compile(r"A GPU crash dump has been created|^nvidia-bug-report\.sh as root to collect this data before"
                    r"|^the NVIDIA kernel module is unloaded\.")
_FELL = re.compile(rf"(?:GPU (?:at )?(?:PCI:)?|The NVIDIA GPU )(?P<bus>{_BUS})\b.*fallen off the bus|"
                   r"^(?:GPU )?has fallen off the bus|^fallen off the bus and is not responding", re.S)
_PROBE = re.compile(rf"^nvidia: probe of (?P<bus>{_BUS}) failed")
_DEVICE = re.compile(rf"^(?P<drv>[A-Za-z0-9_.-]+) (?P<bus>{_BUS}): (?P<body>.*)$", re.S)
_PEERMEM = re.compile(r"^(?:nvidia_peermem|nv_peer_mem|nvidia-peermem): (?:Unknown symbol|disagrees about version)"
                      r"|could not insert '(?:nvidia_peermem|nv_peer_mem)'|failed to load nvidia-peermem module")
# A PCIe AER report: its headline says the severity; its other lines belong to it.
_AER_SEVERITY = re.compile(r"PCIe Bus Error: severity=(?P<sev>[^,]*)|(?:Multiple )?(?P<sev2>(?:Corrected|Correctable|"
                           r"Uncorrected|Uncorrectable)(?: \([A-Za-z-]+\))?) error (?:message )?received"
                           rf"(?: from)?:? ?(?:(?P<src>{_BUS})|id=(?P<id>[0-9a-fA-F]{{4}}))?")
_AER_VENDOR = re.compile(r"device \[(?P<vendor>[0-9a-fA-F]{4}):[0-9a-fA-F]{4}\] error status/mask")
_AER_DETAIL = re.compile(r"^\[\s*\d+\]\s*\S|^(?:aer_status|aer_mask|aer_layer|aer_agent)[:=]|TLP Header|"
                         r"Root Port link has been reset|Downstream Port link has been reset|device recovery successful|"
                         r"broadcast \w+ message|Error of this Agent is reported first|Multiple .* error received")
_AER_UNRECOVERED = re.compile(r"can't recover|device recovery failed|no AER-aware driver")


@dataclass(frozen=True, slots=True)
class DriverEvent:
    """One driver or PCIe line about a GPU failure, parsed."""

    kind: str                        # one of KINDS
    pci_bus_id: str | None           # the device the line names (0000:bb:dd.f), None when it names none
    text: str                        # the message (wrapper peeled)
    severity: str | None = None      # pcie_aer: fatal, uncorrected or corrected (the report's, when the line
                                     # does not say); None for other kinds
    port: bool = False               # pcie_aer: a root or switch port's line (`pcieport ...`), not the endpoint's
    driver: str = ""                 # pcie_aer: the kernel driver the line's device prefix names
    vendor: int | None = None        # pcie_aer: `device [10de:2330] ...`: the reporting device's vendor
    source: str | None = None        # pcie_aer: the device a port's `... error received: BUS` names
    headline: bool = False           # pcie_aer: a report's `PCIe Bus Error: severity=...` line (one per report)
    unrecovered: bool = False        # pcie_aer: `can't recover`, `device recovery failed`, `no AER-aware driver`
    driver_gpu: int | None = None    # `NVRM: GPU6 ...`: the driver's own GPU number (not NVML's index)
    minor: int | None = None         # rm_init_failed: the device minor number (/dev/nvidiaN)
    gpu: str | None = None           # pcie_aer: the GPU the line is about (the endpoint, or the GPU below the port)
    time: float | None = None        # epoch seconds when the wrapper says
    monotonic_s: float | None = None
    origin: str = KERNEL             # as wrappers.peel judged the line, or KERNEL when the source proved it
    boot_id: str | None = None

    @property
    def about(self) -> str | None:
        """The bus id of the GPU this is about: for AER the GPU (endpoint or the one below the port)."""
        return self.gpu if self.kind == PCIE_AER else self.pci_bus_id


def might_be_driver_line(line: str) -> bool:
    """The cheap test every kernel-log line passes before any regex (most lines are none of these)."""
    return ("NVRM" in line or "nvidia" in line or "AER" in line or "pcieport" in line or "peer_mem" in line
            or "PCIe Bus Error" in line or "error status/mask" in line)


def parse_driver_line(line: str, year: int | None = None, kernel: bool = False) -> DriverEvent | None:
    """A DriverEvent with the wrapper's times and origin, or None. `kernel`: the source (kmsg, journald)
    proved the kernel wrote it."""
    if not might_be_driver_line(line):
        return None
    w = peel(line.lstrip(), year)
    event = parse_driver_message(w.message.strip())
    if event is None:
        return None
    return replace(event, time=w.time, monotonic_s=w.monotonic_s, origin=KERNEL if kernel else w.origin,
                   boot_id=w.boot_id)


@lru_cache(maxsize=1024)
def parse_driver_message(msg: str) -> DriverEvent | None:
    """The message itself (no wrapper, leading blanks gone: dmesg indents a split message's records)."""
    if msg.startswith(("NVRM:", "NVRM ")):
        return _nvrm(msg)
    if m := _PROBE.match(msg):
        return DriverEvent(RM_INIT_FAILED, _bus(m["bus"]), msg)
    if _PEERMEM.search(msg):
        return DriverEvent(PEERMEM_FAILED, None, msg)
    if m := _DEVICE.match(msg):
        body = m["body"].lstrip()
        if m["drv"] == "nvidia" and body.startswith("probe with driver nvidia failed"):
            return DriverEvent(RM_INIT_FAILED, _bus(m["bus"]), msg)
        return _aer(msg, body, m["drv"], _bus(m["bus"]))
    if msg.startswith(("PCIe Bus Error:", "AER: PCIe Bus Error:")):
        return _aer(msg, msg, "", None)
    return None


def _nvrm(msg: str) -> DriverEvent | None:
    m = _NVRM.match(msg)
    if m is None or m["body"].startswith("Xid"):
        return None
    body, bus = m["body"], _bus(m["bus"]) if m["bus"] else None
    gpu = int(m["gpu"]) if m["gpu"] else None
    if "fallen off the bus" in body and (f := _FELL.search(body)):
        return DriverEvent(FALLEN_OFF_BUS, bus or (_bus(f["bus"]) if f["bus"] else None), msg, driver_gpu=gpu)
    if _RM_INIT.search(body):
        minor = _MINOR.search(body)
        number = None if minor is None else int(minor["minor"] or minor["paren"])
        return DriverEvent(RM_INIT_FAILED, bus, msg, driver_gpu=gpu, minor=number)
    if _GSP.search(body):
        return DriverEvent(GSP_TIMEOUT, bus, msg, driver_gpu=gpu)
    if _ASSERT.search(body):
        return DriverEvent(DRIVER_ASSERT, bus, msg, driver_gpu=gpu)
    if _CRASH.search(body):
        return DriverEvent(CRASH_DUMP, bus, msg, driver_gpu=gpu)
    return None


def _aer(msg: str, body: str, driver: str, bus: str | None) -> DriverEvent | None:
    if body.startswith("AER:"):
        body = body[4:].lstrip()
    port = driver == "pcieport"
    if s := _AER_SEVERITY.search(body):
        source = _bus(s["src"]) if s["src"] else _requester(s["id"], bus) if s["id"] else None
        return DriverEvent(PCIE_AER, bus, msg, _severity(s["sev"] or s["sev2"]), port, driver, source=source,
                           headline=s["sev"] is not None)
    if v := _AER_VENDOR.search(body):
        return DriverEvent(PCIE_AER, bus, msg, None, port, driver, vendor=int(v["vendor"], 16))
    if _AER_UNRECOVERED.search(body):
        return DriverEvent(PCIE_AER, bus, msg, None, port, driver, unrecovered=True)
    if bus is not None and _AER_DETAIL.search(body):
        return DriverEvent(PCIE_AER, bus, msg, None, port, driver)
    return None


def _severity(text: str) -> str:
    t = text.lower()
    if "non-fatal" in t or "nonfatal" in t:
        return UNCORRECTED
    if "fatal" in t:
        return FATAL
    return CORRECTED if "correct" in t and "uncorrect" not in t else UNCORRECTED


def _requester(rid: str, near: str | None) -> str | None:
    """`id=0010`: a requester id, bus 0x00 device 0x02 function 0, in the domain of the port that printed it."""
    value = int(rid, 16)
    domain = near.split(":")[0] if near else "0000"
    return f"{domain}:{value >> 8:02x}:{(value >> 3) & 0x1f:02x}.{value & 7}"


def _bus(text: str) -> str | None:
    try:
        return normalize_bus_id(text)
    except ValueError:
        return None


# --- PCIe AER reports: severity and GPU of every line --------------------------------------------------

BURST_LINES = 16          # lines of one AER report burst lie this close (the kernel prints a report at once)
BURST_S = 2.0             # ... and within this long, when the lines have times
_PENDING_MAX = 4096       # unresolved port lines held for the end of a saved log


class AerReports:
    """Gives each PCIe AER line its report's severity and the GPU it is about, or drops it.

    A line is about a GPU when its device is one (driver `nvidia`, vendor 10de, or a bus id known to be a
    GPU) or is a port above one: live, `upstream` (sysfs) says which GPU is below a port; in a saved log,
    the same burst's lines naming a GPU endpoint do (a port's report followed by `nvidia 0000:03:00.0: AER:
    can't recover`), and a tie learned so ties that port's other reports in the same log. Lines on other
    devices (a Wi-Fi card, a NIC, a root port above them) are dropped: they are not a GPU's.

    `feed` returns the events ready to judge; a saved log's reader calls `finish` at its end for the port
    lines that only a later burst tied to a GPU."""

    def __init__(self, gpus: Iterable[str] = (), below: Callable[[str], str | None] | None = None):
        self.gpus: set[str] = set(gpus)              # bus ids known to be GPUs
        self._below = below or (lambda port: None)   # live: the GPU under a port (sysfs)
        self._ties: dict[str, str] = {}              # port -> GPU, learned from bursts
        self._burst: list[tuple[DriverEvent, int | None]] = []
        self._where: tuple[int | None, float | None] = (None, None)
        self._severity: dict[str | None, str] = {}   # the open report's severity per device
        self._untied: deque[tuple[DriverEvent, int | None]] = deque(maxlen=_PENDING_MAX)
        self.dropped = 0                             # AER lines on no GPU

    def feed(self, event: DriverEvent, position: int | None = None) -> list[tuple[DriverEvent, int | None]]:
        """`position`: the line's number in its file (or a kmsg sequence number), for telling bursts apart."""
        out = self._close() if self._new_burst(event, position) else []
        self._where = (position, _when(event))
        sev = event.severity
        if sev is not None:                          # a report's headline, or the port's `error received`
            self._severity[event.pci_bus_id] = sev
            if event.source:
                self._severity[event.source] = sev
        elif sev is None:
            sev = self._severity.get(event.pci_bus_id) or self._burst_severity() or (
                FATAL if event.unrecovered else UNCORRECTED)
            event = replace(event, severity=sev)
        if event.pci_bus_id and (event.driver == "nvidia" or event.vendor == NVIDIA_VENDOR):
            self.gpus.add(event.pci_bus_id)
        self._burst.append((event, position))
        return out

    def finish(self) -> list[tuple[DriverEvent, int | None]]:
        """The burst under way, and the port lines a later burst tied to a GPU (a saved log's end)."""
        out = self._close()
        for event, position in self._untied:
            gpu = self._ties.get(event.pci_bus_id or "")
            if gpu is not None:
                out.append((replace(event, gpu=gpu), position))
            else:
                self.dropped += 1
        self._untied.clear()
        return out

    def _new_burst(self, event: DriverEvent, position: int | None) -> bool:
        if not self._burst:
            return False
        last_pos, last_t = self._where
        t = _when(event)
        far = position is not None and last_pos is not None and position - last_pos > BURST_LINES
        late = t is not None and last_t is not None and abs(t - last_t) > BURST_S
        return far or late

    def _burst_severity(self) -> str | None:
        """The severity of the report under way (every line read so far carries its report's)."""
        return self._burst[-1][0].severity if self._burst else None

    def _close(self) -> list[tuple[DriverEvent, int | None]]:
        burst, self._burst = self._burst, []
        self._severity.clear()
        endpoints = {e.pci_bus_id for e, _ in burst if e.pci_bus_id in self.gpus and not e.port}
        sources = {e.source for e, _ in burst if e.source in self.gpus}
        named = endpoints | sources
        out = []
        for event, position in burst:
            bus = event.pci_bus_id
            if bus is None:
                self.dropped += 1
                continue
            if not event.port:
                if bus in self.gpus:
                    out.append((replace(event, gpu=bus), position))
                else:
                    self.dropped += 1
                continue
            gpu = self._below(bus) or (next(iter(named)) if len(named) == 1 else None) or self._ties.get(bus)
            if gpu is not None:
                if len(self._ties) < _PENDING_MAX:
                    self._ties[bus] = gpu
                out.append((replace(event, gpu=gpu), position))
            else:
                self._untied.append((event, position))
        return out


def _when(event: DriverEvent) -> float | None:
    return event.time if event.time is not None else event.monotonic_s
