"""PCIe link health: current width and generation against what this GPU in this slot can do, judged while
the GPU is busy. NVIDIA documents the current link generation and width as values that "may be reduced when
the GPU is not in use" (nvidia-smi(1), PCI section; --help-query-gpu, pcie.link.gen.current and
pcie.link.width.current), and real idle GPUs do both: so a link below its maximum means something only
while the GPU runs work.

The PCIe replay counter (nvmlDeviceGetPcieReplayCounter: replays since the driver loaded) is judged as a rate
over `window`: DCGM's PCIe health watch warns past 8 replays a minute (DCGM_LIMIT_MAX_PCIREPLAY_RATE, "8 replays
per minute is the maximum recommended by RM", dcgmlib/src/dcgm_gpu_hardware_limits.h), the default of
`replays_per_min` here. A window is judged once it covers `min_span` (a minute, as DCGM's), so a burst in the
first seconds after a start is not taken for a rate. One sweep and no more (`diagnose` without a duration, a
replayed capture) has no rate: the totals are compared with the node's other GPUs of the same model instead
(detector/core/siblings.py) and the finding says so. Verdicts are in rules/pcie.yaml."""

from __future__ import annotations

import time
from typing import Any, Callable

import pynvml

from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.inventory import GpuInfo, _optional
from detector.core.rates import CounterWindow, span_text
from detector.core.siblings import standouts
from detector.core.sweep import SweepContext
from detector.core.types import Observation


class PcieCheck(Check):
    """Width or generation below max is judged only while the GPU is `busy`: kernels running at least
    `busy_utilization` % of the time and NVML not reporting it idle. An idle GPU's narrow or slow link is
    power saving (or nothing it can show), never a fault; an unknown utilization leaves `busy` null."""

    name = "pcie"
    description = "PCIe link width and generation per GPU vs the maximum for this GPU and slot, while busy"
    fields = {
        "current_width": "negotiated link width (lanes)",
        "max_width": "widest link possible with this GPU and slot (NVML's max)",
        "current_gen": "negotiated link generation",
        "max_gen": "highest generation possible with this GPU and slot",
        "gpu_max_gen": "highest generation the GPU itself supports",
        "idle": "true when NVML reports the GPU idle (the GpuIdle clock event reason)",
        "utilization_pct": "GPU utilization: % of time a kernel ran (nvmlDeviceGetUtilizationRates; null where "
                           "not supported)",
        "busy": "true when utilization_pct >= busy_utilization and the GPU is not idle: the link is judged only "
                "then (null: utilization unknown)",
        "replays_total": "PCIe replays since the driver loaded (nvmlDeviceGetPcieReplayCounter; null: not readable)",
        "replays_increase": "replays in the last replay_window_s seconds (null until two readings)",
        "replays_per_min": "replays per minute over the window (null until two readings)",
        "replay_window_s": "seconds the increase covers (up to the window setting; less soon after a start)",
        "replay_window_ready": "true once the window covers min_span: the rate is judged",
        "replays_rising": "true when the window is ready and replays_per_min is over the replays_per_min setting",
        "replays_limit_per_min": "the replays_per_min setting (DCGM's 8 a minute by default)",
        "replays_context": "what the rate stands on: the total since the driver loaded and the node's uptime",
        "replays_above_siblings": "one sweep only (diagnose without a duration, a replay): the total since the "
                                  "driver loaded against the node's other GPUs of the same model, when far above "
                                  "them ('' otherwise): a comparison of totals, not a rate",
    }
    config_fields = {
        "busy_utilization": ConfigField(int, 30, "GPU utilization (%) from which the link is judged; below it "
                                                 "the width and generation may drop by design (light desktop "
                                                 "use reaches a few %)"),
        "window": ConfigField(float, 300.0, "seconds over which the PCIe replay counter is turned into a rate"),
        "min_span": ConfigField(float, 60.0, "seconds the window must cover before the replay rate is judged "
                                             "(DCGM judges a minute)"),
        "replays_per_min": ConfigField(float, 8.0, "PCIe replays a minute over which a GPU's link is called "
                                                   "marginal (DCGM_LIMIT_MAX_PCIREPLAY_RATE: 8)"),
        "siblings_factor": ConfigField(float, 10.0, "one sweep only: a GPU's replays since the driver loaded "
                                                    "stand out at this many times its same-model siblings' median"),
        "siblings_floor": ConfigField(float, 1000.0, "one sweep only: and at least this many more than that median "
                                                     "(the real healthy 8x H100 captures hold 0 to 120 each)"),
    }
    gauges = {
        "gpu_npd_gpu_pcie_replays_per_minute": GaugeSpec("replays_per_min", "PCIe replays per minute over the "
                                                         "pcie check's window"),
        "gpu_npd_pcie_link_width": GaugeSpec("current_width", "Negotiated PCIe link width (lanes)"),
        "gpu_npd_pcie_link_max_width": GaugeSpec("max_width", "Widest PCIe link possible for the GPU in its slot"),
        "gpu_npd_pcie_link_gen": GaugeSpec("current_gen", "Negotiated PCIe link generation"),
    }
    default_interval_s = 60.0
    default_timeout_s = 10.0

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(config, clock)
        self._replays = CounterWindow(float(self.config["window"]))

    def run(self, ctx: SweepContext) -> CheckOutput:
        now, uptime = self._clock(), ctx.host.uptime_s()
        one_sweep = ctx.host.snapshot or ctx.host.one_sweep
        seen = [g for g in ctx.inventory.gpus if g.pcie is not None]
        readings = []
        for gpu in seen:
            utilization = _utilization(ctx.host.nvml, gpu)
            fields = {**_link_fields(gpu.pcie), "idle": gpu.idle, "utilization_pct": utilization,
                      "busy": _busy(utilization, gpu.idle, int(self.config["busy_utilization"]))}
            fields.update(self._replay_rate(gpu, _replays(ctx.host.nvml, gpu), now, uptime))
            readings.append((gpu, fields))
        above = standouts({g.index: f["replays_total"] for g, f in readings}, {g.index: g.name for g, _ in readings},
                          factor=float(self.config["siblings_factor"]),
                          floor=float(self.config["siblings_floor"])) if one_sweep else {}
        observations, links = [], []
        for gpu, fields in readings:
            standout = above.get(gpu.index)
            fields["replays_above_siblings"] = (f"{standout.describe('PCIe replays')}: a comparison of totals, not a "
                                                "rate (one sweep cannot measure one)") if standout else ""
            observations.append(Observation(self.name, fields, gpu.ref()))
            links.append({"index": gpu.index, **fields})
        self._replays.keep_only({g.uuid for g in ctx.inventory.gpus if g.uuid})
        return CheckOutput(observations, {"links": links}, summary=_summary(links, one_sweep))

    def _replay_rate(self, gpu: GpuInfo, total: int | None, now: float, uptime: float | None) -> dict[str, Any]:
        rise = self._replays.add(gpu.uuid, total, now) if total is not None and gpu.uuid else None
        ready = rise is not None and rise.seconds >= float(self.config["min_span"])
        limit = float(self.config["replays_per_min"])
        per_min = round(rise.per_min(), 2) if rise else None
        since = "since the driver loaded" + (f" (the node has been up {span_text(uptime)})" if uptime else "")
        return {"replays_total": total, "replays_increase": int(rise.amount) if rise else None,
                "replays_per_min": per_min, "replay_window_s": round(rise.seconds, 1) if rise else 0.0,
                "replay_window_ready": ready, "replays_rising": bool(ready and per_min is not None and per_min > limit),
                "replays_limit_per_min": limit,
                "replays_context": "" if total is None else f"{total} {since}"}


