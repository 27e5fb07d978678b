"""GPU models the fake node can impersonate: the static facts NVML would report."""

from __future__ import annotations

from dataclasses import dataclass

import pynvml


@dataclass(frozen=True)
class GpuModel:
    """What a GPU model is, independent of any one card's state."""

    key: str
    name: str                  # nvmlDeviceGetName
    pci_device_id: int         # 0xDDDD10DE as NVML reports pciDeviceId
    memory_mib: int
    pcie_max_gen: int
    pcie_max_width: int
    nvlink_links: int          # 0: NVLink state raises NotSupported
    ecc: bool                  # False: ECC queries raise NotSupported
    row_remapping: bool
    mig: bool
    power_limit_w: int
    temp_slowdown_c: int
    temp_shutdown_c: int
    nccl_busbw_gbps: float     # all-reduce bus bandwidth of a healthy node at a large size (NVLink or PCIe)
    brand: int                 # nvmlDeviceGetBrand: NVML_BRAND_NVIDIA (Ampere on) or _TESLA data-centre, _GEFORCE
    fabric_probe: bool = False # nvmlDeviceGetGpuFabricInfo[V] answers (Hopper and later); NotSupported otherwise
    multinode_nvlink: bool = False   # an NVLink domain beyond the node (GB200/GB300 NVL72: NVSwitch trays
                                     # elsewhere in the rack), so the GPU registers with the fabric with no
                                     # NVSwitch on the node's own PCI bus


MODELS: dict[str, GpuModel] = {
    m.key: m
    for m in (
        GpuModel("h100-sxm5-80gb", "NVIDIA H100 80GB HBM3", 0x233010DE, 81559, 5, 16, 18,
                 True, True, True, 700, 87, 92, 480.0, pynvml.NVML_BRAND_NVIDIA,
                 fabric_probe=True),
        GpuModel("h200-sxm-141gb", "NVIDIA H200", 0x233510DE, 143771, 5, 16, 18,
                 True, True, True, 700, 87, 92, 470.0, pynvml.NVML_BRAND_NVIDIA,
                 fabric_probe=True),
        # One GPU of a GB200 NVL72 compute tray (2 Grace CPUs, 4 B200-class GPUs joined to the rack's NVSwitch
        # trays by 18 NVLink5 links each). nvidia-smi names it "NVIDIA GB200" with about 186 GB of HBM3e.
        GpuModel("gb200", "NVIDIA GB200", 0x294110DE, 189471, 5, 16, 18,
                 True, True, True, 1200, 87, 92, 800.0, pynvml.NVML_BRAND_NVIDIA,
                 fabric_probe=True, multinode_nvlink=True),
        GpuModel("a100-sxm4-80gb", "NVIDIA A100-SXM4-80GB", 0x20B210DE, 81920, 4, 16, 12,
                 True, True, True, 400, 89, 92, 235.0, pynvml.NVML_BRAND_NVIDIA),
        GpuModel("a100-pcie-40gb", "NVIDIA A100-PCIE-40GB", 0x20F110DE, 40960, 4, 16, 0,
                 True, True, True, 250, 89, 92, 26.5, pynvml.NVML_BRAND_NVIDIA),
        GpuModel("v100-sxm2-32gb", "Tesla V100-SXM2-32GB", 0x1DB510DE, 32510, 3, 16, 6,
                 True, False, False, 300, 87, 90, 130.0, pynvml.NVML_BRAND_TESLA),
        GpuModel("rtx-4090", "NVIDIA GeForce RTX 4090", 0x268410DE, 24564, 4, 16, 0,
                 False, False, False, 450, 90, 95, 20.0, pynvml.NVML_BRAND_GEFORCE),
    )
}


def model_by_key(key: str) -> GpuModel:
    try:
        return MODELS[key]
    except KeyError:
        raise ValueError(f"unknown GPU model {key!r} (known: {', '.join(sorted(MODELS))})") from None
