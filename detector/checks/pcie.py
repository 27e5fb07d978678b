"""PCIe link health: current width and generation against what this GPU in this slot can do."""

from __future__ import annotations

from detector.core.check import Check, CheckOutput, GaugeSpec
from detector.core.sweep import SweepContext
from detector.core.types import Observation


class PcieCheck(Check):
    """Width below max is downtraining whether the GPU is busy or idle. Generation, by design,
    drops at idle to save power, so it is judged only while the GPU is busy (`idle` false)."""

    name = "pcie"
    description = "PCIe link width and generation per GPU vs the maximum for this GPU and slot"
    fields = {
        "current_width": "negotiated link width (lanes)",
        "max_width": "widest link possible with this GPU and slot (NVML's max)",
        "current_gen": "negotiated link generation",
        "max_gen": "highest generation possible with this GPU and slot",
        "gpu_max_gen": "highest generation the GPU itself supports",
        "idle": "true when NVML reports the GPU idle (generation drops then by design)",
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
            fields = {**_link_fields(gpu.pcie), "idle": gpu.idle}
            observations.append(Observation(self.name, fields, gpu.ref()))
            links.append({"index": gpu.index, **fields})
        return CheckOutput(observations, {"links": links})


def _link_fields(link) -> dict[str, int | None]:
    return {"current_width": link.current_width, "max_width": link.max_width,
            "current_gen": link.current_gen, "max_gen": link.max_gen, "gpu_max_gen": link.gpu_max_gen}
