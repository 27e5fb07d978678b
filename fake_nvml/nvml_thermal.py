"""The fake NVML's thermal calls: temperatures and their thresholds, clock event (throttle) reasons, the
violation counters and power. Mixed into FakeNvml, whose `_device(handle)` gives the FakeGpu.

What real NVML does, and so what this fake does:
- nvmlDeviceGetCurrentClocksEventReasons (alias ...ThrottleReasons): a bitmask of nvmlClocksEventReason*
  bits. nvidia-smi -q nests "HW Thermal Slowdown" and "HW Power Brake Slowdown" under "HW Slowdown", so
  either one sets the HwSlowdown bit too. SwThermalSlowdown means the GPU is over its "GPU Max Operating
  Temperature" or its memory over the "Memory Max Operating Temperature" (NVML/DCGM headers); SwPowerCap
  is the power controller holding a busy GPU at its limit (normal).
- nvmlDeviceGetViolationStatus(handle, NVML_PERF_POLICY_*) -> c_nvmlViolationTime_t: referenceTime is a CPU
  timestamp in microseconds, violationTime the nanoseconds the policy held the GPU below application clocks
  (below base clocks for TOTAL_BASE_CLOCKS), counted since the driver loaded. Policies 6..9 do not exist:
  InvalidArgument. Treated as a datacenter-GPU query: NotSupported on GeForce.
- nvmlDeviceGetTemperatureThreshold: SHUTDOWN, SLOWDOWN (HW slowdown), GPU_MAX ("GPU Max Operating Temp",
  where SW slowdown begins), MEM_MAX ("Memory Max Operating Temp"); a GPU without a memory sensor (GDDR
  GeForce boards: nvidia-smi "Memory Current Temp: N/A") answers NotSupported for MEM_MAX, and the acoustic
  thresholds are NotSupported here.
- memory (HBM) temperature: nvmlDeviceGetFieldValues with NVML_FI_DEV_MEMORY_TEMP; NotSupported in its slot
  where there is no sensor.
- power: nvmlDeviceGetPowerUsage, nvmlDeviceGetPowerManagementLimit and nvmlDeviceGetEnforcedPowerLimit in
  milliwatts.

Throttle patterns (the `throttle` and `power_brake` faults) drive the bitmask and the violation counters
from the same node time (FakeNode.elapsed_s()), so the two always agree.

Clocks (the performance check), from the same state:
- nvmlDeviceGetClockInfo(SM) / nvmlDeviceGetMaxClockInfo(SM): an idle GPU sits at its idle clock; a busy one
  runs at its application clock (nvmlDeviceGetApplicationsClock, GRAPHICS; the model's max unless set), held
  lower by an enforced power limit below the model's (clock ~ limit^0.64: dynamic power rises faster than the
  clock, so a 400 W limit of 700 holds an H100 about 30% below its siblings) and halved during a HW slowdown
  ("a factor of 2 or more", NVML).
- the cumulative throttle time per reason through nvmlDeviceGetFieldValues, at the field ids the fake driver's
  version has them (detector/backends/nvmlcompat.py throttle_counter_fields), in nanoseconds: the same
  pattern time as the violation counters.
- a busy GPU drawing its whole limit is power capped: `power_draw` and `power_limit` start an always-on SW
  power cap pattern, so the reasons mask and the counters say what the power figures say.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pynvml

from detector.backends.nvmlcompat import throttle_counter_fields
from fake_nvml.fault_kind import FaultArgs, FaultKind, set_field
from fake_nvml.node import FakeGpu, FakeNode, NodeState

_R = pynvml
# Throttle reasons a fault can name -> the bits they set in the current-reasons mask.
REASON_BITS: dict[str, int] = {
    "sw_power_cap": _R.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": _R.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": _R.nvmlClocksEventReasonSyncBoost,
    "sw_thermal": _R.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal": _R.nvmlClocksEventReasonHwThermalSlowdown | _R.nvmlClocksEventReasonHwSlowdown,
    "hw_power_brake": _R.nvmlClocksEventReasonHwPowerBrakeSlowdown | _R.nvmlClocksEventReasonHwSlowdown,
}
# ... and the violation counters (perf policies) their time counts into. Any of them holds the GPU below
# application clocks (TOTAL_APP_CLOCKS); a HW slowdown halves the clocks or more, below base clocks.
_POLICIES: dict[str, tuple[int, ...]] = {
    "sw_power_cap": (_R.NVML_PERF_POLICY_POWER,),
    "hw_power_brake": (_R.NVML_PERF_POLICY_POWER, _R.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS),
    "hw_thermal": (_R.NVML_PERF_POLICY_THERMAL, _R.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS),
    "sw_thermal": (_R.NVML_PERF_POLICY_THERMAL,),
    "hw_slowdown": (_R.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS,),
    "sync_boost": (_R.NVML_PERF_POLICY_SYNC_BOOST,),
}
_KNOWN_POLICIES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_POWER_CAP_SHARE = 0.97          # a busy GPU drawing this share of its limit is being capped
DEFAULT_MEMORY_TEMPERATURE_C = 40


@dataclass(frozen=True)
class ThermalLimits:
    """A model's thermal facts, as nvidia-smi -q shows them under Temperature."""

    shutdown_c: int
    slowdown_c: int
    gpu_max_c: int
    mem_max_c: int | None          # None: no memory temperature sensor (GDDR GeForce boards)
    violation_counters: bool       # nvmlDeviceGetViolationStatus answers (datacenter GPUs)


