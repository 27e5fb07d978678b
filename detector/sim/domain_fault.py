"""The fleet file's `nvlink_domain_fault`: one link failing in a multi-node NVLink domain, as it showed on a
real GB200 NVL72 rack (marin-community/marin #9086, 2026-09-10): one GPU logged `Xid 149, NETIR_LINK_DOWN
Fatal XC0 i0 Link 14`, and the rack's other 63 GPUs only the downstream XID 145.

The lines are the driver's own form, as real ones read:
- 149: `NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 ...)`
  (leptonai/gpud pull request 1160), with NETIR_LINK_DOWN as marin #9086 and issue 32 quote it; interrupt
  info 0x025001c6 decodes to sub-code (0x025001c6 >> 20) & 0x3F = 37, "149.37".
- 145: `NVRM: Xid (PCI:0001:00:00): 145, RLW_REMAP Fatal XC1 i0 Link 10 (0x00000082 0x00000040 0x00000000
  0x00000000 0x00000000 0x00000000)` (NVIDIA/NVSentinel tests/syslog_health_monitor_test.go). Which link
  of each downstream GPU reported it is not in the public record: the simulator names the same link.

(A formatter for every XID 144-150 line may live in fake_nvml; this one plays only these two.)
"""

from __future__ import annotations

DOMAIN_FAULT = "nvlink_domain_fault"
DOMAIN_FAULT_FIELDS = frozenset({"at", "kind", "node", "gpu", "link"})
DOWNSTREAM_DELAY_S = 1.0          # the downstream XIDs follow the origin's within a second or so
XID149_INTRINFO = 0x025001C6
XID145_INFO = "0x00000082 0x00000040 0x00000000 0x00000000 0x00000000 0x00000000"


def _pci(bus_id: str) -> str:
    """`0008:01:00.0` -> `0008:01:00`, as the driver names a GPU in an XID line."""
    return bus_id.rsplit(".", 1)[0]


def xid149_line(bus_id: str, link: int) -> str:
    return (f"NVRM: Xid (PCI:{_pci(bus_id)}): 149, NETIR_LINK_DOWN Fatal XC0 i0 Link {link:02d} "
            f"(0x{XID149_INTRINFO:08x} 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)")


def xid145_line(bus_id: str, link: int) -> str:
    return f"NVRM: Xid (PCI:{_pci(bus_id)}): 145, RLW_REMAP Fatal XC1 i0 Link {link:02d} ({XID145_INFO})"
