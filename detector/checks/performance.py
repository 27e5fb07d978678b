"""A GPU slower than its peers: the one that holds a whole job back while every health counter says fine.

An A100 at a third of its FLOPS passed `dcgmi diag` (NVIDIA/DCGM #122); no passive health agent names a slow
GPU (NVIDIA/NVSentinel #890). NVML has what is needed, and this check reads it per GPU at every run:
- nvmlDeviceGetClockInfo(SM) and nvmlDeviceGetUtilizationRates: the SM clock and whether the GPU is busy
  (utilization >= `busy_utilization`). Only busy samples count: an idle GPU drops its clocks by design.
- nvmlDeviceGetMaxClockInfo(SM): the model's rated clock, as the machine reports it (read once per GPU).
- nvmlDeviceGetEnforcedPowerLimit and nvmlDeviceGetPowerUsage; nvmlDeviceGetApplicationsClock(GRAPHICS)
  where supported (datacenter GPUs): settings, the same on every GPU of a model unless someone changed one.
- the clocks event reasons mask (sampled) and, where the driver offers them, the cumulative throttle time per
  reason (nvidia-smi's "Clocks Event Reasons Counters": nvmlDeviceGetFieldValues at ids that moved between
  NVML headers, resolved by the running driver's version in detector/backends/nvmlcompat.py; the ids read are
  in `throttle_counters`). Without a field, the share comes from the mask's samples; SW power cap falls back
  to nvmlDeviceGetViolationStatus(POWER).

Each GPU is then compared with its same-model siblings (`model`: NVML's product name) in the same run:
the mean SM clock over its busy samples in the window against the busy siblings' median, its HW-reason
throttle share against theirs, its enforced power limit and application clock against theirs. A GPU alone of
its model is compared with its rated clock only, conservatively (rules/performance.yaml).

Normal, never judged: SW power cap under load (every busy GPU at its limit shows it), idle low clocks, sync
boost. Clocks are judged only over a window (`min_samples` busy samples over `min_span` seconds), never on one
sweep; a differing power limit or application clock is a setting, judged at once. A replayed capture
(host.snapshot) holds one instant: its clocks are not judged, its cumulative HW throttle counters (time since
the driver loaded) are compared across its GPUs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import pynvml

from detector.backends.nvmlcompat import optional, throttle_counter_fields
from detector.checks.nvlink import _field_value
from detector.checks.thermal import _power, _reasons
from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.inventory import GpuInfo
from detector.core.per_gpu import read_each_gpu
from detector.core.rates import CounterWindow
from detector.core.siblings import median
from detector.core.sweep import SweepContext
from detector.core.types import Observation

_R = pynvml
# The reasons whose share of the window is exported and judged, and the mask bits a sample counts for each.
# nvidia-smi nests HW thermal and HW power brake under HW slowdown, so hw_slowdown counts any of the three.
REASON_BITS: dict[str, int] = {
    "hw_slowdown": _R.nvmlClocksEventReasonHwSlowdown | _R.nvmlClocksEventReasonHwThermalSlowdown
    | _R.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "hw_thermal_slowdown": _R.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": _R.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "sw_thermal_slowdown": _R.nvmlClocksEventReasonSwThermalSlowdown,
    "sw_power_cap": _R.nvmlClocksEventReasonSwPowerCap,
}
HW_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
_MAX_SAMPLES = 512          # per GPU, whatever the interval: memory stays bounded


@dataclass(frozen=True)
class _Sample:
    at: float
    utilization: int | None
    sm_clock: int | None
    mask: int | None


class PerformanceCheck(Check):
    """One observation per GPU, with its figures and its same-model siblings' beside them."""

    name = "performance"
    description = ("A GPU slower than its busy same-model siblings: SM clock while busy, HW throttle share, "
                   "enforced power limit and application clocks vs theirs")
    fields = {
        "model": "the GPU's product name as NVML reports it (siblings are GPUs of the same name)",
        "utilization_pct": "GPU utilization now (%)",
        "busy": "utilization now >= the busy_utilization setting",
        "sm_clock_mhz": "SM clock now (MHz)",
        "max_sm_clock_mhz": "the model's rated max SM clock as NVML reports it (MHz)",
        "app_clock_mhz": "application (target) graphics clock (MHz); null where not supported",
        "power_w": "power draw (W)",
        "power_limit_w": "enforced power limit (W)",
        "samples": "samples in the window",
        "busy_samples": "samples in the window taken while the GPU was busy",
        "busy_pct": "% of the window's samples taken while busy",
        "window_s": "seconds the window covers so far (up to the `window` setting)",
        "window_ready": "the window holds min_samples samples over min_span seconds (always on a replay)",
        "busy_ready": "the window holds min_samples busy samples over min_span seconds: its busy clock is judged "
                      "(never on a replay: one instant says nothing of a clock)",
        "busy_sm_clock_mhz": "mean SM clock over the window's busy samples (null: not busy in the window)",
        "sm_clock_vs_rated_pct": "busy_sm_clock_mhz as % of max_sm_clock_mhz",
        "hw_slowdown_pct": "% of the window with any HW slowdown (HW slowdown, HW thermal or HW power brake)",
        "hw_thermal_slowdown_pct": "% of the window with HW thermal slowdown",
        "hw_power_brake_slowdown_pct": "% of the window with the HW power brake",
        "sw_thermal_slowdown_pct": "% of the window with SW thermal slowdown",
        "sw_power_cap_pct": "% of the window with SW power cap (normal under load; never judged)",
        "hw_throttle_pct": "the largest of the four HW-reason shares (hw_slowdown, hw_thermal_slowdown, "
                           "hw_power_brake_slowdown, sw_thermal_slowdown)",
        "throttle_ratio": "each reason's share of the window, 0..1, by reason (the gpu_npd_gpu_throttle_ratio metric)",
        "throttle_source": "by reason: counter (cumulative time from NVML) or samples (the reasons mask)",
        "throttle_counters": "which throttle counters were read: field ids by reason and the driver version that "
                             "chose them, or why none",
        "hw_throttle_s": "replay: seconds of HW-reason throttle (HW thermal + HW power brake + SW thermal) since the "
                         "driver loaded, from the counters; null where not captured",
        "snapshot": "true on a replayed capture (one instant)",
        "peers": "same-model siblings read in this run",
        "peers_busy": "same-model siblings whose busy clock is judged (busy_ready)",
        "peers_busy_sm_clock_mhz": "median busy SM clock of the busy siblings (MHz)",
        "sm_clock_vs_peers_pct": "busy_sm_clock_mhz vs peers_busy_sm_clock_mhz (%; -30: 30% below)",
        "peers_power_limit_w": "median enforced power limit of the siblings (W)",
        "power_limit_vs_peers_pct": "power_limit_w vs peers_power_limit_w (%)",
        "peers_app_clock_mhz": "median application clock of the siblings (MHz)",
        "app_clock_vs_peers_pct": "app_clock_mhz vs peers_app_clock_mhz (%)",
        "peers_hw_throttle_pct": "median hw_throttle_pct of the siblings",
        "peers_hw_throttle_s": "replay: median hw_throttle_s of the siblings",
        "peers_summary": "the siblings' figures in words, for messages",
    }
    config_fields = {
        "window": ConfigField(float, 600.0, "seconds over which busy clocks and throttle shares are measured"),
        "min_span": ConfigField(float, 120.0, "seconds the window must cover before clocks are judged"),
        "min_samples": ConfigField(int, 6, "busy samples the window must hold before a GPU's busy clock is judged"),
        "busy_utilization": ConfigField(int, 80, "utilization (%) at or above which a sample counts as busy"),
    }
    gauges = {
        "gpu_npd_gpu_busy_sm_clock_mhz": GaugeSpec("busy_sm_clock_mhz", "Mean SM clock over the window's busy "
                                                   "samples (absent while the GPU was not busy)", ("model",),
                                                   absent_when_null=True),
        "gpu_npd_gpu_throttle_ratio": GaugeSpec("throttle_ratio", "Share (0..1) of the window each clock event "
                                                "reason held", ("model",), by="reason"),
        "gpu_npd_gpu_power_limit_watts": GaugeSpec("power_limit_w", "Enforced power limit", ("model",)),
    }
    default_interval_s = 15.0
    default_timeout_s = 10.0

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._window = float(self.config["window"])
        self._counters = CounterWindow(self._window)
        self._samples: dict[str, deque[_Sample]] = {}
        self._rated: dict[str, int | None] = {}       # max SM clock per GPU: fixed, read once

    def run(self, ctx: SweepContext) -> CheckOutput:
        nvml, now, held = ctx.host.nvml, self._clock(), ctx.host.snapshot
        counter_ids = throttle_counter_fields(ctx.inventory.driver_version)
        gpus = [g for g in ctx.inventory.gpus if g.uuid]
        read = read_each_gpu(gpus, lambda gpu: self._observe(nvml, gpu, now, held, counter_ids))
        readings = [(gpu, fields) for gpu, fields in read.readings]
        _compare(readings)
        for gpu, fields in readings:
            fields["throttle_counters"] = _counters_said(counter_ids, fields.pop("_counters_read"),
                                                         ctx.inventory.driver_version)
        seen = {g.uuid for g in gpus}
        self._counters.keep_only({k for k in self._counters._samples if k[0] in seen})
        for table in (self._samples, self._rated):
            for uuid in set(table) - seen:
                del table[uuid]
        observations = [Observation(self.name, fields, gpu.ref()) for gpu, fields in readings]
        result = {"gpus": [{"index": gpu.index, "uuid": gpu.uuid, **fields} for gpu, fields in readings]}
        return CheckOutput(observations, result, summary=_summary(readings), error="; ".join(read.errors))

    # -- one GPU ---------------------------------------------------------------------------------------

    def _observe(self, nvml: Any, gpu: GpuInfo, now: float, held: bool,
                 counter_ids: dict[str, int]) -> dict[str, Any]:
        handle, uuid = gpu.handle, gpu.uuid or ""
        rates = optional(nvml, "nvmlDeviceGetUtilizationRates", handle)
        utilization = None if rates is None else int(rates.gpu)
        sm_clock = optional(nvml, "nvmlDeviceGetClockInfo", handle, _R.NVML_CLOCK_SM)
        if uuid not in self._rated:
            self._rated[uuid] = optional(nvml, "nvmlDeviceGetMaxClockInfo", handle, _R.NVML_CLOCK_SM)
        rated = self._rated[uuid]
        mask = _reasons(nvml, handle)
        busy_at = int(self.config["busy_utilization"])
        samples = self._samples.setdefault(uuid, deque(maxlen=_MAX_SAMPLES))
        samples.append(_Sample(now, utilization, sm_clock, mask))
        while len(samples) > 1 and samples[0].at < now - self._window:
            samples.popleft()
        span = samples[-1].at - samples[0].at
        busy = [s for s in samples if s.utilization is not None and s.utilization >= busy_at]
        clocks = [s.sm_clock for s in busy if s.sm_clock is not None]
        busy_clock = round(sum(clocks) / len(clocks), 1) if clocks else None
        enough = span >= float(self.config["min_span"])
        fields: dict[str, Any] = {
            "model": gpu.name or "",
            "utilization_pct": utilization,
            "busy": utilization is not None and utilization >= busy_at,
            "sm_clock_mhz": sm_clock, "max_sm_clock_mhz": rated,
            "app_clock_mhz": optional(nvml, "nvmlDeviceGetApplicationsClock", handle, _R.NVML_CLOCK_GRAPHICS),
            **_draw_and_limit(nvml, handle),
            "samples": len(samples), "busy_samples": len(busy),
            "busy_pct": round(100 * len(busy) / len(samples), 1),
            "window_s": round(span, 1),
            "window_ready": held or (len(samples) >= int(self.config["min_samples"]) and enough),
            "busy_ready": not held and len(clocks) >= int(self.config["min_samples"]) and enough,
            "busy_sm_clock_mhz": busy_clock,
            "sm_clock_vs_rated_pct": round(100 * busy_clock / rated, 1) if busy_clock and rated else None,
            "snapshot": held,
        }
        fields.update(self._throttle(nvml, handle, uuid, samples, now, held, counter_ids))
        return fields

    def _throttle(self, nvml: Any, handle: Any, uuid: str, samples: deque[_Sample], now: float, held: bool,
                  counter_ids: dict[str, int]) -> dict[str, Any]:
        """Each reason's share of the window: from its cumulative counter where the driver has one (time, not
        samples: a short slowdown between two samples still counts), else from the mask's samples."""
        counted = _read_counters(nvml, handle, counter_ids)
        if "sw_power_cap" not in counted:
            violation = optional(nvml, "nvmlDeviceGetViolationStatus", handle, _R.NVML_PERF_POLICY_POWER)
            if violation is not None:
                counted["sw_power_cap"] = int(violation.violationTime)
        masks = [s.mask for s in samples if s.mask is not None]
        shares: dict[str, float | None] = {}
        source: dict[str, str] = {}
        for reason, bits in REASON_BITS.items():
            share = None
            if reason in counted and not held:
                increase = self._counters.add((uuid, reason), float(counted[reason]), now)
                if increase is not None and increase.seconds > 0:
                    share = min(max(increase.fraction(1e9), 0.0), 1.0)
                    source[reason] = "counter"
            if share is None and masks:
                share = sum(1 for m in masks if m & bits) / len(masks)
                source[reason] = "samples"
            shares[reason] = share
        if "hw_slowdown" in shares and shares["hw_slowdown"] is not None:   # the parent covers its children
            parts = [shares[r] for r in ("hw_thermal_slowdown", "hw_power_brake_slowdown") if shares[r] is not None]
            shares["hw_slowdown"] = max([shares["hw_slowdown"], *parts])
        known = [shares[r] for r in HW_REASONS if shares[r] is not None]
        hw_counted = [counted[r] for r in ("hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
                      if r in counted]
        out: dict[str, Any] = {f"{r}_pct": None if s is None else round(100 * s, 1) for r, s in shares.items()}
        out.update({
            "hw_throttle_pct": round(100 * max(known), 1) if known else None,
            "throttle_ratio": {r: round(s, 4) for r, s in shares.items() if s is not None},
            "throttle_source": source,
            "hw_throttle_s": round(sum(hw_counted) / 1e9, 1) if held and hw_counted else None,
            "_counters_read": sorted(counted),
        })
        return out


def _read_counters(nvml: Any, handle: Any, counter_ids: dict[str, int]) -> dict[str, int]:
    """Reason -> nanoseconds, for the counters this driver answers (a NotSupported slot is left out)."""
    if not counter_ids:
        return {}
    values = optional(nvml, "nvmlDeviceGetFieldValues", handle, list(counter_ids.values()))
    if values is None:
        return {}
    out = {}
    for reason, slot in zip(counter_ids, values):
        value = _field_value(slot)
        if value is not None:
            out[reason] = value
    return out


def _draw_and_limit(nvml: Any, handle: Any) -> dict[str, Any]:
    """Power draw and enforced limit, read as the thermal check reads them."""
    power = _power(nvml, handle)
    return {"power_w": power["power_w"], "power_limit_w": power["power_limit_w"]}


def _counters_said(counter_ids: dict[str, int], read: list[str], driver: str | None) -> str:
    if not read:
        return f"none answered (driver {driver or 'unknown'}; shares from the reasons mask's samples)"
    ids = ", ".join(f"{r} {'field ' + str(counter_ids[r]) if r in counter_ids else 'violation status POWER'}"
                    for r in read)
    return f"{ids} (driver {driver or 'unknown'})"


# -- siblings ----------------------------------------------------------------------------------------------


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(median(known), 1) if known else None


def _vs(mine: float | None, theirs: float | None) -> float | None:
    return round(100 * (mine / theirs - 1), 1) if mine is not None and theirs else None


def _compare(readings: list[tuple[GpuInfo, dict[str, Any]]]) -> None:
    """Each GPU's figures against its same-model siblings' (never itself), written into its fields."""
    for gpu, fields in readings:
        siblings = [f for g, f in readings if g is not gpu and f["model"] == fields["model"]]
        busy = [f for f in siblings if f["busy_ready"] and f["busy_sm_clock_mhz"] is not None]
        fields.update({
            "peers": len(siblings),
            "peers_busy": len(busy),
            "peers_busy_sm_clock_mhz": _median([f["busy_sm_clock_mhz"] for f in busy]),
            "peers_power_limit_w": _median([f["power_limit_w"] for f in siblings]),
            "peers_app_clock_mhz": _median([f["app_clock_mhz"] for f in siblings]),
            "peers_hw_throttle_pct": _median([f["hw_throttle_pct"] for f in siblings]),
            "peers_hw_throttle_s": _median([f["hw_throttle_s"] for f in siblings]),
        })
        fields["sm_clock_vs_peers_pct"] = _vs(fields["busy_sm_clock_mhz"], fields["peers_busy_sm_clock_mhz"]) \
            if fields["busy_ready"] and busy else None
        fields["power_limit_vs_peers_pct"] = _vs(fields["power_limit_w"], fields["peers_power_limit_w"])
        fields["app_clock_vs_peers_pct"] = _vs(fields["app_clock_mhz"], fields["peers_app_clock_mhz"])
        fields["peers_summary"] = _peers_words(fields)


def _peers_words(f: dict[str, Any]) -> str:
    if not f["peers"]:
        return "no same-model sibling on this node"
    parts = [f"{f['peers']} sibling(s) of the same model"]
    if f["peers_busy"]:
        parts.append(f"{f['peers_busy']} busy at a median {f['peers_busy_sm_clock_mhz']:g} MHz")
    if f["peers_power_limit_w"] is not None:
        parts.append(f"power limit {f['peers_power_limit_w']:g} W")
    if f["peers_app_clock_mhz"] is not None:
        parts.append(f"application clock {f['peers_app_clock_mhz']} MHz")
    if f["peers_hw_throttle_pct"] is not None:
        parts.append(f"HW throttle {f['peers_hw_throttle_pct']}%")
    return ", ".join(parts)


def _summary(readings: list[tuple[GpuInfo, dict[str, Any]]]) -> str:
    if not readings:
        return ""
    busy = [(g, f) for g, f in readings if f["busy_sm_clock_mhz"] is not None]
    if not busy:
        return f"{len(readings)} GPU(s), none busy in the window: clocks not compared"
    clocks = ", ".join(f"GPU {g.index} {f['busy_sm_clock_mhz']:.0f}" for g, f in busy)
    parts = [f"busy SM clocks (MHz): {clocks}"]
    if not all(f["busy_ready"] for _, f in busy):
        parts.append("window filling: clocks judged after min_samples busy samples over min_span")
    return "; ".join(parts)
