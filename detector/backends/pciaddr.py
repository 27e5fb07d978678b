"""PCI bus ids in one canonical form, whatever wrote them.

NVML says `00000000:3B:00.0`, kernel XID lines say `PCI:0000:3b:00`, sysfs says `0000:3b:00.0`.
Everything inside gpu-npd uses the sysfs form: 4-digit domain, lower case, with function.
"""

from __future__ import annotations

import re

_BUS_ID = re.compile(
    r"^(?:PCI:)?(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
    r"(?:\.(?P<fn>[0-7]))?$"
)


def normalize_bus_id(text: str) -> str:
    """Return `dddd:bb:dd.f` for any common spelling of a PCI address; ValueError if it is none."""
    m = _BUS_ID.match(text.strip())
    if not m:
        raise ValueError(f"not a PCI bus id: {text!r}")
    domain = int(m["domain"] or "0", 16)      # above 0xffff on Intel VMD: printed in full
    return f"{domain:04x}:{int(m['bus'], 16):02x}:{int(m['dev'], 16):02x}.{int(m['fn'] or '0')}"


def nvml_bus_id(bus_id: str) -> str:
    """The spelling NVML uses: 8-digit domain, upper case (`00000000:3B:00.0`)."""
    domain, bus, rest = normalize_bus_id(bus_id).split(":")
    return f"{int(domain, 16):08X}:{bus.upper()}:{rest.upper()}"
