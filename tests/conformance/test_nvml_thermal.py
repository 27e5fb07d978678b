"""Conformance of the thermal NVML calls: temperatures and thresholds, clock event reasons, violation
counters, memory temperature and power. Part 1 runs on both backends and asserts only what real NVML
guarantees; part 2 is the fake's behaviour under faults, which the thermal check's tests rely on."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

from conformance.conftest import node_of
from fake_nvml.faults import Fault
from fake_nvml.node import FakeNode
from fake_nvml.nvml import FakeNvml

_ALL = pynvml.nvmlClocksEventReasonAll
_NOT_HERE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
_POLICIES = (pynvml.NVML_PERF_POLICY_POWER, pynvml.NVML_PERF_POLICY_THERMAL, pynvml.NVML_PERF_POLICY_SYNC_BOOST,
             pynvml.NVML_PERF_POLICY_BOARD_LIMIT, pynvml.NVML_PERF_POLICY_LOW_UTILIZATION,
             pynvml.NVML_PERF_POLICY_RELIABILITY, pynvml.NVML_PERF_POLICY_TOTAL_APP_CLOCKS,
             pynvml.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS)


def _threshold(nvml: Any, h: Any, which: int) -> int | None:
    try:
        return nvml.nvmlDeviceGetTemperatureThreshold(h, which)
    except _NOT_HERE:
        return None


# ---- part 1: what real NVML guarantees (fake and, marked gpu, real) ---------------------------------


def test_the_throttle_reasons_alias_answers_a_bitmask_like_the_event_reasons(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        for reasons in (nvml.nvmlDeviceGetCurrentClocksEventReasons(h), nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)):
            assert isinstance(reasons, int) and reasons >= 0


def test_thresholds_are_ordered_and_the_gpu_is_below_shutdown(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        slowdown = _threshold(nvml, h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        shutdown = _threshold(nvml, h, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
        gpu_max = _threshold(nvml, h, pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX)
        if slowdown is None or shutdown is None:
            pytest.skip("this GPU reports no slowdown/shutdown thresholds")
        assert isinstance(slowdown, int) and 0 < slowdown < shutdown <= 130
        assert gpu_max is None or gpu_max <= slowdown
        assert nvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) < shutdown


def test_memory_max_threshold_is_plausible_where_reported(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        mem_max = _threshold(nvml, h, pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX)
        assert mem_max is None or 50 <= mem_max <= 130


def test_violation_status_is_a_struct_whose_times_only_move_forward(nvml: Any, handles: list[Any]) -> None:
    h = handles[0]
    try:
        first = {p: nvml.nvmlDeviceGetViolationStatus(h, p) for p in _POLICIES}
    except _NOT_HERE:
        pytest.skip("no violation counters on this GPU")
    second = {p: nvml.nvmlDeviceGetViolationStatus(h, p) for p in _POLICIES}
    for p in _POLICIES:
        assert isinstance(first[p], pynvml.c_nvmlViolationTime_t)
        assert isinstance(first[p].referenceTime, int) and isinstance(first[p].violationTime, int)
        assert second[p].referenceTime >= first[p].referenceTime > 0
        assert second[p].violationTime >= first[p].violationTime >= 0


def test_memory_temperature_field_answers_in_its_slot(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        [slot] = nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
        assert slot.fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP
        assert slot.nvmlReturn in (pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED)
        if slot.nvmlReturn == pynvml.NVML_SUCCESS:
            assert slot.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT and 0 < slot.value.uiVal < 130


def test_power_is_milliwatts_within_the_enforced_limit_range(nvml: Any, handles: list[Any]) -> None:
    for h in handles:
        try:
            usage, enforced = nvml.nvmlDeviceGetPowerUsage(h), nvml.nvmlDeviceGetEnforcedPowerLimit(h)
            limit = nvml.nvmlDeviceGetPowerManagementLimit(h)
        except _NOT_HERE:
            pytest.skip("no power readings on this GPU")
        assert all(isinstance(v, int) for v in (usage, enforced, limit))
        assert 1000 <= enforced <= limit <= 2_000_000          # 1 W .. 2 kW, in mW
        assert 0 <= usage <= 2 * limit


# ---- part 2: the fake under faults (fake only) ------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def started(scenario: str = "h100-sxm-8") -> tuple[FakeNvml, FakeNode, _Clock]:
    clock = _Clock()
    from fake_nvml.scenario import load_scenario
    node = load_scenario(scenario).build(clock=clock)
    nvml = FakeNvml(node)
    nvml.nvmlInit()
    return nvml, node, clock


def test_a_throttle_pattern_drives_the_mask_and_the_counters_alike() -> None:
    nvml, node, clock = started()
    h = nvml.nvmlDeviceGetHandleByIndex(2)
    node.inject(Fault("throttle", 2, {"reason": "hw_thermal", "duty": 0.25, "period_s": 40}))
    bits = pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonHwSlowdown
    on = []
    for t in range(0, 400):
        clock.now = float(t)
        on.append(nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & bits == bits)
    assert sum(on) == 100                                       # 10 s of every 40 s
    thermal = nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL).violationTime
    assert thermal == pytest.approx(100e9, rel=0.01)            # 399 s in: 9 full periods + 10 s
    assert nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS).violationTime == thermal
    assert nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_POWER).violationTime == 0
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(nvml.nvmlDeviceGetHandleByIndex(3)) & _ALL == \
        pynvml.nvmlClocksEventReasonGpuIdle                      # the other GPUs untouched


def test_power_brake_sets_its_bit_under_hw_slowdown_and_counts_as_power() -> None:
    nvml, node, clock = started()
    h = nvml.nvmlDeviceGetHandleByIndex(6)
    node.inject(Fault("power_brake", 6, {"duty": 1.0}))
    clock.now = 30.0
    reasons = nvml.nvmlDeviceGetCurrentClocksEventReasons(h)
    assert reasons & pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown and reasons & pynvml.nvmlClocksEventReasonHwSlowdown
    assert nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_POWER).violationTime == 30 * 10**9
    assert nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL).violationTime == 0


def test_temperatures_set_the_thermal_reasons_at_the_gpus_own_thresholds() -> None:
    nvml, node, _ = started()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    gpu_max = nvml.nvmlDeviceGetTemperatureThreshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX)
    slowdown = nvml.nvmlDeviceGetTemperatureThreshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    sw, hw = pynvml.nvmlClocksEventReasonSwThermalSlowdown, pynvml.nvmlClocksEventReasonHwThermalSlowdown
    node.inject(Fault("temperature", 0, {"celsius": gpu_max - 1}))
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & (sw | hw) == 0
    node.inject(Fault("temperature", 0, {"celsius": gpu_max}))
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & (sw | hw) == sw
    node.inject(Fault("temperature", 0, {"celsius": slowdown}))
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & hw
    node.inject(Fault("temperature", 0, {"celsius": 40}))
    node.inject(Fault("memory_temperature", 0, {"celsius": 97}))
    assert nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])[0].value.uiVal == 97
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & sw          # memory over its max: SW slowdown


def test_a_busy_gpu_at_its_power_limit_shows_the_power_cap_and_an_idle_one_does_not() -> None:
    nvml, node, _ = started()
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    node.inject(Fault("power_draw", 1, {"watts": 699.0}))
    assert not nvml.nvmlDeviceGetCurrentClocksEventReasons(h) & pynvml.nvmlClocksEventReasonSwPowerCap
    node.inject(Fault("busy", 1))
    reasons = nvml.nvmlDeviceGetCurrentClocksEventReasons(h)
    assert reasons & pynvml.nvmlClocksEventReasonSwPowerCap and not reasons & pynvml.nvmlClocksEventReasonGpuIdle
    assert nvml.nvmlDeviceGetPowerUsage(h) == 699_000
    node.inject(Fault("power_draw", 1, {"watts": 400.0, "limit_watts": 500.0}))
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == nvml.nvmlDeviceGetPowerManagementLimit(h) == 500_000


def test_geforce_has_gpu_thresholds_but_no_memory_sensor_or_violation_counters() -> None:
    nvml, _, _ = started("rtx-4090-1")
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetTemperatureThreshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX) > 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetTemperatureThreshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL)
    assert nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])[0].nvmlReturn == \
        pynvml.NVML_ERROR_NOT_SUPPORTED


def test_unknown_policy_and_sensor_are_invalid_arguments() -> None:
    nvml, _, _ = started()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetViolationStatus(h, 7)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetTemperature(h, 5)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetTemperatureThreshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_MIN)


def test_memory_temperature_and_nvlink_fields_share_one_call() -> None:
    nvml, _, _ = started()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    temp, replay = nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP,
                                                     (pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY, 0)])
    assert temp.nvmlReturn == replay.nvmlReturn == pynvml.NVML_SUCCESS and temp.value.uiVal == 40


def test_a_reset_stops_throttling_and_its_counters_start_again() -> None:
    nvml, node, clock = started()
    h = nvml.nvmlDeviceGetHandleByIndex(4)
    node.inject(Fault("throttle", 4, {"reason": "sw_thermal"}))
    node.inject(Fault("temperature", 4, {"celsius": 91}))
    clock.now = 60.0
    assert nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL).violationTime == 60 * 10**9
    node.inject(Fault("recover", 4))
    clock.now = 120.0
    assert nvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL).violationTime == 0
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonGpuIdle
    assert nvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) < 50


def test_a_lost_gpu_is_lost_for_every_thermal_call() -> None:
    nvml, node, _ = started()
    h = nvml.nvmlDeviceGetHandleByIndex(3)
    node.inject(Fault("lost", 3))
    for call in (lambda: nvml.nvmlDeviceGetViolationStatus(h, 0), lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h),
                 lambda: nvml.nvmlDeviceGetTemperatureThreshold(h, 1),
                 lambda: nvml.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()


def test_bad_throttle_faults_are_refused() -> None:
    node = node_of("h100-sxm-8")
    with pytest.raises(ValueError, match="reason must be one of"):
        node.inject(Fault("throttle", 0, {"reason": "gpu_idle"}))
    with pytest.raises(ValueError, match="duty"):
        node.inject(Fault("throttle", 0, {"duty": 1.5}))
