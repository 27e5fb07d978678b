"""Bind a snapshot to the detector's backends: ReplayNvml, the snapshot's GPUs as the PCI bus, its
nvidia-smi -L listing, the driver plumbing from the side files, no kernel log and no NCCL probe."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from detector.backends.pci import NVIDIA_VENDOR, PciDevice
from detector.backends.smi import SmiOutcome
from detector.backends.system import SystemInfo
from detector.checks.nccl.probe import ProbeRequest, ProbeResult
from detector.core.check import CheckSkipped
from detector.core.sweep import Host
from detector.backends.replay.load import load_snapshot
from detector.backends.replay.nvml import ReplayNvml
from detector.backends.replay.raw import SnapshotError
from detector.backends.replay.recording import RECORDING, RecordedNvml, read_recording
from detector.backends.replay.side_files import PciListed, SideFiles, read_side_files
from detector.backends.replay.snapshot import GpuSnapshot, Snapshot

HELD = "one snapshot: counters and reasons as held at capture"
_SPEEDS = {1: "2.5 GT/s PCIe", 2: "5.0 GT/s PCIe", 3: "8.0 GT/s PCIe", 4: "16.0 GT/s PCIe", 5: "32.0 GT/s PCIe",
           6: "64.0 GT/s PCIe"}
_GPU_CLASS = 0x0302          # 3D controller: what a datacenter GPU reports where the snapshot does not print it


class ReplayPciBus:
    """The PCI bus as the capture saw it: its `lspci -Dnk` listing where it has one (lspci.txt: a GPU on the
    bus that NVML lost is there, and the NVSwitches), each GPU with the link nvidia-smi printed for it; else
    the snapshot's GPUs, and only those. nvidia-smi does not list NVSwitches: without a listing the host is a
    snapshot (`Host.snapshot`), so the fabric check reads their count as unknown, not none."""

    def __init__(self, snapshot: Snapshot, listed: tuple[PciListed, ...] | None = None):
        self.snapshot, self.listed = snapshot, listed

    def devices(self) -> list[PciDevice]:
        captured = {str(g.bus_id): _device(g) for g in self.snapshot.gpus if g.bus_id}
        if self.listed is None:
            return list(captured.values())
        return [replace(captured[d.bus_id], driver=d.driver) if d.bus_id in captured else
                PciDevice(d.bus_id, d.vendor, d.device, d.class_code, d.driver) for d in self.listed]


def _device(g: GpuSnapshot) -> PciDevice:
    return PciDevice(bus_id=str(g.bus_id), vendor=NVIDIA_VENDOR, device=(g.pci_device_id or 0) >> 16,
                     class_code=(g.pci_class or _GPU_CLASS) << 8, driver="nvidia",
                     current_link_width=g.pcie_current_width, max_link_width=g.pcie_max_width,
                     current_link_speed=_SPEEDS.get(g.pcie_current_gen or 0),
                     max_link_speed=_SPEEDS.get(g.pcie_max_gen or 0))


class ReplaySmi:
    """`nvidia-smi -L` as the captured machine would have printed it, from the same snapshot; nothing else.
    A partial snapshot cannot say what -L would have listed: it reports itself unavailable."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot

    def run(self, args: list[str], timeout_s: float) -> SmiOutcome:
        if args != ["-L"]:
            return SmiOutcome("error", detail=f"a replayed snapshot answers only nvidia-smi -L, not {' '.join(args)}")
        gpus = self.snapshot.gpus
        if not self.snapshot.complete or not all(g.uuid and g.name for g in gpus):
            return SmiOutcome("error", detail="a partial snapshot: what nvidia-smi -L would have listed is unknown")
        listing = "".join(f"GPU {i}: {g.name} (UUID: {g.uuid})\n" for i, g in enumerate(gpus))
        return SmiOutcome("ok", 0, listing, "")


@dataclass(frozen=True)
class ReplaySystem:
    """Driver plumbing from the side files; what they do not hold is None (unknown)."""

    info: SystemInfo

    def read(self) -> SystemInfo:
        return self.info


def system_info(snapshot: Snapshot, side: SideFiles) -> SystemInfo:
    minors = {str(g.bus_id): g.minor_number for g in snapshot.gpus if g.bus_id and g.minor_number is not None}
    return SystemInfo(fabric_manager_running=None, modules=side.modules,
                      kernel_module_version=side.kernel_module_version, kernel_module_flavor=side.kernel_module_flavor,
                      gpu_minors=minors if snapshot.complete and len(minors) == len(snapshot.gpus) else None,
                      device_files=side.device_files)


class ReplayNcclProbe:
    name = "replay"

    def run(self, request: ProbeRequest) -> ProbeResult:
        raise CheckSkipped("a replayed snapshot cannot run an all-reduce")


def replay_info(snapshot: Snapshot, side: SideFiles) -> dict[str, Any]:
    """What diagnose prints about the replay: it judged one snapshot, from which files."""
    skipped = sum(1 for g in snapshot.gpus if not g.bus_id)
    info: dict[str, Any] = {"path": snapshot.path, "format": snapshot.form, "captured": snapshot.timestamp,
                            "driver": snapshot.driver_version, "gpus": len(snapshot.gpus) - skipped,
                            "attached_gpus": snapshot.attached_gpus, "complete": snapshot.complete,
                            "side_files": list(side.read), "judged": HELD}
    if skipped:
        info["gpus_without_bus_id"] = skipped
    return info


KERNEL_LOG = "kernel.log"


def replay_kernel_log(path: Path) -> Path | None:
    """The kernel log a replay folder holds (a bundle's kernel.log), read as `--kernel-log` reads a saved one;
    None when there is none. Only a regular file directly in the folder counts, never a link."""
    file = path / KERNEL_LOG
    if not path.is_dir() or not os.path.lexists(file):
        return None
    if file.is_symlink() or not file.is_file():
        raise SnapshotError(f"{file}: not a regular file; a capture's side files must be regular files in its folder")
    return file


def replay_host(path: Path, node_name: str | None = None) -> Host:
    snapshot = load_snapshot(path)
    if not snapshot.gpus:
        raise SnapshotError(f"{snapshot.path}: no GPU section (a 'GPU 00000000:..' header, <gpu id=..>, or a "
                            "GPU's fields such as Fabric or Clocks Event Reasons) in this output: nothing to judge")
    side = read_side_files(path) if path.is_dir() else SideFiles()
    recording = read_recording(path) if path.is_dir() else None
    nvml: Any = ReplayNvml(snapshot, side.nvlink)
    if recording is not None:                 # a bundle: NVML's own answers at capture, for what -q -x lacks
        nvml = RecordedNvml(nvml, recording)
    nvml.nvmlInit()
    host = Host(node_name or "replay", nvml, ReplaySmi(snapshot), ReplayPciBus(snapshot, side.pci), kernel_log=None,
                boot_id="replay", threaded=False, close=nvml.nvmlShutdown, nccl_probe=ReplayNcclProbe(),
                snapshot=True)
    host.system = ReplaySystem(system_info(snapshot, side))
    host.replay = replay_info(snapshot, side)          # type: ignore[attr-defined]
    if recording is not None:
        host.replay["side_files"].append(RECORDING)
    return host
