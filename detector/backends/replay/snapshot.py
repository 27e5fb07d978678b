"""A snapshot of one machine as nvidia-smi printed it: every field optional, None where the text does
not say (absent, or N/A). Nothing here is guessed; the few derived values say how they were derived."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EccCounts:
    """One counter set (volatile or aggregate) by memory location: {location: (corrected, uncorrected)};
    a side is None where the text does not give it."""

    by_location: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)

    def total(self, uncorrected: bool) -> int | None:
        values = [pair[1 if uncorrected else 0] for pair in self.by_location.values()]
        known = [v for v in values if v is not None]
        return sum(known) if known else None


@dataclass(frozen=True)
class Reasons:
    """Clock event (throttle) reasons as printed: name -> active, for the reasons the text shows."""

    active: dict[str, bool]


@dataclass(frozen=True)
class GpuSnapshot:
    bus_id: str | None = None                  # canonical 0000:bb:dd.f
    name: str | None = None
    brand: str | None = None                   # as printed: Tesla, NVIDIA, GeForce, NVIDIA RTX, Quadro ...
    uuid: str | None = None
    serial: str | None = None
    board_part_number: str | None = None
    vbios_version: str | None = None
    minor_number: int | None = None
    pci_device_id: int | None = None           # 0x233010DE: device id in the high 16 bits, vendor low
    pci_subsystem_id: int | None = None
    pci_class: int | None = None               # 0x0302 (base class, sub class)
    pcie_max_gen: int | None = None            # max for this GPU in this slot
    pcie_current_gen: int | None = None
    pcie_gpu_max_gen: int | None = None        # "Device Max": the GPU's own
    pcie_max_width: int | None = None
    pcie_current_width: int | None = None
    pcie_replays: int | None = None
    persistence_mode: bool | None = None
    mig_mode: tuple[bool | None, bool | None] | None = None    # (current, pending)
    mig_devices: int | None = None             # MIG devices listed under the GPU
    driver_model: str | None = None            # WDDM, TCC (Windows), None on Linux
    virtualization_mode: str | None = None     # None, Pass-Through, VGPU, Host VGPU ...
    recovery_action: str | None = None         # as printed: None, GPU Reset, Node Reboot ...
    ecc_mode: tuple[bool | None, bool | None] | None = None    # (current, pending)
    ecc_volatile: EccCounts | None = None
    ecc_aggregate: EccCounts | None = None
    retired_sbe: int | None = None
    retired_dbe: int | None = None
    retired_pending: bool | None = None
    remapped_corrected: int | None = None
    remapped_uncorrected: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    reasons: Reasons | None = None
    reason_counters_us: dict[str, int] = field(default_factory=dict)   # sw_power_cap, hw_thermal ... -> us
    temperature_c: int | None = None
    memory_temperature_c: int | None = None
    shutdown_c: int | None = None
    slowdown_c: int | None = None
    gpu_max_c: int | None = None
    memory_max_c: int | None = None
    thresholds_from_tlimit: bool = False       # derived from T.Limit margins (driver 565+ prints only those)
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None            # Clocks / SM
    max_sm_clock_mhz: int | None = None        # Max Clocks / SM
    app_clock_mhz: int | None = None           # Applications Clocks / Graphics
    utilization_pct: int | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    processes: tuple[tuple[int, int | None], ...] | None = None      # (pid, used MiB); () when "None"
    fabric_state: str | None = None            # as printed: Completed, In Progress, Not Started
    fabric_status: str | None = None           # Success, or the NVML error text
    fabric_clique_id: int | None = None        # CliqueId / <cliqueId>
    fabric_cluster_uuid: str | None = None     # ClusterUUID / <clusterUuid>, as printed
    # Fabric / Health lines that carry a value (summary, bandwidth, route_unhealthy ...: detector/backends/replay/
    # fabric.py); None when the output has no Health block (drivers before 550 print none)
    fabric_health: dict[str, str] | None = None


@dataclass(frozen=True)
class Snapshot:
    path: str
    form: str                                  # xml or text
    timestamp: str | None
    driver_version: str | None
    cuda_version: str | None
    attached_gpus: int | None                  # what the log says the machine has
    gpus: tuple[GpuSnapshot, ...]

    @property
    def complete(self) -> bool:
        """Every attached GPU is in the file (not one GPU of eight, not a grep fragment)."""
        return (self.attached_gpus is not None and self.attached_gpus == len(self.gpus)
                and all(g.bus_id for g in self.gpus))
