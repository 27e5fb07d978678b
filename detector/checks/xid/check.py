"""The xid check: XID and NVSwitch SXid events from the kernel log and from NVML, as observations.

One observation stands for a group of identical lines (same kind, code, GPU, fatality, recovery
action and boot) with their `count`, so floods stay small. The kernel log is read incrementally by
the daemon (a reader keeps its cursor), or scanned whole for a post-mortem (`kernel_log_file`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detector.backends.kernlog.records import is_kernel
from detector.checks.xid.aggregate import XidAggregator, gpu_for
from detector.checks.xid.nvml_events import NvmlXidListener
from detector.checks.xid.parser import BootBanner, KernelEvent, UuidMapping, parse_line
from detector.checks.xid.scan import scan_stream
from detector.core.check import Check, CheckOutput, ConfigField
from detector.core.sweep import SweepContext
from detector.core.types import GpuRef, Observation

FIELDS = {
    "kind": "xid or sxid",
    "code": "the XID or SXid number",
    "pci_bus_id": "bus id of the GPU (XID) or NVSwitch (SXid), 0000:bb:dd.f",
    "fatal": "true/false when the line says Fatal/Nonfatal (XID 144-150, SXid), else null",
    "recovery_action": "XID 154: the action the driver asks for (NONE, RESET_GPU, RESTART_BM, DRAIN_P2P, "
                       "DRAIN_AND_RESET); '' otherwise",
    "message": "the rest of the first line after the code",
    "pid": "the process the driver named, or null",
    "process_name": "its name, '' when unknown",
    "count": "how many identical lines this observation stands for",
    "source": "kernel, nvml or both",
    "boot": "the boot the lines came from (boot id, or boot-N for a saved log)",
    "line": "line number of the first such line in a log file, or null",
}


@dataclass
class _Boots:
    """Which boot a line of a saved log belongs to: a new one after a boot banner, or when the
    kernel's monotonic clock goes back."""

    ordinal: int = 0
    last_mono: float | None = None

    def see(self, event: KernelEvent | BootBanner) -> str:
        if isinstance(event, BootBanner):
            self.ordinal += 1
            self.last_mono = None
        elif event.monotonic_s is not None:
            if self.last_mono is not None and event.monotonic_s + 1.0 < self.last_mono:
                self.ordinal += 1
            self.last_mono = event.monotonic_s
        return f"boot-{self.ordinal}"


@dataclass
class _Recent:
    """When each source last saw each (kind, code, bus), so one XID seen by both sources counts once.
    Constant time per line, even in a flood; bounded by the number of distinct XIDs."""

    window_s: float
    seen: dict[tuple[str, int, str], dict[str, float]] = field(default_factory=dict)
    limit: int = 4096

    def add(self, source: str, kind: str, code: int, bus: str, now: float) -> None:
        key = (kind, code, bus)
        if key not in self.seen and len(self.seen) >= self.limit:
            self.seen.pop(next(iter(self.seen)))
        self.seen.setdefault(key, {})[source] = now

    def has_other(self, source: str, kind: str, code: int, bus: str, now: float) -> bool:
        by_source = self.seen.get((kind, code, bus), {})
        return any(s != source and now - t <= self.window_s for s, t in by_source.items())


