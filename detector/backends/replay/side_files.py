"""The files a capture may hold beside nvidia-smi -q (the layout of ../shared/real-machines/h100-vm-580):

- proc-modules.txt: /proc/modules; proc-driver-nvidia-version.txt: /proc/driver/nvidia/version (both read
  by the live reader's own parsers, detector/backends/system.py).
- dev-nvidia.txt: `ls -la /dev/nvidia*` (or `ls /dev/nvidia*`): the /dev entries named nvidia*; the
  entries inside a listed directory (/dev/nvidia-caps/) are not /dev's own.
- lspci.txt: `lspci -Dnk` (or `-Dnnk`) of the machine's NVIDIA devices: each device's bus id, class and ids,
  and the driver bound to it. The PCI bus as the machine saw it: a GPU on the bus that NVML lost or never
  listed is there, which nvidia-smi -q cannot show.
- nvidia-smi-nvlink.txt: `nvidia-smi nvlink -s`: per GPU `GPU 0: NAME (UUID: GPU-...)`, then per link
  `Link 3: 26.562 GB/s` (active) or `Link 3: <inactive>`. Empty: NVML answered NotSupported for every link.

Each is read only as a regular file directly in the capture's folder, never through a link (which could
point anywhere on the machine reading the capture), and at most limits.MAX_SIDE_FILE_BYTES of it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from detector.backends.safefile import UnsafeFile, read_bounded
from detector.backends.system import parse_driver_version, parse_proc_modules
from detector.backends.replay.limits import MAX_SIDE_FILE_BYTES
from detector.backends.replay.raw import SnapshotError

MODULES, VERSION, DEV, NVLINK = "proc-modules.txt", "proc-driver-nvidia-version.txt", "dev-nvidia.txt", "nvidia-smi-nvlink.txt"
LSPCI = "lspci.txt"
_BUS_ID = r"(?P<bus>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])"
_LSPCI_N = re.compile(_BUS_ID + r"\s+(?P<cls>[0-9a-fA-F]{4}):\s+(?P<vendor>[0-9a-fA-F]{4}):(?P<device>[0-9a-fA-F]{4})\b")
_LSPCI_NN = re.compile(_BUS_ID + r"\s.*?\[(?P<cls>[0-9a-fA-F]{4})\]:\s.*\[(?P<vendor>[0-9a-fA-F]{4}):(?P<device>[0-9a-fA-F]{4})\]")
_LSPCI_DRIVER = re.compile(r"^\s+Kernel driver in use:\s*(?P<driver>\S+)")
_NVLINK_GPU = re.compile(r"^GPU (\d+): .*?(?:\(UUID: (GPU-[0-9a-fA-F-]+)\))?\s*$")
_LINK = re.compile(r"^Link (\d+):\s*(.*?)\s*$")
_LONG_FORMAT = re.compile(r"^[-bcdlps][-rwxsStT]{9}[.+@]?\s")     # `ls -l`: the name is the last field


@dataclass(frozen=True)
class NvlinkListing:
    """`nvidia-smi nvlink -s` as printed: per GPU (by UUID when printed, else index) link -> active."""

    by_uuid: dict[str, dict[int, bool]]
    by_index: dict[int, dict[int, bool]]
    empty: bool                       # printed nothing: NVML has no NVLink to report on this machine

    def links(self, index: int, uuid: str | None) -> dict[int, bool] | None:
        if uuid and uuid in self.by_uuid:
            return self.by_uuid[uuid]
        return None if self.by_uuid else self.by_index.get(index)


@dataclass(frozen=True)
class PciListed:
    """One device of `lspci -Dnk`: its bus id (canonical), 24-bit class code, ids, and bound driver."""

    bus_id: str
    class_code: int
    vendor: int
    device: int
    driver: str | None


@dataclass(frozen=True)
class SideFiles:
    modules: dict[str, str] | None = None
    kernel_module_version: str | None = None
    kernel_module_flavor: str | None = None
    device_files: frozenset[str] | None = None
    nvlink: NvlinkListing | None = None
    pci: tuple[PciListed, ...] | None = None
    read: tuple[str, ...] = ()        # which files were there


def read_side_files(folder: Path) -> SideFiles:
    """The side files `folder` holds; SnapshotError when one is there but not a regular file of at most
    MAX_SIDE_FILE_BYTES (a link, a FIFO, a device, a folder): refused, never followed or read."""
    def text(name: str) -> str | None:
        return read_side_file(folder, name)

    modules, version, dev, nvlink, lspci = text(MODULES), text(VERSION), text(DEV), text(NVLINK), text(LSPCI)
    kernel, flavor = parse_driver_version(version) if version is not None else (None, None)
    return SideFiles(modules=parse_proc_modules(modules) if modules is not None else None,
                     kernel_module_version=kernel, kernel_module_flavor=flavor,
                     device_files=parse_dev_listing(dev) if dev is not None else None,
                     nvlink=parse_nvlink_status(nvlink) if nvlink is not None else None,
                     pci=parse_lspci(lspci) if lspci is not None else None,
                     read=tuple(n for n, t in ((MODULES, modules), (VERSION, version), (DEV, dev), (NVLINK, nvlink),
                                               (LSPCI, lspci)) if t is not None))


def read_side_file(folder: Path, name: str, limit: int = MAX_SIDE_FILE_BYTES) -> str | None:
    """`name`'s text in `folder`, None when absent. `name` is one path component, and the file is opened
    without following a link, so what is read lies inside the folder."""
    if name in ("", ".", "..") or os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"side file name {name!r} is not a plain file name")
    path = folder / name
    if not os.path.lexists(path):
        return None
    try:
        return read_bounded(path, limit, "replay side file").decode("utf-8", "replace")
    except UnsafeFile as e:
        raise SnapshotError(f"{e}; a capture's side files must be regular files in its folder") from None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read it: {e.strerror or e}") from None


def parse_lspci(text: str) -> tuple[PciListed, ...]:
    """`lspci -Dnk` or `-Dnnk` as printed: every device line (a bus id without a domain gets 0000), with the
    `Kernel driver in use:` line under it. Lines of neither shape (subsystems, modules) are passed over."""
    from detector.backends.pciaddr import normalize_bus_id

    devices: list[PciListed] = []
    for line in text.splitlines():
        if (driver := _LSPCI_DRIVER.match(line)) and devices and devices[-1].driver is None:
            devices[-1] = replace(devices[-1], driver=driver["driver"])
            continue
        m = _LSPCI_N.match(line) or _LSPCI_NN.match(line)
        if m:
            bus = m["bus"] if m["bus"].count(":") == 2 else f"0000:{m['bus']}"
            devices.append(PciListed(normalize_bus_id(bus), int(m["cls"], 16) << 8, int(m["vendor"], 16),
                                     int(m["device"], 16), None))
    return tuple(devices)


def parse_dev_listing(text: str) -> frozenset[str]:
    names: set[str] = set()
    inside_subdir = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith(":") and stripped.startswith("/dev/"):
            inside_subdir = True          # `ls -la /dev/nvidia*` lists a directory's entries under "DIR:"
            names.add(Path(stripped[:-1]).name)
            continue
        if inside_subdir or not stripped or stripped.startswith("total "):
            continue
        tokens = [stripped.split()[-1]] if _LONG_FORMAT.match(stripped) else stripped.split()
        names.update(name for name in (Path(t).name for t in tokens) if name.startswith("nvidia"))
    return frozenset(names)


def parse_nvlink_status(text: str) -> NvlinkListing:
    by_uuid: dict[str, dict[int, bool]] = {}
    by_index: dict[int, dict[int, bool]] = {}
    current: dict[int, bool] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if gpu := _NVLINK_GPU.match(stripped):
            current = {}
            by_index[int(gpu.group(1))] = current
            if gpu.group(2):
                by_uuid[gpu.group(2)] = current
        elif (link := _LINK.match(stripped)) and current is not None:
            state = link.group(2).lower()
            if "inactive" in state:
                current[int(link.group(1))] = False
            elif re.match(r"^\d+(\.\d+)?\s*[gm]b/s$", state):
                current[int(link.group(1))] = True
    return NvlinkListing(by_uuid, by_index, empty=not text.strip())