# H100 SXM: a captured `nvidia-smi -q` of an HGX H800 (same board) shows Shutdown 92, Slowdown 89, Max
# Operating 87, Memory Max Operating 95 C. The others keep models.py's shutdown/slowdown; their max operating
# temperatures are this fake's choice, not confirmed figures. GeForce boards report GPU thresholds and "N/A"
# for memory temperatures (nvidia-smi -q captures of GDDR6X cards).
LIMITS: dict[str, ThermalLimits] = {
    "h100-sxm5-80gb": ThermalLimits(92, 89, 87, 95, True),
    "h200-sxm-141gb": ThermalLimits(92, 89, 87, 95, True),
    "a100-sxm4-80gb": ThermalLimits(92, 89, 85, 95, True),
    "a100-pcie-40gb": ThermalLimits(92, 89, 85, 95, True),
    "v100-sxm2-32gb": ThermalLimits(90, 87, 83, 85, True),
    "rtx-4090": ThermalLimits(95, 90, 88, None, False),
}


def limits_of(gpu: FakeGpu) -> ThermalLimits:
    return LIMITS.get(gpu.model.key) or ThermalLimits(gpu.model.temp_shutdown_c, gpu.model.temp_slowdown_c,
                                                      gpu.model.temp_slowdown_c - 2, None, False)


@dataclass(frozen=True)
class Clocks:
    """A model's SM clocks (MHz), as nvidia-smi -q shows them under Max Clocks and Clocks at idle."""

    max_sm_mhz: int
    idle_sm_mhz: int


# H100 SXM: a captured `nvidia-smi -q` of an H100 80GB HBM3 (tests/fixtures/real_machines/h100-vm-580) shows
# Max Clocks SM 1980 MHz, Applications Clocks Graphics 1980 MHz and an idle SM clock of 345 MHz. The others
# are this fake's choice, near their data sheets' boost clocks.
CLOCKS: dict[str, Clocks] = {
    "h100-sxm5-80gb": Clocks(1980, 345),
    "h200-sxm-141gb": Clocks(1980, 345),
    "a100-sxm4-80gb": Clocks(1410, 210),
    "a100-pcie-40gb": Clocks(1410, 210),
    "v100-sxm2-32gb": Clocks(1530, 135),
    "rtx-4090": Clocks(3120, 210),
}
_POWER_CLOCK_EXPONENT = 0.64     # busy clock ~ (enforced limit / the model's limit) ** this, below the model's


def clocks_of(gpu: FakeGpu) -> Clocks:
    return CLOCKS.get(gpu.model.key) or Clocks(1500, 300)


def app_clock_mhz(gpu: FakeGpu) -> int:
    return gpu.app_clock_mhz or clocks_of(gpu).max_sm_mhz


