"""The node's memory across reboots: which problems each boot had, and each GPU's incidents.

Two questions span reboots, so their answers live in the state directory (`history.json`), not in memory:
is automation rebooting this node again and again for a problem that comes back (a remediation loop)?
Does one GPU keep failing, boot after boot (a flaky GPU to send back)? GPUs are kept by serial, else by
UUID, so a GPU is followed even when it moves to another slot or the node's bus numbering changes.

A GPU that NVML lost (off the bus) has no serial to read: `nvmlDeviceGetHandleByIndex` fails, as `nvidia-smi`
says ("Unable to determine the device handle for GPU ...: GPU is lost"). So the history also keeps, per bus
id, the board gpu-npd last read there (`seen`): within the boot it was read in, that slot holds that board (a
board is not swapped without a power cycle), so a GPU lost later in the boot, or after the daemon restarted,
is recorded by its serial. From another boot it is only a hint (the board may have been replaced in between).

Bounded: what is older than `retention_s` ages out, and at most MAX_BOOTS boots (MAX_PROBLEMS problems
each), MAX_GPUS GPUs and MAX_INCIDENTS incidents per GPU, and MAX_SEEN bus ids' boards are kept (the
newest), so the file has a size limit it never legitimately reaches (HISTORY_LIMIT). Writes happen only
when something new is learned (a boot, a problem in a boot, an incident, a board), atomically through a
fresh temporary name. A file that cannot be read (a link, a FIFO, too big, corrupt, the wrong shape) is
moved aside for a post-mortem, reported once, and the history starts afresh: it never stops the daemon.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from detector.backends.quarantine import kept_at
from detector.backends.safefile import UnsafeFile, read_text_bounded, write_atomic
from detector.core import saved

HISTORY_FILE = "history.json"
VERSION = 1
MAX_BOOTS = 200
MAX_GPUS = 64
MAX_INCIDENTS = 100
MAX_SEEN = 64                # bus ids whose last board is kept
MAX_PROBLEMS = 32            # problem keys (type/reason) kept per boot: more in one boot adds nothing to a loop
# The file at its fullest (MAX_BOOTS boots of MAX_PROBLEMS keys each, MAX_GPUS GPUs of MAX_INCIDENTS
# incidents each) is about 1.7 MB as saved (tests/test_state_files_hostile.py builds it and checks it fits).
# The limit is over twice that, and small on purpose: parsing JSON can cost 25 times the file's size (a
# file of empty objects), so a planted file costs the daemon at most about 100 MiB for a moment, not the
# 1.2 GB a 100 MB one did.
HISTORY_LIMIT = 4 << 20


@dataclass
class BootRecord:
    boot: str
    first_seen: float                       # when gpu-npd first saw this boot (soon after it began)
    problems: dict[str, float] = field(default_factory=dict)   # problem key -> first seen in this boot
    maintenance: str = ""                   # the planned maintenance it began in ("" if none): such a boot
                                            # counts towards neither remediation loops nor flaky GPUs


@dataclass(frozen=True)
class SeenGpu:
    """The board gpu-npd last read at a bus id, and in which boot."""

    pci_bus_id: str
    serial: str | None
    uuid: str | None
    boot: str
    time: float                             # when it was first read there in that boot


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
        self.seen: dict[str, SeenGpu] = {}  # bus id -> the board last read there
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
        if key not in record.problems and len(record.problems) < MAX_PROBLEMS:
            record.problems[key] = now
            self._dirty = True

    def note_seen(self, pci_bus_id: str, serial: str | None, uuid: str | None, boot: str, now: float) -> None:
        """A GPU NVML read at `pci_bus_id`; written only when the board there or the boot is new to the file."""
        before = self.seen.get(pci_bus_id)
        if before is not None and before.uuid == uuid and serial is None:
            serial = before.serial                   # read once: a later read that failed does not forget it
        if before is not None and (before.serial, before.uuid, before.boot) == (serial, uuid, boot):
            return
        self.seen[pci_bus_id] = SeenGpu(pci_bus_id, serial, uuid, boot, now)
        self._dirty = True

    def seen_in_boot(self, pci_bus_id: str | None, boot: str) -> SeenGpu | None:
        """The board read at `pci_bus_id` in `boot`: the same board a GPU lost later in that boot is."""
        seen = self.seen.get(pci_bus_id or "")
        return seen if seen is not None and seen.boot == boot else None

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
        seen = {k: v for k, v in self.seen.items() if v.time >= since}
        if len(seen) > MAX_SEEN:
            seen = dict(sorted(seen.items(), key=lambda kv: kv[1].time)[-MAX_SEEN:])
        if len(seen) != len(self.seen):
            self.seen, self._dirty = seen, True
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
        """Read the file; a warning (never an exception) when it is unusable (a link, a FIFO, over
        HISTORY_LIMIT, corrupt, the wrong shape), after moving it aside (a FIFO is renamed, never opened)."""
        if self.path is None:
            return None
        try:
            self.boots, self.gpus, self.seen = _parse(json.loads(read_text_bounded(self.path, HISTORY_LIMIT,
                                                                                   "GPU history")))
        except FileNotFoundError:
            return None
        except UnsafeFile as e:
            return f"cannot read the GPU history: {e}; {kept_at(self.path)}; starting a new history"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"cannot read the GPU history {self.path} ({type(e).__name__}: {e}); {kept_at(self.path)}; " \
                   "starting a new history"
        return None

    def save(self) -> None:
        """Write when something was learned; atomically through a fresh temporary name (write_atomic), so a
        crash leaves the previous file and a link planted at the name or beside it is never written through."""
        if self.path is None or not self._dirty:
            return
        write_atomic(self.path, json.dumps(self.to_dict(), indent=1))
        self._dirty = False

    def to_dict(self) -> dict[str, Any]:
        return {"version": VERSION,
                "boots": [asdict(b) for b in self.boots],
                "gpus": [asdict(g) for g in self.gpus.values()],
                "seen": [asdict(s) for s in self.seen.values()]}


def read_history(state_dir: Path) -> tuple[History, str | None]:
    """For `gpu-npd history`: the history in a state directory, and what is wrong when it is unreadable.
    Never blocks (a FIFO is refused at once) and never moves the file aside: that is the daemon's to do."""
    history = History(None)
    path = state_dir / HISTORY_FILE
    try:
        history.boots, history.gpus, history.seen = _parse(json.loads(read_text_bounded(path, HISTORY_LIMIT,
                                                                                        "the GPU history")))
    except FileNotFoundError:
        pass
    except UnsafeFile as e:
        return History(None), f"cannot read {e}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return History(None), f"cannot read {path}: {type(e).__name__}: {e}"
    return history, None


