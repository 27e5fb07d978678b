"""The node's memory across reboots: which problems each boot had, and each GPU's incidents.

Two questions span reboots, so their answers live in the state directory (`history.json`), not in memory:
is automation rebooting this node again and again for a problem that comes back (a remediation loop)?
Does one GPU keep failing, boot after boot (a flaky GPU to send back)? GPUs are kept by serial, else by
UUID, so a GPU is followed even when it moves to another slot or the node's bus numbering changes.

Bounded: what is older than `retention_s` ages out, and at most MAX_BOOTS boots, MAX_GPUS GPUs and
MAX_INCIDENTS incidents per GPU are kept (the newest). Writes happen only when something new is learned
(a boot, a problem in a boot, an incident), atomically. A file that cannot be read is moved aside for a
post-mortem, reported once, and the history starts afresh: it never stops the daemon.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from detector.backends.quarantine import kept_at

HISTORY_FILE = "history.json"
VERSION = 1
MAX_BOOTS = 200
MAX_GPUS = 64
MAX_INCIDENTS = 100


@dataclass
class BootRecord:
    boot: str
    first_seen: float                       # when gpu-npd first saw this boot (soon after it began)
    problems: dict[str, float] = field(default_factory=dict)   # problem key -> first seen in this boot
    maintenance: str = ""                   # the planned maintenance it began in ("" if none): such a boot
                                            # counts towards neither remediation loops nor flaky GPUs


@dataclass(frozen=True)
class Incident:
    time: float
    boot: str
    reason: str
    action: str
    message: str = ""


@dataclass
class GpuRecord:
    key: str                                # serial, else UUID, else bus id
    serial: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    index: int | None = None
    incidents: list[Incident] = field(default_factory=list)

    def boots_since(self, since: float) -> list[Incident]:
        """The first incident of each boot since `since`, oldest first."""
        first: dict[str, Incident] = {}
        for incident in sorted(self.incidents, key=lambda i: i.time):
            if incident.time >= since:
                first.setdefault(incident.boot, incident)
        return list(first.values())


@dataclass(frozen=True)
class Loop:
    """Problems that came back after each of `reboots` reboots: `boots` are the boots they were seen in,
    oldest first (the first is the one whose problem the first reboot was meant to cure)."""

    problems: list[str]
    reboots: int
    boots: list[BootRecord]


class History:
    def __init__(self, path: Path | None, retention_s: float = 30 * 86400.0):
        self.path, self.retention_s = path, retention_s
        self.boots: list[BootRecord] = []
        self.gpus: dict[str, GpuRecord] = {}
        self._dirty = False

    # -- learning -------------------------------------------------------------------------------------

    def note_boot(self, boot: str, now: float, maintenance: str = "") -> BootRecord:
        for record in reversed(self.boots):
            if record.boot == boot:
                return record
        record = BootRecord(boot, now, maintenance=maintenance)
        self.boots.append(record)
        self._dirty = True
        return record

    def note_problem(self, boot: str, key: str, now: float) -> None:
        record = self.note_boot(boot, now)
        if key not in record.problems:
            record.problems[key] = now
            self._dirty = True

    def note_incident(self, gpu: GpuRecord, incident: Incident) -> None:
        """Once per GPU, boot and reason: a condition held for hours is one incident, not one per sweep."""
        record = self.gpus.get(gpu.key)
        if record is None:
            record = self.gpus[gpu.key] = GpuRecord(gpu.key, gpu.serial, gpu.uuid, gpu.pci_bus_id, gpu.index)
        for name in ("serial", "uuid", "pci_bus_id", "index"):          # the latest identity wins
            if getattr(gpu, name) is not None and getattr(record, name) != getattr(gpu, name):
                setattr(record, name, getattr(gpu, name))
                self._dirty = True
        if any(i.boot == incident.boot and i.reason == incident.reason for i in record.incidents):
            return
        record.incidents.append(incident)
        self._dirty = True

    def prune(self, now: float) -> None:
        since = now - self.retention_s
        boots = [b for b in self.boots if b.first_seen >= since][-MAX_BOOTS:]
        if len(boots) != len(self.boots):
            self.boots, self._dirty = boots, True
        for key, record in list(self.gpus.items()):
            kept = sorted((i for i in record.incidents if i.time >= since), key=lambda i: i.time)[-MAX_INCIDENTS:]
            if len(kept) != len(record.incidents):
                record.incidents, self._dirty = kept, True
            if not record.incidents:
                del self.gpus[key]
                self._dirty = True
        if len(self.gpus) > MAX_GPUS:
            newest = sorted(self.gpus.values(), key=lambda r: r.incidents[-1].time)[-MAX_GPUS:]
            self.gpus, self._dirty = {r.key: r for r in newest}, True

    # -- judging --------------------------------------------------------------------------------------

    def loop(self, boot: str, window_s: float, now: float) -> Loop | None:
        """The problems of this boot that came back after the most reboots within the window: each reboot
        counted began in the window and followed a boot that had the same problem."""
        order = sorted((b for b in self.boots if not b.maintenance), key=lambda b: b.first_seen)
        current = next((i for i, b in enumerate(order) if b.boot == boot), None)
        if current is None:
            return None
        starts: dict[str, int] = {}
        for key in order[current].problems:
            i = current
            while i > 0 and order[i].first_seen >= now - window_s and key in order[i - 1].problems:
                i -= 1
            if i < current:
                starts[key] = i
        if not starts:
            return None
        first = min(starts.values())
        return Loop(sorted(k for k, i in starts.items() if i == first), current - first, order[first:current + 1])

    # -- persistence ----------------------------------------------------------------------------------

    def load(self) -> str | None:
        """Read the file; a warning (never an exception) when it is unusable, after moving it aside."""
        if self.path is None:
            return None
        try:
            self.boots, self.gpus = _parse(json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"cannot read the GPU history {self.path} ({type(e).__name__}: {e}); {kept_at(self.path)}; " \
                   "starting a new history"
        return None

    def save(self) -> None:
        """Write when something was learned; atomically, so a crash leaves the previous file."""
        if self.path is None or not self._dirty:
            return
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, self.path)
        self._dirty = False

    def to_dict(self) -> dict[str, Any]:
        return {"version": VERSION,
                "boots": [asdict(b) for b in self.boots],
                "gpus": [asdict(g) for g in self.gpus.values()]}


def read_history(state_dir: Path) -> tuple[History, str | None]:
    """For `gpu-npd history`: the history in a state directory, and what is wrong when it is unreadable.
    Reading never moves the file aside: that is the daemon's to do."""
    history = History(None)
    path = state_dir / HISTORY_FILE
    try:
        history.boots, history.gpus = _parse(json.loads(path.read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return History(None), f"cannot read {path}: {type(e).__name__}: {e}"
    return history, None


def _parse(data: Any) -> tuple[list[BootRecord], dict[str, GpuRecord]]:
    if not isinstance(data, dict) or data.get("version") != VERSION:
        found = data.get("version") if isinstance(data, dict) else None
        raise ValueError(f"version {found!r}, this gpu-npd reads {VERSION}")
    boots = [BootRecord(str(b["boot"]), float(b["first_seen"]),
                        {str(k): float(v) for k, v in b.get("problems", {}).items()}, str(b.get("maintenance", "")))
             for b in data["boots"]]
    gpus: dict[str, GpuRecord] = {}
    for g in data["gpus"]:
        record = GpuRecord(str(g["key"]), g.get("serial"), g.get("uuid"), g.get("pci_bus_id"), g.get("index"),
                           [Incident(float(i["time"]), str(i["boot"]), str(i["reason"]), str(i["action"]),
                                     str(i.get("message", ""))) for i in g["incidents"]])
        gpus[record.key] = record
    return boots, gpus
