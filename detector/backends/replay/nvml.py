"""A pynvml look-alike that answers from one snapshot: the same answer at every read, as the machine
was at capture. What the snapshot does not hold raises what real NVML raises for a value it does not
have, NVMLError_NotSupported, which the checks read as "not applicable/unknown", never as 0 or healthy.
NVLink without an `nvidia-smi nvlink -s` capture raises FunctionNotFound (this library cannot tell).
There are no events in a snapshot: the event API is NotSupported.
"""

from __future__ import annotations

import ctypes
import uuid
from dataclasses import dataclass
from typing import Any

import pynvml

from detector.backends.nvmlcompat import constant as nvml_constant, throttle_counter_fields

from detector.backends.fabric_health import encode
from detector.backends.pciaddr import nvml_bus_id
from detector.backends.replay.fabric import fabric_health
from detector.backends.nvml_standin import from_pynvml
from detector.backends.replay.side_files import NvlinkListing
from detector.backends.replay.snapshot import GpuSnapshot, Snapshot

_MIB = 1024 * 1024
_REASON_BITS = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonHwSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown | pynvml.nvmlClocksEventReasonHwSlowdown,
    "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}
# "Clocks Event Reasons Counters" (driver 530+, microseconds) -> the violation policy each counts into.
_POLICY_COUNTERS = {
    pynvml.NVML_PERF_POLICY_THERMAL: ("sw_thermal_slowdown", "hw_thermal_slowdown"),
    pynvml.NVML_PERF_POLICY_POWER: ("sw_power_cap", "hw_power_brake_slowdown"),
    pynvml.NVML_PERF_POLICY_SYNC_BOOST: ("sync_boost",),
}
RECOVERY_ACTIONS = {"none": nvml_constant("NVML_GPU_RECOVERY_ACTION_NONE"), "gpu reset": nvml_constant("NVML_GPU_RECOVERY_ACTION_GPU_RESET"),
                    "reset": nvml_constant("NVML_GPU_RECOVERY_ACTION_GPU_RESET"),
                    "node reboot": nvml_constant("NVML_GPU_RECOVERY_ACTION_NODE_REBOOT"),
                    "drain p2p": nvml_constant("NVML_GPU_RECOVERY_ACTION_DRAIN_P2P"),
                    "drain and reset": nvml_constant("NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET")}
FABRIC_STATES = {"not supported": pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
                 "not started": pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED,
                 "in progress": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS,
                 "completed": pynvml.NVML_GPU_FABRIC_STATE_COMPLETED}
# "Product Brand" as nvidia-smi prints nvmlBrandType_t; a name not listed is a brand this table does not know.
BRANDS = {"unknown": pynvml.NVML_BRAND_UNKNOWN, "quadro": pynvml.NVML_BRAND_QUADRO, "tesla": pynvml.NVML_BRAND_TESLA,
          "nvs": pynvml.NVML_BRAND_NVS, "grid": pynvml.NVML_BRAND_GRID, "geforce": pynvml.NVML_BRAND_GEFORCE,
          "titan": pynvml.NVML_BRAND_TITAN, "nvidia virtual applications": pynvml.NVML_BRAND_NVIDIA_VAPPS,
          "nvidia virtual pc": pynvml.NVML_BRAND_NVIDIA_VPC,
          "nvidia virtual compute server": pynvml.NVML_BRAND_NVIDIA_VCS,
          "nvidia rtx virtual workstation": pynvml.NVML_BRAND_NVIDIA_VWS,
          "nvidia cloud gaming": pynvml.NVML_BRAND_NVIDIA_CLOUD_GAMING, "quadro rtx": pynvml.NVML_BRAND_QUADRO_RTX,
          "nvidia rtx": pynvml.NVML_BRAND_NVIDIA_RTX, "nvidia": pynvml.NVML_BRAND_NVIDIA,
          "geforce rtx": pynvml.NVML_BRAND_GEFORCE_RTX, "titan rtx": pynvml.NVML_BRAND_TITAN_RTX,
          "nvidia rtx virtual game dev": nvml_constant("NVML_BRAND_NVIDIA_VGAMEDEV")}