def _parse(data: Any) -> tuple[list[BootRecord], dict[str, GpuRecord], dict[str, SeenGpu]]:
    """The history as saved; ValueError naming the first field of the wrong shape."""
    if not isinstance(data, dict) or data.get("version") != VERSION:
        found = data.get("version") if isinstance(data, dict) else None
        raise ValueError(f"version {found!r}, this gpu-npd reads {VERSION}")
    boots = []
    for b in saved.listed(data, "boots"):
        problems = saved.record(saved.record(b).get("problems", {}), "a boot's problems")
        boots.append(BootRecord(saved.text(b, "boot"), saved.number(b, "first_seen"),
                                {str(k): saved.number(problems, k) for k in problems},
                                saved.text(b, "maintenance", "")))
    gpus: dict[str, GpuRecord] = {}
    for g in saved.listed(data, "gpus"):
        record = GpuRecord(saved.text(g, "key"), saved.text(g, "serial", None), saved.text(g, "uuid", None),
                           saved.text(g, "pci_bus_id", None), saved.whole_or_none(saved.record(g).get("index"),
                                                                                  "GPU index"),
                           [Incident(saved.number(i, "time"), saved.text(i, "boot"), saved.text(i, "reason"),
                                     saved.text(i, "action"), saved.text(i, "message", ""))
                            for i in saved.listed(g, "incidents")])
        gpus[record.key] = record
    seen = {}
    for g in saved.listed(data, "seen", []):          # absent in files written before it was kept
        board = SeenGpu(saved.text(g, "pci_bus_id"), saved.text(g, "serial", None), saved.text(g, "uuid", None),
                        saved.text(g, "boot"), saved.number(g, "time"))
        seen[board.pci_bus_id] = board
    return boots, gpus, seen