def sm_clock_mhz(gpu: FakeGpu, now_s: float) -> int:
    """What the SM clock is now: idle, or the application clock held down by the power limit and HW slowdown."""
    clocks = clocks_of(gpu)
    if gpu.idle:
        return clocks.idle_sm_mhz
    clock = float(min(app_clock_mhz(gpu), clocks.max_sm_mhz))
    share = enforced_limit_mw(gpu) / (gpu.model.power_limit_w * 1000)
    if share < 1:
        clock = min(clock, clocks.max_sm_mhz * share ** _POWER_CLOCK_EXPONENT)
    if current_reasons(gpu, now_s) & _R.nvmlClocksEventReasonHwSlowdown:
        clock /= 2
    return max(int(clock), clocks.idle_sm_mhz)


# Reason names of the cumulative counters -> the throttle patterns whose time they count.
_COUNTER_PATTERNS: dict[str, tuple[str, ...]] = {
    "sw_power_cap": ("sw_power_cap",),
    "sync_boost": ("sync_boost",),
    "sw_thermal_slowdown": ("sw_thermal",),
    "hw_thermal_slowdown": ("hw_thermal",),
    "hw_power_brake_slowdown": ("hw_power_brake",),
}


def reason_ns(gpu: FakeGpu, reason: str, now_s: float) -> int:
    patterns = _COUNTER_PATTERNS[reason]
    return int(sum(pattern_on_s(p, now_s) for p in gpu.throttles if p["reason"] in patterns) * 1e9)


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


# -- throttle patterns over node time -----------------------------------------------------------------


def pattern_active(pattern: dict[str, Any], now_s: float) -> bool:
    """On for duty*period at the start of every period from since_s."""
    if now_s < pattern["since_s"]:
        return False
    return (now_s - pattern["since_s"]) % pattern["period_s"] < pattern["duty"] * pattern["period_s"]


def pattern_on_s(pattern: dict[str, Any], now_s: float) -> float:
    """Seconds the pattern has been on between since_s and now_s."""
    elapsed = now_s - pattern["since_s"]
    if elapsed <= 0:
        return 0.0
    period, on = pattern["period_s"], pattern["duty"] * pattern["period_s"]
    full, rest = divmod(elapsed, period)
    return full * on + min(rest, on)


def violation_ns(gpu: FakeGpu, policy: int, now_s: float) -> int:
    seconds = 0.0
    for pattern in gpu.throttles:
        policies = _POLICIES[pattern["reason"]]
        if policy in policies or policy == _R.NVML_PERF_POLICY_TOTAL_APP_CLOCKS:
            seconds += pattern_on_s(pattern, now_s)
    return int(seconds * 1e9)


def current_reasons(gpu: FakeGpu, now_s: float) -> int:
    limits = limits_of(gpu)
    reasons = _R.nvmlClocksEventReasonGpuIdle if gpu.idle else 0
    for pattern in gpu.throttles:
        if pattern_active(pattern, now_s):
            reasons |= REASON_BITS[pattern["reason"]]
    if gpu.temperature_c >= limits.slowdown_c:
        reasons |= REASON_BITS["hw_thermal"]
    elif gpu.temperature_c >= limits.gpu_max_c:
        reasons |= REASON_BITS["sw_thermal"]
    if limits.mem_max_c is not None and gpu.memory_temperature_c >= limits.mem_max_c:
        reasons |= REASON_BITS["sw_thermal"]
    if not gpu.idle and gpu.power_mw >= _POWER_CAP_SHARE * enforced_limit_mw(gpu):
        reasons |= REASON_BITS["sw_power_cap"]
    if not gpu.idle and gpu.app_clock_mhz and gpu.app_clock_mhz < clocks_of(gpu).max_sm_mhz:
        reasons |= _R.nvmlClocksEventReasonApplicationsClocksSetting
    return reasons


def enforced_limit_mw(gpu: FakeGpu) -> int:
    return gpu.power_limit_mw or gpu.model.power_limit_w * 1000


