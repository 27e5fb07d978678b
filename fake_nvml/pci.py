"""The fake node's PCI bus: in memory for speed, or written out as a sysfs tree for the real reader; and the
GPU's PCIe replay counter (nvmlDeviceGetPcieReplayCounter), with the fault that makes it rise.

A replay is the link layer resending a TLP the other end did not acknowledge (a bad LCRC, a lost ACK): the
link survives, but a link that replays steadily is marginal (a riser, a retimer, a dirty connector).
NVML's counter counts them since the driver loaded; a GPU reset starts it again at 0."""

from __future__ import annotations

import os
from pathlib import Path

from detector.backends.pci import NVIDIA_VENDOR, PciDevice
from fake_nvml.driver_lines import upstream_port
from fake_nvml.fault_kind import FaultArgs, FaultKind
from fake_nvml.node import FakeGpu, FakeNode, NodeState

GPU_CLASS = 0x030200        # 3D controller
NVSWITCH_CLASS = 0x068000   # bridge, other
NVSWITCH_DEVICE = 0x22A3
_SPEEDS = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe",
           5: "32.0 GT/s PCIe", 6: "64.0 GT/s PCIe"}


def pci_devices(state: NodeState) -> list[PciDevice]:
    devices = [_gpu_device(g, state.driver_loaded) for g in state.gpus]
    devices += [PciDevice(s.pci_bus_id, NVIDIA_VENDOR, NVSWITCH_DEVICE, NVSWITCH_CLASS,
                          "nvidia-nvswitch" if state.driver_loaded else None, 2, 2, _SPEEDS[4], _SPEEDS[4])
                for s in state.nvswitches]
    return sorted(devices, key=lambda d: d.bus_id)


def _gpu_device(gpu: FakeGpu, driver_loaded: bool) -> PciDevice:
    return PciDevice(
        bus_id=gpu.pci_bus_id, vendor=NVIDIA_VENDOR, device=gpu.model.pci_device_id >> 16,
        class_code=GPU_CLASS, driver="nvidia" if driver_loaded and gpu.nvml_visible else None,
        current_link_width=gpu.pcie_width, max_link_width=gpu.model.pcie_max_width,
        current_link_speed=_SPEEDS.get(gpu.pcie_gen), max_link_speed=_SPEEDS.get(gpu.model.pcie_max_gen),
        upstream=(upstream_port(gpu),),
    )


class FakePciBus:
    """A PciBus over a FakeNode's live state."""

    def __init__(self, node: FakeNode):
        self.node = node

    def devices(self) -> list[PciDevice]:
        return self.node.read(pci_devices)


def write_sysfs(state: NodeState, root: Path) -> None:
    """Lay out `<root>/bus/pci/devices/<bdf>` as Linux does (symlinks into /sys/devices and to the driver)."""
    devices_dir = root / "bus" / "pci" / "devices"
    devices_dir.mkdir(parents=True, exist_ok=True)
    for dev in pci_devices(state):
        real = root / "devices" / f"pci{dev.bus_id[:4]}:00" / Path(*dev.upstream[::-1]) / dev.bus_id
        real.mkdir(parents=True, exist_ok=True)
        files = {"vendor": f"0x{dev.vendor:04x}", "device": f"0x{dev.device:04x}", "class": f"0x{dev.class_code:06x}",
                 "current_link_width": dev.current_link_width, "max_link_width": dev.max_link_width,
                 "current_link_speed": dev.current_link_speed, "max_link_speed": dev.max_link_speed}
        for name, value in files.items():
            if value is not None:
                (real / name).write_text(f"{value}\n")
        if dev.driver:
            driver_dir = root / "bus" / "pci" / "drivers" / dev.driver
            driver_dir.mkdir(parents=True, exist_ok=True)
            _symlink(os.path.relpath(driver_dir, real), real / "driver")
        _symlink(os.path.relpath(real, devices_dir), devices_dir / dev.bus_id)


def _symlink(target: str, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


# -- the replay counter over node time, and its fault ----------------------------------------------------


def pcie_replays(gpu: FakeGpu, elapsed_s: float) -> int:
    """The counter now: what was counted so far plus what a rising fault has added since it began."""
    rising = max(0.0, elapsed_s - gpu.pcie_replays_since_s) * gpu.pcie_replays_per_min / 60
    return gpu.pcie_replays + int(rising)


def replays_rising(f: FaultArgs, state: NodeState, gpu: FakeGpu | None, node: FakeNode) -> None:
    """The counter jumps by `add` and/or rises `per_min` from now on, until a reset."""
    assert gpu is not None
    now = node.elapsed_s()
    gpu.pcie_replays = pcie_replays(gpu, now) + f.params.get("add", 0)     # what has arrived stays counted
    gpu.pcie_replays_per_min, gpu.pcie_replays_since_s = float(f.params.get("per_min", 0.0)), now


def heal(state: NodeState, gpus: list[FakeGpu], whole_node: bool) -> None:
    """A GPU reset or reboot: the counter counts since the driver loaded the GPU, so it starts at 0."""
    for g in gpus:
        g.pcie_replays, g.pcie_replays_per_min = 0, 0.0


FAULTS: tuple[FaultKind, ...] = (
    FaultKind("pcie_replays", True, {"add": int, "per_min": float}, (), replays_rising,
              "the GPU's PCIe replay counter jumps by add and/or rises per_min from now until a reset "
              "(a marginal link resending TLPs)"),
)
