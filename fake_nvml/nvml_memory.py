"""Fake NVML calls of the memory check: ECC mode and counters, retired pages (pre-Ampere), row remapping
(Ampere and later). Which GPUs answer what follows the NVML API reference: ECC queries are NotSupported
without ECC (GeForce), nvmlDeviceGetRemappedRows is "for Ampere or newer", page retirement is the
pre-Ampere mechanism (row remapping replaced it), so each raises NotSupported where the model lacks it.
Also the memory faults, and what a GPU reset or reboot does to the memory state."""

from __future__ import annotations

from typing import Any

import pynvml

from fake_nvml.fault_kind import FaultArgs, FaultKind, set_field
from fake_nvml.node import FakeGpu, FakeNode, NodeState

_DEVICE_MEMORY = pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY
_SRAM = pynvml.NVML_MEMORY_LOCATION_SRAM


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def volatile_uncorrected(gpu: FakeGpu, elapsed_s: float) -> int:
    """The volatile uncorrectable count now: the fixed part plus what a rising fault has added since."""
    rising = max(0.0, elapsed_s - gpu.ecc_rising_since_s) * gpu.ecc_uncorrected_per_min / 60
    return gpu.ecc_uncorrected + int(rising)


def volatile_corrected(gpu: FakeGpu, elapsed_s: float) -> int:
    """The volatile corrected count now: the fixed part plus what an SBE storm has added since it began."""
    rising = max(0.0, elapsed_s - gpu.ecc_corrected_since_s) * gpu.ecc_corrected_per_s
    return gpu.ecc_corrected + int(rising)


class MemoryCalls:
    """Mixed into FakeNvml, which supplies `_device(handle)` and `node`."""

    def _ecc_gpu(self, handle: Any) -> FakeGpu:
        gpu = self._device(handle)   # type: ignore[attr-defined]
        if not gpu.model.ecc:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        gpu = self._ecc_gpu(handle)
        mode = pynvml.NVML_FEATURE_ENABLED if gpu.ecc_enabled else pynvml.NVML_FEATURE_DISABLED
        return [mode, mode]

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        gpu = self._ecc_gpu(handle)
        if error_type not in (0, 1) or counter_type not in (0, 1):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not gpu.ecc_enabled:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)    # counters exist only while ECC is on
        corrected = error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        now = self.node.elapsed_s()   # type: ignore[attr-defined]
        volatile = volatile_corrected(gpu, now) if corrected else volatile_uncorrected(gpu, now)
        if counter_type == pynvml.NVML_VOLATILE_ECC:
            return volatile
        before = gpu.ecc_aggregate_corrected if corrected else gpu.ecc_aggregate_uncorrected
        return before + volatile

    def nvmlDeviceGetMemoryErrorCounter(self, handle: Any, error_type: int, counter_type: int,
                                        location: int) -> int:
        """Device memory holds every fake error; SRAM (on-chip, Ampere and later) none."""
        total = self.nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type)
        gpu = self._device(handle)   # type: ignore[attr-defined]
        if location == _DEVICE_MEMORY:
            return total
        if location == _SRAM and gpu.model.row_remapping:
            return 0
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetRetiredPages(self, handle: Any, cause: int) -> list[int]:
        gpu = self._ecc_gpu(handle)
        if gpu.model.row_remapping:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if cause not in (pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                         pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        count = gpu.retired_dbe if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR else gpu.retired_sbe
        base = 0x7F0000 + cause * 0x10000
        return [(base + i) * 4096 for i in range(count)]           # hardware page addresses

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any) -> int:
        gpu = self._ecc_gpu(handle)
        if gpu.model.row_remapping:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_FEATURE_ENABLED if gpu.retire_pending else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        gpu = self._device(handle)   # type: ignore[attr-defined]
        if not gpu.model.row_remapping:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (gpu.remapped_corrected, gpu.remapped_uncorrected, int(gpu.remap_pending), int(gpu.remap_failure))


# -- faults (node time from node.elapsed_s()) ---------------------------------------------------------


def ecc_rising(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    now = node.elapsed_s()
    gpu.ecc_uncorrected = volatile_uncorrected(gpu, now)         # what has arrived so far stays counted
    gpu.ecc_uncorrected_per_min, gpu.ecc_rising_since_s = f.params["per_min"], now


def sbe_storm(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """Corrected (single-bit) errors arrive at `per_s` a second from now on, until a reset."""
    assert gpu is not None
    now = node.elapsed_s()
    gpu.ecc_corrected = volatile_corrected(gpu, now)             # what has arrived so far stays counted
    gpu.ecc_corrected_per_s, gpu.ecc_corrected_since_s = float(f.params["per_s"]), now


def remap_pending(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    gpu.remapped_uncorrected += 1
    gpu.remap_pending = True


def retired_pages(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    gpu.retired_sbe += f.params.get("sbe", 0)
    gpu.retired_dbe += f.params.get("dbe", 0)
    gpu.retire_pending = f.params.get("pending", gpu.retire_pending)


def heal(state: NodeState, gpus: list[FakeGpu], whole_node: bool) -> None:
    """A GPU reset or reboot: volatile ECC counts move into the aggregate ones and start again at 0, a
    rising fault stops, pending remaps and page retirements take effect. A remap failure, retired pages
    and aggregate counts stay: they live in the InfoROM."""
    for g in gpus:
        g.ecc_aggregate_corrected += volatile_corrected(g, g.ecc_corrected_since_s)
        g.ecc_aggregate_uncorrected += volatile_uncorrected(g, g.ecc_rising_since_s)
        g.ecc_corrected = g.ecc_uncorrected = 0
        g.ecc_uncorrected_per_min = g.ecc_corrected_per_s = 0.0
        g.remap_pending = g.retire_pending = False


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("ecc_rising", True, {"per_min": float}, ("per_min",), ecc_rising,
              "volatile uncorrectable ECC errors keep arriving at this rate (per minute) until a reset"),
    FaultKind("sbe_storm", True, {"per_s": float}, ("per_s",), sbe_storm,
              "volatile corrected (single-bit) ECC errors arrive at this rate (per second) until a reset: an "
              "SBE storm"),
    FaultKind("remap_pending", True, {}, (), remap_pending,
              "a row is remapped for an uncorrectable error and waits for a GPU reset to take effect"),
    FaultKind("remap_failure", True, {}, (), set_field("remap_failure", None, True),
              "a row remapping failed (no spare rows left in the bank): persists across resets"),
    FaultKind("retired_pages", True, {"sbe": int, "dbe": int, "pending": bool}, (), retired_pages,
              "pages retired on a pre-Ampere GPU (adds sbe/dbe; pending: one waits for a driver reload)"),
    FaultKind("ecc_disabled", True, {}, (), set_field("ecc_enabled", None, False),
              "ECC turned off on an ECC-capable GPU (its counters are then unavailable)"),
)
