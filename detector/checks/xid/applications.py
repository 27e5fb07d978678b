"""Which applications fault on each GPU: the evidence that turns application faults into a GPU suspect.

One program that keeps faulting is a bug in that program, however often it runs (a user's test kernel
run four times in two minutes gave four pids, all `python3`, on a healthy H100). NVIDIA's catalogue
gives XID 13 and 31 an investigatory workflow that asks whether the faults repeat across applications;
the same fault from several *different* applications on one GPU is what points at the GPU. So this
counts, per GPU, the distinct process names that raised XID 13 or 31 within a window: a pid is not an
application (a rerun gets a new one), and a fault whose process is unknown is no evidence either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GPU_SUSPECT_XIDS = frozenset({13, 31})     # NVIDIA's WORKFLOW_XID_13 / WORKFLOW_XID_31
_NAMES_PER_GPU = 256                      # remembered process names per GPU (oldest forgotten first)


@dataclass
class ApplicationFaults:
    window_s: float = 86_400.0
    _seen: dict[str, dict[str, float | None]] = field(default_factory=dict)   # bus -> name -> last time

    def see(self, bus: str, name: str, when: float | None, new: bool) -> int:
        """Record a fault (when `new`) and return how many distinct applications faulted on `bus` within
        the window ending at `when` (lines without a time are one instant with every other)."""
        names = self._seen.setdefault(bus, {})
        if new and name:
            names.pop(name, None)
            names[name] = when
            if len(names) > _NAMES_PER_GPU:
                names.pop(next(iter(names)))
        if when is None:
            return len(names)
        return sum(1 for t in names.values() if t is None or when - self.window_s <= t <= when)
