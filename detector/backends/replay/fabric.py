"""The Fabric / Health lines of `nvidia-smi -q` (text) and `-q -x` (<fabric><health>), read back into
NVML's FabricHealth, so the replay's NVML stand-in fills nvmlGpuFabricInfo_v3 as the live library would
and the same fabric check and rules judge it.

As driver 580 prints them (real GB200/GB300/B200 trays, tests/fixtures/real_machines/x-k8sti-*): Summary
Healthy | Unhealthy | Limited Capacity; Bandwidth Full | Degraded; Route Recovery in progress, Route
Unhealthy, Access Timeout Recovery and Partition Assigned True | False; Incorrect Configuration None or the
misconfiguration ("No Partition", as nvidia-smi prints NO_PARTITION). `N/A` (NVML's NOT_SUPPORTED) is
absent in the parsed tree and stays unknown. Each misconfiguration name is matched on its words, so the
header's names (INSUFFICIENT_NVLINKS ...) and the spelled-out forms ("Insufficient Nvlinks", "Incorrect
Chassis Serial Number") are both read; a value not recognised stays unknown, never "none".
"""

from __future__ import annotations

from detector.backends.fabric_health import FabricHealth
from detector.backends.replay.tree import Node, norm

HEALTH_LINES = ("summary", "bandwidth", "route_recovery_in_progress", "route_unhealthy", "access_timeout_recovery",
                "incorrect_configuration", "partition_assigned")
_SUMMARIES = {"healthy": "healthy", "unhealthy": "unhealthy", "limited_capacity": "limited_capacity"}
_BANDWIDTH = {"full": False, "degraded": True}
_BOOLS = {"true": True, "false": False}
# norm()ed printed value -> the FabricHealth name
_CONFIGURATIONS = {
    "none": "none",
    "incorrect_sysguid": "incorrect_sysguid", "sysguid": "incorrect_sysguid",
    "incorrect_system_guid": "incorrect_sysguid",
    "incorrect_chassis_sn": "incorrect_chassis_sn", "chassis_serial_number": "incorrect_chassis_sn",
    "incorrect_chassis_serial_number": "incorrect_chassis_sn",
    "no_partition": "no_partition",
    "insufficient_nvlinks": "insufficient_nvlinks",
    "incompatible_gpu_fw": "incompatible_gpu_fw", "incompatible_gpu_firmware": "incompatible_gpu_fw",
    "invalid_location": "invalid_location",
    "gpu_state_invalid": "gpu_state_invalid", "invalid_gpu_state": "gpu_state_invalid",
}


def health_lines(gpu: Node) -> dict[str, str] | None:
    """The printed Health lines that carry a value ({} when every one reads N/A); None when the GPU's
    output has no Health block (drivers before it was printed): then NVML's v2/v3 call is not there."""
    block = gpu.section("fabric/health")
    if block is None:
        return None
    return {name: value for name in HEALTH_LINES if (value := block.get(name)) is not None}


def fabric_health(lines: dict[str, str]) -> FabricHealth:
    def value(name: str, table: dict[str, object]) -> object:
        return table.get(norm(lines[name])) if name in lines else None
    return FabricHealth(
        summary=value("summary", _SUMMARIES),                               # type: ignore[arg-type]
        degraded_bandwidth=value("bandwidth", _BANDWIDTH),                  # type: ignore[arg-type]
        route_recovery=value("route_recovery_in_progress", _BOOLS),         # type: ignore[arg-type]
        route_unhealthy=value("route_unhealthy", _BOOLS),                   # type: ignore[arg-type]
        access_timeout_recovery=value("access_timeout_recovery", _BOOLS),  # type: ignore[arg-type]
        incorrect_configuration=value("incorrect_configuration", _CONFIGURATIONS),  # type: ignore[arg-type]
        partition_assigned=value("partition_assigned", _BOOLS),             # type: ignore[arg-type]
    )


__all__ = ["HEALTH_LINES", "fabric_health", "health_lines"]
