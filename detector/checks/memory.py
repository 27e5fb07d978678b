"""GPU memory health: ECC error counts, retired pages (pre-Ampere) and row remapping (Ampere and later).

What the counters mean follows NVIDIA's memory error documents: NVML API reference for
nvmlDeviceGetRemappedRows ("isPending: a reset will be required to actually remap the row",
"failureOccurred is set if a row remapping ever failed"), the Dynamic Page Retirement guide (pages
retire on a DBE or repeated SBEs; a pending page needs a driver reload), and the A100/H100 GPU memory
error management guide (row remapping replaces page retirement from Ampere on). Verdicts are in
rules/memory.yaml; this module only reads and derives.

Corrected (single-bit) errors are normal at low rates, so only their rate is judged: the volatile corrected
count over `corrected_window`, once the window covers `corrected_min_span`, against `corrected_per_s`. An SBE
storm (NVIDIA/NVSentinel#1748: 17,657 a second on one GB200 GPU, while DCGM stalled and its monitor was killed
49 times) is thousands a second; a count that is not rising is never judged, however large. One sweep and no
more (diagnose without a duration, a replayed capture) has no rate: the count since the driver loaded is
compared with the node's other GPUs of the same model (detector/core/siblings.py), and the finding says so.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pynvml

from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.inventory import _optional
from detector.core.per_gpu import read_each_gpu
from detector.core.rates import CounterWindow, span_text
from detector.core.siblings import standouts
from detector.core.sweep import SweepContext
from detector.core.types import Observation

_ENABLED = pynvml.NVML_FEATURE_ENABLED
_CORRECTED, _UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
_VOLATILE, _AGGREGATE = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
# Where NVML can place an ECC error (nvmlMemoryLocation_t); each GPU answers NotSupported for the ones it lacks.
LOCATIONS = {"l1_cache": pynvml.NVML_MEMORY_LOCATION_L1_CACHE, "l2_cache": pynvml.NVML_MEMORY_LOCATION_L2_CACHE,
             "device_memory": pynvml.NVML_MEMORY_LOCATION_DEVICE_MEMORY,
             "register_file": pynvml.NVML_MEMORY_LOCATION_REGISTER_FILE,
             "texture_memory": pynvml.NVML_MEMORY_LOCATION_TEXTURE_MEMORY,
             "texture_shm": pynvml.NVML_MEMORY_LOCATION_TEXTURE_SHM, "cbu": pynvml.NVML_MEMORY_LOCATION_CBU,
             "sram": pynvml.NVML_MEMORY_LOCATION_SRAM}
# ECC's factory setting by nvmlDeviceGetBrand: on for data-centre GPUs (Tesla, and "NVIDIA" from Ampere on), off
# for desktop and workstation ones (GeForce, Titan, Quadro, NVIDIA RTX), whose owners switch it on if they want it.
# vGPU brands follow the host's physical GPU, which the guest cannot see: unknown, like a brand NVML cannot name.
_ECC_ON_BRANDS = frozenset({pynvml.NVML_BRAND_TESLA, pynvml.NVML_BRAND_NVIDIA})
_ECC_OFF_BRANDS = frozenset({pynvml.NVML_BRAND_GEFORCE, pynvml.NVML_BRAND_GEFORCE_RTX, pynvml.NVML_BRAND_TITAN,
                             pynvml.NVML_BRAND_TITAN_RTX, pynvml.NVML_BRAND_QUADRO, pynvml.NVML_BRAND_QUADRO_RTX,
                             pynvml.NVML_BRAND_NVIDIA_RTX, pynvml.NVML_BRAND_NVS})


class MemoryCheck(Check):
    """Reports each GPU's memory error state. ECC off or unsupported (GeForce) is reported as such,
    never as healthy or failed; so is a mechanism the GPU does not have (row remapping before Ampere,
    page retirement after it)."""

    name = "memory"
    description = "GPU memory errors: ECC counts, retired pages (pre-Ampere), row remapping (Ampere and later)"
    fields = {
        "ecc_mode": "enabled, disabled (an ECC-capable GPU with ECC off) or not_supported (no ECC: GeForce)",
        "ecc_pending_mode": "the ECC mode after the next reboot (enabled/disabled; null without ECC)",
        "ecc_default": "on (data-centre brand: Tesla, NVIDIA), off (GeForce, Titan, Quadro, NVIDIA RTX: ECC "
                       "ships off) or unknown (no brand, a vGPU brand): ECC's factory setting, by "
                       "nvmlDeviceGetBrand",
        "volatile_corrected": "corrected ECC errors since the driver loaded (null when ECC is off)",
        "volatile_uncorrected": "uncorrectable ECC errors since the driver loaded",
        "aggregate_corrected": "corrected ECC errors over the GPU's life (InfoROM)",
        "aggregate_uncorrected": "uncorrectable ECC errors over the GPU's life (InfoROM)",
        "uncorrected_increase": "how many uncorrectable errors arrived in the last `window` seconds (null "
                                "until two readings)",
        "window_s": "seconds the increase covers so far (up to the `window` setting)",
        "corrected_increase": "corrected ECC errors in the last corrected_window_s seconds (null until two readings)",
        "corrected_per_s": "corrected ECC errors per second over the corrected window (null until two readings)",
        "corrected_window_s": "seconds the corrected increase covers (up to the corrected_window setting)",
        "corrected_window_ready": "true once the corrected window covers corrected_min_span: the rate is judged",
        "corrected_rising": "true when the corrected window is ready and corrected_per_s is at or over the "
                            "corrected_per_s setting (an SBE storm)",
        "corrected_limit_per_s": "the corrected_per_s setting",
        "corrected_context": "what the rate stands on: the corrected count since the driver loaded and the uptime",
        "corrected_above_siblings": "one sweep only (diagnose without a duration, a replay): the corrected count "
                                    "since the driver loaded against the node's same-model GPUs, when far above "
                                    "them ('' otherwise): a comparison of totals, not a rate",
        "retired_sbe": "pages retired for multiple single-bit errors (pre-Ampere; null where not applicable)",
        "retired_dbe": "pages retired for a double-bit error (pre-Ampere)",
        "retired_total": "retired pages of either cause",
        "retired_pending": "true when a page waits for a driver reload or reset to be retired",
        "row_remapping": "supported or not_supported (row remapping exists from Ampere on)",
        "remapped_corrected": "rows remapped for correctable errors",
        "remapped_uncorrected": "rows remapped for uncorrectable errors",
        "remap_pending": "true when a remapping waits for a GPU reset to take effect",
        "remap_failure": "true when a row remapping ever failed (no spare row left)",
    }
    config_fields = {
        "window": ConfigField(float, 3600.0, "seconds over which a rise of the uncorrectable count is measured"),
        "corrected_window": ConfigField(float, 600.0, "seconds over which the corrected count is turned into a rate"),
        "corrected_min_span": ConfigField(float, 60.0, "seconds the corrected window must cover before its rate "
                                                       "is judged"),
        "corrected_per_s": ConfigField(float, 1.0, "corrected ECC errors a second from which a GPU is in an SBE "
                                                   "storm (DCGM's health watch warned at 10 between readings, "
                                                   "DCGM_LIMIT_MAX_SBE_RATE, 'a dummy value'; NVSentinel#1748 "
                                                   "saw 17,657 a second)"),
        "siblings_factor": ConfigField(float, 10.0, "one sweep only: a GPU's corrected count since the driver "
                                                    "loaded stands out at this many times its same-model "
                                                    "siblings' median"),
        "siblings_floor": ConfigField(float, 100000.0, "one sweep only: and at least this many more than that "
                                                       "median (a storm passes it in a minute; the real captures "
                                                       "here hold at most 353)"),
    }
    gauges = {
        "gpu_npd_ecc_volatile_uncorrected": GaugeSpec("volatile_uncorrected", "Uncorrectable ECC errors since "
                                                      "the driver loaded"),
        "gpu_npd_ecc_volatile_corrected": GaugeSpec("volatile_corrected", "Corrected ECC errors since the "
                                                    "driver loaded"),
        "gpu_npd_gpu_ecc_corrected_per_second": GaugeSpec("corrected_per_s", "Corrected ECC errors per second "
                                                          "over the memory check's corrected window"),
        "gpu_npd_ecc_aggregate_uncorrected": GaugeSpec("aggregate_uncorrected", "Uncorrectable ECC errors over "
                                                       "the GPU's life"),
        "gpu_npd_retired_pages": GaugeSpec("retired_total", "Retired memory pages (pre-Ampere GPUs)"),
        "gpu_npd_remapped_rows_uncorrected": GaugeSpec("remapped_uncorrected", "Rows remapped for "
                                                       "uncorrectable errors"),
        "gpu_npd_remap_pending": GaugeSpec("remap_pending", "1 while a row remapping waits for a GPU reset"),
    }
    default_interval_s = 60.0
    default_timeout_s = 15.0

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._uncorrected = CounterWindow(float(self.config["window"]))
        self._corrected = CounterWindow(float(self.config["corrected_window"]))

    def run(self, ctx: SweepContext) -> CheckOutput:
        nvml, now, uptime = ctx.host.nvml, self._clock(), ctx.host.uptime_s()
        observations, gpus = [], []
        read = read_each_gpu(ctx.inventory.gpus, lambda gpu: _read(nvml, gpu.handle))
        one_sweep = ctx.host.snapshot or ctx.host.one_sweep
        above = standouts({g.index: f["volatile_corrected"] for g, (f, _) in read.readings},
                          {g.index: g.name for g, _ in read.readings}, factor=float(self.config["siblings_factor"]),
                          floor=float(self.config["siblings_floor"])) if one_sweep else {}
        for gpu, (fields, by_location) in read.readings:
            fields.update(self._corrected_rate(gpu.uuid, fields["volatile_corrected"], now, uptime))
            standout = above.get(gpu.index)
            fields["corrected_above_siblings"] = (
                f"{standout.describe('corrected ECC errors')}: a comparison of totals, not a rate (one sweep "
                "cannot measure one)") if standout else ""
            count = fields["aggregate_uncorrected"]
            if count is None:
                count = fields["volatile_uncorrected"]
            increase = self._uncorrected.add(gpu.uuid, count, now) if count is not None else None
            fields["uncorrected_increase"] = int(increase.amount) if increase else None
            fields["window_s"] = round(increase.seconds, 1) if increase else 0.0
            observations.append(Observation(self.name, fields, gpu.ref()))
            gpus.append({"index": gpu.index, "uuid": gpu.uuid, **fields, "by_location": by_location})
        self._uncorrected.keep_only({g.uuid for g in ctx.inventory.gpus if g.uuid})
        self._corrected.keep_only({g.uuid for g in ctx.inventory.gpus if g.uuid})
        return CheckOutput(observations, {"gpus": gpus}, summary=_summary(gpus), error="; ".join(read.errors))

    def _corrected_rate(self, uuid: str | None, count: int | None, now: float,
                        uptime: float | None) -> dict[str, Any]:
        rise = self._corrected.add(uuid, count, now) if count is not None and uuid else None
        ready = rise is not None and rise.seconds >= float(self.config["corrected_min_span"])
        limit = float(self.config["corrected_per_s"])
        per_s = round(rise.per_s(), 2) if rise else None
        up = f" (the node has been up {span_text(uptime)})" if uptime else ""
        return {"corrected_increase": int(rise.amount) if rise else None, "corrected_per_s": per_s,
                "corrected_window_s": round(rise.seconds, 1) if rise else 0.0, "corrected_window_ready": ready,
                "corrected_rising": bool(ready and per_s is not None and per_s >= limit),
                "corrected_limit_per_s": limit,
                "corrected_context": "" if count is None else f"{count} since the driver loaded{up}"}


def _read(nvml: Any, handle: Any) -> tuple[dict[str, Any], dict[str, dict[str, int]]]:
    """One GPU's memory error state; NotSupported anywhere means 'not applicable here', never 0."""
    fields: dict[str, Any] = dict.fromkeys(MemoryCheck.fields)
    mode = _optional(nvml.nvmlDeviceGetEccMode, handle)
    fields["ecc_default"] = _ecc_default(_optional(nvml.nvmlDeviceGetBrand, handle))
    by_location: dict[str, dict[str, int]] = {}
    if mode is None:
        fields["ecc_mode"] = "not_supported"
    else:
        current, pending = mode
        fields["ecc_mode"] = "enabled" if current == _ENABLED else "disabled"
        fields["ecc_pending_mode"] = "enabled" if pending == _ENABLED else "disabled"
    if fields["ecc_mode"] == "enabled":
        for key, kind, counter in (("volatile_corrected", _CORRECTED, _VOLATILE),
                                   ("volatile_uncorrected", _UNCORRECTED, _VOLATILE),
                                   ("aggregate_corrected", _CORRECTED, _AGGREGATE),
                                   ("aggregate_uncorrected", _UNCORRECTED, _AGGREGATE)):
            fields[key] = _optional(nvml.nvmlDeviceGetTotalEccErrors, handle, kind, counter)
        by_location = _by_location(nvml, handle)
    sbe = _optional(nvml.nvmlDeviceGetRetiredPages, handle,
                    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    if sbe is not None:
        dbe = _optional(nvml.nvmlDeviceGetRetiredPages, handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        pending = _optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        fields["retired_sbe"], fields["retired_dbe"] = len(sbe), len(dbe or [])
        fields["retired_total"] = len(sbe) + len(dbe or [])
        fields["retired_pending"] = None if pending is None else pending == _ENABLED
    remap = _optional(nvml.nvmlDeviceGetRemappedRows, handle)
    fields["row_remapping"] = "not_supported" if remap is None else "supported"
    if remap is not None:
        corrected, uncorrected, pending, failure = remap
        fields.update(remapped_corrected=corrected, remapped_uncorrected=uncorrected,
                      remap_pending=bool(pending), remap_failure=bool(failure))
    return fields, by_location


def _ecc_default(brand: int | None) -> str:
    return "on" if brand in _ECC_ON_BRANDS else "off" if brand in _ECC_OFF_BRANDS else "unknown"


def _by_location(nvml: Any, handle: Any) -> dict[str, dict[str, int]]:
    """Volatile counts per memory location, for the JSON result (where a post-mortem wants them)."""
    found: dict[str, dict[str, int]] = {}
    for name, location in LOCATIONS.items():
        counts = {}
        for label, kind in (("corrected", _CORRECTED), ("uncorrected", _UNCORRECTED)):
            try:
                counts[label] = nvml.nvmlDeviceGetMemoryErrorCounter(handle, kind, _VOLATILE, location)
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound,
                    pynvml.NVMLError_InvalidArgument):
                break
        else:
            found[name] = counts
    return found


def _summary(gpus: list[dict[str, Any]]) -> str:
    if not gpus:
        return ""
    modes = sorted({g["ecc_mode"] for g in gpus})
    if modes == ["not_supported"]:
        return f"ECC not supported on these GPUs ({len(gpus)}): memory errors cannot be counted"
    parts = [f"ECC {','.join(modes)}",
             f"uncorrectable (volatile) {sum(g['volatile_uncorrected'] or 0 for g in gpus)}"]
    if any(g["row_remapping"] == "supported" for g in gpus):
        parts.append(f"remap pending on {sum(bool(g['remap_pending']) for g in gpus)} GPU(s), "
                     f"failed on {sum(bool(g['remap_failure']) for g in gpus)}")
    if any(g["retired_total"] is not None for g in gpus):
        parts.append(f"retired pages {sum(g['retired_total'] or 0 for g in gpus)}")
    storming = [str(g["index"]) for g in gpus if g["corrected_rising"]]
    if storming:
        parts.append(f"corrected errors storming on GPU {', '.join(storming)}")
    return "; ".join(parts)
