"""PCIe link health: current width and generation against what this GPU in this slot can do, judged while
the GPU is busy. NVIDIA documents the current link generation and width as values that "may be reduced when
the GPU is not in use" (nvidia-smi(1), PCI section; --help-query-gpu, pcie.link.gen.current and
pcie.link.width.current), and real idle GPUs do both: so a link below its maximum means something only
while the GPU runs work."""

from __future__ import annotations

from typing import Any

import pynvml

from detector.core.check import Check, CheckOutput, ConfigField, GaugeSpec
from detector.core.inventory import GpuInfo, _optional
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
    }
    config_fields = {
        "busy_utilization": ConfigField(int, 30, "GPU utilization (%) from which the link is judged; below it "
                                                 "the width and generation may drop by design (light desktop "
                                                 "use reaches a few %)"),
    }
    gauges = {
        "gpu_npd_pcie_link_width": GaugeSpec("current_width", "Negotiated PCIe link width (lanes)"),
        "gpu_npd_pcie_link_max_width": GaugeSpec("max_width", "Widest PCIe link possible for the GPU in its slot"),
        "gpu_npd_pcie_link_gen": GaugeSpec("current_gen", "Negotiated PCIe link generation"),
    }
    default_interval_s = 60.0
    default_timeout_s = 10.0

    def run(self, ctx: SweepContext) -> CheckOutput:
        observations = []
        links = []
        for gpu in ctx.inventory.gpus:
            if gpu.pcie is None:
                continue
            utilization = _utilization(ctx.host.nvml, gpu)
            fields = {**_link_fields(gpu.pcie), "idle": gpu.idle, "utilization_pct": utilization,
                      "busy": _busy(utilization, gpu.idle, int(self.config["busy_utilization"]))}
            observations.append(Observation(self.name, fields, gpu.ref()))
            links.append({"index": gpu.index, **fields})
        return CheckOutput(observations, {"links": links})


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
