"""NVML names that every nvidia-ml-py in pyproject's range can give, old bindings included.

pynvml is generated from one release of nvml.h, so a binding older than the code lacks the newer names:
12.535.77 (the range's floor) has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and no fabric health mask,
13.610.43 no NVML_GPU_RECOVERY_ACTION_BUS_RESET. Read at import time, one such name killed every command.
The driver answers in numbers whatever the binding knows, so a constant the binding lacks is taken from
NVML's header where NVML fixed its number (HEADER_VALUES); any other missing name is MISSING, which no
reading equals, so its field reads as not_supported. A function the binding or the driver lacks answers
None through `optional`, the same None that NotSupported gives (detector/core/inventory.py `_optional`).
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml


class _Missing:
    """A constant neither the binding nor HEADER_VALUES has: equal to nothing but itself, not a number."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

# Numbers NVML fixed in nvml.h, for the names an older binding lacks.
HEADER_VALUES: dict[str, int] = {
    # nvmlFieldValue_t ids: NVML API reference, "Field Value Enums"; field 230 came with driver 565
    # (change log v560 -> v565).
    "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": 230,
    # nvmlValueType_t: NVML_VALUE_TYPE_UNSIGNED_SHORT = 6 (not in binding 12.535.77; in 12.560.30 on).
    "NVML_VALUE_TYPE_UNSIGNED_SHORT": 6,
    # nvmlBrandType_t: NVML_BRAND_NVIDIA_VGAMEDEV = 18 (nvml.h; a newer brand than the floor's binding).
    "NVML_BRAND_NVIDIA_VGAMEDEV": 18,
    # nvmlDeviceGpuRecoveryAction_t: NONE..DRAIN_AND_RESET 0-4 (565/570), RECOVER_IMEX_DOMAIN 5 (595),
    # BUS_RESET 6 and SYSTEM_REBOOT 7 (615). NVML change log, https://docs.nvidia.com/deploy/nvml-api/
    # change-log.html; the numbers as cuda.bindings.nvml.DeviceGpuRecoveryAction documents them.
    "NVML_GPU_RECOVERY_ACTION_NONE": 0,
    "NVML_GPU_RECOVERY_ACTION_GPU_RESET": 1,
    "NVML_GPU_RECOVERY_ACTION_NODE_REBOOT": 2,
    "NVML_GPU_RECOVERY_ACTION_DRAIN_P2P": 3,
    "NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET": 4,
    "NVML_GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN": 5,
    "NVML_GPU_RECOVERY_ACTION_BUS_RESET": 6,
    "NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT": 7,
    # Fabric definitions, https://docs.nvidia.com/deploy/nvml-api/group__nvmlFabricDefs.html: each health
    # field is NOT_SUPPORTED 0 / TRUE 1 / FALSE 2 at its shift; the struct versions are
    # NVML_STRUCT_VERSION(GpuFabricInfo, 2|3) = sizeof | version << 24.
    "NVML_GPU_FABRIC_UUID_LEN": 16,
    "NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE": 1,
    "NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE": 2,
    "NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW": 0,
    "NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW": 0x3,
    "NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_RECOVERY_FALSE": 2,
    "NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY": 2,
    "NVML_GPU_FABRIC_HEALTH_MASK_ROUTE_UNHEALTHY_FALSE": 2,
    "NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY": 4,
    "NVML_GPU_FABRIC_HEALTH_MASK_ACCESS_TIMEOUT_RECOVERY_FALSE": 2,
    "NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY": 6,
    "NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED": 0,
    "NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY": 1,
    "nvmlGpuFabricInfo_v2": 0x02000024,
    "nvmlGpuFabricInfo_v3": 0x03000028,
}
# Numbers a binding got wrong, taken from the header that corrected them: an nvml.h of the 570-580 era
# defined WIDTH_DEGRADED_BW as 0x11, which masks bit 4 (ROUTE_UNHEALTHY) instead of the field's two bits
# (binding 13.580.65 carries the 17); later headers, and bindings from 13.610.43 on, say 0x3.
CORRECTED: frozenset[str] = frozenset({"NVML_GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW"})

# What a call the binding or the driver lacks raises: the field is not supported here.
NOT_HERE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)


def constant(name: str, binding: Any = None) -> Any:
    """The binding's (pynvml unless given) value of NVML constant `name`, else the header's, else MISSING."""
    if name in CORRECTED:
        return HEADER_VALUES[name]
    value = getattr(pynvml if binding is None else binding, name, MISSING)
    return HEADER_VALUES.get(name, MISSING) if value is MISSING else value


def optional(nvml: Any, name: str, *args: Any) -> Any:
    """Call nvml's `name`; None where the binding lacks it or the driver answers NotSupported or
    FunctionNotFound (a driver older than the binding). Other NVML errors are the GPU's, and raise."""
    call = getattr(nvml, name, None)
    if call is None:
        return None
    try:
        return call(*args)
    except NOT_HERE:
        return None