class XidCheck(Check):
    name = "xid"
    description = "XID and NVSwitch SXid events from the kernel log and NVML events, deduplicated"
    fields = FIELDS
    config_fields = {
        "kernel_log_file": ConfigField(str, "", "scan this saved log ('-': stdin) instead of the live kernel log"),
        "nvml_events": ConfigField(bool, True, "also listen for NVML XID events"),
        "listen_s": ConfigField(float, 0.0, "wait this long for NVML XID events on each run"),
        "dedupe_window_s": ConfigField(float, 60.0, "an XID seen by both sources within this long counts once"),
        "max_kernel_events": ConfigField(int, 10_000, "XID lines listed per run in the report (all are counted)"),
    }
    default_interval_s = 5.0
    default_timeout_s = 60.0
    needs_fresh_inventory = False

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        self._listener: NvmlXidListener | None = None
        self._recent = _Recent(self.config["dedupe_window_s"])
        self._uuids: dict[str, str] = {}          # bus id -> UUID, from `NVRM: GPU at ...` lines
        self._boots = _Boots()
        self._file_done = False

    def run(self, ctx: SweepContext) -> CheckOutput:
        gpus = {g.pci_bus_id: g.ref() for g in ctx.inventory.gpus if g.pci_bus_id}
        self._uuids.update({g.pci_bus_id: g.uuid for g in ctx.inventory.gpus if g.pci_bus_id and g.uuid})
        run = _Run(self, gpus)
        nvml_count = self._read_nvml(ctx, run)          # first: its listen window may let log lines land
        source = self._read_kernel_log(ctx, run)
        observations = [Observation(self.name, g.fields(), gpu_for(g.first.pci_bus_id, gpus, self._uuids),
                                    g.last_time or time.time())
                        for g in run.aggregator.groups.values()]
        result = {
            "kernel_log": source, "lines_scanned": run.lines, "nvml_events": nvml_count,
            "kernel_events": run.events, "kernel_events_omitted": run.omitted,
            "groups_overflow": run.aggregator.overflow,
        }
        if self._listener and self._listener.error:
            result["nvml_events_error"] = self._listener.error
        return CheckOutput(observations, result)

    # -- sources ---------------------------------------------------------------------------------

    def _read_kernel_log(self, ctx: SweepContext, run: "_Run") -> str:
        path = self.config["kernel_log_file"]
        if path:
            if not self._file_done:              # a saved log is read once, not re-reported each run
                self._scan_file(path, run)
                self._file_done = True
            return "stdin" if path == "-" else path
        reader = ctx.host.kernel_log
        if reader is None:
            return "none"
        for line in reader.read_available():
            run.lines += 1
            if not is_kernel(line):
                continue                         # written by a user-space program, not the kernel
            parsed = parse_line(line.text)
            if parsed is None:
                continue
            boot = "" if isinstance(parsed, UuidMapping) else (line.boot_id or self._boots.see(parsed))
            run.take(parsed, line.lineno, boot, line.realtime, "kernel", line.seq)
        return getattr(reader, "name", type(reader).__name__)

    def _scan_file(self, path: str, run: "_Run") -> None:
        def on_line(lineno: int, parsed: Any, text: str) -> None:
            boot = "" if isinstance(parsed, UuidMapping) else self._boots.see(parsed)
            run.take(parsed, lineno, boot, None, "kernel")

        if path == "-":
            run.lines = scan_stream(sys.stdin.buffer, on_line).lines
            return
        try:
            with Path(path).open("rb") as stream:
                run.lines = scan_stream(stream, on_line).lines
        except OSError as e:
            raise OSError(f"cannot read kernel log {path}: {e.strerror or e}") from None

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
            run.take(event, None, ctx.host.current_boot(), e.arrived, "nvml")
        return len(events)


class _Run:
    """What one run of the check gathers."""

    def __init__(self, check: XidCheck, gpus: dict[str, GpuRef]):
        self.check = check
        self.gpus = gpus
        self.aggregator = XidAggregator()
        self.events: list[dict[str, Any]] = []
        self.omitted = 0
        self.lines = 0

    def take(self, parsed: Any, lineno: int | None, boot: str, when: float | None, source: str,
             seq: int | None = None) -> None:
        if isinstance(parsed, UuidMapping):
            self.check._uuids[parsed.pci_bus_id] = parsed.uuid
            return
        if isinstance(parsed, BootBanner):
            return
        event: KernelEvent = parsed
        now = time.time()
        when = event.time or when or now
        recent = self.check._recent
        duplicate = recent.has_other(source, event.kind, event.code, event.pci_bus_id, now)
        recent.add(source, event.kind, event.code, event.pci_bus_id, now)
        if source == "kernel":
            self._list(event, lineno, seq)
        if duplicate:
            group = self.aggregator.find(event.kind, event.code, event.pci_bus_id)
            if group is not None:
                group.sources.add(source)       # the same XID through the other source: count once
                if source == "kernel":          # the kernel's line says more (message, process)
                    group.first, group.line = event, lineno
            return
        self.aggregator.add(event, boot, lineno, source, when)

    def _list(self, event: KernelEvent, lineno: int | None, seq: int | None) -> None:
        if len(self.events) >= self.check.config["max_kernel_events"]:
            self.omitted += 1
            return
        gpu = gpu_for(event.pci_bus_id, self.gpus, self.check._uuids)
        self.events.append({
            "kind": event.kind, "code": event.code, "pci_bus_id": event.pci_bus_id, "pid": event.pid,
            "process_name": event.process_name or None,
            "gpu": {"index": gpu.index, "uuid": gpu.uuid} if gpu.index is not None or gpu.uuid else None,
            "line": lineno, "seq": seq,
        })
