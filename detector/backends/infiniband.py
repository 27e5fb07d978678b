"""InfiniBand and RoCE ports as sysfs shows them (`<root>/class/infiniband/*/ports/*`).

The file formats are the kernel's (drivers/infiniband/core/sysfs.c): `state` "4: ACTIVE", `phys_state`
"5: LinkUp", `rate` "400 Gb/sec (4X NDR)" (RoCE ports show their Ethernet speed in the same form),
`link_layer` "InfiniBand", "Ethernet" or "Unknown", and each PMA counter as a decimal number or
"N/A (no PMA)" when the device answers no performance-management query. A file that cannot be read or
parsed is that port's error, never the whole read's.

Reading a PMA counter makes the kernel send the HCA a PerfMgt query, so only the counters judged are read
(seven per port), not the whole directory.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Protocol, TypeVar

# The error counters read, with their width in bits. These are IBTA PortCounters fields (the kernel's
# PORT_PMA_ATTR widths): they are never extended to 64 bits (only data and packet counters are), and per
# the InfiniBand spec they stop at all ones instead of wrapping, so a counter at its maximum is saturated:
# it cannot rise any more and gives no rate until someone resets it (perfquery -R).
COUNTER_BITS: dict[str, int] = {
    "link_downed": 8,
    "link_error_recovery": 8,
    "symbol_error": 16,
    "port_rcv_errors": 16,
    "port_xmit_discards": 16,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
}
NO_PMA = "N/A (no PMA)"

# IB port states (IBTA PortInfo.PortState; the kernel's state_show names).
STATE_NAMES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
ACTIVE = 4
# Physical port states (PortInfo.PortPhysicalState; the kernel's phys_state_show names).
PHYS_STATE_NAMES = {1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining", 5: "LinkUp",
                    6: "LinkErrorRecovery", 7: "Phy Test"}
LINK_UP = 5

T = TypeVar("T")
_STATE = re.compile(r"^\s*(\d+)\s*:\s*(.*?)\s*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")


def natural_key(name: str) -> tuple:
    """mlx5_2 before mlx5_10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def counter_max(name: str) -> int:
    """The value at which `name` saturates."""
    return (1 << COUNTER_BITS[name]) - 1


@dataclass(frozen=True)
class IbPort:
    """One port as read. None: the file was absent or unreadable (`errors` says which)."""

    device: str
    port: int
    link_layer: str | None = None
    state_code: int | None = None
    state: str | None = None
    phys_state_code: int | None = None
    phys_state: str | None = None
    rate_gbps: float | None = None
    rate: str | None = None                  # the file's text, e.g. "400 Gb/sec (4X NDR)"
    board_id: str | None = None              # the card's part (PSID), e.g. MT_0000000838
    counters: Mapping[str, int | None] = field(default_factory=dict)   # None: "N/A (no PMA)"
    errors: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"

    @property
    def active(self) -> bool:
        return self.state_code == ACTIVE


@dataclass(frozen=True)
class IbSnapshot:
    """Every port at one moment. `present` False: no <root>/class/infiniband at all (no RDMA device, or
    its driver not loaded). `taken_at`: monotonic seconds of the source's clock, for counter rates."""

    present: bool
    ports: list[IbPort]
    taken_at: float
    errors: tuple[str, ...] = ()             # devices that could not be listed


class IbReader(Protocol):
    def read(self) -> IbSnapshot: ...


def parse_state(text: str) -> tuple[int, str]:
    """`state` or `phys_state`: "4: ACTIVE" -> (4, "ACTIVE"); "8: <unknown>" -> (8, "<unknown>")."""
    m = _STATE.match(text)
    if not m:
        raise ValueError(f"expected 'N: NAME', got {text.strip()[:40]!r}")
    return int(m.group(1)), m.group(2)


def parse_rate(text: str) -> float:
    """`rate`: "400 Gb/sec (4X NDR)" -> 400.0, "2.5 Gb/sec (1X SDR)" -> 2.5."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"expected 'N Gb/sec (...)', got {text.strip()[:40]!r}")
    return float(m.group(1))


def parse_counter(text: str) -> int | None:
    """A PMA counter: a decimal number, or None for "N/A (no PMA)"."""
    value = text.strip()
    if value.startswith("N/A"):
        return None
    if not value.isdigit():
        raise ValueError(f"expected a number, got {value[:40]!r}")
    return int(value)


class SysfsInfiniband:
    """Ports under `<root>/class/infiniband`: one read of a few small files per port."""

    def __init__(self, sysfs_root: Path, clock: Callable[[], float] = time.monotonic):
        self.root = sysfs_root / "class" / "infiniband"
        self.clock = clock

    def read(self) -> IbSnapshot:
        now = self.clock()
        try:
            devices = sorted(os.listdir(self.root), key=natural_key)
        except FileNotFoundError:
            return IbSnapshot(False, [], now)
        except OSError as e:
            return IbSnapshot(True, [], now, (f"{self.root}: {_why(e)}",))
        ports: list[IbPort] = []
        errors: list[str] = []
        for device in devices:
            try:
                ports += self._device(device)
            except OSError as e:
                errors.append(f"{device}: {_why(e)}")
        return IbSnapshot(True, ports, now, tuple(errors))

    def _device(self, device: str) -> list[IbPort]:
        base = self.root / device
        numbers = sorted(int(n) for n in os.listdir(base / "ports") if n.isdigit())
        board_id, _ = _read(base / "board_id")
        board = board_id.strip() or None if board_id else None
        return [read_port(base / "ports" / str(n), device, n, board) for n in numbers]


def read_port(path: Path, device: str, number: int, board_id: str | None = None) -> IbPort:
    """One port directory; every unreadable or odd file is noted in `errors` and left None."""
    errors: list[str] = []

    def parsed(name: str, parse: Callable[[str], T]) -> tuple[T | None, str]:
        text, why = _read(path / name)
        if text is None:
            errors.append(f"{name}: {why}")
            return None, ""
        try:
            return parse(text), text.strip()
        except ValueError as e:
            errors.append(f"{name}: {e}")
            return None, text.strip()

    state, _ = parsed("state", parse_state)
    phys, _ = parsed("phys_state", parse_state)
    rate, rate_text = parsed("rate", parse_rate)
    layer, _ = parsed("link_layer", lambda t: t.strip() or "Unknown")
    counters: dict[str, int | None] = {}
    if (path / "counters").is_dir():
        for name in COUNTER_BITS:
            if (path / "counters" / name).exists():
                counters[name], _ = parsed(f"counters/{name}", parse_counter)
    return IbPort(
        device=device, port=number, link_layer=layer,
        state_code=state[0] if state else None, state=state[1] if state else None,
        phys_state_code=phys[0] if phys else None, phys_state=phys[1] if phys else None,
        rate_gbps=rate, rate=rate_text if rate is not None else None,
        board_id=board_id, counters=counters, errors=tuple(errors),
    )


def _read(path: Path) -> tuple[str | None, str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace"), ""
    except OSError as e:            # absent, or the kernel refused (rate_show's EINVAL on a bad width)
        return None, _why(e)


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


def sysfs_infiniband(sysfs_root: Path | None) -> SysfsInfiniband:
    """The ports reader for this machine (`sysfs_root` None: /sys)."""
    return SysfsInfiniband(sysfs_root or Path("/sys"))
