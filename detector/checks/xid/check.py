"""The xid check: XID and NVSwitch SXid events from the kernel log and from NVML, as observations.

One observation stands for one incident (see `incidents`): one fault of one process, or identical
lines close in time, with their `count`. The kernel log is read incrementally by the daemon (a reader
keeps its cursor; a line must provably come from the kernel, since user space can write to syslog and
/dev/kmsg), or scanned whole for a post-mortem (`kernel_log_file`). In a saved log, a line whose format
shows a user-space facility is no event (counted and listed as ignored); one whose format cannot tell
(plain dmesg) is reported with `origin: unverified`, and the rules act on none of those. NVML's XID
events and the kernel's lines of the same fault are one incident (`source: both`).

The same reading gives the driver's failures that print no Xid (kernlog/driverlines.py: RM init and probe
failures, GSP timeouts, PCIe AER on a GPU's link, nvidia_peermem load failures, assertions, crash dumps):
their observations carry `kind` rm_init_failed, gsp_timeout, pcie_aer, peermem_failed, driver_assert or
crash_dump (see `driver_events`). A "fallen off the bus" line without an Xid is read as XID 79.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Callable

from detector.backends.kernlog.driverlines import PCIE_AER, AerReports, DriverEvent, parse_driver_line
from detector.backends.kernlog.records import LogLine, is_kernel
from detector.checks.xid.applications import GPU_SUSPECT_XIDS, ApplicationFaults
from detector.checks.xid.driver_events import DriverIncidents
from detector.checks.xid.incidents import (APPLICATION_XIDS, NVLINK_UNITS, IncidentTracker, gpu_for,
                                           nvlink_decode)
from detector.checks.xid.logfiles import LogNotFound, SavedLog, looks_like_kernel_log, read_head, saved_logs
from detector.checks.xid.metrics import XidMetrics
from detector.checks.xid.nvml_events import NvmlXidListener
from detector.checks.xid.parser import (KERNEL, USER_SPACE, BoardSerial, KernelEvent, SplitStart, UuidMapping,
                                        parse_line)
from detector.checks.xid.scan import scan_stream
from detector.checks.xid.timeline import SavedLogTimeline
from detector.core.check import Check, CheckOutput, ConfigField
from detector.core.sweep import SweepContext
from detector.core.types import GpuRef, Observation

FIELDS = {
    "kind": "xid or sxid",
    "code": "the XID or SXid number",
    "pci_bus_id": "bus id of the GPU (XID) or NVSwitch (SXid), 0000:bb:dd.f; '' when the log redacted it",
    "fatal": "true/false when the line says Fatal/Nonfatal (XID 144-150, SXid), else null",
    "recovery_action": "XID 154: the action the driver asks for (NONE, RESET_GPU, RESTART_BM, DRAIN_P2P, "
                       "DRAIN_AND_RESET); '' otherwise",
    "message": "the rest of the first line after the code",
    "pid": "the process the driver named, or null",
    "process_name": "its name, '' when unknown",
    "count": "how many lines this incident printed (identical lines close in time)",
    "faults": "how many faults it stands for (an Event's count): for an application's XID whose lines name "
              "the process, those lines (driver 580's XID 13 prints three lines, one with the pid); else its count",
    "incidents": "1 when this observation is a new incident, 0 when it continues one or follows another "
                 "XID (rules with count/window/boots add these up)",
    "follows": "the XID this one is a companion of (154 after it, 45 'caused by previous Xid N', one "
               "NVLink link's 144-150 set), else null",
    "source": "kernel, nvml or both",
    "boot": "the boot the lines came from (boot id, or boot-N for a saved log)",
    "line": "line number of the first such line in a log file, or null",
    "origin": "kernel, or unverified: a saved log's line whose wrapper does not prove the kernel wrote it",
    "gpu_instance": "MIG: the GPU instance (GPU-I) the driver named, else null",
    "nvlink_unit": "XID 144-150: the NVLink5 unit (SAW, RLW, TLW, TREX, NVLPW_CTRL, NETIR, MSE), else ''",
    "nvlink_subcode": "XID 144-150: the unit's subcode the line starts with (RLW_REMAP, NETIR_LINK_EVT, ...)",
    "link": "XID 144-150: the NVLink the line names, else null",
    # XID 144-150 decoded against NVIDIA's "XID 144-150 Decode" table (detector/checks/xid/nvlink5.py)
    "intrinfo": "XID 144-150: the interrupt info, the first hex word in the line's parentheses (0x025001c6); "
                "'' when absent",
    "error_status": "XID 144-150: the error status, the second hex word (0x00000000); '' when absent",
    "xid_decoded": "XID 144-150: the catalogue's sub-code, XID.(IntrInfo[25:20]) (149.37); '' without "
                   "interrupt info",
    "nvlink_layout": "XID 144-150: which IntrInfo layout the unit bits matched, V1 (drivers before R575) or "
                     "V2 (R575 and later); '' when not decoded",
    "nvlink_decoded_unit": "XID 144-150: the unit the interrupt info encodes, named as the line names it; "
                           "'' when not decoded",
    "nvlink_resolution": "XID 144-150: the catalogue's resolution for the decoded row (RESET_GPU, IGNORE, "
                         "XID_154_EVAL); '' when the table has no row for the line",
    "nvlink_investigation": "XID 144-150: the catalogue's investigatory action (INVESTIGATE_PEER_DEVICE, "
                            "CONTACT_SUPPORT, ...); '' when not decoded",
    "nvlink_severity": "XID 144-150: the catalogue's severity (Fatal, Link Fatal, Non-fatal); '' when not "
                       "decoded",
    "nvlink_effect": "XID 144-150: the catalogue's local/remote effect of the row; '' when not decoded",
    "nvlink_guidance": "XID 144-150: the investigatory action in words; '' when not decoded",
    "nvlink_note": "XID 144-150: why the line was not decoded (no interrupt info, a unit, sub-code or status "
                   "the catalogue does not list, a unit word the bits contradict), else ''",
    "detail": "SXid: a Severity/Data detail line whose headline (same switch and code) did not come just "
              "before it (one that did is folded into its headline's incident)",
    "applications": "XID 13/31: how many different applications (process names) raised XID 13 or 31 on this "
                    "GPU within application_window_s, this one included; else null",
    "xid_in_window": "XID (kind xid): new incidents of XIDs that are not an application's (not in the "
                     "RESTART_APP bucket nor 43-45) on this GPU within xid_rate_window_s, this one included; "
                     "else null",
    # Driver lines without an Xid (kind rm_init_failed, gsp_timeout, pcie_aer, peermem_failed, driver_assert,
    # crash_dump); they also carry kind, pci_bus_id (the GPU: for AER the endpoint or the GPU below the port),
    # message (the first line), count, incidents, follows, boot, line and origin.
    "severity": "pcie_aer: the AER report's severity, fatal, uncorrected (non-fatal) or corrected; else null",
    "port": "pcie_aer: the root or switch port(s) above the GPU whose lines reported it, '' for the GPU's own",
    "reports": "pcie_aer: AER reports in this incident (their `PCIe Bus Error`/`error received` lines)",
    "reports_in_window": "pcie_aer corrected: corrected AER reports on this GPU within aer_window_s; else null",
    "driver_gpu": "`NVRM: GPU6 ...`: the driver's own GPU number (not NVML's index), else null",
    "minor": "rm_init_failed: the device minor number (/dev/nvidiaN) the line names, else null",
    "index_from": "driver lines: where the GPU's index comes from: NVML, or 'PCI bus order (NVML does not "
                  "enumerate it)' for a GPU on the PCI bus that NVML does not list; '' when it has none",
}
TABLE_IGNORED = 5          # user-space lines named in diagnose's table
TABLE_EVENTS = 20          # kernel events listed in diagnose's table; JSON lists up to max_kernel_events
# Driver 580 prints an application fault's XID 13 as three lines, the process (pid=, name=) only on the last,
# within a few ms (3.1 ms on a real H100). Read live, a read can end between them: the check then waits up to
# PROCESS_LINE_WAIT_S for the rest, or the fault would be one event with no process and a second naming it.
# Lines older than RECENT_LINE_S (by their own time) are not waited for: their process line would be there.
PROCESS_LINE_WAIT_S = 0.25
RECENT_LINE_S = 5.0
MAX_SERIALS = 256           # bus ids whose board serial the kernel log named (a node has at most 64 GPUs)


class XidCheck(Check):
    name = "xid"
    description = "XID and NVSwitch SXid events from the kernel log and NVML events, deduplicated"
    fields = FIELDS
    config_fields = {
        "kernel_log_file": ConfigField(str, "", "scan this saved log instead of the live kernel log: a file "
                                                "(gzip/bzip2/xz too), a directory or glob of rotated pieces, "
                                                "or '-' for stdin"),
        "nvml_events": ConfigField(bool, True, "also listen for NVML XID events"),
        "listen_s": ConfigField(float, 0.0, "wait this long for NVML XID events on each run"),
        "dedupe_window_s": ConfigField(float, 60.0, "an XID seen by both sources within this long counts once"),
        "incident_gap_s": ConfigField(float, 60.0, "identical lines further apart than this are separate "
                                                   "incidents"),
        "max_kernel_events": ConfigField(int, 1_000, "XID lines listed per run in the report (all are counted)"),
        "application_window_s": ConfigField(float, 86_400.0, "XID 13/31 from different applications on one GPU "
                                                             "within this long count together (field "
                                                             "`applications`)"),
        "xid_rate_window_s": ConfigField(float, 3_600.0, "XID incidents on one GPU within this long count "
                                                         "together (field `xid_in_window`)"),
        "aer_window_s": ConfigField(float, 60.0, "corrected PCIe AER reports on one GPU within this long count "
                                                 "together (field `reports_in_window`; DCGM's PCIe replay limit "
                                                 "is per minute)"),
    }
    default_interval_s = 5.0
    default_timeout_s = 60.0
    needs_fresh_inventory = False
    metrics = XidMetrics

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._listener: NvmlXidListener | None = None
        self._incidents = IncidentTracker(self.config["incident_gap_s"], self.config["dedupe_window_s"])
        self._drivers = DriverIncidents(self.config["incident_gap_s"], self.config["aer_window_s"])
        self._xid_times: dict[str, deque[float]] = {}   # GPU -> times of its new non-application XID incidents
        self._applications = ApplicationFaults(self.config["application_window_s"])
        self._uuids: dict[str, str] = {}          # bus id -> UUID, from `NVRM: GPU at ...` lines
        self._serials: dict[str, str] = {}        # bus id -> board serial, from the lines after those
        self._named_last = ""                     # the bus id the last `NVRM: GPU at ...` line named
        self._live_boots = SavedLogTimeline()     # boots of a live reader that knows no boot id
        self._file_done = False
        self._boot: str | None = None             # the boot the cross-source dedupe belongs to

    def run(self, ctx: SweepContext) -> CheckOutput:
        if ctx.host.current_boot() != self._boot:     # a fake node rebooted under a running agent: an XID of
            self._boot = ctx.host.current_boot()      # the new boot is never a duplicate of the old one's
            self._incidents.forget_sources()
            self._serials.clear()                   # the boards of a boot that is over
        gpus = {g.pci_bus_id: g.ref() for g in ctx.inventory.gpus if g.pci_bus_id}
        self._uuids.update({g.pci_bus_id: g.uuid for g in ctx.inventory.gpus if g.pci_bus_id and g.uuid})
        self._incidents.start_run()
        self._drivers.start_run()
        known = set(gpus) | {d.bus_id for d in ctx.pci_gpus or []}
        upstream = {port: d.bus_id for d in ctx.pci_gpus or [] for port in getattr(d, "upstream", ())}
        run = _Run(self._incidents, gpus, self._uuids, self.config["max_kernel_events"],
                   AerReports(known, upstream.get))
        nvml_count = self._read_nvml(ctx, run)          # first: its listen window may let log lines land
        path = self.config["kernel_log_file"]
        if path:
            source, summary, error = self._read_saved(path, run) if not self._file_done else (path, "", "")
            self._file_done = True
        else:
            source, summary, error = self._read_live(ctx, run), "", ""
        now = time.time()
        for event, boot, when, lineno, file in run.finish_drivers():
            self._drivers.add(event, boot, when, lineno, file)
        self._drivers.finish(self._incidents.groups)
        self._count_applications()
        in_window = self._count_xids()
        observations = [Observation(self.name, {**i.fields(), "xid_in_window": in_window.get(id(i))},
                                    gpu_for(i.first.pci_bus_id, gpus, self._uuids),
                                    i.first_time if i.first_time is not None else now)
                        for i in self._incidents.groups]
        pci_order = [d.bus_id for d in ctx.pci_gpus or []] if not ctx.inventory.nvml_error else []
        for d in self._drivers.groups:
            gpu = None if d.first.kind == "peermem_failed" else _named(gpu_for(d.gpu or "", gpus, self._uuids),
                                                                        pci_order)
            fields = {**d.fields(), "index_from": "" if gpu is None or gpu.index is None else
                      "NVML" if d.gpu in gpus else "PCI bus order (NVML does not enumerate it)"}
            observations.append(Observation(self.name, fields, gpu, d.first_time if d.first_time is not None
                                            else now))
        result = {
            "kernel_log": source, "lines_scanned": run.lines, "nvml_events": nvml_count,
            "kernel_events": run.events, "kernel_events_omitted": run.omitted,
            "incidents": sum(o.fields["incidents"] for o in observations),
            "driver_lines": run.driver_lines, "aer_lines_not_on_a_gpu": run.aer.dropped,
            "groups_overflow": self._incidents.overflow, "ignored_events": run.ignored, **run.saved,
        }
        if self._serials:
            result["board_serials"] = dict(self._serials)
        if self._listener and self._listener.error:
            result["nvml_events_error"] = self._listener.error
        return CheckOutput(observations, result, summary, error)

    def _count_xids(self) -> dict[int, int]:
        """XID incidents (not an application's) per GPU within xid_rate_window_s, at each one's own time."""
        window = self.config["xid_rate_window_s"]
        counts: dict[int, int] = {}
        for i in sorted(self._incidents.groups, key=lambda i: (i.first_time is None, i.first_time or 0.0)):
            e = i.first
            if e.kind != "xid" or e.code in APPLICATION_XIDS or not e.pci_bus_id or i.first_time is None \
                    or (e.pci_bus_id not in self._xid_times and len(self._xid_times) >= 4096):
                continue
            times = self._xid_times.setdefault(e.pci_bus_id, deque(maxlen=4096))
            if i.new and i.follows is None:
                times.append(i.first_time)
            counts[id(i)] = sum(1 for t in times if i.first_time - window < t <= i.first_time)
        return counts

    def _count_applications(self) -> None:
        """XID 13/31 incidents learn how many applications have faulted on their GPU (in time order)."""
        for i in sorted(self._incidents.groups, key=lambda i: (i.first_time is None, i.first_time or 0.0)):
            e = i.first
            if e.kind == "xid" and e.code in GPU_SUSPECT_XIDS and e.pci_bus_id:
                i.applications = self._applications.see(e.pci_bus_id, e.process_name, i.first_time,
                                                        new=i.new and i.follows is None)

    # -- the live kernel log ---------------------------------------------------------------------

    def _read_live(self, ctx: SweepContext, run: "_Run") -> str:
        reader = ctx.host.kernel_log
        if reader is None:
            return "none"
        wait = getattr(reader, "wait", None)
        deadline = time.monotonic() + PROCESS_LINE_WAIT_S
        while True:
            self._read_batch(reader.read_available(), run)
            left = deadline - time.monotonic()
            if not run.awaits_process(time.time()) or wait is None or left <= 0 or not wait(left):
                break
        return getattr(reader, "name", type(reader).__name__)

    def _read_batch(self, lines: list[LogLine], run: "_Run") -> None:
        for line in lines:
            run.lines += 1
            if not is_kernel(line):
                continue                         # written by a user-space program, not the kernel
            parsed = parse_line(line.text, kernel=line.priority is not None)
            if parsed is None:
                driver = parse_driver_line(line.text, kernel=line.priority is not None)
                if driver is not None and driver.origin == KERNEL:
                    boot = line.boot_id or self._live_boots.see(driver)
                    run.take_driver(driver, line.seq if line.seq is not None else line.lineno, boot,
                                    line.realtime or driver.time, None, line.lineno)
                continue
            if not _proven_kernel(line, parsed):
                continue
            if isinstance(parsed, (UuidMapping, BoardSerial)):
                self._learn_identity(parsed)
                continue
            if isinstance(parsed, SplitStart):
                continue                         # kmsg and journald deliver split messages whole
            boot = line.boot_id or self._live_boots.see(parsed)
            if isinstance(parsed, KernelEvent):
                run.take(parsed, line.lineno, boot, line.realtime or parsed.time, seq=line.seq)

    def _learn_identity(self, parsed: UuidMapping | BoardSerial) -> None:
        """Which UUID and board serial the driver printed for a bus id. `GPU Board Serial Number` names no
        GPU: it is the one the `GPU at ...` line printed just before it named."""
        if isinstance(parsed, UuidMapping):
            self._uuids[parsed.pci_bus_id] = parsed.uuid
            self._named_last = parsed.pci_bus_id
            return
        bus = parsed.pci_bus_id or self._named_last
        self._named_last = ""
        if bus and parsed.serial and len(self._serials) < MAX_SERIALS:
            self._serials[bus] = parsed.serial

    # -- a saved log (post-mortem) ---------------------------------------------------------------

    def _read_saved(self, spec: str, run: "_Run") -> tuple[str, str, str]:
        try:
            logs = saved_logs(spec)
        except LogNotFound as e:
            raise OSError(f"cannot read kernel log {e}") from None
        timeline = SavedLogTimeline()
        unrecognised, files = [], []
        for log in logs:
            lines, recognised = self._scan_one(log, timeline, run)
            files.append({"name": log.name, "lines": lines, "recognised": recognised})
            if not recognised:
                unrecognised.append(log.name)
        run.saved = {"files": files, "boots": timeline.boots, "times": timeline.describe_times(),
                     "unverified_events": run.unverified, "ignored": run.ignored_lines}
        name = logs[0].name if len(logs) == 1 else f"{spec} ({len(logs)} files)"
        error = "; ".join(f"no kernel-log lines recognised in {n}" for n in unrecognised)
        return name, _summary(name, run, timeline), error

    def _scan_one(self, log: SavedLog, timeline: SavedLogTimeline, run: "_Run") -> tuple[int, bool]:
        parsed_lines = 0
        split: SplitStart | None = None          # a split message's first line, and where it was
        split_line = 0

        def on_line(lineno: int, parsed: Any, text: str) -> None:
            nonlocal parsed_lines, split, split_line
            parsed_lines += 1
            if isinstance(parsed, (UuidMapping, BoardSerial)):
                self._learn_identity(parsed)
                return
            if isinstance(parsed, SplitStart):
                split, split_line = parsed, lineno
                return
            if isinstance(parsed, DriverEvent):
                boot = timeline.see(parsed)
                if parsed.origin != USER_SPACE:
                    run.take_driver(parsed, run.lines + lineno, boot, timeline.judged_time(parsed), log.name,
                                    lineno)
                return
            if isinstance(parsed, KernelEvent) and not parsed.pci_bus_id and split and lineno - split_line <= 3:
                parsed = replace(parsed, pci_bus_id=split.pci_bus_id)     # the end of a split message
                split = None
            boot = timeline.see(parsed)
            if isinstance(parsed, KernelEvent):
                run.take(parsed, lineno, boot, timeline.judged_time(parsed), file=log.name)

        try:
            with log.open() as stream:
                head = read_head(stream)
                lines = scan_stream(stream, on_line, drivers=True).lines
        except (OSError, EOFError, ValueError) as e:   # unreadable, or a corrupt compressed piece
            raise OSError(f"cannot read kernel log {log.name}: {getattr(e, 'strerror', None) or e}") from None
        run.lines += lines
        return lines, parsed_lines > 0 or looks_like_kernel_log(head)

    # -- NVML's event API ------------------------------------------------------------------------

    def _read_nvml(self, ctx: SweepContext, run: "_Run") -> int:
        if not self.config["nvml_events"] or ctx.inventory.nvml_error or ctx.host.nvml_init_error:
            return 0
        if self._listener is None:
            self._listener = NvmlXidListener(ctx.host.nvml)
        self._listener.register(ctx.inventory.gpus)
        events = self._listener.drain(self.config["listen_s"])
        for e in events:
            bus = e.gpu.pci_bus_id or ""
            event = KernelEvent("xid", e.code, bus, "reported by NVML's event API")
            self._incidents.add_nvml(event, ctx.host.current_boot(), e.arrived)
        return len(events)


def _named(gpu: GpuRef, pci_order: list[str]) -> GpuRef:
    """A GPU NVML does not enumerate (its RM init failed) is numbered by its place among the NVIDIA GPUs on
    the PCI bus in bus order: the index NVML gives it when it does enumerate it (NVML numbers GPUs in PCI bus
    order), and the observation's `index_from` says so. A GPU not on the PCI bus stays unnumbered."""
    if gpu.index is not None or not gpu.pci_bus_id or gpu.pci_bus_id not in pci_order:
        return gpu
    return GpuRef(pci_order.index(gpu.pci_bus_id), gpu.uuid, gpu.pci_bus_id)


def _proven_kernel(line: LogLine, parsed: Any) -> bool:
    """Live lines: a source that knows the facility (kmsg, journald) has proven it (parse_line was told);
    a log file's line must carry a wrapper that says `kernel`. A UUID mapping only names a GPU."""
    return not isinstance(parsed, KernelEvent) or parsed.origin == KERNEL


class _Run:
    """What one run of the check gathers: the kernel lines it lists, and the incidents they make in the
    check's tracker (which merges them with NVML's events of the same faults)."""

    def __init__(self, incidents: IncidentTracker, gpus: dict[str, GpuRef], uuids: dict[str, str],
                 max_events: int, aer: AerReports | None = None):
        self.incidents = incidents
        self.aer = aer or AerReports()
        self.driver_lines = 0
        self._drivers: list[tuple[DriverEvent, str, float | None, int | None, str | None, int]] = []
        self._aer_context: dict[int, tuple[str, float | None, str | None, int | None]] = {}
        self._order = 0
        self.gpus = gpus
        self.uuids = uuids                    # bus id -> UUID, as the log maps them (the check's, updated live)
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        self.omitted = 0
        self.lines = 0
        self.unverified = 0
        self.ignored = 0
        self.ignored_lines: list[dict[str, Any]] = []
        self.saved: dict[str, Any] = {}

    def take_driver(self, event: DriverEvent, position: int | None, boot: str, when: float | None,
                    file: str | None, lineno: int | None) -> None:
        """A driver line; an AER line waits for its report's burst to say which GPU it is about.
        `position`: where it stands among the run's lines (a saved log's lines across its files, or a kmsg
        sequence number), which tells an AER burst from the next."""
        self.driver_lines += 1
        self._order += 1
        if position is None:
            position = self._order
        if event.kind != PCIE_AER:
            self._drivers.append((event, boot, when, lineno, file, position))
            return
        if len(self._aer_context) < 65_536:
            self._aer_context[position] = (boot, when, file, lineno)
        for resolved, at in self.aer.feed(event, position):
            self._take_aer(resolved, at)

    def _take_aer(self, event: DriverEvent, position: int | None) -> None:
        boot, when, file, lineno = self._aer_context.get(position, ("", event.time, None, None))
        self._drivers.append((event, boot, when, lineno, file, position or 0))

    def finish_drivers(self) -> list[tuple[DriverEvent, str, float | None, int | None, str | None]]:
        """The run's driver lines in log order, the AER lines tied to their GPU (or dropped)."""
        for resolved, at in self.aer.finish():
            self._take_aer(resolved, at)
        self._aer_context.clear()
        return [d[:5] for d in sorted(self._drivers, key=lambda d: d[5])]

    def awaits_process(self, now: float) -> bool:
        """Whether a recent application fault read in this run still names no process: its line may be next."""
        return any(i.awaits_process() and (i.last_time is None or now - i.last_time < RECENT_LINE_S)
                   for i in self.incidents.groups)

    def take(self, event: KernelEvent, lineno: int | None, boot: str, when: float | None,
             seq: int | None = None, file: str | None = None) -> None:
        """A kernel-log line. One a user-space facility wrote (the log's format shows it) is no XID:
        it is counted and named as ignored, never an event."""
        if event.origin == USER_SPACE:
            self.ignored += 1
            if len(self.ignored_lines) < self.max_events:
                self.ignored_lines.append({"kind": event.kind, "code": event.code, "line": lineno, "file": file,
                                           "message": event.message})
            return
        self._list(event, lineno, seq, boot, file)
        self.incidents.add_kernel(event, boot, when, lineno, file, taken=time.time())

    def _list(self, event: KernelEvent, lineno: int | None, seq: int | None, boot: str, file: str | None) -> None:
        if event.origin != KERNEL:
            self.unverified += 1
        if len(self.events) >= self.max_events:
            self.omitted += 1
            return
        gpu = gpu_for(event.pci_bus_id, self.gpus, self.uuids)
        entry = {
            "kind": event.kind, "code": event.code, "pci_bus_id": event.pci_bus_id or None, "pid": event.pid,
            "process_name": event.process_name or None,
            "gpu": {"index": gpu.index, "uuid": gpu.uuid} if gpu.index is not None or gpu.uuid else None,
            "time": _rfc3339(event.time), "monotonic_s": event.monotonic_s, "boot": boot,
            "origin": event.origin, "line": lineno, "seq": seq, "message": event.message,
        }
        if file is not None:
            entry["file"] = file
        if event.gpu_instance is not None:
            entry["gpu_instance"] = event.gpu_instance
        if event.kind == "xid" and event.code in NVLINK_UNITS:
            decoded = nvlink_decode(event)
            entry.update({k: decoded[k] for k in ("xid_decoded", "nvlink_resolution", "link")})
        self.events.append(entry)


def _rfc3339(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _summary(name: str, run: _Run, timeline: SavedLogTimeline) -> str:
    """diagnose's table: what was read, boots, how times were judged, then the events themselves."""
    total = len(run.events) + run.omitted
    head = (f"{name}: {run.lines:,} lines, {timeline.boots} boot(s), {total:,} XID/SXid line(s)"
            f"{f' ({run.unverified:,} of unverified origin)' if run.unverified else ''}; "
            f"times: {timeline.describe_times()}")
    rows = []
    for e in run.events[:TABLE_EVENTS]:
        when = e["time"] or (f"+{e['monotonic_s']:.6f}s" if e["monotonic_s"] is not None else "-")
        gpu = e["gpu"] or {}
        who = f"GPU {gpu['index']} " if gpu.get("index") is not None else ""
        who += f"({e['pci_bus_id'] or 'bus id redacted'})"
        mark = "  [unverified origin]" if e["origin"] != KERNEL else ""
        code = e.get("xid_decoded") or e["code"]
        rows.append(f"  {when}  {e['boot']}  line {e['line']}  {e['kind'].upper()} {code}  {who}"
                    f"{mark}  {e['message'][:100]}")
    if total > TABLE_EVENTS:
        rows.append(f"  ... {total - TABLE_EVENTS:,} more (-o json lists up to {run.max_events:,})")
    if run.ignored:
        where = ", ".join(f"line {i['line']}" for i in run.ignored_lines[:TABLE_IGNORED])
        more = f", +{run.ignored - TABLE_IGNORED:,} more" if run.ignored > TABLE_IGNORED else ""
        rows.append(f"  ignored: {run.ignored:,} line(s) written by user space (the log shows a non-kernel "
                    f"facility), never an event: {where}{more}")
    return "\n".join([head, *rows])
