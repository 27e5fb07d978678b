"""NVML's GPU fabric health, decoded: the health mask of nvmlGpuFabricInfo_v2/v3 and the v3 health summary.

Pure: numbers in, a FabricHealth out (and back, for the fakes and the replay), so the live fabric check
and a replayed `nvidia-smi -q` are judged from the same fields.

From nvml.h ("Fabric definitions", https://docs.nvidia.com/deploy/nvml-api/group__nvmlFabricDefs.html,
R580; NVML_GPU_FABRIC_HEALTH_GET(var, type) = (var >> SHIFT_type) & WIDTH_type):
- each two-bit tri-state field reads NOT_SUPPORTED 0, TRUE 1, FALSE 2: degraded bandwidth (shift 0),
  route recovery in progress (2), route unhealthy (4), access-timeout recovery in progress (6), partition
  assigned (12). So a field's healthy value is FALSE (2); 0 says nothing, and is unknown here (None).
- incorrect configuration (shift 8, width 0xf): NOT_SUPPORTED 0, NONE 1, INCORRECT_SYSGUID 2,
  INCORRECT_CHASSIS_SN 3, NO_PARTITION 4, INSUFFICIENT_NVLINKS 5, INCOMPATIBLE_GPU_FW 6, INVALID_LOCATION 7,
  GPU_STATE_INVALID 8.
- global fabric manager state (shift 14, later headers): NOT_SUPPORTED 0, CONNECTED 1, DISCONNECTED 2.
- healthSummary (v3 only, an unsigned char): NOT_SUPPORTED 0, HEALTHY 1, UNHEALTHY 2, LIMITED_CAPACITY 3.
Numbers are taken from the header rather than the binding: bindings of the 570-580 era carry a wrong
WIDTH_DEGRADED_BW (0x11, see detector/backends/nvmlcompat.py CORRECTED) and older ones lack the later fields.
"""

from __future__ import annotations

from dataclasses import dataclass

# field -> (shift, width) in the health mask
TRI_STATE = {"degraded_bandwidth": (0, 0x3), "route_recovery": (2, 0x3), "route_unhealthy": (4, 0x3),
             "access_timeout_recovery": (6, 0x3), "partition_assigned": (12, 0x3)}
CONFIGURATION_FIELD = (8, 0xF)
GFM_FIELD = (14, 0x3)
NOT_SUPPORTED, TRUE, FALSE = 0, 1, 2

# incorrect configuration value -> its name ("none": correctly configured); 0 is unknown
CONFIGURATIONS = {1: "none", 2: "incorrect_sysguid", 3: "incorrect_chassis_sn", 4: "no_partition",
                  5: "insufficient_nvlinks", 6: "incompatible_gpu_fw", 7: "invalid_location",
                  8: "gpu_state_invalid"}
SUMMARIES = {1: "healthy", 2: "unhealthy", 3: "limited_capacity"}
GFM_STATES = {1: "connected", 2: "disconnected"}


@dataclass(frozen=True)
class FabricHealth:
    """The decoded fields; None wherever NVML said NOT_SUPPORTED (or there was no mask at all)."""

    summary: str | None = None                  # healthy, unhealthy, limited_capacity
    degraded_bandwidth: bool | None = None
    route_recovery: bool | None = None          # a route recovery in progress
    route_unhealthy: bool | None = None
    access_timeout_recovery: bool | None = None  # an access-timeout recovery in progress
    incorrect_configuration: str | None = None  # "none" or a CONFIGURATIONS name
    partition_assigned: bool | None = None
    gfm_state: str | None = None                # the global fabric manager: connected, disconnected

    @property
    def recovering(self) -> bool | None:
        """A route or access-timeout recovery in progress (a transient state): None when neither is known."""
        values = (self.route_recovery, self.access_timeout_recovery)
        return True if True in values else None if values == (None, None) else False


def _get(mask: int, shift: int, width: int) -> int:
    return (mask >> shift) & width


def decode(mask: int | None, summary: int | None = None) -> FabricHealth:
    """FabricHealth from a v2/v3 health mask and (v3) summary; None for a call that had neither.
    A value the header does not define reads as unknown, never as healthy or failed."""
    fields: dict[str, object] = {"summary": SUMMARIES.get(summary) if summary is not None else None}
    if mask is not None:
        for name, (shift, width) in TRI_STATE.items():
            fields[name] = {TRUE: True, FALSE: False}.get(_get(mask, shift, width))
        fields["incorrect_configuration"] = CONFIGURATIONS.get(_get(mask, *CONFIGURATION_FIELD))
        fields["gfm_state"] = GFM_STATES.get(_get(mask, *GFM_FIELD))
    return FabricHealth(**fields)  # type: ignore[arg-type]


def encode(health: FabricHealth) -> tuple[int, int]:
    """(healthMask, healthSummary) that decode back to `health`: for the fake NVML and the replay."""
    mask = 0
    for name, (shift, _) in TRI_STATE.items():
        value = getattr(health, name)
        mask |= (NOT_SUPPORTED if value is None else TRUE if value else FALSE) << shift
    by_name = {v: k for k, v in CONFIGURATIONS.items()}
    mask |= by_name.get(health.incorrect_configuration or "", NOT_SUPPORTED) << CONFIGURATION_FIELD[0]
    mask |= {v: k for k, v in GFM_STATES.items()}.get(health.gfm_state or "", NOT_SUPPORTED) << GFM_FIELD[0]
    summary = {v: k for k, v in SUMMARIES.items()}.get(health.summary or "", NOT_SUPPORTED)
    return mask, summary


# A healthy registered GPU as driver 580 reports it on a GB200/GB300 tray (nvidia-smi -q -x of real trays:
# Summary Healthy, Bandwidth Full, the recoveries and Route Unhealthy False, Incorrect Configuration None).
HEALTHY = FabricHealth(summary="healthy", degraded_bandwidth=False, route_recovery=False, route_unhealthy=False,
                       access_timeout_recovery=False, incorrect_configuration="none")


def summarise(health: FabricHealth) -> str:
    """A summary for these conditions where a fake is not told one: any fault Unhealthy, degraded bandwidth
    alone Limited Capacity, else Healthy (as NVIDIA's NVML mock in NVIDIA/k8s-test-infra derives it; real
    NVML reports its own summary, which the check reads as it is)."""
    faults = (health.route_recovery, health.route_unhealthy, health.access_timeout_recovery)
    if True in faults or health.incorrect_configuration not in (None, "none"):
        return "unhealthy"
    return "limited_capacity" if health.degraded_bandwidth else "healthy"


__all__ = ["CONFIGURATIONS", "FabricHealth", "HEALTHY", "SUMMARIES", "decode", "encode", "summarise"]
