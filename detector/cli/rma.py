"""`gpu-npd history --rma`: the node's GPUs to send back, in a form a support case can take.

Every GPU the history keeps has had an incident (a critical reset-, reboot- or replace-class problem), so
each is listed: by serial (else UUID, else bus id), with its incidents, the boots they fell in, whether it
is flaky by the node check's own rule (incidents on `flaky_boots` distinct boots within `flaky_window`),
and the evidence bundles that name it. Most incidents first: the GPU to look at first is on top.

A GPU lost later in a boot in which gpu-npd had read it is kept by that serial (the history's `seen`
boards), and one lost before that by the serial the driver printed before its first Xid. One with neither
(no such line, and gpu-npd never read it in that boot) is kept by its UUID or bus id: the report says
its serial is unknown and where to read it, and names the board gpu-npd last read at that bus id in
another boot as a hint, never as its serial (the board may have been replaced in between).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detector.agent.bundle_index import Bundle
from detector.checks.node.history import GpuRecord, Incident, SeenGpu

MESSAGE_MAX = 80                 # an incident's message in the table (the JSON has it whole)
NO_SERIAL = ("serial unknown: neither NVML (a GPU lost before gpu-npd read it in that boot) nor the kernel log "
             "(the driver's `GPU Board Serial Number` line) gave it; read it from the board's label, the BMC's "
             "inventory, or an earlier boot's `nvidia-smi -q`")


@dataclass(frozen=True)
class RmaGpu:
    record: GpuRecord
    boots: int                   # distinct boots with an incident, in all the history keeps
    boots_in_window: int         # distinct boots with an incident within the flaky window
    flaky: bool
    bundles: tuple[Bundle, ...]
    model: str | None
    last_read: SeenGpu | None = None      # the board last read at its bus id, for a GPU of unknown serial

    def note(self) -> str | None:
        """Why the serial is unknown, with the hint of the board last read at its bus id."""
        if self.record.serial:
            return None
        board = self.last_read
        if board is None or not board.serial:
            return NO_SERIAL
        return (f"{NO_SERIAL}. At bus id {board.pci_bus_id} gpu-npd last read serial {board.serial} "
                f"(boot {board.boot[:8]}, {_when(board.time)}): this board unless it was replaced since; "
                "check the label")

    def to_dict(self) -> dict[str, Any]:
        r = self.record
        return {"key": r.key, "index": r.index, "serial": r.serial, "uuid": r.uuid, "pci_bus_id": r.pci_bus_id,
                "model": self.model, "flaky": self.flaky, "incident_count": len(r.incidents), "boots": self.boots,
                "boots_in_window": self.boots_in_window,
                "incidents": [{"time": _when(i.time), "boot": i.boot, "reason": i.reason, "action": i.action,
                               "message": i.message or None} for i in _oldest_first(r.incidents)],
                "bundles": [b.to_dict() for b in self.bundles],
                "last_read_at_bus_id": None if r.serial or self.last_read is None else {
                    "serial": self.last_read.serial, "uuid": self.last_read.uuid, "boot": self.last_read.boot,
                    "time": _when(self.last_read.time)},
                "note": self.note()}


@dataclass(frozen=True)
class RmaReport:
    node: str
    generated: float
    version: str
    state_dir: Path
    flaky_boots: int
    flaky_window_s: float
    gpus: tuple[RmaGpu, ...]
    notes: tuple[str, ...]       # what could not be read (a corrupt bundle manifest), one line each

    def to_dict(self) -> dict[str, Any]:
        return {"report": "gpu-npd RMA evidence", "node": self.node, "generated_at": _when(self.generated),
                "gpu_npd_version": self.version, "state_dir": str(self.state_dir),
                "flaky_rule": {"flaky_boots": self.flaky_boots, "flaky_window_seconds": self.flaky_window_s},
                "gpus": [g.to_dict() for g in self.gpus], "notes": list(self.notes)}


def rma_report(gpus: list[GpuRecord], bundles: list[Bundle], *, node: str, now: float, version: str,
               state_dir: Path, flaky_boots: int, flaky_window_s: float, notes: list[str],
               seen: dict[str, SeenGpu] | None = None) -> RmaReport:
    """Each GPU with its incidents judged by the flaky rule and the bundles naming it; most incidents
    first, then most boots, then the most recent incident."""
    since = now - flaky_window_s
    out = []
    for record in gpus:
        named = tuple(b for b in bundles if b.names(record.serial, record.uuid, record.pci_bus_id) is not None)
        in_window = len(record.boots_since(since))
        entries = (b.names(record.serial, record.uuid, record.pci_bus_id) for b in named)
        model = next((g.model for g in entries if g is not None and g.model), None)
        out.append(RmaGpu(record, len({i.boot for i in record.incidents}), in_window, in_window >= flaky_boots,
                          named, model, (seen or {}).get(record.pci_bus_id or "")))
    out.sort(key=lambda g: (-len(g.record.incidents), -g.boots,
                            -max((i.time for i in g.record.incidents), default=0.0), g.record.key))
    return RmaReport(node, now, version, state_dir, flaky_boots, flaky_window_s, tuple(out), tuple(notes))


def render_rma(report: RmaReport, window_text: str) -> str:
    """The report as text: a header, then one block per GPU."""
    from detector.cli.render import columns      # diagnose's table helper: not imported by `gpu-npd run`

    lines = ["gpu-npd RMA evidence",
             f"  node:          {report.node}",
             f"  generated at:  {_when(report.generated)}",
             f"  gpu-npd:       {report.version}",
             f"  state dir:     {report.state_dir}",
             f"  flaky rule:    incidents on {report.flaky_boots} distinct boots within {window_text}",
             ""]
    if not report.gpus:
        lines.append("no GPU incidents recorded: no GPU of this node to send back")
    for g in report.gpus:
        r = g.record
        flag = "  FLAKY: send it back" if g.flaky else ""
        lines.append(f"GPU {r.index if r.index is not None else '?'}  serial {r.serial or 'unknown'}{flag}")
        lines.append(f"  uuid:       {r.uuid or 'unknown'}")
        lines.append(f"  bus id:     {r.pci_bus_id or 'unknown'}")
        lines.append(f"  model:      {g.model or 'unknown'}")
        note = g.note()
        if note:
            lines.append(f"  note:       {note}")
        lines.append(f"  incidents:  {len(r.incidents)} on {g.boots} boot(s); {g.boots_in_window} boot(s) "
                     f"within {window_text}")
        lines += _indented(columns([("WHEN (UTC)", "BOOT", "ACTION", "REASON", "MESSAGE")] + [
            (_when(i.time), i.boot[:8], i.action, i.reason, _short(i.message) or "-")
            for i in _oldest_first(r.incidents)]))
        if g.bundles:
            lines.append(f"  bundles:    {len(g.bundles)}")
            sizes = [_size(b.bytes) for b in g.bundles]
            width = max(map(len, ["SIZE", *sizes]))            # sizes right-aligned, to compare at a glance
            lines += _indented(columns([("CREATED", "SIZE".rjust(width), "PATH")] + [
                (b.created or "?", size.rjust(width), str(b.path)) for b, size in zip(g.bundles, sizes)]))
        else:
            lines.append("  bundles:    none kept for this GPU")
        lines.append("")
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines).rstrip()


def _indented(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


def _oldest_first(incidents: list[Incident]) -> list[Incident]:
    return sorted(incidents, key=lambda i: i.time)


def _short(message: str) -> str:
    line = message.splitlines()[0] if message else ""
    return line if len(line) <= MESSAGE_MAX else line[:MESSAGE_MAX - 1] + "…"


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
