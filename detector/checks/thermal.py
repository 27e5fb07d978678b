"""Thermal and power slowdowns: why each GPU's clocks are held down, for how much of the recent window, and
how close its temperatures are to the GPU's own limits.

What the NVML values mean (NVML API reference, nvmlClocksEventReasons and nvmlPerfPolicyType_t; the same
text is in DCGM's dcgm_fields.h):
- HwSlowdown: "reducing the core clocks by a factor of 2 or more": temperature too high, an external power
  brake (the system power supply), or power draw too high for fast-trigger protection; "may be also
  reported during PState or clock change", so one sample means nothing. HwThermalSlowdown and
  HwPowerBrakeSlowdown name the first two causes.
- SwThermalSlowdown: GPU over its "GPU Max Operating Temperature" or memory over its "Memory Max Operating
  Temperature". SwPowerCap: the power controller keeps a busy GPU within its limit: normal, never judged.
- nvmlDeviceGetViolationStatus: nanoseconds a policy held the GPU below application clocks (THERMAL,
  POWER) or below base clocks (TOTAL_BASE_CLOCKS), counted since the driver loaded. DCGM's thermal and
  power health watches read these (DCGM_FI_DEV_THERMAL_VIOLATION / _POWER_VIOLATION) and warn on any rise in
  a minute; here they become a share of the window, with the samples of the reasons mask beside them.
- Thresholds: nvmlDeviceGetTemperatureThreshold SLOWDOWN (HW slowdown begins), SHUTDOWN (HW protection),
  GPU_MAX and MEM_MAX (SW slowdown begins); memory (HBM) temperature through NVML_FI_DEV_MEMORY_TEMP.
  GeForce boards have no memory sensor: NotSupported, reported as null.

A window that is not yet full is judged on what it holds only once it holds `min_samples` samples over
`min_span` seconds (`window_ready`), so a restarted daemon does not page on its first readings; a replayed
capture (host.snapshot) is one sample that held for the whole window, judged at once. Verdicts
are in rules/thermal.yaml.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

import pynvml

from detector.checks.nvlink import _field_value
from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.inventory import _optional
from detector.core.per_gpu import read_each_gpu
from detector.core.rates import CounterWindow
from detector.core.sweep import SweepContext
from detector.core.types import Observation

_R = pynvml
# Every documented clock event reason bit, by the name the observations use.
REASON_NAMES: dict[int, str] = {
    _R.nvmlClocksEventReasonGpuIdle: "gpu_idle",
    _R.nvmlClocksEventReasonApplicationsClocksSetting: "applications_clocks_setting",
    _R.nvmlClocksEventReasonSwPowerCap: "sw_power_cap",
    _R.nvmlClocksEventReasonHwSlowdown: "hw_slowdown",
    _R.nvmlClocksEventReasonSyncBoost: "sync_boost",
    _R.nvmlClocksEventReasonSwThermalSlowdown: "sw_thermal_slowdown",
    _R.nvmlClocksEventReasonHwThermalSlowdown: "hw_thermal_slowdown",
    _R.nvmlClocksEventReasonHwPowerBrakeSlowdown: "hw_power_brake_slowdown",
    _R.nvmlClocksEventReasonDisplayClockSetting: "display_clock_setting",
}
_HW_ANY = (_R.nvmlClocksEventReasonHwSlowdown | _R.nvmlClocksEventReasonHwThermalSlowdown
           | _R.nvmlClocksEventReasonHwPowerBrakeSlowdown)
_THERMAL_ANY = _R.nvmlClocksEventReasonHwThermalSlowdown | _R.nvmlClocksEventReasonSwThermalSlowdown
# Share-of-window fields from the samples of the reasons mask: field -> the bits that count.
SAMPLED: dict[str, int] = {
    "hw_slowdown_pct": _HW_ANY,
    "hw_thermal_slowdown_pct": _R.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_pct": _R.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "sw_thermal_slowdown_pct": _R.nvmlClocksEventReasonSwThermalSlowdown,
    "sw_power_cap_pct": _R.nvmlClocksEventReasonSwPowerCap,
}
# Share-of-window fields from the violation counters: field -> perf policy.
COUNTED: dict[str, int] = {
    "thermal_violation_pct": _R.NVML_PERF_POLICY_THERMAL,
    "power_violation_pct": _R.NVML_PERF_POLICY_POWER,
    "below_base_clocks_pct": _R.NVML_PERF_POLICY_TOTAL_BASE_CLOCKS,
}
_THRESHOLDS = {"shutdown_c": _R.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN, "slowdown_c": _R.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
               "gpu_max_c": _R.NVML_TEMPERATURE_THRESHOLD_GPU_MAX, "memory_max_c": _R.NVML_TEMPERATURE_THRESHOLD_MEM_MAX}
_MAX_SAMPLES = 512          # per GPU, whatever the interval: memory stays bounded


class ThermalCheck(Check):
    """One observation per GPU. Readings a GPU does not offer (memory temperature on GeForce, violation
    counters) are null, with `violation_counters: not_supported`, never 0."""

    name = "thermal"
    description = "Thermal and power slowdowns per GPU (clock event reasons, violation counters) and temperatures vs the GPU's own limits"
    fields = {
        "reasons": "clock event reasons active now, by name (gpu_idle, sw_power_cap, hw_slowdown, ...)",
        "reasons_mask": "the raw nvmlClocksEventReasons bitmask",
        "hw_slowdown_pct": "% of the window's samples with any HW slowdown (HwSlowdown, HW thermal or HW power brake)",
        "hw_thermal_slowdown_pct": "% of the window's samples with HW thermal slowdown",
        "hw_power_brake_pct": "% of the window's samples with the HW power brake (external: power supply / BMC)",
        "sw_thermal_slowdown_pct": "% of the window's samples with SW thermal slowdown",
        "sw_power_cap_pct": "% of the window's samples with SW power cap (normal under load)",
        "thermal_violation_pct": "% of the window NVML's THERMAL violation counter held the GPU below application "
                                 "clocks (null without counters or before two readings)",
        "power_violation_pct": "% of the window the POWER violation counter held the GPU below application clocks",
        "below_base_clocks_pct": "% of the window the GPU was held below base clocks (TOTAL_BASE_CLOCKS counter)",
        "thermal_pct": "the larger of thermal_violation_pct and the % of samples with any thermal slowdown",
        "violation_counters": "supported or not_supported (nvmlDeviceGetViolationStatus)",
        "samples": "reasons samples in the window",
        "window_s": "seconds the window covers so far (up to the `window` setting)",
        "window_ready": "true once the window holds min_samples samples over min_span seconds: shares are judged",
        "temperature_c": "GPU temperature (C)",
        "slowdown_c": "temperature at which the GPU begins HW slowdown (its own threshold)",
        "shutdown_c": "temperature at which the GPU shuts down for HW protection",
        "gpu_max_c": "GPU max operating temperature (SW slowdown begins); null where not reported",
        "slowdown_margin_c": "slowdown_c - temperature_c (0 or less: at or over the slowdown threshold)",
        "shutdown_margin_c": "shutdown_c - temperature_c",
        "memory_temperature_c": "memory (HBM) temperature; null where the GPU has no memory sensor",
        "memory_max_c": "memory max operating temperature (memory SW slowdown begins); null where not reported",
        "memory_margin_c": "memory_max_c - memory_temperature_c",
        "power_w": "power draw (W)",
        "power_limit_w": "enforced power limit (W)",
        "power_pct_of_limit": "power draw as % of the enforced limit",
    }
    config_fields = {
        "window": ConfigField(float, 600.0, "seconds over which the share of time each slowdown reason held is measured"),
        "min_span": ConfigField(float, 120.0, "seconds the window must cover before shares are judged (after a start)"),
        "min_samples": ConfigField(int, 6, "samples the window must hold before shares are judged"),
    }
    gauges = {
        "gpu_npd_gpu_temperature_celsius": GaugeSpec("temperature_c", "GPU temperature"),
        "gpu_npd_gpu_memory_temperature_celsius": GaugeSpec("memory_temperature_c", "GPU memory (HBM) temperature"),
        "gpu_npd_gpu_slowdown_margin_celsius": GaugeSpec("slowdown_margin_c", "Degrees below the GPU's HW slowdown "
                                                         "threshold"),
        "gpu_npd_gpu_power_watts": GaugeSpec("power_w", "GPU power draw"),
        "gpu_npd_gpu_hw_slowdown_percent": GaugeSpec("hw_slowdown_pct", "Share of the window with a HW slowdown"),
        "gpu_npd_gpu_thermal_slowdown_percent": GaugeSpec("thermal_pct", "Share of the window with a thermal "
                                                          "slowdown"),
    }
    default_interval_s = 15.0
    default_timeout_s = 10.0

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._window = float(self.config["window"])
        self._counters = CounterWindow(self._window)
        self._samples: dict[str, deque[tuple[float, int]]] = {}
        self._limits: dict[str, dict[str, int | None]] = {}     # thresholds are fixed per GPU: read once

    def run(self, ctx: SweepContext) -> CheckOutput:
        nvml, now = ctx.host.nvml, self._clock()
        observations, gpus = [], []
        held = ctx.host.snapshot
        # samples and limits are kept by UUID: a GPU without one is not read
        read = read_each_gpu([g for g in ctx.inventory.gpus if g.uuid],
                             lambda gpu: self._observe(nvml, gpu.handle, gpu.uuid or "", now, held=held))
        for gpu, fields in read.readings:
            observations.append(Observation(self.name, fields, gpu.ref()))
            gpus.append({"index": gpu.index, "uuid": gpu.uuid, **fields})
        seen = {g.uuid for g in ctx.inventory.gpus if g.uuid}
        self._counters.keep_only({(u, p) for u in seen for p in COUNTED.values()})
        for table in (self._samples, self._limits):
            for uuid in set(table) - seen:
                del table[uuid]
        return CheckOutput(observations, {"gpus": gpus}, summary=_summary(gpus), error="; ".join(read.errors))

    def _observe(self, nvml: Any, handle: Any, uuid: str, now: float, held: bool = False) -> dict[str, Any]:
        mask = _reasons(nvml, handle)
        if mask is None:        # not readable here (a snapshot without them, an old GPU): unknown, not calm
            fields: dict[str, Any] = {"reasons": None, "reasons_mask": None, **dict.fromkeys(SAMPLED),
                                      "_thermal_sampled_pct": 0.0, "samples": 0, "window_s": 0.0,
                                      "window_ready": False}
        else:
            fields = {"reasons": [n for bit, n in REASON_NAMES.items() if mask & bit], "reasons_mask": mask}
            fields.update(self._shares(uuid, mask, now, held))
        fields.update(self._violations(nvml, handle, uuid, now))
        sampled_thermal = fields.pop("_thermal_sampled_pct")
        counted = fields["thermal_violation_pct"]
        fields["thermal_pct"] = sampled_thermal if counted is None else max(counted, sampled_thermal)
        fields.update(self._temperatures(nvml, handle, uuid))
        fields.update(_power(nvml, handle))
        return fields

    def _shares(self, uuid: str, mask: int, now: float, held: bool = False) -> dict[str, Any]:
        """Shares of the window's samples. `held`: one saved capture (a replay), whose reasons stand for the
        whole window: judged at once, as a window ready, not as one still filling."""
        samples = self._samples.setdefault(uuid, deque(maxlen=_MAX_SAMPLES))
        samples.append((now, mask))
        while len(samples) > 1 and samples[0][0] < now - self._window:
            samples.popleft()
        span = samples[-1][0] - samples[0][0]
        shares = {name: _pct(sum(1 for _, m in samples if m & bits), len(samples)) for name, bits in SAMPLED.items()}
        shares["_thermal_sampled_pct"] = _pct(sum(1 for _, m in samples if m & _THERMAL_ANY), len(samples))
        ready = held or (len(samples) >= int(self.config["min_samples"]) and span >= float(self.config["min_span"]))
        return {**shares, "samples": len(samples), "window_s": round(span, 1), "window_ready": ready}

    def _violations(self, nvml: Any, handle: Any, uuid: str, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {"violation_counters": "not_supported", **dict.fromkeys(COUNTED)}
        for name, policy in COUNTED.items():
            reading = _optional(nvml.nvmlDeviceGetViolationStatus, handle, policy)
            if reading is None:
                continue
            out["violation_counters"] = "supported"
            increase = self._counters.add((uuid, policy), float(reading.violationTime), now)
            if increase is not None and increase.seconds > 0:
                out[name] = round(min(max(increase.fraction(1e9), 0.0), 1.0) * 100, 1)
        return out

    def _temperatures(self, nvml: Any, handle: Any, uuid: str) -> dict[str, Any]:
        limits = self._limits.get(uuid)
        if limits is None:
            limits = {k: _optional(nvml.nvmlDeviceGetTemperatureThreshold, handle, t) for k, t in _THRESHOLDS.items()}
            self._limits[uuid] = limits
        temperature = _optional(nvml.nvmlDeviceGetTemperature, handle, _R.NVML_TEMPERATURE_GPU)
        memory = _memory_temperature(nvml, handle)
        return {"temperature_c": temperature, **limits, "memory_temperature_c": memory,
                "slowdown_margin_c": _minus(limits["slowdown_c"], temperature),
                "shutdown_margin_c": _minus(limits["shutdown_c"], temperature),
                "memory_margin_c": _minus(limits["memory_max_c"], memory)}


def _reasons(nvml: Any, handle: Any) -> int | None:
    """The reasons mask (None: not supported); drivers before 535 only have the older name of the same call."""
    try:
        try:
            return int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
        except pynvml.NVMLError_FunctionNotFound:
            return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return None


def _memory_temperature(nvml: Any, handle: Any) -> int | None:
    try:
        return _field_value(nvml.nvmlDeviceGetFieldValues(handle, [_R.NVML_FI_DEV_MEMORY_TEMP])[0])
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return None


def _power(nvml: Any, handle: Any) -> dict[str, Any]:
    draw = _optional(nvml.nvmlDeviceGetPowerUsage, handle)
    limit = _optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    if limit is None:
        limit = _optional(nvml.nvmlDeviceGetPowerManagementLimit, handle)
    return {"power_w": None if draw is None else round(draw / 1000, 1),
            "power_limit_w": None if limit is None else round(limit / 1000, 1),
            "power_pct_of_limit": round(100 * draw / limit, 1) if draw is not None and limit else None}


def _pct(part: int, whole: int) -> float:
    return round(100 * part / whole, 1) if whole else 0.0


def _minus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def _celsius(value: Any) -> str:
    """A temperature as people read it; one NVML (or a capture) does not give is unknown, never `None`."""
    return "unknown" if value is None else f"{value} C"


def _summary(gpus: list[dict[str, Any]]) -> str:
    if not gpus:
        return ""
    hottest = max(gpus, key=lambda g: g["temperature_c"] or 0)
    parts = [f"hottest GPU {hottest['index']} at {_celsius(hottest['temperature_c'])} "
             f"(slowdown {_celsius(hottest['slowdown_c'])})"]
    slowed = [str(g["index"]) for g in gpus if g["hw_slowdown_pct"] or g["thermal_pct"]]
    parts.append(f"slowed by heat or HW on GPU(s) {','.join(slowed)}" if slowed else "no thermal or HW slowdown")
    if not all(g["window_ready"] for g in gpus):
        parts.append(f"window filling ({min(g['samples'] for g in gpus)} sample(s) so far)")
    if all(g["violation_counters"] == "not_supported" for g in gpus):
        parts.append("violation counters not supported")
    return "; ".join(parts)
