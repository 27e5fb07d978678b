"""Fake NVML calls of the memory check: ECC mode and counters, retired pages (pre-Ampere), row remapping
(Ampere and later). Which GPUs answer what follows the NVML API reference: ECC queries are NotSupported
without ECC (GeForce), nvmlDeviceGetRemappedRows is "for Ampere or newer", page retirement is the
pre-Ampere mechanism (row remapping replaced it), so each raises NotSupported where the model lacks it."""

from __future__ import annotations

from typing import Any

import pynvml

from fake_nvml.node import FakeGpu

_DEVICE_MEMORY = pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY
_SRAM = pynvml.NVML_MEMORY_LOCATION_SRAM


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def volatile_uncorrected(gpu: FakeGpu, elapsed_s: float) -> int:
    """The volatile uncorrectable count now: the fixed part plus what a rising fault has added since."""
    rising = max(0.0, elapsed_s - gpu.ecc_rising_since_s) * gpu.ecc_uncorrected_per_min / 60
    return gpu.ecc_uncorrected + int(rising)


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
        volatile = gpu.ecc_corrected if corrected else volatile_uncorrected(gpu, self.node.elapsed_s())  # type: ignore[attr-defined]
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
