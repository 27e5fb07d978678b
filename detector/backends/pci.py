"""The PCI bus as sysfs shows it, read under a configurable root so tests use a fake tree."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

NVIDIA_VENDOR = 0x10DE
DISPLAY_CLASSES = (0x0300, 0x0302)     # VGA controller, 3D controller; NVSwitches are 0x0680 (bridge)
NVSWITCH_CLASS = 0x0680                # PCI class bridge/other, the class NVSwitches report (class_code >> 8)


@dataclass(frozen=True)
class PciDevice:
    bus_id: str                # canonical 0000:bb:dd.f
    vendor: int
    device: int
    class_code: int            # 24-bit: 0x030200
    driver: str | None         # bound kernel driver, None when no driver attached
    current_link_width: int | None = None
    max_link_width: int | None = None
    current_link_speed: str | None = None     # as sysfs: "32.0 GT/s PCIe"
    max_link_speed: str | None = None
    # The PCIe ports above the device, nearest first (a switch's downstream port ... the root port), from its
    # place in /sys/devices: what ties a port's AER lines in the kernel log to the GPU below it (issue 31).
    upstream: tuple[str, ...] = ()

    @property
    def is_nvidia_gpu(self) -> bool:
        return self.vendor == NVIDIA_VENDOR and (self.class_code >> 8) in DISPLAY_CLASSES


class PciBus(Protocol):
    def devices(self) -> list[PciDevice]: ...


def nvswitch_count(bus: PciBus) -> int:
    """NVSwitches on the node's own PCI bus (HGX/DGX boards); raises OSError when the bus is unreadable."""
    return sum(1 for d in bus.devices() if d.vendor == NVIDIA_VENDOR and d.class_code >> 8 == NVSWITCH_CLASS)


def nvidia_gpus(bus: PciBus) -> list[PciDevice]:
    """NVIDIA GPUs on the bus in PCI order (the order NVML numbers them in)."""
    return sorted((d for d in bus.devices() if d.is_nvidia_gpu), key=lambda d: d.bus_id)


class SysfsPciBus:
    """Reads `<root>/bus/pci/devices/*`; root is `/sys` on a host, `/host/sys` in a pod."""

    def __init__(self, root: Path = Path("/sys")):
        self.root = root

    def devices(self) -> list[PciDevice]:
        base = self.root / "bus" / "pci" / "devices"
        if not base.is_dir():
            raise FileNotFoundError(f"no PCI devices directory at {base}")
        return [dev for entry in sorted(base.iterdir()) if (dev := self._read(entry)) is not None]

    def _read(self, path: Path) -> PciDevice | None:
        try:
            vendor = int(_read(path / "vendor"), 16)
            device = int(_read(path / "device"), 16)
            class_code = int(_read(path / "class"), 16)
        except (OSError, ValueError):
            return None          # a device vanishing mid-read, or a malformed entry: skip, never crash
        driver_link = path / "driver"
        driver = driver_link.resolve().name if driver_link.exists() else None
        return PciDevice(
            bus_id=path.name, vendor=vendor, device=device, class_code=class_code, driver=driver,
            current_link_width=_int_or_none(path / "current_link_width"),
            max_link_width=_int_or_none(path / "max_link_width"),
            current_link_speed=_str_or_none(path / "current_link_speed"),
            max_link_speed=_str_or_none(path / "max_link_speed"),
            upstream=_upstream(path),
        )


_BUS_ID = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _upstream(path: Path) -> tuple[str, ...]:
    """`/sys/bus/pci/devices/0000:18:00.0` links to `/sys/devices/pci0000:00/0000:00:01.0/0000:16:00.0/
    0000:17:00.0/0000:18:00.0`: the bus ids before the device's own are the ports above it."""
    try:
        parts = path.resolve().parts
    except (OSError, RuntimeError):
        return ()
    ids = [p for p in parts[:-1] if _BUS_ID.match(p)]
    return tuple(reversed(ids))


def _read(path: Path) -> str:
    return path.read_text().strip()


def _str_or_none(path: Path) -> str | None:
    try:
        return _read(path)
    except OSError:
        return None


def _int_or_none(path: Path) -> int | None:
    text = _str_or_none(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
