"""What NVML says about each GPU, read once per sweep and shared by the checks.

Each GPU is read on its own thread, so one wedged GPU (an NVML call that never returns) costs
only that GPU's facts, and is itself reported, instead of blinding every check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pynvml

from detector.backends.pciaddr import normalize_bus_id
from detector.core.deadline import Hung, Pending, call_with_deadline
from detector.core.types import GpuRef

if TYPE_CHECKING:
    from detector.backends.pci import PciDevice

HUNG = "Hung"      # error name for a GPU whose NVML calls did not return in time


def nvml_error_name(e: BaseException) -> str:
    """`NVMLError_GpuIsLost` -> `GpuIsLost`: stable names rules can match on."""
    name = type(e).__name__
    if isinstance(e, pynvml.NVMLError):
        return name.removeprefix("NVMLError_") if name != "NVMLError" else f"NvmlError{e.value}"
    return name


@dataclass(frozen=True)
class PcieLink:
    current_width: int | None
    max_width: int | None
    current_gen: int | None
    max_gen: int | None
    gpu_max_gen: int | None

    def to_dict(self) -> dict[str, int | None]:
        return {"current_width": self.current_width, "max_width": self.max_width,
                "current_gen": self.current_gen, "max_gen": self.max_gen}


@dataclass(frozen=True)
class GpuIdentity:
    """What an RMA ticket asks for. Each is None where the board does not say (GeForce boards have no
    InfoROM, so no serial: NVML API reference, nvmlDeviceGetSerial)."""

    serial: str | None = None
    board_part_number: str | None = None
    vbios_version: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {"serial": self.serial, "board_part_number": self.board_part_number,
                "vbios_version": self.vbios_version}


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    pcie: PcieLink | None = None
    identity: GpuIdentity = GpuIdentity()
    idle: bool | None = None
    error: str | None = None          # NVML error name, or HUNG
    handle: Any = field(default=None, compare=False, repr=False)

    def ref(self) -> GpuRef:
        return GpuRef(self.index, self.uuid, self.pci_bus_id)


@dataclass(frozen=True)
class Inventory:
    driver_version: str | None
    nvml_error: str | None             # the whole library failed (DriverNotLoaded, ...); gpus is empty
    gpus: list[GpuInfo]

    def by_bus_id(self) -> dict[str, GpuInfo]:
        return {g.pci_bus_id: g for g in self.gpus if g.pci_bus_id}

    def named_from_pci(self, pci_gpus: "list[PciDevice] | None") -> "Inventory":
        """Give bus ids to GPUs NVML could not open (lost, hung). NVML numbers the GPUs the driver
        bound in PCI order, so when the known GPUs agree with that order, an index names its bus id."""
        unnamed = [g for g in self.gpus if g.pci_bus_id is None]
        if not unnamed or not pci_gpus:
            return self
        driver_order = [d.bus_id for d in pci_gpus if d.driver == "nvidia"]
        if len(driver_order) != len(self.gpus) or any(
                driver_order[g.index] != g.pci_bus_id for g in self.gpus if g.pci_bus_id):
            return self
        gpus = [g if g.pci_bus_id else replace(g, pci_bus_id=driver_order[g.index]) for g in self.gpus]
        return replace(self, gpus=gpus)


def read_inventory(nvml: Any, timeout_s: float, threaded: bool = True) -> Inventory:
    """Read every GPU NVML enumerates. Never raises; never blocks much past `timeout_s`."""
    deadline = time.monotonic() + timeout_s

    def call(fn: Any) -> Any:
        return call_with_deadline(fn, deadline - time.monotonic(), "nvml") if threaded else fn()

    try:
        count = call(nvml.nvmlDeviceGetCount)
        driver = call(nvml.nvmlSystemGetDriverVersion)
    except Hung:
        return Inventory(None, HUNG, [])
    except Exception as e:  # noqa: BLE001 - any failure of the library is a finding, not a crash
        return Inventory(None, nvml_error_name(e), [])
    if not threaded:
        return Inventory(driver, None, [read_gpu(nvml, i) for i in range(count)])
    pending = [Pending(lambda i=i: read_gpu(nvml, i), f"nvml-gpu{i}") for i in range(count)]
    gpus = []
    for i, p in enumerate(pending):
        try:
            gpus.append(p.result(deadline - time.monotonic()))
        except Hung:
            gpus.append(GpuInfo(i, error=HUNG))
    return Inventory(driver, None, gpus)


def read_gpu(nvml: Any, index: int) -> GpuInfo:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        name = nvml.nvmlDeviceGetName(handle)
        info = _optional(nvml.nvmlDeviceGetPciInfo, handle)     # None only in a snapshot that does not say
        bus_id = normalize_bus_id(info.busId) if info is not None else None
    except Exception as e:  # noqa: BLE001 - NVMLError mostly; anything else is as much a finding
        return GpuInfo(index, error=nvml_error_name(e))
    try:
        pcie = PcieLink(
            current_width=_optional(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
            max_width=_optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
            current_gen=_optional(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
            max_gen=_optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            gpu_max_gen=_optional(nvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, handle),
        )
        reasons = _optional(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
        identity = GpuIdentity(serial=_optional(nvml.nvmlDeviceGetSerial, handle),
                               board_part_number=_optional(nvml.nvmlDeviceGetBoardPartNumber, handle),
                               vbios_version=_optional(nvml.nvmlDeviceGetVbiosVersion, handle))
    except Exception as e:  # noqa: BLE001 - lost between calls: keep identity, report the error
        return GpuInfo(index, uuid, name, bus_id, error=nvml_error_name(e), handle=handle)
    idle = None if reasons is None else bool(reasons & pynvml.nvmlClocksEventReasonGpuIdle)
    return GpuInfo(index, uuid, name, bus_id, pcie, identity, idle, handle=handle)


def _optional(fn: Any, *args: Any) -> Any:
    """A value NVML may legitimately not have (NotSupported, FunctionNotFound) becomes None."""
    try:
        return fn(*args)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return None