def _replays(nvml: Any, gpu: GpuInfo) -> int | None:
    if gpu.handle is None or gpu.error:
        return None
    try:
        return _optional(nvml.nvmlDeviceGetPcieReplayCounter, gpu.handle)
    except pynvml.NVMLError:               # gone since the inventory, or a binding without it: unknown
        return None


def _summary(links: list[dict[str, Any]], one_sweep: bool) -> str:
    if not links:
        return ""
    rising = [str(g["index"]) for g in links if g["replays_rising"]]
    above = [str(g["index"]) for g in links if g["replays_above_siblings"]]
    if rising:
        return f"PCIe replays rising on GPU {', '.join(rising)}"
    if one_sweep:
        return ("one sweep: replay totals since the driver loaded compared across GPUs, no rate"
                + (f"; far above their siblings on GPU {', '.join(above)}" if above else ""))
    if not all(g["replay_window_ready"] for g in links if g["replays_total"] is not None):
        return "PCIe replay window filling"
    return "no PCIe replays rising"


def _utilization(nvml: Any, gpu: GpuInfo) -> int | None:
    if gpu.handle is None or gpu.error:
        return None
    try:
        rates = _optional(nvml.nvmlDeviceGetUtilizationRates, gpu.handle)
    except pynvml.NVMLError:               # a GPU that went away since the inventory: unknown, not a failure here
        return None
    return None if rates is None else int(rates.gpu)


def _busy(utilization: int | None, idle: bool | None, threshold: int) -> bool | None:
    if utilization is None:
        return None
    return utilization >= threshold and idle is not True


def _link_fields(link) -> dict[str, int | None]:
    return {"current_width": link.current_width, "max_width": link.max_width,
            "current_gen": link.current_gen, "max_gen": link.max_gen, "gpu_max_gen": link.gpu_max_gen}
