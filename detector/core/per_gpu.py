"""Asking NVML the same thing of every GPU, where one GPU's failure is that GPU's, never the whole check's.

Checks that read each GPU share two rules. A GPU the inventory could not open (no handle, or an error:
lost, hung) has nothing to ask: the visibility and gpu checks already report it. A GPU that answered the
inventory can still fail a later call (it fell off the bus since): its NVMLError becomes a line of the run's
error ("GPU 3: GPU is lost"), so the run's status says it, and the other GPUs' readings still count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import pynvml

from detector.core.inventory import GpuInfo

T = TypeVar("T")


@dataclass(frozen=True)
class GpuReadings(Generic[T]):
    readings: list[tuple[GpuInfo, T]]    # in inventory order, one per GPU that answered
    errors: list[str]                    # "GPU <index>: <error>", one per GPU NVML failed for


def read_each_gpu(gpus: Iterable[GpuInfo], read: Callable[[GpuInfo], T],
                  describe: Callable[[pynvml.NVMLError], str] = str) -> GpuReadings[T]:
    """`read` each GPU that NVML can answer for, in order; `describe` words an NVMLError for the run's error."""
    readings: list[tuple[GpuInfo, T]] = []
    errors: list[str] = []
    for gpu in gpus:
        if gpu.handle is None or gpu.error:
            continue
        try:
            readings.append((gpu, read(gpu)))
        except pynvml.NVMLError as e:
            errors.append(f"GPU {gpu.index}: {describe(e)}")
    return GpuReadings(readings, errors)
