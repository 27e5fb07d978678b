"""A pynvml look-alike backed by a FakeNode.

An instance offers pynvml's function names, constants, return shapes and exception classes (the very
classes of the `pynvml` module, so `except pynvml.NVMLError_GpuIsLost` catches what the fake raises).
Each instance is its own library: reference-counted init and shutdown, no module-level state.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any

import pynvml

from detector.backends.nvml_standin import from_pynvml
from detector.backends.pciaddr import normalize_bus_id, nvml_bus_id
from fake_nvml.identity import board_of
from fake_nvml.node import FakeGpu, FakeNode, NodeState
from fake_nvml.nvml_driver import DriverCalls
from fake_nvml.nvml_latency import LatencyCalls
from fake_nvml.nvml_memory import MemoryCalls
from fake_nvml.nvml_nvlink import NvlinkCalls
from fake_nvml.nvml_thermal import ThermalCalls
from fake_nvml.pci import pcie_replays

_MIB = 1024 * 1024


@dataclass(frozen=True)
class FakeHandle:
    """Stands where pynvml returns a c_nvmlDevice_t pointer."""

    library: int        # id() of the FakeNvml that issued it
    bus_id: str

    def __repr__(self) -> str:
        return f"<FakeHandle {self.bus_id}>"


@dataclass
class FakeEventData:
    """Shape of pynvml.c_nvmlEventData_t."""

    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class _EventSet:
    registered: dict[str, int]      # bus id -> event mask
    next_seq: int


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeNvml(MemoryCalls, DriverCalls, ThermalCalls, NvlinkCalls, LatencyCalls):
    """Call it exactly as you would call the `pynvml` module. Each check's calls live in a mixin of their own.
    `simulated_time`: the node runs on a simulated clock, so a slow GPU's calls declare their latency
    instead of sleeping it (fake_nvml/nvml_latency.py)."""

    def __init__(self, node: FakeNode, simulated_time: bool = False):
        self.node = node
        self.simulated_time = simulated_time
        self._latency = threading.local()     # per thread: latency simulated by the call under way
        self._calls_bounded = False           # a timing proxy tells where each call ends (nvml_latency.py)
        self._refcount = 0
        self._lock = threading.Lock()
        self._event_sets: dict[int, _EventSet] = {}
        self._event_set_ids = itertools.count(1)

    # Constants, NVMLError classes and helpers come straight from pynvml. A pynvml function this fake
    # does not implement behaves like a symbol missing from an old driver: FunctionNotFound.
    def __getattr__(self, name: str) -> Any:
        return from_pynvml(name, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    # -- library ---------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        if not self.node.read(lambda s: s.driver_loaded):
            raise _error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self._check_driver_versions()        # nvml_driver.py: LIB_RM_VERSION_MISMATCH
        with self._lock:
            self._refcount += 1

    def nvmlShutdown(self) -> None:
        with self._lock:
            if self._refcount == 0:
                raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
            self._refcount -= 1

    def nvmlErrorString(self, result: int) -> str:
        return str(_error(result))

    def _state(self) -> NodeState:
        if self._refcount == 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        return self.node.read(lambda state: state)     # live state: attribute reads need no copy

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._state().driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        return "12." + self._state().driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._state().cuda_version

    nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion

    # -- handles ---------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        state = self._state()
        if not state.driver_loaded:
            raise _error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        return len(state.nvml_gpus())

    def _handle(self, gpu: FakeGpu) -> FakeHandle:
        self._wait_if_hung(gpu)
        self._wait_if_slow(gpu)
        if gpu.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return FakeHandle(id(self), gpu.pci_bus_id)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        gpus = self._state().nvml_gpus()
        if not isinstance(index, int) or not 0 <= index < len(gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._handle(gpus[index])

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle:
        for gpu in self._state().nvml_gpus():
            if gpu.uuid == uuid:
                return self._handle(gpu)
        raise _error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> FakeHandle:
        try:
            wanted = normalize_bus_id(bus_id)
        except ValueError:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
        for gpu in self._state().nvml_gpus():
            if gpu.pci_bus_id == wanted:
                return self._handle(gpu)
        raise _error(pynvml.NVML_ERROR_NOT_FOUND)

    def _device(self, handle: Any) -> FakeGpu:
        """The GPU behind a handle, after the checks the driver makes on every device call."""
        state = self._state()
        if not isinstance(handle, FakeHandle) or handle.library != id(self):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for gpu in state.nvml_gpus():
            if gpu.pci_bus_id == handle.bus_id:
                self._wait_if_hung(gpu)
                self._wait_if_slow(gpu)
                if gpu.lost:
                    raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
                return gpu
        raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)

    def _wait_if_hung(self, gpu: FakeGpu) -> None:
        if gpu.nvml_hang_s > 0:
            time.sleep(gpu.nvml_hang_s)      # a wedged GPU: the call blocks, like the real ioctl

    # -- identity --------------------------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._device(handle).model.name

    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        return self._device(handle).model.brand

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._device(handle).uuid

    def nvmlDeviceGetSerial(self, handle: Any) -> str:
        gpu = self._device(handle)
        if not board_of(gpu.model.key).has_inforom:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.serial

    def nvmlDeviceGetBoardPartNumber(self, handle: Any) -> str:
        gpu = self._device(handle)
        return gpu.board_part_number or board_of(gpu.model.key).board_part_number

    def nvmlDeviceGetVbiosVersion(self, handle: Any) -> str:
        gpu = self._device(handle)
        return gpu.vbios_version or board_of(gpu.model.key).vbios_version

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        gpu = self._device(handle)
        return [g.pci_bus_id for g in self._state().nvml_gpus()].index(gpu.pci_bus_id)

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._device(handle).minor

    def nvmlDeviceGetPciInfo(self, handle: Any) -> pynvml.nvmlPciInfo_t:
        gpu = self._device(handle)
        info = pynvml.nvmlPciInfo_t()
        domain, bus, dev_fn = gpu.pci_bus_id.split(":")
        info.busId = nvml_bus_id(gpu.pci_bus_id).encode()
        info.busIdLegacy = nvml_bus_id(gpu.pci_bus_id)[4:].encode()
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(dev_fn.split(".")[0], 16)
        info.pciDeviceId = gpu.model.pci_device_id
        info.pciSubSystemId = 0x16C110DE
        return info

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    # -- PCIe ------------------------------------------------------------------------------------

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._device(handle).pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self._device(handle).pcie_max_width

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._device(handle).pcie_gen

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self._device(handle).pcie_max_gen

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self._device(handle).model.pcie_max_gen

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return pcie_replays(self._device(handle), self.node.elapsed_s())

    # -- health ----------------------------------------------------------------------------------

    # Temperature, power and clock event reasons: fake_nvml/nvml_thermal.py.

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> pynvml.c_nvmlUtilization_t:
        gpu = self._device(handle)
        return pynvml.c_nvmlUtilization_t(gpu=gpu.utilization_pct, memory=gpu.utilization_pct // 2)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        gpu = self._device(handle)
        total, used = gpu.model.memory_mib * _MIB, gpu.memory_used_mib * _MIB
        if not version:
            return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)
        reserved = 512 * _MIB             # v2 reports the driver's reservation separately
        return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=reserved,
                                        free=total - used - reserved, used=used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        gpu = self._device(handle)
        procs = []
        for pid, used_mib in gpu.processes:
            obj = pynvml.nvmlFriendlyObject({"pid": pid, "usedGpuMemory": used_mib * _MIB,
                                             "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF})
            procs.append(obj)
        return procs

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        gpu = self._device(handle)
        if not gpu.model.mig:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE]

    # -- events ----------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> int:
        self._state()
        with self._lock:
            key = next(self._event_set_ids)
            self._event_sets[key] = _EventSet({}, len(self.node.xid_events()))
        return key

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._device(handle)
        return (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError
                | pynvml.nvmlEventTypeDoubleBitEccError | pynvml.nvmlEventTypePState
                | pynvml.nvmlEventTypeClock)

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: int) -> None:
        gpu = self._device(handle)
        self._event_set(event_set).registered[gpu.pci_bus_id] = event_types

    def nvmlEventSetWait_v2(self, event_set: int, timeout_ms: int) -> FakeEventData:
        deadline = time.monotonic() + timeout_ms / 1000
        es = self._event_set(event_set)
        while True:
            state = self._state()
            by_index = {g.index: g for g in state.gpus}
            for event in self.node.xid_events(after_seq=es.next_seq - 1):
                es.next_seq = event.seq + 1
                gpu = by_index[event.gpu_index]
                if es.registered.get(gpu.pci_bus_id, 0) & pynvml.nvmlEventTypeXidCriticalError:
                    return FakeEventData(FakeHandle(id(self), gpu.pci_bus_id),
                                         pynvml.nvmlEventTypeXidCriticalError, event.code)
            if time.monotonic() >= deadline:
                raise _error(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))

    nvmlEventSetWait = nvmlEventSetWait_v2

    def nvmlEventSetFree(self, event_set: int) -> None:
        with self._lock:
            if self._event_sets.pop(event_set, None) is None:
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _event_set(self, key: Any) -> _EventSet:
        self._state()
        es = self._event_sets.get(key) if isinstance(key, int) else None
        if es is None:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return es