class GpuFabricInfo(ctypes.Structure):
    """nvmlGpuFabricInfo_t as nvml.h lays it out (clusterUuid[NVML_GPU_FABRIC_UUID_LEN = 16], 28 bytes).
    Bindings 12.535.77 to 13.610.43 declare an 80-byte clusterUuid: the driver's status, cliqueId and
    state land where they do not look, and every GPU would read as not_supported."""

    _fields_ = [("clusterUuid", ctypes.c_ubyte * 16), ("status", ctypes.c_uint), ("cliqueId", ctypes.c_uint),
                ("state", ctypes.c_uint)]


class GpuFabricInfoV2(ctypes.Structure):
    """nvmlGpuFabricInfo_v2_t (36 bytes, so version nvmlGpuFabricInfo_v2 = 0x02000024): the version field,
    the original fields, then healthMask. Binding 12.560.30 declares it 100 bytes long (an 80-byte uuid)."""

    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_ubyte * 16), ("status", ctypes.c_uint),
                ("cliqueId", ctypes.c_uint), ("state", ctypes.c_uint), ("healthMask", ctypes.c_uint)]

    def __init__(self) -> None:
        super().__init__(version=HEADER_VALUES["nvmlGpuFabricInfo_v2"])


class GpuFabricInfoV3(ctypes.Structure):
    """nvmlGpuFabricInfo_v3_t: v2 and then healthSummary, an unsigned char (37 bytes padded to 40, so version
    nvmlGpuFabricInfo_v3 = 0x03000028). Drivers that know only v2 answer ARGUMENT_VERSION_MISMATCH."""

    _fields_ = [*GpuFabricInfoV2._fields_, ("healthSummary", ctypes.c_ubyte)]

    def __init__(self) -> None:
        super().__init__(version=HEADER_VALUES["nvmlGpuFabricInfo_v3"])


# The cumulative time per clock event reason ("Clocks Event Reasons Counters" in nvidia-smi -q, nanoseconds
# since the driver loaded) is read through nvmlDeviceGetFieldValues, but three of its field ids moved between
# NVML headers, so the number to ask for depends on the running driver, never on the binding:
# - SW power cap and sync boost are the old perf-policy ids NVML_FI_DEV_PERF_POLICY_POWER (74) and
#   _SYNC_BOOST (76), aliased NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP / _SYNC_BOOST: the same everywhere.
# - SW thermal, HW thermal and HW power brake: 251, 252, 253 in the nvml.h of the 575 drivers and early 580
#   (pynvml of that era, NVML_FI_MAX 274, power smoothing at 256-273; nvidia-smi 580.65.06 asks for 251-253,
#   per NVIDIA/k8s-test-infra's mock NVML tests); 269, 270, 271 in the later header (nvidia-ml-py 13.615.71,
#   where 251-268 became the power smoothing fields). The move happened inside the 580 branch: a real H100 on
#   580.159.04 refuses 251-268 (NotSupported) and answers 269-271 with 64-bit counters, idle and busy
#   (tests/fixtures/gpu_check/h100-vm-580-perf, tools/perf_capture.py --scan-ids). Asking the wrong driver
#   reads power smoothing settings as throttle time, so they are asked for only where a header or a machine
#   says which ids a version uses: not below 575, nor between 580.65.06 and 580.159.04, where none was seen.
_OLD_IDS = {"sw_thermal_slowdown": 251, "hw_thermal_slowdown": 252, "hw_power_brake_slowdown": 253}
_NEW_IDS = {"sw_thermal_slowdown": 269, "hw_thermal_slowdown": 270, "hw_power_brake_slowdown": 271}
# (first version, first version past the range or None) -> the ids, newest first.
THROTTLE_COUNTER_FIELDS_BY_VERSION: tuple[tuple[tuple[int, ...], tuple[int, ...] | None, dict[str, int]], ...] = (
    ((590,), None, _NEW_IDS),
    ((580, 159, 4), (590,), _NEW_IDS),
    ((575,), (580, 65, 7), _OLD_IDS),
)
THROTTLE_COUNTER_FIELDS_ALWAYS: dict[str, int] = {"sw_power_cap": 74, "sync_boost": 76}


def driver_major(version: str | None) -> tuple[int, ...] | None:
    """'580.65.06' -> (580, 65, 6); None for an unknown or unreadable version."""
    parts = []
    for part in (version or "").strip().split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts) or None


def throttle_counter_fields(driver_version: str | None) -> dict[str, int]:
    """Reason name -> the field id this driver gives its cumulative throttle time under (nanoseconds).
    An unknown driver version gets only the ids every header agrees on."""
    fields = dict(THROTTLE_COUNTER_FIELDS_ALWAYS)
    version = driver_major(driver_version)
    if version is None:
        return fields
    for first, past, ids in THROTTLE_COUNTER_FIELDS_BY_VERSION:
        if version >= first and (past is None or version < past):
            fields.update(ids)
            break
    return fields