class ThermalCalls:
    """Mixed into FakeNvml, which supplies `_device(handle)`, `_state()` and `node`."""

    def _thermal_now_s(self) -> float:
        return self.node.elapsed_s()    # type: ignore[attr-defined]

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._device(handle)   # type: ignore[attr-defined]
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature_c

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        limits = limits_of(self._device(handle))   # type: ignore[attr-defined]
        value = {pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: limits.shutdown_c,
                 pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: limits.slowdown_c,
                 pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: limits.gpu_max_c,
                 pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: limits.mem_max_c}.get(threshold)
        if value is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._device(handle).power_mw   # type: ignore[attr-defined]

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        return enforced_limit_mw(self._device(handle))   # type: ignore[attr-defined]

    nvmlDeviceGetEnforcedPowerLimit = nvmlDeviceGetPowerManagementLimit

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return current_reasons(self._device(handle), self._thermal_now_s())   # type: ignore[attr-defined]

    nvmlDeviceGetCurrentClocksThrottleReasons = nvmlDeviceGetCurrentClocksEventReasons

    def nvmlDeviceGetViolationStatus(self, device: Any, perfPolicyType: int) -> pynvml.c_nvmlViolationTime_t:
        gpu = self._device(device)   # type: ignore[attr-defined]
        if perfPolicyType not in _KNOWN_POLICIES:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not limits_of(gpu).violation_counters:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlViolationTime_t(referenceTime=int(time.time() * 1e6),
                                            violationTime=violation_ns(gpu, perfPolicyType, self._thermal_now_s()))

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:
        gpu = self._device(handle)   # type: ignore[attr-defined]
        if clock_type not in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return sm_clock_mhz(gpu, self._thermal_now_s())

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock_type: int) -> int:
        gpu = self._device(handle)   # type: ignore[attr-defined]
        if clock_type not in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return clocks_of(gpu).max_sm_mhz

    def nvmlDeviceGetApplicationsClock(self, handle: Any, clock_type: int) -> int:
        gpu = self._device(handle)   # type: ignore[attr-defined]
        if clock_type != pynvml.NVML_CLOCK_GRAPHICS or not limits_of(gpu).violation_counters:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)     # GeForce boards have no application clocks
        return app_clock_mhz(gpu)

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        """The other mixins' fields (NVLink ...), then the memory temperature and the throttle counters (at
        the ids this driver version has them) in their slots."""
        values = super().nvmlDeviceGetFieldValues(handle, fieldIds)   # type: ignore[misc]
        gpu = self._device(handle)   # type: ignore[attr-defined]
        counters = {fid: reason for reason, fid in
                    throttle_counter_fields(self._state().driver_version).items()}   # type: ignore[attr-defined]
        for slot in values:
            reason = counters.get(slot.fieldId)
            if reason is not None:
                if not limits_of(gpu).violation_counters:
                    slot.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                else:
                    slot.nvmlReturn, slot.valueType = pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                    slot.value.ullVal = reason_ns(gpu, reason, self._thermal_now_s())
                continue
            if slot.fieldId != pynvml.NVML_FI_DEV_MEMORY_TEMP:
                continue
            if limits_of(gpu).mem_max_c is None:
                slot.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            else:
                slot.nvmlReturn, slot.valueType = pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                slot.value.uiVal = gpu.memory_temperature_c
        return values


# -- faults (declared in FAULTS below) ------------------------------------------------------------------


