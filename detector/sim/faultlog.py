"""The fault log: every fault a simulated fleet suffered, one JSON line each.

It is the ground truth to score the detector against, so it is written as faults happen (a line
flushed at a time, for another process to tail) and kept in memory for the run's own summary.

    {"time": 1700000060.0, "at_s": 60.0, "node": "gpu-h100-0017", "kind": "xid", "gpu": 3,
     "params": {"code": 79}, "source": "scripted", "fault": "xid on GPU 3 (code=79)"}
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from detector.sim.timeline import FAULT_SOURCES, PlannedFault
from detector.yamlsource import SourceError
from fake_nvml.faults import Fault


class FaultLog:
    """Records faults in memory and, with a path, appends them to that file. Safe across threads."""

    def __init__(self, path: Path | None):
        self.path = path
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        self._file = path.open("a", encoding="utf-8") if path is not None else None

    def record(self, t: float, at_s: float, node: str, fault: Fault, source: str) -> dict[str, Any]:
        """Log one fault injected at epoch time `t`, `at_s` seconds after the fleet started."""
        if source not in FAULT_SOURCES:
            raise ValueError(f"unknown fault source {source!r} (known: {', '.join(FAULT_SOURCES)})")
        entry = {"time": t, "at_s": at_s, "node": node, "kind": fault.kind, "gpu": fault.gpu,
                 "params": dict(fault.params), "source": source, "fault": fault.describe()}
        line = json.dumps(entry) + "\n"
        with self._lock:
            self._records.append(entry)
            if self._file is not None:
                self._file.write(line)
                self._file.flush()
        return _copy(entry)

    def record_planned(self, t: float, planned: PlannedFault) -> dict[str, Any]:
        return self.record(t, planned.at_s, planned.node, planned.fault, planned.source)

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [_copy(r) for r in self._records]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> "FaultLog":
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def read_fault_log(path: Path) -> list[dict[str, Any]]:
    """The records of a fault log. A last line without its newline is still being written: skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SourceError(str(path), None, None, f"cannot read: {e.strerror or e}") from None
    lines = text.split("\n")
    lines.pop()                              # "" after a final newline, else the line being written
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SourceError(str(path), number, None, f"not a JSON fault record: {e.msg}") from None
        if not isinstance(record, dict):
            raise SourceError(str(path), number, None, "not a JSON fault record: expected an object")
        records.append(record)
    return records


def _copy(entry: dict[str, Any]) -> dict[str, Any]:
    return {**entry, "params": dict(entry["params"])}
