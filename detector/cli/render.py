"""How a diagnosis looks: a table for people, JSON for programs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from detector.core.gpu_health import GpuHealth, gpu_health, gpu_key
from detector.core.inventory import GpuIdentity
from detector.core.sweep import CheckRun, SweepResult
from detector.core.types import GpuRef, Problem, Severity


@dataclass(frozen=True)
class Diagnosis:
    backend: str
    sweep: SweepResult
    problems: list[Problem]
    rules: list[dict] | None = None       # the active rule sets: [{"source", "rules"}]
    replay: dict | None = None            # --nvml replay:PATH: what was replayed (path, format, driver, judged)
    watch: dict | None = None             # --duration: how long the node was watched (oneshot.Watch.to_dict)

    def health(self) -> dict[str, GpuHealth]:
        """Each GPU's state (healthy, degraded, failed) and recommended action from the problems naming
        it, by gpu_key: what the daemon exports per GPU, so diagnose and the metrics agree."""
        refs = [g.ref() for g in self.sweep.inventory.gpus] + list(unseen_gpus(self).values())
        return {gpu_key(h.gpu): h for h in gpu_health(refs, self.problems)}

    def to_dict(self) -> dict[str, Any]:
        inv = self.sweep.inventory
        health = self.health()
        return {
            "node": self.sweep.node,
            "backend": self.backend,
            "driver_version": inv.driver_version,
            "nvml_error": inv.nvml_error,
            "healthy": not self.problems,
            "gpus": [{
                "index": g.index, "uuid": g.uuid, "name": g.name, "pci_bus_id": g.pci_bus_id,
                **g.identity.to_dict(), "pcie": g.pcie.to_dict() if g.pcie else None, "error": g.error,
                "health": _health_dict(health.get(gpu_key(g.ref()))),
            } for g in inv.gpus] + [{
                "index": None, "uuid": ref.uuid, "name": None, "pci_bus_id": bus, **GpuIdentity().to_dict(),
                "pcie": None, "error": "NotSeenByNvml", "health": _health_dict(health.get(gpu_key(ref))),
            } for bus, ref in unseen_gpus(self).items()],
            "problems": [p.to_dict() for p in self.problems],
            "rules": self.rules,
            "checks": [run.to_dict() for run in self.sweep.runs],
            **({"replay": self.replay} if self.replay else {}),
            "watch": self.watch,
        }


def render_table(d: Diagnosis) -> str:
    inv = d.sweep.inventory
    lines = [f"node {d.sweep.node}  backend {d.backend}  driver {inv.driver_version or '-'}  "
             f"GPUs {len(inv.gpus)}"]
    if d.replay:
        lines.append(f"replay of {d.replay['path']} ({d.replay['format']}, captured {d.replay['captured'] or 'unknown'}): "
                     f"{d.replay['judged']}")
    if d.watch:
        w = d.watch
        lines.append(f"watched {w['watched_s']:g} of {w['duration_s']:g} s ({w['time']} time), {w['sweeps']} sweep(s)"
                     + (": interrupted, judged on what was seen" if w["interrupted"] else "")
                     + "; rates and windows judged as the daemon judges them")
    elif not d.replay:
        lines.append("one sweep: counters are judged as totals since the driver loaded, against the same-model GPUs "
                     "beside them; --duration SECONDS watches the node and judges rates")
    if inv.nvml_error == "LibraryNotFound":
        lines.append("NVML: no NVIDIA driver on this machine (LibraryNotFound); GPUs are named by bus id")
    elif inv.nvml_error:
        lines.append(f"NVML unusable: {inv.nvml_error}")
    rows = [("GPU", "NAME", "BUS ID", "UUID", "SERIAL", "PCIE", "HEALTH", "STATE")]
    health = d.health()
    # A GPU is its bus id first: an index is NVML's, and a GPU NVML does not see has none.
    reasons: dict[str | int, list[str]] = {}
    for p in d.problems:
        for ref in p.gpus:
            key = ref.pci_bus_id or ref.index
            if key is not None and p.reason not in reasons.setdefault(key, []):
                reasons[key].append(p.reason)
    for g in inv.gpus:
        link = "-"
        if g.pcie and g.pcie.current_width:
            link = f"Gen{g.pcie.current_gen or '?'} x{g.pcie.current_width}/x{g.pcie.max_width or '?'}"
        state = reasons.get(g.pci_bus_id, []) if g.pci_bus_id else reasons.get(g.index, [])
        rows.append((str(g.index), g.name or "-", g.pci_bus_id or "-", g.uuid or "-", g.identity.serial or "-",
                     link, _health_cell(health.get(gpu_key(g.ref()))), ",".join(state) or g.error or "ok"))
    for bus, ref in unseen_gpus(d).items():
        rows.append(("-", "-", bus, ref.uuid or "-", "-", "-", _health_cell(health.get(gpu_key(ref))),
                     ",".join(reasons.get(bus, [])) or "NotSeenByNvml"))
    if len(rows) > 1:
        lines += ["", *columns(rows)]
    found = Counter(p.check for p in d.problems)
    lines += ["", "checks: " + ", ".join(_check_cell(r, found[r.name]) for r in d.sweep.runs)]
    lines += [f"{r.name}: {r.summary}" for r in d.sweep.runs if r.summary]
    lines.append("")
    if not d.problems:
        lines.append("No problems found.")
        return "\n".join(lines)
    lines.append(f"{len(d.problems)} problem(s):")
    for p in sorted(d.problems, key=lambda p: -p.severity.rank):
        gpus = ",".join(str(g.index) if g.index is not None else g.pci_bus_id for g in p.gpus
                        if g.index is not None or g.pci_bus_id)
        lines.append(f"  {_badge(p.severity)} {p.type}/{p.reason}" + (f"  GPUs {gpus}" if gpus else "")
                     + f"  [{p.report}, rule {p.rule}]")
        lines.append(f"      {p.message}")
    return "\n".join(lines)


def unseen_gpus(d: Diagnosis) -> dict[str, GpuRef]:
    """GPUs NVML does not enumerate, by bus id: the ones the visibility check found on the PCI bus (whether
    or not a rule judged them) and the ones a problem names (not attached, or the log of another machine).
    They get rows of their own, never another GPU's index."""
    known = {g.pci_bus_id for g in d.sweep.inventory.gpus if g.pci_bus_id}
    refs = [o.gpu for run in d.sweep.runs if run.name == "visibility" for o in run.observations
            if o.gpu and o.fields.get("in_nvml") is False]
    refs += [ref for p in d.problems for ref in p.gpus]
    unseen: dict[str, GpuRef] = {}
    for ref in refs:
        if ref.pci_bus_id and ref.pci_bus_id not in known:
            unseen.setdefault(ref.pci_bus_id, ref)
    return dict(sorted(unseen.items()))