def throttle(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """A throttle reason on for `duty` of every `period_s` from now on, until a reset."""
    assert gpu is not None
    reason = f.params.get("reason", "hw_slowdown")
    if reason not in REASON_BITS:
        raise ValueError(f"fault 'throttle': reason must be one of {', '.join(REASON_BITS)}, got {reason!r}")
    if reason == "sw_power_cap" and float(f.params.get("duty", 1.0)) == 1.0 and _always_capped(gpu):
        return          # already capped all the time (by its power draw): the counters count it once
    _add_pattern(gpu, reason, f.params, node)


def _always_capped(gpu: FakeGpu) -> bool:
    return any(p["reason"] == "sw_power_cap" and p["duty"] == 1.0 for p in gpu.throttles)


def _cap_if_at_limit(gpu: FakeGpu, node: FakeNode) -> None:
    """A busy GPU drawing its whole limit is held there by the SW power cap from now on."""
    if not gpu.idle and gpu.power_mw >= _POWER_CAP_SHARE * enforced_limit_mw(gpu) and not _always_capped(gpu):
        _add_pattern(gpu, "sw_power_cap", {}, node)


def power_brake(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """The board's external power brake (asserted by the power supply or the BMC): a HW power brake pattern."""
    assert gpu is not None
    _add_pattern(gpu, "hw_power_brake", f.params, node)


def _add_pattern(gpu: FakeGpu, reason: str, params: dict[str, Any], node: FakeNode) -> None:
    duty, period = float(params.get("duty", 1.0)), float(params.get("period_s", 60.0))
    if not 0 < duty <= 1 or period <= 0:
        raise ValueError("throttle faults need 0 < duty <= 1 and period_s > 0")
    gpu.throttles.append({"reason": reason, "duty": duty, "period_s": period, "since_s": node.elapsed_s()})


def heal(state: NodeState, gpus: list[FakeGpu], whole_node: bool) -> None:
    """A GPU reset or node repair: throttle patterns stop (their counters start again from 0, as they count
    since the driver loaded), and the repaired cooling and power bring temperatures and draw back to idle."""
    for g in gpus:
        g.throttles = []
        g.temperature_c, g.memory_temperature_c, g.power_mw = 33, DEFAULT_MEMORY_TEMPERATURE_C, 72_000
        g.power_limit_mw = 0
        g.app_clock_mhz = 0


def power_draw(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    gpu.power_mw = int(f.params["watts"] * 1000)
    if "limit_watts" in f.params:
        gpu.power_limit_mw = int(f.params["limit_watts"] * 1000)
    gpu.utilization_pct = f.params.get("utilization", gpu.utilization_pct)
    _cap_if_at_limit(gpu, node)


def power_limit(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """An operator (nvidia-smi -pl) or a management agent sets the GPU's enforced power limit; a busy GPU
    then draws all of it (SW power cap) and its clocks fall."""
    assert gpu is not None
    watts = float(f.params["watts"])
    if watts <= 0:
        raise ValueError("fault 'power_limit': watts must be > 0")
    gpu.power_limit_mw = int(watts * 1000)
    if not gpu.idle:            # what it drew above the new limit, it no longer may
        gpu.power_mw = min(gpu.power_mw, gpu.power_limit_mw)
    _cap_if_at_limit(gpu, node)


def application_clocks(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    assert gpu is not None
    mhz = int(f.params["mhz"])
    if mhz <= 0:
        raise ValueError("fault 'application_clocks': mhz must be > 0")
    gpu.app_clock_mhz = mhz


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("throttle", True, {"reason": str, "duty": float, "period_s": float}, (), throttle,
              "a clock event reason (hw_slowdown, hw_thermal, hw_power_brake, sw_thermal, sw_power_cap, sync_boost; "
              "default hw_slowdown) is on for duty (default 1.0) of every period_s (default 60) from now until a "
              "reset; the reasons mask and the violation counters follow it"),
    FaultKind("power_brake", True, {"duty": float, "period_s": float}, (), power_brake,
              "the power supply or BMC asserts the GPU's external power brake (HW power brake slowdown) for duty "
              "of every period_s"),
    FaultKind("memory_temperature", True, {"celsius": int}, ("celsius",), set_field("memory_temperature_c", "celsius"),
              "the GPU's memory (HBM) temperature; a GPU without a memory sensor keeps answering NotSupported"),
    FaultKind("power_draw", True, {"watts": float, "limit_watts": float, "utilization": int}, ("watts",),
              power_draw, "the GPU draws this power (its enforced limit becomes limit_watts, its "
              "utilization this %); a busy GPU at its limit shows the SW power cap reason, which is normal"),
    FaultKind("power_limit", True, {"watts": float}, ("watts",), power_limit,
              "the GPU's enforced power limit is set to this (nvidia-smi -pl): a busy GPU draws all of it, is SW "
              "power capped, and its SM clock falls below its siblings'"),
    FaultKind("application_clocks", True, {"mhz": int}, ("mhz",), application_clocks,
              "the GPU's application (target) graphics clock is set to this (nvidia-smi -ac): a busy GPU runs "
              "no faster"),
)
