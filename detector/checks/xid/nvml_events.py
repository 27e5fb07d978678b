"""XIDs from NVML's event API: a second source beside the kernel log, and the only one inside
containers that cannot read /dev/kmsg."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Any

import pynvml

from detector.core.inventory import GpuInfo


@dataclass(frozen=True)
class NvmlXid:
    gpu: GpuInfo
    code: int
    arrived: float


def handle_key(handle: Any) -> Any:
    """Something hashable that is equal for two handles of one device (ctypes pointers are not)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


class NvmlXidListener:
    """Registers every GPU for XID events once, then drains what arrived on each call."""

    def __init__(self, nvml: Any):
        self.nvml = nvml
        self.event_set: Any = None
        self.gpus: dict[Any, GpuInfo] = {}
        self.error = ""

    def register(self, gpus: list[GpuInfo]) -> None:
        if self.event_set is not None:
            return
        try:
            self.event_set = self.nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            self.error = f"cannot create an NVML event set: {e}"
            return
        for gpu in gpus:
            if gpu.handle is None:
                continue
            try:
                self.nvml.nvmlDeviceRegisterEvents(gpu.handle, pynvml.nvmlEventTypeXidCriticalError, self.event_set)
                self.gpus[handle_key(gpu.handle)] = gpu
            except pynvml.NVMLError:
                continue          # NotSupported on some boards; lost GPUs: the kernel log still has them

    def drain(self, wait_s: float = 0.0, limit: int = 10_000) -> list[NvmlXid]:
        """Events that arrived; waits up to `wait_s` in all for more (0: only what is pending)."""
        if self.event_set is None:
            return []
        out: list[NvmlXid] = []
        deadline = time.monotonic() + wait_s
        while len(out) < limit:
            timeout_ms = max(0, int((deadline - time.monotonic()) * 1000))
            try:
                data = self.nvml.nvmlEventSetWait_v2(self.event_set, timeout_ms)
            except pynvml.NVMLError_Timeout:
                break
            except pynvml.NVMLError as e:
                self.error = f"NVML event wait failed: {e}"
                break
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                gpu = self.gpus.get(handle_key(data.device))
                if gpu is not None:
                    out.append(NvmlXid(gpu, int(data.eventData), time.time()))
        return out

    def close(self) -> None:
        if self.event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self.event_set)
            except pynvml.NVMLError:
                pass
            self.event_set = None