# nvidia-smi prints a fabric status as nvmlErrorString of its nvmlReturn_t ("Success", "Unknown Error").
_RETURNS = {str(pynvml.NVMLError(code)).lower(): code for code in
            (getattr(pynvml, n) for n in dir(pynvml) if n.startswith("NVML_ERROR_"))
            if isinstance(code, int)} | {"success": pynvml.NVML_SUCCESS}


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _known(value: Any) -> Any:
    if value is None:
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return value


@dataclass(frozen=True)
class ReplayHandle:
    library: int
    index: int

    def __repr__(self) -> str:
        return f"<ReplayHandle {self.index}>"


class ReplayNvml:
    """Call it as you would call `pynvml`. GPUs are those of the snapshot that have a bus id, in order."""

    def __init__(self, snapshot: Snapshot, nvlink: NvlinkListing | None = None):
        self.snapshot = snapshot
        self.gpus = list(snapshot.gpus)      # a fragment's GPU may have no bus id: read for what it holds
        self.nvlink = nvlink
        self._initialised = 0

    def __getattr__(self, name: str) -> Any:
        return from_pynvml(name, pynvml.NVML_ERROR_NOT_SUPPORTED)

    # -- library ---------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._initialised += 1

    def nvmlInitWithFlags(self, flags: int = 0) -> None:
        self.nvmlInit()

    def nvmlShutdown(self) -> None:
        if not self._initialised:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        self._initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        """"" where the capture does not print it (a fragment): the checks show an empty version as unknown,
        where NotSupported would read as NVML itself being unusable."""
        return self.snapshot.driver_version or ""

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> ReplayHandle:
        if not isinstance(index, int) or not 0 <= index < len(self.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ReplayHandle(id(self), index)

    def _gpu(self, handle: Any) -> GpuSnapshot:
        if not isinstance(handle, ReplayHandle) or handle.library != id(self):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[handle.index]

    # -- identity and PCIe -------------------------------------------------------------------------

    # Real NVML always has a GPU's name and UUID; a partial capture (`nvidia-smi -q -d MEMORY`) may not print
    # them. Failing the call would make the GPU look broken, so the name is "" (shown as unknown) and the
    # UUID a label that says it is unknown and stays distinct per GPU (checks key their windows by UUID).

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle).name or ""

    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        """NotSupported where the capture does not print a brand; NVML_BRAND_UNKNOWN for a name it prints
        that is not in BRANDS (NVML's own answer for a brand it cannot name)."""
        brand = _known(self._gpu(handle).brand)
        return BRANDS.get(" ".join(brand.lower().split()), pynvml.NVML_BRAND_UNKNOWN)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        gpu = self._gpu(handle)
        return gpu.uuid or f"unknown@{gpu.bus_id or self.gpus.index(gpu)}"

    def nvmlDeviceGetSerial(self, handle: Any) -> str:
        return _known(self._gpu(handle).serial)

    def nvmlDeviceGetBoardPartNumber(self, handle: Any) -> str:
        return _known(self._gpu(handle).board_part_number)

    def nvmlDeviceGetVbiosVersion(self, handle: Any) -> str:
        return _known(self._gpu(handle).vbios_version)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        self._gpu(handle)
        return handle.index

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return _known(self._gpu(handle).minor_number)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> pynvml.nvmlPciInfo_t:
        gpu = self._gpu(handle)
        if not gpu.bus_id:                     # a fragment that does not name its GPU
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.nvmlPciInfo_t()
        domain, bus, dev_fn = str(gpu.bus_id).split(":")
        info.busId = nvml_bus_id(str(gpu.bus_id)).encode()
        info.busIdLegacy = nvml_bus_id(str(gpu.bus_id))[4:].encode()
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(dev_fn.split(".")[0], 16)
        info.pciDeviceId = gpu.pci_device_id or 0          # 0: not printed (the nvlink check then goes by name)
        info.pciSubSystemId = gpu.pci_subsystem_id or 0
        return info

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return _known(self._gpu(handle).pcie_current_width)

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return _known(self._gpu(handle).pcie_max_width)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return _known(self._gpu(handle).pcie_current_gen)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return _known(self._gpu(handle).pcie_max_gen)

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, handle: Any) -> int:
        return _known(self._gpu(handle).pcie_gpu_max_gen)

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return _known(self._gpu(handle).pcie_replays)

    # -- state -----------------------------------------------------------------------------------

    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        return _feature(self._gpu(handle).persistence_mode)

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        mode = _known(self._gpu(handle).mig_mode)
        return [_feature(mode[0]), _feature(mode[1])]

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> pynvml.c_nvmlUtilization_t:
        gpu = self._gpu(handle)
        return pynvml.c_nvmlUtilization_t(gpu=_known(gpu.utilization_pct), memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        gpu = self._gpu(handle)
        total, used = _known(gpu.memory_total_mib) * _MIB, _known(gpu.memory_used_mib) * _MIB
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        processes = _known(self._gpu(handle).processes)
        return [pynvml.nvmlFriendlyObject({"pid": pid, "usedGpuMemory": None if mib is None else mib * _MIB,
                                           "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF})
                for pid, mib in processes]

    # -- memory ----------------------------------------------------------------------------------

    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        mode = _known(self._gpu(handle).ecc_mode)
        return [_feature(mode[0]), _feature(mode[1])]

    def _ecc_counts(self, handle: Any, counter_type: int) -> Any:
        gpu = self._gpu(handle)
        if counter_type not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _known(gpu.ecc_volatile if counter_type == pynvml.NVML_VOLATILE_ECC else gpu.ecc_aggregate)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        counts = self._ecc_counts(handle, counter_type)
        return _known(counts.total(uncorrected=error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))

    def nvmlDeviceGetMemoryErrorCounter(self, handle: Any, error_type: int, counter_type: int, location: int) -> int:
        counts = self._ecc_counts(handle, counter_type)
        name = _LOCATIONS.get(location)
        pair = counts.by_location.get(name) if name else None
        return _known(None if pair is None else pair[1 if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 0])

    def nvmlDeviceGetRetiredPages(self, handle: Any, cause: int) -> list[int]:
        """As many entries as the snapshot counts; their addresses are not in it (0 stands for each)."""
        gpu = self._gpu(handle)
        count = gpu.retired_dbe if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR else gpu.retired_sbe
        return [0] * _known(count)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int:
        return _feature(self._gpu(handle).retired_pending)

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu(handle)
        return (_known(gpu.remapped_corrected), _known(gpu.remapped_uncorrected), int(_known(gpu.remap_pending)),
                int(_known(gpu.remap_failure)))

    # -- thermal and power -------------------------------------------------------------------------

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        reasons = _known(self._gpu(handle).reasons)
        mask = 0
        for name, active in reasons.active.items():
            mask |= _REASON_BITS[name] if active else 0
        return mask

    nvmlDeviceGetCurrentClocksThrottleReasons = nvmlDeviceGetCurrentClocksEventReasons

    def nvmlDeviceGetViolationStatus(self, handle: Any, perfPolicyType: int) -> pynvml.c_nvmlViolationTime_t:
        counters = self._gpu(handle).reason_counters_us
        names = _POLICY_COUNTERS.get(perfPolicyType, ())
        if not names or not all(n in counters for n in names):
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlViolationTime_t(referenceTime=0, violationTime=sum(counters[n] for n in names) * 1000)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return _known(self._gpu(handle).temperature_c)

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        gpu = self._gpu(handle)
        return _known({pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: gpu.shutdown_c,
                       pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: gpu.slowdown_c,
                       pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: gpu.gpu_max_c,
                       pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: gpu.memory_max_c}.get(threshold))

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(_known(self._gpu(handle).power_w) * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return int(_known(self._gpu(handle).power_limit_w) * 1000)

    nvmlDeviceGetPowerManagementLimit = nvmlDeviceGetEnforcedPowerLimit

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:
        if clock_type != pynvml.NVML_CLOCK_SM:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _known(self._gpu(handle).sm_clock_mhz)

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock_type: int) -> int:
        if clock_type != pynvml.NVML_CLOCK_SM:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _known(self._gpu(handle).max_sm_clock_mhz)

    def nvmlDeviceGetApplicationsClock(self, handle: Any, clock_type: int) -> int:
        if clock_type != pynvml.NVML_CLOCK_GRAPHICS:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return _known(self._gpu(handle).app_clock_mhz)

    # -- field values: only what the snapshot holds ------------------------------------------------

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        gpu = self._gpu(handle)
        # the throttle counters at the ids the captured driver has them (nvidia-smi read them there)
        counters = {fid: reason for reason, fid in throttle_counter_fields(self.snapshot.driver_version).items()}
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for slot, requested in zip(values, fieldIds):
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            slot.fieldId, slot.scopeId, slot.nvmlReturn = field_id, scope, pynvml.NVML_ERROR_NOT_SUPPORTED
            value = None
            if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                value = gpu.memory_temperature_c
            elif field_id == nvml_constant("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION") and gpu.recovery_action is not None:
                value = RECOVERY_ACTIONS.get(gpu.recovery_action.strip().lower())
            elif field_id in counters:      # the capture's microseconds, as the driver's nanoseconds
                us = gpu.reason_counters_us.get(counters[field_id])
                if us is not None:
                    slot.nvmlReturn, slot.valueType = pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                    slot.value.ullVal = us * 1000
                continue
            if value is not None:
                slot.nvmlReturn, slot.valueType = pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                slot.value.uiVal = value
        return values

    # -- NVLink and fabric ---------------------------------------------------------------------------

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        gpu = self._gpu(handle)
        if self.nvlink is None:
            raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        links = self.nvlink.links(handle.index, gpu.uuid)
        if links is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED if self.nvlink.empty else pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if not links:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link not in links:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if links[link] else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetGpuFabricInfo(self, handle: Any, gpuFabricInfo: Any) -> int:
        """The original probe: state, status, clique and cluster as printed."""
        self._fill_fabric(self._gpu(handle), gpuFabricInfo._obj)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, gpuFabricInfo: Any) -> int:
        """v2 (health mask) and v3 (and its summary) from the printed Health lines; an output without them
        is a driver before the versioned call (FunctionNotFound, so the check takes the original one)."""
        gpu = self._gpu(handle)
        if gpu.fabric_health is None:
            raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        info = gpuFabricInfo._obj
        if info.version not in (nvml_constant("nvmlGpuFabricInfo_v2"), nvml_constant("nvmlGpuFabricInfo_v3")):
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        self._fill_fabric(gpu, info)
        mask, summary = encode(fabric_health(gpu.fabric_health))
        info.healthMask = mask
        if info.version == nvml_constant("nvmlGpuFabricInfo_v3"):
            info.healthSummary = summary
        return pynvml.NVML_SUCCESS

    @staticmethod
    def _fill_fabric(gpu: GpuSnapshot, info: Any) -> None:
        state = FABRIC_STATES.get((gpu.fabric_state or "").strip().lower())
        if state is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        status = _RETURNS.get((gpu.fabric_status or "").strip().lower().rstrip("."), pynvml.NVML_ERROR_UNKNOWN) \
            if state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED else pynvml.NVML_SUCCESS
        info.state, info.status, info.cliqueId = state, status, gpu.fabric_clique_id or 0
        try:
            cluster = uuid.UUID(gpu.fabric_cluster_uuid or "").bytes
        except ValueError:
            cluster = bytes(16)               # absent or not a UUID: zeros, as NVML says "no cluster"
        ctypes.memmove(ctypes.addressof(info.clusterUuid), cluster, 16)

    # -- events: none in a snapshot --------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> int:
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)


_LOCATIONS = {pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY: "device_memory", pynvml.NVML_MEMORY_LOCATION_SRAM: "sram",
              pynvml.NVML_MEMORY_LOCATION_L1_CACHE: "l1_cache", pynvml.NVML_MEMORY_LOCATION_L2_CACHE: "l2_cache",
              pynvml.NVML_MEMORY_LOCATION_REGISTER_FILE: "register_file",
              pynvml.NVML_MEMORY_LOCATION_TEXTURE_MEMORY: "texture_memory",
              pynvml.NVML_MEMORY_LOCATION_TEXTURE_SHM: "texture_shm", pynvml.NVML_MEMORY_LOCATION_CBU: "cbu"}


def _feature(value: bool | None) -> int:
    return pynvml.NVML_FEATURE_ENABLED if _known(value) else pynvml.NVML_FEATURE_DISABLED
