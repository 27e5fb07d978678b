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

The lines are formatted by fake_nvml/nvlink5_lines.py, as every fake 144-150 line is.
"""

from __future__ import annotations

from dataclasses import replace

from fake_nvml.nvlink5_lines import LINK_DOWN_149, Nvlink5Xid, nvlink5_xid_line

DOMAIN_FAULT = "nvlink_domain_fault"
DOMAIN_FAULT_FIELDS = frozenset({"at", "kind", "node", "gpu", "link"})
DOWNSTREAM_DELAY_S = 1.0          # the downstream XIDs follow the origin's within a second or so
# NVSentinel's real RLW_REMAP line: error status 0x40, which the catalogue reads RESET_GPU (fatal), as the
# rack's other GPUs were reported failed.
DOWNSTREAM_REMAP_145 = Nvlink5Xid(145, "RLW_REMAP", True, 10, 0x00000082, 0x00000040, cross_contain=1)


def xid149_line(bus_id: str, link: int) -> str:
    return nvlink5_xid_line(bus_id, replace(LINK_DOWN_149, link=link))


def xid145_line(bus_id: str, link: int) -> str:
    return nvlink5_xid_line(bus_id, replace(DOWNSTREAM_REMAP_145, link=link))