def _health_dict(h: GpuHealth | None) -> dict[str, Any]:
    if h is None:
        return {"state": "healthy", "action": "NONE", "reasons": [], "incidents": 0}
    return {"state": h.state, "action": h.action, "reasons": list(h.reasons), "incidents": h.incidents}


def _health_cell(h: GpuHealth | None) -> str:
    """`healthy`, or the state and the action: `failed RESTART_BM`."""
    if h is None or h.action == "NONE":
        return "healthy" if h is None else h.state
    return f"{h.state} {h.action}"


def _check_cell(run: CheckRun, problems: int) -> str:
    """`xid ok (1 ms)` only for a check that ran and whose observations no rule found a problem in: else
    `xid found 1 problem (1 ms)`, `nccl skipped (0 ms): why`."""
    words = [] if run.status == "ok" and problems else [run.status]
    if problems:
        words.append(f"found {problems} problem{'s' if problems != 1 else ''}")
    why = f": {run.error}" if run.error else ""
    return f"{run.name} {', '.join(words)} ({run.duration_ms:.0f} ms){why}"


def _badge(severity: Severity) -> str:
    return f"{severity.value.upper():<8}"


def columns(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows (a header row first, where there is one) as left-aligned columns two spaces apart, each column as
    wide as its widest cell, so that no name, however long, pushes a row out of line."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
