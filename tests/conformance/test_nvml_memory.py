"""NVML conformance for the memory check's calls: ECC mode and counters, memory error counters by
location, retired pages and row remapping. Part 1 asserts only what real NVML guarantees and runs on
both backends; part 2 is the fake's behaviour under faults."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from fake_nvml.faults import Fault

from .test_nvml_conformance import started

NOT_APPLICABLE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)


def maybe(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except NOT_APPLICABLE:
        return None


def test_ecc_mode_is_current_and_pending_flags(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        mode = maybe(nvml.nvmlDeviceGetEccMode, h)
        if mode is not None:
            current, pending = mode
            assert current in (0, 1) and pending in (0, 1)


def test_ecc_totals_are_non_negative_ints_when_ecc_is_on(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        mode = maybe(nvml.nvmlDeviceGetEccMode, h)
        if mode is None or mode[0] != pynvml.NVML_FEATURE_ENABLED:
            continue
        for error_type in (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED):
            for counter in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
                value = maybe(nvml.nvmlDeviceGetTotalEccErrors, h, error_type, counter)
                assert value is None or isinstance(value, int) and value >= 0


def test_memory_error_counter_by_location_is_an_int_or_not_supported(nvml: Any, handles: list[Any]) -> None:
    for location in (pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY, pynvml.NVML_MEMORY_LOCATION_SRAM,
                     pynvml.NVML_MEMORY_LOCATION_L2_CACHE):
        try:
            value = nvml.nvmlDeviceGetMemoryErrorCounter(handles[0], pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                         pynvml.NVML_VOLATILE_ECC, location)
        except (*NOT_APPLICABLE, pynvml.NVMLError_InvalidArgument):
            continue
        assert isinstance(value, int) and value >= 0


def test_remapped_rows_is_four_counts_with_two_flags(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        rows = maybe(nvml.nvmlDeviceGetRemappedRows, h)
        if rows is None:
            continue
        corrected, uncorrected, pending, failure = rows
        assert all(isinstance(v, int) and v >= 0 for v in (corrected, uncorrected))
        assert pending in (0, 1) and failure in (0, 1)


def test_retired_pages_are_page_addresses(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        for cause in (pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                      pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR):
            pages = maybe(nvml.nvmlDeviceGetRetiredPages, h, cause)
            assert pages is None or all(isinstance(a, int) and a >= 0 for a in pages)
        pending = maybe(nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
        assert pending is None or pending in (0, 1)


# ---- fake only ---------------------------------------------------------------------------------


def test_geforce_answers_not_supported_to_every_ecc_query() -> None:
    nvml, _ = started("rtx-4090-1")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    for call, args in ((nvml.nvmlDeviceGetEccMode, ()), (nvml.nvmlDeviceGetTotalEccErrors, (1, 0)),
                       (nvml.nvmlDeviceGetRemappedRows, ()), (nvml.nvmlDeviceGetRetiredPages, (1,))):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(h, *args)


def test_pre_ampere_retires_pages_and_has_no_row_remapping() -> None:
    nvml, node = started("v100-sxm-8")
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetRemappedRows(h)
    node.inject(Fault("retired_pages", 1, {"sbe": 2, "dbe": 1, "pending": True}))
    assert len(nvml.nvmlDeviceGetRetiredPages(h, 0)) == 2 and len(nvml.nvmlDeviceGetRetiredPages(h, 1)) == 1
    assert nvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_ENABLED
    node.inject(Fault("recover", 1))
    assert nvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_DISABLED
    assert len(nvml.nvmlDeviceGetRetiredPages(h, 1)) == 1                 # retired pages stay retired


def test_remap_pending_until_reset_failure_forever() -> None:
    nvml, node = started("h100-sxm-8")
    h = nvml.nvmlDeviceGetHandleByIndex(3)
    node.inject(Fault("xid", 3, {"code": 63}))
    assert nvml.nvmlDeviceGetRemappedRows(h) == (0, 1, 1, 0)
    node.inject(Fault("recover", 3))
    assert nvml.nvmlDeviceGetRemappedRows(h) == (0, 1, 0, 0)
    node.inject(Fault("remap_failure", 3))
    node.inject(Fault("reboot"))
    assert nvml.nvmlDeviceGetRemappedRows(h)[3] == 1


def test_ecc_off_keeps_the_mode_readable_and_the_counters_not() -> None:
    nvml, node = started("h100-sxm-8")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    node.inject(Fault("ecc_disabled", 0))
    assert nvml.nvmlDeviceGetEccMode(h) == [pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_DISABLED]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetTotalEccErrors(h, 1, 0)


def test_a_reset_moves_volatile_counts_into_the_aggregate() -> None:
    nvml, node = started("h100-sxm-8")
    h = nvml.nvmlDeviceGetHandleByIndex(2)
    node.inject(Fault("ecc", 2, {"corrected": 5, "uncorrected": 2}))
    assert (nvml.nvmlDeviceGetTotalEccErrors(h, 0, 0), nvml.nvmlDeviceGetTotalEccErrors(h, 1, 1)) == (5, 2)
    node.inject(Fault("recover", 2))
    assert (nvml.nvmlDeviceGetTotalEccErrors(h, 0, 0), nvml.nvmlDeviceGetTotalEccErrors(h, 1, 0)) == (0, 0)
    assert (nvml.nvmlDeviceGetTotalEccErrors(h, 0, 1), nvml.nvmlDeviceGetTotalEccErrors(h, 1, 1)) == (5, 2)
