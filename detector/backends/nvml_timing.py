"""Every NVML call timed and charged to the GPU it asked about: the monitoring path as a signal.

A GPU on its way to detaching from the bus often shows first in how slowly the driver answers for it, while
every number it reports still looks healthy ("When GPUs Fail Quietly", arXiv 2603.28781: detachment-class
failures show little numeric precursor, and mostly as monitoring-path degradation; NVIDIA/DCGM #313: calls
blocking past 45 s on a GPU logging corrected ECC errors under load). A healthy call returns in well under a
millisecond (wookayin/gpustat #76: ~2,700 nvmlDeviceGetPowerUsage calls a second on a Tesla K40m).

`TimedNvml` stands where the NVML library stands (the pynvml module, a fake, a replay) and passes every
attribute through; each `nvml*` function it hands out is wrapped to time the call. A call is charged to a GPU
by its first argument, the device handle, once a `nvmlDeviceGetHandleBy*` call has returned that handle (the
inventory opens every GPU that way each sweep). Calls that name no GPU (nvmlDeviceGetCount, ...) are not
kept; calls that wait by design (nvmlEventSetWait) are not timed at all.

What is kept: per GPU, the durations since the last `drain`, at most `capacity` of them (the newest), as
8-byte floats. The reader (the visibility check) drains them every run and keeps its own window on its own
clock, so this module needs no clock but a timer for durations.

Simulated time: a fake node watched on a simulated clock (`diagnose --duration`) cannot sleep its slow calls
for real. A library that simulates latency instead (`SimulatesLatency`: the fake NVML on a simulated clock)
reports, after each call, the seconds that call would have taken; they are added to the measured time of
that very call on that very thread, so concurrent calls to other GPUs are never blamed for it, and the
measurement is the same code on a real node and a fake one.
"""

from __future__ import annotations

import ctypes
import threading
import time
from array import array
from typing import Any, Callable, Hashable, Protocol, runtime_checkable

DEFAULT_CAPACITY = 512      # durations kept per GPU between drains (a sweep makes ~105 per GPU: 8 checks)
MAX_GPUS = 64               # distinct devices remembered; more are not kept (no node has that many)

# Calls that return a device handle: the call is charged to the GPU whose handle it returned.
HANDLE_SOURCES = frozenset({"nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2",
                            "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByPciBusId",
                            "nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetHandleBySerial"})
# Calls that block by design until an event or their timeout: their time is not the driver's latency.
_UNTIMED = frozenset({"nvmlEventSetWait", "nvmlEventSetWait_v2", "nvmlSystemEventSetWait",
                      "nvmlExceptionClass", "nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct"})


def device_key(handle: Any) -> Hashable | None:
    """What a handle's calls are kept under: its device's address for a C handle (pynvml makes a new
    pointer object each time it opens a GPU, to the same device), else the handle itself; None when it
    cannot be a key."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    try:
        hash(handle)
    except TypeError:
        return None
    return handle


@runtime_checkable
class SimulatesLatency(Protocol):
    """A library that can simulate slow calls rather than sleep them (a fake node on a simulated clock)."""

    def call_returned(self) -> float:
        """Called on the calling thread after each call returns (or raises): the seconds of latency that call
        simulated instead of spending them (0 when none)."""


class CallTimes:
    """Per device key, the durations of the calls since the last drain, newest `capacity` kept."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_devices: int = MAX_GPUS):
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2, got {capacity}")
        self.capacity = capacity
        self._max_devices = max_devices
        self._by_key: dict[Hashable, array] = {}
        self._lock = threading.Lock()

    def record(self, key: Hashable, seconds: float) -> None:
        with self._lock:
            samples = self._by_key.get(key)
            if samples is None:
                if len(self._by_key) >= self._max_devices:
                    return
                samples = self._by_key[key] = array("d")
            if len(samples) >= self.capacity:
                del samples[:self.capacity // 2]     # keep the newest half: amortised, never unbounded
            samples.append(seconds)

    def drain(self) -> dict[Hashable, array]:
        """Each device's durations since the last drain (devices without any left out); they are forgotten."""
        with self._lock:
            out = {key: samples for key, samples in self._by_key.items() if samples}
            for key in out:
                self._by_key[key] = array("d")
            return out


class TimedNvml:
    """The NVML library, each call timed. Attributes other than NVML functions (constants, error classes,
    a fake's own fields) are the library's own; setting an attribute on this object (a test replacing one
    call) replaces what it hands out."""

    def __init__(self, nvml: Any, timer: Callable[[], float] = time.perf_counter,
                 capacity: int = DEFAULT_CAPACITY):
        self.wrapped = nvml
        self.times = CallTimes(capacity)
        self._timer = timer
        self._declared = nvml.call_returned if isinstance(nvml, SimulatesLatency) else None
        self._known: set[Hashable] = set()         # device keys learnt from handle-returning calls
        self._handle_types: set[type] = set()      # the types those handles had
        self._indexes: dict[Hashable, int] = {}    # device key -> the NVML index it was opened by

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.wrapped, name)
        if not (name.startswith("nvml") and callable(value) and not isinstance(value, type)) or name in _UNTIMED:
            return value
        timed = self._timed(name, value)
        self.__dict__[name] = timed         # found directly from now on: the wrapper is built once per name
        return timed

    def device_key(self, handle: Any) -> Hashable | None:
        return device_key(handle)

    def opened_index(self, key: Hashable) -> int | None:
        """The NVML index the device under `key` was last opened by, if it was opened by index: what names a
        GPU whose inventory read missed its deadline (no handle to match) while its calls went on."""
        return self._indexes.get(key)

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        timer, times, declared = self._timer, self.times, self._declared
        if name in HANDLE_SOURCES:
            by_index = name.startswith("nvmlDeviceGetHandleByIndex")

            def opened(*args: Any, **kwargs: Any) -> Any:
                start = timer()
                handle = None
                try:
                    handle = fn(*args, **kwargs)
                    return handle
                finally:
                    seconds = timer() - start + (declared() if declared else 0.0)
                    key = self._learn(handle) if handle is not None else None
                    if key is not None:
                        times.record(key, seconds)
                        if by_index and args and isinstance(args[0], int):
                            self._indexes[key] = args[0]
            opened.__name__ = name
            return opened

        known, handle_types = self._known, self._handle_types

        def call(*args: Any, **kwargs: Any) -> Any:
            start = timer()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = timer() - start + (declared() if declared else 0.0)
                if args and type(args[0]) in handle_types:
                    key = self.device_key(args[0])
                    if key in known:
                        times.record(key, seconds)
        call.__name__ = name
        return call

    def _learn(self, handle: Any) -> Hashable | None:
        key = self.device_key(handle)
        if key is None:
            return None
        if key not in self._known:
            if len(self._known) >= MAX_GPUS:
                return None
            self._handle_types.add(type(handle))
            self._known.add(key)
        return key
