"""How long NVML takes to answer for each GPU over a window, and how that compares with the GPU's siblings:
the latency part of the visibility check (a GPU NVML cannot answer for at all is visibility's; one it answers
for slowly is the same failure earlier).

The durations come from the host's timed NVML (detector/backends/nvml_timing.py), drained every run and
stamped with the check's clock, so the window is the check's own: `diagnose --duration` on a fake node moves
it with the simulated clock, tests with a hand-moved one.

Judged per GPU against the median of its same-model siblings' p95, never against a fixed figure alone: a node
whose every call is slow (a driver-wide lock, a CPU-starved agent, persistence mode off) is not any one GPU's
fault (NVIDIA/NVSentinel #1748: one degrading GPU left the DCGM samples of its siblings as incomplete as its
own). The thresholds are in rules/visibility.yaml.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable

from detector.core.siblings import median_high, median_low

MAX_SAMPLES = 2048          # per GPU in the window (a sweep makes ~105 calls per GPU): memory stays bounded


@dataclass(frozen=True)
class GpuLatency:
    calls: int              # calls timed in the window
    p95_s: float            # nearest-rank 95th percentile of their durations
    max_s: float


class LatencyWindow:
    """Per GPU (by bus id), its NVML call durations of the last `window_s` seconds of `clock`, one
    4-byte float each, in batches as drained."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic, max_samples: int = MAX_SAMPLES):
        self.window_s = window_s
        self._clock = clock
        self._max_samples = max_samples
        self._batches: dict[str, deque[tuple[float, array]]] = {}

    def add(self, bus_id: str, durations: Iterable[float]) -> None:
        batch = array("f", durations)
        if not batch:
            return
        batches = self._batches.setdefault(bus_id, deque())
        batches.append((self._clock(), batch))
        total = sum(len(b) for _, b in batches)
        while len(batches) > 1 and total > self._max_samples:       # the oldest batches go first
            total -= len(batches.popleft()[1])
        if len(batches[-1][1]) > self._max_samples:                   # one batch too big on its own
            batches[-1] = (batches[-1][0], batches[-1][1][-self._max_samples:])

    def latency(self, bus_id: str) -> GpuLatency | None:
        """The GPU's figures over the window; None when it made no timed call in it."""
        batches = self._batches.get(bus_id)
        if not batches:
            return None
        oldest = self._clock() - self.window_s
        while batches and batches[0][0] < oldest:
            batches.popleft()
        if not batches:
            del self._batches[bus_id]
            return None
        values = sorted(v for _, batch in batches for v in batch)
        return GpuLatency(len(values), values[math.ceil(0.95 * len(values)) - 1], values[-1])

    def keep_only(self, bus_ids: set[str]) -> None:
        """Forget GPUs the node no longer has."""
        for bus_id in set(self._batches) - bus_ids:
            del self._batches[bus_id]


@dataclass(frozen=True)
class Timed:
    """One GPU to judge: its model (siblings share it), whether NVML answers for it, its latency."""

    model: str | None
    answered: bool          # the inventory read it without error; a GPU NVML fails for is judged elsewhere
    latency: GpuLatency | None


def latency_fields(gpus: Mapping[str, Timed], min_calls: int) -> dict[str, dict[str, Any]]:
    """Each GPU's latency fields, its p95 beside the median p95 of its same-model siblings that NVML answers
    for and that made at least `min_calls` timed calls in the window."""
    ready = {bus: t for bus, t in gpus.items()
             if t.answered and t.latency is not None and t.latency.calls >= min_calls}
    out: dict[str, dict[str, Any]] = {}
    for bus, t in gpus.items():
        lat = t.latency
        siblings = [s.latency.p95_s for b, s in ready.items() if b != bus and s.model == t.model and s.latency]
        median = median_high(siblings) if siblings else None     # the higher middle: fewer alarms
        out[bus] = {
            "nvml_calls": lat.calls if lat else 0,
            "nvml_p95_s": _figure(lat.p95_s) if lat else None,
            "nvml_max_s": _figure(lat.max_s) if lat else None,
            "nvml_latency_ready": lat is not None and lat.calls >= min_calls,
            "nvml_siblings": len(siblings),
            "nvml_siblings_p95_s": _figure(median) if median is not None else None,
            "nvml_slowdown": round(lat.p95_s / median, 1) if lat and median else None,
        }
    return out


def node_fields(gpus: Mapping[str, Timed], min_calls: int) -> dict[str, Any]:
    """The node's figures over the GPUs NVML answers for with a ready window: how many, and their median p95
    (the lower middle one: high only when more than half of them are slow: the driver or the host, not one GPU)."""
    p95s = [t.latency.p95_s for t in gpus.values()
            if t.answered and t.latency is not None and t.latency.calls >= min_calls]
    return {"nvml_gpus_timed": len(p95s),
            "nvml_median_p95_s": _figure(median_low(p95s)) if p95s else None}


def _figure(seconds: float) -> float:
    """Three significant digits: 1.5, 0.000123. The stored float is 4 bytes; more digits would be noise."""
    return float(f"{seconds:.3g}")
